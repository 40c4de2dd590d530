"""Engine profiles of the validation server, and how a profile predicts its steps.

* :func:`measure_server_profile`: an *engine-in-the-loop* profile -- the server's own
  forward + greedy verification timed on a grid of shapes, the LM head and the drafter
  timed alone, fitted like :mod:`dspark_sim.calibration.measure` fits a profile;
* :func:`rescale_to_steps`: a profile's forward terms scaled and its draft cost refitted
  to real serving steps (the level of the serving loop, leave-one-point-out);
* :func:`step_model_check`: measured step times vs a profile's prediction of each
  recorded step (one definition of that prediction, :func:`forward_s`, serves both).

A step record (``ServeResult.step_records``) is ``(step s, forward+verify s, decoding
requests, verify tokens, prefill tokens, KV tokens, finishing prefills, query x context,
context of multi-token blocks, requests with a context)``; older records may lack the
trailing fields, which then count 0.
"""

from __future__ import annotations

import datetime as _dt
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from dspark_sim.calibration.profile import DraftCost, EngineProfile
from dspark_sim.errors import InputError

RECORD_FIELDS = 10


# -- measuring ----------------------------------------------------------------------------------


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

    from dspark_sim.calibration.measure import Sample, fit_terms, heldout_error
    from dspark_sim.validation.server import time_server_shapes

    log = log or (lambda _m: None)
    t0 = time.perf_counter()
    shapes, chunks = _profile_shapes(server, requests, verify_lengths, contexts, prefill_chunks)
    pool = _decoding_pool(server, max(max(requests), 1))
    times = time_server_shapes(server, shapes, warmup=1, repeats=repeats, clock=clock,
                               between=_drafter_pass(server.drafter, pool)
                               if drafter_between else None)
    now = time.thread_time if clock == "cpu" else time.perf_counter
    head = _time_lm_head(server.engine, logit_rows, repeats, now)
    # verify shapes project every row onto the vocabulary, prefill chunks their last row:
    # keep the LM head's fixed cost in f(B), move the per-row part into the logits term
    logits_s = head["slope_s"]
    samples = [Sample(s, max(float(np.median(t)) - logits_s * (s.tokens if s.context else 1),
                             1e-9), float(np.std(t)))
               for s, t in zip(shapes, times, strict=True)]
    fit = fit_terms(samples)
    # the same held-out check as calibration.measure: a quarter of the interior shapes
    # left out of the fit and predicted
    check = heldout_error(samples, "linear", 0.25, 0)
    draft = _draft_cost(server.drafter, pool, requests, draft_gammas, repeats, now)
    elapsed = time.perf_counter() - t0
    log(f"engine-in-the-loop profile: {len(samples)} shapes, kv {fit.kv_s_per_token * 1e6:.4f} "
        f"us/token, attn {fit.attn_s_per_query_ctx * 1e9:.1f} ns/(query x ctx), multi-token kv "
        f"{fit.multi_kv_s_per_token * 1e6:.2f} us/token, {fit.request_s * 1e3:.2f} ms/request, "
        f"f(1) {fit.step_s[0] * 1e3:.1f} ms, f({fit.tokens[-1]}) {fit.step_s[-1] * 1e3:.1f} ms, "
        f"logits {logits_s * 1e6:.1f} us/row (+{head['fixed_s'] * 1e3:.2f} ms fixed), "
        f"draft {server.drafter.kind} n=1 {draft.time_s[0] * 1e3:.2f} ms ({elapsed:.0f} s); "
        f"held-out {check['heldout_shapes']} shapes, relative error mean "
        f"{check['heldout_mean_rel_error']:.1%}, max {check['heldout_max_rel_error']:.1%}")
    params = _profile_parameters(server, torch, clock, chunks, drafter_between, repeats, head,
                                 elapsed, samples)
    params |= {k: (round(v, 5) if isinstance(v, float) else v) for k, v in check.items()}
    return replace(fit, name=name, logits_s_per_row=logits_s, interpolation="linear",
                   drafts={server.drafter.kind: draft},
                   description="Engine-in-the-loop profile of the validation server "
                               "(validation/server_profile.py): its own forward + verification",
                   parameters=params)


