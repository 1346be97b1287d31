"""DistributedDataParallel: the drop-in wrapper that owns buckets and hooks.

It composes the pure layout (layout.py), the bucket tensors (buckets.py), the
gradient reducer (reducer.py), the communicator (comm.py), the parameter
all-gathers (param_gathers.py) and the forward's waits for them
(forward_waits.py), the overlap plan (plan.py, plan_profiler.py) and the
two_stage scheduler (scheduler.py), and the guards on reads and writes of the
module's parameters (module_guards.py, param_guards.py). The optimizer
(optim.py) drives the per-step exchange through ``begin_param_exchange``,
``queue_param_all_gather`` and the ``finish_param_all_gather*`` methods below.
"""
from __future__ import annotations

import contextlib
import sys
import time
import warnings
import weakref
from typing import Any, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from . import lifecycle, shutdown
from .buckets import BucketStorage, layout_strides
from .buffer_broadcast import broadcast_coalesced, versions_kept
from .comm import CommStats, FlatExchange, HierarchicalExchange
from .comm_hooks import hook_reduction, hook_state_problem, reduce_dtype_problem
from .ddp_options import (buffer_sync, checked_arguments, ignored_names, named_device,
                          process_group_of, refuse_unsupported)
from .layout import (BucketLayout, ParamInfo, default_bucket_cap_mb, first_bucket_cap_bytes,
                     owned_numel, param_alignment_for, plan_buckets)
from .forward_waits import ForwardParamWaiter, is_traced_by_dynamo
from .held_param_reads import ParamsInFlight
from .gpu_setup import connect_nccl_groups, make_current_device
from .ignored_params import ignored_places, note_wrapper_leaving_parameters, parameters_at
from .group_collectives import all_reduce_held
from .param_gathers import ParamGathers
from .module_guards import (hand_out_parameters_through_the_wrapper,
                            land_gathers_before_state_dicts, land_gathers_on_attribute_reads,
                            reset_gradients, zero_grad_through_the_wrapper)
from .param_guards import ParamPlaces, ParamVersions, storage_address
from .plan import OverlapPlan, checked_plan, layout_plan, profiling_plan
from .plan_profiler import PlanProfiler
from .scheduler import TwoStageScheduler
from .profiling import nvtx_range
from .reducer import GradientReducer, in_backward
from .tracing import Timeline
from .topology import (NodeLayout, TopologyArg, check_contiguous_nodes, create_link_groups,
                       hashed_group_names, new_group_like, resolve)
from .uneven_inputs import AnnouncedCall, UnevenInputs
from .user_warnings import warn_at_user_code
from .validation import (agree_or_raise, describe, describe_buffers, local_problems,
                         settings_agree_or_raise, shared_memory_problem)


def _plan_setting(plan: Union[str, OverlapPlan]) -> Any:
    """What ranks must agree on of ``overlap_plan``: a name, or a plan's stages and
    lookahead as ints (not what it predicted of the times; numpy ints compare too)."""
    if isinstance(plan, str):
        return plan
    try:
        return (tuple(int(b) for b in plan.stage1), tuple(int(b) for b in plan.stage2),
                None if plan.lookahead is None else int(plan.lookahead))
    except (AttributeError, TypeError, ValueError):  # (not a plan: checked_plan says so)
        return repr(plan)


