"""Reduce-scatter and all-gather among the CPU ranks of one node, through shared memory.

Why: on CPU the ranks of a node are processes of one machine, and gloo moves
their bytes over TCP loopback, which costs CPU in the kernel's network stack
at both ends (on a 2-core machine that CPU is taken from the training
itself). Through a shared mapping each byte is written once and read once.
Measured with bench/node_collectives.py (2 ranks, a 16 MiB bucket, 2-core
test machine), CPU per rank per operation: reduce-scatter 10-11 ms against
13-15 ms for gloo's all-to-all + sum, all-gather 7-8 ms against 14 ms.

[Note: the shared-memory protocol]
Each instance serves one process group and is used by one thread at a time
(a link worker), so its operations come in the same order on every rank.
A region holds two halves, the barrier's area (see [Note: the shared-memory
barrier] in shm_barrier.py), then a failure flag (see [Note: a failed
barrier]); round i uses half i % 2::

    reduce-scatter: rank l copies its input into slot l of the half,
                    barrier, sums chunk l of every slot (in slot order);
                    with two ranks, only the peer's chunk is copied and
                    rank l adds its own chunk from where it lies
    all-gather    : rank l copies its chunk to position l of the half,
                    barrier, copies the other positions out

A bucket larger than a slot moves in several rounds, a piece of every chunk
each. One barrier per round suffices: before rank l writes half p again (at
round i + 2) it has passed the barrier of round i + 1, which every rank
enters only after it has finished reading half p at round i.
The barrier is counts in the region, waited for in C++ (shm_barrier.py);
where that cannot run it is a one-element gloo all-reduce on the group (which
also orders every rank's stores before it, as a socket round trip does).

[Note: a failed barrier]
A rank whose collective fails sets the region's failure flag; a rank waiting
in a barrier looks at it every few milliseconds and fails too instead of
waiting for its peer to exit. The counts barrier also fails as soon as a
missing peer's process is gone. The gloo barrier needs the flag most: on 3
ranks gloo's ring all-reduce of one element is a chain, 2 -> 1 -> 0
(sum) -> 2 -> 1 (result), each send waiting for its receiver to post the
receive. Local rank 0 killed inside a barrier after rank 1 had sent it its
part leaves rank 1 waiting only on rank 2, while only rank 2 sees the closed
connection: rank 1 would wait until rank 2's process ends (or the timeout, if
rank 2 went on into another collective); the flag, looked at every _POLL,
ends that wait. After a failure every later operation of this instance
raises, unrun. The collectives of a reallocation (_allocate) block without
polling: a rank killed in one left both survivors seeing the closed
connection within about 1 s in every injection run, but that is gloo's doing,
not this flag's.

The region grows on demand: every rank sees the same sizes in the same
order, so all reallocate at the same operation. Local rank 0 creates the
file (in /dev/shm), reserves its bytes (posix_fallocate: a full tmpfs is an
error here, not a SIGBUS later), and broadcasts its name; once every rank
has mapped it, rank 0 unlinks it, so nothing is left behind when the
processes end. If any rank cannot map it (no shared /dev/shm, tmpfs full),
every rank agrees to fall back to gloo for good, with one warning.
"""
from __future__ import annotations

import os
import re
import time
import uuid
import warnings
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from .group_collectives import hold_past_gloo_worker
from .rank_order_sum import sum_in_rank_order
from .shm_barrier import (RegionBarrier, area_bytes, group_timeout_s, native_barrier_wanted,
                          open_region_barrier)

_SHM_DIR = "/dev/shm"
_NAME_BYTES = 96  # the broadcast file name, NUL-padded
_ALIGN = 64  # slot sizes are multiples of this: every dtype's view stays aligned
_FLAG_BYTES = _ALIGN  # after the halves; its first byte is set by a rank whose collective failed
_POLL = timedelta(milliseconds=100)  # how often a waiting barrier looks at the flag
# A bucket larger than this moves in rounds (one barrier each), so that the
# region stays small: 2 x local ranks x this for a reduce-scatter, 2 x this for
# an all-gather, whatever the largest bucket.
_MAX_SLOT_BYTES = 16 * 2**20


def shared_memory_dir() -> Optional[str]:
    """Where shared files go; None where the system has no tmpfs for them."""
    return _SHM_DIR if os.path.isdir(_SHM_DIR) and os.access(_SHM_DIR, os.W_OK) else None


