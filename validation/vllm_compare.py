"""Hold the simulator against recorded vLLM runs: calibrate on a stated subset, predict the
rest, and say how far off each prediction is.

:func:`compare` fits a profile and a trace (:func:`dspark_sim.validation.vllm_fit.fit_profile`)
to the runs the split names (``--fit``: by default the none runs at every load plus
``ngram-k3`` at the lightest and heaviest closed-loop load), then re-simulates *every*
run on its own workload and writes one table: measured against simulated output
throughput, median TPOT, median TTFT and acceptance length per (setting, load), each
marked ``fitted`` or ``held-out``. Its headline is the worst held-out error per figure;
below it, per load, the measured and the simulated best setting, the gain of the best
speculative setting over none (where speculation pays), and whether the simulator's pick
is vLLM's best or within 3 % of it (or, where the best was measured repeatedly, whether
the pick's median lies within the range of the best's repeats).

Repeats of a point (``vllm measure --rounds``) are one row: the median of each figure,
with the repeats' count and spread (relative half-range), and the run's noise floor
(:mod:`dspark_sim.validation.vllm_repeats`) in the headline.

Acceptance is not part of the split: every speculative setting, fitted or held out,
replays its own measured per-request trace where the folder has one
(:mod:`dspark_sim.validation.vllm_acceptance`), else the fitted runs' pooled counters, and
the table says which.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from dspark_sim.errors import InputError
from dspark_sim.sim.config import EngineConfig
from dspark_sim.validation.vllm_acceptance import setting_traces
from dspark_sim.validation.vllm_fit import (
    METRICS,
    BenchRun,
    FitResult,
    fit_profile,
    simulate_with_steps,
    workload_file,
)
from dspark_sim.validation.vllm_repeats import (
    constants_line,
    format_noise,
    group_points,
    noise_floor,
)
from dspark_sim.validation.vllm_steps import step_frame, step_markdown, step_rows

FIGURES = (*METRICS, "acceptance_length")
LABELS = {"output_throughput": "output tok/s", "median_tpot_ms": "median TPOT ms",
          "median_ttft_ms": "median TTFT ms", "acceptance_length": "tau"}
PICK_TOLERANCE = 0.03  # the simulator's pick may be this much below vLLM's best
# A held-out figure is within bounds when its relative error is at most this, or at most
# the point's own measured spread (its repeats' relative half-range) where that is wider:
# no model can be held closer than the measurement repeats itself.
BOUNDS = {"output_throughput": 0.10, "median_tpot_ms": 0.10, "median_ttft_ms": 0.20}


def default_split(runs: list[BenchRun]) -> str:
    """The none runs at every load, and the ``k = 3`` setting (else the middle ``k``) at
    the lightest and the heaviest closed-loop load."""
    spec = sorted({(r.k, r.setting) for r in runs if r.k})
    parts = ["none"] if any(r.k == 0 for r in runs) else []
    if spec:
        k, setting = next(((k, s) for k, s in spec if k == 3), spec[len(spec) // 2])
        loads = sorted(r.concurrency for r in runs if r.setting == setting and r.concurrency)
        parts += [f"{setting}@c{c}" for c in dict.fromkeys((loads[0], loads[-1]))] if loads \
            else [setting]
    return ",".join(parts)


def parse_split(spec: str, runs: list[BenchRun]) -> set[str]:
    """``none,ngram-k3@c1,ngram-k3@c16`` -> the fitted runs' names (``SETTING`` takes all
    of its loads, ``SETTING@cN`` / ``SETTING@rX`` one)."""
    names = {r.name for r in runs}
    settings = {r.setting for r in runs}
    chosen: set[str] = set()
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        if "@" in part:
            if part not in names:
                raise InputError("--fit", f"{part!r} is not a recorded run (runs: "
                                          f"{', '.join(sorted(names))})")
            chosen.add(part)
        elif part in settings:
            chosen |= {r.name for r in runs if r.setting == part}
        else:
            raise InputError("--fit", f"{part!r} is not a recorded setting (settings: "
                                      f"{', '.join(sorted(settings))})")
    if not chosen:
        raise InputError("--fit", "names no run")
    if chosen == names:
        raise InputError("--fit", "fits every run: hold some out to predict")
    return chosen


@dataclass(frozen=True, eq=False)
class Comparison:
    table: pl.DataFrame  # one row per (run, figure)
    regimes: pl.DataFrame  # one row per load
    fit: FitResult
    split: str
    noise: dict | None = None  # per figure, the median spread of repeated points
    # per speculative setting, where its acceptance came from; what stood in, as warnings
    acceptance: dict[str, str] | None = None
    warnings: tuple[str, ...] = ()
    # per point, its mean step at each decoding batch and with a prompt chunk, measured
    # and simulated (:mod:`dspark_sim.validation.vllm_steps`)
    steps: pl.DataFrame | None = None

    def against_bounds(self) -> pl.DataFrame:
        """The held-out figures that :data:`BOUNDS` covers, each with its bound, the
        allowance (the bound, or the point's spread where wider) and ``within``."""
        held = self.table.filter((pl.col("split") == "held-out")
                                 & pl.col("figure").is_in(list(BOUNDS)))
        bound = pl.col("figure").replace_strict(BOUNDS, return_dtype=pl.Float64)
        return held.with_columns(bound=bound).with_columns(
            allowed=pl.max_horizontal("bound", pl.col("spread").fill_null(0.0))).with_columns(
            within=pl.col("error").abs() <= pl.col("allowed"))

    def headline(self) -> dict:
        held = self.table.filter(pl.col("split") == "held-out")
        bounds = self.against_bounds()
        worst = {}
        for fig in FIGURES:
            t = held.filter(pl.col("figure") == fig)
            if t.height:
                i = t["error"].abs().arg_max()
                worst[fig] = {"error": float(t["error"][i]), "run": t["run"][i]}
        return {"held_out_points": held["run"].n_unique(),
                "fitted_points": self.table.filter(pl.col("split") == "fitted")["run"].n_unique(),
                "worst_held_out": worst,
                "held_out_within_bounds": int(bounds["within"].sum()),
                "held_out_bounded": bounds.height,
                "held_out_outside_bounds": [
                    f"{r['run']} {r['figure']}" for r in
                    bounds.filter(~pl.col("within")).iter_rows(named=True)],
                "picks_within_tolerance": bool(self.regimes["pick_ok"].all()),
                "loads_where_speculation_pays": int((self.regimes["measured_gain"] > 0).sum()),
                "best_measured_gain": float(self.regimes["measured_gain"].max()),
                "max_repeats": int(self.table["repeats"].max()),
                "noise_floor": self.noise,
                "constants": self.fit.uncertainty,
                "ttft_line": self.fit.line_record(),
                "acceptance": self.acceptance,
                "split": self.split}


def compare(runs: list[BenchRun], *, engine: EngineConfig, split: str | None = None,
            seed: int = 0, step_table: str = "auto") -> Comparison:
    split = split or default_split(runs)
    fitted = parse_split(split, runs)
    fitted_runs = [r for r in runs if r.name in fitted]
    # every setting's own measured acceptance, held-out ones too: the split is of the
    # step costs; the pooled counters, where a setting has none, are the fitted runs'
    traces = setting_traces(runs, fitted_runs, seed)
    fit = fit_profile(fitted_runs, engine=engine, seed=seed, traces=traces,
                      step_table=step_table)
    points = group_points(runs)
    rows, by_batch = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for p in points:
            r = p.run  # every figure at its median over the repeats
            sim, steps = simulate_with_steps(r, fit.profile, traces, engine,
                                             workload_file(r, Path(tmp)), seed)
            by_batch += step_rows(p, "fitted" if r.name in fitted else "held-out", steps)
            for fig in FIGURES:
                if fig in r.measured:
                    err = sim[fig] / r.measured[fig] - 1.0
                    rows.append({"run": r.name, "setting": r.setting, "k": r.k,
                                 "load": r.load, "concurrency": r.concurrency,
                                 "rate": r.rate,
                                 "split": "fitted" if r.name in fitted else "held-out",
                                 "figure": fig, "measured": r.measured[fig],
                                 "simulated": sim[fig], "error": err,
                                 "repeats": p.repeats, "spread": p.spread(fig),
                                 "lowest": float(p.values(fig).min())})
    table = pl.DataFrame(rows)
    return Comparison(table, _regimes(table), fit, split,
                      noise_floor(points) if any(p.repeats > 1 for p in points) else None,
                      dict(traces.sources), traces.warnings, step_frame(by_batch))


def acceptance_line(sources: dict[str, str] | None) -> str | None:
    """One sentence: what each speculative setting's acceptance replayed."""
    if not sources:
        return None
    by: dict[str, list[str]] = {}
    for s, src in sources.items():
        by.setdefault("measured" if src.startswith("measured") else src, []).append(s)
    parts = []
    for src, settings in by.items():
        one = len(settings) == 1
        names = ", ".join(sorted(settings))
        parts.append(f"{names} {'replays its' if one else 'replay their'} own measured "
                     f"per-request trace{'' if one else 's'} (acceptance/SETTING.jsonl), "
                     "request by request" if src == "measured"
                     else f"{names} replay{'s' if one else ''} the {src}")
    tail = " (no acceptance/SETTING.jsonl: vllm measure's per-request pass)" \
        if any(src != "measured" for src in by) else ""
    return "**Acceptance:** " + "; ".join(parts) + tail + "."


def _regimes(table: pl.DataFrame) -> pl.DataFrame:
    """Per load: the best setting by output throughput, measured and simulated, and the
    best speculative setting's gain over none."""
    tp = table.filter(pl.col("figure") == "output_throughput")
    out = []
    for load in tp["load"].unique(maintain_order=True):
        t = tp.filter(pl.col("load") == load)
        best_m = t.sort("measured", descending=True).row(0, named=True)
        best_s = t.sort("simulated", descending=True).row(0, named=True)
        none = t.filter(pl.col("k") == 0)
        spec = t.filter(pl.col("k") > 0)
        gain_m = gain_s = None
        if none.height and spec.height:
            gain_m = float(spec["measured"].max() / none["measured"][0] - 1.0)
            gain_s = float(spec["simulated"].max() / none["simulated"][0] - 1.0)
        picked = t.filter(pl.col("setting") == best_s["setting"])["measured"][0]
        # a pick whose median lies within the range of the best's own repeats cannot be
        # told from it
        floor = min((1.0 - PICK_TOLERANCE) * best_m["measured"], best_m["lowest"])
        order_m = t.sort("measured", descending=True)["setting"].to_list()
        order_s = t.sort("simulated", descending=True)["setting"].to_list()
        out.append({"load": load, "measured_best": best_m["setting"],
                    "simulated_best": best_s["setting"],
                    "pick_shortfall": float(1.0 - picked / best_m["measured"]),
                    "pick_ok": bool(picked >= floor),
                    "measured_gain": gain_m, "simulated_gain": gain_s,
                    "same_ranking": order_m == order_s})
    return pl.DataFrame(out)


def markdown(cmp: Comparison) -> str:
    """The comparison as Markdown: headline, per-run table, per-load regimes."""
    h = cmp.headline()
    lines = [f"Fitted on: `{cmp.split}` ({h['fitted_points']} runs); held out: "
             f"{h['held_out_points']} runs.", ""]
    worst = ", ".join(f"{LABELS[f]} {w['error']:+.1%} ({w['run']})"
                      for f, w in h["worst_held_out"].items())
    lines += [f"**Worst held-out error:** {worst}.", ""]
    outside = cmp.against_bounds().filter(~pl.col("within"))
    bounds = ", ".join(f"{LABELS[f]} {b:.0%}" for f, b in BOUNDS.items())
    lines += [f"**Against the bounds** ({bounds}, or a point's own spread where wider): "
              f"{h['held_out_within_bounds']} of {h['held_out_bounded']} held-out figures "
              "within" + ("." if outside.height == 0 else "; outside: " + ", ".join(
                  f"{r['run']} {LABELS[r['figure']]} {r['error']:+.1%} (allowed "
                  f"{r['allowed']:.1%})" for r in outside.iter_rows(named=True)) + "."), ""]
    acc = acceptance_line(cmp.acceptance)
    if acc:
        lines += [acc, ""]
    if cmp.noise is not None:
        rep = cmp.table.filter(pl.col("repeats") > 1).unique("run")["repeats"]
        lines += [format_noise(cmp.noise, rep.len(), int(rep.min()), int(rep.max())), ""]
    wide = cmp.table.pivot(on="figure", index=["run", "setting", "load", "split", "repeats"],
                           values=["measured", "simulated", "error", "spread"])
    head = ["run", "split"] + [f"{LABELS[f]} meas / sim (err)" for f in FIGURES]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in wide.iter_rows(named=True):
        cells = [row["run"], row["split"]]
        for f in FIGURES:
            m = row.get(f"measured_{f}")
            if m is None:
                cells.append("")
                continue
            fmt = ".3g" if f != "acceptance_length" else ".2f"
            spread = f" ±{row[f'spread_{f}']:.0%}" if row["repeats"] > 1 else ""
            cells.append(f"{m:{fmt}}{spread} / {row[f'simulated_{f}']:{fmt}} "
                         f"({row[f'error_{f}']:+.1%})")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| load | vLLM's best | simulator's pick | pick's shortfall | best spec "
              "gain over none, measured / simulated | same ranking |", "|---|---|---|---|---|---|"]
    for r in cmp.regimes.iter_rows(named=True):
        gain = "" if r["measured_gain"] is None else \
            f"{r['measured_gain']:+.0%} / {r['simulated_gain']:+.0%}"
        lines.append(f"| {r['load']} | {r['measured_best']} | {r['simulated_best']} | "
                     f"{r['pick_shortfall']:.1%} | {gain} | {'yes' if r['same_ranking'] else 'no'} |")
    steps = [] if cmp.steps is None else step_markdown(cmp.steps)
    lines += ["", *steps, *([""] if steps else []), cmp.fit.line_sentence(), "",
              "Fitted step cost (ms, ± one standard error): "
              + constants_line(cmp.fit.uncertainty, cmp.fit.points, cmp.fit.steps,
                               cmp.fit.lone)
              + f"; {cmp.fit.iterations} iterations."]
    return "\n".join(lines) + "\n"


