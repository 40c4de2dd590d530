"""Request streams (sim/workload.py) against their definitions, by hand: length specs
(fixed, lognormal, long-context, the shipped empirical samples), Poisson and gamma gaps
(moments of the distribution), replayed and closed-loop workload files (timestamps
rescaled by hand), and the per-request trace lengths. Expected values come from the
spec's formula or the data file itself, never from a run of the code under test."""

from __future__ import annotations

import json
from dataclasses import replace
from importlib import resources

import numpy as np
import polars as pl
import pytest

from dspark_sim.errors import InputError
from dspark_sim.sim.config import MAX_TOKENS_PER_REQUEST, WorkloadConfig
from dspark_sim.sim.workload import build_stream, read_workload, sample_lengths

MAX = MAX_TOKENS_PER_REQUEST


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _lognormal_oracle(seed: int, n: int, medians, sigma: float):
    """Prompt and output draws of a lognormal spec: median * e^(sigma Z), Z standard
    normal, the prompts' n draws first, rounded to whole tokens in [1, MAX]."""
    z = _rng(seed).standard_normal(2 * n)
    return [np.clip(np.round(m * np.exp(sigma * z[i * n:(i + 1) * n])), 1, MAX).astype(np.int64)
            for i, m in enumerate(medians)]


# -- length specs ---------------------------------------------------------------------------
def test_fixed_lengths_are_exact():
    p, o, desc = sample_lengths("fixed:300:40", 5, _rng())
    assert p.tolist() == [300] * 5 and o.tolist() == [40] * 5
    assert p.dtype == o.dtype == np.int64
    assert desc == "fixed 300 in / 40 out"
    # one token is the least a request has; both counts are needed
    assert sample_lengths("fixed:1:1", 2, _rng())[0].tolist() == [1, 1]
    for bad in ("fixed:0:5", "fixed:5:0"):  # the form is right, a count is not
        with pytest.raises(InputError, match="fixed token counts must be at least 1"):
            sample_lengths(bad, 3, _rng())
    for bad in ("fixed:5", "fixed:5:5:5", "fixed:a:5"):
        with pytest.raises(InputError, match="--lengths: bad length spec"):
            sample_lengths(bad, 3, _rng())


@pytest.mark.parametrize("spec, medians, sigma", [
    ("lognormal:2000:300", (2000, 300), 0.8),  # the default sigma
    ("lognormal:2000:300:0.25", (2000, 300), 0.25),
    ("lognormal:2000:300:4", (2000, 300), 4.0),  # the limit itself is allowed
    ("long-context", (32768, 512), 0.5),  # the documented defaults
    ("long-context:65536:128", (65536, 128), 0.5),
    ("long-context:65536:128:1.5", (65536, 128), 1.5),
])
def test_lognormal_lengths_follow_the_formula(spec, medians, sigma):
    n = 400
    p, o, desc = sample_lengths(spec, n, _rng(7))
    want_p, want_o = _lognormal_oracle(7, n, medians, sigma)
    assert np.array_equal(p, want_p) and np.array_equal(o, want_o)
    assert p.dtype == o.dtype == np.int64
    assert desc == f"lognormal medians {medians[0]:g}/{medians[1]:g}"


def test_lognormal_draws_are_clipped_to_whole_tokens_in_range():
    # median 1, sigma 4: about half the draws round to 0 (clipped up to 1); median 2^24,
    # sigma 4: about half exceed the limit (clipped down to it)
    p, o, _ = sample_lengths(f"lognormal:1:{MAX}:4", 2000, _rng(1))
    assert p.min() == 1 and o.max() == MAX
    assert (p == 1).mean() > 0.4 and (o == MAX).mean() > 0.4


@pytest.mark.parametrize("spec", ["lognormal:2000:300:4.001", "long-context:100:100:4.5"])
def test_a_sigma_above_the_limit_is_refused(spec):
    with pytest.raises(InputError, match=r"--lengths.*sigma .* above the limit of 4"):
        sample_lengths(spec, 3, _rng())


