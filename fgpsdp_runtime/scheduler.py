"""Executes the stage-1 part of an OverlapPlan during backward.

Timeline of one step under ``two_stage`` (buckets 0..3; plan stage1=[0, 1, 2])::

    backward      : [grads b0][grads b1][grads b2][grads b3]
    reduce-scatter:          [RS b0]   [RS b1]   [RS b2]   [RS b3]
    stage 1 (hooks):                [spec step b0, AG b0][spec b1, AG b1] ...
    optimizer.step: wait RS; speculate b2 if still due; norm all-reduce;
                    commit or roll back; step b3; AG b3 (stage 2)
    next forward  : pre-hooks wait for each bucket's all-gather just before use

Stage-1 steps run from the backward hooks on the main thread, strictly in the
plan's order, whenever the next stage-1 bucket's reduce-scatter has landed;
whatever is still due when the step begins runs there, in the same order.
The all-gathers they start are thus issued in the same order on every rank,
whatever the timing. The link worker threads (comm.py) move the bytes.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from .plan import OverlapPlan

if TYPE_CHECKING:  # pragma: no cover
    from .optim import ShardedOptimizer


class TwoStageScheduler:
    def __init__(self, model, plan: OverlapPlan):
        self.model = model
        self.plan = plan
        self.optimizer: Optional["ShardedOptimizer"] = None
        self._next = 0  # position in plan.stage1 of the next bucket to speculate
        # bucket -> (SliceBackup, reduce-scatters it had received when stepped)
        self.speculated: dict[int, tuple] = {}
        self.rollbacks = 0  # buckets rolled back so far (clipping, inf/NaN, unused)
        self.commits = 0
        self._cancelled = False  # a forward came between backward and step
        # Speculate only while the previous step would have committed: while
        # clipping is active every speculative step is undone and its
        # all-gather sent twice. Decided from all-reduced figures, so every
        # rank speculates in the same steps.
        self.speculating = True

    def attach(self, optimizer: "ShardedOptimizer") -> None:
        if self.optimizer is not None and self.optimizer is not optimizer:
            raise RuntimeError("two_stage: one ShardedOptimizer per model")
        self.optimizer = optimizer

    def poll(self) -> None:
        """From the backward hooks: speculate stage-1 buckets whose reduce-scatter landed."""
        if (self.optimizer is None or not self.model.reducer.sync_enabled or self._cancelled
                or not self.speculating):
            return
        reducer = self.model.reducer
        stage1 = self.plan.stage1
        while self._next < len(stage1):
            b = stage1[self._next]
            if reducer.reduce_scatters_since_step[b] == 0 or not reducer.landed(b):
                return
            self._speculate(b)

    def finish_stage1(self) -> None:
        """At the step: every stage-1 bucket not yet speculated, in plan order."""
        if self.optimizer is None or not self.speculating:
            return
        while self._next < len(self.plan.stage1):
            self._speculate(self.plan.stage1[self._next])

    def _speculate(self, b: int) -> None:
        reducer = self.model.reducer
        reducer.wait_bucket(b)
        backup = self.optimizer.speculative_step(b)
        self.speculated[b] = (backup, reducer.reduce_scatters_since_step[b])
        self.model.start_param_all_gather(b)
        self._next += 1

    def before_forward(self) -> None:
        """Called by every forward: a reduction since the step means a forward
        between backward and step, which must see the old parameters."""
        if (self.optimizer is not None and not self._cancelled
                and any(self.model.reducer.reduce_scatters_since_step)):
            self.cancel()

    def cancel(self) -> None:
        """A forward between backward and step must see the old parameters.

        (Gradient accumulation without no_sync(): forward, backward, forward,
        backward, step.) Undo the speculative steps, send the restored slices
        again, and speculate no more until the step. How far stage 1 got
        depends on timing, so first every stage-1 bucket is speculated (all
        were launched when the backward ended): then every rank undoes and
        re-sends the same buckets in the same order. Whether to cancel depends
        only on the reductions launched, which every rank launches alike.
        """
        optimizer = self.optimizer
        self.finish_stage1()
        for b in sorted(self.speculated):
            self.model.finish_param_all_gather(b)
            self.speculated[b][0].restore(self.model.buckets[b].param_shard,
                                          optimizer._bucket_pieces[b], optimizer.optim.state)
            optimizer._bucket_sq.pop(b, None)
            self.model.start_param_all_gather(b)
            self.rollbacks += 1
        self.speculated = {}
        self._next = len(self.plan.stage1)
        self._cancelled = True

    def end_step(self, would_commit: bool) -> None:
        self.speculating = would_commit
        self._next = 0
        self.speculated = {}
        self._cancelled = False