class DistributedDataParallel(nn.Module):
    """Partially sharded (ZeRO-2) data parallelism with torch DDP's interface.

    Gradients are averaged over ranks like DDP's, but each rank keeps only its
    slice of the reduced gradient and (through :class:`ShardedOptimizer`) of
    the optimizer state; updated parameters are all-gathered back into every
    rank's full replica.
    """

    # torch DDP's parameters (of 2.15; 2.13's end at forward_sync_buffers), in its
    # order (see ddp_options.py), then ours.
    def __init__(self, module: nn.Module, device_ids: Optional[Sequence[Any]] = None,
                 output_device: Any = None, dim: int = 0,
                 broadcast_buffers: Optional[bool] = None, init_sync: bool = True,
                 process_group: Optional[dist.ProcessGroup] = None,
                 bucket_cap_mb: Optional[float] = None,
                 find_unused_parameters: bool = False, check_reduction: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 delay_all_reduce_named_params: Any = None,
                 param_to_hook_all_reduce: Any = None, mixed_precision: Any = None,
                 device_mesh: Any = None, skip_all_reduce_unused_params: bool = False,
                 bucket_cap_mb_list: Optional[Sequence[float]] = None,
                 batched_grad_copy: bool = False,
                 forward_sync_buffers: Optional[bool] = None,
                 lazy_bucket_allocation: bool = False, *,
                 topology: TopologyArg = None, schedule: str = "two_stage",
                 overlap_plan: Union[str, OverlapPlan] = "auto",
                 reduce_dtype: Optional[torch.dtype] = None,
                 speculation_memory_mb: Optional[float] = None):
        # Who the finalizer belongs to: torch.compile's nn_module_proxy makes
        # stand-ins of a module (new objects of its class sharing its __dict__),
        # and their __del__ must release none of this wrapper's hooks, threads or
        # groups (see __del__). Set first: a failed __init__ is finalized too.
        self.__dict__["_finalizer_owner"] = id(self)
        super().__init__()
        refuse_unsupported(mixed_precision=mixed_precision,
                           delay_all_reduce_named_params=delay_all_reduce_named_params,
                           param_to_hook_all_reduce=param_to_hook_all_reduce)
        # Invalid arguments are said on every rank (by agree_or_raise below): one
        # given on one rank only would otherwise leave the others waiting there.
        args = checked_arguments(module, schedule=schedule, overlap_plan=overlap_plan,
                                 reduce_dtype=reduce_dtype,
                                 speculation_memory_mb=speculation_memory_mb,
                                 bucket_cap_mb=bucket_cap_mb,
                                 bucket_cap_mb_list=bucket_cap_mb_list, device_ids=device_ids)
        argument_problems, bucket_caps = args.problems, args.bucket_caps
        schedule, overlap_plan, reduce_dtype = args.schedule, args.overlap_plan, args.reduce_dtype
        speculation_memory_mb, bucket_cap_mb = args.speculation_memory_mb, args.bucket_cap_mb
        device_ids = args.device_ids
        if not dist.is_available() or not dist.is_initialized():
            if argument_problems:  # no group to tell: said here
                raise ValueError("fgpsdp: " + "; ".join(argument_problems))
            raise RuntimeError("fgpsdp: call torch.distributed.init_process_group() first")
        # output_device, dim, check_reduction, gradient_as_bucket_view,
        # static_graph, skip_all_reduce_unused_params, batched_grad_copy and
        # lazy_bucket_allocation are accepted for drop-in compatibility and change
        # nothing: outputs stay where the single-device module puts them, gradients
        # are released into the send buffer as soon as they are ready, packed by one
        # fused copy per bucket into a buffer that lives until its reduce-scatter
        # lands, and unused parameters are handled without knowing the graph (a
        # parameter no rank used keeps grad=None, as when DDP skips it).
        self.schedule = schedule
        self.module = module
        make_current_device(module)
        process_group = process_group_of(process_group, device_mesh)
        self.device_mesh = device_mesh
        # The group object, as torch DDP holds it (code calls model.process_group.size()).
        # The local stays None for the default group: topology.py tells it apart.
        self.process_group = process_group if process_group is not None \
            else dist.distributed_c10d._get_default_group()
        self._buffer_sync = buffer_sync(broadcast_buffers, forward_sync_buffers)
        self.forward_sync_buffers = self._buffer_sync.at_forward
        self.find_unused_parameters = find_unused_parameters
        self.device_ids = list(device_ids) if device_ids is not None else None
        self.output_device = output_device
        # As torch DDP keeps them, for code that reads them back.
        self.dim = dim
        self.static_graph = static_graph
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.lazy_bucket_allocation = lazy_bucket_allocation
        # torch DDP's manual backward finalization (torch 2.15): see finalize_backward.
        self._require_manual_backward_finalization = False
        self.mixed_precision = None
        self.require_forward_param_sync = True
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)

        subgroup_ranks = dist.get_process_group_ranks(process_group) \
            if process_group is not None and self.world_size < dist.get_world_size() else None
        try:
            self.topology: NodeLayout = resolve(topology, self.world_size, subgroup_ranks)
            topology_problems = []
        except (TypeError, ValueError) as error:  # said on every rank by agree_or_raise
            self.topology = NodeLayout(self.world_size, self.world_size, hierarchical=False)
            topology_problems = [str(error)]
        # The slice of every bucket this rank owns (not always its rank: see topology.py).
        self.slice_index = self.topology.slice_index(self.rank)

        # Left alone as torch DDP leaves them: neither broadcast nor compared across
        # ranks, nor reduced, nor in a bucket. Trainable ones (an expert-parallel
        # model's experts) are the user's to reduce, if at all, and to step with an
        # optimizer of their own.
        self._ignored_names = ignored_names(module)
        named = [(n, p) for n, p in module.named_parameters()  # tied ones appear once
                 if n not in self._ignored_names]
        trainable = [(n, p) for n, p in named if p.requires_grad]
        # Where each parameter left to the user lives (its module's path, its name
        # there), looked up at each use: the user may replace one, or its module, and
        # a walk of the whole module per zero_grad() took 0.8 ms on 1,000 parameters.
        self._ignored_places = ignored_places(module, self._ignored_names)
        # Every rank or none (the loss scaler agrees on the scale in a collective
        # while such a wrapper lives: see ShardedGradScaler.scale).
        self.has_ignored_trainable_parameters = bool(self.named_ignored_parameters())
        problems = argument_problems + topology_problems + local_problems(module, trainable) \
            + lifecycle.wrapped_elsewhere(trainable)
        if not problems:  # it bumps version counters: not those a live wrapper tracks
            shared = shared_memory_problem(trainable)
            problems += [shared] if shared is not None else []
        placement = check_contiguous_nodes(self.topology, process_group) \
            if self.topology.uses_hierarchy else None
        # What the ranks' collectives must pair on: one rank's setting alone
        # would leave the others waiting (or summing bytes of another dtype).
        settings = {"topology": self.topology.summary(), "schedule": schedule,
                    # A rank skipping the initial broadcast would pair its first
                    # reduce-scatter with the others' broadcast.
                    "init_sync": bool(init_sync),
                    "overlap_plan": _plan_setting(overlap_plan),
                    # It shapes the plan (rank 0's is broadcast): one meaning for all.
                    "speculation_memory_mb": speculation_memory_mb,
                    "reduce_dtype": str(reduce_dtype),
                    # torch's bucket_cap_mb_list overrides bucket_cap_mb.
                    "bucket_cap_mb": bucket_cap_mb if bucket_caps is None else None,
                    "bucket_cap_mb_list": bucket_caps,
                    "buffer sync (at construction, at forward)": (
                        self._buffer_sync.at_init, self._buffer_sync.at_forward),
                    "trainable parameters in _ddp_params_and_buffers_to_ignore":
                        self.has_ignored_trainable_parameters}
        # Buffers rank 0 broadcasts (at construction or at each forward) must match
        # in name, shape and dtype: the broadcast is one flat tensor per dtype.
        buffers_broadcast = ((init_sync and self._buffer_sync.at_init)
                             or self._buffer_sync.at_forward)
        synced_buffers = [(n, b) for n, b in module.named_buffers()
                          if n not in self._ignored_names] if buffers_broadcast else []
        agree_or_raise(process_group, problems + ([placement] if placement else []),
                       describe(named), settings=settings,
                       buffers=describe_buffers(synced_buffers))

        self._params = [p for _, p in trainable]
        self._param_names = [n for n, _ in trainable]
        lifecycle.claim(trainable, self)
        if self.has_ignored_trainable_parameters:  # (see ShardedGradScaler.update)
            note_wrapper_leaving_parameters(self)
        lifecycle.finish_before_destroy(self)
        # Unfrozen later, they would never be reduced nor stepped: see _check_frozen.
        self._frozen_at_wrap = [(n, p) for n, p in named if not p.requires_grad]
        self._param_index = {id(p): i for i, p in enumerate(self._params)}
        # Frozen ones, which zero_grad() resets as nn.Module's would: fixed from here,
        # as a parameter replaced or added later is refused.
        self._frozen_params = [p for _, p in self._frozen_at_wrap]
        device = self._params[0].device if self._params else torch.device("cpu")
        self.device = device  # torch DDP's attribute
        self._comm_stats = CommStats()
        # Off until enabled: model.timeline.enable(); model.timeline.save_chrome_trace(path).
        self.timeline = Timeline(self.rank)
        # Bucket traffic goes over groups of its own (one per link class and
        # phase), driven by worker threads; the wrapper's group stays free for
        # broadcasts and the norm all-reduce. See link_worker.py.
        naming = hashed_group_names(process_group)  # see topology.py
        if self.topology.uses_hierarchy:
            rs_groups = create_link_groups(self.topology, process_group, naming)
            ag_groups = create_link_groups(self.topology, process_group, naming)
            self._own_groups = [rs_groups.intra, rs_groups.inter, ag_groups.intra,
                                ag_groups.inter]
            self._exchange = HierarchicalExchange(
                self.topology, rs_groups, ag_groups, device, self._comm_stats,
                self.timeline, intra_shared_memory=self.topology.shared_memory)
        else:
            ranks = dist.get_process_group_ranks(process_group) if process_group \
                else list(range(dist.get_world_size()))
            self._own_groups = [new_group_like(ranks, process_group, naming)
                                for _ in range(2)]
            self._exchange = FlatExchange(
                *self._own_groups, device, self._comm_stats, self.timeline,
                one_node_shared_memory=self.topology.shared_memory and self.topology.nodes == 1)
        connect_nccl_groups(self._own_groups, device)

        infos = [ParamInfo(p.numel(), str(p.dtype).replace("torch.", ""), p.element_size(),
                           layout_strides(p))
                 for p in self._params]
        # None: sized to the model (layout.default_bucket_cap_mb); the same on
        # every rank, as the models are checked to agree. As torch DDP,
        # bucket_cap_mb_list wins over bucket_cap_mb.
        if bucket_caps is not None:
            self.bucket_cap_mb = max(bucket_caps) / 2**20
        elif bucket_cap_mb is not None:
            self.bucket_cap_mb = float(bucket_cap_mb)
        else:
            self.bucket_cap_mb = default_bucket_cap_mb(sum(i.numel * i.element_size for i in infos))
        self.bucket_bytes_cap = int(self.bucket_cap_mb * 1024 * 1024)
        self.bucket_layouts: tuple[BucketLayout, ...] = plan_buckets(
            infos, bucket_cap_bytes=self.bucket_bytes_cap,
            world_size=self.world_size,
            # As torch DDP: a 1 MB first bucket only under the default cap.
            first_bucket_cap_bytes=first_bucket_cap_bytes() if bucket_cap_mb is None else None,
            bucket_caps_bytes=bucket_caps,
            param_align_bytes=param_alignment_for(device.type))
        # None: gradients are reduced in their parameters' dtype, as torch DDP
        # does; torch.bfloat16 halves the reduce-scatter's bytes (DDP's
        # bf16_compress_hook, FSDP's MixedPrecision(reduce_dtype=...)).
        self.reduce_dtype = reduce_dtype
        self._buckets = [
            BucketStorage(layout, [self._params[s.param_index] for s in layout.spans],
                          self.slice_index, reduce_dtype)
            for layout in self.bucket_layouts]
        self._param_places = ParamPlaces(module, self._param_names, self._params, self._buckets,
                                         self._ignored_names)
        self.param_versions = ParamVersions(
            [[self._params[s.param_index] for s in layout.spans] for layout in self.bucket_layouts],
            {id(p): name for name, p in zip(self._param_names, self._params)})
        # Set inside ``with model.join():`` (see uneven_inputs.py).
        self._uneven_inputs: Optional[UnevenInputs] = None
        # The torch DDP communication hook registered (see register_comm_hook).
        self._comm_hook_name: Optional[str] = None
        if init_sync:  # else the user vouches that every rank starts alike, as with DDP
            self._broadcast_initial_state(named, with_buffers=self._buffer_sync.at_init)

        self.reducer = GradientReducer(self._params, self._param_names, self._buckets,
                                       self._exchange, self.world_size, self.timeline,
                                       launch_during_backward=schedule != "serial")
        self.reducer.register_hooks()
        # Weak, as every link from the reducer back to the wrapper: a cycle would keep
        # a dropped wrapper (its hooks taking the module's gradients, its threads,
        # groups and buckets) alive until the garbage collector's next full pass.
        self.reducer.round_start_listeners.append(lifecycle.weak_call(self._announce_reduce_round))
        # A ShardedOptimizer registers itself: without one, a loop built for torch
        # DDP (a torch.optim optimizer on module.parameters()) would silently not
        # train, as param.grad stays None; the first backward warns instead.
        self._optimizer_ref: Optional[weakref.ref] = None  # see attach_optimizer
        self._warned_no_optimizer = False
        self.reducer.backward_end_listeners.append(lifecycle.weak_call(self._warn_if_no_optimizer))
        self._gathers = ParamGathers(self._exchange, self._buckets, self.timeline,
                                     self.param_versions, schedule,
                                     overlaps_forward=schedule in ("next_forward", "two_stage"))
        self._forward_waiter: Optional[ForwardParamWaiter] = None
        # All-gathers run in descending bucket order: buckets were filled in
        # reverse registration order, so this is forward order for most models,
        # and it is the same on every rank whatever each rank's control flow.
        self.forward_bucket_order = tuple(reversed(range(len(self._buckets))))
        self.scheduler: Optional[TwoStageScheduler] = None
        self.plan_profiler: Optional[PlanProfiler] = None
        if schedule == "two_stage":
            if isinstance(overlap_plan, OverlapPlan):
                initial = checked_plan(overlap_plan, len(self._buckets))
            elif overlap_plan == "auto":  # no speculation until the profile is done
                initial = profiling_plan(len(self._buckets), self.forward_bucket_order)
            else:
                initial = layout_plan(len(self._buckets), self.forward_bucket_order)
            self.scheduler = TwoStageScheduler(self, initial)
            self.reducer.reduce_scatter_listeners.append(self.scheduler.on_reduce_scatter)
            self.reducer.backward_end_listeners.append(self.scheduler.on_backward_end)
            self.reducer.backward_start_listeners.append(self.scheduler.on_backward_start)
            self._gathers.lookahead = self.scheduler.plan.lookahead
            if overlap_plan == "auto":
                # Profiles a few steps, then every rank switches to rank 0's plan.
                self.plan_profiler = PlanProfiler(
                    self, undo_budget_bytes=None if speculation_memory_mb is None
                    else speculation_memory_mb * 2**20)
        # id(parameter) -> the buckets holding it (a large one spans several).
        buckets_of: dict[int, list[int]] = {}
        for b, layout in enumerate(self.bucket_layouts):
            for span in layout.spans:
                buckets_of.setdefault(id(self._params[span.param_index]), []).append(b)
        self._buckets_of_param = buckets_of
        if schedule in ("next_forward", "two_stage"):
            # Weakly: the module's hooks must not keep a dropped wrapper alive.
            self._forward_waiter = ForwardParamWaiter(
                module, buckets_of, lifecycle.weak_call(self._finish_param_all_gather_for_the_loop),
                lifecycle.weak_call(self._finish_param_all_gathers_for_the_loop),
                lifecycle.weak_call(self._land_gathers_for_a_direct_call),
                lifecycle.weak_call(self._bucket_storages))
        # As torch DDP: buffers are broadcast before a forward that follows a
        # synchronised, grad-enabled forward (and before the first one).
        self._sync_buffers_before_forward = True
        self._forwards_running = 0  # (nested: a forward may call the wrapper again)
        # Inside opt.summon_full_grads(): p.grad holds the gradients, so a read of the
        # parameters there (torch's clip over them) is no reason to warn.
        self.grads_summoned = False
        # This forward runs under torch.func.functional_call with substitutes (_note_substitutes).
        self._forward_reads_substitutes = False
        self._save_load_guards = land_gathers_before_state_dicts(self, module)
        self._parameter_read_guards = hand_out_parameters_through_the_wrapper(
            lifecycle.weak_call(self._read_through_module), module)
        self._zero_grad_guard = zero_grad_through_the_wrapper(
            lifecycle.weak_call(self.zero_grad), module)
        # (Only where all-gathers land after the step: none is in flight between
        # steps under the other schedules.)
        self._attribute_read_guards = None if self._forward_waiter is None else \
            land_gathers_on_attribute_reads(
                lifecycle.weak_call(self.land_for_a_read),
                self._gathers.in_flight_table, self._forward_waiter, module)
        # And parameters the loop holds from before the step (an EMA's list): a torch
        # call that reads one lands it (held_param_reads.py).
        if self._forward_waiter is not None:
            self._gathers.params_in_flight = ParamsInFlight(self.param_versions.params_of_bucket,
                                                            buckets_of)

    # -- set-up --------------------------------------------------------------

    @property
    def optimizer_attached(self) -> bool:
        return self._optimizer_ref is not None and self._optimizer_ref() is not None

    @property
    def attached_optimizer(self):
        """The ShardedOptimizer stepping this model, or None."""
        return self._optimizer_ref() if self._optimizer_ref is not None else None

    def attach_optimizer(self, optimizer) -> None:
        """ShardedOptimizer's registration: one at a time, a new one once the last is
        freed (a weak reference: the model must not keep an optimizer alive)."""
        if self.optimizer_attached and self._optimizer_ref() is not optimizer:
            # Each would clip by the norm of every gradient and reset every
            # gradient at its zero_grad(), unlike torch optimizers on disjoint
            # parameters.
            raise RuntimeError("fgpsdp: one ShardedOptimizer per model; give parts of the "
                               "model their own hyperparameters with param_groups=[...]. To "
                               "replace it, drop every reference to the old one first (an lr "
                               "scheduler holds one)")
        self._optimizer_ref = weakref.ref(optimizer)
        if self.scheduler is not None:
            self.scheduler.attach(optimizer)

    def _warn_if_no_optimizer(self) -> None:
        if not self.optimizer_attached and not self._warned_no_optimizer:
            self._warned_no_optimizer = True
            warnings.warn("fgpsdp: a backward ran but no fgpsdp_runtime.ShardedOptimizer wraps "
                          "this model. The reduced gradients are not in param.grad (it stays "
                          "None), so a torch.optim optimizer over model.parameters() does not "
                          "train: use ShardedOptimizer(model, torch.optim.AdamW, ...).",
                          RuntimeWarning)

    @property
    def authoritative_rank(self) -> int:
        """The group rank whose buffers (and profile plan) every rank takes: the
        first, or under join() the highest active one (as torch DDP: rank 0 may
        have joined, and its buffers and timings are then stale)."""
        uneven = self._uneven_inputs
        return uneven.authoritative_rank if uneven is not None else 0

    def _authoritative_rank(self) -> int:
        """``authoritative_rank`` as a global rank (what broadcasts take)."""
        rank = self.authoritative_rank
        return dist.get_global_rank(self.process_group, rank)

    @torch.no_grad()
    def _broadcast_initial_state(self, named_params, with_buffers: bool) -> None:
        """Rank 0's parameters and buffers everywhere, as DDP does at construction."""
        if self.world_size == 1:
            return
        src = self._authoritative_rank()
        for storage in self._buckets:
            dist.broadcast(storage.flat_param, src=src, group=self.process_group)
        frozen = [p for _, p in named_params if not p.requires_grad]
        buffers = self._synced_buffers() if with_buffers else []
        broadcast_coalesced(frozen + buffers, src, self.process_group)

    @property
    def broadcast_buffers(self) -> bool:
        """Whether buffers are broadcast at every forward (torch 2.13 calls it
        ``forward_sync_buffers``); loops may set it."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    def _synced_buffers(self) -> list[torch.Tensor]:
        # Read at each call: a module may assign new buffers (as torch DDP notes).
        return [b for n, b in self.module.named_buffers() if n not in self._ignored_names]

    @torch.no_grad()
    def _broadcast_buffers(self) -> None:
        if self.world_size == 1:
            return  # nothing to send: no walk over named_buffers() each forward
        buffers = self._synced_buffers()
        if buffers:
            with versions_kept(buffers):
                broadcast_coalesced(buffers, self._authoritative_rank(), self.process_group)

    # -- forward -------------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        self.refuse_inside_summoned_grads("a forward")
        if is_traced_by_dynamo():
            # [Note: torch.compile]
            # Traced by torch.compile: our bookkeeping runs eagerly at every call
            # (a graph break each side of the module), and the forward waits
            # for every pending all-gather first, since the per-module pre-hooks
            # are no-ops in compiled code (forward_waits.py).
            inputs, kwargs = self._before_forward_eagerly(inputs, kwargs, wait_all=True)
            output = self.module(*inputs, **kwargs)
            self._after_forward_eagerly(output)
            return output
        waiter = self._forward_waiter
        inputs, kwargs = self._before_forward(inputs, kwargs, wait_all=waiter is None)
        with nvtx_range("fgpsdp.forward"), self.timeline.span("compute", "forward"):
            self._forwards_running += 1  # its own parameter reads are no loop's clip
            try:
                if waiter is not None:
                    # Each module waits for its buckets in its pre-hook; a forward
                    # that reads substitutes has waited for all (_before_forward).
                    waiter.begin_forward(landed=self._forward_reads_substitutes)
                    try:
                        output = self.module(*inputs, **kwargs)
                    finally:
                        waiter.end_forward()
                else:
                    output = self.module(*inputs, **kwargs)
            finally:
                self._forwards_running -= 1
        self._after_forward(output)
        return output

    def _before_forward(self, inputs: tuple, kwargs: dict, wait_all: bool) -> tuple[tuple, dict]:
        self._drop_unfinished_step()
        if self._uneven_inputs is not None:
            buffers_first = self._sync_buffers_before_forward and self.broadcast_buffers
            synchronised = torch.is_grad_enabled() and self.reducer.sync_enabled
            self._uneven_inputs.notify(AnnouncedCall.FORWARD, float(buffers_first),
                                       float(synchronised))
        tree_changed = self._param_places.tree_changed
        substitutes = self._param_places.check()
        if tree_changed and self._forward_waiter is not None:
            self._forward_waiter.hook_modules_compiled_apart()
        self._forward_reads_substitutes = bool(substitutes)
        if substitutes:
            self._note_substitutes(substitutes)
            wait_all = True
        self._check_frozen()
        if self.reducer.discard_unfinished_backward():
            warnings.warn("fgpsdp: the last backward did not finish (an exception raised in "
                          "it?); the gradients it had not reduced yet are dropped. Call "
                          "zero_grad() to drop those it had (as with torch).", RuntimeWarning)
        if self.optimizer_attached:
            self._optimizer_ref().note_forward()
        if self.scheduler is not None:
            # First: between backward and step it undoes the speculative steps
            # and sends the restored slices again, which the waits must cover.
            self.scheduler.before_forward()
        if wait_all:
            self.finish_param_all_gathers(timed=True)
        if self._sync_buffers_before_forward and self.broadcast_buffers:
            self._broadcast_buffers()
        if self.device_ids is not None:
            device = named_device(self.device_ids[0])  # (a 0-dim tensor too)
            inputs, kwargs = _move_to(inputs, device), _move_to(kwargs, device)
        return inputs, kwargs

    def _note_substitutes(self, substitutes: list[torch.Tensor]) -> None:
        """A forward under ``torch.func.functional_call(model, {name: tensor}, ...)``.

        It lands every all-gather first and neither records nor follows the
        per-module waits: the modules hold the substitutes, so a recording would
        find no bucket for those parameters, and the next forward would read them
        before their all-gathers landed. A substitute that views a bucket's
        memory (``p.data``, ``p.detach()``, any parameter's), taken with gradients
        on, may be saved for backward apart from the parameter's gradient: from
        then on the speculative steps wait for the end of backward, as for such a
        read in a recorded forward (scheduler.py)."""
        waiter = self._forward_waiter
        if waiter is not None and torch.is_grad_enabled():
            storages = self._bucket_storages()
            if any(storage_address(value) in storages for value in substitutes):
                waiter.reads_detached_params = True

    def _after_forward(self, output: Any) -> None:
        self._param_places.adopt_new_storage()
        if self._gathers.queued:
            # Buckets this forward did not use: started now, so that every rank
            # has issued all of them before backward issues stage-1 all-gathers.
            self._gathers.start_queued(all_of_them=True)
        if self.plan_profiler is not None:
            self.plan_profiler.on_forward_end()
        self._sync_buffers_before_forward = torch.is_grad_enabled() and self.reducer.sync_enabled
        self.reducer.note_forward(output)

    def _check_frozen(self) -> None:
        for name, param in self._frozen_at_wrap:
            if param.requires_grad:
                raise RuntimeError(
                    f"fgpsdp: parameter {name!r} was frozen (requires_grad=False) when the module "
                    "was wrapped and requires grad now: no bucket holds it, so it would never "
                    "be reduced or stepped. Wrap the module with it trainable (in a param group "
                    "at lr=0 until it should train), or drop the wrapper and its optimizer and "
                    "wrap the module again")

    def _shadow_forward(self, buffers_first: bool, synchronised: bool) -> None:
        """A joined rank's part in the active ranks' forward (uneven_inputs.py): the
        same collectives, no compute."""
        self._sync_buffers_before_forward = buffers_first
        self._before_forward((), {}, wait_all=True)
        self._sync_buffers_before_forward = synchronised

    def _announce_reduce_round(self) -> None:
        if self._uneven_inputs is not None:
            self._uneven_inputs.notify(AnnouncedCall.REDUCE_ROUND)

    def _bucket_storages(self) -> frozenset[int]:
        return frozenset(s.flat_param.untyped_storage().data_ptr() for s in self._buckets)

    @property
    def backward_may_read_detached_params(self) -> bool:
        """A recording forward took a parameter's ``.detach()`` or ``.data`` (or read a
        view of one without autograd history), which the backward may read after the
        parameter's gradient is complete (see
        scheduler.py, [Note: parameters the backward still reads])."""
        waiter = self._forward_waiter
        return waiter is not None and waiter.reads_detached_params

    def mark_params_changed(self, buckets: Sequence[int]) -> None:
        """The parameters of ``buckets`` changed in place (a step, an undo)."""
        self.param_versions.mark_changed(buckets)

    # What a compiled forward calls: dynamo runs them as they are, every call.
    _before_forward_eagerly = torch.compiler.disable(_before_forward)
    _after_forward_eagerly = torch.compiler.disable(_after_forward)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next synchronised backward reduces them."""
        previous = self.reducer.sync_enabled
        self.reducer.sync_enabled = False
        try:
            yield
        finally:
            self.reducer.sync_enabled = previous

    @property
    def require_backward_grad_sync(self) -> bool:
        """torch DDP's flag (False inside no_sync()); some trainers set it directly."""
        return self.reducer.sync_enabled

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self.reducer.sync_enabled = bool(value)

    def __deepcopy__(self, memo: dict) -> "DistributedDataParallel":
        raise TypeError(
            "fgpsdp: a DistributedDataParallel cannot be copied (it holds process groups, "
            "threads and the buckets); copy model.module instead, after model.synchronize() "
            "(the copy is not wrapped)")

    def __copy__(self) -> "DistributedDataParallel":
        # Else copy.copy reaches __reduce_ex__ and its pickling message (and without
        # either, the shallow copy's __del__ stopped the original's threads).
        return self.__deepcopy__({})

    def __reduce_ex__(self, protocol: int) -> Any:
        # torch.save(model) pickles the wrapper: torch DDP's drops its process
        # group and reducer; ours holds threads and buckets too. Say what to save.
        raise TypeError(
            "fgpsdp: a DistributedDataParallel cannot be pickled (torch.save(model)): it "
            "holds process groups, threads and the buckets; save model.module "
            "(torch.save(model.module)) or model.state_dict() instead")

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> UnevenInputs:
        """torch DDP's context manager for uneven inputs: ranks may run different
        numbers of iterations inside it. A rank whose loop has ended keeps
        stepping its slices with the others' gradients (see uneven_inputs.py)."""
        return UnevenInputs(self, divide_by_initial_world_size=divide_by_initial_world_size,
                            enable=enable, throw_on_early_termination=throw_on_early_termination)

    def join_hook(self, **kwargs: Any) -> Any:
        """torch's generic ``Join([model, ...])`` asks each of its joinables for one: a
        clear error on every rank (before, "has no attribute 'join_hook'")."""
        raise NotImplementedError(
            "fgpsdp: torch.distributed.algorithms.Join([...]) is not supported; use "
            "`with model.join():` (one wrapped model; the ShardedOptimizer needs no joining)")

    @property
    def require_manual_backward_finalization(self) -> bool:
        """torch DDP's (torch 2.15): the loop calls ``finalize_backward()`` after each
        synchronized backward. Accepted: see finalize_backward."""
        return self._require_manual_backward_finalization

    @require_manual_backward_finalization.setter
    def require_manual_backward_finalization(self, required: bool) -> None:
        self._require_manual_backward_finalization = bool(required)

    @property
    def should_finalize_after_backward(self) -> bool:
        """torch DDP's: whether ``finalize_backward()`` must wait until backward has
        returned. Never here: it may be called from a backward hook as well."""
        return False

    def finalize_backward(self) -> None:
        """torch DDP's (torch 2.15), under ``require_manual_backward_finalization``: torch
        waits there for the gradients' all-reduce and writes them into ``param.grad``.
        Here nothing is written back (the reduced gradients are this rank's slices,
        see docs/semantics.md#gradients), and what reads them (``opt.step()``, the
        clip, ``opt.full_grad()``) waits for their reduce-scatters itself: it returns
        at once, and the reduce-scatters go on overlapping until then. Misuse torch
        refuses is refused alike."""
        if not self._require_manual_backward_finalization:
            raise RuntimeError(
                "fgpsdp: finalize_backward() is called only with "
                "model.require_manual_backward_finalization = True (as in torch DDP)")
        if not self.require_backward_grad_sync:
            raise RuntimeError(
                "fgpsdp: finalize_backward() inside no_sync(): no gradient is reduced "
                "there (as in torch DDP, call it after the synchronized backward)")

    def _set_static_graph(self) -> None:
        """torch DDP's late ``static_graph=True`` (trainers' strategies call it after
        wrapping): accepted and unneeded, as the keyword is."""
        self.static_graph = True

    def will_sync_module_buffers(self) -> bool:
        """torch DDP's: whether a forward broadcasts the buffers first."""
        return self.forward_sync_buffers and bool(self._synced_buffers())

    def register_comm_hook(self, state: object, hook: Any) -> None:
        """torch DDP's, for the hooks that choose the dtype gradients travel in:
        torch's ``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``
        and the fp16/bf16 compress wrappers of ``allreduce_hook`` set the reduce
        dtype, as ``reduce_dtype=`` does; others are refused (see comm_hooks.py).

        As torch asks: once, before the first backward, on every rank with the
        same hook. A collective here (torch's is local): the ranks check that
        they registered the same one, since a rank summing another dtype's bytes
        would corrupt every gradient. State: None (the default group) or the
        wrapper's process group, as torch's hooks read it."""
        if self._uneven_inputs is not None:
            self._uneven_inputs.refuse("fgpsdp: register_comm_hook() under model.join(): "
                                       "register the hook before the join context")
        problem: Optional[Exception] = None
        reduction = None
        try:
            reduction = hook_reduction(hook)
            if self._comm_hook_name is not None:
                raise RuntimeError(
                    f"fgpsdp: register_comm_hook can only be called once (as torch DDP's); "
                    f"{self._comm_hook_name} is registered")
            if self.reducer.reduce_scatters_launched or \
                    any(b.send_buffer is not None for b in self._buckets):
                raise RuntimeError("fgpsdp: register_comm_hook() after a backward has reduced "
                                   "gradients: register the hook before the first backward, "
                                   "as torch DDP asks")
            text = hook_state_problem(state, self.process_group,
                                      self.world_size == dist.get_world_size()) \
                or reduce_dtype_problem(reduction, self.reduce_dtype,
                                        [b.dtype for b in self._buckets])
            if text is not None:
                raise ValueError("fgpsdp: " + text)
        except Exception as error:  # noqa: BLE001 - raised below, on every rank
            problem = error
        settings_agree_or_raise(self.process_group, {
            "communication hook": None if reduction is None else reduction.name,
            "communication hook problem": None if problem is None
            else f"{type(problem).__name__}: {problem}"},
            "register_comm_hook: the ranks' hooks differ")
        if problem is not None:
            raise problem
        self._comm_hook_name = reduction.name
        if reduction.reduce_dtype is not None:
            self.reduce_dtype = reduction.reduce_dtype
        for storage in self._buckets:
            storage.set_reduce_dtype(reduction.reduce_dtype)

    @torch.compiler.disable  # see the note at ShardedOptimizer.zero_grad
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients: this rank's reduced slices and those no_sync() left,
        and, as torch DDP's (nn.Module's) resets every parameter's, those of the
        parameters no bucket holds (left to the user, or frozen with a gradient).

        The reduced gradient lives in the buckets, not in ``param.grad`` (None
        after a synchronised backward), so nn.Module's zero_grad would leave it
        for the next backward to add to. Loops may call this or
        ``ShardedOptimizer.zero_grad``, as with torch DDP.
        """
        self.refuse_inside_summoned_grads("model.zero_grad()")
        self.zero_reduced_gradients(set_to_none)
        # (Before, an expert's gradient added up over the steps of a loop that
        # zeroes through the model.)
        reset_gradients(self._frozen_params + [p for _, p in self._ignored_now()], set_to_none)

    def zero_reduced_gradients(self, set_to_none: bool = True) -> None:
        """``zero_grad()``'s part for the parameters the buckets hold: what
        ``ShardedOptimizer.zero_grad`` resets (torch's resets its own parameters')."""
        self._drop_unfinished_step()
        if self._uneven_inputs is not None:
            self._uneven_inputs.notify(AnnouncedCall.ZERO_GRAD, float(set_to_none))
        self._read_for_a_clip = False  # (of gradients no step used)
        self.reducer.discard_unfinished_backward()
        if self.scheduler is not None:
            # Between backward and step: what the speculative steps used is reset.
            self.scheduler.before_forward()
        self.reducer.wait_all()
        for _, param in self.named_trainable_parameters():
            if param.grad is not None:  # left by no_sync() backwards
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.zero_()
        for storage in self.buckets:
            if set_to_none:
                storage.invalidate_grad_shard()
            else:
                storage.zero_grad_shard()
        if set_to_none:
            self.reducer.reset_used()
        self.reducer.gradients_zeroed()
        if self.scheduler is not None:
            self.scheduler.gradients_zeroed()

    # -- parameter exchange (driven by the optimizer) -------------------------

    def start_param_all_gather(self, bucket: int) -> None:
        """Send this rank's updated slice of ``bucket``; receive everyone else's."""
        self._gathers.start(bucket)

    @property
    def plan(self) -> Optional[OverlapPlan]:
        """The two-stage overlap plan (None under the other schedules)."""
        return self.scheduler.plan if self.scheduler is not None else None

    @property
    def gathers_overlap_forward(self) -> bool:
        """``next_forward`` / ``two_stage``: the next forward waits for each all-gather."""
        return self._forward_waiter is not None

    def begin_param_exchange(self) -> None:
        """Before a step queues its all-gathers: start what an earlier step left queued.

        The step then queues the updated buckets (``queue_param_all_gather``)
        in forward order. ``next_forward`` and ``two_stage`` leave them to the
        next forward's pre-hooks (up to the plan's lookahead run ahead); the
        other schedules wait for them at the end of the step.
        """
        self._gathers.start_queued(all_of_them=True)

    def queue_param_all_gather(self, bucket: int) -> None:
        """Queue ``bucket``'s all-gather behind the step's earlier ones; under the
        forward-overlapped schedules start it now if the lookahead allows."""
        self._gathers.queue(bucket)

    def finish_param_all_gather(self, bucket: int, *, timed: bool = False,
                                by_the_loop: bool = True) -> None:
        """Wait for ``bucket``'s all-gather. ``timed``: the training loop waits here
        for updated parameters (a forward, ``synchronize()``), which the plan profiler
        times (see [Note: stage 1 only where the forward waits] in plan.py).
        ``by_the_loop``: False for a wait that may run on one rank alone (see [Note:
        the lookahead counts what the loop has not waited for] in param_gathers.py)."""
        self._gathers.finish(bucket, self.plan_profiler if timed else None,
                             by_the_loop=by_the_loop)

    def _finish_param_all_gather_for_the_loop(self, bucket: int) -> None:
        self.finish_param_all_gather(bucket, timed=True)

    def _finish_param_all_gathers_for_the_loop(self) -> None:
        self.finish_param_all_gathers(timed=True)

    def finish_param_all_gathers(self, *, timed: bool = False, by_the_loop: bool = True) -> None:
        self._gathers.finish_all(self.plan_profiler if timed else None, by_the_loop=by_the_loop)

    def set_overlap_plan(self, plan: OverlapPlan) -> None:
        """Replace the two-stage plan; between steps, with the same plan on every rank:
        a collective, which compares the ranks' checked plans (and whatever checking
        found wrong) and raises on every rank where they differ, since plans that
        differ pair one bucket's all-gather with another's. Under
        ``overlap_plan="auto"`` it ends the profile too: the plan set here is kept,
        not replaced by the profile's."""
        if self.scheduler is None:
            raise RuntimeError("set_overlap_plan: only the two_stage schedule has a plan")
        if self._uneven_inputs is not None:
            self._uneven_inputs.announce_load(
                "set_overlap_plan()", "set the plan before the join context or after it")
        problem: Optional[Exception] = None
        try:
            plan = checked_plan(plan, len(self._buckets))
        except Exception as error:  # noqa: BLE001 - raised below, on every rank
            problem = error
        settings_agree_or_raise(self.process_group, {
            "overlap_plan": None if problem is not None else _plan_setting(plan),
            "overlap plan problem": None if problem is None
            else f"{type(problem).__name__}: {problem}"},
            "set_overlap_plan: the ranks' plans differ")
        if problem is not None:
            raise problem
        if self.plan_profiler is not None:
            self.plan_profiler.stop()
        self.install_overlap_plan(plan)

    def install_overlap_plan(self, plan: OverlapPlan) -> None:
        """The plan profiler's switch to its plan (checked, the same on every rank)."""
        self.scheduler.set_plan(plan)
        self._gathers.lookahead = plan.lookahead

    def land_gathers_for_a_save(self) -> None:
        """What a ``state_dict`` of ``module`` (or a submodule) waits for.

        Unlike ``synchronize()`` it changes no collective: it may run on one
        rank only (torch DDP loops save on rank 0). Between backward and step
        two_stage's speculative updates may be in the parameters, and only a
        collective (every rank undoing them) could take them out: refused.
        """
        if self.scheduler is not None and self.scheduler.holds_speculative_values_once_settled():
            raise RuntimeError(
                "fgpsdp: a state_dict() or a copy of the module (copy.deepcopy, torch.save) "
                "between backward and opt.step() would hold two_stage's speculative updates; "
                "save or copy after opt.step(), or call model.synchronize() on every rank first "
                "(not after a step cut short by an exception or Ctrl-C: the ranks may have "
                "stopped at different points, and synchronize() would wait for the process "
                "group's timeout; keep the checkpoint of the last completed step)")
        optimizer = self.attached_optimizer
        unfinished = None if optimizer is None else optimizer._unfinished
        if unfinished is not None and not unfinished.save_warned:
            # Allowed (a save between the error and the retry), but its stepped buckets
            # are updated and the rest not, whose all-gathers are not even queued.
            # Once (a save runs this for every submodule); marked only once said, so
            # that under -W error every such save raises.
            warn_at_user_code(
                "fgpsdp: a state_dict() or a copy of the module while this rank's opt.step() "
                "is unfinished (it raised part-way, a Ctrl-C inside it included) holds that "
                "step's updates on part of the buckets only; call opt.step() again to "
                "finish it (no collective) before saving, or keep the last completed "
                "step's checkpoint")
            unfinished.save_warned = True
        # With the default lookahead every all-gather has started at the step, and
        # the save may run on one rank; with a smaller one, save on every rank (the
        # rest start here).
        self.finish_param_all_gathers(by_the_loop=self._gathers.queued)

    def _land_gathers_for_a_direct_call(self) -> None:
        """``model.module(x)``, bypassing the wrapper (an eval, ``generate()``, often on
        rank 0 alone): as a save does, land the all-gathers in flight first."""
        if in_backward():
            return  # recomputation (activation checkpointing) reads what backward does
        if self.scheduler is not None and self.scheduler.holds_speculative_values_once_settled():
            raise RuntimeError(
                "fgpsdp: model.module(...) between a backward through it and opt.step() (or "
                "zero_grad()) would read two_stage's speculative updates; call the wrapper, "
                "model(...), which undoes them (on every rank), or call it after the step")
        if self._gathers.queued:
            # Not started yet (a plan's lookahead below the bucket count): starting
            # them on this rank alone could wait on peers that wait on it.
            raise RuntimeError(
                "fgpsdp: model.module(...) while all-gathers wait to start (a plan with a "
                "small lookahead): call model.synchronize() on every rank first")
        if self._gathers.in_flight:
            self.finish_param_all_gathers(timed=True, by_the_loop=False)

    @torch.compiler.disable  # collectives: see the note at ShardedOptimizer.zero_grad
    def synchronize(self) -> None:
        """Block until every parameter of ``module`` holds its updated value.

        Between backward and step it holds the values before the step: the
        speculative steps of that backward are undone (as for a forward there),
        a collective: call it on every rank.
        """
        if self.scheduler is not None:
            if self._uneven_inputs is not None and self.scheduler.holds_speculative_values():
                self._uneven_inputs.notify(AnnouncedCall.SYNCHRONIZE)
            self.scheduler.before_forward()
        self.finish_param_all_gathers(timed=True)

    def _drop_unfinished_step(self) -> None:
        """A step that raised part-way and was not called again sends what is left
        (see ShardedOptimizer.drop_unfinished_step): first thing at a forward or
        zero_grad(), before their announcement under join(), which the other ranks
        may only reach once they have it. (Not at synchronize() or a save: the
        step may still be called again then.)"""
        if self.optimizer_attached:
            self._optimizer_ref().drop_unfinished_step()

    # -- introspection ---------------------------------------------------------

    @property
    def local_numel(self) -> int:
        return owned_numel(self.bucket_layouts, self.slice_index)

    def comm_stats(self) -> dict[str, dict[str, int]]:
        """Bytes this rank sent since the last reset: ``{link: {phase: bytes, "total": bytes}}``.

        Links are ``intra`` and ``inter`` under the hierarchy, ``flat`` otherwise;
        phases ``reduce_scatter`` and ``all_gather``.
        """
        return self._comm_stats.as_dict()

    @property
    def node_transport(self) -> str:
        """How bucket bytes move among this node's ranks: ``shared_memory`` (CPU ranks,
        see shared_memory.py), else the group's backend (``gloo``, ``nccl``)."""
        return self._exchange.node_transport

    def reset_comm_stats(self) -> None:
        """Start comm_stats() from zero (a benchmark's timed steps alone)."""
        self._comm_stats.reset()

    # -- reads of the parameters ----------------------------------------------

    def named_parameters(self, *args: Any, **kwargs: Any):
        # model.parameters() goes through here. See [Note: reading parameters
        # through the wrapper].
        return self._read_through_module(super().named_parameters(*args, **kwargs), self)

    def _read_through_module(self, named, module: nn.Module):
        """The parameters ``module`` (the wrapper, ``model.module`` or a submodule
        of it: module_guards.hand_out_parameters_through_the_wrapper) hands out. The
        warning for torch's clip only for the whole model's (a submodule's are
        read for other reasons: a logged norm, a freeze)."""
        land, warn = self._before_parameters_read()
        # (Not a forward's own read, an L2 term over self.parameters(), say: under
        # accumulation without no_sync() it comes between a backward and the step.)
        warn = warn and (module is self or module is self.module) \
            and not self._forwards_running and not self.grads_summoned
        if not (land or warn):
            return named
        return self._reading(named, land, warn)

    def _reading(self, named, land: bool, warn: bool):
        # Each parameter's bucket lands just before the parameter is handed out: an
        # EMA over all of them lands them all, next(model.parameters()).device only
        # the first (the forward's first bucket), and the rest keep overlapping.
        # A read of every parameter is noted for the warning about torch's clip (a
        # clip reads them all; a device lookup, one), said at the step if no clip of
        # ours ran (see note_step_for_the_clip_warning).
        buckets_of = self._buckets_of_param
        gathers, waiter = self._gathers, self._forward_waiter
        for name, param in named:
            # (Checked again at each: the consumer runs between two parameters.)
            if land and gathers.in_flight and not gathers.queued \
                    and (waiter is None or not waiter.in_forward):
                for b in buckets_of.get(id(param), ()):  # a large one spans several
                    self.finish_param_all_gather(b, timed=True, by_the_loop=False)
            yield name, param
        if warn:
            self._read_for_a_clip = True

    def land_for_a_read(self, param: torch.Tensor) -> None:
        """``module.weight`` read outside a forward while all-gathers are in flight
        (module_guards.land_gathers_on_attribute_reads tests both), or a torch call
        reading a parameter held from before the step (held_param_reads.py): its
        bucket lands where a read through ``parameters()`` would land it. Not noted
        for the warning about torch's clip, which reads ``parameters()``."""
        land, _ = self._before_parameters_read()
        if land:
            for b in self._buckets_of_param.get(id(param), ()):
                self.finish_param_all_gather(b, timed=True, by_the_loop=False)

    def note_step_for_the_clip_warning(self, clipped: bool,
                                       every_gradient_read_through_ours: bool = False) -> None:
        """At opt.step(): every parameter was read through the wrapper or its module
        since the reductions of this step began, and, unless ``clipped`` (a clip of
        ours ran, or ``max_grad_norm``), that was most likely torch's clip, which
        clipped nothing. Said once. (Said at the read before: HF Trainer's
        floating_point_ops() counts the parameters there, and clips with ours.)
        ``every_gradient_read_through_ours``: the loop read every gradient through
        opt.full_grad(), which explains the walk."""
        read, self._read_for_a_clip = self.__dict__.get("_read_for_a_clip", False), False
        if read and not clipped and not every_gradient_read_through_ours \
                and not self.__dict__.get("_warned_parameters_without_gradients"):
            self._warned_parameters_without_gradients = True
            # Those left to the user keep theirs, and a loop may walk the list only to
            # pick them out (to all-reduce an expert's gradient over its group).
            ignored = (" Only the parameters named in _ddp_params_and_buffers_to_ignore keep "
                       "theirs (a clip over all of them would clip those alone). If this read "
                       "only picked those out, list them before the loop, or reach them "
                       "through their submodules (no warning then)"
                       ) if self.named_ignored_parameters() else ""
            warn_at_user_code(
                "fgpsdp: model.parameters() (or model.module's) read between backward and "
                "opt.step(): each param.grad is None there (the reduced gradients are in "
                "this rank's bucket slices), so torch.nn.utils.clip_grad_norm_ over them "
                "returns 0 and clips nothing. Use opt.clip_grad_norm_(max_norm) or "
                "ShardedOptimizer(..., max_grad_norm=...), or run the clip inside "
                "`with opt.summon_full_grads():`. torch.distributed.pipelining's "
                "schedules scale them there (scale_grads) and so scale nothing: pass "
                "scale_grads=False and divide the loss by the number of microbatches." + ignored)

    def _before_parameters_read(self) -> tuple[bool, bool]:
        """[Note: reading parameters through the wrapper]
        Right after opt.step() the next forward's all-gathers are still landing
        (two_stage, next_forward): a read of the values then (torch's
        AveragedModel.update_parameters(model), an EMA by torch._foreach_lerp_, a
        logged weight norm) would see a mix of updated and old slices, another mix
        on every rank. So a read through the wrapper lands each parameter's
        all-gathers as it hands the parameter out: local waits, no collective (a read
        on rank 0 alone is fine), and a lookup of the device waits for the first
        bucket only. Not
        inside a forward (the pre-hooks wait there) or a backward, and not between
        backward and step under two_stage (the speculative updates stay).

        Between a synchronised backward and the step the gradients are in the
        buckets and every param.grad is None, so torch.nn.utils.clip_grad_norm_
        over model.parameters() (nanoGPT's, timm's and HF accelerate's loops) would
        return 0 and clip nothing: said once, after a read of all of them (a clip's).
        Returns (land?, warn?) for _reading."""
        state = self.__dict__
        gathers = state.get("_gathers")
        if gathers is None or in_backward():
            return False, False  # (during construction, or a backward's hook)
        # (Reduce-scatters since the last step or zero_grad(): reduced gradients wait.
        # Not those that add to a stepped gradient, which no step will use before a
        # zero_grad(): a GAN's discriminator after the generator's backward, whose
        # loops then read it, requires_grad_(True) itself.)
        reducer = state["reducer"]
        warn = any(reducer.reduce_scatters_since_reset) \
            and not reducer.adds_to_stepped_gradients \
            and not state.get("_warned_parameters_without_gradients")
        waiter = self._forward_waiter
        if not gathers.in_flight or (waiter is not None and waiter.in_forward):
            return False, warn
        scheduler = self.scheduler
        if scheduler is not None and scheduler.holds_speculative_values():
            return False, warn
        if gathers.queued:
            # Not started yet (a plan's lookahead below the bucket count): starting
            # them on this rank alone could wait on peers that wait on it.
            if not state.get("_warned_parameters_while_gathers_queued"):
                self._warned_parameters_while_gathers_queued = True
                warn_at_user_code(
                    "fgpsdp: parameters read (through parameters(), as a module's "
                    "attributes, or held from before the step) while all-gathers wait to "
                    "start (a plan with a small "
                    "lookahead): their values may be those before the "
                    "step; call model.synchronize() on every rank first")
            return False, warn
        return True, warn  # the reads land each parameter's bucket (_reading)

    def state_dict(self, *args: Any, **kwargs: Any):
        self.synchronize()
        return super().state_dict(*args, **kwargs)

    def named_trainable_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(zip(self._param_names, self._params))

    def named_ignored_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The trainable parameters named in ``_ddp_params_and_buffers_to_ignore``,
        which no bucket holds (see ignored_params.py)."""
        return [(n, p) for n, p in self._ignored_now() if p.requires_grad]

    def _ignored_now(self) -> list[tuple[str, nn.Parameter]]:
        return parameters_at(self.module, self._ignored_places)

    # -- internals shared with the optimizer ----------------------------------

    @property
    def buckets(self) -> Sequence[BucketStorage]:
        return self._buckets

    def param_index(self, param: torch.Tensor) -> Optional[int]:
        return self._param_index.get(id(param))

    def refuse_inside_summoned_grads(self, what: str) -> None:
        """Raises, locally (every rank's loop is in the block alike), inside
        opt.summon_full_grads(): the parameters' ``.grad`` are copies of the reduced
        gradient there, which the block's end writes back over the slices, so a call
        that reads or changes the slices would see stale values or be undone."""
        if self.grads_summoned:
            hint = " (torch.nn.utils.clip_grad_norm_ over the parameters works inside it)" \
                if "clip" in what else \
                " (to zero gradients in it, zero p.grad in place)" if "zero_grad" in what \
                else ""
            raise RuntimeError(
                f"fgpsdp: {what} inside `with opt.summon_full_grads():`: p.grad there holds "
                "copies of the gradient, which the block's end writes back over this rank's "
                "slices, so the call would read stale values or be undone; make it before or "
                f"after the block{hint}")

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Blocking sum of a small tensor (norms, flags) over the wrapper's group."""
        if self.world_size > 1:
            all_reduce_held(tensor, dist.ReduceOp.SUM, self.process_group, "wrapper all-reduce")

    # -- teardown -------------------------------------------------------------

    def __del__(self, _finalizing=sys.is_finalizing):
        if _finalizing():
            # A wrapper freed as the interpreter ends (one torch.compile's caches
            # held): the exit hook stopped its threads, and the modules this would
            # call have been emptied ("Exception ignored ... 'NoneType' object is
            # not callable" before). Nothing is left to release.
            return
        # Only the wrapper itself releases, once: not a stand-in sharing its
        # __dict__ (which may outlive it and get its address when it is gone).
        state = self.__dict__
        if state.get("_finalizer_owner") != id(self) or state.get("_released"):
            return
        state["_released"] = True
        # The module may outlive its wrapper (wrapped again later): our hooks go.
        reducer = self.__dict__.get("reducer")
        if reducer is not None:
            reducer.remove_hooks()
        waiter = self.__dict__.get("_forward_waiter")
        if waiter is not None:
            waiter.remove()
        for guards in ("_save_load_guards", "_parameter_read_guards", "_zero_grad_guard",
                       "_attribute_read_guards"):
            handles = self.__dict__.get(guards)
            if handles is not None:
                handles.remove()
        gathers = self.__dict__.get("_gathers")
        if gathers is not None and gathers.params_in_flight is not None:
            gathers.params_in_flight.release()
        # Stops and joins this model's threads (bounded), so that a later
        # destroy_process_group() finds none of them still ending.
        self._finish_communication()
        for group in self.__dict__.get("_own_groups", ()):
            lifecycle.destroy_gloo_group(group)
        self._warn_of_what_the_module_is_left_holding()

    def _warn_of_what_the_module_is_left_holding(self) -> None:
        """The module outlives its wrapper (saved, wrapped again), and nothing else
        would say where it holds what no step of torch DDP's leaves: where the last
        step's all-gathers failed (a peer gone, the group destroyed under them), did
        not end within the teardown's bound, or never started (a plan with a small
        lookahead), the values before that step, on some elements; between backward
        and step, two_stage's speculative updates (undoing them takes a collective)."""
        gathers = self.__dict__.get("_gathers")
        buckets = gathers.not_landed() if gathers is not None else []
        if buckets:
            warnings.warn(
                f"fgpsdp: a DistributedDataParallel was freed before the all-gathers of its "
                f"last step (or, between backward and opt.step(), of two_stage's speculative "
                f"updates) landed in bucket(s) {buckets} (they failed: a peer gone or the "
                "process group destroyed under them; or did not end within the bound of its "
                "teardown; or never started: a plan with a small lookahead): its module "
                "holds the values before that update there, on some elements. Save after "
                "model.synchronize() on every rank, or keep the last completed step's "
                "checkpoint", RuntimeWarning, stacklevel=2)
        scheduler = self.__dict__.get("scheduler")
        if scheduler is not None and scheduler.holds_speculative_values():
            warnings.warn(
                "fgpsdp: a DistributedDataParallel was freed between backward and opt.step(): "
                "its module holds two_stage's speculative updates on some elements, which "
                "no step committed. Keep the last completed step's checkpoint, or call "
                "model.synchronize() on every rank before dropping the wrapper",
                RuntimeWarning, stacklevel=2)

    def _finish_communication(self) -> None:
        """Let the submitted collectives run (the last step's all-gathers), then stop
        the threads, bounded as at exit: when the wrapper is freed, and before its
        process group is destroyed (see [Note: the last step's all-gathers and
        destroy_process_group()] in lifecycle.py). The wrapper steps no more."""
        # Once: closed, the threads take nothing new, and a later call (the destroy
        # reaches this for each of the wrapper's groups, then __del__) would only
        # wait again for threads stuck in a wait whose peer is gone.
        if self.__dict__.get("_communication_finished"):
            return
        self.__dict__["_communication_finished"] = True
        # The scheduler first (its last speculative all-gathers go to the link
        # workers, which then refuse new ones), within one bound for both.
        deadline = time.monotonic() + shutdown.EXIT_JOIN_TIMEOUT_S
        scheduler = self.__dict__.get("scheduler")
        if scheduler is not None:
            shutdown.stop_and_join([scheduler])
        exchange = self.__dict__.get("_exchange")
        if exchange is not None:
            shutdown.stop_and_join(exchange.workers, max(0.0, deadline - time.monotonic()))



def _move_to(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple):
        return tuple(_move_to(o, device) for o in obj)
    if isinstance(obj, list):
        return [_move_to(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: _move_to(v, device) for k, v in obj.items()}
    return obj