@pytest.mark.parametrize("spec", ["lognormal:300", "lognormal:1:2:3:4", "long-context:5",
                                  "long-context:1:2:3:4", "nosuch", "azure-conv:5",
                                  "mooncake:1:2"])
def test_malformed_length_specs_are_refused(spec):
    with pytest.raises(InputError, match="--lengths: bad length spec"):
        sample_lengths(spec, 3, _rng())


@pytest.mark.parametrize("spec", ["lognormal:0:300", "lognormal:300:0", "lognormal:300:300:0",
                                  "long-context:0:5", "long-context:5:5:0",
                                  "lognormal:-1:300"])
def test_length_specs_of_the_right_form_with_a_zero_say_so(spec):
    with pytest.raises(InputError, match=f"--lengths: '{spec}': medians and sigma must be "
                                         "above 0"):
        sample_lengths(spec, 3, _rng())


@pytest.mark.parametrize("name", ["azure-conv", "azure-code", "mooncake"])
def test_named_lengths_are_rows_of_the_shipped_sample(name):
    """Each request takes the prompt and output of one row of the named dataset, the
    rows drawn uniformly with the run's generator."""
    res = resources.files("dspark_sim.sim") / "data" / "lengths.parquet"
    with resources.as_file(res) as fp:
        df = pl.read_parquet(fp).filter(pl.col("dataset") == name)
    rows = _rng(3).integers(0, df.height, size=50)
    p, o, desc = sample_lengths(name, 50, _rng(3))
    assert p.tolist() == df["prompt_tokens"].to_numpy()[rows].tolist()
    assert o.tolist() == df["output_tokens"].to_numpy()[rows].tolist()
    assert p.dtype == o.dtype == np.int64
    assert desc == f"{name} empirical lengths"


# -- open loop: Poisson and gamma arrivals ----------------------------------------------------
def _open(**kw) -> WorkloadConfig:
    return replace(WorkloadConfig(lengths="fixed:10:5"), **kw)


@pytest.mark.parametrize("arrival, burstiness, cv2", [
    ("poisson", 1.0, 1.0),  # exponential gaps: CV^2 = 1
    ("poisson", 0.25, 1.0),  # a burstiness means nothing to Poisson arrivals
    ("gamma", 0.25, 4.0),  # Gamma(shape b): CV^2 = 1 / b
    ("gamma", 4.0, 0.25),
])
def test_open_loop_gaps_have_the_rate_and_shape_asked_for(arrival, burstiness, cv2):
    """Gaps ~ Gamma(shape b, scale 1 / (qps b)): mean 1 / qps whatever b, CV^2 = 1 / b.
    20,000 gaps: the mean is within ~1 % (4 % allowed), CV^2 within ~2-4 % (10 %)."""
    qps, n = 50.0, 20_000
    s = build_stream(_open(arrival=arrival, qps=qps, burstiness=burstiness, num_requests=n),
                     _rng(11))
    assert s.size == n and s.arrival_s[0] == 0.0  # the first request arrives at t = 0
    gaps = np.diff(s.arrival_s)
    assert gaps.min() >= 0
    assert abs(gaps.mean() * qps - 1) < 0.04
    assert abs(gaps.var() / gaps.mean() ** 2 / cv2 - 1) < 0.1
    kind = "Poisson" if cv2 == 1.0 else f"gamma(burstiness={burstiness:g})"
    assert s.description == f"{kind} arrivals at 50 req/s, fixed 10 in / 5 out"
    assert s.prompt_tokens.tolist() == [10] * n and s.trace_rows is None


def test_gamma_arrivals_of_shape_one_are_called_poisson():
    s = build_stream(_open(arrival="gamma", burstiness=1.0, num_requests=5), _rng())
    assert s.description.startswith("Poisson arrivals at 200 req/s")


