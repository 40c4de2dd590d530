"""``validate``: hold the simulator against a real speculative-decoding serving run.

For every (policy, request rate) point:

1. **real run** -- :class:`dspark_sim.validation.server.SpecServer` serves a Poisson workload
   (held-out prompts of the project's prompt sets, ``max_new_tokens`` output tokens each,
   EOS ignored) on the target (default: SmolLM2-135M on CPU) with a drafter (``auto``: the
   shipped trained ``dspark`` checkpoint when present, else the training-free ``lookup``
   drafter). Its per-request log and step statistics are summarised by
   :func:`dspark_sim.sim.metrics.summarize`, the simulator's own code;
2. **simulation** of the *same* workload: the arrival times and lengths are written as a
   Mooncake JSONL file and replayed (``WorkloadConfig(arrival="replay")``), with the
   engine profile calibrated on this machine and the acceptance trace of the same target
   and drafter. Two variants:

   * ``sim``: :func:`dspark_sim.sim.api.simulate` itself (trace rows drawn at random per
     request, as in every simulation), averaged over ``sim_seeds`` seeds;
   * ``paired``: the same engine with request ``i`` replaying trace row ``i`` (its own
     acceptance sequence), which removes acceptance sampling noise and isolates the
     step-time model;

3. a table of measured vs simulated output throughput, median/p90 TPOT, median TTFT,
   tau and mean verify tokens per request step, with relative errors, plus a per-step
   check of the cost model (measured step time vs ``draft + target(B) + kv * KV +
   logits * rows + attn * query_ctx`` of the profile, split into decode-only and prefill
   steps).

Profiles (``profile=``): ``"auto"`` uses the built-in ``smollm2-cpu`` when shipped, else
measures one *engine-in-the-loop*: the server's own forward + verification timed on a
grid of ``(requests, verify length, context)`` shapes (plus prefill chunks) and fitted
with :func:`dspark_sim.calibration.measure.fit_terms`, immediately before the runs (a
shared CPU drifts); ``"measure"`` forces that; anything else is a profile name/path.

Traces: ``lookup`` -- exact, from the served sequences themselves (the lookup draft at
every output position depends only on the tokens); learned drafters -- the captured
``traces/data/captured-<target>-<kind>.parquet``.

Everything torch-side is imported lazily: ``import dspark_sim.validation.harness`` needs no torch.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from dspark_sim.calibration.confmap import CalibrationMap, load_calibration
from dspark_sim.calibration.profile import DraftCost, EngineProfile, builtin_profiles, load_profile
from dspark_sim.errors import InputError
from dspark_sim.io import atomic_path, jsonable, write_json_atomic, write_text_atomic
from dspark_sim.policies.registry import get_policy
from dspark_sim.sim.api import simulate
from dspark_sim.sim.config import DeploymentConfig, EngineConfig, SimConfig, WorkloadConfig
from dspark_sim.sim.metrics import requests_frame, summarize
from dspark_sim.sim.workload import build_stream
from dspark_sim.traces.schema import AcceptanceTrace, TraceMeta, trace_from_frame

METRICS = (
    ("output_throughput", "output tok/s"),
    ("median_tpot_ms", "median TPOT ms"),
    ("p90_tpot_ms", "p90 TPOT ms"),
    ("median_ttft_ms", "median TTFT ms"),
    ("spec_decode_acceptance_length", "tau"),
    ("mean_verify_tokens_per_request_step", "verify tok/req/step"),
)
DEFAULT_POLICIES = ("mtp1", "fixed:3", "confidence")
DEFAULT_RATES = (0.25, 0.6)
SHIPPED_PROFILE = "smollm2-cpu"
INSITU = "insitu"  # profile spec: rescaled on the other points' real steps (leave-one-point-out)
INSITU_SELF = "insitu-self"  # diagnostic: rescaled on the point's *own* steps (level known)
_INSITU = (INSITU, INSITU_SELF)
VALIDATE_PROFILE = Path(__file__).resolve().parent.parent / "calibration" / "data" / \
    "smollm2-cpu-validate.toml"


@dataclass(frozen=True)
class Workload:
    arrival_s: np.ndarray
    prompts: list[list[int]]
    output_tokens: np.ndarray
    domains: list[str]
    rate: float

    @property
    def prompt_tokens(self) -> np.ndarray:
        return np.array([len(p) for p in self.prompts], dtype=np.int64)


# -- workloads ------------------------------------------------------------------------------


def prompt_pool(target: Any, num: int, max_prompt_tokens: int = 128, seed: int = 0,
                vocab: int | None = None) -> tuple[list[list[int]], list[str]]:
    """``num`` held-out prompts (math/code/chat round-robin) tokenised with the target's
    chat template; without a prompt set (or tokenizer) random token prompts."""
    try:
        from dspark_sim.traces.targets import load_prompts, select_prompts

        if getattr(target, "tokenizer", None) is None:
            raise InputError("prompts", "target has no tokenizer")
        per = max(1, math.ceil(num / 3))
        chosen = select_prompts(load_prompts(), "heldout", per)
        by_dom: dict[str, list] = {}
        for p in chosen:
            by_dom.setdefault(p.domain, []).append(p)
        mixed = [q for group in zip(*by_dom.values(), strict=False) for q in group][:num]
        if len(mixed) < num:
            raise InputError("prompts", "not enough held-out prompts")
        return ([target.encode_prompt(list(p.turns), max_prompt_tokens) for p in mixed],
                [p.domain for p in mixed])
    except InputError:
        rng = np.random.default_rng(seed)
        v = int(vocab or 256)
        out = []
        for _ in range(num):  # a repeated motif, so that n-gram lookup finds something
            motif = rng.integers(0, v, size=int(rng.integers(4, 12))).tolist()
            out.append((motif * (max_prompt_tokens // len(motif) + 1))[: int(
                rng.integers(max_prompt_tokens // 2, max_prompt_tokens + 1))])
        return out, ["random"] * num


def poisson_workload(prompts: list[list[int]], domains: list[str], rate: float,
                     max_new_tokens: int, seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    n = len(prompts)
    arr = np.cumsum(rng.exponential(1.0 / rate, size=n))
    arr -= arr[0]
    return Workload(arr, prompts, np.full(n, int(max_new_tokens), np.int64), domains, rate)


def write_mooncake(path: str | Path, w: Workload) -> Path:
    """The workload as Mooncake JSONL (timestamp ms, input_length, output_length)."""
    lines = [json.dumps({"timestamp": float(t) * 1e3, "input_length": int(p),
                         "output_length": int(o)})
             for t, p, o in zip(w.arrival_s, w.prompt_tokens, w.output_tokens, strict=True)]
    return write_text_atomic(path, "\n".join(lines) + "\n")


# -- traces ------------------------------------------------------------------------------------


def lookup_trace(prompts: list[list[int]], outputs: list[list[int]], domains: list[str],
                 gamma: int, target_name: str, max_ngram: int = 3) -> AcceptanceTrace:
    """The lookup drafter's exact trace on the served sequences (row ``i`` = request ``i``)."""
    from dspark_sim.validation.server import lookup_accept_lengths

    rows = []
    for i, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
        m, conf = lookup_accept_lengths(list(p) + list(o), len(p), gamma, max_ngram)
        rows.append(pl.DataFrame({
            "request_id": np.full(len(m), i, np.int32),
            "domain": [domains[i]] * len(m),
            "position": np.arange(len(m), dtype=np.int32),
            "accept_len": m.astype(np.int8),
            "conf": pl.Series("conf", conf.astype(np.float32), dtype=pl.Array(pl.Float32, gamma)),
        }))
    meta = TraceMeta(drafter="lookup", target=target_name, gamma_max=gamma, source="captured",
                     temperature=0.0,
                     generator={"tool": "dspark_sim.validation.harness", "from": "served sequences"})
    return trace_from_frame(pl.concat(rows), meta, "validate-lookup")


