"""A self-contained HTML report of a sweep (plotly.js inlined: it opens offline).

Sections: the throughput-vs-interactivity fronts (markers = sweep points with hover
details, lines = Pareto fronts, one legend group per policy so a click toggles a
policy), SLA tiers as dashed lines, the Fig. 8 view (throughput and verification
budget against concurrency), queueing (median TTFT and E2E against concurrency),
verification waste against load, and the headline numbers. Measured vLLM ``bench
serve`` results can be overlaid (:func:`read_vllm_results`).

Figures are steady-state (``basis="steady"``, warm-up and drain excluded; see
``dspark_sim.sim.metrics``) unless ``basis="whole"``; markers: circle = stable point,
x = unstable (left off the fronts), open circle = steady window flagged short (run more
requests), diamond = a lossy policy's point, star = a measured vLLM point. The key to the
markers sits under the front plot, not in its title: a plot title does not wrap, and a
long one is cut at the figure's edge.

Each point says where its policy's confidences came from (the drafter's own, or assumed
through ``--conf-source``) and whether the deployment's measured drafter can run the
policy in its engine (results columns ``confidences``, ``engine_can_run``,
``engine_note``). A policy it cannot run is still simulated, and labelled "simulated only"
in the legend, the hover, the per-load answer (which recommends the best policy the
deployment can run, and names a higher-ranked one it cannot) and a table of its own.
"""

from __future__ import annotations

import html
import json
import math
import textwrap
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio
import polars as pl
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from dspark_sim.errors import InputError
from dspark_sim.io import loads_bench_serve_json, not_a_file, write_text_atomic
from dspark_sim.sim.frontier import (
    BASIS_TEXT,
    CONTEXT,
    DEFAULT_TIERS,
    GOODPUT_Y,
    Y_INCL_PREFILL,
    Slo,
    X,
    Y,
    answer,
    answer_rows,
    basis_used,
    budget_table,
    by_prefix_cache,
    by_prefix_cache_rows,
    canonical_policy,
    compute_fronts,
    default_tiers,
    format_answer,
    format_headline,
    headline,
    headline_pair,
    headline_rows,
    is_lossy,
    left_out,
    load_text,
    metric_view,
    one_run_per_point,
    select_lossy,
    waste_table,
    with_goodput,
    with_labels,
)
from dspark_sim.sim.sweep import load_results

PALETTE = qualitative.Plotly + qualitative.D3
HOVER_COLS = (("load_kind", "load", "{}"), ("spec_decode_acceptance_length", "tau", "{:.2f}"),
              ("mean_verify_tokens_per_request_step", "verify/request-step", "{:.2f}"),
              ("verification_waste", "waste", "{:.1%}"), ("median_tpot_ms", "median TPOT ms",
                                                          "{:.2f}"),
              ("median_ttft_ms", "median TTFT ms", "{:.0f}"),
              ("p90_ttft_ms", "p90 TTFT ms", "{:.0f}"),
              ("median_e2el_ms", "median E2E ms", "{:.0f}"),
              ("p90_e2el_ms", "p90 E2E ms", "{:.0f}"),
              ("mean_concurrency", "requests in system", "{:.1f}"),
              ("mean_decode_batch", "decode batch", "{:.1f}"),
              ("whole_median_interactivity", "whole run: interactivity", "{:.1f}"),
              ("whole_output_throughput_per_gpu", "whole run: tok/s/GPU", "{:,.0f}"),
              ("output_throughput_per_gpu_incl_prefill", "tok/s per GPU, decode + prefill",
               "{:,.0f}"),
              ("steady_window_s", "steady window s", "{:.1f}"),
              ("steady_window_requests", "requests in window", "{}"),
              ("steady_window_note", "window", "{}"),
              ("confidences", "confidences", "{}"),
              ("stable", "stable", "{}"), ("seed", "seed", "{}"), ("point_id", "point", "{}"))
SIMULATED_ONLY = "simulated only"  # the label of a policy the measured drafter cannot run


# -- vLLM bench serve results ------------------------------------------------------------
def check_overlay(vllm_results: Path | None, gpus: int | None) -> None:
    """``--gpus`` and the vLLM result files, read before any sweep point runs."""
    if gpus is not None and gpus < 1:
        raise InputError("--gpus", f"must be a positive integer, got {gpus}")
    if vllm_results is not None:
        read_vllm_results(vllm_results, gpus)


