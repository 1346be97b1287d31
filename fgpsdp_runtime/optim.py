"""ShardedOptimizer: any torch.optim optimizer on this rank's slices.

Per step::

    finish reduce-scatters (two_stage: speculative steps of stage-1 buckets)
    -> [ShardedGradScaler.unscale_: slices times the inverse loss scale]
    -> per-bucket sums of squares + used mask
    -> one all-reduce [sum, non-finite flag, hyperparameters-changed flag,
                       speculative-step-failed flag, used mask]
    -> clip coefficient
    -> two_stage: commit or roll back each speculative step
    -> inner optimizer step on the remaining slices -> all-gather them

[Note: slices as optimizer parameters]
For every parameter piece inside this rank's slice of a bucket the inner
optimizer gets a 1-D view of the bucket's flat parameter buffer (a leaf
tensor) whose ``.grad`` is the matching view of the reduced gradient slice.
The optimizer's state is thus allocated for owned elements only, and
updates land in place in the model's storage (slice_pieces.py builds them
and hands them their gradients). This is exact for
element-wise optimizers (SGD, Adam, AdamW, RMSprop, Adagrad, ...); those whose
update depends on a parameter's shape (LBFGS, Adafactor, SparseAdam) are
refused by name (optimizer_kinds.py), and a class from outside torch.optim is
tried on small tensors first (elementwise_probe.py).
"""
from __future__ import annotations

import contextlib
import functools
import math
import operator
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from . import grad_reads, optim_checkpoint, summoned_grads
from .collective_watch import warn_if_the_others_are_late
from .ddp import DistributedDataParallel
from .optimizer_itself import on_itself, remember_itself
from .optimizer_conversion import constructor_defaults, conversion_problem, param_groups_to_give
from .elementwise_probe import refuse_unless_elementwise
from .optimizer_kinds import refuse_unsliceable, refuse_unsliceable_settings
from .ignored_params import UnsteppedIgnoredParameters, check_ignored_parameter_replicas
from .grad_norm_figures import NormFigures, norm_from
from .model_parallel_norm import GROUP_KEYWORDS, check_model_parallel_group, counted_ranges
from .muon import not_a_matrix
from .param_group_args import read_param_groups
from .profiling import nvtx_range
from .slice_pieces import SlicePieces
from .slice_state import SliceState
from .speculation import (SliceBackup, compile_session_active, hyperparameters,
                          no_compile_session_begins, same_hyperparameters,
                          wait_out_compile_session)
from .step_chunks import split_evenly, step_chunk_count, step_chunk_min_elements
from .step_wide_state import StepWideState
from .uneven_inputs import AnnouncedCall, UnevenInputs
from .user_warnings import user_code_line, warn_at_user_code
from .validation import settings_agree_or_raise
from .whole_matrices import WholeMatrices


def _group_size(group: object) -> Any:
    """A group as the ranks compare it: its size (or its type's name, refused later)."""
    return dist.get_world_size(group) if isinstance(group, dist.ProcessGroup) \
        else type(group).__name__


def _float_text(value: Any) -> str:
    try:
        return repr(None if value is None else float(value))
    except (TypeError, ValueError):
        return repr(value)


