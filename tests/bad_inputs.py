"""Rank functions that feed fgpsdp bad input (imported by spawned ranks)."""
import warnings

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn

import fgpsdp_runtime as fgp

from .scenarios import MLP


def models_differ(rank, world_size):
    model = MLP()
    if rank == 1:
        model.net[0] = nn.Linear(13, 38)  # rank 1 built another model
        model.net[2] = nn.Linear(38, 29)
    fgp.DistributedDataParallel(model)


def sparse_module(rank, world_size):
    fgp.DistributedDataParallel(nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2)))


class FunctionalSparse(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(10, 4))

    def forward(self, idx):
        return nn.functional.embedding(idx, self.weight, sparse=True)


def sparse_gradient_at_runtime(rank, world_size):
    model = fgp.DistributedDataParallel(FunctionalSparse())
    model(torch.tensor([1, 2, 3])).sum().backward()


def gradient_of_another_shape(rank, world_size):
    model = fgp.DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))

    def replace(param):  # a post-accumulate hook swapping the gradient's storage
        param.grad.data = torch.ones(3)
    model.module[0].weight.register_post_accumulate_grad_hook(replace)
    model(torch.randn(2, 4)).sum().backward()


class OptionalFirstLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.last = nn.Linear(4, 2)

    def forward(self, x, use_first=True):
        return self.last(self.first(x) if use_first else x)


def gradient_of_another_shape_left_by_no_sync(rank, world_size):
    model = fgp.DistributedDataParallel(OptionalFirstLayer())

    def replace(param):  # a post-accumulate hook swapping the gradient's storage
        param.grad.data = torch.ones(3)
    model.module.first.weight.register_post_accumulate_grad_hook(replace)
    with model.no_sync():  # the gradient stays in param.grad
        model(torch.randn(2, 4)).sum().backward()
    # first is unused here: its no_sync() gradient is reduced as it was left.
    model(torch.randn(2, 4), use_first=False).sum().backward()


def mixed_devices(rank, world_size):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    if rank == world_size - 1:  # only one rank is broken: all must still raise
        model[1].to("meta")
    fgp.DistributedDataParallel(model)


def complex_dtype(rank, world_size):
    model = nn.Linear(4, 4).to(torch.complex64)
    fgp.DistributedDataParallel(model)


class NotATorchOptimizer:
    def __init__(self, params, lr=0.1):
        self.params = list(params)


def non_torch_optimizer(rank, world_size):
    model = fgp.DistributedDataParallel(MLP())
    fgp.ShardedOptimizer(model, NotATorchOptimizer, lr=0.1)


def non_elementwise_optimizer(rank, world_size):
    model = fgp.DistributedDataParallel(MLP())
    fgp.ShardedOptimizer(model, torch.optim.LBFGS, lr=0.1)


def param_groups_replaced_by_others(rank, world_size):
    """A new group list over other tensors (the model's parameters) than the slices."""
    model = fgp.DistributedDataParallel(MLP())
    opt = fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    opt.param_groups = [{"params": list(model.parameters()), "lr": 0.1}]


def param_group_dict_over_other_tensors(rank, world_size):
    """One group's dict replaced in the list, over the model's parameters: before,
    the steps went over them (no gradient there) and nothing trained, silently."""
    model = fgp.DistributedDataParallel(MLP())
    opt = fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    opt.param_groups[0] = {**opt.param_groups[0], "params": list(model.parameters())}
    model(torch.randn(4, 13)).sum().backward()
    opt.step()


def param_group_params_replaced(rank, world_size):
    """"params" of a group replaced with fewer of its own tensors (two_stage's
    speculative steps during backward already ran over them)."""
    model = fgp.DistributedDataParallel(MLP(), schedule="two_stage", bucket_cap_mb=0.0001,
                                       overlap_plan="layout")
    opt = fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    group = opt.param_groups[0]
    group["params"] = group["params"][1:]
    model(torch.randn(4, 13)).sum().backward()
    opt.step()


def param_groups_dropped(rank, world_size):
    model = fgp.DistributedDataParallel(MLP())
    opt = fgp.ShardedOptimizer(model, torch.optim.SGD, param_groups=[
        {"params": [model.module.net[0].weight]},
        {"params": [p for n, p in model.module.named_parameters() if n != "net.0.weight"]}],
        lr=0.1)
    opt.param_groups = opt.param_groups[1:]


def differentiable_optimizer(rank, world_size):
    model = fgp.DistributedDataParallel(MLP())
    fgp.ShardedOptimizer(model, torch.optim.Adam, lr=0.1, differentiable=True)


def differentiable_group(rank, world_size):
    model = fgp.DistributedDataParallel(MLP())
    fgp.ShardedOptimizer(model, torch.optim.SGD, param_groups=[
        {"params": list(model.parameters()), "differentiable": True}], lr=0.1)


def muon_optimizer(rank, world_size):
    model = fgp.DistributedDataParallel(MLP())
    fgp.ShardedOptimizer(model, torch.optim.Muon, lr=0.02)