def read_vllm_results(path: str | Path, gpus: int | None = None) -> pl.DataFrame:
    """Read vLLM ``bench serve --save-result`` JSON files (a folder, searched
    recursively, or one file) into rows ``label, file, interactivity, throughput_per_gpu,
    output_throughput, num_gpus, max_concurrency, request_rate``.

    Interactivity = 1000 / ``median_tpot_ms`` (else ``median_itl_ms``). Per-GPU
    throughput divides ``output_throughput`` by the file's ``num_gpus`` field, else by
    ``gpus``; neither is an error. The label is the file's ``label``/``policy`` field
    (``--metadata policy=...``), else its folder name.
    """
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*.json") if f.is_file())  # a folder named x.json
    elif p.is_file():
        files = [p]
    else:
        raise InputError("--vllm-results", f"{p}: {not_a_file(p, 'result file or folder')}")
    if not files:
        raise InputError("--vllm-results", f"{p}: no .json result files")
    rows = []
    for f in files:
        try:
            d = loads_bench_serve_json(f.read_text(encoding="utf-8-sig"), str(f))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InputError(str(f), f"not a JSON file ({exc})") from exc
        except OSError as exc:
            raise InputError(str(f), f"cannot read ({exc.strerror or exc})") from None
        if not isinstance(d, dict) or "output_throughput" not in d:
            raise InputError(str(f), "not a vLLM bench serve result (no output_throughput)")
        out_tps = _result_number(f, d, "output_throughput", low=0.0)
        tpot = (_result_number(f, d, "median_tpot_ms", low=0.0, optional=True)
                or _result_number(f, d, "median_itl_ms", low=0.0, optional=True))
        if not tpot:
            raise InputError(str(f), "needs median_tpot_ms or median_itl_ms > 0")
        if not math.isfinite(1000.0 / tpot):  # 1e-320 ms: an infinite interactivity point
            key = "median_tpot_ms" if d.get("median_tpot_ms") else "median_itl_ms"
            raise InputError(str(f), f"'{key}' {tpot!r} is too small: 1000 / it (the "
                                     "interactivity) is not a finite number")
        n = _result_number(f, d, "num_gpus", low=0, integer=True, optional=True) or gpus
        if not n or int(n) < 1:
            raise InputError("--gpus", f"{f}: per-GPU throughput needs --gpus N or a "
                                       "'num_gpus' field in the result file")
        rate = d.get("request_rate")
        rows.append({
            "label": str(d.get("label") or d.get("policy") or f.parent.name or "vLLM"),
            "file": str(f),
            "interactivity": 1000.0 / tpot,
            "throughput_per_gpu": out_tps / int(n),
            "output_throughput": out_tps,
            "num_gpus": int(n),
            "max_concurrency": _result_number(f, d, "max_concurrency", low=1, integer=True,
                                              optional=True),
            # "inf" (bench serve's unthrottled rate) or any other text: no rate to plot
            "request_rate": None if rate is None or isinstance(rate, str) else
            _result_number(f, d, "request_rate", low=0.0),
        })
    return pl.DataFrame(rows, schema={"label": pl.Utf8, "file": pl.Utf8,
                                      "interactivity": pl.Float64,
                                      "throughput_per_gpu": pl.Float64,
                                      "output_throughput": pl.Float64, "num_gpus": pl.Int64,
                                      "max_concurrency": pl.Int64, "request_rate": pl.Float64})


def _result_number(f: Path, d: dict, key: str, *, low: float, integer: bool = False,
                   optional: bool = False) -> float | int | None:
    """Field ``key`` of result file ``f``: a finite number >= ``low`` (``integer``: a whole
    one below 2**63, the column's type), or None where ``optional`` and absent/null. Any
    other value is refused naming the file and the field (``float("abc")`` or ``int(inf)``
    would end in a traceback)."""
    v = d.get(key)
    if v is None and optional:
        return None
    ok = isinstance(v, int | float) and not isinstance(v, bool) and low <= v < 2**63
    if ok and integer:
        ok = float(v).is_integer()
    if not ok:
        kind = "a whole number" if integer else "a number"
        raise InputError(str(f), f"'{key}' must be {kind} in [{low:g}, 2**63), got {v!r}")
    return int(v) if integer else float(v)


# -- figures -----------------------------------------------------------------------------
def _fmt(v, f: str) -> str:
    if v is None or (isinstance(v, float) and not np.isfinite(v)):
        return "-"
    try:
        return f.format(v)
    except (ValueError, TypeError):
        return str(v)


def _hover(row: dict) -> str:
    lossy = bool(row.get("lossy"))
    lines = [f"<b>{'LOSSY ' if lossy else ''}{html.escape(str(row.get('policy')))}</b>",
             f"interactivity {_fmt(row.get(X), '{:.1f}')} tok/s/user",
             f"throughput {_fmt(row.get(Y), '{:,.0f}')} tok/s/GPU"]
    if row.get("engine_can_run") is False:
        note = str(row.get("engine_note") or "the measured drafter cannot run it")
        lines.append(f"<b>{SIMULATED_ONLY.upper()}</b>: "
                     + "<br>".join(html.escape(x) for x in textwrap.wrap(note, 80)))
    for col, name, f in HOVER_COLS + (LOSSY_HOVER_COLS if lossy else ()):
        if col in row:
            lines.append(f"{name}: {_fmt(row[col], f)}")
    return "<br>".join(lines)


LOSSY_HOVER_COLS = (("changed_token_fraction", "LOSSY changed tokens", "{:.2%}"),
                    ("changed_requests", "requests with a change", "{:.0f}"),
                    ("task_score_greedy", "task score, greedy", "{:.1%}"),
                    ("task_score_low", "task score, low bound", "{:.1%}"),
                    ("task_score_high", "task score, high bound", "{:.1%}"))


def _colors(labels: Sequence[str]) -> dict[str, str]:
    pols = list(dict.fromkeys(label.split(" | ")[0] for label in labels))
    by_pol = {p: PALETTE[i % len(PALETTE)] for i, p in enumerate(pols)}
    out = {}
    for i, label in enumerate(labels):
        pol = label.split(" | ")[0]
        out[label] = by_pol[pol] if len(labels) == len(pols) else PALETTE[i % len(PALETTE)]
    return out


