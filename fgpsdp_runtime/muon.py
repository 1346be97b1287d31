"""Muon for the hidden matrices, AdamW for the rest: the inner optimizer for a Muon loop.

torch.optim.Muon updates each matrix by its momentum orthogonalised as a whole
(Newton-Schulz iterations on the matrix, after dividing it by its norm), so it cannot
run on flat slices alone, and it takes 2-D parameters only: a torch DDP loop pairs it
with a second optimizer (AdamW) for the biases, norms and embeddings. A
ShardedOptimizer runs one inner optimizer, so this class is both, by param group, as
DeepSpeed's and Keller Jordan's ``MuonWithAuxAdam`` are: ``use_muon=True`` groups take
torch.optim.Muon's update and its settings, the others torch.optim.AdamW's.

On a rank's slices ([Note: whole matrices from slices]), the momentum is element-wise
and stays on the pieces; the matrix that Newton-Schulz needs is put together from
every rank's pieces, orthogonalised on one rank, and each rank steps its pieces with
their part of the result. The parameters end bit for bit where torch.optim.Muon's
step on the whole matrices puts them: the same element-wise operations on the same
values, and the same orthogonalisation of the same matrix.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from .step_wide_state import same_value

# [Note: whole matrices from slices]
# The ShardedOptimizer runs this class's step once over every bucket (not in the
# chunks of step_chunks.py: see _step_chunk_count). For each matrix of a use_muon
# group in the buckets it runs over that has a gradient (the same list on every rank,
# taken from the layout, not from this rank's pieces: a rank may orthogonalise a
# matrix it holds no piece of), each rank updates its pieces' momentum. Each matrix
# is orthogonalised by one rank, its owner, the inner step's matrices spread over the
# ranks alike on every rank (under torch DDP every rank orthogonalises every matrix).
# One exchange brings each owner every other rank's pieces of its matrices' updates
# (as bytes, so every value arrives unchanged), and a second brings every rank its
# pieces' part of each result, bit for bit; each rank steps its pieces with them.
# Both are all-to-alls on the wrapper's group, blocking the training thread, each
# rank sending only what another rank needs: about 1/N of the matrices' updates
# (their gradients' dtype) and of the results (bfloat16) per rank (see [Note: each
# matrix to its owner and back] in whole_matrices.py). Speculative steps, which run
# on the scheduler thread before the norm is known, are off: a collective there
# would not pair with the other ranks'.


@dataclass
class MatrixPieces:
    """One matrix of a use_muon group, as this rank's step sees it."""

    shape: torch.Size
    # This rank's pieces of it (the optimizer's tensors, with their .grad): the whole
    # parameter when stepped without a wrapper.
    pieces: list[torch.Tensor]
    # What the ShardedOptimizer's exchanges read (None for a whole parameter).
    handle: Any = None


def _each_whole(matrices: Sequence[MatrixPieces],
                values: Optional[Sequence[list[torch.Tensor]]],
                raised: Optional[Exception] = None) -> list[Optional[torch.Tensor]]:
    # Whole parameters (no wrapper): the update computed on the one piece is the matrix.
    if raised is not None:
        raise raised
    return [v[0] for v in values]


def _each_here(matrices: Sequence[MatrixPieces],
               orthogonalise: Callable[[int], torch.Tensor]) -> list[list[torch.Tensor]]:
    # Whole parameters (no wrapper): every matrix is orthogonalised here, and is its
    # one piece's part.
    return [[orthogonalise(i)] for i in range(len(matrices))]


_RESULT_DTYPES: dict[torch.dtype, torch.dtype] = {}


def newton_schulz_dtype(dtype: torch.dtype) -> torch.dtype:
    """What torch's Newton-Schulz returns for an update of ``dtype`` (bfloat16 on
    torch 2.13 and 2.15): every rank must lay out the results alike before any
    computes one."""
    if dtype not in _RESULT_DTYPES:
        from torch.optim._muon import _zeropower_via_newtonschulz
        _RESULT_DTYPES[dtype] = _zeropower_via_newtonschulz(
            torch.ones(2, 2, dtype=dtype), (1.0, 0.0, 0.0), 1, 1e-7).dtype
    return _RESULT_DTYPES[dtype]


def not_a_matrix(name: str, shape: Sequence[int]) -> ValueError:
    """The error for a parameter of ``shape`` in a use_muon=True group that is not 2-D
    (torch.optim.Muon's check, with the parameter's name)."""
    return ValueError(f"parameter {name!r} of shape {tuple(shape)} is in a use_muon=True "
                      "group: Muon takes 2-D parameters only; put the others (biases, "
                      "norms, embeddings as you choose) in a use_muon=False group (AdamW)")


