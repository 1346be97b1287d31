"""Forward pre-hooks that wait for a bucket's all-gather just before it is read.

With the ``next_forward`` schedule the updated parameters of step t are still
being all-gathered when forward t+1 starts. Each module waits, in its forward
pre-hook, only for the buckets holding parameters it is the first to read.

[Note: who reads a parameter]
A module may read its own parameters and those of submodules it does not
call (``nn.MultiheadAttention`` reads ``out_proj.weight`` without calling
``out_proj``). So the first forward after construction (nothing pending)
records which modules run, in which order; each parameter is then assigned to
the earliest running module that holds it directly, or else to the deepest
running module that holds it in its subtree. A forward whose module order
differs from the recording (another branch, another module order) waits for
every pending bucket at the first difference, runs safely, and the next
forward records again. Parameters read outside any module's forward must be
synchronised by the caller (``model.synchronize()``).
"""
from __future__ import annotations

from typing import Callable, Optional

from torch import nn


class ForwardParamWaiter:
    def __init__(self, root: nn.Module, bucket_of_param: dict[int, list[int]],
                 wait_bucket: Callable[[int], None], wait_all: Callable[[], None]):
        self._root = root
        self._bucket_of_param = bucket_of_param  # id(param) -> buckets holding it
        self._wait_bucket = wait_bucket
        self._wait_all = wait_all
        self._recorded: Optional[list[int]] = None  # id(module) in pre-hook order
        self._needs: list[list[int]] = []  # buckets to wait for at each recorded position
        self._recording: list[int] = []
        self._cursor = 0
        self._mode = "record"  # "record", "follow" or "off" (this forward)
        self.deviations = 0  # forwards whose module order differed from the recording
        self._modules = [m for m in root.modules() if any(True for _ in m.parameters())]
        # First among the module's pre-hooks: those registered before wrapping
        # (weight_norm's, pruning's, a user's) may read the parameters too.
        self._handles = [m.register_forward_pre_hook(self._pre_hook, prepend=True)
                         for m in self._modules]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    # -- per forward -----------------------------------------------------------

    def begin_forward(self) -> None:
        if self._recorded is None:
            self._wait_all()  # nothing may be pending while we learn who reads what
            self._mode = "record"
            self._recording = []
        else:
            self._mode = "follow"
            self._cursor = 0

    def end_forward(self) -> None:
        if self._mode == "record":
            self._recorded = self._recording
            self._needs = self._assign(self._recording)
        # Buckets no module waited for (modules skipped this time): land them now.
        self._wait_all()
        self._mode = "off"

    def _pre_hook(self, module: nn.Module, args) -> None:
        if self._mode == "record":
            self._recording.append(id(module))
        elif self._mode == "follow":
            position = self._cursor
            if position < len(self._recorded) and self._recorded[position] == id(module):
                for b in self._needs[position]:
                    self._wait_bucket(b)
                self._cursor += 1
            else:
                # Another order than recorded: be safe now, learn again next time.
                self.deviations += 1
                self._wait_all()
                self._recorded = None
                self._mode = "off"

    # -- the assignment ----------------------------------------------------------

    def _assign(self, order: list[int]) -> list[list[int]]:
        by_id = {id(m): m for m in self._modules}
        depth = {id(self._root): 0}
        for name, m in self._root.named_modules():
            if name:
                depth[id(m)] = name.count(".") + 1
        first_position: dict[int, int] = {}
        for position, mid in enumerate(order):
            first_position.setdefault(mid, position)
        owner: dict[int, int] = {}  # id(param) -> position of the module that waits
        # 1) the earliest running module that holds the parameter directly
        for mid, position in sorted(first_position.items(), key=lambda kv: kv[1]):
            for p in by_id[mid].parameters(recurse=False):
                owner.setdefault(id(p), position)
        # 2) otherwise the deepest running module that holds it in its subtree
        for mid, position in sorted(first_position.items(),
                                    key=lambda kv: (-depth.get(kv[0], 0), kv[1])):
            for p in by_id[mid].parameters():
                owner.setdefault(id(p), position)
        needs: list[list[int]] = [[] for _ in order]
        seen_bucket: set[int] = set()
        for pid, position in sorted(owner.items(), key=lambda kv: kv[1]):
            for b in self._bucket_of_param.get(pid, ()):
                if b not in seen_bucket:  # a bucket is waited for where first needed
                    seen_bucket.add(b)
                    needs[position].append(b)
        return needs
