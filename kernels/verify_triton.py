"""Triton kernels for varlen verification (layout: see :mod:`.verify`).

Every kernel streams the vocabulary in ``BLOCK_V`` chunks with per-lane running
accumulators (max/argmax, sums) reduced once at the end, so no full-vocab copy
(softmax, residual) is ever written: traffic is the input rows plus ``O(T + R)`` words.

Grids: row kernels run one program per (request, position) -- ``(R, max_seqlen + 1)``,
programs past a request's ``l_r + 1`` rows exit at once; the per-request kernels run
one program per request and touch ``l_r`` integers plus at most two rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._backend import interpreter_on, next_pow2
from .verify import GreedyVerify, StochasticVerify, Uniforms


def _block_v(vocab: int, elem_bytes: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps). On GPU: 8 warps, 16 bytes per lane-load and 2 loads per thread
    per row per iteration -- 16 KB (fp32) / 8 KB (bf16) in flight per program, enough
    for ~8 resident programs per SM to cover HBM latency. Not yet tuned on hardware.
    The interpreter prefers fewer, larger numpy blocks."""
    if interpreter_on():
        return min(next_pow2(vocab), 8192), 4
    return min(next_pow2(vocab), 4096 if elem_bytes <= 2 else 2048), 8


@triton.jit
def request_span(cu_ptr, r):
    """Request ``r``'s draft rows in the varlen layout: its first row and its length
    (``cu[r]``, ``cu[r + 1] - cu[r]``; int64, so row offsets times a stride never wrap)."""
    start = tl.load(cu_ptr + r).to(tl.int64)
    return start, tl.load(cu_ptr + r + 1).to(tl.int64) - start


# ---------------------------------------------------------------------------------------
# Greedy.


@triton.jit
def _row_argmax_kernel(
    logits_ptr, stride_row, cu_ptr, out_ptr, V, BLOCK_V: tl.constexpr
):
    r = tl.program_id(0)
    k = tl.program_id(1)
    start, n = request_span(cu_ptr, r)
    if k <= n:
        row = start + r + k
        base = logits_ptr + row * stride_row
        offs = tl.arange(0, BLOCK_V)
        best = tl.full([BLOCK_V], float("-inf"), tl.float32)
        best_idx = tl.zeros([BLOCK_V], tl.int32)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + offs
            x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            upd = x > best  # strict: each lane keeps its first maximum
            best = tl.where(upd, x, best)
            best_idx = tl.where(upd, cols, best_idx)
        m = tl.max(best, 0)
        idx = tl.min(tl.where(best == m, best_idx, V), 0)  # first global maximum
        idx = tl.where(idx == V, 0, idx)  # all -inf/NaN row: index 0 like torch
        tl.store(out_ptr + row, idx.to(tl.int64))


@triton.jit
def _greedy_accept_kernel(
    draft_ptr, argmax_ptr, cu_ptr, acc_ptr, next_ptr, BLOCK_G: tl.constexpr
):
    r = tl.program_id(0)
    start, n = request_span(cu_ptr, r)
    k = tl.arange(0, BLOCK_G)
    valid = k < n
    d = tl.load(draft_ptr + start + k, mask=valid, other=0)
    a = tl.load(argmax_ptr + start + r + k, mask=valid, other=0)
    acc = tl.min(tl.where(valid & (d != a), k, n), 0)
    tl.store(acc_ptr + r, acc)
    tl.store(next_ptr + r, tl.load(argmax_ptr + start + r + acc))


def verify_greedy_triton(
    draft_tokens: torch.Tensor, target_logits: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int
) -> GreedyVerify:
    num_req = cu_seqlens.numel() - 1
    rows, vocab = target_logits.shape
    dev = target_logits.device
    am = torch.empty(rows, dtype=torch.int64, device=dev)
    acc = torch.empty(num_req, dtype=torch.int64, device=dev)
    nxt = torch.empty(num_req, dtype=torch.int64, device=dev)
    if num_req == 0:
        return GreedyVerify(acc, nxt, am)
    block_v, warps = _block_v(vocab, target_logits.element_size())
    _row_argmax_kernel[(num_req, max_seqlen + 1)](
        target_logits, target_logits.stride(0), cu_seqlens, am, vocab,
        BLOCK_V=block_v, num_warps=warps,
    )
    _greedy_accept_kernel[(num_req,)](
        draft_tokens, am, cu_seqlens, acc, nxt, BLOCK_G=next_pow2(max_seqlen)
    )
    return GreedyVerify(acc, nxt, am)


