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
  never reaches ``T`` is *infeasible* at that tier; a tier below the interactivity of
  every point of the policy gets the front's maximum throughput, flagged ``below-sweep``
  (no load of the sweep fell to ``T``, so the number is a lower bound, and a gain with
  one such side is a bound: ``>=`` or ``<=``; with both, no gain is given). The text
  says why the front stops there: heavier loads left out (too few requests, unstable)
  or never swept.
* **who**: ``headline_pair``: the candidate defaults to the run's default policy
  (``SimConfig.policy``), the baseline to ``mtp1``; either is taken from the sweep when
  it is the only other policy.
* **points left off the fronts** (:func:`left_out`): every point without the figures
  (no steady window, too few requests in it) or unstable, with why and the remedy.
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
from dspark_sim.sim.config import SimConfig

X = "median_interactivity"
Y = "output_throughput_per_gpu"  # over the decode GPUs (docs/frontiers.md, "per GPU")
# beside it with disaggregated prefill: over the decode and the prefill GPUs
Y_INCL_PREFILL = "output_throughput_per_gpu_incl_prefill"
# what a sweep varies besides policy and load: fronts, answers and headlines are per value
CONTEXT = ("profile_spec", "trace_spec", "prefix_cache_spec")
# a context value as a label reads it ("prefix cache on" rather than a bare "on")
CONTEXT_PREFIX = {"prefix_cache_spec": "prefix cache "}
DEFAULT_TIERS = (80.0, 120.0)
# The headline's sides by default: what `dspark-sim run` runs when no policy is named
# (DEFAULT_POLICY, policies/registry.py) against MTP-1, the production baseline DSpark
# compares with.
DEFAULT_CANDIDATE = SimConfig.policy
DEFAULT_BASELINE = "mtp1"
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
    # the lowest interactivity of any point it was drawn from (a dominated one too): a
    # tier at or above it was reached by the sweep, so the front's value there is exact
    reach: float | None = None

    @classmethod
    def from_points(cls, label: str, x, y, rows: pl.DataFrame | None = None) -> Front:
        idx = pareto_front(x, y)
        xa = np.asarray(x, dtype=np.float64)
        xs = xa[idx]
        ys = np.asarray(y, dtype=np.float64)[idx]
        pts = rows[idx.tolist()] if rows is not None and rows.height else pl.DataFrame()
        reach = float(np.min(xa[np.isfinite(xa)])) if idx.size else None
        return cls(label, xs, ys, pts, reach)

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
    parts = [pl.col("policy").cast(pl.Utf8)] + [context_text(c) for c in context]
    return df.with_columns(pl.concat_str(parts, separator=" | ").alias("front_label"))


def context_text(col: str) -> pl.Expr:
    """A context column as labels read it (null: the run's default)."""
    return pl.concat_str([pl.lit(CONTEXT_PREFIX.get(col, "")),
                          pl.col(col).cast(pl.Utf8).fill_null("default")])


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
    # checked: samples=0 would end in numpy's zero-size reduction error, a NaN fraction
    # in a 'feasible' result with y_hi NaN (or silently no floor)
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
    lowest = front.x_range[0] if front.reach is None else min(front.reach, front.x_range[0])
    status = "below-sweep" if tier < lowest else "ok"
    return TierResult(float(tier), thr, status, mx)


# why a front stays above a tier and what to do, when nothing else is known
STOP_DEFAULT = ("the sweep has no heavier load", "extend the load range")


def tier_gain(a: Front, b: Front, tiers: Sequence[float] = DEFAULT_TIERS,
              stops: dict[str, tuple[str, str]] | None = None) -> list[dict]:
    """Throughput of ``a`` and ``b`` at each SLA tier and the gain ``a/b - 1``.

    ``bound``: ``"exact"``; ``"lower"`` / ``"upper"`` when the candidate's / baseline's
    front stays above the tier (that throughput is a lower bound, so the gain is one
    too / an upper one); None with no gain (a side infeasible, both fronts above the
    tier: a ratio of two lower bounds says nothing, or a baseline at zero). ``stops``:
    per front label, (why it stays above a tier, what to do); default
    :data:`STOP_DEFAULT`."""
    rows = []
    for t in tiers:
        ra, rb = tier_throughput(a, t), tier_throughput(b, t)
        gain, bound, text = _tier_verdict(a, b, ra, rb, stops or {})
        rows.append({"tier": float(t), "candidate": ra, "baseline": rb, "gain": gain,
                     "bound": bound, "text": text})
    return rows


def _tier_verdict(a: Front, b: Front, ra: TierResult, rb: TierResult,
                  stops: dict[str, tuple[str, str]]) -> tuple[float | None, str | None, str]:
    """(gain, bound, text) at one tier; each side's own figure is told beside it (see
    :func:`headline_rows`), so the text says only the verdict."""
    if ra.throughput is None or rb.throughput is None:
        missing = [f.label for f, r in ((a, ra), (b, rb)) if r.throughput is None]
        return None, None, ("infeasible for both" if len(missing) == 2
                            else f"infeasible for {missing[0]}")
    if rb.throughput <= 0:  # both feasible, the baseline at no throughput (not a's fault)
        return None, None, (f"no gain: {b.label} serves {rb.text()} at this tier; "
                            f"{a.label}: {ra.text()}")
    gain = ra.throughput / rb.throughput - 1.0
    above = [f for f, r in ((a, ra), (b, rb)) if r.status == "below-sweep"]
    if not above:
        return gain, "exact", f"{gain:+.0%}"
    said = [stops.get(f.label, STOP_DEFAULT) for f in above]
    why = "; ".join(f"{f.label}: {w}" for f, (w, _) in zip(above, said, strict=True))
    why += "; " + "; ".join(dict.fromkeys(r for _, r in said))  # each remedy once
    if len(above) == 2:
        return None, None, ("no gain: both fronts stay above this tier, so both throughputs "
                            f"are lower bounds ({why})")
    bound = "lower" if above[0] is a else "upper"
    return gain, bound, (f"{'>=' if bound == 'lower' else '<='} {gain:+.0%} (its throughput "
                         f"a lower bound, {why})")


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
            "output_throughput_per_gpu", Y_INCL_PREFILL, X, "mean_decode_batch",
            "median_ttft_ms", "p90_ttft_ms", "median_e2el_ms", "p90_e2el_ms", "stable", "steady_window_short"]
    d = d.with_columns(_concurrency_expr().alias("concurrency_x"))
    return d.select([c for c in cols if c in d.columns]).sort(
        ["policy", "load_kind", "concurrency_x"], nulls_last=True)


