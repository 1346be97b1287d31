"""The systems under comparison, each behind one small interface.

Every system trains the same model on the same data with AdamW and gradient
clipping at 1.0. ``final_params`` returns the full parameters (on every rank)
so the driver can compare each system with torch DDP after the timed steps.
"""
from __future__ import annotations

import os
import re
import threading
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

import fgpsdp_runtime as fgp

ADAMW = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01)
# The Muon systems (ddp_muon, fgpsdp_muon): torch.optim.Muon's settings for the blocks'
# 2-D weights (muon_split), AdamW's above for the rest.
MUON = dict(lr=0.02, momentum=0.95, weight_decay=0.01)
MAX_NORM = 1.0  # every system clips at this total norm (set_max_norm changes it for all)
BUCKET_CAP_MB = 25.0  # the peers' bucket size (torch DDP's default)


def tensor_bytes(optimizer_state) -> int:
    return sum(t.numel() * t.element_size() for s in optimizer_state.values()
               for t in s.values() if isinstance(t, torch.Tensor))


class System:
    name = "?"

    def train_step(self, x, y) -> torch.Tensor:
        raise NotImplementedError

    def finish_step(self) -> None:
        """Block until the step's updates are visible (back-to-back steps skip it)."""

    def opt_state_bytes(self) -> int:
        raise NotImplementedError

    def final_params(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def timeline(self):
        """The system's fgpsdp_runtime Timeline, or None (peers are not traced)."""
        return None

    def schedule_info(self) -> dict:
        """fgpsdp: the schedule, the plan it ran and how speculation went."""
        return {}


class TorchDDP(System):
    name = "ddp"
    synchronize_norm = False  # TorchZeRO reuses train_step without this __init__

    def __init__(self, model, loss_fn, compute_only=False, bucket_cap_mb=BUCKET_CAP_MB,
                 synchronize_norm=False, reduce_dtype=None, muon=False):
        self.model = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
        if reduce_dtype is not None:
            self.model.register_comm_hook(None, reduce_in_dtype_hook(reduce_dtype))
        if muon:  # ddp_muon: torch's pair of optimizers, as a torch DDP loop runs Muon
            matrices, rest = muon_split(self.model.module)
            self.opt = TwoOptimizers(torch.optim.Muon(matrices, **MUON),
                                     torch.optim.AdamW(rest, **ADAMW))
        else:
            self.opt = torch.optim.AdamW(self.model.parameters(), **ADAMW)
        self.loss_fn = loss_fn
        self.compute_only = compute_only
        # compute_synced: the compute-only step plus the one synchronisation that
        # clipping by the global norm needs (a one-element all-reduce), so every
        # rank waits for the slowest once per step, as any data-parallel step
        # with exact clipping must. Its gap to ``compute`` is what the ranks'
        # drift apart on shared cores costs a synchronised step.
        self.synchronize_norm = synchronize_norm
        self._norm_packet = torch.zeros(1, dtype=torch.float64)
        if compute_only:
            self.name = "compute_synced" if synchronize_norm else "compute"

    def train_step(self, x, y):
        if self.compute_only:  # same compute, no communication: the floor's compute part
            with self.model.no_sync():
                loss = self.loss_fn(self.model(x), y)
                loss.backward()
        else:
            loss = self.loss_fn(self.model(x), y)
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_NORM)
        if self.synchronize_norm:
            self._norm_packet.fill_(float(norm) ** 2)
            dist.all_reduce(self._norm_packet)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss

    def opt_state_bytes(self):
        return tensor_bytes(self.opt.state)

    def final_params(self):
        return [p.detach() for p in self.model.module.parameters()]


def muon_split(model: nn.Module) -> tuple[list, list]:
    """(Muon's parameters: the blocks' 2-D weights; AdamW's: the rest)."""
    matrices = [p for n, p in model.named_parameters()
                if p.ndim == 2 and n.startswith("blocks.")]
    if not matrices:
        raise ValueError("the Muon systems need a workload with blocks of 2-D weights "
                         "(gpt2, bert, vit)")
    chosen = {id(p) for p in matrices}
    return matrices, [p for p in model.parameters() if id(p) not in chosen]


class TwoOptimizers:
    """torch's Muon and AdamW stepped together, as one optimizer to train_step."""

    def __init__(self, *optimizers: torch.optim.Optimizer):
        self.optimizers = optimizers
        self.state = {k: v for o in optimizers for k, v in o.state.items()}

    def step(self):
        for o in self.optimizers:
            o.step()
        self.state = {k: v for o in self.optimizers for k, v in o.state.items()}

    def zero_grad(self, set_to_none=True):
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


