"""Greedy verification of draft *trees* (varlen, one tree per request): wrappers and
plain-torch references.

Layout (the chain layout of :mod:`.verify`, generalised to trees):

* ``cu_nodes`` [R+1] int: request ``r`` owns tree nodes ``cu_nodes[r] : cu_nodes[r+1]``
  (``n_r`` nodes, any ``n_r >= 0``).
* ``node_tokens`` [N] int64: the drafted token of every node.
* ``parents`` [N] int: the parent of each node as a *request-local* node index, ``-1``
  for a child of the root. Nodes are in topological order: ``-1 <= parents[i] < i``
  (local), so an ancestor always comes before its descendants.
* ``target_logits`` [N + R, V] (float, any dtype) or ``target_argmax`` [N + R] (int):
  request ``r`` owns rows ``cu[r] + r : cu[r+1] + r + 1`` -- one target forward over
  ``[root, node_0 .. node_{n-1}]`` under the tree attention mask
  (:func:`tree_attention_mask`). Row ``cu[r] + r`` is the root (the last committed
  token, it predicts the depth-1 nodes); row ``cu[r] + r + 1 + i`` is node ``i``'s
  (it predicts node ``i``'s children, or the bonus token after it).

The wrappers take these as one :class:`~dspark_sim.kernels.layout.DraftTree`
(``DraftTree.build(parents, cu_nodes)``), checked once and shared by the mask and the
verification of the same trees.

A chain is the tree ``parents = [-1, 0, 1, ...]``; its rows are then exactly the chain
layout (row ``cu[r] + r + k`` judges draft token ``k``), and :func:`verify_tree_greedy`
returns what :func:`~dspark_sim.kernels.verify_greedy` returns.

Greedy acceptance: node ``i`` is *accepted* iff its token equals the target argmax of
its parent's row and its parent is accepted (the root always is). The result is the
deepest accepted node -- the longest accepted root-to-leaf path; ties at equal depth
(possible only when siblings repeat a token) go to the lowest node index. The bonus
token is the argmax of that node's row (the root row when nothing is accepted).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._backend import resolve_backend, same_device
from .layout import DraftTree
from .layout import request_ids as _request_ids


class TreeVerify(NamedTuple):
    accepted_len: torch.Tensor  # [R] int64: depth of the deepest accepted node (0: none)
    best_node: torch.Tensor  # [R] int64: request-local index of that node, -1 if none
    path: torch.Tensor  # [R, D] int64: request-local node indices root->leaf, -1 padded
    next_token: torch.Tensor  # [R] int64: bonus = target argmax of the best node's row
    target_argmax: torch.Tensor  # [N + R] int64: argmax of every target row


class TreeMask(NamedTuple):
    mask: torch.Tensor  # [R, M + 1, M + 1] bool: row q may attend to column k
    depth: torch.Tensor  # [N] int64: node depth (root = 0, its children = 1): position offset


# ---------------------------------------------------------------------------------------
# Input checks (the tree itself is checked once, by DraftTree.build).


def _argmax_rows(target: torch.Tensor, rows: int) -> torch.Tensor | None:
    """The [N + R] argmax if ``target`` already holds argmax ids, else None (logits)."""
    if target.dim() == 1:
        if target.numel() != rows or target.is_floating_point():
            raise ValueError(f"target_argmax must be [{rows}] int, got {tuple(target.shape)} "
                             f"{target.dtype}")
        return target.to(torch.int64)
    if target.dim() != 2 or target.shape[0] != rows or not target.is_floating_point():
        raise ValueError(f"target_logits must be [{rows}, V] float, got {tuple(target.shape)}")
    if target.shape[1] > 1 and target.stride(1) != 1:
        raise ValueError("target_logits must be contiguous along V")
    return None


# ---------------------------------------------------------------------------------------
# Torch references.


def _walk_ancestors(parents: torch.Tensor, cu_nodes: torch.Tensor, match: torch.Tensor,
                    steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pointer doubling: (all ancestors-or-self matched, depth) per node, ceil(log2) rounds.

    ``anc`` is each node's 2^k-th ancestor (global index, -1 past the root); ``ok`` the
    AND of ``match`` over the node and its 2^k - 1 nearest ancestors; ``depth`` how many
    nodes that segment holds. Every tensor is [N]; no host sync."""
    num_nodes = parents.numel()
    req, _ = _request_ids(cu_nodes, num_nodes)
    start = cu_nodes.to(torch.int64)[req]
    par = parents.to(torch.int64)
    anc = torch.where(par >= 0, start + par, -1)
    ok = match.clone()
    depth = torch.ones(num_nodes, dtype=torch.int64, device=par.device)
    span = 1
    while span < max(steps, 1):
        has = anc >= 0
        a = anc.clamp(min=0)
        ok = ok & (~has | ok[a])
        depth = depth + torch.where(has, depth[a], 0)
        anc = torch.where(has, anc[a], -1)
        span *= 2
    return ok, depth


