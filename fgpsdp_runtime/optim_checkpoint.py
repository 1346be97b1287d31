"""Optimizer checkpoints in torch.optim's own format, at any world size.

[Note: full optimizer state dicts]
``ShardedOptimizer.state_dict()`` is this rank's shard: quick and local, but it
loads only on the same rank of a world of the same size with the same buckets.
``full_state_dict()`` instead gathers every rank's slices into the dict that a
``torch.optim`` optimizer over the whole (unwrapped) model would hold:

- parameters numbered as torch numbers them, in param-group order (the groups
  as the user listed them, frozen parameters included; by default
  ``module.parameters()``, as ``AdamW(model.parameters())`` would);
- each per-element state tensor (``exp_avg``, ``momentum_buffer``, ...) whole,
  in its parameter's shape; scalar entries (``step``) once per parameter;
  listed parameters no slice backs (frozen ones) hold what torch's optimizer
  would give them at construction (nothing, or Adagrad's initial ``sum``);
- the param groups' hyperparameters, and state entries not keyed by a
  parameter (an optimizer-wide step count) as they are.

So it loads into a ShardedOptimizer at another world size or bucket size, into
a torch optimizer on the unwrapped model (fine-tuning on one device), and the
``state_dict()`` of a torch DDP run's optimizer loads into a ShardedOptimizer
(moving a run from DDP). Loading slices the dict locally: no collective.

Gathering, a collective: one ``all_gather_object`` of per-parameter metadata
(which parameters have state, their scalar entries, the names and dtypes of the
per-element ones), then per bucket and per-element key one
all-gather of this rank's slice (every rank's slice of a bucket
has the same length by construction), cut into parameters by the bucket layout.
"""
from __future__ import annotations

import copy
import sys
import warnings
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from . import grad_reads
from .backends import objects_on
from .buckets import span_as_param, to_bucket_order
from .group_collectives import all_gather_single, hold_past_gloo_worker
from .object_collectives import all_gather_objects
from .step_wide_state import copy_value, optimizer_wide_entries
from .user_warnings import warn_at_user_code

if TYPE_CHECKING:  # imported for annotations only: optim imports this module
    from .optim import ShardedOptimizer

# Scalar state entries of torch's element-wise optimizers. Only needed to load
# the state of a 0-dim parameter (a learnable temperature), where a scalar
# entry and a per-element one have the same shape; everywhere else the shape
# tells them apart.
_SCALAR_STATE_KEYS = frozenset({"step", "mu_product", "eta", "mu"})


# Under master_weights, a 16-bit parameter's float32 master weights, saved as one more
# per-element state entry of the parameter (DeepSpeed's and Megatron's checkpoints
# keep theirs too): resumed without them, every master would restart from its
# rounded 16-bit value. Never in the inner optimizer's state, where a step would
# copy it into every undo record: the pieces themselves are the masters.
MASTER_KEY = "master_param"


def saved_state(opt: ShardedOptimizer, tensor: torch.Tensor, bucket: int) -> dict[str, Any]:
    """What a checkpoint holds of a piece: its optimizer state, and, once it has
    some, the piece itself where it is a master (see MASTER_KEY); {} before."""
    state = opt.optim.state.get(tensor)
    if not state:
        return {}
    if bucket in opt._slice_pieces.masters:
        return {**state, MASTER_KEY: tensor}
    return state


def _is_per_element(value: Any, piece: torch.Tensor) -> bool:
    """In the inner optimizer's state: a tensor with one entry per element of the piece."""
    return torch.is_tensor(value) and value.dim() == 1 and value.shape == piece.shape


def _local_metadata(opt: ShardedOptimizer) -> dict[int, dict[str, Any]]:
    """Per parameter (wrapper's index) this rank holds a piece of, with state:
    the order of its state keys, its scalar entries and its per-element keys' dtypes."""
    meta = {}
    for index, pieces in opt._slice_pieces.by_param.items():
        found = _piece_metadata(opt, pieces[0][0], pieces[0][1])
        if found is not None:
            meta[index] = found
    return meta


