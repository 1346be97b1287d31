"""Guards that keep the model's parameters and the bucket buffers one and the same.

Parameters are views of the bucket buffers (see buckets.py): the optimizer and
the all-gathers write the buffers, and the model reads the views. Two things
break that silently, and are guarded here (what lands the all-gathers before a
save, a copy or a read of the module is in module_guards.py):

- a parameter given new storage or replaced after wrapping (``model.double()``,
  ``module.weight = nn.Parameter(...)``), a submodule holding parameters replaced
  (``model.module.head = nn.Linear(...)``) or a trainable parameter added: the next
  forward raises (``ParamPlaces``);
- a parameter changed in place by the loop while its all-gather lands (or after a
  speculative step): its autograd version counter tells (``ParamVersions``).
"""
from __future__ import annotations

import operator
import weakref
from typing import Optional, Sequence

import torch
from torch import nn

from .buckets import BucketStorage, span_as_param
from .module_guards import is_traced_by_dynamo, plain_named_parameters, plain_parameter


# id(module) -> (weak reference to the module, weak references to its wrappers'
# ParamPlaces), for each module of a wrapped tree; an entry goes when its module is
# freed. Keyed by id, not by the module: torch's hooks see every module of the
# process, and a module class with __eq__ and no __hash__ (a @dataclass nn.Module)
# or a __hash__ that reads attributes set later in its __init__ must still build.
# See ParamPlaces.tree_changed.
# A module in the trees of two live wrappers (a shared parameter-free container) is
# watched for both: a change there is a change to each tree.
_watched_modules: "dict[int, tuple[weakref.ref, tuple[weakref.ref, ...]]]" = {}
_registration_hooks_added = False


def _forget(module_ref: weakref.ref, key: int) -> None:
    entry = _watched_modules.get(key)
    if entry is not None and entry[0] is module_ref:
        del _watched_modules[key]


def _note_registration(module: nn.Module, name: str, value: object) -> None:
    """torch's global hook, called when any module gets a submodule or a parameter
    set (before it is set): a dictionary lookup by id, and nothing else unless the
    module is in a wrapped tree. Not in code dynamo traces (a module set there is
    torch.compile's own).

    In the tree, setting what is already there (``self.weight = self.weight``, HF's
    tie_weights()) or swapping one parameter-free module for another (an activation
    cached in forward) changes nothing the buckets hold: the next forward does not
    walk the tree for it. A submodule set is watched at once, its own submodules
    with it."""
    if is_traced_by_dynamo():
        return None
    entry = _watched_modules.get(id(module))
    if entry is None or entry[0]() is not module:
        return None
    # (ref, ParamPlaces) of the live wrappers, held until the end: dropped ones out once.
    live = [(ref, places) for ref in entry[1] if (places := ref()) is not None]
    if not live:
        return None
    state = module.__dict__
    if value is not None and (dict.get(state.get("_parameters", {}), name) is value
                              or state.get("_modules", {}).get(name) is value):
        return None
    if isinstance(value, nn.Module):
        for places_ref, _ in live:
            _watch_subtree(value, places_ref)
        old = state.get("_modules", {}).get(name)
        # Only a swap (an activation cached in forward) is let through: with no module
        # there, one may have been deleted (`del module.head`, which no hook sees).
        if old is not None and next(iter(plain_named_parameters(old)), None) is None \
                and next(iter(plain_named_parameters(value)), None) is None:
            return None  # parameter-free for parameter-free
    for _, places in live:
        places.tree_changed = True
    return None  # the value is kept as given


def _watch_subtree(root: nn.Module, places_ref: weakref.ref) -> None:
    for m in root.modules():
        key = id(m)
        entry = _watched_modules.get(key)
        if entry is not None and entry[0]() is m:
            if places_ref not in entry[1]:  # (identity: a weakref to a live object)
                kept = tuple(ref for ref in entry[1] if ref() is not None)
                _watched_modules[key] = (entry[0], kept + (places_ref,))
            continue
        module_ref = weakref.ref(m, lambda r, k=key: _forget(r, k))
        _watched_modules[key] = (module_ref, (places_ref,))