# A plot title is one line that plotly cuts at the figure's edge; at a desktop width
# (about 1,140 px of plot at 17 px type, ~7.4 px a character) 150 characters show. The
# lines kept below this leave room for a narrower window.
TITLE_CHARS = 100
# Measured points: star shapes no sweep point uses, in colours no policy line uses
# (PALETTE's), so a measured label never reads as the simulated policy of the same colour
VLLM_SYMBOLS = ("star", "star-square", "star-diamond", "star-triangle-up", "hexagram")
MEASURED_COLORS = tuple(c for c in ("#111111", "#7a0177", "#b8860b", "#006d2c", "#08306b",
                                    "#67000d", "#525252", "#00688b")
                        if c.lower() not in {p.lower() for p in PALETTE})


def _symbol(row: dict) -> str:
    """circle (lossless) or diamond (lossy); x = unstable, open = short window."""
    if not bool(row.get("stable", True)):
        return "x-open"
    shape = "diamond" if row.get("lossy") else "circle"
    return f"{shape}-open" if row.get("steady_window_short") else shape


def fronts_figure(df: pl.DataFrame, *, policies: Sequence[str] | None = None,
                  tiers: Sequence[float] = DEFAULT_TIERS, stable_only: bool = True,
                  vllm: pl.DataFrame | None = None, title: str = "",
                  basis: str = "steady", y: str = Y) -> go.Figure:
    """Sweep points (markers) and Pareto fronts (lines), one legend group per policy.
    ``y``: the throughput axis, :data:`~dspark_sim.sim.frontier.Y` (tok/s per decode GPU)
    or :data:`~dspark_sim.sim.frontier.GOODPUT_Y` (the same, of the requests meeting the
    SLOs: ``df`` from :func:`~dspark_sim.sim.frontier.with_goodput`)."""
    df = metric_view(df, basis)
    fronts = compute_fronts(df, policies=policies, stable_only=stable_only, seeds="all", y=y)
    # lossy policies: their own marker (diamond), dashed fronts, labelled LOSSY; never
    # merged into a lossless front
    lossy = compute_fronts(df, policies=policies, stable_only=stable_only, seeds="all",
                           lossy=True, y=y)
    colors = _colors(list(fronts) + list(lossy))
    fig = go.Figure()
    for kind, group in ((False, fronts), (True, lossy)):
        labelled = with_labels(select_lossy(df, kind), with_labels_context(df))
        for label, fr in group.items():
            c = colors[label]
            name = f"LOSSY {label}" if kind else label
            pts = labelled.filter((pl.col("front_label") == label) & pl.col(X).is_not_null()
                                  & pl.col(y).is_not_null())
            rows = pts.to_dicts()
            if any(r.get("engine_can_run") is False for r in rows):
                name += f" ({SIMULATED_ONLY})"
            fig.add_trace(go.Scatter(
                x=pts[X].to_list(), y=pts[y].to_list(), mode="markers",
                name=f"{name} points", legendgroup=name, showlegend=False,
                marker={"color": c, "size": 10 if kind else 8, "opacity": 0.75,
                        "symbol": [_symbol(r) for r in rows]},
                hovertext=[_hover(r) for r in rows], hoverinfo="text"))
            fig.add_trace(go.Scatter(
                x=fr.x.tolist(), y=fr.y.tolist(), mode="lines", name=name, legendgroup=name,
                line={"color": c, "width": 2.5, "dash": "dash" if kind else "solid"},
                hoverinfo="skip"))
    has_vllm = vllm is not None and vllm.height > 0 and y == Y
    if has_vllm:
        for i, (lab, g) in enumerate(vllm.group_by("label", maintain_order=True)):
            lab = lab[0] if isinstance(lab, tuple) else lab
            name = f"vLLM measured: {lab}"
            fig.add_trace(go.Scatter(
                x=g["interactivity"].to_list(), y=g["throughput_per_gpu"].to_list(),
                mode="markers", name=name, legendgroup=name,
                marker={"symbol": VLLM_SYMBOLS[i % len(VLLM_SYMBOLS)], "size": 14,
                        "color": MEASURED_COLORS[i % len(MEASURED_COLORS)],
                        "line": {"width": 1.5, "color": "white"}},
                hovertext=[f"<b>{html.escape(name)}</b><br>{html.escape(Path(f).name)}<br>"
                           f"interactivity {x:.1f} tok/s/user<br>throughput {y:,.0f} tok/s/GPU"
                           f"<br>concurrency {mc} rate {rr}"
                           for f, x, y, mc, rr in g.select("file", "interactivity",
                                                           "throughput_per_gpu",
                                                           "max_concurrency",
                                                           "request_rate").iter_rows()],
                hoverinfo="text"))
    for i, t in enumerate(sorted(tiers)):  # labels to alternate sides: close tiers' overlap
        fig.add_vline(x=float(t), line_dash="dash", line_color="grey",
                      annotation_text=f"SLA {t:g} tok/s/user",
                      annotation_position="top left" if i % 2 == 0 else "top right")
    key = marker_key(lossy=bool(lossy), vllm=has_vllm)
    fig.add_annotation(text="<br>".join(textwrap.wrap(key, TITLE_CHARS)), xref="paper",
                       yref="paper", x=0, y=-0.14, xanchor="left", yanchor="top",
                       align="left", showarrow=False, font={"size": 12, "color": "#555"})
    fig.update_layout(
        title=title or f"Throughput vs interactivity, {BASIS_TEXT[basis_used(df, basis)]}",
        xaxis_title="median interactivity (tok/s/user = 1000 / TPOT ms)",
        yaxis_title="output throughput (tok/s/GPU)" if y == Y else
        "goodput: output tok/s/GPU of the requests meeting the SLOs", hovermode="closest", height=650,
        margin={"b": 150}, legend={"groupclick": "togglegroup"}, template="plotly_white")
    return fig


