"""A generated block of a document: text a test computes, kept between two markers."""

from __future__ import annotations

import os
from pathlib import Path


def check_block(doc: Path, name: str, text: str) -> None:
    """Assert that ``doc`` shows ``text`` between ``<!-- NAME:begin -->`` and
    ``<!-- NAME:end -->``; with ``DSPARK_SIM_WRITE_DOCS`` set, write it there first."""
    begin, end = f"<!-- {name}:begin -->\n", f"<!-- {name}:end -->"
    whole = doc.read_text(encoding="utf-8")
    assert begin in whole and end in whole, f"{doc} lacks the {name} block"
    head, rest = whole.split(begin)
    shown, tail = rest.split(end)
    if os.environ.get("DSPARK_SIM_WRITE_DOCS"):
        doc.write_text(head + begin + text + end + tail, encoding="utf-8")
        shown = text
    assert shown == text
