"""The scheduler thread that executes the stage-1 part of an OverlapPlan.

Timeline of one step under ``two_stage`` (buckets 0..3; plan stage1=[0, 1, 2])::

    main thread   : [backward b0][b1][b2][b3] .......... step: wait RS, join, norm,
                                                         commit/roll back, step b3
    reduce-scatter:          [RS b0][RS b1][RS b2]  [RS b3]
    scheduler     :                 [spec b0][spec b1]   [spec b2]
    all-gather    :                         [AG b0]  [AG b1]   [AG b2]   [AG b3] (stage 2,
                                                                          next forward)

The backward hooks hand each stage-1 bucket's reduce-scatter to the scheduler
thread as they launch it. The thread takes the plan's stage-1 buckets strictly
in order: it waits for the bucket's reduce-scatter, steps this rank's slice
speculatively (keeping an undo record), and starts the bucket's all-gather.
The all-gathers are thus issued in the plan's order on every rank, whatever
the timing. At the step the main thread hands over the rest (every
reduce-scatter has landed by then) and joins; only then does it read the
speculative results, so nothing is shared while the thread runs except
tensors the backward no longer reads (a ready bucket's parameters).

[Note: parameters the backward still reads]
A ready bucket's parameters are read by no later backward node when every
saved copy of them leads to their own gradient. A model may also save one
through ``.detach()`` (``F.linear(h, self.out.weight.detach())``): a node
that runs after the gradient is complete then reads the value. Recording
forwards note a parameter's ``.detach()`` or ``.data`` taken, and a view of one
without autograd history read with gradients on (forward_waits.py;
whether it is saved is not looked at: unpacking saved tensors would rerun
checkpointed regions); a rank that saw one hands its stage-1 buckets to the
thread only when the backward has ended (the same buckets in the same order:
the all-gathers still pair across ranks).
Every in-place change of the parameters (a step, an undo) also bumps their
autograd version counters, as torch's optimizers' in-place updates do: a
backward that still holds their old values (a second backward through a
retained graph) raises torch's "modified by an inplace operation" instead of
computing with the new ones; such a backward first waits for stage 1 to end
(on_backward_start), so that every rank sees the counters bumped.

[Note: scheduler thread lifetime and errors]
The thread is a daemon: it never keeps the process alive. It is started at
the first step that speculates. An exception raised in a speculative step
(an out-of-memory error in its undo record, a hyperparameter the loop set
to a value the optimizer refuses while the thread was stepping) is most
often raised on one rank only, and depends on timing. So the thread undoes
that step and goes on through the rest of stage 1 without stepping,
starting each bucket's all-gather all the same (and bumping its parameters'
version counters, as a step would: a second backward through a retained
graph then fails alike on every rank): the all-gathers stay paired with the
other ranks'. The error waits for the step, whose all-reduce tells every
rank that some rank's speculative step raised: every rank then undoes its
speculative steps, sends the restored slices, skips the step, stops
speculating for the rest of the run and raises the same exception (a failing
rank its own; the others the lowest failing rank's, sent pickled), so that a
loop catching its type (torch.cuda.OutOfMemoryError) catches it on every rank
as from torch's step. A round zero_grad() drops before any step has no step
to fail: the error is dropped with a warning on its rank (torch's step, which
would have raised it, never ran), and the next round speculates on every
rank alike.
On CUDA it runs on a stream of its own (``speculation_stream``), so the
speculative optimizer steps overlap backward kernels; joins order the main
stream after it.
"""
from __future__ import annotations

import pickle
import queue
import threading
import time
import warnings
import weakref
from typing import TYPE_CHECKING, Optional

import torch

from . import shutdown
from .backends import objects_on
from .object_collectives import all_gather_objects
from .plan import OverlapPlan
from .thread_settings import ThreadSettings

if TYPE_CHECKING:  # pragma: no cover
    from .optim import ShardedOptimizer

_JOIN = object()  # queue marker: speculate what is left of stage 1, then report