def marker_key(*, lossy: bool, vllm: bool) -> str:
    """What the front plot's shapes mean, naming only the kinds it draws."""
    key = ("Markers: sweep points (circle: stable; x: unstable, left off the fronts; open: "
           "steady window flagged short). Lines: Pareto fronts.")
    if lossy:
        key += " Diamonds and dashed fronts: LOSSY policies."
    if vllm:
        key += (" Stars (in dark colours no policy line uses): measured vLLM bench serve "
                "points.")
    return key


def with_labels_context(df: pl.DataFrame) -> list[str]:
    """The context columns the whole sweep varies (labels agree across both kinds)."""
    return [c for c in CONTEXT if c in df.columns and df[c].n_unique() > 1]


def lossy_figure(df: pl.DataFrame, *, policies: Sequence[str] | None = None,
                 basis: str = "steady") -> go.Figure:
    """The lossy axis: each lossy point's throughput against its quality cost (the
    fraction of emitted tokens that differ from the target's greedy output), the
    task-score bounds in the hover. Lossless points sit at 0 % for reference."""
    d = metric_view(df, basis).filter(pl.col(Y).is_not_null())
    if policies:
        d = d.filter(pl.col("policy").is_in([canonical_policy(p) for p in policies]))
    if "changed_token_fraction" not in d.columns:
        d = d.with_columns(pl.lit(0.0).alias("changed_token_fraction"))
    fig = go.Figure()
    pols = list(dict.fromkeys(d["policy"].to_list()))
    for i, pol in enumerate(pols):
        g = d.filter(pl.col("policy") == pol)
        rows = g.to_dicts()
        lossy = bool(rows and rows[0].get("lossy"))
        fig.add_trace(go.Scatter(
            x=[100 * (r.get("changed_token_fraction") or 0.0) for r in rows],
            y=g[Y].to_list(), mode="markers", name=f"LOSSY {pol}" if lossy else pol,
            marker={"color": PALETTE[i % len(PALETTE)], "size": 10 if lossy else 7,
                    "symbol": [_symbol(r) for r in rows], "opacity": 0.8},
            hovertext=[_hover(r) for r in rows], hoverinfo="text"))
    fig.update_layout(height=450, template="plotly_white",
                      title="Lossy axis: throughput against the tokens changed from the "
                            "target's greedy output (not comparable as lossless)",
                      xaxis_title="changed tokens (% of emitted)",
                      yaxis_title="output throughput (tok/s/GPU)")
    return fig


def _two_rows_by_concurrency(df: pl.DataFrame, policies: Sequence[str] | None, basis: str,
                             subplot_titles: tuple[str, str]):
    """A two-row figure sharing the concurrency axis, and per policy (in the table's order,
    ``policies`` only when given) its colour and its points with a concurrency, in load
    order: what the budget and latency figures plot."""
    t = budget_table(df, basis)
    if policies:
        t = t.filter(pl.col("policy").is_in([canonical_policy(p) for p in policies]))
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=subplot_titles)
    pols = list(dict.fromkeys(t["policy"].to_list()))
    groups = [(pol, PALETTE[i % len(PALETTE)],
               t.filter((pl.col("policy") == pol) & pl.col("concurrency_x").is_not_null())
               .sort("concurrency_x")) for i, pol in enumerate(pols)]
    return fig, groups


def _concurrency_layout(fig: go.Figure, open_loop_x: str, height: int, title: str) -> go.Figure:
    fig.update_xaxes(title_text=f"concurrent requests (closed loop: clients; open loop: "
                                f"{open_loop_x})", row=2, col=1)
    fig.update_layout(height=height, template="plotly_white", title=title,
                      legend={"groupclick": "togglegroup"})
    return fig


def budget_figure(df: pl.DataFrame, *, policies: Sequence[str] | None = None,
                  basis: str = "steady") -> go.Figure:
    """Fig. 8: throughput (top) and verification budget per request (bottom) vs
    concurrency."""
    fig, groups = _two_rows_by_concurrency(
        df, policies, basis, ("throughput vs concurrency",
                              "verification budget per request (tokens verified per "
                              "request-step, bonus included; MTP-1 = 2)"))
    for pol, c, g in groups:
        fig.add_trace(go.Scatter(x=g["concurrency_x"].to_list(),
                                 y=g["output_throughput_per_gpu"].to_list(),
                                 mode="lines+markers", name=pol, legendgroup=pol,
                                 line={"color": c}), row=1, col=1)
        fig.add_trace(go.Scatter(x=g["concurrency_x"].to_list(),
                                 y=g["mean_verify_tokens_per_request_step"].to_list(),
                                 mode="lines+markers", name=pol, legendgroup=pol,
                                 showlegend=False, line={"color": c}), row=2, col=1)
    fig.update_yaxes(title_text="tok/s/GPU", row=1, col=1)
    fig.update_yaxes(title_text="tokens / request-step", row=2, col=1)
    return _concurrency_layout(fig, "Little's-law mean", 700,
                               "Load-adaptive verification budget (DSpark Fig. 8 view)")


# one shape per policy in the latency plot (no diamond, x or star: those mean lossy,
# unstable and measured in the front plot)
LATENCY_SYMBOLS = ("circle", "square", "triangle-up", "triangle-down", "pentagon", "hexagon",
                   "cross", "triangle-left", "triangle-right", "hourglass")


