"""Varlen speculative-decoding verification: wrappers and plain-torch references.

Layout (cu_seqlens style, DSpark §5.3: a variable number ``l_r`` of draft tokens per
request, no padding):

* ``cu_seqlens`` [R+1] int: request ``r`` owns draft tokens ``cu_seqlens[r] : cu_seqlens[r+1]``.
* ``draft_tokens`` [T] int64, ``draft_probs`` [T, V]: one row per draft token.
* ``target_logits`` / ``target_probs`` [T + R, V]: request ``r`` owns target rows
  ``cu_seqlens[r] + r : cu_seqlens[r+1] + r + 1`` -- ``l_r + 1`` rows, exactly what one
  target forward over ``[last token, d_1 .. d_l]`` produces. Row ``cu_seqlens[r] + r + k``
  judges draft token ``k`` (``k < l_r``); the last row (``k = l_r``) is the bonus position.

Rows must be contiguous along V (``stride(-1) == 1``); any float dtype (bf16/fp16/fp32),
math is fp32 (fp64 for the residual sampling prefix sums).

The layout is a :class:`~dspark_sim.kernels.layout.Blocks` (or a bare ``cu_seqlens``,
checked per call); each wrapper checks inputs against it, allocates outputs and launches either the Triton kernels
(:mod:`.verify_triton`, imported lazily) or the torch reference below (see
:func:`dspark_sim.kernels._backend.resolve_backend`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._backend import resolve_backend, same_device
from .layout import Blocks, as_blocks
from .layout import request_ids as _request_ids


class GreedyVerify(NamedTuple):
    accepted_len: torch.Tensor  # [R] int64: leading draft tokens equal to the target argmax
    next_token: torch.Tensor  # [R] int64: target argmax at the first mismatch / bonus row
    target_argmax: torch.Tensor  # [T + R] int64: argmax of every target row


class StochasticVerify(NamedTuple):
    accepted_len: torch.Tensor  # [R] int64
    next_token: torch.Tensor  # [R] int64: residual sample at the rejection, else bonus sample
    tv_accept: torch.Tensor  # [T] float32: 1 - 0.5 * ||p_d - p_t||_1 per draft position


class Uniforms(NamedTuple):
    accept: torch.Tensor  # [T] float32: one uniform per draft token (accept test)
    sample: torch.Tensor  # [R] float64: one uniform per request (inverse-CDF sample)


# ---------------------------------------------------------------------------------------
# Input checks shared by the wrappers (the layout itself is checked in .layout).


def _check_rows(name: str, x: torch.Tensor, rows: int, vocab: int | None) -> int:
    if x.dim() != 2 or x.shape[0] != rows:
        raise ValueError(f"{name} must be [{rows}, V], got {tuple(x.shape)}")
    if vocab is not None and x.shape[1] != vocab:
        raise ValueError(f"{name} has V={x.shape[1]}, expected {vocab}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be floating point, got {x.dtype}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"{name} must be contiguous along V")
    return x.shape[1]


def _check_tokens(name: str, tokens: torch.Tensor, blocks: Blocks) -> None:
    """1-D integer ids, one per token of the layout (any value: ids outside the
    vocabulary are rejected by verification, never read)."""
    if tokens.dim() != 1 or tokens.is_floating_point() or tokens.is_complex() or (
            tokens.dtype == torch.bool):
        raise TypeError(f"{name} must be 1-D integer ids, got {tuple(tokens.shape)} {tokens.dtype}")
    blocks.expect_tokens(tokens.numel(), name)


def _check_prob_rows(draft_probs: torch.Tensor, target_probs: torch.Tensor,
                     blocks: Blocks | torch.Tensor) -> Blocks:
    """The layout, with ``draft_probs`` [T, V] and ``target_probs`` [T + R, V] checked on it."""
    blocks = as_blocks(blocks)
    if draft_probs.dim() == 2:  # the layout's own mismatch first: it names cu_seqlens
        blocks.expect_tokens(draft_probs.shape[0], "draft_probs")
    vocab = _check_rows("target_probs", target_probs, blocks.num_target_rows, None)
    _check_rows("draft_probs", draft_probs, blocks.num_tokens, vocab)
    return blocks


def _first_false(ok: torch.Tensor, req: torch.Tensor, pos: torch.Tensor, lengths: torch.Tensor):
    """Accepted length per request: first position where ``ok`` is False, else l_r (no sync)."""
    big = torch.where(ok, lengths[req], pos)
    out = lengths.clone()
    return out.scatter_reduce_(0, req, big, reduce="amin", include_self=True)


# ---------------------------------------------------------------------------------------
# Greedy verification.


def verify_greedy_torch(
    draft_tokens: torch.Tensor, target_logits: torch.Tensor, cu_seqlens: torch.Tensor
) -> GreedyVerify:
    """Reference: argmax every target row, compare, first mismatch per request."""
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    req, pos = _request_ids(cu, draft_tokens.numel())
    am = target_logits.argmax(dim=-1)  # first maximum on ties, like the kernel
    ok = am[torch.arange(draft_tokens.numel(), device=am.device) + req] == draft_tokens
    acc = _first_false(ok, req, pos, lengths)
    nxt = am[cu[:-1] + torch.arange(lengths.numel(), device=am.device) + acc]
    return GreedyVerify(acc, nxt, am)


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor,
                  blocks: Blocks | torch.Tensor, *, backend: str = "auto") -> GreedyVerify:
    """Greedy verification of varlen draft blocks (target argmax vs draft token).

    ``target_logits`` may equally be probabilities: only the argmax is used. Reads every
    target row once (``(T + R) * V`` elements) and writes ``O(T + R)`` integers.
    """
    blocks = as_blocks(blocks)
    _check_tokens("draft_tokens", draft_tokens, blocks)
    _check_rows("target_logits", target_logits, blocks.num_target_rows, None)
    same_device(draft_tokens, target_logits, blocks.cu_seqlens)
    if resolve_backend(backend, target_logits) == "torch":
        return verify_greedy_torch(draft_tokens, target_logits, blocks.cu_seqlens)
    from . import verify_triton

    return verify_triton.verify_greedy_triton(
        draft_tokens.contiguous(), target_logits, blocks.cu_seqlens.contiguous(), blocks.max_seqlen
    )


# ---------------------------------------------------------------------------------------
# Stochastic verification (Leviathan et al. 2023 / Chen et al. 2023 rejection sampling).


def draw_uniforms(
    num_draft: int,
    num_requests: int,
    device: torch.device | str,
    *,
    seed: int | None = None,
    generator: torch.Generator | None = None,
) -> Uniforms:
    """The only randomness of stochastic verification, drawn once so both backends agree."""
    if generator is None:
        generator = torch.Generator(device=device)
        generator.manual_seed(0 if seed is None else int(seed))
    u_acc = torch.rand(num_draft, generator=generator, device=device, dtype=torch.float32)
    u_smp = torch.rand(num_requests, generator=generator, device=device, dtype=torch.float64)
    return Uniforms(u_acc, u_smp)


def _target_minus_draft(
    draft_probs: torch.Tensor, target_probs: torch.Tensor, req: torch.Tensor, max_seqlen: int
) -> torch.Tensor:
    """[T, V] float32 ``p_t - p_d`` for every draft row: one [T, V] temporary (a copy of
    the target rows, then an in-place subtract). Equal-length blocks (T == R * max_seqlen)
    read the target rows through a strided view instead of an index_select."""
    num_draft, vocab = draft_probs.shape
    num_req = target_probs.shape[0] - num_draft
    if num_draft == num_req * max_seqlen and max_seqlen > 0:
        rows = target_probs.view(num_req, max_seqlen + 1, vocab)[:, :max_seqlen]
        diff = rows.to(torch.float32, copy=True).view(num_draft, vocab)
    else:
        rows = torch.arange(num_draft, device=req.device) + req
        diff = target_probs.index_select(0, rows).to(torch.float32, copy=True)
    return diff.sub_(draft_probs)


def _tv_from_diff(diff: torch.Tensor) -> torch.Tensor:
    return 1.0 - 0.5 * torch.linalg.vector_norm(diff, ord=1, dim=-1)  # no |diff| copy


def verify_stochastic_torch(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    cu_seqlens: torch.Tensor,
    uniforms: Uniforms,
    max_seqlen: int,
) -> StochasticVerify:
    """Reference. Accept ``x`` iff ``u * p_d(x) < p_t(x)``; on the first rejection sample
    the residual ``max(0, p_t - p_d)`` by inverse CDF with one uniform; if all accepted,
    sample the bonus row ``p_t`` the same way. One ``[T, V]`` float32 temporary."""
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    num_req, num_draft = lengths.numel(), draft_tokens.numel()
    req, pos = _request_ids(cu, num_draft)
    tv = _tv_from_diff(_target_minus_draft(draft_probs, target_probs, req, max_seqlen))
    vocab = target_probs.shape[1]
    in_vocab = (draft_tokens >= 0) & (draft_tokens < vocab)  # outside: p_t(x) = 0, rejected
    x = draft_tokens.clamp(0, vocab - 1)
    px_d = draft_probs.gather(1, x.unsqueeze(1)).squeeze(1).float()
    px_t = target_probs[torch.arange(num_draft, device=cu.device) + req, x].float()
    ok = in_vocab & (uniforms.accept * px_d < px_t)
    acc = _first_false(ok, req, pos, lengths)

    rejected = acc < lengths
    stop_t = cu[:-1] + torch.arange(num_req, device=cu.device) + acc
    stop_d = (cu[:-1] + acc).clamp(max=max(draft_probs.shape[0] - 1, 0))
    row_t = target_probs.index_select(0, stop_t).float()
    if draft_probs.shape[0] > 0:
        row_d = draft_probs.index_select(0, stop_d).float() * rejected.unsqueeze(1)
    else:
        row_d = torch.zeros_like(row_t)
    res = (row_t - row_d).clamp_(min=0.0)
    nxt = _inverse_cdf_torch(res, row_t, uniforms.sample)
    return StochasticVerify(acc, nxt, tv)


def _inverse_cdf_torch(res: torch.Tensor, row_t: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """First index whose fp64 running mass exceeds ``u * total`` (fallbacks as the kernel).

    Four [R, V] passes: fp64 cast, cumsum, compare, count (cum is non-decreasing, so the
    number of entries <= target is the first index above it)."""
    cum = res.double().cumsum(dim=1)
    target = (u * cum[:, -1]).unsqueeze(1)
    first = (cum <= target).sum(dim=1)
    vocab = res.shape[1]
    if bool((first >= vocab).any()):  # host check; only rounding/zero mass gets here
        # Degenerate guards: last positive entry, else the target argmax.
        pos = res > 0
        last = torch.where(pos.any(dim=1), vocab - 1 - pos.flip(1).to(torch.int8).argmax(dim=1), -1)
        fallback = torch.where(last >= 0, last, row_t.argmax(dim=1))
        first = torch.where(first < vocab, first, fallback)
    return first


def verify_stochastic(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    blocks: Blocks | torch.Tensor,
    *,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    uniforms: Uniforms | None = None,
    backend: str = "auto",
) -> StochasticVerify:
    """Lossless rejection-sampling verification of varlen draft blocks.

    Randomness: ``uniforms`` if given, else :func:`draw_uniforms` with ``seed`` /
    ``generator``; the same uniforms give the same tokens on both backends (up to
    fp64 rounding of the sampling prefix sums). Triton traffic: ``2 T + R`` rows read in
    pass 1 (TV, accept test, residual mass), at most ``2 R`` rows in pass 2 (sampling).
    """
    blocks = _check_prob_rows(draft_probs, target_probs, blocks)
    _check_tokens("draft_tokens", draft_tokens, blocks)
    num_draft, num_req = blocks.num_tokens, blocks.num_requests
    device = same_device(draft_tokens, draft_probs, target_probs, blocks.cu_seqlens)
    if uniforms is None:
        uniforms = draw_uniforms(num_draft, num_req, device, seed=seed, generator=generator)
    if uniforms.accept.numel() != num_draft or uniforms.sample.numel() != num_req:
        raise ValueError("uniforms must be ([T] float32, [R] float64)")
    uniforms = Uniforms(uniforms.accept.float(), uniforms.sample.double())
    cu, width = blocks.cu_seqlens, blocks.max_seqlen
    if resolve_backend(backend, target_probs) == "torch":
        return verify_stochastic_torch(draft_tokens, draft_probs, target_probs, cu, uniforms, width)
    from . import verify_triton

    return verify_triton.verify_stochastic_triton(
        draft_tokens.contiguous(), draft_probs, target_probs, cu.contiguous(), uniforms, width
    )


def tv_acceptance(draft_probs: torch.Tensor, target_probs: torch.Tensor,
                  blocks: Blocks | torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Per draft position ``1 - 0.5 * ||p_d - p_t||_1`` [T] float32 (same layout as verify)."""
    blocks = _check_prob_rows(draft_probs, target_probs, blocks)
    same_device(draft_probs, target_probs, blocks.cu_seqlens)
    if resolve_backend(backend, target_probs) == "torch":
        req, _ = _request_ids(blocks.cu_seqlens, blocks.num_tokens)
        diff = _target_minus_draft(draft_probs, target_probs, req, blocks.max_seqlen)
        return _tv_from_diff(diff)
    from . import verify_triton

    return verify_triton.tv_acceptance_triton(
        draft_probs, target_probs, blocks.cu_seqlens.contiguous(), blocks.max_seqlen
    )


__all__ = [
    "GreedyVerify",
    "StochasticVerify",
    "Uniforms",
    "draw_uniforms",
    "tv_acceptance",
    "verify_greedy",
    "verify_greedy_torch",
    "verify_stochastic",
    "verify_stochastic_torch",
]