class FusedLAMB(torch.optim.Optimizer):
    """apex's name; a per-tensor trust ratio."""

    def __init__(self, params, lr=1e-3):
        super().__init__(params, {"lr": lr})


def layerwise_optimizer(rank, world_size):
    model = fgp.DistributedDataParallel(MLP())
    fgp.ShardedOptimizer(model, FusedLAMB, lr=1e-3)


class AdamW8bit(torch.optim.AdamW):
    """Named as bitsandbytes' and torchao's block-quantized optimizers are."""


def block_quantized_optimizer(rank, world_size):
    model = fgp.DistributedDataParallel(MLP())
    fgp.ShardedOptimizer(model, AdamW8bit, lr=1e-3)


class BitsAndBytesLikeAdamW(torch.optim.AdamW):
    """bitsandbytes' AdamW: its name says nothing, ``args.optim_bits`` says 8-bit
    (transformers' optim="adamw_8bit"; found by an audit: it trained 5.65e-3 away from
    torch DDP, silently, as a 32-bit AdamW after from_optimizer)."""

    def __init__(self, params, lr=1e-3, optim_bits=32):
        super().__init__(params, lr=lr)
        self.args = type("Args", (), {"optim_bits": optim_bits})()


def block_quantized_by_setting(rank, world_size):
    model = fgp.DistributedDataParallel(MLP())
    fgp.ShardedOptimizer(model, BitsAndBytesLikeAdamW, lr=1e-3, optim_bits=8)


def block_quantized_by_setting_converted(rank, world_size):
    module = MLP()
    optimizer = BitsAndBytesLikeAdamW(module.parameters(), optim_bits=8)
    fgp.ShardedOptimizer.from_optimizer(fgp.DistributedDataParallel(module), optimizer)


class GrokAdamW(torch.optim.AdamW):
    """transformers' optim="grokadamw": each tensor clipped by its own norm (found by an
    audit: 4.45e-3 from torch DDP, silently)."""


def per_tensor_clipping_optimizer(rank, world_size):
    model = fgp.DistributedDataParallel(MLP())
    fgp.ShardedOptimizer(model, GrokAdamW, lr=1e-3)


def _restore_scratch_state(optimizer):
    """A hook torch-optimi's optimizers register on themselves."""


class StableAdamW(torch.optim.AdamW):
    """torch-optimi's: each tensor's update clipped by its RMS, and a hook of its own."""

    def __init__(self, params, lr=1e-3):
        super().__init__(params, lr=lr)
        self.register_load_state_dict_post_hook(_restore_scratch_state)


def per_tensor_optimizer_with_its_own_hook_converted(rank, world_size):
    # Found by an audit: refused for "hooks registered on it", which the user had not.
    module = MLP()
    fgp.ShardedOptimizer.from_optimizer(fgp.DistributedDataParallel(module),
                                        StableAdamW(module.parameters()))


class HessianFree(torch.optim.SGD):
    """Says it is second-order as timm's Adahessian does (timm's loops read it)."""

    @property
    def is_second_order(self):
        return True


class Adahessian(torch.optim.SGD):
    """Named as the Adahessian implementations that do not say so."""


def second_order_optimizer(rank, world_size):
    model = fgp.DistributedDataParallel(MLP())
    fgp.ShardedOptimizer(model, HessianFree, lr=1e-3)


def second_order_optimizer_by_name(rank, world_size):
    model = fgp.DistributedDataParallel(MLP())
    fgp.ShardedOptimizer(model, Adahessian, lr=1e-3)


def foreign_param_in_groups(rank, world_size):
    model = fgp.DistributedDataParallel(MLP())
    fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1,
                         param_groups=[{"params": [nn.Parameter(torch.zeros(3))]}])


def grad_scaler_step(rank, world_size, unscale_first=False, through_a_wrapper=False):
    model = fgp.DistributedDataParallel(MLP())
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    if through_a_wrapper:  # Lightning's LightningOptimizer: it sets its own attributes
        from .grad_scaler_scenarios import ClassMixingWrapper
        opt = ClassMixingWrapper(opt)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.randn(4, 13)).sum()).backward()
    if unscale_first:  # the AMP recipe with clipping
        scaler.unscale_(opt)
        opt.clip_grad_norm_(1.0)
    scaler.step(opt)


def grad_scaler_step_through_a_wrapper(rank, world_size):
    grad_scaler_step(rank, world_size, through_a_wrapper=True)


def grad_scaler_unscale_then_step(rank, world_size):
    grad_scaler_step(rank, world_size, unscale_first=True)


def sharded_grad_scaler_fp16_params(rank, world_size):
    # torch's GradScaler refuses float16 parameters' gradients too (no fp32 master).
    model = fgp.DistributedDataParallel(MLP().half())
    opt = fgp.ShardedOptimizer(model, torch.optim.SGD, lr=1e-2)
    scaler = fgp.ShardedGradScaler("cpu")
    scaler.scale(model(torch.randn(4, 13, dtype=torch.float16)).float().sum()).backward()
    scaler.step(opt)


