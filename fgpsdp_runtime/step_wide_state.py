"""What an inner optimizer step writes besides its pieces' state.

``opt.step()`` runs the inner optimizer's step several times: once per chunk of
buckets under the forward-overlapped schedules, once per speculative bucket under
``two_stage``, again for a bucket rolled back. torch's optimizers keep all their
state per parameter, so those runs add up to one step. Others also count steps in
their param groups (schedule-free's ``group["k"]``), in the optimizer's state under
a key that is not a parameter (MADGRAD's ``state["k"]``), or in a plain number on
the optimizer object itself (a subclass's ``self.n_steps += 1`` driving a warm-up):
each run would count once more, and later steps would use the wrong count.

So every run starts from the values the step started from and leaves them as they
were; what a run wrote is kept aside and written when the step ends, if it stepped.
A run reads copies of the param group dicts, not the dicts themselves: a speculative
run is on the scheduler thread while the training loop may set a learning rate in
them, and putting back what the run wrote must not undo that. The numbers on the
optimizer object get no copy (the run steps that object): one the loop sets there
while a speculative run is on the scheduler thread counts as that run's write
(docs/semantics.md says so; the loop reaches that object only through ``opt.optim``).
"""
from __future__ import annotations

import copy
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch

_MISSING = object()


def same_value(u: Any, v: Any) -> bool:
    """Equal as a hyperparameter: tensors by device and value, lists, tuples and dicts
    entry by entry (Adam's ``betas`` may hold tensors), anything else by ==."""
    if isinstance(u, torch.Tensor) or isinstance(v, torch.Tensor):
        return (isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor)
                and u.device == v.device and u.shape == v.shape and torch.equal(u, v))
    if isinstance(u, (list, tuple)) and isinstance(v, (list, tuple)):
        return type(u) is type(v) and len(u) == len(v) and all(map(same_value, u, v))
    if isinstance(u, dict) and isinstance(v, dict):
        return (type(u) is type(v) and u.keys() == v.keys()
                and all(same_value(x, v[k]) for k, x in u.items()))
    try:
        return u is v or bool(u == v)
    except Exception:  # noqa: BLE001 - an object without a usable ==: take it as changed
        return False


# Values a copy may share with the original: nothing changes them in place.
IMMUTABLE = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device)


def tensor_versions(value: Any) -> Optional[tuple[int, ...]]:
    """The version counters of a tensor, or of the tensors in a tuple of tensors and
    plain values (Adam's ``betas``); None for any other value. With them, a
    hyperparameter that is still the same object, its counters unmoved, is unchanged
    without reading its values: torch.equal on a GPU tensor (``lr=torch.tensor(...,
    device="cuda")``, capturable and fused optimizers) waits for the device, once per
    inner step and per speculative bucket. Every in-place write through the tensor
    moves its counter; one through its ``.data`` does not (``.data`` has a counter of
    its own), so such a write is not seen."""
    try:
        if isinstance(value, torch.Tensor):
            return (value._version,)
        if type(value) is tuple and all(isinstance(v, (torch.Tensor,) + IMMUTABLE)
                                        for v in value):
            return tuple(v._version for v in value if isinstance(v, torch.Tensor))
    except RuntimeError:  # an inference-mode tensor keeps no version counter
        pass
    return None


def untouched(source: Any, versions: Optional[tuple[int, ...]], value: Any) -> bool:
    """``value`` is ``source`` itself, no tensor in it written since ``versions``
    (tensor_versions(source)) were read."""
    return versions is not None and value is source and tensor_versions(value) == versions