_REGION_NAME = re.compile(r"fgpsdp-(\d+)-[0-9a-f]{32}")
# A region's name lives from its creation until every rank of the node has mapped
# it; one older than this whose creator is gone was left by a killed job.
_STALE_AFTER_S = 120.0


def remove_stale_regions(directory: str) -> list[str]:
    """Unlink region files whose creating process is gone: a SIGTERM (a scheduler's
    cancel, torchrun stopping a job) while local rank 0 waited for its peers to map
    a new region skips the unlink, and tmpfs would hold the file (up to 16 MiB x 2 x
    (local ranks + 1)) until reboot. Only files older than _STALE_AFTER_S: a process
    of another PID namespace sharing the directory may be alive though unseen here."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        match = _REGION_NAME.fullmatch(name)
        if match is None or int(match.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(match.group(1)), 0)
            continue  # alive
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError):
            continue  # another user's live process; or not a pid
        path = os.path.join(directory, name)
        try:
            if now - os.stat(path).st_mtime > _STALE_AFTER_S:
                os.unlink(path)
                removed.append(name)
        except OSError:
            pass  # gone meanwhile, or not ours to remove
    return removed


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class SharedMemoryCollectives:
    """Intra-node reduce-scatter / all-gather of CPU tensors for one gloo group."""

    def __init__(self, group: dist.ProcessGroup, directory: Optional[str] = None,
                 name: str = "intra", max_slot_bytes: int = _MAX_SLOT_BYTES):
        self.group = group
        self.max_slot_bytes = max_slot_bytes
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.name = name
        self.directory = directory if directory is not None else shared_memory_dir()
        self.enabled = self.directory is not None
        self._region: Optional[torch.Tensor] = None  # uint8, 2 halves of _slots x _slot_bytes
        self._slots = 0
        self._slot_bytes = 0
        self._op = 0
        self._flag = torch.zeros(1)  # the gloo barrier's all-reduced element
        self._native_barrier = native_barrier_wanted()
        self._timeout_s = group_timeout_s(group) if self._native_barrier else 0.0
        self._region_barrier: Optional[RegionBarrier] = None  # None: gloo's barrier
        self._exit_byte = torch.zeros(1, dtype=torch.uint8)  # set by abort_waits
        self._failure: Optional[BaseException] = None  # the first, on this rank
        self._exiting = False  # set at interpreter exit (see abort_waits)
        self.allocations = 0  # regions mapped so far (grows only)

    def prepare(self, slots: int) -> bool:
        """Collective, before any operation: map a small region now, so that a node
        whose ranks cannot share one falls back (and warns) at construction."""
        return self._ready(slots=slots, slot_bytes=_ALIGN)

    # -- collectives -----------------------------------------------------------

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> bool:
        """Sum ``input`` over the group into chunk ``rank`` -> ``output``; False if disabled
        (the caller then uses gloo)."""
        self._raise_if_failed()
        n = self.size
        if input.numel() != output.numel() * n:
            raise ValueError(f"reduce-scatter sizes: input {input.numel()} "
                             f"!= {n} x output {output.numel()}")
        chunk = output.numel()
        piece = self._rounds(chunk, input.element_size(), slots=n)
        if not piece:
            return False
        rows = input.reshape(n, chunk)  # row j: what rank j receives the sum of
        out = output.view(-1)
        me = self.rank
        for lo in range(0, chunk, piece):
            m = min(piece, chunk - lo)
            slots = self._half(n, input, n * m).view(n, n, m)  # [slot j][row]: rank j's pieces
            if n == 2:
                # Only the peer's row goes through the region; this rank's own
                # piece is read where it lies (half the bytes written). One
                # addition in rank order: the same bits as the sum below.
                peer = 1 - me
                slots[me, peer].copy_(rows[peer, lo:lo + m])
                self._barrier()
                mine, theirs = rows[me, lo:lo + m], slots[peer, me]
                torch.add(*((mine, theirs) if me == 0 else (theirs, mine)), out=out[lo:lo + m])
                continue
            slots[me].copy_(rows[:, lo:lo + m])
            self._barrier()
            sum_in_rank_order(slots[:, me, :], out[lo:lo + m])
        return True

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> bool:
        """Chunk ``rank`` of ``output`` <- ``input`` on every rank; False if disabled."""
        self._raise_if_failed()
        n = self.size
        if output.numel() != input.numel() * n:
            raise ValueError(f"all-gather sizes: output {output.numel()} "
                             f"!= {n} x input {input.numel()}")
        chunk = input.numel()
        piece = self._rounds(chunk, output.element_size(), slots=1)
        if not piece:
            return False
        rows = output.view(n, chunk)
        mine = input.reshape(-1)
        own_in_place = mine.data_ptr() == rows[self.rank].data_ptr()
        for lo in range(0, chunk, piece):
            m = min(piece, chunk - lo)
            gathered = self._half(1, output, n * m).view(n, m)
            gathered[self.rank].copy_(mine[lo:lo + m])
            self._barrier()
            for j in range(n):
                if j != self.rank:
                    rows[j, lo:lo + m].copy_(gathered[j])
        if not own_in_place:
            rows[self.rank].copy_(mine)
        return True

    # -- internals ---------------------------------------------------------------

    def _rounds(self, chunk: int, element_size: int, slots: int) -> int:
        """Elements of each rank's chunk moved per round (a slot holds one piece per
        rank, at most max_slot_bytes), with the region sized for it; 0 if disabled."""
        n = self.size
        piece = max(1, min(chunk, self.max_slot_bytes // (n * element_size)))
        return piece if self._ready(slots=slots, slot_bytes=n * piece * element_size) else 0

    def _half(self, slots: int, like: torch.Tensor, numel: int) -> torch.Tensor:
        """The next half of the region as ``slots`` rows of ``numel`` elements of
        ``like``'s dtype (see the note)."""
        half_bytes = self._slots * self._slot_bytes
        parity = self._op % 2
        self._op += 1
        half = self._region[parity * half_bytes:(parity + 1) * half_bytes]
        nbytes = numel * like.element_size()
        return half.view(slots, self._slot_bytes)[:, :nbytes].view(like.dtype)

    def _barrier(self) -> None:
        """Every rank has stored its part (see [Note: a failed barrier])."""
        if self._region_barrier is not None:
            return self._counts_barrier(self._region_barrier)
        return self._gloo_barrier()

    def _counts_barrier(self, barrier: RegionBarrier) -> None:
        rc = barrier.wait()
        if rc == 0:
            return
        if rc == 1:
            why = (f"a rank of the {self.name} shared-memory link failed in a collective "
                   "(a rank of this node died?)")
        elif rc == 2:
            why = (f"the process is exiting while the {self.name} shared-memory link "
                   "waited for a peer")
        elif rc == 3:
            why = (f"the {self.name} shared-memory link waited {barrier.timeout_s:.0f} s "
                   "(the group's timeout) for a peer")
        else:
            why = f"local rank {rc - 100} of the {self.name} shared-memory link has exited"
        error = RuntimeError(f"fgpsdp: {why}; this rank stops waiting for it")
        self._fail(error)
        raise error

    def _gloo_barrier(self) -> None:
        work = dist.all_reduce(self._flag, group=self.group, async_op=True)
        while True:
            try:
                work.wait(_POLL)
                return
            except RuntimeError:
                if work.is_completed():  # not a timed-out wait: the all-reduce's outcome
                    try:
                        work.wait()
                    except BaseException as error:
                        self._fail(error)
                        raise
                    return
            if self._exiting:
                # The exit gave up waiting for this rank's link worker: a worker left
                # polling here would take the GIL back during finalization and abort
                # the process (see shutdown.py). Fail as a dying rank does: the flag
                # tells the peers' barriers too.
                why = (f"the process is exiting while the {self.name} shared-memory link "
                       "waited for a peer")
            elif self._region is not None and int(self._region[-_FLAG_BYTES]) != 0:
                why = (f"a rank of the {self.name} shared-memory link failed in a collective "
                       "(a rank of this node died?)")
            else:
                continue
            error = RuntimeError(f"fgpsdp: {why}; this rank stops waiting for it")
            self._fail(error)
            raise error

    def abort_waits(self) -> None:
        """At exit, after the link workers were given their time: a barrier still
        waiting raises within _POLL (this rank's failure, which its peers see)."""
        self._exiting = True
        self._exit_byte[0] = 1

    def _fail(self, error: BaseException) -> None:
        """This rank's collective failed: later operations raise, and the ranks still
        waiting in a barrier of this region see the flag (see the note)."""
        if self._failure is None:
            self._failure = error
        if self._region is not None:
            self._region[-_FLAG_BYTES] = 1

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"fgpsdp: the {self.name} shared-memory link failed earlier on "
                               f"this rank: {self._failure}") from self._failure

    def _ready(self, slots: int, slot_bytes: int) -> bool:
        if not self.enabled:
            return False
        if self._region is None or slots != self._slots or slot_bytes > self._slot_bytes:
            self._allocate(slots, max(_round_up(slot_bytes, _ALIGN), self._slot_bytes))
        return self.enabled

    def _allocate(self, slots: int, slot_bytes: int) -> None:
        """Collective: map a new region of 2 x slots x slot_bytes, the barrier's area and
        _FLAG_BYTES (see the note)."""
        barrier_bytes = area_bytes(self.size)
        total = 2 * slots * slot_bytes + barrier_bytes + _FLAG_BYTES
        name = torch.zeros(_NAME_BYTES, dtype=torch.uint8)
        path = None
        if self.rank == 0:
            path = self._create(total)
            if path is not None:
                encoded = os.path.basename(path).encode()
                name[:len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
        text = ""
        barrier = None
        try:
            dist.broadcast(name, src=dist.get_global_rank(self.group, 0), group=self.group)
            text = bytes(name.tolist()).rstrip(b"\0").decode()
            region = self._map(os.path.join(self.directory, text), total) if text else None
            if region is not None and self._native_barrier:
                # Locked before the agreement below, so before any peer's first barrier
                # (and before rank 0 unlinks the name).
                area = region[total - _FLAG_BYTES - barrier_bytes:total - _FLAG_BYTES]
                barrier = open_region_barrier(area, region[-_FLAG_BYTES:], self._exit_byte,
                                              os.path.join(self.directory, text),
                                              self.rank, self.size, self._timeout_s)
            # 0: not mapped here; 1: mapped; 2: mapped, with the counts barrier.
            ok = torch.tensor([0 if region is None else 2 if barrier is not None else 1],
                              dtype=torch.int32)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)
            # (One key per link: the two links map their regions on their own threads.)
            hold_past_gloo_worker(f"shared-memory mapping {self.name}", name, ok)  # see group_collectives.py
        except BaseException as error:
            if barrier is not None:
                barrier.close()
            self._fail(error)
            # Local rank 0 may have died after sending the name (killed, os._exit):
            # its unlink below never runs, and the file would stay in tmpfs until
            # a later job's stale sweep. A rank that knows the name removes it.
            if text and path is None:
                try:
                    os.unlink(os.path.join(self.directory, text))
                except OSError:
                    pass  # rank 0 (alive) or another peer got there first
            raise
        finally:
            # Every rank has mapped it (or given up, or a peer died in between, when
            # the name would outlive the job in tmpfs): the mapping outlives the name.
            if path is not None:
                os.unlink(path)
        if int(ok) < 2 and barrier is not None:
            barrier.close()  # a peer cannot lock its byte: gloo's barrier for this region
            barrier = None
        if self._region_barrier is not None:
            self._region_barrier.close()  # the old region's
        self._region_barrier = barrier
        if int(ok) == 0:
            self.enabled = False
            self._region = None
            warnings.warn(f"fgpsdp: the {self.name} link cannot use shared memory "
                          f"({total} bytes in {self.directory}); using gloo", RuntimeWarning)
            return
        self._region, self._slots, self._slot_bytes = region, slots, slot_bytes
        self._op = 0
        self.allocations += 1

    def _create(self, nbytes: int) -> Optional[str]:
        remove_stale_regions(self.directory)
        path = os.path.join(self.directory, f"fgpsdp-{os.getpid()}-{uuid.uuid4().hex}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            return None
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError:
            os.close(fd)
            os.unlink(path)
            return None
        os.close(fd)
        return path

    @staticmethod
    def _map(path: str, nbytes: int) -> Optional[torch.Tensor]:
        try:
            if os.path.getsize(path) < nbytes:
                return None
            return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        except (OSError, RuntimeError):
            return None
