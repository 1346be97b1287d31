"""What the wrapper puts on the user's module: hooks and instance attributes.

Parameters are views of the bucket buffers (see buckets.py), and under the
forward-overlapped schedules a step's all-gathers land after ``step()`` has
returned; the reduced gradients live in the buckets, not in ``param.grad``. So
on every submodule of the wrapped module:

- a ``state_dict`` / ``load_state_dict`` first lands the all-gathers in flight
  (state-dict hooks), and so does a copy or a pickle (a ``__getstate__``
  instance attribute);
- the parameters read through ``model.module.parameters()`` or a submodule's (an
  EMA teacher, a clamp) land each one's all-gather as it is handed out (a
  ``named_parameters`` instance attribute);
- a parameter read as an attribute (``module.logit_scale``) lands its all-gather
  first (a ``_parameters`` table of ours, whose lookups ``nn.Module.__getattr__``
  makes), and so does a read of that table's entries (a conversion, ``.cpu()``,
  ``.half()``, ``.to(...)``: ``nn.Module._apply`` copies them from there);
- and on the wrapped module itself, ``zero_grad()`` resets the reduced slices (a
  ``zero_grad`` instance attribute).

A copy or a pickle of the module is not wrapped: it gets none of our hooks or
guards (see ``LandingGetstate``); a class's own ``__deepcopy__`` that copies
``__dict__`` gets inert hooks and guards that act on the copy (see ``_TheCopy``).
The wrapper removes all of them when dropped.
"""
from __future__ import annotations

import copy
import threading
import weakref
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
from torch import nn

from .lifecycle import HookHandles

if TYPE_CHECKING:  # pragma: no cover
    from .ddp import DistributedDataParallel


# True only in code dynamo traces (torch.compiler.is_compiling() is True in
# every thread while any thread compiles); torch < 2.3 has it under _dynamo.
is_traced_by_dynamo = getattr(torch.compiler, "is_dynamo_compiling", None) or \
    torch._dynamo.is_compiling


def eager_only(reason: str, disable: Optional[Callable] = None) -> Callable:
    """``torch.compiler.disable(reason=...)``: the function runs eagerly, a graph
    break in compiled code, and under fullgraph=True dynamo's error gives
    ``reason``. Older torch (2.4) takes no reason: there, the plain decorator."""
    disable = disable or torch.compiler.disable
    try:
        return disable(reason=reason)
    except TypeError:
        return disable


class ModuleHook:
    """A hook of ours on the user's module; a copy or a pickle of the module gets an
    inert one. ``copy.deepcopy(model.module)`` (``swa_utils.AveragedModel``, EMA
    teachers) would otherwise copy what the hook refers to, the wrapper with its
    threads and locks, and fail; the copy is not wrapped, so nothing to do there."""

    def __init__(self, fn):
        self._fn = fn

    def __call__(self, *args, **kwargs):
        return self._fn(*args, **kwargs)

    @property
    def __name__(self):
        # What torch.jit.script reads first of each forward hook: say what works
        # instead of a bare "no attribute" (an AttributeError still, so that
        # getattr(hook, "__name__", default) goes on working).
        raise AttributeError(
            "fgpsdp: the wrapper's forward hooks on model.module cannot be compiled by "
            "torch.jit.script; script a copy, which has none: "
            "torch.jit.script(copy.deepcopy(model.module))")

    def __deepcopy__(self, memo):
        # Reached only by a class's own __deepcopy__ that copies __dict__ (a copy by
        # copy.deepcopy or pickle leaves our hooks out: see LandingGetstate).
        return inert_hook

    def __reduce__(self):
        return (_inert, ())


def inert_hook(*_args, **_kwargs) -> None:
    return None


def _inert():
    return inert_hook


