"""Throughput-vs-interactivity frontiers from sweep results (DSpark Fig. 7 / Fig. 8).

Axes (InferenceX): x = median interactivity (tok/s/user = 1000 / TPOT_ms), y = output
throughput per GPU (tok/s/GPU). More of both is better, so a policy's *front* is its
set of non-dominated points (upper-right dominance; InferenceX draws the same set as
its "upper-left" front with the axes swapped). Between two front points the front is
the straight segment joining them (the operating points in between are reachable by
a load in between); outside its first and last point it is not extrapolated.

Headline numbers, policy A (candidate) against B (baseline):

* **matched-throughput TPS gain**: over the throughput range both fronts cover,
  ``x_A(y) / x_B(y) - 1`` (per-user speed at equal tok/s/GPU); min / max / mean over
  that range, the range itself.
* **throughput at an SLA tier** ``T`` (tok/s/user): the largest throughput on a front
  with interactivity >= ``T``, i.e. the front interpolated at ``x = T``. A front that
  never reaches ``T`` is *infeasible* at that tier; a tier below the front's lowest
  interactivity gets the front's maximum throughput, flagged ``below-sweep`` (the sweep
  did not load the engine enough to fall to ``T``, so the number is a lower bound).
* **verification budget** (Fig. 8): ``mean_verify_tokens_per_request_step`` against
  concurrency (closed loop: the clients; open loop: the mean requests in the system),
  and **verification waste** against load.

**Steady state by default.** Every function here takes ``basis="steady"`` (default) or
``"whole"``. With ``"steady"``, :func:`metric_view` puts each ``steady_<metric>``
column (the figure over the run's steady-state window, warm-up and drain excluded; see
``dspark_sim.sim.metrics``) in place of ``<metric>`` and keeps the whole-run figure as
``whole_<metric>``; results without steady columns (older sweeps) are used as they are.
Unstable points (requests unfinished, or requests in the system growing through the
steady window) are left off the fronts.

**Lossy policies** (``asd``, ``skip``; results column ``lossy``) emit tokens that may differ
from the target's greedy output: their points never join a lossless front.
:func:`compute_fronts` draws lossless fronts by default, ``lossy=True`` the lossy ones
(the report draws them as diamonds with dashed fronts, labelled LOSSY, and on a lossy
axis of their own: throughput against changed tokens).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from dspark_sim.errors import InputError
from dspark_sim.policies.registry import get_policy

X = "median_interactivity"
Y = "output_throughput_per_gpu"
CONTEXT = ("profile_spec", "trace_spec")
DEFAULT_TIERS = (80.0, 120.0)
BASES = ("steady", "whole")
STEADY = "steady_"
WHOLE = "whole_"


def metric_view(df: pl.DataFrame, basis: str = "steady") -> pl.DataFrame:
    """``df`` with the figures of ``basis`` under the plain metric names.

    ``"steady"``: every ``steady_<m>`` column whose ``<m>`` exists replaces it, the
    whole-run ``<m>`` is kept as ``whole_<m>``; ``steady_mean_concurrency`` (time-averaged
    requests in the system) replaces Little's-law ``mean_concurrency``. ``"whole"``:
    ``df`` unchanged. Idempotent (a frame that already has ``whole_`` columns is a view).
    """
    if basis not in BASES:
        raise InputError("--basis", f"must be one of {', '.join(BASES)}, got {basis!r}")
    if basis == "whole" or any(c.startswith(WHOLE) for c in df.columns):
        return df
    pairs = [(c, c[len(STEADY):]) for c in df.columns
             if c.startswith(STEADY) and c[len(STEADY):] in df.columns]
    if not pairs:
        return df
    return df.with_columns([pl.col(m).alias(WHOLE + m) for _, m in pairs]
                           + [pl.col(c).alias(m) for c, m in pairs])


def pareto_front(x: Sequence[float], y: Sequence[float]) -> np.ndarray:
    """Indices of the non-dominated points (more x and more y are better), ordered by
    increasing x (so y decreases). Non-finite points are ignored; of duplicates one is
    kept."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:  # an IndexError, or a front of mismatched pairs
        raise ValueError(f"pareto_front: x and y must be 1-D and of one length, got shapes "
                         f"{x.shape} and {y.shape}")
    ok = np.flatnonzero(np.isfinite(x) & np.isfinite(y))
    if ok.size == 0:
        return np.zeros(0, dtype=np.int64)
    order = ok[np.lexsort((-y[ok], -x[ok]))]  # x descending, then y descending
    keep = []
    best_y = -np.inf
    for i in order:
        if y[i] > best_y:
            keep.append(i)
            best_y = y[i]
    return np.asarray(keep[::-1], dtype=np.int64)


