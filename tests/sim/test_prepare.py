"""``sim.api.prepare``: every check of fit between policy, trace and settings made once,
so a setting the policy never reads is refused alike by ``simulate()``, ``run``, a
config file and ``sweep``."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from dspark_sim.cli import app
from dspark_sim.errors import InputError
from dspark_sim.sim.api import RunInputs, prepare, simulate
from dspark_sim.sim.config import DeploymentConfig, SimConfig, WorkloadConfig

TINY = SimConfig(policy="mtp1", deployment=DeploymentConfig(replicas=1),
                 workload=WorkloadConfig(qps=5.0, num_requests=10, lengths="fixed:32:16"))
# mtp1 drafts one token: the block drafter's draft length is nothing it reads
UNREAD = "--gamma-max: 5 sets the block drafter's draft length, but --policy"


def _refusal(argv: list[str]) -> str:
    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 2, r.output
    return " ".join(r.output.split())


def test_simulate_refuses_a_setting_the_policy_never_reads():
    from dataclasses import replace

    with pytest.raises(InputError) as exc:
        simulate(replace(TINY, gamma_max=5))
    assert exc.value.where == "--gamma-max"
    assert "mtp1 (drafter mtp1) never reads it" in str(exc.value)


def test_run_refuses_it_from_the_same_rule():
    out = _refusal(["run", "--policy", "mtp1", "--gamma-max", "5", "--replicas", "1",
                    "--qps", "5", "--num-requests", "10", "--lengths", "fixed:32:16"])
    assert f"error: {UNREAD} mtp1 (drafter mtp1) never reads it" in out


def test_a_config_file_key_is_refused_naming_the_key(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[run]\npolicy = "mtp1"\ngamma_max = 5\n[deployment]\nreplicas = 1\n'
                   '[workload]\nqps = 5.0\nnum_requests = 10\nlengths = "fixed:32:16"\n')
    out = _refusal(["run", "--config", str(cfg)])
    assert "gamma_max" in out and "never reads it" in out and str(cfg) in out


def test_sweep_refuses_it_for_every_policy_of_its_grid(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[run]\ngamma_max = 5\n")
    out = _refusal(["sweep", "--out", str(tmp_path / "s"), "--policies", "mtp1,none",
                    "--config", str(cfg), "--qps", "5", "--num-requests", "10"])
    assert "gamma_max" in out and "none of --policies mtp1, none reads it" in out


def test_a_sweep_point_of_none_shares_the_grids_trace():
    """``none`` reads no trace; a sweep pairs it with its ``--traces`` (checked against
    the whole grid), which a lone run would refuse."""
    from dataclasses import replace

    point = replace(TINY, policy="none", trace="dspark-synthetic")
    with pytest.raises(InputError, match="never reads it"):
        prepare(point)
    assert prepare(point, grid_point=True).trace is None


def test_the_record_is_built_once_and_simulated_as_given():
    inputs = prepare(TINY)
    assert isinstance(inputs, RunInputs) and inputs.policy.name == "mtp1"
    assert inputs.cfg.deployment.replicas == 1 and inputs.trace is not None
    assert simulate(inputs).summary == simulate(TINY).summary
    with pytest.raises(TypeError, match="give them to prepare"):
        simulate(inputs, trace="dspark-synthetic")


def test_a_draft_length_past_the_trace_is_refused_by_prepare():
    from dataclasses import replace

    with pytest.raises(InputError, match="verifies 9 draft tokens"):
        prepare(replace(TINY, policy="fixed:9", trace="dspark-synthetic"))