def _series(g: pl.DataFrame, name: str) -> tuple[np.ndarray, np.ndarray]:
    return (np.asarray(g["concurrency_x"].to_list(), dtype=np.float64),
            np.asarray(g[name].to_list(), dtype=np.float64))  # null -> nan


def coincident(groups, name: str) -> list[list[str]]:
    """The sets (two or more policies, in plot order) whose ``name`` series match within
    0.1 % at every load both have (two at least): drawn over each other they look like
    one line, as every policy's TTFT does where prefill never queues."""
    series = {pol: _series(g, name) for pol, _c, g in groups if name in g.columns and g.height}

    def same(a, b) -> bool:
        (xa, ya), (xb, yb) = series[a], series[b]
        common, ia, ib = np.intersect1d(xa, xb, return_indices=True)
        return common.size >= 2 and np.allclose(ya[ia], yb[ib], rtol=1e-3, equal_nan=True)

    sets, seen = [], set()
    for a in series:
        if a not in seen:
            group = [a] + [b for b in series if b != a and b not in seen and same(a, b)]
            seen.update(group)
            if len(group) > 1:
                sets.append(group)
    return sets


def _who(group: list[str], everyone: list[str]) -> str:
    """A set of policies in few words: all of them, all but a few, or their names."""
    rest = [p for p in everyone if p not in group]
    if not rest:
        return f"all {len(group)} policies"
    return f"all but {', '.join(rest)}" if len(rest) < len(group) - 1 else " = ".join(group)


def _coincidence_note(sets: dict[str, list[list[str]]], room: int,
                      everyone: list[str] | None = None) -> str:
    """'median and p90: a = b coincide' for a subplot title; the counts alone where the
    words would not fit in ``room`` characters."""
    for short in (False, True):
        by_text: dict[str, list[str]] = {}
        for q, groups in sets.items():
            for group in groups:
                text = (f"{len(group)} policies" if short else
                        _who(group, everyone) if everyone else " = ".join(group))
                by_text.setdefault(text, []).append(q)
        note = "; ".join(f"{' and '.join(qs)}: {t} coincide" for t, qs in by_text.items())
        if len(note) <= room:
            break
    return note


def latency_figure(df: pl.DataFrame, *, policies: Sequence[str] | None = None,
                   basis: str = "steady") -> go.Figure:
    """Queueing made visible: median (solid) and p90 (dotted) TTFT and E2E latency
    against concurrency. TPOT, and so interactivity, excludes the wait for admission;
    these do not. Lines that coincide are drawn widest first, so each shows as a band
    round the next, and the subplot's title names them."""
    fig, groups = _two_rows_by_concurrency(
        df, policies, basis, ("time to first token (ms)", "end-to-end latency (ms)"))
    for row, col in ((1, "ttft_ms"), (2, "e2el_ms")):
        sets = {q: coincident(groups, f"{q}_{col}") for q in ("median", "p90")}
        for q, dash in (("median", "solid"), ("p90", "dot")):
            name = f"{q}_{col}"
            under = {pol: len(s) - 1 - s.index(pol) for s in sets[q] for pol in s}
            for i, (pol, c, g) in enumerate(groups):
                if name not in g.columns:
                    continue
                k = under.get(pol, 0)  # how many coinciding lines this one lies under
                fig.add_trace(go.Scatter(
                    x=g["concurrency_x"].to_list(), y=g[name].to_list(), mode="lines+markers",
                    name=pol if q == "median" else f"{pol} (p90)", legendgroup=pol,
                    showlegend=row == 1 and q == "median",
                    line={"color": c, "dash": dash, "width": 2 + 2.5 * k},
                    marker={"symbol": LATENCY_SYMBOLS[i % len(LATENCY_SYMBOLS)],
                            "size": 7 + 3 * k},
                    hovertemplate=f"{pol}<br>concurrency %{{x:.1f}}<br>{q} {col.split('_')[0]} "
                                  "%{y:,.0f} ms<extra></extra>"), row=row, col=1)
        title = fig.layout.annotations[row - 1]
        note = _coincidence_note(sets, TITLE_CHARS - len(title.text) - 2,
                                 [pol for pol, _c, _g in groups])
        if note:
            title.text = f"{title.text}; {note}"
    fig.update_yaxes(type="log", title_text="ms")
    fig.update_layout(legend_itemsizing="constant")  # not the banded lines' wide markers
    return _concurrency_layout(fig, "mean requests in the system", 650,
                               "Queueing: TTFT and E2E vs load (solid: median, dotted: p90)")


def waste_figure(df: pl.DataFrame, *, policies: Sequence[str] | None = None,
                 basis: str = "steady") -> go.Figure:
    """Verification waste (rejected / verified draft tokens) against load."""
    t = waste_table(df, basis)
    if policies:
        t = t.filter(pl.col("policy").is_in([canonical_policy(p) for p in policies]))
    kinds = list(dict.fromkeys(t["load_kind"].to_list())) or ["qps"]
    fig = make_subplots(rows=1, cols=len(kinds), subplot_titles=[
        {"qps": "open loop (req/s)", "concurrency": "closed loop (clients)"}.get(k, k)
        for k in kinds])
    pols = list(dict.fromkeys(t["policy"].to_list()))
    for j, kind in enumerate(kinds):
        for i, pol in enumerate(pols):
            g = t.filter((pl.col("policy") == pol) & (pl.col("load_kind") == kind)).sort("load")
            fig.add_trace(go.Scatter(
                x=g["load"].to_list(), y=g["verification_waste"].to_list(),
                mode="lines+markers", name=pol, legendgroup=pol, showlegend=j == 0,
                line={"color": PALETTE[i % len(PALETTE)]},
                customdata=g["mean_verify_tokens_per_request_step"].to_list(),
                hovertemplate=f"{pol}<br>load %{{x}}<br>waste %{{y:.1%}}<br>verify/request-step "
                              "%{customdata:.2f}<extra></extra>"), row=1, col=j + 1)
        fig.update_xaxes(title_text=kind, row=1, col=j + 1)
    fig.update_yaxes(title_text="rejected / verified draft tokens", tickformat=".0%")
    fig.update_layout(height=450, template="plotly_white", title="Verification waste vs load",
                      legend={"groupclick": "togglegroup"})
    return fig