def integer_reduce_dtype(rank, world_size):
    fgp.DistributedDataParallel(MLP(), reduce_dtype=torch.int8)


def param_group_added_later(rank, world_size):
    model = fgp.DistributedDataParallel(MLP())
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2,
                               param_groups=[{"params": model.module.net[0].parameters()}])
    opt.add_param_group({"params": model.module.net[2].parameters(), "lr": 1e-3})


def cast_after_wrapping(rank, world_size):
    model = fgp.DistributedDataParallel(MLP())
    fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    model.double()  # new storage for every parameter: the buckets no longer back them
    model(torch.randn(4, 13, dtype=torch.float64))


def memory_layouts_differ(rank, world_size):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 2, 3))
    if rank == 1:  # the conversion ran on one rank only
        model.to(memory_format=torch.channels_last)
    fgp.DistributedDataParallel(model)


def channels_last_after_wrapping(rank, world_size):
    model = fgp.DistributedDataParallel(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 2, 3)))
    model.module.to(memory_format=torch.channels_last)  # new storage for the conv weights
    model(torch.randn(2, 3, 8, 8))


def ddp_mixed_precision(rank, world_size):
    from torch.nn.parallel.distributed import _MixedPrecision
    fgp.DistributedDataParallel(MLP(), mixed_precision=_MixedPrecision(
        param_dtype=torch.bfloat16))


def ddp_delayed_all_reduce(rank, world_size):
    model = MLP()
    fgp.DistributedDataParallel(model, delay_all_reduce_named_params=list(
        model.net[0].named_parameters()), param_to_hook_all_reduce=model.net[2].weight)


def process_group_and_device_mesh(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,))
    fgp.DistributedDataParallel(MLP(), process_group=mesh.get_group(), device_mesh=mesh)


def all_parameters_frozen(rank, world_size):
    model = MLP().requires_grad_(False)
    fgp.DistributedDataParallel(model)


def sync_batchnorm_on_cpu(rank, world_size):
    # torch DDP refuses it at construction; the forward would raise on every rank
    # (SyncBatchNorm takes GPU inputs only), an eval forward not.
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    fgp.DistributedDataParallel(nn.SyncBatchNorm.convert_sync_batchnorm(model))


def no_parameters(rank, world_size):
    fgp.DistributedDataParallel(nn.Sequential(nn.ReLU(), nn.Flatten()))


def ignored_parameter_in_groups(rank, world_size, converted=False):
    # Left to the user (an expert's parameter): a torch optimizer of its own steps it.
    model = MLP()
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, ["net.4.bias"])
    model = fgp.DistributedDataParallel(model)
    if converted:  # the loop's torch DDP optimizer, over all of model.parameters()
        fgp.ShardedOptimizer.from_optimizer(model, torch.optim.AdamW(model.parameters()))
    else:
        fgp.ShardedOptimizer(model, torch.optim.AdamW,
                             param_groups=[{"params": list(model.module.parameters())}])


def ignored_trainable_on_one_rank(rank, world_size):
    # The loss scaler shares the experts' infs only where every rank has some.
    model = MLP()
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, ["net.4.bias"])
    model.net[4].bias.requires_grad_(rank == 0)  # rank 0's alone trains it
    fgp.DistributedDataParallel(model)


def ignored_parameter_converted(rank, world_size):
    ignored_parameter_in_groups(rank, world_size, converted=True)


def other_models_optimizer_checkpoint(rank, world_size):
    model = fgp.DistributedDataParallel(MLP())
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    opt.load_state_dict(torch.optim.AdamW(nn.Linear(3, 3).parameters()).state_dict())


def not_an_optimizer_checkpoint(rank, world_size):
    model = fgp.DistributedDataParallel(MLP())
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    opt.load_state_dict(model.module.state_dict())


def two_optimizers(rank, world_size):
    model = fgp.DistributedDataParallel(MLP())
    first = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2,
                                 param_groups=[{"params": model.module.net[0].parameters()}])
    del first  # freed: another may take its place
    first = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)  # noqa: F841 (kept alive)
    fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1,
                         param_groups=[{"params": model.module.net[2].parameters()}])


def save_between_backward_and_step(rank, world_size):
    model = fgp.DistributedDataParallel(MLP(), bucket_cap_mb=0.0001, overlap_plan="layout")
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    model(torch.randn(4, 13)).sum().backward()
    model.module.state_dict()  # two_stage's speculative updates may be in it
    opt.step()


def optimizer_state_reset_between_backward_and_step(rank, world_size):
    from collections import defaultdict
    model = fgp.DistributedDataParallel(MLP(), bucket_cap_mb=0.0001, overlap_plan="layout")
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    model(torch.randn(4, 13)).sum().backward()
    opt.state = defaultdict(dict)  # the speculative steps' undo would write it back
    opt.step()


