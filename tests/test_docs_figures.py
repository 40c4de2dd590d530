"""Figures the docs quote from shipped data files, read back from those files, so a
re-measurement that changes the data cannot leave the docs behind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dspark_sim.calibration.profile import load_profile

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_profiles_doc_quotes_the_shipped_cpu_profiles_held_out_error():
    """docs/profiles.md: "Held-out error (N of M shapes held out ...): mean X %, median
    Y %, max Z %" for smollm2-cpu, against the file's [profile.parameters]."""
    text = (DOCS / "profiles.md").read_text()
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