def _table_html(rows: list[dict], cols: Sequence[str] | None = None) -> str:
    if not rows:
        return "<p>(none)</p>"
    cols = list(cols or rows[0].keys())
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(r.get(c, '')))}</td>" for c in cols)
                   + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _fronts_rows(df: pl.DataFrame, policies, stable_only, basis) -> list[dict]:
    """Each front's points with the load that gave them (seeds averaged)."""
    rows = []
    for kind in (False, True):
        for label, fr in compute_fronts(df, policies=policies, stable_only=stable_only,
                                        basis=basis, lossy=kind).items():
            loads = (fr.points.select("load_kind", "load").rows()
                     if {"load_kind", "load"} <= set(fr.points.columns) else [])
            # disaggregated prefill: the same tokens over the prefill GPUs too (docs/frontiers.md)
            incl = (fr.points[Y_INCL_PREFILL].to_list()
                    if Y_INCL_PREFILL in fr.points.columns else [])
            for i, (x, y) in enumerate(zip(fr.x, fr.y, strict=True)):
                row = {"front": f"LOSSY {label}" if kind else label,
                       "load": load_text(*loads[i]) if loads else "-",
                       "interactivity (tok/s/user)": f"{x:.1f}",
                       "throughput per decode GPU (tok/s/GPU)": f"{y:,.0f}"}
                if any(v is not None for v in incl):
                    row["per GPU, decode + prefill (tok/s/GPU)"] = _fmt(incl[i], "{:,.0f}")
                rows.append(row)
    return rows


def _left_out_rows(df: pl.DataFrame, policies, stable_only, basis) -> list[dict]:
    """Every point no front uses, with why and what would keep it."""
    return [{"front": r["front_label"], "load": load_text(r["load_kind"], r["load"]),
             "seed": r["seed"], "reason": r["reason"], "detail": r["detail"],
             "remedy": r["remedy"]}
            for r in left_out(df, policies=policies, stable_only=stable_only,
                              basis=basis).iter_rows(named=True)]


