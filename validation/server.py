"""A real continuous-batching speculative-decoding server (torch), for validation.

This is the engine :mod:`dspark_sim.validation.harness` holds the simulator against. It runs
an actual target model and drafter; nothing in it replays the simulator:

* **arrivals**: requests become visible when the server clock passes their arrival time;
* **admission** (FCFS, head-of-line blocking): under ``max_num_seqs`` and a KV capacity in
  tokens (``kv_mode = "reserve"``: prompt + full output must fit, so nothing is ever
  preempted; ``"preempt"`` admits on prompt + verify slots and refuses to overcommit);
* **one batched target forward per step** over the *flattened* new tokens of every
  scheduled request (vLLM style): verify tokens ``[last token, d_1 .. d_l]`` of decoding
  requests first, then chunked prefill in what is left of ``max_num_batched_tokens``.
  Linear layers see ``[1, T, d]``; attention is one padded SDPA call per layer over a
  slot KV cache ``[max_num_seqs, kv_heads, max_len, head_dim]`` (a request owns one slot,
  slots stay compact ``0..R-1``) with a per-request causal mask; logits only for the rows
  that need them (verify rows, last prefill row);
* **batched drafting** before the forward: a learned drafter (``mtp1`` / ``parallel`` /
  ``dspark`` checkpoints of :mod:`dspark_sim.traces.drafters`, fed the target features it
  was trained on) or the training-free ``lookup`` drafter (incremental n-gram index);
* **policy** (``mtp1`` / ``fixed:k`` / ``confidence`` ...) from the project's registry, on
  a :class:`~dspark_sim.policies.base.BatchSnapshot` (survival = calibrated cumulative
  confidence of the drafts, SPS curve from an :class:`EngineProfile`);
* **verification** with :func:`dspark_sim.kernels.verify_greedy` (greedy, lossless): a
  request accepts its leading drafts equal to the target argmax and takes the target
  token at the first mismatch (or the bonus row);
* **per-request timestamps** (arrival, first token, finish) and step statistics written
  into the simulator's own :class:`RequestLog` / :class:`StepStats`, so
  :func:`dspark_sim.sim.metrics.summarize` reads real and simulated runs alike.

Clocks (:mod:`dspark_sim.validation.clock`): ``"wall"``, or ``"cpu"``, a virtual clock of
the serving thread's CPU time that jumps over idle gaps. Requests generate exactly
``output_tokens`` tokens (EOS ignored, as ``vllm bench serve --ignore-eos``).

:meth:`SpecServer.serve` runs one step at a time (:meth:`SpecServer._step`): admission,
drafting + policy (:meth:`~SpecServer._decide`), prefill chunks, the flattened forward
(:func:`_flatten`), verification (:meth:`~SpecServer._verify`), bookkeeping
(:meth:`~SpecServer._account`).
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from dspark_sim.errors import InputError
from dspark_sim.kernels import Blocks, verify_greedy
from dspark_sim.policies.base import StepCost, readonly
from dspark_sim.sim.config import EngineConfig
from dspark_sim.sim.engine import ITL_EDGES_S, RequestLog, StepStats, sps_curve
from dspark_sim.validation.clock import CLOCKS, ServerClock, resolve_clock

# -- configuration and results ---------------------------------------------------------------


def _default_engine() -> EngineConfig:
    # small enough for a 135M model on a CPU; "reserve": prompt + full output must fit,
    # so nothing is ever preempted
    return EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, kv_capacity_tokens=8192,
                        kv_mode="reserve")


@dataclass(frozen=True)
class ServerConfig:
    """The real server's settings: the scheduler limits the simulator models (``engine``:
    an :class:`~dspark_sim.sim.config.EngineConfig`, same fields, same meaning) plus how
    the server keeps time and whether it chunks prefills."""

    engine: EngineConfig = field(default_factory=_default_engine)
    clock: str = "auto"
    chunked_prefill: bool = True

    def check(self) -> ServerConfig:
        e = self.engine
        if e.max_num_seqs is None or e.kv_capacity_tokens is None:
            raise InputError("server", "needs max_num_seqs and kv_capacity_tokens (no profile "
                             "to take them from)")
        e.validate()
        if self.clock not in CLOCKS:
            raise InputError("server", f"clock must be one of {CLOCKS}, got {self.clock!r}")
        return self


@dataclass
class ServeRequest:
    rid: int
    arrival_s: float
    prompt: list[int]
    output_tokens: int
    # state
    slot: int = -1
    filled: int = 0  # prompt tokens whose KV is in the cache
    generated: list[int] = field(default_factory=list)
    first_token_s: float = float("nan")
    finish_s: float = float("nan")
    last_emit_s: float = float("nan")
    steps: int = 0
    verified: int = 0
    accepted: int = 0
    lookup: Any = None
    feats: Any = None  # [max_len, n_feat + 1, d] target features (learned drafters)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def decoding(self) -> bool:
        return self.filled >= self.prompt_len

    @property
    def seq(self) -> list[int]:
        return self.prompt + self.generated


@dataclass
class ServeResult:
    log: Any  # dspark_sim.sim.engine.RequestLog
    stats: Any  # dspark_sim.sim.engine.StepStats
    outputs: list[list[int]]
    clock: str
    wall_s: float
    cpu_s: float
    # per step: (step s, forward+verify s, decoding requests, verify tokens, prefill tokens,
    # KV tokens held, prefills finishing in the step -- their last row gets logits,
    # query tokens x attended context summed over rows -- the engine's attention unit)
    step_records: list[tuple] = field(default_factory=list)


# -- the target engine: flattened varlen forward over a slot KV cache -------------------------


class TargetEngine:
    """Llama-family causal LM (q/k/v/o projections, RoPE, RMSNorm, gated MLP) run token-flat
    over a slot KV cache. Uses the Hugging Face modules' own weights and sub-modules."""

    def __init__(self, model, max_slots: int, max_len: int, feature_layers: list[int] | None = None,
                 attention: str = "auto", pad_max: int = 16):
        self.model = model
        core = model.model
        self.core = core
        cfg = model.config
        self.layers = list(core.layers[: cfg.num_hidden_layers])
        attn = self.layers[0].self_attn
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(attn, "head_dim", None) or cfg.hidden_size // self.heads)
        self.scaling = float(getattr(attn, "scaling", self.head_dim ** -0.5))
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.max_slots, self.max_len = int(max_slots), int(max_len)
        shape = (self.max_slots, self.kv_heads, self.max_len, self.head_dim)
        self.k = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in self.layers]
        self.v = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in self.layers]
        self.feature_layers = list(feature_layers or [])
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self._rope = apply_rotary_pos_emb
        self.vocab = int(model.get_output_embeddings().weight.shape[0])
        if attention not in ("auto", "loop", "padded"):
            raise InputError("attention", f"must be auto, loop or padded, got {attention!r}")
        # CPU: per-request calls cost what a padded call does and match a varlen kernel
        self.attention = ("loop" if self.device.type == "cpu" else "padded") \
            if attention == "auto" else attention
        self.pad_max = int(pad_max)

    def move_slot(self, src: int, dst: int, length: int) -> None:
        if src == dst or length <= 0:
            return
        for kk, vv in zip(self.k, self.v, strict=True):
            kk[dst, :, :length] = kk[src, :, :length]
            vv[dst, :, :length] = vv[src, :, :length]

    @torch.inference_mode()
    def forward(self, slots: list[int], starts: list[int], tokens: list[list[int]],
                logit_rows: list[int], want_features: bool = False):
        """One step. Request ``i`` feeds ``tokens[i]`` at positions ``starts[i]..`` into slot
        ``slots[i]``. Returns (logits [len(logit_rows), V] for the given flat rows,
        features [T, n_feat + 1, d] or None)."""
        dev = self.device
        lens = [len(t) for t in tokens]
        flat = torch.tensor([x for t in tokens for x in t], dtype=torch.long, device=dev)
        req = np.repeat(np.arange(len(tokens)), lens)
        col = np.concatenate([np.arange(n) for n in lens])
        st = np.asarray(starts, dtype=np.int64)
        pos = torch.from_numpy(st[req] + col).to(dev)
        slot_t = torch.from_numpy(np.asarray(slots, dtype=np.int64)[req]).to(dev)
        groups = self._attention_groups(slots, st, lens)
        x = self.core.embed_tokens(flat)[None]  # [1, T, d]
        cos, sin = self.core.rotary_emb(x, pos[None])
        feats = {}  # hidden_states indices: 0 = embeddings, i = output of layer i, L = normed
        n_layers = len(self.layers)
        if want_features and 0 in self.feature_layers:
            feats[0] = x[0]
        for li, layer in enumerate(self.layers):
            x = self._layer(li, layer, x, cos, sin, slot_t, pos, groups)
            if want_features and (li + 1) in self.feature_layers and li + 1 < n_layers:
                feats[li + 1] = x[0]
        rows = torch.as_tensor(logit_rows, dtype=torch.long, device=dev)
        if want_features:
            normed = self.core.norm(x[0])
            logits = self.model.lm_head(normed[rows])
            feats[n_layers] = normed
            f = torch.stack([feats[i] for i in self.feature_layers] + [normed], 1).float()
            return logits, f
        logits = self.model.lm_head(self.core.norm(x[0, rows]))
        return logits, None

    def _attention_groups(self, slots: list[int], st: np.ndarray, lens: list[int]) -> list:
        """Varlen attention plan: request i's queries attend keys 0 .. starts[i] + j of its
        slot. ``"loop"``: one SDPA call per request (cost ~ sum of contexts, as a varlen
        kernel); ``"padded"``: short blocks share one padded call, long (prefill) chunks get
        their own. Entries: ``("one", (slot, flat rows lo, hi), L, mask)`` or ``("pad",
        (slots, pad rows, pad cols, flat rows, t_max), L, mask)``."""
        dev = self.device
        offs = np.concatenate([[0], np.cumsum(lens)])
        short = [] if self.attention == "loop" else [i for i, n in enumerate(lens)
                                                     if n <= self.pad_max]
        groups = []
        for i in sorted(set(range(len(lens))) - set(short)):
            L = int(st[i] + lens[i])
            m = None
            if lens[i] > 1:
                qp_ = torch.arange(int(st[i]), L, device=dev)
                m = torch.arange(L, device=dev)[None, :] <= qp_[:, None]
            groups.append(("one", (slots[i], int(offs[i]), int(offs[i + 1])), L, m))
        if short:
            tmax = int(max(lens[i] for i in short))
            lmax = int(max(st[i] + lens[i] for i in short))
            qpos = np.zeros((len(short), tmax), dtype=np.int64)  # padding sees key 0
            prow, pcol, frow = [], [], []
            for k, i in enumerate(short):
                qpos[k, : lens[i]] = st[i] + np.arange(lens[i])
                prow += [k] * lens[i]
                pcol += list(range(lens[i]))
                frow += list(range(offs[i], offs[i + 1]))
            key = torch.arange(lmax, device=dev)
            m = (key[None, None, :] <= torch.from_numpy(qpos).to(dev)[:, :, None])[:, None]
            sl = torch.as_tensor([slots[i] for i in short], dtype=torch.long, device=dev)
            groups.append(("pad", (sl, torch.as_tensor(prow, device=dev),
                                   torch.as_tensor(pcol, device=dev),
                                   torch.as_tensor(frow, device=dev), tmax), lmax, m))
        return groups

    def _layer(self, li: int, layer, x, cos, sin, slot_t, pos, groups: list):
        """One decoder layer over the flat batch; writes the new K/V into the slot cache."""
        T = x.shape[1]
        H, KV, Dh = self.heads, self.kv_heads, self.head_dim
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(1, T, H, Dh).transpose(1, 2)
        k = attn.k_proj(h).view(1, T, KV, Dh).transpose(1, 2)
        v = attn.v_proj(h).view(1, T, KV, Dh).transpose(1, 2)
        if hasattr(attn, "q_norm"):  # Qwen3-style per-head norms
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = self._rope(q, k, cos, sin)
        kc, vc = self.k[li], self.v[li]
        kc[slot_t, :, pos] = k[0].transpose(0, 1)
        vc[slot_t, :, pos] = v[0].transpose(0, 1)
        o = q.new_empty((T, H, Dh))
        for kind, a, L, m in groups:
            if kind == "one":
                s_, lo, hi = a
                r = F.scaled_dot_product_attention(
                    q[:, :, lo:hi], kc[s_ : s_ + 1, :, :L], vc[s_ : s_ + 1, :, :L],
                    attn_mask=m, scale=self.scaling, enable_gqa=H != KV)
                o[lo:hi] = r[0].transpose(0, 1)
            else:
                sl, prow, pcol, frow, tmax = a
                qp = q.new_zeros((len(sl), tmax, H, Dh))
                qp[prow, pcol] = q[0].transpose(0, 1)[frow]
                r = F.scaled_dot_product_attention(
                    qp.transpose(1, 2), kc[sl, :, :L], vc[sl, :, :L], attn_mask=m,
                    scale=self.scaling, enable_gqa=H != KV)
                o[frow] = r.transpose(1, 2)[prow, pcol]
        x = x + attn.o_proj(o.reshape(1, T, H * Dh))
        return x + layer.mlp(layer.post_attention_layernorm(x))


