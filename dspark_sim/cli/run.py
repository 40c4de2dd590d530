"""``dspark-sim run``: one typer option per setting of the schema, then the run."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer

from dspark_sim.cli.common import (
    RUN_DEPLOY,
    PathOption,
    console,
    err_console,
    with_setting_options,
)
from dspark_sim.cli.summary import print_summary
from dspark_sim.errors import InputError
from dspark_sim.io import check_writable
from dspark_sim.policies import compiled

RUN_OUT = "Settings and output"


@with_setting_options(after={"--profile": "policy_profile"})
def run(
    *,
    policy_profile: Annotated[str | None, typer.Option(
        rich_help_panel=RUN_DEPLOY,
        help="Profile the scheduler's SPS curve comes from (default: --profile); steps "
             "still cost --profile. A what-if on a stale or mis-calibrated table (an "
             "option only, no config key).")] = None,
    config: Annotated[Path | None, PathOption(
        rich_help_panel=RUN_OUT,
        help="TOML config file; explicit options override it (docs/cli.md).")] = None,
    preset_name: Annotated[str | None, typer.Option(
        "--preset", rich_help_panel=RUN_OUT, help="default | single-replica | tiny")] = None,
    out: Annotated[Path | None, PathOption(
        rich_help_panel=RUN_OUT, help="Write summary.json and requests.parquet here.")] = None,
    quiet: Annotated[bool, typer.Option(
        rich_help_panel=RUN_OUT, help="Print nothing but errors.")] = False,
    executor: Annotated[str, typer.Option(
        rich_help_panel=RUN_OUT,
        help="serial | ray: simulate replica groups as Ray tasks (on the cluster "
             "RAY_ADDRESS names, else a local one) and merge them, the same bytes; an "
             "open loop routed round-robin only, else it says why and runs serially "
             "(docs/performance.md).")] = "serial",
    workers: Annotated[int | None, typer.Option(
        rich_help_panel=RUN_OUT, min=1,
        help="Replica groups with --executor ray (default: one per replica).")] = None,
    **settings: Any,
) -> None:
    """Simulate one deployment under load and print a summary."""
    from dspark_sim.calibration.profile import load_profile
    from dspark_sim.sim.config import files_read, requests_known, resolve_config
    from dspark_sim.sim.outputs import REQUESTS, SUMMARY

    layers: list = []
    cfg = resolve_config(preset_name=preset_name, config_path=config, options=settings,
                         layers_out=layers)
    compiled.choose_for_run(requests_known(cfg.workload))
    if out is not None:  # after the config: its files are inputs too
        check_writable(out, "--out", inside={SUMMARY: "file", REQUESTS: "file"},
                       not_over=files_read(cfg, {"--config": config,
                                                 "--policy-profile": policy_profile}))
    if policy_profile is not None and not policy_profile.strip():
        raise InputError("--policy-profile", "is empty: give a profile or leave the option out")
    if executor not in ("serial", "ray"):
        raise InputError("--executor", f"must be serial or ray, got {executor!r}")
    if workers is not None and executor != "ray":
        raise InputError("--workers", "sizes --executor ray's replica groups: give "
                                      "--executor ray or leave --workers out")
    sched_profile = load_profile(policy_profile) if policy_profile is not None else None
    t0 = time.perf_counter()
    result = _simulate(cfg, layers, sched_profile, executor=executor, workers=workers)
    wall = time.perf_counter() - t0
    if out is not None:
        result.write(out)
    if not quiet:
        print_summary(result.summary, wall)
        if out is not None:
            console.print(f"wrote {out / 'summary.json'} and {out / 'requests.parquet'}", style="dim")


def _simulate(cfg, layers: list, sched_profile, executor: str = "serial",
              workers: int | None = None):
    """The run of :func:`~dspark_sim.sim.api.prepare`'s inputs (with ``executor="ray"``,
    replica groups as Ray tasks where the run allows it); a bad value the config file
    gave names the file's key (``layers``: :func:`resolve_config`'s)."""
    from dspark_sim.sim.api import prepare, simulate
    from dspark_sim.sim.config import blame_config

    with blame_config(layers):
        inputs = prepare(cfg, policy_profile=sched_profile)
        if executor == "serial":
            return simulate(inputs)
        from dspark_sim.sim.shard import simulate_replicas

        result, why = simulate_replicas(inputs, executor=executor, workers=workers)
        if why is not None:
            err_console.print(f"note: --executor {executor} ran serially: {why}",
                              highlight=False)
        return result