def waste_table(df: pl.DataFrame, basis: str = "steady") -> pl.DataFrame:
    """Verification waste (rejected / verified draft tokens) and budget against load."""
    d = aggregate_seeds(metric_view(df, basis))
    cols = ["policy", *_context_cols(df), "load_kind", "load", "verification_waste",
            "mean_draft_tokens_per_request_step", "mean_verify_tokens_per_request_step",
            "spec_decode_acceptance_length", "output_throughput_per_gpu", Y_INCL_PREFILL, X,
            "stable"]
    return d.select([c for c in cols if c in d.columns]).sort(["policy", "load_kind", "load"])


# -- headline -------------------------------------------------------------------------
def headline(df: pl.DataFrame, *, candidate: str | None = None, baseline: str | None = None,
             tiers: Sequence[float] = DEFAULT_TIERS, stable_only: bool = True,
             basis: str = "steady") -> list[dict]:
    """Candidate vs baseline for each profile/trace context of the sweep; either side not
    given is :func:`headline_pair`'s.

    Each entry: ``context`` (label suffix), ``candidate``, ``baseline`` (front labels),
    ``matched`` (:func:`matched_throughput_gain`), ``tiers`` (:func:`tier_gain`),
    ``candidate_front`` / ``baseline_front`` (:class:`Front`), ``basis`` (``steady`` or
    ``whole``: what the figures are; ``whole`` when the results have no steady columns),
    ``left_out`` (the two policies' :func:`left_out` rows in this context, as dicts).
    """
    swept = df["policy"].to_list() if "policy" in df.columns else []
    cand, base, _ = headline_pair(swept, candidate, baseline)
    used = basis_used(df, basis)
    # naming a lossy policy as candidate or baseline asks for its front
    fronts = compute_fronts(df, policies=[cand, base], stable_only=stable_only, basis=basis,
                            lossy=None)
    left = left_out(df, policies=[cand, base], stable_only=stable_only, basis=basis)
    stops = _front_stops(df, left, stable_only=stable_only, basis=basis)
    out = []
    by_ctx: dict[str, dict[str, Front]] = {}
    for label, fr in fronts.items():
        pol, _, ctx = label.partition(" | ")
        by_ctx.setdefault(ctx, {})[pol] = fr
    for ctx, fr in by_ctx.items():
        a = fr.get(cand, Front(cand, np.zeros(0), np.zeros(0)))
        b = fr.get(base, Front(base, np.zeros(0), np.zeros(0)))
        labels = [f"{p} | {ctx}" if ctx else p for p in (cand, base)]
        out.append({"context": ctx, "candidate": cand, "baseline": base,
                    "matched": matched_throughput_gain(a, b),
                    "tiers": tier_gain(a, b, tiers, {p: stops[lab] for p, lab in zip(
                        (cand, base), labels, strict=True) if lab in stops}),
                    "candidate_front": a, "baseline_front": b, "basis": used,
                    "left_out": left.filter(pl.col("front_label").is_in(labels)).to_dicts()})
    if not out:
        out.append({"context": "", "candidate": cand, "baseline": base,
                    "matched": matched_throughput_gain(Front(cand, np.zeros(0), np.zeros(0)),
                                                       Front(base, np.zeros(0), np.zeros(0))),
                    "tiers": [], "candidate_front": None, "baseline_front": None,
                    "basis": used, "left_out": left.to_dicts()})
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


def headline_policy(option: str, given: str | None, policies: list[str]) -> str | None:
    """The headline's candidate or baseline as the user names it (``option``: how): it
    must be swept, since a typo would silently drop the headline. None: taken from the
    sweep (:func:`headline_pair`)."""
    if given is None:
        return None
    swept = {canonical_policy(p): p for p in policies}
    if canonical_policy(given.strip()) not in swept:
        raise InputError(option, f"{given!r} is not one of --policies ({', '.join(policies)})")
    return swept[canonical_policy(given.strip())]


def headline_pair(policies: Sequence[str], candidate: str | None = None,
                  baseline: str | None = None) -> tuple[str, str, str | None]:
    """The headline's candidate and baseline (canonical names) for a sweep of
    ``policies``, and a note when a side is not among them (None when both are).

    A name given wins. Otherwise the baseline is ``mtp1`` and the candidate the run's
    default policy when swept, and a side is the sweep's one other policy when fixing the
    first leaves exactly one (a sweep of one policy: the candidate). A side still open
    falls back to its default, which the note says is not in the sweep, and how to name
    one."""
    present = list(dict.fromkeys(canonical_policy(p) for p in policies))
    cand = canonical_policy(candidate.strip()) if candidate else None
    base = canonical_policy(baseline.strip()) if baseline else None
    if base is None and DEFAULT_BASELINE in present and cand != DEFAULT_BASELINE:
        base = DEFAULT_BASELINE
    if cand is None and DEFAULT_CANDIDATE in present and base != DEFAULT_CANDIDATE:
        cand = DEFAULT_CANDIDATE
    rest = [p for p in present if p != base]
    if cand is None and len(rest) == 1:  # the one policy besides the baseline, or the only one
        cand = rest[0]
    if base is None and cand is not None and len(rest := [p for p in present if p != cand]) == 1:
        base = rest[0]
    notes = []
    for role, name, default in (("candidate", cand, DEFAULT_CANDIDATE),
                                ("baseline", base, DEFAULT_BASELINE)):
        if name is None:
            notes.append(f"no {role}: {default} is not swept and no single other policy is "
                         f"left to take (name one with --{role})")
        elif name not in present:
            notes.append(f"{name} not in the results")
    note = "; ".join(notes) + f" (policies: {', '.join(present) or 'none'})" if notes else None
    return cand or DEFAULT_CANDIDATE, base or DEFAULT_BASELINE, note