# -- drafters ----------------------------------------------------------------------------------


class OnlineLookup:
    """Incremental version of :class:`dspark_sim.traces.drafters.Lookup` (same drafts, same
    confidences) for one request: the n-gram index grows as tokens are committed."""

    def __init__(self, max_ngram: int = 3) -> None:
        self.n_max = max_ngram
        self.index: dict[tuple[int, ...], list[int]] = {}
        self.added = 0  # ends 0..added-1 are indexed

    def draft(self, seq: list[int], gamma: int) -> tuple[np.ndarray, np.ndarray]:
        a = len(seq) - 1
        while self.added < a:  # index every end strictly before the anchor
            e = self.added
            for n in range(1, self.n_max + 1):
                if e - n + 1 >= 0:
                    self.index.setdefault(tuple(seq[e - n + 1 : e + 1]), []).append(e)
            self.added += 1
        toks = np.full(gamma, -1, dtype=np.int64)
        conf = np.zeros(gamma, dtype=np.float64)
        for n in range(self.n_max, 0, -1):
            if a - n + 1 < 0:
                continue
            ends = self.index.get(tuple(seq[a - n + 1 : a + 1]))
            if not ends:
                continue
            e = ends[-1]
            cont = seq[e + 1 : min(e + 1 + gamma, a + 1)]
            toks[: len(cont)] = cont
            prev = len(ends)
            alive = list(ends)
            for k in range(len(cont)):
                alive = [x for x in alive if x + 1 + k <= a and seq[x + 1 + k] == cont[k]]
                conf[k] = len(alive) / (prev + 1.0)
                prev = len(alive)
            break
        return toks, conf


