"""vLLM in the loop, on two recorded real runs (tests/data/vllm-cpu/run-1, run-2: vLLM 0.32
on this project's 2-core CPU box, SmolLM2-135M fp32, none and ngram k = 1, 3, 5 at
concurrency 1-16 and one open-loop rate; the bench client's own result files, the
scrapes and the manifest, as `dspark-sim vllm measure` wrote them, 50 minutes apart).

The suite checks import -> calibrate -> predict against those measurements with the
split docs/validation.md states (fitted on none at every load plus ngram k = 3 at the
lightest and heaviest closed-loop load, everything else held out), and that the docs
show each comparison as the code computes it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from doc_blocks import check_block
from typer.testing import CliRunner

from dspark_sim.calibration.profile import load_profile
from dspark_sim.cli import app
from dspark_sim.errors import InputError
from dspark_sim.traces.schema import read_trace
from dspark_sim.validation.vllm_compare import (
    compare,
    default_split,
    load_engine,
    markdown,
    parse_split,
)
from dspark_sim.validation.vllm_fit import (
    lone_requests,
    lone_ttft_ms,
    read_bench_run,
    read_bench_runs,
)

# Slow (refits and re-simulates the recorded vLLM runs): out of the default run, in .ci/run's slow leg.
pytestmark = pytest.mark.slow

RECORDED = Path(__file__).parents[1] / "data" / "vllm-cpu"
RECORDINGS = ("run-1", "run-2")
# run-3: every point in three interleaved rounds (resident servers, the settings' order
# rotated each round) and each n-gram k's own per-request acceptance pass
INTERLEAVED = "run-3"
# run-4: as run-3, and the loads' order rotated across the rounds as well
ROTATED = "run-4"
# run-5: as run-4 with six requests per client (24 at C = 4, 48 at C = 8)
LONGER = "run-5"
# run-6: as run-5, measured after the fit's rules were last changed and scored blind
BLIND = "run-6"
# run-7: as run-6, measured and scored blind again, the fit's rules still unchanged
BLIND_AGAIN = "run-7"
ALL = (*RECORDINGS, INTERLEAVED, ROTATED, LONGER, BLIND, BLIND_AGAIN)
SPLIT = "none,ngram-k3@c1,ngram-k3@c16"
DOC = Path(__file__).parents[2] / "docs" / "validation.md"


@pytest.fixture(scope="module")
def runs():
    return read_bench_runs([RECORDED / "run-2" / "runs"])


@pytest.fixture(scope="module")
def comparisons():
    return {name: compare(read_bench_runs([RECORDED / name / "runs"]),
                          engine=load_engine(RECORDED / name / "manifest.json"), split=SPLIT)
            for name in ALL}


@pytest.mark.parametrize("name", ALL)
def test_the_recorded_run_is_what_the_docs_say(name):
    runs = read_bench_runs([RECORDED / name / "runs"])
    names = {r.name for r in runs}
    settings = {"none", "ngram-k1", "ngram-k3", "ngram-k5"}
    assert {r.setting for r in runs} == settings
    assert names == {f"{s}@{load}" for s in settings
                     for load in ("c1", "c2", "c4", "c8", "c16", "r0.5")}
    assert {r.k for r in runs if r.setting == "ngram-k5"} == {5}
    manifest = json.loads((RECORDED / name / "manifest.json").read_text())
    assert manifest["engine"] == "vllm" and manifest["prefix_caching"] is False
    assert manifest["max_num_batched_tokens"] == 1024 and manifest["kv_capacity_tokens"] > 0
    # speculation pays somewhere by at least 15 %: the regime the comparison is about
    gains = []
    for c in (1, 2, 4):
        none = next(r for r in runs if r.name == f"none@c{c}")
        best = max(r.measured["output_throughput"] for r in runs if r.concurrency == c and r.k)
        gains.append(best / none.measured["output_throughput"] - 1)
    assert max(gains) >= 0.15


def test_default_split_is_the_documented_one(runs):
    assert default_split(runs) == SPLIT


@pytest.mark.parametrize("name", ALL)
def test_docs_carry_each_recordings_comparison(comparisons, name):
    """docs/validation.md shows each recording's table as the code computes it now
    (regenerate: DSPARK_SIM_WRITE_DOCS=1 python -m pytest tests/validation/test_vllm_loop.py)."""
    check_block(DOC, f"vllm-cpu:{name}", markdown(comparisons[name]))


@pytest.mark.parametrize("name", RECORDINGS)
def test_comparison_holds_out_enough_and_fits_its_own_runs(comparisons, name):
    cmp = comparisons[name]
    h = cmp.headline()
    assert h["fitted_points"] == 8 and h["held_out_points"] == 16
    fitted = cmp.table.filter((pl.col("split") == "fitted")
                              & pl.col("figure").is_in(["output_throughput", "median_tpot_ms"]))
    assert fitted["error"].abs().max() < 0.15  # in-sample: the cost model can express them
    assert cmp.regimes.height == 6 and set(cmp.regimes.columns) >= {
        "measured_best", "simulated_best", "pick_shortfall", "pick_ok", "same_ranking"}


def test_the_interleaved_run_repeats_each_point_and_picks_within_the_best_spread(
        comparisons):
    """run-3, the documented split: every point measured once a round in three rounds;
    every n-gram k replays its own measured per-request acceptance (none extrapolated),
    which reproduces vLLM's tau of each held-out run within 2 %; and at every load the
    simulator's pick is vLLM's best or lies within the best's spread (or 3 %)."""
    cmp = comparisons[INTERLEAVED]
    runs = read_bench_runs([RECORDED / INTERLEAVED / "runs"])
    per_point: dict[str, set] = {}
    for r in runs:
        per_point.setdefault(r.name, set()).add(r.round)
    assert len(per_point) == 24 and all(v == {1, 2, 3} for v in per_point.values())
    assert cmp.headline()["max_repeats"] == 3 and cmp.noise is not None
    assert set(cmp.acceptance) == {"ngram-k1", "ngram-k3", "ngram-k5"}
    assert all(v.startswith("measured per request") for v in cmp.acceptance.values())
    tau = cmp.table.filter((pl.col("split") == "held-out")
                           & (pl.col("figure") == "acceptance_length"))
    assert tau.height == 16 and tau["error"].abs().max() <= 0.02
    assert cmp.regimes["pick_ok"].all()
    # the bounds line counts what against_bounds finds
    b = cmp.against_bounds()
    h = cmp.headline()
    assert (h["held_out_within_bounds"], h["held_out_bounded"]) == (int(b["within"].sum()), 48)