def reduce_in_dtype_hook(dtype: torch.dtype):
    """A DDP comm hook: the bucket cast to ``dtype``, divided by the world size
    there, all-reduced, cast back. What torch's bf16_compress_hook does, which
    refuses to run without CUDA/NCCL."""
    def hook(state, bucket):
        buffer = bucket.buffer()
        wire = buffer.to(dtype).div_(dist.get_world_size())

        def cast_back(fut):
            buffer.copy_(fut.value()[0])
            return buffer
        return dist.all_reduce(wire, async_op=True).get_future().then(cast_back)
    return hook


class TorchZeRO(TorchDDP):
    """torch DDP + ZeroRedundancyOptimizer (per-parameter partitioning); DDP's step loop."""

    name = "ddp_zero1"

    def __init__(self, model, loss_fn, bucket_cap_mb=BUCKET_CAP_MB):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        self.model = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
        self.opt = ZeroRedundancyOptimizer(self.model.parameters(),
                                           optimizer_class=torch.optim.AdamW, **ADAMW)
        self.loss_fn = loss_fn
        self.compute_only = False

    def opt_state_bytes(self):
        return tensor_bytes(self.opt.optim.state)


class TorchFSDP(System):
    """FSDP1 with SHARD_GRAD_OP (ZeRO-2) or _HYBRID_SHARD_ZERO2 (per-node sharding)."""

    def __init__(self, model, loss_fn, hybrid: bool, bucket_cap_mb=BUCKET_CAP_MB,
                 reduce_dtype=None):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
        self.FSDP = FSDP
        kwargs = {}
        if reduce_dtype is not None:
            kwargs["mixed_precision"] = MixedPrecision(reduce_dtype=reduce_dtype)
        if hybrid:
            self.name = "fsdp_hybrid_zero2"
            kwargs["sharding_strategy"] = ShardingStrategy._HYBRID_SHARD_ZERO2
            kwargs["process_group"] = node_groups()
        else:
            self.name = "fsdp_grad_op"
            kwargs["sharding_strategy"] = ShardingStrategy.SHARD_GRAD_OP
        self.model = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True,
                          auto_wrap_policy=_size_wrap_policy(model, bucket_cap_mb), **kwargs)
        self.opt = torch.optim.AdamW(self.model.parameters(), **ADAMW)
        self.loss_fn = loss_fn

    def train_step(self, x, y):
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        self.model.clip_grad_norm_(MAX_NORM)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss

    def opt_state_bytes(self):
        return tensor_bytes(self.opt.state)

    def final_params(self):
        with self.FSDP.summon_full_params(self.model, writeback=False):
            return [p.detach().clone() for p in self.model.module.parameters()]


class DeepSpeedZeRO2(System):
    name = "deepspeed_zero2"

    def __init__(self, model, loss_fn, batch: int, bucket_cap_mb=BUCKET_CAP_MB,
                 reduce_dtype=None):
        import deepspeed
        config = {
            "train_micro_batch_size_per_gpu": batch,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": MAX_NORM,
            "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                                  "reduce_bucket_size": int(bucket_cap_mb * 2**20 / 4),
                                  "allgather_bucket_size": int(bucket_cap_mb * 2**20 / 4)},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        if reduce_dtype == torch.bfloat16:
            config["communication_data_type"] = "bf16"
        opt = torch.optim.AdamW(model.parameters(), **ADAMW)
        self.engine, self.opt, _, _ = deepspeed.initialize(model=model, optimizer=opt,
                                                           config=config)
        self.loss_fn = loss_fn

    def train_step(self, x, y):
        loss = self.loss_fn(self.engine(x), y)
        self.engine.backward(loss)
        self.engine.step()
        return loss

    def opt_state_bytes(self):
        inner = getattr(self.opt, "optimizer", self.opt)
        return tensor_bytes(inner.state)

    def final_params(self):
        return [p.detach() for p in self.engine.module.parameters()]


