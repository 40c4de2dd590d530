"""``dspark-sim run`` parsed without typer, where its options are plain values.

Building the typer app costs a process typer's and pydantic's imports and a pydantic
validator per option (~0.15 s of CPU and ~14 MB), more than a short run simulates. So
:func:`run_fast` parses ``run``'s options itself when every one is a known option given
once with a value typer would read the same way (a decimal integer, a decimal number,
any text that does not look like an option, a path that is not empty), calls the command
(``cli/runner.py``) and fails as the app fails (one line and exit 2 for bad input, 1
aborted, 130 interrupted). Anything else (``--help``, an unknown or repeated option, a
value in another form, shell completion) goes to the typer app, which stays the
reference: tests/cli/test_fast.py holds the two to the same call.
"""

from __future__ import annotations

import errno
import os
import re
import sys
from pathlib import Path

from dspark_sim.errors import InputError

_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?")
_TYPER = object()  # a value typer has to read


def options() -> dict[str, tuple[str, type, object, int | None]]:
    """``run``'s options: flag -> (parameter, type, default, least value)."""
    from dspark_sim.cli.runner import OWN_OPTIONS, setting_type
    from dspark_sim.sim.config import OPTIONS

    table = {flag: (flag[2:].replace("-", "_"), setting_type(settings), None, None)
             for flag, settings in OPTIONS.items()}
    return table | OWN_OPTIONS


def _value(text: str, kind: type, least: int | None) -> object:
    if kind is int and _INT.fullmatch(text):
        value = int(text)
        return value if least is None or value >= least else _TYPER
    if kind is float and _FLOAT.fullmatch(text):
        return float(text)
    if kind is str and not text.startswith("-"):
        return text
    if kind is Path and text.strip() and not text.startswith("-"):
        from dspark_sim.io import path_too_long

        return _TYPER if path_too_long(text) else Path(text)
    return _TYPER


def parse_run(args: list[str]) -> dict | None:
    """``run_command``'s keyword arguments for ``run``'s options ``args``; None where
    typer is to parse them."""
    table = options()
    given: dict[str, object] = {}
    i = 0
    while i < len(args):
        flag, eq, text = args[i].partition("=")
        if flag in ("--quiet", "--no-quiet") and not eq:
            name, value = "quiet", flag == "--quiet"
            i += 1
        elif flag in table and table[flag][1] is not bool:
            name, kind, _, least = table[flag]
            if not eq:
                if i + 1 == len(args):
                    return None
                text = args[i + 1]
            i += 1 if eq else 2
            value = _value(text, kind, least)
        else:
            return None
        if value is _TYPER or name in given:
            return None
        given[name] = value
    return {name: default for name, _, default, _ in table.values()} | given


def run_fast(argv: list[str]) -> None:
    """Run ``argv`` (the command line after the program's name) and exit, when it is a
    ``run`` this module parses; return otherwise."""
    if not argv or argv[0] != "run" or any(k.endswith("_COMPLETE") for k in os.environ):
        return
    kwargs = parse_run(argv[1:])
    if kwargs is None:
        return
    from dspark_sim.cli.runner import run_command
    from dspark_sim.cli.terminal import _error_line, _exit_cleanly_on_termination
    from dspark_sim.io import as_os_error

    try:
        with _exit_cleanly_on_termination():
            run_command(**kwargs)
    except InputError as exc:
        _error_line(str(exc))
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    except EOFError:
        print(file=sys.stderr)
        _error_line("aborted")
        sys.exit(1)
    except Exception as exc:
        if isinstance(exc, OSError) and exc.errno == errno.EPIPE:  # a reader that left
            try:  # the wrapper typer's click installs on EPIPE (common.py's import rule)
                from typer._click.utils import PacifyFlushWrapper
            except ImportError:  # pragma: no cover - depends on the installed typer
                from click.utils import PacifyFlushWrapper

            sys.stdout = PacifyFlushWrapper(sys.stdout)
            sys.stderr = PacifyFlushWrapper(sys.stderr)
            sys.exit(1)
        if as_os_error(exc) is None:
            raise
        from dspark_sim.cli.terminal import raise_os_error_line

        raise_os_error_line(exc)
    sys.exit(0)
