"""Analytic engine profiles: every term that makes a step cost what it costs.

A step of one replica carrying ``B`` batch tokens is priced from three sheets
(hardware, model, deployment; formulas below, the sheets' fields documented on the
dataclasses). Each term is a separate, sourced line, so a user can see which one makes
verification expensive on their engine (docs/profiles.md walks through them):

* **weights** (the memory-bound floor): the bytes of weights one GPU reads per step,
  ``dense_params / g`` plus its share of the routed experts the *global* batch touches
  (an expert is read when at least one of the EP group's tokens routes to it:
  ``1 - (1 - top_k / experts) ** B_global``), over HBM bandwidth x efficiency.
* **compute**: ``2 * active_params * B / g`` FLOPs per GPU at a realistic fraction of the
  dense peak (MoE decode GEMMs run far below peak). The step pays
  ``max(weights, compute)``: the roofline.
* **expert-parallel traffic**: each token's hidden state is dispatched to its ``top_k``
  experts and combined back on every MoE layer (FP8 out, BF16 back: 3 bytes per hidden
  element); the share leaving the GPU crosses the interconnect (NVLink within a node,
  InfiniBand across nodes). ``comm_overlap`` of it hides behind compute (two-micro-batch
  overlap); the rest adds to the step.
* **tensor-parallel all-reduces**: a replica of ``g > 1`` GPUs combines every layer's
  partial sums (``tp_allreduces_per_layer``, 2 for attention + FFN) over the node's link:
  per all-reduce the link's latency plus a ring's ``2 (g - 1) / g`` of the batch's BF16
  hidden states over ``tp_link_bytes_per_s``.
* **fixed overhead** per step (scheduler, input preparation, launches: what a step costs
  beyond the terms above; ``DEFAULT_OVERHEAD_MS`` when a sheet does not state it) and an
  optional **per-token overhead** (scheduling, padding) the terms above miss.
* **CUDA-graph staircase**: up to ``cuda_graph_max_tokens`` a batch runs in the smallest
  captured graph that holds it (the table's "step" rows; by default vLLM's own capture
  sizes and limit, :func:`vllm_capture_limit`); beyond, the engine runs eager:
  ``eager_slowdown`` x the cost plus ``eager_penalty_ms``, tabulated up to the token
  budget.
* **attention and KV by context** (per step, outside the table, charged by the
  simulator from each request's context): attention FLOPs per query token x attended
  context (``attn_window_tokens`` caps it for sparse attention), KV bytes read per
  context token (once per request for dense attention; per query token over the
  selected window for sparse attention, where each query picks its own tokens).
* **LM head, sampling and rejection** per logit row (every verify token): the vocabulary
  projection, the softmax/sampling passes over the vocabulary, and a fixed per-row cost.
* **drafters**: the block (DSpark) drafter runs ``draft_layers`` dense-layer equivalents
  over ``n * (gamma + 1)`` tokens and projects ``n * gamma`` rows onto the vocabulary;
  the MTP-1 head is one transformer block (with its MoE) over ``n`` tokens.

The profile also states the replica's limits: ``max_num_seqs``, ``max_num_batched_tokens``
(from the deployment), ``kv_capacity_tokens`` (HBM left after the weights and an
activation reserve, over the KV bytes per token) and ``max_model_len``.

A *replica* is what the simulator schedules as one batch. With data-parallel attention
and expert parallelism (DeepSeek's deployment, SGLang/vLLM ``--enable-dp-attention``)
each GPU runs its own batch: a replica is one GPU (``gpus_per_replica = 1``) and
``ep_size`` GPUs share the experts, their batches assumed alike (symmetric load), so the
global batch is ``B * ep_size``. With tensor-parallel attention a replica spans its TP
group (``gpus_per_replica = ep_size = 8`` for one node).

Shipped analytic profiles (``calibration/data/<name>.toml``, :func:`builtin_analytic_specs`)
and the published points some were fitted to are listed in docs/profiles.md. Any other
pair is built from a sheet file with :func:`profile_from_sheets`.
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import MISSING, asdict, dataclass, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from dspark_sim.calibration.hf_config_check import check_hf_config
from dspark_sim.calibration.profile import (
    DEFAULT_LIMITS,
    DraftCost,
    EngineLimits,
    EngineProfile,
    check_default_trace,
    profile_from_dict,
)
from dspark_sim.errors import InputError, check_known_keys
from dspark_sim.io import loads_json, read_toml


@dataclass(frozen=True)
class HardwareSheet:
    name: str
    hbm_bytes_per_s: float  # HBM bandwidth per GPU
    peak_flops: float  # dense peak per GPU, in the precision the model's GEMMs run in
    hbm_bytes: float = 80e9  # HBM capacity per GPU
    # Per-GPU bandwidth of the link expert-parallel all-to-all crosses: InfiniBand
    # (400 Gb/s = 50 GB/s) for a multi-node EP group, NVLink within one node.
    interconnect_bytes_per_s: float = 50e9
    mem_efficiency: float = 0.75  # achieved / peak HBM bandwidth on weight streaming
    flop_efficiency: float = 0.55  # achieved / peak FLOP/s on the batch's GEMMs
    attn_efficiency: float = 0.6  # achieved / peak FLOP/s of the attention kernels
    # Per-GPU, per-direction bandwidth of the link a tensor-parallel group's all-reduces
    # cross inside the node (0: = interconnect_bytes_per_s): NVLink 4 is 450 GB/s.
    tp_link_bytes_per_s: float = 0.0
    # Latency of one all-reduce of a decode step's hidden states inside the node: a
    # one-shot NVLink all-reduce of up to a few hundred KB (vLLM's custom all-reduce,
    # NCCL's low-latency protocol) takes ~5-15 us; 8 us is an assumption, not measured.
    allreduce_latency_us: float = 8.0


@dataclass(frozen=True)
class ModelSheet:
    name: str
    active_params: float  # parameters one token passes through
    dense_params: float  # attention, shared experts, embeddings: read every step
    routed_params: float  # all routed experts of all layers (0 for a dense model)
    experts: int = 1
    top_k: int = 1
    layers: int = 1
    bytes_per_param: float = 1.0  # dense weights
    routed_bytes_per_param: float = 0.0  # routed experts (0: = bytes_per_param); FP4 = 0.5
    kv_bytes_per_token: float = 0.0  # KV cache stored per context token (all layers)
    attn_flops_per_ctx_token: float = 0.0  # attention FLOPs per query token per context token
    attn_window_tokens: int = 1 << 30  # context one query attends to (sparse attention)
    sparse_attention: bool = False  # each query reads its own selected window of the KV
    # KV bytes read per context token by the selection (sparse attention's indexer keys);
    # dense attention reads kv_bytes_per_token per context token once per request.
    index_bytes_per_token: float = 0.0
    hidden_size: int = 4096
    vocab_size: int = 129280
    max_model_len: int = 131072


# What a step costs beyond the modelled terms when a sheet does not say: vLLM's CPU side of
# one step with CUDA graphs (scheduler, input preparation, sampler hand-off, the graph
# launch). 1.5 ms is what the shipped single-GPU dense profiles assume; the fitted
# multi-GPU MoE profiles here land at 2.25-11.5 ms. How to choose it: a measured TPOT at
# concurrency 1 less the sheet's own B = 1 step (docs/profiles.md), or let
# `dspark-sim calibrate vllm` fit the step's fixed cost from bench-serve results.
DEFAULT_OVERHEAD_MS = 1.5


@dataclass(frozen=True)
class DeploymentSheet:
    gpus_per_replica: int  # GPUs one simulated replica (one batch) spans
    # fixed per step: scheduler, launches, synchronisation (DEFAULT_OVERHEAD_MS above)
    overhead_ms: float = DEFAULT_OVERHEAD_MS
    per_token_overhead_us: float = 0.0  # per batch token, beyond the modelled terms
    ep_size: int = 0  # GPUs sharing the routed experts (0: = gpus_per_replica)
    # remote destinations of a token's hidden state per MoE layer (0: top_k's off-GPU
    # share; node-limited routing over InfiniBand sends one copy per remote node)
    ep_remote_copies: float = 0.0
    # share of the step's compute time that hides all-to-all traffic (two-micro-batch
    # overlap, DeepEP): exposed = comm - overlap * min(comm, compute)
    comm_overlap: float = 0.0
    # False: the replica's GPUs all hold every token (tensor-parallel attention, no
    # data-parallel ranks) and combine the experts' outputs in the layer's all-reduce,
    # as vLLM's TP + EP does; no all-to-all crosses the link
    ep_all_to_all: bool = True
    # captured graph sizes in tokens (empty: vLLM's default capture sizes,
    # vllm_capture_sizes) and the largest one (0: vLLM's default limit,
    # vllm_capture_limit); a batch past the limit runs eager
    graph_buckets: tuple[int, ...] = ()
    cuda_graph_max_tokens: int = 0
    # all-reduces per layer across a replica of several GPUs (attention out + FFN out);
    # 0 where a fitted overhead already carries them
    tp_allreduces_per_layer: float = 2.0
    eager_penalty_ms: float = 5.0  # added to an eager step
    eager_slowdown: float = 1.0  # an eager step costs this many times the graph cost
    # a sheet that states neither limit: the simulator's defaults (vLLM's)
    max_num_seqs: int = DEFAULT_LIMITS.max_num_seqs
    max_num_batched_tokens: int = DEFAULT_LIMITS.max_num_batched_tokens
    activation_reserve: float = 0.1  # fraction of HBM kept for activations / workspace
    sample_us_per_row: float = 0.0  # sampling / rejection per logit row, fixed part
    draft_layers: float = 3.0  # block drafter depth in dense-layer equivalents
    draft_gamma: int = 7  # block the drafter's table is priced at (gamma_ref)
    # tokens the block drafter's checkpoint drafts in one pass (0: draft_gamma, one pass):
    # a verify length past it takes another pass, so the drafted length follows the
    # policy's (the table at draft_gamma, ceil(draft_gamma / block) passes, linear down to
    # one pass at the block; shorter lengths, not a valid baseline, are priced below it)
    draft_block_tokens: int = 0
    # "chunked": prefill in the decode batch (colocated); "disaggregated": prefill
    # instances hand this replica each request's KV and first token (DeepSeek, large EP)
    prefill: str = "chunked"


# Vendor data sheets (SXM / OAM parts). Dense peaks (no sparsity) per precision; a preset
# named without a precision (``hardware = "H100"``) takes the peak of the precision the
# model's GEMMs run in (:func:`gemm_precision`), never silently FP8 for a BF16 model.
# H100 SXM: 80 GB HBM3 at 3.35 TB/s; 989 TFLOP/s BF16, 1,979 FP8; NVLink 4 900 GB/s
# bidirectional (450 GB/s each way). H200: 141 GB HBM3e at 4.8 TB/s, H100's peaks and
# NVLink. B200: 180 GB HBM3e at 8 TB/s; 2.25 PFLOP/s BF16, 4.5 FP8, 9 FP4; NVLink 5 1.8
# TB/s bidirectional (900 GB/s each way). B300 (Blackwell Ultra): 288 GB HBM3e at 8 TB/s,
# B200's BF16 and FP8, 13.5 PFLOP/s dense FP4, NVLink 5. H20 (Hopper, export part): 96 GB
# HBM3 at 4.0 TB/s; 148 TFLOP/s BF16, 296 FP8; NVLink 4. AMD Instinct MI350X: 288 GB
# HBM3E at 8 TB/s; 2.3 PFLOP/s BF16, 4.6 FP8, 9.2 MXFP4 (dense); 7 Infinity Fabric links
# of 153.6 GB/s bidirectional to the node's other 7 GPUs (76.8 GB/s each way per peer,
# 537.6 GB/s each way in all).
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H100": {"bf16": 0.989e15, "fp8": 1.979e15},
    "H200": {"bf16": 0.989e15, "fp8": 1.979e15},
    "H20": {"bf16": 0.148e15, "fp8": 0.296e15},
    "B200": {"bf16": 2.25e15, "fp8": 4.5e15, "fp4": 9.0e15},
    "B300": {"bf16": 2.25e15, "fp8": 4.5e15, "fp4": 13.5e15},
    "MI350X": {"bf16": 2.3e15, "fp8": 4.6e15, "fp4": 9.2e15},
}
H200 = HardwareSheet("H200", hbm_bytes_per_s=4.8e12, peak_flops=1.979e15, hbm_bytes=141e9,
                     tp_link_bytes_per_s=450e9)
H100 = HardwareSheet("H100", hbm_bytes_per_s=3.35e12, peak_flops=1.979e15, hbm_bytes=80e9,
                     tp_link_bytes_per_s=450e9)
B200 = HardwareSheet("B200", hbm_bytes_per_s=8.0e12, peak_flops=4.5e15, hbm_bytes=180e9,
                     interconnect_bytes_per_s=900e9)
B300 = HardwareSheet("B300", hbm_bytes_per_s=8.0e12, peak_flops=4.5e15, hbm_bytes=288e9,
                     interconnect_bytes_per_s=900e9)
H20 = HardwareSheet("H20", hbm_bytes_per_s=4.0e12, peak_flops=0.296e15, hbm_bytes=96e9,
                    interconnect_bytes_per_s=450e9)
MI350X = HardwareSheet("MI350X", hbm_bytes_per_s=8.0e12, peak_flops=4.6e15, hbm_bytes=288e9,
                       interconnect_bytes_per_s=537.6e9)
# BF16 dense peaks, named for models served in BF16.
H100_BF16 = replace(H100, peak_flops=0.989e15)
H200_BF16 = replace(H200, peak_flops=0.989e15)
B200_BF16 = replace(B200, peak_flops=2.25e15)

HARDWARE: dict[str, HardwareSheet] = {
    "H100": H100, "H200": H200, "H20": H20, "B200": B200, "B300": B300, "MI350X": MI350X,
    "H100-bf16": H100_BF16, "H200-bf16": H200_BF16, "B200-bf16": B200_BF16,
}

# Model presets live in one data file (calibration/data/sheets/models.toml: the
# DeepSeek-V4-Flash/V4-Pro/V3-like MoEs, Qwen3-8B-like and Llama-3.1-8B-like dense models,
# each sourced there), read by the same validator as a user's sheet file.
MODELS: dict[str, ModelSheet] = {}  # filled below, once _sheet is defined


# -- the terms ------------------------------------------------------------------------------


def _ep(dep: DeploymentSheet) -> int:
    return dep.ep_size or dep.gpus_per_replica


def _routed_bpp(m: ModelSheet) -> float:
    return m.routed_bytes_per_param or m.bytes_per_param


def weights_s(b, hw: HardwareSheet, m: ModelSheet, dep: DeploymentSheet):
    """Seconds one GPU spends streaming the weights a step of ``b`` replica tokens reads."""
    b = np.asarray(b, dtype=np.float64)
    g, ep = dep.gpus_per_replica, _ep(dep)
    global_tokens = b * ep / g  # symmetric load over the EP group's replicas
    touched = 1.0 - (1.0 - m.top_k / max(m.experts, 1)) ** global_tokens \
        if m.routed_params else 0.0
    per_gpu = m.bytes_per_param * m.dense_params / g + _routed_bpp(m) * m.routed_params * touched / ep
    return per_gpu / (hw.hbm_bytes_per_s * hw.mem_efficiency)


def compute_s(b, hw: HardwareSheet, m: ModelSheet, dep: DeploymentSheet):
    """Seconds of GEMM FLOPs per GPU for ``b`` replica tokens at the sheet's efficiency."""
    b = np.asarray(b, dtype=np.float64)
    return 2.0 * m.active_params * b / dep.gpus_per_replica / (hw.peak_flops * hw.flop_efficiency)