@pytest.mark.parametrize("num_requests", [None, 100_000])
@pytest.mark.parametrize("burstiness", [1.0, 0.01])
def test_a_duration_bounds_the_arrival_window(num_requests, burstiness):
    """Every arrival lies inside the window; the count is ~ qps * duration (Poisson: sd
    sqrt(qps * duration) ~ 45; 5 sd allowed). A bursty stream (shape 0.01: most gaps ~0,
    a few very long) needs the window filled past its first batch of draws: the arrivals
    still rise and stay inside it."""
    qps, duration_s = 40.0, 50.0
    s = build_stream(_open(arrival="gamma", qps=qps, burstiness=burstiness,
                           num_requests=num_requests, duration_s=duration_s), _rng(5))
    assert s.arrival_s[0] == 0.0 and s.arrival_s[-1] < duration_s
    assert np.all(np.diff(s.arrival_s) >= 0)
    assert s.prompt_tokens.size == s.output_tokens.size == s.arrival_s.size
    if burstiness == 1.0:
        assert abs(s.size - qps * duration_s) < 5 * np.sqrt(qps * duration_s)


def test_a_count_caps_a_window_that_would_hold_more():
    s = build_stream(_open(qps=100.0, num_requests=30, duration_s=100.0), _rng())
    assert s.size == 30


def test_a_window_no_request_arrives_in_is_refused():
    with pytest.raises(InputError, match="--qps/--duration-s: no request arrived inside the "
                                         "1 s window at 0.001 req/s"):
        build_stream(_open(qps=1e-3, num_requests=None, duration_s=1.0), _rng())
    with pytest.raises(InputError, match="--qps/--duration-s"):
        build_stream(_open(qps=1e-3, num_requests=5, duration_s=1.0), _rng())


# -- workload files: replay and closed loop ---------------------------------------------------
# Mooncake timestamps in ms, out of order; a zero output length (served as one token)
ROWS = [(2000, 70, 1), (0, 100, 20), (900, 50, 10), (500, 30, 7)]


def _mooncake(path, rows=ROWS):
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": i, "output_length": o})
                            + "\n" for t, i, o in rows))
    return str(path)


def test_read_workload_sorts_by_time_and_starts_at_zero(tmp_path):
    df = read_workload(_mooncake(tmp_path / "w.jsonl", [(t + 4000, i, o) for t, i, o in ROWS]))
    assert np.allclose(df["arrival_s"], [0.0, 0.5, 0.9, 2.0], rtol=0, atol=1e-12)
    assert df["prompt_tokens"].to_list() == [100, 30, 50, 70]
    assert df["output_tokens"].to_list() == [20, 7, 10, 1]


@pytest.mark.parametrize("rows, message", [
    ([], "workload has no requests"),
    ([(0, -1, 5)], "negative token count in prompt_tokens"),
    ([(0, 5, -1)], "negative token count in output_tokens"),
    # served as one token, a request of none would change the workload unsaid
    ([(0, 5, 5), (1, 5, 0)], "data row 2: output_tokens is 0"),
    ([(0, 0, 5)], "data row 1: prompt_tokens is 0"),
    ([(0, 5, 5), (1e400, 5, 5)], "workload has unparseable timestamps"),  # JSON reads inf
])
def test_read_workload_refuses_what_is_not_a_request(tmp_path, rows, message):
    p = _mooncake(tmp_path / "w.jsonl", rows)
    with pytest.raises(InputError, match=f"w.jsonl: {message}"):
        read_workload(p)
    with pytest.raises(InputError, match="workload file not found"):
        read_workload(tmp_path / "none.jsonl")


AZURE = ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
         "2023-11-16 18:15:50.9951690,396,109\n2023-11-16 18:15:51.2000000,100,10\n")


def test_azure_timestamps_read_as_seconds_from_the_first(tmp_path):
    """7 fractional digits trimmed to microseconds: 46.680590, 50.995169, 51.200000 (the
    epoch seconds, ~1.7e9, hold ~0.2 us in a float64)."""
    p = tmp_path / "a.csv"
    p.write_text(AZURE)
    df = read_workload(p)
    assert np.allclose(df["arrival_s"], [0.0, 4.314579, 4.519410], rtol=0, atol=1e-6)
    assert df["prompt_tokens"].to_list() == [374, 396, 100]
    assert df["output_tokens"].to_list() == [44, 109, 10]