class DraftRunner:
    """Batched drafting for a set of decoding requests: ``lookup`` or a learned drafter."""

    def __init__(self, drafter: Any, shared: Any = None, name: str | None = None) -> None:
        from dspark_sim.traces.drafters import LearnedDrafter, Lookup

        self.drafter = drafter
        self.learned = isinstance(drafter, LearnedDrafter)
        if not self.learned and not isinstance(drafter, Lookup):
            raise InputError("drafter", "expected a learned drafter module or a Lookup")
        self.shared = shared
        self.kind = name or getattr(drafter, "kind", "lookup")
        cfg = getattr(drafter, "cfg", None)
        self.gamma_max = int(cfg.gamma) if cfg is not None else 7
        self.max_ngram = int(cfg.max_ngram) if cfg is not None else 3
        self.window = int(cfg.window) if self.learned else 0
        self.feature_layers = list(cfg.feature_layers) if self.learned else []
        # a block drafter proposes its whole block whatever the policy verifies (as the
        # simulator's engine prices it: DraftCost.block)
        self.block = self.learned and self.kind in BLOCK_DRAFTERS

    def new_request(self, r: ServeRequest) -> None:
        if not self.learned:
            r.lookup = OnlineLookup(self.max_ngram)

    def draft(self, reqs: list[ServeRequest], gamma: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """tokens [n, gamma] (-1 = none), conf [n, gamma], have [n] (usable leading drafts)."""
        n = len(reqs)
        if n == 0 or gamma == 0:
            return np.zeros((n, gamma), np.int64), np.zeros((n, gamma)), np.zeros(n, np.int64)
        if not self.learned:
            toks = np.empty((n, gamma), np.int64)
            conf = np.empty((n, gamma))
            for i, r in enumerate(reqs):
                toks[i], conf[i] = r.lookup.draft(r.seq, gamma)
            have = (toks >= 0).cumprod(1).sum(1)
            return toks, conf, have
        from dspark_sim.traces.drafters import DraftBatch

        W = self.window
        feats, h_last, last = [], [], []
        for r in reqs:
            a = r.prompt_len + len(r.generated) - 1  # anchor: index of the last token
            ctx = torch.clamp(torch.arange(a - W, a), min=0)
            f = r.feats
            feats.append(f[ctx, :-1])
            h_last.append(f[max(a - 1, 0), -1])
            last.append(r.generated[-1])
        dev = self.shared.head_weight.device
        b = DraftBatch(feats=torch.stack(feats).to(dev), h_last=torch.stack(h_last).to(dev),
                       last_tok=torch.tensor(last, dtype=torch.long, device=dev))
        with torch.inference_mode():
            d = self.drafter.draft(b, self.shared, gamma)
        toks = d["tokens"].cpu().numpy().astype(np.int64)
        conf = d["conf"].float().clamp(0, 1).cpu().numpy().astype(np.float64)
        return toks, conf, np.full(n, gamma, np.int64)


# -- the server loop ---------------------------------------------------------------------------


class SpecServer:
    """Continuous-batching speculative-decoding server over one :class:`TargetEngine`."""

    def __init__(self, model, drafter: DraftRunner, config: ServerConfig, max_len: int,
                 profile: Any = None, calibration: Any = None) -> None:
        self.cfg = config.check()
        self.drafter = drafter
        self.engine = TargetEngine(model, config.engine.max_num_seqs, max_len,
                                   drafter.feature_layers if drafter.learned else None)
        self.max_len = int(max_len)
        self.profile = profile
        self.calibration = calibration
        self._dense: tuple[Any, np.ndarray] | None = None  # (profile, its step table)

    # -- policy inputs ---------------------------------------------------------------------
    def _extra(self, n_dec: int, gamma: int, kv_tokens: int, n_rows: int) -> np.ndarray:
        # the same terms as the simulator's engine (EngineProfile.step_extra_s)
        return self.profile.step_extra_s(n_dec, gamma, kv_tokens, n_rows or n_dec,
                                         self._draft_time(n_dec, gamma))

    def _dense_step_s(self) -> np.ndarray:
        """The target's step time at 0 .. max_num_batched_tokens tokens (the profile's
        table, read once: the same dense table the simulator's engine prices with)."""
        if self._dense is None or self._dense[0] is not self.profile:  # profile swapped
            budget = self.cfg.engine.max_num_batched_tokens
            table = np.asarray(self.profile.target_time_s(np.arange(budget + 1)), dtype=np.float64)
            self._dense = (self.profile, readonly(table))
        return self._dense[1]

    def _sps(self, n_dec: int, gamma: int, pending_prefill: int, kv_tokens: int,
             n_rows: int = 0, decode_only: bool = False) -> np.ndarray:
        """Steps/s with i admitted draft tokens, priced like the simulator's scheduler
        (:func:`~dspark_sim.sim.engine.sps_curve` over the same table and
        ``EngineProfile.step_extra_s``)."""
        return sps_curve(self._dense_step_s(), self._extra(n_dec, gamma, kv_tokens, n_rows),
                         n_dec, gamma, pending_prefill, self.cfg.engine.max_num_batched_tokens,
                         decode_only=decode_only)

    def _cost(self, n_dec: int, gamma: int, pending_prefill: int, kv_tokens: int,
              n_rows: int) -> StepCost:
        """The cost view a policy pricing verification itself reads (the engine's)."""
        budget = self.cfg.engine.max_num_batched_tokens
        return StepCost(self._dense_step_s(),
                        readonly(self._extra(n_dec, gamma, kv_tokens, n_rows)),
                        int(pending_prefill), self.profile.prefill_s_per_token(budget))

    def _draft_time(self, n: int, gamma: int) -> float:
        prof = self.profile
        key = self.drafter.kind if self.drafter.kind in prof.drafts else None
        if key is None and prof.drafts:
            key = next(iter(prof.drafts))
        return prof.draft_time_s(key, n, gamma) if key else 0.0

    # -- run -------------------------------------------------------------------------------
    def serve(self, prompts: list[list[int]], output_tokens: list[int], arrival_s: list[float],
              policy: Any) -> ServeResult:
        """Serve the workload under ``policy`` (a :class:`~dspark_sim.policies.registry.Policy`)."""
        run = self._start(prompts, output_tokens, arrival_s, policy)
        while run.done < len(run.reqs):
            now = run.clock.now()
            while run.pending and run.pending[0].arrival_s <= now:
                r = run.pending.popleft()
                run.log.arrival_s[r.rid] = r.arrival_s
                run.waiting.append(r)
            if not run.running and not run.waiting:
                run.clock.wait_until(run.pending[0].arrival_s)
                continue
            self._step(run, now)
        return self._result(run)

    def _start(self, prompts, output_tokens, arrival_s, policy) -> _Run:
        n = len(prompts)
        reqs = [ServeRequest(i, float(arrival_s[i]), [int(t) for t in prompts[i]],
                             int(max(1, output_tokens[i]))) for i in range(n)]
        for r in reqs:
            if r.prompt_len + r.output_tokens + self.drafter.gamma_max + 1 > self.max_len:
                raise InputError("server", f"request {r.rid} does not fit max_len {self.max_len}")
        gamma_max = self.drafter.gamma_max
        speculate = policy.speculates
        gamma = policy.verify_max(gamma_max) if speculate else 0
        log = RequestLog.empty(n)
        log.prompt_tokens[:] = [r.prompt_len for r in reqs]
        log.output_tokens[:] = [r.output_tokens for r in reqs]
        log.trace_row[:] = np.arange(n)
        log.replica[:] = 0
        clock_kind = resolve_clock(self.cfg.clock, self.engine.device.type, torch.get_num_threads())
        order = np.argsort(np.asarray(arrival_s, dtype=np.float64), kind="stable")
        block = self.drafter.block
        return _Run(reqs=reqs, policy=policy, gamma=gamma, gamma_max=gamma_max, log=log,
                    draft_len=gamma_max if (block and gamma) else gamma,
                    lag=deque(maxlen=max(1, policy.history)),
                    stats=StepStats(gamma_max if speculate else 0), clock=ServerClock(clock_kind),
                    pending=deque(reqs[i] for i in order),
                    free_slots=list(range(self.cfg.engine.max_num_seqs)))

    def _step(self, run: _Run, now: float) -> None:
        """One engine step: admission, drafting + policy, chunked prefill, one forward,
        verification, bookkeeping; appends the step's record."""
        self._admit(run.waiting, run.running, run.free_slots, 1 + run.gamma)
        dec = [r for r in run.running if r.decoding]
        pre = [r for r in run.running if not r.decoding]
        n_dec = len(dec)
        kv_tokens = sum(r.filled + len(r.generated) for r in run.running)
        pending_prefill = sum(r.prompt_len - r.filled for r in pre)
        ell, toks, have = self._decide(run, dec, pending_prefill, kv_tokens)
        verify_tokens = n_dec + int(ell.sum())
        chunks = self._prefill_chunks(pre, self.cfg.engine.max_num_batched_tokens - verify_tokens)
        units = _work_units(dec, pre, ell, chunks)
        batch = _flatten(dec, pre, ell, toks, chunks)
        t_start = run.clock.now()
        logits, feats = self.engine.forward(batch.slots, batch.starts, batch.feed, batch.rows,
                                            want_features=self.drafter.learned)
        emitted, acc = self._verify(dec, ell, toks, have, logits, feats)
        _advance_prefill(pre, chunks, batch, feats)
        emitted += [(r, [int(logits[li].argmax())], -1) for r, li in batch.pre_last]
        t_end = run.clock.now()  # tokens of this step are out
        prefill_tokens = int(sum(chunks))
        self._account(run, emitted, ell, acc, verify_tokens, prefill_tokens, t_end)
        # the whole step: admission, drafting, policy, forward, verification, bookkeeping
        dt_step = run.clock.now() - now
        run.stats.busy_s += dt_step
        run.records.append((dt_step, t_end - t_start, n_dec, verify_tokens, prefill_tokens,
                            kv_tokens, len(batch.pre_last), *units))

    def _decide(self, run: _Run, dec: list[ServeRequest], pending_prefill: int,
                kv_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Draft for the decoding requests and let the policy pick each one's verify length
        (trimmed to the token budget). Returns (verify lengths, draft tokens, drafted)."""
        n_dec, gamma, gamma_max, policy = len(dec), run.gamma, run.gamma_max, run.policy
        ell = np.zeros(n_dec, np.int64)
        if not (n_dec and gamma):
            return ell, np.zeros((n_dec, gamma), np.int64), np.zeros(n_dec, np.int64)
        budget = self.cfg.engine.max_num_batched_tokens
        toks, conf, have = self.drafter.draft(dec, run.draft_len)
        reads = policy.reads
        if reads.survival:
            surv = self.calibration.survival(conf) if self.calibration is not None \
                else np.cumprod(conf, axis=1)
            if run.draft_len < gamma_max:
                surv = np.pad(surv, ((0, 0), (0, gamma_max - run.draft_len)))
        else:
            surv = np.zeros((n_dec, gamma_max))
        sps = (self._sps(n_dec, gamma_max, pending_prefill, kv_tokens, len(run.running),
                         reads.sps == "decode") if reads.sps is not None else None)
        cost = (self._cost(n_dec, gamma_max, pending_prefill, kv_tokens, len(run.running))
                if reads.cost else None)
        snap = policy.snapshot(run.lag, surv, gamma_max, budget, sps=sps, cost=cost)
        ell = np.minimum(np.array(policy(snap), dtype=np.int64), gamma)
        if n_dec + int(ell.sum()) > budget:
            ell = np.minimum(ell, max(0, (budget - n_dec) // n_dec))
            run.stats.budget_limited_steps += 1
        return ell, toks, have

    def _prefill_chunks(self, pre: list[ServeRequest], left: int) -> list[int]:
        """Prefill tokens per prefilling request in what verification left (FCFS)."""
        chunks = []
        for r in pre:
            rem = r.prompt_len - r.filled
            c = min(rem, max(0, left)) if self.cfg.chunked_prefill else (rem if rem <= left else 0)
            chunks.append(c)
            left -= c
        return chunks

    def _verify(self, dec: list[ServeRequest], ell: np.ndarray, toks: np.ndarray,
                have: np.ndarray, logits, feats) -> tuple[list, np.ndarray]:
        """Greedy (lossless) verification with the project's kernel: each decoding request
        emits its accepted drafts plus the target's token at the first mismatch. Returns
        ``[(request, new tokens, index in dec)]`` and the accepted counts."""
        n_dec = len(dec)
        acc = np.zeros(n_dec, np.int64)
        if not n_dec:
            return [], acc
        dev = self.engine.device
        nv = int(ell.sum()) + n_dec
        blocks = Blocks.from_lengths(ell.tolist(), device=dev)  # host lengths: no sync
        dt_flat = torch.as_tensor(np.concatenate([toks[i, : ell[i]] for i in range(n_dec)]),
                                  dtype=torch.long, device=dev).clamp(min=0)
        res = verify_greedy(dt_flat, logits[:nv].contiguous(), blocks)
        am = res.target_argmax.cpu().numpy()
        acc = np.minimum(res.accepted_len.cpu().numpy().astype(np.int64), np.minimum(have, ell))
        off = np.concatenate([[0], np.cumsum(ell + 1)[:-1]])
        emitted = []
        for i, r in enumerate(dec):
            a = int(acc[i])
            if feats is not None:
                base = r.prompt_len + len(r.generated) - 1
                r.feats[base : base + a + 1] = feats[off[i] : off[i] + a + 1]
            emitted.append((r, [int(x) for x in toks[i, :a]] + [int(am[off[i] + a])], i))
        return emitted, acc

    def _account(self, run: _Run, emitted: list, ell: np.ndarray, acc: np.ndarray,
                 verify_tokens: int, prefill_tokens: int, t_end: float) -> None:
        """Step statistics, emitted tokens, timestamps; release finished requests."""
        stats = run.stats
        stats.steps += 1
        stats.batch_tokens += verify_tokens + prefill_tokens
        if len(ell):
            stats.request_steps += len(ell)
            stats.verify_tokens += verify_tokens
            nh = stats.accept_hist.size
            stats.accept_hist += np.bincount(acc, minlength=nh)[:nh]
            stats.ell_hist += np.bincount(ell, minlength=nh)[:nh]
        finished = []
        for r, new, i in emitted:
            new = new[: r.output_tokens - len(r.generated)]
            if i >= 0:  # a verification step
                r.steps += 1
                r.verified += int(ell[i])
                r.accepted += int(acc[i])
                gap = t_end - r.last_emit_s
                stats.itl_hist[bisect.bisect_left(_ITL_EDGES, gap)] += 1
                stats.itl_sum_s += gap
            else:
                r.first_token_s = t_end
            r.generated.extend(new)
            r.last_emit_s = t_end
            if len(r.generated) >= r.output_tokens:
                finished.append(r)
        for r in finished:
            r.finish_s = t_end
            self._release(r, run.running, run.free_slots)
            run.done += 1

    def _result(self, run: _Run) -> ServeResult:
        log = run.log
        for r in run.reqs:
            log.first_token_s[r.rid] = r.first_token_s
            log.finish_s[r.rid] = r.finish_s
            log.generated[r.rid] = len(r.generated)
            log.steps[r.rid] = r.steps
            log.draft_tokens_verified[r.rid] = r.verified
            log.accepted_tokens[r.rid] = r.accepted
        return ServeResult(log, run.stats, [r.generated for r in run.reqs], run.clock.kind,
                           time.perf_counter() - run.wall0, time.thread_time() - run.cpu0,
                           run.records)

    def _admit(self, waiting: deque, running: list, free_slots: list, verify_slots: int) -> None:
        e = self.cfg.engine
        if e.kv_mode == "reserve":
            used = sum(r.prompt_len + r.output_tokens for r in running)
        else:
            used = sum(r.prompt_len + len(r.generated) + verify_slots for r in running)
        while waiting and len(running) < e.max_num_seqs:
            r = waiting[0]
            need = (r.prompt_len + r.output_tokens if e.kv_mode == "reserve"
                    else r.prompt_len + verify_slots)
            if used + need > e.kv_capacity_tokens and running:
                break  # head-of-line blocking (FCFS)
            waiting.popleft()
            r.slot = min(free_slots)
            free_slots.remove(r.slot)
            self.drafter.new_request(r)
            if self.drafter.learned:
                d = self.engine.model.config.hidden_size
                nf = len(self.drafter.feature_layers) + 1
                r.feats = torch.zeros(self.max_len, nf, d)
            running.append(r)
            used += need

    def _release(self, r: ServeRequest, running: list, free_slots: list) -> None:
        """Free the request's slot; keep slots compact by moving the highest one down."""
        running.remove(r)
        hole = r.slot
        top = max((q.slot for q in running), default=-1)
        if top > hole:
            q = next(q for q in running if q.slot == top)
            self.engine.move_slot(top, hole, q.filled + len(q.generated) + 1)
            q.slot = hole
            free_slots.append(top)
        else:
            free_slots.append(hole)
        r.slot = -1
        r.lookup = None
        r.feats = None


_ITL_EDGES = ITL_EDGES_S.tolist()  # bisect on a list, as the simulator's engine does


BLOCK_DRAFTERS = ("dspark", "parallel", "dflash")


@dataclass
class _Run:
    """The state of one :meth:`SpecServer.serve` call."""

    reqs: list[ServeRequest]
    policy: Any
    gamma: int  # tokens drafted per decoding request and step (0: no speculation)
    gamma_max: int
    log: RequestLog
    stats: StepStats
    clock: ServerClock
    pending: deque  # not yet arrived, by arrival time
    free_slots: list[int]
    waiting: deque = field(default_factory=deque)
    running: list[ServeRequest] = field(default_factory=list)  # admission order
    draft_len: int = 0  # tokens drafted per request and step (a block drafter: its block)
    lag: deque = field(default_factory=deque)  # (survival, sps, cost) history, oldest first
    records: list[tuple] = field(default_factory=list)
    done: int = 0
    wall0: float = field(default_factory=time.perf_counter)
    cpu0: float = field(default_factory=time.thread_time)


@dataclass
class _Batch:
    """A step's flattened forward input: per scheduled request its slot, first position
    and tokens; the rows that need logits; the prefills finishing (request, logit row)."""

    slots: list[int]
    starts: list[int]
    feed: list[list[int]]
    rows: list[int]
    pre_last: list[tuple[ServeRequest, int]]


def _flatten(dec: list[ServeRequest], pre: list[ServeRequest], ell: np.ndarray,
             toks: np.ndarray, chunks: list[int]) -> _Batch:
    """Verify blocks ``[last token, d_1 .. d_l]`` of the decoding requests first (every
    row gets logits), then the prefill chunks (a finishing prefill's last row gets one)."""
    b = _Batch([], [], [], [], [])
    row = 0
    for i, r in enumerate(dec):
        b.slots.append(r.slot)
        b.starts.append(r.prompt_len + len(r.generated) - 1)
        b.feed.append([r.generated[-1]] + [int(x) if x >= 0 else 0 for x in toks[i, : ell[i]]])
        b.rows.extend(range(row, row + 1 + int(ell[i])))
        row += 1 + int(ell[i])
    for r, c in zip(pre, chunks, strict=True):
        if c == 0:
            continue
        b.slots.append(r.slot)
        b.starts.append(r.filled)
        b.feed.append(r.prompt[r.filled : r.filled + c])
        row += c
        if r.filled + c >= r.prompt_len:
            b.pre_last.append((r, len(b.rows)))
            b.rows.append(row - 1)
    if not b.feed:
        raise RuntimeError("server step with no work")
    return b


def _advance_prefill(pre: list[ServeRequest], chunks: list[int], batch: _Batch, feats) -> None:
    """Prefilling requests take their chunk into the cache (and its features)."""
    row = sum(len(f) for f in batch.feed) - sum(chunks)  # the first prefill row
    for r, c in zip(pre, chunks, strict=True):
        if c == 0:
            continue
        if feats is not None:
            r.feats[r.filled : r.filled + c] = feats[row : row + c]
        row += c
        r.filled += c


def _work_units(dec: list[ServeRequest], pre: list[ServeRequest], ell: np.ndarray,
                chunks: list[int]) -> tuple[float, float, int]:
    """The step's work in the profile's units, as the simulator's engine counts them:
    query tokens x attended context (a verify block of 1 + l tokens over the request's
    context; a prefill chunk of c after f filled: c * (f + c / 2)), the context of
    multi-token blocks, and the requests with a context."""
    query_ctx = float(sum((1 + int(ell[i])) * (r.filled + len(r.generated))
                          for i, r in enumerate(dec)))
    query_ctx += float(sum(c * (r.filled + c / 2.0) for r, c in zip(pre, chunks, strict=True) if c))
    multi_ctx = float(sum(r.filled + len(r.generated) for i, r in enumerate(dec) if ell[i] > 0))
    multi_ctx += float(sum(r.filled for r, c in zip(pre, chunks, strict=True) if c and r.filled > 0))
    ctx_requests = len(dec) + sum(1 for r, c in zip(pre, chunks, strict=True) if c and r.filled > 0)
    return query_ctx, multi_ctx, ctx_requests


# -- references and helpers ----------------------------------------------------------------------


@torch.inference_mode()
def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """The target's greedy continuation (EOS ignored) with the plain Hugging Face forward."""
    import inspect

    from transformers import DynamicCache

    dev = next(model.parameters()).device
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids = torch.tensor([prompt], dtype=torch.long, device=dev)
    cache = DynamicCache()
    out = model(input_ids=ids, use_cache=True, **{kw: cache})
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None) or cache
    nxt = int(out.logits[0, -1].argmax())
    res = [nxt]
    for _ in range(n - 1):
        out = model(input_ids=torch.tensor([[nxt]], device=dev), use_cache=True, **{kw: cache})
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None) or cache
        nxt = int(out.logits[0, -1].argmax())
        res.append(nxt)
    return res