def _piece_metadata(opt: ShardedOptimizer, tensor: torch.Tensor,
                    bucket: int) -> Optional[dict[str, Any]]:
    """_local_metadata's entry for the parameter whose piece on this rank is ``tensor``,
    in ``bucket`` (one piece per parameter per rank: a span meets a slice once); None
    without state."""
    state = saved_state(opt, tensor, bucket)
    if not state:
        return None
    scalars, per_element = {}, {}
    for key, value in state.items():
        if _is_per_element(value, tensor):
            per_element[key] = str(value.dtype).replace("torch.", "")
        else:
            scalars[key] = value.detach().cpu().clone() if torch.is_tensor(value) else value
    return {"order": list(state), "scalars": scalars, "per_element": per_element}


def _merge_metadata(gathered: Sequence[dict]) -> dict[int, dict[str, Any]]:
    """One entry per parameter; the ranks sharing a parameter must agree on its scalars."""
    merged: dict[int, dict[str, Any]] = {}
    for rank_meta in gathered:
        for index, meta in rank_meta["params"].items():
            seen = merged.setdefault(index, meta)
            if seen is meta:
                continue
            same = seen["per_element"] == meta["per_element"] and \
                seen["scalars"].keys() == meta["scalars"].keys() and \
                all(_same_scalar(seen["scalars"][k], meta["scalars"][k]) for k in meta["scalars"])
            if not same:  # every rank sees the same gathered figures, so all raise
                raise RuntimeError(f"fgpsdp: the ranks holding parameter {index} disagree on its "
                                   f"optimizer state: {seen} vs {meta}")
    return merged


