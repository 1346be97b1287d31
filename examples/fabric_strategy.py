"""A Lightning Fabric strategy that runs fgpsdp in place of torch DDP: a Fabric loop
written for ``strategy="ddp"`` runs unchanged with ``strategy=FgpsdpFabricStrategy()``
(checked with Lightning 2.6.6; ``examples/fabric_loop.py`` uses it).

    from fabric_strategy import FgpsdpFabricStrategy
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FgpsdpFabricStrategy())
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))

What it changes in Fabric's DDP strategy (``lightning.fabric.strategies.DDPStrategy``):

- ``setup_module`` wraps the model in ``fgp.DistributedDataParallel`` (keyword
  arguments of the strategy go to it: ``schedule=``, ``bucket_cap_mb=``, ...).
- ``setup_optimizer`` turns the torch.optim optimizer built over the model's
  parameters into a ``fgp.ShardedOptimizer`` of its class, groups and
  hyperparameters (``ShardedOptimizer.from_optimizer``), for ``fabric.setup(model,
  optimizer)`` and for ``fabric.setup_module`` then ``fabric.setup_optimizers``
  alike. Build lr schedulers on the optimizer Fabric returns: one built before is
  refused (it would schedule an optimizer that no longer steps anything).
- ``fabric.no_backward_sync(model)`` enters the wrapper's ``no_sync()``.
- ``fabric.clip_gradients(model, optimizer, max_norm=... | clip_val=...)`` clips the
  reduced, sharded gradient with the ShardedOptimizer's own clip (Fabric's goes over
  ``optimizer.param_groups``, this rank's slices, which hold no ``.grad``: by norm it
  clipped nothing, silently). Fabric's measures the norm of the optimizer's
  parameters, the sharded clip of every trainable parameter of the model: a clip by
  norm is refused where the optimizer leaves some out (freeze those instead).
- One optimizer per model (the ShardedOptimizer's rule): give parts of a model their
  own hyperparameters with param groups of one torch optimizer.
- Float16 loss scaling: the precision plugin's torch ``GradScaler`` becomes a
  ``fgp.ShardedGradScaler`` with the same settings (torch's unscales ``param.grad``,
  which here holds nothing; the ShardedOptimizer refuses it).

Everything else is Fabric's: ``fabric.backward``, ``fabric.autocast`` and the
precision plugins (a model set up by Fabric has its forward cast), ``fabric.save`` /
``fabric.load`` (Fabric calls the ShardedOptimizer's ``consolidate_state_dict()``
on every rank, and rank 0 saves the whole optimizer state, which loads at any world
size; the model's keys are the module's own).
"""
from __future__ import annotations

import weakref
from contextlib import nullcontext
from datetime import timedelta
from typing import Any, Optional

import torch
from torch.distributed.constants import default_pg_timeout

try:
    from lightning.fabric.plugins.precision.amp import MixedPrecision
    from lightning.fabric.strategies import DDPStrategy
    from lightning.fabric.strategies.strategy import _BackwardSyncControl
except ImportError as error:  # (not a dependency of fgpsdp_runtime)
    raise SystemExit(f"this example needs Lightning (pip install lightning): {error}")

import fgpsdp_runtime as fgp


class _NoSync(_BackwardSyncControl):
    def no_backward_sync(self, module: torch.nn.Module, enabled: bool):
        if not enabled:
            return nullcontext()
        if not isinstance(module, fgp.DistributedDataParallel):
            raise TypeError("fabric.no_backward_sync needs a model set up by this strategy, "
                            f"got {type(module).__name__}")
        return module.no_sync()