@dataclass(frozen=True, eq=False)
class Front:
    """A piecewise-linear front: ``x`` increasing, ``y`` strictly decreasing."""

    label: str
    x: np.ndarray
    y: np.ndarray
    points: pl.DataFrame = field(default_factory=pl.DataFrame)  # the front's rows

    @classmethod
    def from_points(cls, label: str, x, y, rows: pl.DataFrame | None = None) -> Front:
        idx = pareto_front(x, y)
        xs = np.asarray(x, dtype=np.float64)[idx]
        ys = np.asarray(y, dtype=np.float64)[idx]
        pts = rows[idx.tolist()] if rows is not None and rows.height else pl.DataFrame()
        return cls(label, xs, ys, pts)

    @property
    def empty(self) -> bool:
        return self.x.size == 0

    @property
    def x_range(self) -> tuple[float, float]:
        return float(self.x[0]), float(self.x[-1])

    @property
    def y_range(self) -> tuple[float, float]:
        return float(self.y[-1]), float(self.y[0])

    def throughput_at(self, interactivity: float) -> float | None:
        """Max throughput with interactivity >= ``interactivity``; None if infeasible."""
        if self.empty or interactivity > self.x[-1] + 1e-12:
            return None
        if interactivity <= self.x[0]:
            return float(self.y[0])
        return float(np.interp(interactivity, self.x, self.y))

    def interactivity_at(self, throughput: float) -> float | None:
        """Interactivity on the front at ``throughput``; None outside its range."""
        if self.empty:
            return None
        lo, hi = self.y_range
        if throughput < lo - 1e-12 or throughput > hi + 1e-12:
            return None
        return float(np.interp(throughput, self.y[::-1], self.x[::-1]))


# -- from sweep results ---------------------------------------------------------------
def canonical_policy(spec: str) -> str:
    try:
        return get_policy(spec).name
    except InputError:
        return spec


def _context_cols(df: pl.DataFrame) -> list[str]:
    return [c for c in CONTEXT if c in df.columns and df[c].n_unique() > 1]


def aggregate_seeds(df: pl.DataFrame, by: Sequence[str] = ()) -> pl.DataFrame:
    """Mean of every numeric column over seeds of the same point (policy, context, load)."""
    keys = [c for c in ("policy", *CONTEXT, "load_kind", "load", *by) if c in df.columns]
    keys = list(dict.fromkeys(keys))
    if "seed" not in df.columns or df.height == 0:
        return df
    num = [c for c, t in df.schema.items()
           if c not in keys and c != "seed" and t.is_numeric()]
    aggs = [pl.col(c).mean() for c in num]
    if "stable" in df.columns:
        aggs.append(pl.col("stable").all())
    if "steady_window_short" in df.columns:
        aggs.append(pl.col("steady_window_short").any())
    aggs.append(pl.len().alias("seeds"))
    return df.group_by(keys, maintain_order=True).agg(aggs)


def usable(df: pl.DataFrame, *, stable_only: bool = True, x: str = X, y: str = Y) -> pl.DataFrame:
    """Rows with finite x and y (and, by default, a stable run)."""
    out = df.filter(pl.col(x).is_not_null() & pl.col(y).is_not_null()
                    & pl.col(x).is_finite() & pl.col(y).is_finite())
    if stable_only and "stable" in out.columns:
        out = out.filter(pl.col("stable").fill_null(False))
    return out


