"""Figures the docs quote from shipped data files, read back from those files, so a
re-measurement that changes the data cannot leave the docs behind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dspark_sim.calibration.profile import load_profile

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_profiles_doc_quotes_the_shipped_cpu_profiles_held_out_error():
    """docs/profiles.md: "Held-out error (N of M shapes held out ...): mean X %, median
    Y %, max Z %" for smollm2-cpu, against the file's [profile.parameters]."""
    text = (DOCS / "profiles.md").read_text()
    # read back by pattern, not regenerated: the figures sit inside a sentence of prose
    m = re.search(r"\*\*Held-out error\*\* \((\d+) of \d+ shapes held out.*?mean \*\*([\d.]+) %"
                  r"\*\*, median ([\d.]+) %, max ([\d.]+) %", text, re.S)
    assert m, "docs/profiles.md no longer states the held-out error"
    p = load_profile("smollm2-cpu").parameters
    assert int(m.group(1)) == p["heldout_shapes"]
    assert float(m.group(2)) == pytest.approx(100 * p["heldout_mean_rel_error"], abs=0.05)
    assert float(m.group(3)) == pytest.approx(100 * p["heldout_median_rel_error"], abs=0.05)
    assert float(m.group(4)) == pytest.approx(100 * p["heldout_max_rel_error"], abs=0.5)
    # and the number is a fit, not noise: under 15 % on held-out shapes
    assert p["heldout_mean_rel_error"] < 0.15


def test_trees_doc_offline_tables_are_the_benchmarks_output():
    """docs/trees.md: the offline accepted-length tables (chain vs each tree's static
    replay on the shipped block-16 v2 traces, and CURE's budget grid) are what
    ``benchmarks/trees.py`` computes from the shipped traces today, line for line; and
    PCTree's solved tree tau is the published 11.16 it was fitted to."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "trees_bench", DOCS.parent / "benchmarks" / "trees.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    text = (DOCS / "trees.md").read_text()
    assert mod.BEGIN in text and mod.END in text
    rows = [*mod.offline_rows(mod.PCTREE_TRACE, list(mod.ROW_LOCAL)),
            *mod.offline_rows(mod.CURE_TRACE, list(mod.ROW_LOCAL))]
    for line in mod.md_offline(rows, list(mod.ROW_LOCAL)).splitlines()[2:]:
        assert line in text, line
    grid = mod.offline_rows(mod.CURE_TRACE, list(mod.CURE_GRID))
    for line in mod.md_offline(grid, list(mod.CURE_GRID)).splitlines()[2:]:
        assert line in text, line
    pc = next(r for r in rows if r["trace"] == mod.PCTREE_TRACE)
    assert pc["pctree"] == pytest.approx(11.16, abs=0.005)
