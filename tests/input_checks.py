"""The bad-input contract the loaders' and the CLI's tests check (house rule: a malformed
file gives a one-line ``InputError`` naming the file, never a traceback; the CLI turns it
into exit 2 and one line ``error: ...``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from dspark_sim.errors import InputError


def assert_rejects_file(path: Path, text: str, load: Callable[[Path], object],
                        match: str) -> None:
    """``load`` of a file ``path`` holding ``text`` raises a one-line InputError matching
    ``match`` that starts with the file's name."""
    path.write_text(text)
    with pytest.raises(InputError, match=match) as err:
        load(path)
    assert str(err.value).startswith(str(path)) and "\n" not in str(err.value), str(err.value)


def one_line_error(r, *needles: str) -> str:
    """A CLI result (typer's ``CliRunner``) that refused its input: exit 2 and one line,
    ``error: ...``, holding each of ``needles``; returns the line."""
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, r.output
    assert lines[0].startswith("error: ") and "Traceback" not in r.output
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]