# ---------------------------------------------------------------------------------------
# Stochastic: pass 1 (per row) and pass 2 (per request).


@triton.jit
def _stoch_rows_kernel(
    tok_ptr, pd_ptr, stride_pd, pt_ptr, stride_pt, cu_ptr, u_ptr,
    tv_ptr, mass_ptr, ok_ptr, V,
    WITH_ACCEPT: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Draft rows: TV, residual mass sum(max(0, p_t - p_d)) (fp64), accept flag.
    Bonus rows (WITH_ACCEPT only): mass sum(max(0, p_t)) for the bonus sample."""
    r = tl.program_id(0)
    k = tl.program_id(1)
    start, n = request_span(cu_ptr, r)
    offs = tl.arange(0, BLOCK_V)
    if k < n:
        i = start + k
        row_t = i + r
        pd_base = pd_ptr + i * stride_pd
        pt_base = pt_ptr + row_t * stride_pt
        abs_sum = tl.zeros([BLOCK_V], tl.float32)
        res_sum = tl.zeros([BLOCK_V], tl.float64)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + offs
            m = cols < V
            pd = tl.load(pd_base + cols, mask=m, other=0.0).to(tl.float32)
            pt = tl.load(pt_base + cols, mask=m, other=0.0).to(tl.float32)
            diff = pt - pd
            abs_sum += tl.abs(diff)
            res_sum += tl.maximum(diff, 0.0).to(tl.float64)
        tl.store(tv_ptr + i, 1.0 - 0.5 * tl.sum(abs_sum, 0))
        if WITH_ACCEPT:
            tl.store(mass_ptr + row_t, tl.sum(res_sum, 0))
            x = tl.load(tok_ptr + i)
            # A token outside the vocabulary has p_t(x) = 0: rejected, never loaded (an
            # unmasked load there read past the row: garbage, or an illegal address).
            x_ok = (x >= 0) & (x < V)
            px_d = tl.load(pd_base + x, mask=x_ok, other=0.0).to(tl.float32)
            px_t = tl.load(pt_base + x, mask=x_ok, other=0.0).to(tl.float32)
            u = tl.load(u_ptr + i)
            tl.store(ok_ptr + i, (x_ok & (u * px_d < px_t)).to(tl.int8))
    elif WITH_ACCEPT:
        if k == n:
            row_t = start + n + r
            pt_base = pt_ptr + row_t * stride_pt
            mass = tl.zeros([BLOCK_V], tl.float64)
            for v0 in range(0, V, BLOCK_V):
                cols = v0 + offs
                pt = tl.load(pt_base + cols, mask=cols < V, other=0.0).to(tl.float32)
                mass += tl.maximum(pt, 0.0).to(tl.float64)
            tl.store(mass_ptr + row_t, tl.sum(mass, 0))


@triton.jit
def _stoch_sample_kernel(
    pd_ptr, stride_pd, pt_ptr, stride_pt, cu_ptr, ok_ptr, mass_ptr, u_ptr,
    acc_ptr, next_ptr, V, BLOCK_G: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Accepted length = first rejection; then one inverse-CDF scan of the stop row:
    residual max(0, p_t - p_d) after a rejection, p_t itself at the bonus row."""
    r = tl.program_id(0)
    start, n = request_span(cu_ptr, r)
    k = tl.arange(0, BLOCK_G)
    valid = k < n
    ok = tl.load(ok_ptr + start + k, mask=valid, other=1)
    acc = tl.min(tl.where(valid & (ok == 0), k, n), 0)
    rejected = acc < n
    row_t = start + r + acc
    pt_base = pt_ptr + row_t * stride_pt
    pd_base = pd_ptr + (start + acc) * stride_pd
    target = tl.load(u_ptr + r) * tl.load(mass_ptr + row_t)
    pd_len = tl.where(rejected, V, 0)  # bonus row: no draft row to subtract

    offs = tl.arange(0, BLOCK_V)
    carry = tl.zeros([1], tl.float64)
    first = tl.full([BLOCK_V], V, tl.int32)
    last = tl.full([BLOCK_V], -1, tl.int32)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK_V], tl.int32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs
        m = cols < V
        pt = tl.load(pt_base + cols, mask=m, other=0.0).to(tl.float32)
        pd = tl.load(pd_base + cols, mask=cols < pd_len, other=0.0).to(tl.float32)
        res = tl.maximum(pt - pd, 0.0)
        cum = tl.cumsum(res.to(tl.float64), 0) + carry
        first = tl.minimum(first, tl.where((cum > target) & m, cols, V))
        last = tl.maximum(last, tl.where((res > 0.0) & m, cols, -1))
        pt_m = tl.where(m, pt, float("-inf"))
        upd = pt_m > best
        best = tl.where(upd, pt_m, best)
        best_idx = tl.where(upd, cols, best_idx)
        carry = tl.max(cum, 0) + tl.zeros([1], tl.float64)  # res >= 0: last lane is the max
    tok = tl.min(first, 0)
    lst = tl.max(last, 0)
    bm = tl.max(best, 0)
    arg = tl.min(tl.where(best == bm, best_idx, V), 0)
    # Degenerate guards (zero residual mass only arises from rounding).
    tok = tl.where(tok < V, tok, tl.where(lst >= 0, lst, arg))
    tl.store(acc_ptr + r, acc)
    tl.store(next_ptr + r, tok.to(tl.int64))


