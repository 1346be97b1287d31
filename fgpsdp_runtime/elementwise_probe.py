"""Whether an optimizer class this runtime does not know is element-wise, tried
rather than assumed.

[Note: the element-wise probe]
The inner optimizer steps 1-D pieces of the parameters, each rank its own
(optim.py's [Note: slices as optimizer parameters]). That equals torch DDP's
step only for an element-wise update. optimizer_kinds.py refuses the known
exceptions by name; an optimizer it does not know that reads a tensor's shape
or norm, clips each tensor inside its step, sums over all its parameters or
draws random numbers per tensor would train differently with no error. So a
class from outside ``torch.optim`` is stepped here once, at construction, on
small tensors it never sees again: whole, in one instance, and cut into flat
pieces the way the buckets cut them, spread over three instances as over three
ranks. The two must agree within float rounding, or the class is refused.

The probe runs in float64 (in float32 where the class refuses float64), so
the rounding by an element's place that fused kernels show (see
docs/semantics.md#matching-torch-ddp) stays far below any difference in the
update itself. One of its tensors is a 129 x 33 matrix, so that optimizers
that factor a matrix only where two of its dimensions reach a size take that
path (16 in timm's AdafactorBigVision, 32 in big_vision's: a 129 x 9 one let
timm's through), and the cuts fall off every power-of-two block (state
quantized in blocks shows). Sizes stay small otherwise: an optimizer that keeps
a dense preconditioner per tensor makes one per 1-D piece, n x n for n elements,
and decomposes it at a cost of n^3 (pytorch_optimizer's Kron took the longest
probe of its library, over a second: docs/benchmarks/, the probe survey). So optax's
factoring from 128 in both dimensions, and bitsandbytes' 8-bit state from 4,096
elements, are not reached: optimizer_kinds.py refuses the latter by name and
setting.

It leaves no trace: the random number generators are restored (and seeded
while it runs, so that a class that draws gets the same verdict everywhere),
warnings, the global optimizer hooks
(``torch.optim.optimizer.register_optimizer_step_pre_hook``) and torch.compile
are held back while it runs, and each instance gets its own copy of the
groups' settings. The user's own step code does run (a class that logs each
step logs the probe's), which ``check_elementwise=False`` avoids, as it skips
the probe. The outcome is the same on every rank (same class, settings and
inputs); where it is not (a class that draws from a source the probe does not
seed), the constructor's agreement on its arguments raises on every rank. What
it holds back is process-wide (the CPU generator, the warning filters, the
compile stance, the global hooks): another thread working meanwhile (a second
wrapper's scheduler stepping) sees the probe's settings for those milliseconds.
"""
from __future__ import annotations

import contextlib
import copy
import itertools
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch

from .step_wide_state import copy_value
from .user_warnings import warn_at_user_code

# The probe's parameters per group: a matrix above common size thresholds (see the
# note), a vector, a 3-D tensor and a one-element one, of odd sizes.
_SHAPES = ((129, 33), (131,), (3, 5, 7), (1,))
_RANKS = 3
# Each step's gradients scaled apart, so that a history of norms (a running mean
# that a step compares its norm with, a spike clipped) does something in a few steps.
_STEP_SCALES = (1.0, 0.3, 2.0, 0.5, 1.5, 0.2)
_STEPS = len(_STEP_SCALES)
_SEED = 0x5EED  # the probe's tensors' and, while it runs, the random streams'
# (dtype, relative to how far the whole step moved a parameter, relative to the
# parameters' size): the first that the class steps whole tensors of is used.
_TOLERANCES = ((torch.float64, 1e-6, 1e-12), (torch.float32, 1e-3, 1e-5))


@dataclass(frozen=True)
class _Difference:
    shape: tuple[int, ...]
    largest: float  # |whole - pieces|, the largest element's
    moved: float  # how far the whole step moved that tensor's elements, at most
    dtype: torch.dtype


def known_elementwise(optimizer_class: type) -> bool:
    """torch.optim's own classes (those that are not element-wise are refused by
    name before this): their results on slices are tested in this repository."""
    module = getattr(optimizer_class, "__module__", "") or ""
    return module == "torch.optim" or module.startswith("torch.optim.")