def _profile_shapes(server: Any, requests, verify_lengths, contexts, prefill_chunks):
    """Verify shapes that fit the server, plus one prefill chunk shape per chunk size."""
    from dspark_sim.calibration.measure import Shape, default_prefill_chunks

    eng = server.engine
    max_b = server.cfg.engine.max_num_batched_tokens
    cap = min(max_b, eng.max_len)
    if prefill_chunks is None:
        prefill_chunks = default_prefill_chunks(cap, dense_to=64)
    chunks = sorted({int(x) for x in prefill_chunks if 1 < int(x) <= cap})
    shapes = [Shape(r, v, c) for c in contexts for v in verify_lengths for r in requests
              if r <= eng.max_slots and c + 1 + v <= eng.max_len and r * (1 + v) <= max_b]
    shapes += [Shape(1, b - 1, 0) for b in chunks]
    return shapes, chunks


def _decoding_pool(server: Any, n: int) -> list:
    """``n`` dummy decoding requests (~200 context tokens, a repeated motif so that lookup
    finds matches) for the drafter to draft on."""
    import torch

    from dspark_sim.validation.server import ServeRequest

    eng, dr = server.engine, server.drafter
    rng = np.random.default_rng(1)
    pool = []
    for i in range(n):
        motif = rng.integers(0, eng.vocab, size=16).tolist()
        r = ServeRequest(i, 0.0, (motif * 10)[:150], 64)
        r.generated = (motif * 4)[:50]
        dr.new_request(r)
        if dr.learned:
            nf = len(dr.feature_layers) + 1
            r.feats = torch.randn(eng.max_len, nf, int(eng.model.config.hidden_size))
        pool.append(r)
    return pool


def _steady_lookup(pool: list) -> None:
    """Lookup drafters index incrementally: step each index back one token so the next
    draft does a serving step's incremental work, not none."""
    for r in pool:
        if r.lookup is not None:
            r.lookup.added = max(0, r.lookup.added - 1)


def _drafter_pass(drafter: Any, pool: list) -> Callable[[int], None]:
    """What runs (untimed) between two timed forwards: the drafter on ``n`` requests."""
    def between(n: int) -> None:
        _steady_lookup(pool)
        drafter.draft(pool[:n], drafter.gamma_max)

    return between


def _time_lm_head(eng: Any, logit_rows: Sequence[int], repeats: int, now) -> dict:
    """The LM head alone on k rows: its per-row slope is the profile's logits term."""
    import torch

    from dspark_sim.calibration.measure import fit_logits

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
    rows = sorted(head_t)
    med = [float(np.median(head_t[k])) for k in rows]
    fixed_s, slope_s = fit_logits(rows, med)
    return {"rows": rows, "median_s": med, "fixed_s": fixed_s, "slope_s": slope_s}


def _draft_cost(drafter: Any, pool: list, requests: Sequence[int], draft_gammas: Sequence[int],
                repeats: int, now) -> DraftCost:
    """Batched drafting of n of the dummy requests, per gamma: the table at the largest
    gamma, a slope for the others (:func:`~dspark_sim.calibration.measure.fit_gamma_slope`)."""
    from dspark_sim.calibration.measure import fit_gamma_slope

    batch = sorted({int(r) for r in requests})
    gammas = sorted({min(int(g), drafter.gamma_max) for g in draft_gammas})
    med: dict[int, list[float]] = {g: [] for g in gammas}
    for g in gammas:
        for nreq in batch:
            ts = []
            for k in range(1 + repeats):
                _steady_lookup(pool[:nreq])  # time the steady-state incremental draft
                t1 = now()
                drafter.draft(pool[:nreq], g)
                if k:
                    ts.append(now() - t1)
            med[g].append(float(np.median(ts)))
    gref = max(gammas)
    times = {g: np.asarray(v) for g, v in med.items()}
    # a block drafter drafts its whole block at every verify length in the server: the
    # profile must say so, or the simulator prices mtp1 / fixed:3 steps at 1 / 3 drafted
    # tokens and runs them up to 69 % too fast (validation.md, the dspark-drafter run)
    return DraftCost(np.asarray(batch, float), times[gref], gref, fit_gamma_slope(times, gref),
                     block=bool(getattr(drafter, "block", False)))


def _profile_parameters(server: Any, torch, clock: str, chunks, drafter_between: bool,
                        repeats: int, head: dict, elapsed: float, samples) -> dict:
    """What the profile records about how it was measured."""
    from dspark_sim.calibration.measure import FIT_NOTE

    eng = server.engine
    return {
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
        "logit_rows": [int(k) for k in head["rows"]],
        "logit_rows_median_ms": [round(t * 1e3, 4) for t in head["median_s"]],
        "logits_fixed_ms": round(head["fixed_s"] * 1e3, 4),
        "draft_source": f"{server.drafter.kind} drafter of the validation server",
        "elapsed_s": round(elapsed, 1),
        "shape_requests": [s.shape.requests for s in samples],
        "shape_verify": [s.shape.verify for s in samples],
        "shape_context": [s.shape.context for s in samples],
        "shape_median_ms": [round(s.median_s * 1e3, 4) for s in samples],
    }


