"""``dspark-sim traces``: write, import, export and inspect acceptance traces."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from dspark_sim.cli.common import (
    OutParquet,
    PathArgument,
    PathOption,
    Seed,
    TraceArg,
    _as_argument,
    console,
)
from dspark_sim.io import check_writable, file_or_none

traces_app = typer.Typer(help="Write, import, inspect and export acceptance traces (schema v1 "
                              "and v2: docs/traces.md).", no_args_is_help=True)


@traces_app.command("synth")
def traces_synth(
    out: OutParquet,
    kind: Annotated[str, typer.Option(help="iid | dspark | mtp1")] = "iid",
    alpha: Annotated[float | None, typer.Option(
        help="iid only: per-token acceptance probability [0.8].")] = None,
    gamma: Annotated[int | None, typer.Option(
        help="iid and dspark: draft block length gamma_max [7] (mtp1 drafts 1).")] = None,
    requests: Annotated[int, typer.Option(help="Requests (per domain for dspark/mtp1).")] = 64,
    positions: Annotated[int, typer.Option(help="Output positions per request.")] = 512,
    overconfidence: Annotated[float | None, typer.Option(
        help="dspark/mtp1 only: raw-confidence sharpening [1.3].")] = None,
    noise: Annotated[float | None, typer.Option(
        help="dspark/mtp1 only: confidence noise, lowers AUC [0.35].")] = None,
    seed: Seed = 0,
) -> None:
    """Write a synthetic schema-v1 trace."""
    from dspark_sim.traces.schema import write_trace
    from dspark_sim.traces.synth import synth_kind

    check_writable(out, "--out", kind="file")  # before minutes of generation, not after
    t = synth_kind(kind, alpha=alpha, gamma=gamma, requests=requests, positions=positions,
                   overconfidence=overconfidence, noise=noise, seed=seed)
    write_trace(t, out)
    console.print(f"wrote {out}: {t.num_requests} requests, {t.num_positions:,} positions, "
                  f"gamma_max {t.gamma_max}, served tau(gamma_max) = {t.served_tau():.3f} "
                  f"(per-position mean {t.tau():.3f})")


@traces_app.command("import")
def traces_import(
    src: Annotated[list[Path], PathArgument(
        help="Source files or folders (JSONL, CSV, /metrics text or bench serve JSON, by "
             "--format); several are combined into one trace.")],
    out: OutParquet,
    fmt: Annotated[str, typer.Option("--format", help="specdecode-bench | per-position | "
                                     "vllm-counters | vllm-per-request")],
    column: Annotated[str | None, typer.Option(
        help="specdecode-bench: which acceptance column, eagle | ngram (default eagle).")] = None,
    domain: Annotated[str | None, typer.Option(
        help="Domain label (default: from the file name; per-position: its 'domain' column).")] = None,
    gamma_max: Annotated[int | None, typer.Option(
        help="Draft block length (default: the longest accepted run in the file; longer runs "
             "are cut, exact for verify lengths up to it).")] = None,
    drafter: Annotated[str | None, typer.Option(help="Drafter name in the trace metadata.")] = None,
    target: Annotated[str | None, typer.Option(help="Target model name in the metadata.")] = None,
    requests: Annotated[int | None, typer.Option(
        help="vllm-counters: requests of the synthetic trace (default 64).")] = None,
    positions: Annotated[int | None, typer.Option(
        help="vllm-counters: positions per request (default 512).")] = None,
    seed: Annotated[int | None, typer.Option(help="vllm-counters: seed (default 0).")] = None,
    model_name: Annotated[str | None, typer.Option(
        help="vllm-counters: the model_name label to read from a scrape of several models.")]
    = None,
) -> None:
    """Import another engine's acceptance data as a schema-v1 trace (docs/traces.md)."""
    from dspark_sim.traces.import_files import import_files
    from dspark_sim.traces.importers import check_format_options
    from dspark_sim.traces.schema import write_trace

    check_format_options(fmt, {"--column": column, "--domain": domain,
                                "--gamma-max": gamma_max, "--requests": requests,
                                "--positions": positions, "--seed": seed,
                                "--model-name": model_name})
    check_writable(out, "--out", kind="file",
                   not_over={f"the source file {p}": p for p in src if not p.is_dir()})
    opts = {k: v for k, v in {"column": column, "domain": domain, "gamma_max": gamma_max,
                               "drafter": drafter, "target": target, "requests": requests,
                               "positions": positions, "seed": seed,
                               "model_name": model_name}.items() if v is not None}
    imported = import_files(fmt, src, **opts)
    t = imported.trace
    write_trace(t, out)
    console.print(f"wrote {out}: {t.num_requests} requests, {t.num_positions:,} positions, "
                  f"gamma_max {t.gamma_max}, source {t.meta.source}"
                  f"{'' if t.has_conf else ', no confidences'}"
                  f"{', per-request lengths' if t.has_lengths else ''}; served tau "
                  + ", ".join(f"k={k}: {t.served_tau(k):.2f}"
                              for k in sorted({1, 3, 5, t.gamma_max}) if k <= t.gamma_max)
                  + ("" if t.meta.extra.get("vllm_acceptance_length") is None else
                     f"; vLLM acceptance length (per step with a proposal) "
                     f"{t.meta.extra['vllm_acceptance_length']:.3f}"),
                  highlight=False)
    if imported.note:
        console.print(imported.note, highlight=False)


