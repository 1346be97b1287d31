"""Optimizers the element-wise probe must tell apart, none of them named in
optimizer_kinds.py's lists, and the scenarios that build them through the wrapper."""
import copy

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

import fgpsdp_runtime as fgp

from .scenarios import MLP, param_diff, train_both


class _PlainSGD(torch.optim.Optimizer):
    """The skeleton the others bend: p -= lr * direction(p, grad)."""

    def __init__(self, params, lr=0.05, **extra):
        super().__init__(params, {"lr": lr, **extra})

    def direction(self, p, grad, group):
        return grad

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(self.direction(p, p.grad, group), alpha=-group["lr"])


# -- element-wise: accepted --------------------------------------------------

class HandWrittenLion(_PlainSGD):
    """Lion (sign of interpolated momenta), element by element."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1):
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay)

    def direction(self, p, grad, group):
        beta1, beta2 = group["betas"]
        state = self.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p)
        update = state["exp_avg"].lerp(grad, 1 - beta1).sign_()
        state["exp_avg"].lerp_(grad, 1 - beta2)
        return update + group["weight_decay"] * p


class WholeShapeRefusingSGD(_PlainSGD):
    """Element-wise, but refuses tensors of more than two dimensions, which the
    probe's whole tensors include and the runtime's 1-D pieces never are."""

    def direction(self, p, grad, group):
        if p.dim() > 2:
            raise ValueError("only up to 2-D parameters")
        return grad


class VectorOnlySGD(_PlainSGD):
    """Element-wise, but refuses anything but a vector: the probe's whole matrix
    too, so nothing can be compared."""

    def direction(self, p, grad, group):
        if p.dim() != 1:
            raise ValueError("only 1-D parameters")
        return grad


class BFloat16OnlySGD(_PlainSGD):
    """Element-wise, for bfloat16 parameters only (as a class written for one
    model's dtype is): the probe's float64 and float32 tensors fail on whole and
    pieces alike, while the runtime's bfloat16 slices would step."""

    def direction(self, p, grad, group):
        if p.dtype != torch.bfloat16:
            raise TypeError("bfloat16 parameters only")
        return grad


class PairedSGD(_PlainSGD):
    """Steps its parameters in pairs of matrices (as LoRA factors; pytorch_optimizer's
    LoRARite): a pair of anything else raises, a lone tensor is skipped; so given the
    probe's tensors, or its matrix alone, it moves none."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = group["params"]
            for left, right in zip(params[0::2], params[1::2]):
                if left.dim() != 2 or right.dim() != 2:
                    raise ValueError("pairs of matrices only")
                left.add_(left.grad, alpha=-group["lr"])
                right.add_(right.grad, alpha=-group["lr"])


class CountingGroupTensorSGD(_PlainSGD):
    """Element-wise; advances a tensor held in its group settings in place (as a
    step count kept there is), which must not be the user's tensor."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["count"] += 1
        super().step(closure)


class Countdown:
    """A schedule object kept in a group's settings, counting its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return 1.0 / (1 + 0.1 * self.calls)


class ScheduledSGD(_PlainSGD):
    """Element-wise; its group's schedule object scales each step. The probe's
    instances must each call their own copy (three sharing one would count three
    times as fast as the whole run's), and never the user's."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            factor = group["schedule"]()
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * factor)


class SelfRegisteringSGD(_PlainSGD):
    """Registers a global optimizer step hook when first built, as a logging
    library might: it must still be registered after the probe."""
    calls = 0
    registered = None

    def __init__(self, params, lr=0.05):
        super().__init__(params, lr=lr)
        if SelfRegisteringSGD.registered is None:
            SelfRegisteringSGD.registered = \
                register_optimizer_step_post_hook(self._count)

    @staticmethod
    def _count(*args):
        SelfRegisteringSGD.calls += 1


def _counting_backend(graph, example_inputs):
    CompiledStepSGD.graphs += 1
    return graph.forward


class CompiledStepSGD(_PlainSGD):
    """Its update compiled (torch.compile with a backend that counts the graphs)."""
    graphs = 0

    def direction(self, p, grad, group):
        return _compiled_direction(grad)


@torch.compile(backend=_counting_backend, dynamic=False)
def _compiled_direction(grad):
    return grad * 0.5


# -- not element-wise: refused ------------------------------------------------

class TrustRatioSGD(_PlainSGD):
    """LAMB's trust ratio, ||p|| / ||update||, per tensor."""

    def direction(self, p, grad, group):
        return grad * (p.norm() / grad.norm().clamp_min(1e-12))


class PerTensorClipSGD(_PlainSGD):
    """Each tensor's gradient clipped to norm 1 inside the step."""

    def direction(self, p, grad, group):
        return grad * (1.0 / grad.norm()).clamp(max=1.0)


class MatrixDecaySGD(_PlainSGD):
    """Weight decay on matrices only, as some optimizers leave biases alone by
    their number of dimensions: a 1-D piece of a matrix escapes it."""

    def direction(self, p, grad, group):
        return grad + 0.5 * p if p.dim() >= 2 else grad


class CentralizedSGD(_PlainSGD):
    """Gradient centralization (each row's mean out of a matrix's gradient), when
    its group says so."""

    def __init__(self, params, lr=0.05, centralize=False):
        super().__init__(params, lr=lr, centralize=centralize)

    def direction(self, p, grad, group):
        if group["centralize"] and grad.dim() > 1:
            return grad - grad.mean(dim=tuple(range(1, grad.dim())), keepdim=True)
        return grad


class FactoredRMSProp(_PlainSGD):
    """Adafactor's second moment: a matrix's row and column means, not per element."""

    def direction(self, p, grad, group):
        square = grad * grad + 1e-30
        if grad.dim() == 2:
            second = square.mean(1, keepdim=True) * square.mean(0, keepdim=True) \
                / square.mean()
        else:
            second = square
        return grad / second.sqrt()


class FactoredFrom32RMSProp(FactoredRMSProp):
    """Factored only where two dimensions reach 32, as big_vision's Adafactor."""

    def direction(self, p, grad, group):
        if grad.dim() == 2 and min(grad.shape) < 32:
            return grad / (grad * grad + 1e-30).sqrt()
        return super().direction(p, grad, group)


class GlobalNormSGD(_PlainSGD):
    """Every gradient divided by the norm of all of this instance's gradients:
    the same on whole tensors as on pieces held by one instance, so only the
    probe's split over instances (ranks) tells."""

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"]
                 if p.grad is not None]
        total = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / total, alpha=-group["lr"])


