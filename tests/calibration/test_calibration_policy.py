"""Calibration pays off in the simulator: lower ECE, confidence throughput rises or stays."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from typer.testing import CliRunner

from dspark_sim.calibration.confmap import load_calibration
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


def _run_recording_predictions(trace, calibration: str, policy: str, monkeypatch):
    """Simulate, recording for every decision the scheduler's own expectation of the
    drafts it will get accepted: the survivals of the drafts it admitted."""
    from dspark_sim.sim import api

    inner = api.get_policy(policy)
    predicted = []

    def decide(snap):
        ell = inner(snap)
        a = np.asarray(snap.survival)
        predicted.append(float(sum(a[r, :k].sum() for r, k in enumerate(ell.tolist()))))
        return ell

    monkeypatch.setattr(api, "get_policy", lambda spec: replace(inner, decide=decide))
    wl = WorkloadConfig(arrival="closed", max_concurrency=64, num_requests=192,
                        lengths="fixed:512:128")
    cfg = SimConfig(policy=policy, deployment=DeploymentConfig(replicas=1), workload=wl,
                    calibration=calibration)
    s = simulate(cfg, trace=trace).summary
    assert s["budget_limited_steps"] == 0  # every admitted draft was verified
    return sum(predicted), s


@pytest.mark.parametrize("policy", ["confidence", "confidence-async"])
def test_calibration_makes_the_schedulers_expectation_come_true(overconfident, policy,
                                                                monkeypatch):
    """docs/calibration.md: the scheduler multiplies survival into the expected accepted
    length, so survival must be right in absolute terms. Over the whole run, the drafts the
    scheduler expected to be accepted (the sum of the survivals it admitted) against the
    drafts the replay accepted: off by a large factor with the raw over-confident
    confidences, within a few per cent with the fitted map. (Whether that also buys
    throughput depends on the trace and the scheduler; the runs are deterministic.)"""
    t, path, _ = overconfident
    pred_raw, raw = _run_recording_predictions(t, "identity", policy, monkeypatch)
    pred_cal, cal = _run_recording_predictions(t, str(path), policy, monkeypatch)
    assert cal["calibration"] == str(path) and raw["calibration"] == "<identity>"
    err_raw = pred_raw / raw["num_accepted_tokens"] - 1
    err_cal = pred_cal / cal["num_accepted_tokens"] - 1
    assert abs(err_cal) < 0.05, err_cal
    assert abs(err_raw) > 3 * abs(err_cal), (err_raw, err_cal)


def test_the_scheduler_sees_the_calibrated_survival(overconfident, monkeypatch):
    """Every survival row a confidence policy is handed is the map's survival of a trace
    row, cumprod(map(conf)), not the raw cumprod(conf)."""
    from dspark_sim.calibration.confmap import load_calibration
    from dspark_sim.sim import api

    t, path, _ = overconfident
    cmap = load_calibration(path)
    inner = api.get_policy("confidence")
    rows = []

    def decide(snap):
        rows.append(np.array(snap.survival))
        return inner(snap)

    monkeypatch.setattr(api, "get_policy", lambda spec: replace(inner, decide=decide))
    cfg = SimConfig(policy="confidence", deployment=DeploymentConfig(replicas=1),
                    workload=WorkloadConfig(arrival="closed", max_concurrency=8, num_requests=16,
                                            lengths="fixed:64:32"), calibration=str(path))
    simulate(cfg, trace=t)
    seen = np.concatenate(rows)
    mapped = {tuple(r) for r in cmap.survival(t.conf).tolist()}
    raw = {tuple(r) for r in np.cumprod(t.conf.astype(np.float64), axis=1).tolist()}
    assert len(seen) > 100
    assert all(tuple(r) in mapped for r in seen.tolist())
    assert not any(tuple(r) in raw for r in seen.tolist())


def test_calibrate_confidence_cli(tmp_path):
    runner = CliRunner()
    out = tmp_path / "map.toml"
    html = tmp_path / "rel.html"
    r = runner.invoke(app, ["calibrate", "confidence", "--trace", "dspark-synthetic",
                            "--out", str(out), "--html", str(html)])
    assert r.exit_code == 0, r.output
    assert "ECE before" in r.output and out.is_file() and html.stat().st_size > 100_000
    # the default method on the synthetic drafter's over-confident raw confidences: a
    # temperature above 1 at every position of its block
    cmap = load_calibration(out)
    assert cmap.method == "temperature" and cmap.drafter == "dspark-synthetic"
    assert len(cmap.temperatures) == 7 and (cmap.temperatures > 1).all(), cmap.temperatures
    r = runner.invoke(app, ["run", "--calibration", str(out), "--num-requests", "60",
                            "--replicas", "1", "--quiet", "--out", str(tmp_path / "run")])
    assert r.exit_code == 0, r.output
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["calibration"] == str(out) and s["policy"] == "confidence" and s["completed"] == 60
    bad = tmp_path / "bad.toml"
    bad.write_text("[calibration]\nmethod = 'temperature'\ntemperatures = [-1.0]\n")
    r = runner.invoke(app, ["run", "--calibration", str(bad)])
    assert r.exit_code == 2 and str(bad) in r.output and "Traceback" not in r.output