@traces_app.command("export")
def traces_export(
    trace: TraceArg,
    out: Annotated[Path, PathOption(help="Output file (JSON).")],
    fmt: Annotated[str, typer.Option("--format", help="vllm-synthetic")] = "vllm-synthetic",
    num_speculative_tokens: Annotated[int | None, typer.Option(
        help="Draft tokens per step on the real engine (default: the trace's gamma_max).")] = None,
    weighting: Annotated[str, typer.Option(
        help="served (over the steps a fixed-K run visits: the engine then serves the "
             "trace's served tau) | positions (every position once).")] = "served",
    method: Annotated[str | None, typer.Option(help="Also write the drafter's 'method'.")] = None,
    model: Annotated[str | None, typer.Option(help="Also write the drafter's 'model'.")] = None,
) -> None:
    """Write a trace's per-position acceptance for a real engine (vLLM's synthetic
    rejection sampler: --speculative-config)."""
    from dspark_sim.traces.export import export_trace
    from dspark_sim.traces.schema import load_trace

    check_writable(out, "--out", kind="file", not_over={"the trace": file_or_none(trace)})
    with _as_argument("--trace", "trace"):
        t = load_trace(trace)
    cfg = export_trace(t, fmt, out, num_speculative_tokens=num_speculative_tokens,
                       weighting=weighting, method=method, model=model)
    k = cfg["num_speculative_tokens"]
    console.print(f"wrote {out}: num_speculative_tokens {k}, synthetic_acceptance_rates "
                  f"{cfg['synthetic_acceptance_rates']} ({weighting}); the engine will serve "
                  f"tau = {1 + sum(cfg['synthetic_acceptance_rates']):.3f} (trace served tau "
                  f"at k={k}: {t.served_tau(k):.3f})", highlight=False)


@traces_app.command("inspect")
def traces_inspect(
    trace: TraceArg,
) -> None:
    """Print tau by verify length (served per verify step, and the per-position mean)
    and the per-position acceptance of a trace."""
    from dspark_sim.traces.schema import load_trace

    with _as_argument("--trace", "trace"):
        tr = load_trace(trace)
    meta = tr.meta
    console.print(Text(str(tr.source_path), style="bold"),
                  f" drafter {meta.drafter}, target {meta.target}, "
                  f"source {meta.source}, gamma_max {meta.gamma_max}, temperature {meta.temperature:g}"
                  f"{'' if meta.replay_exact else ' (replay approximate: sampled decoding)'}")
    console.print(f"{tr.num_requests} requests, {tr.num_positions:,} positions, "
                  f"domains {', '.join(meta.domains)}"
                  f"{'' if tr.has_conf else '; no confidences (conf column absent)'}"
                  f"{'; per-request prompt/output lengths' if tr.has_lengths else ''}")
    g = tr.gamma_max
    parts = [("all", tr)] + ([(d, tr.select_domain(d)) for d in meta.domains] if len(meta.domains) > 1 else [])
    # One row per verify length, so any gamma_max fits the terminal's width. The per
    # proposal column only where a step can go without a proposal (a draft_tokens
    # column): elsewhere it equals the per request-step one, and a third column a domain
    # would push the domains past an 80-column terminal.
    proposals = tr.draft_tokens is not None
    tab = Table(title="tau (tokens per verification step, incl. bonus) by verify length l")
    tab.add_column("l", justify="right")
    for name, _ in parts:
        if proposals:
            tab.add_column(f"{name}\nper proposal", justify="right", min_width=8)
        tab.add_column(f"{name}\nper req-step", justify="right", min_width=8)
        tab.add_column(f"{name}\nper-pos", justify="right", min_width=7)
    for ell in range(g + 1):
        tab.add_row(str(ell), *[f"{v:.2f}" for name, sub in parts
                                for v in ((sub.acceptance_length(ell),) if proposals else ())
                                + (sub.served_tau(ell), sub.tau(ell))])
    console.print(tab)
    console.print("a fixed-l chain replayed through each request, as a run serves it: per "
                  "proposal = vLLM's spec_decode_acceptance_length (tokens / steps where the "
                  "drafter proposed; a run's 'tau per proposal'), per req-step = tokens / "
                  "every request-step (a step without a proposal is one token; a run's 'tau "
                  "per request-step'; DSpark Table 1); equal when the drafter proposes at "
                  "every step"
                  + ("" if proposals else ", as in this trace (it has no draft_tokens "
                     "column), so per proposal is not shown")
                  + ". per-pos: min(l, m_t) + 1 averaged over positions; higher when "
                  "acceptance comes in easy and hard stretches.", style="dim")
    for name, sub in parts:
        pos = Table(title=f"per-position acceptance: {name}")
        pos.add_column("k", justify="right")
        cols = [("P(k | 1..k-1) (DSpark Fig. 2)", sub.conditional_acceptance()),
                ("P(m >= k) per position", sub.survival()),
                (f"P(m >= k) per step at l={g} (vLLM counters)", sub.served_survival())]
        if sub.conf is not None:
            cols.append(("mean raw confidence", sub.conf.mean(axis=0)))
        for head, _ in cols:
            pos.add_column(head, justify="right")
        for k in range(1, g + 1):
            # n/a: no chain reached position k (0 / 0), not an acceptance of 0
            pos.add_row(str(k), *[f"{v[k - 1]:.3f}" if math.isfinite(v[k - 1]) else "n/a"
                                  for _, v in cols])
        console.print(pos)

