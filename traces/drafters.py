"""Draft models sharing the target's frozen token embedding and LM head.

Every drafter works at an *anchor* ``t`` of the output: tokens ``y_0..y_t`` are known
(``y_t`` is the last bonus/prefill token), the target has hidden states for every
sequence index up to the one before ``y_t``; the drafter proposes ``y_{t+1}..y_{t+gamma}``.

``mtp1``
    DeepSeek-V3-style MTP module: ``u = W[RMSNorm(h); RMSNorm(E[x])]`` -> one
    transformer block (causal over the draft chain) -> final norm -> shared LM head.
    Depth 1 uses the target's last hidden state ``h_{t-1}`` and ``E[y_t]``; deeper
    drafts apply the same module recursively on its own output state and own token.
``parallel``
    DFlash-style block drafter: the last ``window`` context positions' target features
    from three layers (concatenated -> projected), the bonus-token embedding and
    ``gamma`` mask queries (+ position embedding) go through one bidirectional block;
    query ``k`` predicts ``y_{t+k}`` -- all ``gamma`` tokens in one pass.
``dspark``
    The parallel backbone plus a low-rank Markov head (a logit bias
    ``W_head U V^T E[x_{k-1}]`` from the previous draft token, applied sequentially)
    and a confidence head ``c_k = sigmoid(w . [h_k; W1 E[x_{k-1}]])``.
``lookup``
    Training-free prompt lookup: the longest (<= 3) suffix n-gram of prompt+output is
    matched to its most recent earlier occurrence; confidence from match counts.

The block has the target's decoder-layer shapes (GQA attention with RoPE, SwiGLU) and is
initialised from the target's last decoder layer. Checkpoints hold only the drafter's own
weights (bf16 safetensors) plus a JSON sidecar; see :func:`save_drafter` / :func:`load_drafter`.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dspark_sim.errors import InputError

KINDS = ("mtp1", "parallel", "dspark", "lookup")
LEARNED_KINDS = ("mtp1", "parallel", "dspark")


@dataclass
class DrafterConfig:
    kind: str
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    gamma: int = 7
    window: int = 4  # context positions seen by the parallel backbone
    n_feat: int = 3  # target layers concatenated for parallel/dspark
    feature_layers: list[int] = field(default_factory=list)  # hidden_states indices
    rank: int = 64  # Markov head rank
    # How the parallel backbone's gamma query slots start: "mask" (DFlash: one learned mask
    # embedding) or "fused" (each slot starts from W[RMSNorm(h_{t-1}); RMSNorm(E[y_t])],
    # the MTP input, so that a one-block drafter need not squeeze the target's last
    # hidden state through a single attention layer). Old checkpoints lack the key: "mask".
    query_init: str = "mask"
    # dspark loss weights (CE, TV, BCE). The paper's (0.1, 0.9, 1.0) targets temperature-1
    # rejection sampling, where TV is the acceptance; under greedy verification the
    # acceptance is argmax agreement, for which CE on the target's greedy token is the
    # matched surrogate, so a greedy-served drafter may weight CE up.
    loss_weights: list[float] = field(default_factory=lambda: [0.1, 0.9, 1.0])
    conf_dim: int = 64  # W1 width of the confidence head
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    max_ngram: int = 3  # lookup

    @classmethod
    def for_target(cls, kind: str, target: Any, gamma: int = 7, **kw: Any) -> DrafterConfig:
        c = target.config
        return cls(
            kind=kind,
            hidden=int(c.hidden_size),
            heads=int(c.num_attention_heads),
            kv_heads=int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads),
            intermediate=int(c.intermediate_size),
            vocab=int(target.vocab_size),
            gamma=gamma,
            feature_layers=target.feature_layers(3),
            rope_theta=float(getattr(c, "rope_theta", None) or 10000.0),
            rms_eps=float(getattr(c, "rms_norm_eps", 1e-5)),
            **kw,
        )


class Shared:
    """The target's frozen embedding and LM head (never saved with a drafter)."""

    def __init__(self, embed_weight: torch.Tensor, head_weight: torch.Tensor) -> None:
        self.embed_weight = embed_weight.detach()
        self.head_weight = head_weight.detach()

    @classmethod
    def of(cls, target: Any) -> Shared:
        return cls(target.embed.weight, target.head_weight)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed_weight)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.head_weight)


