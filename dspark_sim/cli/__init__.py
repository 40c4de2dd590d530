"""The ``dspark-sim`` command line: the one typer app, a thin layer over the Python API.

Each command group is a module of this package (``run``, ``sweep``, ``traces``,
``profiles``, ``calibrate``, ``vllm``, ``policies``; ``models`` for the commands that load
the real target); ``common`` holds what they share and ``commands`` the app. Commands
parse options, call library functions and print what they return. Bad input of any kind
is one line on stderr and exit code 2, never a traceback (``common.OneLineErrors``);
every argument is checked before anything expensive (loading a model, simulating)
starts, and files are written atomically. Each module imports its heavy libraries
inside the command that needs them, and importing this package imports none of them,
typer included: a ``run`` whose options are plain values is parsed without typer
(``fast``), the app is built for everything else.
"""

from __future__ import annotations

import importlib
import os
import sys

from dspark_sim import BLAS_DEFAULTED_ENV

# what this package exports, from the module that defines it (imported when first read)
_EXPORTS = {"app": "commands", "RUN_PANELS": "common", "console": "terminal",
            "err_console": "terminal", "print_summary": "summary",
            "profile_terms_text": "profiles", "raise_os_error_line": "terminal"}


def single_threaded_blas() -> None:
    """One OpenBLAS thread, unless the user chose: the simulator's numpy work is not
    BLAS, and OpenBLAS starting a thread per core as numpy is imported spins ~0.1 s of
    CPU, a fifth of a 10,000-request run. Only before numpy is imported (it reads the
    setting then)."""
    if "numpy" not in sys.modules and "OPENBLAS_NUM_THREADS" not in os.environ:
        os.environ["OPENBLAS_NUM_THREADS"] = "1"
        os.environ[BLAS_DEFAULTED_ENV] = "1"


def main() -> None:  # pragma: no cover - console entry
    single_threaded_blas()
    from dspark_sim.cli.fast import run_fast

    run_fast(sys.argv[1:])  # exits when it ran the command
    from dspark_sim.cli.commands import app

    app()


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"dspark_sim.cli.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["RUN_PANELS", "app", "console", "err_console", "main", "print_summary",
           "profile_terms_text", "raise_os_error_line"]

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