def learned_trace(target: Any, drafter: Any, prompts: list[list[int]], outputs: list[list[int]],
                  domains: list[str], gamma: int, kind: str, chunk: int = 4) -> AcceptanceTrace:
    """A learned drafter's trace on the served sequences, the way
    :mod:`dspark_sim.traces.capture` records one: a clean target forward over
    prompt + output gives the features, the drafter drafts ``gamma`` tokens at every
    output position, :func:`dspark_sim.traces.capture.draft_rows` verifies them."""
    import torch

    from dspark_sim.traces.capture import draft_rows
    from dspark_sim.traces.drafters import SequenceStore, Shared

    layers = list(drafter.cfg.feature_layers) + [target.num_layers]
    shared = Shared.of(target)
    frames = []
    for lo in range(0, len(prompts), chunk):
        recs = [{"prompt": torch.tensor(p), "tokens": torch.tensor(o)}
                for p, o in zip(prompts[lo : lo + chunk], outputs[lo : lo + chunk], strict=True)]
        with torch.inference_mode():
            target._hidden_for(recs, layers)
        store = SequenceStore.from_records(recs)
        with torch.inference_mode():
            rows = draft_rows(drafter, store, shared, gamma, max(len(o) for o in outputs))
        n = rows["per_seq"]
        frames.append(pl.DataFrame({
            "request_id": np.repeat(np.arange(lo, lo + len(recs)), n).astype(np.int32),
            "domain": np.repeat(np.asarray(domains[lo : lo + len(recs)]), n).astype(str),
            "position": np.concatenate([np.arange(k) for k in n]).astype(np.int32),
            "accept_len": rows["accept_len"].astype(np.int8),
            "conf": pl.Series("conf", rows["conf"].astype(np.float32),
                              dtype=pl.Array(pl.Float32, gamma)),
        }))
    meta = TraceMeta(drafter=kind, target=target.name, gamma_max=gamma, source="captured",
                     temperature=0.0,
                     generator={"tool": "dspark_sim.validation.harness", "from": "served sequences"})
    return trace_from_frame(pl.concat(frames), meta, f"validate-{kind}")


# -- profiles ------------------------------------------------------------------------------------