def _same_scalar(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    return type(a) is type(b) and a == b


def full_state_dict(opt: ShardedOptimizer, keep_on: Optional[int]) -> dict[str, Any]:
    """torch.optim's state dict for the whole model, on every rank (``keep_on`` None) or
    on group rank ``keep_on`` only (the others return {})."""
    model = opt.model
    group = model.process_group
    world = model.world_size
    local = {"slice_index": model.slice_index, "params": _local_metadata(opt)}
    with objects_on(model.device):  # (a checkpoint thread's current GPU is cuda:0)
        gathered = all_gather_objects(local, group, "optimizer state metadata")
    merged = _merge_metadata(gathered)
    keep = keep_on is None or model.rank == keep_on
    params = [p for _, p in model.named_trainable_parameters()]

    per_element: dict[int, dict[str, torch.Tensor]] = {}
    # Group rank r holds slice gathered[r]["slice_index"]: reorder the gathered slices.
    slice_of_rank = torch.tensor([g["slice_index"] for g in gathered])
    rank_of_slice = torch.argsort(slice_of_rank)
    for b, storage in enumerate(model.buckets):
        layout = storage.layout
        keys = sorted({(key, dtype) for span in layout.spans
                       for key, dtype in merged.get(span.param_index, {})
                       .get("per_element", {}).items()})
        # This rank's pieces of the bucket with what a checkpoint holds of each.
        held = [(start, end, saved_state(opt, tensor, b))
                for _, tensor, start, end in opt._slice_pieces.by_bucket[b]]
        for key, dtype_name in keys:
            dtype = getattr(torch, dtype_name)
            mine = torch.zeros(layout.shard_numel, dtype=dtype, device=storage.device)
            for start, end, state in held:
                if key in state:
                    lo = start - storage.shard_start
                    mine[lo:lo + (end - start)].copy_(state[key])
            if world > 1:
                out = torch.empty(world * layout.shard_numel, dtype=dtype, device=storage.device)
                all_gather_single(out, mine, group=group)
                # Kept past gloo's thread (a save, then destroy_process_group()): one
                # bucket's state entry, until the next save. See group_collectives.py.
                hold_past_gloo_worker("optimizer state gather", mine, out)
                whole = out.view(world, layout.shard_numel)[rank_of_slice.to(out.device)].reshape(-1)
            else:
                whole = mine
            if not keep:
                continue
            for span in layout.spans:
                if key in merged.get(span.param_index, {}).get("per_element", {}):
                    value = span_as_param(whole[span.bucket_offset:span.bucket_end],
                                          params[span.param_index].shape, span.strides)
                    # Laid out as the parameter, as torch's optimizers lay out their state.
                    per_element.setdefault(span.param_index, {})[key] = \
                        value.to("cpu", copy=True)
    if not keep:
        return {}

    untrained = state_of_untrained_params(opt)
    state, groups, number = {}, [], 0
    for inner_group, numbered, names in zip(opt.optim.param_groups, opt._numbered_params,
                                            opt._numbered_names):
        indices = []
        for param in numbered:
            index = model.param_index(param)
            if index is not None and index in merged:
                meta = merged[index]
                entry = {**meta["scalars"], **per_element.get(index, {})}
                state[number] = {key: entry[key] for key in meta["order"]}
            elif id(param) in untrained:
                state[number] = untrained[id(param)]
            indices.append(number)
            number += 1
        groups.append({**{k: v for k, v in inner_group.items() if k != "params"},
                       "params": indices, **({"param_names": names} if names else {})})
    # Entries not keyed by a parameter (MADGRAD's step count "k"), as torch keeps
    # them; every rank's inner optimizer steps alike, so this rank's are everyone's.
    for key, value in optimizer_wide_entries(opt.optim).items():
        state[key] = value.detach().to("cpu", copy=True) if torch.is_tensor(value) \
            else copy.deepcopy(value)
    return {"state": state, "param_groups": groups}


def param_state(opt: ShardedOptimizer, index: int) -> dict[str, Any]:
    """Trainable parameter ``index``'s optimizer state as a torch optimizer over the
    whole model holds it in ``opt.state[p]``: each per-element entry whole, shaped
    and laid out as the parameter (on its device), scalar entries (``step``) as
    they are; {} before its first step. A collective (the ranks must agree on which
    parameter, checked by the caller): one ``all_gather_objects`` of this rank's
    entries' names, dtypes and scalar values (a rank may hold no piece of the
    parameter), then per per-element entry one all-reduce of its bytes, each non-zero
    on its owner alone (grad_reads.whole_from_pieces: every value arrives bit for
    bit)."""
    model = opt.model
    pieces = opt._slice_pieces.by_param.get(index, ())
    mine = _piece_metadata(opt, *pieces[0][:2]) if pieces else None  # (this one alone)
    with objects_on(model.device):
        gathered = all_gather_objects({"params": {index: mine} if mine else {}},
                                      model.process_group, "a parameter's optimizer state")
    meta = _merge_metadata(gathered).get(index)
    if meta is None or index not in model.reducer.slot:  # (an empty parameter: no piece)
        return {}
    held = [(start, saved_state(opt, tensor, b)) for tensor, b, start, _ in pieces]
    state = {}
    for key in meta["order"]:
        if key not in meta["per_element"]:
            value = meta["scalars"][key]
            state[key] = value.clone() if torch.is_tensor(value) else copy.deepcopy(value)
            continue
        mine = [(start, entries[key]) for start, entries in held if key in entries]
        state[key] = grad_reads.whole_from_pieces(
            model, index, getattr(torch, meta["per_element"][key]), mine,
            "a parameter's optimizer state")
    return state


def state_of_untrained_param(opt: ShardedOptimizer, param: Optional[torch.Tensor]
                             ) -> dict[str, Any]:
    """What torch's optimizer holds for ``param``, listed and frozen (see
    state_of_untrained_params), its per-element entries on the parameter's device as
    torch's are (full_state_dict() gives them on the CPU). {} for None (a joined rank
    taking its part in the read)."""
    if param is None:
        return {}
    return {key: value.to(param.device) if torch.is_tensor(value)
            and key not in _SCALAR_STATE_KEYS and value.shape == param.shape else value
            for key, value in state_of_untrained_params(opt).get(id(param), {}).items()}


def state_of_untrained_params(opt: ShardedOptimizer) -> dict[int, dict[str, Any]]:
    """What torch's optimizer holds for listed parameters no slice backs (frozen ones).

    Most optimizers create state at a parameter's first step, so none; some
    (Adagrad) at construction, for every listed parameter. A throwaway
    optimizer of the same class, arguments and groups over those parameters
    shows which: never stepped, that state is what torch's would still hold
    (the arguments too: Adagrad's initial sum is one, which no group passes on).
    """
    groups = []
    for inner_group, numbered in zip(opt.optim.param_groups, opt._numbered_params):
        untrained = [p for p in numbered if opt.model.param_index(p) is None]
        if untrained:
            groups.append({**{k: v for k, v in inner_group.items() if k != "params"},
                           "params": untrained})
    if not groups:
        return {}
    throwaway = type(opt.optim)(groups, **opt._inner_arguments)
    return {id(p): {key: value.detach().to("cpu", copy=True) if torch.is_tensor(value) else value
                    for key, value in entry.items()}
            for p, entry in throwaway.state.items() if entry}


def load_full_state_dict(opt: ShardedOptimizer, state_dict: dict[str, Any]) -> None:
    """Load torch.optim's whole-model format into this rank's slices (local, no collective)."""
    model = opt.model
    saved_groups = state_dict["param_groups"]
    saved_state = state_dict["state"]
    if len(saved_groups) != len(opt._numbered_params):
        raise ValueError(f"fgpsdp: the optimizer state dict has {len(saved_groups)} param "
                         f"groups; this optimizer has {len(opt._numbered_params)}")
    spans = {span.param_index: span for layout in model.bucket_layouts for span in layout.spans}
    inner_number = {id(piece): i for i, piece in
                    enumerate(p for g in opt.optim.param_groups for p in g["params"])}
    # Every saved parameter is checked first, on every rank alike, whether or
    # not this rank holds a piece of it: a rank raising alone would leave the
    # others to hang in the next collective.
    to_load = []  # (parameter index, saved entry, {key: per-element?})
    ignored = {id(p): name for name, p in model.named_ignored_parameters()}
    left_to_the_user = []
    for g, saved in enumerate(saved_groups):
        numbered = _numbering_for(opt, g, len(saved["params"]))
        stepped = []  # (saved index, its state's keys, its parameter)
        for saved_index, param in zip(saved["params"], numbered):
            index = model.param_index(param)
            entry = saved_state.get(saved_index)
            if index is None and entry and id(param) in ignored:
                left_to_the_user.append(ignored[id(param)])
            if index is None or not entry:
                continue  # frozen, or never stepped (torch creates state at the first step)
            kinds = {key: _is_saved_per_element(key, value, param, saved_index)
                     for key, value in entry.items()}
            stepped.append((saved_index, set(entry), param))
            to_load.append((index, entry, kinds))
        _check_no_entry_is_missing(opt, g, saved, stepped)
    if left_to_the_user:
        # A torch DDP checkpoint of one AdamW(model.parameters()): their moments would
        # be dropped without a word.
        warn_at_user_code(
            f"fgpsdp: this state dict holds the state of {len(left_to_the_user)} "
            "parameter(s) named in _ddp_params_and_buffers_to_ignore ("
            + ", ".join(repr(n) for n in left_to_the_user[:3])
            + (", ..." if len(left_to_the_user) > 3 else "") + "), which this "
            "ShardedOptimizer does not step: not loaded. Load it into their own optimizer")
    inner_state: dict[int, dict[str, Any]] = {}
    masters = {}  # bucket -> [(offset in this rank's slice, saved values)]
    for index, entry, kinds in to_load:
        for tensor, b, start, end in opt._slice_pieces.by_param.get(index, ()):
            offset = start - spans[index].bucket_offset
            inner_state[inner_number[id(tensor)]] = {
                key: _piece_of(value, kinds[key], offset, end - start, spans[index].strides)
                for key, value in entry.items() if key != MASTER_KEY}
            # Saved without master weights (or by a torch optimizer), the masters
            # restart from the parameters (SlicePieces.load_masters).
            if b in opt._slice_pieces.masters and kinds.get(MASTER_KEY):
                masters.setdefault(b, []).append((
                    start - model.buckets[b].shard_start,
                    _piece_of(entry[MASTER_KEY], True, offset, end - start,
                              spans[index].strides)))
    for key, value in saved_state.items():
        if not isinstance(key, int):  # optimizer-wide: as torch loads it, but a copy
            inner_state[key] = value.clone() if torch.is_tensor(value) else copy.deepcopy(value)
    inner_groups = []
    for saved, inner_group in zip(saved_groups, opt.optim.param_groups):
        inner_groups.append({**{k: v for k, v in saved.items()
                                if k not in ("params", "param_names")},
                             "params": [inner_number[id(p)] for p in inner_group["params"]]})
    # torch's loader casts each value to its piece's device and dtype ("step" kept).
    opt.optim.load_state_dict({"state": inner_state, "param_groups": inner_groups})
    opt._slice_pieces.load_masters(masters)


def _check_no_entry_is_missing(opt: ShardedOptimizer, g: int, saved_group: dict[str, Any],
                               stepped: list[tuple[int, set, torch.Tensor]]) -> None:
    """Raise, on every rank alike, if a stepped parameter's saved state lacks an entry
    that a first step creates under the group's saved hyperparameters.

    Such a dict (edited by hand, merged from two runs) would load, and only the
    rank holding that parameter's elements would raise at its step, leaving the
    others to see their exchange fail instead of the cause. Parameters of a group
    may hold different entries legitimately: a setting that decides which entries a
    first step creates (Adam's ``amsgrad``, RMSprop's ``momentum``) changed during
    the run, before another parameter's first step. So only where the entries
    differ is a throwaway optimizer stepped to learn which ones are needed.
    """
    if len({frozenset(keys) for _, keys, _ in stepped}) < 2:
        return  # all alike: torch's own loader and step treat every rank the same
    needed = _entries_a_first_step_creates(type(opt.optim), opt._inner_arguments,
                                           saved_group, stepped[0][2])
    if needed is None:
        return
    for saved_index, keys, _ in stepped:
        if needed - keys:
            raise ValueError(
                f"fgpsdp: in param group {g} of the optimizer state dict, saved parameter "
                f"{saved_index} has no state {sorted(needed - keys)}, which a step of "
                f"{type(opt.optim).__name__} creates under the group's settings and other "
                "parameters of the group hold (a state dict edited or merged by hand?)")


def _entries_a_first_step_creates(optimizer_class: type, arguments: dict[str, Any],
                                  saved_group: dict[str, Any],
                                  like: torch.Tensor) -> Optional[set]:
    """The state entries ``optimizer_class`` (built with ``arguments``) gives a
    parameter like ``like`` at its first step under ``saved_group``'s hyperparameters:
    a throwaway optimizer steps a zero gradient at learning rate 0. None if it cannot
    (nothing is then refused)."""
    hyper = {k: v for k, v in saved_group.items() if k not in ("params", "param_names")}
    if "lr" in hyper:
        hyper["lr"] = torch.zeros_like(hyper["lr"]) if torch.is_tensor(hyper["lr"]) else 0.0
    probe = torch.zeros(2, dtype=like.dtype, device=like.device, requires_grad=True)
    probe.grad = torch.zeros_like(probe)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            throwaway = optimizer_class([{**hyper, "params": [probe]}], **arguments)
            throwaway.step()
    except Exception:  # noqa: BLE001 - a class we cannot build alone: leave it to its step
        return None
    return set(throwaway.state.get(probe, {}))


def _numbering_for(opt: ShardedOptimizer, g: int, saved_count: int) -> list[torch.Tensor]:
    numbered = opt._numbered_params[g]
    if saved_count == len(numbered):
        return numbered
    if opt._default_groups:
        # Default groups number module.parameters(); a torch optimizer built over
        # the trainable ones only (filter(lambda p: p.requires_grad, ...)) loads too.
        trainable = [p for p in numbered if opt.model.param_index(p) is not None]
        if saved_count == len(trainable):
            return trainable
    raise ValueError(f"fgpsdp: param group {g} of the optimizer state dict holds {saved_count} "
                     f"parameters; this optimizer's holds {len(numbered)} (a state dict of "
                     "another model, or of other param groups)")


def _is_saved_per_element(key: str, value: Any, param: torch.Tensor, saved_index: int) -> bool:
    """Whether a saved entry has one value per element of its parameter (raises if
    a tensor entry fits neither that nor a scalar)."""
    if not torch.is_tensor(value):
        return False
    if value.shape == param.shape and (param.dim() > 0 or key not in _SCALAR_STATE_KEYS):
        return True
    if value.numel() > 1:
        raise ValueError(f"fgpsdp: state '{key}' of saved parameter {saved_index} has shape "
                         f"{tuple(value.shape)}; the parameter has {tuple(param.shape)}")
    return False


def _piece_of(value: Any, per_element: bool, offset: int, numel: int,
              strides: Optional[tuple[int, ...]]) -> Any:
    """This rank's piece of one saved entry: per-element tensors are cut, scalars copied.

    Copies: the optimizer updates them in place, and must neither write into
    the caller's checkpoint nor keep its whole tensors alive.
    """
    if not torch.is_tensor(value):
        return value
    if per_element:
        return to_bucket_order(value, strides)[offset:offset + numel].clone()
    return value.clone()


def shard_params(opt: ShardedOptimizer) -> list[list[tuple]]:
    """What a ``state_dict()`` shard records of its buckets besides their sizes: per
    bucket, which parameter each span holds (name, shape, offset). The sizes alone
    match after the set of trainable parameters or their order changed (another
    layer of the same size frozen). Names as torch.compile would not change them (a
    module compiled before wrapping adds ``_orig_mod.``)."""
    named = opt.model.named_trainable_parameters()
    return [[(named[s.param_index][0].replace("_orig_mod.", ""),
              tuple(named[s.param_index][1].shape), s.bucket_offset)
             for s in layout.spans] for layout in opt.model.bucket_layouts]


def shard_layout(opt: ShardedOptimizer) -> list[tuple]:
    """The sizes a ``state_dict()`` shard records of its buckets: (dtype, padded
    length, number of spans) each."""
    return [(l.dtype_name, l.padded_numel, len(l.spans)) for l in opt.model.bucket_layouts]


def shard_problem(opt: ShardedOptimizer, state_dict: dict[str, Any]) -> Optional[str]:
    """Why a ``state_dict()`` shard cannot load on this rank, or None."""
    if not {"shard", "rank", "world_size", "layout"} <= set(state_dict):
        return ("fgpsdp: not an optimizer checkpoint (it holds "
                f"{sorted(state_dict)}); load what state_dict() or full_state_dict() saved")
    expected = (opt.model.rank, opt.model.world_size)
    got = (state_dict.get("rank"), state_dict.get("world_size"))
    if got != expected:
        return (f"fgpsdp: optimizer shard saved by rank/world {got}, loading on "
                f"{expected}: opt.state_dict() is one rank's shard (every rank saves and "
                "loads its own); opt.full_state_dict(), called on every rank "
                "(rank0_only=True keeps it on rank 0 alone), is the whole state and loads "
                "at any world size. A loop or trainer that saves rank 0's state_dict() "
                "alone: call opt.consolidate_state_dict() on every rank first, as for "
                "torch's ZeroRedundancyOptimizer, and rank 0's is the whole state")
    # The slice a rank owns follows the topology (topology.py): the same rank of
    # 2 nodes x 2 and of one node of 4 own other slices. (Shards saved before
    # the slice was recorded do not say.)
    saved_slice = state_dict.get("slice_index", opt.model.slice_index)
    if saved_slice != opt.model.slice_index:
        return (f"fgpsdp: optimizer shard of slice {saved_slice} loading on rank "
                f"{opt.model.rank}, which owns slice {opt.model.slice_index} under this "
                "topology (nodes x local ranks changed); full_state_dict() loads under "
                "any topology")
    if [tuple(x) for x in state_dict["layout"]] != shard_layout(opt):
        return ("fgpsdp: optimizer shard was saved with another bucket layout (bucket_cap_mb or "
                "model changed, or an fgpsdp before parameters started aligned "
                "sized the buckets); full_state_dict() loads with any buckets")
    masters = opt._slice_pieces.masters
    for b, saved in (state_dict.get("master_weights") or {}).items():
        if b in masters and (not torch.is_tensor(saved) or saved.shape != masters[b].shape):
            return (f"fgpsdp: the optimizer shard's master weights of bucket {b} do not fit "
                    f"this rank's slice of {masters[b].numel()} elements")
    saved_params = state_dict.get("params")  # (shards saved before it was recorded: None)
    if saved_params is not None and \
            [[(n, tuple(shape), o) for n, shape, o in b] for b in saved_params] \
            != shard_params(opt):
        return ("fgpsdp: optimizer shard was saved with other parameters in the buckets (the set "
                "of trainable parameters or their order changed, or an fgpsdp before "
                "parameters started aligned placed them otherwise); "
                "full_state_dict() loads by parameter")
    return None


_TORCH_DCP_HELPERS = "torch.distributed.checkpoint.state_dict"
_PACKAGE = __name__.rsplit(".", 1)[0] + "."


def refuse_torchs_checkpoint_helpers() -> None:
    """Called by ``ShardedOptimizer.state_dict()`` and ``load_state_dict()``: refuse torch's
    ``get_state_dict`` / ``get_optimizer_state_dict`` / ``set_optimizer_state_dict``
    with what works instead. They map ``opt.param_groups``' tensors to the model's
    parameter names, and ours are this rank's slices: they failed with a bare
    ``KeyError: 'state'``. Every rank calls them, so every rank raises here."""
    # The first frame outside this package: the caller of state_dict() /
    # load_state_dict(), whatever runs between (optimizer_itself.py's call).
    caller = sys._getframe(1)
    while caller is not None and caller.f_globals.get("__name__", "").startswith(_PACKAGE):
        caller = caller.f_back
    if caller is not None and caller.f_globals.get("__name__") == _TORCH_DCP_HELPERS:
        raise TypeError(
            "fgpsdp: torch.distributed.checkpoint.state_dict's helpers (get_state_dict, "
            "get_optimizer_state_dict, set_optimizer_state_dict, set_state_dict) do not know "
            "ShardedOptimizer: its param_groups hold this rank's slices, not the model's "
            "parameters. Save opt.full_state_dict() (torch.optim's format, every rank "
            "calls it) with dcp.save; to resume, dcp.load into "
            "opt.full_state_dict(init_state=True) and pass that to opt.load_state_dict(). "
            "For the model, give get_model_state_dict / set_model_state_dict model.module")


def create_missing_state(opt: ShardedOptimizer) -> list[Any]:
    """For ``full_state_dict(init_state=True)``: give every piece without state the
    state a step would create (a step on zero gradients at learning rate 0, as
    torch's ``_init_optim_state`` does for ``get_optimizer_state_dict``), and likewise
    optimizer-wide entries (MADGRAD's step count); return the keys created, which
    the caller removes once the dict is copied out. The pieces' values are put back
    as they were, and so is what the run wrote to entries that were there (a step
    count in a group or in the state)."""
    optim = opt.optim
    state = optim.state
    pieces = [p for g in optim.param_groups for p in g["params"]
              if p.numel() > 0 and not state.get(p)]
    if not pieces:
        return []
    before = [p.detach().clone() for p in pieces]
    # The pieces that have state keep it: without a gradient they are not stepped
    # (after a step, before zero_grad(), they still hold their slice gradients).
    without = {id(p) for p in pieces}
    held = [(p, p.grad) for g in optim.param_groups for p in g["params"]
            if id(p) not in without and p.grad is not None]
    try:
        for p, _ in held:
            p.grad = None
        with opt._step_wide_state.run_and_forget():
            for g in optim.param_groups:  # the run's copies of the groups
                if "lr" in g:
                    g["lr"] = torch.zeros_like(g["lr"]) if torch.is_tensor(g["lr"]) else 0.0
            for p in pieces:
                p.grad = torch.zeros_like(p)
            # (MuonWithAdamW's step puts matrices together inside opt.step()'s run
            # over the buckets alone; on zero gradients it needs none.)
            zero_gradient_step = getattr(optim, "zero_gradient_step", None)
            (zero_gradient_step or opt._inner_step_unhooked)()
            new_wide = {k: copy_value(v) for k, v in optimizer_wide_entries(optim).items()}
    finally:
        with torch.no_grad():
            for p, old in zip(pieces, before):
                p.grad = None
                p.copy_(old)
        for p, grad in held:
            p.grad = grad
    new_wide = {k: v for k, v in new_wide.items() if k not in state}
    state.update(new_wide)
    return pieces + list(new_wide)