def copy_value(value: Any, other: Callable[[Any], Any] = lambda value: value) -> Any:
    """A copy a run cannot change: tensors cloned, lists, tuples and dicts copied entry
    by entry (a count kept in a dict and increased in place, ``state["meta"]["n"] +=
    1``; a tensor in Adam's ``betas`` filled in place by a momentum schedule). Any
    other object (a module, a config object in a param group) is ``other(value)``: by
    default the same object, as in torch's param groups: copying it would hand the
    loop back a copy, and a run's changes inside it are the optimizer's own business."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, IMMUTABLE) or (
            type(value) is tuple and all(isinstance(v, IMMUTABLE) for v in value)):
        return value
    if type(value) is tuple:
        return tuple(copy_value(v, other) for v in value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(copy_value(v, other) for v in value))
    if isinstance(value, (list, dict)):  # subclasses too: OrderedDict, defaultdict
        new = copy.copy(value)
        for k in (range(len(value)) if isinstance(value, list) else value):
            new[k] = copy_value(value[k], other)
        return new
    return other(value)


# The attribute types kept step-wide: plain numbers (a count, a running scale). Not
# bool: a flag is set once and read by later runs (``self.initialized = True`` after
# filling every piece's state in the first run: put back, the next run of the same
# step would fill them again, over what the first run stepped).
SCALAR_ATTRIBUTE_TYPES = (int, float)


def scalar_attributes(optim: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer object's own attributes that hold plain numbers
    (``self.n_steps``), bool excluded. Others (a module, a list) are the optimizer's
    business, as in param groups."""
    return {k: v for k, v in getattr(optim, "__dict__", {}).items()
            if type(v) in SCALAR_ATTRIBUTE_TYPES}


def set_or_delete_attribute(obj: Any, name: str, value: Any) -> None:
    """``setattr``, or, for _MISSING, remove the attribute (a run created it)."""
    if value is _MISSING:
        obj.__dict__.pop(name, None)
    else:
        setattr(obj, name, value)


def optimizer_wide_entries(optim: torch.optim.Optimizer) -> dict[Any, Any]:
    """``optim.state`` entries not keyed by a parameter tensor (MADGRAD's "k")."""
    state = optim.state
    keys = getattr(state, "wide_keys", None)  # SliceState tracks them: no scan per run
    if keys is not None:
        return {k: state[k] for k in list(keys) if k in state}
    return {k: v for k, v in list(state.items()) if not isinstance(k, torch.Tensor)}