def with_labels(df: pl.DataFrame, context: Sequence[str] | None = None) -> pl.DataFrame:
    """Add ``front_label``: ``policy``, or ``policy | profile | trace`` when the sweep
    varies the profile or trace."""
    context = _context_cols(df) if context is None else list(context)
    parts = [pl.col("policy").cast(pl.Utf8)]
    parts += [pl.col(c).cast(pl.Utf8).fill_null("default") for c in context]
    return df.with_columns(pl.concat_str(parts, separator=" | ").alias("front_label"))


def is_lossy(df: pl.DataFrame) -> pl.Expr:
    """Rows of lossy policies (``asd``, ``skip``: output differs from the target's greedy
    output); results without the column are lossless."""
    return pl.col("lossy").fill_null(False) if "lossy" in df.columns else pl.lit(False)


def select_lossy(df: pl.DataFrame, lossy: bool | None) -> pl.DataFrame:
    """``False``: lossless rows only; ``True``: lossy rows only; ``None``: all."""
    if lossy is None:
        return df
    m = is_lossy(df)
    return df.filter(m if lossy else ~m)


def compute_fronts(df: pl.DataFrame, *, policies: Sequence[str] | None = None,
                   x: str = X, y: str = Y, stable_only: bool = True,
                   seeds: str = "mean", basis: str = "steady",
                   lossy: bool | None = False) -> dict[str, Front]:
    """One front per policy (and per profile/trace when the sweep varies them).

    ``seeds="mean"`` averages seeds of a point first; ``"all"`` keeps each seed's point.
    Keys are labels ``policy`` or ``policy | profile | trace``. ``basis``: steady-state
    (default) or whole-run figures (:func:`metric_view`). ``lossy``: lossless fronts only
    by default (a lossy policy's throughput is not comparable: its output differs from
    the target's); ``True`` only lossy ones, ``None`` both (asked for).
    """
    if df.height == 0:
        return {}
    if "policy" not in df.columns:
        raise InputError("results", "no 'policy' column (not sweep results)")
    df = metric_view(df, basis)
    context = _context_cols(df)  # over the whole sweep: lossy and lossless labels agree
    df = select_lossy(df, lossy)
    d = aggregate_seeds(df) if seeds == "mean" else df
    d = usable(d, stable_only=stable_only, x=x, y=y)
    if policies:
        wanted = [canonical_policy(p) for p in policies]
        d = d.filter(pl.col("policy").is_in(wanted))
        order = {p: i for i, p in enumerate(wanted)}
    else:
        order = {p: i for i, p in enumerate(dict.fromkeys(df["policy"].to_list()))}
    out: dict[str, Front] = {}
    if d.height == 0:
        return out
    d = with_labels(d, context)
    groups = d.partition_by("front_label", maintain_order=True, as_dict=False)
    groups.sort(key=lambda g: (order.get(g["policy"][0], 1 << 30), g["front_label"][0]))
    for g in groups:
        label = g["front_label"][0]
        out[label] = Front.from_points(label, g[x].to_numpy(), g[y].to_numpy(), g)
    return out


# -- comparisons ----------------------------------------------------------------------
EMPTY_FRONT = "a front is empty"  # headline() replaces it with which policy and why


