"""Confidences for traces that carry none (``--conf-source``) and drafting past the
recorded positions (``--extrapolate-gamma``): dspark_sim.calibration.confidence_source and its wiring
into runs."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from input_checks import one_line_error
from typer.testing import CliRunner

from dspark_sim.calibration.confidence_source import (
    apply_conf_source,
    extend_gamma,
    parse_conf_source,
)
from dspark_sim.calibration.fit import auc as rank_auc
from dspark_sim.cli import app
from dspark_sim.errors import InputError
from dspark_sim.sim.api import simulate
from dspark_sim.sim.config import preset
from dspark_sim.traces.schema import AcceptanceTrace, TraceMeta, load_trace
from dspark_sim.traces.synth import synth_iid

runner = CliRunner()

# a /metrics scrape of one model on two engines (K = 3): survival 0.8, 0.55, 0.3
SCRAPE = """# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 600.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 400.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 480.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="0"} 320.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 330.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="1"} 220.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 180.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="2"} 120.0
"""


def _hand_trace(rows: list[list[int]], gamma: int) -> AcceptanceTrace:
    lengths = [len(r) for r in rows]
    return AcceptanceTrace(
        meta=TraceMeta(drafter="hand", target="hand", gamma_max=gamma, domains=("chat",)),
        accept_len=np.concatenate([np.asarray(r, np.int8) for r in rows]),
        conf=None, req_offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        req_domain=np.array(["chat"] * len(rows)), req_ids=np.arange(len(rows), dtype=np.int32))


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """The scrape imported as `traces import --format vllm-counters` writes it."""
    d = tmp_path_factory.mktemp("scrape")
    (d / "metrics.txt").write_text(SCRAPE)
    out = d / "t.parquet"
    r = runner.invoke(app, ["traces", "import", "--format", "vllm-counters",
                            str(d / "metrics.txt"), "--out", str(out)])
    assert r.exit_code == 0, r.output
    return out


def _reached(trace: AcceptanceTrace) -> tuple[np.ndarray, np.ndarray]:
    m = trace.accept_len.astype(np.int64)[:, None]
    j = np.arange(trace.gamma_max)[None, :]
    return j <= m, j < m


def test_position_source_is_the_conditional_acceptance():
    # position 3 is never reached (no chain accepts 2): its rate is NaN, its conf 0
    t = _hand_trace([[0, 1, 0, 1, 1, 0], [1, 0, 0, 1]], 3)
    got, report = apply_conf_source(t, "position")
    cond = t.conditional_acceptance()
    assert np.isnan(cond[2])
    assert got.conf.dtype == np.float32 and got.conf.shape == (t.num_positions, 3)
    assert np.allclose(got.conf, np.nan_to_num(cond, nan=0.0)[None, :].astype(np.float32))
    assert report.source == "position" and report.ece == pytest.approx(0.0, abs=1e-6)
    assert got.accept_len is t.accept_len  # the outcomes are the trace's own


@pytest.mark.parametrize("auc", [0.7, 0.85, 0.95])
def test_synthetic_source_reaches_its_auc_and_is_calibrated(auc):
    t = synth_iid(0.75, 5, num_requests=64, positions=2048, seed=4)
    got, report = apply_conf_source(t, f"synthetic:{auc}", seed=1)
    assert got.conf.dtype == np.float32
    assert got.conf.min() >= 1e-6 and got.conf.max() <= 1 - 1e-6
    assert report.auc == pytest.approx(auc, abs=0.02) and report.ece < 0.03
    # the report is measured, not stated: recompute it from the confidences
    reached, accepted = _reached(t)
    assert rank_auc(got.conf[reached], accepted[reached]) == pytest.approx(report.auc, abs=1e-4)


def test_synthetic_source_per_position_auc_on_a_decaying_trace(imported):
    # the imported trace's positions differ in rate (0.8, 0.69, 0.55): pooled, the
    # position itself separates too; at each position the AUC is the stated one
    t = load_trace(imported)
    got, report = apply_conf_source(t, "synthetic:0.85", seed=0)
    reached, accepted = _reached(t)
    for k in range(t.gamma_max):
        r = reached[:, k]
        assert rank_auc(got.conf[r, k], accepted[r, k]) == pytest.approx(0.85, abs=0.02), k
        assert got.conf[r, k].mean() == pytest.approx(accepted[r, k].mean(), abs=0.02), k
    assert report.ece < 0.03 and report.auc >= 0.85 - 0.02


def test_same_seed_same_bytes_other_seed_differs():
    t = synth_iid(0.8, 4, num_requests=16, positions=256, seed=0)
    a = apply_conf_source(t, "synthetic:0.85", seed=3)[0].conf
    b = apply_conf_source(t, "synthetic:0.85", seed=3)[0].conf
    c = apply_conf_source(t, "synthetic:0.85", seed=4)[0].conf
    assert a.tobytes() == b.tobytes() and a.tobytes() != c.tobytes()
    e1, e2 = (extend_gamma(t, 9, seed=3)[0].accept_len for _ in range(2))
    assert e1.tobytes() == e2.tobytes()
    assert e1.tobytes() != extend_gamma(t, 9, seed=4)[0].accept_len.tobytes()


def test_trace_source_keeps_the_trace_conf_and_refuses_none():
    t = load_trace("dspark-synthetic")
    got, report = apply_conf_source(t, "trace")
    assert got.conf is t.conf and 0.5 < report.auc < 1
    bare = replace(t, conf=None)
    with pytest.raises(InputError, match="position or synthetic:AUC"):
        apply_conf_source(bare, "trace")


@pytest.mark.parametrize("spec,needle", [
    ("", "is empty"), ("  ", "is empty"), ("bogus", "unknown source 'bogus'"),
    ("synthetic", "needs a number"), ("synthetic:abc", "needs a number"),
    ("synthetic:0.5", "0.5 < AUC < 1"), ("synthetic:1", "0.5 < AUC < 1"),
    ("synthetic:nan", "0.5 < AUC < 1"), ("position:3", "takes no argument"),
])
def test_bad_specs_are_one_line_errors(spec, needle):
    with pytest.raises(InputError, match=needle) as exc:
        parse_conf_source(spec)
    assert exc.value.where == "--conf-source" and "\n" not in str(exc.value)


def test_extend_gamma_keeps_recorded_positions_and_adds_a_geometric_tail():
    t = synth_iid(0.8, 3, num_requests=64, positions=2048, seed=2)
    t = replace(t, conf=np.full((t.num_positions, 3), 0.8, np.float32))
    got, report = extend_gamma(t, 8, seed=0)
    assert got.gamma_max == 8 and got.accept_len.dtype == np.int8
    for k in (1, 2, 3):  # min(k, m) is unchanged for every row
        assert got.served_tau(k) == t.served_tau(k)
    assert (np.minimum(got.accept_len, 3) == t.accept_len).all()
    rate = t.conditional_acceptance()[2]
    assert report.rate == pytest.approx(rate, abs=1e-4)
    assert report.text == f"positions 4-8 extrapolated from position 3's conditional " \
                          f"acceptance {rate:.2f}"
    m = got.accept_len.astype(np.int64)
    for k in range(4, 9):
        reached = int((m >= k - 1).sum())
        q = (m >= k).sum() / reached
        assert abs(q - rate) < 4 * np.sqrt(rate * (1 - rate) / reached), k
    assert got.conf.shape == (t.num_positions, 8)
    assert np.allclose(got.conf[:, 3:], np.float32(rate)) and (got.conf[:, :3] == 0.8).all()


def test_extend_gamma_limits():
    t = synth_iid(0.8, 3, num_requests=4, positions=64, seed=2)
    same, report = extend_gamma(t, 2)
    assert same.gamma_max == 3 and same.accept_len is t.accept_len
    assert report.text == "none (the trace records 3 draft positions)"
    assert extend_gamma(t, 127)[0].accept_len.max() <= 127
    for bad in (0, 128, 2.5, True):
        with pytest.raises(InputError, match="--extrapolate-gamma"):
            extend_gamma(t, bad)
    v2 = load_trace("selfspec-synthetic")
    with pytest.raises(InputError, match="schema-v2"):
        extend_gamma(v2, v2.gamma_max + 1)


def test_drafts_never_proposed_are_never_judged():
    # an n-gram drafter proposes nothing at some positions (draft_tokens 0): those are
    # not rejections, neither in the rates nor in the measured ECE and AUC
    t = synth_iid(0.8, 3, num_requests=32, positions=1024, seed=1)
    none = np.random.default_rng(0).random(t.num_positions) < 0.3
    t = replace(t, accept_len=np.where(none, 0, t.accept_len).astype(np.int8),
                draft_tokens=np.where(none, 0, 3).astype(np.int8))
    got, report = apply_conf_source(t, "position")
    assert got.conf[0] == pytest.approx([0.8, 0.8, 0.8], abs=0.02)
    assert report.ece < 0.01
    longer, _ = extend_gamma(t, 6, seed=0)
    assert set(np.unique(longer.draft_tokens)) == {0, 6}
    assert (longer.accept_len <= longer.draft_tokens).all()


def test_conf_source_leaves_the_run_stream_alone():
    # fixed:3 reads no confidences: drawing them must not move the arrivals, lengths or
    # trace rows (their own random stream), so the two runs serve the same requests alike
    cfg = replace(preset("tiny"), policy="fixed:3", trace="dspark-synthetic")
    plain = simulate(cfg)
    synth = simulate(replace(cfg, conf_source="synthetic:0.85"))
    assert plain.requests.equals(synth.requests)
    assert "conf_source" not in plain.summary
    assert synth.summary["conf_source"] == "synthetic:0.85"
    assert 0.8 < synth.summary["conf_source_auc"] < 0.9


def test_conf_source_uses_the_identity_map_unless_given():
    cfg = replace(preset("tiny"), trace="dspark-synthetic")
    base = simulate(cfg).summary
    assert base["calibration"] == "builtin:dspark-synthetic-sts"
    assert simulate(replace(cfg, conf_source="position")).summary["calibration"] == "<identity>"
    given = simulate(replace(cfg, conf_source="synthetic:0.85",
                             calibration="dspark-synthetic-sts")).summary
    assert given["calibration"] == "builtin:dspark-synthetic-sts"
    assert simulate(replace(cfg, conf_source="trace")).summary["calibration"] == \
        "builtin:dspark-synthetic-sts"


POLICIES = ["none", "fixed:3", "confidence", "confidence-async", "vllm-adaptive", "dfly"]


@pytest.mark.parametrize("policy", POLICIES)
def test_cli_runs_chain_policies_on_an_imported_scrape(tmp_path, imported, policy):
    out = tmp_path / "run"
    args = ["run", "--trace", str(imported), "--policy", policy, "--preset", "tiny",
            "--conf-source", "synthetic:0.85", "--out", str(out)]
    if policy == "none":  # no drafter: the trace and the confidence source go unread: refused
        one_line_error(runner.invoke(app, args), "--trace", "--policy none")
        without_trace = args[:1] + args[3:]
        one_line_error(runner.invoke(app, without_trace), "--conf-source", "--policy none")
        assert not out.exists()
        return
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    s = json.loads((out / "summary.json").read_text())
    assert s["conf_source"] == "synthetic:0.85" and s["completed"] == s["num_requests"]
    assert "synthetic:0.85" in r.output
    assert s["conf_source_ece"] < 0.03 and 0.83 < s["conf_source_auc"] < 0.9
    assert s["calibration"] == "<identity>" and "trace_extrapolation" not in s


def test_cli_extrapolates_for_longer_drafts(tmp_path, imported):
    args = ["run", "--trace", str(imported), "--preset", "tiny", "--policy", "fixed:7"]
    one_line_error(runner.invoke(app, args), "--policy", "use K <= 3", "--extrapolate-gamma 7")
    out = tmp_path / "run"
    r = runner.invoke(app, [*args, "--extrapolate-gamma", "7", "--out", str(out)])
    assert r.exit_code == 0, r.output
    s = json.loads((out / "summary.json").read_text())
    assert s["trace_gamma_max"] == 7 and s["gamma_max"] == 7
    assert s["trace_extrapolation"].startswith("positions 4-7 extrapolated from position 3's")
    assert "conf_source" not in s and "positions 4-7 extrapolated" in r.output
    # the confidence policies take the extrapolated positions with a source's confidences
    r = runner.invoke(app, ["run", "--trace", str(imported), "--preset", "tiny",
                            "--extrapolate-gamma", "6", "--conf-source", "position",
                            "--quiet"])
    assert r.exit_code == 0, r.output


def test_cli_without_a_conf_source_says_how_to_proceed(imported):
    one_line_error(runner.invoke(app, ["run", "--trace", str(imported), "--preset", "tiny",
                                       "--policy", "confidence"]),
                   str(imported), "no 'conf' column", "--conf-source position or synthetic:AUC")


@pytest.mark.parametrize("args,needles", [
    (["--conf-source", "bogus"], ["--conf-source", "unknown source 'bogus'"]),
    (["--conf-source", "synthetic:0.3"], ["--conf-source", "0.5 < AUC < 1"]),
    (["--conf-source", "synthetic:x"], ["--conf-source", "needs a number"]),
    (["--conf-source", ""], ["--conf-source"]),
    (["--extrapolate-gamma", "0"], ["--extrapolate-gamma", "positive integer"]),
    (["--extrapolate-gamma", "128"], ["--extrapolate-gamma", "limit of 127"]),
])
def test_cli_bad_values_are_refused_before_simulating(no_simulation, args, needles):
    one_line_error(runner.invoke(app, ["run", "--preset", "tiny", *args]), *needles)


def test_config_file_conf_source_is_blamed_on_its_key(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[run]\nconf_source = "synthetic:2"\n')
    one_line_error(runner.invoke(app, ["run", "--config", str(cfg), "--preset", "tiny"]),
                   f"{cfg} [run] conf_source", "0.5 < AUC < 1")
