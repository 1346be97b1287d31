"""The sharded optimizer's ``state``: keyed by this rank's slice pieces.

``opt.state`` is the inner optimizer's per-tensor state, and its tensors are
the 1-D pieces of this rank's bucket slices (the tensors in
``opt.param_groups``), not the model's parameters. Code written for
torch.optim looks a model parameter up there (logging Adam's moments,
resetting a re-initialised layer's state): torch's ``defaultdict`` would
insert an empty entry for it, and the next ``state_dict()`` would fail on a
key no param group holds. Such a lookup gets an empty dict that is not kept,
and one warning; so do ``get``, ``pop`` and ``in`` with a model parameter (None,
the default, False), and writing or deleting its entry raises. A reset of the
whole state by the loop (``opt.state.clear()``) asks ``before_reset`` first: between
backward and step, two_stage's speculative steps hold state a rollback would write
back and a commit would keep an update of. (Entries are deleted one by one by the
runtime itself there: step_wide_state.py, speculation.py.)
"""
from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Callable, Optional

import torch


class SliceState(defaultdict):
    """``defaultdict(dict)`` that does not insert entries for the model's parameters."""

    def __init__(self, is_model_param: Callable[[object], bool], *args, warned: bool = False,
                 before_reset: Optional[Callable[[str], None]] = None):
        super().__init__(dict, *args)
        self._is_model_param = is_model_param
        self._before_reset = before_reset  # (what the loop called) -> raises to refuse it
        self.warned = warned  # carried over to the state a load_state_dict() replaces
        # Keys that are not tensors (an optimizer-wide step count, MADGRAD's "k"),
        # for step_wide_state.py without a scan of every piece's entry per step.
        # Removed ones may linger here: readers check that they are still in.
        self.wide_keys = {k for k in self if not isinstance(k, torch.Tensor)}

    def __missing__(self, key):
        if not self._is_model_param_key(key):
            return super().__missing__(key)  # a piece: torch.optim fills it in
        self._warn_once(stacklevel=3)
        return {}

    def _warn_once(self, stacklevel: int) -> None:
        if not self.warned:
            self.warned = True
            warnings.warn(
                "fgpsdp: opt.state is keyed by this rank's slice pieces (the tensors in "
                "opt.param_groups), not by the model's parameters, which have no entry; "
                "opt.full_state(param) gives one parameter's state as torch.optim holds it, "
                "and opt.full_state_dict() every parameter's (both collectives)",
                RuntimeWarning, stacklevel=stacklevel)

    def _is_model_param_key(self, key) -> bool:
        return isinstance(key, torch.Tensor) and self._is_model_param(key)

    # A model parameter is never a key: these answer as for a missing key, and warn
    # (a loop resetting a re-initialised layer by `opt.state.pop(p, None)` would
    # otherwise reset nothing without a word).
    def get(self, key, default=None):
        if self._is_model_param_key(key):
            self._warn_once(stacklevel=3)
            return default
        return super().get(key, default)

    def pop(self, key, *default):
        if self._is_model_param_key(key):
            self._warn_once(stacklevel=3)
            if default:
                return default[0]
        return super().pop(key, *default)

    def __contains__(self, key) -> bool:
        if self._is_model_param_key(key):
            self._warn_once(stacklevel=3)
            return False
        return super().__contains__(key)

    def refuse_model_params(self, keys) -> None:
        """KeyError if any of ``keys`` is a model parameter."""
        if any(self._is_model_param_key(key) for key in keys):
            # Kept, it would make the next state_dict() fail on a key no group holds.
            raise KeyError(
                "fgpsdp: opt.state is keyed by this rank's slice pieces (the tensors in "
                "opt.param_groups), not by the model's parameters: to reset a parameter's "
                "state, reset the entries of its pieces")

    def __setitem__(self, key, value) -> None:
        self.refuse_model_params([key])
        if not isinstance(key, torch.Tensor):
            self.wide_keys.add(key)
        super().__setitem__(key, value)

    def __delitem__(self, key) -> None:
        self.refuse_model_params([key])
        super().__delitem__(key)

    def clear(self) -> None:
        if self._before_reset is not None:
            self._before_reset("state.clear()")
        super().clear()

    def popitem(self):
        if self._before_reset is not None:
            self._before_reset("state.popitem()")
        return super().popitem()

    def setdefault(self, key, default=None):  # dict's would bypass __setitem__
        self.refuse_model_params([key])
        if key not in self:
            self[key] = default
        return self[key]

    def update(self, *args, **kwargs) -> None:  # likewise
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def __reduce__(self):  # copied or pickled as the plain defaultdict torch keeps
        return (defaultdict, (dict,), None, None, iter(self.items()))

    def copy(self) -> defaultdict:  # defaultdict's would call SliceState(dict, self)
        return defaultdict(dict, self)

    __copy__ = copy