def matched_throughput_gain(a: Front, b: Front, *, samples: int = 401,
                            floor_fraction: float = 0.0, ceil_fraction: float = 1.0) -> dict:
    """Per-user TPS gain of ``a`` over ``b`` at equal throughput, over the overlap of
    their throughput ranges; ``floor_fraction`` / ``ceil_fraction`` keep only the part
    between those fractions of the overlap's top (DSpark's "practical throughput levels":
    near zero throughput the ratio is just the two drafters' tau at batch 1, and its
    production runs below compute saturation, §5.3). Keys: ``feasible``,
    ``y_lo``, ``y_hi`` (tok/s/GPU), ``gain_min``, ``gain_max``, ``gain_mean`` (fractions,
    0.6 = +60%), ``gain_at_lo``, ``gain_at_hi``, ``reason`` (when not feasible)."""
    # checked: samples=0 was numpy's zero-size reduction error, a NaN fraction a
    # 'feasible' result with y_hi NaN (or silently no floor)
    if isinstance(samples, bool) or not isinstance(samples, numbers.Integral) or samples < 1:
        raise ValueError(f"matched_throughput_gain: samples must be a positive integer, "
                         f"got {samples!r}")
    for name, v in (("floor_fraction", floor_fraction), ("ceil_fraction", ceil_fraction)):
        if not 0.0 <= v <= 1.0:  # a floor above the ceiling is an empty band, said below
            raise ValueError(f"matched_throughput_gain: {name} must lie in [0, 1], got {v!r}")
    res = {"feasible": False, "y_lo": None, "y_hi": None, "gain_min": None, "gain_max": None,
           "gain_mean": None, "gain_at_lo": None, "gain_at_hi": None, "reason": None}
    if a.empty or b.empty:
        res["reason"] = EMPTY_FRONT
        return res
    top = min(a.y_range[1], b.y_range[1])
    lo = max(a.y_range[0], b.y_range[0], floor_fraction * top)
    hi = ceil_fraction * top
    if hi < lo:
        res["reason"] = (f"throughput ranges do not overlap ({a.label}: "
                         f"{a.y_range[0]:.0f}-{a.y_range[1]:.0f}, {b.label}: "
                         f"{b.y_range[0]:.0f}-{b.y_range[1]:.0f} tok/s/GPU)")
        return res
    grid = np.linspace(lo, hi, samples) if hi > lo else np.array([lo])
    xa = np.interp(grid, a.y[::-1], a.x[::-1])
    xb = np.interp(grid, b.y[::-1], b.x[::-1])
    gain = xa / xb - 1.0
    res.update(feasible=True, y_lo=float(lo), y_hi=float(hi), gain_min=float(gain.min()),
               gain_max=float(gain.max()), gain_mean=float(gain.mean()),
               gain_at_lo=float(gain[0]), gain_at_hi=float(gain[-1]))
    return res


@dataclass(frozen=True)
class TierResult:
    tier: float
    throughput: float | None  # tok/s/GPU; None: infeasible
    status: str  # "ok" | "infeasible" | "below-sweep"
    max_interactivity: float | None

    def text(self) -> str:
        if self.status == "infeasible":
            mx = "no points" if self.max_interactivity is None else (
                f"max {self.max_interactivity:.0f} tok/s/user")
            return f"infeasible ({mx})"
        s = f"{self.throughput:,.0f} tok/s/GPU"
        return s + (" (>=, below sweep)" if self.status == "below-sweep" else "")


def tier_throughput(front: Front, tier: float) -> TierResult:
    if math.isnan(tier):  # read as a feasible tier of NaN tok/s/GPU
        raise ValueError(f"tier_throughput: the tier must be a number of tok/s/user, got {tier!r}")
    if front.empty:
        return TierResult(float(tier), None, "infeasible", None)
    thr = front.throughput_at(tier)
    mx = front.x_range[1]
    if thr is None:
        return TierResult(float(tier), None, "infeasible", mx)
    status = "below-sweep" if tier < front.x_range[0] else "ok"
    return TierResult(float(tier), thr, status, mx)


def tier_gain(a: Front, b: Front, tiers: Sequence[float] = DEFAULT_TIERS) -> list[dict]:
    """Throughput of ``a`` and ``b`` at each SLA tier and the gain ``a/b - 1``."""
    rows = []
    for t in tiers:
        ra, rb = tier_throughput(a, t), tier_throughput(b, t)
        gain = None
        if ra.throughput is not None and rb.throughput is not None and rb.throughput > 0:
            gain = ra.throughput / rb.throughput - 1.0
        if gain is not None:
            text = f"{gain:+.0%}"
            if "below-sweep" in (ra.status, rb.status):
                text += " (a front does not fall to this tier: extend the load range)"
        elif ra.throughput is None and rb.throughput is None:
            text = "infeasible for both"
        elif rb.throughput is None:
            text = f"infeasible for {b.label} ({rb.text()}); {a.label}: {ra.text()}"
        elif ra.throughput is None:
            text = f"infeasible for {a.label} ({ra.text()})"
        else:  # both feasible, the baseline at no throughput: no ratio (was blamed on a)
            text = f"no gain: {b.label} serves {rb.text()} at this tier; {a.label}: {ra.text()}"
        rows.append({"tier": float(t), "candidate": ra, "baseline": rb, "gain": gain,
                     "text": text})
    return rows


