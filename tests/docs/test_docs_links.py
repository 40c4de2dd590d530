"""Cross-references in the user docs resolve: every relative link of README.md and docs/*.md
names a file that exists and, with a ``#fragment``, a heading of that file (GitHub's
anchor rules), and every repository path quoted in backticks (``sim/...``,
``traces/data/...``, ``benchmarks/...``) exists. A renamed file or heading fails here
instead of leaving a reader at a dead link."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP = ("sim/", "traces/", "policies/", "calibration/", "kernels/", "notebooks/", "docs/",
       "tests/", "benchmarks/", "validation/", "dspark_sim/")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lower case, punctuation other than
    '-' and '_' removed (letters of any script kept), spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[`*]", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    fenced = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#{1,6}\s+(.*)", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def dead_links(doc: Path, text: str) -> list[str]:
    bad = []
    for m in LINK.finditer(text):
        target = m.group(1)
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        line = text.count("\n", 0, m.start()) + 1
        if not dest.exists():
            bad.append(f"{doc.name}:{line}: {target} (no such file)")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest.read_text()):
            bad.append(f"{doc.name}:{line}: {target} (no such heading)")
    return bad


def missing_paths(doc: Path, text: str) -> list[str]:
    bad = []
    for n, line in enumerate(text.splitlines(), 1):
        for quoted in re.findall(r"`([^`\s]+)`", line):
            path = quoted.split("::")[0].rstrip(".,:;)")
            if path.startswith(TOP) and not re.search(r"[*{}<>\[\]|…]", path) \
                    and not (ROOT / path).exists() and not _defined(path):
                bad.append(f"{doc.name}:{n}: {quoted}")
    return bad


def _defined(path: str) -> bool:
    """``validation/server_profile._draft_cost``: a function or class of a module file."""
    module, _, name = path.rpartition(".")
    source = ROOT / f"{module}.py"
    return bool(name) and source.is_file() and re.search(
        rf"^\s*(?:def|class)\s+{name}\b", source.read_text(), re.M) is not None


def test_the_checker_finds_a_dead_link_a_missing_heading_and_a_missing_path(tmp_path):
    doc = tmp_path / "a.md"
    doc.write_text("# Two τ: the `served` one\n\n## Two τ: the served one\n")
    assert anchors(doc.read_text()) == {"two-τ-the-served-one", "two-τ-the-served-one-1"}
    text = ("[ok](a.md#two-τ-the-served-one) [gone](b.md) [typo](#two-tau) `sim/nope.py` "
            "`sim/api.simulate` `sim/api.no_such_function`")
    assert dead_links(doc, text) == ["a.md:1: b.md (no such file)",
                                     "a.md:1: #two-tau (no such heading)"]
    assert missing_paths(doc, text) == ["a.md:1: sim/nope.py", "a.md:1: sim/api.no_such_function"]


def test_every_docs_cross_reference_resolves():
    assert len(DOCS) > 10
    bad = [b for doc in DOCS for b in (*dead_links(doc, doc.read_text()),
                                        *missing_paths(doc, doc.read_text()))]
    assert bad == []