def with_draft(profile: EngineProfile, kind: str, measured: EngineProfile | None) -> EngineProfile:
    """``profile`` plus a ``[draft.<kind>]`` section (from ``measured``) when it lacks one."""
    if kind in profile.drafts or measured is None or kind not in measured.drafts:
        return profile
    return replace(profile, drafts={**profile.drafts, kind: measured.drafts[kind]})


# -- predicting recorded steps ------------------------------------------------------------------


def step_records(records) -> np.ndarray:
    """Step records as a float matrix of :data:`RECORD_FIELDS` columns (missing trailing
    fields of older records count 0)."""
    a = np.asarray(records, dtype=np.float64).reshape(len(records), -1)
    if a.shape[1] < RECORD_FIELDS:
        a = np.pad(a, ((0, 0), (0, RECORD_FIELDS - a.shape[1])))
    return a


def forward_s(a: np.ndarray, profile: EngineProfile) -> np.ndarray:
    """The profile's target-forward time of each recorded step (no draft): ``f(B) + kv * KV
    + logits * (verify rows + finishing prefills) + attn * query_ctx + multi_kv * multi_ctx
    + request * ctx_requests``."""
    ver, pre, kv, fin, qc, mkv, nrq = (a[:, i] for i in (3, 4, 5, 6, 7, 8, 9))
    return (np.asarray(profile.target_time_s((ver + pre).astype(np.int64)))
            + profile.kv_s_per_token * kv + profile.logits_s_per_row * (ver + fin)
            + profile.attn_s_per_query_ctx * qc + profile.multi_kv_s_per_token * mkv
            + profile.request_s * nrq)


def step_model_check(records: list[tuple], profile: EngineProfile, draft_key: str | None,
                     draft_gamma: int) -> dict:
    """Measured step time vs the profile's ``draft + target(B) + kv * KV + logits * rows
    + attn * query_ctx + multi_kv * multi_ctx + request * ctx_requests`` (rows: verify
    tokens + prefills finishing in the step), per step kind (decode-only, with prefill,
    all)."""
    if not records:
        return {}
    a = step_records(records)
    dt, fwd, n_dec, pre = a[:, 0], a[:, 1], a[:, 2], a[:, 4]
    pred_d = np.array([profile.draft_time_s(draft_key, int(k), draft_gamma) if draft_key else 0.0
                       for k in n_dec])
    pred = forward_s(a, profile) + pred_d
    out = {}
    for kind, m in (("decode", pre == 0), ("prefill", pre > 0), ("all", np.ones_like(pre, bool))):
        if m.any():
            out[f"{kind}_steps"] = int(m.sum())
            out[f"{kind}_measured_ms"] = float(dt[m].mean() * 1e3)
            out[f"{kind}_predicted_ms"] = float(pred[m].mean() * 1e3)
            out[f"{kind}_forward_ms"] = float(fwd[m].mean() * 1e3)
            out[f"{kind}_overhead_ms"] = float((dt[m] - fwd[m]).mean() * 1e3)
            out[f"{kind}_rel_error"] = float(pred[m].sum() / dt[m].sum() - 1.0)
    return out


# -- rescaling to serving steps ------------------------------------------------------------------


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
    a = step_records(flat)
    gam = np.concatenate([np.full(len(recs), int(g)) for recs, g in zip(
        records, record_gammas, strict=True)])
    dt, n_dec = a[:, 0], a[:, 2]
    gs = sorted(set(gam.tolist()))
    cols = [forward_s(a, base)]
    for g in gs:
        on = (gam == g) & (n_dec > 0)
        cols += [on.astype(np.float64), on * n_dec]
    w = 1.0 / np.maximum(dt, 1e-9)
    sol = _nnls(np.stack(cols, 1) * w[:, None], dt * w)
    scale = float(sol[0]) if sol[0] > 0 else 1.0
    g_fit = gamma if gamma in gs else gs[-1]
    k = 1 + 2 * gs.index(g_fit)
    d0, d1 = float(sol[k]), float(sol[k + 1])
    drafts = dict(base.drafts)
    if draft_key is not None:
        nmax = max(2, int(n_dec.max()) if n_dec.size else 2)
        batch = np.arange(1, nmax + 1, dtype=np.float64)
        block = draft_key in base.drafts and base.drafts[draft_key].block
        drafts[draft_key] = DraftCost(batch, d0 + d1 * batch, int(gamma), 0.0, block=block)
    return replace(
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