# -- Fig. 8 and waste tables --------------------------------------------------------------
def _concurrency_expr() -> pl.Expr:
    return (pl.when(pl.col("load_kind") == "concurrency").then(pl.col("concurrency").cast(
        pl.Float64)).otherwise(pl.col("mean_concurrency")))


def budget_table(df: pl.DataFrame, basis: str = "steady") -> pl.DataFrame:
    """Fig. 8 view: verification budget per request (tokens verified per request-step,
    bonus slot included, so MTP-1 = 2) and throughput against concurrency."""
    d = aggregate_seeds(metric_view(df, basis))
    if "mean_concurrency" not in d.columns:
        d = d.with_columns(pl.lit(None, pl.Float64).alias("mean_concurrency"))
    cols = ["policy", *_context_cols(df), "load_kind", "load", "concurrency_x",
            "mean_verify_tokens_per_request_step", "spec_decode_acceptance_length",
            "output_throughput_per_gpu", X, "mean_decode_batch", "median_ttft_ms",
            "p90_ttft_ms", "median_e2el_ms", "p90_e2el_ms", "stable", "steady_window_short"]
    d = d.with_columns(_concurrency_expr().alias("concurrency_x"))
    return d.select([c for c in cols if c in d.columns]).sort(
        ["policy", "load_kind", "concurrency_x"], nulls_last=True)


def waste_table(df: pl.DataFrame, basis: str = "steady") -> pl.DataFrame:
    """Verification waste (rejected / verified draft tokens) and budget against load."""
    d = aggregate_seeds(metric_view(df, basis))
    cols = ["policy", *_context_cols(df), "load_kind", "load", "verification_waste",
            "mean_draft_tokens_per_request_step", "mean_verify_tokens_per_request_step",
            "spec_decode_acceptance_length", "output_throughput_per_gpu", X, "stable"]
    return d.select([c for c in cols if c in d.columns]).sort(["policy", "load_kind", "load"])


# -- headline -------------------------------------------------------------------------
def headline(df: pl.DataFrame, *, candidate: str = "confidence-async", baseline: str = "mtp1",
             tiers: Sequence[float] = DEFAULT_TIERS, stable_only: bool = True,
             basis: str = "steady") -> list[dict]:
    """Candidate vs baseline for each profile/trace context of the sweep.

    Each entry: ``context`` (label suffix), ``candidate``, ``baseline`` (front labels),
    ``matched`` (:func:`matched_throughput_gain`), ``tiers`` (:func:`tier_gain`),
    ``candidate_front`` / ``baseline_front`` (:class:`Front`), ``basis`` (``steady`` or
    ``whole``: what the figures are; ``whole`` when the results have no steady columns).
    """
    cand, base = canonical_policy(candidate), canonical_policy(baseline)
    used = basis_used(df, basis)
    # naming a lossy policy as candidate or baseline asks for its front
    fronts = compute_fronts(df, policies=[cand, base], stable_only=stable_only, basis=basis,
                            lossy=None)
    out = []
    by_ctx: dict[str, dict[str, Front]] = {}
    for label, fr in fronts.items():
        pol, _, ctx = label.partition(" | ")
        by_ctx.setdefault(ctx, {})[pol] = fr
    for ctx, fr in by_ctx.items():
        a = fr.get(cand, Front(cand, np.zeros(0), np.zeros(0)))
        b = fr.get(base, Front(base, np.zeros(0), np.zeros(0)))
        out.append({"context": ctx, "candidate": cand, "baseline": base,
                    "matched": matched_throughput_gain(a, b), "tiers": tier_gain(a, b, tiers),
                    "candidate_front": a, "baseline_front": b, "basis": used})
    if not out:
        out.append({"context": "", "candidate": cand, "baseline": base,
                    "matched": matched_throughput_gain(Front(cand, np.zeros(0), np.zeros(0)),
                                                       Front(base, np.zeros(0), np.zeros(0))),
                    "tiers": [], "candidate_front": None, "baseline_front": None,
                    "basis": used})
    for e in out:
        if e["matched"]["reason"] == EMPTY_FRONT:
            e["matched"]["reason"] = _empty_front_reason(df, e, stable_only)
    return out