LEFT_OUT_REASONS = ("no steady window", "too few requests", "unstable")
LEFT_OUT_SCHEMA = {"front_label": pl.Utf8, "policy": pl.Utf8, "load_kind": pl.Utf8,
                   "load": pl.Float64, "seed": pl.Int64, "point_id": pl.Utf8,
                   "reason": pl.Utf8, "detail": pl.Utf8, "remedy": pl.Utf8}


def left_out(df: pl.DataFrame, *, policies: Sequence[str] | None = None,
             stable_only: bool = True, basis: str = "steady") -> pl.DataFrame:
    """Every sweep point (each seed) that no front can use, and why: one row each,
    :data:`LEFT_OUT_SCHEMA`'s columns, ``reason`` one of :data:`LEFT_OUT_REASONS`
    (``detail``: the numbers; ``remedy``: the sweep options that would keep it). A point
    with the figures that a front dominates is not left out: it was weighed."""
    if df.height == 0 or "policy" not in df.columns:
        return pl.DataFrame(schema=LEFT_OUT_SCHEMA)
    steady = basis_used(df, basis) == "steady"
    view = with_labels(metric_view(df, basis), _context_cols(df))
    if policies:
        view = view.filter(pl.col("policy").is_in([canonical_policy(p) for p in policies]))
    judge_stable = stable_only and "stable" in view.columns  # as usable() reads the flag
    rows = []
    for r in view.to_dicts():
        why = _why_left_out(r, steady=steady, judge_stable=judge_stable)
        if why is not None:
            rows.append({k: r.get(k) for k in ("front_label", "policy", "load_kind", "load",
                                               "seed", "point_id")}
                        | dict(zip(("reason", "detail", "remedy"), why, strict=True)))
    return pl.DataFrame(rows, schema=LEFT_OUT_SCHEMA)


def _finite(v) -> bool:
    return v is not None and math.isfinite(v)


def _why_left_out(r: dict, *, steady: bool, judge_stable: bool) -> tuple[str, str, str] | None:
    """(reason, detail, remedy) for one point of a metric view, or None when a front can
    use it."""
    if not _finite(r.get(Y)):
        detail = (r.get("steady_window_note") if steady else None) or "no engine step in it"
        return "no steady window", detail, _more_requests(r)
    if not _finite(r.get(X)):
        n = r.get("steady_window_requests") or 0
        ran = r.get("num_requests")
        detail = (f"{n:,} requests in the steady window's latency sample"
                  + (f", of {ran:,} run" if ran else "") if steady
                  else "no finished request of two or more tokens")
        return "too few requests", detail, _more_requests(r)
    if judge_stable and not r.get("stable"):
        return ("unstable", r.get("stability_note") or "requests unfinished, or the queue grew",
                "none: the policy cannot keep up with this load, its front ends at a "
                "lighter one (sweep loads in between to find where)")
    return None


def _more_requests(r: dict) -> str:
    """The sizing options that give a point a steady window with a latency sample."""
    double = "--max-doublings D (reruns it with twice the requests while its window is short)"
    if r.get("load_kind") == "concurrency":
        return (f"run more requests per point: --requests-per-client K (at least K x the "
                f"clients; the case study uses 32) or {double}")
    return f"run more requests per point: --num-requests N or {double}"


def load_text(kind: str | None, load: float | None) -> str:
    """A point's load as a reader says it: ``C = 64`` (clients) or ``20 req/s``."""
    if load is None:
        return "-"
    if kind == "concurrency":
        return f"C = {load:g}"
    return f"{load:g} req/s" if kind == "qps" else f"{kind} {load:g}"


def _front_stops(df: pl.DataFrame, left: pl.DataFrame, *, stable_only: bool,
                 basis: str) -> dict[str, tuple[str, str]]:
    """Per front label: (why the front ends where it does at its heavy-load end, what to
    do). Its heavier loads left out (too few requests, no window, unstable) say so;
    otherwise the sweep never went heavier: extend the load range past its heaviest."""
    view = with_labels(metric_view(df, basis), _context_cols(df))
    used = usable(view, stable_only=stable_only)
    out = {}
    for label in dict.fromkeys(used["front_label"].to_list() + left["front_label"].to_list()):
        u, lo = used.filter(pl.col("front_label") == label), left.filter(
            pl.col("front_label") == label)
        heavier = []
        for r in lo.to_dicts():
            mine = u.filter(pl.col("load_kind") == r["load_kind"])["load"]
            if mine.len() == 0 or r["load"] > mine.max():
                heavier.append(r)
        if heavier:
            loads = ", ".join(dict.fromkeys(load_text(r["load_kind"], r["load"])
                                            for r in sorted(heavier, key=lambda r: r["load"])))
            sized = [r for r in heavier if r["reason"] != "unstable"]
            out[label] = ((f"heavier loads ({loads}) left off, {sized[0]['reason']}",
                           "run more requests per point (--requests-per-client, "
                           "--max-doublings)") if sized else
                          (f"heavier loads ({loads}) unstable",
                           "sweep loads between its heaviest stable one and them"))
        elif u.height:
            top = u.sort("load").row(-1, named=True)
            out[label] = (f"its heaviest load is {load_text(top['load_kind'], top['load'])}",
                          "extend the load range")
    return out


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
        if e.get("left_out"):
            rows.append({"context": ctx, "metric": f"points left off the fronts, {vs}",
                         "value": left_out_text(e["left_out"])})
        rows.append({"context": ctx, "metric": "figures", "value": BASIS_TEXT[
            e.get("basis", "whole")]})
    return rows


def left_out_text(rows: Sequence[dict]) -> str:
    """:func:`left_out` rows in one line: each point (seeds of one load together) with
    its reason and numbers, then each remedy once."""
    points: dict[tuple, list] = {}
    for r in rows:
        points.setdefault((r["front_label"], r["load_kind"], r["load"], r["reason"]),
                          []).append(r)
    said = []
    for (label, kind, load, reason), rs in points.items():
        seeds = f", {len(rs)} seeds" if len(rs) > 1 else ""
        said.append(f"{label} at {load_text(kind, load)}: {reason}{seeds} ({rs[0]['detail']})")
    remedies = list(dict.fromkeys(r["remedy"] for r in rows))
    return "; ".join(said) + ". Remedy: " + "; ".join(remedies)


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


