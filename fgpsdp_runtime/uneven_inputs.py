"""Uneven inputs: ``model.join()``, torch DDP's context manager, for sharded state.

A rank that runs out of data still owns a slice of every bucket: each step
the others take must reduce-scatter into that slice, step it with its share
of the optimizer state and all-gather it back. Under torch DDP a joined rank
only has to add zeros to the all-reduces; here it has to keep training its
slices, so it shadows every call of the loop that communicates.

[Note: the join protocol]
Inside ``with model.join():`` each active rank announces every call that
communicates with one small all-reduce on the wrapper's group, before the
call's first collective: a forward, a round of reduce-scatters (the first
bucket a backward launches), ``opt.step()``, ``opt.clip_grad_norm_()``,
``zero_grad()``, a ``synchronize()`` that undoes speculative steps, and
``opt.full_state_dict()``. A rank whose loop has ended loops in ``__exit__``:
it adds zeros to the same all-reduce, learns from the sum how many ranks are
still active, which call they make and with which arguments, and makes the
same call itself, contributing zero gradients. Its reducer, optimizer and
scheduler thus go through the same states as the active ranks', and every
later collective pairs up as it does without a join. When the all-reduce
sums to zero active ranks every rank has left its loop: the buffers are
broadcast from the last rank to join (as torch DDP does; the parameters are
the same everywhere already) and the context ends.

    active rank : notify(F) forward  notify(R) RS RS RS  notify(S) norm AG AG
    joined rank : notify    -> F     notify    RS RS RS  notify    norm AG AG
                  (zeros)      (lands gathers, buffers)  (zeros)    (steps its slices)

A call that an active rank refuses before announcing it (its arguments, an
unfinished step) announces nothing: the loop may catch the error and go on, and
the join with it. One that ends the loop instead leaves a joined rank waiting
for the next announcement until the group's timeout, as torch DDP's joined
ranks wait. (Telling them from the refusal broke both: a caught error ended
the join, and a rank-local one, an unfinished step's, met the others'
all-gathers.)
A round of reduce-scatters that a step or a clip launches itself (a
backward that reached no parameter on some rank) is launched and announced
before the step's or clip's own announcement, as a backward's is.
Hyperparameters set on the active ranks (a learning-rate schedule)
are broadcast to the joined ranks at each step. While a rank is joined
``two_stage`` does not speculate (its speculative steps would run before
that broadcast); it resumes after the context.
"""
from __future__ import annotations

import enum
import struct
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
import torch.distributed as dist

from .backends import objects_on
from .group_collectives import all_reduce_held
from .model_parallel_norm import GROUP_KEYWORDS
from .object_collectives import broadcast_object
from .step_wide_state import copy_value
from .user_warnings import warn_at_user_code

if TYPE_CHECKING:  # pragma: no cover
    from .ddp import DistributedDataParallel


class AnnouncedCall(enum.IntEnum):
    """What the active ranks are about to do (one slot each in the notification)."""
    FORWARD = 0        # args: (buffers broadcast before it, a synchronised grad-enabled forward)
    REDUCE_ROUND = 1   # a backward launches its round of reduce-scatters
    STEP = 2
    CLIP = 3           # args: (max_norm,)
    ZERO_GRAD = 4      # args: (set_to_none,)
    SYNCHRONIZE = 5    # one that undoes two_stage's speculative steps (a collective then)
    FULL_STATE = 6     # args: (rank0_only, init_state)
    REFUSED = 7        # the active ranks raise: so does the joined one
    LOAD = 8           # a model or optimizer load (refused once a rank has joined)
    CLIP_VALUE = 9     # args: (clip_value,)
    GRAD_NORMS = 10    # opt.grad_norms()
    FULL_GRAD = 11     # args: (the parameter's index in the wrapper, or a grad_reads marker,)
    PARAM_STATE = 12   # opt.full_state(param); args: (as FULL_GRAD's,)
    # opt.summon_full_grads(): refused under model.join(), so never announced; its
    # number tells it from the other reads in grad_reads.agree_on_the_read.
    FULL_GRADS = 13
    # opt.step() called again after it raised part-way, where its inner step has
    # collectives (MuonWithAdamW's exchanges): a joined rank takes it up again too.
    STEP_AGAIN = 14


