"""docs/related-work.md's simulator numbers are the benchmark scripts' tables, and its prose
reads them correctly.

Each table sits in a ``<!-- bench: KEY -->`` block that ``benchmarks/shared_budget.py`` /
``benchmarks/long_context.py`` write with ``--doc`` (the command that printed it is the
block's first line). Rerunning the scripts is minutes of CPU, so the suite checks what can be
checked cheaply: every block names the script of its key, every row is arithmetically
consistent (a hand-edited cell breaks that), and every number the prose quotes is the
range it claims over the table's rows, recomputed here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "related-work.md"
# parsed, not regenerated (cog --check would rerun minutes of simulation): each block is
# what its script wrote, marked with the command that writes it again
BLOCK = re.compile(r"<!-- bench: (?P<key>[^>]+?) -->\n<!-- (?P<cmd>[^>]+) -->\n"
                   r"(?P<table>.*?)\n<!-- /bench -->", re.S)


def _num(cell: str) -> float:
    """'1,027' -> 1027; '+4.2%' -> 0.042; '988 (1.68x)' -> 988."""
    cell = cell.strip().split(" (")[0].replace(",", "")
    return float(cell[:-1]) / 100 if cell.endswith("%") else float(cell)


def _tables() -> dict[str, tuple[str, list[dict[str, str]]]]:
    out = {}
    for m in BLOCK.finditer(DOC.read_text()):
        lines = m["table"].splitlines()
        head = [c.strip() for c in lines[0].strip("|").split("|")]
        rows = [dict(zip(head, (c.strip() for c in ln.strip("|").split("|")), strict=True))
                for ln in lines[2:]]
        out[m["key"]] = (m["cmd"], rows)
    return out


TABLES = _tables()


def test_every_table_is_a_scripts_block():
    text = DOC.read_text()
    assert text.count("<!-- bench: ") == len(TABLES) == 8  # no block without its command
    for key, (cmd, rows) in TABLES.items():
        script, profile = key.split()[:2]
        assert cmd.startswith(f"python benchmarks/{script}.py"), key
        assert profile in cmd or "--profiles" not in cmd, key  # named, or the default
        assert len(rows) >= 6, key
    # no table outside a block (a typed table would have no command line)
    outside = BLOCK.sub("", text)
    assert not re.search(r"^\|", outside, re.M)


def _close(printed: float, a: float, b: float, digits: float) -> bool:
    """printed == a / b, the operands rounded to integers and the ratio to ``digits``."""
    r = a / b
    return abs(printed - r) <= digits / 2 + r * (0.5 / a + 0.5 / b) + 1e-9


@pytest.mark.parametrize("key", [k for k in TABLES if k.startswith("shared_budget")])
def test_shared_budget_rows_are_consistent(key):
    for row in TABLES[key][1]:
        t = {p: _num(row[p]) for p in ("none", "dfly", "dcut", "confidence")}
        assert _close(_num(row["dfly × AR"]), t["dfly"], t["none"], 0.01), row
        assert _close(_num(row["dcut × AR"]), t["dcut"], t["none"], 0.01), row
        assert _close(1 + _num(row["dcut ÷ dfly"]), t["dcut"], t["dfly"], 0.001), row
        assert _close(1 + _num(row["conf ÷ dcut"]), t["confidence"], t["dcut"], 0.001), row


@pytest.mark.parametrize("key", [k for k in TABLES if k.startswith("long_context")])
def test_long_context_rows_are_consistent(key):
    for row in TABLES[key][1]:
        none = _num(row["none"])
        for pol in ("fixed:1", "fixed:3", "fixed:7", "sparsespec", "sparsespec:conf"):
            thr, x = _num(row[pol]), float(row[pol].split("(")[1].rstrip("x)"))
            assert _close(x, thr, none, 0.01), (row, pol)


def _col(key: str, col: str, loads=None) -> list[float]:
    rows = TABLES[key][1]
    return [_num(r[col]) for r in rows if loads is None or int(r["C"]) in loads]


def _gain(key: str, col: str, loads=None) -> list[float]:
    rows = TABLES[key][1]
    return [float(r[col].split("(")[1].rstrip("x)")) for r in rows
            if loads is None or int(r["C"]) in loads]


def test_the_prose_quotes_the_tables():
    text = " ".join(DOC.read_text().split())  # prose wraps lines
    a21b = "shared_budget benchmarks/sheets/a21b-8xh20.sheet.toml"
    lo, hi = min(_col(a21b, "dfly × AR", range(4, 65))), max(_col(a21b, "dfly × AR", range(4, 65)))
    assert f"DFly {lo:.2f}–{hi:.2f}× over AR at C 4–64" in text
    edge = _col(a21b, "dcut ÷ dfly", range(48, 10**6))
    assert (f"D-cut's edge over DFly there is +{min(edge) * 100:.1f}–{max(edge) * 100:.1f} %"
            in text)
    grid = _col("shared_budget v4flash-h200", "dcut ÷ dfly", range(32, 10**6))
    assert f"costs {min(grid) * 100:.0f}–{max(grid) * 100:.0f} % from C ≈ 32 up" in text
    kv = "long_context selfspec-llama8b-8xh200 long-context"
    best256 = sorted(max(_gain(kv, p, [256])) for p in ("fixed:3", "sparsespec:conf"))
    assert f"{best256[0]:.2f}–{best256[1]:.2f}× at C = 256 with 32k prompts" in text
    v3 = [k for k in TABLES if "selfspec-v3-h200" in k]
    best_v3 = max(g for k in v3 for p in ("fixed:1", "fixed:3", "fixed:7", "sparsespec",
                                          "sparsespec:conf") for g in _gain(k, p))
    assert f"the best policy gains at most {round((best_v3 - 1) * 100)} %" in text
    f7 = [g for k in v3 for g in _gain(k, "fixed:7")]
    assert f"fixed:7 {min(f7):.2f}–{max(f7):.2f}×" in text


def test_frontiers_shared_budget_headlines_are_the_scripts_and_the_prose_reads_them():
    """docs/frontiers.md's DFly/D-cut headlines are benchmarks/headlines.py's block, and
    the prose after it quotes the block's tier gains (17 % at both tiers, within 1–2 %)."""
    text = (DOC.parent / "frontiers.md").read_text()
    (m,) = [m for m in BLOCK.finditer(text) if m["key"] == "headlines shared_budget"]
    assert m["cmd"].startswith("python benchmarks/headlines.py")
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.strip("|").split("|")]
            for ln in m["table"].splitlines()[2:]}
    tiers = {k: [_num(x.split(" (")[0]) for x in v[2].split(" / ")] for k, v in rows.items()}
    lo, hi = sorted(round(100 * x) for x in tiers["`dcut` vs `dfly`"])
    prose = " ".join(text[m.end():].split("## Notebooks")[0].split())
    said = f"{lo} % of throughput at both" if lo == hi else f"{lo}–{hi} % of throughput at the"
    assert f"and {said} interactivity tiers" in prose
    # "within 1–2 % of each other": every dcut-vs-confidence figure, tiers and the matched
    # range's ends, is within 2 %
    matched = rows["`dcut` vs `confidence`"][1].split(" (mean")[0].split(" … ")
    figures = tiers["`dcut` vs `confidence`"] + [_num(x) for x in matched]
    assert "within 1–2 % of each other" in prose
    assert max(abs(x) for x in figures) <= 0.02