# -- goodput under SLOs ------------------------------------------------------------------
GOODPUT = "goodput"  # requests/s meeting every SLO given
GOODPUT_TOKENS = "goodput_tokens"  # their output tokens/s
GOODPUT_Y = "goodput_tokens_per_gpu"  # the same per decode GPU: the goodput fronts' y axis
GOODPUT_FRACTION = "goodput_fraction"  # of the judged requests, those meeting every SLO
GOODPUT_JUDGED = "goodput_judged"  # how many requests were judged


@dataclass(frozen=True)
class Slo:
    """Service-level objectives a request must meet to count in goodput (None: not set).
    TPOT is judged only where a request has one (a single-token request passes it)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def given(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def text(self) -> str:
        parts = [f"TTFT <= {self.ttft_ms:g} ms" if self.ttft_ms is not None else "",
                 f"TPOT <= {self.tpot_ms:g} ms" if self.tpot_ms is not None else ""]
        return " and ".join(p for p in parts if p) or "no SLO"

    @classmethod
    def of(cls, cfg: SimConfig) -> Slo:
        return cls(cfg.slo_ttft_ms, cfg.slo_tpot_ms)


def with_goodput(df: pl.DataFrame, slo: Slo, basis: str = "steady") -> pl.DataFrame:
    """``df`` (any view) with :data:`GOODPUT`, :data:`GOODPUT_TOKENS`, :data:`GOODPUT_Y`,
    :data:`GOODPUT_FRACTION` and :data:`GOODPUT_JUDGED` under ``slo``, judged on each
    point's request sample (``sweep.SAMPLE_COLUMNS``): with ``basis="steady"`` the
    requests of its steady latency sample (arrived between the window's start and
    ``steady_latency_arrivals_end_s``, the requests its latency figures describe), else
    every finished one. Goodput = the basis's request (or output-token) throughput x the
    fraction of the judged requests (or of their tokens) meeting every SLO. Null where
    no SLO is given, or a point has no sample (a sweep from before samples were kept) or
    no judged request."""
    view = metric_view(df, basis)
    steady = basis_used(df, basis) == "steady"
    cols = (GOODPUT, GOODPUT_TOKENS, GOODPUT_Y, GOODPUT_FRACTION, GOODPUT_JUDGED)
    if not slo.given or "sample_ttft_ms" not in view.columns:
        return view.with_columns([pl.lit(None, dtype=pl.Float64).alias(c) for c in cols])
    out = {c: [] for c in cols}
    for r in view.iter_rows(named=True):
        g = _goodput_row(r, slo, steady)
        for c in cols:
            out[c].append(g.get(c))
    return view.with_columns([pl.Series(c, v, dtype=pl.Float64) for c, v in out.items()])


def _goodput_row(r: dict, slo: Slo, steady: bool) -> dict:
    if r.get("sample_ttft_ms") is None:
        return {}
    arrival = np.asarray(r["sample_arrival_s"], dtype=np.float64)
    ttft = np.asarray(r["sample_ttft_ms"], dtype=np.float64)
    tpot = np.asarray(r["sample_tpot_ms"], dtype=np.float64)
    tokens = np.asarray(r["sample_output_tokens"], dtype=np.float64)
    judged = np.ones(arrival.size, bool)
    if steady:
        t0, t1 = r.get("steady_window_start_s"), r.get("steady_latency_arrivals_end_s")
        if not (_finite(t0) and _finite(t1)):
            return {}
        judged = (arrival >= t0) & (arrival <= t1)
    if not judged.any():
        return {}
    ok = judged.copy()
    if slo.ttft_ms is not None:
        ok &= ttft <= slo.ttft_ms
    if slo.tpot_ms is not None:
        ok &= ~(tpot > slo.tpot_ms)  # NaN (one token, no TPOT) passes
    frac = ok.sum() / judged.sum()
    tok_all = tokens[judged].sum()
    frac_tok = tokens[ok].sum() / tok_all if tok_all > 0 else 0.0

    def times(col: str, f: float) -> float | None:
        v = r.get(col)
        return v * f if _finite(v) else None

    return {GOODPUT: times("request_throughput", frac),
            GOODPUT_TOKENS: times("output_throughput", frac_tok),
            GOODPUT_Y: times(Y, frac_tok), GOODPUT_FRACTION: float(frac),
            GOODPUT_JUDGED: float(judged.sum())}


# -- the per-load answer -------------------------------------------------------------------
# The same policy, load and seed run again into one folder (more requests, another
# deployment or lengths): a front or the per-load answer must weigh one run of it, or
# its repeats would pass for seeds and narrow the noise falsely.
POINT_KEY = ("policy", "profile_spec", "trace_spec", "load_kind", "load", "seed")
# keys a point has only in later results: part of the key where the rows carry them
POINT_KEY_OPTIONAL = ("prefix_cache_spec",)


def one_run_per_point(df: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(kept, superseded): of the rows that share :data:`POINT_KEY`, the one that ran the
    most requests (then the most completed) is kept; the others come back in ``superseded``
    with ``reason`` and ``detail`` saying which run took their place."""
    key = [c for c in POINT_KEY if c in df.columns]
    if df.height == 0 or "point_id" not in df.columns or len(key) < len(POINT_KEY):
        return df, df.clear().with_columns(reason=pl.lit(""), detail=pl.lit(""))
    key += [c for c in POINT_KEY_OPTIONAL if c in df.columns]
    order = [c for c in ("num_requests", "completed") if c in df.columns]
    d = df.with_row_index("_row")
    ranked = d.sort([*order, "point_id"], descending=[True] * len(order) + [False],
                    nulls_last=True)
    kept_ids = ranked.unique(subset=key, keep="first", maintain_order=True)
    kept = d.filter(pl.col("_row").is_in(kept_ids["_row"].implode())).sort("_row")
    gone = d.filter(~pl.col("_row").is_in(kept_ids["_row"].implode()))
    if gone.height == 0:
        return kept.drop("_row"), gone.drop("_row").with_columns(
            reason=pl.lit(""), detail=pl.lit(""))
    winner = kept_ids.select([*key, pl.col("point_id").alias("_by")]
                             + [pl.col(c).alias(f"_by_{c}") for c in order])
    gone = gone.join(winner, on=key, how="left", nulls_equal=True)
    n = "num_requests" if "num_requests" in df.columns else None
    detail = pl.concat_str([
        pl.lit("the same policy, load and seed ran again as point "), pl.col("_by"),
        *([pl.lit(" with "), pl.col("_by_num_requests").cast(pl.Utf8),
           pl.lit(" requests (this one "), pl.col(n).cast(pl.Utf8), pl.lit(")")] if n else []),
    ])
    gone = gone.with_columns(reason=pl.lit("superseded"), detail=detail)
    gone = gone.drop([c for c in gone.columns if c.startswith("_by") or c == "_row"])
    return kept.drop("_row"), gone


