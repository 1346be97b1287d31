"""Warnings about the user's code, shown at the user's line.

A warning raised inside ``opt.step()`` passes through torch's wrappers around
it (``torch.no_grad``, ``torch.compiler.disable``, the optimizer's profiling
hook) and ours; a fixed ``stacklevel`` named torch's ``_contextlib.py`` (found
by an audit of real loops), so the line was hard to find and a filter by the
user's module (``warnings.filterwarnings(..., module="train")``) never matched.
``warn_at_user_code`` counts the frames of this package and of torch and warns
at the first frame of anyone else's, with the usual once-per-line registry;
``user_code_line`` gives that line to a warning raised later from a timer thread
(collective_watch.py).
"""
from __future__ import annotations

import os
import sys
import warnings
from types import FrameType
from typing import Optional

import torch

_OURS = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _internal(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(_OURS) or path.startswith(_TORCH)


def _first_outside(frame) -> tuple[Optional[FrameType], int]:
    """The first frame from ``frame`` outward that is neither ours nor torch's, and
    how many were skipped to reach it."""
    skipped = 0
    while frame is not None and _internal(frame.f_code.co_filename):
        frame = frame.f_back
        skipped += 1
    return frame, skipped


def user_stacklevel() -> int:
    """The ``stacklevel`` naming the first caller outside this package and torch,
    for a ``warnings.warn`` made by the function that calls this one."""
    frame, skipped = _first_outside(sys._getframe(2))  # from the asker's caller
    return 2 + skipped if frame is not None else 1


def user_code_line() -> tuple[str, int]:
    """(file, line) of the first caller outside this package and torch: where a
    warning raised later, from another thread, should point."""
    frame, _ = _first_outside(sys._getframe(1))
    return (frame.f_code.co_filename, frame.f_lineno) if frame is not None else ("<unknown>", 0)


def warn_at_user_code(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """``warnings.warn(message, category)`` at the user's line (see the module note).
    Call it from the main thread's path of a user call, not from a worker thread."""
    warnings.warn(message, category, stacklevel=user_stacklevel())
