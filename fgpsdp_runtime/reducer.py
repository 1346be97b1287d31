"""Gradient reduction: backward hooks, bucket readiness, ordered reduce-scatters.

Timeline of one synchronised backward (one process group, ``flat``)::

    backward compute : [grads of bucket 0][grads of bucket 1][grads of bucket 2]
    reduce-scatter   :                   [RS 0]             [RS 1]      [RS 2]
                                          ^ bucket 0 full, launched async
    end of backward  :  callback flushes buckets holding unused parameters

[Note: launch order]
Collectives on a process group must be issued in the same order on every
rank. A bucket is therefore launched only after every bucket before it has
been launched (as torch DDP does): a rank whose bucket 1 fills before bucket 0
waits with bucket 1. Buckets with parameters that got no gradient on this rank
are launched by the end-of-backward callback, or at the latest by
``finish_gradient_sync`` (called from the optimizer step on every rank), with
zeros for the missing gradients. Every rank thus issues the same sequence of
reduce-scatters whatever its data-dependent control flow, and an unused
parameter can never hang a step.
"""
from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Mapping
from typing import Any, Callable, Iterator, Sequence

import torch

from .buckets import BucketStorage, to_bucket_order
from .lifecycle import HookHandles
from .link_worker import PendingOp
from .ops import multi_tensor_pack
from .tracing import Timeline
from .user_warnings import warn_at_user_code


