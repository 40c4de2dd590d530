"""Triton kernel for :func:`dspark_sim.kernels.survival.survival_varlen`: one program per
request holds its whole block (``l_r <= BLOCK_G``) in registers -- scale, sigmoid and a
register scan (``tl.cumprod``); no intermediate touches memory."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._backend import next_pow2
from .verify_triton import request_span


@triton.jit
def _survival_kernel(z_ptr, cu_ptr, temp_ptr, out_ptr, BLOCK_G: tl.constexpr):
    r = tl.program_id(0)
    start, n = request_span(cu_ptr, r)
    k = tl.arange(0, BLOCK_G)
    valid = k < n
    z = tl.load(z_ptr + start + k, mask=valid, other=0.0).to(tl.float32)
    t = tl.load(temp_ptr + k, mask=valid, other=1.0)
    c = tl.where(valid, tl.sigmoid(z / t), 1.0)
    tl.store(out_ptr + start + k, tl.cumprod(c, 0), mask=valid)


def survival_triton(
    conf_logits: torch.Tensor, cu_seqlens: torch.Tensor, temperature: torch.Tensor, max_seqlen: int
) -> torch.Tensor:
    out = torch.empty(conf_logits.numel(), dtype=torch.float32, device=conf_logits.device)
    num_req = cu_seqlens.numel() - 1
    if num_req > 0 and conf_logits.numel() > 0:
        _survival_kernel[(num_req,)](
            conf_logits, cu_seqlens, temperature, out, BLOCK_G=next_pow2(max_seqlen)
        )
    return out