def optimizer_state_cleared_between_backward_and_step(rank, world_size):
    # Before: no error; a committed speculative step kept its update over the
    # cleared moments, and a rollback wrote the old moments back (0.04-0.06 off
    # torch DDP clearing its own).
    model = fgp.DistributedDataParallel(MLP(), bucket_cap_mb=0.0001, overlap_plan="layout")
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    model(torch.randn(4, 13)).sum().backward()
    opt.state.clear()
    opt.step()


def optimizer_state_dict_between_backward_and_step(rank, world_size):
    model = fgp.DistributedDataParallel(MLP(), bucket_cap_mb=0.0001, overlap_plan="layout")
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    model(torch.randn(4, 13)).sum().backward()
    opt.state_dict()  # the speculative steps have updated the optimizer state
    opt.step()


def optimizer_piece_data_assigned(rank, world_size):
    # A hand-written decoupled weight decay over the optimizer's groups, as torch.optim
    # loops write it: before, training silently stopped (the steps wrote orphans).
    model = fgp.DistributedDataParallel(MLP())
    opt = fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    model(torch.randn(4, 13)).sum().backward()
    for group in opt.param_groups:
        for p in group["params"]:
            p.data = p.data.add(p.data, alpha=-1e-4)
    opt.step()


def parameter_replaced_after_wrapping(rank, world_size):
    model = fgp.DistributedDataParallel(MLP())
    fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    model.module.net[2].bias = nn.Parameter(torch.zeros(29))  # no bucket backs it
    model(torch.randn(4, 13))


def plain_tensor_written_into_parameters(rank, world_size):
    # As functional_call does for one call, but left there: the forward reads the
    # tensor (allowed, a functional_call looks the same), the step refuses it.
    model = fgp.DistributedDataParallel(MLP())
    opt = fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    model.module.net[2]._parameters["weight"] = torch.randn(29, 37)
    model(torch.randn(4, 13)).sum().backward()
    opt.step()


def spectral_norm_after_wrapping(rank, world_size):
    # The hook-based spectral_norm moves 'weight' to 'weight_orig' and makes
    # 'weight' a tensor it computes in forward: the message says where it went.
    model = fgp.DistributedDataParallel(MLP())
    fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    torch.nn.utils.spectral_norm(model.module.net[2])
    model(torch.randn(4, 13))


def parametrization_after_wrapping(rank, world_size):
    # parametrize moves 'weight' to 'parametrizations.weight.original'.
    model = fgp.DistributedDataParallel(MLP())
    fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    torch.nn.utils.parametrizations.spectral_norm(model.module.net[2])
    model(torch.randn(4, 13))


def old_weight_norm_after_wrapping(rank, world_size):
    # The deprecated hook-based weight_norm removes 'weight' for 'weight_g' and 'weight_v'.
    model = fgp.DistributedDataParallel(MLP())
    fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        torch.nn.utils.weight_norm(model.module.net[2])
    model(torch.randn(4, 13))


def submodule_replaced_after_wrapping(rank, world_size):
    # A head replaced after wrapping (fine-tuning code that swaps the classifier):
    # before, the new head silently never trained, and the old one's slices went on.
    model = fgp.DistributedDataParallel(MLP())
    fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    model(torch.randn(4, 13)).sum().backward()
    model.module.net[1] = nn.ReLU()  # no parameters: fine
    model(torch.randn(4, 13))
    model.module.net[4] = nn.Linear(29, 5)
    try:
        model(torch.randn(4, 13))
    except RuntimeError:
        pass  # a loop that catches it and goes on
    model(torch.randn(4, 13))  # is refused again


def parameter_added_after_wrapping(rank, world_size):
    model = fgp.DistributedDataParallel(MLP())
    fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    model.module.register_parameter("temperature", nn.Parameter(torch.ones(())))
    model(torch.randn(4, 13))


def wrapped_twice(rank, world_size):
    module = MLP()
    first = fgp.DistributedDataParallel(module)
    fgp.DistributedDataParallel(module)  # while the first is alive
    return first


def shared_by_two_wrappers(rank, world_size):
    shared = nn.Linear(13, 8)
    first = fgp.DistributedDataParallel(nn.Sequential(shared, nn.Linear(8, 2)))
    fgp.DistributedDataParallel(nn.Sequential(shared, nn.Linear(8, 3)))
    return first


def unfrozen_after_wrapping(rank, world_size):
    module = MLP()
    module.net[0].requires_grad_(False)
    model = fgp.DistributedDataParallel(module)
    fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    module.net[0].requires_grad_(True)  # progressive unfreezing, after wrapping
    model(torch.randn(4, 13))


def nested_join(rank, world_size):
    model = fgp.DistributedDataParallel(MLP())
    with model.join():
        with model.join():
            pass


def ddp_comm_hook_of_its_own(rank, world_size):
    """A hook that is not one of torch's reduce-dtype hooks (PowerSGD, a loop's own)."""
    def averaged(state, bucket):
        buffer = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])
    model = fgp.DistributedDataParallel(MLP())
    model.register_comm_hook(None, averaged)


