"""The ``dspark-sim`` typer app: every command, its help and its option parsing (a plain
``run`` is parsed without it: ``cli/fast.py``)."""

from __future__ import annotations

import typer

from dspark_sim.cli import calibrate, models, policies, profiles, run, sweep, traces, vllm
from dspark_sim.cli.common import OneLineErrors

app = typer.Typer(
    name="dspark-sim",
    help="Simulate speculative-decoding verification policies on an LLM serving deployment.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=OneLineErrors,
)
# the order of --help's command list
app.command()(run.run)
app.command("policies")(policies.policies_cmd)
app.command()(sweep.sweep)
app.command("train-drafter")(models.train_drafter_cmd)
app.command()(models.capture)
app.command()(models.validate)
app.add_typer(traces.traces_app, name="traces")
app.add_typer(profiles.profiles_app, name="profiles")
app.add_typer(calibrate.calibrate_app, name="calibrate")
app.add_typer(vllm.vllm_app, name="vllm")

__all__ = ["app"]
