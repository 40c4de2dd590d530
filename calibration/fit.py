"""Fit confidence calibration maps on acceptance traces (DSpark §3.2.1).

The drafter's raw confidences ``c_k = P(token k accepted | 1..k-1 accepted)`` are
conditional; the scheduler consumes the prefix survival ``a_k = prod_{i<=k} c'_i``
(the probability that the first ``k`` draft tokens are all accepted). Calibration
is therefore judged on ``a_k`` against the observed event ``accept_len >= k`` over
*all* positions of the trace.

* **Sequential temperature scaling** (``method="temperature"``, the paper's STS):
  ``c'_k = sigmoid(logit(c_k) / T_k)``. Left to right, for each draft position ``k`` a
  1-D grid search picks ``T_k`` minimising the ECE of the cumulative product ``a_k``
  with ``T_1..T_{k-1}`` held fixed. Order-preserving per position.
* **Isotonic** (``method="isotonic"``): per position ``k``, a monotone (pool adjacent
  violators) regression of the event ``accept_len >= k`` on ``c_k`` among the rows that
  *reached* position ``k`` (``accept_len >= k-1``), i.e. on the conditional confidence,
  stored as a piecewise-linear map through the block centres.

Metrics (``calibration_metrics``): ECE with 15 equal-width bins on ``[0, 1]``, weighted
by bin counts (Naeini et al. 2015), and rank-based ROC-AUC (Mann-Whitney, average ranks
for ties), per position, before and after, on held-out requests (the trace is split
by request, never by row, so one request's positions never straddle the split).
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dspark_sim.calibration.confmap import (
    IDENTITY,
    CalibrationMap,
    isotonic_map,
    logit,
    sigmoid,
    temperature_map,
)
from dspark_sim.errors import InputError, check_seed
from dspark_sim.io import write_text_atomic

ECE_BINS = 15
METHODS = ("temperature", "isotonic")
DEFAULT_T_GRID = np.geomspace(0.1, 10.0, 241)


# -- metrics ---------------------------------------------------------------------------------


def ece(pred: np.ndarray, outcome: np.ndarray, bins: int = ECE_BINS) -> float:
    """Expected calibration error, ``bins`` equal-width bins on [0, 1], count-weighted."""
    p = np.asarray(pred, dtype=np.float64).ravel()
    y = np.asarray(outcome, dtype=np.float64).ravel()
    if p.size == 0:
        return float("nan")
    idx = np.minimum((p * bins).astype(np.int64), bins - 1)
    idx = np.maximum(idx, 0)
    sp = np.bincount(idx, weights=p, minlength=bins)
    sy = np.bincount(idx, weights=y, minlength=bins)
    return float(np.abs(sp - sy).sum() / p.size)


def auc(score: np.ndarray, outcome: np.ndarray) -> float:
    """Rank-based ROC-AUC (Mann-Whitney U with average ranks); NaN if one class is empty."""
    s = np.asarray(score, dtype=np.float64).ravel()
    y = np.asarray(outcome).ravel().astype(bool)
    n1 = int(y.sum())
    n0 = y.size - n1
    if n1 == 0 or n0 == 0:
        return float("nan")
    _, inv, counts = np.unique(s, return_inverse=True, return_counts=True)
    avg_rank = np.cumsum(counts) - (counts - 1) / 2.0  # 1-based average rank of each value
    r = avg_rank[inv]
    return float((r[y].sum() - n1 * (n1 + 1) / 2.0) / (n1 * n0))


def reliability_bins(pred: np.ndarray, outcome: np.ndarray, bins: int = ECE_BINS) -> dict:
    """Per equal-width bin: mean prediction, observed frequency, count (empty bins: NaN)."""
    p = np.asarray(pred, dtype=np.float64).ravel()
    y = np.asarray(outcome, dtype=np.float64).ravel()
    idx = np.clip((p * bins).astype(np.int64), 0, bins - 1)
    n = np.bincount(idx, minlength=bins).astype(np.float64)
    sp = np.bincount(idx, weights=p, minlength=bins)
    sy = np.bincount(idx, weights=y, minlength=bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        return {
            "edges": np.linspace(0.0, 1.0, bins + 1),
            "mean_pred": np.where(n > 0, sp / np.maximum(n, 1), np.nan),
            "observed": np.where(n > 0, sy / np.maximum(n, 1), np.nan),
            "count": n.astype(np.int64),
        }


# -- validation ------------------------------------------------------------------------------


def _check_arrays(conf, accept_len, where: str = "confidences") -> tuple[np.ndarray, np.ndarray]:
    try:
        c = np.asarray(conf, dtype=np.float64)
        m = np.asarray(accept_len)
    except (TypeError, ValueError) as exc:
        raise InputError(where, "conf and accept_len must be numeric arrays") from exc
    if c.ndim != 2 or c.shape[0] == 0 or c.shape[1] == 0:
        raise InputError(where, f"conf must be a non-empty [N, gamma] array, got shape {c.shape}")
    if m.ndim != 1 or m.shape[0] != c.shape[0]:
        raise InputError(
            where, f"accept_len has shape {m.shape}, expected ({c.shape[0]},) to match conf"
        )
    if not np.all(np.isfinite(c)) or np.any(c < 0) or np.any(c > 1):
        raise InputError(where, "conf has NaN/inf or values outside [0, 1]")
    mf = m.astype(np.float64)
    if not np.all(np.isfinite(mf)) or np.any(mf != np.round(mf)):
        raise InputError(where, "accept_len must be integers")
    m = mf.astype(np.int64)
    if np.any(m < 0) or np.any(m > c.shape[1]):
        raise InputError(where, f"accept_len outside [0, gamma={c.shape[1]}]")
    return c, m


def _events(m: np.ndarray, gamma: int) -> np.ndarray:
    """[N, gamma] bool: accept_len >= k for k = 1..gamma."""
    return m[:, None] >= np.arange(1, gamma + 1)[None, :]


# -- fitting ---------------------------------------------------------------------------------


def _best_temperature(prefix: np.ndarray, lg: np.ndarray, y: np.ndarray, grid: np.ndarray,
                      bins: int) -> float:
    def score(t: float) -> float:
        return ece(prefix * sigmoid(lg / t), y, bins)

    errs = np.array([score(t) for t in grid])
    best = float(errs.min())
    # Among (near-)ties prefer the temperature closest to 1 (the least change).
    near = np.flatnonzero(errs <= best + 1e-12)
    i = int(near[np.argmin(np.abs(np.log(grid[near])))])
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    fine = np.geomspace(lo, hi, 41) if hi > lo else np.array([grid[i]])
    ferr = np.array([score(t) for t in fine])
    j = int(np.argmin(ferr))
    return float(fine[j]) if ferr[j] < errs[i] else float(grid[i])


def fit_sequential_temperature(conf, accept_len, *, grid: Sequence[float] | None = None,
                               bins: int = ECE_BINS) -> np.ndarray:
    """STS: per-position temperatures ``T_k``, fitted left to right (see module doc)."""
    c, m = _check_arrays(conf, accept_len)
    g = np.asarray(DEFAULT_T_GRID if grid is None else grid, dtype=np.float64)
    if g.ndim != 1 or g.size == 0 or not np.all(np.isfinite(g)) or np.any(g <= 0):
        raise InputError("grid", "temperature grid must be positive finite numbers")
    g = np.unique(g)
    ev = _events(m, c.shape[1])
    lg = logit(c)
    prefix = np.ones(c.shape[0])
    temps = np.empty(c.shape[1])
    for k in range(c.shape[1]):
        temps[k] = _best_temperature(prefix, lg[:, k], ev[:, k], g, bins)
        prefix = prefix * sigmoid(lg[:, k] / temps[k])
    return temps


def _pav(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Isotonic (non-decreasing) regression by pool adjacent violators.

    Returns the block centres (weighted mean ``x``) and block values, with equal
    ``x`` values pooled first so the centres strictly increase."""
    order = np.argsort(x, kind="stable")
    xs, ys = x[order], y[order].astype(np.float64)
    ux, inv, cnt = np.unique(xs, return_inverse=True, return_counts=True)
    sy = np.bincount(inv, weights=ys)
    vals, wts, sxs = [], [], []
    for v, w, sx in zip(sy / cnt, cnt.astype(np.float64), ux * cnt, strict=True):
        vals.append(v)
        wts.append(w)
        sxs.append(sx)
        while len(vals) > 1 and vals[-2] >= vals[-1]:
            w2 = wts[-2] + wts[-1]
            v2 = (vals[-2] * wts[-2] + vals[-1] * wts[-1]) / w2
            s2 = sxs[-2] + sxs[-1]
            del vals[-1], wts[-1], sxs[-1]
            vals[-1], wts[-1], sxs[-1] = v2, w2, s2
    w = np.asarray(wts)
    return np.asarray(sxs) / w, np.asarray(vals)