class _HookObject:
    def __call__(self, state, bucket):
        return dist.all_reduce(bucket.buffer(), async_op=True).get_future()


def ddp_comm_hook_callable_object(rank, world_size):
    """A callable object's repr holds its address, which differs by rank: the refusal
    must not read as ranks registering different hooks."""
    model = fgp.DistributedDataParallel(MLP())
    model.register_comm_hook(None, _HookObject())


def ddp_comm_hook_powersgd(rank, world_size):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    model = fgp.DistributedDataParallel(MLP())
    model.register_comm_hook(powersgd.PowerSGDState(process_group=None),
                             powersgd.powerSGD_hook)


def ddp_comm_hook_twice(rank, world_size):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    model = fgp.DistributedDataParallel(MLP())
    model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    model.register_comm_hook(None, default_hooks.bf16_compress_hook)


def ddp_comm_hook_after_backward(rank, world_size):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    model = fgp.DistributedDataParallel(MLP())
    model(torch.randn(4, 13)).sum().backward()
    model.register_comm_hook(None, default_hooks.fp16_compress_hook)


def ddp_comm_hooks_differ(rank, world_size):
    """Rank 1 reduces in float16, the others in bfloat16: every rank raises."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    model = fgp.DistributedDataParallel(MLP())
    model.register_comm_hook(None, default_hooks.fp16_compress_hook if rank == 1
                             else default_hooks.bf16_compress_hook)


def ddp_comm_hook_against_reduce_dtype(rank, world_size):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    model = fgp.DistributedDataParallel(MLP(), reduce_dtype=torch.bfloat16)
    model.register_comm_hook(None, default_hooks.fp16_compress_hook)


def ddp_comm_hook_state_of_another_group(rank, world_size):
    """torch's hooks reduce over their state's group: not the wrapper's here."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    pair = dist.new_group([0, 1])
    model = fgp.DistributedDataParallel(MLP())
    model.register_comm_hook(pair, default_hooks.fp16_compress_hook)


def ddp_comm_hook_default_state_on_a_subgroup(rank, world_size):
    """state=None reduces over the default group in torch's hooks; the wrapper's is
    a subgroup (ranks 0 and 1 train together, rank 2 alone)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    groups = [dist.new_group([0, 1]), dist.new_group([2])]
    model = fgp.DistributedDataParallel(MLP(), process_group=groups[rank // 2])
    model.register_comm_hook(None, default_hooks.fp16_compress_hook)


def optimizer_checkpoint_of_another_shape(rank, world_size):
    """A state tensor that fits another shape: every rank raises, also those holding
    no piece of that parameter (default buckets on 3 ranks)."""
    torch.manual_seed(0)
    module = MLP()
    torch_opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    module(torch.randn(4, 13)).sum().backward()
    torch_opt.step()
    saved = torch_opt.state_dict()
    saved["state"][4]["exp_avg"] = saved["state"][4]["exp_avg"].t().contiguous()  # net.4.weight
    model = fgp.DistributedDataParallel(MLP())
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    opt.load_state_dict(saved)


class _SharedAcrossReentrantCheckpoint(nn.Module):
    """One Linear used outside and inside a reentrant checkpoint (ALBERT-style sharing)."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(13, 13)
        self.out = nn.Linear(13, 5)

    def _segment(self, h):
        return torch.tanh(self.shared(h))

    def forward(self, x):
        h = torch.tanh(self.shared(x))
        h = torch.utils.checkpoint.checkpoint(self._segment, h, use_reentrant=True)
        return self.out(h)


def shared_weight_across_reentrant_checkpoint(rank, world_size):
    """The nested backward hands over the shared weight's gradient, whose bucket is
    then reduced; the outer backward's part comes after."""
    model = fgp.DistributedDataParallel(_SharedAcrossReentrantCheckpoint(), bucket_cap_mb=0.0001)
    model(torch.randn(4, 13)).sum().backward()


class _ReentrantCheckpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(13, 13)  # (a reentrant region needs an input with grad)
        self.inner = nn.Linear(13, 13)
        self.out = nn.Linear(13, 5)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self.inner, self.inp(x), use_reentrant=True)
        return self.out(torch.tanh(h))


def two_forwards_through_a_reentrant_checkpoint(rank, world_size):
    """Two forwards before one backward (a siamese loss): the first nested backward
    hands over the checkpointed weights' gradients, the second adds to them."""
    model = fgp.DistributedDataParallel(_ReentrantCheckpointed(), bucket_cap_mb=0.0001,
                                        schedule="overlap_backward")
    (model(torch.randn(4, 13)).sum() + model(torch.randn(4, 13)).sum()).backward()


class _FusedViews(nn.Module):
    """q, k, v made as views of one fused tensor (one autograd version counter)."""

    def __init__(self, overlapping: bool):
        super().__init__()
        fused = torch.randn(3 * 8, 8)
        if overlapping:  # the second is the first, transposed
            self.q = nn.Parameter(fused[:8])
            self.k = nn.Parameter(fused[:8].t())
        else:
            self.q, self.k, self.v = (nn.Parameter(c) for c in fused.chunk(3))