def test_the_interleaved_run_tables_the_step_by_batch_and_it_holds_more_figures(
        comparisons):
    """run-3's none TPOT is not monotonic in the batch beyond its repeats' spread, so
    the default fit tables the step at each batch the none runs decode, fitted to their
    measured token gaps too, and that holds more held-out figures within bounds than the
    linear step on the same split; the single-run recordings, whose spreads are unknown,
    stay linear."""
    cmp = comparisons[INTERLEAVED]
    knots = [n for n in cmp.fit.theta_ms if n.startswith("step_ms@")]
    assert knots == [f"step_ms@{c}" for c in (1, 2, 3, 4, 5, 8, 16)]
    assert cmp.fit.steps == 7
    table = cmp.fit.profile.target_time_s(np.array([1, 2, 4]))
    assert table[2] < table[0] < table[1]  # vLLM CPU decodes 4 rows faster than 1 or 2
    runs = read_bench_runs([RECORDED / INTERLEAVED / "runs"])
    linear = compare(runs, engine=load_engine(RECORDED / INTERLEAVED / "manifest.json"),
                     split=SPLIT, step_table="linear")
    assert "step_fixed_ms" in linear.fit.theta_ms
    held = cmp.headline()["held_out_within_bounds"]
    assert held > linear.headline()["held_out_within_bounds"] and held >= 47
    for name in RECORDINGS:
        assert "step_fixed_ms" in comparisons[name].fit.theta_ms