# -- building blocks ------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding over the sequence axis (-2) of [B, H, S, Dh]."""
    S, Dh = x.shape[-2], x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, Dh, 2, device=x.device, dtype=torch.float32) / Dh))
    ang = torch.arange(S, device=x.device, dtype=torch.float32)[:, None] * inv[None]
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)
    x1, x2 = x[..., : Dh // 2], x[..., Dh // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Block(nn.Module):
    """Pre-norm decoder block with the target's layer shapes (GQA + RoPE, SwiGLU)."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        d, h, kv = cfg.hidden, cfg.heads, cfg.kv_heads
        self.h, self.kv, self.dh, self.theta = h, kv, d // h, cfg.rope_theta
        self.input_layernorm = RMSNorm(d, cfg.rms_eps)
        self.q_proj = nn.Linear(d, h * self.dh, bias=False)
        self.k_proj = nn.Linear(d, kv * self.dh, bias=False)
        self.v_proj = nn.Linear(d, kv * self.dh, bias=False)
        self.o_proj = nn.Linear(h * self.dh, d, bias=False)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_eps)
        self.gate_proj = nn.Linear(d, cfg.intermediate, bias=False)
        self.up_proj = nn.Linear(d, cfg.intermediate, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate, d, bias=False)

    def forward(self, x: torch.Tensor, causal: bool) -> torch.Tensor:
        B, S, _ = x.shape
        a = self.input_layernorm(x)
        q = self.q_proj(a).view(B, S, self.h, self.dh).transpose(1, 2)
        k = self.k_proj(a).view(B, S, self.kv, self.dh).transpose(1, 2)
        v = self.v_proj(a).view(B, S, self.kv, self.dh).transpose(1, 2)
        q, k = _rope(q, self.theta), _rope(k, self.theta)
        rep = self.h // self.kv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        x = x + self.o_proj(o.transpose(1, 2).reshape(B, S, -1))
        m = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))

    def init_from_target_layer(self, layer: nn.Module) -> None:
        """Copy a Llama-style decoder layer's weights where the shapes match."""
        src = dict(layer.named_parameters())
        names = {
            "input_layernorm.weight": "input_layernorm.weight",
            "post_attention_layernorm.weight": "post_attention_layernorm.weight",
            "q_proj.weight": "self_attn.q_proj.weight",
            "k_proj.weight": "self_attn.k_proj.weight",
            "v_proj.weight": "self_attn.v_proj.weight",
            "o_proj.weight": "self_attn.o_proj.weight",
            "gate_proj.weight": "mlp.gate_proj.weight",
            "up_proj.weight": "mlp.up_proj.weight",
            "down_proj.weight": "mlp.down_proj.weight",
        }
        with torch.no_grad():
            for mine, theirs in names.items():
                p = dict(self.named_parameters())[mine]
                if theirs in src and src[theirs].shape == p.shape:
                    p.copy_(src[theirs].to(p.dtype))


# -- drafter inputs -------------------------------------------------------------------


@dataclass
class DraftBatch:
    """Inputs at ``N`` anchors. ``feats`` [N, W, n_feat, d]: target features of the last
    W context positions (oldest first); ``h_last`` [N, d]: target last-layer (final-norm)
    hidden of the position before ``y_t``; ``last_tok`` [N]: ``y_t``. For training,
    ``future`` [N, gamma]: the target's greedy ``y_{t+1..t+gamma}`` and ``target_logits``
    [N, gamma, V] (optional)."""

    feats: torch.Tensor
    h_last: torch.Tensor
    last_tok: torch.Tensor
    future: torch.Tensor | None = None
    target_logits: torch.Tensor | None = None


def position_weights(gamma: int, device: Any = None) -> torch.Tensor:
    w = torch.exp(-torch.arange(gamma, dtype=torch.float32, device=device) / gamma)
    return w / w.sum()


# -- learned drafters --------------------------------------------------------------------


def _drafted(logits: torch.Tensor, toks: torch.Tensor) -> dict[str, torch.Tensor]:
    """A drafted block [N, gamma]: its tokens, each token's probability under the drafter
    (the confidence a policy reads) and the logits."""
    conf = torch.softmax(logits.float(), -1).gather(-1, toks[..., None])[..., 0]
    return {"tokens": toks, "conf": conf, "logits": logits}


class LearnedDrafter(nn.Module, ABC):
    kind = "base"

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.cfg = cfg

    def init_from_target(self, target: Any) -> None:
        layers = target.model.model.layers
        self.block.init_from_target_layer(layers[len(layers) - 1])
        with torch.no_grad():
            self.final_norm.weight.copy_(target.model.model.norm.weight.float())

    @abstractmethod
    def draft(self, b: DraftBatch, shared: Shared, gamma: int | None = None) -> dict[str, torch.Tensor]:
        """Greedy draft: ``tokens`` [N, g], ``conf`` [N, g] in [0, 1], ``logits`` [N, g, V]."""

    def loss(self, b: DraftBatch, shared: Shared) -> tuple[torch.Tensor, dict[str, float]]:
        """Weighted CE on the target's greedy tokens (teacher-forced)."""
        logits = self.teacher_forced_logits(b, shared)
        g = logits.shape[1]
        w = position_weights(g, logits.device)
        ce = F.cross_entropy(logits.flatten(0, 1).float(), b.future.flatten(), reduction="none")
        ce = (ce.view(-1, g) * w).sum(-1).mean()
        with torch.no_grad():
            acc = (logits.argmax(-1) == b.future).float().mean(0)
        return ce, {"ce": float(ce.detach()), "acc1": float(acc[0]), "acc_mean": float(acc.mean())}

    @abstractmethod
    def teacher_forced_logits(self, b: DraftBatch, shared: Shared) -> torch.Tensor:
        """Logits [N, g, V] with the target's greedy tokens fed as previous tokens."""


class MTP1(LearnedDrafter):
    kind = "mtp1"

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__(cfg)
        d = cfg.hidden
        self.norm_h = RMSNorm(d, cfg.rms_eps)
        self.norm_e = RMSNorm(d, cfg.rms_eps)
        self.proj = nn.Linear(2 * d, d, bias=False)
        self.block = Block(cfg)
        self.final_norm = RMSNorm(d, cfg.rms_eps)
        with torch.no_grad():  # start as "pass the hidden state through"
            self.proj.weight.zero_()
            self.proj.weight[:, :d].copy_(torch.eye(d))

    def _unroll(self, b: DraftBatch, shared: Shared, gamma: int, forced: torch.Tensor | None):
        h = b.h_last
        x = b.last_tok
        us: list[torch.Tensor] = []
        logits, toks = [], []
        for k in range(gamma):
            us.append(self.proj(torch.cat([self.norm_h(h), self.norm_e(shared.embed(x))], -1)))
            out = self.block(torch.stack(us, 1), causal=True)[:, -1]
            lg = shared.head(self.final_norm(out))
            logits.append(lg)
            nxt = lg.argmax(-1)
            toks.append(nxt)
            h = out
            x = forced[:, k] if forced is not None else nxt
        return torch.stack(logits, 1), torch.stack(toks, 1)

    def teacher_forced_logits(self, b: DraftBatch, shared: Shared) -> torch.Tensor:
        return self._unroll(b, shared, b.future.shape[1], b.future)[0]

    @torch.no_grad()
    def draft(self, b: DraftBatch, shared: Shared, gamma: int | None = None) -> dict[str, torch.Tensor]:
        return _drafted(*self._unroll(b, shared, gamma or self.cfg.gamma, None))


class Parallel(LearnedDrafter):
    kind = "parallel"

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__(cfg)
        d = cfg.hidden
        self.feat_norms = nn.ModuleList([RMSNorm(d, cfg.rms_eps) for _ in range(cfg.n_feat)])
        self.feat_proj = nn.Linear(cfg.n_feat * d, d, bias=False)
        self.norm_e = RMSNorm(d, cfg.rms_eps)
        self.mask_emb = nn.Parameter(torch.zeros(d))
        self.slot_emb = nn.Parameter(torch.randn(cfg.window + 1 + cfg.gamma, d) * 0.02)
        self.block = Block(cfg)
        self.final_norm = RMSNorm(d, cfg.rms_eps)
        if cfg.query_init not in ("mask", "fused"):
            raise InputError("query_init", f"must be 'mask' or 'fused', got {cfg.query_init!r}")
        if cfg.query_init == "fused":
            self.q_norm_h = RMSNorm(d, cfg.rms_eps)
            self.q_norm_e = RMSNorm(d, cfg.rms_eps)
            self.q_proj = nn.Linear(2 * d, d, bias=False)
            with torch.no_grad():  # start as "the target's last hidden state" (as MTP1)
                self.q_proj.weight.zero_()
                self.q_proj.weight[:, :d].copy_(torch.eye(d))

    def backbone(self, b: DraftBatch, shared: Shared, gamma: int) -> torch.Tensor:
        """Hidden states of the ``gamma`` query slots [N, gamma, d], in one pass."""
        N, W = b.feats.shape[:2]
        f = torch.cat([n(b.feats[:, :, i]) for i, n in enumerate(self.feat_norms)], -1)
        ctx = self.feat_proj(f)  # [N, W, d]
        tok = self.norm_e(shared.embed(b.last_tok))[:, None]
        q = self.mask_emb.expand(N, gamma, -1)
        if self.cfg.query_init == "fused":
            fused = self.q_proj(torch.cat([self.q_norm_h(b.h_last),
                                           self.q_norm_e(shared.embed(b.last_tok))], -1))
            q = q + fused[:, None]
        x = torch.cat([ctx, tok, q], 1) + self.slot_emb[None, : W + 1 + gamma]
        return self.block(x, causal=False)[:, W + 1 :]

    def teacher_forced_logits(self, b: DraftBatch, shared: Shared) -> torch.Tensor:
        return shared.head(self.final_norm(self.backbone(b, shared, b.future.shape[1])))

    @torch.no_grad()
    def draft(self, b: DraftBatch, shared: Shared, gamma: int | None = None) -> dict[str, torch.Tensor]:
        logits = shared.head(self.final_norm(self.backbone(b, shared, gamma or self.cfg.gamma)))
        return _drafted(logits, logits.argmax(-1))


class DSpark(Parallel):
    """Parallel backbone + low-rank Markov head + confidence head (DSpark §3)."""

    kind = "dspark"

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__(cfg)
        d, r = cfg.hidden, cfg.rank
        self.markov_v = nn.Linear(d, r, bias=False)  # V^T
        self.markov_u = nn.Linear(r, d, bias=False)  # U (zero: starts as the plain backbone)
        nn.init.zeros_(self.markov_u.weight)
        self.conf_w1 = nn.Linear(d, cfg.conf_dim, bias=False)
        self.conf_out = nn.Linear(d + cfg.conf_dim, 1)
        self.conf_norm = RMSNorm(d, cfg.rms_eps)

    def _logits_conf(self, hk: torch.Tensor, prev: torch.Tensor, shared: Shared):
        e = shared.embed(prev)
        bias = self.markov_u(self.markov_v(e))  # head(bias) = W_head U V^T E[x_{k-1}]
        logits = shared.head(self.final_norm(hk) + bias)
        c_in = torch.cat([self.conf_norm(hk), self.conf_w1(e)], -1)
        return logits, self.conf_out(c_in)[..., 0]

    def teacher_forced_logits(self, b: DraftBatch, shared: Shared) -> torch.Tensor:
        return self._teacher_forced(b, shared)[0]

    def _teacher_forced(self, b: DraftBatch, shared: Shared):
        g = b.future.shape[1]
        hk = self.backbone(b, shared, g)
        prev = torch.cat([b.last_tok[:, None], b.future[:, :-1]], 1)
        return self._logits_conf(hk, prev, shared)

    def loss(self, b: DraftBatch, shared: Shared) -> tuple[torch.Tensor, dict[str, float]]:
        logits, c_logit = self._teacher_forced(b, shared)
        g = logits.shape[1]
        w = position_weights(g, logits.device)
        lf = logits.float()
        ce = F.cross_entropy(lf.flatten(0, 1), b.future.flatten(), reduction="none").view(-1, g)
        p_d = torch.softmax(lf, -1)
        p_t = torch.softmax(b.target_logits.float(), -1)
        tv = 0.5 * (p_d - p_t).abs().sum(-1)  # [N, g]
        c_star = (1.0 - tv).detach().clamp(0, 1)
        bce = F.binary_cross_entropy_with_logits(c_logit.float(), c_star, reduction="none")
        a, bb, cc = self.cfg.loss_weights
        total = ((a * ce + bb * tv + cc * bce) * w).sum(-1).mean()
        with torch.no_grad():
            acc = (logits.argmax(-1) == b.future).float().mean(0)
        return total, {
            "ce": float((ce.detach() * w).sum(-1).mean()),
            "tv": float((tv.detach() * w).sum(-1).mean()),
            "bce": float((bce.detach() * w).sum(-1).mean()),
            "acc1": float(acc[0]),
            "acc_mean": float(acc.mean()),
        }

    @torch.no_grad()
    def draft(self, b: DraftBatch, shared: Shared, gamma: int | None = None) -> dict[str, torch.Tensor]:
        g = gamma or self.cfg.gamma
        hk = self.backbone(b, shared, g)
        prev = b.last_tok
        toks, confs, logits = [], [], []
        for k in range(g):  # the Markov head is sequential in the drafted token
            lg, cl = self._logits_conf(hk[:, k], prev, shared)
            prev = lg.argmax(-1)
            toks.append(prev)
            confs.append(torch.sigmoid(cl.float()))
            logits.append(lg)
        return {"tokens": torch.stack(toks, 1), "conf": torch.stack(confs, 1),
                "logits": torch.stack(logits, 1)}


# -- prompt lookup -----------------------------------------------------------------------


class Lookup:
    """Training-free prompt-lookup drafter (n-gram match in prompt + generated output)."""

    kind = "lookup"

    def __init__(self, cfg: DrafterConfig | None = None, max_ngram: int = 3) -> None:
        self.cfg = cfg
        self.max_ngram = cfg.max_ngram if cfg is not None else max_ngram

    def draft_sequence(self, seq: list[int], start: int, gamma: int) -> tuple[np.ndarray, np.ndarray]:
        """Drafts at every anchor index ``a >= start`` of ``seq`` (context ``seq[:a+1]``).

        Returns ``tokens`` [n, gamma] (-1 = no draft) and ``conf`` [n, gamma]:
        ``c_k = A_k / (A_{k-1} + 1)`` where ``A_0`` is the number of earlier occurrences
        of the matched n-gram and ``A_k`` those whose continuation agrees with the draft
        on its first ``k`` tokens (Laplace-shrunk, so one lone match gives 0.5)."""
        n_max = self.max_ngram
        index: dict[tuple[int, ...], list[int]] = {}  # n-gram -> end indices (ascending)

        def add(end: int) -> None:
            for n in range(1, n_max + 1):
                if end - n + 1 >= 0:
                    index.setdefault(tuple(seq[end - n + 1 : end + 1]), []).append(end)

        for e in range(start):  # occurrences fully inside the prompt part
            add(e)
        n_out = len(seq) - start
        toks = np.full((n_out, gamma), -1, dtype=np.int64)
        conf = np.zeros((n_out, gamma), dtype=np.float32)
        for i, a in enumerate(range(start, len(seq))):
            # earlier occurrences end before a (strictly): look them up before adding a
            for n in range(n_max, 0, -1):
                if a - n + 1 < 0:
                    continue
                ends = index.get(tuple(seq[a - n + 1 : a + 1]))
                if not ends:
                    continue
                e = ends[-1]
                cont = seq[e + 1 : min(e + 1 + gamma, a + 1)]
                toks[i, : len(cont)] = cont
                prev = len(ends)
                alive = list(ends)
                for k in range(len(cont)):
                    alive = [x for x in alive if x + 1 + k <= a and seq[x + 1 + k] == cont[k]]
                    conf[i, k] = len(alive) / (prev + 1.0)
                    prev = len(alive)
                break
            add(a)
        return toks, conf


# -- construction / checkpoints ----------------------------------------------------------

_CLASSES: dict[str, type[LearnedDrafter]] = {"mtp1": MTP1, "parallel": Parallel, "dspark": DSpark}


def build_drafter(kind: str, target: Any, gamma: int = 7, init_from_target: bool = True, **kw: Any):
    """A fresh drafter of ``kind`` for ``target`` (``lookup`` needs no training)."""
    if kind not in KINDS:
        raise InputError("--drafter", f"unknown drafter {kind!r}; choose from {', '.join(KINDS)}")
    cfg = DrafterConfig.for_target(kind, target, gamma=gamma, **kw)
    if kind == "lookup":
        return Lookup(cfg)
    model = _CLASSES[kind](cfg)
    if init_from_target:
        model.init_from_target(target)
    return model.to(target.device)


def save_drafter(model: LearnedDrafter, out_dir: str | Path, sidecar: dict[str, Any]) -> Path:
    """``<out_dir>/drafter.safetensors`` (bf16, own weights only) + ``drafter.json``."""
    from safetensors.torch import save_file

    from dspark_sim.io import atomic_path, write_json_atomic

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in model.state_dict().items()}
    st = out / "drafter.safetensors"
    with atomic_path(st) as tmp:
        save_file(sd, str(tmp), metadata={"kind": model.kind})
    from dspark_sim.io import sha256_file

    meta = dict(sidecar)
    meta.update({
        "kind": model.kind,
        "config": asdict(model.cfg),
        "num_params": int(sum(v.numel() for v in sd.values())),
        "sha256": sha256_file(st),
    })
    write_json_atomic(out / "drafter.json", meta)
    return st