def ep_comm_s(b, hw: HardwareSheet, m: ModelSheet, dep: DeploymentSheet):
    """Expert-parallel dispatch + combine time for ``b`` replica tokens: per token and
    MoE layer, one FP8 hidden state out and one BF16 back (3 bytes per element) to each
    remote destination (``ep_remote_copies``; by default the ``top_k`` experts' share
    off this GPU, fewer with node-limited routing over a node interconnect)."""
    b = np.asarray(b, dtype=np.float64)
    ep = _ep(dep)
    if not m.routed_params or ep <= 1:
        return np.zeros_like(b)
    copies = dep.ep_remote_copies or m.top_k * (ep - 1) / ep
    bytes_per_token = m.layers * copies * m.hidden_size * 3.0
    return bytes_per_token * b / dep.gpus_per_replica / hw.interconnect_bytes_per_s


def allreduce_s(b, hw: HardwareSheet, m: ModelSheet, dep: DeploymentSheet):
    """Tensor-parallel all-reduces of a step of ``b`` tokens across the replica's ``g``
    GPUs: per layer ``tp_allreduces_per_layer`` of them, each the link's latency plus a
    ring's ``2 (g - 1) / g`` of the ``b`` BF16 hidden states over the TP link."""
    b = np.asarray(b, dtype=np.float64)
    g = dep.gpus_per_replica
    if g <= 1 or not dep.tp_allreduces_per_layer:
        return np.zeros_like(b)
    link = hw.tp_link_bytes_per_s or hw.interconnect_bytes_per_s
    one = hw.allreduce_latency_us / 1e6 + 2.0 * (g - 1) / g * b * m.hidden_size * 2.0 / link
    return m.layers * dep.tp_allreduces_per_layer * one