def _tensors_in(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """The tensors of a forward's output: in tuples, lists, dicts (a
    HuggingFace ModelOutput is one) and dataclasses, as torch DDP looks for them."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth > 8:
        return
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item, depth + 1)
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors_in(item, depth + 1)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from _tensors_in(getattr(value, field.name, None), depth + 1)


def in_backward() -> bool:
    """True when called from inside a backward (a hook, a recomputation)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def _in_compiled_autograd() -> bool:
    """Whether this backward runs under compiled autograd (private: False elsewhere)."""
    try:
        from torch._dynamo import compiled_autograd
    except ImportError:
        return False
    # (torch 2.4 names it compiled_autograd_enabled)
    return bool(getattr(compiled_autograd, "in_compiled_autograd_region",
                        getattr(compiled_autograd, "compiled_autograd_enabled", False)))


class GradientReducer:
    """Packs gradients into buckets and reduce-scatters them during backward."""

    def __init__(self, params: Sequence[torch.nn.Parameter], param_names: Sequence[str],
                 buckets: Sequence[BucketStorage], exchange, world_size: int,
                 timeline: Timeline, *, launch_during_backward: bool = True):
        self.params = list(params)
        self.param_names = list(param_names)
        self.buckets = list(buckets)
        self.exchange = exchange  # comm.FlatExchange or comm.HierarchicalExchange
        self.timeline = timeline
        # DDP averages: every rank's gradient is pre-scaled by 1/N and summed.
        self.grad_scale = 1.0 / world_size
        # param index -> (bucket index, span)
        self.slot = {}
        for b, storage in enumerate(self.buckets):
            for span in storage.layout.spans:
                self.slot[span.param_index] = (b, span)
        self.sync_enabled = True  # False inside no_sync()
        # Whether backward reduces: sync_enabled at the last grad-enabled forward
        # through the wrapper, as torch DDP decides at forward (a forward inside
        # no_sync() whose backward runs outside it accumulates locally; one outside
        # whose backward runs inside reduces). True before any forward.
        self.backward_sync = True
        # False for the "serial" schedule: buckets are packed during backward
        # and reduced when backward has ended.
        self.launch_during_backward = launch_during_backward
        # Called with the bucket index when a bucket's gradients are all packed
        # (profilers record when backward compute finished each bucket).
        self.bucket_ready_listeners: list[Callable[[int], None]] = []
        # Called with (bucket, PendingOp, reduce-scatters of it since the step or
        # zero_grad()) as each reduce-scatter is launched (the two-stage
        # scheduler's hand-over).
        self.reduce_scatter_listeners: list[Callable[[int, PendingOp, int], None]] = []
        # perf_counter at a backward's first hook (an output's, else a parameter's)
        self.backward_started_at = 0.0
        # Called once a synchronised backward has ended and its buckets are launched.
        self.backward_end_listeners: list[Callable[[], None]] = []
        # Called as a synchronised backward starts (its outputs' first gradient, before
        # it reads any parameter; else at its first parameter's gradient).
        self.backward_start_listeners: list[Callable[[], None]] = []
        # Called before a round's first reduce-scatter is launched (model.join()
        # announces it).
        self.round_start_listeners: list[Callable[[], None]] = []
        # Reduce-scatters launched per bucket since the last step or zero_grad()
        # (the rounds a step would use, or a zero_grad() has dropped), and in all.
        self.reduce_scatters_since_reset = [0] * len(self.buckets)
        self.reduce_scatters_launched = 0
        self._hook_handles = HookHandles()
        self._grad_accumulators: list[Any] = []  # the nodes carrying our hooks
        self._in_flight: dict[int, PendingOp] = {}
        self._callback_queued = False
        self._grads_in_backward = False  # a parameter's hook ran since the callback was queued
        # Every bucket was launched in this backward: a later gradient is a second one.
        self._round_done_in_backward = False
        self._round_launched = False  # a full round of reduce-scatters since the last step
        self._reset_backward_state()
        # Parameters that received a gradient on this rank since the last
        # reset_used(); summed over ranks to tell globally unused ones apart.
        # The hooks write the bytes (a tensor's item assignment costs microseconds
        # per parameter, a third of a hook on a model of small tensors); the
        # tensor shares them, for the all-reduce.
        self._used_flags = bytearray(len(self.params))
        self.locally_used = torch.frombuffer(self._used_flags, dtype=torch.bool) \
            if self.params else torch.zeros(0, dtype=torch.bool)
        # An optimizer step ran since the last zero_grad(): a backward adding to
        # the reduced gradients then, and a step using them, is most likely a loop
        # that zeroes them where they are not (model.module, param.grad): warned
        # of once, at that step. (GAN loops add to D's gradients in G's backward,
        # after D's step, and zero them before D's next backward: no warning.)
        self._stepped_since_zeroed = False
        self._added_after_step = False
        # A gradient of this rank's reached the reducer since the last step: a round
        # launched by a step alone (opt.step() twice on one backward's gradients)
        # adds zeros, nothing to warn of.
        self._gradient_since_step = False
        self._report_accumulation = False  # said at the end of the step (end_step)
        self._warned_accumulating_across_step = False

    # -- per-backward state -------------------------------------------------

    def _reset_backward_state(self) -> None:
        self._missing = [len(s.layout.spans) for s in self.buckets]
        self._seen = [False] * len(self.params)  # got its gradient in this backward
        self._held: list[list[tuple]] = [[] for _ in self.buckets]  # (span, grad) not packed yet
        self._bucket_packed = [False] * len(self.buckets)
        self._next_to_launch = 0

    def discard_unfinished_backward(self) -> bool:
        """Outside backward: a backward whose end-of-backward callback never ran
        (an exception raised in it, caught by the loop) left gradients held or
        packed and not reduced. Drop them, so the next backward starts a round
        of its own; reductions it launched have landed in the slices, where
        zero_grad() resets them. Every rank whose backward raised alike drops
        alike. Returns whether there was one."""
        if not self._callback_queued or in_backward():
            return False
        self._callback_queued = False
        self._grads_in_backward = False
        self._round_done_in_backward = False
        self.wait_all()
        self._reset_backward_state()
        return True

    def reset_used(self) -> None:
        self.locally_used.zero_()

    def gradients_zeroed(self) -> None:
        self._stepped_since_zeroed = False
        self._added_after_step = False
        self.reduce_scatters_since_reset = [0] * len(self.buckets)

    @property
    def adds_to_stepped_gradients(self) -> bool:
        """A step has run since the last zero_grad(): a round now adds to what it used."""
        return self._stepped_since_zeroed

    # -- hooks -------------------------------------------------------------

    def register_hooks(self) -> None:
        # On each parameter's gradient accumulator node, not the tensor: a node's
        # hooks run after every post-accumulate-grad hook of its tensor, so a user's
        # hook registered after wrapping still sees (and may edit) the local
        # gradient before it is packed, as under torch DDP, whose reducer hooks the
        # same node. The node lives only while something holds it (the parameter
        # keeps a weak reference), so the reducer keeps it: a new node made at the
        # next forward would carry no hook.
        self._grad_accumulators = []
        with torch.enable_grad():
            for index, param in enumerate(self.params):
                if index not in self.slot:
                    continue  # empty parameter: nothing to reduce
                accumulator = param.view_as(param).grad_fn.next_functions[0][0]
                self._grad_accumulators.append(accumulator)
                self._hook_handles.add(accumulator.register_hook(self._make_hook(index)))

    def remove_hooks(self) -> None:
        self._hook_handles.remove()
        self._grad_accumulators = []

    def _make_hook(self, index: int) -> Callable[..., None]:
        # Weak: a node's hooks live in C++, where the garbage collector cannot see
        # them, so a strong reference would keep this reducer (and the wrapper, its
        # threads and buckets) alive as long as the parameter's node (a backward
        # graph may hold it), and its hooks taking the gradients of a later wrapper
        # of the module.
        reducer_ref = weakref.ref(self)

        # Autograd calls this from inside a compiled training step too (the backward
        # is a graph break, dynamo's frame callback still set): run it as it is, as
        # the optimizer's calls run, not traced (one recompile per parameter index).
        @torch.compiler.disable
        def hook(grad_inputs, grad_outputs) -> None:
            reducer = reducer_ref()
            if reducer is not None:
                reducer._on_grad_accumulated(index, reducer.params[index])
        return hook

    def _on_grad_accumulated(self, index: int, param: torch.Tensor) -> None:
        if not self.backward_sync:
            return  # no_sync(): the gradient stays in param.grad, accumulating
        grad = param.grad
        if grad is None:
            return
        self._refuse_unsupported_gradient(index, param, grad)
        if not self._callback_queued:
            self._queue_backward_end()  # no output hook ran: see watch_outputs
        elif self._round_done_in_backward:
            # Every parameter had its gradient in this backward already.
            raise RuntimeError(self._second_gradient_message(index))
        self._grads_in_backward = True
        self._gradient_since_step = True
        b, span = self.slot[index]
        param.grad = None  # the reducer holds it until the bucket is packed
        self._used_flags[index] = 1
        if self._seen[index]:
            self._accumulate_second_gradient(index, b, span, grad)
            return
        self._seen[index] = True
        self._held[b].append((span, grad))
        self._missing[b] -= 1
        if self._missing[b] == 0:
            self._pack_bucket(b)
            if self.launch_during_backward:
                self._launch_ready_in_order()

    def _refuse_unsupported_gradient(self, index: int, param: torch.Tensor,
                                     grad: torch.Tensor) -> None:
        if grad.is_sparse:
            raise RuntimeError(
                f"fgpsdp: parameter '{self.param_names[index]}' received a sparse gradient; "
                "sparse gradients are not supported (use nn.Embedding(sparse=False))")
        if grad.shape != param.shape:
            # Autograd checks the shape of what it accumulates; a hook that swaps
            # param.grad (or its .data) afterwards is not checked, and a smaller
            # tensor would be packed with the rest of its span left stale.
            raise RuntimeError(
                f"fgpsdp: parameter '{self.param_names[index]}' of shape "
                f"{tuple(param.shape)} holds a gradient of shape {tuple(grad.shape)} (did a "
                "hook replace param.grad?); a gradient must have its parameter's shape")

    def _accumulate_second_gradient(self, index: int, b: int, span, grad: torch.Tensor) -> None:
        """A parameter used across two backward graphs of one backward call."""
        if b < self._next_to_launch:
            raise RuntimeError(self._second_gradient_message(index))
        if self._bucket_packed[b]:
            dst = BucketStorage.span_view(self.buckets[b].send_buffer, span)
            dst.add_(to_bucket_order(grad, span.strides), alpha=self.grad_scale)
        else:
            held = self._held[b]
            for i, (held_span, held_grad) in enumerate(held):
                if held_span is span:
                    held[i] = (span, held_grad + grad)
                    break

    def _second_gradient_message(self, index: int) -> str:
        return (f"fgpsdp: parameter '{self.param_names[index]}' received a second gradient "
                "after its bucket was reduced in this backward: it is used in a "
                "torch.utils.checkpoint(use_reentrant=True) region and again in this "
                "backward (shared weights, used inside and outside the region, or two "
                "forwards before one backward), and the region's nested backward hands "
                "over its gradient apart. Not supported: use use_reentrant=False, which "
                "hands over one gradient (for shared weights torch DDP needs "
                "static_graph=True)")

    def _pack_bucket(self, b: int) -> None:
        """All held gradients of bucket b into its send buffer: one fused, scaled copy.

        On CUDA the copy runs on the current stream with no wait for the streams
        that produced the held gradients, which is safe because there is one: a
        node's hooks run on the node's stream, and autograd runs a gradient
        accumulator on the stream it was made on (after making that stream wait for
        the gradient's producer, a side stream of the forward's included).
        register_hooks makes every accumulator at once, so every hook, and the
        launch of each reduce-scatter, runs on that one stream; the end-of-backward
        flush runs on the caller's stream, which autograd makes wait for the
        accumulators' streams before the callback. (An accumulator node alive from
        before wrapping, kept by a graph made under another stream, would be reused
        on its own stream: not handled.)"""
        storage = self.buckets[b]
        pending = self._in_flight.pop(b, None)
        if pending is not None:  # a previous backward's reduce-scatter still uses it
            pending.wait()
        send = storage.acquire_send_buffer()
        held = self._held[b]
        # In the span's memory order: a view for gradients laid out like their
        # parameter (as autograd lays them out), see buckets.py.
        # (A row-major gradient goes as it is: the kernels take any contiguous tensor.)
        # (A gradient without history, as backward leaves them, goes without a detach.)
        multi_tensor_pack([(g.detach() if g.requires_grad else g)
                           if sp.strides is None and g.is_contiguous()
                           else to_bucket_order(g.detach(), sp.strides).contiguous()
                           for sp, g in held], send,
                          [sp.bucket_offset for sp, _ in held], self.grad_scale)
        self._held[b] = []
        self._bucket_packed[b] = True
        for listener in self.bucket_ready_listeners:
            listener(b)

    def note_forward(self, output: Any) -> None:
        """After a forward through the wrapper: a grad-enabled one decides whether
        the next backward reduces, and watches its outputs if it does."""
        if not torch.is_grad_enabled():
            return  # an eval forward changes nothing, as under torch DDP
        self.backward_sync = self.sync_enabled
        if self.backward_sync:
            self.watch_outputs(output)

    def watch_outputs(self, output: Any) -> None:
        """After a forward: hooks on its output tensors queue the end-of-backward
        callback on the backward that runs through them.

        [Note: reentrant checkpointing]
        The callback runs when the graph task it was queued on ends. Queued by
        the first parameter's hook, it would belong to whatever task that
        hook runs in: under torch.utils.checkpoint(use_reentrant=True) that
        may be the nested backward of one checkpointed segment, whose end
        would then flush every bucket the later segments have not reached
        (zeros, a round per segment) and let two_stage step parameters that
        their recomputation still reads. The forward's outputs get their
        gradients in the outermost task, before any parameter does (as FSDP's
        root pre-backward hooks). Outputs holding no tensor fall back to the
        first parameter's hook.
        """
        reducer_ref = weakref.ref(self)

        @torch.compiler.disable  # see _make_hook
        def hook(grad: torch.Tensor) -> None:
            reducer = reducer_ref()
            if reducer is not None and reducer.backward_sync and not reducer._callback_queued:
                reducer._queue_backward_end()

        for tensor in _tensors_in(output):
            # Not leaves: a hook on a leaf (a parameter returned as is) would stay
            # on it for good, one more per forward.
            if tensor.requires_grad and tensor.grad_fn is not None:
                tensor.register_hook(hook)

    @torch.compiler.disable  # see _make_hook
    def _queue_backward_end(self) -> None:
        # Runs once the whole backward has finished: flushes buckets whose
        # parameters got no gradient on this rank.
        if _in_compiled_autograd():
            raise RuntimeError(
                "fgpsdp: compiled autograd (torch._dynamo.config.compiled_autograd) is not "
                "supported: the reducer needs the end of backward, which it cannot see "
                "there; turn it off (torch.compile of the forward works)")
        torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
        self._callback_queued = True
        self.backward_started_at = time.perf_counter()
        for listener in self.backward_start_listeners:
            listener()

    @torch.compiler.disable  # autograd's end-of-backward callback: see _make_hook
    def _on_backward_end(self) -> None:
        # Every schedule reduces once per backward ("serial" only here, at the
        # end), so accumulating over several backwards sums the same way.
        # A backward through the outputs that reached no parameter of ours
        # (torch.autograd.grad for an input gradient penalty) is no round.
        self._callback_queued = False
        self._round_done_in_backward = False
        grads_in_backward, self._grads_in_backward = self._grads_in_backward, False
        if self.backward_sync and grads_in_backward:
            self.flush()
            for listener in self.backward_end_listeners:
                listener()
        if self.timeline.enabled:
            self.timeline.add("compute", "backward (from first gradient)",
                              self.backward_started_at, time.perf_counter())

    # -- launching ---------------------------------------------------------

    def _launch_ready_in_order(self) -> None:
        while (self._next_to_launch < len(self.buckets)
               and self._bucket_packed[self._next_to_launch]):
            self._start_reduce_scatter(self._next_to_launch)
            self._next_to_launch += 1
        if self._next_to_launch == len(self.buckets):
            self._reset_backward_state()
            self._round_launched = True
            self._round_done_in_backward = self._callback_queued

    def _round_in_progress(self) -> bool:
        return self._next_to_launch > 0 or any(self._seen)

    def flush(self) -> None:
        """Launch every bucket not launched yet in this backward, in order.

        Parameters without a gradient in this backward contribute what their
        ``.grad`` holds (left there by no_sync() iterations), or zeros.
        """
        if self._round_in_progress():
            self._fill_missing_and_launch()

    def _fill_missing_and_launch(self) -> None:
        for b in range(self._next_to_launch, len(self.buckets)):
            if self._bucket_packed[b]:
                continue
            zero_spans = []
            for span in self.buckets[b].layout.spans:
                index = span.param_index
                if self._seen[index]:
                    continue
                param = self.params[index]
                if param.grad is not None:  # left by no_sync() iterations
                    self._refuse_unsupported_gradient(index, param, param.grad)
                    self._held[b].append((span, param.grad))
                    param.grad = None
                    self._used_flags[index] = 1
                    self._gradient_since_step = True
                else:
                    zero_spans.append(span)
                self._seen[index] = True
            self._missing[b] = 0
            self._pack_bucket(b)
            send = self.buckets[b].send_buffer
            for span in zero_spans:
                BucketStorage.span_view(send, span).zero_()
        self._launch_ready_in_order()

    def _start_reduce_scatter(self, b: int) -> None:
        if b == 0:
            for listener in self.round_start_listeners:
                listener()
        storage = self.buckets[b]
        send = storage.acquire_send_buffer()
        if storage.grad_shard_valid or send.dtype != storage.grad_shard.dtype:
            # Received apart, then added (gradients accumulate across backwards
            # until zero_grad()) or cast in (reduced in another dtype).
            received = torch.empty(storage.grad_shard.numel(), dtype=send.dtype,
                                   device=send.device)
            if storage.grad_shard_valid:
                self._added_after_step |= self._stepped_since_zeroed and self._gradient_since_step
                land = storage.grad_shard.add_
            else:
                land = storage.grad_shard.copy_
                storage.grad_shard_valid = True

            def on_done(storage=storage, received=received, land=land):
                land(received)
                if received.is_cuda:  # read on the waiter's stream: the scheduler's, maybe
                    received.record_stream(torch.cuda.current_stream(received.device))
                storage.release_send_buffer()
        else:
            received = storage.grad_shard
            storage.grad_shard_valid = True

            def on_done(storage=storage):
                storage.release_send_buffer()
        op = self.exchange.start_reduce_scatter(received, send, label=f"b{b}")
        op.on_done = on_done
        self._in_flight[b] = op
        self.reduce_scatters_since_reset[b] += 1
        self.reduce_scatters_launched += 1
        for listener in self.reduce_scatter_listeners:
            listener(b, op, self.reduce_scatters_since_reset[b])

    # -- finishing ---------------------------------------------------------

    def finish_gradient_sync(self) -> None:
        """Make every bucket's grad_shard hold the reduced gradient.

        Called on every rank by the optimizer step. A rank whose backward
        reached no hook since the last step (its loss did not depend on any
        parameter, or every backward ran under no_sync()) still launches a
        full round, with zeros or its no_sync() leftovers, so that the
        sequence of collectives matches the other ranks'.
        """
        self.launch_pending_round()
        self.wait_all()
        self._round_launched = False

    def holds_unreduced_gradients(self) -> bool:
        """Gradients a backward under no_sync() left in ``param.grad``, which no round
        has reduced yet (the step's finish_gradient_sync would). Not zeros (a
        ``zero_grad(set_to_none=False)`` since): reduced apart, they change nothing the
        step computes (the sign of a -0.0 aside)."""
        left = [self.params[index].grad for index in self.slot
                if self.params[index].grad is not None]
        # (One synchronisation for them all on a GPU, not one per parameter.)
        return bool(left) and bool(torch.stack([grad.any() for grad in left]).any())

    def launch_pending_round(self) -> None:
        """finish_gradient_sync's launch: a round not (fully) launched since the
        last step is launched now, the same on every rank."""
        if self._round_in_progress() or not self._round_launched:
            self._fill_missing_and_launch()

    def launch_round_of_zeros(self) -> None:
        """A joined rank's part in the others' backward (model.join()): a round of
        reduce-scatters of zero gradients, as a backward reaching no parameter."""
        self._fill_missing_and_launch()
        for listener in self.backward_end_listeners:
            listener()

    def end_step(self, stepped_gradients: bool = True) -> None:
        """``stepped_gradients``: some rank's backward fed the step (the same on every rank)."""
        self.reduce_scatters_since_reset = [0] * len(self.buckets)
        self._report_accumulation = self._added_after_step
        self._stepped_since_zeroed |= stepped_gradients
        self._added_after_step = False
        self._gradient_since_step = False

    def report_accumulation(self) -> None:
        """At the very end of a step (a warning raised as an error leaves it whole)."""
        if self._report_accumulation and not self._warned_accumulating_across_step:
            self._warned_accumulating_across_step = True
            warn_at_user_code(
                "fgpsdp: opt.step() used gradients added to those of the previous step: no "
                "opt.zero_grad() or model.zero_grad() between them. With no zeroing at all "
                "torch DDP would add too; but the reduced gradients are not in param.grad, "
                "so zeroing through a submodule's zero_grad() or param.grad = None, which "
                "torch DDP would have taken, does not reset them, nor does the zero_grad() "
                "of an optimizer wrapping this one over its param_groups (timm's "
                "Lookahead inherits torch's, which clears only the slices' .grad): call "
                "opt.zero_grad(), model.zero_grad() or model.module.zero_grad().")
        self._report_accumulation = False

    def landed(self, b: int) -> bool:
        """Bucket b's last reduce-scatter has landed (or none is in flight)."""
        op = self._in_flight.get(b)
        return op is None or op.done()

    def wait_bucket(self, b: int) -> None:
        op = self._in_flight.pop(b, None)
        if op is not None:
            op.wait()

    def wait_all(self) -> None:
        for b in sorted(self._in_flight):
            self._in_flight.pop(b).wait()