class StepWideState:
    def __init__(self, optim: torch.optim.Optimizer):
        self._optim = optim
        # The loop's group list (opt.param_groups): the inner optimizer's outside a
        # run. The loop may give a new one (set_loop_groups) while a run, on the
        # scheduler thread, holds copies there: the lock orders the two.
        self.loop_groups: list[dict] = optim.param_groups
        self._swap_lock = threading.Lock()
        self._runs = 0
        # What this step's runs wrote (every run starts from the same values, so
        # what any run wrote counts, a later run's winning): per group
        # {key: value}, and optimizer-wide state {key: value or _MISSING (removed)}.
        self._group_writes: list[dict[str, Any]] = []
        self._state_writes: dict[Any, Any] = {}
        self._attribute_writes: dict[str, Any] = {}  # the optimizer object's numbers
        # Group entries a run has ever written: the optimizer's own state, not
        # hyperparameters of the loop's (model.join() must not restore them).
        self.written_group_keys: set[str] = set()

    @contextmanager
    def run(self) -> Iterator[None]:
        """One inner step: on copies of the groups, optimizer-wide state put back after."""
        optim = self._optim
        with self._swap_lock:
            originals = self.loop_groups
        # One copy each, under the GIL; tensor entries cloned, so that one written in
        # place (apex FusedAdam(capturable=True)'s group["step"] += 1) stays in the copy.
        # (Per run, on the step's path: plain loops, no per-entry calls.)
        # What the run gets and the state it writes in place are remembered with
        # their version counters: untouched ones need no comparison of values after.
        copies, groups_before, handed_out = [], [], []
        for group in originals:
            group_copy = dict(group)
            before = dict(group_copy)
            del before["params"]
            handed = {}
            for k, v in before.items():
                if not isinstance(v, IMMUTABLE):  # a tensor, a container: copies of it
                    group_copy[k] = copy_value(v)
                    before[k] = copy_value(v)
                    handed[k] = (group_copy[k], tensor_versions(group_copy[k]))
            copies.append(group_copy)
            groups_before.append(before)
            handed_out.append(handed)
        live_state = optimizer_wide_entries(optim)
        live_versions = {k: (v, tensor_versions(v)) for k, v in live_state.items()}
        state_before = {k: copy_value(v) for k, v in live_state.items()}
        attributes_before = scalar_attributes(optim)
        with self._swap_lock:
            optim.param_groups = copies
            self._runs += 1
        ran = False
        try:
            yield
            ran = True
        finally:
            with self._swap_lock:
                self._runs -= 1
                optim.param_groups = self.loop_groups  # a list given meanwhile, or originals
            state_after = optimizer_wide_entries(optim)
            for key in state_after.keys() | state_before.keys():
                if key in state_before:
                    optim.state[key] = state_before[key]
                else:
                    del optim.state[key]
            attributes_after = scalar_attributes(optim)
            attributes_written = {}
            for name in attributes_after.keys() | attributes_before.keys():
                old, new = (attributes_before.get(name, _MISSING),
                            attributes_after.get(name, _MISSING))
                if type(old) is not type(new) or not same_value(old, new):
                    attributes_written[name] = new
            for name in attributes_written:
                set_or_delete_attribute(optim, name, attributes_before.get(name, _MISSING))
            if ran:
                # (The identity test first: most entries are the objects they were.)
                writes = [{k: copy_value(v) for k, v in after.items()
                           if k != "params" and not (before.get(k) is v
                                                     and isinstance(v, IMMUTABLE))
                           and not (k in handed and untouched(*handed[k], v))
                           and not same_value(before.get(k, _MISSING), v)}
                          for before, after, handed in zip(groups_before, copies,
                                                           handed_out)]
                if len(self._group_writes) != len(writes):
                    self._group_writes = [{} for _ in writes]
                for kept, new in zip(self._group_writes, writes):
                    kept.update(new)
                    self.written_group_keys.update(new)
                self._state_writes.update({
                    key: copy_value(state_after.get(key, _MISSING))
                    for key in state_after.keys() | state_before.keys()
                    if not (key in live_versions and key in state_after
                            and untouched(*live_versions[key], state_after[key]))
                    and not same_value(state_before.get(key, _MISSING),
                                       state_after.get(key, _MISSING))})
                self._attribute_writes.update(attributes_written)

    def set_loop_groups(self, groups: list[dict]) -> None:
        """The loop's new group list (``opt.param_groups = ...``): the inner
        optimizer's at once, or, while a run holds copies there, when it ends (a
        run on the scheduler thread must step its copies, not the loop's dicts)."""
        with self._swap_lock:
            self.loop_groups = groups
            if self._runs == 0:
                self._optim.param_groups = groups

    @contextmanager
    def run_and_forget(self) -> Iterator[None]:
        """A run whose writes outside the pieces are dropped, whatever this step's
        runs have kept so far (a template's state made for a checkpoint load)."""
        kept = self._group_writes, self._state_writes, self._attribute_writes
        self._group_writes, self._state_writes, self._attribute_writes = [], {}, {}
        try:
            with self.run():
                yield
        finally:
            self._group_writes, self._state_writes, self._attribute_writes = kept

    def discard(self) -> None:
        """The runs so far were undone without a step (two_stage's speculative steps
        cancelled by a forward or synchronize() between backward and step)."""
        self._group_writes, self._state_writes, self._attribute_writes = [], {}, {}

    def end_step(self, stepped: bool) -> None:
        """The step is over: keep what its runs wrote if it stepped."""
        if stepped:
            for group, writes in zip(self.loop_groups, self._group_writes):
                group.update(writes)
            for key, value in self._state_writes.items():
                if value is _MISSING:
                    self._optim.state.pop(key, None)
                else:
                    self._optim.state[key] = value
            for name, value in self._attribute_writes.items():
                set_or_delete_attribute(self._optim, name, value)
        self.discard()

