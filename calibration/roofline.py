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

Built-in analytic profiles (``calibration/data/<model>-<gpu>.toml``): the
DeepSeek-V4-Flash-like MoE (``v4flash``), a DeepSeek-V3-like MoE (``v3``) and a
Qwen3-8B-like dense model (``qwen3-8b``), each on H100, H200 and B200; see
:func:`builtin_analytic_specs` and :func:`write_builtin_profiles`. Any other pair is
built from a sheet file with :func:`profile_from_sheets` (format in docs/profiles.md)::

    name = "my-model-h100"
    [hardware]              # or: hardware = "H100" (a preset of HARDWARE)
    name = "H100"
    hbm_bytes_per_s = 3.35e12
    peak_flops = 1.979e15
    [model]                 # ModelSheet fields, or: hf_config = "path/config.json"
    ...
    [deployment]            # DeploymentSheet fields
    gpus_per_replica = 8
    overhead_ms = 6.0
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from dspark_sim.calibration.profile import DraftCost, EngineProfile
from dspark_sim.errors import InputError
from dspark_sim.io import read_toml


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


# per_token_overhead_us: expert-parallel all-to-all. Dispatch (FP8, 7 KB) and combine
# (BF16, 14 KB) of a token's hidden state to its 6 experts on 43 MoE layers move ~5.4 MB
# per token; 32 GPUs x 50 GB/s of inter-node bandwidth take ~3.4 us/token, of which
# about 40 % overlaps with compute: 2 us/token of exposed communication.
V4_FLASH_H200_DEPLOYMENT = DeploymentSheet(gpus_per_replica=32, overhead_ms=9.0,
                                           per_token_overhead_us=2.0)


def default_profile() -> EngineProfile:
    """The embedded default: V4-Flash-like MoE on 32x H200 per replica (EP32)."""
    return analytic_profile(H200, V4_FLASH_LIKE, V4_FLASH_H200_DEPLOYMENT, name="v4flash-h200")


# -- more hardware and models ----------------------------------------------------------------

# BF16 dense peaks, for models served in BF16 (the FP8 sheets above are for FP8 weights).
H100_BF16 = HardwareSheet("H100", hbm_bytes_per_s=3.35e12, peak_flops=0.989e15)
H200_BF16 = HardwareSheet("H200", hbm_bytes_per_s=4.8e12, peak_flops=0.989e15)
B200_BF16 = HardwareSheet("B200", hbm_bytes_per_s=8.0e12, peak_flops=2.25e15)

HARDWARE: dict[str, HardwareSheet] = {
    "H100": H100, "H200": H200, "B200": B200,
    "H100-bf16": H100_BF16, "H200-bf16": H200_BF16, "B200-bf16": B200_BF16,
}

# DeepSeek-V3-like MoE: 671B total / 37B active, 256 routed experts top-8 over 58 MoE
# layers (+3 dense), FP8 weights, MLA KV (512 + 64 latent dims x 61 layers, BF16) and
# full attention (no sparse window).
V3_LIKE = ModelSheet(
    name="DeepSeek-V3-like MoE (671B total, 37B active)",
    active_params=37e9,
    dense_params=16.5e9,
    routed_params=654.5e9,
    experts=256,
    top_k=8,
    layers=61,
    bytes_per_param=1.0,
    kv_bytes_per_token=70.3e3,
    attn_flops_per_ctx_token=17e6,
)

# Qwen3-8B-like dense model: 8.2B parameters, 36 layers, GQA 32/8 heads of 128, BF16.
QWEN3_8B_LIKE = ModelSheet(
    name="Qwen3-8B-like dense (8.2B)",
    active_params=8.2e9,
    dense_params=8.2e9,
    routed_params=0.0,
    layers=36,
    bytes_per_param=2.0,
    kv_bytes_per_token=147.5e3,
    attn_flops_per_ctx_token=0.59e6,
)

MODELS: dict[str, ModelSheet] = {"v4flash": V4_FLASH_LIKE, "v3": V3_LIKE, "qwen3-8b": QWEN3_8B_LIKE}

# Deployments (assumptions, documented in docs/profiles.md): the MoEs run expert-parallel
# over two 8-GPU nodes on Hopper and one 8-GPU node on B200 (192 GB each); the dense model
# runs on one GPU. The fixed overhead is the per-step launch + collective + sampling cost.
_MOE_TWO_NODES = V4_FLASH_H200_DEPLOYMENT
_MOE_ONE_NODE = DeploymentSheet(gpus_per_replica=8, overhead_ms=7.0, per_token_overhead_us=0.5)
_DENSE_ONE_GPU = DeploymentSheet(gpus_per_replica=1, overhead_ms=1.5, per_token_overhead_us=2.0,
                                 eager_penalty_ms=2.0, draft_layers=5)