class TwoStageScheduler:
    def __init__(self, model, plan: OverlapPlan):
        # Weak: the thread must not keep a wrapper the loop has dropped alive
        # (its __del__ stops the thread).
        self._model_ref = weakref.ref(model)
        self.plan = plan
        # Weak: a ShardedOptimizer the loop has dropped may be freed (and replaced).
        self._optimizer_ref: Optional[weakref.ref] = None
        # bucket -> (SliceBackup, reduce-scatters it had received when stepped)
        self.speculated: dict[int, tuple] = {}
        self.rollbacks = 0  # buckets rolled back so far (clipping, inf/NaN, unused)
        self.commits = 0
        # No speculation until the step or zero_grad(): a forward came between
        # backward and step (cancel()), or the round adds to gradients a step
        # has used (see on_reduce_scatter).
        self._round_excluded = False
        # Speculate only while the previous step would have committed: while
        # clipping is active every speculative step is undone and its
        # all-gather sent twice. Decided from all-reduced figures, so every
        # rank speculates in the same steps.
        self.speculating = True
        # A forward (or zero_grad()) came after this step's first reduction:
        # gradient accumulation without no_sync(), most likely (see end_step).
        self._read_before_step = False
        # Set once speculation can never pay off in this run (and why): the
        # loop sets the optimizer's hyperparameters between backward and step,
        # so every speculative step would be redone.
        self.stopped_because: Optional[str] = None
        # While a rank has joined (model.join()): see suspend_speculation.
        self._suspended = False
        self._stop_to_report = False
        # Per step, owned by the thread between the first hand-over and the join.
        self._handed: set[int] = set()  # stage-1 buckets handed to the thread this step
        # Handed over at the backward's end (see [Note: parameters the backward still reads]).
        self._deferred: list[tuple] = []
        # bucket -> (reduce-scatter op, its count, CUDA event of the handing stream or None)
        self._arrived: dict[int, tuple] = {}
        self._next = 0  # position in plan.stage1 of the next bucket to speculate
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._joined = threading.Event()
        self._join_ready = None  # CUDA: the main stream at the last join (finish_stage1)
        # This round's first error in a speculative step, until the step takes it
        # (see [Note: scheduler thread lifetime and errors]), and the stage-1
        # buckets sent since without a step.
        self._error: Optional[BaseException] = None
        # Items put for the thread, and those it has handled (see ..._once_settled):
        # a flag the thread set after its get() left a moment in which a waiter saw
        # an empty queue and no work while it held a bucket.
        self._put_count = 0
        self._handled_count = 0  # written by the thread only
        self._put_lock = threading.Lock()  # hooks may hand over from autograd's threads
        self.sent_unstepped: list[int] = []
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        device = model.buckets[0].device if model.buckets else torch.device("cpu")
        self.device = device
        # CUDA: speculative steps run beside the backward kernels.
        self.speculation_stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        # The loop thread's per-thread settings, recorded at each forward, and what
        # the scheduler thread adopted last (see thread_settings.py).
        self._loop_settings = self._settings_of_this_thread()
        self._adopted: Optional[ThreadSettings] = None

    def _settings_of_this_thread(self) -> ThreadSettings:
        # The flush-to-zero mode matters only to CPU arithmetic (see thread_settings.py).
        return ThreadSettings.of_this_thread(probe_flush_denormal=self.device.type == "cpu")

    @property
    def model(self):
        return self._model_ref()

    @property
    def optimizer(self) -> Optional["ShardedOptimizer"]:
        return self._optimizer_ref() if self._optimizer_ref is not None else None

    def attach(self, optimizer: "ShardedOptimizer") -> None:
        """Between steps (the wrapper allows one live ShardedOptimizer at a time)."""
        self._optimizer_ref = weakref.ref(optimizer)
        self.speculated = {}

    def set_plan(self, plan: OverlapPlan) -> None:
        """Between steps only (the optimizer's step calls it when a profile is done)."""
        self.plan = plan

    # -- main thread: hand-over from the backward hooks ------------------------

    def on_reduce_scatter(self, b: int, op, count: int) -> None:
        """Reducer listener: bucket b's reduce-scatter number ``count`` since the last
        step or zero_grad()."""
        if self.model.reducer.adds_to_stepped_gradients:
            # A round after a step and before zero_grad(): a GAN's D in G's
            # backward (D zeroes them before its own next backward), or a loop
            # that never zeroes. Its gradients are rarely stepped; speculating
            # would step D with G's gradients, to be undone (and re-sent) at
            # zero_grad(), and would put those values in D's module meanwhile.
            # Every rank steps and zeroes alike, so every rank decides alike.
            self._round_excluded = True
        if (self.optimizer is None or self._round_excluded or not self.speculating
                or b in self._handed or b not in self.plan.stage1):
            return
        self._handed.add(b)
        if self.model.backward_may_read_detached_params:
            self._deferred.append((b, op, count))
            return
        self._hand_over(b, op, count)

    def on_backward_end(self) -> None:
        """Reducer listener (main thread): the backward reads no parameter any more."""
        deferred, self._deferred = self._deferred, []
        for item in deferred:
            self._hand_over(*item)

    def _hand_over(self, b: int, op, count: int) -> None:
        self._start_thread()
        # The speculative step must follow what this stream queued so far: an
        # event the thread waits for just before this bucket's step (a wait put
        # on the speculation stream from here would also hold back the kernels
        # of an earlier bucket's step that the thread is still launching).
        self._put((b, op, count, self._current_stream_event()))

    def _put(self, item) -> None:
        with self._put_lock:
            self._put_count += 1
        self._queue.put(item)

    def _current_stream_event(self):
        if self.speculation_stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def finish_stage1(self) -> None:
        """At the step: every stage-1 bucket not yet speculated, in plan order; then join.

        Every reduce-scatter has landed when this is called.
        """
        if self.optimizer is None or not self.speculating or self._round_excluded:
            return
        self.on_backward_end()  # anything still deferred
        self._start_thread()
        # A stage-1 bucket never handed over (the optimizer was built after the
        # backward) is stepped at the join with no op to wait for: its gradient
        # landed on this stream (the reduce-scatters' waits), which its step must
        # follow.
        self._join_ready = self._current_stream_event()
        self._joined.clear()
        self._put(_JOIN)
        # Not a bare wait: a close() from another thread (destroy_process_group())
        # between the check above and the put ends the thread before the join.
        while not self._joined.wait(0.1):
            if not self.is_alive():
                self._refuse_if_closed()
                raise RuntimeError("fgpsdp: the two_stage scheduler thread ended "
                                   "before the step's join")
        if self.speculation_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.speculation_stream)

    @property
    def failed(self) -> bool:
        """A speculative step raised on this rank since the last step took the error."""
        return self._error is not None

    def take_error(self) -> BaseException:
        """At a step whose all-reduce said some rank's speculative step raised (a
        collective: every rank calls it): the exception to raise, the same on every
        rank (see [Note: scheduler thread lifetime and errors]). Stage 1 stops for
        the rest of the run: its next speculative step would most likely raise
        again."""
        error, self._error = self._error, None
        self.speculating = False
        self.stop_speculating(f"a speculative step raised {error!r}" if error is not None
                              else "a speculative step raised on another rank", warn=False)
        mine = None
        if error is not None:
            try:  # (sent as bytes: a peer that cannot unpickle it falls back below)
                data = pickle.dumps(error)
            except Exception:  # noqa: BLE001 - not picklable: described in words
                data = None
            mine = (data, f"{type(error).__name__}: {error}")
        model = self.model
        with objects_on(model.device):
            gathered = all_gather_objects(mine, model.process_group,
                                          "speculative step failures")
        first = next(rank for rank, failure in enumerate(gathered) if failure is not None)
        where = "in a two_stage speculative step (the scheduler thread)"
        if error is None:
            data, description = gathered[first]
            try:
                error = pickle.loads(data) if data is not None else None
            except Exception:  # noqa: BLE001 - a class this process cannot rebuild
                error = None
            if not isinstance(error, BaseException):
                error = RuntimeError(f"fgpsdp: {description}")
            where = f"on rank {first} {where}"
        if hasattr(error, "add_note"):  # Python >= 3.11
            error.add_note(f"fgpsdp: raised {where}; this step was skipped on every rank, and "
                           "stage 1 is off for the rest of the run")
        return error

    # -- the thread -------------------------------------------------------------

    def _start_thread(self) -> None:
        self._refuse_if_closed()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fgpsdp-scheduler", daemon=True)
            self._thread.start()
            shutdown.register(self)  # stopped and joined at exit: see shutdown.py

    def _run(self) -> None:
        if self.speculation_stream is not None:
            torch.cuda.set_device(self.device)
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                if item is _JOIN:
                    self._advance(until_end=True)
                else:
                    b, op, count, ready = item
                    self._arrived[b] = (op, count, ready)
                    self._advance(until_end=False)
            except BaseException as error:  # not a step's: the link's, most likely
                if self._error is None:
                    self._error = error
                self._next = len(self.plan.stage1)
            finally:
                self._handled_count += 1
            if item is _JOIN:
                self._joined.set()

    def _advance(self, until_end: bool) -> None:
        stage1 = self.plan.stage1
        while self._next < len(stage1):
            b = stage1[self._next]
            arrived = self._arrived.pop(b, None)
            if arrived is None and not until_end:
                return
            op, count, ready = arrived if arrived is not None else \
                (None, self.model.reducer.reduce_scatters_since_reset[b], self._join_ready)
            if count == 0:
                # No reduction since the step or zero_grad() (one between backward
                # and step): nothing to step early. The same on every rank.
                self._next += 1
                continue
            self._speculate(b, op, count, ready)

    def _speculate(self, b: int, op, count: int, ready) -> None:
        if self.speculation_stream is not None:
            if ready is not None:
                self.speculation_stream.wait_event(ready)
            with torch.cuda.stream(self.speculation_stream):
                self._speculate_on_current_stream(b, op, count)
        else:
            self._speculate_on_current_stream(b, op, count)

    def _speculate_on_current_stream(self, b: int, op, count: int) -> None:
        timeline = self.model.timeline
        with timeline.span("scheduler", f"wait RS b{b}"):
            if op is not None:
                op.wait()
        if self._error is None:
            settings = self._loop_settings
            if settings != self._adopted:
                settings.adopt()
                self._adopted = settings
            try:
                with timeline.span("scheduler", f"spec step b{b}"):
                    backup = self.optimizer.speculative_step(b)  # undone if it raises
            except BaseException as error:  # see [Note: scheduler thread lifetime and errors]
                self._error = error
            else:
                self.speculated[b] = (backup, count)
        if self._error is not None:
            self.sent_unstepped.append(b)
            self.model.mark_params_changed([b])  # as a step would: see the Note
        self.model.start_param_all_gather(b)
        self._next += 1

    # -- main thread: a forward before the step, the step's end --------------------

    def holds_speculative_values(self) -> bool:
        """Between backward and step: stage-1 steps may have updated parameters. (Not
        once a step that raised part-way has decided what it keeps: they are then
        part of that unfinished step.) Buckets handed to the thread count while it
        may still step them; once it has failed (a link error: a peer gone) it steps
        none, and those it did step are recorded, so a survivor's save goes through."""
        if self._step_unfinished():
            return False
        may_step = bool(self._handed) and self._error is None
        return (may_step or bool(self.speculated)) and not self._round_excluded

    def holds_speculative_values_once_settled(self, timeout_s: float = 1.0) -> bool:
        """holds_speculative_values(), after waiting (at most ``timeout_s``, and only
        if it says yes) for the thread to handle the buckets handed to it or to
        fail: then it tells what the thread stepped, not what it might. For a save
        on a survivor of a failed peer (a peer gone fails its reduce-scatters at
        once), whose step raised on the exchange before the thread saw the same."""
        if not self.holds_speculative_values():
            return False
        deadline = time.monotonic() + timeout_s
        while (self._error is None
               and (self._handled_count < self._put_count or self._arrived)
               and time.monotonic() < deadline):
            time.sleep(0.002)
        return self.holds_speculative_values()

    def _step_unfinished(self) -> bool:
        """A step raised part-way after deciding what of stage 1 it keeps (see
        optim._UnfinishedStep): nothing is speculative any more, nor undone."""
        optimizer = self.optimizer
        return optimizer is not None and optimizer._unfinished is not None

    def on_backward_start(self) -> None:
        """Reducer listener (main thread): a backward starts before the step.

        A second backward of this step through a graph the first one ran through
        (``retain_graph=True``) reads parameters that stage 1 may be writing on
        the scheduler thread: whether it saw old values, new ones or torch's
        "modified by an inplace operation" depended on timing, on each rank
        apart (one rank raised, the other went on into the step's collectives).
        Finishing stage 1 first makes it the same on every rank: torch's error
        when it reads a speculated parameter, as after a step.
        """
        if self.holds_speculative_values():
            self.model.reducer.wait_all()
            self.finish_stage1()

    def before_forward(self) -> None:
        """Called by every forward, synchronize() and zero_grad() (on every rank):
        a reduction since the step (or zero_grad()) means a read between backward
        and step, which must see the old parameters, or a reset of what
        speculation used."""
        self._loop_settings = self._settings_of_this_thread()
        if self._step_unfinished():
            # (synchronize() or a save then: a forward or zero_grad() ends it first.)
            # Its committed speculative steps are part of it; undoing them would
            # resend, on this rank alone if it alone failed.
            return
        if any(self.model.reducer.reduce_scatters_since_reset) and not self._round_excluded:
            # Most likely gradient accumulation without no_sync(), which a loop
            # does on every step: see end_step. (An excluded round, a GAN's D in
            # G's backward, speculated nothing and says nothing of the next step.)
            self._read_before_step = True
            if self.optimizer is not None:
                self.cancel()

    def cancel(self) -> None:
        """A forward between backward and step must see the old parameters.

        (Gradient accumulation without no_sync(): forward, backward, forward,
        backward, step.) Undo the speculative steps, send the restored slices
        again, and speculate no more until the step or zero_grad(). How far
        stage 1 got depends on timing, so first every stage-1 bucket is
        speculated (all were launched when the backward ended): then every rank
        undoes and re-sends the same buckets in the same order. Whether to
        cancel depends only on the reductions launched, which every rank
        launches alike.
        """
        self.model.reducer.wait_all()
        self.finish_stage1()
        for b in self.undo_speculation():
            self.model.start_param_all_gather(b)
        self._round_excluded = True

    def undo_speculation(self) -> list[int]:
        """After the join: undo this round's speculative steps (each once its
        all-gather has landed) and return every stage-1 bucket sent this round, for
        the caller to send again: the same buckets on every rank, in order (those
        sent unstepped after an error included, as the other ranks re-send theirs)."""
        optimizer = self.optimizer
        sent = sorted(set(self.speculated) | set(self.sent_unstepped))
        for b in sent:
            self.model.finish_param_all_gather(b)
            if b in self.speculated:
                optimizer.restore_speculated(b, self.speculated[b][0])
                self.model.mark_params_changed([b])
                optimizer._bucket_sq.pop(b, None)
                self.rollbacks += 1
        if self.speculated:
            optimizer._step_wide_state.discard()  # what those steps counted is undone too
        self.speculated = {}
        self.sent_unstepped = []
        return sent

    def stop_speculating(self, reason: str, warn: bool = True) -> None:
        """For the rest of the run (every rank decides it alike: from all-reduced
        figures, or from a call every rank makes); said by report_stop() at the
        end of the step, so that a warning raised as an error cannot leave a
        step half done. ``stopped_because`` keeps the reason either way."""
        if self.stopped_because is None:
            self.stopped_because = reason
            self._stop_to_report = warn

    def suspend_speculation(self) -> None:
        """Speculate no more until resume_speculation(): from now if no round of
        reduce-scatters has begun since the step or zero_grad() (every rank tells
        alike), else from the step's end. Under model.join() a joined rank's
        speculative steps would run before the step shares the hyperparameters."""
        self._suspended = True
        if not any(self.model.reducer.reduce_scatters_since_reset):
            self.speculating = False

    def resume_speculation(self) -> None:
        """From the next step that would commit on."""
        self._suspended = False

    def end_step(self, would_commit: bool) -> None:
        # A step whose round was read before it (a forward between backward and
        # step) would have its speculation undone and its all-gathers sent twice;
        # the next step most likely does the same. Every rank reduces alike, so
        # every rank decides alike; a step without such a read speculates again.
        self.speculating = (would_commit and not self._read_before_step
                            and self.stopped_because is None and not self._suspended)
        self._read_before_step = False
        self._reset_round()

    def gradients_zeroed(self) -> None:
        """zero_grad(), after before_forward() has undone this round's speculation
        (the thread is idle): the next backward starts a round of its own, which
        may speculate."""
        if self._error is not None:  # no step of this round will raise it
            error, self._error = self._error, None
            warnings.warn(f"fgpsdp: a two_stage speculative step raised {error!r}; zero_grad() "
                          "dropped its round before opt.step(), which would have raised it",
                          RuntimeWarning)
        self._reset_round()

    def _reset_round(self) -> None:
        self._next = 0
        self.speculated = {}
        self.sent_unstepped = []
        self._handed = set()
        self._deferred = []
        self._arrived = {}
        self._round_excluded = False

    def report_stop(self) -> None:
        """The optimizer's last call in a step: the step is whole even if this raises."""
        if self._stop_to_report:
            self._stop_to_report = False
            warnings.warn(f"fgpsdp: two_stage stops speculating: {self.stopped_because}. Set "
                          "them before backward (lr_scheduler.step() after opt.step() does) "
                          "to keep stage 1.", RuntimeWarning)

    def close(self) -> None:
        """The thread ends once what was handed to it has run; a later hand-over or
        join raises (the thread would never take it, and the step wait forever)."""
        self._closed = True
        if self._thread is not None:
            self._queue.put(None)

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise RuntimeError("fgpsdp: the two_stage scheduler thread was stopped (its wrapper "
                               "was released, its process group destroyed, or the process is "
                               "exiting): no step can run")

    request_stop = close

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout: Optional[float] = None) -> None:
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