def land_gathers_before_state_dicts(model: "DistributedDataParallel",
                                    module: nn.Module) -> HookHandles:
    """Hooks on every submodule of ``module``: a ``state_dict`` (through the
    wrapper, ``module`` or any submodule) first lands the all-gathers in flight,
    a ``load_state_dict`` first synchronises.

    A checkpoint saved from ``model.module`` right after ``step()`` (the usual
    torch DDP idiom, often on rank 0 alone) would otherwise hold a mix of
    updated and old slices, another mix on every rank: saving changes no
    collective (see ``DistributedDataParallel.land_gathers_for_a_save``). An
    all-gather landing after a load would write the other ranks' pre-load
    slices over what was loaded. ``assign=True`` would swap the parameters for
    tensors the buckets do not hold: refused.
    """
    model_ref = weakref.ref(model)  # the hooks must not keep a freed wrapper alive

    def land_gathers_before_load(_state_dict, _prefix, local_metadata, *_rest) -> None:
        wrapper = model_ref()
        if wrapper is None:
            return
        if wrapper._uneven_inputs is not None:  # first: a joined rank must hear of it
            wrapper._uneven_inputs.announce_load("load_state_dict() of the model")
        if local_metadata.get("assign_to_params_buffers"):
            raise ValueError("fgpsdp: load_state_dict(assign=True) would replace parameters "
                             "that are views of the bucket buffers; load with assign=False")
        wrapper.synchronize()

    def land_gathers_before_save(*_args) -> None:
        wrapper = model_ref()
        if wrapper is not None:
            wrapper.land_gathers_for_a_save()

    save_hook, load_hook = ModuleHook(land_gathers_before_save), ModuleHook(land_gathers_before_load)
    handles = HookHandles()
    for sub in module.modules():
        handles.add_instance_attribute(sub, "__getstate__",
                                       LandingGetstate(land_gathers_before_save,
                                                       _TheModule(sub)))
        handles.add(sub.register_state_dict_pre_hook(save_hook))
        # Without the module: torch's wrapper of a hook that takes it holds the
        # module, and a class's own __deepcopy__ that copies __dict__ without first
        # putting the copy into the memo then made a second copy through it, which
        # the copy's hook pointed at (dead soon: the copy no longer pickled).
        handles.add(sub._register_load_state_dict_pre_hook(load_hook))
    return handles  # removed when the wrapper is dropped


class _ModuleGuard:
    """An instance attribute of ours on a submodule of the wrapped module. ``_act``
    is the wrapper's part in it (weakly; it returns None once the wrapper is gone),
    ``_module`` finds the module (_TheModule, _TheCopy or _nobody). A class's own
    ``__deepcopy__`` that copies ``__dict__`` (torch.nn.utils.parametrize's) brings
    it along: the copy's has no wrapper's part and acts on the copy alone (see
    _TheCopy); a copy's or a pickle's state leaves it out (LandingGetstate)."""

    NAME = "guard"

    def __init__(self, act: Callable, module: Callable[[], Optional[nn.Module]]):
        self._act = act
        self._module = module

    def _target(self) -> nn.Module:
        module = self._module()
        if module is None:
            raise TypeError(f"fgpsdp: the {self.NAME} of {_GONE}")
        return module

    def __deepcopy__(self, memo):
        return type(self)(inert_hook, _TheCopy.of(self._module(), memo))


class LandingGetstate(_ModuleGuard):
    """A submodule's ``__getstate__`` (an instance attribute, which ``copy`` and
    ``pickle`` look up before the class's): lands the all-gathers in flight first.

    ``copy.deepcopy(model.module)`` right after ``opt.step()`` (``AveragedModel``,
    an EMA teacher, timm's ``ModelEmaV2``) or ``torch.save(model.module)`` would
    otherwise copy the other ranks' slices before the step, another mix on every
    rank. No hook of torch's runs before a copy reads the parameters (the state
    dict hooks do not run, and our hook dicts are copied after ``_parameters``);
    this runs before anything is copied, and leaves our guards out of the state.
    """

    NAME = "copy guard"

    def __call__(self):
        module = self._target()
        self._act()  # lands the all-gathers in flight
        state = type(module).__getstate__(module)
        if isinstance(state, dict):
            if state is module.__dict__:  # a class returning its own __dict__
                state = dict(state)
            for name in [k for k, v in state.items() if isinstance(v, _ModuleGuard)]:
                del state[name]
            if isinstance(state.get("_parameters"), LandingParameters):
                state["_parameters"] = state["_parameters"].plain()
            _leave_our_hooks_out(state)
        return state