def _empty_front_reason(df: pl.DataFrame, entry: dict, stable_only: bool) -> str:
    """Why a headline has no front to compare, for each empty side: a policy the results
    never ran (a typo in ``candidate=``), one whose points all lack the figures of the
    basis (steady-state figures need a steady window long enough), or one whose points
    were all unstable."""
    present = set(df["policy"].to_list()) if "policy" in df.columns else set()
    missing = [p for p in (entry["candidate"], entry["baseline"]) if p not in present]
    if missing:
        return (f"{' and '.join(missing)} not in the results (policies: "
                f"{', '.join(sorted(present)) or 'none'})")
    view = metric_view(df, entry["basis"])
    view = with_labels(view, _context_cols(view))  # the labels compute_fronts gave
    why = []
    for role in ("candidate", "baseline"):
        front = entry[f"{role}_front"]
        if front is not None and not front.empty:
            continue
        name = entry[role]
        label = f"{name} | {entry['context']}" if entry["context"] else name
        rows = usable(view.filter(pl.col("front_label") == label), stable_only=False)
        if rows.height == 0:
            words = "steady-state" if entry["basis"] == "steady" else "whole-run"
            why.append(f"{name} has no point with {words} figures" + (
                " (every steady window too short: run more requests per point)"
                if entry["basis"] == "steady" else ""))
        elif stable_only:
            why.append(f"{name} has no stable point")
    ctx = f" ({entry['context']})" if entry["context"] else ""
    return "; ".join(why) + ctx


def basis_used(df: pl.DataFrame, basis: str = "steady") -> str:
    """``"steady"`` when ``basis`` asks for it and the results carry the steady front
    columns, else ``"whole"``."""
    if basis not in BASES:
        raise InputError("--basis", f"must be one of {', '.join(BASES)}, got {basis!r}")
    has = {STEADY + X, STEADY + Y} <= set(df.columns) or {WHOLE + X, WHOLE + Y} <= set(
        df.columns)
    return "steady" if basis == "steady" and has else "whole"


def headline_rows(h: list[dict]) -> list[dict[str, str]]:
    """Flat ``{context, metric, value}`` rows for tables (report, docs, CLI)."""
    rows = []
    for e in h:
        ctx, m = e["context"], e["matched"]
        vs = f"{e['candidate']} vs {e['baseline']}"
        if m["feasible"]:
            val = (f"{m['gain_min']:+.0%} to {m['gain_max']:+.0%} (mean {m['gain_mean']:+.0%}) "
                   f"over {m['y_lo']:,.0f}-{m['y_hi']:,.0f} tok/s/GPU")
        else:
            val = f"no matched range: {m['reason']}"
        rows.append({"context": ctx, "metric": f"per-user TPS gain at matched throughput, {vs}",
                     "value": val})
        for t in e["tiers"]:
            rows.append({"context": ctx,
                         "metric": f"throughput gain at {t['tier']:g} tok/s/user, {vs}",
                         "value": f"{t['text']} [{e['candidate']}: {t['candidate'].text()}; "
                                  f"{e['baseline']}: {t['baseline'].text()}]"})
        rows.append({"context": ctx, "metric": "figures", "value": BASIS_TEXT[
            e.get("basis", "whole")]})
    return rows


BASIS_TEXT = {"steady": "steady state (warm-up and drain excluded)",
              "whole": "whole run (first arrival to last completion)"}


def format_headline(h: list[dict]) -> str:
    """A markdown table of :func:`headline_rows`."""
    rows = headline_rows(h)
    ctx = any(r["context"] for r in rows)
    head = "| context | metric | value |\n|---|---|---|" if ctx else "| metric | value |\n|---|---|"
    lines = [head]
    for r in rows:
        cells = ([r["context"]] if ctx else []) + [r["metric"], r["value"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


__all__ = ["BASES", "DEFAULT_TIERS", "Front", "TierResult", "X", "Y", "aggregate_seeds",
           "basis_used", "budget_table", "compute_fronts", "format_headline", "headline",
           "headline_rows", "is_lossy", "metric_view", "select_lossy",
           "matched_throughput_gain", "pareto_front", "tier_gain", "tier_throughput",
           "waste_table", "with_labels"]
