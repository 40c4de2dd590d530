"""Triton kernels for :mod:`.scheduler` (ranking is done by ``torch.sort`` beforehand).

``_theta_kernel``: ONE program holds all ``N + 1 <= 16384`` Theta entries in registers:
a sequential float64 prefix sum of the sorted survivals (numpy's summation order, so
ties resolve bit for bit as in numpy), Theta, then either the early stop (first ``i``
with Theta_i <= Theta_{i-1}) or the first global argmax, and optionally the admission
count. Prefix sums and Theta are staged through a global scratch row (a register
vector can neither be indexed by a loop counter nor shifted by one lane).

``_admit_kernel``: multi-program; K is read from device memory, so the async path
never synchronises with the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._backend import next_pow2
from .scheduler import MAX_CANDIDATES, rank_torch


@triton.jit
def _theta_kernel(
    vals_ptr, order_ptr, sps_ptr, work_ptr, k_ptr, ell_ptr, n, N, gamma,
    EARLY_STOP: tl.constexpr, ADMIT: tl.constexpr, BLOCK: tl.constexpr,
):
    i = tl.arange(0, BLOCK)  # Theta index: i draft tokens admitted, 0..N
    live = i <= N
    csum_ptr = work_ptr  # [N + 1] prefix sums, then [N + 1] Theta
    theta_ptr = work_ptr + N + 1
    # Sequential float64 prefix sum, in numpy's order (s_j = s_{j-1} + a_j): a tree scan
    # (tl.cumsum on GPU) rounds differently and can flip an exact-tie decision. Costs
    # N dependent adds; the vector load first pulls the row into L1 for the scalar loads.
    tl.load(vals_ptr + i, mask=i < N, other=0.0)
    s = tl.zeros([1], tl.float64)
    one = tl.arange(0, 1)
    tl.store(csum_ptr + one, s)
    for j in tl.range(0, N, loop_unroll_factor=8):
        s = s + tl.load(vals_ptr + j + one)
        tl.store(csum_ptr + j + 1 + one, s)
    tl.debug_barrier()
    tau = n + tl.load(csum_ptr + i, mask=live, other=0.0)  # int n -> float64, as numpy
    theta = tau * tl.load(sps_ptr + i, mask=live, other=0.0)
    tl.store(theta_ptr + i, theta, mask=live)
    tl.debug_barrier()  # make every lane's Theta visible before reading neighbours
    if EARLY_STOP:
        prev = tl.load(theta_ptr + i - 1, mask=(i >= 1) & live, other=0.0)
        stop = (i >= 1) & live & ~(theta > prev)  # numpy: first False of rises
        k = tl.min(tl.where(stop, i - 1, N), 0)
    else:
        th = tl.where(live, theta, float("-inf"))
        k = tl.min(tl.where(live & (th == tl.max(th, 0)), i, N), 0)
    tl.store(k_ptr, k.to(tl.int64))
    if ADMIT:
        take = i < k
        f = tl.load(order_ptr + i, mask=take, other=0)
        tl.atomic_add(ell_ptr + f // gamma, tl.full([BLOCK], 1, tl.int64), mask=take)


@triton.jit
def _admit_kernel(order_ptr, k_ptr, ell_ptr, N, gamma, BLOCK: tl.constexpr):
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    take = (p < N) & (p < tl.load(k_ptr))
    f = tl.load(order_ptr + p, mask=take, other=0)
    tl.atomic_add(ell_ptr + f // gamma, tl.full([BLOCK], 1, tl.int64), mask=take)


def _warps(block: int) -> int:
    return 4 if block <= 2048 else (8 if block <= 8192 else 16)


def schedule_triton(
    survival: torch.Tensor, sps: torch.Tensor, *, early_stop: bool, admit: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (l [n] int64 -- zeros unless ``admit``, K 0-d int64)."""
    n, gamma = survival.shape
    num_cand = n * gamma
    if num_cand + 1 > MAX_CANDIDATES:
        raise ValueError(f"n*gamma+1 = {num_cand + 1} > {MAX_CANDIDATES}; use backend='torch'")
    dev = survival.device
    order, vals = rank_torch(survival)
    work = torch.empty(2 * (num_cand + 1), dtype=torch.float64, device=dev)
    k = torch.empty((), dtype=torch.int64, device=dev)
    ell = torch.zeros(n, dtype=torch.int64, device=dev)
    block = next_pow2(num_cand + 1)
    _theta_kernel[(1,)](
        vals, order, sps, work, k, ell, n, num_cand, gamma,
        EARLY_STOP=early_stop, ADMIT=admit, BLOCK=block, num_warps=_warps(block),
    )
    return ell, k


def admit_topk_triton(survival: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    n, gamma = survival.shape
    order, _ = rank_torch(survival)
    ell = torch.zeros(n, dtype=torch.int64, device=survival.device)
    block = 1024
    _admit_kernel[(triton.cdiv(order.numel(), block),)](
        order, k, ell, order.numel(), gamma, BLOCK=block
    )
    return ell