def _watch(root: nn.Module, places: "ParamPlaces") -> None:
    global _registration_hooks_added
    if not _registration_hooks_added:
        from torch.nn.modules import module as torch_module
        for name in ("register_module_module_registration_hook",
                     "register_module_parameter_registration_hook"):
            register = getattr(torch_module, name, None)  # (torch >= 2.0)
            if register is not None:
                register(_note_registration)
        _registration_hooks_added = True
    _watch_subtree(root, weakref.ref(places))


class ParamPlaces:
    """Where each trainable parameter must stay: the module attribute that holds it,
    and its place in its bucket's buffer."""

    def __init__(self, module: nn.Module, names: Sequence[str],
                 params: Sequence[torch.nn.Parameter], buckets: Sequence[BucketStorage],
                 ignored_names: frozenset = frozenset()):
        self._root = module
        self._ignored_names = ignored_names
        # Every parameter of the module at wrapping, trainable or not.
        self._known = {id(p) for p in module.parameters()}
        # Set by torch's registration hooks when a module of the tree gets a
        # submodule or a parameter (not when it is set what it holds, nor for a
        # parameter-free swap: see _note_registration): the next check() looks at
        # the tree once.
        self.tree_changed = False
        # A forward since the last step found a plain tensor standing in for a
        # parameter (check()): only then does the step look again (refuse_substitutes).
        self._substitutes_seen = False
        _watch(module, self)
        # Per bucket: its flat buffer, and per parameter (name, owner module,
        # attribute, parameter, byte offset from the buffer's start, span).
        self._buckets = []
        for storage in buckets:
            flat = storage.flat_param
            places = []
            for span in storage.layout.spans:
                name = names[span.param_index]
                path, _, leaf = name.rpartition(".")
                places.append((name, module.get_submodule(path), leaf, params[span.param_index],
                               span.bucket_offset * flat.element_size(), span))
            self._buckets.append((flat, places))

    @torch.no_grad()
    def adopt_new_storage(self) -> None:
        """After a forward of the wrapper: a parameter that the forward gave new
        storage like its own (shape, dtype, device, strides) goes back into its
        bucket with those values.

        The idiom is a max-norm constraint run in forward, ``self.weight.data =
        torch.renorm(self.weight.data, ...)`` (braindecode's EEGNet layers):
        torch DDP then steps the new storage, and here the step writes the
        bucket, which the parameter must view again. What a forward reads is
        current (each module waits for its bucket), so the copy loses nothing.
        New storage given outside a forward, right after a step, may hold
        values read while all-gathers were landing: ``check`` refuses it."""
        for flat, _name, param, span, _owner, _leaf, replaced in self._displaced():
            if replaced or param.numel() != span.numel:
                continue
            view = span_as_param(flat[span.bucket_offset:span.bucket_end], param.shape,
                                 span.strides)
            if (param.dtype, param.device, param.stride()) == \
                    (view.dtype, view.device, view.stride()):
                view.copy_(param.detach())
                param.data = view

    def check(self) -> list[torch.Tensor]:
        """Raise if a parameter was given new storage (``model.double()``,
        ``.to(...)``, ``.to(memory_format=...)``, ``param.data = ...``) or replaced by another
        (``module.weight = nn.Parameter(...)``) after wrapping: it would
        silently never change again. Storage moved as a whole
        (``share_memory()``) keeps every view in place: allowed, as the check
        is relative to the buffer. Runs before every forward: addresses only.

        Returns the plain tensors that stand in for parameters during this call
        (``_substitute_for_a_call``)."""
        substitutes = []
        for _flat, name, param, _span, owner, leaf, replaced in self._displaced():
            if replaced and (value := _substitute_for_a_call(owner, leaf)) is not None:
                substitutes.append(value)
                self._substitutes_seen = True
                continue
            if not replaced:
                problem = f"was given new storage (now {param.dtype} on {param.device})"
            elif (moved := _moved_to(name, param, owner, leaf)) is not None:
                raise RuntimeError(moved)
            elif plain_parameter(owner, leaf) is None:
                problem = "was removed from its module"
            else:
                problem = "was replaced by another tensor"
            raise RuntimeError(
                f"fgpsdp: parameter '{name}' {problem} after DistributedDataParallel(...) "
                "was built: it no longer lives in its bucket and would not train. Cast, "
                "move, change the memory format of, or otherwise change the module "
                "before wrapping it. (A `param.data = ...` of the same shape, dtype and "
                "layout is taken back into the bucket when the module's forward, run "
                "through the wrapper, makes it; outside it, write in place after "
                "model.synchronize() instead.)")
        if self.tree_changed:
            self.tree_changed = False  # (first: a set during the walk is seen next time)
            try:
                self._check_tree()
            except RuntimeError:
                self.tree_changed = True  # the next forward raises too
                raise
            # Submodules set through a hook are watched already; one that came in
            # without one (ModuleList.insert) is watched from here on, as before.
            _watch_subtree(self._root, weakref.ref(self))
        return substitutes

    def refuse_substitutes(self) -> None:
        """At ``opt.step()``, where no ``functional_call`` is under way: a plain tensor
        still standing in for a parameter was written into ``_parameters`` for good,
        and the parameter would never train again. Only after a forward that saw
        one: a step walks the parameters no more than that."""
        if not self._substitutes_seen:
            return
        for _flat, name, _param, _span, owner, leaf, replaced in self._displaced():
            if replaced and _substitute_for_a_call(owner, leaf) is not None:
                raise RuntimeError(
                    f"fgpsdp: parameter '{name}' was replaced by a plain tensor in its "
                    "module's _parameters (written there directly; torch.func.functional_call "
                    "puts the parameter back after its call): it no longer lives in its "
                    "bucket and would not train. Change the module before wrapping it")
        self._substitutes_seen = False

    def _check_tree(self) -> None:
        """After a submodule or a parameter was set somewhere in the tree: each
        bucketed parameter's owner is still in the tree, and no trainable parameter
        has come in that no bucket holds. (Swapping a module without parameters, an
        activation, is fine.)"""
        # By identity, not by path: a submodule re-parented with its parameters (a
        # wrapper set around it after wrapping) is still called, its hooks with it.
        in_tree = {id(m) for m in self._root.modules()}
        for _flat, places in self._buckets:
            for name, owner, _leaf, _param, _offset, _span in places:
                if id(owner) not in in_tree:
                    path = name.rpartition(".")[0]
                    raise RuntimeError(
                        f"fgpsdp: submodule '{path}' was replaced after "
                        "DistributedDataParallel(...) was built: the buckets hold the "
                        f"parameters of the one it replaced ('{name}'), and the new one's "
                        "would never be reduced or stepped. Change the module before "
                        "wrapping it, or drop the wrapper and its optimizer and wrap the "
                        "module again")
        for name, param in plain_named_parameters(self._root):
            if param.requires_grad and id(param) not in self._known \
                    and name not in self._ignored_names:
                raise RuntimeError(
                    f"fgpsdp: parameter '{name}' was added after DistributedDataParallel(...) "
                    "was built: no bucket holds it, so it would never be reduced or "
                    "stepped. Add it before wrapping the module, or drop the wrapper and "
                    "its optimizer and wrap the module again")

    def _displaced(self):
        """(flat buffer, name, parameter, span, owner module, leaf name, replaced?) of
        each parameter not at its place: no longer its module's (replaced, moved,
        removed; the old weight_norm removes it for '<leaf>_g' and '<leaf>_v'), or
        given new storage. Addresses only."""
        for flat, places in self._buckets:
            start = flat.data_ptr()
            for name, owner, leaf, param, offset, span in places:
                if plain_parameter(owner, leaf) is not param:
                    yield flat, name, param, span, owner, leaf, True
                elif param.data_ptr() - start != offset:
                    yield flat, name, param, span, owner, leaf, False


