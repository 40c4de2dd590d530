"""Inputs a hostile user tried that lost data or made it silently wrong, each pinned at
its cause:

* an output written over one of the command's own inputs (``run --trace
  D/requests.parquet --out D``), for every file input of ``run`` and ``sweep``;
* a point file whose footer reads but whose data does not, counted as done; a parquet
  in ``points/`` that is no point, merged into the results;
* a point id that hashes an input file's path, not its contents;
* integers past the trace schema's int32 columns, wrapped round on writing;
* an engine profile's ``[engine]`` limits past the options' caps;
* a draft-time table extrapolated to a negative time;
* a seed read through a float.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from dspark_sim.calibration.profile import DraftCost, load_profile, profile_from_dict
from dspark_sim.errors import MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, InputError
from dspark_sim.io import loads_toml
from dspark_sim.sim.config import preset

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "traces" / "data" / "mtp1-synthetic.parquet"
PROFILE = ROOT / "calibration" / "data" / "v4flash-h200.toml"
CALIBRATION = ROOT / "calibration" / "data" / "calibration" / "cure-qwen3-8b-synthetic-sts.toml"
runner = CliRunner()


def one_line_error(r, *needles: str) -> str:
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.fixture
def base():
    cfg = preset("tiny")
    return replace(cfg, workload=replace(cfg.workload, num_requests=40))


# -- profile limits ----------------------------------------------------------------------
@pytest.mark.parametrize("key,limit", [("max_num_batched_tokens", MAX_NUM_BATCHED_TOKENS),
                                       ("max_num_seqs", MAX_NUM_SEQS)])
def test_a_profiles_engine_limits_obey_the_options_caps(key, limit):
    data = loads_toml(PROFILE.read_text())
    data.setdefault("engine", {})[key] = limit
    assert getattr(profile_from_dict(data, "p.toml").limits, key) == limit
    data["engine"][key] = 1 << 30
    with pytest.raises(InputError, match=rf"p.toml \[engine\]: '{key}' must be an integer in "
                                         rf"\[1, {limit:,}\], got {1 << 30}"):
        profile_from_dict(data, "p.toml")


# -- draft extrapolation ---------------------------------------------------------------
def test_the_draft_table_never_extrapolates_below_its_last_time():
    cost = DraftCost(batch=np.array([1.0, 8.0]), time_s=np.array([0.004, 0.001]))
    assert cost.base_time(8, 1) == pytest.approx(0.001)
    assert cost.base_time(1000, 1) == pytest.approx(0.001)  # was -0.42 s


def test_a_falling_draft_table_runs_past_its_end(tmp_path, base):
    """SimPy raised "Negative delay" once the batch outgrew the table."""
    from dspark_sim.sim.api import simulate

    text = PROFILE.read_text()
    assert "[draft.dspark]" in text and load_profile(PROFILE).drafts["dspark"]
    lines = text.splitlines()
    at = lines.index("[draft.dspark]")
    ends = next((i for i in range(at + 1, len(lines)) if lines[i].startswith("[")), len(lines))
    table = [ln for ln in lines[at + 1:ends] if not ln.startswith(("batch", "time_ms"))]
    lines[at + 1:ends] = ["batch = [1, 2]", "time_ms = [300.0, 0.5]", *table]
    prof = tmp_path / "falling.toml"
    prof.write_text("\n".join(lines) + "\n")
    cost = load_profile(prof).drafts["dspark"]
    assert cost.base_time(64, cost.gamma_ref) == pytest.approx(0.0005)
    cfg = replace(base, policy="fixed:3", deployment=replace(base.deployment, profile=str(prof)))
    s = simulate(cfg).summary
    assert s["completed"] == 40