def load_drafter(spec: str | Path, target: Any):
    """A drafter from a checkpoint directory (``drafter.safetensors`` + ``drafter.json``),
    ``"lookup"``, or ``"deepspec:<dir>"`` (see :mod:`dspark_sim.traces.deepspec`).
    Returns ``(model, info)`` where info holds the sidecar + sha256."""
    from safetensors.torch import load_file

    from dspark_sim.io import sha256_file

    if str(spec) == "lookup":
        return Lookup(DrafterConfig.for_target("lookup", target)), {"kind": "lookup", "sha256": ""}
    if str(spec).startswith("deepspec:"):  # a DeepSpec DSpark/DFlash checkpoint directory
        from dspark_sim.traces.deepspec import load_deepspec_drafter

        return load_deepspec_drafter(str(spec)[len("deepspec:"):], target, for_capture=True)
    p = Path(spec)
    if p.is_file():
        p = p.parent
    st, js = p / "drafter.safetensors", p / "drafter.json"
    if not st.is_file() or not js.is_file():
        raise InputError(spec, "not a drafter checkpoint (drafter.safetensors + drafter.json)")
    info = json.loads(js.read_text())
    cfg = DrafterConfig(**info["config"])
    if cfg.hidden != target.hidden_size or cfg.vocab != target.vocab_size:
        raise InputError(spec, f"drafter was trained for hidden {cfg.hidden}/vocab {cfg.vocab}, "
                               f"target has {target.hidden_size}/{target.vocab_size}")
    model = _CLASSES[cfg.kind](cfg)
    sd = load_file(str(st))
    model.load_state_dict({k: v.float() for k, v in sd.items()})
    info["sha256"] = sha256_file(st)
    info["path"] = str(p)
    return model.to(target.device).eval(), info


