"""The v4flash-b300 profile against vLLM's Figure 3: its points and shape are checked in
tests/test_published.py through validation/published.py's runner; here, that the runner
is the CLI command a user types (the same summary, figure for figure)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dspark_sim.cli import app
from dspark_sim.validation.published import FIG3_FITTED, FIG3_POINTS, V4FLASH_B300_TRACE, runner

FIGURES = ("output_throughput", "median_interactivity", "median_tpot_ms",
           "spec_decode_acceptance_length")


@pytest.mark.parametrize("policy, c", [("fixed:7", 128), ("vllm-adaptive", 256)])
def test_the_published_runner_is_the_cli_command(tmp_path, policy, c):
    out = tmp_path / "run"
    r = CliRunner().invoke(app, [
        "run", "--profile", "v4flash-b300", "--replicas", "1", "--lengths", "fixed:250:512",
        "--max-concurrency", str(c), "--policy", policy, "--trace", V4FLASH_B300_TRACE,
        "--num-requests", "880", "--out", str(out)])
    assert r.exit_code == 0, r.output
    cli = json.loads((out / "summary.json").read_text())
    lib = runner("v4flash-b300").summary(policy, c)
    for key in FIGURES:
        assert cli[key] == lib[key], key
    assert cli["profile"] == "v4flash-b300" and cli["policy"] == policy


def test_the_fitted_subset_is_stated_and_the_rest_held_out():
    cells = {(arm, c) for arm, row in FIG3_POINTS.items() for c in row}
    assert len(cells) == 24 and FIG3_FITTED < cells
    # no speculation everywhere, fixed k = 5 at 1-64 and 256; fixed k = 7, fixed k = 5 at
    # 128 and adaptive everywhere held out
    assert {a for a, _ in FIG3_FITTED} == {"none", "fixed:5"}
    assert ("fixed:5", 128) not in FIG3_FITTED
    assert not any(a in ("fixed:7", "vllm-adaptive") for a, _ in FIG3_FITTED)