_N_CALLS = len(AnnouncedCall)
_N_ARGS = 2
# An argument travels as its float64 bits in 16-bit pieces, each piece and its
# square in a slot of their own: summed over the active ranks they stay exact
# integers (below 2**53 for up to 2**21 ranks), and a piece's sum divided by the
# ranks' count is the piece. The value itself summed and divided would not be:
# three ranks' 0.1 came back as 0.10000000000000002 (a joined rank's max_norm
# one ulp off). The squares tell whether the ranks passed the same:
# n * sum(p^2) == sum(p)^2 only if every p is equal.
_PIECE_BITS = 16
_PIECES = 64 // _PIECE_BITS
_ARG_SLOTS = 2 * _N_ARGS * _PIECES
_DIFFERENT_CALLS = ("fgpsdp: under model.join() the active ranks made different calls at the "
                    "same point of their loops; every rank must run the same loop")
_DIFFERENT_ARGS = ("fgpsdp: under model.join() the active ranks made the same call with "
                   "different arguments (a max_norm, a clip value, set_to_none); every rank "
                   "must pass the same")
EARLY_TERMINATION = ("fgpsdp: detected at least one rank that exhausted its inputs; raising on "
                     "every rank (join(throw_on_early_termination=True))")


class UnevenInputs:
    """What ``model.join(...)`` returns; see the module docstring."""

    def __init__(self, model: "DistributedDataParallel", *, divide_by_initial_world_size: bool,
                 enable: bool, throw_on_early_termination: bool):
        self.model = model
        self.enable = enable
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self.throw_on_early_termination = throw_on_early_termination
        self.joined = False  # this rank's loop has ended; it shadows the others
        self.active_ranks: Sequence[int] = range(model.world_size)  # group ranks
        self._someone_joined = False
        # The joined rank's own stand-in step raised: raised once every rank has joined.
        self._shadowed_step_error: Optional[BaseException] = None
        self._held_warnings: list[Optional[str]] = []  # (see __exit__)

    # -- the context -----------------------------------------------------------

    def __enter__(self) -> "UnevenInputs":
        if self.enable:
            if self.model._uneven_inputs is not None:
                raise RuntimeError("fgpsdp: model.join() contexts cannot be nested")
            if _active_contexts:
                # Each would shadow its own wrapper's calls only: a rank joined in
                # one waits there while the others call the other (torch's nested
                # DDP joins hang alike). Same code on every rank: all raise.
                raise NotImplementedError(
                    "fgpsdp: model.join() of one wrapper inside another's: uneven inputs "
                    "with two wrapped models (a GAN's generator and discriminator) are not "
                    "supported; give every rank the same number of iterations there")
            optimizer = self.model._optimizer_ref() if self.model.optimizer_attached else None
            for name in GROUP_KEYWORDS:
                if getattr(optimizer, name, None) is not None:
                    # A joined rank would leave its peers there alone in the norm's
                    # all-reduce over that group. Same on every rank: all raise.
                    raise NotImplementedError(
                        f"fgpsdp: model.join() with a ShardedOptimizer's {name} is not "
                        "supported; give every rank the same number of iterations there")
            self.model._uneven_inputs = self
            _active_contexts.add(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if not self.enable:
            return False
        optimizer = self.model._optimizer_ref() if self.model.optimizer_attached else None
        # The step shares the active ranks' hyperparameters with the joined ones;
        # after the join each rank's are its own again (its lr schedule's). Not the
        # entries the optimizer's steps write (schedule-free's step count group["k"]):
        # those every rank stepped alike.
        written = optimizer._step_wide_state.written_group_keys if optimizer is not None \
            else set()
        own = [{k: copy_value(v) for k, v in g.items() if k != "params" and k not in written}
               for g in optimizer.param_groups] if optimizer is not None else None
        try:
            if exc_type is None:
                if optimizer is not None:
                    # A step that raised as the loop ended: the rest goes out before
                    # the join's announcements, which the others reach only after it.
                    self._held_warnings.append(optimizer.drop_unfinished_step(warn=False))
                self.joined = True
                self._shadow_until_all_joined()
                # Given only now: one raised as an error (-W error) before would have
                # left the join without shadowing, the others waiting.
                for message in filter(None, self._held_warnings):
                    warn_at_user_code(message)
                if self._shadowed_step_error is not None:
                    raise self._shadowed_step_error
        finally:
            self._leave()
            if own is not None:
                for group, values in zip(optimizer.param_groups, own):
                    _update_in_place(group, values)
        return False

    def _leave(self) -> None:
        model = self.model
        model._uneven_inputs = None
        _active_contexts.discard(self)
        model.reducer.grad_scale = 1.0 / model.world_size
        if model.scheduler is not None:
            model.scheduler.resume_speculation()

    # -- active ranks ------------------------------------------------------------

    @property
    def authoritative_rank(self) -> int:
        """The group rank buffers come from: the highest active one (torch DDP's choice)."""
        return max(self.active_ranks)

    def rank0_only_keeper(self) -> int:
        """The group rank a ``full_state_dict(rank0_only=True)`` is kept on: rank 0,
        or, once it has joined, the lowest active rank (a joined rank's loop has
        ended: a dict kept there would reach no save). The same on every rank: each
        learnt the active ranks from the call's announcement."""
        return 0 if 0 in self.active_ranks else min(self.active_ranks)

    def notify(self, call: AnnouncedCall, *args: float) -> None:
        """An active rank announces ``call``: before its first collective, on every active rank."""
        if self.joined:
            return  # a joined rank making the call it shadows
        packet = self._empty_packet(torch.device("cpu"))
        packet[0] = 1.0
        packet[1 + int(call)] = 1.0
        packet[1 + _N_CALLS:1 + _N_CALLS + _ARG_SLOTS] = torch.tensor(_arg_slots(args),
                                                                     dtype=torch.float64)
        packet[1 + _N_CALLS + _ARG_SLOTS + self.model.rank] = 1.0
        packet = packet.to(self._device)
        self.model.all_reduce_sum(packet)
        packet = packet.cpu()  # read in one copy from the device
        active = int(round(float(packet[0])))
        if int(round(float(packet[1 + int(call)]))) != active:
            raise RuntimeError(_DIFFERENT_CALLS)
        _take_args(packet, active)  # raises where the ranks' differ
        self._learn(packet)
        if call is AnnouncedCall.FORWARD and not self.divide_by_initial_world_size:
            # torch DDP's option: average over the ranks that contribute.
            self.model.reducer.grad_scale = 1.0 / len(self.active_ranks)

    def share_hyperparameters(self, optimizer) -> None:
        """After opt.step()'s announcement, once a rank has joined: the step's
        hyperparameters, as the joined ranks' schedules stopped with their loops."""
        if self._someone_joined and not self.joined:  # a joined rank received them in _shadow
            _share_hyperparameters(self.model, optimizer, self.authoritative_rank)

    def announce_load(self, what: str, advice: str = "load before the join context or "
                      "after it") -> None:
        """A load on the active ranks (of the model or the optimizer), or another
        rewrite of every rank's own slices (schedule-free's opt.eval()): a joined
        rank's would keep their values (spread to every rank by the next
        all-gather). Refused on every rank once a rank has joined; before, every
        rank takes part and nothing is amiss."""
        if self.joined:
            return
        self.notify(AnnouncedCall.LOAD)
        if self._someone_joined:
            self.refuse(f"fgpsdp: {what} under model.join() after a rank has joined: the "
                        f"joined rank owns a slice of every bucket and takes no part; {advice}")

    def refuse(self, message: str, error: type = NotImplementedError) -> None:
        """Raise ``error(message)`` on every rank (the joined ones are told first, and
        raise NotImplementedError)."""
        self.notify(AnnouncedCall.REFUSED)
        raise error(message)

    # -- joined ranks --------------------------------------------------------------

    def _shadow_until_all_joined(self) -> None:
        model = self.model
        # Gradients a no_sync() backward left (a loop that ends between its
        # accumulation's micro-batches) count for nothing in the shadowed steps
        # (a joined rank contributes zeros) but stay in param.grad for the first
        # step after the join, as under torch DDP, whose joined rank never touches
        # them: set aside here, put back when every rank has joined (a shadowed
        # zero_grad() would have cleared them; before, they were dropped). Those of
        # the parameters left to the user too: clip_ignored_parameters would count
        # a joined rank's last ones in every shadowed step's norm.
        leftover = [(param, param.grad) for _, param in
                    model.named_trainable_parameters() + model.named_ignored_parameters()]
        for param, _ in leftover:
            param.grad = None
        self._shadow_all()
        for param, grad in leftover:
            param.grad = grad

    def _shadow_all(self) -> None:
        """Every call the active ranks announce, until none is left."""
        last_to_join = True
        while True:
            packet = self._empty_packet(self._device)
            self.model.all_reduce_sum(packet)
            packet = packet.cpu()  # read in one copy from the device
            active = int(round(float(packet[0])))
            if active == 0:
                break
            last_to_join = False
            self._learn(packet)
            calls = [c for c in AnnouncedCall if int(round(float(packet[1 + int(c)]))) == active]
            if len(calls) != 1:
                raise RuntimeError(_DIFFERENT_CALLS)
            args = _take_args(packet, active)
            self._shadow(calls[0], args)
        self._finish(last_to_join)

    def _shadow(self, call: AnnouncedCall, args: list[float]) -> None:
        model = self.model
        optimizer = model._optimizer_ref() if model.optimizer_attached else None
        if call in (AnnouncedCall.FORWARD, AnnouncedCall.ZERO_GRAD):
            # A step kept for STEP_AGAIN (_shadow_step) that the active ranks went on
            # from without calling it again: their forward or zero_grad() dropped
            # theirs before announcing. (Their other calls are refused while a step
            # is unfinished.)
            self._drop_unfinished_step(optimizer)
        if call is AnnouncedCall.FORWARD:
            model._shadow_forward(buffers_first=args[0] > 0.5, synchronised=args[1] > 0.5)
        elif call is AnnouncedCall.REDUCE_ROUND:
            model.reducer.launch_round_of_zeros()
        elif call is AnnouncedCall.STEP:
            _share_hyperparameters(model, optimizer, self.authoritative_rank)
            self._shadow_step(optimizer)
        elif call is AnnouncedCall.STEP_AGAIN:
            _share_hyperparameters(model, optimizer, self.authoritative_rank)
            self._shadow_step(optimizer)
        elif call is AnnouncedCall.CLIP:
            optimizer.clip_grad_norm_(args[0])
        elif call is AnnouncedCall.CLIP_VALUE:
            optimizer.clip_grad_value_(args[0])
        elif call is AnnouncedCall.GRAD_NORMS:
            optimizer.grad_norms()
        elif call is AnnouncedCall.FULL_GRAD:  # (the index may be a marker: see grad_reads)
            optimizer._full_grad_at(int(args[0]))
        elif call is AnnouncedCall.PARAM_STATE:
            optimizer._full_state_at(int(args[0]))
        elif call is AnnouncedCall.ZERO_GRAD:
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=args[0] > 0.5)
            else:  # (the buckets' part: a joined rank's own parameters stay as they are)
                model.zero_reduced_gradients(set_to_none=args[0] > 0.5)
        elif call is AnnouncedCall.SYNCHRONIZE:
            model.synchronize()
        elif call is AnnouncedCall.FULL_STATE:
            optimizer.full_state_dict(rank0_only=args[0] > 0.5, init_state=args[1] > 0.5)
        elif call is AnnouncedCall.LOAD:
            pass  # loaded while no rank had joined: then this rank would not be here
        elif call is AnnouncedCall.REFUSED:
            raise NotImplementedError("fgpsdp: the active ranks raised under model.join() "
                                      "(their error says why)")

    def _shadow_step(self, optimizer) -> None:
        """A joined rank's part in the active ranks' opt.step(), or in their call of it
        again after it raised part-way (STEP_AGAIN)."""
        try:
            optimizer.step()
        except Exception as error:  # (not an interrupt: that ends the join)
            if optimizer._unfinished is None:
                raise
            if optimizer.steps_with_collectives:
                # Raised on every rank (MuonWithAdamW says a rank's error to all):
                # the active ranks may call the step again (STEP_AGAIN), and this
                # rank must take it up with them. Kept; dropped where they go on.
                return
            # Its inner optimizer raised (this rank's own: out of memory), where
            # no loop can call the step again: the rest goes out unstepped, the
            # active ranks' all-gathers are answered, and the error is given when
            # every rank has joined.
            self._drop_unfinished_step(optimizer)
            if self._shadowed_step_error is None:
                self._shadowed_step_error = error
        # Every all-gather starts now: an active rank may wait for any of
        # them (a save, a direct call of model.module) without a forward.
        self.model.begin_param_exchange()

    def _drop_unfinished_step(self, optimizer) -> None:
        """The stand-in step left unfinished (its inner optimizer raised) goes out
        unstepped, answering the active ranks' all-gathers; its warning is held until
        every rank has joined."""
        if optimizer is not None and optimizer._unfinished is not None:
            self._held_warnings.append(optimizer.drop_unfinished_step(
                "in the stand-in step of a rank whose loop had ended (model.join())",
                warn=False))

    def _finish(self, last_to_join: bool) -> None:
        model = self.model
        # A step kept for STEP_AGAIN whose active ranks left their loops without
        # calling it again (their join's end dropped theirs).
        self._drop_unfinished_step(model._optimizer_ref() if model.optimizer_attached
                                   else None)
        model.finish_param_all_gathers()
        # The buffers of the last rank to join, as torch DDP ends a join: a
        # joined rank's are stale. (Its parameters are not: it took part in
        # every all-gather.)
        candidate = torch.tensor([model.rank if last_to_join else -1], dtype=torch.float64,
                                 device=self._device)
        if model.world_size > 1:
            all_reduce_held(candidate, dist.ReduceOp.MAX, model.process_group, "join's end")
        self.active_ranks = (int(candidate.item()),)
        if model.broadcast_buffers:
            model._broadcast_buffers()

    # -- shared ------------------------------------------------------------------------

    def _learn(self, packet: torch.Tensor) -> None:
        world_size = self.model.world_size
        mask = packet[1 + _N_CALLS + _ARG_SLOTS:]
        self.active_ranks = tuple(r for r in range(world_size) if mask[r] > 0.5)
        if len(self.active_ranks) < world_size and not self._someone_joined:
            self._someone_joined = True
            if self.throw_on_early_termination:
                raise RuntimeError(EARLY_TERMINATION)
            if self.model.scheduler is not None:
                self.model.scheduler.suspend_speculation()

    def _empty_packet(self, device: torch.device) -> torch.Tensor:
        """[active count, one slot per call, the call's arguments in pieces, one slot per rank]."""
        return torch.zeros(1 + _N_CALLS + _ARG_SLOTS + self.model.world_size,
                           dtype=torch.float64, device=device)

    @property
    def _device(self) -> torch.device:
        buckets = self.model.buckets
        return buckets[0].device if buckets else torch.device("cpu")


