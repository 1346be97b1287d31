"""What the per-step bookkeeping made cheaper must still do: the views of the reduced
gradient slice that the optimizer's pieces take as .grad (made once, again when the slice
moves), and the version bumps of one call per bucket."""
import torch
from torch import nn

from fgpsdp_runtime.ddp_options import SCHEDULES

from .dist_harness import run_distributed


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(8, 8), nn.LayerNorm(8))])


def _train(rank, world_size, schedule, steps=4, share_memory=False):
    import fgpsdp_runtime as fgp
    module = _model()
    model = fgp.DistributedDataParallel(module, schedule=schedule, bucket_cap_mb=0.0005)
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2, max_grad_norm=0.05)
    if share_memory:
        model.synchronize()
        module.share_memory()  # moves every bucket buffer: the cached addresses must follow
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        model(torch.randn(4, 8, generator=g)).square().mean().backward()
        # Slice gradients are what the reduced slice holds, view by view.
        opt.step()
        for b, storage in enumerate(model.buckets):
            for index, piece, start, end in opt._slice_pieces.by_bucket[b]:
                if piece.grad is not None:
                    lo = start - storage.shard_start
                    assert piece.grad.data_ptr() == storage.grad_shard[lo:].data_ptr()
                    assert piece.grad.numel() == end - start
        opt.zero_grad(set_to_none=True)
    model.synchronize()
    return [p.detach().clone() for p in module.parameters()]


def _all_schedules(rank, world_size):
    return {s: _train(rank, world_size, s)
            for s in SCHEDULES}


def test_schedules_bitwise_with_cached_views():
    results = run_distributed(2, _all_schedules)
    for per_rank in results:
        ref = per_rank["serial"]
        for schedule, params in per_rank.items():
            assert all(torch.equal(a, b) for a, b in zip(ref, params)), schedule


def _shared_memory_run(rank, world_size):
    return _train(rank, world_size, "next_forward", share_memory=True)


def test_share_memory_after_wrapping_still_trains():
    a, b = run_distributed(2, _shared_memory_run)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def _piece_new_storage(rank, world_size):
    import fgpsdp_runtime as fgp
    module = _model()
    model = fgp.DistributedDataParallel(module, schedule="serial", bucket_cap_mb=0.0005)
    opt = fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    piece = opt.param_groups[0]["params"][-1]
    piece.data = piece.data.clone()
    try:
        opt.step()
    except RuntimeError as error:
        return str(error)
    return None


def test_piece_given_new_storage_still_refused():
    for message in run_distributed(2, _piece_new_storage):
        assert message is not None and "given new storage" in message


def _versions(rank, world_size):
    import fgpsdp_runtime as fgp
    module = _model()
    model = fgp.DistributedDataParallel(module, schedule="serial", bucket_cap_mb=0.0005)
    opt = fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    before = [p._version for p in module.parameters()]
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return [p._version - v for p, v in zip(module.parameters(), before)]


def test_step_bumps_every_parameter_version():
    for bumps in run_distributed(2, _versions):
        assert all(b >= 1 for b in bumps)


def _step_before_any_backward(rank, world_size, schedule):
    """opt.step() before the first backward (to build the optimizer's state before a
    load_state_dict, or to quiet torch's lr_scheduler order warning), then a plain
    loop, beside torch DDP doing the same. Returns (largest parameter difference, our
    warnings, speculative steps kept in the first real step)."""
    import copy
    import warnings

    import fgpsdp_runtime as fgp
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(13, 37), nn.Tanh(), nn.Linear(37, 5))
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    model = fgp.DistributedDataParallel(base, schedule=schedule, bucket_cap_mb=0.0001,
                                        overlap_plan="layout")
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    ref_opt.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    first_real_step_commits = None
    g = torch.Generator().manual_seed(rank)
    for step in range(3):
        x, y = torch.randn(8, 13, generator=g), torch.randn(8, 5, generator=g)
        for m, o in ((ref, ref_opt), (model, opt)):
            with warnings.catch_warnings(record=True) as during:
                warnings.simplefilter("always")
                nn.functional.mse_loss(m(x), y).backward()
                o.step()
                o.zero_grad()
            if m is model:
                caught.extend(during)
        if step == 0 and model.scheduler is not None:
            first_real_step_commits = model.scheduler.commits
    model.synchronize()
    diff = max(float((a - b).abs().max()) for a, b in
               zip(model.module.parameters(), ref.module.parameters()))
    return diff, [str(w.message)[:80] for w in caught], first_real_step_commits


def test_a_step_before_any_backward_is_not_taken_for_stepped_gradients():
    """Before, its round of zeros counted as gradients stepped: the first real step
    warned of gradients added across steps, and two_stage kept no speculative step
    in it (the round was taken for a GAN's D in G's backward)."""
    for schedule in ("serial", "two_stage"):
        for rank, (diff, caught, commits) in enumerate(
                run_distributed(2, _step_before_any_backward, schedule)):
            assert diff == 0.0, (schedule, rank, diff)
            assert caught == [], (schedule, rank, caught)
            if schedule == "two_stage":
                assert commits, (rank, commits)