def _substitute_for_a_call(owner: nn.Module, leaf: str) -> Optional[torch.Tensor]:
    """The plain tensor (not a Parameter) the module holds where the parameter was,
    or None: ``torch.func.functional_call(model, {...}, args)`` puts it there for one
    call, writing ``_parameters`` directly (``setattr`` cannot put a plain tensor in
    ``_parameters``), and puts the parameter back after it. The forward reads the
    substitute; a gradient that flows through it to the parameter (a substitute
    computed from it) is reduced as any other, as under torch DDP. One left there
    for good is refused at the step (``refuse_substitutes``)."""
    value = plain_parameter(owner, leaf)
    if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
        return value
    return None


def storage_address(tensor: torch.Tensor) -> Optional[int]:
    """Where ``tensor``'s storage starts (a view of a bucket, ``p.data``, gives the
    bucket's), or None for a tensor without one (a subclass, sparse)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _moved_to(name: str, param: torch.Tensor, owner: nn.Module, leaf: str) -> Optional[str]:
    """The message for a parameter its module now holds under another name (the
    same object, still a view of its bucket), or None."""
    where = next((n for n, p in plain_named_parameters(owner, remove_duplicate=False)
                  if p is param), None)
    if where is None:
        return None
    path = name.rpartition(".")[0]
    full = f"{path}.{where}" if path else where
    # The hook-based torch.nn.utils.spectral_norm moves it to '<leaf>_orig';
    # torch.nn.utils.parametrize (parametrizations.spectral_norm, orthogonal,
    # weight_norm) to 'parametrizations.<leaf>.original'.
    how = (" (as torch.nn.utils.spectral_norm does)" if where == f"{leaf}_orig" else
           " (as torch.nn.utils.parametrize does)"
           if where == f"parametrizations.{leaf}.original" else "")
    return (f"fgpsdp: parameter '{name}' was moved to '{full}'{how} after "
            "DistributedDataParallel(...) was built: the wrapper keeps each parameter "
            "at the name it had then (its module's forward waits for its bucket, "
            "state dicts name it so). Apply such a change to the module before "
            "wrapping it")


_VERSION = operator.attrgetter("_version")


def _increment_version_takes_a_list() -> bool:
    bump = getattr(torch.autograd.graph, "increment_version", None)
    if bump is None:
        return False
    probe = [torch.zeros(1), torch.zeros(1)]
    try:
        bump(probe)
    except (TypeError, RuntimeError):
        return False
    return [t._version for t in probe] == [1, 1]


_BUMPS_A_LIST = _increment_version_takes_a_list()


class ParamVersions:
    """The bucketed parameters' autograd version counters, as our own changes left them.

    Steps, undos and speculative steps change parameters through the flat
    buffers, which do not share the parameters' version counters; each such
    change bumps them here, as torch's optimizers' in-place updates do, so that
    a backward still holding the old values raises torch's "modified by an
    inplace operation". What else moves a counter afterwards is the loop
    writing a parameter in place (``p.clamp_()`` under no_grad; ``p.data`` has
    a counter of its own and is not seen).
    """

    def __init__(self, params_of_bucket: Sequence[Sequence[torch.Tensor]],
                 names: dict[int, str]):
        self.params_of_bucket = params_of_bucket
        self._names = names  # id(param) -> name
        self._after_change = [[p._version for p in params] for params in params_of_bucket]

    def mark_changed(self, buckets: Sequence[int]) -> None:
        bump = getattr(torch.autograd.graph, "increment_version", None)  # torch >= 2.1
        for b in buckets:
            params = self.params_of_bucket[b]
            if bump is not None and params:
                if _BUMPS_A_LIST:  # one call for the bucket (torch >= 2.4 takes a list)
                    bump(params)
                else:
                    for p in params:
                        bump(p)
            self._after_change[b] = list(map(_VERSION, params))

    def written_since_change(self, b: int) -> Optional[str]:
        """The name of a parameter of bucket b written in place since our last change
        (said once: the change is taken as known afterwards)."""
        params = self.params_of_bucket[b]
        now = list(map(_VERSION, params))
        before, self._after_change[b] = self._after_change[b], now
        return next((self._names[id(p)] for p, v, w in zip(params, now, before) if v != w), None)
