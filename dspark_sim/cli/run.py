"""``dspark-sim run``: one typer option per setting of the schema, then the run
(``cli/runner.py``, which ``cli/fast.py`` calls without typer where it can parse the
options itself)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from dspark_sim.cli.common import RUN_DEPLOY, PathOption, with_setting_options
from dspark_sim.cli.runner import run_command

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
    run_command(policy_profile=policy_profile, config=config, preset_name=preset_name,
                out=out, quiet=quiet, executor=executor, workers=workers, **settings)