def _is_ours(hook) -> bool:
    # torch keeps a load_state_dict pre-hook inside its own _WrappedHook.
    return isinstance(hook, ModuleHook) or isinstance(getattr(hook, "hook", None), ModuleHook)


def _leave_our_hooks_out(state: dict) -> None:
    """In a copy's or a pickle's ``state`` (the module's ``__dict__``, shallow):
    each hook dictionary holding hooks of ours replaced by one without them (the
    module's own is left as it is), and their ids dropped from the dictionaries
    of flags keyed by hook id (``_forward_hooks_with_kwargs`` & co.). The copy is
    not wrapped: inert hooks there would only cost a call per forward, and
    ``torch.jit.script`` cannot compile them. The user's own hooks stay."""
    dropped: set = set()
    for name, value in list(state.items()):
        if isinstance(value, dict) and any(_is_ours(v) for v in value.values()):
            kept = type(value)()
            for key, hook in value.items():
                if _is_ours(hook):
                    dropped.add(key)
                else:
                    kept[key] = hook
            state[name] = kept
    if not dropped:
        return
    for name, value in list(state.items()):
        if isinstance(value, dict) and name.endswith(("_with_kwargs", "_always_called")) \
                and any(key in dropped for key in value):
            state[name] = type(value)((k, v) for k, v in value.items() if k not in dropped)


_GONE = ("a module that is gone (or of a copy made by a __deepcopy__ that copies the "
         "module's __dict__ item by item without first putting the copy into the memo: "
         "put it there, memo[id(self)] = copy, or delete the copy's 'named_parameters', "
         "'zero_grad' and '__getstate__' instance attributes, vars(copy).pop(...))")


def _nobody() -> None:
    return None


class _TheModule:
    """The guarded module, weakly: the guards must not keep it alive."""

    def __init__(self, module: nn.Module):
        self._ref = weakref.ref(module)

    def __call__(self) -> Optional[nn.Module]:
        return self._ref()


class _TheCopy:
    """The copy a class's own ``__deepcopy__`` made of a guarded module: the copy's
    guards are copied inside it, before that ``__deepcopy__`` returns it.

    While the copy in the memo lives, that copy (a ``__deepcopy__`` that puts it
    there before copying ``__dict__``, whole or item by item, as torch's
    parametrize does). Else a stand-in of the copy's class over the copy's
    ``__dict__`` (deep-copied with the memo), which the class's methods read as
    they would the copy: for a ``__deepcopy__`` that does not register the copy, or
    whose registered one is another copy, soon gone, made through a hook of the
    user's that holds the module. Holding that dictionary, which holds the guard,
    makes a reference cycle: the garbage collector frees it with the copy."""

    def __init__(self, replica: Optional[nn.Module], cls: type, module_dict: Optional[dict]):
        self._replica = weakref.ref(replica) if replica is not None else None
        self._cls, self._dict = cls, module_dict

    @staticmethod
    def of(module: Optional[nn.Module], memo: dict) -> Callable[[], Optional[nn.Module]]:
        if module is None:
            return _nobody
        replica, module_dict = memo.get(id(module)), memo.get(id(module.__dict__))
        if replica is None and module_dict is None:
            return _nobody  # __dict__ copied item by item, the copy not in the memo
        return _TheCopy(replica, type(module), module_dict)

    def __call__(self) -> Optional[nn.Module]:
        # A live copy first: a dictionary merged into the copy's own
        # (``replica.__dict__.update(deepcopy(self.__dict__))``) is not the copy's.
        replica = self._replica() if self._replica is not None else None
        if replica is not None or self._dict is None:
            return replica
        stand_in = object.__new__(_without_finalizer(self._cls))
        object.__setattr__(stand_in, "__dict__", self._dict)
        return stand_in


_WITHOUT_FINALIZER: dict = {}