@pytest.mark.parametrize("old, new, row", [
    ("2023-11-16 18:15:50.9951690", "yesterday", 2),
    (",396,", ",lots,", 2),
    (",10\n", ",ten\n", 3),
])
def test_azure_unparseable_cells_name_their_row(tmp_path, old, new, row):
    """One bad cell, not a polars parse error: the row is named (the columns are read as
    text and converted leniently, nulls marking what did not convert)."""
    p = tmp_path / "a.csv"
    p.write_text(AZURE.replace(old, new))
    with pytest.raises(InputError, match=f"^{p}: unparseable value in data row {row}$"):
        read_workload(p)
    p.write_text(AZURE.replace("ContextTokens", "Context"))
    with pytest.raises(InputError, match="needs columns ContextTokens, GeneratedTokens, TIMESTAMP"):
        read_workload(p)


def test_mooncake_counts_up_to_the_per_request_limit_are_read(tmp_path):
    df = read_workload(_mooncake(tmp_path / "w.jsonl", [(0, MAX, 1), (5, 1, MAX)]))
    assert df["prompt_tokens"].to_list() == [MAX, 1] and df["output_tokens"].max() == MAX


def test_requests_at_the_same_time_keep_the_files_order(tmp_path):
    rows = [(100, 1, 1), *[(50, i, 1) for i in range(2, 40)], (0, 99, 1)]
    df = read_workload(_mooncake(tmp_path / "w.jsonl", rows))
    assert df["prompt_tokens"].to_list() == [99, *range(2, 40), 1]


def _replay(path, **kw) -> WorkloadConfig:
    return WorkloadConfig(arrival="replay", workload_path=path, **{"num_requests": None, **kw})


def test_replay_keeps_the_files_times_and_lengths(tmp_path):
    s = build_stream(_replay(_mooncake(tmp_path / "w.jsonl")), _rng())
    assert s.arrival_s.tolist() == [0.0, 0.5, 0.9, 2.0]
    assert s.prompt_tokens.tolist() == [100, 30, 50, 70]
    assert s.output_tokens.tolist() == [20, 7, 10, 1]
    assert s.trace_rows is None
    # 4 requests, 3 gaps over 2 s: 1.5 req/s
    assert s.description == "replay of w.jsonl (1.50 req/s native)"


def test_replay_rescaled_to_a_rate(tmp_path):
    s = build_stream(_replay(_mooncake(tmp_path / "w.jsonl"), replay_qps=6.0), _rng())
    # native 1.5 req/s -> 6 req/s: every time divided by 4
    assert np.allclose(s.arrival_s, [0.0, 0.125, 0.225, 0.5], rtol=0, atol=1e-12)
    assert s.description == "replay of w.jsonl (1.50 req/s native, time-scaled to 6 req/s)"


@pytest.mark.parametrize("kw, kept", [
    ({"duration_s": 0.9}, 2),  # the window is half-open: t = 0.9 is outside
    ({"duration_s": 0.91}, 3),
    ({"duration_s": 0.1}, 1),
    ({"num_requests": 3}, 3),
    ({"num_requests": 1}, 1),
    ({"num_requests": 10}, 4),
    ({"num_requests": 3, "duration_s": 0.6}, 2),
])
def test_replay_window_and_count(tmp_path, kw, kept):
    s = build_stream(_replay(_mooncake(tmp_path / "w.jsonl"), **kw), _rng())
    assert s.arrival_s.tolist() == [0.0, 0.5, 0.9, 2.0][:kept]
    assert s.prompt_tokens.tolist() == [100, 30, 50, 70][:kept]


def test_replay_of_one_request_has_no_rate_to_rescale(tmp_path):
    """Replayed as it is; a rate to rescale it to is refused, not dropped without a word."""
    one = _mooncake(tmp_path / "w.jsonl", [(300, 8, 9)])
    s = build_stream(_replay(one), _rng())
    assert s.arrival_s.tolist() == [0.0] and s.output_tokens.tolist() == [9]
    assert s.description == "replay of w.jsonl (inf req/s native)"
    with pytest.raises(InputError, match=r"--replay-qps: the 1 request\(s\) .* one instant"):
        build_stream(_replay(one, replay_qps=5.0), _rng())


