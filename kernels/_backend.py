"""Backend choice shared by every kernel wrapper.

``backend="auto"`` runs Triton when the tensors live on CUDA, or when the
Triton interpreter is switched on (``TRITON_INTERPRET=1``, CPU only, ~100x
slower: for tests); everything else runs the plain-torch reference. Triton is
imported lazily so ``import dspark_sim.kernels`` works without it.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

BACKENDS = ("auto", "triton", "torch")


@functools.cache  # find_spec walks sys.path: ~50 us, too slow for every kernel call
def triton_importable() -> bool:
    """True when the ``triton`` package can be found (not imported here)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # broken install / stubbed module
        return False


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_backend(backend: str, *tensors: torch.Tensor) -> str:
    """Return ``"triton"`` or ``"torch"`` for these tensors; raise on an impossible request."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    on_cuda = any(t.is_cuda for t in tensors)
    can_triton = (on_cuda or interpreter_on()) and triton_importable()
    if backend == "auto":
        return "triton" if can_triton else "torch"
    if backend == "triton" and not can_triton:
        why = "triton is not installed" if not triton_importable() else (
            "tensors are on CPU and TRITON_INTERPRET is not set"
        )
        raise RuntimeError(f"backend='triton' unavailable: {why}")
    return backend


def same_device(*tensors: torch.Tensor) -> torch.device:
    """The one device all tensors share (raises otherwise)."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"tensors on different devices: {sorted(map(str, devices))}")
    return devices.pop()


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()
