"""A report as a browser shows it: Debian's headless Chromium renders the page, runs its
scripts and dumps the DOM; the tables are read back as text. Tests skip where Chromium
is not installed (`apt-get install -y chromium`)."""

from __future__ import annotations

import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

# the flags a root user in a container needs (no sandbox, no GPU), and none of the
# browser's own network traffic: the report is a local file and must render offline
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync")
NAMES = ("chromium", "chromium-browser")


def chromium() -> str:
    """The Chromium binary; skips the test when none is installed."""
    found = next((p for p in map(shutil.which, NAMES) if p), None)
    if found is None:
        pytest.skip("headless Chromium is not installed (Debian: apt-get install -y "
                    "chromium): the report's rendering cannot be checked")
    return found


def rendered_dom(page: Path, profile_dir: Path, timeout_s: float = 120) -> str:
    """``page`` after Chromium loaded it and ran its scripts: the dumped DOM."""
    done = subprocess.run([chromium(), *FLAGS, f"--user-data-dir={profile_dir}",
                           "--dump-dom", page.resolve().as_uri()],
                          capture_output=True, text=True, timeout=timeout_s, check=False)
    assert done.returncode == 0 and "<body" in done.stdout, done.stderr[-2000:]
    return done.stdout


class _Tables(HTMLParser):
    """Every <table>, in document order, as (the <h2> heading above it, its rows of cell
    text); the header row first."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[tuple[str, list[list[str]]]] = []
        self._heading: str | None = None
        self._last_heading = ""
        self._rows: list[list[str]] | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "h2":
            self._heading = ""
        elif tag == "table":
            self._rows = []
        elif tag == "tr" and self._rows is not None:
            self._rows.append([])
        elif tag in ("td", "th") and self._rows is not None:
            self._cell = []

    def handle_endtag(self, tag):
        if tag == "h2" and self._heading is not None:
            self._last_heading, self._heading = self._heading.strip(), None
        elif tag in ("td", "th") and self._cell is not None and self._rows:
            self._rows[-1].append(" ".join("".join(self._cell).split()))
            self._cell = None
        elif tag == "table" and self._rows is not None:
            self.tables.append((self._last_heading, self._rows))
            self._rows = None

    def handle_data(self, data):
        if self._heading is not None:
            self._heading += data
        if self._cell is not None:
            self._cell.append(data)


def tables(html: str) -> list[tuple[str, list[dict[str, str]]]]:
    """The page's tables in order: (heading, one dict per body row keyed by the header)."""
    parser = _Tables()
    parser.feed(html)
    out = []
    for heading, rows in parser.tables:
        head, *body = rows
        out.append((heading, [dict(zip(head, r, strict=True)) for r in body]))
    return out
