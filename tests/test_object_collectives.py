"""The runtime's object collectives (object_collectives.py): what torch's give, with
their tensors kept past gloo's thread (see [Note: tensors a finished gloo collective
still holds] in group_collectives.py)."""
import torch

from .dist_harness import run_distributed


def _gather_and_broadcast(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from fgpsdp_runtime import group_collectives
    from fgpsdp_runtime.object_collectives import all_gather_objects, broadcast_object

    # Pickles of different lengths on each rank (padded to the longest in flight),
    # a tensor among them.
    mine = {"rank": rank, "text": "x" * (100 * rank), "tensor": torch.arange(rank + 1.0)}
    ours = all_gather_objects(mine, None, "test gather")
    theirs = [None] * world_size
    dist.all_gather_object(theirs, mine, group=None)
    # On the group of ranks 1 and 2, from its rank 1 (global rank 2): a group rank.
    pair = dist.new_group([1, 2])
    sent = broadcast_object(("from", rank), 1, pair, "test broadcast") if rank > 0 else None
    whole = broadcast_object({"plan": rank}, 0, None, "test broadcast, whole group")
    # Under a loop's default device (torch.set_default_device): still CPU tensors.
    with torch.device("meta"):
        under_meta = all_gather_objects(rank, None, "test gather, default device")
    held = group_collectives._held_past_gloo_worker
    return {"under_meta": under_meta,
            "same_as_torch": [o["rank"] == t["rank"] and o["text"] == t["text"]
                              and torch.equal(o["tensor"], t["tensor"])
                              for o, t in zip(ours, theirs)],
            "ranks": [o["rank"] for o in ours], "sent": sent, "whole": whole,
            "held": {site: len(tensors) for site, tensors in held.items()}}


def test_objects_are_gathered_and_broadcast_as_torchs_and_their_tensors_are_kept():
    results = run_distributed(3, _gather_and_broadcast)
    for rank, result in enumerate(results):
        assert result["ranks"] == [0, 1, 2] and all(result["same_as_torch"])
        assert result["sent"] == (None if rank == 0 else ("from", 2))
        assert result["whole"] == {"plan": 0}
        assert result["under_meta"] == [0, 1, 2]
        # The size, 3 gathered sizes, the padded pickle, 3 received ones.
        assert result["held"]["test gather"] == 8
        assert result["held"]["test broadcast, whole group"] == 2
        assert ("test broadcast" in result["held"]) == (rank > 0)


def _wrapping_refused(rank: int, world_size: int) -> dict:
    import torch.nn as nn

    import fgpsdp_runtime as fgp
    from fgpsdp_runtime import group_collectives

    module = nn.Linear(4, 4 if rank == 0 else 5)  # the ranks' models differ
    try:
        fgp.DistributedDataParallel(module)
        error = None
    except ValueError as refused:
        error = str(refused)
    held = group_collectives._held_past_gloo_worker
    return {"error": error, "held": {site: len(tensors) for site, tensors in held.items()}}


def test_a_refused_wrapping_keeps_its_set_up_checks_tensors():
    # No wrapper is left to put the runtime's own steps before a destroy of the
    # group: on torch 2.4.1 a destroy_process_group() right after the refusal could
    # hang, gloo's thread freeing the check's last tensor (bench/gloo_teardown_check.py).
    for result in run_distributed(2, _wrapping_refused):
        assert "model differs from rank 0" in result["error"]
        assert result["held"]["set-up checks"] == 6
