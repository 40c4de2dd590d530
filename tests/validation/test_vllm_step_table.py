"""The fitted step's shape: linear in the batch, or its own step time at each batch a none
run decodes, and the rule that picks between them; and the per-load pick's tolerance.
Fast: no fit runs (the fits on the recorded runs are in test_vllm_loop)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import polars as pl
import pytest
from timed_runs import timed_run
from typer.testing import CliRunner

from dspark_sim.calibration.profile import EngineLimits
from dspark_sim.cli import app
from dspark_sim.errors import InputError
from dspark_sim.validation.vllm_compare import _regimes
from dspark_sim.validation.vllm_fit import (
    MIN_GAPS,
    PARAMS,
    StepModel,
    _Fit,
    _gap_misses,
    _linear_misses,
    decode_gaps,
    fit_profile,
    knot_starts,
    make_profile,
    measured_decode_steps,
    read_bench_runs,
    step_model,
)
from dspark_sim.validation.vllm_repeats import group_points

RUN3 = Path(__file__).parents[1] / "data" / "vllm-cpu" / "run-3" / "runs"
LIMITS = EngineLimits(max_num_seqs=64, max_num_batched_tokens=1024)


@pytest.fixture(scope="module")
def runs():
    return read_bench_runs([RUN3])


def test_linear_model_is_fixed_plus_token_times_batch():
    tokens, step = StepModel().target_table(np.array([10.0, 0.5, 0, 0, 0]), 1024)
    assert tokens.tolist() == [1, 1024]
    assert step.tolist() == pytest.approx([10.5, 10.0 + 0.5 * 1024])
    assert StepModel().names == PARAMS


def test_knots_carry_their_own_step_and_the_token_slope_continues_past_the_last():
    model = StepModel((1, 2, 4))
    theta = np.array([64.0, 73.0, 50.0, 2.0, 0.1, 0.2, 30.0])
    tokens, step = model.target_table(theta, 1024)
    assert tokens.tolist() == [1, 2, 4, 1024]
    assert step.tolist() == pytest.approx([64.0, 73.0, 50.0, 50.0 + 2.0 * 1020])
    assert model.names[:4] == ("step_ms@1", "step_ms@2", "step_ms@4", "token_ms")
    prof = make_profile(theta, name="t", max_batched_tokens=1024, limits=LIMITS, model=model)
    # a step of 4 tokens is cheaper than one of 2: the table keeps what the runs measured
    assert prof.target_time_s(4) < prof.target_time_s(2) > prof.target_time_s(1)
    assert prof.target_time_s(3) == pytest.approx((73.0 + 50.0) / 2 / 1e3)
    assert prof.request_s == pytest.approx(0.1e-3)
    assert prof.logits_s_per_row == pytest.approx(0.2e-3)
    assert prof.frontend_s_per_request == pytest.approx(30e-3)


def test_below_the_first_knot_its_slope_continues_down_and_stays_positive():
    tokens, step = StepModel((4, 8)).target_table(np.array([50.0, 60.0, 2.0]), 512)
    assert tokens.tolist() == [1, 4, 8, 512] and step[0] == pytest.approx(50.0 - 2.0 * 3)
    _, steep = StepModel((4, 8)).target_table(np.array([5.0, 60.0, 20.0]), 512)
    assert steep[0] == pytest.approx(2.5)  # never below half the first knot's step


def test_each_token_gap_is_labelled_with_the_batch_decoding_at_its_midpoint():
    # request 0 decodes from 1.0 s: gaps of 0.1 s to 1.3 s; request 1 decodes from 1.15 s
    # to 1.55 s, so 0's second and third gaps and 1's first two overlap it
    run = timed_run([0.0, 0.5], [1.0, 0.65], [[0.1, 0.1, 0.1], [0.1, 0.1, 0.2]])
    gaps = decode_gaps(run)
    assert sorted(gaps) == [1, 2]
    assert sorted(gaps[1].tolist()) == pytest.approx([100.0, 200.0])
    assert sorted(gaps[2].tolist()) == pytest.approx([100.0] * 4)
    assert decode_gaps(replace(run, k=3)) == {}  # a speculative step carries several tokens
    assert decode_gaps(replace(run, itl_s=None)) == {}


def test_knots_are_the_batches_the_none_runs_decode_often_enough(runs):
    knots = step_model(runs, 1024).knots
    # every closed-loop concurrency, and the open loop's 3 and 5 in flight
    assert knots == (1, 2, 3, 4, 5, 8, 16)
    counts = {b: sum(len(decode_gaps(r).get(b, ())) for r in runs) for b in range(1, 17)}
    assert all(counts[b] >= MIN_GAPS for b in knots)
    assert all(counts[b] < MIN_GAPS for b in set(range(1, 17)) - set(knots))
    assert step_model(runs, 8).knots == (1, 2, 3, 4, 5)
    untimed = [replace(r, itl_s=None) for r in runs]
    assert step_model(untimed, 1024).knots == (1, 2, 4, 8, 16)  # the concurrencies
    assert step_model([r for r in untimed if r.concurrency in (None, 4)], 1024) == StepModel()
    assert step_model([r for r in runs if r.k], 1024) == StepModel()


def test_a_knots_measured_step_is_its_median_gap_and_starts_fall_back_to_tpot(runs):
    model = step_model(runs, 1024)
    steps = measured_decode_steps(runs, model)
    two = np.concatenate([decode_gaps(r).get(2, np.zeros(0)) for r in runs])
    assert steps[2] == pytest.approx(float(np.median(two)))
    assert steps[4] < steps[1] < steps[2]  # the recorded CPU server's shape
    untimed = [replace(r, itl_s=None) for r in runs]
    starts = knot_starts(untimed, StepModel((1, 2)))
    none_c2 = [r.measured["median_tpot_ms"] for r in untimed if r.name == "none@c2"]
    assert measured_decode_steps(untimed, StepModel((1, 2))) == {}
    assert starts[2] in none_c2


def _fit_with_tpot(points, tpot_by_name: dict[str, float]) -> _Fit:
    sims = [{"median_tpot_ms": tpot_by_name.get(p.run.name, p.run.measured["median_tpot_ms"])}
            for p in points]
    return _Fit(StepModel(), np.ones(5), sims, np.zeros(1), np.zeros((1, 1)), 1, 1, None, {})


def test_linear_misses_only_beyond_what_a_points_repeats_explain(runs):
    points = group_points([r for r in runs if r.k == 0])
    c2 = next(p for p in points if p.run.name == "none@c2")
    spread = c2.spread("median_tpot_ms")
    measured = c2.run.measured["median_tpot_ms"]
    assert not _linear_misses(_fit_with_tpot(points, {}), points)
    inside = measured * np.exp(2.5 * max(spread, 0.02))
    outside = measured * np.exp(3.5 * max(spread, 0.02))
    assert not _linear_misses(_fit_with_tpot(points, {"none@c2": inside}), points)
    assert _linear_misses(_fit_with_tpot(points, {"none@c2": outside}), points)
    # an open-loop point decodes no known batch, so its miss says nothing about the table
    assert not _linear_misses(_fit_with_tpot(points, {"none@r0.5": 10 * measured}), points)
    # nor does a point measured fewer than three times: its spread is not known
    single = group_points([r for r in runs if r.k == 0 and r.round == 1])
    assert not _linear_misses(_fit_with_tpot(single, {"none@c2": 10 * measured}), single)


def _gapped(step_ms, scales: tuple[float, ...]) -> tuple[list, dict]:
    """Fake none runs, one a round at each scale (the host's speed that round), whose
    token gaps at batch ``b`` scatter by +-1 % around ``step_ms(b) x scale``."""
    rng = np.random.default_rng(0)
    runs, gaps = [], {}
    for n, scale in enumerate(scales, 1):
        run = SimpleNamespace(round=n)
        gaps[id(run)] = {b: step_ms(b) * scale * rng.uniform(0.99, 1.01, 500)
                         for b in (1, 2, 3, 4, 8, 16)}
        runs.append(run)
    return runs, gaps


@pytest.mark.parametrize(("step_ms", "scales", "tabled"), [
    (lambda b: 50.0 + 2.5 * b, (1.0, 1.03, 0.98), False),  # linear, rounds drifting
    (lambda b: (50.0 + 2.5 * b) * (1.25 if b == 2 else 1.0), (1.0, 1.03, 0.98), True),
    # the same bump, in rounds scattered by +-30 %: the drift could explain it
    (lambda b: (50.0 + 2.5 * b) * (1.25 if b == 2 else 1.0), (1.0, 1.3, 0.7), False),
    # two rounds: their scatter is not known
    (lambda b: (50.0 + 2.5 * b) * (1.25 if b == 2 else 1.0), (1.0, 1.06), False),
])
def test_gap_misses_reads_the_step_from_each_rounds_token_gaps(monkeypatch, step_ms, scales,
                                                              tabled):
    from dspark_sim.validation import vllm_fit

    runs, gaps = _gapped(step_ms, scales)
    monkeypatch.setattr(vllm_fit, "decode_gaps", lambda r: gaps[id(r)])
    assert _gap_misses(runs, StepModel((1, 2, 3, 4, 8, 16))) is tabled
    # runs without rounds (single measurements) never table
    for r in runs:
        r.round = None
    assert not _gap_misses(runs, StepModel((1, 2, 3, 4, 8, 16)))


def test_an_unknown_step_table_is_refused_naming_the_option(runs, tmp_path):
    with pytest.raises(InputError, match="--step-table"):
        fit_profile(runs[:1], engine=None, step_table="cubic")
    r = CliRunner().invoke(app, ["calibrate", "vllm", str(RUN3), "--out", str(tmp_path / "o"),
                                 "--step-table", "cubic"])
    assert r.exit_code == 2 and "--step-table" in r.output
    assert len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def _load(rows: list[tuple[str, int, float, float]]) -> pl.DataFrame:
    return pl.DataFrame([{"run": f"{s}@c8", "setting": s, "k": k, "load": "C=8",
                          "figure": "output_throughput", "measured": m, "simulated": sim,
                          "spread": 0.0, "lowest": m} for s, k, m, sim in rows])


def test_a_pick_within_the_range_of_the_best_repeats_is_not_a_miss():
    t = _load([("none", 0, 65.7, 65.4), ("ngram-k1", 1, 69.3, 64.2),
               ("ngram-k3", 3, 63.4, 66.2)])
    assert not _regimes(t)["pick_ok"][0]  # single measurements: 3 % is all the slack
    lowest = t.with_columns(lowest=pl.when(pl.col("setting") == "ngram-k1")
                            .then(59.3).otherwise(pl.col("lowest")))
    r = _regimes(lowest).row(0, named=True)
    assert r["pick_ok"] and r["simulated_best"] == "ngram-k3"
    assert r["pick_shortfall"] == pytest.approx(1 - 63.4 / 69.3)
    above = lowest.with_columns(measured=pl.when(pl.col("setting") == "ngram-k3")
                                .then(58.0).otherwise(pl.col("measured")))
    assert not _regimes(above)["pick_ok"][0]


def test_a_fit_profile_of_knots_writes_and_reads_back(tmp_path):
    from dspark_sim.calibration.profile import load_profile

    model = StepModel((1, 2, 4))
    prof = make_profile(np.array([64.0, 73.0, 50.0, 2.0, 0.1, 0.2, 30.0, 1.0, 0.5]),
                        name="t", max_batched_tokens=1024, limits=LIMITS, model=model)
    path = tmp_path / "p.toml"
    path.write_text(prof.to_toml(), encoding="utf-8")
    back = load_profile(path)
    assert back.tokens.tolist() == prof.tokens.tolist()
    assert np.allclose(back.step_s, prof.step_s)
    assert back.interpolation == "linear"
    assert back.target_time_s(3) == pytest.approx(prof.target_time_s(3))
    assert replace(back, source="x").drafts["vllm"].time(2, 3) == pytest.approx(
        prof.drafts["vllm"].time(2, 3))