def _arg_slots(args: Sequence[float]) -> list[float]:
    """A call's argument slots: the pieces of each one's bits, then their squares
    (a missing argument is 0.0)."""
    values = list(args) + [0.0] * (_N_ARGS - len(args))
    pieces = []
    for value in values:
        # + 0.0: -0.0 becomes 0.0, so that ranks passing 0.0 and -0.0 (the same
        # argument to any call) do not differ in the sign bit.
        bits = struct.unpack("<Q", struct.pack("<d", float(value) + 0.0))[0]
        pieces += [(bits >> (_PIECE_BITS * j)) & ((1 << _PIECE_BITS) - 1)
                   for j in range(_PIECES)]
    return [float(p) for p in pieces] + [float(p * p) for p in pieces]


def _take_args(packet: torch.Tensor, active: int) -> list[float]:
    """The arguments the ``active`` ranks put in ``packet`` before its sum, exactly as
    each passed them. Raises if they passed different ones."""
    first = 1 + _N_CALLS
    slots = [int(round(v)) for v in packet[first:first + _ARG_SLOTS].tolist()]
    n = max(active, 1)
    args = []
    for i in range(_N_ARGS):
        bits = 0
        for j in range(_PIECES):
            total, squares = slots[i * _PIECES + j], slots[(_N_ARGS + i) * _PIECES + j]
            if n * squares != total * total:
                raise RuntimeError(_DIFFERENT_ARGS)
            bits |= (total // n) << (_PIECE_BITS * j)
        args.append(struct.unpack("<d", struct.pack("<Q", bits))[0])
    return args


def _share_hyperparameters(model: "DistributedDataParallel", optimizer, src: int) -> None:
    """Every param group's hyperparameters from group rank ``src`` to every rank (a collective)."""
    groups = optimizer.param_groups
    mine = [{k: _on_the_host(v) for k, v in g.items() if k != "params"}
            for g in groups] if model.rank == src else None
    with objects_on(model.device):
        shared = broadcast_object(mine, src, model.process_group, "join's hyperparameters")
    if model.rank != src:
        for group, values in zip(groups, shared):
            _update_in_place(group, values)


def _on_the_host(value: Any) -> Any:
    """Tensors (also inside tuples and lists) as CPU tensors: a pickled CUDA tensor is
    unpickled on the sender's GPU (a CUDA context there on every receiver, or an error
    where it sees fewer GPUs)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if type(value) in (tuple, list):
        return type(value)(_on_the_host(v) for v in value)
    return value


def _placed_like(value: Any, current: Any) -> Any:
    """``value`` with its tensors on the devices of ``current``'s, entry by entry."""
    if isinstance(value, torch.Tensor) and isinstance(current, torch.Tensor):
        return value.to(current.device)
    if type(value) in (tuple, list) and type(current) is type(value) \
            and len(value) == len(current):
        return type(value)(_placed_like(v, c) for v, c in zip(value, current))
    return value


def _update_in_place(group: dict, values: dict) -> None:
    """``group.update(values)``, but a tensor entry (``lr=torch.tensor(...)``, which
    the loop may hold and fill) keeps its object: its values are copied into it; other
    tensors go where the group's own were (they arrive on the CPU: _on_the_host)."""
    for key, value in values.items():
        current = group.get(key)
        if isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor) \
                and current.shape == value.shape and current.dtype == value.dtype:
            with torch.no_grad():
                current.copy_(value)
        else:
            group[key] = _placed_like(value, current)


# The join contexts open in this process (see UnevenInputs.__enter__).
_active_contexts: set = set()
