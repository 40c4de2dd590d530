"""The consoles and the one-line forms every command prints through, and the exit on a
signal, apart from the command-line framework: a run parsed without typer
(``cli/fast.py``) prints and fails through these as the typer app does. rich is imported
when a console is first used, so a run that prints nothing never imports it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from dspark_sim.io import as_os_error, os_error_line

_consoles: list = []


def consoles() -> list:
    """[stdout's, stderr's] console, made on first use. User text (paths, specs like
    "fixed:100:100") must print as given: no ":100:" emoji, and markup off, since what
    we print carries user text (file paths, profile descriptions, trace metadata, error
    messages) in which "[...]" is data, not rich markup (a description holding "[/]"
    would crash `profiles show`, "[draft.selfspec]" vanish); styles go in style=."""
    if not _consoles:
        from rich.console import Console

        _consoles.extend([Console(emoji=False, markup=False),
                          Console(stderr=True, emoji=False, markup=False)])
    return _consoles


def __getattr__(name: str) -> Any:
    if name == "console":
        return consoles()[0]
    if name == "err_console":
        return consoles()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _error_line(text: str) -> None:
    consoles()[1].print("error: " + " ".join(map(_shortened, text.split())), highlight=False,
                        soft_wrap=True)


def _shortened(word: str, longest: int = 200) -> str:
    """An error echoes the value it refuses: a 100,000-character policy spec or path made
    a 100,000-character line. Its head and tail stay, and how long it was."""
    if len(word) <= longest:
        return word
    return f"{word[:120]}...({len(word):,} characters)...{word[-40:]}"


def _fmt(v, nd: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{nd}f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def _terminated(signum: int, _frame: Any) -> None:
    # an exception, not the default death: every ``finally`` runs, so a file being
    # written atomically loses its temporary sibling and a run's output pair is rolled
    # back (killed outright, a half-written ``.NAME.*.tmp`` stayed beside the output)
    raise SystemExit(128 + signum)


@contextmanager
def _exit_cleanly_on_termination() -> Iterator[None]:
    """SIGTERM and SIGHUP (``kill``, a closed terminal, a batch scheduler's time limit)
    end the command as Ctrl-C does: temporary files removed, the previous output kept,
    exit code 128 + the signal's number, no traceback."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return
    sigs = [signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    previous = {sig: signal.signal(sig, _terminated) for sig in sigs}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def raise_os_error_line(exc: BaseException) -> None:
    """A file-system error (a full disk, a name too long, a folder that refused a write)
    as one line naming the file, exit 2 like any input the user can fix (docs/cli.md's
    exit codes: 1 is a bug's traceback). Reached only where no check caught it first;
    the atomic writers leave every file whole, written or as it was."""
    import sys

    _error_line(os_error_line(as_os_error(exc)))
    sys.exit(2)