# two-sided 95 % Student t quantiles by degrees of freedom (the last: the normal's)
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
       9: 2.262, 10: 2.228, 12: 2.179, 15: 2.131, 19: 2.093, 24: 2.064, 30: 2.042}


def t95(dof: int) -> float:
    """The two-sided 95 % t quantile at ``dof`` (the table's next lower entry: wider)."""
    if dof < 1:
        return math.inf
    if dof > 30:
        return 1.96
    return T95[max(k for k in T95 if k <= dof)]


# the batch-means error's spans (metrics.RSE_BATCHES): its degrees of freedom, less one
BATCH_MEANS_DOF = 19


@dataclass(frozen=True)
class Estimate:
    """A policy's figure at one load: mean over its seeds, standard error, how measured
    (``seeds`` >= 2: the spread of the seeds' figures; 1: the run's own batch-means error
    over its steady window), and the requests each run ran."""

    mean: float
    se: float | None
    seeds: int
    requests: int | None

    @property
    def dof(self) -> int:
        return self.seeds - 1 if self.seeds > 1 else BATCH_MEANS_DOF


RANKS = {"goodput": (GOODPUT_Y, "goodput (tok/s/GPU meeting the SLOs)"),
         "throughput": (Y, "throughput (tok/s/GPU)"),
         "interactivity": (X, "median interactivity (tok/s/user)")}
# each ranking figure's short name and unit, for a gap no ratio can state
RANK_UNITS = {"goodput": ("goodput", "tok/s/GPU"), "throughput": ("throughput", "tok/s/GPU"),
              "interactivity": ("median interactivity", "tok/s/user")}
RSE_OF = {Y: "steady_output_throughput_rse", X: "steady_median_interactivity_rse"}


def rank_metric(load_kind: str | None, arrival: str | None, slo: Slo) -> str:
    """What ranks the policies at a load: goodput under SLOs when given; else throughput
    per GPU in a closed loop (the clients set the load, the policy the tokens served) and
    median interactivity in an open loop (every stable policy serves the offered rate, so
    what differs is each user's speed)."""
    if slo.given:
        return "goodput"
    closed = load_kind == "concurrency" or (load_kind == "base" and arrival == "closed")
    return "throughput" if closed else "interactivity"


def _estimate(rows: pl.DataFrame, col: str) -> Estimate | None:
    vals = [v for v in rows[col].to_list() if _finite(v)] if col in rows.columns else []
    if not vals or len(vals) < rows.height:
        return None
    n = len(vals)
    mean = float(np.mean(vals))
    reqs = rows["num_requests"].to_list()[0] if "num_requests" in rows.columns else None
    if n > 1:
        return Estimate(mean, float(np.std(vals, ddof=1) / math.sqrt(n)), n, reqs)
    r = rows.row(0, named=True)
    if col in RSE_OF:
        rse = r.get(RSE_OF[col])
        return Estimate(mean, abs(mean) * rse if _finite(rse) else None, 1, reqs)
    if col in (GOODPUT, GOODPUT_TOKENS, GOODPUT_Y):  # the throughput's error and the
        rse, p, k = r.get(RSE_OF[Y]), r.get(GOODPUT_FRACTION), r.get(GOODPUT_JUDGED)
        if not (_finite(rse) and _finite(p) and k):  # judged fraction's binomial one
            return Estimate(mean, None, 1, reqs)
        frac_se = math.sqrt(max(p * (1 - p), 0.25 / k) / k)  # never 0 at p = 0 or 1
        return Estimate(mean, math.sqrt((mean * rse) ** 2 + (frac_se * mean / p) ** 2)
                        if p > 0 else frac_se * (mean or r.get(Y) or 0.0), 1, reqs)
    return Estimate(mean, None, 1, reqs)


def _gain(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)) or b <= 0:
        return None
    return a / b - 1.0


def answer(df: pl.DataFrame, *, slo: Slo = Slo(), basis: str = "steady",
           baseline: str = "none", rank: str | None = None) -> list[dict]:
    """The per-load answer: for each context (profile, trace) and load, the policy to
    deploy, its gains over ``baseline`` (no speculation) and over the runner-up on
    throughput per GPU and on goodput under ``slo``, and whether the runner-up is within
    noise. One dict per load, in load order, with the numbers (``best``, ``runner_up``,
    ``rank``, ``estimates`` by policy, ``gain_*``, ``tie``, ``diff``, ``half_width``,
    ``settle_factor``) and ``verdict``, the sentence.

    Candidates: the lossless policies whose every seed at that load is stable with the
    ranking figure (lossy ones trade quality for speed; unstable ones cannot hold the
    load). ``best`` is the best one the deployment can run with its measured drafter
    (results column ``engine_can_run``; a policy it cannot run is still simulated):
    where one it cannot run ranks higher, ``undeployable_best`` names it, with its gain
    over ``best`` and why (``undeployable_note``); where it can run none, ``best`` is the
    best simulated and ``deployable`` is False. The runner-up is the next one as
    deployable as ``best``. Noise: the 95 % confidence interval of the best minus the runner-up, from the
    spread over seeds (``sweep --seeds``), or with one seed from each run's batch-means
    error; a gap inside it is a tie. Narrowing the interval below the gap takes
    (half-width / gap)^2 times the seeds, or the requests per point (the interval
    shrinks as 1/sqrt(n)). ``rank``: one of :data:`RANKS` (default: :func:`rank_metric`).
    """
    if df.height == 0 or "policy" not in df.columns:
        return []
    if rank is not None and rank not in RANKS:
        raise InputError("--rank", f"must be one of {', '.join(RANKS)}, got {rank!r}")
    view = with_goodput(df, slo, basis)
    view = select_lossy(view, False)
    steady = basis_used(df, basis) == "steady"
    ctx_cols = _context_cols(view)
    view = with_labels(view, ctx_cols).with_columns(
        pl.concat_str([context_text(c) for c in ctx_cols],
                      separator=" | ").alias("_ctx") if ctx_cols else pl.lit("").alias("_ctx"))
    baseline = canonical_policy(baseline)
    out = []
    keys = ["_ctx", "load_kind", "load"]
    for (ctx, kind, load), g in sorted(view.group_by(keys, maintain_order=True),
                                       key=lambda kv: (kv[0][0], str(kv[0][1]), kv[0][2])):
        out.append(_load_answer(g, ctx, kind, load, rank=rank, slo=slo, steady=steady,
                                ctx_cols=ctx_cols, baseline=baseline))
    return out