@pytest.mark.parametrize("name", ALL)
def test_each_fit_holds_its_lone_requests_ttft_line(comparisons, name):
    """Every recording's none runs at C = 1 ran each request alone (and a few of the
    open loop's found the server idle): the fit holds their TTFT line, overhead and
    per-token cost apart, within 10 % at both ends, and the fitted runs' lone requests
    are exactly those."""
    fit = comparisons[name].fit
    runs = [r for r in read_bench_runs([RECORDED / name / "runs"])
            if r.name in fit.profile.parameters["fitted_runs"]]
    c1 = sum(len(r.prompt_tokens) for r in runs if r.name == "none@c1")
    line = fit.line
    assert line.unused == "" and fit.lone == line.requests
    assert line.requests == sum(int(lone_requests(r).sum()) for r in runs) > c1
    assert all(lone_requests(r).all() for r in runs if r.name == "none@c1")
    assert not any(lone_requests(r).any() for r in runs if r.k)
    simulated = lone_ttft_ms(fit.profile, line.ends, fit.engine.max_num_batched_tokens)
    assert simulated == pytest.approx(line.at(line.ends), rel=0.10)
    assert fit.profile.parameters["fit_lone_requests"] == line.requests
    assert "the TTFT line of" in markdown(comparisons[name])


def test_fitted_profile_and_trace_come_from_the_fitted_runs_only(comparisons):
    fit = comparisons["run-2"].fit
    runs = read_bench_runs([RECORDED / "run-2" / "runs"])
    assert set(fit.profile.parameters["fitted_runs"]) == parse_split(SPLIT, runs)
    assert fit.trace is not None and fit.trace.gamma_max == 3
    assert fit.trace.meta.extra["request_rows_from"] == "ngram-k3@c16"
    assert "ngram-k1" not in fit.trace.meta.extra["pooled_runs"]
    assert all(v > 0 for v in fit.theta_ms.values())


def test_split_errors_name_the_option(runs):
    for bad, match in [("ngram-k9", "not a recorded setting"),
                       ("none@c3", "not a recorded run"), (",", "names no run"),
                       ("none,ngram-k1,ngram-k3,ngram-k5", "hold some out")]:
        with pytest.raises(InputError, match=match) as exc:
            parse_split(bad, runs)
        assert exc.value.where == "--fit"


def test_calibrate_vllm_writes_a_profile_and_trace_that_run(tmp_path):
    files = [RECORDED / "run-2" / "runs" / f for f in ("none-c1.json", "none-c4.json", "none-c16.json",
                                             "ngram-k3-c1.json", "ngram-k3-c16.json")]
    r = CliRunner().invoke(app, ["calibrate", "vllm", *map(str, files), "--out",
                                 str(tmp_path / "cal"), "--max-num-seqs", "64",
                                 "--max-num-batched-tokens", "1024"])
    assert r.exit_code == 0, r.output
    prof = load_profile(tmp_path / "cal" / "profile.toml")
    assert prof.kind == "measured" and prof.limits.max_num_batched_tokens == 1024
    trace = read_trace(tmp_path / "cal" / "trace.parquet")
    assert trace.gamma_max == 3
    fit = json.loads((tmp_path / "cal" / "fit.json").read_text())
    assert len(fit["residuals"]) == 15 and max(abs(x["error"]) for x in fit["residuals"]) < 0.25
    run = CliRunner().invoke(app, ["run", "--profile", str(tmp_path / "cal" / "profile.toml"),
                                   "--trace", str(tmp_path / "cal" / "trace.parquet"),
                                   "--policy", "fixed:3", "--replicas", "1",
                                   "--num-requests", "40", "--qps", "0.5",
                                   "--lengths", "fixed:150:64"])
    assert run.exit_code == 0, run.output