def parameter_views_of_one_tensor(rank, world_size):
    fgp.DistributedDataParallel(_FusedViews(overlapping=False), bucket_cap_mb=0.0001)


def overlapping_parameters(rank, world_size):
    fgp.DistributedDataParallel(_FusedViews(overlapping=True))


def topologies_differ(rank, world_size):
    # One node of 3 on ranks 1-2 (shared memory), 3 nodes of 1 on rank 0 (gloo): before,
    # the ranks waited on different transports until the timeout.
    fgp.DistributedDataParallel(MLP(), topology=fgp.Topology(local_size=1 if rank == 0 else 3))


def topology_invalid_on_one_rank(rank, world_size):
    # Before, rank 0 raised alone and the others hung in the model check.
    fgp.DistributedDataParallel(MLP(), topology=fgp.Topology(local_size=2 if rank == 0 else 3))


class _Expanded(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(5, 3)
        self.bias_rows = nn.Parameter(torch.zeros(1, 3).expand(4, 3))

    def forward(self, x):
        return self.net(x) + self.bias_rows.sum(0)


def expanded_parameter(rank, world_size):
    # Before, it was copied into a dense span and its four rows trained apart.
    fgp.DistributedDataParallel(_Expanded())


def float8_reduce_dtype(rank, world_size):
    # Before, accepted here and refused by the pack kernel at the first backward.
    fgp.DistributedDataParallel(MLP(), reduce_dtype=torch.float8_e4m3fn)


def reduce_dtypes_differ(rank, world_size):
    # Before: bfloat16 bits summed as float16 (silently wrong), or gloo aborted one rank.
    fgp.DistributedDataParallel(MLP(), reduce_dtype=torch.bfloat16 if rank == 0 else
                                torch.float16)


def schedules_and_bucket_caps_differ(rank, world_size):
    # Before: one rank returned, another got "Connection closed by peer"; a bucket cap
    # of its own hung until the timeout.
    fgp.DistributedDataParallel(MLP(), schedule="serial" if rank == 2 else "two_stage",
                                bucket_cap_mb=0.01 if rank == 1 else None)


def clipping_differs(rank, world_size):
    # Before: two_stage hung (rank 0 rolled back and sent all-gathers again); serial
    # clipped rank 0's slices only.
    model = fgp.DistributedDataParallel(MLP())
    fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-3,
                         max_grad_norm=1.0 if rank == 0 else None)


def clipping_of_ignored_parameters_differs(rank, world_size):
    # One rank's norm over its experts too would clip with another coefficient.
    model = fgp.DistributedDataParallel(MLP())
    fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-3, max_grad_norm=1.0,
                         clip_ignored_parameters=rank == 0)


def master_weights_differ(rank, world_size):
    # One rank's slices rounded from float32 masters, the others' stepped in bfloat16.
    model = fgp.DistributedDataParallel(MLP().to(torch.bfloat16))
    fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-3, master_weights=rank == 0)


def schedule_invalid_on_one_rank(rank, world_size):
    # Before, rank 1 raised alone and the others waited for it at the model check.
    fgp.DistributedDataParallel(MLP(), schedule="two-stage" if rank == 1 else "two_stage")


def speculation_memory_invalid(rank, world_size):
    fgp.DistributedDataParallel(MLP(), speculation_memory_mb=-1.0 if rank == 1 else 64)


def speculation_memory_differs(rank, world_size):
    fgp.DistributedDataParallel(MLP(), speculation_memory_mb=32 if rank == 2 else 64)


def settings_equal_in_other_types(rank, world_size):
    """Equal settings written otherwise on some ranks are accepted: max_grad_norm 1 or
    1.0, a plan's buckets as numpy ints (before, json could not compare them)."""
    import numpy as np
    from fgpsdp_runtime.plan import OverlapPlan
    ints = np.arange(2, dtype=np.int64) if rank == 0 else range(2)
    plan = OverlapPlan(stage1=(), stage2=tuple(ints), lookahead=2, source="given")
    model = fgp.DistributedDataParallel(MLP(), bucket_cap_mb=0.001 if rank else 0.0010,
                                        schedule="next_forward", overlap_plan=plan)
    fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1, max_grad_norm=1 if rank else 1.0)
    return len(model.buckets)


def built_under_inference_mode(rank, world_size):
    # Before: an AttributeError on a grad_fn of None, on that rank alone.
    model = MLP()
    if rank == 1:
        with torch.inference_mode():
            fgp.DistributedDataParallel(model)
    else:
        fgp.DistributedDataParallel(model)


def inference_tensor_parameter(rank, world_size):
    # Before: "Inference tensors do not track version counter", on that rank alone.
    with torch.inference_mode(rank == world_size - 1):
        model = MLP()
    fgp.DistributedDataParallel(model)


