"""The v4flash-b300 profile against vLLM's Figure 3: its points and shape are checked in
tests/validation/test_published.py through validation/published.py's runner; here, that the runner
is the CLI command a user types (the same summary, figure for figure)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dspark_sim.cli import app
from dspark_sim.validation.published import FIG3_FITTED, FIG3_POINTS, V4FLASH_B300_TRACE, runner

FIGURES = ("output_throughput", "median_interactivity", "median_tpot_ms",
           "spec_decode_acceptance_length")


def _run(tmp_path, policy: str, c: int, *extra: str) -> dict:
    out = tmp_path / "run"
    r = CliRunner().invoke(app, [
        "run", "--profile", "v4flash-b300", "--replicas", "1", "--lengths", "fixed:250:512",
        "--max-concurrency", str(c), "--policy", policy, "--num-requests", "880", *extra,
        "--out", str(out)])
    assert r.exit_code == 0, r.output
    return json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("policy, c", [("fixed:7", 128), ("vllm-adaptive", 256)])
def test_the_published_runner_is_the_cli_command(tmp_path, policy, c):
    """The issue's command, with no --trace: the profile's default_trace is the setup's
    drafter, so it gives the runner's figures, and its deployment line says why."""
    cli = _run(tmp_path, policy, c)
    lib = runner("v4flash-b300").summary(policy, c)
    for key in FIGURES:
        assert cli[key] == lib[key], key
    assert cli["profile"] == "v4flash-b300" and cli["policy"] == policy
    assert cli["trace"] == f"builtin:{V4FLASH_B300_TRACE}"
    assert cli["trace_chosen_by"] == "profile v4flash-b300 default_trace"
    assert f"trace {V4FLASH_B300_TRACE}: the profile's default_trace" in cli["deployment"]


def test_a_given_trace_still_wins_over_the_profiles(tmp_path):
    cli = _run(tmp_path, "fixed:7", 16, "--trace", "dspark-synthetic")
    assert cli["trace"] == "builtin:dspark-synthetic" and "trace_chosen_by" not in cli
    assert "default_trace" not in cli["deployment"]
    # the package default's tau (3.5-5.6 by domain), not the setup drafter's 3.2
    assert cli["spec_decode_acceptance_length"] > 3.6


def test_the_cli_resolves_the_profiles_trace_without_the_profile_object():
    """`dspark-sim run` resolves the trace from the config before it simulates: the
    profile it names is read for its default_trace there too (and not for MTP-1)."""
    from dspark_sim.policies.registry import get_policy
    from dspark_sim.sim.api import DEFAULT_MTP_TRACE, resolve_trace
    from dspark_sim.sim.config import DeploymentConfig, SimConfig

    cfg = SimConfig(policy="fixed:7", deployment=DeploymentConfig(profile="v4flash-b300"))
    assert resolve_trace(cfg, get_policy("fixed:7")).source_path == \
        f"builtin:{V4FLASH_B300_TRACE}"
    assert resolve_trace(cfg, get_policy("mtp1")).source_path == f"builtin:{DEFAULT_MTP_TRACE}"
    assert resolve_trace(cfg, get_policy("none")) is None


def test_the_fitted_subset_is_stated_and_the_rest_held_out():
    cells = {(arm, c) for arm, row in FIG3_POINTS.items() for c in row}
    assert len(cells) == 24 and FIG3_FITTED < cells
    # no speculation everywhere, fixed k = 5 at 1-64 and 256; fixed k = 7, fixed k = 5 at
    # 128 and adaptive everywhere held out
    assert {a for a, _ in FIG3_FITTED} == {"none", "fixed:5"}
    assert ("fixed:5", 128) not in FIG3_FITTED
    assert not any(a in ("fixed:7", "vllm-adaptive") for a, _ in FIG3_FITTED)


def test_fixed7_leaves_the_graphs_between_64_and_128_clients():
    """The cliff's mechanism: 64 x 8 = 512 verify tokens plus the prompts joining stay
    within the 1,024-token capture limit; 128 x 8 = 1,024 fill it, so a step a prompt joins
    runs eager and pays the launch penalty, and C = 128's steps cost more than twice C = 64's
    for twice the requests (a graph-only table would give under twice)."""
    from dspark_sim.calibration.profile import load_profile

    prof = load_profile("v4flash-b300")
    limit = prof.parameters["deploy_cuda_graph_max_tokens"]
    assert limit == 1024 and prof.eager_penalty_s > 0.04
    # a step one token past the limit pays the penalty; one inside the graphs does not
    assert prof.target_time_s(limit + 1) - prof.target_time_s(limit) > prof.eager_penalty_s
    assert prof.target_time_s(limit) - prof.target_time_s(limit - 16) < 1e-3
    r = runner("v4flash-b300")
    s64, s128 = r.summary("fixed:7", 64), r.summary("fixed:7", 128)
    assert 64 * 8 < s64["steady_mean_batch_tokens"] < limit < s128["steady_mean_batch_tokens"]
    assert s128["steady_mean_step_ms"] > 2.2 * s64["steady_mean_step_ms"]
    assert s128["output_throughput"] < 0.95 * s64["output_throughput"]