def _filled_group(optimizer_class: type, group: dict[str, Any]) -> dict[str, Any]:
    """``group``'s settings with ``optimizer_class``'s defaults for the ones it leaves
    out, checked by the class's own constructor (over a stand-in matrix). An entry
    the class puts in its groups without taking it as an argument (AdamW's
    ``decoupled_weight_decay`` on torch 2.13) is taken at its own value: groups read
    back from ``param_groups`` (``ShardedOptimizer.from_optimizer``) build again."""
    settings = {k: v for k, v in group.items() if k not in ("params", "use_muon")}
    stand_in = torch.zeros(2, 2, requires_grad=True)
    own = {k: v for k, v in optimizer_class([stand_in]).param_groups[0].items()
           if k != "params"}
    arguments = inspect.signature(optimizer_class.__init__).parameters
    kept = {k for k, v in settings.items()
            if k not in arguments and k in own and same_value(v, own[k])}
    try:
        built = optimizer_class([stand_in], **{k: v for k, v in settings.items()
                                               if k not in kept})
    except TypeError as error:
        raise TypeError(f"a use_muon={optimizer_class is torch.optim.Muon} group: "
                        f"{optimizer_class.__name__} takes no such setting ({error})") from None
    filled = {k: v for k, v in built.param_groups[0].items() if k != "params"}
    if optimizer_class is torch.optim.Muon:
        # What Newton-Schulz refuses (ns_steps >= 100, not 3 coefficients), refused
        # here on every rank: in a step only the rank orthogonalising a matrix runs it.
        from torch.optim._muon import _zeropower_via_newtonschulz
        _zeropower_via_newtonschulz(torch.ones(2, 2), filled["ns_coefficients"],
                                    filled["ns_steps"], filled["eps"])
    return {**group, **filled}


def _step_unhooked(optimizer: torch.optim.Optimizer) -> None:
    # The outer optimizer's step runs torch's step hooks once; this one runs inside it.
    step = type(optimizer).step
    if getattr(step, "hooked", False):  # torch's patch (Optimizer._patch_step_function)
        step.__wrapped__(optimizer)
    else:
        optimizer.step()