def buffer_shapes_differ(rank, world_size):
    # The parameters agree; rank 1's BatchNorm statistics are wider. The buffer
    # broadcast (one flat tensor per dtype) filled them with rank 0's bytes silently.
    width = 6 if rank == 1 else 4
    fgp.DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(width,
                                                                              affine=False)))


def buffer_dtypes_differ(rank, world_size):
    model = nn.Linear(4, 4)
    model.register_buffer("scale", torch.ones(3, dtype=torch.float64 if rank == 2
                                              else torch.float32))
    fgp.DistributedDataParallel(model)


def rank_local_buffers_unsynced(rank, world_size):
    """Never broadcast (broadcast_buffers=False): they may differ, as under torch DDP."""
    model = nn.Linear(4, 4)
    model.register_buffer("local", torch.zeros(rank + 1))
    return len(fgp.DistributedDataParallel(model, broadcast_buffers=False).bucket_layouts)


def device_ids_for_a_cpu_module(rank, world_size):
    # torch DDP refuses it at construction; before, the first forward moved the
    # inputs to cuda:0 ("Torch not compiled with CUDA enabled" on a CPU build).
    fgp.DistributedDataParallel(nn.Linear(4, 4), device_ids=[0])


def init_sync_differs(rank, world_size):
    """A rank that skips the initial broadcast would pair its first reduce-scatter with
    the others' broadcast (torch DDP hangs there)."""
    fgp.DistributedDataParallel(MLP(), init_sync=rank != 1)


def overlap_plan_set_differently_on_one_rank(rank, world_size):
    """Before, no check: rank 1's plan sent its buckets in another order than the
    others', and where they were of one size each all-gather paired one bucket with
    another, silently (the ranks 0.38 apart after 4 steps)."""
    model = fgp.DistributedDataParallel(MLP(), schedule="two_stage", bucket_cap_mb=0.002,
                                        overlap_plan="layout")
    n = len(model.buckets)
    stage1 = (1, 0) if rank == 1 else (0, 1)
    model.set_overlap_plan(fgp.OverlapPlan(stage1=stage1, stage2=tuple(range(n - 1, 1, -1)),
                                           lookahead=n))


def overlap_plan_of_floats_on_one_rank(rank, world_size):
    """Compared as ints, rank 0's floats agreed with the others' ints: rank 0 alone
    raised, and the others ran the plan (0.54 apart in an audit's repro)."""
    model = fgp.DistributedDataParallel(MLP(), schedule="two_stage", overlap_plan="layout")
    n = len(model.buckets)
    index = float if rank == 0 else int
    model.set_overlap_plan(fgp.OverlapPlan(stage1=(), stage2=tuple(index(b) for b in range(n)),
                                           lookahead=n))


def overlap_plan_of_floats(rank, world_size):
    """Before, accepted: the next step failed in its all-gathers."""
    model = fgp.DistributedDataParallel(MLP(), schedule="two_stage", overlap_plan="layout")
    n = len(model.buckets)
    model.set_overlap_plan(fgp.OverlapPlan(stage1=(), stage2=tuple(float(b) for b in range(n)),
                                           lookahead=n))


def optimizer_argument_bad_on_one_rank(rank, world_size):
    """Refused on rank 1 alone: before, the others went on into their first collective."""
    model = fgp.DistributedDataParallel(MLP())
    extra = [nn.Parameter(torch.zeros(3))] if rank == 1 else []
    fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1,
                         param_groups=[{"params": list(model.parameters()) + extra}])


def optimizer_groups_differ(rank, world_size):
    """Slices of one parameter would step with another group's hyperparameters."""
    model = fgp.DistributedDataParallel(MLP())
    params = list(model.parameters())
    groups = [{"params": params}] if rank == 0 else [{"params": params[:2]},
                                                      {"params": params[2:]}]
    fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1, param_groups=groups)


# ShardedOptimizer.from_optimizer: what a conversion would lose silently is refused,
# on every rank, even where one rank alone has it.

def _converting(rank, prepare_on):
    """A torch AdamW over an MLP, ``prepare_on(rank, optimizer)`` run on it, then
    converted once the MLP is wrapped."""
    module = MLP()
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    prepare_on(rank, optimizer)
    model = fgp.DistributedDataParallel(module)
    fgp.ShardedOptimizer.from_optimizer(model, optimizer)


def _scheduler(rank, optimizer):
    optimizer.scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)


def conversion_after_an_lr_scheduler(rank, world_size):
    # The scheduler would set the lr of an optimizer that no longer steps anything.
    _converting(rank, _scheduler)


def conversion_after_an_lr_scheduler_on_one_rank(rank, world_size):
    _converting(rank, lambda r, o: _scheduler(r, o) if r == 2 else None)


def conversion_with_a_step_hook(rank, world_size):
    # Its handle removes it from the dict of the optimizer given: not movable.
    _converting(rank, lambda r, o: o.register_step_post_hook(lambda *args: None))


def _one_step(optimizer):
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.ones_like(p)
    optimizer.step()
    optimizer.zero_grad()