def test_replay_past_the_clock_limit_is_refused(tmp_path):
    """The simulated clock holds 1e7 s: a replay ending exactly there runs, one past it is
    refused, naming the rate when one was given (else the file)."""
    ok = _mooncake(tmp_path / "ok.jsonl", [(0, 5, 5), (1e10, 5, 5)])  # ms: 1e7 s
    assert build_stream(_replay(ok), _rng()).arrival_s.tolist() == [0.0, 1e7]
    far = _mooncake(tmp_path / "far.jsonl", [(0, 5, 5), (2e10, 5, 5)])
    with pytest.raises(InputError, match=r"far.jsonl: the replay spans 2e\+07 s"):
        build_stream(_replay(far), _rng())
    # 1 req/s native -> 1e-7 req/s: 1 s becomes 1e7 s
    slow = _mooncake(tmp_path / "slow.jsonl", [(0, 5, 5), (1000, 5, 5), (2000, 5, 5)])
    with pytest.raises(InputError, match=r"^--replay-qps: the replay spans 2e\+07 s"):
        build_stream(_replay(slow, replay_qps=1e-7), _rng())
    # ... unless the count or window cuts it short
    assert build_stream(_replay(slow, replay_qps=1e-7, num_requests=2), _rng()).size == 2


def test_replay_with_explicit_lengths_overrides_the_files(tmp_path):
    s = build_stream(_replay(_mooncake(tmp_path / "w.jsonl"), lengths="fixed:11:12"), _rng())
    assert s.prompt_tokens.tolist() == [11] * 4 and s.output_tokens.tolist() == [12] * 4
    assert s.arrival_s.tolist() == [0.0, 0.5, 0.9, 2.0]
    assert s.description == ("replay of w.jsonl (1.50 req/s native), fixed 11 in / 12 out, "
                             "overriding the file's lengths")


def _closed(path=None, **kw) -> WorkloadConfig:
    return WorkloadConfig(arrival="closed", max_concurrency=3, workload_path=path, **kw)


@pytest.mark.parametrize("num_requests, n, which", [
    (None, 4, "all 4 requests of the file"),
    (4, 4, "all 4 requests of the file"),
    (2, 2, "the file's first 2 of 4 requests"),
    (3, 3, "the file's first 3 of 4 requests"),
    (5, 4, "all 4 requests of the file, fewer than --num-requests 5"),
])
def test_closed_loop_sends_the_files_requests_in_time_order(tmp_path, num_requests, n, which):
    s = build_stream(_closed(_mooncake(tmp_path / "w.jsonl"), num_requests=num_requests), _rng())
    assert s.arrival_s.tolist() == [0.0] * n  # the clients decide when; the times are unused
    assert s.prompt_tokens.tolist() == [100, 30, 50, 70][:n]
    assert s.output_tokens.tolist() == [20, 7, 10, 1][:n]
    assert s.description == f"closed loop, 3 clients, lengths of w.jsonl ({which}, in order)"


def test_closed_loop_without_a_file_draws_its_lengths():
    s = build_stream(_closed(num_requests=6, lengths="fixed:8:9"), _rng())
    assert s.arrival_s.tolist() == [0.0] * 6 and s.output_tokens.tolist() == [9] * 6
    assert s.description == "closed loop, 3 clients, fixed 8 in / 9 out"


def test_a_stream_is_frozen():
    from dataclasses import FrozenInstanceError

    s = build_stream(_closed(num_requests=2, lengths="fixed:8:9"), _rng())
    with pytest.raises(FrozenInstanceError):
        s.description = "edited"


def test_one_token_requests_stay_one_token(tmp_path):
    """One token is one token (not raised further); zero is refused (above)."""
    s = build_stream(_replay(_mooncake(tmp_path / "w.jsonl", [(0, 1, 1), (20, 2, 3)])), _rng())
    assert s.prompt_tokens.tolist() == [1, 2] and s.output_tokens.tolist() == [1, 3]


