"""Which inner optimizers may run on this rank's flat bucket slices.

The slices of one parameter lie in several ranks' shards, each a 1-D view. An
element-wise update (SGD, Adam, AdamW, RMSprop, Adagrad, ...) gives the same
values on them as on the whole tensor; one that reads a tensor's shape or norm,
all parameters, or blocks of quantized state would train differently, silently.
Such optimizers are refused by name at construction, before any slice is made;
one from outside torch.optim that is not named here is then tried on small
tensors (elementwise_probe.py). The names stay: a refusal by name costs nothing,
says why, and holds where the probe's few steps show nothing (an estimate that
moves only after many steps, as D-Adaptation's and Shampoo's preconditioning do).
"""
from __future__ import annotations

import inspect

import torch

# Optimizers whose update is not element-wise: slicing would change the result.
# Matched by lower-case class name, so that the layer-wise ones of other
# libraries (apex FusedLAMB, timm's Lamb and Lars, D-Adaptation, Prodigy,
# Shampoo) are caught too: on slices they would train, silently otherwise.
_NOT_ELEMENTWISE = {
    "lbfgs", "sparseadam",  # a closure; sparse gradients
    "adafactor", "muon", "shampoo", "distributedshampoo", "soap",  # a matrix's shape
    "lamb", "fusedlamb", "lars", "fusedlars", "novograd", "fusednovograd",  # per-tensor norms
    "prodigy", "dadaptadam", "dadaptsgd", "dadaptadagrad", "dadaptlion",  # whole-model sums
    "dadaptadan",
    "scalableshampoo",  # pytorch_optimizer's: grafted steps first, preconditioned later
    # Each tensor's update against its gradient (a dot product) picks a group's switch
    # from Adam to SGD and the SGD rate: each rank's slices would pick their own.
    "swats",
    # pytorch_optimizer's AdaShift: the second moment of each tensor's delayed gradient
    # reduced to one number (reduce_func=torch.max by default), after a queue of 10 steps.
    "adashift",
    "came", "adammini",  # factored second moments; a learning rate per block of a matrix
    "sm3",  # accumulators per row and column of a matrix
    # A tensor's norm or RMS: GrokAdamW clips each tensor by its norm (and weighs
    # its beta by the tensor's place in the group); torch-optimi's StableAdamW
    # clips each tensor's update by its RMS.
    "grokadamw", "stableadamw",
    "lomo", "adalomo",  # built from the model, fused into its backward
    # Per tensor: AdamP / SGDP project out each tensor's radial component, Nero and
    # Fromage scale by each tensor's (or neuron's) norm, Ranger21 centralizes each
    # matrix's gradient and clips by unit norms.
    "adamp", "sgdp", "nero", "fromage", "ranger21",
    # Sharpness-aware minimization (davda54's SAM, pytorch_optimizer's SAM, GSAM, WSAM,
    # BSAM, LookSAM, FriendlySAM): the ascent step scales by the whole model's gradient
    # norm, which on slices would be this rank's alone, and it steps in two calls
    # around a second backward (first_step, second_step), which the wrapper never makes.
    "sam", "gsam", "wsam", "bsam", "looksam", "friendlysam",
}
# Parts of lower-case class names: block-wise quantized state (bitsandbytes' Adam8bit,
# AdamW8bit, PagedAdamW8bit, Lion8bit; torchao's AdamW8bit, AdamW4bit: one scale per
# block of a tensor's elements, and 32-bit state below a tensor size, so slices would
# change both) and GaLore's low-rank projections of each matrix.
_NOT_ELEMENTWISE_PARTS = ("8bit", "4bit", "galore")
# Second-order ones differentiate the gradients (Hessian-vector products through
# backward(create_graph=True)): the reduced slices carry no graph. timm's loops ask
# an optimizer's ``is_second_order``; Adahessian implementations without it by name.
_SECOND_ORDER = {"adahessian", "sophiah"}  # (SophiaH: Hutchinson's estimate)


def _is_second_order(optimizer_class: type) -> bool:
    if optimizer_class.__name__.lower() in _SECOND_ORDER:
        return True
    flag = inspect.getattr_static(optimizer_class, "is_second_order", False)
    # A property (timm's Adahessian: always True) cannot be read without an instance.
    return flag is True or isinstance(flag, property)


def refuse_unsliceable(optimizer_class: object) -> None:
    """TypeError unless ``optimizer_class`` is a torch.optim.Optimizer subclass whose
    update may run on flat slices."""
    if not (isinstance(optimizer_class, type)
            and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError("optimizer_class must be a torch.optim.Optimizer subclass "
                        f"(for example torch.optim.AdamW), got {optimizer_class!r}")
    name = getattr(optimizer_class, "__name__", "").lower()
    if name in _NOT_ELEMENTWISE or any(part in name for part in _NOT_ELEMENTWISE_PARTS):
        hint = ("; for Muon on the matrices and AdamW on the rest, as a torch DDP loop "
                "pairs torch.optim.Muon with torch.optim.AdamW, use "
                "fgpsdp_runtime.MuonWithAdamW with use_muon=True / False param groups"
                if name == "muon" else "")
        raise TypeError(f"{optimizer_class.__name__} is not element-wise (its update reads "
                        "a whole tensor's shape or norm, or all parameters, or blocks of "
                        "quantized state, or it needs a closure or sparse gradients); it "
                        f"cannot run on flat slices{hint}")
    if _is_second_order(optimizer_class):
        raise TypeError(f"{optimizer_class.__name__} is a second-order optimizer: it "
                        "differentiates the gradients (backward(create_graph=True), "
                        "Hessian-vector products), and the reduced gradients in "
                        "this rank's slices carry no graph; it cannot run here")


def refuse_unsliceable_settings(optimizer: torch.optim.Optimizer) -> None:
    """TypeError where an optimizer of an accepted class was built with settings
    that make it not element-wise: bitsandbytes' classes (``bnb.optim.AdamW``, which
    transformers' ``optim="adamw_8bit"`` builds) quantize their state in blocks of a
    tensor with ``optim_bits=8``; pytorch_optimizer's Ranger (and others) with
    ``use_gc=True`` centralize each matrix's gradient (its mean over the rows, which
    a 1-D slice has not: skipped there)."""
    name = type(optimizer).__name__
    bits = getattr(getattr(optimizer, "args", None), "optim_bits", None)
    if isinstance(bits, int) and bits < 32:
        raise TypeError(f"{name} was built with optim_bits={bits}: its state is quantized "
                        "in blocks of a tensor's elements, which slices would change; it "
                        "cannot run on flat slices (optim_bits=32 can)")
    if getattr(optimizer, "use_gc", False) is True or any(
            group.get("use_gc") is True for group in optimizer.param_groups):
        raise TypeError(f"{name} was built with use_gc=True: gradient centralization "
                        "subtracts each matrix's mean over its rows, which a flat slice "
                        "has not; it cannot run on flat slices (use_gc=False can)")
