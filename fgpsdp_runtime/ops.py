"""Kernel entry points: the compiled extension when present, else torch.

Every kernel has a pure-torch reference here with the same signature; the
tests hold the compiled kernels to it and to float64. When the extension
cannot be loaded, the reference runs instead and one warning says so.
"""
from __future__ import annotations

import warnings
from typing import Optional, Sequence

import torch

try:
    from . import _C  # type: ignore[attr-defined]
    _LOAD_ERROR: Optional[BaseException] = None
except ImportError as error:  # pragma: no cover - depends on the build
    _C = None
    _LOAD_ERROR = error

_warned = False


def extension_available() -> bool:
    return _C is not None


def _extension():
    global _warned
    if _C is None and not _warned:
        warnings.warn(f"fgpsdp_runtime._C could not be loaded ({_LOAD_ERROR}); "
                      "using the slower pure-torch kernels", RuntimeWarning, stacklevel=3)
        _warned = True
    return _C


def reference_multi_tensor_sq_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """float64 ``[sum of squares, non-finite flag]`` of all elements of ``tensors``."""
    device = tensors[0].device if tensors else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for t in tensors:
        if t.numel():
            total = total + t.detach().double().square().sum()
    flag = (~torch.isfinite(total)).to(torch.float64)
    return torch.stack([total, flag])


def multi_tensor_sq_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """float64 ``[sum of squares, non-finite flag]``, without a host sync on GPU."""
    ext = _extension()
    tensors = list(tensors)
    if ext is not None and (not tensors or tensors[0].device.type == "cpu"):
        return ext.multi_tensor_sq_norm(tensors)
    return reference_multi_tensor_sq_norm(tensors)
