"""The varlen layouts every kernel wrapper reads, checked once when they are built.

A decode step lays its draft blocks out once and then runs several kernels over the same
layout: survival, verification, TV acceptance (chains), or the attention mask and the
verification of the same trees. Checking a layout needs its offsets on the host, one
device->host sync; building it once per step pays that once, and each kernel then reads
``max_seqlen`` from the host int instead of syncing again (flash-attn's varlen contract).

* :class:`Blocks` -- ``cu_seqlens`` [R+1] with its host-side facts (``max_seqlen``,
  ``num_tokens``). Request ``r`` owns tokens ``cu_seqlens[r] : cu_seqlens[r+1]``.
* :class:`DraftTree` -- a :class:`Blocks` of tree nodes plus each node's request-local
  parent, checked for topological order (``-1 <= parent < local index``).

Every wrapper also takes a bare ``cu_seqlens`` tensor and builds the layout itself: the
convenient form, one sync per call. A malformed layout is refused here; before these
objects the Triton kernels read past their buffers when ``cu_seqlens`` did not end at
the token count (garbage accepted lengths on CPU, an illegal address on CUDA).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_INT_DTYPES = (torch.int32, torch.int64)


def _host_offsets(cu_seqlens: torch.Tensor) -> list[int]:
    """The offsets as host ints (the one sync), after the checks that need no data."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D [R+1], got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in _INT_DTYPES:
        raise TypeError(f"cu_seqlens must be int32/int64, got {cu_seqlens.dtype}")
    return cu_seqlens.tolist()


