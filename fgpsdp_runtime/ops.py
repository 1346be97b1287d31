"""Kernel entry points: the compiled extension when it can run, else pure torch.

Every kernel has a pure-torch reference here with the same signature; the
tests hold the compiled kernels to it and to float64. When the extension
cannot be loaded (or was built without CUDA and a CUDA tensor comes in), the
reference runs instead and one warning says so.
"""
from __future__ import annotations

import functools
import importlib.machinery
import os
import warnings
from typing import Optional, Sequence

import torch

try:
    from . import _C  # type: ignore[attr-defined]
    _LOAD_ERROR: Optional[BaseException] = None
except ImportError as error:  # pragma: no cover - depends on the build
    _C = None
    _LOAD_ERROR = error

_warned: set[str] = set()


def extension_available() -> bool:
    return _C is not None


@functools.lru_cache(maxsize=None)  # asked at every kernel call of the fallback
def _why_not_loaded() -> str:
    # With no file this Python can import (none built, or one built for another
    # Python), its message ("cannot import name '_C' from partially initialized
    # module ... circular import") points elsewhere.
    here = os.path.dirname(os.path.abspath(__file__))
    if not any(os.path.exists(os.path.join(here, "_C" + suffix))
               for suffix in importlib.machinery.EXTENSION_SUFFIXES):
        return ("fgpsdp_runtime._C is not built for this Python (run `make setup`, or "
                "`pip install --no-build-isolation -e .` in the checkout)")
    return f"fgpsdp_runtime._C could not be loaded ({_LOAD_ERROR})"


def cuda_kernels_available() -> bool:
    return _C is not None and bool(_C.has_cuda_kernels())


def _compiled_for(device: torch.device):
    """The extension if it has kernels for ``device``, else None (warning once)."""
    if device.type == "cpu" and _C is not None:
        return _C
    if device.type == "cuda" and cuda_kernels_available():
        return _C
    reason = (_why_not_loaded() if _C is None
              else f"fgpsdp_runtime._C has no kernels for {device.type}")
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"{reason}; using the slower pure-torch kernels", RuntimeWarning,
                      stacklevel=3)
    return None


# -- references ------------------------------------------------------------------

def reference_multi_tensor_pack(tensors: Sequence[torch.Tensor], flat: torch.Tensor,
                                offsets: Sequence[int], scale: float) -> None:
    """``flat[offsets[i]:offsets[i] + n_i] = cast(tensors[i] * scale)``."""
    for t, off in zip(tensors, offsets):
        compute = torch.float64 if torch.float64 in (t.dtype, flat.dtype) else torch.float32
        # Not in place: .to() returns the tensor itself when the dtype matches.
        flat[off:off + t.numel()].copy_(t.reshape(-1).to(compute) * scale)


def reference_multi_tensor_unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor],
                                  offsets: Sequence[int], scale: float) -> None:
    """``tensors[i] = cast(flat[offsets[i]:offsets[i] + n_i] * scale)``."""
    for t, off in zip(tensors, offsets):
        compute = torch.float64 if torch.float64 in (t.dtype, flat.dtype) else torch.float32
        t.copy_((flat[off:off + t.numel()].to(compute) * scale).view_as(t))


def reference_multi_tensor_sq_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """float64 ``[sum of squares, non-finite flag]`` of all elements of ``tensors``."""
    device = tensors[0].device if tensors else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for t in tensors:
        if t.numel():
            total = total + t.detach().double().square().sum()
    flag = (~torch.isfinite(total)).to(torch.float64)
    return torch.stack([total, flag])


# -- dispatch -----------------------------------------------------------------------

def multi_tensor_pack(tensors: Sequence[torch.Tensor], flat: torch.Tensor,
                      offsets: Sequence[int], scale: float = 1.0) -> None:
    """Copy many tensors into one flat buffer with a scale and a cast, in one pass."""
    ext = _compiled_for(flat.device)
    if ext is None:
        return reference_multi_tensor_pack(tensors, flat, offsets, scale)
    ext.multi_tensor_pack(list(tensors), flat, [int(o) for o in offsets], float(scale))


def multi_tensor_unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor],
                        offsets: Sequence[int], scale: float = 1.0) -> None:
    """Scatter a flat buffer back into many tensors with a scale and a cast."""
    ext = _compiled_for(flat.device)
    if ext is None:
        return reference_multi_tensor_unpack(flat, tensors, offsets, scale)
    ext.multi_tensor_unpack(flat, list(tensors), [int(o) for o in offsets], float(scale))


def multi_tensor_sq_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """float64 ``[sum of squares, non-finite flag]``, without a host sync on GPU."""
    tensors = list(tensors)
    ext = _compiled_for(tensors[0].device if tensors else torch.device("cpu"))
    if ext is None:
        return reference_multi_tensor_sq_norm(tensors)
    return ext.multi_tensor_sq_norm(tensors)