def _without_finalizer(cls: type) -> type:
    """``cls``, or where it has a ``__del__`` (a handle it closes) a subclass whose
    ``__del__`` does nothing: a dropped stand-in must not finalize the copy."""
    if getattr(cls, "__del__", None) is None:
        return cls
    if cls not in _WITHOUT_FINALIZER:
        try:
            _WITHOUT_FINALIZER[cls] = type(cls.__name__, (cls,), {
                "__del__": lambda self: None, "__module__": cls.__module__})
        except TypeError:  # a class that refuses subclasses (__init_subclass__)
            _WITHOUT_FINALIZER[cls] = cls
    return _WITHOUT_FINALIZER[cls]


def hand_out_parameters_through_the_wrapper(read: Callable, module: nn.Module) -> HookHandles:
    """``named_parameters`` (which ``parameters()`` calls) of every submodule of
    ``module`` hands the parameters out through ``read(named, submodule)``, the
    wrapper's reads (see [Note: reading parameters through the wrapper] in ddp.py):
    each one's all-gather lands as it is handed out.

    Right after ``opt.step()`` an EMA teacher or a momentum encoder updated from
    ``model.module.parameters()`` (DINO's, BYOL's, MoCo's), a
    ``swa_utils.AveragedModel.update_parameters(model.module)`` or a WGAN clamp
    over ``D.module.parameters()`` would otherwise read, under ``next_forward``
    and ``two_stage``, a mix of updated and old slices, another mix on every rank.
    (The library's own reads call ``nn.Module``'s, see ``plain_named_parameters``.)
    """
    handles = HookHandles()
    for sub in module.modules():
        handles.add_instance_attribute(sub, "named_parameters",
                                       HandingOutParameters(read, _TheModule(sub)))
    return handles  # removed when the wrapper is dropped


def plain_named_parameters(module: nn.Module, *args, **kwargs):
    """``module.named_parameters(...)`` without our guard, nor the landing reads of
    our ``_parameters`` tables: what the library reads itself (a check before each
    forward must not land the all-gathers the forward overlaps)."""
    if type(module).named_parameters is nn.Module.named_parameters:
        return _nn_modules_over_plain_tables(module, *args, **kwargs)
    return _read_plainly(lambda: type(module).named_parameters(module, *args, **kwargs))


def _nn_modules_over_plain_tables(module: nn.Module, prefix: str = "", recurse: bool = True,
                                  remove_duplicate: bool = True):
    # nn.Module.named_parameters over the tables as plain dicts, at its speed (a large
    # model's every parameter is walked at each zero_grad()).
    return module._named_members(_plain_items, prefix=prefix, recurse=recurse,
                                 remove_duplicate=remove_duplicate)


def _plain_items(module: nn.Module):
    return dict.items(module.__dict__["_parameters"])


def plain_parameter(module: nn.Module, name: str) -> Optional[torch.Tensor]:
    """``module._parameters.get(name)``, landing nothing (see plain_named_parameters)."""
    return dict.get(module.__dict__["_parameters"], name)


class _PlainReads(threading.local):
    depth = 0  # > 0 while this thread reads for the library (our tables land nothing)


_plain_reads = _PlainReads()


def _read_plainly(call: Callable):
    """What ``call()`` (a class's own named_parameters) returns, an iterator or a
    list, item by item: the call and each item taken with our tables' landing reads
    and parameter guards off in this thread (one that builds its list at once, or
    hands out a child's ``named_parameters``, reads them there)."""
    _plain_reads.depth += 1
    try:
        named = iter(call())
    finally:
        _plain_reads.depth -= 1
    while True:
        _plain_reads.depth += 1
        try:
            item = next(named)
        except StopIteration:
            return
        finally:
            _plain_reads.depth -= 1
        yield item


class HandingOutParameters(_ModuleGuard):
    """A submodule's ``named_parameters`` (an instance attribute, looked up before
    the class's method): see ``hand_out_parameters_through_the_wrapper``."""

    NAME = "parameter guard"

    def __call__(self, *args, **kwargs):
        module = self._target()
        named = plain_named_parameters(module, *args, **kwargs)
        if is_traced_by_dynamo() or _plain_reads.depth:
            # compiled code: the wrapper's compiled forward waited; or the library's
            # own read, through a parent class's named_parameters handing out this one's
            return named
        read = self._act(named, module)
        return named if read is None else read  # None: no wrapper (gone, or a copy)

    # What a bound method has: torch.compile checks ``module.named_parameters.__func__``
    # against nn.Module's to learn whether a class overrides it.
    @property
    def __self__(self) -> Optional[nn.Module]:
        return self._module()

    @property
    def __func__(self):
        module = self._module()
        return type(module).named_parameters if module is not None else nn.Module.named_parameters


