"""The lone requests' TTFT line: which requests ran alone, the robust line through their
TTFTs against their prompt lengths, when the fit uses it, and how it enters the fit's
residuals and the constants' uncertainty. Fast: synthetic requests, no fit runs (the
fits on the recorded runs are in test_vllm_loop and test_vllm_prefix_recorded)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from dspark_sim.calibration.profile import EngineLimits
from dspark_sim.sim.config import EngineConfig
from dspark_sim.validation.vllm_fit import (
    LINE_WEIGHT,
    MAX_PAIRS,
    MIN_LONE,
    MIN_PROMPT_SPREAD,
    BenchRun,
    FitResult,
    StepModel,
    _Objective,
    lone_requests,
    lone_ttft_ms,
    make_profile,
    profile_line,
    run_config,
    theil_sen,
    ttft_line,
    workload_file,
)
from dspark_sim.validation.vllm_repeats import (
    BOOTSTRAP_SAMPLES,
    constant_uncertainty,
    constants_line,
)

BUDGET = 256
LIMITS = EngineLimits(max_num_seqs=64, max_num_batched_tokens=BUDGET)
ENGINE = EngineConfig(max_num_seqs=64, max_num_batched_tokens=BUDGET,
                      kv_capacity_tokens=100_000, prefill="chunked")


def _run(prompt, send_s, ttft_s, itl_s, *, k=0, concurrency=None) -> BenchRun:
    return BenchRun(Path("x.json"), "none" if not k else f"ngram-k{k}", k, concurrency,
                    None if concurrency else 1.0, np.asarray(prompt, np.int64),
                    np.array([len(g) + 1 for g in itl_s]), np.asarray(send_s, float),
                    {"output_throughput": 10.0, "median_tpot_ms": 50.0,
                     "median_ttft_ms": 300.0}, {}, None, None, (), None,
                    np.asarray(ttft_s, float), tuple(np.asarray(g, float) for g in itl_s))


def _closed_loop(prompt, ttft_ms, decode_s=0.2) -> BenchRun:
    """One request at a time: each sent once the one before has finished."""
    send, t = [], 0.0
    for ttft in ttft_ms:
        send.append(t)
        t += ttft / 1e3 + decode_s + 0.01
    return _run(prompt, send, np.asarray(ttft_ms) / 1e3, [[decode_s / 4] * 4] * len(prompt),
                concurrency=1)


def test_theil_sen_finds_a_known_line_through_outliers_that_pull_least_squares():
    rng = np.random.default_rng(1)
    x = rng.integers(100, 600, 60).astype(float)
    y = 40.0 + 2.5 * x + rng.normal(0, 10, x.size)
    y[:12] += 800.0  # a fifth of the requests slowed by something else
    slope, intercept = theil_sen(x, y)
    assert slope == pytest.approx(2.5, rel=0.04)
    assert intercept == pytest.approx(40.0, abs=25.0)
    ls_slope, ls_intercept = np.polyfit(x, y, 1)
    assert abs(ls_intercept - 40.0) > 100.0  # the plain least squares line is pulled


def test_theil_sen_needs_two_lengths_and_samples_pairs_past_its_bound():
    assert all(math.isnan(v) for v in theil_sen(np.full(5, 300.0), np.arange(5.0)))
    rng = np.random.default_rng(2)
    x = rng.integers(10, 2000, 1000).astype(float)  # 499,500 pairs
    assert x.size * (x.size - 1) // 2 > MAX_PAIRS
    y = 30.0 + 0.05 * x + rng.normal(0, 1, x.size)
    slope, intercept = theil_sen(x, y, seed=3)
    assert slope == pytest.approx(0.05, rel=0.03) and intercept == pytest.approx(30, abs=1)
    assert theil_sen(x, y, seed=3) == (slope, intercept)  # seeded


def test_a_request_is_lone_when_nothing_else_is_in_flight_from_its_send_to_its_first_token():
    # 0 alone; 1 and 2 overlap before 1's first token (2 sent at 1.2 s, 1's first token at
    # 1.3 s); 2's stream ends at 2.0 s, when 3 is sent; 4 is sent while 3 decodes (after
    # its first token at 2.3 s: 3 stays lone, 4 is not)
    run = _run([100, 200, 300, 400, 500], [0.0, 1.0, 1.2, 2.0, 2.35],
               [0.3, 0.3, 0.5, 0.3, 0.3], [[0.1] * 3] * 5)
    assert lone_requests(run).tolist() == [True, False, False, True, False]
    closed = _closed_loop([100, 200, 300], [300.0, 500.0, 700.0])
    assert lone_requests(closed).all()
    assert not lone_requests(replace(closed, k=3)).any()  # a speculative run: not used
    assert not lone_requests(replace(closed, itl_s=None)).any()  # no timings


def test_the_line_of_a_closed_loop_at_c1_is_its_overhead_and_per_token_cost():
    rng = np.random.default_rng(4)
    prompt = rng.integers(150, 700, 36)
    ttft = 45.0 + 2.4 * prompt + rng.normal(0, 15, prompt.size)
    ttft[[3, 17, 29]] *= 1.6  # a co-tenant's stalls
    runs = [_closed_loop(prompt[i::3], ttft[i::3]) for i in range(3)]  # three repeats
    line = ttft_line(runs)
    assert line.requests == 36 and line.unused == ""
    assert line.slope_ms == pytest.approx(2.4, rel=0.05)
    assert line.intercept_ms == pytest.approx(45.0, abs=30.0)
    lo, hi = line.ends
    assert lo == round(np.quantile(prompt, 0.1)) and hi == round(np.quantile(prompt, 0.9))
    # a run with a longer or a shorter prompt set does not change what each request costs
    more = ttft_line([*runs, _closed_loop(prompt + 400, 45.0 + 2.4 * (prompt + 400))])
    assert more.slope_ms == pytest.approx(2.4, rel=0.05)


def test_the_line_is_left_out_where_the_runs_do_not_support_it():
    few = ttft_line([_closed_loop(np.arange(MIN_LONE - 1) * 60 + 100,
                                  50 + 2.0 * (np.arange(MIN_LONE - 1) * 60 + 100))])
    assert f"fewer than {MIN_LONE}" in few.unused
    narrow_prompt = np.tile([300, 305, 310, 312], 5)
    narrow = ttft_line([_closed_loop(narrow_prompt, 50 + 2.0 * narrow_prompt)])
    assert narrow.spread < MIN_PROMPT_SPREAD and "spread" in narrow.unused
    wide = np.tile([300, 420, 500, 610], 5)
    assert ttft_line([_closed_loop(wide, 50 + 2.0 * wide)]).unused == ""
    falling = ttft_line([_closed_loop(wide, 1500 - 2.0 * wide)])
    assert "not positive" in falling.unused
    assert ttft_line([]).requests == 0 and ttft_line([]).unused


def test_bootstrap_shifts_vanish_on_an_exact_line_and_shrink_with_more_requests():
    prompt = np.tile([200, 300, 400, 500, 600], 4)
    exact = ttft_line([_closed_loop(prompt, 60 + 2.0 * prompt)])
    assert np.allclose(exact.shifts(50), 0.0)
    rng = np.random.default_rng(5)

    def spread(n):
        p = rng.integers(200, 600, n)
        return ttft_line([_closed_loop(p, 60 + 2.0 * p + rng.normal(0, 40, n))]).shifts(
            BOOTSTRAP_SAMPLES).std(axis=0)

    small, large = spread(12), spread(200)
    assert (small > 0).all() and (large < small / 2).all()


@pytest.mark.parametrize("model,theta", [
    (StepModel(), [40.0, 2.0, 0.5, 3.0, 25.0]),
    (StepModel((1, 2, 4)), [60.0, 70.0, 50.0, 2.0, 0.5, 3.0, 25.0]),
])
def test_a_lone_requests_ttft_is_what_the_simulator_gives_it(model, theta, tmp_path):
    from dspark_sim.sim.api import simulate

    prof = make_profile(np.array(theta), name="t", max_batched_tokens=BUDGET, limits=LIMITS,
                        model=model)
    prompt = np.array([50, 100, 256, 300, 700])  # one chunk, then two and three
    run = _run(prompt, np.zeros(prompt.size), np.zeros(prompt.size), [[0.1] * 4] * 5,
               concurrency=1)
    res = simulate(run_config(run, workload_file(run, tmp_path), ENGINE), profile=prof)
    simulated = res.requests.sort("request_id")["ttft_ms"].to_numpy()
    assert lone_ttft_ms(prof, prompt, BUDGET) == pytest.approx(simulated, rel=1e-9)


def test_the_fit_holds_a_lone_requests_ttft_at_the_lines_ends_after_the_points(tmp_path):
    prompt = np.tile([60, 120, 180, 240], 3)  # one chunk each
    run = _closed_loop(prompt, 70 + 2.0 * prompt)
    line = ttft_line([run])
    theta = np.array([40.0, 2.0, 0.5, 3.0, 25.0])
    with_line = _Objective([run], None, ENGINE, tmp_path, 0, "t", StepModel(), None, line)
    without = _Objective([run], None, ENGINE, tmp_path, 0, "t", StepModel())
    res = with_line.residuals(np.log(theta))
    base = without.residuals(np.log(theta))
    assert res.size == base.size + 2 and np.allclose(res[:-2], base)
    sim = lone_ttft_ms(with_line.profile(theta), line.ends, BUDGET)
    assert res[-2:] == pytest.approx(math.sqrt(LINE_WEIGHT) * np.log(sim / line.at(line.ends)))
    # a profile whose overhead is the line's has no misfit there
    fit = np.array([40.0, 2.0, 0.5, 3.0, 70.0 - 40.0 - 3.0])
    assert with_line.residuals(np.log(fit))[-2:] == pytest.approx([0, 0], abs=1e-9)


def test_the_lines_bootstrap_widens_the_constants_it_moves():
    jac = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, -1.0]])
    res = np.array([0.01, -0.01, 0.02, 0.0])
    names = ("a", "b")
    quiet = constant_uncertainty(jac, res, np.ones(2), names, [], {}, 0)
    rng = np.random.default_rng(6)
    tail = np.column_stack([rng.normal(0, 0.3, BOOTSTRAP_SAMPLES),
                            np.zeros(BOOTSTRAP_SAMPLES)])
    loud = constant_uncertainty(jac, res, np.ones(2), names, [], {}, 0, tail)
    assert loud["a"]["relative_sd"] > quiet["a"]["relative_sd"] + 0.05
    # the tail's shifts reach each constant through the fit's pseudo-inverse
    expected = np.cov(-(np.linalg.pinv(jac) @ np.pad(tail, ((0, 0), (2, 0))).T), ddof=1)
    assert loud["a"]["relative_sd"] ** 2 == pytest.approx(
        quiet["a"]["relative_sd"] ** 2 + expected[0, 0], rel=1e-6)


def test_the_constants_line_counts_the_ttft_line_as_two_figures():
    unc = {n: {"value": 1.0, "relative_sd": 0.1, "flag": ""} for n in "abcde"}
    assert constants_line(unc, 4).endswith(
        "5 constants from 4 points: fewer points than constants, some are set by their "
        "start, not by the runs")
    assert constants_line(unc, 4, lone=52).endswith(
        "5 constants from 4 points and the TTFT line of 52 lone requests")
    assert constants_line(unc, 8, 7, 44).endswith(
        "from 8 points, 7 measured decode steps and the TTFT line of 44 lone requests")


def test_a_profiles_own_line_is_its_per_token_cost_and_its_per_request_overhead():
    theta = np.array([40.0, 2.0, 0.5, 3.0, 25.0])  # fixed, token, request, logit, frontend
    slope, intercept = profile_line(theta, "t", StepModel(), ENGINE, (60, 240))
    assert slope == pytest.approx(2.0) and intercept == pytest.approx(25.0 + 40.0 + 3.0)


def test_the_fit_says_what_line_it_held_or_why_it_held_none():
    prof = make_profile(np.array([40.0, 2.0, 0.5, 3.0, 25.0]), name="t",
                        max_batched_tokens=BUDGET, limits=LIMITS)
    wide = np.tile([60, 120, 180, 240], 3)
    line = ttft_line([_closed_loop(wide, 70 + 2.0 * wide)])
    fitted = FitResult(prof, None, {}, [], 1, ENGINE, line=line, line_fit={
        "slope_ms": 2.0, "slope_sd_ms": 0.1, "intercept_ms": 68.0, "intercept_sd_ms": 9.0})
    assert fitted.lone == 12
    assert "12 requests, prompts of 60-240 tokens" in fitted.line_sentence()
    assert "70 ±0 ms a request + 2 ±0 ms a prompt token" in fitted.line_sentence()
    assert "the fitted profile gives 68 ±9 ms + 2 ±0.1 ms" in fitted.line_sentence()
    rec = fitted.line_record()
    assert rec["fitted"] and rec["requests"] == 12 and rec["prompt_ends"] == [60, 240]
    assert rec["intercept_ms"] == pytest.approx(70.0) and rec["profile"]["intercept_ms"] == 68
    narrow = np.tile([300, 305, 310, 312], 5)
    unused = FitResult(prof, None, {}, [], 1, ENGINE, line=ttft_line(
        [_closed_loop(narrow, 50 + 2.0 * narrow)]))
    assert unused.lone == 0 and "not fitted: their prompt lengths spread by" in \
        unused.line_sentence()
    assert unused.line_record()["fitted"] is False
    none = FitResult(prof, None, {}, [], 1, ENGINE, line=ttft_line([]))
    assert none.line_record() is None and "no such request" in none.line_sentence()