def graph_cost_s(b, hw: HardwareSheet, m: ModelSheet, dep: DeploymentSheet):
    """Target forward time for ``b`` tokens inside a captured graph (no LM head): the
    roofline body ``max(weights, compute)``, the part of the all-to-all that overlap
    (``comm_overlap`` of the body's time) does not hide, the all-reduces and the
    overheads."""
    b = np.asarray(b, dtype=np.float64)
    body = np.maximum(weights_s(b, hw, m, dep), compute_s(b, hw, m, dep))
    comm = ep_comm_s(b, hw, m, dep) if dep.ep_all_to_all else np.zeros_like(b)
    exposed = comm - dep.comm_overlap * np.minimum(comm, body)
    return (dep.overhead_ms / 1e3 + body + exposed + allreduce_s(b, hw, m, dep)
            + b * dep.per_token_overhead_us / 1e6)


# vLLM's default capture limit (CompilationConfig.max_cudagraph_capture_size left unset):
# min(max_num_seqs x (1 + num_speculative_tokens) x 2, 512), then at most
# max_num_batched_tokens; a batch of more tokens runs without a graph.
VLLM_MAX_CAPTURE_TOKENS = 512


def vllm_capture_limit(dep: DeploymentSheet) -> int:
    """vLLM's default ``max_cudagraph_capture_size`` for this deployment, its drafter
    verifying ``draft_gamma`` tokens per request."""
    return min(dep.max_num_seqs * (1 + dep.draft_gamma) * 2, VLLM_MAX_CAPTURE_TOKENS,
               dep.max_num_batched_tokens)


def vllm_capture_sizes(limit: int) -> tuple[int, ...]:
    """vLLM's default capture sizes up to ``limit`` tokens: 1, 2, 4, every 8 to 248, then
    every 16 (and the limit itself)."""
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, limit + 1, 16)]
    return tuple(sorted({x for x in sizes if x <= limit} | {limit}))


def resolve_graphs(dep: DeploymentSheet) -> DeploymentSheet:
    """The deployment with its capture limit and sizes stated: vLLM's defaults where the
    sheet leaves them out (0 and empty)."""
    limit = dep.cuda_graph_max_tokens or vllm_capture_limit(dep)
    buckets = dep.graph_buckets or vllm_capture_sizes(limit)
    return replace(dep, cuda_graph_max_tokens=limit, graph_buckets=buckets)


