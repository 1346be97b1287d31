"""The barrier among the ranks that map one shared-memory region.

[Note: the shared-memory barrier]
A shared-memory collective needs one barrier per round (see [Note: the
shared-memory protocol] in shared_memory.py). It used to be a one-element gloo
all-reduce: a TCP round trip over loopback, 0.36-0.48 ms (0.23-0.31 ms of CPU)
per barrier with 2 ranks on the 2-core test machine, which made a bucket of a
few KB cost tens of times its copies; the counts take 6-7 us
(bench/shm_barrier.py, docs/benchmarks/2026-12-03-shm-barrier-cpu.md):

    arrive : rank r stores count[r] = k (release: its copies before are seen by
             whoever acquires it), bumps the wake word and futex-wakes sleepers
    wait   : spin a few microseconds, then sleep on the wake word (futex) until
             every count[j] >= k; every 2 ms (kPollNs in csrc/cpu/shm_barrier_cpu.cpp)
             look at the failure flag, the exit byte, the peers' liveness and
             the deadline

Liveness: a rank that died never arrives. Each rank holds a POSIX record lock
on byte `rank` of the region's file (taken before the allocation's agreement,
so before any barrier), which the kernel drops when the process ends,
SIGKILL included. A waiter that finds a missing peer's byte unlocked fails at
once (within 2 ms), where the gloo barrier waited for gloo to see the
closed socket. Record locks belong to the process, not to a thread or to
forked children (DataLoader workers holding the inherited descriptor keep
nothing alive), and no PID is compared, so ranks may live in different PID
namespaces. The lock also goes when the process closes any descriptor of that
file: only this module opens it after it is mapped.
The deadline is the group's timeout, as gloo's all-reduce applied it.

FGPSDP_SHM_BARRIER=gloo keeps the gloo all-reduce (also used where the
extension is not built or the system has no futex).
"""
from __future__ import annotations

import fcntl
import os
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from . import ops
from .topology import group_timeout

_LINE = 64


def native_barrier_wanted() -> bool:
    """Whether the counts-in-the-region barrier can and may be used here."""
    if os.environ.get("FGPSDP_SHM_BARRIER", "native") == "gloo" or not ops.extension_available():
        return False
    # An extension built before the barrier existed (sources updated, not rebuilt)
    # has no such function: gloo's barrier then, as without the extension.
    supported = getattr(ops._C, "shm_barrier_supported", None)
    return supported is not None and bool(supported())


def area_bytes(size: int) -> int:
    """Bytes of the barrier's area for ``size`` ranks: a wake word's line and a count's
    line per rank (csrc/cpu/shm_barrier_cpu.cpp)."""
    return (1 + size) * _LINE


def group_timeout_s(group: dist.ProcessGroup) -> float:
    """The group's timeout (torch's default where it cannot be read), capped at about
    31 years so that the C++ deadline cannot overflow."""
    timeout = group_timeout(group) or dist.distributed_c10d.default_pg_timeout
    return min(timeout.total_seconds(), 1e9)


class RegionBarrier:
    """The barrier of one region: ``area`` (uint8, zeroed, area_bytes(size) long) inside
    it, and this rank's lock on byte ``rank`` of the region's file at ``path``. A wait
    also ends when the byte ``flag`` (the region's failure flag) or ``exit_byte`` is set."""

    def __init__(self, area: torch.Tensor, flag: torch.Tensor, exit_byte: torch.Tensor,
                 path: str, rank: int, size: int, timeout_s: float):
        if area.numel() != area_bytes(size):
            raise ValueError(f"barrier area of {area.numel()} bytes, need {area_bytes(size)}")
        # The tensors keep the mapping alive; their addresses are what the C++ reads.
        self._tensors = (area, flag, exit_byte)
        self._area_ptr, self._flag_ptr, self._exit_ptr = (
            area.data_ptr(), flag.data_ptr(), exit_byte.data_ptr())
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self.arrivals = 0  # barriers this rank has entered in this region
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, rank)
        except OSError:
            os.close(fd)
            raise
        self._fd = fd
        # Closed when the barrier is dropped; not at interpreter exit, where a link
        # worker may still wait in it (the process's end drops the lock anyway).
        self._close = weakref.finalize(self, os.close, fd)
        self._close.atexit = False

    def wait(self) -> int:
        """Arrive and wait for every rank: 0, or why not (1: a rank set the flag;
        2: the exit byte is set; 3: the timeout passed; 100 + r: local rank r is gone)."""
        self.arrivals += 1
        return int(ops._C.shm_barrier_wait(self._area_ptr, self.rank, self.size, self.arrivals,
                                           self._fd, self._flag_ptr, self._exit_ptr,
                                           self.timeout_s))

    def close(self) -> None:
        """Let go of the lock (the region is replaced)."""
        self._close()


def open_region_barrier(area: torch.Tensor, flag: torch.Tensor, exit_byte: torch.Tensor,
                        path: str, rank: int, size: int,
                        timeout_s: float) -> Optional[RegionBarrier]:
    """A RegionBarrier, or None where the file cannot be locked (the ranks then agree
    on gloo's barrier for this region)."""
    try:
        return RegionBarrier(area, flag, exit_byte, path, rank, size, timeout_s)
    except OSError:
        return None
