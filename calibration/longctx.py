"""Long-context self-speculation profiles: a ``[draft.selfspec]`` table priced from the
roofline sheets, and the two shipped regimes.

Self-speculation (SparseSpec-L, MagicDec, QuantSpec) drafts with the target itself over a
sparse KV: each draft pass is the target's forward for one token per request (its
weights, GEMMs, expert traffic and LM head, from :mod:`~dspark_sim.calibration.roofline`),
but attending at most ``kv_budget_tokens`` of each request's context instead of all of
it. So (``[draft.selfspec]``, :class:`~dspark_sim.calibration.profile.DraftCost`):

* ``time_ms`` at ``n`` requests: the target table at ``n`` tokens plus ``n`` LM-head rows
  (no context term), ``gamma_ref = 1``, ``gamma_slope = 1`` (each drafted token is one
  more pass);
* ``sparse_kv_us_per_token``: per attended (budgeted) KV token per drafted token: its KV
  read plus one query's attention FLOPs over it;
* ``select_us_per_context_token``: choosing the budget from the whole context once per
  drafting step. PillarAttn-style selection reuses the verifier's attention scores, so
  the modelled cost is reading one BF16 score per 16-token page per layer (an
  assumption, stated: the selection kernel is not published in the figures here).

Whether long contexts keep speculation profitable at large batch depends on what an extra
*verify* token costs next to the step (the admission threshold ``a*`` of
docs/architecture.md, from ../shared/reference/PUBLISHED_FIGURES.md's "Why a
confidence-scheduled budget shrinks with load"): the two shipped profiles sit on either side.

* ``selfspec-llama8b-8xh200`` (**KV-bound**): a Llama-3.1-8B-like dense model (GQA 32/8
  heads of 128, BF16 KV: 128 KiB per token) tensor-parallel over 8 H200. A request's KV
  at 32k context is 4 GiB, read once per step whatever its verify length, while a verify
  token's attention FLOPs over it are ~4 per KV byte: attention is memory-bound, the
  step is dominated by KV reads, and extra verify tokens are nearly free (MagicDec's
  regime: 1.84-2x at batch 32-256 for long contexts).
* ``selfspec-v3-h200`` (**compute-bound attention**): a DeepSeek-V3-like MoE rank (MLA:
  70 KB of KV per token, ~17 MFLOP per query token per context token, ~240 FLOP per KV
  byte) on H200, the shipped ``v3-h200`` sheets. Each verify token pays its own
  attention over the whole context in compute, so an extra verify token costs about what
  a decode token does, and every self-draft pass reads the full weights: speculation
  stops paying as the batch grows.
"""

from __future__ import annotations

from dataclasses import replace
from importlib import resources
from pathlib import Path

import numpy as np

from dspark_sim.calibration.profile import DraftCost, EngineProfile
from dspark_sim.calibration.roofline import (
    COARSE_GRAPH_BUCKETS,
    H200_BF16,
    MODELS,
    DeploymentSheet,
    HardwareSheet,
    ModelSheet,
    analytic_profile,
    attention_terms,
    builtin_analytic_specs,
    graph_cost_s,
    logits_s_per_row,
)

KV_BUDGET_TOKENS = 2048  # SparseSpec / MagicDec-scale sparse KV budgets are 0.5-4k tokens
PAGE_TOKENS = 16  # selection granularity: one score per page per layer

# Llama-3.1-8B-like: 8.0B parameters, 32 layers, GQA 32/8 heads, BF16 weights and KV
# (128 KiB per token); the sheet and its sources are in calibration/data/sheets/models.toml.
LLAMA31_8B_LIKE = MODELS["llama31-8b"]
# Tensor-parallel over one 8-GPU node (MagicDec's long-context setting: batch 32-256,
# TP over 8 GPUs): one all-reduce pair per layer in the fixed overhead (4 ms), so no
# separate all-reduce term.
TP8_LONGCTX = DeploymentSheet(gpus_per_replica=8, overhead_ms=4.0, per_token_overhead_us=2.0,
                              eager_penalty_ms=2.0, cuda_graph_max_tokens=512,
                              graph_buckets=COARSE_GRAPH_BUCKETS, tp_allreduces_per_layer=0.0,
                              eager_slowdown=1.1, sample_us_per_row=2.0, draft_layers=5.0,
                              max_num_seqs=256, max_num_batched_tokens=8192)


def selfspec_draft(hw: HardwareSheet, m: ModelSheet, dep: DeploymentSheet,
                   kv_budget_tokens: int = KV_BUDGET_TOKENS,
                   batches=(1, 8, 32, 64, 128, 256, 512)) -> DraftCost:
    """The ``[draft.selfspec]`` table of the target drafting for itself over a sparse KV."""
    n = np.asarray([x for x in batches if x <= max(dep.max_num_seqs, 1)] or [1], np.float64)
    row_s = logits_s_per_row(hw, m, replace(dep, sample_us_per_row=0.0))
    per_query_ctx, per_ctx, _ = attention_terms(hw, m, dep)
    bw = dep.gpus_per_replica * hw.hbm_bytes_per_s * hw.mem_efficiency
    return DraftCost(batch=n, time_s=graph_cost_s(n, hw, m, dep) + row_s * n, gamma_ref=1,
                     gamma_slope=1.0, kv_budget_tokens=int(kv_budget_tokens),
                     sparse_kv_s_per_token=per_ctx + per_query_ctx,
                     select_s_per_context_token=m.layers * 2.0 / PAGE_TOKENS / bw)


def selfspec_specs() -> dict[str, tuple[HardwareSheet, ModelSheet, DeploymentSheet, str]]:
    hw3, m3, dep3 = builtin_analytic_specs()["v3-h200"]
    return {
        "selfspec-llama8b-8xh200": (
            replace(H200_BF16, flop_efficiency=0.55), LLAMA31_8B_LIKE, TP8_LONGCTX,
            "KV-bound long-context self-speculation: a Llama-3.1-8B-like dense model, TP8 "
            "on 8 x H200, drafting for itself over a 2048-token sparse KV ([draft.selfspec])"),
        "selfspec-v3-h200": (
            hw3, m3, dep3,
            "Compute-bound attention: the v3-h200 DeepSeek-V3-like MoE rank (MLA), drafting "
            "for itself over a 2048-token sparse KV ([draft.selfspec])"),
    }


def selfspec_profile(name: str) -> EngineProfile:
    hw, m, dep, description = selfspec_specs()[name]
    base = analytic_profile(hw, m, dep, name=name, description=description,
                            notes={"selfspec_kv_budget_tokens": KV_BUDGET_TOKENS,
                                   "selfspec_select": f"one BF16 score per {PAGE_TOKENS}-token "
                                                      "page per layer (assumed)",
                                   "source": "dspark_sim.calibration.longctx"})
    return replace(base, drafts={**base.drafts, "selfspec": selfspec_draft(hw, m, dep)})


def write_selfspec_profiles(out_dir: str | Path | None = None) -> list[Path]:
    """(Re)write the shipped self-speculation profile files."""
    from dspark_sim.io import write_text_atomic

    root = Path(out_dir) if out_dir is not None else Path(
        str(resources.files("dspark_sim.calibration") / "data"))
    return [write_text_atomic(root / f"{name}.toml", selfspec_profile(name).to_toml())
            for name in selfspec_specs()]
