"""Calibration pays off in the simulator: lower ECE, confidence throughput rises or stays."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from dspark_sim.calibration.fit import calibrate_confidence
from dspark_sim.cli import app
from dspark_sim.sim.api import simulate
from dspark_sim.sim.config import DeploymentConfig, SimConfig, WorkloadConfig
from dspark_sim.traces.synth import DSPARK_CURVES, SignalModel, synth_drafter


@pytest.fixture(scope="module")
def overconfident(tmp_path_factory):
    t = synth_drafter(DSPARK_CURVES, requests_per_domain=24, positions=384, seed=5,
                      signal=SignalModel(overconfidence=2.5))
    cmap, report = calibrate_confidence(t, holdout=0.3, seed=0)
    path = tmp_path_factory.mktemp("cal") / "sts.toml"
    cmap.save(path)
    return t, path, report


def test_calibration_lowers_ece(overconfident):
    _, _, report = overconfident
    assert report["ece_before_mean"] > 0.08
    assert report["ece_after_mean"] < 0.3 * report["ece_before_mean"]
    assert report["auc_after_mean"] >= report["auc_before_mean"] - 0.01


@pytest.mark.parametrize("policy", ["confidence", "confidence-async"])
def test_calibrated_confidence_policy_throughput_rises_or_stays(overconfident, policy):
    t, path, _ = overconfident
    wl = WorkloadConfig(arrival="closed", max_concurrency=192, num_requests=576,
                        lengths="fixed:1024:256")
    base = SimConfig(policy=policy, deployment=DeploymentConfig(replicas=1), workload=wl,
                     calibration="identity")
    raw = simulate(base, trace=t).summary
    cal = simulate(SimConfig(**{**base.__dict__, "calibration": str(path)}), trace=t).summary
    assert cal["calibration"] == str(path)
    # "rises or stays": within 2 % (sampling noise of one closed-loop run)
    assert cal["output_throughput"] >= 0.98 * raw["output_throughput"]


def test_calibrate_confidence_cli(tmp_path):
    runner = CliRunner()
    out = tmp_path / "map.toml"
    html = tmp_path / "rel.html"
    r = runner.invoke(app, ["calibrate", "confidence", "--trace", "dspark-synthetic",
                            "--out", str(out), "--html", str(html)])
    assert r.exit_code == 0, r.output
    assert "ECE before" in r.output and out.is_file() and html.stat().st_size > 100_000
    r = runner.invoke(app, ["run", "--calibration", str(out), "--num-requests", "60",
                            "--replicas", "1", "--quiet"])
    assert r.exit_code == 0, r.output
    bad = tmp_path / "bad.toml"
    bad.write_text("[calibration]\nmethod = 'temperature'\ntemperatures = [-1.0]\n")
    r = runner.invoke(app, ["run", "--calibration", str(bad)])
    assert r.exit_code == 2 and str(bad) in r.output and "Traceback" not in r.output