class ShardedOptimizer(torch.optim.Optimizer):
    """Runs ``optimizer_class`` on this rank's slices of every bucket."""

    # torch.amp.GradScaler then hands step() the scale instead of unscaling
    # param.grad itself, which here holds nothing: step() refuses it and
    # names ShardedGradScaler, which unscales the reduced slices instead.
    _step_supports_amp_scaling = True

    def __init__(self, model: DistributedDataParallel, optimizer_class: type, *,
                 param_groups: Optional[Sequence[dict[str, Any]]] = None,
                 max_grad_norm: Optional[float] = None, master_weights: bool = False,
                 clip_ignored_parameters: bool = False, ignored_parameter_replicas: int = 1,
                 model_parallel_group: Optional[dist.ProcessGroup] = None,
                 pipeline_parallel_group: Optional[dist.ProcessGroup] = None,
                 check_elementwise: bool = True, **defaults: Any):
        remember_itself(self)  # see optimizer_itself.py
        # torch.compile(wrapper) gives an OptimizedModule around it; torch DDP's
        # loops build their optimizer on that one's parameters alike.
        model = getattr(model, "_orig_mod", model)
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(
                "fgpsdp: ShardedOptimizer needs the fgpsdp_runtime.DistributedDataParallel "
                f"wrapper, got {type(model).__name__}: wrap the module first, then build "
                "the optimizer on the wrapper (fgp.ShardedOptimizer(model, torch.optim.AdamW, "
                "...) with model = fgp.DistributedDataParallel(module)); param_groups= picks "
                "its parameters")
        # Checked on every rank before any is refused: a rank that raised alone would
        # leave the others to fail in their first collective (or wait out the timeout).
        self.model = model
        problem: Optional[Exception] = None
        groups = None
        # MuonWithAdamW (muon.py): its matrices are put together from every rank's
        # slices, and checked to be matrices here (its pieces are 1-D).
        self._steps_whole_matrices = bool(getattr(optimizer_class, "steps_whole_matrices",
                                                  False))
        try:
            refuse_unsliceable(optimizer_class)  # see optimizer_kinds.py
            if max_grad_norm is not None and not (max_grad_norm > 0):
                raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm}")
            check_ignored_parameter_replicas(ignored_parameter_replicas,
                                             clip_ignored_parameters)
            for name, group in zip(GROUP_KEYWORDS,
                                   (model_parallel_group, pipeline_parallel_group)):
                check_model_parallel_group(group, clip_ignored_parameters, name)
                if group is not None and model._uneven_inputs is not None:
                    raise ValueError(f"{name} is not supported under model.join() (a "
                                     "joined rank would leave its peers there alone in "
                                     "the norm's all-reduce over that group)")
            given = read_param_groups(model, param_groups)
            groups = given.groups
            # For full_state_dict(): torch.optim's numbering (see param_group_args.py).
            self._default_groups = given.default
            self._numbered_params = given.numbered_params
            self._numbered_names = given.numbered_names
            self._step_chunk_min_elements = step_chunk_min_elements()
            if defaults.get("differentiable") or any(g.get("differentiable") for g in groups):
                raise ValueError("differentiable=True is not supported: the inner optimizer "
                                 "steps this rank's bucket slices outside autograd, so no "
                                 "graph through the step reaches the model's parameters")
            if self._steps_whole_matrices:
                _refuse_muon_groups_over_non_matrices(model, groups)
            elif check_elementwise:  # a class outside torch.optim, tried on small tensors
                refuse_unless_elementwise(optimizer_class, groups, defaults, self._device)
        except (TypeError, ValueError) as error:
            problem = error
        # A rank clipping alone would roll back and send again what the others
        # commit: their collectives would no longer pair. Groups that differ
        # would step the slices of one parameter with other hyperparameters.
        settings_agree_or_raise(model.process_group, {
            "optimizer_class": getattr(optimizer_class, "__module__", "") + "."
            + getattr(optimizer_class, "__qualname__", repr(optimizer_class)),
            # repr of a float: 1 and 1.0 agree, and nan equals nan (refused below).
            "max_grad_norm": _float_text(max_grad_norm),
            # The write-back rounds what every rank's slice sends.
            "master_weights": bool(master_weights),
            "clip_ignored_parameters": bool(clip_ignored_parameters),
            "ignored_parameter_replicas": str(ignored_parameter_replicas),
            # Every rank or none takes part in the norm's second all-reduce.
            "model_parallel_group (its size)": _group_size(model_parallel_group),
            "pipeline_parallel_group (its size)": _group_size(pipeline_parallel_group),
            "argument problem": None if problem is None
            else f"{type(problem).__name__}: {problem}",
            "param_groups (parameter indices per group)": None if groups is None else
            [[model.param_index(p) for p in g["params"]] for g in groups],
            # MuonWithAdamW: which groups' matrices every rank puts together.
            "param_groups (use_muon per group)": None if groups is None
            or not self._steps_whole_matrices else [g.get("use_muon") for g in groups]},
            "cannot build the ShardedOptimizer")
        if problem is not None:
            raise problem
        self.max_grad_norm = max_grad_norm
        # The norm (max_grad_norm, clip_grad_norm_) also over the gradients of the
        # parameters the wrapper leaves to the user (see ignored_params.py).
        self.clip_ignored_parameters = bool(clip_ignored_parameters)
        # Ranks holding each of them (expert-data-parallel replicas, their gradients
        # averaged over their group by the loop): each rank's squares count 1/r.
        self.ignored_parameter_replicas = operator.index(ignored_parameter_replicas)
        self.skipped_steps = 0  # steps skipped because the gradient norm was inf/NaN
        self.last_step_skipped = False

        # 16-bit buckets stepped through float32 copies of this rank's slices
        # (see [Note: master weights] in slice_pieces.py).
        self.master_weights = bool(master_weights)
        self._slice_pieces = SlicePieces(model, master_weights=self.master_weights)
        for b in self._slice_pieces.masters:
            model.buckets[b].set_grad_dtype(torch.float32)
        # Tensor parallelism and pipeline stages beside the wrapper (see
        # model_parallel_norm.py): the norm also sums over these groups; per bucket,
        # what of this rank's slice it counts.
        self.model_parallel_group = model_parallel_group
        self.pipeline_parallel_group = pipeline_parallel_group
        self._norm_figures = NormFigures(
            model, counted_ranges(model, self._slice_pieces, model_parallel_group),
            self.clip_ignored_parameters, self.ignored_parameter_replicas,
            model_parallel_group, pipeline_parallel_group)
        slice_groups = []
        for group in groups:
            pieces = [piece for p in group["params"]
                      for piece, *_ in self._slice_pieces.by_param.get(model.param_index(p), ())]
            if not pieces:
                # Keep the group (schedulers index groups by position) with a
                # placeholder that never gets a gradient, so the inner
                # optimizer skips it.
                pieces = [self._placeholder(group["params"])]
            slice_groups.append({**{k: v for k, v in group.items() if k != "params"},
                                 "params": pieces})
        self.optim = optimizer_class(slice_groups, **defaults)
        # The buckets and the used parameters of the inner step running now (an
        # inner step that puts matrices together reads them: see whole_matrices.py).
        self._inner_run: Optional[tuple[Sequence[int], Optional[Sequence[bool]]]] = None
        if self._steps_whole_matrices:
            self._indices_by_group = [[model.param_index(p) for p in g["params"]]
                                      for g in groups]
            self._whole_matrices = WholeMatrices(model, self._slice_pieces)
            self.optim.matrices_of_group = self._matrices_of_group
            self.optim.put_together = self._whole_matrices.put_together
            self.optim.orthogonalised = self._whole_matrices.orthogonalised
        # (Every rank alike: the class and the groups agree, and so do the
        # arguments of a loop that builds the same optimizer on every rank.)
        refuse_unsliceable_settings(self.optim)
        # The tensors each group steps, as built: the loop may give groups new dicts
        # but never other tensors (see _refuse_groups_over_other_tensors).
        self._pieces_by_group = [tuple(g["params"]) for g in self.optim.param_groups]
        # Some state at construction comes from these alone, not from the groups
        # (Adagrad's initial_accumulator_value): see optim_checkpoint.
        self._inner_arguments = dict(defaults)
        # Group entries and optimizer-wide state an inner step writes (step counters
        # outside the parameters' state) advance once per opt.step(), not per run.
        self._step_wide_state = StepWideState(self.optim)
        super().__init__(slice_groups, self.optim.defaults)
        # One set of groups and state: lr schedulers edit what the inner optimizer
        # reads (param_groups is the inner optimizer's list from here).
        self._groups_fixed = True  # see add_param_group and param_groups
        del self.__dict__["param_groups"]  # torch's list, replaced by the inner one's
        self._share_state()
        # reducer.reduce_scatters_launched when this step's were finished: see
        # _forget_stale_measurements.
        self._finished_at: Optional[int] = None
        # consolidate_state_dict's dict, in a holder: a wrapper that copies this
        # optimizer's __dict__ (older Lightning's) shares the holder, so a step drops
        # the dict for both.
        self._consolidated: list[Optional[dict[str, Any]]] = [None]
        # reducer.reduce_scatters_launched at this round's last clip (see clipped_this_step).
        self._clipped_at: Optional[int] = None
        # A step whose inner optimizer raised part-way (see _UnfinishedStep).
        self._unfinished: Optional[_UnfinishedStep] = None
        self._reset_step_measurements()
        self._unstepped_ignored = UnsteppedIgnoredParameters(model.named_ignored_parameters())
        model.attach_optimizer(self)
        if self._steps_whole_matrices and model.scheduler is not None:
            # A speculative step runs on the scheduler thread, where the collective
            # that puts a matrix together would not pair with the other ranks'.
            model.scheduler.stop_speculating(
                f"{optimizer_class.__name__} puts matrices together from every rank's "
                "slices in its step, a collective", warn=False)
            model.scheduler.suspend_speculation()  # from now, not from the step's end

    @classmethod
    def from_optimizer(cls, model: DistributedDataParallel, optimizer: torch.optim.Optimizer,
                       *, max_grad_norm: Optional[float] = None,
                       master_weights: bool = False,
                       clip_ignored_parameters: bool = False,
                       ignored_parameter_replicas: int = 1,
                       model_parallel_group: Optional[dist.ProcessGroup] = None,
                       pipeline_parallel_group: Optional[dist.ProcessGroup] = None,
                       check_elementwise: bool = True) -> "ShardedOptimizer":
        """A ShardedOptimizer of ``optimizer``'s class, param groups and
        hyperparameters, for a torch.optim optimizer built over the wrapped module's
        parameters (by a trainer or a framework: Lightning Fabric's
        ``fabric.setup(model, optimizer)``), with its state dict, if it has stepped
        (not what it keeps elsewhere: a subclass's step count in an attribute).

        Use the result from then on: ``optimizer`` is left as it was, and steps
        nothing (its parameters get no ``.grad``). Refused, on every rank, when
        something would be lost silently: a live lr scheduler built on ``optimizer``
        (build it on the result), hooks registered on it, constructor arguments it
        keeps outside its defaults with other values than theirs, a wrapper around
        another optimizer (convert the one inside), one sharded already, or state on
        some ranks only. Every rank must call it (collectives)."""
        model = getattr(model, "_orig_mod", model)
        if isinstance(optimizer, cls):
            if optimizer.model is not model:
                raise ValueError("fgpsdp: this ShardedOptimizer was built on another wrapper")
            return optimizer
        try:
            problem = conversion_problem(optimizer)
        except Exception as error:  # noqa: BLE001 (said on every rank, below)
            problem = (RuntimeError, "reading the optimizer raised "
                                     f"{type(error).__name__}: {error}")
        stepped = problem is None and bool(optimizer.state)
        if isinstance(model, DistributedDataParallel):
            # A rank that raised alone would leave the others waiting in the
            # constructor's collectives; one with state alone, in the load's.
            settings_agree_or_raise(model.process_group, {
                "optimizer to convert": "convertible" if problem is None
                else f"{problem[0].__name__}: {problem[1]}",
                "its state": "stepped" if stepped else "none"},
                "cannot convert the optimizer")
        if problem is not None:
            raise problem[0](f"fgpsdp: {problem[1]}")
        converted = cls(model, type(optimizer), param_groups=param_groups_to_give(optimizer),
                        max_grad_norm=max_grad_norm, master_weights=master_weights,
                        clip_ignored_parameters=clip_ignored_parameters,
                        ignored_parameter_replicas=ignored_parameter_replicas,
                        model_parallel_group=model_parallel_group,
                        pipeline_parallel_group=pipeline_parallel_group,
                        check_elementwise=check_elementwise,
                        **constructor_defaults(type(optimizer), optimizer.defaults))
        if stepped:
            # torch.optim's format, numbered as the groups were given: each rank
            # keeps its slices of it.
            converted.load_state_dict(optimizer.state_dict())
        return converted

    # -- construction helpers ------------------------------------------------

    def _matrices_of_group(self, position: int) -> list:
        """MuonWithAdamW's matrices of group ``position`` in the inner step running now."""
        if self._inner_run is None:
            raise RuntimeError("fgpsdp: an inner step that puts matrices together ran "
                               "outside opt.step()'s chunks")
        buckets, globally_used = self._inner_run
        return self._whole_matrices.matrices_in(self._indices_by_group[position], buckets,
                                                globally_used)

    def _placeholder(self, params) -> torch.Tensor:
        candidates = list(params) + [p for _, p in self.model.named_trainable_parameters()]
        any_param = candidates[0] if candidates else None
        if any_param is None:
            return torch.empty(0)
        return torch.empty(0, dtype=any_param.dtype, device=any_param.device)

    # -- public API ---------------------------------------------------------

    @property
    def local_numel(self) -> int:
        """Parameter elements whose optimizer state this rank owns (padding excluded)."""
        return self.model.local_numel

    def undo_record_bytes(self) -> list[int]:
        """Per bucket, what a speculative step's undo record holds (see
        speculation.py): copies of this rank's parameter and gradient slices and
        of the slice's optimizer state. State not created yet (a piece whose
        parameter has had no gradient so far) is counted at the bytes per
        element of the pieces that have it, as the inner optimizer will make it."""
        state = self.optim.state
        per_element = 0.0  # state bytes per slice element, where state exists
        for pieces in self._slice_pieces.of_bucket:
            for piece in pieces:
                if piece in state and piece.numel() > 0:  # per-element entries only
                    per_element = max(per_element, sum(
                        v.element_size() for v in state[piece].values()
                        if torch.is_tensor(v) and v.dim() == 1 and v.shape == piece.shape))
        sizes = []
        for b, storage in enumerate(self.model.buckets):
            copied = [storage.param_shard, storage.grad_shard]
            if b in self._slice_pieces.masters:
                copied.append(self._slice_pieces.masters[b])
            nbytes = sum(t.numel() * t.element_size() for t in copied)
            for piece in self._slice_pieces.of_bucket[b]:
                if piece in state:
                    nbytes += sum(v.numel() * v.element_size() for v in state[piece].values()
                                  if torch.is_tensor(v))
                else:
                    nbytes += int(per_element * piece.numel())
            sizes.append(nbytes)
        return sizes

    # [Note: the optimizer's calls under torch.compile]
    # step(), zero_grad(), the clips and train()/eval() run collectives, the
    # scheduler's hand-over and Python bookkeeping: dynamo runs them as they are
    # (``torch.compiler.disable``), also inside a compiled training step or under
    # torch.compile(opt.step). Traced, a graph break on one rank's path (the plan
    # profiler's broadcast, sent by rank 0 only) hung the others, and two_stage
    # kept speculative steps that clipping had to undo, as the undo decision read
    # a coefficient the traced clip never wrote.
    @torch.compiler.disable
    @on_itself
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.refuse_inside_summoned_grads("opt.zero_grad()")
        self._clipped_at = None
        self.model.zero_reduced_gradients(set_to_none=set_to_none)
        for group in self.optim.param_groups:
            for piece in group["params"]:
                if set_to_none:
                    piece.grad = None
                elif piece.grad is not None:
                    piece.grad.zero_()

    # Schedule-free optimizers move their parameters between the point they train
    # at and the average they evaluate at: train() before training, eval() before
    # an evaluation or a save (every rank, as with torch DDP). Where the inner
    # optimizer has none, neither has this one: HF's Trainer and accelerate call
    # opt.train() only where hasattr() finds it.
    @property
    def train(self) -> Callable[[], None]:
        """The inner optimizer's ``train()`` (schedule-free's), on every rank."""
        self._inner_method("train")
        return self._train

    @property
    def eval(self) -> Callable[[], None]:
        """The inner optimizer's ``eval()`` (schedule-free's), on every rank."""
        self._inner_method("eval")
        return self._eval

    @torch.compiler.disable
    @on_itself
    def _train(self) -> None:
        """The inner optimizer's ``train()`` (schedule-free's), on every rank: a
        collective that rewrites this rank's slices and all-gathers every bucket."""
        self._rewrite_slices("train")

    @torch.compiler.disable
    @on_itself
    def _eval(self) -> None:
        """The inner optimizer's ``eval()`` (schedule-free's), on every rank: a
        collective that rewrites this rank's slices and all-gathers every bucket."""
        self._rewrite_slices("eval")

    def _inner_method(self, name: str) -> Callable[[], None]:
        method = getattr(self.optim, name, None)
        if not callable(method):
            raise AttributeError(f"{type(self.optim).__name__} has no {name}() (schedule-free "
                                 "optimizers have one)")
        return method

    def _rewrite_slices(self, name: str) -> None:
        """The inner optimizer's ``name()`` rewrites this rank's slices element by
        element; every bucket is then all-gathered, so that every replica holds the
        result (a collective)."""
        method = self._inner_method(name)
        self._refuse_while_unfinished(f"{name}()")
        self._refuse_speculative_state(f"{name}()")
        model = self.model
        if model._uneven_inputs is not None:
            model._uneven_inputs.announce_load(f"opt.{name}()", f"call opt.{name}() before "
                                               "the join context or after it")
        model.synchronize()
        self._drop_consolidated()
        buckets = range(len(model.buckets))
        self._slice_pieces.follow_param_writes(buckets)
        try:
            method()
        finally:
            self._slice_pieces.write_back(buckets)
        model.mark_params_changed(buckets)
        for b in buckets:
            model.start_param_all_gather(b)
        model.finish_param_all_gathers()

    def _built_step_wide_state(self) -> Optional[StepWideState]:
        """Where the loop's group list lives once this optimizer is built. Looked up
        as attributes, not in ``__dict__``: a wrapper that takes this class as a base
        and forwards attributes to the optimizer it wraps (Lightning's
        LightningOptimizer) reaches the wrapped one's. None while being built, and in
        a copy made through torch's ``__getstate__`` (pickle, ``copy.deepcopy``), which
        holds only the list as it was."""
        try:
            return self._step_wide_state if self._groups_fixed else None
        except AttributeError:
            return None

    @property
    @on_itself
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's groups, the list it steps with: lr schedulers and
        loops edit what the step reads. A new list given here is the one it steps
        with from then on, as with a torch optimizer. (The inner optimizer holds
        copies while a step runs, on the scheduler thread under two_stage: see
        step_wide_state.py. This list stays the loop's meanwhile.)"""
        wide = self._built_step_wide_state()
        if wide is None:  # torch.optim.Optimizer.__init__'s own list, or a copy's
            try:
                return self.__dict__["param_groups"]
            except KeyError:  # not built (hasattr() and repr() expect this error)
                raise AttributeError("param_groups") from None
        return wide.loop_groups

    @param_groups.setter
    @on_itself
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        wide = self._built_step_wide_state()
        if wide is None:
            self.__dict__["param_groups"] = groups
            return
        groups = list(groups)
        if self._groups_over_other_tensors(groups) is not None:
            # The tensors are this rank's slice pieces; groups cannot be added or
            # dropped after construction (see add_param_group).
            raise ValueError(
                "fgpsdp: opt.param_groups can be given new dicts only over the same tensors, "
                "group for group (as [dict(g) for g in opt.param_groups] makes): its tensors "
                "are this rank's bucket slices, and groups cannot be added or removed after "
                "construction; change a hyperparameter in the groups instead")
        wide.set_loop_groups(groups)

    @property
    @on_itself
    def state(self) -> defaultdict:
        """The inner optimizer's per-tensor state, keyed by this rank's slice pieces
        (see slice_state.py)."""
        if self._built_step_wide_state() is None:  # as for param_groups
            try:
                return self.__dict__["state"]
            except KeyError:
                raise AttributeError("state") from None
        return self.optim.state

    @state.setter
    @on_itself
    def state(self, state: Any) -> None:
        """``opt.state = defaultdict(dict)``, torch.optim's reset of every moment: the
        inner optimizer's state is emptied and given the new entries (before, the
        assignment replaced an attribute the steps never read)."""
        if self._built_step_wide_state() is None:
            self.__dict__["state"] = state
            return
        self._refuse_while_unfinished("state = ...")
        self._refuse_speculative_state("state = ...")
        self._drop_consolidated()
        current = self.optim.state
        entries = dict(state)  # before clearing: it may be the state itself
        current.refuse_model_params(entries)  # before anything changes
        current.clear()
        current.update(entries)

    def _groups_over_other_tensors(self, groups: Sequence[Any]) -> Optional[str]:
        """None when ``groups`` hold the tensors the optimizer was built with, group
        for group and in order; else which group does not (or that the count differs)."""
        built = self._pieces_by_group
        if len(groups) != len(built):
            return f"it has {len(groups)} groups, built with {len(built)}"
        for i, (group, pieces) in enumerate(zip(groups, built)):
            params = group.get("params") if isinstance(group, dict) else None
            if not (isinstance(params, (list, tuple)) and len(params) == len(pieces)
                    and all(map(operator.is_, params, pieces))):
                return f"group {i}'s \"params\" are not the tensors it was built with"
        return None

    def _refuse_groups_over_other_tensors(self) -> None:
        """Before a step: a group dict put in the list (``opt.param_groups[0] = {...}``)
        or "params" replaced in one, over other tensors (the model's parameters, as a
        torch.optim loop might write), would step tensors no bucket reads: the model
        would silently stop training."""
        problem = self._groups_over_other_tensors(self.param_groups)
        if problem is not None:
            raise ValueError(
                f"fgpsdp: opt.param_groups was changed to hold other tensors ({problem}): "
                "its tensors are this rank's bucket slices, and a step over others would "
                "train nothing. Change hyperparameters in the groups, or give new dicts over "
                "the same tensors (as [dict(g) for g in opt.param_groups] makes)")

    @on_itself
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        # torch.optim's would add whole parameters that no bucket slice backs:
        # they would never get a gradient, so never train.
        if getattr(self, "_groups_fixed", False):
            raise NotImplementedError(
                "fgpsdp: ShardedOptimizer cannot add a param group after construction; list "
                "every group in param_groups=[...] (a group with lr=0 stays as it is until "
                "its lr is raised)")
        super().add_param_group(param_group)

    @torch.compiler.disable
    @on_itself
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False,
                        foreach: Optional[bool] = None) -> torch.Tensor:
        """Clip the reduced gradient as torch.nn.utils.clip_grad_norm_ would on DDP.

        Returns the total norm before clipping, the same value on every rank.
        ``error_if_nonfinite`` raises torch's error on every rank (the total is
        all-reduced); ``foreach`` is accepted and unneeded.
        """
        if float(norm_type) != 2.0:
            raise ValueError(
                f"fgpsdp: ShardedOptimizer.clip_grad_norm_ supports only the L2 norm "
                f"(norm_type=2), not norm_type={norm_type!r}")
        self.model.refuse_inside_summoned_grads("opt.clip_grad_norm_()")
        self._refuse_while_unfinished("clip_grad_norm_()")
        self._announce(AnnouncedCall.CLIP, float(max_norm))
        self._clip_called = True
        self._reduce_and_measure()
        total = self._norm_now()  # a clip earlier in this step scaled the slices
        if error_if_nonfinite and not math.isfinite(total):
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} for gradients from `parameters` "
                "is non-finite, so it cannot be clipped. To disable this error and scale the "
                "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
        self._apply_clip(float(max_norm))
        self._clipped_at = self.model.reducer.reduce_scatters_launched
        self._note_ignored_grads_may_have_changed()
        return self._norm_tensor(total)

    @on_itself
    def clipped_this_step(self) -> bool:
        """clip_grad_norm_ or clip_grad_value_ ran on the gradients the step will take:
        no step, opt.zero_grad() or new reduce-scatter (a backward) since. (Not
        _clip_called: a forward between the clip and the step, an evaluation, starts
        the step's measurements again, while the clip has scaled the gradients.)"""
        at = self.__dict__.get("_clipped_at")
        return at is not None and at == self.model.reducer.reduce_scatters_launched

    @torch.compiler.disable
    @torch.no_grad()
    @on_itself
    def clip_grad_value_(self, clip_value: float, foreach: Optional[bool] = None) -> None:
        """Clamp the reduced gradient to [-clip_value, clip_value], as
        torch.nn.utils.clip_grad_value_ would on DDP's gradients. A collective.
        ``foreach`` is accepted and unneeded."""
        clip_value = float(clip_value)
        self.model.refuse_inside_summoned_grads("opt.clip_grad_value_()")
        self._refuse_while_unfinished("clip_grad_value_()")
        self._announce(AnnouncedCall.CLIP_VALUE, clip_value)
        self._clip_called = True
        self._reduce_and_measure()  # every reduce-scatter landed, every stage-1 step taken
        changed = torch.zeros(1, dtype=torch.float64, device=self._device)
        for shard in self._valid_grad_shards():
            changed += (shard.abs() > clip_value).any()
            shard.clamp_(-clip_value, clip_value)
        self._note_grads_edited(changed)
        self._clipped_at = self.model.reducer.reduce_scatters_launched
        self._note_ignored_grads_may_have_changed()

    @torch.compiler.disable
    @torch.no_grad()
    @on_itself
    def grad_norms(self) -> dict[str, torch.Tensor]:
        """``{name: norm}``: each trainable parameter's gradient norm, what
        ``p.grad.norm()`` gives under torch DDP at this point of the loop (after a
        clip, the clipped gradient's), keyed by ``model.module``'s parameter names;
        those without a gradient are left out, as their ``p.grad`` is None. A
        collective: one all-reduce of a float64 per parameter (see grad_reads.py)."""
        with self._read("opt.grad_norms()", AnnouncedCall.GRAD_NORMS):
            return grad_reads.grad_norms(self.model, self._slice_pieces, self._globally_used)

    @torch.compiler.disable
    @torch.no_grad()
    @on_itself
    def full_grad(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """The reduced gradient of ``param`` (a parameter of the model), whole and
        laid out as the parameter: bit for bit what torch DDP's ``param.grad`` holds
        at this point of the loop where this rank's slices match it (see
        docs/semantics.md), or None where that would be None. A collective: every
        rank asks for the same parameter; one all-reduce of the parameter's bytes.
        A new tensor: writing it changes nothing."""
        return self._full_grad_at(self._read_index(param), param)

    def _full_grad_at(self, index: int, param: object = None) -> Optional[torch.Tensor]:
        """full_grad() of the parameter at ``index`` (_read_index's); ``param`` None
        on a rank that only takes its part (under model.join())."""
        with self._read("opt.full_grad()", AnnouncedCall.FULL_GRAD, index):
            if index == grad_reads.NOT_A_PARAMETER:
                raise ValueError(self._not_a_bucketed_parameter(param, "full_grad"))
            if index == grad_reads.NOT_BUCKETED:
                return None  # frozen when wrapped: as its p.grad
            return grad_reads.full_grad(self.model, self._slice_pieces, self._globally_used,
                                        index)

    @torch.compiler.disable
    @torch.no_grad()
    @on_itself
    def full_state(self, param: torch.Tensor) -> dict[str, Any]:
        """``param``'s optimizer state, what ``opt.state[param]`` holds for a torch
        optimizer over the whole model (under torch DDP): each per-element entry
        (``exp_avg``, ``momentum_buffer``, ...) whole, in the parameter's shape and
        layout, bit for bit; scalar entries (``step``) as the slices hold them;
        {} before its first step (a frozen parameter: what torch's optimizer gives it
        at construction). ``opt.state`` itself is keyed by this rank's slice pieces.
        A collective: every rank asks for the same parameter."""
        return self._full_state_at(self._read_index(param), param)

    def _full_state_at(self, index: int, param: object = None) -> dict[str, Any]:
        """full_state() of the parameter at ``index`` (see _full_grad_at)."""
        with self._read("opt.full_state()", AnnouncedCall.PARAM_STATE, index, gradients=False):
            if index == grad_reads.NOT_A_PARAMETER:
                raise ValueError(self._not_a_bucketed_parameter(param, "full_state"))
            if index == grad_reads.NOT_BUCKETED:
                # What torch's optimizer gives it at construction, as in full_state_dict().
                return optim_checkpoint.state_of_untrained_param(self, param)
            self._masters_take_param_writes()
            return optim_checkpoint.param_state(self, index)

    @on_itself
    def summon_full_grads(self, params: Optional[Sequence[torch.Tensor]] = None,
                          writeback: bool = True) -> "_SummonedGradsBlock":
        """Inside the block each trainable parameter's ``p.grad`` holds its whole
        reduced gradient, bit for bit torch DDP's ``p.grad`` at this point of the loop
        (None where that is None); at the end each rank takes its own slices back from
        what the block left there (``writeback=False``: dropped), and ``p.grad`` is
        None again. For code that edits ``p.grad`` between backward and step, as a torch
        DDP loop may: every rank must edit alike, as every rank's ``p.grad`` is the
        same under torch DDP. ``params``: only these parameters (fewer buckets
        gathered). A collective at both ends: one all-gather per bucket held, then one
        all-reduce of whether any element changed (the step then measures the norm
        again and redoes two_stage's speculative steps, as after clip_grad_value_).
        Holds the gathered buckets' gradients whole while it lasts (as much memory as
        torch DDP's ``p.grad``). The optimizer's own calls and a forward are refused
        inside it (the end would write over what they did). An exception in the block
        leaves the slices as they were. Under ``master_weights`` ``p.grad`` holds the
        float32 gradient rounded to the parameter's dtype, and an element the block
        leaves at that rounding keeps its float32 value. See [Note: summoned gradients]
        in summoned_grads.py."""
        return _SummonedGradsBlock(self, params, writeback)

    def _enter_summoned_block(self, params: Optional[Sequence[torch.Tensor]]
                              ) -> summoned_grads.SummonedGrads:
        what = "opt.summon_full_grads()"
        indices, problem = self._summoned_indices(params)
        if self.model._uneven_inputs is not None:
            # A joined rank's loop has ended: it would not edit its slices.
            self.model._uneven_inputs.refuse(
                f"fgpsdp: {what} is not supported inside model.join() (a joined rank "
                "would not take the block's edits into its slices)", RuntimeError)
        # The read's agreement takes whether the ranks named every parameter, some, or
        # a tensor not of the model (every rank raises then); which ones, the next.
        selection = grad_reads.NOT_A_PARAMETER if problem else \
            _EVERY_PARAMETER if params is None else _SOME_PARAMETERS
        with self._read(what, AnnouncedCall.FULL_GRADS, selection), torch.no_grad():
            if problem:
                raise ValueError(problem)
            if params is not None:
                summoned_grads.agree_on_the_selection(self.model, indices, what)
            summoned = summoned_grads.gather(
                self.model, indices,
                lambda b, index: grad_reads.has_gradient(self.model, self._globally_used, b,
                                                          index))
        self.model.grads_summoned = True
        return summoned

    def _leave_summoned_block(self, summoned: summoned_grads.SummonedGrads, writeback: bool,
                              raised: bool) -> None:
        try:
            with torch.no_grad():
                changed = writeback and not raised and \
                    summoned_grads.write_back(self.model, summoned)
        finally:
            summoned_grads.restore(summoned)
            self.model.grads_summoned = False
        if writeback and not raised:
            # (The block's edits of the gradients of parameters left to the user, which
            # the norm counts with clip_ignored_parameters: entering it, a read, marked
            # the norm for measuring again.)
            self._note_grads_edited(torch.tensor([float(changed)], dtype=torch.float64,
                                                 device=self._device))

    def _summoned_indices(self, params: Optional[Sequence[torch.Tensor]]
                          ) -> tuple[list[int], Optional[str]]:
        """summon_full_grads' parameters as the wrapper's indices, sorted, or what is
        wrong with one of them (local)."""
        if params is None:
            return list(range(len(self.model.named_trainable_parameters()))), None
        if isinstance(params, torch.Tensor):
            params = [params]
        indices = set()
        for param in params:
            index = self._read_index(param)
            if index == grad_reads.NOT_A_PARAMETER:
                return [], self._not_a_bucketed_parameter(param, "summon_full_grads")
            if index >= 0:  # (frozen when wrapped: its p.grad stays None)
                indices.add(index)
        return sorted(indices), None

    def _note_grads_edited(self, changed: torch.Tensor) -> None:
        """``changed`` (float64 [1] on the device, above 0 where this rank's slices
        changed: clip_grad_value_, summon_full_grads) summed over the ranks: if any
        rank's changed, the step measures the norm again and undoes the speculative
        steps (every rank decides alike; with a model_parallel_group or
        pipeline_parallel_group, every rank of it too: that measure is a collective)."""
        self.model.all_reduce_sum(changed)
        changed = self._norm_figures.summed_over_model_parallel(changed)
        if changed.item() > 0:
            self._grads_edited = True
            self._clipped_norm = None

    def _masters_take_param_writes(self) -> None:
        """Before the master weights are read or saved: the loop's writes to the
        parameters since the last step, which the next step would take in first
        (see [Note: master weights] in slice_pieces.py). Local: this rank's slices."""
        masters = self._slice_pieces.masters
        for b in masters:  # (not by_the_loop: state_dict() may run on one rank alone)
            self.model.finish_param_all_gather(b, by_the_loop=False)
        self._slice_pieces.follow_param_writes(list(masters))

    def _read_index(self, param: object) -> int:
        """full_grad's and full_state's parameter index, or grad_reads.NOT_BUCKETED /
        NOT_A_PARAMETER (local: no collective)."""
        index = self.model.param_index(param) if isinstance(param, torch.Tensor) else None
        if index is not None:
            return index
        if any(p is param for p in self.model._frozen_params) and not any(
                p is param for _, p in self.model.named_ignored_parameters()):
            return grad_reads.NOT_BUCKETED
        return grad_reads.NOT_A_PARAMETER

    @contextlib.contextmanager
    def _read(self, what: str, call: AnnouncedCall, index: int = 0,
              gradients: bool = True) -> Iterator[None]:
        """Around a read: every rank makes the same one (see
        grad_reads.agree_on_the_read), and a warning if the other ranks do not come
        (a read on rank 0 alone, to log there). Of ``gradients``: of reduced ones,
        and, for a parameter the buckets hold, after what a clip does first (every
        reduce-scatter landed, the used parameters known). Of the optimizer state:
        not of two_stage's speculative updates."""
        self.model.refuse_inside_summoned_grads(what)
        self._refuse_while_unfinished(what)
        uneven = self.model._uneven_inputs
        unreduced = gradients and self.model.reducer.holds_unreduced_gradients()
        if unreduced and uneven is not None and not uneven.joined:
            # Under model.join() the announcement would launch the round that reduces
            # them (see _announce): refused before it, on every rank.
            uneven.refuse(grad_reads.unreduced_refusal(what), RuntimeError)
        if not gradients:
            self._refuse_speculative_state(what)
        with warn_if_the_others_are_late(what, self.model.world_size, user_code_line(),
                                         " Read on every rank, and log on one"):
            if gradients:
                self._announce(call, float(index))
            elif uneven is not None:  # (no round of reduce-scatters to launch first)
                uneven.notify(call, float(index))
            grad_reads.agree_on_the_read(self.model, what, int(call), index, unreduced)
            if gradients and index >= 0:
                self._reduce_and_measure()
                if call is AnnouncedCall.FULL_GRAD:
                    self._full_grad_read.add(index)
            yield
        self._note_ignored_grads_may_have_changed()

    def _read_every_gradient(self) -> bool:
        """full_grad() read every trainable parameter's gradient this step: the loop
        walked the parameters for that (not for torch's clip, see _step_with)."""
        return bool(self._full_grad_read) and \
            len(self._full_grad_read) == len(self.model.named_trainable_parameters())

    def _not_a_bucketed_parameter(self, param: object, call: str) -> str:
        if param is None:  # a rank taking its part in the active ranks' read
            return (f"fgpsdp: the active ranks' opt.{call}() was given no parameter of the "
                    "model (their error says why)")
        if not isinstance(param, torch.Tensor):
            return f"fgpsdp: opt.{call}() takes a parameter of the model, got {type(param).__name__}"
        if any(p is param for _, p in self.model.named_ignored_parameters()):
            return (f"fgpsdp: opt.{call}(): this parameter is named in "
                    "_ddp_params_and_buffers_to_ignore, so the wrapper leaves it to you: "
                    "its gradient is in param.grad, as this rank's backward left it, and "
                    "no ShardedOptimizer steps it")
        return (f"fgpsdp: opt.{call}(): not a parameter of the wrapped model (pass the "
                "tensors of model.module.parameters(), not the slice pieces in "
                "opt.param_groups)")

    @torch.compiler.disable  # see the note at zero_grad
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        # Not on_itself's: torch's GradScaler sets its attributes on the object it was
        # given, which may be a wrapper (see optimizer_itself.py).
        if "grad_scale" in self.__dict__ or "found_inf" in self.__dict__:
            # GradScaler sets them (grad_scale None after an explicit unscale_()).
            # Every rank gets here (the scaler's steps are the same everywhere)
            # before this step's first collective.
            raise RuntimeError(
                "fgpsdp: torch.amp.GradScaler cannot drive a ShardedOptimizer: the reduced "
                "gradients are not in param.grad, so it can neither unscale them nor see an "
                "inf on another rank. Use fgpsdp_runtime.ShardedGradScaler, the same API "
                "(scale, unscale_, step, update, state_dict).")
        return self._step_with(closure)

    @on_itself
    def _step_with(self, closure: Optional[Callable[[], Any]]) -> Any:
        self.model.refuse_inside_summoned_grads("opt.step()")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # A loop that read every gradient through full_grad() walked the parameters
        # for that, and knows where the gradients are: no warning about torch's clip.
        # (Not grad_norms(), nor full_grad() of some: a loop may still clip with torch's.)
        self.model.note_step_for_the_clip_warning(
            clipped=self._clip_called or self.max_grad_norm is not None,
            every_gradient_read_through_ours=self._read_every_gradient())
        self.run_step()
        self._unstepped_ignored.after_step()
        return loss

    @torch.no_grad()
    @on_itself
    def run_step(self, inf_found_by_scaler: bool = False) -> None:
        """step()'s work without torch's optimizer hooks: ShardedGradScaler runs it
        for a step that an inf skips (torch's scaler does not call step() then, so
        step hooks such as an EMA update do not run; every rank must still take
        part, to undo speculative steps and keep the collectives paired).
        ``inf_found_by_scaler``: the scaler's unscale_ found an inf, so the step is
        skipped whatever the gradients hold now. A forward between unscale_ and the
        step makes the step measure them again (note_forward), and clip_grad_value_
        may have clamped the inf away by then; torch's scaler, too, decides by
        what unscale_ found. Called again after it raised part-way, it finishes
        that step (see _UnfinishedStep)."""
        # Before any collective: the loop did it everywhere.
        self._refuse_groups_over_other_tensors()
        self._drop_consolidated()
        self._slice_pieces.check_they_view_their_buckets()
        self.model._param_places.refuse_substitutes()  # (likewise)
        if self._unfinished is not None:  # called again after it raised: no collective
            if self.steps_with_collectives:
                # (but its inner step's own: a joined rank takes the step up too)
                uneven = self._announce(AnnouncedCall.STEP_AGAIN)
                if uneven is not None:
                    uneven.share_hyperparameters(self)
            with self.model.timeline.span("compute", "optimizer step"):
                self._resume_unfinished_step()
            return
        uneven = self._announce(AnnouncedCall.STEP)
        if uneven is not None:
            uneven.share_hyperparameters(self)
        with self.model.timeline.span("compute", "optimizer step"):
            self._step(inf_found_by_scaler)

    # -- the step -------------------------------------------------------------

    def _step(self, inf_found_by_scaler: bool = False) -> None:
        model = self.model
        self._forget_stale_measurements()
        measured_earlier = self._reduced  # by clip_grad_norm_, before this call
        self._reduce_and_measure()
        if self._speculation_failures:
            self._abandon_failed_speculation()  # raises on every rank
        # After clip_grad_value_, what the gradient holds now (its infs clamped: the
        # step goes on, as torch's would).
        total = self._norm_now()
        if self.max_grad_norm is not None:
            self._apply_clip(self.max_grad_norm)
        # Under loss scaling, an overflow skips the step even once clip_grad_value_
        # has clamped its infs (torch's scaler decides by what unscale_ found).
        finite = math.isfinite(total) and not inf_found_by_scaler and not (
            self._loss_unscaled and not math.isfinite(self._total_norm))
        scheduler = model.scheduler
        speculated = scheduler.speculated if scheduler is not None else {}
        if measured_earlier and speculated:
            # The loop may have set hyperparameters after clip_grad_norm_'s all-reduce.
            self._speculated_with_other_hyperparameters |= self._any_rank(
                self._speculation_hyperparameters_differ(speculated))
        for b in sorted(speculated):
            # Written by the loop between backward and step: after the speculative
            # step, over values the all-gather may be overwriting; undoing would
            # drop the write. Nothing of this step has changed yet.
            name = model.param_versions.written_since_change(b) \
                or self._slice_pieces.master_written_by_the_loop(b)
            if name is not None:
                raise RuntimeError(
                    f"fgpsdp: parameter {name!r} was changed in place between backward and "
                    "opt.step(), after two_stage's speculative step of it; change parameters "
                    "before backward or after the step, or use schedule='next_forward'")
        other_hyperparameters = self._speculated_with_other_hyperparameters
        if other_hyperparameters and scheduler is not None:
            scheduler.stop_speculating(
                "the optimizer's hyperparameters changed between backward and step() (or "
                "torch's default dtype, or the CPU's flush-to-zero mode, did)")
        # Roll back what the true gradient contradicts; the decision is the
        # same on every rank (it uses only all-reduced figures).
        rolled_back = [b for b in sorted(speculated)
                       if not finite or self._applied_coefficient < 1.0 or other_hyperparameters
                       or self._grads_edited
                       or self._speculated_on_scaled_gradients
                       or not self._bucket_fully_used(b)
                       or model.reducer.reduce_scatters_since_reset[b] != speculated[b][1]]
        for b in sorted(set(speculated) - set(rolled_back)):
            speculated[b][0].keep_written_gradient(model.buckets[b].grad_shard)
        for b in rolled_back:
            model.finish_param_all_gather(b)  # the speculative values must have landed
            self.restore_speculated(b, speculated[b][0])
        model.mark_params_changed(rolled_back)
        if scheduler is not None:
            scheduler.rollbacks += len(rolled_back)
            scheduler.commits += len(speculated) - len(rolled_back)
        self.last_step_skipped = not finite
        would_commit = (finite and self._applied_coefficient >= 1.0
                        and not self._grads_edited
                        and not other_hyperparameters
                        and not self._speculated_on_scaled_gradients)
        if finite:
            # In forward order (the same on every rank): what the next forward
            # needs first is stepped and sent first.
            redo = set(rolled_back)
            to_step = [b for b in model.forward_bucket_order if b in redo or b not in speculated]
            for b in to_step:  # slices must not change under an all-gather
                model.finish_param_all_gather(b)
            # Under the forward-overlapped schedules, step bucket by bucket and
            # queue each all-gather at once, so the next forward's first bucket
            # is on the wire while later slices are stepped. The inner
            # optimizers are element-wise, so one step per bucket equals one
            # step over all of them; each inner step walks every parameter, so
            # a model with many buckets is stepped in at most MAX_STEP_CHUNKS
            # runs of consecutive buckets, and a small one in fewer (see
            # step_chunks.py). The other schedules step once.
            chunks = split_evenly(to_step, self._step_chunk_count(to_step)) \
                if model.gathers_overlap_forward else [to_step]
            model.begin_param_exchange()
            committed = len(speculated) > len(rolled_back)
            self._unfinished = _UnfinishedStep(chunks, [], self._globally_used, would_commit,
                                               len(chunks), committed)
            self._step_chunks()
        else:
            # Same decision on every rank: the total and the scaler's flag are all-reduced.
            self.skipped_steps += 1
            # Under loss scaling a skip is routine, as in torch: no warning.
            if not (self._loss_unscaled or inf_found_by_scaler):
                warn_at_user_code(f"fgpsdp: gradient norm is {total}; step skipped "
                                  f"({self.skipped_steps} so far)")
            model.begin_param_exchange()
            for b in rolled_back:  # peers hold the speculative values: send the restored ones
                model.queue_param_all_gather(b)
        self._finish_step(stepped=finite, would_commit=would_commit)

    @property
    def steps_with_collectives(self) -> bool:
        """The inner optimizer's step has collectives of its own (MuonWithAdamW's
        exchanges): an error in it is raised on every rank, and calling opt.step()
        again after it is a collective too."""
        return self._steps_whole_matrices

    def _step_chunk_count(self, buckets: Sequence[int]) -> int:
        """How many inner steps the forward-ordered step takes (see step_chunks.py)."""
        if self._steps_whole_matrices:
            # One: MuonWithAdamW spreads Newton-Schulz over the ranks within an inner
            # step, whose ranks meet at its all-reduce; in chunks of a matrix or two
            # one rank works while the others wait (GPT-2's CPU workload on 2 ranks:
            # 0.89-0.95 s per step in one, 1.08-1.20 s in its 9 chunks,
            # docs/benchmarks/2026-12-07-muon-cost.md).
            return 1
        elements = sum(self.model.buckets[b].layout.shard_numel for b in buckets)
        return step_chunk_count(elements, self._step_chunk_min_elements)

    def _step_chunks(self) -> None:
        """Step and send what is left of this step, chunk by chunk (see
        _UnfinishedStep). Progress is recorded as it is made, whatever raises
        (the inner optimizer, or an all-gather's error surfacing as the next is
        queued): a chunk is stepped once, and each bucket queued once, whether
        the step is called again or drop_unfinished_step sends the rest."""
        unfinished, model = self._unfinished, self.model
        try:
            while True:
                self._send_stepped(unfinished)
                if not unfinished.chunks:
                    break
                chunk = unfinished.chunks[0]
                self._slice_pieces.assign_grads(unfinished.globally_used, chunk)
                self._slice_pieces.follow_param_writes(chunk)
                self._inner_run = (chunk, unfinished.globally_used)
                try:
                    with nvtx_range("fgpsdp.optimizer_step"):
                        self._inner_step()
                finally:
                    self._inner_run = None
                    self._slice_pieces.write_back(chunk)
                    model.mark_params_changed(chunk)  # (one that raised may have written some)
                unfinished.chunks.pop(0)
                unfinished.to_send = list(chunk)
        except BaseException:
            # Taken only on an error, off the step's path: what the loop has not
            # changed since the step began (see _resume_unfinished_step).
            if unfinished.hyperparameters is None:
                unfinished.hyperparameters = self._hyperparameters_now()
            raise
        self._unfinished = None

    def _send_stepped(self, unfinished: "_UnfinishedStep") -> None:
        """Queue the all-gathers of the buckets stepped and not yet sent, each
        recorded as sent once queued (a queue raising leaves the rest listed)."""
        while unfinished.to_send:
            self.model.queue_param_all_gather(unfinished.to_send[0])
            unfinished.to_send.pop(0)

    def _finish_step(self, stepped: bool, would_commit: bool) -> None:
        self._step_wide_state.end_step(stepped=stepped)
        if not self.model.gathers_overlap_forward:
            # serial / overlap_backward: the parameters have landed when the step ends.
            self.model.finish_param_all_gathers()
        self._end_step(would_commit=would_commit)

    def _resume_unfinished_step(self) -> None:
        """opt.step() called again after its inner optimizer raised (on this rank, or
        on every rank): step what was left and send it, as the first call would
        have. Nothing before that is done again: the clip (once per step), the
        rollbacks, the collectives, which a rank retrying alone would call alone."""
        unfinished = self._unfinished
        stepped_before = (unfinished.committed_speculation
                          or len(unfinished.chunks) < unfinished.chunk_count)
        changed = stepped_before and not same_hyperparameters(unfinished.hyperparameters,
                                                              self._hyperparameters_now())
        self._step_chunks()
        self._finish_step(stepped=True, would_commit=unfinished.would_commit)
        if changed:  # last: a warning raised as an error must not stop the step
            warn_at_user_code(
                "fgpsdp: the optimizer's hyperparameters changed between opt.step() raising "
                "and this call, which finished it: the buckets stepped before it raised "
                "kept the old values' update (set them before the step, or after it)")

    def drop_unfinished_step(self, where: Optional[str] = None,
                             warn: bool = True) -> Optional[str]:
        """The loop went on (a forward, zero_grad()) after opt.step()
        raised part-way, without calling it again (or ``where`` it raised, none
        can): send the slices not yet stepped as they are, so that the other
        ranks' all-gathers are answered, and end the step. Warns (or, with
        ``warn=False``, returns the warning for the caller to give once it may
        raise): those slices missed this step's update."""
        unfinished = self._unfinished
        if unfinished is None:
            return None
        left = sum(len(chunk) for chunk in unfinished.chunks)
        # As _step_chunks: progress recorded as made, should a send raise part-way
        # (the next forward or zero_grad() sends the rest).
        unfinished.to_send.extend(b for chunk in unfinished.chunks for b in chunk)
        unfinished.chunks = []
        self._send_stepped(unfinished)
        self._unfinished = None
        # As decided from all-reduced figures: two_stage's next rounds speculate
        # on every rank alike, whichever ranks raised.
        self._finish_step(stepped=True, would_commit=unfinished.would_commit)
        went_on = (f", {where}" if where is not None else
                   ", and the loop went on without calling it again")
        message = (f"fgpsdp: opt.step() raised before it had stepped {left} of the "
                   f"{len(self.model.buckets)} buckets on this rank{went_on}: this rank's "
                   "slices of those buckets were sent as they were, without this step's "
                   "update (call opt.step() again after it raises to finish it)")
        if warn:  # last: a warning raised as an error (-W error) must not stop the sending
            warn_at_user_code(message)
        return message

    def _abandon_failed_speculation(self) -> None:
        """Some rank's speculative step raised (all-reduced: every rank gets here):
        undo this rank's speculative steps, send every stage-1 bucket sent this
        round again (the same buckets on every rank, in the same order), skip the
        step and raise the failing rank's exception. The gradients stay as reduced:
        a loop that catches the error may step again. See [Note: scheduler thread
        lifetime and errors]."""
        model, scheduler = self.model, self.model.scheduler
        resend = scheduler.undo_speculation()
        model.begin_param_exchange()
        for b in resend:
            model.queue_param_all_gather(b)
        self._step_wide_state.end_step(stepped=False)
        error = scheduler.take_error()  # the same on every rank (a collective)
        self.last_step_skipped = True
        self._end_step(would_commit=False, stepped=False)
        raise error

    def _inner_step(self) -> None:
        """The inner optimizer's step without torch's step hooks: a global one
        (``torch.optim.optimizer.register_optimizer_step_post_hook``) fires once per
        ``opt.step()``, as for a torch optimizer, not once per chunk of buckets and
        per speculative step."""
        with self._step_wide_state.run():  # see step_wide_state.py
            self._inner_step_unhooked()

    def _inner_step_unhooked(self) -> None:
        step = type(self.optim).step
        if getattr(step, "hooked", False):  # torch's patch (Optimizer._patch_step_function)
            step.__wrapped__(self.optim)
        else:
            self.optim.step()

    def speculative_step(self, b: int) -> SliceBackup:
        """Stage 1: step bucket b's slice before the global norm is known; return the undo record."""
        storage = self.model.buckets[b]
        sq = self._norm_figures.of_bucket(b)  # before any update
        self.model.finish_param_all_gather(b)
        self._slice_pieces.follow_param_writes([b])
        backup = SliceBackup(storage.param_shard, storage.grad_shard,
                             self._slice_pieces.of_bucket[b], self.optim.state,
                             self._slice_pieces.masters.get(b))
        self._slice_pieces.assign_grads(None, [b], grads={b: backup.grad})
        try:
            while True:  # see [Note: speculative steps during a torch.compile session]
                wait_out_compile_session()
                with no_compile_session_begins:
                    if compile_session_active():  # began before the lock was taken
                        continue
                    ran_with = self._hyperparameters_now()
                    with nvtx_range(f"fgpsdp.speculative_step[{b}]"):
                        self._inner_step()
                    self._slice_pieces.write_back([b])
                    if not compile_session_active():
                        break
                self.restore_speculated(b, backup)
                backup.reset_gradient(storage.grad_shard)
        except BaseException:
            # Raised part-way (an out-of-memory error in a foreach kernel): the slice
            # and its state as they were, for the all-gather that follows all the same.
            self.restore_speculated(b, backup)
            self.model.mark_params_changed([b])
            raise
        self.model.mark_params_changed([b])
        # Kept only for a step that ran: one that raised is measured afresh.
        self._bucket_sq[b] = sq
        # The training loop may write them while this runs (on the scheduler
        # thread): a change in between leaves them unknown, which rolls back.
        if same_hyperparameters(ran_with, self._hyperparameters_now()):
            backup.hyperparameters = ran_with
        return backup

    def restore_speculated(self, b: int, backup: SliceBackup) -> None:
        """Bucket b's slice and its optimizer state as before its speculative step."""
        backup.restore(self.model.buckets[b].param_shard, self._slice_pieces.of_bucket[b],
                       self.optim.state, self._slice_pieces.masters.get(b))
        self._slice_pieces.note_master_restored(b)

    @on_itself
    def unscale_gradients_(self, inv_scale: torch.Tensor) -> Optional[bool]:
        """For ShardedGradScaler.unscale_: multiply every reduced slice by ``inv_scale``.

        A collective (every rank calls it, through the scaler). Returns whether
        any rank's slices hold an inf or NaN, the same on every rank; None where no
        rank's backward fed this step (no parameter has a gradient), where torch's
        scaler records no inf check. The norm measured from then on (clipping,
        clip_grad_norm_) is the unscaled gradient's, as after torch's unscale_.
        """
        if any(s.grad_shard.dtype == torch.float16 for s in self.model.buckets):
            raise ValueError("Attempting to unscale FP16 gradients.")  # torch's refusal
        self.model.refuse_inside_summoned_grads("the scaler's unscale_(opt)")
        self._refuse_while_unfinished("unscale_gradients_() (the scaler's unscale_)")
        if self.model._uneven_inputs is not None:
            # A joined rank's scaler would miss the others' update(): its scale
            # would differ after the join.
            self.model._uneven_inputs.refuse(
                "fgpsdp: ShardedGradScaler is not supported inside model.join() (a joined "
                "rank's loss scale would stop following the others')")
        self._finish_reduce_scatters()
        scheduler = self.model.scheduler
        if scheduler is not None:
            # A speculative step runs during backward, before the scale is known
            # (the first step of a run that speculates from the start): undone
            # at the step. Stage 1 stays off for the run: see docs/semantics.md
            # (float16 loss scaling).
            self._speculated_on_scaled_gradients = bool(scheduler.speculated)
            scheduler.stop_speculating("the gradients are loss-scaled (ShardedGradScaler)",
                                       warn=False)
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        for shard in self._valid_grad_shards():
            by_kind.setdefault((shard.device, shard.dtype), []).append(shard)
        for (device, _), grads in by_kind.items():
            found = torch.zeros((), dtype=torch.float32, device=device)  # the norm sees infs too
            torch._amp_foreach_non_finite_check_and_unscale_(
                grads, found, inv_scale.to(device=device, dtype=torch.float32))
        # Sums of squares taken before (a speculative step's, or clip_grad_norm_'s
        # before unscale_, as torch allows) were of the scaled gradients.
        self._bucket_sq = {}
        self._reduced = False
        self._clipped_norm = None
        self._loss_unscaled = True
        found_inf = not math.isfinite(self._reduce_and_measure())
        self._note_ignored_grads_may_have_changed()
        return found_inf if self._fed_by_a_backward() else None

    def _announce(self, call: AnnouncedCall, *args: float) -> Optional[UnevenInputs]:
        """Under model.join() (see uneven_inputs.py): announce a call that finishes
        the gradients. The round of reduce-scatters it would launch itself (a
        backward that reached no parameter on this rank) is launched first, and
        announced as a backward's is, so every rank announces the same
        sequence whichever launched the round."""
        uneven = self.model._uneven_inputs
        if uneven is None or uneven.joined:
            return uneven
        self._forget_stale_measurements()
        if not self._reduce_scatters_finished:
            self.model.reducer.launch_pending_round()
        uneven.notify(call, *args)
        return uneven

    def _reset_step_measurements(self) -> None:
        """What the optimizer learned about this step's gradients (all-reduced or
        the same on every rank, so every rank resets alike)."""
        self._reduced = False  # reduce-scatters finished and norm measured this step
        self._reduce_scatters_finished = False  # this step's (finishing twice would relaunch)
        self._loss_unscaled = False  # ShardedGradScaler.unscale_ ran this step
        # two_stage stepped some slices before the loss scale was taken out of them.
        self._speculated_on_scaled_gradients = False
        self._bucket_sq: dict[int, torch.Tensor] = {}  # measured before a speculative step
        self._globally_used: Optional[list[bool]] = None
        self._applied_coefficient = 1.0  # clipping applied to the gradient this step
        self._clipped_norm: Optional[float] = None  # the norm measured after the last clip
        # clip_grad_value_ or summon_full_grads changed an element on some rank
        self._grads_edited = False
        # The norm was measured before the loop could change ignored parameters' gradients.
        self._ignored_grads_stale = False
        self._clip_called = False  # clip_grad_norm_ or clip_grad_value_ ran this step
        self._full_grad_read: set[int] = set()  # the parameters full_grad() read this step
        # Some rank's speculative steps ran with other hyperparameters than the step's.
        self._speculated_with_other_hyperparameters = False
        self._speculation_failures = 0  # ranks whose speculative step raised this round

    def note_forward(self) -> None:
        """The wrapper's forward (every rank runs it): one after this step's
        gradients were finished starts another round (the loop skipped step(),
        or accumulates on), so what was measured is forgotten and the step
        finishes and measures again. A backward under no_sync() launches no
        reduce-scatter to tell; the forward before it does, on every rank, even
        one whose backward reaches no parameter. (A forward only between
        clip_grad_norm_ or unscale_ and the step costs a round of
        reduce-scatters adding zeros.)"""
        if self._reduce_scatters_finished:
            self._reset_step_measurements()

    def _forget_stale_measurements(self) -> None:
        """Reduce-scatters launched since this step's were finished: the loop did
        not call step() after measuring (a step it skipped after clip_grad_norm_
        or scaler.unscale_ saw an inf, as torch allows), or ran another
        backward. What was measured is of older gradients: finish and measure
        again. (Every rank launches the same reduce-scatters.)"""
        if (self._reduce_scatters_finished
                and self.model.reducer.reduce_scatters_launched != self._finished_at):
            self._reset_step_measurements()

    def _fed_by_a_backward(self) -> bool:
        """Some rank's backward reached a parameter this step (the same on every rank,
        from the norm's all-reduce; True before it is known)."""
        return self._globally_used is None or any(self._globally_used)

    def _end_step(self, would_commit: bool, stepped: bool = True) -> None:
        # A step that no rank's backward fed (one before the first backward, to build
        # the optimizer's state before a load_state_dict; every gradient None to the
        # inner optimizer, which steps nothing, as torch's): its round of zeros is no
        # gradient stepped, or the next backward would count as adding to it (a
        # warning, and no speculation in that step). The slices hold those zeros only.
        fed = self._fed_by_a_backward()
        self._reset_step_measurements()
        self._clipped_at = None
        self.model.reducer.end_step(stepped_gradients=fed and stepped)
        if not fed:
            for storage in self.model.buckets:
                storage.invalidate_grad_shard()
        if self.model.scheduler is not None:
            self.model.scheduler.end_step(would_commit)
        if self.model.plan_profiler is not None:
            self.model.plan_profiler.end_step()
        if self.model.scheduler is not None:
            self.model.scheduler.report_stop()
        self.model.reducer.report_accumulation()

    def _bucket_fully_used(self, b: int) -> bool:
        used = self._globally_used
        return all(used[span.param_index] for span in self.model.buckets[b].layout.spans)

    # -- checkpoints ----------------------------------------------------------

    @on_itself
    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state, with the layout it belongs to.

        Local and quick; it loads only on this rank of a world of this size
        with these buckets. ``full_state_dict()`` is torch.optim's format.
        """
        optim_checkpoint.refuse_torchs_checkpoint_helpers()
        self._refuse_while_unfinished("state_dict()")
        self._refuse_speculative_state("state_dict()")
        consolidated = self._consolidated[0]
        if consolidated is not None:  # see consolidate_state_dict
            return self._with_groups_now(consolidated)
        self._run_state_dict_pre_hooks()
        self._masters_take_param_writes()
        # The hooks registered on this optimizer see a torch.optim state dict: here
        # the inner optimizer's, over this rank's slices.
        shard = self._run_state_dict_post_hooks(self.optim.state_dict())
        saved = {"shard": shard, "rank": self.model.rank,
                 "world_size": self.model.world_size, "slice_index": self.model.slice_index,
                 "layout": optim_checkpoint.shard_layout(self),
                 "params": optim_checkpoint.shard_params(self)}
        if self._slice_pieces.masters:
            # By bucket; the live tensors, as torch's state_dict() gives its state's.
            saved["master_weights"] = dict(self._slice_pieces.masters)
        return saved

    @on_itself
    def full_state_dict(self, *, rank0_only: bool = False,
                        init_state: bool = False) -> dict[str, Any]:
        """The state dict a torch.optim optimizer over the whole model would hold.

        A collective: call it on every rank. Tensors are on the CPU. With
        ``rank0_only`` the other ranks return ``{}`` (and hold no copy; under
        ``model.join()`` once rank 0 has joined, the lowest active rank keeps it). It
        loads into a ShardedOptimizer at any world size or bucket size, and
        into a torch optimizer built with the same param groups. With
        ``init_state`` the dict holds an entry for every parameter even before the
        first step, the state a step would create, as a template for an in-place
        load (``torch.distributed.checkpoint``); the optimizer itself is unchanged.
        """
        self._refuse_while_unfinished("full_state_dict()")
        self._refuse_speculative_state("full_state_dict()")
        with warn_if_the_others_are_late("opt.full_state_dict()", self.model.world_size,
                                         user_code_line(),
                                         " (rank0_only=True keeps the result on rank 0 alone)"):
            return self._full_state_dict(rank0_only, init_state)

    @on_itself
    def consolidate_state_dict(self, to: int = 0) -> None:
        """torch's ZeroRedundancyOptimizer API, which trainers call before saving a
        sharded optimizer from one rank (PyTorch Lightning's checkpoints): a collective
        that gathers the whole state in torch.optim's format (``full_state_dict()``)
        onto group rank ``to``, whose ``state_dict()`` then returns it, until the next
        step or load. It loads on every rank, at any world size. The other ranks'
        ``state_dict()`` stays their shard (torch's raises there)."""
        world_size = self.model.world_size
        if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to < world_size:
            raise ValueError(f"fgpsdp: consolidate_state_dict(to={to!r}): to is a rank of "
                             f"the optimizer's group, 0 to {world_size - 1}")
        if to != 0 and self.model._uneven_inputs is not None:
            raise ValueError("fgpsdp: consolidate_state_dict(to=...) under model.join() "
                             "consolidates on rank 0 only (or, once it has joined, on the "
                             "lowest active rank, as full_state_dict(rank0_only=True))")
        self._drop_consolidated()  # (an older one: not held twice)
        self._refuse_while_unfinished("consolidate_state_dict()")
        self._refuse_speculative_state("consolidate_state_dict()")
        with warn_if_the_others_are_late("opt.consolidate_state_dict()",
                                         world_size, user_code_line(), ""):
            full = self._full_state_dict(True, False, keep_on_rank=to,
                                         call="opt.consolidate_state_dict()")
        self._consolidated[0] = full or None  # ({} on the other ranks)

    def _drop_consolidated(self) -> None:
        """The optimizer changes (a step, a load): a consolidated dict would be stale."""
        self._consolidated[0] = None

    def _with_groups_now(self, consolidated: dict[str, Any]) -> dict[str, Any]:
        """A new dict: the consolidated state, and the groups' hyperparameters as they
        are now (an lr scheduler may have stepped since), as torch's ZeRO builds its
        groups at each state_dict()."""
        groups = [{**saved, **{k: v for k, v in group.items() if k != "params"}}
                  for saved, group in zip(consolidated["param_groups"], self.param_groups)]
        return {**consolidated, "param_groups": groups}

    def _full_state_dict(self, rank0_only: bool, init_state: bool, keep_on_rank: int = 0,
                         call: str = "opt.full_state_dict(rank0_only=True)") -> dict[str, Any]:
        # (keep_on_rank: consolidate_state_dict's ``to``, 0 under model.join(); call:
        # what a warning names)
        keep_on = keep_on_rank if rank0_only else None  # (None: every rank)
        uneven = self.model._uneven_inputs
        if uneven is not None:
            uneven.notify(AnnouncedCall.FULL_STATE, float(rank0_only), float(init_state))
            if rank0_only:
                keep_on = uneven.rank0_only_keeper()
        created = []
        if init_state:
            # A template for an in-place load (torch.distributed.checkpoint's dcp.load
            # fills only the entries a dict has, and a fresh optimizer has none): the
            # state a step creates, as torch's get_optimizer_state_dict makes it. It is
            # removed once copied out, so the optimizer is left as it was.
            self.model.synchronize()  # no all-gather in flight over the pieces
            created = optim_checkpoint.create_missing_state(self)
        try:
            self._run_state_dict_pre_hooks()
            self._masters_take_param_writes()
            full = optim_checkpoint.full_state_dict(self, keep_on)
        finally:
            for key in created:
                self.optim.state.pop(key, None)
        if keep_on not in (None, 0) and uneven is not None and not uneven.joined:
            # (Said after the collectives: a warning raised as an error (-W error)
            # must not leave the joined rank waiting in them.)
            self._warn_kept_off_rank_0(keep_on, call)
        # (With rank0_only the other ranks hold nothing for a post-hook to edit.)
        return self._run_state_dict_post_hooks(full) if full else full

    def _warn_kept_off_rank_0(self, keep_on: int, call: str) -> None:
        group = self.model.process_group
        first, keeper = (dist.get_global_rank(group, r) for r in (0, keep_on))
        warn_at_user_code(
            f"fgpsdp: {call} under model.join() after rank "
            f"{first} has joined: the dict is kept on rank {keeper}, the lowest active "
            f"rank, and the others get {{}} (a joined rank's loop has ended, so nothing "
            f"would receive it there): save where the dict is not empty, or after the join")

    @on_itself
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict()`` shard (this rank's), or a whole-model dict in
        torch.optim's format (``full_state_dict()``, or a torch optimizer's, as
        a torch DDP run saves it) on every rank."""
        optim_checkpoint.refuse_torchs_checkpoint_helpers()
        self._refuse_while_unfinished("load_state_dict()")
        self._refuse_speculative_state("load_state_dict()")
        if self.model._uneven_inputs is not None:
            self.model._uneven_inputs.announce_load("opt.load_state_dict()")
        self._drop_consolidated()
        if {"state", "param_groups"} <= set(state_dict) and "shard" not in state_dict:
            optim_checkpoint.load_full_state_dict(self, self._run_load_pre_hooks(state_dict))
        else:
            if isinstance(state_dict.get("shard"), dict):
                state_dict = dict(state_dict, shard=self._run_load_pre_hooks(state_dict["shard"]))
            self._load_shard(state_dict)
        # torch's load_state_dict replaces the inner optimizer's group list and
        # state: share the new ones, or lr schedulers would write to the old.
        self._step_wide_state.set_loop_groups(self.optim.param_groups)
        self._share_state()
        for hook in list(self._optimizer_load_state_dict_post_hooks.values()):
            hook(self)

    # The hooks of torch.optim.Optimizer's register_state_dict_pre_hook & co., run as
    # its state_dict() / load_state_dict() run them, on the torch.optim-format dict.
    def _run_state_dict_pre_hooks(self) -> None:
        for hook in list(self._optimizer_state_dict_pre_hooks.values()):
            hook(self)

    def _run_state_dict_post_hooks(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        for hook in list(self._optimizer_state_dict_post_hooks.values()):
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def _run_load_pre_hooks(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        state_dict = state_dict.copy()  # as torch's: a hook may replace entries, not the caller's
        for hook in list(self._optimizer_load_state_dict_pre_hooks.values()):
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def _share_state(self) -> None:
        """The inner optimizer's state, also as ``opt.state``, where a lookup of a model
        parameter inserts nothing (see slice_state.py)."""
        index = self.model.param_index  # not self: the state would hold its optimizer
        # The one a load replaced (torch's load_state_dict makes a new one): its
        # warning is not given twice.
        previous = self.__dict__.get("_slice_state")
        self.optim.state = SliceState(lambda key: index(key) is not None, self.optim.state,
                                      warned=previous is not None and previous.warned,
                                      before_reset=functools.partial(
                                          refuse_speculative_state, self.model))
        self._slice_state = self.optim.state
        self.__dict__.pop("state", None)  # torch.optim.Optimizer.__init__'s: see state

    def _load_shard(self, state_dict: dict[str, Any]) -> None:
        """A collective (every rank loads its own shard): a shard that does not fit on
        one rank raises on every rank, so that none goes on alone into the next
        step's collectives."""
        problem = optim_checkpoint.shard_problem(self, state_dict)
        # On the buckets' device: an NCCL-only group has no backend for CPU tensors.
        unfit = torch.tensor([0.0 if problem is None else 1.0], device=self._device)
        self.model.all_reduce_sum(unfit)
        if problem is not None:
            raise ValueError(problem)
        if unfit.item() > 0:
            raise ValueError(f"fgpsdp: the optimizer shards of {int(unfit.item())} other rank(s) "
                             "do not fit (see their errors); nothing was loaded")
        self.optim.load_state_dict(state_dict["shard"])
        # A shard saved without master weights restarts them from the parameters.
        self._slice_pieces.load_masters(state_dict.get("master_weights") or {})

    def _refuse_while_unfinished(self, what: str) -> None:
        """Raised locally, before any collective: under serial and overlap_backward the
        ranks whose step went through wait inside it for the rest of this rank's
        all-gathers, and a rank that alone failed would call this collective alone;
        and the optimizer state is half stepped."""
        if self._unfinished is not None:
            raise RuntimeError(
                f"fgpsdp: opt.{what} while this rank's opt.step() is unfinished (it raised "
                "part-way): call opt.step() again to finish it, or go on (a forward or "
                "zero_grad() sends the rest unstepped) first")

    def _refuse_speculative_state(self, what: str) -> None:
        refuse_speculative_state(self.model, what)

    # -- internals -----------------------------------------------------------

    def _reduce_and_measure(self) -> float:
        """Finish the reduce-scatters once per step; return the global L2 norm.

        Each bucket's sum of squares is taken separately (before its
        speculative step, under two_stage) and added in bucket order, so every
        schedule computes the same float64 total. One all-reduce carries
        [sum of squares, non-finite flag, hyperparameters-changed flag,
        speculative-step-failed flag, per-parameter used count].
        """
        self._forget_stale_measurements()
        if self._reduced:
            return self._total_norm
        model = self.model
        self._finish_reduce_scatters()
        local = torch.zeros(2, dtype=torch.float64, device=self._device)
        speculated = model.scheduler.speculated if model.scheduler is not None else {}
        for b, storage in enumerate(model.buckets):
            if not storage.grad_shard_valid:
                continue  # no gradient since zero_grad(set_to_none=True): adds nothing
            part = self._bucket_sq.get(b)
            stale = b in speculated and \
                speculated[b][1] != model.reducer.reduce_scatters_since_reset[b]
            local += part if part is not None and not stale \
                else self._norm_figures.of_bucket(b)
        self._norm_figures.add_ignored(local)
        # The host-side figures in one CPU tensor and one copy: on CUDA a copy from
        # pageable memory (torch.tensor(..., device=cuda), .to(cuda)) waits for the
        # whole stream; from pinned memory it is queued behind the norms.
        flags = torch.empty(2 + len(model.reducer.locally_used), dtype=torch.float64)
        flags[0] = float(self._speculation_hyperparameters_differ(speculated))
        flags[1] = float(model.scheduler is not None and model.scheduler.failed)
        flags[2:] = model.reducer.locally_used
        if local.is_cuda:
            flags = flags.pin_memory()
        packet = torch.cat([local, flags.to(local.device, non_blocking=True)])
        with model.timeline.span("compute", "norm all-reduce"):
            model.all_reduce_sum(packet)
            if self._norm_figures.sums_over_model_parallel:  # (no copy onto itself otherwise)
                packet[:2] = self._norm_figures.summed_over_model_parallel(packet[:2])
        packet = packet.cpu()
        sq_sum, nonfinite = float(packet[0]), float(packet[1])
        self._speculated_with_other_hyperparameters = float(packet[2]) > 0
        self._speculation_failures = int(round(float(packet[3])))
        self._globally_used = (packet[4:] > 0).tolist()
        self._total_norm = norm_from(sq_sum, nonfinite)
        self._reduced = True
        return self._total_norm

    def _finish_reduce_scatters(self) -> None:
        """Once per step: every reduce-scatter has landed, every stage-1 step is taken."""
        self._forget_stale_measurements()
        if self._reduce_scatters_finished:
            return
        model = self.model
        with model.timeline.span("compute", "wait reduce-scatters"):
            model.reducer.finish_gradient_sync()
        if model.scheduler is not None:
            with model.timeline.span("compute", "join scheduler"):
                model.scheduler.finish_stage1()
        self._reduce_scatters_finished = True
        self._finished_at = model.reducer.reduce_scatters_launched

    @property
    def _device(self) -> torch.device:
        """Where the buckets (and so the norm's figures) live."""
        return self.model.buckets[0].device if self.model.buckets else torch.device("cpu")

    def _speculation_hyperparameters_differ(self, speculated: dict[int, tuple]) -> bool:
        """This rank's view: did a speculative step run with other hyperparameters than now?"""
        if not speculated:
            return False
        now = self._hyperparameters_now()
        return any(not same_hyperparameters(backup.hyperparameters, now)
                   for backup, _ in speculated.values())

    def _hyperparameters_now(self) -> list[dict]:
        """What a step on this thread would run with (speculation.hyperparameters)."""
        return hyperparameters(self.param_groups, cpu_arithmetic=self._device.type == "cpu")

    def _any_rank(self, flag: bool) -> bool:
        packet = torch.tensor([float(flag)], dtype=torch.float64, device=self._device)
        self.model.all_reduce_sum(packet)
        return float(packet.cpu()[0]) > 0

    def _apply_clip(self, max_norm: float) -> None:
        # torch: coefficient max_norm / (total + 1e-6), applied when below 1,
        # with the total of what the gradients hold now: a second clip in one
        # step (clip_grad_norm_ and max_grad_norm, or a step retried after it
        # raised) sees the clipped gradient, as torch's would, instead of
        # clipping by the first total again.
        total = self._norm_now()
        if not math.isfinite(total):
            return
        coefficient = max_norm / (total + 1e-6)
        if coefficient < 1.0:
            shards = [s.grad_shard for s in self.model.buckets]
            # A CPU float64 tensor, not a Python float: on CPU the foreach kernel
            # rounds a Python float to the shards' dtype first (bfloat16: up to
            # 0.4% off the coefficient); a scalar tensor is applied at the
            # kernel's compute precision, as g.mul_(coefficient) is (float32 for
            # bfloat16, float64 for float64). CUDA takes it as a scalar alike.
            scale = torch.tensor(coefficient, dtype=torch.float64)
            ignored = self._norm_figures.ignored_grads()
            torch._foreach_mul_(shards + [g for g in ignored if not g.is_sparse], scale)
            for g in ignored:
                if g.is_sparse:
                    g.mul_(scale)
            self._applied_coefficient *= coefficient
            self._clipped_norm = None  # measured again when asked for

    def _note_ignored_grads_may_have_changed(self) -> None:
        """Where a call that measured the norm returns to the loop: with
        ``clip_ignored_parameters`` the loop may change the gradients of the parameters
        left to the user (their own ``p.grad``: an expert's all-reduce, an edit) before
        it clips or steps, so the norm is measured again then, as torch's clip would
        measure what they hold at that point. The same on every rank (the settings and
        the measurement are)."""
        # (Not whether this rank holds such parameters now: one that froze its own
        # expert since wrapping would skip the measure's all-reduce the others make.)
        if self._reduced and self.clip_ignored_parameters:
            self._ignored_grads_stale = True
            self._clipped_norm = None

    def measured_norm_stands(self) -> None:
        """For ShardedGradScaler.step's own unscale_: no loop code ran between it and
        the step, so the gradients of the parameters left to the user are as measured
        (no second measure: an all-reduce saved)."""
        self._ignored_grads_stale = False

    def _valid_grad_shards(self) -> list[torch.Tensor]:
        """This rank's reduced gradient slices, bucket by bucket, but those holding no
        gradient since zero_grad(set_to_none=True)."""
        return [s.grad_shard for s in self.model.buckets if s.grad_shard_valid]

    def _norm_now(self) -> float:
        """The norm of what the reduced slices hold now. After a clip (or a
        clip_grad_value_ that changed some element) it is measured again, as torch's
        second clip_grad_norm_ measures the clipped gradient: the
        total times the coefficient differs from that by the clipped elements'
        rounding, and a second coefficient taken from it would be off in the last
        bits. So is it where the loop may have changed the gradients of the parameters
        left to the user since it was measured (_note_ignored_grads_may_have_changed). A
        collective then (every rank clipped alike: the decision used only all-reduced
        figures)."""
        if self._ignored_grads_stale:  # (see _note_ignored_grads_may_have_changed)
            self._ignored_grads_stale = False
            self._clipped_norm = None
        elif self._applied_coefficient == 1.0 and not self._grads_edited \
                and self._clipped_norm is None:
            return self._total_norm
        if self._clipped_norm is None:
            local = torch.zeros(2, dtype=torch.float64, device=self._device)
            for b, storage in enumerate(self.model.buckets):  # in bucket order, as the first
                if storage.grad_shard_valid:
                    local += self._norm_figures.of_bucket(b)
            self._norm_figures.add_ignored(local)
            with self.model.timeline.span("compute", "norm all-reduce"):
                self.model.all_reduce_sum(local)
                local = self._norm_figures.summed_over_model_parallel(local)
            sq_sum, nonfinite = (float(v) for v in local.cpu())
            self._clipped_norm = norm_from(sq_sum, nonfinite)
        return self._clipped_norm

    def _norm_tensor(self, total: float) -> torch.Tensor:
        # The dtype torch's clip returns: its per-dtype norms stacked, so the dtypes
        # of the gradients there are (those of parameters some rank's backward
        # reached), promoted (float32 under master_weights, whose slices are
        # float32); float32 without any gradient (torch's 0.0).
        slot, buckets = self.model.reducer.slot, self.model.buckets
        used = self._globally_used or []
        dtypes = {buckets[slot[i][0]].grad_shard.dtype
                  for i, reached in enumerate(used) if reached and i in slot}
        dtype = functools.reduce(torch.promote_types, dtypes) if dtypes else torch.float32
        return torch.tensor(total, dtype=dtype, device=self._device)


def refuse_speculative_state(model: DistributedDataParallel, what: str) -> None:
    """Raise where ``opt.{what}`` would see (or reset) two_stage's speculative
    updates of the optimizer state: between backward and step."""
    # Not undone here: undoing re-sends the restored slices, a collective, and
    # a checkpoint is often taken on one rank. Whether stage 1 holds anything
    # depends on the plan, so a loop can pass the profile window and raise
    # from step 4 on: the message says both ways out. Settled first, as for a
    # save of the module: a survivor of a failed peer saves here too.
    scheduler = model.scheduler
    if scheduler is not None and scheduler.holds_speculative_values_once_settled():
        raise RuntimeError(
            f"fgpsdp: opt.{what} between backward and opt.step() would see two_stage's "
            "speculative updates of the optimizer state; call it after opt.step(), or "
            "call model.synchronize() first on every rank (it undoes them; the step "
            "then redoes them)")


# summon_full_grads' selection in the read's agreement (see _enter_summoned_block).
_EVERY_PARAMETER, _SOME_PARAMETERS = 0, 1


class _SummonedGradsBlock:
    """``with opt.summon_full_grads():`` (a class, not a generator: both ends run as
    they are under torch.compile, as the optimizer's other calls do)."""

    def __init__(self, optimizer: ShardedOptimizer,
                 params: Optional[Sequence[torch.Tensor]], writeback: bool):
        self.optimizer, self.params, self.writeback = optimizer, params, writeback
        self.summoned: Optional[summoned_grads.SummonedGrads] = None

    @torch.compiler.disable
    def __enter__(self) -> None:
        if self.summoned is not None:
            raise RuntimeError("fgpsdp: a summon_full_grads() block entered twice")
        self.summoned = self.optimizer._enter_summoned_block(self.params)

    @torch.compiler.disable
    def __exit__(self, kind, value, traceback) -> None:
        summoned, self.summoned = self.summoned, None
        self.optimizer._leave_summoned_block(summoned, self.writeback, raised=kind is not None)


@dataclass
class _UnfinishedStep:
    """What is left of a step whose inner optimizer raised part-way (an
    out-of-memory error; a hyperparameter it refuses).

    The step had taken every decision from all-reduced figures (the norm, the
    clip, what to roll back) and sent the chunks stepped before; peers went on
    and wait for the rest of its all-gathers. The rest is sent in the same order
    whether the loop calls opt.step() again (each chunk stepped then: on this
    rank alone too, with no collective, as torch DDP's optimizer step is local)
    or goes on without it (sent unstepped, with a warning). A chunk that raised
    after writing some of its slices (torch's optimizers check their arguments
    first) is stepped again whole, as a torch optimizer's step called again is."""

    chunks: list[list[int]]  # not yet stepped, the next first, in forward order
    to_send: list[int]  # stepped, their all-gathers not yet queued
    globally_used: Optional[list[bool]]
    would_commit: bool
    chunk_count: int  # chunks the first call had to step
    committed_speculation: bool  # two_stage's speculative steps kept some buckets' update
    # What the first call stepped with (speculation.hyperparameters), taken when it raised.
    hyperparameters: Any = None
    save_warned: bool = False  # a save of the module said it holds part of this step


def _refuse_muon_groups_over_non_matrices(model: DistributedDataParallel,
                                          groups: Sequence[dict[str, Any]]) -> None:
    """torch.optim.Muon's own check, on the parameters (the inner optimizer sees 1-D
    pieces): a use_muon group takes 2-D parameters only."""
    names = {id(p): n for n, p in model.named_trainable_parameters()}
    for group in groups:
        if group.get("use_muon") is True:
            for p in group["params"]:
                if p.ndim != 2:
                    raise not_a_matrix(names.get(id(p), '?'), p.shape)
