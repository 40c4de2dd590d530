"""Bring-your-own DeepSpec drafters (DSpark / DFlash / Eagle3 checkpoints).

Reads a local directory in the format ``save_pretrained`` writes for DeepSpec's draft
models (github.com/deepseek-ai/DeepSpec; e.g. ``deepseek-ai/dspark_qwen3_4b_block7``):
``config.json`` (the target's Qwen3 config plus drafter fields) and ``model.safetensors``
(or shards listed in ``model.safetensors.index.json``). The weights are mapped into a
plain torch module implementing the project's drafter interface
(:meth:`draft` -> ``tokens`` / ``conf`` / ``logits``), so :func:`capture` can replay it
at every output position like the shipped drafters. Independent re-implementation from
the format; no DeepSpec code is used.

* **DSpark / DFlash** (``architectures: ["Qwen3DSparkModel"]``): the block is
  ``[y_t, mask, ..., mask]`` (``block_size`` slots, ``mask_token_id``) at positions
  ``t .. t+block_size-1``; slot ``k`` predicts ``y_{t+k+1}`` (``gamma = block_size``).
  Each of ``num_hidden_layers`` Qwen3 layers attends (bidirectionally) over the context
  keys/values ``k_proj/v_proj(hidden_norm(fc([h_l for l in target_layer_ids])))`` of all
  positions ``< t`` plus the block's own. Logits ``lm_head(norm(h_k))`` plus the Markov
  bias ``markov_w2(markov_w1[x_{k-1}])`` (``x_0 = y_t``; greedy, sequential); confidence
  ``sigmoid(confidence_head.proj([h_k; markov_w1[x_{k-1}]]))``. DFlash = DSpark with
  ``markov_rank = 0`` and no confidence head (conf = draft probability of the token).
* **Eagle3** (``Qwen3Eagle3Model``): causal over entries ``(fc(h_i), y_{i+1})`` at
  position ``i``; each layer takes ``[input_layernorm(E[y]); hidden_norm(h)]``; the last
  entry's output gives ``lm_head(norm(.))`` and is fed back with the drafted token.
  Needs the context token ids, which :func:`capture` does not pass: direct use only.

Target-layer ids follow DeepSpec: id ``l`` is ``hidden_states[l + 1]`` (``-1`` =
embeddings); the final layer is not allowed. Capture must record those layers, so
loading for capture points ``target.feature_layers`` at them (one DeepSpec drafter per
capture run; see docs/traces-capture.md).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dspark_sim.errors import InputError
from dspark_sim.traces.drafters import DraftBatch, DrafterConfig, LearnedDrafter, RMSNorm, Shared

DSPARK_ARCHS = ("Qwen3DSparkModel",)
EAGLE3_ARCHS = ("Qwen3Eagle3Model",)
DEFAULT_WINDOW = 512  # context positions the block drafter attends to (DeepSpec: all)


@dataclass
class DeepSpecConfig:
    family: str  # "dspark" | "dflash" | "eagle3"
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    layers: int
    target_layer_ids: list[int]
    num_target_layers: int | None
    rms_eps: float
    rope_theta: float
    attention_bias: bool
    block_size: int = 0
    mask_token_id: int = -1
    markov_rank: int = 0
    markov_head_type: str = ""
    confidence: bool = False
    confidence_with_markov: bool = False
    ttt_length: int = 0


def _parse_config(cfg_path: Path) -> DeepSpecConfig:
    try:
        c = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise InputError(cfg_path, f"cannot read DeepSpec config: {e}") from None
    arch = (c.get("architectures") or [""])[0]
    if arch not in DSPARK_ARCHS + EAGLE3_ARCHS:
        raise InputError(cfg_path, f"architecture {arch!r} not supported; expected one of "
                                   f"{', '.join(DSPARK_ARCHS + EAGLE3_ARCHS)}")

    def need(key: str) -> Any:
        if key not in c:
            raise InputError(cfg_path, f"missing field {key!r}")
        return c[key]

    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    theta = c.get("rope_theta") or (rope.get("rope_theta") if isinstance(rope, dict) else None)
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) not in (
            "default", None):
        raise InputError(cfg_path, f"rope scaling {rope.get('rope_type', rope.get('type'))!r} "
                                   "not supported")
    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    d = DeepSpecConfig(
        family="eagle3" if arch in EAGLE3_ARCHS else "dspark",
        hidden=hidden, heads=heads,
        kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or hidden // heads),
        intermediate=int(need("intermediate_size")),
        vocab=int(need("vocab_size")),
        layers=int(need("num_hidden_layers")),
        target_layer_ids=[int(x) for x in need("target_layer_ids")],
        num_target_layers=c.get("num_target_layers"),
        rms_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta or 1_000_000.0),
        attention_bias=bool(c.get("attention_bias", False)),
    )
    if d.family == "dspark":
        d.block_size = int(need("block_size"))
        d.mask_token_id = int(need("mask_token_id"))
        d.markov_rank = int(need("markov_rank"))
        d.confidence = bool(need("enable_confidence_head"))
        if d.markov_rank > 0:
            d.markov_head_type = str(need("markov_head_type")).lower()
            if d.markov_head_type not in ("vanilla", "gated"):
                raise InputError(cfg_path, f"markov_head_type {d.markov_head_type!r} not "
                                           "supported (vanilla, gated)")
        if d.confidence:
            d.confidence_with_markov = bool(need("confidence_head_with_markov"))
            if d.confidence_with_markov and d.markov_rank == 0:
                raise InputError(cfg_path, "confidence_head_with_markov needs markov_rank > 0")
        if d.markov_rank == 0 and not d.confidence:
            d.family = "dflash"
        if not 0 <= d.mask_token_id < d.vocab:
            raise InputError(cfg_path, f"mask_token_id {d.mask_token_id} outside vocab {d.vocab}")
        if d.block_size < 1:
            raise InputError(cfg_path, f"block_size must be >= 1, got {d.block_size}")
    else:
        d.ttt_length = int(c.get("ttt_length", 7))
    return d


# -- weights ----------------------------------------------------------------------------


def _weight_files(p: Path) -> list[Path]:
    single = p / "model.safetensors"
    if single.is_file():
        return [single]
    idx = p / "model.safetensors.index.json"
    if idx.is_file():
        try:
            wm = json.loads(idx.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise InputError(idx, f"bad safetensors index: {e}") from None
        files = [p / f for f in sorted(set(wm.values()))]
        for f in files:
            if not f.is_file():
                raise InputError(f, "shard listed in model.safetensors.index.json is missing")
        return files
    raise InputError(p, "no model.safetensors (or model.safetensors.index.json) in directory")


def checkpoint_sha256(files: list[Path]) -> str:
    """sha256 of the single weight file; for shards, of the sorted ``name:sha256`` lines."""
    from dspark_sim.io import sha256_file

    if len(files) == 1:
        return sha256_file(files[0])
    lines = "".join(f"{f.name}:{sha256_file(f)}\n" for f in sorted(files))
    return hashlib.sha256(lines.encode()).hexdigest()


def _load_state(files: list[Path]) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    from safetensors.torch import load_file

    sd: dict[str, torch.Tensor] = {}
    where: dict[str, Path] = {}
    for f in files:
        try:
            part = load_file(str(f))
        except Exception as e:  # noqa: BLE001 - any unreadable file is an input problem
            raise InputError(f, f"cannot read safetensors: {e}") from None
        for k, v in part.items():
            k = k.removeprefix("_orig_mod.")
            sd[k] = v
            where[k] = f
    return sd, where


# -- the module -------------------------------------------------------------------------


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half convention) of [N, H, S, Dh] at positions ``pos`` [S]."""
    Dh = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, Dh, 2, device=x.device, dtype=torch.float32) / Dh))
    ang = pos.to(torch.float32)[:, None] * inv[None]
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)
    x1, x2 = x[..., : Dh // 2], x[..., Dh // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class _Layer(nn.Module):
    """A Qwen3 decoder layer (q/k norms, GQA, SwiGLU) with DeepSpec's parameter names."""

    def __init__(self, c: DeepSpecConfig, attn_in: int) -> None:
        super().__init__()
        H, KV, Dh, b = c.heads, c.kv_heads, c.head_dim, c.attention_bias
        self.c = c
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(attn_in, H * Dh, bias=b)
        self.self_attn.k_proj = nn.Linear(attn_in, KV * Dh, bias=b)
        self.self_attn.v_proj = nn.Linear(attn_in, KV * Dh, bias=b)
        self.self_attn.o_proj = nn.Linear(H * Dh, c.hidden, bias=b)
        self.self_attn.q_norm = RMSNorm(Dh, c.rms_eps)
        self.self_attn.k_norm = RMSNorm(Dh, c.rms_eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.mlp.up_proj = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.mlp.down_proj = nn.Linear(c.intermediate, c.hidden, bias=False)
        self.input_layernorm = RMSNorm(c.hidden, c.rms_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden, c.rms_eps)
        if c.family == "eagle3":
            self.hidden_norm = RMSNorm(c.hidden, c.rms_eps)

    def attend(self, q_in: torch.Tensor, kv_in: torch.Tensor, q_pos: torch.Tensor,
               kv_pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``mask`` [N, Sq, Skv] (True = attend)."""
        a, c = self.self_attn, self.c
        N, Sq, _ = q_in.shape
        Skv = kv_in.shape[1]
        q = a.q_norm(a.q_proj(q_in).view(N, Sq, c.heads, c.head_dim)).transpose(1, 2)
        k = a.k_norm(a.k_proj(kv_in).view(N, Skv, c.kv_heads, c.head_dim)).transpose(1, 2)
        v = a.v_proj(kv_in).view(N, Skv, c.kv_heads, c.head_dim).transpose(1, 2)
        q, k = _rope(q, q_pos, c.rope_theta), _rope(k, kv_pos, c.rope_theta)
        rep = c.heads // c.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        return a.o_proj(o.transpose(1, 2).reshape(N, Sq, -1))

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        m = self.post_attention_layernorm(x)
        return x + self.mlp.down_proj(F.silu(self.mlp.gate_proj(m)) * self.mlp.up_proj(m))


def _valid_context(feats: torch.Tensor) -> torch.Tensor:
    """[N, W] mask of real context entries. ``SequenceStore.batch`` clamps window indices
    before the sequence start to its first position, so the window starts with a run of
    identical copies of that position; all but the last copy are padding."""
    N, W = feats.shape[:2]
    if W < 2:
        return torch.ones(N, W, dtype=torch.bool, device=feats.device)
    f = feats.flatten(2)
    same = (f[:, :-1] == f[:, 1:]).all(-1)  # [N, W-1]
    dup = same.to(torch.int64).cumprod(1).sum(1)  # leading padding copies
    return torch.arange(W, device=feats.device)[None] >= dup[:, None]


class DeepSpecDrafter(LearnedDrafter):
    """A DeepSpec DSpark / DFlash / Eagle3 checkpoint behind the project's drafter API."""

    def __init__(self, c: DeepSpecConfig, cfg: DrafterConfig) -> None:
        super().__init__(cfg)
        self.ds = c
        self.kind = f"deepspec-{c.family}"
        d = c.hidden
        self.embed_tokens = nn.Embedding(c.vocab, d)
        self.lm_head = nn.Linear(d, c.vocab, bias=False)
        self.fc = nn.Linear(len(c.target_layer_ids) * d, d, bias=False)
        self.norm = RMSNorm(d, c.rms_eps)
        attn_in = 2 * d if c.family == "eagle3" else d
        self.layers = nn.ModuleList([_Layer(c, attn_in) for _ in range(c.layers)])
        if c.family != "eagle3":
            self.hidden_norm = RMSNorm(d, c.rms_eps)
        if c.markov_rank > 0:
            self.markov_head = nn.Module()
            self.markov_head.markov_w1 = nn.Embedding(c.vocab, c.markov_rank)
            self.markov_head.markov_w2 = nn.Linear(c.markov_rank, c.vocab, bias=False)
            if c.markov_head_type == "gated":
                self.markov_head.gate_proj = nn.Linear(d + c.markov_rank, c.markov_rank)
        if c.confidence:
            self.confidence_head = nn.Module()
            width = d + (c.markov_rank if c.confidence_with_markov else 0)
            self.confidence_head.proj = nn.Linear(width, 1)

    def init_from_target(self, target: Any) -> None:
        # Part of the drafter interface for training from scratch; a DeepSpec drafter's
        # weights come from its checkpoint, so asking for this is a usage error.
        raise InputError("deepspec", "DeepSpec drafters load their weights from the "
                         "checkpoint; they are not initialised from the target")

    def teacher_forced_logits(self, b: DraftBatch, shared: Shared) -> torch.Tensor:
        raise InputError("deepspec", "DeepSpec drafters are inference-only here "
                         "(train-drafter trains the project's own drafters)")

    # -- DSpark / DFlash -------------------------------------------------------------

    def _block_hidden(self, b: DraftBatch, B: int) -> torch.Tensor:
        N, W = b.feats.shape[:2]
        valid = _valid_context(b.feats)
        ctx = self.hidden_norm(self.fc(b.feats.flatten(2)))  # [N, W, d]
        ids = torch.full((N, B), self.ds.mask_token_id, dtype=torch.long, device=ctx.device)
        ids[:, 0] = b.last_tok
        x = self.embed_tokens(ids)
        dev = ctx.device
        q_pos = W + torch.arange(B, device=dev)
        kv_pos = torch.cat([torch.arange(W, device=dev), q_pos])
        mask = torch.cat([valid, torch.ones(N, B, dtype=torch.bool, device=dev)], 1)
        mask = mask[:, None].expand(N, B, W + B)
        for layer in self.layers:
            a = layer.input_layernorm(x)
            x = x + layer.attend(a, torch.cat([ctx, a], 1), q_pos, kv_pos, mask)
            x = layer.ffn(x)
        return self.norm(x)

    def _markov(self, prev: torch.Tensor, hk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mh = self.markov_head
        e = mh.markov_w1(prev)
        z = e
        if self.ds.markov_head_type == "gated":
            z = torch.sigmoid(mh.gate_proj(torch.cat([hk, e], -1))) * e
        return mh.markov_w2(z), e

    @torch.no_grad()
    def draft(self, b: DraftBatch, shared: Shared, gamma: int | None = None) -> dict[str, torch.Tensor]:
        g = gamma or self.cfg.gamma
        if self.ds.family == "eagle3":
            return self._draft_eagle3(b, g)
        B = self.ds.block_size
        if g > B:
            raise InputError("--gamma-max", f"{self.kind} drafts block_size {B} tokens, asked {g}")
        h = self._block_hidden(b, B)[:, :g]
        base = self.lm_head(h)
        prev = b.last_tok
        toks, confs, logits = [], [], []
        for k in range(g):
            lg, e = base[:, k], None
            if self.ds.markov_rank > 0:
                bias, e = self._markov(prev, h[:, k])
                lg = lg + bias
            tok = lg.argmax(-1)
            if self.ds.confidence:
                feat = torch.cat([h[:, k], e], -1) if self.ds.confidence_with_markov else h[:, k]
                conf = torch.sigmoid(self.confidence_head.proj(feat)[..., 0].float())
            else:
                conf = torch.softmax(lg.float(), -1).gather(-1, tok[:, None])[:, 0]
            toks.append(tok)
            confs.append(conf)
            logits.append(lg)
            prev = tok
        return {"tokens": torch.stack(toks, 1), "conf": torch.stack(confs, 1),
                "logits": torch.stack(logits, 1)}

    # -- Eagle3 ----------------------------------------------------------------------

    def _eagle3_forward(self, h: torch.Tensor, tok: torch.Tensor, pos: torch.Tensor,
                        valid: torch.Tensor) -> torch.Tensor:
        N, S, _ = h.shape
        e = self.embed_tokens(tok)
        causal = torch.ones(S, S, dtype=torch.bool, device=h.device).tril()
        mask = causal[None] & valid[:, None, :]
        mask = mask | torch.eye(S, dtype=torch.bool, device=h.device)[None]  # no empty rows
        for layer in self.layers:
            a = torch.cat([layer.input_layernorm(e), layer.hidden_norm(h)], -1)
            h = layer.ffn(h + layer.attend(a, a, pos, pos, mask))
        return h

    def _draft_eagle3(self, b: DraftBatch, g: int) -> dict[str, torch.Tensor]:
        ctx_tok = getattr(b, "ctx_tokens", None)
        if ctx_tok is None:
            raise InputError(self.kind, "Eagle3 drafting needs DraftBatch.ctx_tokens [N, W] "
                                        "(token i+1 for each context position i); capture "
                                        "does not provide it")
        N, W = b.feats.shape[:2]
        valid = _valid_context(b.feats)
        dev = b.feats.device
        hs = self.fc(b.feats.flatten(2))
        toks_in = ctx_tok.to(dev)
        toks, confs, logits = [], [], []
        for k in range(g):
            pos = torch.arange(W + k, device=dev)
            vk = torch.cat([valid, torch.ones(N, k, dtype=torch.bool, device=dev)], 1)
            out = self._eagle3_forward(hs, toks_in, pos, vk)[:, -1]
            lg = self.lm_head(self.norm(out))
            tok = lg.argmax(-1)
            toks.append(tok)
            confs.append(torch.softmax(lg.float(), -1).gather(-1, tok[:, None])[:, 0])
            logits.append(lg)
            hs = torch.cat([hs, out[:, None]], 1)
            toks_in = torch.cat([toks_in, tok[:, None]], 1)
        return {"tokens": torch.stack(toks, 1), "conf": torch.stack(confs, 1),
                "logits": torch.stack(logits, 1)}


# -- loader -----------------------------------------------------------------------------


def _check_target(c: DeepSpecConfig, cfg_path: Path, target: Any) -> None:
    if c.hidden != target.hidden_size or c.vocab != target.vocab_size:
        raise InputError(cfg_path, f"drafter is for hidden {c.hidden}/vocab {c.vocab}, target "
                                   f"has {target.hidden_size}/{target.vocab_size}")
    L = target.num_layers
    if c.num_target_layers is not None and int(c.num_target_layers) != L:
        raise InputError(cfg_path, f"drafter was trained on a {c.num_target_layers}-layer "
                                   f"target, target has {L} layers")
    ids = c.target_layer_ids
    if not ids or any(not (-1 <= i <= L - 2) for i in ids) or ids != sorted(set(ids)):
        raise InputError(cfg_path, f"target_layer_ids {ids} must be strictly increasing in "
                                   f"[-1, {L - 2}] (final layer excluded) for a {L}-layer target")


def load_deepspec_drafter(path: str | Path, target: Any, window: int = DEFAULT_WINDOW,
                          for_capture: bool = False) -> tuple[DeepSpecDrafter, dict[str, Any]]:
    """Load a DeepSpec drafter directory for ``target``; returns ``(model, info)``.

    ``window``: context positions a DSpark/DFlash block attends to (DeepSpec attends to
    the whole prefix; keep it >= prompt + generated length for exact replay).
    ``for_capture``: also point ``target.feature_layers`` at the drafter's layers so
    :func:`capture` records them (and refuse Eagle3, which capture cannot feed)."""
    p = Path(path)
    if p.is_file():
        p = p.parent
    cfg_path = p / "config.json"
    if not cfg_path.is_file():
        raise InputError(p, "not a DeepSpec drafter directory (no config.json)")
    c = _parse_config(cfg_path)
    _check_target(c, cfg_path, target)
    if for_capture and c.family == "eagle3":
        raise InputError(cfg_path, "Eagle3 needs the context token ids, which capture does not "
                                   "pass; use load_deepspec_drafter directly")
    files = _weight_files(p)
    sd, where = _load_state(files)
    feat_layers = [i + 1 for i in c.target_layer_ids]  # hidden_states indices
    gamma = c.block_size if c.family != "eagle3" else max(c.ttt_length, 1)
    dcfg = DrafterConfig(kind=f"deepspec-{c.family}", hidden=c.hidden, heads=c.heads,
                         kv_heads=c.kv_heads, intermediate=c.intermediate, vocab=c.vocab,
                         gamma=gamma, window=int(window), n_feat=len(feat_layers),
                         feature_layers=feat_layers, rank=c.markov_rank,
                         rope_theta=c.rope_theta, rms_eps=c.rms_eps)
    model = DeepSpecDrafter(c, dcfg)
    own = model.state_dict()
    wfile = files[0] if len(files) == 1 else p / "model.safetensors.index.json"
    shared_from_target = []
    for name in ("embed_tokens.weight", "lm_head.weight"):
        if name not in sd:  # frozen copies of the target's; take them from the target
            w = target.embed.weight if name.startswith("embed") else target.head_weight
            sd[name] = w.detach()
            shared_from_target.append(name)
    missing = sorted(set(own) - set(sd))
    if missing:
        raise InputError(wfile, f"{len(missing)} weight(s) missing, e.g. {missing[0]!r}")
    extra = sorted(set(sd) - set(own))
    if extra:
        raise InputError(where.get(extra[0], wfile),
                         f"unexpected weight {extra[0]!r} ({len(extra)} unexpected)")
    for k, v in own.items():
        if tuple(sd[k].shape) != tuple(v.shape):
            raise InputError(where.get(k, wfile), f"weight {k!r} has shape {tuple(sd[k].shape)}, "
                                                  f"config implies {tuple(v.shape)}")
    model.load_state_dict({k: sd[k].float() for k in own})
    if for_capture:
        prev = getattr(target, "_deepspec_feature_layers", None)
        if prev is not None and list(prev) != feat_layers:
            raise InputError(cfg_path, f"needs target layers {feat_layers}, another DeepSpec drafter "
                                       f"in this run needs {list(prev)}; capture them separately")
        target._deepspec_feature_layers = tuple(feat_layers)
        target.feature_layers = lambda n=3, _ids=tuple(feat_layers): list(_ids)
    info = {
        "kind": model.kind,
        "format": "deepspec",
        "family": c.family,
        "path": str(p),
        "sha256": checkpoint_sha256(files),
        "weight_files": [f.name for f in files],
        "target_layer_ids": c.target_layer_ids,
        "feature_layers": feat_layers,
        "block_size": c.block_size,
        "mask_token_id": c.mask_token_id,
        "markov_rank": c.markov_rank,
        "markov_head_type": c.markov_head_type,
        "confidence_head": c.confidence,
        "window": int(window),
        "embed_head_from_target": shared_from_target,
        "num_params": int(sum(v.numel() for v in own.values())),
    }
    return model.to(target.device).eval(), info