class FgpsdpFabricStrategy(DDPStrategy):
    """Fabric's DDP strategy with fgpsdp's wrapper and sharded optimizer."""

    def __init__(self, process_group_backend: Optional[str] = None,
                 timeout: Optional[timedelta] = default_pg_timeout,
                 **wrapper_kwargs: Any) -> None:
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        self._wrapper_kwargs = wrapper_kwargs
        self._backward_sync_control = _NoSync()
        # The wrappers set up so far, for setup_optimizers after setup_module.
        self._wrappers: list[weakref.ref] = []
        # The optimizers that leave some trainable parameters of their model out.
        self._partial: weakref.WeakSet = weakref.WeakSet()

    def setup_environment(self) -> None:
        super().setup_environment()
        scaler = getattr(self.precision, "scaler", None)
        if isinstance(self.precision, MixedPrecision) and scaler is not None \
                and not isinstance(scaler, fgp.ShardedGradScaler):
            self.precision.scaler = fgp.ShardedGradScaler(
                scaler._device, init_scale=scaler._init_scale,
                growth_factor=scaler._growth_factor, backoff_factor=scaler._backoff_factor,
                growth_interval=scaler._growth_interval, enabled=scaler.is_enabled())

    def setup_module(self, module: torch.nn.Module) -> fgp.DistributedDataParallel:
        wrapper = (module if isinstance(module, fgp.DistributedDataParallel)
                   else fgp.DistributedDataParallel(module, **self._wrapper_kwargs))
        self._wrappers.append(weakref.ref(wrapper))
        return wrapper

    def setup_module_and_optimizers(self, module, optimizers, scheduler=None):
        wrapper = self.setup_module(module)
        return wrapper, [self._sharded(wrapper, o) for o in optimizers], scheduler

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> fgp.ShardedOptimizer:
        return self._sharded(self._wrapper_of(optimizer), optimizer)

    def _sharded(self, wrapper: fgp.DistributedDataParallel,
                 optimizer: torch.optim.Optimizer) -> fgp.ShardedOptimizer:
        sharded = fgp.ShardedOptimizer.from_optimizer(wrapper, optimizer)
        given = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if not all(id(p) in given for _, p in wrapper.named_trainable_parameters()):
            self._partial.add(sharded)
        return sharded

    def _wrapper_of(self, optimizer: torch.optim.Optimizer) -> fgp.DistributedDataParallel:
        if isinstance(optimizer, fgp.ShardedOptimizer):
            return optimizer.model
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for ref in self._wrappers:
            wrapper = ref()
            if wrapper is not None and any(wrapper.param_index(p) is not None for p in params):
                return wrapper
        raise ValueError("fgpsdp: the optimizer's parameters are in no model this strategy "
                         "set up: fabric.setup_module(model) first, then build the optimizer "
                         "over model.parameters() and fabric.setup_optimizers(optimizer)")

    def clip_gradients_norm(self, module, optimizer, max_norm, norm_type=2.0,
                            error_if_nonfinite=True) -> torch.Tensor:
        if optimizer in self._partial:
            # Fabric's clip measures the norm over the optimizer's parameters; the
            # sharded clip measures it over every reduced gradient of the model.
            raise ValueError(
                "fgpsdp: fabric.clip_gradients(max_norm=...) clips by the norm of the "
                "optimizer's parameters, and this optimizer steps only some of the model's "
                "trainable parameters, while the sharded clip measures them all: freeze "
                "the others (requires_grad_(False)) before fabric.setup")
        self._unscale(optimizer)
        return optimizer.clip_grad_norm_(max_norm, norm_type,
                                         error_if_nonfinite=error_if_nonfinite)

    def clip_gradients_value(self, module, optimizer, clip_val) -> None:
        self._unscale(optimizer)
        optimizer.clip_grad_value_(clip_val)

    def _unscale(self, optimizer: fgp.ShardedOptimizer) -> None:
        scaler = getattr(self.precision, "scaler", None)
        if isinstance(scaler, fgp.ShardedGradScaler):
            # Not through the plugin's unscale_gradients, which refuses an optimizer
            # that takes the scale in its step (as a ShardedOptimizer says it does).
            scaler.unscale_(optimizer)
        else:
            self.precision.unscale_gradients(optimizer)

    def get_module_state_dict(self, module: torch.nn.Module) -> dict[str, Any]:
        if isinstance(module, fgp.DistributedDataParallel):
            module = module.module
        return super().get_module_state_dict(module)

    def load_module_state_dict(self, module: torch.nn.Module, state_dict: dict[str, Any],
                               strict: bool = True) -> None:
        if isinstance(module, fgp.DistributedDataParallel):
            module = module.module
        super().load_module_state_dict(module, state_dict, strict)

