"""Confidence logits -> calibrated prefix survival, fused (DSpark §3.2.1, Eq. 7 + STS).

``c_{r,k} = sigmoid(z_{r,k} / T_k)`` with one Sequential-Temperature-Scaling temperature
per draft position ``k`` (0-based inside the request's block), then
``a_{r,j} = prod_{k<=j} c_{r,k}`` -- the survival the prefix scheduler ranks.

Layouts:

* varlen (matches :mod:`.verify`): ``conf_logits`` [T], a :class:`~.layout.Blocks` (or
  ``cu_seqlens`` [R+1]), output [T];
* dense convenience: ``conf_logits`` [R, gamma] (every position valid), output [R, gamma].

``temperature`` [>= max l_r] positive floats. Output float32; math in fp32.
One kernel reads ``T`` logits + ``gamma`` temperatures and writes ``T`` floats.
"""

from __future__ import annotations

import torch

from ._backend import resolve_backend, same_device
from .layout import Blocks, as_blocks
from .layout import request_ids as _request_ids


def survival_torch(
    conf_logits: torch.Tensor, cu_seqlens: torch.Tensor, temperature: torch.Tensor, max_seqlen: int
) -> torch.Tensor:
    """Reference: scale, sigmoid, pad to [R, max_seqlen] with ones, cumprod, unpad.
    Equal-length blocks skip the padding (3 ops instead of ~20 launch-bound ones)."""
    num_tok = conf_logits.numel()
    cu = cu_seqlens.to(torch.int64)
    num_req = cu.numel() - 1
    temp = temperature.to(device=conf_logits.device, dtype=torch.float32)
    if num_tok == num_req * max_seqlen and max_seqlen > 0:
        dense = conf_logits.float().view(num_req, max_seqlen) / temp[:max_seqlen]
        return torch.sigmoid(dense).cumprod(dim=1).view(-1)
    req, pos = _request_ids(cu, num_tok)
    conf = torch.sigmoid(conf_logits.float() / temp[pos])
    dense = torch.ones(num_req, max(max_seqlen, 1), dtype=torch.float32, device=conf.device)
    dense[req, pos] = conf
    return dense.cumprod(dim=1)[req, pos]


def survival_varlen(conf_logits: torch.Tensor, blocks: Blocks | torch.Tensor,
                    temperature: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Varlen fused temperature scaling -> sigmoid -> per-request cumulative product."""
    if conf_logits.dim() != 1 or not conf_logits.is_floating_point():
        raise ValueError("conf_logits must be a 1-D float tensor [T]")
    if temperature.dim() != 1 or not temperature.is_floating_point():
        raise ValueError("temperature must be a 1-D float tensor [gamma]")
    blocks = as_blocks(blocks)
    blocks.expect_tokens(conf_logits.numel(), "conf_logits")
    cu, width = blocks.cu_seqlens, blocks.max_seqlen
    same_device(conf_logits, cu, temperature)
    if width > temperature.numel():
        raise ValueError(f"temperature has {temperature.numel()} entries, blocks reach {width}")
    if resolve_backend(backend, conf_logits) == "torch":
        return survival_torch(conf_logits, cu, temperature, width)
    from . import survival_triton

    return survival_triton.survival_triton(
        conf_logits.contiguous(), cu.contiguous(), temperature.float().contiguous(), width
    )


def survival_dense(
    conf_logits: torch.Tensor, temperature: torch.Tensor, *, backend: str = "auto"
) -> torch.Tensor:
    """Dense convenience form: [R, gamma] logits -> [R, gamma] survival (no padding copy)."""
    if conf_logits.dim() != 2:
        raise ValueError("conf_logits must be [R, gamma]")
    num_req, gamma = conf_logits.shape
    cu = torch.arange(num_req + 1, device=conf_logits.device, dtype=torch.int64) * gamma
    blocks = Blocks(cu, gamma, num_req * gamma)  # regular by construction: no check, no sync
    flat = conf_logits.reshape(-1)
    return survival_varlen(flat, blocks, temperature, backend=backend).view(num_req, gamma)


__all__ = ["survival_dense", "survival_torch", "survival_varlen"]
