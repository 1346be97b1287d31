"""The ShardedOptimizer a call reaches, when it comes through a wrapper of it.

PyTorch Lightning's LightningOptimizer (what ``self.optimizers()`` gives in
manual optimization) sets its own class to one derived from both its class and
the optimizer's, and reads the attributes it lacks from the optimizer. The
optimizer's methods then run with the wrapper as ``self``: what they read comes
from the optimizer, what they write stays on the wrapper. The optimizer keeps
the step's state in plain attributes (the clip's coefficient, which
reduce-scatters it measured), so a clip through the wrapper and the step on the
optimizer itself (Lightning's) each saw half of it, and a loss scaler keyed
``unscale_(wrapper)`` apart from ``step(optimizer)``, unscaling twice. So the
public methods run on the optimizer itself, found through a weak reference it
holds to itself (read through such a wrapper, or copied with the ``__dict__`` by
a wrapper that copies it; weak: no cycle that would keep a dropped optimizer,
and the buckets it holds, alive until the garbage collector runs).
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, TypeVar

Method = TypeVar("Method", bound=Callable[..., Any])


def remember_itself(optimizer: Any) -> None:
    optimizer._itself = weakref.ref(optimizer)


def itself(optimizer: Any) -> Any:
    """The optimizer that ``optimizer`` is or stands for (itself when no wrapper, and
    for a copy made through torch's ``__getstate__``, which holds no reference)."""
    reference = getattr(optimizer, "_itself", None)
    target = reference() if reference is not None else None
    return optimizer if target is None else target


def on_itself(method: Method) -> Method:
    """Runs ``method`` on the optimizer itself, whatever object it was called on."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        return method(itself(self), *args, **kwargs)
    return call  # type: ignore[return-value]