def num_params(model: nn.Module) -> int:
    return int(sum(p.numel() for p in model.parameters()))



# -- batching from recorded target states -------------------------------------------------


def _hidden_of(rec: dict[str, Any]) -> torch.Tensor:
    if "final" in rec:
        return torch.cat([rec["feats"].float(), rec["final"].float()[:, None]], 1)
    return rec["hidden"].float()


@dataclass
class SequenceStore:
    """Prompt+generation token ids and target hidden states of many sequences, flat.

    ``hidden`` [S, n_feat + 1, d] (the ``feature_layers`` then the final-norm'd last
    layer), ``tokens`` [S]; sequence ``i`` is ``starts[i] : starts[i] + lens[i]`` with its
    generated part starting ``prompt_lens[i]`` tokens in."""

    hidden: torch.Tensor
    tokens: torch.Tensor
    starts: np.ndarray
    lens: np.ndarray
    prompt_lens: np.ndarray

    @classmethod
    def from_records(cls, recs: list[dict[str, Any]]) -> SequenceStore:
        toks = [torch.cat([r["prompt"], r["tokens"]]) for r in recs]
        lens = np.array([len(t) for t in toks], dtype=np.int64)
        return cls(
            hidden=torch.cat([_hidden_of(r) for r in recs]),
            tokens=torch.cat(toks),
            starts=np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64),
            lens=lens,
            prompt_lens=np.array([len(r["prompt"]) for r in recs], dtype=np.int64),
        )

    def anchors(self, gamma: int, full_lookahead: bool) -> np.ndarray:
        """Global indices ``a`` of ``y_t`` for every output position ``t`` (with at least
        ``gamma`` (or 1) known future tokens)."""
        need = gamma if full_lookahead else 1
        out = [np.arange(s + p, s + n - need) for s, n, p in
               zip(self.starts, self.lens, self.prompt_lens, strict=True)]
        return np.concatenate(out) if out else np.zeros(0, np.int64)

    def batch(self, a: np.ndarray, window: int, gamma: int, shared: Shared | None,
              seq_of: np.ndarray | None = None, device: Any = "cpu",
              with_future: bool = True) -> DraftBatch:
        """Drafter inputs at anchors ``a`` (global indices of ``y_t``)."""
        a_t = torch.as_tensor(a, dtype=torch.long)
        if seq_of is None:
            seq_of = np.searchsorted(self.starts, a, side="right") - 1
        lo = torch.as_tensor(self.starts[seq_of], dtype=torch.long)
        ctx = (a_t[:, None] - window + torch.arange(window)[None]).clamp(min=lo[:, None])
        nf = self.hidden.shape[1] - 1
        feats = self.hidden[ctx][:, :, :nf].float()
        h_last = self.hidden[(a_t - 1).clamp(min=lo), nf].float()
        b = DraftBatch(feats=feats.to(device), h_last=h_last.to(device),
                       last_tok=self.tokens[a_t].to(device))
        if with_future:
            hi = torch.as_tensor(self.starts[seq_of] + self.lens[seq_of] - 1, dtype=torch.long)
            fut = (a_t[:, None] + 1 + torch.arange(gamma)[None]).clamp(max=hi[:, None])
            b.future = self.tokens[fut].to(device)
            if shared is not None:
                hf = self.hidden[fut - 1, nf].float().to(device)
                b.target_logits = shared.head(hf)
        return b