def conversion_stepped_on_one_rank(rank, world_size):
    # The ranks with state would load it (collectives) while rank 0 trained on.
    _converting(rank, lambda r, o: _one_step(o) if r == 1 else None)


class _FrameworkOptimizer(torch.optim.Optimizer):
    """A framework's wrapper around an optimizer (Fabric's, accelerate's) in brief."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.__dict__.update({k: v for k, v in optimizer.__dict__.items()
                              if k not in ("optimizer",)})


def conversion_of_a_framework_wrapper(rank, world_size):
    module = MLP()
    wrapped = _FrameworkOptimizer(torch.optim.AdamW(module.parameters(), lr=1e-3))
    fgp.ShardedOptimizer.from_optimizer(fgp.DistributedDataParallel(module), wrapped)


class _OptimizerWithAProperty(torch.optim.SGD):
    """Reading its ``optimizer`` (as a framework's wrapper would hold one) raises."""

    raises = False

    @property
    def optimizer(self):
        if self.raises:
            raise RuntimeError("not available on this rank")
        return None


def conversion_reading_raises_on_one_rank(rank, world_size):
    # Found by a review: the error left the other ranks waiting in the agreement.
    module = MLP()
    optimizer = _OptimizerWithAProperty(module.parameters(), lr=0.1)
    optimizer.raises = rank == 0
    fgp.ShardedOptimizer.from_optimizer(fgp.DistributedDataParallel(module), optimizer)


def ignored_parameter_replicas_without_clip(rank, world_size):
    model = fgp.DistributedDataParallel(MLP())
    fgp.ShardedOptimizer(model, torch.optim.AdamW, ignored_parameter_replicas=2)


def ignored_parameter_replicas_zero(rank, world_size):
    model = fgp.DistributedDataParallel(MLP())
    fgp.ShardedOptimizer(model, torch.optim.AdamW, clip_ignored_parameters=True,
                         ignored_parameter_replicas=0)


def ignored_parameter_replicas_differ(rank, world_size):
    model = fgp.DistributedDataParallel(MLP())
    fgp.ShardedOptimizer(model, torch.optim.AdamW, clip_ignored_parameters=True,
                         ignored_parameter_replicas=2 if rank == 1 else 4)


def dtensor_parameter(rank, world_size):
    """A DTensor parameter (torch.distributed.tensor), which torch DDP turns into a
    local one first: refused on every rank, naming it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    mesh = init_device_mesh("cpu", (world_size,))
    module = MLP()
    module.net[2].weight = nn.Parameter(distribute_tensor(module.net[2].weight.detach(),
                                                          mesh, [Replicate()]))
    fgp.DistributedDataParallel(module)


def _optimizer_over_a_group(keyword: str, group):
    """A wrapped MLP and its ShardedOptimizer built with ``keyword=group``
    (model_parallel_group or pipeline_parallel_group)."""
    model = fgp.DistributedDataParallel(MLP())
    return model, fgp.ShardedOptimizer(model, torch.optim.AdamW, max_grad_norm=1.0,
                                       **{keyword: group})


def _solo_group(rank, world_size):
    return [dist.new_group([r]) for r in range(world_size)][rank]


def _group_without_this_rank(rank, world_size):
    return [dist.new_group([r for r in range(world_size) if r != me])
            for me in range(world_size)][rank]


def _under_join(keyword, rank, world_size):
    model, opt = _optimizer_over_a_group(keyword, _solo_group(rank, world_size))
    with model.join():
        pass
    del opt


def model_parallel_group_not_a_group(rank, world_size):
    _optimizer_over_a_group("model_parallel_group", "tp")


def pipeline_parallel_group_not_a_group(rank, world_size):
    _optimizer_over_a_group("pipeline_parallel_group", "pp")


def model_parallel_group_on_one_rank(rank, world_size):
    solo = _solo_group(rank, world_size)
    _optimizer_over_a_group("model_parallel_group", solo if rank == 1 else None)


def pipeline_parallel_group_on_one_rank(rank, world_size):
    solo = _solo_group(rank, world_size)
    _optimizer_over_a_group("pipeline_parallel_group", solo if rank == 2 else None)


def model_parallel_group_under_join(rank, world_size):
    _under_join("model_parallel_group", rank, world_size)


def pipeline_parallel_group_under_join(rank, world_size):
    _under_join("pipeline_parallel_group", rank, world_size)


def model_parallel_group_without_this_rank(rank, world_size):
    _optimizer_over_a_group("model_parallel_group", _group_without_this_rank(rank, world_size))


def pipeline_parallel_group_without_this_rank(rank, world_size):
    _optimizer_over_a_group("pipeline_parallel_group",
                            _group_without_this_rank(rank, world_size))


def model_parallel_group_built_under_join(rank, world_size):
    solo = [dist.new_group([r]) for r in range(world_size)][rank]
    model = fgp.DistributedDataParallel(MLP())
    with model.join():
        fgp.ShardedOptimizer(model, torch.optim.AdamW, max_grad_norm=1.0,
                             model_parallel_group=solo)