def fit_isotonic(conf, accept_len, *, clip: float = 1e-3) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per-position isotonic maps on the conditional confidences among reached positions.

    Returns ``(xs, ys)`` knots for ``np.interp``, spanning [0, 1]; values clipped to
    ``[clip, 1 - clip]`` so a survival is never exactly 0 or 1."""
    c, m = _check_arrays(conf, accept_len)
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    for k in range(c.shape[1]):
        reached = m >= k
        if not reached.any():
            # Nobody reached position k in the fitting data: reuse the previous map.
            xs.append(xs[-1] if xs else np.array([0.0, 1.0]))
            ys.append(ys[-1] if ys else np.array([0.0, 1.0]))
            continue
        cx, cy = _pav(c[reached, k], (m[reached] >= k + 1).astype(np.float64))
        cy = np.clip(cy, clip, 1.0 - clip)
        x = np.concatenate([[0.0], cx, [1.0]])
        y = np.concatenate([[cy[0]], cy, [cy[-1]]])
        # Drop centres that coincide with the added ends.
        keep = np.concatenate([[True], np.diff(x) > 0])
        xs.append(x[keep])
        ys.append(np.maximum.accumulate(y[keep]))
    return xs, ys


# -- metrics of a map ------------------------------------------------------------------------


def calibration_metrics(conf, accept_len, cmap: CalibrationMap = IDENTITY, *,
                        bins: int = ECE_BINS) -> list[dict[str, float]]:
    """Per position k: ECE and AUC of the survival ``a_k`` vs ``accept_len >= k`` (all rows),
    and of the conditional ``c'_k`` among rows that reached ``k``."""
    c, m = _check_arrays(conf, accept_len)
    cal = cmap.apply(c)
    surv = np.cumprod(cal, axis=1)
    ev = _events(m, c.shape[1])
    out = []
    for k in range(c.shape[1]):
        reached = m >= k
        out.append({
            "k": k + 1,
            "n": int(c.shape[0]),
            "observed": float(ev[:, k].mean()),
            "predicted": float(surv[:, k].mean()),
            "ece": ece(surv[:, k], ev[:, k], bins),
            "auc": auc(surv[:, k], ev[:, k]),
            "n_reached": int(reached.sum()),
            "cond_ece": ece(cal[reached, k], ev[reached, k], bins) if reached.any() else float("nan"),
            "cond_auc": auc(cal[reached, k], ev[reached, k]) if reached.any() else float("nan"),
        })
    return out