def _load_answer(g: pl.DataFrame, ctx: str, kind: str, load, *, rank: str | None, slo: Slo,
                 steady: bool, ctx_cols: list[str], baseline: str) -> dict:
    """:func:`answer`'s row for one context and load (``g``: its points)."""
    arrival = g["arrival"][0] if "arrival" in g.columns else None
    how = rank or rank_metric(kind, arrival, slo)
    col = RANKS[how][0]
    est: dict[str, dict[str, Estimate | None]] = {}
    unstable = []
    for pol, rows in g.group_by("policy", maintain_order=True):
        pol = pol[0]
        if "stable" in rows.columns and not rows["stable"].fill_null(False).all():
            unstable.append(pol)
            continue
        est[pol] = {c: _estimate(rows, c) for c in (col, Y, X, GOODPUT, GOODPUT_Y)}
    ranked = sorted((p for p in est if est[p][col] is not None),
                    key=lambda p: -est[p][col].mean)
    ranking = list(ranked)  # every policy with the figure, deployable or not
    # stable but without the ranking figure (a steady window too short for a latency
    # sample, no request judged): it holds the load, so it is named, not dropped
    unranked = {p: _no_figure(g.filter(pl.col("policy") == p), steady)
                for p in est if est[p][col] is None}
    cannot = _cannot_run(g)
    runnable = [p for p in ranked if p not in cannot]
    row = {"context": ctx, "load_kind": kind, "load": load,
           "load_text": load_text(kind, load), "rank": how, "slo": slo,
           "estimates": est, "unstable": unstable, "best": None, "runner_up": None,
           "tie": None, "diff": None, "half_width": None, "settle_factor": None,
           "deployable": True, "undeployable_best": None, "undeployable_gain": None,
           "undeployable_note": None, "unranked": unranked, "compared": {},
           "ranking": ranking,
           "context_values": {c: g[c][0] for c in ctx_cols},
           "simulated_only": [p for p in ranked if p in cannot]}
    if ranked and ranked[0] in cannot and runnable:
        top = ranked[0]
        row |= {"undeployable_best": top, "undeployable_note": cannot[top],
                "undeployable_gain": _gain(est[top][col].mean,
                                           est[runnable[0]][col].mean)}
    if runnable:  # rank what the deployment can run; the rest are named, not picked
        ranked = runnable
    elif ranked:
        row["deployable"] = False
    if not ranked and len(unranked) == 1:  # the one policy that holds the load
        ranked = list(unranked)
        row["deployable"] = ranked[0] not in cannot
    if not ranked:
        row["verdict"] = _verdict_unranked(row, unstable)
        return row
    best = ranked[0]
    row["best"] = best
    row["best_unranked"] = unranked.get(best)  # the one policy holding it, no figure
    row["unranked"] = {p: why for p, why in unranked.items() if p != best}
    for name, other in (("none", baseline if baseline in est and baseline != best
                         else None), ("runner_up", ranked[1] if len(ranked) > 1 else None)):
        row["compared"][name] = other
        for metric, c in (("throughput", Y), ("goodput", GOODPUT_Y)):
            a, b = est[best][c], est[other][c] if other else None
            row[f"gain_{metric}_vs_{name}"] = _gain(a.mean if a else None,
                                                    b.mean if b else None)
    row["runner_up"] = ranked[1] if len(ranked) > 1 else None
    row |= _noise(est, best, row["runner_up"], col)
    row["verdict"] = _verdict(row, unstable)
    return row


def by_prefix_cache(rows: Sequence[dict], baseline: str = "none") -> list[dict]:
    """The per-load answer (:func:`answer`'s rows) with the prefix cache on beside off:
    one dict per load (and other context) the sweep ran both ways, with each setting's
    ``best``, ``ranking`` (best first, by the answer's figure), the best's ``gain``
    over ``baseline`` on that figure, and whether the ranking (``same_ranking``) and
    the best (``same_best``) change with caching. Empty when the rows do not vary it."""
    col = "prefix_cache_spec"
    pairs: dict[tuple, dict] = {}
    for r in rows:
        ctx = r.get("context_values") or {}
        if col not in ctx:
            return []
        rest = tuple((k, v) for k, v in ctx.items() if k != col)
        pairs.setdefault((rest, r["load_kind"], r["load"]), {})[ctx[col]] = r
    out = []
    for (rest, kind, load), by in pairs.items():
        if not {"on", "off"} <= set(by):
            continue
        entry = {"context": " | ".join(f"{CONTEXT_PREFIX.get(k, '')}{v or 'default'}"
                                       for k, v in rest),
                 "load_kind": kind, "load": load, "load_text": load_text(kind, load),
                 "rank": by["on"]["rank"]}
        for cache in ("on", "off"):
            r = by[cache]
            c = RANKS[r["rank"]][0]
            best, est = r["best"], r["estimates"]
            base = est.get(canonical_policy(baseline), {}).get(c)
            entry[cache] = {"best": best, "ranking": r["ranking"],
                            "figure": est[best][c].mean if best and est[best][c] else None,
                            "gain": _gain(est[best][c].mean if best and est[best][c] else None,
                                          base.mean if base else None),
                            "verdict": r["verdict"]}
        entry["same_best"] = entry["on"]["best"] == entry["off"]["best"]
        entry["same_ranking"] = entry["on"]["ranking"] == entry["off"]["ranking"]
        out.append(entry)
    return out


