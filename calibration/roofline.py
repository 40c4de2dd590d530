"""Analytic (roofline) engine profiles for hardware that is not at hand.

Formulas (per replica of ``G`` GPUs, ``B`` tokens in the batch; see docs/profiles.md):

* MoE weights touched: each of ``E`` routed experts per layer is hit by at least one
  of ``B`` tokens (top-``k`` routing, uniform) with probability ``1 - (1 - k/E)^B``, so
  ``weight_bytes(B) = bpp * (dense_params + routed_params * (1 - (1 - k/E)^B))``.
  A dense model is ``routed_params = 0``.
* ``mem_s  = weight_bytes(B) / (G * hbm_bw * mem_eff)`` (KV reads are charged per
  context token of the live batch by the profile's ``kv_us_per_token`` term).
* ``flop_s = (2 * active_params * B + B * ctx_ref * attn_flops_per_ctx_token) / (G * peak_flops * flop_eff)``
  with ``ctx_ref`` the reference context, capped at ``attn_window_tokens`` (sparse attention).
* ``target_s(B) = max(mem_s, flop_s) + overhead_s + B * per_token_overhead_s``,
  evaluated at the CUDA-graph bucket ``B`` is padded into (the staircase); past the
  largest bucket the engine runs eager and pays ``eager_penalty_ms``.
* KV reads of the live batch beyond the reference: ``kv_bytes_per_token / (G * hbm_bw * mem_eff)``
  per context token in the batch.
* Drafters: a parallel (DSpark-style) drafter is ``draft_layers`` target-sized layers
  run once per step, whatever ``gamma``; an MTP-1 head is one layer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
from dspark_sim.calibration.profile import DraftCost, EngineProfile


@dataclass(frozen=True)
class HardwareSheet:
    name: str
    hbm_bytes_per_s: float
    peak_flops: float  # dense, in the precision the model runs in
    mem_efficiency: float = 0.75
    flop_efficiency: float = 0.55


@dataclass(frozen=True)
class ModelSheet:
    name: str
    active_params: float
    dense_params: float  # attention, shared experts, embeddings read per step
    routed_params: float  # all routed experts of all layers (0 for dense)
    experts: int = 1
    top_k: int = 1
    layers: int = 1
    bytes_per_param: float = 1.0
    kv_bytes_per_token: float = 0.0
    attn_flops_per_ctx_token: float = 0.0
    attn_window_tokens: int = 1 << 30


@dataclass(frozen=True)
class DeploymentSheet:
    gpus_per_replica: int
    overhead_ms: float
    per_token_overhead_us: float = 0.0
    reference_context_tokens: int = 2048
    graph_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384,
                                      512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
    eager_penalty_ms: float = 5.0
    draft_layers: int = 3  # parallel drafter depth in target-layer equivalents


H200 = HardwareSheet("H200", hbm_bytes_per_s=4.8e12, peak_flops=1.979e15)
H100 = HardwareSheet("H100", hbm_bytes_per_s=3.35e12, peak_flops=1.979e15)
B200 = HardwareSheet("B200", hbm_bytes_per_s=8.0e12, peak_flops=4.5e15)

# DeepSeek-V4-Flash-like MoE: 284B total / 13B active, 256 routed experts top-6,
# FP8 weights, compressed (MLA-style) KV and sparse attention over <= 2048 tokens.
V4_FLASH_LIKE = ModelSheet(
    name="DeepSeek-V4-Flash-like MoE (284B total, 13B active)",
    active_params=13e9,
    dense_params=6.5e9,
    routed_params=277.5e9,
    experts=256,
    top_k=6,
    layers=43,
    bytes_per_param=1.0,
    kv_bytes_per_token=20e3,
    attn_flops_per_ctx_token=6e6,
    attn_window_tokens=2048,
)


def _target_s(b: np.ndarray, hw: HardwareSheet, m: ModelSheet, d: DeploymentSheet) -> np.ndarray:
    b = np.asarray(b, dtype=np.float64)
    touched = 1.0 - (1.0 - m.top_k / max(m.experts, 1)) ** b if m.routed_params else 0.0
    weight_bytes = m.bytes_per_param * (m.dense_params + m.routed_params * touched)
    ctx = min(d.reference_context_tokens, m.attn_window_tokens)
    g = d.gpus_per_replica
    mem_s = weight_bytes / (g * hw.hbm_bytes_per_s * hw.mem_efficiency)
    flops = 2.0 * m.active_params * b + b * ctx * m.attn_flops_per_ctx_token
    flop_s = flops / (g * hw.peak_flops * hw.flop_efficiency)
    return np.maximum(mem_s, flop_s) + d.overhead_ms / 1e3 + b * d.per_token_overhead_us / 1e6


def analytic_profile(
    hw: HardwareSheet,
    model: ModelSheet,
    dep: DeploymentSheet,
    *,
    name: str,
    draft_batches: tuple[int, ...] = (1, 8, 32, 64, 128, 256, 512),
) -> EngineProfile:
    buckets = np.asarray(dep.graph_buckets, dtype=np.int64)
    step_s = _target_s(buckets, hw, model, dep)
    g = dep.gpus_per_replica
    kv_s = model.kv_bytes_per_token / (g * hw.hbm_bytes_per_s * hw.mem_efficiency)
    per_layer = np.asarray(
        [
            (_target_s(np.array([n]), hw, model, dep)[0] - dep.overhead_ms / 1e3)
            / max(1, model.layers)
            for n in draft_batches
        ]
    )
    # Drafter launches are short: a tenth of the engine's fixed overhead per pass.
    launch_s = 0.1 * dep.overhead_ms / 1e3
    drafts = {
        "dspark": DraftCost(np.asarray(draft_batches, float), dep.draft_layers * per_layer + launch_s,
                            gamma_ref=7, gamma_slope=0.0),
        "mtp1": DraftCost(np.asarray(draft_batches, float), per_layer + launch_s,
                          gamma_ref=1, gamma_slope=1.0),
    }
    params = {f"hw_{k}": v for k, v in asdict(hw).items()}
    params |= {f"model_{k}": v for k, v in asdict(model).items()}
    params |= {f"deploy_{k}": (list(v) if isinstance(v, tuple) else v) for k, v in asdict(dep).items()}
    return EngineProfile(
        name=name,
        kind="analytic",
        gpus_per_replica=g,
        tokens=buckets,
        step_s=step_s,
        kv_s_per_token=kv_s,
        eager_penalty_s=dep.eager_penalty_ms / 1e3,
        interpolation="step",
        drafts=drafts,
        description=f"Roofline of {model.name} on {g}x {hw.name} (CUDA-graph buckets, eager beyond)",
        parameters=params,
    )


V4_FLASH_H200_DEPLOYMENT = DeploymentSheet(gpus_per_replica=16, overhead_ms=9.0,
                                           per_token_overhead_us=0.5)


def default_profile() -> EngineProfile:
    """The embedded default: V4-Flash-like MoE on 16x H200 per replica."""
    return analytic_profile(H200, V4_FLASH_LIKE, V4_FLASH_H200_DEPLOYMENT, name="v4flash-h200")