def lookup_accept_lengths(seq: list[int], prompt_len: int, gamma: int,
                          max_ngram: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """Trace rows of the lookup drafter on a finished sequence: ``m_t`` and ``conf`` at
    every output position (what :mod:`dspark_sim.traces.capture` records for ``lookup``)."""
    from dspark_sim.traces.drafters import Lookup

    toks, conf = Lookup(max_ngram=max_ngram).draft_sequence(seq, prompt_len, gamma)
    n_out = len(seq) - prompt_len
    m = np.zeros(n_out, np.int64)
    for i in range(n_out):
        a = prompt_len + i
        left = len(seq) - 1 - a
        k = 0
        while k < min(gamma, left) and toks[i, k] >= 0 and toks[i, k] == seq[a + 1 + k]:
            k += 1
        m[i] = k
    return m, conf


def time_server_shapes(server: SpecServer, shapes, warmup: int = 1, repeats: int = 3,
                       clock: str = "cpu", seed: int = 0,
                       between: Callable[[int], Any] | None = None) -> list[list[float]]:
    """Time the server's own forward (+ greedy verification) on ``(R, l, L)`` shapes, for a
    profile measured engine-in-the-loop (see :func:`dspark_sim.validation.server_profile.measure_server_profile`).

    A shape with ``L > 0`` is ``R`` verify blocks of ``1 + l`` tokens (every row gets
    logits, then verified); ``L = 0`` is one prefill chunk of ``1 + l`` tokens from position
    0 with one logit row, as the server runs it. Shapes are interleaved in a random order
    every pass. ``between(R)`` (untimed) runs before each timed pass: the validation passes
    the drafter, because in serving the drafter runs between two target forwards and
    evicts part of the target's weights from the last-level cache. Timed back to back, a
    135M fp32 target on a CPU with a large shared L3 runs ~10-15 % faster than it does
    inside the serving loop.
    """
    from dspark_sim.kernels import Blocks, verify_greedy

    eng = server.engine
    now = time.thread_time if clock == "cpu" else time.perf_counter
    rng = np.random.default_rng(seed)
    times: list[list[float]] = [[] for _ in shapes]
    for rnd in range(warmup + repeats):
        for i in rng.permutation(len(shapes)):
            s = shapes[i]
            t = 1 + s.verify
            prefill = s.context == 0
            if between is not None:
                between(1 if prefill else s.requests)
            if prefill:
                toks = [rng.integers(0, eng.vocab, size=t).tolist()]
                t0 = now()
                logits, _ = eng.forward([0], [0], toks, [t - 1],
                                        want_features=server.drafter.learned)
                float(logits[0, 0])
                dt = now() - t0
            else:
                toks = rng.integers(0, eng.vocab, size=(s.requests, t)).tolist()
                rows = list(range(s.requests * t))
                t0 = now()
                logits, _ = eng.forward(list(range(s.requests)), [s.context] * s.requests, toks,
                                        rows, want_features=server.drafter.learned)
                blocks = Blocks.from_lengths([s.verify] * s.requests, device=eng.device)
                d = torch.as_tensor([x for row in toks for x in row[1:]], dtype=torch.long,
                                    device=eng.device)
                res = verify_greedy(d, logits.contiguous(), blocks)
                res.accepted_len.cpu()  # waits for the device, as the serving loop does
                dt = now() - t0
            if rnd >= warmup:
                times[i].append(dt)
    return times