LOSSY_SECTION = """<h2>Lossy axis</h2>
<p class="note">Lossy policies (diamonds, dashed fronts, labelled LOSSY) emit tokens that may
differ from the target's greedy output: their throughput is bought with quality and is never
part of a lossless front. Here: throughput against the fraction of changed tokens; the hover
gives the task-score bounds (requests with no changed token keep their label exactly; a
changed one counts wrong for the low bound, keeps its label for the high). See
docs/lossy.md.</p>
{div}"""

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;
max-width:1200px;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:0.9em}
td,th{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f3f3f3} .note{color:#555;font-size:0.9em}
"""


def _headline_parts(df: pl.DataFrame, candidate: str | None, baseline: str | None, tiers,
                    stable_only: bool, basis: str) -> tuple[str, str]:
    """The headline table as HTML and as markdown (kept in the page as a comment), or a
    note naming what is missing when the sweep lacks the candidate or the baseline (the
    sides not given are :func:`headline_pair`'s)."""
    cand, base, missing = headline_pair(df["policy"].to_list(), candidate, baseline)
    if missing is None:
        h = headline(df, candidate=cand, baseline=base, tiers=tiers, stable_only=stable_only,
                     basis=basis)
        rows = headline_rows(h)
        cols = ["context", "metric", "value"] if any(r["context"] for r in rows) else [
            "metric", "value"]  # one context: no column of empty cells
        return _table_html(rows, cols), format_headline(h)
    return (f"<p>No headline comparison: {html.escape(missing)}.</p>"), ""


GOODPUT_SECTION = """<h2>Goodput vs interactivity</h2>
<p class="note">Goodput: the output tokens per second (per decode GPU) of the requests that
meet every SLO ({slo}), judged on each point's steady latency sample. A policy that serves
more tokens by making its requests wait past the TTFT SLO loses them here.</p>
{div}"""


def _answer_parts(df: pl.DataFrame, slo: Slo, basis: str) -> tuple[str, str]:
    """The per-load answer as HTML (with a note on how to read it) and as markdown."""
    rows = answer(df, slo=slo, basis=basis)
    if not rows:
        return "<p>(no loads)</p>", ""
    note = ("<p class=\"note\">One row per load: the policy to deploy, ranked on goodput "
            f"under the SLOs ({html.escape(slo.text())})" if slo.given else
            "<p class=\"note\">One row per load: the policy to deploy, ranked on throughput "
            "per GPU in a closed loop and on median interactivity in an open loop (every "
            "stable policy serves an open loop's rate; give --slo to rank on goodput)")
    note += (". ± is the 95 % confidence interval: over the seeds of a point when it ran "
             "several (--seeds), else the run's own batch-means error. A runner-up inside "
             "the interval is a tie, with how many seeds or requests would settle it. "
             "Unstable and lossy policies do not compete; a policy the deployment's "
             "measured drafter cannot run is not recommended while one it can run holds "
             "the load, and is named where it would rank higher.</p>")
    html_out, md = _table_html(answer_rows(rows)) + note, format_answer(rows)
    cache = by_prefix_cache_rows(by_prefix_cache(rows))
    if cache:  # the sweep ran each point with the prefix cache on and off
        html_out += ("<h3>Prefix cache on vs off</h3>" + _table_html(cache)
                     + "<p class=\"note\">Per load, the policies that hold it, best first, "
                     "with the prefix cache on and off (sweep --prefix-cache on,off), and the "
                     "best's gain over none on the figure the answer ranks on.</p>")
        md += "\n\nPrefix cache on vs off\n\n" + _markdown(cache)
    return html_out, md


def _markdown(table: list[dict[str, str]]) -> str:
    cols = list(table[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return "\n".join(lines + ["| " + " | ".join(r[c] for c in cols) + " |" for r in table])


def engine_rows(df: pl.DataFrame) -> list[dict]:
    """Per policy (and trace, where the sweep has several): where its confidences came
    from and whether the deployment's measured drafter can run it, with why."""
    if "engine_can_run" not in df.columns and "confidences" not in df.columns:
        return []
    keys = ["policy"] + (["trace_spec"] if "trace_spec" in df.columns
                         and df["trace_spec"].n_unique() > 1 else [])
    out = []
    for _, g in df.group_by(keys, maintain_order=True):
        r = g.row(0, named=True)
        can = g["engine_can_run"].to_list() if "engine_can_run" in g.columns else [None]
        runs = "-" if all(v is None for v in can) else (
            "yes" if all(v is not False for v in can) else f"no: {SIMULATED_ONLY}")
        conf = [v for v in dict.fromkeys(g["confidences"].to_list())
                if v is not None] if "confidences" in g.columns else []
        row = {"policy": r["policy"]}
        if len(keys) > 1:
            row["trace"] = r.get("trace_spec") or "default"
        row |= {"confidences": "; ".join(map(str, conf)) or "none read",
                "runs in the deployment's engine": runs,
                "note": r.get("engine_note") or ""}
        out.append(row)
    return out


ENGINE_SECTION = """<h2 id="engine">Policies and the measured drafter</h2>
<p class="note">Where each policy's drafter confidences come from, and whether the
deployment's measured drafter can run it in its engine. A policy marked "{label}" is
simulated with that drafter's acceptances but cannot be deployed with it as it is (an
n-gram drafter has no confidence head; vLLM's adaptive verification needs its own drafter
method): its figures say what it would gain, not what the deployment can serve today.</p>
{table}"""


def _superseded_rows(superseded: pl.DataFrame) -> list[dict]:
    """The reruns :func:`one_run_per_point` left out, as rows of the left-off table."""
    return [{"front": r.get("policy"), "load": load_text(r.get("load_kind"), r.get("load")),
             "seed": r.get("seed"), "reason": r["reason"], "detail": r["detail"],
             "remedy": "none needed: the rerun is drawn; delete its points/ file to draw "
                       "this one"}
            for r in superseded.iter_rows(named=True)]


def _context_rows(df: pl.DataFrame) -> list[dict]:
    """The configuration table: each context column's distinct values, in sweep order."""
    ctx = []
    for col in ("deployment", "workload", "profile", "trace"):
        if col in df.columns:
            vals = [str(v) for v in dict.fromkeys(df[col].to_list()) if v is not None]
            ctx.append({"field": col, "values": "; ".join(vals)})
    return ctx


def _points_note(df: pl.DataFrame, left: list[dict], superseded: int = 0) -> str:
    """How many points the page has, and how many of them no front uses."""
    n_unstable = int((~df["stable"].fill_null(False)).sum()) if "stable" in df.columns else 0
    n_short = (int(df["steady_window_short"].fill_null(False).sum())
               if "steady_window_short" in df.columns else 0)
    again = (f" and {superseded} superseded by a rerun of the same policy, load and seed "
             "(listed with the points left off)" if superseded else "")
    return (f"{df.height + superseded} sweep points in all{again}; of the {df.height} drawn, "
            f"{n_unstable} unstable, drawn as x and left out of the "
            f"fronts; {n_short} with a steady-state window flagged short, drawn open: run more "
            f"requests; {len(left)} left off the fronts in all, each listed with why under "
            f'"Points left off the fronts"')


def _tables_html(df: pl.DataFrame, policies, stable_only: bool, basis: str,
                 left: list[dict]) -> str:
    """The closing tables: the front points with their loads, every point left off the
    fronts with why, and the configuration."""
    return f"""<h2>Front points</h2>
{_table_html(_fronts_rows(df, policies, stable_only, basis))}
<h2>Points left off the fronts</h2>
<p class="note">Points no front could use: no steady window or too few requests in it (its
figures are missing: run more requests per point), or unstable (the policy falls behind that
load).</p>
{_table_html(left)}
<h2>Configuration</h2>
{_table_html(_context_rows(df))}"""


def _report_figures(df: pl.DataFrame, policies, tiers, stable_only: bool, basis: str,
                    slo: Slo, vllm_results, gpus: int | None) -> tuple[list[str], bool]:
    """The report's figures as HTML divs in page order (fronts, budget, latency, waste,
    then lossy and goodput where they apply; plotly.js with the first), and whether the
    lossy one is among them. ``vllm_results``: measured runs drawn on the fronts."""
    vllm = read_vllm_results(vllm_results, gpus) if vllm_results else None
    figs = [fronts_figure(df, policies=policies, tiers=tiers, stable_only=stable_only,
                          vllm=vllm, basis=basis),
            budget_figure(df, policies=policies, basis=basis),
            latency_figure(df, policies=policies, basis=basis),
            waste_figure(df, policies=policies, basis=basis)]
    has_lossy = bool(df.select(is_lossy(df).any()).item())
    if has_lossy:
        figs.append(lossy_figure(df, policies=policies, basis=basis))
    if slo.given:
        figs.append(fronts_figure(df, policies=policies, tiers=tiers, stable_only=stable_only,
                                  basis=basis, y=GOODPUT_Y, title=(
                                      f"Goodput vs interactivity, {slo.text()}")))
    return [pio.to_html(f, include_plotlyjs=(i == 0), full_html=False,
                        config={"displaylogo": False}) for i, f in enumerate(figs)], has_lossy


def build_report(results: pl.DataFrame | str | Path, out: str | Path, *,
                 policies: Sequence[str] | None = None, candidate: str | None = None,
                 baseline: str | None = None, tiers: Sequence[float] | None = None,
                 vllm_results: str | Path | None = None, gpus: int | None = None,
                 stable_only: bool = True, title: str = "dspark-sim frontiers",
                 basis: str = "steady", slo: Slo | None = None) -> Path:
    """Write the HTML report to ``out`` (a ``.html`` file, or a folder: ``out/report.html``).

    ``results``: a frame from :func:`run_sweep`, a sweep folder or a results.parquet.
    ``policies`` restricts (and orders) the policies shown; ``candidate``/``baseline``
    are compared in the headline table (default: ``frontier.headline_pair``'s, the run's
    default policy against mtp1 or the sweep's one other policy; a note says so when a
    side is absent). ``basis``: ``"steady"`` (default) or ``"whole"``-run figures.
    ``tiers``: the SLA lines (tok/s/user; None: :func:`~dspark_sim.sim.frontier.default_tiers`,
    inside the data's range). ``slo``: goodput's SLOs (a column of the per-load answer,
    and a front of its own).

    The page opens with the per-load answer (:func:`~dspark_sim.sim.frontier.answer`).
    Every point of ``results`` is drawn, except a rerun of one policy, load and seed
    (:func:`~dspark_sim.sim.frontier.one_run_per_point`): the run with the most requests
    is drawn, and the others are listed as superseded.
    """
    df = results if isinstance(results, pl.DataFrame) else load_results(results)
    if df.height == 0:
        raise InputError("results", "no sweep points to report")
    slo = slo or Slo()
    df, superseded = one_run_per_point(df)
    used = basis_used(df, basis)
    df = with_goodput(metric_view(df, basis), slo, basis)
    if tiers is None:
        tiers = default_tiers(df, basis)
    out = Path(out)
    if out.suffix.lower() not in (".html", ".htm"):
        out = out / "report.html"
    divs, has_lossy = _report_figures(df, policies, tiers, stable_only, basis, slo, vllm_results, gpus)
    head_html, head_md = _headline_parts(df, candidate, baseline, tiers, stable_only, basis)
    left = _left_out_rows(df, policies, stable_only, basis) + _superseded_rows(superseded)
    answer_html, answer_md = _answer_parts(df, slo, basis)
    engines = engine_rows(df)
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    doc = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{CSS}</style></head><body>
<h1>{html.escape(title)}</h1>
<p class="note">{_points_note(df, left, superseded.height)}, generated {stamp}. Figures: {html.escape(BASIS_TEXT[used])}. Click a legend
entry to hide or show a policy (points and front together).</p>
<h2 id="answer">Which policy at which load</h2>
{answer_html}
{ENGINE_SECTION.format(label=SIMULATED_ONLY, table=_table_html(engines)) if engines else ""}
<h2>Headline numbers</h2>
{head_html}
<p class="note">Matched-throughput gain: candidate's / baseline's interactivity at equal
tok/s/GPU, over the throughput range both fronts cover. Tier throughput: the front
interpolated at the tier; "infeasible" when a front never reaches it; "below sweep" when no
point of the policy fell to the tier (a lower bound, so the gain is marked &gt;= or &lt;=, and
with both sides below it no gain is given; the row says why the front stops: heavier loads
left off, listed below, or never swept).</p>
<h2>Throughput vs interactivity</h2>
{divs[0]}
{GOODPUT_SECTION.format(slo=html.escape(slo.text()), div=divs[-1]) if slo.given else ""}
<h2>Verification budget vs concurrency (Fig. 8)</h2>
{divs[1]}
<h2>Queueing: TTFT and E2E vs load</h2>
<p class="note">TPOT (and so interactivity) starts at the first token: a request waiting
for admission shows here, not on the front.</p>
{divs[2]}
<h2>Verification waste vs load</h2>
{divs[3]}
{LOSSY_SECTION.format(div=divs[4]) if has_lossy else ""}
{_tables_html(df, policies, stable_only, basis, left)}
<!-- answer (markdown)
{html.escape(answer_md)}
-->
<!-- headline (markdown)
{html.escape(head_md)}
-->
</body></html>
"""
    write_text_atomic(out, doc)
    return out


__all__ = ["budget_figure", "build_report", "fronts_figure", "latency_figure", "lossy_figure",
           "read_vllm_results", "waste_figure"]