def table_rows(dep: DeploymentSheet) -> np.ndarray:
    """Captured graph sizes up to the capture limit, then eager rows every quarter of the
    capture limit (at least 64 tokens) up to the token budget."""
    dep = resolve_graphs(dep)
    graphs = [x for x in dep.graph_buckets if x <= dep.cuda_graph_max_tokens]
    top = graphs[-1] if graphs else 0
    stride = max(64, dep.cuda_graph_max_tokens // 4)
    eager = list(range(top + stride, dep.max_num_batched_tokens + stride, stride))
    rows = sorted(set(graphs + [min(x, dep.max_num_batched_tokens) for x in eager]))
    return np.asarray([x for x in rows if x <= max(dep.max_num_batched_tokens, top)], np.int64)


def target_table_s(rows: np.ndarray, hw, m, dep) -> np.ndarray:
    dep = resolve_graphs(dep)
    t = graph_cost_s(rows, hw, m, dep)
    eager = rows > dep.cuda_graph_max_tokens
    t[eager] = t[eager] * dep.eager_slowdown + dep.eager_penalty_ms / 1e3
    return t


def logits_s_per_row(hw: HardwareSheet, m: ModelSheet, dep: DeploymentSheet) -> float:
    """LM head (2 x vocab x hidden FLOPs), three fp32 passes over the vocabulary
    (softmax, sampling, rejection) and the fixed per-row sampling cost."""
    g = dep.gpus_per_replica
    head = 2.0 * m.vocab_size * m.hidden_size / g / (hw.peak_flops * hw.flop_efficiency)
    passes = 3 * 4.0 * m.vocab_size / g / (hw.hbm_bytes_per_s * hw.mem_efficiency)
    return head + passes + dep.sample_us_per_row / 1e6


def attention_terms(hw: HardwareSheet, m: ModelSheet, dep: DeploymentSheet
                    ) -> tuple[float, float, float]:
    """(seconds per query token x attended context token, seconds per context token of
    KV read once per request, seconds per request with a context). Dense attention reads
    each request's whole KV once per step; sparse attention reads the indexer keys of the
    whole context plus the selected window's KV (the block's queries select mostly the
    same tokens, so the window is read about once per request)."""
    g = dep.gpus_per_replica
    per_query_ctx = m.attn_flops_per_ctx_token / g / (hw.peak_flops * hw.attn_efficiency)
    bw = g * hw.hbm_bytes_per_s * hw.mem_efficiency
    if m.sparse_attention:
        return per_query_ctx, m.index_bytes_per_token / bw, \
            m.attn_window_tokens * m.kv_bytes_per_token / bw
    return per_query_ctx, m.kv_bytes_per_token / bw, 0.0


def engine_limits(hw: HardwareSheet, m: ModelSheet, dep: DeploymentSheet) -> EngineLimits:
    """The replica's limits: KV capacity is its HBM after the weights it holds and the
    activation reserve, over the KV bytes per token."""
    g, ep = dep.gpus_per_replica, _ep(dep)
    weights = m.bytes_per_param * m.dense_params + _routed_bpp(m) * m.routed_params * g / ep
    free = g * hw.hbm_bytes * (1.0 - dep.activation_reserve) - weights
    if free <= 0:
        raise InputError("deployment sheet", f"{m.name} does not fit on {g} x {hw.name}: "
                         f"{weights / 1e9:.0f} GB of weights per replica")
    return EngineLimits(max_num_seqs=dep.max_num_seqs,
                        max_num_batched_tokens=dep.max_num_batched_tokens,
                        # a sheet without KV bytes per token cannot size the cache
                        kv_capacity_tokens=int(free // m.kv_bytes_per_token)
                        if m.kv_bytes_per_token > 0 else None,
                        max_model_len=m.max_model_len, prefill=dep.prefill)


def _dense_layer(m: ModelSheet) -> float:
    """Parameters of one dense transformer layer of the model's width (attention + an
    FFN of 3 x 4 x hidden^2 / ... approximated as 12 x hidden^2)."""
    return 12.0 * m.hidden_size ** 2


def _pass_s(params: float, tokens, hw, m, dep, overhead_s: float):
    tokens = np.asarray(tokens, dtype=np.float64)
    g = dep.gpus_per_replica
    mem = m.bytes_per_param * params / g / (hw.hbm_bytes_per_s * hw.mem_efficiency)
    flop = 2.0 * params * tokens / g / (hw.peak_flops * hw.flop_efficiency)
    return overhead_s + np.maximum(mem, flop)


def draft_costs(hw: HardwareSheet, m: ModelSheet, dep: DeploymentSheet,
                batches=(1, 8, 32, 64, 128, 256, 512, 1024)) -> dict[str, DraftCost]:
    """Block (DSpark) drafter and MTP-1 head tables over the drafted requests ``n``."""
    n = np.asarray([x for x in batches if x <= max(dep.max_num_seqs, 1)] or [1], np.float64)
    launch_s = 0.1 * dep.overhead_ms / 1e3  # a drafter pass is a few short graphs
    # a draft row is projected and arg-maxed / sampled once: no rejection pass
    row_s = logits_s_per_row(hw, m, replace(dep, sample_us_per_row=0.0))
    gamma = dep.draft_gamma

    def block(gam: int) -> np.ndarray:
        layers = dep.draft_layers * _pass_s(_dense_layer(m), n * (gam + 1), hw, m, dep, 0.0)
        return launch_s + layers + row_s * n * gam

    width = dep.draft_block_tokens
    if width and width < gamma:
        passes = -(-gamma // width)
        at_ref = passes * block(width)
        # one pass at the checkpoint's block, `passes` at draft_gamma, linear between
        slope = (1.0 - 1.0 / passes) / (gamma - width)
        dspark = DraftCost(n, at_ref, gamma_ref=gamma, gamma_slope=slope, block=False)
    else:
        at_ref, at_next = block(gamma), block(gamma + 1)
        # one slope for the table: the per-token share at the largest batch
        slope = float((at_next[-1] - at_ref[-1]) / at_ref[-1])
        dspark = DraftCost(n, at_ref, gamma_ref=gamma, gamma_slope=slope, block=True)
    mtp_params = m.active_params / max(m.layers, 1)  # one block, with its MoE
    mtp = launch_s + _pass_s(mtp_params, n, hw, m, dep, 0.0) + row_s * n
    return {
        "dspark": dspark,
        "mtp1": DraftCost(n, mtp, gamma_ref=1, gamma_slope=1.0),
    }


def analytic_profile(hw: HardwareSheet, model: ModelSheet, dep: DeploymentSheet, *, name: str,
                     description: str | None = None, notes: dict[str, Any] | None = None,
                     default_trace: str | None = None) -> EngineProfile:
    dep = resolve_graphs(dep)
    rows = table_rows(dep)
    per_query_ctx, per_ctx, per_request = attention_terms(hw, model, dep)
    params = {f"hw_{k}": v for k, v in asdict(hw).items()}
    params |= {f"model_{k}": v for k, v in asdict(model).items()}
    params |= {f"deploy_{k}": (list(v) if isinstance(v, tuple) else v)
               for k, v in asdict(dep).items()}
    params |= notes or {}
    g, ep = dep.gpus_per_replica, _ep(dep)
    drafts = draft_costs(hw, model, dep)
    drafts |= {trace_drafter: drafts[table]
               for trace_drafter, table in DRAFTER_TABLES.get(name, {}).items()}
    layout = (f"{g} GPU(s) per replica" if ep == g else
              f"one data-parallel attention rank of an EP{ep} group (symmetric load)")
    return EngineProfile(
        name=name,
        kind="analytic",
        gpus_per_replica=g,
        tokens=rows,
        step_s=target_table_s(rows, hw, model, dep),
        kv_s_per_token=per_ctx,
        logits_s_per_row=logits_s_per_row(hw, model, dep),
        attn_s_per_query_ctx=per_query_ctx,
        request_s=per_request,
        attn_window_tokens=model.attn_window_tokens if model.attn_window_tokens < (1 << 30)
        else None,
        eager_penalty_s=dep.eager_penalty_ms / 1e3,
        interpolation="step",
        drafts=drafts,
        limits=engine_limits(hw, model, dep),
        description=description or f"Roofline of {model.name} on {hw.name}: {layout} "
                                   "(CUDA-graph buckets, eager beyond)",
        parameters=params,
        default_trace=default_trace,
    )


# -- shipped deployments ----------------------------------------------------------------------

# Coarse capture sizes the shipped deployments below are priced on (their fits and the
# results docs/ states rest on them); a sheet that leaves graph_buckets out gets vLLM's own.
COARSE_GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768,
                        1024, 1536, 2048, 3072, 4096, 6144, 8192)

# DeepSeek's own V4 serving (DSpark §5.3/5.4): data-parallel attention with expert
# parallelism across nodes and disaggregated prefill; each GPU runs a batch of up to a
# few hundred requests (Fig. 8's x axis), so a replica here is one GPU of an EP32 group
# (four 8-GPU nodes). Node-limited routing sends a token's hidden state to at most the
# three other nodes over InfiniBand (ep_remote_copies = 3). overhead_ms (11.5),
# flop_efficiency (0.7: DeepGEMM's FP8 grouped GEMMs at a few hundred tokens per expert)
# and comm_overlap (0.95: DeepEP's two-micro-batch overlap) are FITTED
# (benchmarks/fit_published.py; validation/published.py) to
# MTP-1 reaching ~125 tok/s/user at concurrency 1 (its 120 tok/s/user operational
# boundary, §5.4) and a verification budget of ~4 tokens per request at ~200 concurrent
# requests (Fig. 8); the matched-throughput and SLA-tier gains are held out.
V4_FLASH_DP_EP32 = DeploymentSheet(gpus_per_replica=1, ep_size=32, overhead_ms=11.5,
                                   ep_remote_copies=3.0, comm_overlap=0.95, max_num_seqs=256,
                                   prefill="disaggregated", max_num_batched_tokens=8192,
                                   cuda_graph_max_tokens=2048, eager_penalty_ms=5.0,
                                   graph_buckets=COARSE_GRAPH_BUCKETS,
                                   eager_slowdown=1.2, sample_us_per_row=2.0, draft_layers=1.0,
                                   draft_gamma=7)
V4_FLASH_H200_HW = replace(H200, flop_efficiency=0.7)

# vLLM's adaptive-verification benchmark (vllm-project.github.io, 2026-08-14): V4-Pro,
# TP8 + EP on one 8x B300 node, max-num-seqs 256, max-num-batched-tokens 16384, CUDA
# graphs captured up to 1024 tokens. Overhead, efficiency and the eager slowdown are
# FITTED to its no-speculation and fixed-7 throughput at concurrency 256 and its
# concurrency-1 speed (benchmarks/fit_published.py); the rest of its figures are held out.
# The fitted overhead and per-token terms carry the TP all-reduces (no separate term).
V4_PRO_B300_TP8 = DeploymentSheet(gpus_per_replica=8, ep_size=8, overhead_ms=9.0,
                                  per_token_overhead_us=20.0, tp_allreduces_per_layer=0.0,
                                  comm_overlap=0.0, max_num_seqs=256,
                                  max_num_batched_tokens=16384, cuda_graph_max_tokens=1024,
                                  graph_buckets=(1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128,
                                                 160, 192, 224, 256, 320, 384, 448, 512,
                                                 640, 768, 896, 1024),
                                  eager_penalty_ms=80.0, eager_slowdown=2.5,
                                  sample_us_per_row=10.0, draft_layers=1.0, draft_gamma=7)
V4_PRO_B300_HW = replace(B300, flop_efficiency=0.3)

# The same post's primary figure (Figure 3, fig3-pareto.svg; PUBLISHED_FIGURES.md "vLLM
# adaptive verification, primary figure"): DeepSeek-V4-Flash, TP4 attention + EP4 experts
# on 4x B300 (no data-parallel ranks: every GPU holds the batch and the experts' outputs
# are combined in the layer's all-reduce), FP8 KV, max_model_len 8192, max_num_seqs 256,
# max_cudagraph_capture_size 1024 (vLLM's capture sizes up to it; a step past it runs
# eager). From the sheets: B300's HBM, FP8 peak and NVLink; the model's shapes; two
# all-reduces per layer. FITTED (benchmarks/fit_published.py) to no speculation at every
# concurrency and fixed k = 5 at concurrency 1-64 and 256 (validation/published.py): what
# the sheets cannot know, the step's fixed and per-token overheads, the achieved HBM
# bandwidth and the eager steps' cost (and the trace's served tau, traces/synth.py).
# Fixed k = 7 everywhere, fixed k = 5 at 128 and adaptive are held out. An eager step
# (past the 1,024-token capture limit: 128 x 8 verify tokens plus any prompt) runs the same
# kernels without a graph, so it costs its graph cost plus the host's launches of the
# whole forward (eager_slowdown 1, eager_penalty_ms ~1.3 ms per layer): the one fitted
# eager point (fixed k = 5 at 256) cannot split a penalty from a slowdown, and a penalty
# alone fits it best.
V4_FLASH_B300_TP4 = DeploymentSheet(gpus_per_replica=4, ep_size=4, ep_all_to_all=False,
                                    overhead_ms=4.5, per_token_overhead_us=33.0,
                                    max_num_seqs=256, max_num_batched_tokens=8192,
                                    cuda_graph_max_tokens=1024, eager_slowdown=1.0,
                                    eager_penalty_ms=57.5, sample_us_per_row=0.0,
                                    draft_layers=1.0, draft_gamma=7, draft_block_tokens=5)
V4_FLASH_B300_HW = replace(B300, mem_efficiency=0.45, flop_efficiency=0.55)

# SGLang's adaptive-speculation benchmark (PR #23336; AutoSpec, PR #22246): GLM-4.7-FP8
# with its MTP layer as an EAGLE-style chain (topk 1), one engine over TP8, chunked
# prefill, CUDA graphs. The PRs do not name the GPUs: ASSUMED one 8x H20 node (the
# series' other runs are on H20; 8 x 96 GB holds the 353 GB of FP8 weights). The MoE
# runs tensor-parallel (no all-to-all; the EP terms stand in for the all-reduces).
# overhead_ms, per_token_overhead_us and sample_us_per_row are FITTED
# (benchmarks/fit_published.py) to no speculation, k = 1 and k = 3 at concurrency 2;
# flop_efficiency 0.3 is carried over from v4pro-b300 (the other fitted TP8 node; the
# fitted points are all memory-bound and cannot pin it). k = 7, the adaptive arm and the
# best k at batch 1 and 64 are held out (validation/published.py).
# SGLang captures a verify graph per (batch size, draft tokens) tier, so a step is not
# padded to a power of two of tokens (k = 4 at batch 1 is not priced as k = 7): buckets
# every token up to 64, then every 8, 32 and 128.
_FINE_BUCKETS = (*range(1, 64), *range(64, 512, 8), *range(512, 2048, 32),
                 *range(2048, 8193, 128))
# The fitted overhead carries the TP all-reduces (no separate term).
GLM47_H20_TP8 = DeploymentSheet(gpus_per_replica=8, ep_size=8, overhead_ms=2.25,
                                tp_allreduces_per_layer=0.0,
                                per_token_overhead_us=0.0, comm_overlap=0.0, max_num_seqs=256,
                                max_num_batched_tokens=8192, cuda_graph_max_tokens=8192,
                                graph_buckets=_FINE_BUCKETS, sample_us_per_row=0.0,
                                draft_layers=1.0, draft_gamma=7)
GLM47_H20_HW = replace(H20, flop_efficiency=0.3)
# Trace drafters a profile prices with one of its own tables: the MTP layer of GLM-4.7
# drafts autoregressively, one pass per token (the MTP head's table), not as a block.
DRAFTER_TABLES: dict[str, dict[str, str]] = {"glm47-h20": {"glm47-mtp": "mtp1"}}
# The acceptance trace a profile's run replays when it names none (its [profile]
# default_trace): the drafter its published figures were measured with, on their prompts.
# v4flash-b300 and v4pro-b300 are fitted to vLLM's SPEED-Bench runs with those traces, so
# the package default (dspark-synthetic, tau 3.5-5.6 by domain) cannot give their figures.
# The DSpark-production V4-Flash profiles (v4flash-h200, the package's default profile,
# and the h100 / b200 ones priced on its deployment) keep the package default: their
# published setup sets gamma 5 over dspark-v4flash-synthetic's single domain, and moving
# every default run (the README's, the stored golden runs, --domain chat / code / math)
# onto it is a change of the package's default, not of one profile.
DEFAULT_TRACES: dict[str, str] = {"v4flash-b300": "dspark-v4flash-speedbench-synthetic",
                                  "v4pro-b300": "dspark-v4pro-synthetic"}

# Analytic (not fitted) deployments. The MoE ones carry over the V4-Flash fit's
# efficiency and overlap (same serving stack, other hardware or model): on Hopper a
# DP-attention rank of an EP32 group over InfiniBand, on B200 a rank of one EP8 node over
# NVLink; the dense model on one GPU with chunked prefill.
_MOE_HOPPER_EP32 = replace(V4_FLASH_DP_EP32)
_MOE_B200_EP8 = replace(V4_FLASH_DP_EP32, ep_size=8, ep_remote_copies=0.0, overhead_ms=9.0)
_DENSE_ONE_GPU = DeploymentSheet(gpus_per_replica=1, overhead_ms=1.5, per_token_overhead_us=2.0,
                                 eager_penalty_ms=2.0, cuda_graph_max_tokens=512,
                                 graph_buckets=COARSE_GRAPH_BUCKETS,
                                 eager_slowdown=1.1, sample_us_per_row=2.0, draft_layers=5.0)
_MOE_EFF = V4_FLASH_H200_HW.flop_efficiency  # MoE decode GEMMs run far below peak
_DENSE_EFF = 0.55


def builtin_analytic_specs() -> dict[str, tuple[HardwareSheet, ModelSheet, DeploymentSheet]]:
    """Name -> (hardware, model, deployment) of every shipped analytic profile."""
    moe = {"H100": replace(H100, flop_efficiency=_MOE_EFF), "H200": V4_FLASH_H200_HW,
           "B200": replace(B200, flop_efficiency=_MOE_EFF)}  # one efficiency for MoE decode
    m = MODELS
    return {
        "v4flash-h100": (moe["H100"], m["v4flash"], _MOE_HOPPER_EP32),
        "v4flash-h200": (V4_FLASH_H200_HW, m["v4flash"], V4_FLASH_DP_EP32),
        "v4flash-b200": (moe["B200"], m["v4flash"], _MOE_B200_EP8),
        "v4pro-b300": (V4_PRO_B300_HW, m["v4pro"], V4_PRO_B300_TP8),
        "v4flash-b300": (V4_FLASH_B300_HW, replace(m["v4flash"], max_model_len=8192),
                         V4_FLASH_B300_TP4),
        "glm47-h20": (GLM47_H20_HW, m["glm47"], GLM47_H20_TP8),
        "v3-h100": (moe["H100"], m["v3"], _MOE_HOPPER_EP32),
        "v3-h200": (moe["H200"], m["v3"], _MOE_HOPPER_EP32),
        "v3-b200": (moe["B200"], m["v3"], _MOE_B200_EP8),
        "qwen3-8b-h100": (replace(H100_BF16, flop_efficiency=_DENSE_EFF), m["qwen3-8b"],
                          _DENSE_ONE_GPU),
        "qwen3-8b-h200": (replace(H200_BF16, flop_efficiency=_DENSE_EFF), m["qwen3-8b"],
                          _DENSE_ONE_GPU),
        "qwen3-8b-b200": (replace(B200_BF16, flop_efficiency=_DENSE_EFF), m["qwen3-8b"],
                          _DENSE_ONE_GPU),
    }


# What each shipped profile was fitted to and what it reproduces without being fitted
# (tests/validation/test_published.py checks every line; docs/profiles.md prints them).
PUBLISHED_POINTS: dict[str, dict[str, list[str]]] = {}


def builtin_analytic_profile(name: str) -> EngineProfile:
    specs = builtin_analytic_specs()
    if name not in specs:
        raise InputError("--profile", f"no analytic spec {name!r}; known: {', '.join(specs)}")
    hw, model, dep = specs[name]
    notes = {f"fitted_to_{i}": s for i, s in enumerate(PUBLISHED_POINTS.get(name, {})
                                                        .get("fitted", []))}
    return analytic_profile(hw, model, dep, name=name, notes=notes,
                            default_trace=DEFAULT_TRACES.get(name))


def default_profile() -> EngineProfile:
    """The embedded default: a V4-Flash-like DP-attention rank of an EP32 H200 group."""
    return builtin_analytic_profile("v4flash-h200")


# Shipped profiles built from a sheet file alone (calibration/data/sheets/<name>.sheet.toml,
# each stating its sources): hardware no published point covers, nothing fitted.
SHEET_PROFILES = ("llama31-70b-4xh100", "v4pro-8xmi350x")


def sheet_profile_path(name: str) -> Path:
    return Path(str(resources.files("dspark_sim.calibration") / "data" / "sheets"
                    / f"{name}.sheet.toml"))


def write_builtin_profiles(out_dir: str | Path | None = None) -> list[Path]:
    """(Re)write the shipped analytic profile files: the built-in specs and the sheet-only
    profiles (:data:`SHEET_PROFILES`)."""
    from dspark_sim.io import write_text_atomic

    root = Path(out_dir) if out_dir is not None else Path(
        str(resources.files("dspark_sim.calibration") / "data"))
    written = [write_text_atomic(root / f"{name}.toml", builtin_analytic_profile(name).to_toml())
               for name in builtin_analytic_specs()]
    return written + [write_text_atomic(root / f"{name}.toml",
                                        profile_from_sheets(sheet_profile_path(name)).to_toml())
                      for name in SHEET_PROFILES]


# -- sheets from files -----------------------------------------------------------------------


_INT_FIELDS = {"experts", "top_k", "layers", "attn_window_tokens", "gpus_per_replica",
               "ep_size", "cuda_graph_max_tokens", "max_num_seqs", "max_num_batched_tokens",
               "hidden_size", "vocab_size", "max_model_len", "draft_gamma",
               "draft_block_tokens"}
_BOOL_FIELDS = {"sparse_attention", "ep_all_to_all"}
# integer fields whose 0 means "the default" (documented on DeploymentSheet)
ZERO_MEANS_DEFAULT = {"ep_size", "cuda_graph_max_tokens", "draft_block_tokens"}


def _sheet(cls, where: str, table: Any, defaults: dict[str, Any] | None = None):
    """Validate a sheet table against dataclass ``cls`` (unknown/missing keys, types)."""
    if not isinstance(table, dict):
        raise InputError(where, "must be a table")
    known = {f.name: f for f in fields(cls)}
    check_known_keys(where, table, known)
    merged = dict(defaults or {}) | dict(table)
    missing = [k for k, f in known.items()
               if k not in merged and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise InputError(where, f"missing key(s) {', '.join(missing)}")
    for k, v in merged.items():
        if k == "name":
            merged[k] = str(v)
        elif k == "graph_buckets":
            try:
                b = tuple(int(x) for x in v)
            except (TypeError, ValueError) as exc:
                raise InputError(where, "graph_buckets must be a list of integers") from exc
            if not b or b[0] <= 0 or any(y <= x for x, y in zip(b, b[1:], strict=False)):
                # leave the key out for vLLM's own capture sizes
                raise InputError(where, "graph_buckets must be strictly increasing positive integers")
            merged[k] = b
        elif k == "prefill":
            if v not in ("chunked", "disaggregated"):
                raise InputError(where, f"'prefill' must be chunked or disaggregated, got {v!r}")
        elif k in _BOOL_FIELDS:
            if not isinstance(v, bool):
                raise InputError(where, f"'{k}' must be true or false, got {v!r}")
        elif isinstance(v, bool) or not isinstance(v, int | float) or not np.isfinite(v) or v < 0:
            raise InputError(where, f"'{k}' must be a finite number >= 0, got {v!r}")
        elif k in _INT_FIELDS:
            if not float(v).is_integer() or (v < 1 and k not in ZERO_MEANS_DEFAULT):
                raise InputError(where, f"'{k}' must be a positive integer, got {v!r}")
            merged[k] = int(v)
        else:
            merged[k] = float(v)
    for k in ("comm_overlap", "activation_reserve"):
        if k in merged and not 0.0 <= merged[k] < 1.0:
            raise InputError(where, f"'{k}' must lie in [0, 1), got {merged[k]!r}")
    for k in ("mem_efficiency", "flop_efficiency"):
        if k in merged and not 0.0 < merged[k] <= 1.0:
            raise InputError(where, f"'{k}' must lie in (0, 1], got {merged[k]!r}")
    return cls(**merged)


def _load_model_presets() -> dict[str, ModelSheet]:
    path = resources.files("dspark_sim.calibration") / "data" / "sheets" / "models.toml"
    where = "calibration/data/sheets/models.toml"
    return {key: _sheet(ModelSheet, f"{where} [{key}]", table)
            for key, table in read_toml(Path(str(path)), "model presets").items()}


MODELS.update(_load_model_presets())


def model_sheet_from_hf_config(cfg: dict[str, Any], *, bytes_per_param: float | None = None,
                               name: str | None = None) -> ModelSheet:
    """A ModelSheet from a Hugging Face ``config.json`` dict: dense Llama/Qwen-style
    decoders (GQA) and DeepSeek-V3-style MoE with MLA. Parameter counts are computed
    from the shapes (embeddings counted once per step as read)."""
    try:
        h = int(cfg["hidden_size"])
        n_layers = int(cfg["num_hidden_layers"])
        vocab = int(cfg["vocab_size"])
        heads = int(cfg["num_attention_heads"])
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError("hf_config", f"missing or bad field {exc}") from exc
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or h // heads)
    tied = bool(cfg.get("tie_word_embeddings", False))
    embed = vocab * h * (1 if tied else 2)
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    bpp = bytes_per_param or (1.0 if "float8" in dtype or cfg.get("quantization_config") else
                              4.0 if dtype == "float32" else 2.0)
    if "kv_lora_rank" in cfg:  # MLA (DeepSeek-V2/V3 style)
        q_rank = cfg.get("q_lora_rank") or 0
        rope, nope = int(cfg.get("qk_rope_head_dim", 64)), int(cfg.get("qk_nope_head_dim", 128))
        v_dim, kv_rank = int(cfg.get("v_head_dim", 128)), int(cfg["kv_lora_rank"])
        q_proj = (h * q_rank + q_rank * heads * (nope + rope)) if q_rank else h * heads * (nope + rope)
        attn = q_proj + h * (kv_rank + rope) + kv_rank * heads * (nope + v_dim) + heads * v_dim * h
        kv_bytes = n_layers * (kv_rank + rope) * 2.0
        attn_flops = n_layers * 2.0 * heads * (2 * kv_rank + rope)
    else:
        attn = h * head_dim * (heads + 2 * kv_heads) + heads * head_dim * h
        kv_bytes = n_layers * 2 * kv_heads * head_dim * 2.0
        attn_flops = n_layers * 4.0 * heads * head_dim
    experts = int(cfg.get("n_routed_experts") or cfg.get("num_experts") or 0)
    if experts:
        top_k = int(cfg.get("num_experts_per_tok", 1))
        moe_ffn = 3 * h * int(cfg.get("moe_intermediate_size"))
        dense_layers = int(cfg.get("first_k_dense_replace", 0))
        moe_layers = n_layers - dense_layers
        shared = int(cfg.get("n_shared_experts") or 0) * moe_ffn
        dense_ffn = 3 * h * int(cfg.get("intermediate_size", 0))
        routed = moe_layers * experts * moe_ffn
        dense = embed + n_layers * attn + dense_layers * dense_ffn + moe_layers * shared
        active = dense + moe_layers * top_k * moe_ffn
    else:
        top_k, experts, routed = 1, 1, 0.0
        dense = embed + n_layers * (attn + 3 * h * int(cfg["intermediate_size"]))
        active = dense
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    max_len = int(cfg.get("max_position_embeddings") or 131072)
    return ModelSheet(
        name=name or str(cfg.get("_name_or_path") or cfg.get("model_type", "hf-model")),
        active_params=float(active),
        dense_params=float(dense),
        routed_params=float(routed),
        experts=experts,
        top_k=top_k,
        layers=n_layers,
        bytes_per_param=float(bpp),
        kv_bytes_per_token=float(kv_bytes),
        attn_flops_per_ctx_token=float(attn_flops),
        attn_window_tokens=int(window) if window else 1 << 30,
        hidden_size=h,
        vocab_size=vocab,
        max_model_len=max_len,
    )


def _hardware_sheet(hw_spec: Any, source: str) -> HardwareSheet:
    """The ``[hardware]`` table, or the preset ``hardware = "NAME"`` names."""
    if isinstance(hw_spec, str):
        if hw_spec not in HARDWARE:
            raise InputError(source, f"unknown hardware {hw_spec!r}; presets: {', '.join(HARDWARE)}")
        return HARDWARE[hw_spec]
    if hw_spec is None:
        raise InputError(source, "missing [hardware] table")
    return _sheet(HardwareSheet, f"{source} [hardware]", hw_spec)


def _model_sheet(m_spec: Any, source: str, base: Path) -> ModelSheet:
    """The ``[model]`` table: a preset name, fields, or ``hf_config`` (relative to the
    sheet's folder) plus overrides."""
    if isinstance(m_spec, str):
        if m_spec not in MODELS:
            raise InputError(source, f"unknown model {m_spec!r}; presets: {', '.join(MODELS)}")
        return MODELS[m_spec]
    if isinstance(m_spec, dict) and "hf_config" in m_spec:
        cfg_path = Path(str(m_spec["hf_config"]))
        cfg_path = cfg_path if cfg_path.is_absolute() else base / cfg_path
        try:
            cfg = loads_json(cfg_path.read_text(encoding="utf-8-sig"))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InputError(str(cfg_path), f"cannot read HF config ({exc})") from exc
        check_hf_config(cfg, str(cfg_path))
        derived = asdict(model_sheet_from_hf_config(cfg))
        overrides = {k: v for k, v in m_spec.items() if k != "hf_config"}
        return _sheet(ModelSheet, f"{source} [model]", overrides, derived)
    if m_spec is None:
        raise InputError(source, "missing [model] table")
    return _sheet(ModelSheet, f"{source} [model]", m_spec)


def profile_from_sheets(spec: str | Path | dict[str, Any], name: str | None = None) -> EngineProfile:
    """Build an analytic profile from a sheet file (TOML) or an already parsed dict.

    Tables: ``[hardware]`` (HardwareSheet fields, or ``hardware = "H100"`` naming a preset
    in :data:`HARDWARE`), ``[model]`` (ModelSheet fields, or ``hf_config = "config.json"``
    plus optional overrides, or ``model = "v3"`` naming a preset in :data:`MODELS`),
    ``[deployment]`` (DeploymentSheet fields); optionally ``default_trace``, the model's
    drafter trace (a built-in name or a parquet path relative to the sheet) that runs on
    the profile replay when they name none. Raises :class:`InputError` naming the file."""
    source = "<sheets>"
    base = Path(".")
    if isinstance(spec, str | Path):
        p = Path(spec)
        source, base = str(p), p.parent
        data = read_toml(p, "sheet file")
    elif isinstance(spec, dict):
        data = spec
    else:
        raise InputError(source, "expected a path or a dict")
    if not isinstance(data, dict):
        raise InputError(source, "expected a table")
    check_known_keys(source, data, SHEET_KEYS)
    hw_spec = data.get("hardware")
    hw = _hardware_sheet(hw_spec, source)
    model = _model_sheet(data.get("model"), source, base)
    dep = _sheet(DeploymentSheet, f"{source} [deployment]", data.get("deployment", {}))
    precision = gemm_precision(model, data.get("precision"), source)
    if isinstance(hw_spec, str) and hw_spec in PEAK_FLOPS:
        peaks = PEAK_FLOPS[hw_spec]
        if precision not in peaks:
            raise InputError(source, f"precision {precision!r}: the {hw_spec} preset has peaks "
                                     f"for {', '.join(peaks)}")
        hw = replace(hw, peak_flops=peaks[precision])
    check_units(source, hw, model, data.get("deployment", {}))
    if _ep(dep) < dep.gpus_per_replica:
        raise InputError(f"{source} [deployment]", "ep_size must be 0 or >= gpus_per_replica")
    if not math.isfinite(dep.eager_slowdown) or dep.eager_slowdown < 1.0:
        raise InputError(f"{source} [deployment]", "eager_slowdown must be >= 1")
    prof_name = name or str(data.get("name") or Path(source).stem)
    # the model's drafter trace, named in the profile it implies ([profile] default_trace)
    default_trace = (check_default_trace(source, data["default_trace"],
                                         base if isinstance(spec, str | Path) else None)
                     if "default_trace" in data else None)
    # Each field can be a finite number >= 0 while the arithmetic they feed is not (a zero
    # bandwidth divides by zero, 1e308 bytes per parameter overflows to inf, then NaN):
    # any such step refuses the sheet in one line instead of a traceback or a warning.
    try:
        # underflow is not refused: (1 - top_k / experts) ** tokens, the chance an expert
        # stays untouched, goes to 0 at large batches, which is the right limit
        with np.errstate(over="raise", divide="raise", invalid="raise", under="ignore"):
            prof = analytic_profile(hw, model, dep, name=prof_name, default_trace=default_trace)
    except InputError as exc:
        if exc.where != "deployment sheet":
            raise
        raise InputError(source, exc.problem) from None
    except (ArithmeticError, FloatingPointError, ValueError) as exc:
        raise InputError(source, f"its numbers imply no profile ({exc})") from None
    # Every field of a sheet can be sane while what they imply is not a profile (a million
    # GPUs per replica: a KV capacity past the engine's limit): refuse it here, naming the
    # sheet, rather than write a profile file nothing can load.
    profile_from_dict(tomllib.loads(prof.to_toml()), f"{source}: the profile it implies")
    summary = sheet_summary(hw, model, resolve_graphs(dep), precision,
                            hw_spec if isinstance(hw_spec, str) else None,
                            stated=set(data.get("deployment", {})))
    return replace(prof, parameters={**prof.parameters, "sheet_summary": summary})


SHEET_KEYS = {"name", "hardware", "model", "deployment", "precision", "default_trace"}
PRECISIONS = ("bf16", "fp8", "fp4")


def gemm_precision(m: ModelSheet, stated: Any, source: str) -> str:
    """The precision the model's GEMMs run in: the sheet's ``precision`` if it states one,
    else BF16 for 2-byte (or wider) weights and FP8 for 1-byte and narrower ones (FP4 or
    INT4 weights dequantise to FP8 or BF16 activations; a sheet whose GEMMs run FP4
    says ``precision = "fp4"``)."""
    if stated is not None:
        if stated not in PRECISIONS:
            raise InputError(source, f"'precision' must be one of {', '.join(PRECISIONS)}, "
                                     f"got {stated!r}")
        return str(stated)
    return "bf16" if m.bytes_per_param >= 2.0 else "fp8"


# Plausible ranges, in the units the sheet's fields carry: a number outside is almost
# always a unit slip (TB/s written as 3.35, TFLOP/s as 989, GB as 80, billions of
# parameters as 70, bits per parameter as 16, seconds as milliseconds).
UNIT_RANGES: dict[str, tuple[float, float, str]] = {
    "hbm_bytes_per_s": (1e10, 1e14, "bytes per second (3.35 TB/s is 3.35e12)"),
    "peak_flops": (1e12, 1e17, "FLOP/s (989 TFLOP/s is 0.989e15)"),
    "hbm_bytes": (1e9, 1e13, "bytes (80 GB is 80e9)"),
    "interconnect_bytes_per_s": (1e9, 1e13, "bytes per second (450 GB/s is 450e9)"),
    "tp_link_bytes_per_s": (1e9, 1e13, "bytes per second (450 GB/s is 450e9)"),
    "allreduce_latency_us": (0.0, 1000.0, "microseconds (8 us is 8.0)"),
    "active_params": (1e6, 1e14, "parameters (70B is 70e9)"),
    "dense_params": (1e6, 1e14, "parameters (70B is 70e9)"),
    "bytes_per_param": (0.25, 4.0, "bytes per parameter (BF16 2, FP8 1, FP4 0.5)"),
    "kv_bytes_per_token": (0.0, 1e8, "bytes per context token over all layers"),
    "overhead_ms": (0.0, 1000.0, "milliseconds (1.5 ms is 1.5)"),
    "per_token_overhead_us": (0.0, 10000.0, "microseconds per batch token"),
    "eager_penalty_ms": (0.0, 10000.0, "milliseconds"),
}


def check_units(source: str, hw: HardwareSheet, m: ModelSheet, dep_table: Any) -> None:
    """Refuse a sheet number outside its field's plausible range (:data:`UNIT_RANGES`),
    naming the field and the unit it is in."""
    values = {**asdict(hw), **asdict(m)}
    if isinstance(dep_table, dict):
        values |= {k: v for k, v in dep_table.items() if k in UNIT_RANGES}
    for key, (lo, hi, unit) in UNIT_RANGES.items():
        v = values.get(key)
        if v is None or (key == "tp_link_bytes_per_s" and v == 0):  # 0: the default link
            continue
        if not lo <= float(v) <= hi:
            raise InputError(source, f"'{key}' = {v!r} is outside {lo:g}-{hi:g}: it is in "
                                     f"{unit}; a wrong unit?")


def sheet_summary(hw: HardwareSheet, m: ModelSheet, dep: DeploymentSheet, precision: str,
                  preset: str | None, stated: set[str]) -> str:
    """The assumptions a sheet's profile rests on, in one line: the peak it priced the
    GEMMs at, the capture limit, the fixed overhead and the all-reduce term (each said to
    be the sheet's or a default)."""
    where = (f"the {preset} preset's dense {precision.upper()} peak" if preset in PEAK_FLOPS
             else f"the {preset} preset" if preset else "the [hardware] table")
    limit = dep.cuda_graph_max_tokens
    graphs = ("as the sheet states" if "cuda_graph_max_tokens" in stated else
              f"vLLM's default max_cudagraph_capture_size, min(max_num_seqs x "
              f"(1 + {dep.draft_gamma}) x 2, {VLLM_MAX_CAPTURE_TOKENS}, "
              f"max_num_batched_tokens)")
    over = ("the sheet's" if "overhead_ms" in stated else
            "default; fit it with dspark-sim calibrate vllm")
    g = dep.gpus_per_replica
    if g > 1 and dep.tp_allreduces_per_layer:
        link = hw.tp_link_bytes_per_s or hw.interconnect_bytes_per_s
        ar = (f"TP{g} all-reduce {dep.tp_allreduces_per_layer:g} per layer x {m.layers} "
              f"layers at {hw.allreduce_latency_us:g} us + {link / 1e9:g} GB/s")
    else:
        ar = "no TP all-reduce term" + (" (tp_allreduces_per_layer = 0)" if g > 1 else "")
    return (f"peak {hw.peak_flops / 1e12:,.0f} TFLOP/s ({where}); CUDA graphs up to "
            f"{limit:,} tokens ({graphs}); overhead {dep.overhead_ms:g} ms ({over}); {ar}")


def refine_sheet(sheet: str | Path, fitted: EngineProfile) -> dict[str, float]:
    """What a sheet's ``[deployment] overhead_ms`` becomes once a deployment is measured:
    ``fitted`` is the profile ``dspark-sim calibrate vllm`` fitted to that deployment's
    bench-serve runs. The sheet's overhead is moved by the difference between the two
    profiles' one-request decode step (the table at one token, the per-request cost and
    one logit row), so the sheet keeps its terms (weights, all-reduces, the graph
    staircase) and takes the measured step's fixed cost. Returns the old and the new
    overhead and both steps, in ms."""
    prof = profile_from_sheets(sheet)

    def one_request_ms(p: EngineProfile) -> float:
        table = float(p.target_time_s(np.array([1]))[0])
        return 1e3 * (table + p.request_s + p.logits_s_per_row)

    old = float(prof.parameters["deploy_overhead_ms"])
    sheet_ms, measured_ms = one_request_ms(prof), one_request_ms(fitted)
    new = old + measured_ms - sheet_ms
    if new < 0:
        raise InputError(str(sheet), f"the measured one-request step ({measured_ms:.3g} ms) is "
                                     f"below the sheet's terms without overhead "
                                     f"({sheet_ms - old:.3g} ms): a bandwidth or peak too low?")
    return {"overhead_ms_was": old, "overhead_ms": new, "sheet_step_ms": sheet_ms,
            "measured_step_ms": measured_ms}