@dataclass(frozen=True, eq=False)  # identity equality: == on tensor fields is ambiguous
class Blocks:
    """Varlen blocks: ``cu_seqlens`` [R+1] (on the kernels' device) and its host facts.

    Build with :meth:`from_lengths` (host lengths: no sync, one small host->device copy)
    or :meth:`from_cu_seqlens` (one sync). ``max_seqlen`` may exceed the longest block
    (a fixed launch width, e.g. for CUDA graphs) but never fall short of it."""

    cu_seqlens: torch.Tensor
    max_seqlen: int
    num_tokens: int

    @property
    def num_requests(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def num_target_rows(self) -> int:
        """``T + R``: a target row per token plus each request's bonus row."""
        return self.num_tokens + self.num_requests

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, max_seqlen: int | None = None) -> Blocks:
        return cls._checked(cu_seqlens, _host_offsets(cu_seqlens), max_seqlen)

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], device: torch.device | str = "cpu",
                     max_seqlen: int | None = None) -> Blocks:
        lens = [operator.index(n) for n in lengths]  # 2.5 is refused, not cut to 2
        if any(n < 0 for n in lens):
            raise ValueError(f"block lengths must be >= 0, got {min(lens)}")
        offsets = [0]
        for n in lens:
            offsets.append(offsets[-1] + n)
        cu = torch.tensor(offsets, dtype=torch.int64, device=device)
        return cls._checked(cu, offsets, max_seqlen)

    @classmethod
    def _checked(cls, cu: torch.Tensor, offsets: list[int], max_seqlen: int | None) -> Blocks:
        if offsets[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0, got {offsets[0]}")
        lens = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
        if lens and min(lens) < 0:
            r = lens.index(min(lens))
            raise ValueError(f"cu_seqlens must be non-decreasing; it falls at request {r}")
        longest = max(lens, default=0)
        if max_seqlen is None:
            max_seqlen = longest
        elif isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
            raise TypeError(f"max_seqlen must be an int, got {max_seqlen!r}")
        elif max_seqlen < longest:  # a narrower launch would skip tokens silently
            raise ValueError(f"max_seqlen={max_seqlen} is below the longest block ({longest})")
        return cls(cu, max_seqlen, offsets[-1])

    def expect_tokens(self, num_tokens: int, what: str) -> None:
        """Refuse a token tensor whose length is not the layout's (host ints: no sync)."""
        if num_tokens != self.num_tokens:
            raise ValueError(f"{what} has {num_tokens} entries but cu_seqlens ends at "
                             f"{self.num_tokens}")


def as_blocks(layout: Blocks | torch.Tensor) -> Blocks:
    """A :class:`Blocks` as given, or one built (and checked) from a bare ``cu_seqlens``."""
    return layout if isinstance(layout, Blocks) else Blocks.from_cu_seqlens(layout)


@dataclass(frozen=True, eq=False)
class DraftTree:
    """Varlen draft trees: node blocks, each node's request-local parent, the depth bound.

    ``parents`` [N] int: ``-1`` for a child of the root, else an earlier node of the same
    request. ``max_depth`` bounds the deepest path (the width of ``TreeVerify.path`` and
    the ancestor walk's length); it defaults to the largest tree, always safe. A smaller
    one must still reach the deepest node: :meth:`build` checks that when it validates
    (unchecked, a shallower walk mis-judges the deep nodes)."""

    parents: torch.Tensor
    blocks: Blocks
    max_depth: int

    @classmethod
    def build(cls, parents: torch.Tensor, cu_nodes: Blocks | torch.Tensor, *,
              max_depth: int | None = None, validate: bool = True) -> DraftTree:
        """Check shapes and, with ``validate`` (one more sync), the topological order."""
        blocks = as_blocks(cu_nodes)
        if not isinstance(parents, torch.Tensor) or parents.dim() != 1:
            raise ValueError("parents must be a 1-D tensor [N]")
        if parents.dtype not in _INT_DTYPES:
            raise TypeError(f"parents must be int32/int64, got {parents.dtype}")
        blocks.expect_tokens(parents.numel(), "parents")
        if parents.device != blocks.cu_seqlens.device:
            raise ValueError(f"parents on {parents.device}, cu_nodes on "
                             f"{blocks.cu_seqlens.device}")
        deepest = _check_topological(parents, blocks) if validate and parents.numel() else 0
        if max_depth is None:
            return cls(parents, blocks, blocks.max_seqlen)  # always safe: depth <= n_r
        if isinstance(max_depth, bool) or not isinstance(max_depth, int):
            raise TypeError(f"max_depth must be an int, got {max_depth!r}")
        if max_depth < deepest:  # a shallower walk mis-judges deep nodes, silently on Triton
            raise ValueError(f"max_depth={max_depth} is below the deepest node ({deepest})")
        return cls(parents, blocks, max_depth)


def request_ids(cu_seqlens: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: owning request and position inside its block (torch, no sync).

    req[t] = #{r : cu[r+1] <= t}, as a scatter of ones plus a cumsum: serial O(T) ops.
    (repeat_interleave / searchsorted take ~10 ms for 256 tokens on a busy 2-core CPU,
    their OpenMP parallel_for waits on threads.)"""
    cu = cu_seqlens.to(torch.int64)
    ends = torch.zeros(num_tokens + 1, dtype=torch.int64, device=cu.device)
    ends.index_add_(0, cu[1:], torch.ones_like(cu[1:]))
    req = ends[:num_tokens].cumsum(0)
    return req, torch.arange(num_tokens, device=cu.device) - cu[req]


def _check_topological(parents: torch.Tensor, blocks: Blocks) -> int:
    """Refuse a parent that is not an earlier node of its request; return the deepest
    node's depth (pointer doubling: ceil(log2 max_nodes) rounds of [N] gathers)."""
    req, local = request_ids(blocks.cu_seqlens, blocks.num_tokens)
    bad = (parents < -1) | (parents >= local)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"parents must satisfy -1 <= parent < local index (topological "
                         f"order); node {i} has parent {int(parents[i])}")
    par = parents.to(torch.int64)
    anc = torch.where(par >= 0, blocks.cu_seqlens.to(torch.int64)[req] + par, -1)
    depth = torch.ones_like(anc)
    for _ in range(max(blocks.max_seqlen - 1, 0).bit_length()):
        has = anc >= 0
        up = anc.clamp(min=0)
        depth = depth + torch.where(has, depth[up], 0)
        anc = torch.where(has, anc[up], -1)
    return int(depth.max())


__all__ = ["Blocks", "DraftTree", "as_blocks", "request_ids"]
