"""What the kernel tests run on, decided once (imported by tests/kernels/test_kernels_*.py).

Skips the importing test module where torch is absent. Without CUDA, Triton runs in its
CPU interpreter: ``TRITON_INTERPRET=1`` must be set before the first Triton kernel is
defined in the process (tests/conftest.py sets it too, for machines without a driver).
"""

import importlib.util
import os

import pytest

torch = pytest.importorskip("torch")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_TRITON = importlib.util.find_spec("triton") is not None
DEV = "cuda" if CUDA else "cpu"
TRITON_OK = HAS_TRITON and (CUDA or os.environ.get("TRITON_INTERPRET") == "1")
needs_triton = pytest.mark.skipif(not TRITON_OK,
                                  reason="needs triton on CUDA or TRITON_INTERPRET=1")