class FGPSDP(System):
    name = "fgpsdp"

    def __init__(self, model, loss_fn, bucket_cap_mb=None, calls_in_flight=None,
                 first_bucket_at_cap=False, shm_barrier=None, training_thread_nice=None,
                 compiled=None, muon=False, **ddp_kwargs):
        # Raised after the first step, once every communication thread exists
        # (threads inherit their creator's nice value): see train_step.
        self.training_thread_nice = training_thread_nice
        if calls_in_flight is not None:  # read when the link workers start
            os.environ["FGPSDP_CALLS_IN_FLIGHT"] = str(calls_in_flight)
        if shm_barrier is not None:  # read when the shared-memory links are made
            os.environ["FGPSDP_SHM_BARRIER"] = shm_barrier
        if first_bucket_at_cap:  # read when the wrapper builds its buckets
            fgp.layout.FIRST_BUCKET_CAP_MB = None
        if compiled == "layers":
            for layer in compiled_layers(model):
                layer.compile(backend=COMPILE_BACKEND)
        # None: fgpsdp's own default (sized to the model, 1-25 MB).
        self.model = fgp.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb, **ddp_kwargs)
        self.run_model = self.model
        if compiled == "wrapper":
            self.run_model = torch.compile(self.model, backend=COMPILE_BACKEND)
        if muon:  # fgpsdp_muon: the same pair as ddp_muon's, one inner optimizer
            matrices, rest = muon_split(self.model.module)
            self.opt = fgp.ShardedOptimizer(
                self.model, fgp.MuonWithAdamW, max_grad_norm=MAX_NORM,
                param_groups=[{"params": matrices, "use_muon": True, **MUON},
                              {"params": rest, "use_muon": False, **ADAMW}])
        else:
            self.opt = fgp.ShardedOptimizer(self.model, torch.optim.AdamW,
                                            max_grad_norm=MAX_NORM, **ADAMW)
        self.loss_fn = loss_fn

    def train_step(self, x, y):
        loss = self.loss_fn(self.run_model(x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.training_thread_nice is not None:
            # Only this thread: on cores the ranks share, the kernel then runs a
            # runnable link worker or gloo thread before the training threads.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.training_thread_nice)
            self.training_thread_nice = None
        return loss

    def finish_step(self):
        self.model.synchronize()

    def opt_state_bytes(self):
        return tensor_bytes(self.opt.state)

    def final_params(self):
        self.model.synchronize()
        return [p.detach() for p in self.model.module.parameters()]

    def timeline(self):
        return self.model.timeline

    def schedule_info(self):
        scheduler = self.model.scheduler
        transport = self.model.node_transport
        if scheduler is None:
            return {"schedule": self.model.schedule, "node_transport": transport}
        return {"schedule": self.model.schedule, "node_transport": transport,
                "plan": self.model.plan.to_json(),
                "speculative_commits": scheduler.commits,
                "speculative_rollbacks": scheduler.rollbacks}


# The fgpsdp_compiled_* systems compile with AOTAutograd and no code generation:
# the compute is eager's, so only where the forward waits for all-gathers changes
# (inductor on these CPUs would time its own C++ build and kernels too).
COMPILE_BACKEND = "aot_eager"


def compiled_layers(model: nn.Module) -> list[nn.Module]:
    """The layers ``fgpsdp_compiled_layers`` compiles in place, one at a time, as
    torchtune compiles each decoder layer: every module with parameters that is an
    item of an ``nn.Sequential`` or ``nn.ModuleList`` (a block of GPT-2, an encoder
    layer, a ResNet bottleneck), the outermost where they nest."""
    layers, inside = [], set()
    for parent in model.modules():
        if id(parent) in inside or not isinstance(parent, (nn.Sequential, nn.ModuleList)):
            continue
        for child in parent.children():
            if any(True for _ in child.parameters()) and id(child) not in inside:
                layers.append(child)
                inside.update(id(m) for m in child.modules())
    return layers


def node_groups():
    """(intra-node group, inter-node group) for this rank, from torchrun's environment."""
    world, rank = dist.get_world_size(), dist.get_rank()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    intra = inter = None
    for node in range(world // local):  # every rank creates every group, in the same order
        g = dist.new_group(list(range(node * local, (node + 1) * local)))
        if rank // local == node:
            intra = g
    for index in range(local):
        g = dist.new_group(list(range(index, world, local)))
        if rank % local == index:
            inter = g
    return intra, inter


def _size_wrap_policy(model: nn.Module, bucket_cap_mb: float):
    """FSDP auto-wrap policy: about one wrapped unit per ``bucket_cap_mb``, like the
    other systems' buckets, never splitting a tied parameter.

    FSDP1 flattens each unit's parameters into one buffer, so a parameter shared by
    two modules (GPT-2's and BERT's tied embedding and output weight) must sit in a
    unit that holds both; a module that holds one user of a tied parameter and not
    the other is therefore never wrapped on its own (the parameter stays with an
    ancestor that holds both, at worst the root).
    """
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy
    min_num_params = int(bucket_cap_mb * 2**20 / 4)
    splits_a_tie = _modules_splitting_a_tie(model)

    def policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        if not recurse and id(module) in splits_a_tie:
            return False
        return size_based_auto_wrap_policy(module, recurse, nonwrapped_numel,
                                           min_num_params=min_num_params)
    return policy


def _modules_splitting_a_tie(model: nn.Module) -> set[int]:
    """ids of the modules under ``model`` that hold some but not all users of a tied parameter."""
    owners: dict[int, list[str]] = {}  # parameter id -> names of the modules that hold it
    for name, module in model.named_modules(remove_duplicate=False):
        for param in module._parameters.values():
            if param is not None:
                owners.setdefault(id(param), []).append(name)
    tied = [names for names in owners.values() if len(set(names)) > 1]
    splitting = set()
    for name, module in model.named_modules():
        inside = (lambda owner: owner == name or owner.startswith(name + ".")) if name \
            else (lambda owner: True)
        if any(0 < sum(map(inside, names)) < len(names) for names in tied):
            splitting.add(id(module))
    return splitting


SYSTEMS = ("ddp", "ddp_zero1", "fsdp_grad_op", "fsdp_hybrid_zero2", "deepspeed_zero2",
           "fgpsdp", "fgpsdp_flat", "fgpsdp_gloo_intra", "fgpsdp_next_forward",
           "fgpsdp_overlap_backward", "fgpsdp_serial", "compute", "compute_synced")
FGPSDP_SCHEDULES = ("next_forward", "overlap_backward", "serial")


def set_max_norm(max_norm: float) -> None:
    """Clip every system at ``max_norm`` (before building them).

    At 1.0 clipping triggers in most steps of these short runs, so fgpsdp's
    speculative stage-1 steps are undone and speculation stays off; a large
    value keeps the same work (every system still computes the norm) without
    clipping.
    """
    global MAX_NORM
    MAX_NORM = float(max_norm)


def build_system(name: str, model: nn.Module, loss_fn: Callable, batch: int) -> System:
    """``name`` is one of SYSTEMS or an fgpsdp variant, optionally suffixed
    ``_bucket<MB>`` for another bucket size (FSDP: wrap unit; DeepSpeed:
    reduce and all-gather bucket), e.g. ``ddp_bucket8``, then ``_bf16grads``
    for gradients reduced in bfloat16, e.g. ``ddp_bucket8_bf16grads``."""
    base, reduce_dtype = split_reduce_dtype_suffix(name)
    base, bucket_cap_mb = split_bucket_suffix(base)
    # Without a suffix every system runs at its own default: the peers at 25 MB
    # (torch DDP's default; FSDP's wrap unit and DeepSpeed's buckets set to
    # match), fgpsdp at its model-sized default.
    kw = {"bucket_cap_mb": bucket_cap_mb if bucket_cap_mb is not None else BUCKET_CAP_MB}
    if reduce_dtype is not None:
        if not _sets_reduce_dtype(base):
            raise ValueError(f"{name!r}: {base} has no reduction dtype to set")
        kw["reduce_dtype"] = reduce_dtype
    if base == "ddp":
        system = TorchDDP(model, loss_fn, **kw)
    elif base == "ddp_muon":
        system = TorchDDP(model, loss_fn, muon=True, **kw)
    elif base == "compute":
        system = TorchDDP(model, loss_fn, compute_only=True, **kw)
    elif base == "compute_synced":
        system = TorchDDP(model, loss_fn, compute_only=True, synchronize_norm=True, **kw)
    elif base == "ddp_zero1":
        system = TorchZeRO(model, loss_fn, **kw)
    elif base == "fsdp_grad_op":
        system = TorchFSDP(model, loss_fn, hybrid=False, **kw)
    elif base == "fsdp_hybrid_zero2":
        system = TorchFSDP(model, loss_fn, hybrid=True, **kw)
    elif base == "deepspeed_zero2":
        system = DeepSpeedZeRO2(model, loss_fn, batch, **kw)
    elif fgpsdp_variant(base) is not None:
        extra = {"reduce_dtype": reduce_dtype} if reduce_dtype is not None else {}
        system = FGPSDP(model, loss_fn, **fgpsdp_variant(base), bucket_cap_mb=bucket_cap_mb,
                        **extra)
    else:
        raise ValueError(f"unknown system {name!r}; choose from {SYSTEMS}")
    system.name = name
    return system


def split_reduce_dtype_suffix(name: str) -> tuple[str, Optional[torch.dtype]]:
    """``"ddp_bf16grads"`` -> ``("ddp", torch.bfloat16)``: gradients reduced in
    bfloat16 (DDP: reduce_in_dtype_hook; FSDP: MixedPrecision(reduce_dtype);
    DeepSpeed: communication_data_type; fgpsdp: reduce_dtype). No suffix: None."""
    if name.endswith("_bf16grads"):
        return name[:-len("_bf16grads")], torch.bfloat16
    return name, None


def system_base(name: str) -> str:
    """The system without its suffixes: ``"fsdp_hybrid_zero2_bucket8_bf16grads"`` ->
    ``"fsdp_hybrid_zero2"``."""
    return split_bucket_suffix(split_reduce_dtype_suffix(name)[0])[0]


def split_bucket_suffix(name: str) -> tuple[str, Optional[float]]:
    """``"ddp_bucket8"`` -> ``("ddp", 8.0)``; no suffix: ``(name, None)``."""
    m = re.fullmatch(r"(.+?)_bucket(\d+(?:\.\d+)?)", name)
    return (m.group(1), float(m.group(2))) if m else (name, None)


def fgpsdp_variant(name: str):
    """fgpsdp's keyword arguments for a system name (no bucket suffix), or None.

    ``fgpsdp`` (two_stage, topology from torchrun), ``fgpsdp_flat``,
    ``fgpsdp_gloo_intra`` (intra-node bytes over gloo's TCP loopback, not
    shared memory), ``fgpsdp_one_call_in_flight`` (each link worker waits for
    a call before posting the next: link_worker.calls_in_flight),
    ``fgpsdp_gloo_barrier`` (the shared-memory rounds' barrier is gloo's one-element
    all-reduce, not the counts in the region: shm_barrier.py),
    ``fgpsdp_first_bucket_at_cap`` (the first bucket closes at the bucket cap,
    not at layout.FIRST_BUCKET_CAP_MB), ``fgpsdp_comm_first`` (after the first
    step the training thread runs at nice 10, every other thread of the rank at
    its nice 0, so communication threads win the shared cores),
    ``fgpsdp_compiled_wrapper`` (``torch.compile`` of the wrapper: its forward
    waits for every all-gather first), ``fgpsdp_compiled_layers`` (each of
    ``compiled_layers(model)`` compiled in place before wrapping: each waits for
    its own), ``fgpsdp_muon`` (MuonWithAdamW: Muon on the blocks' 2-D weights, as
    ``ddp_muon``), ``fgpsdp_<schedule>``.
    """
    if name == "fgpsdp":
        return {}
    if name == "fgpsdp_muon":
        return {"muon": True}
    if name == "fgpsdp_one_call_in_flight":
        return {"calls_in_flight": 1}
    if name == "fgpsdp_gloo_barrier":
        return {"shm_barrier": "gloo"}
    if name == "fgpsdp_first_bucket_at_cap":
        return {"first_bucket_at_cap": True}
    if name == "fgpsdp_comm_first":
        return {"training_thread_nice": 10}
    if name == "fgpsdp_flat":
        return {"topology": "flat"}
    if name in ("fgpsdp_compiled_wrapper", "fgpsdp_compiled_layers"):
        return {"compiled": name[len("fgpsdp_compiled_"):]}
    if name == "fgpsdp_gloo_intra":
        return {"topology": fgp.Topology(shared_memory=False)}
    schedule = name[len("fgpsdp_"):] if name.startswith("fgpsdp_") else None
    return {"schedule": schedule} if schedule in FGPSDP_SCHEDULES else None


def _sets_reduce_dtype(base: str) -> bool:
    return base in ("ddp", "fsdp_grad_op", "fsdp_hybrid_zero2", "deepspeed_zero2") \
        or fgpsdp_variant(base) is not None


def is_system(name: str) -> bool:
    base, reduce_dtype = split_reduce_dtype_suffix(name)
    base, _ = split_bucket_suffix(base)
    if reduce_dtype is not None and not _sets_reduce_dtype(base):
        return False
    return base in SYSTEMS or base == "ddp_muon" or fgpsdp_variant(base) is not None
