"""The commands that load the real target model: ``train-drafter``, ``capture`` and
``validate`` (the capture extra's torch stack, imported only when one runs)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dspark_sim.cli.common import Device, PathOption, PromptDir, Seed, console
from dspark_sim.errors import InputError
from dspark_sim.io import check_writable


def train_drafter_cmd(
    drafter: Annotated[str, typer.Option(help="mtp1 | parallel | dspark | all")] = "all",
    target: Annotated[str, typer.Option(
        help="smollm2 (the CPU default), an HF model directory, or a .gguf file.")] = "smollm2",
    steps: Annotated[int, typer.Option(help="Optimizer steps per drafter (at most 100,000).")] =
        300,
    out: Annotated[Path | None, PathOption(
        help="Checkpoint root (default: the package's traces/data/drafters).")] = None,
    prompts: PromptDir = None,
    device: Device = "cpu",
    seed: Seed = 0,
) -> None:
    """Self-distil drafters on the target's own greedy generations (training prompts only)."""
    from dspark_sim.errors import check_seed
    from dspark_sim.traces.targets import PROMPT_DIR, check_device, check_target_spec
    from dspark_sim.traces.train import LEARNED_KINDS, check_steps, train_all

    # every argument before the target loads, so a typo fails before minutes of loading
    kinds = LEARNED_KINDS if drafter == "all" else (drafter,)
    if any(k not in LEARNED_KINDS for k in kinds):
        raise InputError("--drafter", f"must be one of {', '.join(LEARNED_KINDS)} or all")
    check_steps(steps)
    check_device(device)
    check_target_spec(target)
    check_seed(seed)
    if out is not None:
        check_writable(out, "--out")
    # the files last: the default prompt folder lies in ../shared, which a clone may lack
    if not Path(prompts or PROMPT_DIR).is_dir():
        raise InputError("--prompts", f"prompt folder {prompts or PROMPT_DIR} not found")
    kw = {"prompt_dir": prompts} if prompts is not None else {}
    info = train_all(kinds, target=target, steps=steps, out_root=out, device=device, seed=seed, **kw)
    for kind, side in info.items():
        curve = side.get("loss_curve") or []
        last = curve[-1].get("loss") if curve else None
        console.print(f"trained {kind}: {side.get('steps', steps)} steps"
                      + (f", final loss {last}" if last is not None else ""))


def capture(
    out: Annotated[Path, PathOption(help="Folder for the traces (one parquet per drafter).")],
    drafters: Annotated[str, typer.Option(help="Comma-separated drafters.")] =
        "mtp1,parallel,dspark,lookup",
    target: Annotated[str, typer.Option(help="smollm2, an HF model directory, or a .gguf.")] =
        "smollm2",
    gamma_max: Annotated[int, typer.Option(help="Draft block length recorded per position.")] = 7,
    max_new_tokens: Annotated[int, typer.Option(
        help="Greedy output tokens per prompt (at most 32,768).")] = 160,
    per_domain: Annotated[int, typer.Option(help="Held-out prompts per domain.")] = 20,
    prompts: PromptDir = None,
    resume: Annotated[bool, typer.Option(help="Continue a killed capture from its shards.")] = False,
    device: Device = "cpu",
) -> None:
    """Decode the target greedily and record every drafter's acceptance at every position."""
    from dspark_sim.sim.sweep import parse_list
    from dspark_sim.traces.capture import capture as run_capture

    kw = {"prompt_dir": prompts} if prompts is not None else {}
    paths = run_capture(target=target, drafters=tuple(parse_list(drafters, option="--drafters", what="drafter")), gamma_max=gamma_max,
                        max_new_tokens=max_new_tokens, out=out, resume=resume,
                        per_domain=per_domain, device=device, **kw)
    for name, path in paths.items():
        console.print(f"{name}: {path}")


def validate(
    out: Annotated[Path, PathOption(help="Folder for real and simulated results.")] =
        Path("runs/validate"),
    policies: Annotated[str, typer.Option(help="Comma-separated policies.")] =
        "mtp1,fixed:3,confidence",
    rates: Annotated[str, typer.Option(
        help="Poisson request rates (req/s): at most 16, each in [0.01, 1000].")] = "0.25,0.6",
    num_requests: Annotated[int, typer.Option(help="Requests per point (at most 1,000).")] = 10,
    max_new_tokens: Annotated[int, typer.Option(
        help="Output tokens per request (at most 32,768).")] = 128,
    device: Device = "cpu",
    drafter: Annotated[str, typer.Option(
        help="auto (the shipped dspark checkpoint, else mtp1's, else lookup) | lookup | a "
             "shipped kind: mtp1, parallel, dspark | a checkpoint folder (drafter.safetensors "
             "+ drafter.json) | deepspec:DIR (a DeepSpec checkpoint).")] = "auto",
    profile: Annotated[str, typer.Option(
        help="Comma-separated cost tables to compare, the first the headline: a built-in name "
             "or TOML path | auto (built-in smollm2-cpu, else measured) | measure (re-measure "
             "now) | insitu (the first real one rescaled to the other points' real steps) | "
             "insitu-self (diagnostic: to the point's own steps).")] =
        "insitu,measure,auto",
    clock: Annotated[str, typer.Option(help="auto | cpu (thread CPU time) | wall")] = "auto",
    save_profile: Annotated[Path | None, PathOption(
        help="Also write the engine-in-the-loop profile measured for 'measure'/'auto' here.")] =
        None,
    sim_seeds: Annotated[int, typer.Option(
        help="Simulator seeds averaged per point (at most 100).")] = 5,
    seed: Seed = 0,
    strict: Annotated[bool, typer.Option(
        help="Exit 1 when a point misses 10 % on throughput or median TPOT.")] = False,
) -> None:
    """Run a real spec-decoding server on the CPU target and compare it with the simulator."""
    from dspark_sim.sim.sweep import parse_list, parse_numbers
    from dspark_sim.validation.harness import ValidationSetup
    from dspark_sim.validation.harness import validate as run_validation

    setup = ValidationSetup(
        policies=tuple(parse_list(policies)), rates=tuple(parse_numbers(rates, option="--rates")),
        num_requests=num_requests, max_new_tokens=max_new_tokens, out_dir=out, device=device,
        drafter=drafter, profiles=tuple(parse_list(profile, option="--profile", what="profile")), clock=clock,
        save_profile=save_profile, sim_seeds=sim_seeds, seed=seed,
    ).check()  # every argument before a model loads
    result = run_validation(setup, log=lambda msg: console.print(msg,
                                                                 highlight=False))
    console.print(result.table(), highlight=False)
    console.print(result.headline(), highlight=False)
    if strict and not result.passed():
        raise typer.Exit(1)