def builtin_analytic_specs() -> dict[str, tuple[HardwareSheet, ModelSheet, DeploymentSheet]]:
    """Name -> (hardware, model, deployment) of every shipped analytic profile."""
    return {
        "v4flash-h100": (H100, V4_FLASH_LIKE, _MOE_TWO_NODES),
        "v4flash-h200": (H200, V4_FLASH_LIKE, V4_FLASH_H200_DEPLOYMENT),
        "v4flash-b200": (B200, V4_FLASH_LIKE, _MOE_ONE_NODE),
        "v3-h100": (H100, V3_LIKE, _MOE_TWO_NODES),
        "v3-h200": (H200, V3_LIKE, _MOE_TWO_NODES),
        "v3-b200": (B200, V3_LIKE, _MOE_ONE_NODE),
        "qwen3-8b-h100": (H100_BF16, QWEN3_8B_LIKE, _DENSE_ONE_GPU),
        "qwen3-8b-h200": (H200_BF16, QWEN3_8B_LIKE, _DENSE_ONE_GPU),
        "qwen3-8b-b200": (B200_BF16, QWEN3_8B_LIKE, _DENSE_ONE_GPU),
    }


def builtin_analytic_profile(name: str) -> EngineProfile:
    specs = builtin_analytic_specs()
    if name not in specs:
        raise InputError("--profile", f"no analytic spec {name!r}; known: {', '.join(specs)}")
    if name == "v4flash-h200":
        return default_profile()
    hw, model, dep = specs[name]
    return analytic_profile(hw, model, dep, name=name)


def write_builtin_profiles(out_dir: str | Path | None = None) -> list[Path]:
    """(Re)write the shipped analytic profile files. ``v4flash-h200.toml`` (the simulator
    default) is only rewritten when its bytes would not change."""
    from dspark_sim.io import write_text_atomic

    root = Path(out_dir) if out_dir is not None else Path(
        str(resources.files("dspark_sim.calibration") / "data"))
    written = []
    for name in builtin_analytic_specs():
        path = root / f"{name}.toml"
        text = builtin_analytic_profile(name).to_toml()
        if name == "v4flash-h200" and path.exists():
            if path.read_text() != text:
                raise RuntimeError(f"{path}: regenerated default profile differs; not overwritten")
            continue
        written.append(write_text_atomic(path, text))
    return written


# -- sheets from files -----------------------------------------------------------------------


_INT_FIELDS = {"experts", "top_k", "layers", "attn_window_tokens", "gpus_per_replica",
               "reference_context_tokens", "draft_layers"}


def _sheet(cls, where: str, table: Any, defaults: dict[str, Any] | None = None):
    """Validate a sheet table against dataclass ``cls`` (unknown/missing keys, types)."""
    if not isinstance(table, dict):
        raise InputError(where, "must be a table")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise InputError(where, f"unknown key(s) {', '.join(unknown)}; known: {', '.join(known)}")
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
                raise InputError(where, "graph_buckets must be strictly increasing positive integers")
            merged[k] = b
        elif isinstance(v, bool) or not isinstance(v, int | float) or not np.isfinite(v) or v < 0:
            raise InputError(where, f"'{k}' must be a finite number >= 0, got {v!r}")
        elif k in _INT_FIELDS:
            if not float(v).is_integer() or v < 1:
                raise InputError(where, f"'{k}' must be a positive integer, got {v!r}")
            merged[k] = int(v)
        else:
            merged[k] = float(v)
    return cls(**merged)


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
    )


def profile_from_sheets(spec: str | Path | dict[str, Any], name: str | None = None) -> EngineProfile:
    """Build an analytic profile from a sheet file (TOML) or an already parsed dict.

    Tables: ``[hardware]`` (HardwareSheet fields, or ``hardware = "H100"`` naming a preset
    in :data:`HARDWARE`), ``[model]`` (ModelSheet fields, or ``hf_config = "config.json"``
    plus optional overrides, or ``model = "v3"`` naming a preset in :data:`MODELS`),
    ``[deployment]`` (DeploymentSheet fields). Raises :class:`InputError` naming the file."""
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
    hw_spec = data.get("hardware")
    if isinstance(hw_spec, str):
        if hw_spec not in HARDWARE:
            raise InputError(source, f"unknown hardware {hw_spec!r}; presets: {', '.join(HARDWARE)}")
        hw = HARDWARE[hw_spec]
    elif hw_spec is None:
        raise InputError(source, "missing [hardware] table")
    else:
        hw = _sheet(HardwareSheet, f"{source} [hardware]", hw_spec)
    m_spec = data.get("model")
    if isinstance(m_spec, str):
        if m_spec not in MODELS:
            raise InputError(source, f"unknown model {m_spec!r}; presets: {', '.join(MODELS)}")
        model = MODELS[m_spec]
    elif isinstance(m_spec, dict) and "hf_config" in m_spec:
        cfg_path = Path(str(m_spec["hf_config"]))
        cfg_path = cfg_path if cfg_path.is_absolute() else base / cfg_path
        try:
            cfg = json.loads(cfg_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise InputError(str(cfg_path), f"cannot read HF config ({exc})") from exc
        derived = asdict(model_sheet_from_hf_config(cfg))
        overrides = {k: v for k, v in m_spec.items() if k != "hf_config"}
        model = _sheet(ModelSheet, f"{source} [model]", overrides, derived)
    elif m_spec is None:
        raise InputError(source, "missing [model] table")
    else:
        model = _sheet(ModelSheet, f"{source} [model]", m_spec)
    dep = _sheet(DeploymentSheet, f"{source} [deployment]", data.get("deployment", {}))
    prof_name = name or str(data.get("name") or Path(source).stem)
    return analytic_profile(hw, model, dep, name=prof_name)