def zero_grad_through_the_wrapper(zero: Callable[[bool], Optional[bool]],
                                  module: nn.Module) -> HookHandles:
    """``model.module.zero_grad()`` (the wrapped module's own, as a loop written for
    either may call it) resets what ``model.zero_grad()`` does, through ``zero``
    (the wrapper's, weakly). nn.Module's sets ``param.grad`` only, and the reduced
    gradients live in the buckets: the next step added the new ones to them (torch
    DDP's ``model.module.zero_grad()`` resets its gradients), and it read every
    parameter, landing the all-gathers the next forward overlaps. A class with a
    ``zero_grad`` of its own keeps it. A submodule's cannot do the same (the
    reduced slices hold no gradient per parameter to set to None): it warns at the
    step, as ``param.grad = None`` does."""
    handles = HookHandles()
    if type(module).zero_grad is nn.Module.zero_grad:
        handles.add_instance_attribute(module, "zero_grad",
                                       ZeroingThroughTheWrapper(zero, _TheModule(module)))
    return handles  # removed when the wrapper is dropped


class ZeroingThroughTheWrapper(_ModuleGuard):
    """The wrapped module's ``zero_grad`` (an instance attribute): see
    ``zero_grad_through_the_wrapper``. A copy's zeroes the copy's gradients as
    nn.Module's does."""

    NAME = "zero_grad guard"

    def __call__(self, set_to_none: bool = True) -> None:
        module = self._target()
        self._act(set_to_none)  # the reduced slices, and what no_sync() left
        # As nn.Module's, over the parameters as they are (no all-gather to land):
        # those the wrapper does not reduce (frozen ones a loop gave gradients).
        reset_gradients([param for _, param in plain_named_parameters(module)], set_to_none)


def reset_gradients(params: Sequence[torch.Tensor], set_to_none: bool) -> None:
    """``param.grad`` reset as nn.Module.zero_grad resets it."""
    for param in params:
        if param.grad is None:
            continue
        if set_to_none:
            param.grad = None
        else:
            if param.grad.grad_fn is not None:
                param.grad.detach_()
            else:
                param.grad.requires_grad_(False)
            param.grad.zero_()


def land_gathers_on_attribute_reads(land: Callable[[torch.Tensor], None], in_flight: dict,
                                    waiter: Optional[object],
                                    module: nn.Module) -> "ParameterTables":
    """Every submodule of ``module`` reads its parameters as attributes
    (``module.weight``) through a ``_parameters`` table of ours, which hands each one
    to ``land`` (the wrapper's, weakly) while all-gathers are in flight (``in_flight``,
    the wrapper's table of them, is not empty) outside a forward (``waiter``'s
    ``in_forward``; its pre-hooks wait there): its all-gather lands first.

    Right after ``opt.step()`` OpenCLIP clamps ``model.module.logit_scale`` in place,
    and a loop may log ``model.module.head.weight.norm()``: under ``next_forward`` and
    ``two_stage`` that reached the parameter while its all-gather was landing, a
    mix of updated and old slices (a clamp raised at the next forward, by the
    version counter; one through ``.data`` was lost). ``nn.Module.__getattr__``
    reads ``self.__dict__["_parameters"][name]``, so the table's ``__getitem__``
    sees every such read. A forward's own reads cost three tests each (``land``
    would do nothing there; nor in a backward, or between backward and step under
    ``two_stage``).

    The table's ``get()``, ``items()`` and ``values()`` land too (the whole table's
    for the last two): ``nn.Module._apply`` (``.cpu()``, ``.half()``, ``.to(...)``)
    copies every parameter from ``items()``, and PyTorch Lightning ends each fit
    with ``lightning_module.cpu()``, a copy on a GPU; export and conversion scripts
    walk ``module._parameters.items()`` themselves. Not the library's own reads
    (``plain_named_parameters``, ``plain_parameter``).
    """
    tables = ParameterTables()
    for sub in module.modules():
        tables.install(sub, LandingParameters(sub.__dict__["_parameters"], land, in_flight,
                                              waiter))
    return tables  # put back when the wrapper is dropped