class NormHistorySGD(_PlainSGD):
    """AdaNorm's rule: a tensor's gradient scaled up to a running mean of its norm
    where its norm falls below that mean; with gradients whose norms stay put, as
    a probe's of one scale would, the rule never acts."""

    def direction(self, p, grad, group):
        state = self.state[p]
        norm = grad.norm()
        state["mean"] = 0.95 * state.get("mean", torch.zeros_like(norm)) + 0.05 * norm
        return grad * (state["mean"] / norm) if state["mean"] > norm else grad


class NoisySGD(_PlainSGD):
    """Gradient noise drawn per tensor: each rank's slice would draw its own."""

    def direction(self, p, grad, group):
        return grad + 0.01 * torch.randn_like(grad)


class NumPyNoisySGD(_PlainSGD):
    """A step size drawn from NumPy's global generator at each step (as PSGD Kron
    decides when to update its preconditioner)."""

    def direction(self, p, grad, group):
        import numpy
        return grad * (1.0 + 0.1 * numpy.random.random())


class MatrixOnlySGD(_PlainSGD):
    """Refuses anything but a matrix, as Muon does: it cannot step a 1-D piece."""

    def direction(self, p, grad, group):
        if p.dim() != 2:
            raise ValueError(f"only 2-D parameters, got {tuple(p.shape)}")
        return grad


# -- through the wrapper ----------------------------------------------------

def built_with(rank, world_size, optimizer_class, check_elementwise, kwargs):
    """The error ShardedOptimizer raises for ``optimizer_class`` (None where it
    builds), on this rank."""
    model = fgp.DistributedDataParallel(MLP(), bucket_cap_mb=0.0001)
    try:
        fgp.ShardedOptimizer(model, optimizer_class, check_elementwise=check_elementwise,
                             **kwargs)
    except TypeError as error:
        return str(error)
    return None


def converted(rank, world_size, check_elementwise):
    """from_optimizer of a TrustRatioSGD built over the module: the probe runs there too."""
    module = MLP()
    optimizer = TrustRatioSGD(module.parameters(), lr=0.1)
    try:
        fgp.ShardedOptimizer.from_optimizer(fgp.DistributedDataParallel(module), optimizer,
                                            check_elementwise=check_elementwise)
    except TypeError as error:
        return str(error)
    return None


def group_setting_reaches_the_probe(rank, world_size, centralize_weights):
    """CentralizedSGD with centralize=True on the weights' group only: refused, built
    where no group sets it, so the probe steps each group with its own settings.
    (The probe's tensors are its own, the same for every group: a setting that is
    harmless on the group's real parameters alone, centralize=True on the 1-D biases,
    is refused too.)"""
    model = fgp.DistributedDataParallel(MLP(), bucket_cap_mb=0.0001)
    weights = [p for n, p in model.module.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.module.named_parameters() if n.endswith("bias")]
    groups = [{"params": weights, "centralize": centralize_weights},
              {"params": biases, "centralize": False}]
    try:
        fgp.ShardedOptimizer(model, CentralizedSGD, param_groups=groups, lr=0.05)
    except TypeError as error:
        return str(error)
    return None


def lion_beside_torch_ddp(rank, world_size):
    """A hand-written element-wise optimizer the probe accepted trains as it does
    under torch DDP: the probe left the model, its random stream and the step alone."""
    torch.manual_seed(0)
    module = MLP()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(module))
    model = fgp.DistributedDataParallel(module, bucket_cap_mb=0.0001)
    before = torch.get_rng_state()
    opt = fgp.ShardedOptimizer(model, HandWrittenLion, lr=1e-2)
    same_rng = torch.equal(before, torch.get_rng_state())
    ref_opt = HandWrittenLion(ref.parameters(), lr=1e-2)
    train_both([(model, opt), (ref, ref_opt)], rank, steps=3)
    model.synchronize()
    return {"same rng": same_rng, "max diff": param_diff(model, ref)}