def write_comparison(cmp: Comparison, out: Path) -> dict[str, Path]:
    """``comparison.parquet``, ``regimes.parquet``, ``steps.parquet``, ``comparison.md``,
    ``comparison.json``, the fitted ``profile.toml`` and ``trace.parquet`` (each written
    whole or not at all)."""
    from dspark_sim.io import write_atomic, write_json_atomic, write_text_atomic
    from dspark_sim.traces.schema import write_trace

    out.mkdir(parents=True, exist_ok=True)
    paths = {"table": out / "comparison.parquet", "regimes": out / "regimes.parquet",
             "markdown": out / "comparison.md", "json": out / "comparison.json",
             "profile": out / "profile.toml"}
    write_atomic(paths["table"], lambda p: cmp.table.write_parquet(p))
    write_atomic(paths["regimes"], lambda p: cmp.regimes.write_parquet(p))
    if cmp.steps is not None:
        paths["steps"] = out / "steps.parquet"
        write_atomic(paths["steps"], lambda p: cmp.steps.write_parquet(p))
    write_text_atomic(paths["markdown"], markdown(cmp))
    write_json_atomic(paths["json"], cmp.headline())
    write_text_atomic(paths["profile"], cmp.fit.profile.to_toml())
    if cmp.fit.trace is not None:
        paths["trace"] = write_trace(cmp.fit.trace, out / "trace.parquet")
    return paths


def load_engine(manifest: Path | None, **overrides) -> EngineConfig:
    """The scheduler limits the runs were served with: the live manifest's, else the
    options given."""
    vals = {}
    if manifest is not None and manifest.is_file():
        m = json.loads(manifest.read_text(encoding="utf-8"))
        vals = {k: m[k] for k in ("max_num_seqs", "max_num_batched_tokens",
                                  "kv_capacity_tokens") if m.get(k) is not None}
    vals.update({k: v for k, v in overrides.items() if v is not None})
    if vals.get("max_num_batched_tokens") is None:
        # the step's token budget shapes every fitted cost: a guess would bias the fit
        where = manifest if manifest is not None else "the runs"
        raise InputError("--max-num-batched-tokens",
                         f"{where} gives no max_num_batched_tokens (vllm measure writes "
                         "manifest.json when it finishes): give the server's value")
    return EngineConfig(**vals, prefill="chunked").validate()
