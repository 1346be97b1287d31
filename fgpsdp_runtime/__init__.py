"""fgpsdp_runtime: fine-grained partially sharded data parallel training.

    model = fgp.DistributedDataParallel(module, bucket_cap_mb=25.0)
    opt = fgp.ShardedOptimizer(model, torch.optim.AdamW, lr=3e-4, max_grad_norm=1.0)
"""
from .ddp import DistributedDataParallel
from .topology import Topology
from .optim import ShardedOptimizer
from .muon import MuonWithAdamW  # ShardedOptimizer(model, MuonWithAdamW, param_groups=...)
from .grad_scaler import ShardedGradScaler
from .plan import OverlapPlan  # DistributedDataParallel(overlap_plan=...), model.plan

__all__ = ["DistributedDataParallel", "MuonWithAdamW", "OverlapPlan", "ShardedGradScaler",
           "ShardedOptimizer", "Topology"]
__version__ = "0.1.0"