def verify_tree_greedy_torch(
    node_tokens: torch.Tensor,
    parents: torch.Tensor,
    target_argmax: torch.Tensor,
    cu_nodes: torch.Tensor,
    max_nodes: int,
    max_depth: int,
) -> TreeVerify:
    """Reference: ``ceil(log2 D)`` pointer-doubling rounds over [N] tensors, one
    scatter-max per request for the deepest accepted node, ``D`` steps up the path."""
    cu = cu_nodes.to(torch.int64)
    num_nodes, num_req = node_tokens.numel(), cu.numel() - 1
    dev = node_tokens.device
    req, local = _request_ids(cu, num_nodes)
    par = parents.to(torch.int64)
    root_row = cu[:-1] + torch.arange(num_req, device=dev)  # [R]
    judge = target_argmax[root_row[req] + 1 + par]  # parent's row (root row for -1)
    ok, depth = _walk_ancestors(par, cu, node_tokens == judge, max_depth)
    # Deepest accepted node, lowest local index on ties: one key, one amax per request.
    big = max_nodes + 1
    key = torch.where(ok, depth * big + (big - 1 - local), -1)
    best_key = torch.full((num_req,), -1, dtype=torch.int64, device=dev)
    best_key.scatter_reduce_(0, req, key, reduce="amax", include_self=True)
    found = best_key >= 0
    acc = torch.where(found, best_key // big, 0)
    best = torch.where(found, big - 1 - best_key % big, -1)
    path = torch.full((num_req, max(max_depth, 0)), -1, dtype=torch.int64, device=dev)
    cur = best.clone()
    cols = torch.arange(num_req, device=dev)
    for j in range(max_depth):  # fill the path leaf -> root
        col = acc - 1 - j
        live = (cur >= 0) & (col >= 0)
        path[cols[live], col[live]] = cur[live]
        nxt = par[(cu[:-1] + cur).clamp(min=0, max=max(num_nodes - 1, 0))] if num_nodes else cur
        cur = torch.where(live, nxt, -1)
    nxt_tok = target_argmax[root_row + 1 + best]
    return TreeVerify(acc, best, path, nxt_tok, target_argmax)


def tree_attention_mask_torch(parents: torch.Tensor, cu_nodes: torch.Tensor, max_nodes: int,
                              max_depth: int) -> TreeMask:
    """Reference: every node walks ``max_depth`` steps up its ancestors, scattering one
    column per step into its row ([N] index ops per step)."""
    cu = cu_nodes.to(torch.int64)
    num_nodes, num_req = parents.numel(), cu.numel() - 1
    dev = parents.device
    m1 = max_nodes + 1
    mask = torch.zeros((num_req, m1, m1), dtype=torch.bool, device=dev)
    idx = torch.arange(m1, device=dev)
    mask[:, idx, idx] = True  # self (and padding rows: self only, never an all-False row)
    lengths = cu[1:] - cu[:-1]
    mask[:, :, 0] |= (idx[None, :] <= lengths[:, None])  # every live row sees the root
    req, local = _request_ids(cu, num_nodes)
    par = parents.to(torch.int64)
    cur = par.clone()
    depth = torch.ones(num_nodes, dtype=torch.int64, device=dev)
    for _ in range(max(max_depth - 1, 0)):
        has = cur >= 0
        mask[req[has], local[has] + 1, cur[has] + 1] = True
        depth = depth + has
        cur = torch.where(has, par[(cu[req] + cur).clamp(min=0)], -1)
    return TreeMask(mask, depth)


# ---------------------------------------------------------------------------------------
# Wrappers.


def verify_tree_greedy(node_tokens: torch.Tensor, target: torch.Tensor, tree: DraftTree, *,
                       backend: str = "auto") -> TreeVerify:
    """Greedy verification of varlen draft trees: longest accepted path + bonus token.

    ``target``: target logits/probabilities [N + R, V] (only the argmax is used; Triton
    streams each row once, like :func:`~dspark_sim.kernels.verify_greedy`) or the argmax
    ids [N + R]. ``tree`` (:class:`~dspark_sim.kernels.layout.DraftTree`) carries the
    parents, the node blocks and ``max_depth``, the width of ``path``."""
    if node_tokens.dim() != 1 or node_tokens.is_floating_point() or node_tokens.is_complex():
        raise ValueError(f"node_tokens must be 1-D integer ids [N], got "
                         f"{tuple(node_tokens.shape)} {node_tokens.dtype}")
    blocks, parents = tree.blocks, tree.parents
    blocks.expect_tokens(node_tokens.numel(), "node_tokens")
    am = _argmax_rows(target, blocks.num_target_rows)
    same_device(node_tokens, parents, target, blocks.cu_seqlens)
    if resolve_backend(backend, target) == "torch":
        if am is None:
            am = target.argmax(dim=-1)  # first maximum on ties, like the kernel
        return verify_tree_greedy_torch(node_tokens, parents, am, blocks.cu_seqlens,
                                        blocks.max_seqlen, tree.max_depth)
    from . import tree_triton

    return tree_triton.verify_tree_greedy_triton(
        node_tokens.contiguous(), parents.contiguous(), target if am is None else am,
        blocks.cu_seqlens.contiguous(), blocks.max_seqlen, tree.max_depth, am is not None,
    )


def tree_attention_mask(tree: DraftTree, *, backend: str = "auto") -> TreeMask:
    """Ancestor mask of each request's ``[root, node_0 .. node_{n-1}]`` block.

    ``mask[r, q, k]`` (q, k = 0 for the root, ``1 + i`` for node ``i``): row ``q`` may
    attend to column ``k`` -- the root and every ancestor-or-self of the node. Rows and
    columns past ``n_r`` are padding: they see only themselves (never an all-False row,
    which would make softmax NaN). ``depth`` [N] is each node's depth (its RoPE position
    offset after the root). The committed context before the root is visible to every
    row and is not part of this mask. Build ``tree`` once and pass the same object to
    :func:`verify_tree_greedy`: it is checked once."""
    cu, width = tree.blocks.cu_seqlens, tree.blocks.max_seqlen
    if resolve_backend(backend, tree.parents) == "torch":
        return tree_attention_mask_torch(tree.parents, cu, width, tree.max_depth)
    from . import tree_triton

    return tree_triton.tree_attention_mask_triton(tree.parents.contiguous(), cu.contiguous(),
                                                  width, tree.max_depth)


def chain_parents(lengths: list[int] | torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """``parents`` of chains with the given lengths (``[-1, 0, 1, ...]`` per request)."""
    lens = torch.as_tensor(lengths, dtype=torch.int64).cpu()
    if lens.numel() == 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    req, local = _request_ids(cu, int(cu[-1]))
    return (local - 1).to(device)


__all__ = [
    "DraftTree",
    "TreeMask",
    "TreeVerify",
    "chain_parents",
    "tree_attention_mask",
    "tree_attention_mask_torch",
    "verify_tree_greedy",
    "verify_tree_greedy_torch",
]
