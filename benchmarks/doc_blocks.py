"""Benchmark tables in the docs are written by the scripts that measure them, not typed.

A table sits in a doc between ``<!-- bench: KEY -->`` and ``<!-- /bench -->``; a script run
with ``--doc PATH`` replaces the block of each KEY it measured with the table it printed,
preceded by the exact command line (a markdown comment), and leaves the rest of the doc
untouched. A KEY with no block in the doc is an error: where a new table goes in the prose
is an author's choice, so the markers are placed by hand once.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from pathlib import Path

from dspark_sim.errors import InputError
from dspark_sim.io import write_text_atomic

BEGIN, END = "<!-- bench: {key} -->", "<!-- /bench -->"


def block_pattern(key: str) -> re.Pattern:
    return re.compile(re.escape(BEGIN.format(key=key)) + r"\n.*?" + re.escape(END), re.S)


def replace_blocks(doc: str | Path, tables: dict[str, list[str]], command: str) -> None:
    """Replace each key's block in ``doc`` by its table (atomic: all or none are written)."""
    path = Path(doc)
    text = path.read_text()
    for key, lines in tables.items():
        pat = block_pattern(key)
        if len(pat.findall(text)) != 1:
            raise InputError(str(path), f"needs exactly one '{BEGIN.format(key=key)}' ... "
                             f"'{END}' block")
        body = "\n".join([BEGIN.format(key=key), f"<!-- {command} -->", *lines, END])
        text = pat.sub(lambda _m, body=body: body, text)
    write_text_atomic(path, text)


def command_line(script: str, argv: list[str] | None) -> str:
    """The command that reproduces a table: the script and its options, ``--doc`` dropped."""
    args = list(sys.argv[1:] if argv is None else argv)
    kept, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--doc":
            skip = True
        elif not a.startswith("--doc="):
            kept.append(a)
    return " ".join(["python", script, *kept])


def print_table(lines: list[str], rows: Iterable[str]) -> None:
    """Print a table's header ``lines``, then each row as soon as it is measured (a point
    takes seconds to minutes), appending every row to ``lines`` for :func:`write_tables`."""
    print("\n".join(lines))
    for row in rows:
        lines.append(row)
        print(row, flush=True)


def write_tables(doc: str | Path | None, tables: dict[str, list[str]], script: str,
              argv: list[str] | None) -> None:
    """``--doc PATH``: replace each measured table's block in PATH (nothing without it)."""
    if doc:
        replace_blocks(doc, tables, command_line(script, argv))
