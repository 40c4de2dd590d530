"""Steady-state measurement: the window rule on hand-built step series, the figures over a
window on a hand-built log, and the window on real runs (conservation identities)."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, replace
from fractions import Fraction

import numpy as np
import polars as pl
import pytest
from hand_oracles import mser_criteria

from dspark_sim.sim import frontier as fr
from dspark_sim.sim.api import simulate
from dspark_sim.sim.config import DeploymentConfig, EngineConfig, SimConfig, WorkloadConfig
from dspark_sim.sim.engine import RequestLog, StepStats
from dspark_sim.sim.metrics import (
    STABLE_FRACTION,
    STABLE_SLACK,
    QueueTrend,
    SteadyWindow,
    StepSeries,
    mser_truncation,
    stability_verdict,
    steady_state,
    steady_window,
    summarize,
)


# -- MSER ----------------------------------------------------------------------------------
def test_mser_truncation_hand_series():
    # a 4-bin transient then a flat series: cutting exactly the transient leaves SSE 0
    assert mser_truncation([0, 0, 3, 7] + [10] * 16) == 4
    assert mser_truncation([5.0] + [1.0] * 9) == 1
    assert mser_truncation([2.0] * 10) == 0  # flat: no truncation
    # never more than half the series, even when the tail is the odd part
    assert mser_truncation([1.0] * 5 + [100.0] * 5) <= 5


# -- the window on a hand-built series -------------------------------------------------------
def _ramp_series(dt=1 / 128, n_total=3600, plateau_k=400, level=50, drain_from=3200):
    """One replica, a step every ``dt`` (dyadic, so bin edges are exact): the decode
    batch is ``k // 8`` until step ``plateau_k``, then ``level``; it falls again after
    step ``drain_from``. Every request-step emits 2 tokens."""
    k = np.arange(1, n_total + 1)
    n = np.minimum(k // 8, level).astype(float)
    n[k > drain_from] = np.maximum(level - (k[k > drain_from] - drain_from) // 8, 0)
    return StepSeries.of(k * dt, dt, decode_batch=n, emitted_tokens=2 * n,
                         verified_drafts=3 * n, accepted_tokens=n)


def test_window_on_hand_built_ramp():
    """Drain starts at the last arrival, 25 s (step 3200). 3200 steps before it -> 200
    bins of 0.125 s, 16 steps each. Plateau bins hold a decode batch of exactly 50 (the
    median of the second half = the steady occupancy). Ramp bin m (steps 16m..16m+15)
    averages 2m + 0.5; the first to reach 90 % of 50 is m = 23 (46.5; m = 22 has 44.5),
    so the fill ends at 24 x 0.125 = 3.0 s. MSER on the throughput bins cuts the 25 ramp
    bins: 25 x 0.125 = 3.125 s, the later of the two. The window is [3.125, 25]."""
    steps = _ramp_series()
    arrivals = np.linspace(0.0, 25.0, 300)
    w = steady_window(steps, arrivals, closed=False)
    assert w.drain_start_s == 25.0 and w.end_s == 25.0
    assert w.bins == 200
    assert w.occupancy == 50.0
    assert w.fill_s == pytest.approx(3.0)
    assert w.mser_s == pytest.approx(3.125)
    assert w.start_s == pytest.approx(3.125)
    assert "last arrival" in w.rule and "open loop" in w.rule
    wc = steady_window(steps, arrivals, closed=True)
    assert "last request issued" in wc.rule and wc.start_s == w.start_s


def test_window_mser_catches_a_transient_after_the_fill():
    """A closed loop's lockstep first cohort: the batch is full from the start (fill at
    the first bin) but the output rate overshoots for the first 2 s: MSER cuts it."""
    dt = 1 / 128
    k = np.arange(1, 3201)
    t = k * dt
    n = np.full(k.size, 40.0)
    emitted = np.where(t <= 2.0, 3 * n, 2 * n)  # 16 bins of overshoot, then flat
    steps = StepSeries.of(t, dt, decode_batch=n, emitted_tokens=emitted)
    w = steady_window(steps, np.array([0.0, 25.0]), closed=True)
    # bin 0 holds 15 steps (ends 1/128 .. 15/128): 40 x 15/16 = 37.5, already within
    # 90 % of 40, so the fill ends with bin 0
    assert w.fill_s == pytest.approx(0.125)
    # the step ending at exactly 2.0 s opens bin 16 (bins hold ends in [m w, (m+1) w)),
    # so bin 16 is part overshoot: MSER cuts 17 bins
    assert w.mser_s == pytest.approx(17 * 0.125)
    assert w.start_s == pytest.approx(17 * 0.125)


def test_no_steady_state_when_all_requests_issued_at_once():
    steps = _ramp_series(n_total=200)
    w = steady_window(steps, np.zeros(16), closed=True)
    assert w.duration_s == 0.0 and "no steady state" in w.rule
    # nothing was measured: no bins, no fill, no MSER, no occupancy
    assert (w.bins, w.fill_s, w.mser_s, w.occupancy) == (0, None, None, None)
    assert w.start_s == w.end_s == w.drain_start_s == 0.0
    log = _log([0.0] * 2, [0.1] * 2, [1.0] * 2, [5] * 2)
    s = steady_state(log, steps, w, gpus=1)
    assert s["steady_output_throughput"] is None and s["steady_window_short"]
    assert "num_requests <= concurrency" in s["steady_window_note"]


def test_step_series_fields_left_out_are_zeros():
    s = StepSeries.of([0.5, 1.0, 1.5], 0.5, decode_batch=[1, 2, 3])
    assert s.dt_s.tolist() == [0.5] * 3 and s.decode_batch.tolist() == [1.0, 2.0, 3.0]
    for f in ("replica", "running", "waiting", "batch_tokens", "prefill_tokens",
              "verified_drafts", "emitted_tokens", "accepted_tokens"):
        assert getattr(s, f).tolist() == [0.0] * 3, f
    with pytest.raises(TypeError, match="unknown step fields: bogus"):
        StepSeries.of([1.0], 1.0, bogus=1)


def _eight_bin_series(batch_per_bin):
    """80 steps of 1/16 s ending mid-step, (k - 0.5)/16 for k = 1..80, with the last
    arrival at 5 s: 80 // 10 = 8 bins of 0.625 s holding exactly steps 10m+1..10m+10,
    so bin m's time-averaged decode batch is the batch its steps carry. 2 tokens a step:
    a flat output rate, so MSER cuts nothing."""
    k = np.arange(1, 81)
    batch = np.repeat(np.asarray(batch_per_bin, dtype=float), 10)
    return StepSeries.of((k - 0.5) / 16, 1 / 16, decode_batch=batch, emitted_tokens=2.0)


def test_steady_occupancy_is_the_median_bin_of_the_second_half():
    """Bins 0-7 carry 0, 10, 20, 30, 44, 48, 60, 70. The steady occupancy is the median
    of bins 4-7, (48 + 60) / 2 = 54 (the median of bins 2-7 would be 46); 90 % of it is
    48.6, first reached by bin 6 (60 > 48.6 > 48), so the fill ends at 7 x 0.625 s."""
    steps = _eight_bin_series([0, 10, 20, 30, 44, 48, 60, 70])
    w = steady_window(steps, np.array([0.0, 2.0, 5.0]), closed=False)
    assert w.bins == 8
    assert w.occupancy == pytest.approx(54.0)
    assert w.mser_s == 0.0
    assert w.fill_s == pytest.approx(4.375)
    assert (w.start_s, w.end_s) == (pytest.approx(4.375), 5.0)


@pytest.mark.parametrize(("margin", "stable"), [(-0.01, True), (0.0, True), (0.01, False)])
def test_stability_threshold_counts_the_arrivals_on_the_window_edges(margin, stable):
    """Window [4.375, 5] (the series above; 0.625 s long). Arrivals 0, 1, 2, 3, 4.375,
    4.5, 4.75, 5: the four from 4.375 to 5, both edges included, are the window's
    arrivals, so a run is unstable when the queue grows by more than 10 + 0.02 x 4 =
    10.08 requests across the window. A growth 0.01 below that is stable, 0.01 above
    is not (counting either edge out would make the threshold 10.06), and a growth of
    exactly 10.08 (16.128 x 0.625 is 10.08 in floating point too) is not "more than".
    Two of the four complete in the window (2 short of the arrivals: well within)."""
    assert (STABLE_SLACK, STABLE_FRACTION) == (10, 0.02)
    arrival = [0.0, 1.0, 2.0, 3.0, 4.375, 4.5, 4.75, 5.0]
    log = _log(arrival, [a + 0.1 for a in arrival], [a + 0.5 for a in arrival], [5] * 8)
    steps = _eight_bin_series([0, 10, 20, 30, 44, 48, 60, 70])
    growth_per_s = (10.08 + margin) / 0.625
    s = summarize(log, StepStats(gamma=3), gpus=1, slo_ttft_ms=None, slo_tpot_ms=None,
                  queue_growth_per_s=growth_per_s, steps=steps)
    assert s["steady_window_start_s"] == pytest.approx(4.375)
    assert s["steady_window_rule"].startswith("open loop:")  # summarize's default loop
    assert s["stable"] is stable
    assert s["queue_growth_per_s"] == growth_per_s


def _mser_exact(z) -> int:
    """White's MSER by brute force (hand_oracles.mser_criteria) in exact rational
    arithmetic; the smallest ``d`` on ties (exact ties: no rounding to absorb)."""
    crit = mser_criteria([Fraction(float(v)) for v in z])
    return crit.index(min(crit)) if crit else 0


def test_mser_truncation_equals_exact_brute_force_on_random_series():
    """Random series of odd and even lengths, with a transient or without, at scales
    from 1e-7 to 1e4 (the criterion's floor and tie tolerance must be relative)."""
    rng = np.random.default_rng(17)
    for case in range(60):
        n = int(rng.integers(2, 41))
        z = rng.normal(0.0, 1.0, n)
        if case % 3 == 0:  # a decaying warm-up transient
            z += 4.0 * np.exp(-np.arange(n) / 3.0)
        z *= 10.0 ** rng.integers(-7, 5)
        assert mser_truncation(z) == _mser_exact(z), (case, z.tolist())


def test_mser_truncation_short_and_flat_tails():
    assert mser_truncation([]) == 0 and mser_truncation([7.0]) == 0
    # two points: cutting the first leaves one point, SSE 0 (d = n // 2 = 1 is allowed)
    assert mser_truncation([5.0, 1.0]) == 1
    # a spike then a constant tail of a value binary floats cannot hold (0.3): every cut
    # from 1 to 10 leaves SSE 0 up to rounding (~1e-18 here, not exactly 0 in every
    # suffix); those are ties, and the smallest cut wins
    assert mser_truncation([5.0] + [0.3] * 19) == 1
    # the best cut (6, after the six 1s) is past half the series: MSER stops at n // 2
    z = [1.0] * 6 + [100.0] * 4
    assert _mser_exact(z) == mser_truncation(z) <= 5


# -- the window's edge cases ------------------------------------------------------------------
def _uniform_series(n: int, dt: float, **cols) -> StepSeries:
    """``n`` steps of ``dt`` ending at ``dt, 2 dt, ..., n dt``."""
    return StepSeries.of(np.arange(1, n + 1) * dt, dt, **cols)


def test_window_counts_the_step_ending_at_the_drain_start():
    """80 steps of 1/16 s ending at k/16, the last (k = 80) exactly at the last arrival,
    5 s: all 80 count, so 8 bins of 0.625 s; bin m holds the steps ending in
    [0.625 m, 0.625 (m + 1)), i.e. k = 10m .. 10m + 9, and the last bin also holds the
    step ending at 5 s itself. Decode batches: 40, 50, 60 on bins 4-6, 30 on steps 70-79
    and 150 on step 80, so bin 7 averages (10 x 30 + 150) / 10 = 45 (a bin's average is
    its steps' batches x 1/16 s / 0.625 s). The steady occupancy is the median of bins
    4-7, (45 + 50) / 2 = 47.5; 90 % of it, 42.75, is first reached by bin 5 (bin 4 has
    40), so the fill ends at 6 x 0.625 = 3.75 s."""
    k = np.arange(1, 81)
    batch = np.select([k >= 80, k >= 70, k >= 60, k >= 50, k >= 40], [150, 30, 60, 50, 40], 0)
    steps = _uniform_series(80, 1 / 16, decode_batch=batch, emitted_tokens=2.0)
    w = steady_window(steps, np.array([0.0, 1.0, 5.0]), closed=False)
    assert w.bins == 8
    assert w.occupancy == pytest.approx(47.5)
    assert w.fill_s == pytest.approx(3.75)


def test_window_needs_eight_steps_before_the_drain():
    """Eight steps of 1/8 s up to a last arrival at 1 s: enough for a window, of the
    minimum 4 bins (8 // 10 = 0, clipped up to 4) of 0.25 s. They hold 1, 2, 2 and 3
    steps (the step ending at 1 s joins the last bin), so with a decode batch of 4 the
    bins average 4 x n x 1/8 s / 0.25 s = 2, 4, 4, 6: the steady occupancy (median of
    bins 2-3) is 5."""
    steps = _uniform_series(8, 1 / 8, decode_batch=4.0, emitted_tokens=4.0)
    w = steady_window(steps, np.array([0.0, 1.0]), closed=False)
    assert w.bins == 4 and "no steady state" not in w.rule
    assert w.occupancy == pytest.approx(5.0) and w.end_s == 1.0


@pytest.mark.parametrize("closed", [False, True])
def test_window_with_too_few_steps_says_how_many(closed):
    """Three steps end before the last arrival (0.5 s): no window, and the reason names
    the step count and the drain start, in either loop (a closed loop's "all requests
    issued at once" is only for a drain start at 0)."""
    steps = StepSeries.of([0.1, 0.2, 0.3, 0.6], 0.1, decode_batch=1.0)
    w = steady_window(steps, np.array([0.0, 0.5]), closed=closed)
    what = "last request issued" if closed else "last arrival"
    loop = "closed loop" if closed else "open loop"
    assert w.rule == f"{loop}: no steady state (only 3 engine steps before the {what} at 0.500 s)"
    assert (w.start_s, w.end_s, w.bins) == (0.5, 0.5, 0)


def test_window_without_arrivals_is_empty_at_zero():
    """No finite arrival time (every request rejected before a time was kept): the drain
    start is 0, so nothing counts, however many steps ran."""
    steps = _uniform_series(50, 1 / 64, decode_batch=2.0, emitted_tokens=2.0)
    w = steady_window(steps, np.array([np.nan, np.nan]), closed=False)
    assert (w.start_s, w.end_s, w.bins, w.occupancy) == (0.0, 0.0, 0, None)
    assert w.rule == "open loop: no steady state (only 0 engine steps before the last arrival at 0.000 s)"


def test_fill_is_the_first_bin_at_exactly_ninety_percent():
    """Bins 0-7 carry 0, 10, 45, 46, 50, 50, 50, 50: steady occupancy 50, and bin 2's 45
    is exactly 90 % of it (0.9 x 50 is 45.0 in floating point, and 45 x 10 steps x 1/16 s
    / 0.625 s is exact): "reaches" includes equality, so the fill ends at 3 x 0.625 s."""
    steps = _eight_bin_series([0, 10, 45, 46, 50, 50, 50, 50])
    w = steady_window(steps, np.array([0.0, 5.0]), closed=False)
    assert w.occupancy == 50.0
    assert w.fill_s == pytest.approx(3 * 0.625)


def test_window_types_are_frozen():
    w = SteadyWindow(0.0, 1.0, 1.0, None, None, None, 0, "hand")
    with pytest.raises(FrozenInstanceError):
        w.start_s = 0.5
    s = StepSeries.of([1.0], 1.0)
    with pytest.raises(FrozenInstanceError):
        s.dt_s = np.ones(1)
    # a window cannot run backwards
    assert SteadyWindow(3.0, 2.0, 2.0, None, None, None, 0, "hand").duration_s == 0.0


# -- the figures over a window, by hand ------------------------------------------------------
def _log(arrival, first, finish, generated) -> RequestLog:
    n = len(arrival)
    log = RequestLog.empty(n)
    log.arrival_s[:] = arrival
    log.first_token_s[:] = first
    log.finish_s[:] = finish
    log.generated[:] = generated
    return log


def test_steady_figures_by_hand():
    w = SteadyWindow(2.0, 12.0, 12.0, 2.0, 1.0, 3.0, 10, "hand")
    #          r0    r1    r2    r3    r4      r5
    log = _log([1.0, 2.5, 5.0, 11.0, 8.0, 3.0],
               [1.5, 2.7, 5.1, 11.2, 8.4, 3.3],
               [3.0, 4.5, 6.1, 13.0, np.nan, 3.9],
               [10, 11, 5, 7, 3, 1])
    steps = StepSeries.of([1.9, 2.0, 3.0, 6.0, 12.0, 12.5], 0.1,
                          decode_batch=[9, 9, 2, 4, 2, 9], verified_drafts=[9, 9, 6, 8, 2, 9],
                          accepted_tokens=[9, 9, 4, 4, 2, 9], emitted_tokens=[9, 9, 7, 10, 5, 9],
                          running=[9, 9, 3, 5, 2, 9], batch_tokens=[1, 1, 30, 12, 6, 1])
    s = steady_state(log, steps, w, gpus=2)
    # steps ending in (2, 12]: the 3rd, 4th, 5th
    assert s["steady_window_steps"] == 3
    assert s["steady_output_throughput"] == pytest.approx(22 / 10)
    assert s["steady_output_throughput_per_gpu"] == pytest.approx(22 / 10 / 2)
    # completions in (2, 12]: r0, r1, r2, r5
    assert s["steady_window_completions"] == 4
    assert s["steady_request_throughput"] == pytest.approx(0.4)
    # latency sample: arrivals in [2, 12 - H], H = p99 lifetime of the finished requests
    # arriving in [2, 12] (r1 2.0, r2 1.1, r3 2.0, r5 0.9 s: numpy's p99 of four is 2.0),
    # so arrivals in [2, 10]: r1, r2, r5 (r0 arrived before, r3 after, r4 never finished)
    assert s["steady_latency_arrivals_end_s"] == pytest.approx(10.0)
    assert s["steady_window_requests"] == 3
    assert s["steady_median_ttft_ms"] == pytest.approx(200.0)
    assert s["steady_mean_ttft_ms"] == pytest.approx(200.0)
    assert s["steady_median_e2el_ms"] == pytest.approx(1100.0)
    # TPOT r1 (2000-200)/10 = 180, r2 (1100-100)/4 = 250; r5 has one token: none
    assert s["steady_median_tpot_ms"] == pytest.approx(215.0)
    assert s["steady_median_interactivity"] == pytest.approx((1000 / 180 + 1000 / 250) / 2)
    assert s["steady_spec_decode_acceptance_length"] == pytest.approx(1 + 10 / 8)
    assert s["steady_mean_verify_tokens_per_request_step"] == pytest.approx(24 / 8)
    assert s["steady_verification_waste"] == pytest.approx(6 / 16)
    assert s["steady_mean_decode_batch"] == pytest.approx(8 / 3)
    assert s["steady_mean_step_ms"] == pytest.approx(100.0)
    assert s["steady_mean_batch_tokens"] == pytest.approx(48 / 3)
    assert s["steady_mean_running"] == pytest.approx((3 + 5 + 2) * 0.1 / 10)
    # time in [2, 12]: r0 1, r1 2, r2 1.1, r3 1, r4 4 (unfinished: to the end), r5 0.9
    assert s["steady_mean_in_system"] == pytest.approx(10.0 / 10)
    assert s["steady_window_short"] and "3 requests" in s["steady_window_note"]


def test_steady_figures_count_unverified_commits_as_drafts_not_acceptances():
    """A skipping policy's steps (the by-hand steps above, with 0, 0, 3, 1, 2, 0 drafts
    committed without the verifier): in the window (steps 3-5) the acceptance length
    counts the 10 accepted and the 6 unjudged drafts over 8 request-steps; the waste is
    the verifier's, rejected 6 of the 16 it verified, as without them."""
    w = SteadyWindow(2.0, 12.0, 12.0, 2.0, 1.0, 3.0, 10, "hand")
    log = _log([1.0, 2.5], [1.5, 2.7], [3.0, 4.5], [10, 11])
    steps = StepSeries.of([1.9, 2.0, 3.0, 6.0, 12.0, 12.5], 0.1,
                          decode_batch=[9, 9, 2, 4, 2, 9], verified_drafts=[9, 9, 6, 8, 2, 9],
                          accepted_tokens=[9, 9, 4, 4, 2, 9],
                          unverified_tokens=[0, 0, 3, 1, 2, 0])
    s = steady_state(log, steps, w, gpus=1)
    assert s["steady_spec_decode_acceptance_length"] == pytest.approx(1 + 16 / 8)
    assert s["steady_verification_waste"] == pytest.approx(6 / 16)


def test_latency_sample_is_chosen_by_arrival_not_by_finish():
    """A 5 s request arriving at 97 s finishes after the window's end (100 s) but is in
    the sample (selecting by finish would drop it, and with it long requests in
    general); a 1 s request arriving at 99.5 s, after end - H (H = the p99 lifetime,
    1 s here), is not."""
    w = SteadyWindow(0.0, 100.0, 100.0, 0.0, 0.0, 1.0, 10, "hand")
    arr = np.arange(0.0, 100.0, 0.5)  # 200 requests of 1 s ...
    life = np.ones(arr.size)
    life[194] = 5.0  # ... but the one arriving at 97 s lives 5 s
    log = _log(arr, arr + 0.1, arr + life, np.full(arr.size, 11))
    steps = StepSeries.of(np.linspace(0.5, 100.0, 200), 0.5, decode_batch=2.0,
                          emitted_tokens=2.0)
    s = steady_state(log, steps, w, gpus=1)
    assert s["steady_latency_arrivals_end_s"] == pytest.approx(99.0)
    assert s["steady_window_requests"] == 199  # arrivals 0 .. 99 s
    assert s["steady_mean_e2el_ms"] == pytest.approx((198 * 1000.0 + 5000.0) / 199)


def _flat_steps(t0: float, t1: float, n: int = 20) -> StepSeries:
    """``n`` steps of equal length ending evenly over ``(t0, t1]``, 2 requests decoding,
    2 tokens each."""
    dt = (t1 - t0) / n
    return StepSeries.of(t0 + dt * np.arange(1, n + 1), dt, decode_batch=2.0,
                         emitted_tokens=2.0)


@pytest.mark.parametrize(("edge", "cutoff"), [
    # lifetimes 5 (arriving at t0 = 2) and 1: numpy's p99 of two interpolates,
    # 1 + 0.99 x (5 - 1) = 4.96
    ("start", 12.0 - 4.96),
    # lifetimes 1 and 7 (arriving at t1 = 12, finishing at 19): 1 + 0.99 x 6 = 6.94
    ("end", 12.0 - 6.94),
])
def test_latency_cutoff_lifetimes_include_arrivals_on_both_window_edges(edge, cutoff):
    """The p99 lifetime H is over the requests arriving in [t0, t1], both edges in: a
    request arriving exactly on an edge moves the latency cut-off t1 - H."""
    w = SteadyWindow(2.0, 12.0, 12.0, 2.0, 2.0, 2.0, 10, "hand")
    arrival, life = ([2.0, 3.0], [5.0, 1.0]) if edge == "start" else ([3.0, 12.0], [1.0, 7.0])
    arrival, life = np.array(arrival), np.array(life)
    log = _log(arrival, arrival + 0.25, arrival + life, [9, 9])
    s = steady_state(log, _flat_steps(2.0, 12.0), w, gpus=1)
    assert s["steady_latency_arrivals_end_s"] == pytest.approx(cutoff)



@pytest.mark.parametrize(("life_s", "cutoff"), [
    (9.5, 2.5),  # p99 lifetime 9.5 s in a 10 s window: arrivals in [2, 2.5]
    (10.0, 2.0),  # exactly the window: the sample is the arrivals at its start
    (10.5, None),  # longer than the window: no latency sample (it was reported as 1.5 s)
    (30.0, None),  # and never a time before the window, negative on short closed loops
])
def test_latency_cutoff_is_absent_when_the_window_is_shorter_than_a_lifetime(life_s, cutoff):
    """Two requests arrive at t0 = 2 s and t0 + 0.25 s and live ``life_s``: the cut-off
    t1 - H is 12 - life_s; when it falls before t0 there is no latency sample, and the
    summary says so with null rather than a time outside the window (or before 0)."""
    w = SteadyWindow(2.0, 12.0, 12.0, 2.0, 2.0, 2.0, 10, "hand")
    arrival = np.array([2.0, 2.25])
    log = _log(arrival, arrival + 0.25, arrival + life_s, [9, 9])
    s = steady_state(log, _flat_steps(2.0, 12.0), w, gpus=1)
    if cutoff is None:
        assert s["steady_latency_arrivals_end_s"] is None
    else:  # p99 of two equal lifetimes is the lifetime
        assert s["steady_latency_arrivals_end_s"] == pytest.approx(cutoff)
    assert s["steady_window_requests"] == int(cutoff is not None and 1 + (cutoff >= 2.25))
    assert s["steady_window_short"]


def test_latency_cutoff_of_a_short_closed_loop_is_never_before_its_window():
    """64 clients, 100 requests: the window is shorter than one request's lifetime (the
    cut-off came out at -1.8 s); no latency sample, null cut-off, a short window."""
    cfg = SimConfig(deployment=DeploymentConfig(replicas=1),
                    workload=WorkloadConfig(arrival="closed", max_concurrency=64,
                                            num_requests=100))
    s = simulate(cfg).summary
    assert s["steady_window_s"] > 0
    assert s["steady_latency_arrivals_end_s"] is None
    assert s["steady_window_requests"] == 0 and s["steady_window_short"]

def test_completions_count_finishes_in_the_half_open_window():
    """Completions are the requests finishing in (t0, t1]: one finishing exactly at t0
    is the previous window's, one finishing exactly at t1 is this one's."""
    w = SteadyWindow(2.0, 12.0, 12.0, 2.0, 2.0, 2.0, 10, "hand")
    log = _log([1.0, 5.0, 11.0], [1.5, 5.5, 11.5], [2.0, 7.0, 12.0], [9, 9, 9])
    s = steady_state(log, _flat_steps(2.0, 12.0), w, gpus=1)
    assert s["steady_window_completions"] == 2
    assert s["steady_request_throughput"] == pytest.approx(2 / 10)


def test_window_at_the_short_thresholds_exactly_is_not_short():
    """Window [0, 10] s; 100 requests arriving every 1/16 s from 0, each living exactly
    1 s (dyadic times: no rounding). The p90 lifetime is 1 s, so the window spans exactly
    MIN_WINDOW_LIFETIMES = 10 of them, and the latency sample (arrivals up to 10 - 1 s)
    holds exactly MIN_WINDOW_REQUESTS = 100: at both bounds, not below them."""
    w = SteadyWindow(0.0, 10.0, 10.0, 0.0, 0.0, 2.0, 10, "hand")
    arrival = np.arange(100) / 16
    log = _log(arrival, arrival + 0.25, arrival + 1.0, np.full(100, 9))
    s = steady_state(log, _flat_steps(0.0, 10.0), w, gpus=1)
    assert s["steady_window_requests"] == 100
    assert s["steady_window_short"] is False and s["steady_window_note"] is None


def test_window_under_ten_p90_lifetimes_is_short_and_says_so():
    """Window [0, 10] s; 200 requests arriving every 1/32 s (by 6.22 s), every 10th
    living 3 s, the rest 1 s. The p99 lifetime is 3 s, so the latency sample (arrivals
    up to 7 s) holds all 200: the sample is not what is short. The p90 lifetime falls
    between the 180th and 181st of the 200 sorted (1 and 3 s), at numpy's position
    0.9 x 199 = 179.1 counted from 0: 1 + 0.1 x 2 = 1.2 s, and 10 s is under 10 x 1.2 s."""
    w = SteadyWindow(0.0, 10.0, 10.0, 0.0, 0.0, 2.0, 10, "hand")
    arrival = np.arange(200) / 32
    life = np.where(np.arange(200) % 10 == 0, 3.0, 1.0)
    log = _log(arrival, arrival + 0.25, arrival + life, np.full(200, 9))
    s = steady_state(log, _flat_steps(0.0, 10.0), w, gpus=1)
    assert s["steady_window_requests"] == 200
    assert s["steady_window_short"] is True
    assert s["steady_window_note"] == (
        "window 10.00 s is under 10 p90 request lifetimes (1.20 s): run more requests")


def test_window_shorter_than_a_second():
    """A 0.5 s window is a window (no floor on its length): steps ending at 1.25 and 1.5 s
    emit 2 + 2 tokens in [1, 1.5]."""
    w = SteadyWindow(1.0, 1.5, 1.5, 1.0, 1.0, 2.0, 4, "hand")
    log = _log([0.9, 1.1], [1.0, 1.2], [1.3, 1.4], [3, 3])
    steps = StepSeries.of([1.0, 1.25, 1.5], 0.25, decode_batch=1.0, emitted_tokens=2.0)
    s = steady_state(log, steps, w, gpus=1)
    assert s["steady_window_s"] == 0.5
    assert s["steady_output_throughput"] == pytest.approx(4 / 0.5)
    assert s["steady_request_throughput"] == pytest.approx(2 / 0.5)


def test_window_without_a_step_in_it_has_no_figures():
    """A window of positive length in which no step ends measures nothing: the
    throughputs are None (not 0), and the note gives the window's rule."""
    w = SteadyWindow(2.0, 3.0, 3.0, 2.0, 2.0, 2.0, 4, "hand")
    log = _log([1.0, 2.5], [1.1, 2.6], [1.5, 2.9], [3, 3])
    steps = StepSeries.of([1.0, 1.5, 3.5], 0.5, decode_batch=1.0, emitted_tokens=2.0)
    s = steady_state(log, steps, w, gpus=1)
    assert s["steady_window_steps"] == 0
    assert s["steady_output_throughput"] is None and s["steady_request_throughput"] is None
    assert s["steady_mean_decode_batch"] is None and s["steady_mean_in_system"] is None
    assert s["steady_output_throughput_rse"] is None
    assert s["steady_window_short"] is True
    assert s["steady_window_note"] == "hand: run more requests"


@pytest.mark.parametrize(("verified", "accepted", "waste"), [
    ([0, 0], [0, 0], 0.0),  # requests decode, nothing drafted: nothing wasted
    ([4, 4], [1, 3], 4 / 8),
])
def test_steady_speculation_figures_by_hand(verified, accepted, waste):
    """Two steps in the window, 2 decoding requests each (4 request-steps)."""
    w = SteadyWindow(0.0, 2.0, 2.0, 0.0, 0.0, 2.0, 4, "hand")
    log = _log([0.1], [0.2], [1.9], [5])
    steps = StepSeries.of([1.0, 2.0], 1.0, decode_batch=2.0, emitted_tokens=2.0,
                          verified_drafts=verified, accepted_tokens=accepted)
    s = steady_state(log, steps, w, gpus=1)
    assert s["steady_verification_waste"] == pytest.approx(waste)
    assert s["steady_mean_draft_tokens_per_request_step"] == pytest.approx(sum(verified) / 4)
    assert s["steady_spec_decode_acceptance_length"] == pytest.approx(1 + sum(accepted) / 4)


# -- real runs -------------------------------------------------------------------------------
def _in_system(arr, fin, t):
    return int(((arr <= t) & ~(fin <= t)).sum())


def test_open_loop_window_conservation_and_drain_excluded():
    cfg = SimConfig(policy="fixed:3", deployment=DeploymentConfig(replicas=1),
                    engine=EngineConfig(prefill="chunked"),
                    workload=WorkloadConfig(qps=20.0, num_requests=1500,
                                            lengths="fixed:128:64"))
    res = simulate(cfg)
    s, r = res.summary, res.requests
    t0, t1 = s["steady_window_start_s"], s["steady_window_end_s"]
    arr, fin = r["arrival_s"].to_numpy(), r["finish_s"].to_numpy()
    assert t1 == pytest.approx(arr.max())  # the drain starts at the last arrival
    assert 0 < t0 < t1 / 2
    # flow balance over the window: completions = arrivals + in system at start - at end
    arrived = int(((arr > t0) & (arr <= t1)).sum())
    completions = int(((fin > t0) & (fin <= t1)).sum())
    assert completions == arrived + _in_system(arr, fin, t0) - _in_system(arr, fin, t1)
    assert s["steady_window_completions"] == completions
    assert s["steady_request_throughput"] == pytest.approx(completions / (t1 - t0))
    # the latency sample, counted from the rows: arrivals in [t0, t1 - p99 lifetime]
    came = (arr >= t0) & (arr <= t1)
    cutoff = t1 - np.percentile(fin[came] - arr[came], 99)
    assert s["steady_latency_arrivals_end_s"] == pytest.approx(cutoff)
    lived = (arr >= t0) & (arr <= cutoff)
    assert s["steady_window_requests"] == int(lived.sum())
    assert s["steady_median_ttft_ms"] == pytest.approx(float(np.median(r["ttft_ms"].to_numpy()[
        lived])))
    # the drain's emptying batch lowers the whole-run rate, never the window's
    assert s["steady_output_throughput"] > s["output_throughput"]
    assert s["stable"] and not s["steady_window_short"]
    assert 0 < s["steady_output_throughput_rse"] < 0.05
    assert 0 <= s["steady_median_interactivity_rse"] < 0.05


def test_closed_loop_window_holds_the_clients():
    cfg = SimConfig(policy="mtp1", deployment=DeploymentConfig(replicas=1),
                    workload=WorkloadConfig(arrival="closed", max_concurrency=8,
                                            num_requests=400, lengths="fixed:64:32"))
    s = simulate(cfg).summary
    # a closed loop keeps exactly C requests in the system until the last one is issued
    assert s["steady_mean_in_system"] == pytest.approx(8.0, rel=1e-9)
    # C at every sample but possibly the window's end, the last issue, where the step that
    # issued it may have finished two requests (C - 1 then): one request over 10 s
    assert abs(s["queue_growth_per_s"]) < 0.01
    assert s["stable"]
    assert "closed loop" in s["steady_window_rule"]


def test_growing_queue_is_unstable_even_when_everything_finishes():
    cfg = SimConfig(policy="none", deployment=DeploymentConfig(replicas=1),
                    engine=EngineConfig(max_num_seqs=8),
                    workload=WorkloadConfig(qps=200.0, num_requests=600, lengths="fixed:64:64"),
                    drain_timeout_s=1e6)
    s = simulate(cfg).summary
    assert s["unfinished"] == 0
    assert s["queue_growth_per_s"] > 50  # 200 req/s offered, ~1/20 of it served
    assert not s["stable"]


def test_a_saturated_default_run_is_unstable():
    """The default deployment without speculation at 200 req/s fills its 1,024 seats and
    falls behind in its steady window (5,125 arrivals, 4,951 completions; the requests in
    the system grow by ~145): more than the 10 + 2 % of the arrivals (112) a run keeps
    up within. The verdict and its reason are in the summary."""
    s = simulate(SimConfig(policy="none", workload=WorkloadConfig(qps=200.0))).summary
    assert s["unfinished"] == 0 and s["steady_mean_decode_batch"] > 0.99 * 256
    assert not s["stable"]
    note = s["stability_note"]
    assert "5,125 arrivals met 4,951 completions (174 short)" in note
    assert note.endswith("more than 10 + 2% of the arrivals (112 requests), the queue grows")


@pytest.mark.parametrize(("completions", "growth", "stable"), [
    (970, 0.0, True), (969, 0.0, False), (1000, 30.0, True), (1000, 30.5, False),
    (1010, -5.0, True)])
def test_stability_verdict_counts_the_shortfall_and_the_trend(completions, growth, stable):
    """1,000 arrivals in the window: the limit is 10 + 2 % of them, 30 requests, for the
    completions' shortfall and for the least-squares growth alike, each on its own."""
    q = QueueTrend(1.0, 11.0, 1000, completions, growth)
    assert q.limit == 30.0
    ok, note = stability_verdict(q, unfinished=0, completed=5000)
    assert ok is stable
    assert note.startswith("over the steady window (1.00-11.00 s) the requests in the system "
                           f"grew by {growth:,.0f} (least squares) and 1,000 arrivals met "
                           f"{completions:,} completions")
    assert note.endswith("within 10 + 2% of the arrivals (30 requests)" if stable else
                         "more than 10 + 2% of the arrivals (30 requests), the queue grows")


def test_stability_verdict_without_a_window_or_with_requests_left():
    assert stability_verdict(None, unfinished=0, completed=3) == (
        True, "every request finished (no step series: the queue's trend not judged)")
    q = QueueTrend(0.0, 1.0, 10, 10, 0.0)
    assert stability_verdict(q, unfinished=4, completed=0) == (
        False, "4 requests unfinished at the horizon, none completed")
    assert stability_verdict(q, unfinished=0, completed=0, rejected=7) == (
        False, "no request completed (all 7 rejected at arrival)")



@pytest.mark.parametrize("closed", [False, True], ids=["open", "closed"])
@pytest.mark.parametrize("limit", ["max_model_len", "kv_capacity_tokens"])
def test_a_run_that_completed_nothing_is_not_stable(closed, limit, monkeypatch):
    """Every request is 8 + 4 tokens; a limit of 11 refuses each at arrival (nothing
    unfinished, nothing queued: yet not stable), 12 serves them all
    (KV reserved for prompt + output alone: no verify slots on top)."""
    from typer.testing import CliRunner

    from dspark_sim import cli

    monkeypatch.setenv("COLUMNS", "200")  # the verdict on one line of the table
    arrival = dict(arrival="closed", max_concurrency=4) if closed else dict(qps=20.0)
    for tokens, served in ((11, False), (12, True)):
        cfg = SimConfig(policy="none", deployment=DeploymentConfig(replicas=1),
                        engine=EngineConfig(**{limit: tokens}, kv_mode="reserve"),
                        workload=WorkloadConfig(num_requests=30, lengths="fixed:8:4", **arrival))
        s = simulate(cfg).summary
        assert (s["completed"], s["rejected"], s["unfinished"]) == \
            ((30, 0, 0) if served else (0, 30, 0))
        assert s["stable"] is served
    flags = ["--max-concurrency", "4"] if closed else ["--qps", "20"]
    r = CliRunner().invoke(cli.app, ["run", "--policy", "none", "--replicas", "1",
                                 "--num-requests", "30", "--lengths", "fixed:8:4", *flags,
                                 f"--{limit.replace('_', '-')}", "11", "--kv-mode", "reserve"])
    assert r.exit_code == 0, r.output
    verdict = next(ln for ln in r.output.splitlines() if "│ stable " in ln)
    assert "NO: no request completed (all 30 rejected at arrival)" in verdict

# -- unfinished requests keep their progress ----------------------------------------------
@pytest.mark.parametrize("seqs, kv, qps, lengths", [
    (16, None, 100.0, "fixed:256:400"), (64, 6000, 100.0, "fixed:256:400"),
    (8, None, 400.0, "fixed:128:400")], ids=["overload", "kv-preempt", "overload-8-seqs"])
def test_unfinished_requests_keep_progress_and_totals_add_up(seqs, kv, qps, lengths):
    eng = EngineConfig(max_num_seqs=seqs, kv_capacity_tokens=kv)
    cfg = SimConfig(policy="fixed:3", deployment=DeploymentConfig(replicas=1), engine=eng,
                    workload=WorkloadConfig(qps=qps, num_requests=300, lengths=lengths),
                    drain_timeout_s=0.5)
    res = simulate(cfg)
    s, r = res.summary, res.requests
    assert s["unfinished"] > 0
    if kv is not None:
        assert s["preemptions"] > 0
    open_ = r.filter(~pl.col("finished") & pl.col("ttft_ms").is_not_null())
    assert open_.height > 0
    assert (open_["generated_tokens"] >= 1).all()
    assert open_["steps"].sum() > 0 and open_["accepted_tokens"].sum() > 0
    # the step aggregates (counted per engine step) equal the per-request rows' sums
    assert int(r["steps"].sum()) == s["num_drafts"]
    assert int(r["draft_tokens_verified"].sum()) == s["num_draft_tokens_verified"]
    assert int(r["accepted_tokens"].sum()) == s["num_accepted_tokens"]
    assert int(r["generated_tokens"].sum()) == s["total_generated_tokens"]
    fin = r.filter(pl.col("finished"))
    assert s["total_output_tokens"] == int(fin["generated_tokens"].sum())
    # every generated token came from a step: a decode step emits <= accepted + 1 per
    # request, a completed prefill emits one
    assert (r["generated_tokens"] <= r["accepted_tokens"] + r["steps"] + 1
            + r["preemptions"]).all()


# -- fronts use the steady figures -------------------------------------------------------------
def _two_basis_frame() -> pl.DataFrame:
    rows = []
    for i, x in enumerate([10.0, 20.0, 30.0]):
        rows.append({"policy": "mtp1", "policy_spec": "mtp1", "seed": 0,
                     "load_kind": "concurrency", "load": float(i), "concurrency": i,
                     "point_id": f"p{i}", "stable": True,
                     fr.X: x, fr.Y: 100.0 - x,  # whole run
                     "steady_" + fr.X: x + 1.0, "steady_" + fr.Y: 200.0 - x,
                     "mean_verify_tokens_per_request_step": 2.0,
                     "steady_mean_verify_tokens_per_request_step": 2.0,
                     "steady_window_short": i == 2})
    rows.append(dict(rows[0], point_id="none", load=9.0, **{"steady_" + fr.X: None}))
    return pl.DataFrame(rows)


def test_fronts_default_to_steady_and_whole_is_available():
    df = _two_basis_frame()
    steady = fr.compute_fronts(df)["mtp1"]
    assert steady.x.tolist() == [11.0, 21.0, 31.0] and steady.y.tolist() == [190, 180, 170]
    whole = fr.compute_fronts(df, basis="whole")["mtp1"]
    assert whole.x.tolist() == [10.0, 20.0, 30.0]
    v = fr.metric_view(df)
    assert v["whole_" + fr.X].to_list()[:3] == [10.0, 20.0, 30.0]
    assert fr.metric_view(v).equals(v)  # idempotent
    assert fr.basis_used(df) == "steady"
    assert fr.basis_used(df.drop("steady_" + fr.X)) == "whole"
    h = fr.headline(df, candidate="mtp1", baseline="mtp1")
    assert h[0]["basis"] == "steady"
    assert "steady state" in fr.format_headline(h)
    agg = fr.aggregate_seeds(df)
    assert agg["steady_window_short"].to_list() == [False, False, True, False]
    with pytest.raises(Exception, match="basis"):
        fr.compute_fronts(df, basis="bogus")


def test_sweep_rows_carry_steady_columns(tmp_path):
    from dspark_sim.sim.config import preset
    from dspark_sim.sim.sweep import run_sweep

    base = replace(preset("tiny"), workload=replace(preset("tiny").workload, num_requests=60))
    df = run_sweep(base, qps=[10], policies=["mtp1"], out=tmp_path, executor="serial",
                   progress=False)
    for col in ("steady_output_throughput_per_gpu", "steady_median_interactivity",
                "steady_window_start_s", "steady_window_rule", "steady_window_short",
                "steady_mean_concurrency", "size_doublings"):
        assert col in df.columns, col
    assert df.schema["steady_window_note"] == pl.Utf8


# -- precision (batch means) -------------------------------------------------------------------
def test_batch_means_errors_by_hand():
    from dspark_sim.sim.metrics import _rse_median, _rse_throughput

    # 100 steps of 1 s ending at 0.5 .. 99.5: 20 batches of 5 steps; batches alternate
    # 10 and 20 tokens (2 or 4 per step). Batch rates: ten 10s and ten 20s, mean 15,
    # sd (n-1) = sqrt(20 * 25 / 19); SE = sd / sqrt(20); RSE = SE / 15.
    end = np.arange(100) + 0.5
    per_step = np.where((end // 5) % 2 == 0, 2.0, 4.0)
    steps = StepSeries.of(end, 1.0, emitted_tokens=per_step)
    sd = np.sqrt(20 * 25 / 19)
    assert _rse_throughput(steps, 0.0, 100.0) == pytest.approx(sd / np.sqrt(20) / 15)
    assert _rse_throughput(StepSeries.of(end, 1.0, emitted_tokens=3.0), 0.0, 100.0) == 0.0
    # 100 requests in arrival order, 20 groups of 5 alike: group medians alternate 100 and
    # 110, the overall median is 105
    vals = np.repeat(np.where(np.arange(20) % 2 == 0, 100.0, 110.0), 5)
    arrival = np.arange(100.0)[::-1]  # ordered by arrival, not by position
    got = _rse_median(vals[::-1], arrival)
    assert got == pytest.approx(sd / np.sqrt(20) / 105)
    assert _rse_median(vals[:50], arrival[:50]) is None  # too few for 20 batches of 5

def test_batch_means_window_is_half_open_and_small_rates_count():
    """101 steps ending at 0, 1, ..., 100 s, 0.1 token each, window (0, 100]: the step
    ending at 0 is outside, the one at 100 inside, so 100 steps in 20 batches of 5 s:
    batch 0 holds the steps ending at 1-4 s (4), batches 1-18 five each, batch 19 the
    ones at 95-100 s (6). Rates 0.4, 0.5 x 18, 0.6: mean 0.5 (under one token per batch
    is still a rate), sd (n-1) = sqrt(2 x 0.01 / 19)."""
    from dspark_sim.sim.metrics import _rse_throughput

    steps = StepSeries.of(np.arange(101.0), 1.0, emitted_tokens=0.1)
    sd = np.sqrt(2 * 0.01 / 19)
    assert _rse_throughput(steps, 0.0, 100.0) == pytest.approx(sd / np.sqrt(20) / 0.5)
    # nothing emitted: no relative error
    assert _rse_throughput(StepSeries.of(np.arange(101.0), 1.0), 0.0, 100.0) is None
    # too few steps for 20 batches of 5: the 99 steps of (1, 100]
    assert _rse_throughput(steps, 1.0, 100.0) is None


def test_batch_medians_of_small_and_zero_values():
    from dspark_sim.sim.metrics import _rse_median

    # the by-hand groups above scaled by 1/1000: medians under 1 are still medians
    vals = np.repeat(np.where(np.arange(20) % 2 == 0, 0.100, 0.110), 5)
    sd = np.sqrt(20 * 0.005 ** 2 / 19)
    assert _rse_median(vals, np.arange(100.0)) == pytest.approx(sd / np.sqrt(20) / 0.105)
    # a median of 0 has no relative error
    assert _rse_median(np.zeros(100), np.arange(100.0)) is None


def test_queue_growth_by_hand():
    """Arrivals every 0.1 s and nothing finishing: the requests in the system climb 10 a
    second (a staircase; its least-squares line over [0, 10] has slope 10 to within the
    step's 1/10)."""
    from dspark_sim.sim.metrics import in_system, queue_growth

    arr = np.arange(100) / 10
    fin = np.full(100, np.nan)
    assert queue_growth(arr, fin, 0.0, 10.0) == pytest.approx(10.0, rel=0.02)
    # in the system at t: arrived at or before t, not finished at or before t. Those
    # arriving before 5 s live 0.5 s. At 0: the one arriving at 0. At 0.45 s: 5 arrived
    # (0-0.4 s), none finished. At 5 s: 51 arrived (0-5 s) and 46 finished (arrivals
    # 0-4.5 s, the last exactly at 5 s)
    assert in_system(arr, np.where(arr < 5, arr + 0.5, np.nan),
                     np.array([0.0, 0.45, 5.0])).tolist() == [1.0, 5.0, 5.0]
    # a window of no length has no growth
    assert queue_growth(arr, fin, 3.0, 3.0) == 0.0



def test_sizing_target_rse_decides_doubling():
    from dspark_sim.sim.sweep import Sizing, _needs_more

    sz = Sizing(max_doublings=2, target_rse=0.005)
    ok = {"steady_window_short": False, "steady_output_throughput_rse": 0.004,
          "steady_median_interactivity_rse": 0.002}
    assert not _needs_more(ok, sz)
    assert _needs_more(dict(ok, steady_median_interactivity_rse=0.006), sz)
    assert _needs_more(dict(ok, steady_output_throughput_rse=None), sz)  # unknown: too large
    assert _needs_more(dict(ok, steady_window_short=True), sz)
    assert not _needs_more(dict(ok, steady_median_interactivity_rse=0.5), Sizing(2))
    with pytest.raises(Exception, match="target-rse"):
        Sizing(target_rse=-0.1).validate()
    Sizing(target_rse=0.999).validate()
    with pytest.raises(Exception, match=r"^--target-rse: must be a fraction in \[0, 1\)"):
        Sizing(target_rse=1).validate()