def split_requests(trace, holdout: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Row masks (fit, test): a random ``holdout`` fraction of requests is the test set."""
    r = trace.num_requests
    lengths = trace.req_lengths
    if holdout <= 0:
        every = np.ones(trace.num_positions, dtype=bool)
        return every, every
    if r < 2:
        raise InputError(trace.source_path, "need at least 2 requests to hold some out")
    n_test = int(min(r - 1, max(1, round(holdout * r))))
    rng = np.random.default_rng(seed)
    test_req = np.zeros(r, dtype=bool)
    test_req[rng.choice(r, size=n_test, replace=False)] = True
    test_rows = np.repeat(test_req, lengths)
    return ~test_rows, test_rows


def _as_trace(trace):
    from dspark_sim.traces.schema import AcceptanceTrace, load_trace

    if isinstance(trace, AcceptanceTrace):
        return trace
    if isinstance(trace, str | Path):
        return load_trace(trace)
    raise InputError("trace", f"expected an AcceptanceTrace or a trace path, got {type(trace).__name__}")


def _mean(vals) -> float:
    a = np.asarray([v for v in vals if np.isfinite(v)], dtype=np.float64)
    return float(a.mean()) if a.size else float("nan")


def check_fit_options(method: str, holdout: float, seed: int) -> None:
    """:func:`calibrate_confidence`'s options, named as the CLI names them; cheap, so the
    CLI calls it before reading the trace."""
    if method not in METHODS:
        raise InputError("--method", f"must be one of {', '.join(METHODS)}, got {method!r}")
    if not 0.0 <= holdout < 1.0:  # also refuses NaN
        raise InputError("--holdout", f"must lie in [0, 1), got {holdout}")
    check_seed(seed)


def calibrate_confidence(
    trace,
    method: str = "temperature",
    holdout: float = 0.3,
    seed: int = 0,
    *,
    bins: int = ECE_BINS,
    grid: Sequence[float] | None = None,
) -> tuple[CalibrationMap, dict[str, Any]]:
    """Fit a calibration map on part of ``trace`` (a trace object, path or built-in name)
    and evaluate it on held-out requests.

    ``holdout``: fraction of requests held out (0: fit and report on all of them).
    Returns ``(map, report)``; the report holds per-position ECE/AUC before and after
    (``positions``), their means, the split and the fitted parameters. The map is fitted
    on the fit split only; refit with ``holdout=0`` to use every request.
    """
    check_fit_options(method, holdout, seed)
    if bins < 1:
        raise InputError("bins", "must be >= 1")
    tr = _as_trace(trace)
    where = tr.source_path
    if tr.conf is None:
        raise InputError(where, "trace has no 'conf' column: nothing to calibrate")
    c, m = _check_arrays(tr.conf, tr.accept_len, where)
    fit_rows, test_rows = split_requests(tr, holdout, seed)
    drafter = tr.meta.drafter
    if method == "temperature":
        temps = fit_sequential_temperature(c[fit_rows], m[fit_rows], grid=grid, bins=bins)
        cmap = temperature_map(temps, drafter=drafter)
        params: dict[str, Any] = {"temperatures": [float(t) for t in temps]}
    else:
        xs, ys = fit_isotonic(c[fit_rows], m[fit_rows])
        cmap = isotonic_map(xs, ys, drafter=drafter)
        params = {"isotonic_knots": [int(len(x)) for x in xs]}
    before = calibration_metrics(c[test_rows], m[test_rows], IDENTITY, bins=bins)
    after = calibration_metrics(c[test_rows], m[test_rows], cmap, bins=bins)
    positions = []
    for b, a in zip(before, after, strict=True):
        positions.append({
            "k": b["k"], "n": b["n"], "observed": b["observed"],
            "predicted_before": b["predicted"], "predicted_after": a["predicted"],
            "ece_before": b["ece"], "ece_after": a["ece"],
            "auc_before": b["auc"], "auc_after": a["auc"],
            "cond_ece_before": b["cond_ece"], "cond_ece_after": a["cond_ece"],
            "cond_auc_before": b["cond_auc"], "cond_auc_after": a["cond_auc"],
        })
    test_ids = tr.req_ids[np.repeat(np.arange(tr.num_requests), tr.req_lengths)[test_rows]]
    report: dict[str, Any] = {
        "method": method,
        "drafter": drafter,
        "gamma": int(c.shape[1]),
        "target": "prefix survival a_k = prod_{i<=k} c'_i vs event accept_len >= k, all rows",
        "ece_bins": int(bins),
        "ece_binning": "equal-width bins on [0, 1], weighted by count",
        "auc": "rank-based ROC-AUC (Mann-Whitney, average ranks)",
        "split": {
            "by": "request",
            "holdout": float(holdout),
            "seed": int(seed),
            "fit_rows": int(fit_rows.sum()),
            "test_rows": int(test_rows.sum()),
            "test_request_ids": sorted({x.item() for x in test_ids}),  # ids may be strings
            "evaluated_on": "held-out requests" if holdout > 0 else "the fitting data",
        },
        "params": params,
        "positions": positions,
        "ece_before_mean": _mean(p["ece_before"] for p in positions),
        "ece_after_mean": _mean(p["ece_after"] for p in positions),
        "auc_before_mean": _mean(p["auc_before"] for p in positions),
        "auc_after_mean": _mean(p["auc_after"] for p in positions),
    }
    return cmap, report


def format_report(report: dict[str, Any]) -> str:
    """A plain-text table of a :func:`calibrate_confidence` report."""
    lines = [
        f"{report['method']} calibration, {report['split']['evaluated_on']} "
        f"({report['split']['test_rows']} rows); ECE: {report['ece_bins']} equal-width bins",
        "  k   observed  ECE before  ECE after  AUC before  AUC after",
    ]
    for p in report["positions"]:
        lines.append(
            f"  {p['k']:<3d} {p['observed']:8.3f}  {p['ece_before']:9.2%}  {p['ece_after']:9.2%}"
            f"  {p['auc_before']:10.3f}  {p['auc_after']:9.3f}"
        )
    lines.append(
        f"  mean          {report['ece_before_mean']:9.2%}  {report['ece_after_mean']:9.2%}"
        f"  {report['auc_before_mean']:10.3f}  {report['auc_after_mean']:9.3f}"
    )
    return "\n".join(lines)


# -- reliability diagram ---------------------------------------------------------------------


def write_reliability_html(
    path: str | Path,
    trace,
    cmap: CalibrationMap,
    *,
    report: dict[str, Any] | None = None,
    positions: Sequence[int] | None = None,
    bins: int = ECE_BINS,
    title: str | None = None,
) -> Path:
    """Reliability diagram (DSpark Fig. 6 style) as one self-contained Plotly HTML file.

    Rows: the held-out requests of ``report`` when given, else the whole trace.
    ``positions``: 1-based draft positions to show (default 1, 3, 5, 7 within gamma).
    Each panel: the diagonal, raw and calibrated survival per bin, and the share of
    samples per bin (bars, same axis)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    tr = _as_trace(trace)
    c, m = _check_arrays(tr.conf, tr.accept_len, tr.source_path)
    if report is not None and report.get("split", {}).get("holdout", 0) > 0:
        test_ids = np.asarray(report["split"]["test_request_ids"])
        req_of_row = np.repeat(tr.req_ids, tr.req_lengths)
        rows = np.isin(req_of_row, test_ids)
        if not rows.any():
            raise InputError(tr.source_path, "report's held-out requests are not in this trace")
        c, m = c[rows], m[rows]
    g = c.shape[1]
    ks = [k for k in (positions or (1, 3, 5, 7)) if 1 <= k <= g] or [1]
    surv_raw = np.cumprod(c, axis=1)
    surv_cal = cmap.survival(c)
    ev = _events(m, g)
    subtitles = []
    panels = []
    for k in ks:
        y = ev[:, k - 1]
        e0, e1 = ece(surv_raw[:, k - 1], y, bins), ece(surv_cal[:, k - 1], y, bins)
        a0 = auc(surv_raw[:, k - 1], y)
        subtitles.append(f"Position {k}<br>ECE {e0:.1%} → {e1:.1%}, AUC {a0:.3f}")
        panels.append((reliability_bins(surv_raw[:, k - 1], y, bins),
                       reliability_bins(surv_cal[:, k - 1], y, bins)))
    fig = make_subplots(rows=1, cols=len(ks), subplot_titles=subtitles, shared_yaxes=True)
    centers = (np.arange(bins) + 0.5) / bins
    for j, (raw, cal) in enumerate(panels, start=1):
        first = j == 1
        share = cal["count"] / max(1, int(cal["count"].sum()))
        fig.add_trace(go.Bar(x=centers, y=share, width=1.0 / bins, marker_color="lightgray",
                             opacity=0.6, name="sample share (calibrated bins)",
                             showlegend=first, legendgroup="hist"), row=1, col=j)
        fig.add_trace(go.Scatter(x=[0, 1], y=[0, 1], mode="lines", name="perfect calibration",
                                 line={"dash": "dash", "color": "black"}, showlegend=first,
                                 legendgroup="diag"), row=1, col=j)
        for data, label, color in ((raw, "before calibration", "#d62728"),
                                   (cal, "after calibration", "#1f77b4")):
            ok = data["count"] > 0
            fig.add_trace(go.Scatter(
                x=data["mean_pred"][ok], y=data["observed"][ok], mode="lines+markers",
                name=label, line={"color": color}, showlegend=first, legendgroup=label,
                customdata=data["count"][ok],
                hovertemplate="predicted %{x:.3f}<br>observed %{y:.3f}<br>n=%{customdata}",
            ), row=1, col=j)
        fig.update_xaxes(range=[0, 1], title_text="Predicted survival", row=1, col=j)
    fig.update_yaxes(range=[0, 1], title_text="Observed acceptance (m ≥ k)", row=1, col=1)
    head = title or (f"Reliability diagram: {html.escape(tr.meta.drafter or 'drafter')}, "
                     f"{cmap.method} calibration ({bins} equal-width bins)")
    fig.update_layout(title=head, height=420, width=max(420, 330 * len(ks)), barmode="overlay",
                      template="plotly_white")
    text = fig.to_html(include_plotlyjs=True, full_html=True)
    return write_text_atomic(path, text)


def write_shipped_synthetic(trace_dir, calibration_dir) -> list:
    """Regenerate the shipped synthetic traces and re-fit the STS map the DSpark trace
    names (every request, as ``dspark-sim calibrate confidence`` does for its output).
    It lives here, not in traces/synth.py, because fitting a map is calibration's work and
    traces/ never imports calibration/ (one-way rooms)::

        python -c "from dspark_sim.calibration.fit import write_shipped_synthetic; \\
                   write_shipped_synthetic('traces/data', 'calibration/data/calibration')"
    """
    from dspark_sim.traces.schema import write_trace
    from dspark_sim.traces.synth import (
        default_dspark_trace,
        default_mtp1_trace,
        glm47_mtp_trace,
        llama32_1b_trace,
        v4flash_live_trace,
        v4flash_speedbench_trace,
        v4pro_speedbench_trace,
    )

    trace_dir, calibration_dir = Path(trace_dir), Path(calibration_dir)
    written = [write_trace(default_mtp1_trace(), trace_dir / "mtp1-synthetic.parquet")]
    for name, trace in (("dspark-synthetic", default_dspark_trace()),
                        ("dspark-v4pro-synthetic", v4pro_speedbench_trace()),
                        ("dspark-v4flash-synthetic", v4flash_live_trace()),
                        ("dspark-v4flash-speedbench-synthetic", v4flash_speedbench_trace()),
                        ("dspark-llama32-1b-synthetic", llama32_1b_trace()),
                        ("glm47-mtp-synthetic", glm47_mtp_trace())):
        written += write_trace_with_map(trace, trace_dir / f"{name}.parquet", calibration_dir)
    return written


def write_trace_with_map(trace, trace_path, calibration_dir) -> list:
    """Write a shipped trace and the STS map its metadata names (``extra["calibration"]``),
    fitted on every request (holdout 0, seed 0), as ``dspark-sim calibrate confidence``
    does: the two files a shipped synthetic trace is made of."""
    from dspark_sim.traces.schema import write_trace

    written = [write_trace(trace, trace_path)]
    cmap, _ = calibrate_confidence(trace, method="temperature", holdout=0.0, seed=0)
    path = Path(calibration_dir) / f"{trace.meta.extra['calibration']}.toml"
    cmap.save(path)
    return [*written, path]