class LandingParameters(dict):
    """A submodule's ``_parameters``: see ``land_gathers_on_attribute_reads``. The
    same entries as the module's own table (``original``), in order. A copy or a
    pickle of the module gets ``original`` with these entries (a copied module is
    not wrapped; a shallow copy shares it with the module once the wrapper, dropped,
    hands it back, as without the wrapper); a copy of the table alone is a plain
    ``dict``."""

    def __init__(self, original: dict, land: Callable[[torch.Tensor], None], in_flight: dict,
                 waiter: Optional[object]):
        super().__init__(original)
        self._original = original
        self._land, self._in_flight, self._waiter = land, in_flight, waiter

    def __getitem__(self, name: str):
        param = dict.__getitem__(self, name)
        # (_lands_now's tests written out: every attribute read in a forward runs them)
        if is_traced_by_dynamo() or not self._in_flight or param is None \
                or _plain_reads.depth:
            return param
        waiter = self._waiter
        if waiter is None or not waiter.in_forward:
            self._land(param)
        return param

    def get(self, name: str, default=None):
        return self[name] if dict.__contains__(self, name) else default

    def items(self):
        self._land_all()
        return dict.items(self)

    def values(self):
        self._land_all()
        return dict.values(self)

    def _lands_now(self) -> bool:
        # Dynamo's test first: while it traces this it is a constant, and a test of
        # the in-flight table there would be guarded on (a compiled function that
        # reads an attribute right after the step recompiled at every call).
        if is_traced_by_dynamo() or not self._in_flight or _plain_reads.depth:
            return False
        waiter = self._waiter
        return waiter is None or not waiter.in_forward

    def _land_all(self) -> None:
        if self._lands_now():
            for param in dict.values(self):
                if param is not None:
                    self._land(param)

    def plain(self) -> dict:
        """The module's own table (no wrapper's), holding these entries now."""
        original = self._original
        while isinstance(original, LandingParameters):  # (a submodule wrappers share)
            original = original._original
        return self._refill(original)

    def _refill(self, table: dict) -> dict:
        table.clear()
        table.update(dict.items(self))
        return table

    def _let_go(self) -> None:
        """Its wrapper dropped: hold nothing of the wrapper's (its waiter holds the
        module, whose parameters are views of the wrapper's buckets)."""
        self._land, self._in_flight, self._waiter = _land_nothing, {}, None

    def __deepcopy__(self, memo: dict) -> dict:
        copied: dict = {}
        memo[id(self)] = copied
        for name, param in dict.items(self):
            copied[name] = copy.deepcopy(param, memo)
        return copied

    def __reduce__(self):
        return dict, (dict(self),)


class ParameterTables:
    """The ``_parameters`` tables of ours on the submodules. ``remove()`` gives each
    module the table ours replaced (its own, or another live wrapper's where two
    share a submodule) with the entries ours holds then, and takes ours out of a
    chain where a later wrapper's table covers it."""

    def __init__(self):
        self._installed: list[tuple[dict, LandingParameters]] = []

    def install(self, module: nn.Module, table: LandingParameters) -> None:
        module.__dict__["_parameters"] = table
        self._installed.append((module.__dict__, table))

    def remove(self) -> None:
        for attributes, table in self._installed:
            installed = attributes.get("_parameters")
            if installed is table:
                attributes["_parameters"] = table._refill(table._original)
            else:
                # Another wrapper's table replaced it, where two share a submodule:
                # out of that chain, so that it keeps nothing of this wrapper alive.
                above = installed
                while isinstance(above, LandingParameters) and above._original is not table:
                    above = above._original
                if isinstance(above, LandingParameters):
                    above._original = table._original
            table._let_go()
        self._installed.clear()


def _land_nothing(_param: torch.Tensor) -> None:
    return None
