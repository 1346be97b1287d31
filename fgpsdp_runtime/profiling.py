"""NVTX ranges and per-bucket timing marks (no-ops where they cost nothing to skip).

NVTX ranges show up in Nsight Systems (``bench/nsys.sh``); they are pushed only
once the process has started CUDA, so CPU runs pay a function call and nothing else.
"""
from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch


@contextlib.contextmanager
def nvtx_range(name: str) -> Iterator[None]:
    # Asked each time, not once at import: torch.cuda.is_available() starts the CUDA
    # driver in the asking process, and ranks forked from a process that merely
    # imported this package then fail their first CUDA call ("initialization error").
    if torch.cuda.is_initialized():
        torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            torch.cuda.nvtx.range_pop()
    else:
        yield


class Marks:
    """Named time marks on one device, resolved to seconds after the fact.

    On CUDA a mark is an event on the current stream (no host sync while
    recording); on CPU it is a perf_counter reading.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self._marks: list[tuple[str, object]] = []

    def mark(self, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            self._marks.append((name, event))
        else:
            self._marks.append((name, time.perf_counter()))

    def resolve(self) -> list[tuple[str, float]]:
        """(name, seconds since the first mark), in recording order."""
        if not self._marks:
            return []
        if self.cuda:
            torch.cuda.synchronize(self.device)  # not the current device's: ours
            first = self._marks[0][1]
            return [(n, first.elapsed_time(e) / 1e3) for n, e in self._marks]
        t0 = self._marks[0][1]
        return [(n, t - t0) for n, t in self._marks]

    def clear(self) -> None:
        self._marks.clear()
