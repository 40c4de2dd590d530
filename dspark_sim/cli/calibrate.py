"""``dspark-sim calibrate``: engine profiles, confidence maps, and a profile fitted to a
vLLM deployment's bench runs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dspark_sim.calibration.profile import DEFAULT_LIMITS
from dspark_sim.cli.common import (
    Device,
    EngineKv,
    EngineSeqs,
    EngineTokens,
    PathArgument,
    PathOption,
    Seed,
    StepTable,
    _ints,
    console,
    err_console,
)
from dspark_sim.io import check_writable, deferred_interrupts, file_or_none

calibrate_app = typer.Typer(help="Measure engine profiles and calibrate drafter confidences.",
                            no_args_is_help=True)


@calibrate_app.command("engine")
def calibrate_engine(
    out: Annotated[Path, PathOption(help="Profile TOML to write.")],
    model: Annotated[str | None, typer.Option(
        help="HF config.json, model dir or .gguf (default: the SmolLM2 CPU target). "
             "Weights are random: only the architecture is timed.")] = None,
    sheet: Annotated[Path | None, PathOption(
        help="Instead of measuring: an analytic profile from a hardware+model sheet TOML.")] = None,
    device: Device = "cpu",
    batch_requests: Annotated[str, typer.Option(help="Requests per timed batch.")] = "1,2,4,6,8",
    verify_lengths: Annotated[str, typer.Option(help="Draft tokens verified per request.")] = "0,1,3,7",
    context_lengths: Annotated[str, typer.Option(help="KV context lengths.")] = "128,512",
    warmup: Annotated[int, typer.Option(help="Untimed passes per shape (at most 1,000).")] = 2,
    repeats: Annotated[int, typer.Option(
        help="Timed passes per shape (median; at most 1,000); 12 keeps a shared CPU within "
             "~10 %.")] = 12,
    cuda_graphs: Annotated[bool, typer.Option(help="Capture CUDA graphs per bucket.")] = False,
    name: Annotated[str | None, typer.Option(help="Profile name.")] = None,
) -> None:
    """Measure SPS(B) and draft cost on this device (or build an analytic profile)."""
    check_writable(out, "--out", kind="file", not_over={"the --sheet": sheet})
    if sheet is not None:
        from dspark_sim.calibration.measure import write_profile
        from dspark_sim.calibration.roofline import profile_from_sheets

        prof = profile_from_sheets(sheet, name=name)  # checked: it loads back
        write_profile(prof, out)
        console.print(f"wrote {out}: {prof.summary()}")
        # what the sheet's numbers rest on: the peak, the capture limit, the defaults taken
        console.print(prof.parameters["sheet_summary"], highlight=False)
        return
    from dspark_sim.calibration.measure import measure_engine, write_profile
    from dspark_sim.traces.targets import check_device

    # every option before a model is built, so a typo fails before minutes of loading
    check_device(device)
    shapes = {"batch_requests": _ints("--batch-requests", batch_requests),
              "verify_lengths": _ints("--verify-lengths", verify_lengths, lo=0),
              "context_lengths": _ints("--context-lengths", context_lengths, lo=0)}
    prof = measure_engine(
        model, device=device, **shapes, warmup=warmup,
        repeats=repeats, cuda_graphs=cuda_graphs, name=name,
        log=lambda msg: console.print(msg, style="dim"),
    )
    write_profile(prof, out)
    err = prof.parameters.get("heldout_mean_rel_error")
    console.print(f"wrote {out}: {prof.summary()}")
    if err is not None:
        console.print(f"held-out step-time error: mean {100 * err:.1f} %, max "
                      f"{100 * prof.parameters.get('heldout_max_rel_error', float('nan')):.1f} %")


@calibrate_app.command("confidence")
def calibrate_confidence_cmd(
    trace: Annotated[str, typer.Option(help="Trace path or built-in name.")],
    out: Annotated[Path, PathOption(help="Calibration map TOML to write.")],
    method: Annotated[str, typer.Option(help="temperature (sequential) | isotonic")] = "temperature",
    holdout: Annotated[float, typer.Option(help="Fraction of requests held out for the report.")] = 0.3,
    html: Annotated[Path | None, PathOption(help="Also write a reliability diagram (HTML).")] = None,
    seed: Seed = 0,
) -> None:
    """Fit sequential temperature scaling (or isotonic) on a trace; report ECE/AUC."""
    from dspark_sim.calibration.fit import (
        calibrate_confidence,
        check_fit_options,
        format_report,
        write_reliability_html,
    )
    from dspark_sim.traces.schema import load_trace

    check_fit_options(method, holdout, seed)  # before the (possibly large) trace is read
    check_writable(out, "--out", kind="file", not_over={"the trace": file_or_none(trace)})
    if html is not None:
        check_writable(html, "--html", kind="file",
                       not_over={"the trace": file_or_none(trace), "--out": out})
    t = load_trace(trace)
    fitted, report = calibrate_confidence(t, method=method, holdout=holdout, seed=seed)
    # The shipped map uses every request; the report is on held-out requests.
    full, _ = calibrate_confidence(t, method=method, holdout=0.0, seed=seed)
    # the diagram first: it can still refuse the trace, and then neither file is touched
    # and nothing but that one error line is printed. Both under one deferral: an
    # interrupt between the two writes would leave a new diagram beside the old (or no) map
    with deferred_interrupts():
        if html is not None:
            write_reliability_html(html, t, fitted, report=report)
        full.save(out)
    console.print(format_report(report), highlight=False)
    console.print(f"wrote {out} (fitted on all {t.num_requests} requests)")
    if html is not None:
        console.print(f"wrote {html}")


@calibrate_app.command("vllm")
def calibrate_vllm_cmd(
    files: Annotated[list[Path], PathArgument(
        help="vllm bench serve --save-result JSON files (or folders of them), with and "
             "without speculation, at several loads; an acceptance/ folder beside them "
             "(vllm measure's) gives each setting its measured per-request acceptance.")],
    out: Annotated[Path, PathOption(help="Folder for profile.toml, trace.parquet, fit.json.")],
    max_num_seqs: EngineSeqs = None,
    max_num_batched_tokens: EngineTokens = None,
    kv_capacity_tokens: EngineKv = None,
    name: Annotated[str, typer.Option(help="Profile name.")] = "vllm-fitted",
    seed: Seed = 0,
    step_table: StepTable = "auto",
    sheet: Annotated[Path | None, PathOption(
        help="A hardware+model sheet of the same deployment: print the overhead_ms the "
             "measured step gives it.")] = None,
) -> None:
    """Fit an engine profile and an acceptance trace to a vLLM deployment's bench runs."""
    from dspark_sim.io import write_json_atomic, write_text_atomic
    from dspark_sim.traces.schema import write_trace
    from dspark_sim.validation.vllm_acceptance import setting_traces
    from dspark_sim.validation.vllm_compare import load_engine
    from dspark_sim.validation.vllm_fit import (
        fit_profile,
        read_bench_runs,
        substitution_warnings,
    )
    from dspark_sim.validation.vllm_repeats import constants_line

    check_writable(out, "--out", inside={"profile.toml": "file", "trace.parquet": "file",
                                         "fit.json": "file"})
    if sheet is not None:
        from dspark_sim.calibration.roofline import profile_from_sheets

        profile_from_sheets(sheet)  # a bad sheet fails before the fit runs
    runs = read_bench_runs(files)
    traces = setting_traces(runs, runs, seed)
    for line in substitution_warnings(runs) + list(traces.warnings):
        err_console.print("warning: " + line, highlight=False)
    engine = load_engine(None, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=(max_num_batched_tokens
                                                 or DEFAULT_LIMITS.max_num_batched_tokens),
                         kv_capacity_tokens=kv_capacity_tokens)
    fit = fit_profile(runs, engine=engine, name=name, seed=seed, traces=traces,
                      step_table=step_table)
    out.mkdir(parents=True, exist_ok=True)
    with deferred_interrupts():
        write_text_atomic(out / "profile.toml", fit.profile.to_toml())
        if fit.trace is not None:
            write_trace(fit.trace, out / "trace.parquet")
        write_json_atomic(out / "fit.json", {"parameters_ms": fit.theta_ms,
                                             "constants": fit.uncertainty,
                                             "points": fit.points,
                                             "ttft_line": fit.line_record(),
                                             "acceptance": traces.sources,
                                             "iterations": fit.iterations,
                                             "residuals": fit.residuals})
    for r in fit.residuals:
        console.print(f"{r['run']:<24} {r['metric']:<18} measured {r['measured']:10.4g}  "
                      f"simulated {r['simulated']:10.4g}  ({r['error']:+.1%})", highlight=False)
    console.print(fit.line_sentence().replace("**", ""), highlight=False)
    console.print("constants (ms, ± one standard error): "
                  + constants_line(fit.uncertainty, fit.points, fit.steps, fit.lone),
                  highlight=False)
    console.print(f"wrote {out / 'profile.toml'}" + (f", {out / 'trace.parquet'}"
                                                      if fit.trace is not None else "")
                  + f"; worst fitted error {fit.worst_error:.1%}", highlight=False)
    if sheet is not None:
        from dspark_sim.calibration.roofline import refine_sheet

        r = refine_sheet(sheet, fit.profile)
        console.print(f"{sheet}: one-request step {r['sheet_step_ms']:.3g} ms, measured "
                      f"{r['measured_step_ms']:.3g} ms: set [deployment] overhead_ms = "
                      f"{r['overhead_ms']:.3g} (was {r['overhead_ms_was']:.3g})", highlight=False)