def refuse_unless_elementwise(optimizer_class: type, group_settings: Sequence[dict[str, Any]],
                              defaults: dict[str, Any], device: torch.device) -> None:
    """TypeError where ``optimizer_class``, built as the runtime builds it (groups of
    ``group_settings``, without their params, and ``defaults``), steps flat pieces
    spread over instances otherwise than whole tensors, or raises on the pieces
    where it stepped the whole tensors; a RuntimeWarning where it raised on the whole
    tensors or moved none of them (nothing to compare with)."""
    if known_elementwise(optimizer_class):
        return
    name = getattr(optimizer_class, "__name__", repr(optimizer_class))
    settings = _distinct(group_settings)
    with _no_trace(device):
        outcome = _tried(optimizer_class, settings, defaults, device, _SHAPES)
        if outcome.whole_failure is not None:
            # A class that takes matrices only (Muon's kind) refused the others: the
            # matrix alone then shows whether it can step a 1-D piece of one.
            matrices = tuple(shape for shape in _SHAPES if len(shape) == 2)
            only_matrices = _tried(optimizer_class, settings, defaults, device, matrices)
            if only_matrices.whole_failure is None:
                outcome = only_matrices
    if outcome.difference is not None:
        difference = outcome.difference
        raise TypeError(
            f"{name} is not element-wise: stepped on flat pieces of its parameters spread "
            "over several instances, as this runtime steps each rank's slices, it moved "
            "them otherwise than stepped on the whole tensors (by up to "
            f"{difference.largest:.3g} on the {'x'.join(map(str, difference.shape))} "
            f"tensor, which the whole step moved by up to {difference.moved:.3g}; "
            f"{_STEPS} steps on small {str(difference.dtype).replace('torch.', '')} "
            "tensors at construction). Its update likely reads a tensor's shape or norm, "
            "clips inside its step, sums over all its parameters or draws random numbers "
            "per tensor, and would train otherwise than under torch DDP, silently. "
            "check_elementwise=False runs it anyway.")
    if outcome.whole_failure is None and outcome.pieces_failure is not None:
        # The runtime steps nothing but such pieces: its first step would raise alike.
        failure = outcome.pieces_failure
        raise TypeError(
            f"{name} cannot run on flat slices: its step raised on 1-D pieces of its "
            "parameters (as this runtime steps each rank's slices of them) where it "
            f"stepped the whole tensors: {type(failure).__name__}: {failure} (a probe on "
            "small tensors at construction; check_elementwise=False skips it)") from failure
    if outcome.whole_failure is None and not outcome.moved:
        # (A class that steps pairs of matrices, LoRA factors, skips the matrix alone.)
        warn_at_user_code(
            f"fgpsdp: could not check that {name} is element-wise (its update must be, to "
            "run on this rank's flat slices as under torch DDP): its step moved none of "
            "the small tensors of a probe at construction. check_elementwise=False skips "
            "the probe and this warning.", RuntimeWarning)
    if outcome.whole_failure is not None:
        failure = outcome.whole_failure
        warn_at_user_code(
            f"fgpsdp: could not check that {name} is element-wise (its update must be, to "
            "run on this rank's flat slices as under torch DDP): its step raised on a "
            f"probe of small whole tensors at construction: {type(failure).__name__}: "
            f"{failure}. check_elementwise=False skips the probe and this warning.",
            RuntimeWarning)


@dataclass
class _Outcome:
    """What the probe saw, at the first dtype whose whole run stepped (or the last)."""
    whole_failure: Optional[BaseException] = None
    pieces_failure: Optional[BaseException] = None
    difference: Optional[_Difference] = None
    moved: bool = True  # did the whole run move any of the probe's tensors?


def _tried(optimizer_class: type, settings: list[dict[str, Any]], defaults: dict[str, Any],
           device: torch.device, shapes: tuple[tuple[int, ...], ...]) -> _Outcome:
    for dtype, relative, absolute in _TOLERANCES:
        probe = _Probe(settings, dtype, device, shapes)
        outcome = _Outcome()
        try:
            whole = probe.step_whole(optimizer_class, defaults)
        except Exception as error:  # noqa: BLE001 (said in the warning)
            outcome.whole_failure = error
            continue
        outcome.moved = any(not torch.equal(a, b) for tensors, starts in
                            zip(whole, probe.initial) for a, b in zip(tensors, starts))
        try:
            pieces = probe.step_pieces(optimizer_class, defaults)
        except Exception as error:  # noqa: BLE001 (said in the refusal)
            outcome.pieces_failure = error
            return outcome
        outcome.difference = _largest_difference(probe, whole, pieces, relative, absolute)
        return outcome
    return outcome


