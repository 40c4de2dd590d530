"""``dspark-sim sweep``: loads x policies (x profiles x traces x seeds), then the report."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from dspark_sim.cli.common import (
    PathOption,
    _print_table,
    _warnings_as_lines,
    console,
    with_setting_options,
)
from dspark_sim.errors import InputError

# How a sweep sizes its points (sim.sweep.Sizing).
SizePerClient = Annotated[int, typer.Option(
    help="Closed loop: run each point with at least this many requests per client.")]
SizeDoublings = Annotated[int, typer.Option(
    help="Rerun a point with 2x requests, at most this often, while its steady window "
         "is short (or --target-rse is missed).")]
SizeRse = Annotated[float, typer.Option(
    help="Also double while steady throughput or median interactivity has a larger "
         "relative standard error (0: off).")]
SizeMax = Annotated[int, typer.Option(help="Never size a point beyond this many requests.")]

SweepPrefixCache = Annotated[str | None, typer.Option(
    help="Prefix caching per point: on, off, or on,off to run each point both ways "
         "(the ranking with caching on and off; the workload must carry reuse).")]
SweepWorkers = Annotated[int | None, typer.Option(
    help="Parallel workers (default: cores; at most 4 per core).")]
SweepSla = Annotated[str | None, typer.Option(
    help="Interactivity tiers (tok/s/user) for the headline and the plot's SLA lines "
         "(default: two inside the data's range).")]
SweepCandidate = Annotated[str | None, typer.Option(
    help="Policy compared in the headline (one of --policies; default: the run's default, "
         "confidence, when swept, else the one policy besides the baseline).")]
SweepBaseline = Annotated[str | None, typer.Option(
    help="Baseline policy of the headline (one of --policies; default: mtp1 when "
         "swept, else the one policy besides the candidate).")]
SweepBasis = Annotated[str, typer.Option(
    help="Figures of the fronts, headline and report: steady (warm-up and drain "
         "excluded) | whole (whole-run, vLLM bench serve).")]

@with_setting_options(grid=True)
def sweep(
    out: Annotated[Path, PathOption(help="Folder for points/, results.parquet, report.html.")],
    policies: Annotated[str, typer.Option(help="Comma-separated policy specs.")] =
        "mtp1,fixed:3,fixed:5,confidence,confidence-async,none",
    qps: Annotated[str | None, typer.Option(
        help="Open-loop rates: 10:400:20 (inclusive), 1:256:x2 (geometric) or 1,2,4.")] = None,
    concurrency: Annotated[str | None, typer.Option(
        help="Closed-loop client counts, e.g. 1,2,4,8,16,32,64,128,256.")] = None,
    profiles: Annotated[str | None, typer.Option(help="Comma-separated profiles.")] = None,
    traces: Annotated[str | None, typer.Option(help="Comma-separated traces.")] = None,
    seeds: Annotated[str, typer.Option(help="Seeds to repeat each point with (error bars).")] = "0",
    prefix_cache: SweepPrefixCache = None,
    executor: Annotated[str, typer.Option(help="process | serial | ray")] = "process",
    workers: SweepWorkers = None,
    sla: SweepSla = None,
    candidate: SweepCandidate = None,
    baseline: SweepBaseline = None,
    vllm_results: Annotated[Path | None, PathOption(
        help="Folder of vLLM `bench serve` result JSON files to overlay.")] = None,
    gpus: Annotated[int | None, typer.Option(help="GPUs behind the vLLM results (per-GPU).")] = None,
    config: Annotated[Path | None, PathOption(help="Base TOML config.")] = None,
    basis: SweepBasis = "steady",
    requests_per_client: SizePerClient = 0, max_doublings: SizeDoublings = 0,
    target_rse: SizeRse = 0.0, max_requests: SizeMax = 1_000_000,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
    **settings: Any,
) -> None:
    """Sweep loads x policies (x profiles x traces x seeds); write results and a report.

    Every other setting is run's option, one value for every point (over --config's);
    with a goodput --slo the per-load answer ranks on goodput and the report adds its
    fronts, and a new SLO reruns no point.
    """
    from dspark_sim.sim.config import blame_config, resolve_config
    from dspark_sim.sim.frontier import BASES, Slo, headline_policy
    from dspark_sim.sim.report import check_overlay
    from dspark_sim.sim.sweep import (
        Sizing,
        SweepWarning,
        check_grid,
        check_sweep_out,
        parse_list,
        parse_numbers,
        run_sweep,
    )

    if basis not in BASES:
        raise InputError("--basis", f"must be one of {', '.join(BASES)}, got {basis!r}")
    sizing = Sizing(requests_per_client=requests_per_client, max_doublings=max_doublings,
                    target_rse=target_rse, max_requests=max_requests).validate()
    layers: list = []
    base = resolve_config(config_path=config, options=settings, layers_out=layers)
    tiers = parse_numbers(sla, option="--sla")
    policy_specs = parse_list(policies)
    profile_specs = parse_list(profiles, option="--profiles", what="profile")
    trace_specs = parse_list(traces, option="--traces", what="trace")
    check_sweep_out(out, base, config, profile_specs, trace_specs, vllm_results)
    candidate = headline_policy("--candidate", candidate, policy_specs)
    baseline = headline_policy("--baseline", baseline, policy_specs)
    check_grid(base, policy_specs, profile_specs, trace_specs, layers)
    check_overlay(vllm_results, gpus)
    with blame_config(layers), _warnings_as_lines(SweepWarning):  # config errors: its key
        df = run_sweep(
            base,
            qps=parse_numbers(qps),
            concurrency=parse_numbers(concurrency, integer=True, option="--concurrency"),
            policies=policy_specs,
            profiles=profile_specs,
            traces=trace_specs,
            seeds=parse_numbers(seeds, integer=True, allow_zero=True, option="--seeds"),
            prefix_cache=prefix_cache,
            out=out, executor=executor, workers=workers, progress=not quiet, sizing=sizing,
        )
    _report_sweep(df, out, candidate, baseline, tiers=tiers, vllm_results=vllm_results,
                  gpus=gpus, basis=basis, slo=Slo.of(base))


def _report_sweep(this, out: Path, candidate: str | None, baseline: str | None, *, tiers,
                  vllm_results: Path | None, gpus: int | None, basis: str, slo) -> None:
    """Write the report of every point in ``out`` (this sweep's rows are ``this``) and
    print the per-load answer, where the report went, its basis, the headline and every
    point left off the fronts, with why."""
    import polars as pl

    from dspark_sim.sim.frontier import (
        BASIS_TEXT,
        answer,
        answer_rows,
        basis_used,
        default_tiers,
        format_headline,
        headline,
        headline_pair,
        left_out,
        left_out_text,
        one_run_per_point,
    )
    from dspark_sim.sim.report import build_report
    from dspark_sim.sim.sweep import load_results

    folder = load_results(out)
    df, superseded = one_run_per_point(folder)
    tiers = tiers or default_tiers(df, basis)
    candidate, baseline, missing = headline_pair(df["policy"].to_list(), candidate, baseline)
    report = build_report(folder, out / "report.html", candidate=candidate, baseline=baseline,
                          tiers=tiers, vllm_results=vllm_results, gpus=gpus, basis=basis,
                          slo=slo)
    _print_table(answer_rows(answer(df, slo=slo, basis=basis)),
                 "Which policy at which load" + (f" ({slo.text()})" if slo.given else ""))
    others = folder.height - this.height
    console.print(f"{folder.height} points in {out / 'results.parquet'}"
                  + (f" ({this.height} from this sweep, {others} from earlier ones)"
                     if others else "") + f"; report {report}", highlight=False)
    if superseded.height:
        console.print(f"{superseded.height} of them superseded by a rerun of the same policy, "
                      "load and seed with more requests: the rerun is drawn, the rest listed "
                      "in the report", style="dim", highlight=False)
    console.print(f"figures: {BASIS_TEXT[basis_used(df, basis)]}; SLA tiers "
                  f"{', '.join(f'{t:g}' for t in tiers)} tok/s/user", highlight=False)
    if df["load"].n_unique() < 2:  # the base workload's own load: a point, not a front
        console.print("one load per policy: a front needs several, e.g. --concurrency "
                      "1:256:x2 or --qps 10:400:40", style="dim", highlight=False)
    left = left_out(df, basis=basis)
    if missing is None:
        console.print(format_headline(headline(df, candidate=candidate, baseline=baseline,
                                               tiers=tiers, basis=basis)),
                      highlight=False)
        # the headline lists its two policies' points left out; the others' follow
        left = left.filter(~pl.col("policy").is_in([candidate, baseline]))
    else:
        console.print(f"no headline: {missing}", style="dim", highlight=False)
    if left.height:
        console.print(f"{left.height} point{'s' if left.height > 1 else ''} left off the fronts: "
                      f"{left_out_text(left.to_dicts())}", highlight=False)
