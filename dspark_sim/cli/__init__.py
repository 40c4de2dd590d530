"""The ``dspark-sim`` command line: the one typer app, a thin layer over the Python API.

Each command group is a module of this package (``run``, ``sweep``, ``traces``,
``profiles``, ``calibrate``, ``vllm``, ``policies``; ``models`` for the commands that load
the real target); ``common`` holds what they share. Commands parse options, call library
functions and print what they return. Bad input of any kind is one line on stderr and
exit code 2, never a traceback (``common.OneLineErrors``); every argument is checked
before anything expensive (loading a model, simulating) starts, and files are written
atomically. Each module imports its heavy libraries inside the command that needs them,
so importing the app (``--help``, a short run) stays light.
"""

from __future__ import annotations

import sys

import typer

from dspark_sim.cli import calibrate, models, policies, profiles, run, sweep, traces, vllm
from dspark_sim.cli.common import (
    RUN_PANELS,
    OneLineErrors,
    console,
    err_console,
    raise_os_error_line,
)
from dspark_sim.cli.profiles import profile_terms_text
from dspark_sim.cli.summary import print_summary

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


def main() -> None:  # pragma: no cover - console entry
    app()


__all__ = ["RUN_PANELS", "app", "console", "err_console", "main", "print_summary",
           "profile_terms_text", "raise_os_error_line"]

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