def measure_server_profile(server: Any, *, requests: Sequence[int] = (1, 2, 4, 8),
                           verify_lengths: Sequence[int] = (0, 1, 3, 7),
                           contexts: Sequence[int] = (64, 256),
                           prefill_chunks: Sequence[int] | None = None,
                           draft_gammas: Sequence[int] = (1, 3, 7), repeats: int = 3,
                           clock: str = "cpu", name: str = "smollm2-cpu-validate",
                           logit_rows: Sequence[int] = (1, 4, 16, 64),
                           drafter_between: bool = True,
                           log=print) -> EngineProfile:
    """Engine-in-the-loop profile: the server's own forward + greedy verification timed on
    ``R x (1 + l)`` verify shapes at contexts ``L`` (all rows produce logits) and on single
    prefill chunks (one logit row, as the server runs them), fitted jointly as
    ``t = f(B) + kv * R * L + attn * query_ctx + logits * rows``
    (:func:`dspark_sim.calibration.measure.fit_terms` on the times less ``logits * rows``;
    ``query_ctx`` is the engine's attention unit, ``R * (1 + l) * L`` for a verify shape and
    ``c * c / 2`` for a prefill chunk of ``c`` tokens from position 0); ``logits``
    (``logits_s_per_row``) is the LM head's per-row slope timed on ``logit_rows`` rows, its
    fixed cost stays in ``f(B)``. The drafter's batched cost is tabulated under its own
    kind.

    ``prefill_chunks`` defaults to every size 2..64 and every 16 tokens above, up to
    ``max_num_batched_tokens`` (:func:`~dspark_sim.calibration.measure.default_prefill_chunks`
    with ``dense_to=64``): the CPU forward's cost is jagged in B, so the table is measured
    at every B a decode step can have rather than interpolated. All shapes are interleaved
    in one random order per pass; with ``drafter_between`` the server's drafter runs
    (untimed) before every timed pass, reproducing the cache state of a serving step."""
    import torch

    from dspark_sim.calibration.measure import (
        FIT_NOTE,
        Sample,
        Shape,
        default_prefill_chunks,
        fit_logits,
        fit_terms,
        heldout_error,
    )
    from dspark_sim.validation.server import ServeRequest, time_server_shapes

    log = log or (lambda _m: None)
    eng = server.engine
    dr = server.drafter
    max_b = server.cfg.max_num_batched_tokens
    cap = min(max_b, eng.max_len)
    if prefill_chunks is None:
        prefill_chunks = default_prefill_chunks(cap, dense_to=64)
    chunks = sorted({int(x) for x in prefill_chunks if 1 < int(x) <= cap})
    shapes = [Shape(r, v, c) for c in contexts for v in verify_lengths for r in requests
              if r <= eng.max_slots and c + 1 + v <= eng.max_len and r * (1 + v) <= max_b]
    shapes += [Shape(1, b - 1, 0) for b in chunks]
    t0 = time.perf_counter()
    # dummy decoding requests (~200 context tokens) for the drafter: run between timed
    # passes and timed on their own for the draft cost
    rng = np.random.default_rng(1)
    pool = []
    for i in range(max(max(requests), 1)):
        motif = rng.integers(0, eng.vocab, size=16).tolist()
        r = ServeRequest(i, 0.0, (motif * 10)[:150], 64)
        r.generated = (motif * 4)[:50]
        dr.new_request(r)
        if dr.learned:
            nf = len(dr.feature_layers) + 1
            r.feats = torch.randn(eng.max_len, nf, int(eng.model.config.hidden_size))
        pool.append(r)

    def between(n: int) -> None:
        for r in pool:  # lookup: keep the incremental index at steady state
            if r.lookup is not None:
                r.lookup.added = max(0, r.lookup.added - 1)
        dr.draft(pool[:n], dr.gamma_max)

    times = time_server_shapes(server, shapes, warmup=1, repeats=repeats, clock=clock,
                               between=between if drafter_between else None)
    now = time.thread_time if clock == "cpu" else time.perf_counter
    # the LM head alone on k rows: its per-row slope is the profile's logits term
    head = eng.model.lm_head
    hid = torch.randn(max(logit_rows), int(head.weight.shape[1]), device=eng.device,
                      dtype=head.weight.dtype)
    head_t: dict[int, list[float]] = {int(k): [] for k in logit_rows}
    with torch.inference_mode():
        for rnd in range(1 + repeats):
            for k in sorted(head_t):
                t1 = now()
                out = head(hid[:k])
                float(out[0, 0])
                if rnd:
                    head_t[k].append(now() - t1)
    rows_k = sorted(head_t)
    head_med = [float(np.median(head_t[k])) for k in rows_k]
    logits_fixed_s, logits_s = fit_logits(rows_k, head_med)
    # verify shapes project every row onto the vocabulary, prefill chunks their last row:
    # keep the LM head's fixed cost in f(B), move the per-row part into the logits term
    samples = [Sample(s, max(float(np.median(t)) - logits_s * (s.tokens if s.context else 1),
                             1e-9), float(np.std(t)))
               for s, t in zip(shapes, times, strict=True)]
    fit = fit_terms(samples)
    tokens, step, std, kv_s = fit.tokens, fit.step_s, fit.std_s, fit.kv_s_per_token
    attn_s = fit.attn_s_per_query_ctx
    multi_kv_s, request_s = fit.multi_kv_s_per_token, fit.request_s
    # the same held-out check as calibration.measure: a quarter of the interior shapes
    # left out of the fit and predicted
    check = heldout_error(samples, "linear", 0.25, 0)
    # the drafter: batched drafting of n of the dummy requests
    drafts: dict[str, DraftCost] = {}
    batch = sorted({int(r) for r in requests})
    gammas = sorted({min(int(g), dr.gamma_max) for g in draft_gammas})
    med: dict[int, list[float]] = {g: [] for g in gammas}
    for g in gammas:
        for nreq in batch:
            reqs = pool[:nreq]
            ts = []
            for k in range(1 + repeats):
                for r in reqs:  # lookup: time the steady-state incremental draft
                    if r.lookup is not None:
                        r.lookup.added = max(0, r.lookup.added - 1)
                t1 = now()
                dr.draft(reqs, g)
                if k:
                    ts.append(now() - t1)
            med[g].append(float(np.median(ts)))
    gref = max(gammas)
    ref = np.asarray(med[gref])
    slope = 0.0
    if len(gammas) > 1:
        est = [float(np.median(np.asarray(med[g]) / np.maximum(ref, 1e-9) - 1.0)) / (g - gref)
               for g in gammas if g != gref]
        slope = max(0.0, float(np.mean(est)))
    drafts[dr.kind] = DraftCost(np.asarray(batch, float), ref, gref, slope)
    elapsed = time.perf_counter() - t0
    log(f"engine-in-the-loop profile: {len(samples)} shapes, kv {kv_s * 1e6:.4f} us/token, "
        f"attn {attn_s * 1e9:.1f} ns/(query x ctx), multi-token kv {multi_kv_s * 1e6:.2f} "
        f"us/token, {request_s * 1e3:.2f} ms/request, "
        f"f(1) {step[0] * 1e3:.1f} ms, f({tokens[-1]}) {step[-1] * 1e3:.1f} ms, "
        f"logits {logits_s * 1e6:.1f} us/row (+{logits_fixed_s * 1e3:.2f} ms fixed), "
        f"draft {dr.kind} n=1 {ref[0] * 1e3:.2f} ms ({elapsed:.0f} s); held-out "
        f"{check['heldout_shapes']} shapes, relative error mean "
        f"{check['heldout_mean_rel_error']:.1%}, max {check['heldout_max_rel_error']:.1%}")
    params = {
        "model": getattr(eng.model.config, "_name_or_path", "") or "target",
        "device": str(eng.device),
        "device_name": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": int(torch.get_num_threads()),
        "dtype": str(eng.dtype).replace("torch.", ""),
        "date": _dt.date.today().isoformat(),
        "clock": "thread CPU time" if clock == "cpu" else "wall clock",
        "method": "engine-in-the-loop: dspark_sim.validation.server forward + verify_greedy",
        "fit": FIT_NOTE,
        "prefill_chunks": chunks,
        "between_passes": "the server's drafter (untimed)" if drafter_between else "nothing",
        "repeats": int(repeats),
        "logits": "LM head timed alone; table = measured - logits_per_row * logit rows",
        "logit_rows": [int(k) for k in rows_k],
        "logit_rows_median_ms": [round(t * 1e3, 4) for t in head_med],
        "logits_fixed_ms": round(logits_fixed_s * 1e3, 4),
        "draft_source": f"{dr.kind} drafter of the validation server",
        "elapsed_s": round(elapsed, 1),
        "shape_requests": [s.shape.requests for s in samples],
        "shape_verify": [s.shape.verify for s in samples],
        "shape_context": [s.shape.context for s in samples],
        "shape_median_ms": [round(s.median_s * 1e3, 4) for s in samples],
    }
    params |= {k: (round(v, 5) if isinstance(v, float) else v) for k, v in check.items()}
    return EngineProfile(name=name, kind="measured", gpus_per_replica=1,
                         tokens=tokens.astype(np.int64), step_s=step, step_std_s=std,
                         kv_s_per_token=kv_s, logits_s_per_row=logits_s,
                         attn_s_per_query_ctx=attn_s, multi_kv_s_per_token=multi_kv_s,
                         request_s=request_s, interpolation="linear", drafts=drafts,
                         description="Engine-in-the-loop profile of the validation server "
                                     "(sim/validate.py): its own forward + verification",
                         parameters=params)