def by_prefix_cache_rows(rows: Sequence[dict]) -> list[dict[str, str]]:
    """:func:`by_prefix_cache` as table rows of text."""
    table = []
    for e in rows:
        t = {"context": e["context"]} if any(x["context"] for x in rows) else {}
        t["load"] = e["load_text"]
        for cache in ("on", "off"):
            s = e[cache]
            t[f"ranking, cache {cache}"] = " > ".join(s["ranking"]) or "-"
            t[f"best vs none, cache {cache}"] = _pct(s["gain"])
        t["ranked on"] = RANKS[e["rank"]][1]
        held = e["on"]["best"] or e["off"]["best"]
        t["caching changes"] = ("nothing: no policy holds this load either way" if not held
                                else "nothing in the ranking" if e["same_ranking"] else
                                "the ranking, not the best" if e["same_best"] else
                                f"the best: {e['on']['best']} (on) vs {e['off']['best']} (off)")
        table.append(t)
    return table


def _cannot_run(g: pl.DataFrame) -> dict[str, str]:
    """The policies at a load the deployment cannot run with its measured drafter, each
    with why (results without ``engine_can_run``, from before it was recorded, count as
    runnable: nothing says otherwise)."""
    if "engine_can_run" not in g.columns:
        return {}
    bad = g.filter(pl.col("engine_can_run").cast(pl.Boolean, strict=False) == False)  # noqa: E712
    notes = bad["engine_note"].to_list() if "engine_note" in bad.columns else [None] * bad.height
    return {p: n or "the measured drafter cannot run it"
            for p, n in zip(bad["policy"].to_list(), notes, strict=True)}


def _no_figure(rows: pl.DataFrame, steady: bool) -> tuple[str, str]:
    """(why a stable policy has no ranking figure at a load, what would give it one)."""
    r = rows.row(0, named=True)
    why = _why_left_out(r, steady=steady, judge_stable=False)
    if why is not None:
        return f"{why[0]}: {why[1]}", why[2]
    return ("no request judged under the SLOs (no request sample in the results)",
            "rerun the sweep into a new folder: its points keep the requests goodput judges")


def _reasons(unranked: dict[str, tuple[str, str]]) -> str:
    """Each policy without the ranking figure with why, then each remedy once."""
    said = "; ".join(why if len(unranked) == 1 else f"{p}: {why}"
                     for p, (why, _) in unranked.items())
    return said + "; " + "; ".join(dict.fromkeys(fix for _, fix in unranked.values()))


def _verdict_unranked(row: dict, unstable: list[str]) -> str:
    off = f"; unstable: {', '.join(unstable)}" if unstable else ""
    un = row["unranked"]
    if un:
        return (f"cannot rank: {', '.join(un)} hold this load but have no "
                f"{RANK_UNITS[row['rank']][0]} figure ({_reasons(un)}){off}")
    return "no policy holds this load" + (f" ({', '.join(unstable)} unstable)" if unstable
                                          else " (no figures)")


def _noise(est: dict, best: str, runner: str | None, col: str) -> dict:
    if runner is None:
        return {}
    a, b = est[best][col], est[runner][col]
    diff = a.mean - b.mean
    if a.se is None or b.se is None:
        return {"diff": diff}
    half = t95(min(a.dof, b.dof)) * math.hypot(a.se, b.se)
    tie = diff <= half
    factor = (half / diff) ** 2 if diff > 0 else math.inf
    return {"diff": diff, "half_width": half, "tie": tie,
            "settle_factor": factor if tie else None}


def _verdict(row: dict, unstable: list[str]) -> str:
    best, runner = row["best"], row["runner_up"]
    col = RANKS[row["rank"]][0]
    metric = RANK_UNITS[row["rank"]][0] + " figure"
    a = row["estimates"][best][col]
    off = f"; unstable: {', '.join(unstable)}" if unstable else ""
    if row.get("unranked"):
        off += (f"; {', '.join(row['unranked'])} also hold{'s' * (len(row['unranked']) == 1)}"
                f" this load but without a {metric} ({_reasons(row['unranked'])})")
    if not row.get("deployable", True):
        off += ("; simulated only: the deployment's measured drafter can run none of these "
                "policies")
    elif row.get("undeployable_best"):
        g = row["undeployable_gain"]
        off += (f"; {row['undeployable_best']} would rank first"
                + (f" ({g:+.1%})" if g is not None else "")
                + " but is simulated only: the deployment's measured drafter cannot run it")
    if runner is None:
        which = "deployable policy" if row.get("simulated_only") and \
            row.get("deployable", True) else "policy"
        if row.get("best_unranked"):
            return (f"{best} is the only {which} that holds this load, without a {metric} "
                    f"({_reasons({best: row['best_unranked']})}){off}")
        if row.get("unranked"):
            return f"{best} is the only {which} with a {metric} at this load{off}"
        return f"{best} is the only {which} that holds this load{off}"
    base = abs(row["estimates"][runner][col].mean)
    how = (f"{a.seeds} seeds" if a.seeds > 1 else
           "1 seed, the runs' own batch-means error")
    if base > 0:
        ahead = f"{row['diff'] / base:+.1%}"
        gap = f"{ahead} ± {row['half_width'] / base:.1%}" if row["tie"] is not None else ""
    else:  # over nothing no ratio is finite: the gap in the figure's own units
        name, unit = RANK_UNITS[row["rank"]]
        zero = f" ({runner}'s {name} is 0)"
        ahead = f"{row['diff']:,.1f} {unit}{zero}"
        gap = (f"{row['diff']:,.1f} ± {row['half_width']:,.1f} {unit}{zero}"
               if row["tie"] is not None else "")
    if row["tie"] is None:
        return (f"{best} ahead of {runner} by {ahead}, noise not measured "
                f"(run --seeds 0,1,2 or more requests per point){off}")
    gap = f"{gap} (95 % CI, {how})"
    if not row["tie"]:
        return f"clear: {best} over {runner} by {gap}{off}"
    f = row["settle_factor"]
    if not math.isfinite(f):
        return f"tie: {best} and {runner} are identical here ({how}){off}"
    if a.seeds > 1:
        need = f"about {math.ceil(a.seeds * f):,} seeds per point"
    else:
        need = f"about {f:,.1f}x the requests per point" + (
            f" ({math.ceil(a.requests * f):,})" if a.requests else "") + " or "
        need += f"{math.ceil(max(f, 2.0)):,} seeds"
    return (f"tie within noise: {best} vs {runner} {gap}; {need} would settle a gap this "
            f"size{off}")


