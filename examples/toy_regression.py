"""The model and data every framework example trains (lightning_trainer.py,
hf_trainer.py, accelerate_loop.py, fabric_loop.py): a 2-layer MLP on 64 fixed
samples, small enough for a comparison of many 2-process runs to take a minute."""
from __future__ import annotations

import torch


def regression_net() -> torch.nn.Sequential:
    """Seed torch first: its initial weights come from torch's generator."""
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def regression_dataset() -> torch.utils.data.TensorDataset:
    """64 inputs of 8 features and their noisy targets, the same on every rank and run."""
    g = torch.Generator().manual_seed(123)
    x = torch.randn(64, 8, generator=g)
    y = (x.sum(1, keepdim=True) * 0.5).tanh() + 0.1 * torch.randn(64, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)