def _records(records) -> np.ndarray:
    """Step records as a float matrix of 10 columns; fields older records lack count 0."""
    a = np.asarray(records, dtype=np.float64).reshape(len(records), -1)
    if a.shape[1] < 10:
        a = np.pad(a, ((0, 0), (0, 10 - a.shape[1])))
    return a


def _forward_s(a: np.ndarray, profile: EngineProfile) -> np.ndarray:
    """The profile's target-forward time of each recorded step (no draft): ``f(B) + kv * KV
    + logits * (verify rows + finishing prefills) + attn * query_ctx + multi_kv * multi_ctx
    + request * ctx_requests``."""
    ver, pre, kv, fin, qc, mkv, nrq = (a[:, i] for i in (3, 4, 5, 6, 7, 8, 9))
    return (np.asarray(profile.target_time_s((ver + pre).astype(np.int64)))
            + profile.kv_s_per_token * kv + profile.logits_s_per_row * (ver + fin)
            + profile.attn_s_per_query_ctx * qc + profile.multi_kv_s_per_token * mkv
            + profile.request_s * nrq)


def _nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0 (small problems): drop the most negative
    coefficient and refit until none is negative."""
    active = list(range(a.shape[1]))
    sol = np.zeros(a.shape[1])
    while active:
        x, *_ = np.linalg.lstsq(a[:, active], y, rcond=None)
        if np.all(x >= 0):
            sol[active] = x
            break
        active.pop(int(np.argmin(x)))
    return sol


def rescale_to_steps(records: Sequence[Sequence[tuple]], base: EngineProfile, draft_key: str | None,
                     record_gammas: Sequence[int], gamma: int,
                     name: str = "insitu-loo") -> EngineProfile:
    """``base`` with its forward terms scaled and its draft cost refitted to real serving
    steps (of *other* points: leave-one-point-out).

    Why: timed in isolation (even engine-in-the-loop, with the drafter run between timed
    passes), a forward runs 5-19 % faster than the same block structure inside the serving
    loop on this CPU (measured by replaying the server's own steps in isolation); the gap
    grows with the drafter's work per step. The table's *shape* (jagged in B) is right;
    its level is not. Model, weighted least squares (weights 1/dt) with non-negative
    coefficients on the records' fields::

        dt = s * forward_base(step) + a_g + b_g * n_decoding      (g = the step's draft gamma)

    ``forward_base`` is ``base``'s ``f(B) + kv + logits + attn + multi_kv + request`` terms
    of the step. The result scales every forward term by ``s`` and replaces
    ``[draft.<draft_key>]`` by ``a + b * n`` for the point's own ``gamma`` (fitted on the
    other points' steps with that gamma; all steps when none has it).
    """
    flat = [r for recs in records for r in recs]
    if not flat:
        raise InputError("insitu", "no serving steps to fit")
    a = _records(flat)
    gam = np.concatenate([np.full(len(recs), int(g)) for recs, g in zip(
        records, record_gammas, strict=True)])
    dt, n_dec = a[:, 0], a[:, 2]
    fwd = _forward_s(a, base)
    gs = sorted(set(gam.tolist()))
    cols = [fwd]
    for g in gs:
        on = (gam == g) & (n_dec > 0)
        cols += [on.astype(np.float64), on * n_dec]
    A = np.stack(cols, 1)
    w = 1.0 / np.maximum(dt, 1e-9)
    sol = _nnls(A * w[:, None], dt * w)
    scale = float(sol[0]) if sol[0] > 0 else 1.0
    g_fit = gamma if gamma in gs else gs[-1]
    k = 1 + 2 * gs.index(g_fit)
    d0, d1 = float(sol[k]), float(sol[k + 1])
    drafts = dict(base.drafts)
    if draft_key is not None:
        nmax = max(2, int(n_dec.max()) if n_dec.size else 2)
        batch = np.arange(1, nmax + 1, dtype=np.float64)
        drafts[draft_key] = DraftCost(batch, d0 + d1 * batch, int(gamma), 0.0)
    from dataclasses import replace as _replace

    return _replace(
        base, name=name, step_s=np.asarray(base.step_s) * scale,
        step_std_s=None if base.step_std_s is None else np.asarray(base.step_std_s) * scale,
        kv_s_per_token=base.kv_s_per_token * scale,
        logits_s_per_row=base.logits_s_per_row * scale,
        attn_s_per_query_ctx=base.attn_s_per_query_ctx * scale,
        multi_kv_s_per_token=base.multi_kv_s_per_token * scale, request_s=base.request_s * scale,
        drafts=drafts,
        description=f"{base.name} rescaled to the validation server's own steps "
                    "(leave-one-point-out)",
        parameters={"steps": int(len(dt)), "base": base.name, "forward_scale": round(scale, 4),
                    "draft_gamma": int(g_fit), "draft_ms": round(d0 * 1e3, 3),
                    "draft_ms_per_request": round(d1 * 1e3, 3),
                    "fit": "dt = s * forward_base + a_g + b_g * n, NNLS, weights 1/dt"})


def with_draft(profile: EngineProfile, kind: str, measured: EngineProfile | None) -> EngineProfile:
    """``profile`` plus a ``[draft.<kind>]`` section (from ``measured``) when it lacks one."""
    if kind in profile.drafts or measured is None or kind not in measured.drafts:
        return profile
    return replace(profile, drafts={**profile.drafts, kind: measured.drafts[kind]})


# -- simulation -----------------------------------------------------------------------------------


def sim_config(workload_path: Path, policy: str, engine: EngineConfig, profile_path: str,
               n: int, seed: int = 0, calibration: str | None = None) -> SimConfig:
    return SimConfig(
        engine=engine,
        deployment=DeploymentConfig(replicas=1, router="round-robin", profile=profile_path),
        workload=WorkloadConfig(arrival="replay", workload_path=str(workload_path),
                                num_requests=n),
        policy=policy, seed=seed, drain_timeout_s=1e6, calibration=calibration,
    )


def simulate_paired(cfg: SimConfig, profile: EngineProfile, trace: AcceptanceTrace,
                    calibration: CalibrationMap | None = None,
                    policy_profile: EngineProfile | None = None) -> dict:
    """The simulator's engine on a replayed workload with request ``i`` replaying trace row
    ``i`` (no random row assignment). Same engine code as :func:`simulate`."""
    n = build_stream(cfg.workload, np.random.default_rng(cfg.seed)).size
    res = simulate(cfg, profile=profile, trace=trace,
                   calibration=calibration or load_calibration(cfg.calibration),
                   trace_rows=np.arange(n) % trace.num_requests, policy_profile=policy_profile)
    return res.summary


def _mean_summaries(summaries: list[dict]) -> dict:
    out = dict(summaries[0])
    for key, _ in METRICS + (("mean_step_ms", ""), ("engine_steps", ""), ("duration", "")):
        vals = [s.get(key) for s in summaries]
        vals = [float(v) for v in vals if v is not None]
        out[key] = float(np.mean(vals)) if vals else None
    return out


def step_model_check(records: list[tuple], profile: EngineProfile, draft_key: str | None,
                     draft_gamma: int) -> dict:
    """Measured step time vs the profile's ``draft + target(B) + kv * KV + logits * rows
    + attn * query_ctx + multi_kv * multi_ctx + request * ctx_requests`` (rows: verify
    tokens + prefills finishing in the step; query_ctx: the step's sum of query tokens x
    attended context, the record's 8th field; multi_ctx / ctx_requests: context of
    multi-token blocks and requests with a context, 9th / 10th; missing fields of older
    records count 0), per step kind."""
    if not records:
        return {}
    a = _records(records)
    dt, fwd, n_dec, pre = a[:, 0], a[:, 1], a[:, 2], a[:, 4]
    pred_t = _forward_s(a, profile)
    pred_d = np.array([profile.draft_time_s(draft_key, int(k), draft_gamma) if draft_key else 0.0
                       for k in n_dec])
    pred = pred_t + pred_d
    out = {}
    for name, m in (("decode", pre == 0), ("prefill", pre > 0), ("all", np.ones_like(pre, bool))):
        if m.any():
            out[f"{name}_steps"] = int(m.sum())
            out[f"{name}_measured_ms"] = float(dt[m].mean() * 1e3)
            out[f"{name}_predicted_ms"] = float(pred[m].mean() * 1e3)
            out[f"{name}_forward_ms"] = float(fwd[m].mean() * 1e3)
            out[f"{name}_overhead_ms"] = float((dt[m] - fwd[m]).mean() * 1e3)
            out[f"{name}_rel_error"] = float(pred[m].sum() / dt[m].sum() - 1.0)
    return out


# -- the comparison ------------------------------------------------------------------------------------


def _rel(sim: float | None, real: float | None) -> float | None:
    if sim is None or real is None or not math.isfinite(real) or real == 0:
        return None
    return float(sim) / float(real) - 1.0


def _resolve_drafter(spec: str) -> str:
    if spec != "auto":
        return spec
    from dspark_sim.traces.capture import SHIPPED_DRAFTERS

    for kind in ("dspark", "mtp1"):
        if (SHIPPED_DRAFTERS / kind / "drafter.safetensors").is_file():
            return kind
    return "lookup"


def validate(
    policies: Sequence[str] = DEFAULT_POLICIES,
    rates: Sequence[float] = DEFAULT_RATES,
    num_requests: int = 10,
    max_new_tokens: int = 128,
    out_dir: str | Path = "runs/validate",
    device: str = "cpu",
    *,
    target: Any = "smollm2",
    drafter: str = "auto",
    profile: str | EngineProfile | Sequence[str | EngineProfile] = (INSITU, "measure", "auto"),
    calibration: str | None = None,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 256,
    max_prompt_tokens: int = 128,
    gamma_max: int = 7,
    clock: str = "auto",
    num_threads: int | None = 1,
    sim_seeds: int = 5,
    seed: int = 0,
    save_profile: str | Path | None = None,
    log=print,
) -> pl.DataFrame:
    """Real serving runs vs simulations of the same workloads; returns the comparison.

    One row per (policy, rate, metric): ``real``, ``sim`` (mean of ``sim_seeds``
    :func:`simulate` runs), ``rel_error`` (sim / real - 1), ``paired`` and
    ``paired_rel_error`` (request ``i`` replays its own trace row). Writes under
    ``out_dir``: ``<policy>-r<rate>/{real,sim,paired}/summary.json`` (+
    ``requests.parquet`` for real/sim), ``workload-r<rate>.jsonl``, the profile used,
    ``comparison.parquet`` / ``comparison.csv`` and ``validation.json``.

    ``profile``: one spec or several, each simulated; the first is the headline, the first
    that is not ``"insitu"`` gives the server's SPS curve (and every simulation's, via
    ``policy_profile``, so rows compare step-cost models under the same scheduler table):
    ``"auto"`` (built-in ``smollm2-cpu`` if shipped, else measured), ``"measure"``
    (engine-in-the-loop, see :func:`measure_server_profile`; ``save_profile`` writes it),
    ``"insitu"`` (the first real profile rescaled to the *other* points' real steps,
    :func:`rescale_to_steps`: the serving loop's level, leave-one-point-out), a profile
    name/path or an :class:`EngineProfile`; rows carry a ``profile`` column.
    ``target``: ``"smollm2"``, a path, a :class:`~dspark_sim.traces.targets.Target` or a
    ``(model, tokenizer)`` pair (tokenizer may be None: random prompts). ``drafter``:
    ``auto`` | ``lookup`` | a shipped kind | a checkpoint directory.
    """
    import torch

    from dspark_sim.traces.drafters import Lookup, Shared, load_drafter
    from dspark_sim.traces.targets import Target, load_target
    from dspark_sim.validation.server import DraftRunner, ServerConfig, SpecServer, resolve_clock

    log = log or (lambda _m: None)
    if not policies or not rates:
        raise InputError("validate", "need at least one policy and one rate")
    pols = [get_policy(p) for p in policies]
    for r in rates:
        if not (float(r) > 0 and math.isfinite(float(r))):
            raise InputError("--rates", f"rates must be positive, got {r!r}")
    if num_requests < 1 or max_new_tokens < 2:
        raise InputError("validate", "need num_requests >= 1 and max_new_tokens >= 2")
    saved_threads = torch.get_num_threads()
    if num_threads is not None and torch.device(device).type == "cpu":
        torch.set_num_threads(int(num_threads))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t_begin = time.perf_counter()
    try:
        if isinstance(target, tuple):
            model, tok = target
            model = model.to(device).eval()
            tgt = Target(name=getattr(model.config, "_name_or_path", "") or "custom",
                         model=model, tokenizer=tok, device=torch.device(device),
                         source="in-memory")
        else:
            tgt = load_target(target, device=device)
        drafter_spec = _resolve_drafter(drafter)
        if drafter_spec == "lookup":
            dmodel: Any = Lookup(max_ngram=3)
            shared = None
            kind = "lookup"
        else:
            from dspark_sim.traces.capture import SHIPPED_DRAFTERS

            p = Path(drafter_spec)
            if not p.exists() and (SHIPPED_DRAFTERS / drafter_spec).is_dir():
                p = SHIPPED_DRAFTERS / drafter_spec
            dmodel, info = load_drafter(p, tgt)
            dmodel.cfg.gamma = max(dmodel.cfg.gamma, gamma_max)
            shared = Shared.of(tgt)
            kind = info.get("kind", p.name)
        runner = DraftRunner(dmodel, shared, kind)
        runner.gamma_max = gamma_max
        prompts, domains = prompt_pool(tgt, num_requests, max_prompt_tokens, seed,
                                       vocab=tgt.vocab_size)
        max_len = max(len(p) for p in prompts) + max_new_tokens + gamma_max + 2
        kv_cap = max_num_seqs * max_len
        scfg = ServerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                            kv_capacity_tokens=kv_cap, kv_mode="reserve", clock=clock)
        calib = load_calibration(calibration)
        server = SpecServer(tgt.model, runner, scfg,
                            max_len=max(max_len, 256 + gamma_max + 2, max_num_batched_tokens + 1),
                            calibration=None if calib.is_identity else calib)
        clock_kind = resolve_clock(clock, server.engine.device)
        # -- profiles: the first is the headline; the first real one drives the SPS curve
        specs = [profile] if isinstance(profile, str | EngineProfile) else list(profile)
        measured: EngineProfile | None = None

        def resolve(spec) -> EngineProfile:
            nonlocal measured
            if isinstance(spec, EngineProfile):
                return spec
            if spec == "auto" and SHIPPED_PROFILE in builtin_profiles():
                return load_profile(SHIPPED_PROFILE)
            if spec in ("auto", "measure"):
                measured = measured or measure_server_profile(server, clock=clock_kind, log=log)
                return measured
            return load_profile(spec)

        profs: list[Any] = []
        for spec in specs:
            if spec in _INSITU:
                if spec not in profs:
                    profs.append(spec)
                continue
            p = resolve(spec)
            if kind not in p.drafts:
                measured = measured or measure_server_profile(server, clock=clock_kind, log=log)
                p = with_draft(p, kind, measured)
            if all(isinstance(q, str) or q.name != p.name for q in profs):
                profs.append(p)
        real_profs = [p for p in profs if not isinstance(p, str)]
        if not real_profs:
            raise InputError("--profile", "'insitu' needs another profile for the server's SPS")
        prof = real_profs[0]
        server.profile = prof
        prof_paths = []
        for i, p in enumerate(profs):
            if isinstance(p, str):
                prof_paths.append(None)
                continue
            prof_paths.append(out / f"profile-{i}-{p.name}.toml")
            write_text_atomic(prof_paths[-1], p.to_toml())
        if save_profile is not None and measured is not None:
            write_text_atomic(save_profile, measured.to_toml())
        engine_cfg = EngineConfig(max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens,
                                  kv_capacity_tokens=kv_cap, kv_mode="reserve")
        rows: list[dict] = []
        points: list[dict] = []
        runs = []  # phase 1: every real run
        traces: dict[tuple, AcceptanceTrace] = {}
        for rate in rates:
            w = poisson_workload(prompts, domains, float(rate), max_new_tokens, seed)
            wpath = write_mooncake(out / f"workload-r{rate:g}.jsonl", w)
            for pol in pols:
                tag = f"{pol.name.replace(':', '')}-r{rate:g}"
                t0 = time.perf_counter()
                res = server.serve(w.prompts, list(w.output_tokens), list(w.arrival_s), pol)
                real = summarize(res.log, res.stats, gpus=1, slo_ttft_ms=None, slo_tpot_ms=None,
                                 stable=True, queue_growth_per_s=0.0)
                real = jsonable({"policy": pol.name, "source": "real server",
                                  "clock": res.clock, "drafter": kind, "rate": float(rate),
                                  "wall_s": res.wall_s, "cpu_s": res.cpu_s, **real})
                _write_run(out / tag / "real", real, requests_frame(res.log))
                with atomic_path(out / tag / "real" / "steps.parquet") as tmp:
                    pl.DataFrame(np.asarray(res.step_records, dtype=np.float64).reshape(-1, 10),
                                 schema=["step_s", "forward_s", "decoding", "verify_tokens",
                                         "prefill_tokens", "kv_tokens", "finishing_prefills",
                                         "query_ctx", "multi_ctx", "ctx_requests"],
                                 orient="row").write_parquet(tmp)
                # the trace of the same models on the same sequences (greedy decoding is
                # lossless, so every policy and rate serves the same tokens: build it once)
                key = tuple(tuple(o) for o in res.outputs)
                if key not in traces:
                    if kind == "lookup":
                        traces[key] = lookup_trace(w.prompts, res.outputs, w.domains, gamma_max,
                                                   tgt.name, runner.max_ngram)
                    else:
                        traces[key] = learned_trace(tgt, dmodel, w.prompts, res.outputs,
                                                    w.domains, gamma_max, kind)
                trace = traces[key]
                runs.append((rate, w, wpath, pol, tag, res, real, trace,
                             time.perf_counter() - t0))
                log(f"[{pol.name} @ {rate:g} req/s] real run: {real['engine_steps']} steps, "
                    f"{real['output_throughput']:.1f} tok/s, median TPOT "
                    f"{real['median_tpot_ms']:.1f} ms ({res.wall_s:.0f} s wall)")
        # phase 2: simulate every point under every profile
        for ri, (rate, w, wpath, pol, tag, res, real, trace, t_real) in enumerate(runs):
            t0 = time.perf_counter()
            point = {"policy": pol.name, "rate": float(rate), "tag": tag,
                     "real_steps": real.get("engine_steps"),
                     "real_mean_step_ms": real.get("mean_step_ms"),
                     "real_duration_s": real.get("duration"), "real_wall_s": res.wall_s,
                     "real_cpu_s": res.cpu_s, "profiles": {}}
            for pi, spec in enumerate(profs):
                if spec in _INSITU:
                    # insitu: the other points' steps (leave-one-out); insitu-self: the
                    # point's own steps, a diagnostic of the structure once the level is known
                    others = ([r for j, r in enumerate(runs) if j != ri] or [runs[ri]]) \
                        if spec == INSITU else [runs[ri]]

                    def _g(pol_):
                        return min(gamma_max, pol_.draft_gamma if pol_.draft_gamma is not None
                                   else gamma_max)

                    pname = "insitu-loo" if spec == INSITU else "insitu-self"
                    p = rescale_to_steps([r[5].step_records for r in others], prof,
                                         kind if kind in prof.drafts else None,
                                         [_g(r[3]) for r in others], _g(pol), name=pname)
                    ppath = out / tag / f"profile-{pname}.toml"
                    ppath.parent.mkdir(parents=True, exist_ok=True)
                    write_text_atomic(ppath, p.to_toml())
                else:
                    p, ppath = spec, prof_paths[pi]
                cfg = sim_config(wpath, pol.name, engine_cfg, str(ppath), len(w.prompts),
                                 calibration=calibration)
                # the scheduler's SPS curve comes from the table the server's scheduler
                # used (``prof``), whatever profile prices the steps: each row compares
                # step-cost models, not two schedulers fed different tables
                sims = [simulate(replace(cfg, seed=seed + k), profile=p, trace=trace,
                                 policy_profile=prof)
                        for k in range(max(1, sim_seeds))]
                sim = _mean_summaries([x.summary for x in sims])
                sub = "" if pi == 0 else f"-{p.name}"
                _write_run(out / tag / f"sim{sub}", sim, sims[0].requests)
                paired = simulate_paired(cfg, p, trace, calib, policy_profile=prof)
                _write_run(out / tag / f"paired{sub}", paired, None)
                dkey = kind if kind in p.drafts else None
                dgam = pol.draft_gamma if pol.draft_gamma is not None else gamma_max
                check = step_model_check(res.step_records, p, dkey, min(dgam, gamma_max))
                for key, label in METRICS:
                    rows.append({
                        "profile": p.name, "policy": pol.name, "rate": float(rate),
                        "metric": key, "label": label,
                        "real": _f(real.get(key)), "sim": _f(sim.get(key)),
                        "rel_error": _rel(sim.get(key), real.get(key)),
                        "paired": _f(paired.get(key)),
                        "paired_rel_error": _rel(paired.get(key), real.get(key)),
                    })
                point["profiles"][p.name] = {
                    "sim_steps": sim.get("engine_steps"),
                    "sim_mean_step_ms": sim.get("mean_step_ms"),
                    "paired_steps": paired.get("engine_steps"),
                    "paired_mean_step_ms": paired.get("mean_step_ms"),
                    "step_check": check}
                if pi == 0:
                    head_rows, head_check = rows[-len(METRICS):], check
            point["sim_wall_s"] = time.perf_counter() - t0
            points.append(point)
            log(_point_line(pol.name, rate, head_rows, head_check, t_real))
        df = pl.DataFrame(rows, schema={
            "profile": pl.Utf8, "policy": pl.Utf8, "rate": pl.Float64, "metric": pl.Utf8, "label": pl.Utf8,
            "real": pl.Float64, "sim": pl.Float64, "rel_error": pl.Float64,
            "paired": pl.Float64, "paired_rel_error": pl.Float64})
        with atomic_path(out / "comparison.parquet") as tmp:
            df.write_parquet(tmp)
        with atomic_path(out / "comparison.csv") as tmp:
            df.write_csv(tmp)
        write_json_atomic(out / "validation.json", jsonable({
            "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()} {platform.processor()} ({platform.node()})",
            "device": device, "threads": int(torch.get_num_threads()), "clock": clock_kind,
            "target": tgt.name, "drafter": kind, "profile": prof.name,
            "profiles": [p if isinstance(p, str) else p.name for p in profs],
            "profile_kind": prof.kind, "policies": [p.name for p in pols],
            "rates": [float(r) for r in rates], "num_requests": num_requests,
            "max_new_tokens": max_new_tokens, "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens, "sim_seeds": sim_seeds,
            "elapsed_s": time.perf_counter() - t_begin, "points": points}))
        return df
    finally:
        torch.set_num_threads(saved_threads)


def _f(v) -> float | None:
    return None if v is None else float(v)


def _write_run(d: Path, summary: dict, requests: pl.DataFrame | None) -> None:
    d.mkdir(parents=True, exist_ok=True)
    if requests is not None:
        with atomic_path(d / "requests.parquet") as tmp:
            requests.write_parquet(tmp)
    write_json_atomic(d / "summary.json", jsonable(summary))


def _fmt(v: float | None, err: bool = False) -> str:
    if v is None or not math.isfinite(v):
        return "-"
    return f"{v:+.1%}" if err else (f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}")


def _point_line(policy: str, rate: float, rows: list[dict], check: dict, elapsed: float) -> str:
    parts = [f"{r['label']} {_fmt(r['real'])}/{_fmt(r['sim'])} ({_fmt(r['rel_error'], True)})"
             for r in rows]
    step = (f"; step model {_fmt(check.get('all_rel_error'), True)}" if check else "")
    return f"[{policy} @ {rate:g} req/s, {elapsed:.0f} s] real/sim: " + ", ".join(parts) + step


def format_table(df: pl.DataFrame) -> str:
    """A Markdown table: one row per (policy, rate), real / sim (error) per metric."""
    head = "| profile | policy | rate | " + " | ".join(lbl for _, lbl in METRICS) + " |"
    lines = [head, "|" + "---|" * (3 + len(METRICS))]
    for (prof, pol, rate), g in df.group_by(["profile", "policy", "rate"], maintain_order=True):
        cells = []
        by = {r["metric"]: r for r in g.iter_rows(named=True)}
        for key, _ in METRICS:
            r = by.get(key)
            cells.append("-" if r is None else
                         f"{_fmt(r['real'])} / {_fmt(r['sim'])} ({_fmt(r['rel_error'], True)}; "
                         f"paired {_fmt(r['paired_rel_error'], True)})")
        lines.append(f"| {prof} | {pol} | {rate:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(
    policies: Sequence[str] = DEFAULT_POLICIES,
    rates: Sequence[float] = DEFAULT_RATES,
    num_requests: int = 10,
    max_new_tokens: int = 128,
    out_dir: str | Path = "runs/validate",
    device: str = "cpu",
    drafter: str = "auto",
    profile: str = "insitu,measure,auto",
    clock: str = "auto",
    sim_seeds: int = 5,
    seed: int = 0,
    save_profile: str | None = None,
) -> int:
    """CLI helper: run :func:`validate`, print the table; exit code 0 when every point is
    within 10 % on output throughput and median TPOT (first profile), 1 otherwise.
    ``profile``: comma-separated specs (see :func:`validate`)."""
    specs = [p.strip() for p in str(profile).split(",") if p.strip()]
    df = validate(policies, rates, num_requests, max_new_tokens, out_dir, device,
                  drafter=drafter, profile=specs, clock=clock, sim_seeds=sim_seeds, seed=seed,
                  save_profile=save_profile)
    print(format_table(df))
    first = df["profile"][0]
    key = df.filter(pl.col("metric").is_in(["output_throughput", "median_tpot_ms"])
                    & (pl.col("profile") == first))
    worst = key["rel_error"].abs().max()
    print(f"worst |error| on output throughput / median TPOT: {_fmt(worst, True)} "
          f"(target 10%); results in {out_dir}")
    return 0 if worst is not None and worst <= 0.10 else 1


__all__ = ["validate", "main", "format_table", "measure_server_profile", "simulate_paired",
           "lookup_trace", "poisson_workload", "write_mooncake", "step_model_check",
           "rescale_to_steps"]