def answer_rows(rows: Sequence[dict]) -> list[dict[str, str]]:
    """:func:`answer` as table rows of text: load, deploy, ranked on, the best's figures
    with their 95 % interval, its gains over no speculation and over the runner-up,
    goodput (when SLOs are given) and the verdict."""
    ctx = any(r["context"] for r in rows)
    out = []
    for r in rows:
        e = r["estimates"].get(r["best"], {}) if r["best"] else {}
        t = {"context": r["context"]} if ctx else {}
        deploy = r["best"] or "-"
        if r["best"] and not r.get("deployable", True):
            deploy += " (simulated only: not deployable)"
        t |= {"load": r["load_text"], "deploy": deploy,
              "ranked on": RANKS[r["rank"]][1],
              "tok/s/GPU": _est_text(e.get(Y), "{:,.0f}"),
              "interactivity (tok/s/user)": _est_text(e.get(X), "{:,.1f}")}
        if r["slo"].given:
            g, gy = e.get(GOODPUT), e.get(GOODPUT_Y)
            t["goodput (req/s; tok/s/GPU)"] = (f"{_est_text(g, '{:,.2f}')}; "
                                               f"{_est_text(gy, '{:,.0f}')}")
        for name, who in (("none", "vs none"), ("runner_up", "vs runner-up")):
            parts = [f"{_pct(r.get(f'gain_throughput_vs_{name}'))} tok/s/GPU"]
            if r["slo"].given:
                parts.append(_goodput_gain_text(r, name))
            t[who] = ", ".join(parts)
        t["runner-up"] = r["runner_up"] or "-"
        if any(x.get("undeployable_best") for x in rows):
            u = r.get("undeployable_best")
            t["ranks higher, not deployable"] = "-" if not u else (
                f"{u} ({_pct(r.get('undeployable_gain'))})")
        t["verdict"] = r["verdict"]
        out.append(t)
    return out


def _goodput_gain_text(r: dict, name: str) -> str:
    """The best's goodput gain over ``name`` (none, runner_up); where the other policy's
    goodput is 0 the gain is infinite, and that is said in words."""
    g = r.get(f"gain_goodput_vs_{name}")
    other = r.get("compared", {}).get(name)
    if g is not None or other is None:
        return f"{_pct(g)} goodput"
    theirs = r["estimates"].get(other, {}).get(GOODPUT_Y)
    if theirs is None or theirs.mean != 0:
        return f"{_pct(g)} goodput"
    ours = r["estimates"][r["best"]].get(GOODPUT_Y)
    if ours is not None and ours.mean == 0:
        return f"{r['best']} and {other} meet the SLOs on no request"
    return f"{other} meets no request's SLOs (goodput 0)"


def _est_text(e: Estimate | None, f: str) -> str:
    if e is None:
        return "-"
    return f.format(e.mean) + (f" ± {f.format(t95(e.dof) * e.se)}" if e.se is not None else "")


def _pct(g: float | None) -> str:
    return "-" if g is None else f"{g:+.1%}"


def format_answer(rows: Sequence[dict]) -> str:
    """:func:`answer_rows` as a markdown table."""
    table = answer_rows(rows)
    if not table:
        return "(no loads)"
    cols = list(table[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(r[c] for c in cols) + " |" for r in table]
    return "\n".join(lines)


def default_tiers(df: pl.DataFrame, basis: str = "steady", count: int = 2) -> list[float]:
    """SLA tiers (tok/s/user) inside the data: ``count`` evenly spaced values between the
    lowest and highest median interactivity of the stable points, rounded to two
    significant figures (three where two would merge them). A fixed default (80, 120) sits outside an engine that runs at
    15-25 tok/s/user ("infeasible for both") and squeezes its plot; :data:`DEFAULT_TIERS`
    when no point has the figure."""
    if df.height == 0 or "policy" not in df.columns:
        return list(DEFAULT_TIERS)
    x = usable(select_lossy(metric_view(df, basis), False))[X] if X in df.columns else None
    if x is None or x.len() == 0:
        return list(DEFAULT_TIERS)
    lo, hi = float(x.min()), float(x.max())
    vals = [lo + (hi - lo) * (i + 1) / (count + 1) for i in range(count)] if hi > lo else [lo]
    for digits in (2, 3):  # three where two would make two tiers one
        tiers = list(dict.fromkeys(float(f"{v:.{digits}g}") for v in vals if v > 0))
        if len(tiers) == len(vals):
            break
    return tiers or list(DEFAULT_TIERS)


__all__ = ["BASES", "DEFAULT_BASELINE", "DEFAULT_CANDIDATE", "DEFAULT_TIERS", "GOODPUT",
           "GOODPUT_TOKENS", "GOODPUT_Y", "Estimate", "Front", "RANKS", "Slo", "answer",
           "answer_rows", "by_prefix_cache", "by_prefix_cache_rows", "default_tiers",
           "format_answer", "one_run_per_point",
           "rank_metric", "with_goodput",
           "LEFT_OUT_REASONS", "TierResult", "X", "Y", "Y_INCL_PREFILL", "aggregate_seeds",
           "basis_used", "budget_table", "compute_fronts", "format_headline", "headline",
           "headline_pair", "headline_rows", "is_lossy", "left_out", "left_out_text",
           "load_text", "metric_view", "select_lossy",
           "matched_throughput_gain", "pareto_front", "tier_gain", "tier_throughput",
           "waste_table", "with_labels"]
