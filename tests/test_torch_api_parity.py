"""Calls a torch DDP loop makes that fgpsdp answers differently (hunt of 2026-12-02):
torch.save(model) says what to save, copy.copy(model) is refused; clip_grad_norm_ takes
torch's keywords."""
import copy
import io

import pytest
import torch
import torch.nn as nn

import fgpsdp_runtime as fgp

from .dist_harness import run_distributed


def _wrapped(rank):
    torch.manual_seed(0)
    model = fgp.DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)))
    return model, fgp.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)


def pickle_and_clip_keywords(rank: int, world_size: int) -> dict:
    model, opt = _wrapped(rank)
    out = {}
    try:
        torch.save(model, io.BytesIO())
        out["save"] = "saved"
    except TypeError as error:
        out["save"] = str(error)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    scale = float("inf") if rank == 1 else 1.0  # an inf in one rank's loss only
    (model(x).square().mean() * scale).backward()
    try:
        opt.clip_grad_norm_(1.0, error_if_nonfinite=True, foreach=True)
        out["nonfinite"] = "no error"
    except RuntimeError as error:
        out["nonfinite"] = str(error)
    opt.zero_grad()
    model(x).square().mean().backward()
    total = opt.clip_grad_norm_(1.0, error_if_nonfinite=True, foreach=False)
    opt.step()
    out["finite_total"] = float(total)
    return out


def test_save_of_the_wrapper_and_torchs_clip_keywords():
    results = run_distributed(2, pickle_and_clip_keywords)
    for out in results:
        assert "save model.module" in out["save"]
        assert "non-finite" in out["nonfinite"]  # on every rank, also the finite one
        assert out["finite_total"] > 0


def copy_of_the_wrapper(rank: int, world_size: int) -> str:
    model, _ = _wrapped(rank)
    with pytest.raises(TypeError, match="cannot be copied") as info:
        copy.copy(model)  # before: copied, and the copy's __del__ stopped the original
    model(torch.randn(2, 8)).sum().backward()  # the original still trains
    model.synchronize()
    return str(info.value)


def test_copy_of_the_wrapper_is_refused_and_the_original_trains_on():
    assert all("copy model.module" in m for m in run_distributed(2, copy_of_the_wrapper))