def test_a_negative_count_anywhere_in_the_file_is_refused(tmp_path):
    p = _mooncake(tmp_path / "w.jsonl", [(0, 5, 5), (1, 5, -2), (2, 5, 5)])
    with pytest.raises(InputError, match="negative token count in output_tokens"):
        read_workload(p)


def test_a_bursty_window_is_filled_past_the_first_batch_of_gaps(monkeypatch):
    """Shape 0.01 at 1 req/s over 10 s: the first batch of gaps (~50) often sums to less
    than the window (a few gaps carry almost all the time), so more are drawn until it is
    filled. Each later batch continues from the last arrival: the arrivals keep rising."""
    import dspark_sim.sim.workload as wl

    calls = []
    gaps = wl._gaps
    monkeypatch.setattr(wl, "_gaps", lambda *a: calls.append(1) or gaps(*a))
    refilled = 0
    for seed in range(24):
        calls.clear()
        s = build_stream(_open(arrival="gamma", qps=1.0, burstiness=0.01, num_requests=None,
                               duration_s=10.0), _rng(seed))
        refilled += len(calls) > 1
        assert s.arrival_s[0] == 0.0 and s.arrival_s[-1] < 10.0
        assert np.all(np.diff(s.arrival_s) >= 0), seed
    assert refilled  # the refill is exercised (in 7 of these 24 seeds), not just possible


# -- lengths from an acceptance trace ---------------------------------------------------------
@pytest.fixture(scope="module")
def trace():
    from pathlib import Path

    from dspark_sim.traces.importers import import_specdecode_bench

    return import_specdecode_bench(Path(__file__).parents[1] / "data" / "specdecode_bench"
                                   / "combined_fixture.jsonl")


def test_trace_sample_draws_rows_uniformly_with_the_seed(trace):
    n = 200
    s = build_stream(_closed(num_requests=n, lengths="trace:sample"), _rng(9), trace=trace)
    rows = _rng(9).integers(0, trace.num_requests, size=n)  # every row, the first included
    assert s.trace_rows.tolist() == rows.tolist()
    assert s.prompt_tokens.tolist() == trace.req_prompt_tokens[rows].tolist()
    assert "drawn with the seed" in s.description


def test_trace_lengths_of_one_token_stay_one_and_of_zero_are_refused(trace):
    t = replace(trace, req_prompt_tokens=np.array([1, 1, 2, 1, 4, 7]),
                req_output_tokens=np.array([1, 2, 1, 2, 3, 1]))
    s = build_stream(_closed(num_requests=8, lengths="trace"), _rng(), trace=t)
    assert s.trace_rows.tolist() == [0, 1, 2, 3, 4, 5, 0, 1]  # cycled in order
    assert s.prompt_tokens.tolist() == [1, 1, 2, 1, 4, 7, 1, 1]
    assert s.output_tokens.tolist() == [1, 2, 1, 2, 3, 1, 1, 2]
    # served as one token, a request of none would change the workload unsaid
    zero = replace(t, req_output_tokens=np.array([1, 0, 1, 2, 3, 0]))
    with pytest.raises(InputError, match=rf"output_tokens of request {trace.req_ids[1]} is 0"):
        build_stream(_closed(num_requests=8, lengths="trace"), _rng(), trace=zero)


def test_trace_lengths_need_a_trace_that_carries_them(trace):
    w = _closed(num_requests=3, lengths="trace")
    with pytest.raises(InputError, match="needs a trace .*; no trace has none"):
        build_stream(w, _rng(), trace=None)
    bare = replace(trace, req_prompt_tokens=None, req_output_tokens=None, source_path="b.parquet")
    with pytest.raises(InputError, match="needs a trace .*; trace b.parquet has none"):
        build_stream(w, _rng(), trace=bare)


def test_the_first_trace_request_past_the_limit_is_named(trace):
    big = trace.req_output_tokens.copy()
    big[1], big[3] = MAX, MAX + 1  # the limit itself is a length
    with pytest.raises(InputError, match=rf"output_tokens of request {trace.req_ids[3]} "
                                         rf"\(16,777,217\) is above"):
        build_stream(_closed(num_requests=3, lengths="trace"), _rng(),
                     trace=replace(trace, req_output_tokens=big))
