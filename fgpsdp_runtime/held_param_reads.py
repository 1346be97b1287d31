"""Parameters held from before the step land their all-gather when a torch call reads them.

[Note: parameters held from before the step]
Under ``next_forward`` and ``two_stage`` a step's all-gathers land during the
next forward. Reads through ``parameters()``, a module's attributes and its
``_parameters`` table land them first (module_guards.py), but a loop may hold
the parameter objects themselves from before the step: torch_ema's
``ExponentialMovingAverage(model.parameters())`` keeps the list, and its
``update()`` right after ``opt.step()`` read a mix of updated and old slices,
another mix on every rank, with no error.

So while a bucket's all-gather is pending (queued or in flight), each of its
parameters is of class ``ParameterInFlight``, a subclass of ``nn.Parameter``
whose ``__torch_function__`` lands the buckets of every such parameter a torch
call takes (not for a read of its metadata: dtype, shape, ``.grad``), through
the same rules as an attribute read (the wrapper's; none inside a forward on
its own thread, whose pre-hooks wait, or a backward, or between backward and
step under ``two_stage``). The class goes back to ``nn.Parameter`` as the bucket lands.

Under torch.compile the landing is a graph break: a compiled function that
reads a pending parameter runs that call eagerly, and under ``fullgraph=True``
raises, saying to synchronize first.

Why a class and not a TorchFunctionMode: a mode sees every torch call of the
thread, the next forward's included, until the last bucket lands, and would
be pushed at the step and popped at that landing, out of stack order with a
mode the loop entered in between (``with torch.device(...)``). The class
costs only the calls that take a pending parameter, and outside a forward
those are the reads to land. Only parameters of class ``nn.Parameter``
itself are switched: a subclass of the user's keeps its class and is not
seen (nor is a view or ``.data`` taken before the step).
"""
from __future__ import annotations

from typing import Container, Sequence

import torch
from torch import nn

from .forward_waits import METADATA_ONLY_CALLS, tensors_in
from .lifecycle import wrapper_of
from .module_guards import eager_only, is_traced_by_dynamo

# Besides the metadata a forward's recording ignores: what the loop and the
# library touch on every parameter between the step and the next forward
# without reading its values (``zero_grad()`` sets ``.grad``; the version
# counter is compared when a bucket lands; a parameter is hashed as a dict key).
_READS_NO_VALUES = METADATA_ONLY_CALLS | frozenset(
    [torch.Tensor.grad.__get__, torch.Tensor.grad.__set__, torch.Tensor.grad.__delete__,
     torch.Tensor._version.__get__, torch.Tensor.__hash__,
     torch.Tensor.requires_grad.__set__, torch.Tensor.requires_grad_])


class ParameterInFlight(nn.Parameter):
    """A parameter whose updated values are still being all-gathered (see the note
    above). Behaves as ``nn.Parameter`` in every call: results are plain tensors."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        # Traced by dynamo, the landing is a graph break (the call runs eagerly). Not
        # while dynamo itself looks at the inputs as it compiles (a tracing context
        # but no tracing): landed there, the graph would be guarded on nn.Parameter
        # and compiled again at every step, whose parameters are pending.
        if func not in _READS_NO_VALUES and (is_traced_by_dynamo()
                                             or torch._guards.TracingContext.try_get() is None):
            for tensor in tensors_in((args, kwargs)):
                if type(tensor) is cls:
                    land(tensor)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def __deepcopy__(self, memo):
        # nn.Parameter's would make the copy of type(self): land first, and copy
        # as an nn.Parameter whatever the landing did.
        if id(self) in memo:
            return memo[id(self)]
        land(self)
        result = nn.Parameter(self.data.clone(memory_format=torch.preserve_format),
                              self.requires_grad)
        memo[id(self)] = result
        return result


@eager_only("fgpsdp: a parameter whose updated values are still being all-gathered "
            "after opt.step() lands first, outside compiled code; under fullgraph=True "
            "call model.synchronize() before this function")
def land(param: torch.Tensor) -> None:
    """Land ``param``'s buckets through the wrapper holding it, as a read of
    ``module.weight`` would."""
    wrapper = wrapper_of(param)
    if wrapper is None:  # dropped, its all-gathers never landed (it warned)
        plain_class(param)
        return
    wrapper.land_for_a_read(param)


class ParamsInFlight:
    """Switches the class of each bucket's parameters while its all-gather is
    pending. Called by ParamGathers under its lock, as buckets are queued or
    started and as they land."""

    def __init__(self, params_of_bucket: Sequence[Sequence[torch.Tensor]],
                 buckets_of_param: dict[int, list[int]]):
        self._params_of_bucket = params_of_bucket
        self._buckets_of_param = buckets_of_param

    def pending(self, bucket: int) -> None:
        for param in self._params_of_bucket[bucket]:
            if type(param) is nn.Parameter:
                param.__class__ = ParameterInFlight

    def landed(self, bucket: int, still_pending: Container[int]) -> None:
        """``bucket`` landed; ``still_pending``: the buckets that have not (a large
        parameter spans several)."""
        for param in self._params_of_bucket[bucket]:
            if type(param) is ParameterInFlight and not any(
                    b in still_pending for b in self._buckets_of_param.get(id(param), ())):
                param.__class__ = nn.Parameter

    def release(self) -> None:
        """The wrapper is dropped: every parameter back to ``nn.Parameter`` (what it
        holds is said by the wrapper's warning about what did not land)."""
        for params in self._params_of_bucket:
            for param in params:
                if type(param) is ParameterInFlight:
                    param.__class__ = nn.Parameter


def plain_class(param: torch.Tensor) -> None:
    """``param`` back to ``nn.Parameter`` (no live wrapper holds it any more)."""
    if type(param) is ParameterInFlight:
        param.__class__ = nn.Parameter
