"""The lossy axis against ASD's published setting (arXiv 2608.03447; figures in
``shared/reference/PUBLISHED_FIGURES.md``): DeepSeek-V4-Flash-DSpark, 8xH20, serial
GSM8K, tau 4.65 -> 4.93 (+6.0 %), 31.8 -> 33.5 tok/s (+5.4 %), -0.8 pp accuracy.

* :func:`served_asd` replays ``asd`` as a serial chain through every request of a trace
  (one numpy pass per verify step over all requests: the same rule as the policy,
  :func:`dspark_sim.policies.lossy.asd_block`), giving served tau and changed fraction.
* :func:`fit_regret_median` solves the synthetic regret scale
  (:mod:`dspark_sim.traces.synth_lossy`) so the default ``asd`` serves the published
  tau ratio on the trace (common random numbers, bisection on log scale).
* :func:`gsm8k_lossy_trace` / :func:`write_shipped_lossy` build the shipped
  ``dspark-gsm8k-lossy-synthetic`` trace and its STS map::

      python -c "from dspark_sim.validation.lossy import write_shipped_lossy; \\
                 write_shipped_lossy('traces/data', 'calibration/data/calibration')"
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from dspark_sim.policies.lossy import ASD_DEFAULTS, AsdConfig, asd_block
from dspark_sim.traces.schema import AcceptanceTrace
from dspark_sim.traces.synth import DomainCurve, synth_drafter
from dspark_sim.traces.synth_lossy import LossyModel, add_lossy_fields, draw, fields

ASD_TAU = (4.65, 4.93)  # strict -> ASD, serial GSM8K (DeepSeek-V4-Flash-DSpark)
ASD_TOK_S = (31.8, 33.5)
ASD_ACCURACY_PP = -0.8
# V4-Flash's DSpark on GSM8K: tau 4.65 at the block of 7 (serial: the whole block is
# verified); position-1 acceptance as DSpark's math figure (Fig. 2, Qwen3-4B: 0.93).
GSM8K_CURVE = DomainCurve("gsm8k", p1=0.93, tau=ASD_TAU[0], k=7)
LOSSY_TRACE = "dspark-gsm8k-lossy-synthetic"


def served_asd(trace: AcceptanceTrace, cfg: AsdConfig | None, k: int | None = None
               ) -> tuple[float, float]:
    """(served tau, changed-token fraction) of a fixed-``k`` chain with ASD (``None``:
    strict) replayed serially through every request from position 0, as
    :meth:`AcceptanceTrace.served_tau` does for the strict chain."""
    k = trace.gamma_max if k is None else int(k)
    v2 = trace.v2
    m = trace.accept_len.astype(np.int64)
    start = trace.req_offsets[:-1].astype(np.int64)
    length = trace.req_lengths.astype(np.int64)
    pos = np.zeros(len(length), np.int64)
    spent = np.zeros(len(length))
    tokens = steps = changed = 0
    live = np.flatnonzero(length > 0)
    if cfg is not None:
        top = v2.tgt_top1_logit.astype(np.float32)
        regret = np.maximum(top - v2.draft_tgt_logit.astype(np.float32), 0.0)
    while live.size:
        rows = start[live] + pos[live]
        if cfg is None:
            acc, ch = np.minimum(m[rows], k), np.zeros(live.size, np.int64)
        else:
            acc, ch, spent[live] = asd_block(np.full(live.size, k), m[rows], regret[rows],
                                             v2.draft_prob[rows], spent[live], cfg)
        adv = acc + 1
        tokens += int(adv.sum())
        changed += int(ch.sum())
        steps += live.size
        pos[live] += adv
        live = live[pos[live] < length[live]]
    return tokens / max(steps, 1), changed / max(tokens, 1)


def fit_regret_median(trace: AcceptanceTrace, model: LossyModel | None = None, *,
                      ratio: float = ASD_TAU[1] / ASD_TAU[0], cfg: AsdConfig | None = None,
                      seed: int = 0, iters: int = 40) -> tuple[LossyModel, dict]:
    """The ``regret_median`` at which ``cfg`` (default: ``asd``'s defaults) serves
    ``ratio`` x the strict chain's tau on ``trace``. A larger median means fewer
    mismatches under ``g``: the served tau falls monotonically in it."""
    model = model or LossyModel()
    cfg = cfg or AsdConfig(*ASD_DEFAULTS)
    d = draw(trace, model, np.random.default_rng(seed))
    strict, _ = served_asd(trace, None)

    def gain(log_med: float) -> float:
        t = replace(trace, v2=fields(trace, replace(model, regret_median=float(np.exp(log_med))), d))
        return served_asd(t, cfg)[0] / strict

    lo, hi = np.log(1e-3), np.log(1e3)  # gain falls from lo to hi
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if gain(mid) > ratio:
            lo = mid
        else:
            hi = mid
    fitted = replace(model, regret_median=round(float(np.exp(0.5 * (lo + hi))), 4))
    t = replace(trace, v2=fields(trace, fitted, d))
    tau, frac = served_asd(t, cfg)
    return fitted, {"strict_tau": strict, "asd_tau": tau, "changed_fraction": frac,
                    "target_ratio": ratio, "asd": [cfg.g, cfg.m, cfg.budget]}


def gsm8k_lossy_trace(seed: int = 5, requests: int = 48, positions: int = 384
                      ) -> tuple[AcceptanceTrace, dict]:
    """The shipped lossy trace: a DSpark-like GSM8K trace at served tau 4.65 (block 7)
    with synthetic lossy fields fitted to ASD's tau gain."""
    base = synth_drafter((GSM8K_CURVE,), gamma=7, requests_per_domain=requests,
                         positions=positions, drafter="dspark-gsm8k-lossy-synthetic",
                         target="deepseek-v4-flash-like (ASD, serial GSM8K)", seed=seed,
                         extra={"calibration": f"{LOSSY_TRACE}-sts"})
    model, fit = fit_regret_median(base, seed=seed)
    trace = add_lossy_fields(base, model, seed=seed)
    gen = dict(trace.meta.generator)
    gen["lossy"] = {**gen["lossy"], "fit": {k: (round(v, 4) if isinstance(v, float) else v)
                                           for k, v in fit.items()},
                    "published": {"tau": list(ASD_TAU), "tok_s": list(ASD_TOK_S),
                                  "accuracy_pp": ASD_ACCURACY_PP}}
    return replace(trace, meta=replace(trace.meta, generator=gen)), fit


def write_shipped_lossy(trace_dir, calibration_dir) -> list[Path]:
    from dspark_sim.calibration.fit import calibrate_confidence
    from dspark_sim.traces.schema import write_trace

    trace, _ = gsm8k_lossy_trace()
    out = [write_trace(trace, Path(trace_dir) / f"{LOSSY_TRACE}.parquet")]
    cmap, _ = calibrate_confidence(trace, method="temperature", holdout=0.0, seed=0)
    path = Path(calibration_dir) / f"{trace.meta.extra['calibration']}.toml"
    cmap.save(path)
    out.append(path)
    return out
