"""The lone requests' TTFT line: which requests ran alone, the robust line through their
TTFTs against their prompt lengths, when the runs support it, and what a profile makes
a lone request wait. Fast: synthetic requests, no fit runs."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from dspark_sim.calibration.profile import EngineLimits
from dspark_sim.sim.config import EngineConfig
from dspark_sim.validation.vllm_fit import (
    MAX_PAIRS,
    MIN_LONE,
    MIN_PROMPT_SPREAD,
    BenchRun,
    StepModel,
    lone_requests,
    lone_ttft_ms,
    make_profile,
    run_config,
    theil_sen,
    ttft_line,
    workload_file,
)
from dspark_sim.validation.vllm_repeats import BOOTSTRAP_SAMPLES

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
