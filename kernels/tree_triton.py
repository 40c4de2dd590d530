"""Triton kernels for varlen draft-tree verification (layout: see :mod:`.tree`).

* Row argmax: the chain kernel :func:`.verify_triton._row_argmax_kernel` as is -- the
  tree's target rows have the chain's layout (``n_r + 1`` rows per request).
* ``_tree_accept_kernel``: one program per request; its ``n_r`` nodes live in one
  ``BLOCK_N`` register vector. Every node walks up its ancestors (``max_depth - 1``
  vector gathers of a parent, a token and an argmax, all in L1/L2: ``O(n_r * depth)``
  integers), ANDing "token == argmax of the parent's row"; the deepest accepted node
  is one max + one min reduction; the path is a scalar walk back up, gathered into a register vector.
* ``_tree_mask_kernel``: one program per (request, block row): a scalar walk up the
  row's ancestors sets one column per step; writes one ``M + 1`` bool row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._backend import next_pow2
from .tree import TreeMask, TreeVerify
from .verify_triton import _block_v, _row_argmax_kernel, request_span


@triton.jit
def _tree_accept_kernel(
    tok_ptr, par_ptr, am_ptr, cu_ptr, acc_ptr, best_ptr, path_ptr, next_ptr,
    max_depth, path_width, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    r = tl.program_id(0)
    start, n = request_span(cu_ptr, r)
    row0 = start + r + 1  # row of local node 0; the root row is row0 - 1
    i = tl.arange(0, BLOCK_N)
    valid = i < n
    par = tl.load(par_ptr + start + i, mask=valid, other=-1).to(tl.int64)
    tok = tl.load(tok_ptr + start + i, mask=valid, other=-1)
    am = tl.load(am_ptr + row0 + par, mask=valid, other=-2)
    ok = valid & (tok == am)
    depth = tl.full([BLOCK_N], 1, tl.int32)
    cur = par
    for _ in range(0, max_depth - 1):
        has = valid & (cur >= 0)
        ctok = tl.load(tok_ptr + start + cur, mask=has, other=0)
        cpar = tl.load(par_ptr + start + cur, mask=has, other=-1).to(tl.int64)
        cam = tl.load(am_ptr + row0 + cpar, mask=has, other=0)
        ok = ok & ((~has) | (ctok == cam))
        depth += has.to(tl.int32)
        cur = tl.where(has, cpar, -1)
    best_depth = tl.max(tl.where(ok, depth, 0), 0)
    best = tl.min(tl.where(ok & (depth == best_depth), i, BLOCK_N), 0)
    best = tl.where(best_depth > 0, best, -1).to(tl.int64)
    tl.store(acc_ptr + r, best_depth.to(tl.int64))
    tl.store(best_ptr + r, best)
    tl.store(next_ptr + r, tl.load(am_ptr + row0 + best))
    # Path, built in registers (one vector store: no two lanes write one address).
    d = tl.arange(0, BLOCK_D)
    path = tl.full([BLOCK_D], -1, tl.int64)
    node = best
    for j in range(0, max_depth):
        col = best_depth - 1 - j
        live = (node >= 0) & (col >= 0)
        path = tl.where((d == col) & live, node, path)
        node = tl.where(live, tl.load(par_ptr + start + node, mask=live, other=-1).to(tl.int64), -1)
    tl.store(path_ptr + r * path_width + d, path, mask=d < path_width)


@triton.jit
def _tree_mask_kernel(par_ptr, cu_ptr, mask_ptr, depth_ptr, M1, max_depth,
                      BLOCK_M: tl.constexpr):
    r = tl.program_id(0)
    q = tl.program_id(1)  # block row: 0 = root, 1 + i = node i
    start, n = request_span(cu_ptr, r)
    cols = tl.arange(0, BLOCK_M)
    row = cols == q  # self; padding rows (q > n) see only themselves
    if q <= n:
        row = row | (cols == 0)
    if (q >= 1) & (q <= n):
        cur = tl.load(par_ptr + start + q - 1).to(tl.int64)
        dep = 1
        for _ in range(0, max_depth - 1):
            has = cur >= 0
            row = row | ((cols == cur + 1) & has)
            dep += has.to(tl.int32)
            cur = tl.where(has, tl.load(par_ptr + start + cur, mask=has, other=-1).to(tl.int64), -1)
        tl.store(depth_ptr + start + q - 1, dep.to(tl.int64))
    base = mask_ptr + (r * M1 + q) * M1
    tl.store(base + cols, row.to(tl.int8), mask=cols < M1)


def verify_tree_greedy_triton(
    node_tokens: torch.Tensor,
    parents: torch.Tensor,
    target: torch.Tensor,
    cu_nodes: torch.Tensor,
    max_nodes: int,
    max_depth: int,
    is_argmax: bool,
) -> TreeVerify:
    num_req = cu_nodes.numel() - 1
    num_nodes = node_tokens.numel()
    dev = node_tokens.device
    acc = torch.empty(num_req, dtype=torch.int64, device=dev)
    best = torch.empty(num_req, dtype=torch.int64, device=dev)
    nxt = torch.empty(num_req, dtype=torch.int64, device=dev)
    path = torch.empty((num_req, max(max_depth, 0)), dtype=torch.int64, device=dev)
    if is_argmax:
        am = target
    else:
        am = torch.empty(num_nodes + num_req, dtype=torch.int64, device=dev)
    if num_req == 0:
        return TreeVerify(acc, best, path, nxt, am)
    if not is_argmax:
        block_v, warps = _block_v(target.shape[1], target.element_size())
        _row_argmax_kernel[(num_req, max_nodes + 1)](
            target, target.stride(0), cu_nodes, am, target.shape[1],
            BLOCK_V=block_v, num_warps=warps,
        )
    # Never-read pointers for empty trees still need a valid allocation.
    tok = node_tokens if num_nodes else am
    par = parents if num_nodes else am
    _tree_accept_kernel[(num_req,)](
        tok, par, am, cu_nodes, acc, best, path, nxt, max(max_depth, 1), path.shape[1],
        BLOCK_N=next_pow2(max(max_nodes, 1)), BLOCK_D=next_pow2(max(max_depth, 1)),
    )
    return TreeVerify(acc, best, path, nxt, am)


def tree_attention_mask_triton(parents: torch.Tensor, cu_nodes: torch.Tensor, max_nodes: int,
                               max_depth: int) -> TreeMask:
    num_req = cu_nodes.numel() - 1
    dev = parents.device
    m1 = max_nodes + 1
    mask = torch.empty((num_req, m1, m1), dtype=torch.bool, device=dev)
    depth = torch.empty(parents.numel(), dtype=torch.int64, device=dev)
    if num_req == 0:
        return TreeMask(mask, depth)
    par = parents if parents.numel() else depth.new_zeros(1)
    _tree_mask_kernel[(num_req, m1)](
        par, cu_nodes, mask.view(torch.int8), depth, m1, max(max_depth, 1),
        BLOCK_M=next_pow2(m1),
    )
    return TreeMask(mask, depth)