def test_vllm_compare_cli_writes_the_table(tmp_path):
    out = tmp_path / "cmp"
    r = CliRunner().invoke(app, ["vllm", "compare", str(RECORDED / "run-2"), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "Worst held-out error" in r.output
    table = pl.read_parquet(out / "comparison.parquet")
    assert set(table["split"]) == {"fitted", "held-out"}
    head = json.loads((out / "comparison.json").read_text())
    assert head["split"] == SPLIT and head["held_out_points"] == 16
    assert load_profile(out / "profile.toml").name == "vllm-fitted"


def test_a_bench_file_that_is_not_one_is_refused_in_one_line(tmp_path):
    bad = tmp_path / "x.json"
    for text, match in [("{", "not a JSON bench serve result"), ("[]", "a JSON object"),
                        (json.dumps({"completed": 1}), "'output_throughput' must be"),
                        (json.dumps({"completed": 2, "output_throughput": 5,
                                     "median_tpot_ms": 3, "median_ttft_ms": 9,
                                     "total_input_tokens": 4, "total_output_tokens": 8,
                                     "request_rate": "inf"}), "cannot tell the run's load")]:
        bad.write_text(text)
        with pytest.raises(InputError, match=match) as exc:
            read_bench_run(bad)
        assert exc.value.where == str(bad)
    r = CliRunner().invoke(app, ["calibrate", "vllm", str(tmp_path / "missing.json"),
                                 "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "missing.json" in r.output and len(r.output.splitlines()) == 1


def test_per_request_rows_serve_each_requests_own_tokens_per_step():
    from dspark_sim.traces.importers import per_request_trace

    surv = np.array([0.7, 0.6, 0.5])  # per draft: E[m] = 1.8, acceptance length 2.8
    out = np.full(4, 4001)
    tau = np.array([1.0, 1.9, 2.8, 3.7])  # no drafts, half, pooled, above pooled
    trace = per_request_trace(surv, out, np.round((out - 1) / tau), seed=3)
    tokens, steps = trace.served_tau_per_request(3)
    assert tokens / steps == pytest.approx(tau, rel=0.03)
    assert trace.draft_tokens is not None  # the first two requests draft only sometimes
    frac = [float((trace.draft_tokens[a:b] > 0).mean())
            for a, b in zip(trace.req_offsets[:-1], trace.req_offsets[1:], strict=True)]
    assert frac == pytest.approx([0.0, 0.5, 1.0, 1.0], abs=0.03)
    # a request at or below the pooled length keeps the pooled per-draft distribution
    row = slice(trace.req_offsets[2], trace.req_offsets[3])
    m = trace.accept_len[row]
    assert [(m >= j).mean() for j in (1, 2, 3)] == pytest.approx(surv, abs=0.03)
    again = per_request_trace(surv, out, np.round((out - 1) / tau), seed=3)
    assert np.array_equal(again.accept_len, trace.accept_len)


def test_calibrate_vllm_fits_repeats_at_their_medians_with_each_constants_uncertainty(
        tmp_path):
    """Three repeats of each of four points (the recorded run, and copies 6 % faster and
    3 % slower): one point each, fitted at the median (the recorded figures), every
    constant printed with its uncertainty and the count of points behind them."""
    from dspark_sim.validation.vllm_fit import PARAMS

    src = RECORDED / "run-2" / "runs"
    names = ("none-c1", "none-c16", "ngram-k3-c1", "ngram-k3-c16")
    for name in names:
        d = json.loads((src / f"{name}.json").read_text())
        for n, scale in enumerate((1.0, 1.06, 0.97), 1):
            e = {**d, "output_throughput": d["output_throughput"] * scale,
                 "median_tpot_ms": d["median_tpot_ms"] / scale, "dspark_round": str(n)}
            (tmp_path / f"{name}.round{n}.json").write_text(json.dumps(e))
    r = CliRunner().invoke(app, ["calibrate", "vllm", str(tmp_path), "--out",
                                 str(tmp_path / "cal"), "--max-num-seqs", "64",
                                 "--max-num-batched-tokens", "1024"])
    assert r.exit_code == 0, r.output
    assert "7 constants from 4 points" in r.output
    fit = json.loads((tmp_path / "cal" / "fit.json").read_text())
    assert fit["points"] == 4 and len(fit["residuals"]) == 12
    for row in fit["residuals"]:
        original = json.loads((src / f"{row['file'].split('.round')[0]}.json").read_text())
        assert row["repeats"] == 3
        assert row["measured"] == pytest.approx(original[row["metric"]])
    assert set(fit["constants"]) == set(PARAMS)
    for c in fit["constants"].values():
        assert c["flag"] in ("", "at its bound 0", "not identified")
        assert c["relative_sd"] is None or c["relative_sd"] > 0  # the repeats scatter


def test_the_longer_run_holds_its_held_out_figures_and_picks_at_every_load(comparisons):
    """run-5, the documented split: 24 and 48 requests at C = 4 and 8. Its none points'
    TPOT misses the linear step by less than three times their spread, but each round's
    token gaps show the step with two requests decoding slower than with three, beyond
    the rounds' scatter, so the default fit tables the step; then every held-out figure
    meets the bounds (or its spread), where the linear step holds 47, and the pick is
    vLLM's best or within the best's spread at every load."""
    cmp = comparisons[LONGER]
    runs = read_bench_runs([RECORDED / LONGER / "runs"])
    counts = {r.concurrency: len(r.prompt_tokens) for r in runs if r.concurrency}
    assert counts == {1: 12, 2: 12, 4: 24, 8: 48, 16: 96}
    assert "step_ms@2" in cmp.fit.theta_ms
    h = cmp.headline()
    assert (h["held_out_within_bounds"], h["held_out_bounded"]) == (48, 48)
    assert cmp.regimes["pick_ok"].all() and h["picks_within_tolerance"]
    linear = compare(runs, engine=load_engine(RECORDED / LONGER / "manifest.json"),
                     split=SPLIT, step_table="linear")
    assert linear.headline()["held_out_within_bounds"] == 47


def test_the_blind_run_holds_all_but_one_held_out_figure_and_picks_at_every_load(
        comparisons):
    """run-6, measured at the code that fits it now and scored without touching the fit:
    47 of the 48 held-out figures within the bounds; the one outside is k = 5's
    throughput at C = 2, predicted 11 % high against a 10 % bound and a ±3 % spread.
    The pick is vLLM's best, or within the best's spread, at every load."""
    cmp = comparisons[BLIND]
    runs = read_bench_runs([RECORDED / BLIND / "runs"])
    counts = {r.concurrency: len(r.prompt_tokens) for r in runs if r.concurrency}
    assert counts == {1: 12, 2: 12, 4: 24, 8: 48, 16: 96}
    assert "step_ms@2" in cmp.fit.theta_ms  # the token gaps table the step again
    h = cmp.headline()
    assert (h["held_out_within_bounds"], h["held_out_bounded"]) == (47, 48)
    assert h["held_out_outside_bounds"] == ["ngram-k5@c2 output_throughput"]
    assert cmp.regimes["pick_ok"].all() and h["picks_within_tolerance"]
    tau = cmp.table.filter((pl.col("split") == "held-out")
                           & (pl.col("figure") == "acceptance_length"))
    assert tau.height == 16 and tau["error"].abs().max() <= 0.02


def test_the_second_blind_run_holds_every_held_out_figure_and_picks_vllms_best(
        comparisons):
    """run-7, measured like run-6 with the fit's rules unchanged since before run-6 and
    scored without touching them: all 48 held-out figures within the bounds, none by a
    point's spread alone, and the pick vLLM's own best at every load."""
    cmp = comparisons[BLIND_AGAIN]
    runs = read_bench_runs([RECORDED / BLIND_AGAIN / "runs"])
    counts = {r.concurrency: len(r.prompt_tokens) for r in runs if r.concurrency}
    assert counts == {1: 12, 2: 12, 4: 24, 8: 48, 16: 96}
    assert {r.round for r in runs} == {1, 2, 3}
    assert "step_ms@2" in cmp.fit.theta_ms  # the token gaps table the step again
    h = cmp.headline()
    assert (h["held_out_points"], h["fitted_points"]) == (16, 8)
    assert (h["held_out_within_bounds"], h["held_out_bounded"]) == (48, 48)
    assert (cmp.against_bounds()["error"].abs() <= cmp.against_bounds()["bound"]).all()
    assert (cmp.regimes["measured_best"] == cmp.regimes["simulated_best"]).all()
    assert h["best_measured_gain"] >= 0.15
    tau = cmp.table.filter((pl.col("split") == "held-out")
                           & (pl.col("figure") == "acceptance_length"))
    assert tau.height == 16 and tau["error"].abs().max() <= 0.02


def test_the_steps_table_holds_every_closed_loop_point_at_its_own_batch(comparisons):
    """The blind run's steps by batch: every closed-loop point has its full batch, and
    the none points' steps, which the tabled fit prices batch by batch, match within 3 %
    (means of thousands of gaps against hundreds of simulated steps). Every speculative
    point with two requests or more in flight has its prompt steps, each seen as one long
    gap (the none runs' clients finish together, so their prompts share steps and are
    too few at C = 2); a point at C = 1 never has one."""
    steps = comparisons[BLIND].steps
    table = comparisons[BLIND].table.unique("run")
    decode = steps.filter(pl.col("kind") == "decode")
    for row in table.filter(pl.col("concurrency").is_not_null()).iter_rows(named=True):
        mine = steps.filter(pl.col("run") == row["run"])
        assert row["concurrency"] in mine.filter(pl.col("kind") == "decode")["batch"], \
            row["run"]
        assert (mine["split"] == row["split"]).all()
        prompt = mine.filter(pl.col("kind") == "prompt")
        if row["concurrency"] == 1 or row["k"]:
            assert prompt.height == (row["concurrency"] > 1), row["run"]
    none = decode.filter(pl.col("run").str.starts_with("none@"))
    assert none.height >= 6 and none["error"].abs().max() <= 0.03
    assert (decode["gaps"] >= 100).all() and (decode["steps"] >= 20).all()
    prompts = steps.filter(pl.col("kind") == "prompt")
    assert prompts["batch"].is_null().all()
    longest = decode.group_by("run").agg(pl.col("measured_ms").max().alias("longest"))
    both = prompts.join(longest, on="run")
    assert both.height == prompts.height and (both["measured_ms"] > both["longest"]).all()


def test_the_rotated_run_measures_each_load_early_midway_and_late():
    """run-4's rounds rotate the loads too: within a round each load's runs come
    together, and across the three rounds each load takes three different places in
    its round (the bench client stamps each result with the second it ran)."""
    runs = read_bench_runs([RECORDED / ROTATED / "runs"])
    places: dict[str, set[int]] = {}
    for n in (1, 2, 3):
        stamps: dict[str, str] = {}
        for r in runs:
            if r.round == n:
                load = r.name.split("@")[1]
                date = json.loads(r.path.read_text())["date"]
                stamps[load] = min(stamps.get(load, date), date)
        order = sorted(stamps, key=stamps.get)
        assert len(order) == 6
        for i, load in enumerate(order):
            places.setdefault(load, set()).add(i)
    assert all(len(v) == 3 for v in places.values()), places
