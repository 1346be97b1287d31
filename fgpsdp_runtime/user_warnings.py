"""Warnings about the user's code, shown at the user's line.

A warning raised inside ``opt.step()`` passes through torch's wrappers around
it (``torch.no_grad``, ``torch.compiler.disable``, the optimizer's profiling
hook) and ours; a fixed ``stacklevel`` named torch's ``_contextlib.py`` (found
by an audit of real loops), so the line was hard to find and a filter by the
user's module (``warnings.filterwarnings(..., module="train")``) never matched.
``warn_at_user_code`` counts the frames of this package and of torch and warns
at the first frame of anyone else's, with the usual once-per-line registry.
"""
from __future__ import annotations

import os
import sys
import warnings

import torch

_OURS = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _internal(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(_OURS) or path.startswith(_TORCH)


def user_stacklevel() -> int:
    """The ``stacklevel`` naming the first caller outside this package and torch,
    for a ``warnings.warn`` made by the function that calls this one."""
    frame = sys._getframe(2)  # the caller of the function that asks
    level = 2
    while frame is not None and _internal(frame.f_code.co_filename):
        frame = frame.f_back
        level += 1
    return level if frame is not None else 1


def warn_at_user_code(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """``warnings.warn(message, category)`` at the user's line (see the module note).
    Call it from the main thread's path of a user call, not from a worker thread."""
    warnings.warn(message, category, stacklevel=user_stacklevel())