def _distinct(group_settings: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One of each group's settings (all but params), repeats left out, in order."""
    seen, kept = set(), []
    for group in group_settings:
        settings = {k: v for k, v in group.items() if k != "params"}
        key = repr(sorted(settings.items(), key=lambda item: item[0]))
        if key not in seen:
            seen.add(key)
            kept.append(settings)
    return kept or [{}]


class _Probe:
    """The probe's tensors for each group setting: initial values and per-step
    gradients, the same for the whole run and the pieces."""

    def __init__(self, settings: list[dict[str, Any]], dtype: torch.dtype,
                 device: torch.device, shapes: tuple[tuple[int, ...], ...]):
        # Drawn on the CPU (device= given: torch.set_default_device must not move
        # them off the generator's device), then moved.
        generator = torch.Generator().manual_seed(_SEED)

        def drawn(shape: tuple[int, ...], scale: float = 1.0) -> torch.Tensor:
            values = torch.randn(shape, generator=generator, dtype=torch.float64,
                                 device="cpu")
            return (values * scale).to(device=device, dtype=dtype)

        self.settings, self.shapes = settings, shapes
        self.initial = [[drawn(shape) for shape in shapes] for _ in settings]
        # Each tensor's gradients of another size, so that its norm stands apart.
        self.grads = [[[drawn(shape, (0.5 + 2 * i) * scale) for i, shape in enumerate(shapes)]
                       for _ in settings] for scale in _STEP_SCALES]
        self.device, self.dtype = device, dtype

    def _groups(self, params_per_group: list[list[torch.Tensor]]) -> list[dict[str, Any]]:
        return [{**_copied(settings), "params": params}
                for settings, params in zip(self.settings, params_per_group)]

    def step_whole(self, optimizer_class: type, defaults: dict[str, Any]
                   ) -> list[list[torch.Tensor]]:
        params = [[t.clone() for t in tensors] for tensors in self.initial]
        optimizer = optimizer_class(self._groups(params), **_copied(defaults))
        _enter_train_mode(optimizer)
        for step in range(_STEPS):
            for g, tensors in enumerate(params):
                for i, p in enumerate(tensors):
                    p.grad = self.grads[step][g][i].clone()
            optimizer.step()
        return params

    def step_pieces(self, optimizer_class: type, defaults: dict[str, Any]
                    ) -> list[list[torch.Tensor]]:
        """Each group's tensors flattened one after the other and cut into _RANKS
        ranges at odd places; each range's pieces (one per tensor it meets) stepped
        by an instance of its own. Returns the pieces put back into whole tensors."""
        cuts_per_group = [_cuts(sum(t.numel() for t in tensors)) for tensors in self.initial]
        # pieces[rank][group] = [(tensor index, lo, hi, leaf)]
        pieces: list[list[list[tuple[int, int, int, torch.Tensor]]]] = []
        for rank in range(_RANKS):
            per_group = []
            for g, tensors in enumerate(self.initial):
                lo_rank, hi_rank = cuts_per_group[g][rank], cuts_per_group[g][rank + 1]
                mine, start = [], 0
                for i, t in enumerate(tensors):
                    lo, hi = max(lo_rank, start), min(hi_rank, start + t.numel())
                    if lo < hi:
                        mine.append((i, lo - start, hi - start,
                                     t.reshape(-1)[lo - start:hi - start].clone()))
                    start += t.numel()
                per_group.append(mine)
            pieces.append(per_group)
        instances = []
        for per_group in pieces:
            # A rank holding nothing of a group keeps it with a tensor that never gets
            # a gradient, as the runtime's placeholder (optim.py).
            params = [[leaf for *_, leaf in mine] or
                      [torch.zeros(1, device=self.device, dtype=self.dtype)]
                      for mine in per_group]
            instance = optimizer_class(self._groups(params), **_copied(defaults))
            _enter_train_mode(instance)
            instances.append(instance)
        for step in range(_STEPS):
            for instance, per_group in zip(instances, pieces):
                for g, mine in enumerate(per_group):
                    for i, lo, hi, leaf in mine:
                        leaf.grad = self.grads[step][g][i].reshape(-1)[lo:hi].clone()
                instance.step()
        result = [[torch.empty_like(t) for t in tensors] for tensors in self.initial]
        for per_group in pieces:
            for g, mine in enumerate(per_group):
                for i, lo, hi, leaf in mine:
                    result[g][i].view(-1)[lo:hi] = leaf.detach()
        return result


def _cuts(total: int) -> list[int]:
    """_RANKS + 1 boundaries over ``total`` elements, the inner ones odd and off every
    power-of-two block, as a bucket's padding puts them anywhere."""
    step = total // _RANKS
    inner = [(rank * step + 37) | 1 for rank in range(1, _RANKS)]
    return [0, *inner, total]


def _largest_difference(probe: _Probe, whole: list[list[torch.Tensor]],
                        pieces: list[list[torch.Tensor]], relative: float,
                        absolute: float) -> Optional[_Difference]:
    """The tensor whose pieces ended farthest from the whole step, beyond the
    tolerance (None where all are within it)."""
    size = max(float(t.abs().max()) for tensors in probe.initial for t in tensors)
    worst: Optional[_Difference] = None
    for g, i in itertools.product(range(len(whole)), range(len(probe.shapes))):
        a, b, start = whole[g][i], pieces[g][i], probe.initial[g][i]
        # Equal values (infinities too) and NaN in both agree; a NaN in one is a difference.
        agree = (a == b) | (torch.isnan(a) & torch.isnan(b))
        largest = float(torch.where(agree, 0.0, (a - b).abs()).nan_to_num(
            nan=float("inf")).max())
        moved = float((a - start).abs().nan_to_num(nan=0.0, posinf=0.0).max())
        if largest > relative * moved + absolute * size and \
                (worst is None or largest > worst.largest):
            worst = _Difference(tuple(a.shape), largest, moved, probe.dtype)
    return worst


def _copied(settings: dict[str, Any]) -> dict[str, Any]:
    """Settings for one instance of the probe: its steps must not write into the
    user's objects (a step count kept in a group as a tensor, a schedule object that
    counts its calls, a generator), nor its instances share one. Tensors cloned
    inside tuples, lists and dicts (step_wide_state.copy_value); any other object
    there copied too (_own_copy)."""
    return {k: copy_value(v, _own_copy) for k, v in settings.items()}


def _own_copy(value: Any) -> Any:
    """A generator forked; another object copied shallowly (never deeply: a setting
    may reach a model), or shared where it cannot be copied."""
    if isinstance(value, torch.Generator):
        forked = torch.Generator(device=value.device)
        forked.set_state(value.get_state())
        return forked
    try:
        return copy.copy(value)
    except Exception:  # noqa: BLE001 (shared then)
        return value


def _enter_train_mode(optimizer: torch.optim.Optimizer) -> None:
    # Schedule-free optimizers refuse a step outside train mode.
    train = getattr(type(optimizer), "train", None)
    if callable(train):
        train(optimizer)


@contextlib.contextmanager
def _no_trace(device: torch.device) -> Iterator[None]:
    """Random number generators seeded for the probe and restored after it (torch's
    on the CPU and the probe's device, Python's, NumPy's where imported: a class that
    draws then gives the same verdict, with the same figures, on every rank and run);
    warnings and the global optimizer hooks held back (a profiler's or a logger's
    would count the probe's steps; one that the class registers while built stays);
    torch.compile held back (a compiled step would compile for the probe's float64
    tensors, spending its recompile limit before the loop's first step)."""
    import random
    import sys
    import warnings
    from torch.optim import optimizer as torch_optimizer
    held = [getattr(torch_optimizer, name, None) for name in
            ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")]
    saved = [dict(hooks) if hooks is not None else None for hooks in held]
    numpy = sys.modules.get("numpy")
    python_state = random.getstate()
    numpy_state = numpy.random.get_state() if numpy is not None else None
    devices = [device] if device.type == "cuda" else []
    set_stance = getattr(torch.compiler, "set_stance", None)  # (torch >= 2.6)
    eager = set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()
    try:
        for hooks in held:
            if hooks is not None:
                hooks.clear()
        with torch.random.fork_rng(devices=devices), warnings.catch_warnings(), eager:
            warnings.simplefilter("ignore")
            torch.random.default_generator.manual_seed(_SEED)
            if device.type == "cuda":
                with torch.cuda.device(device):
                    torch.cuda.manual_seed(_SEED)
            random.seed(_SEED)
            if numpy is not None:
                numpy.random.seed(_SEED)
            yield
    finally:
        for hooks, kept in zip(held, saved):
            if hooks is not None:
                registered_meanwhile = dict(hooks)
                hooks.clear()
                hooks.update(kept)
                hooks.update(registered_meanwhile)
        random.setstate(python_state)
        if numpy is not None:
            numpy.random.set_state(numpy_state)
