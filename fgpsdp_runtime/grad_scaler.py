"""ShardedGradScaler: torch.amp.GradScaler (float16 loss scaling) for a ShardedOptimizer.

torch's scaler unscales ``param.grad`` and looks there for infs. Here the
reduced gradient lives in this rank's slices, not in ``param.grad``, and an
inf in one rank's slice is not in another's. This scaler keeps torch's API
and bookkeeping (the scale, its growth and backoff, ``state_dict()``) and
changes two things for a ShardedOptimizer:

- ``unscale_`` multiplies the reduced slices by the inverse scale (torch's
  kernel, so the same values as after torch DDP) and takes the inf/NaN flag
  from the optimizer's norm all-reduce: every rank sees the same flag, so
  every rank skips the same steps and moves the scale alike.
- ``step`` runs the optimizer's step work even when the flag is set (without
  its step hooks, as torch skips ``step()``): it skips the update on every
  rank, but must run, to undo two_stage's speculative steps and to keep the
  ranks' collectives paired.

Other optimizers given to the same scaler go through torch's code unchanged.
"""
from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import OptState

from .optim import ShardedOptimizer
from .group_collectives import all_reduce_held
from .ignored_params import latest_wrapper_leaving_parameters
from .optimizer_itself import itself
from .user_warnings import warn_at_user_code


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose ``unscale_`` and ``step`` understand ShardedOptimizer.

    Used as torch's: ``scaler.scale(loss).backward()``, optionally
    ``scaler.unscale_(opt)`` then ``opt.clip_grad_norm_(max_norm)``,
    ``scaler.step(opt)``, ``scaler.update()``. ``unscale_`` and ``step`` are
    collectives for a ShardedOptimizer: call them on every rank.
    """

    # Collectives and the optimizer's bookkeeping: run as they are under
    # torch.compile (see the note at ShardedOptimizer.zero_grad).
    @torch.compiler.disable
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(optimizer, ShardedOptimizer):
            return super().unscale_(optimizer)
        if not self._enabled:
            return
        # Keyed by the optimizer itself: Lightning unscales through its wrapper and
        # steps the optimizer (see optimizer_itself.py).
        optimizer = itself(optimizer)
        optimizer.model.refuse_inside_summoned_grads("the scaler's unscale_(opt)")
        self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        self.__dict__.setdefault("_sharded_this_round", {})[id(optimizer)] = optimizer
        if state["stage"] is OptState.READY and optimizer.clip_ignored_parameters:
            self._warn_if_ignored_still_scaled(optimizer)
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        if optimizer.clipped_this_step():
            self._warn_clip_before_unscale()
        wrapper = latest_wrapper_leaving_parameters()
        if wrapper is not None:
            # Here too (every rank unscales this optimizer, once per step): an update()
            # after the experts' step (one per optimizer) may have moved one rank's.
            self._take_the_smallest_scale(wrapper, None)
        # The reciprocal in float64, as torch takes it (float32 division can round otherwise).
        inv_scale = self._scale.double().reciprocal().float()
        found_inf = optimizer.unscale_gradients_(inv_scale)
        device = self._scale.device
        # None: no gradient at all; as torch's, step() and update() then raise.
        state["found_inf_per_device"] = {} if found_inf is None else {
            device: torch.full((), float(found_inf), dtype=torch.float32, device=device)}
        state["stage"] = OptState.UNSCALED

    @torch.compiler.disable
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(optimizer, ShardedOptimizer) or not self._enabled:
            return super().step(optimizer, *args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        optimizer = itself(optimizer)
        optimizer.model.refuse_inside_summoned_grads("the scaler's step(opt)")
        self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
            # No loop code ran since: what unscale_ measured stands for the step.
            optimizer.measured_norm_stands()
        result = None
        # torch's check, on every rank alike (see unscale_gradients_).
        assert len(state["found_inf_per_device"]) > 0, \
            "No inf checks were recorded for this optimizer."
        if sum(v.item() for v in state["found_inf_per_device"].values()):
            # Skipped on every rank (the flag is all-reduced); its step hooks do
            # not run, as under torch.
            optimizer.run_step(inf_found_by_scaler=True)
        else:
            result = optimizer.step(*args, **kwargs)
        state["stage"] = OptState.STEPPED
        return result

    def _warn_clip_before_unscale(self) -> None:
        """A clip of this step ran on gradients still multiplied by the loss scale: it
        measured and clipped (or clamped) them as torch's does then. Said once:
        PyTorch Lightning's MixedPrecision plugin skips unscale_ for this optimizer (it
        reads _step_supports_amp_scaling as "unscales itself")."""
        if self.__dict__.get("_warned_clip_before_unscale"):
            return
        self._warned_clip_before_unscale = True
        warn_at_user_code(
            "fgpsdp: opt.clip_grad_norm_ (or clip_grad_value_) ran before "
            "scaler.unscale_(opt), on gradients still multiplied by the loss scale "
            f"({self.get_scale():g}): its norm and its bound were those of the scaled "
            "gradients, as torch's clip's are then. Call scaler.unscale_(opt) before the "
            "clip (under PyTorch Lightning's MixedPrecision plugin, which does not call "
            "it for this optimizer: trainer.precision_plugin.scaler.unscale_(optimizer) "
            "in configure_gradient_clipping)")

    def _warn_if_ignored_still_scaled(self, optimizer: ShardedOptimizer) -> None:
        """With ``clip_ignored_parameters`` the norm takes the gradients of the
        parameters the wrapper leaves to the user as they are: still loss-scaled
        unless their optimizer was unscaled first (its norm came out ~scale times too
        large, the clip ~scale times too hard). Said once, on this rank: no optimizer
        of this round is unscaled yet."""
        if self.__dict__.get("_warned_ignored_scaled") \
                or not optimizer._norm_figures.ignored_grads():
            return
        if any(state["stage"] is OptState.UNSCALED and key not in self._sharded_this_round
               for key, state in self._per_optimizer_states.items()):
            return
        self._warned_ignored_scaled = True
        warn_at_user_code(
            "fgpsdp: clip_ignored_parameters: the gradients of the parameters named in "
            "_ddp_params_and_buffers_to_ignore are still loss-scaled when the "
            "ShardedOptimizer unscales: its norm would take them at the scale's size. Call "
            "scaler.unscale_(their optimizer) before scaler.step(opt) (or "
            "scaler.unscale_(opt))")

    @torch.compiler.disable
    def scale(self, outputs: Any) -> Any:
        """torch's scale. While a wrapper that leaves trainable parameters to the user
        lives, every rank first takes the smallest of the ranks' scales: an experts'
        optimizer finds its infs on one rank alone, which backs off that rank's scale
        alone, and the next reduce-scatter would sum gradients scaled apart (each
        rank unscaling its slices by its own). Here, as every rank calls scale() once
        per backward (each a collective of the wrapper's), not at update(), which a
        loop may call a different number of times on each rank (once per optimizer
        stepped, as Lightning's and Accelerate's do, one not stepped where its experts
        got no gradient)."""
        if self._enabled:
            wrapper = latest_wrapper_leaving_parameters()
            if wrapper is not None:
                self._take_the_smallest_scale(wrapper, outputs)
        return super().scale(outputs)

    def _take_the_smallest_scale(self, wrapper: Any, outputs: Any) -> None:
        if self._scale is None:  # (a first scale(): unscale_ comes after one)
            first = _first_tensor(outputs)
            if first is None:
                return
            self._lazy_init_scale_growth_tracker(first.device)
        own = self._scale
        # The smallest scale and the smallest growth count, in one all-reduce: a rank
        # brought down to the others' scale starts its count again with theirs (else
        # each grew alone, and the smallest undid it each time), and ranks updated to
        # scales of their own keep growing together. On the device: no host sync.
        pair = torch.stack([own.detach().to(torch.float64),
                            self._growth_tracker.to(own.device, torch.float64)])
        pair = pair.to(wrapper.device)
        all_reduce_held(pair, dist.ReduceOp.MIN, wrapper.process_group, "loss scale")
        pair = pair.to(own.device)
        self._growth_tracker = pair[1].to(self._growth_tracker.dtype)
        # A new tensor, not written in place: autograd saved the old one for an
        # output scaled before (two losses scaled for one backward).
        self._scale = pair[0].to(own.dtype)

    @torch.compiler.disable
    def update(self, new_scale: Optional[Union[float, torch.Tensor]] = None) -> None:
        """torch's update, run as it is under torch.compile: the state it reads was
        written by the eager unscale_ and step."""
        self.__dict__.pop("_sharded_this_round", None)
        super().update(new_scale)


def _first_tensor(outputs: Any) -> Optional[torch.Tensor]:
    """The first tensor of what ``scale()`` takes (a tensor, or nested iterables)."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, (str, bytes)):
        return None
    try:
        for item in outputs:
            found = _first_tensor(item)
            if found is not None:
                return found
    except TypeError:
        return None
    return None