def verify_stochastic_triton(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    cu_seqlens: torch.Tensor,
    uniforms: Uniforms,
    max_seqlen: int,
) -> StochasticVerify:
    num_req = cu_seqlens.numel() - 1
    num_draft, vocab = draft_probs.shape
    dev = target_probs.device
    tv = torch.empty(num_draft, dtype=torch.float32, device=dev)
    mass = torch.empty(num_draft + num_req, dtype=torch.float64, device=dev)
    ok = torch.empty(max(num_draft, 1), dtype=torch.int8, device=dev)
    acc = torch.empty(num_req, dtype=torch.int64, device=dev)
    nxt = torch.empty(num_req, dtype=torch.int64, device=dev)
    if num_req == 0:
        return StochasticVerify(acc, nxt, tv)
    block_v, warps = _block_v(vocab, target_probs.element_size())
    # An empty draft_probs still needs a valid pointer for the (never taken) pd loads.
    pd = draft_probs if num_draft > 0 else target_probs
    _stoch_rows_kernel[(num_req, max_seqlen + 1)](
        draft_tokens, pd, pd.stride(0), target_probs, target_probs.stride(0), cu_seqlens,
        uniforms.accept, tv, mass, ok, vocab,
        WITH_ACCEPT=True, BLOCK_V=block_v, num_warps=warps,
    )
    _stoch_sample_kernel[(num_req,)](
        pd, pd.stride(0), target_probs, target_probs.stride(0), cu_seqlens, ok, mass,
        uniforms.sample, acc, nxt, vocab,
        BLOCK_G=next_pow2(max_seqlen), BLOCK_V=block_v, num_warps=warps,
    )
    return StochasticVerify(acc, nxt, tv)


def tv_acceptance_triton(
    draft_probs: torch.Tensor, target_probs: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int
) -> torch.Tensor:
    num_req = cu_seqlens.numel() - 1
    num_draft, vocab = draft_probs.shape
    dev = target_probs.device
    tv = torch.empty(num_draft, dtype=torch.float32, device=dev)
    if num_req == 0 or num_draft == 0:
        return tv
    block_v, warps = _block_v(vocab, target_probs.element_size())
    # Pointers the WITH_ACCEPT=False specialisation never touches.
    dummy = torch.empty(1, dtype=torch.int64, device=dev)
    _stoch_rows_kernel[(num_req, max(max_seqlen, 1))](
        dummy, draft_probs, draft_probs.stride(0), target_probs, target_probs.stride(0),
        cu_seqlens, dummy, tv, dummy, dummy, vocab,
        WITH_ACCEPT=False, BLOCK_V=block_v, num_warps=warps,
    )
    return tv
