"""Reads of ``opt.param_groups[i]["params"]`` by the loop between backward and step.

The tensors there are this rank's slice pieces: their ``.grad`` is None until the
step assigns them their slices of the reduced gradient. So a clip over them between
backward and ``opt.step()`` (PyTorch Lightning's ``gradient_clip_val`` and
mmengine's ``clip_grad`` gather the tensors of ``optimizer.param_groups`` and pass
them to torch's clip) clips nothing, and an edit of their gradients changes
nothing: torch's clip returns 0, without a word.

The group dicts the optimizer builds are ``GroupNotingParamsReads``: a subscript
``group["params"]`` calls back the optimizer, which notes it when it comes from
neither torch's code nor this package's (their own reads: the inner optimizer's
``state_dict()``, our ``zero_grad()``) while the reduced gradients wait in the
buckets (``DistributedDataParallel.reduced_gradients_wait()``). ``opt.step()`` then
says so once, unless a clip of ours ran, as the wrapper does for
``model.parameters()`` (ddp.py). ``dict(group)``, ``.get`` and iteration do not
call ``__getitem__``: the step's copies of the groups read nothing through it.

Groups the loop gives itself (``opt.param_groups = [dict(g) ...]``) stay its own
plain dicts: reads of those are not seen (swapping in a dict of ours would cut the
loop's reference to the one it edits).
"""
from __future__ import annotations

import sys
import weakref
from typing import Any, Sequence

# Module prefixes whose reads are not the loop's: torch's own (an optimizer's
# state_dict(), load_state_dict(), zero_grad() over these groups) and ours.
_OWN_READERS = ("torch", "fgpsdp_runtime")


class GroupNotingParamsReads(dict):
    """A param group dict whose ``["params"]`` subscript by the loop is reported to
    its optimizer (held weakly: the optimizer owns its groups), while
    ``optimizer.params_reads_matter()``: ``optimizer.note_params_read()``. Pickled
    and copied as a plain dict: the optimizer is this process's business."""

    __slots__ = ("_optimizer",)

    def __init__(self, entries: dict[str, Any], optimizer: Any):
        super().__init__(entries)
        self._optimizer = weakref.ref(optimizer)

    def __getitem__(self, key: Any) -> Any:
        if key == "params":
            optimizer = self._optimizer()
            # (The frame is looked at only inside the window: reads outside it are
            # every step's, torch's zero_grad() among them.)
            if optimizer is not None and optimizer.params_reads_matter() \
                    and not _read_by_own_code():
                optimizer.note_params_read()
        return dict.__getitem__(self, key)

    def __reduce_ex__(self, protocol: Any):
        return (dict, (dict(self),))


def _read_by_own_code() -> bool:
    """Whether the code subscripting the group (two frames up, past __getitem__) is
    torch's or this package's."""
    frame = sys._getframe(2)
    return frame.f_globals.get("__name__", "").split(".", 1)[0] in _OWN_READERS


def noting_params_reads(groups: Sequence[dict[str, Any]], optimizer: Any,
                        unless_in: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """``groups`` with each plain dict that is not among ``unless_in`` (by identity:
    dicts the loop or the inner optimizer may hold) replaced by a noting copy."""
    held = {id(g) for g in unless_in}
    return [GroupNotingParamsReads(g, optimizer) if type(g) is dict and id(g) not in held
            else g for g in groups]
