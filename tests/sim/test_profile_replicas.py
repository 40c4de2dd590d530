"""How many replicas a run simulates when it names no count: the profile's
``default_replicas`` (a profile fitted to one vLLM server says 1), else four; a count
given anywhere (option, config file, preset, Python) wins, and the deployment line says
when the profile chose."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from typer.testing import CliRunner

from dspark_sim.calibration.profile import load_profile
from dspark_sim.cli import app
from dspark_sim.errors import InputError
from dspark_sim.sim.api import simulate
from dspark_sim.sim.config import DeploymentConfig, SimConfig, WorkloadConfig, resolve_config
from dspark_sim.sim.shard import simulate_replicas
from dspark_sim.validation.vllm_fit import make_profile, pooled_trace, read_bench_runs

RECORDED = Path(__file__).parents[1] / "data" / "vllm-cpu" / "run-2" / "runs"
SMALL = WorkloadConfig(qps=20.0, num_requests=40, lengths="fixed:32:8")
runner = CliRunner()


@pytest.fixture(scope="module")
def two_replica_profile(tmp_path_factory) -> Path:
    """The default profile, saying its runs are two replicas unless told."""
    path = tmp_path_factory.mktemp("prof") / "two.toml"
    path.write_text(replace(load_profile(None), default_replicas=2).to_toml())
    return path


def test_the_profiles_count_is_the_default_and_the_deployment_line_says_so(two_replica_profile):
    cfg = SimConfig(workload=SMALL, deployment=DeploymentConfig(profile=str(two_replica_profile)))
    assert cfg.deployment.replicas is None
    r = simulate(cfg)
    assert r.summary["replicas"] == 2 and r.config.deployment.replicas == 2
    assert r.summary["num_gpus"] == 2 * r.summary["gpus_per_replica"]
    assert "2 decode replica(s)" in r.summary["deployment"]
    assert "the profile's default_replicas; --replicas replaces it" in r.summary["deployment"]
    # a count given in Python wins, and then the line does not credit the profile
    three = simulate(replace(cfg, deployment=replace(cfg.deployment, replicas=3)))
    assert three.summary["replicas"] == 3 and "default_replicas" not in three.summary["deployment"]
    # the replica groups of a sharded run are the profile's count too
    sharded, _why = simulate_replicas(cfg, executor="serial", workers=2)
    assert sharded.summary["replicas"] == 2


def test_a_profile_without_one_keeps_four_replicas():
    s = simulate(SimConfig(workload=SMALL)).summary
    assert s["replicas"] == 4 and "default_replicas" not in s["deployment"]
    assert load_profile(None).default_replicas is None


def test_option_config_file_and_preset_each_win_over_the_profile(two_replica_profile, tmp_path):
    p = str(two_replica_profile)
    assert resolve_config(options={"profile": p}).deployment.replicas is None
    assert resolve_config(options={"profile": p, "replicas": 3}).deployment.replicas == 3
    assert resolve_config(preset_name="single-replica",
                          options={"profile": p}).deployment.replicas == 1
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[deployment]\nprofile = "{p}"\nreplicas = 5\n')
    assert resolve_config(config_path=cfg).deployment.replicas == 5

    def replicas_of(*args: str) -> int:
        out = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        r = runner.invoke(app, ["run", "--profile", p, "--qps", "20", "--num-requests", "40",
                                "--lengths", "fixed:32:8", "--quiet", "--out", str(out),
                                *args])
        assert r.exit_code == 0, r.output
        return json.loads((out / "summary.json").read_text())["replicas"]

    assert replicas_of() == 2
    assert replicas_of("--replicas", "1") == 1


def test_a_sweep_point_on_the_profile_runs_its_count(two_replica_profile, tmp_path):
    r = runner.invoke(app, ["sweep", "--out", str(tmp_path / "sw"), "--policies", "none",
                            "--profiles", str(two_replica_profile), "--qps", "20",
                            "--num-requests", "40", "--lengths", "fixed:32:8",
                            "--executor", "serial", "--quiet"])
    assert r.exit_code == 0, r.output
    assert pl.read_parquet(tmp_path / "sw" / "results.parquet")["replicas"].to_list() == [2]


@pytest.mark.parametrize("bad", ["0", '"two"', "2000", "1.5"])
def test_a_bad_count_is_refused_naming_the_file_and_key(tmp_path, bad):
    text = load_profile(None).to_toml().replace("[profile]\n",
                                                f"[profile]\ndefault_replicas = {bad}\n", 1)
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(InputError, match=r"bad\.toml \[profile\].*'default_replicas'"):
        load_profile(path)


def test_the_count_survives_a_round_trip(two_replica_profile):
    prof = load_profile(two_replica_profile)
    assert prof.default_replicas == 2
    assert "default_replicas = 2" in prof.to_toml()
    assert "default_replicas" not in load_profile(None).to_toml()


def test_a_profile_fitted_to_vllm_runs_is_one_server_and_its_trace_the_bench_requests():
    prof = make_profile(np.ones(7), name="f", max_batched_tokens=1024,
                        limits=load_profile(None).limits)
    assert prof.default_replicas == 1
    runs = read_bench_runs([RECORDED])
    trace = pooled_trace(runs)
    assert trace.has_lengths  # so `--lengths trace` replays the bench's own requests
    rows_from = next(r for r in runs if r.name == trace.meta.extra["request_rows_from"])
    assert trace.req_prompt_tokens.tolist() == rows_from.prompt_tokens.tolist()
    assert trace.req_output_tokens.tolist() == rows_from.output_tokens.tolist()