class MuonWithAdamW(torch.optim.Optimizer):
    """torch.optim.Muon's update for param groups with ``use_muon=True`` (2-D
    parameters), torch.optim.AdamW's for those with ``use_muon=False``; each group's
    settings default to its class's. Run by ``ShardedOptimizer(model, MuonWithAdamW,
    param_groups=[...])``; on whole tensors (no wrapper) it steps as those two
    torch optimizers would."""

    # ShardedOptimizer: the update reads whole matrices (see the module's note).
    steps_whole_matrices = True

    def __init__(self, params: Iterable[Any], **defaults: Any):
        if not hasattr(torch.optim, "Muon"):
            raise TypeError("MuonWithAdamW needs torch.optim.Muon (torch >= 2.9)")
        if defaults:
            raise TypeError("MuonWithAdamW takes its settings per param group (each "
                            "with use_muon=True or False), not as keywords: got "
                            + ", ".join(sorted(defaults)))
        groups = list(params)
        if not groups or not all(isinstance(g, dict) for g in groups):
            raise TypeError("MuonWithAdamW takes param groups (dicts), each with "
                            "use_muon=True (Muon, 2-D parameters) or False (AdamW)")
        filled = []
        for group in groups:
            if not isinstance(group.get("use_muon"), bool):  # (1 == True: not taken)
                raise ValueError("every MuonWithAdamW param group says use_muon=True "
                                 "(Muon, 2-D parameters) or use_muon=False (AdamW), got "
                                 f"{group.get('use_muon')!r}")
            kind = torch.optim.Muon if group["use_muon"] else torch.optim.AdamW
            filled.append(_filled_group(kind, group))
        super().__init__(filled, {})
        # Steps the AdamW groups: given this optimizer's groups and state at each
        # step (the outer optimizer may have handed out copies of the group dicts).
        self._adamw = torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
        # Set by the ShardedOptimizer running this one over slices: group position ->
        # the matrices of this inner step (None: each parameter is a whole matrix);
        # (matrices, the update's values on this rank's pieces of each, or None and
        # the error that stopped this rank computing them) -> each whole update,
        # shaped as its matrix, on the rank that orthogonalises it (None on the
        # others): one collective for them all, which raises every rank's error;
        self.matrices_of_group: Optional[Callable[[int], Sequence[MatrixPieces]]] = None
        self.put_together: Callable[..., list[Optional[torch.Tensor]]] = _each_whole
        # and (matrices, i -> matrix i orthogonalised) -> this rank's pieces' parts of
        # each result (each computed on that one rank), per matrix: one collective.
        self.orthogonalised: Callable[[Sequence[MatrixPieces], Callable[[int], torch.Tensor]],
                                      list[list[torch.Tensor]]] = _each_here

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # torch.optim._muon._single_tensor_muon per matrix, in phases: every group's
        # momentum, the matrices put together at once, each orthogonalised (on one
        # rank, shared with the others), each rank's pieces stepped. Nothing is
        # written before the last collective has returned: a step that raised (on
        # any rank: the collective says so on every rank) is taken again whole by
        # the next opt.step(), and the AdamW groups step after it.
        todo = [(group, matrix) for position, group in enumerate(self.param_groups)
                if group["use_muon"] for matrix in self._matrices(position, group)]
        matrices = [matrix for _, matrix in todo]
        momenta, raised = [], None
        try:
            momenta = [self._momentum_step(group, matrix) for group, matrix in todo]
        except Exception as error:  # noqa: BLE001 - said to every rank by put_together
            raised = error
        wholes = self.put_together(matrices, [updates for _, updates in momenta]
                                   if raised is None else None, raised)

        def orthogonalise(i: int) -> torch.Tensor:
            from torch.optim._muon import _zeropower_via_newtonschulz
            group = todo[i][0]
            return _zeropower_via_newtonschulz(wholes[i], group["ns_coefficients"],
                                               group["ns_steps"], group["eps"])
        parts = self.orthogonalised(matrices, orthogonalise)
        for (group, matrix), (buffers, _), mine in zip(todo, momenta, parts):
            for piece, buffer in zip(matrix.pieces, buffers):
                self.state[piece]["momentum_buffer"] = buffer
            self._orthogonalised_step(group, matrix, mine)
        self._step_adamw_groups()
        return loss

    @torch.no_grad()
    def zero_gradient_step(self) -> None:
        """The state that step() at learning rate 0 on zero gradients makes (torch's
        ``_init_optim_state``, for a checkpoint template) for the parameters given a
        ``.grad``, without putting any matrix together: a use_muon piece gets a zero
        momentum buffer (a zero matrix orthogonalises to zero), the others AdamW's
        step. On a wrapper's slices the matrices are put together only inside
        opt.step()'s run over the buckets, every rank at once."""
        for group in self.param_groups:
            if group["use_muon"]:
                for p in group["params"]:
                    if p.grad is not None and "momentum_buffer" not in self.state[p]:
                        self.state[p]["momentum_buffer"] = torch.zeros_like(
                            p.grad, memory_format=torch.preserve_format)
        self._step_adamw_groups()

    def _step_adamw_groups(self) -> None:
        adamw_groups = [g for g in self.param_groups if not g["use_muon"]]
        if adamw_groups:
            self._adamw.param_groups = adamw_groups
            self._adamw.state = self.state
            _step_unhooked(self._adamw)

    def _matrices(self, position: int, group: dict[str, Any]) -> Sequence[MatrixPieces]:
        if self.matrices_of_group is not None:
            return self.matrices_of_group(position)
        found = []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.ndim != 2:
                raise ValueError("Muon only supports 2D parameters whereas we found a "
                                 f"parameter with size: {p.size()}")
            found.append(MatrixPieces(p.shape, [p]))
        return found

    def _momentum_step(self, group: dict[str, Any], matrix: MatrixPieces
                       ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """This rank's pieces' momentum buffers after this step (new tensors, kept
        by step() once nothing can raise), and the values to orthogonalise."""
        momentum = group["momentum"]
        buffers, updates = [], []
        for piece in matrix.pieces:
            grad = piece.grad
            buf = self.state[piece].get("momentum_buffer") if piece in self.state else None
            if buf is None:
                buf = torch.zeros_like(grad, memory_format=torch.preserve_format)
            buf = buf.lerp(grad, 1 - momentum)  # torch's buf.lerp_, on a copy
            buffers.append(buf)
            updates.append(grad.lerp(buf, momentum) if group["nesterov"] else buf)
        return buffers, updates

    def _orthogonalised_step(self, group: dict[str, Any], matrix: MatrixPieces,
                             parts: Sequence[torch.Tensor]) -> None:
        """This rank's pieces stepped with their parts of the orthogonalised update."""
        from torch.optim._muon import _adjust_lr
        from torch.optim.optimizer import _to_scalar
        lr = _to_scalar(group["lr"])
        adjusted_lr = _adjust_lr(lr, group["adjust_lr_fn"], matrix.shape)
        for piece, part in zip(matrix.pieces, parts):
            piece.mul_(1 - lr * group["weight_decay"])
            piece.add_(part, alpha=-adjusted_lr)
