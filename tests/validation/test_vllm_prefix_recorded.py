"""vLLM with prefix caching on, one recorded live run (tests/data/vllm-cpu/prefix-1: vLLM
0.32 on this project's 2-core CPU box, SmolLM2-135M fp32, the shipped sessions prompt
set in file order, none with caching off and on at concurrency 1, 4, 8 and one
open-loop rate, three interleaved rounds; the bench client's own result files, vLLM's
prefix-cache counters around each caching run, the requests' token ids and the
manifest, as `dspark-sim vllm measure` wrote them).

The suite refits it with the documented split (the caching-off runs fitted, every
caching run held out), checks what the recording is, and that docs/validation.md shows
the comparison as the code computes it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from doc_blocks import check_block

from dspark_sim.validation import vllm_fit
from dspark_sim.validation.vllm_compare import load_engine
from dspark_sim.validation.vllm_fit import lone_ttft_ms, read_bench_runs
from dspark_sim.validation.vllm_prefix import (
    HIT_RATE_BOUND,
    compare_prefix,
    prefix_markdown,
    read_record,
)

# Slow (refits and re-simulates the recorded vLLM runs): out of the default run.
pytestmark = pytest.mark.slow

RECORDED = Path(__file__).parents[1] / "data" / "vllm-cpu" / "prefix-1"
DOC = Path(__file__).parents[2] / "docs" / "validation.md"
LOADS = ("c1", "c4", "c8", "r0.3")


@pytest.fixture(scope="module")
def runs():
    return read_bench_runs([RECORDED / "runs"])


@pytest.fixture(scope="module")
def comparison(runs):
    return compare_prefix(runs, RECORDED, engine=load_engine(RECORDED / "manifest.json"))


def test_the_recording_is_what_the_docs_say(runs):
    assert {r.name for r in runs} == {f"{s}@{load}" for s in ("none", "none-prefix")
                                      for load in LOADS}
    rounds: dict[str, set] = {}
    for r in runs:
        rounds.setdefault(r.name, set()).add(r.round)
    assert all(v == {1, 2, 3} for v in rounds.values())
    manifest = json.loads((RECORDED / "manifest.json").read_text())
    assert manifest["prefix_caching"] is True and manifest["prompt_order"] == "file"
    assert manifest["prompts"] == "sessions-32.jsonl" and manifest["output_tokens"] == 32
    # every caching run's own counters, at vLLM's CPU block
    for r in runs:
        if r.setting == "none-prefix":
            rec = read_record(RECORDED, r)
            assert rec["block_tokens"] == 128
            assert rec["queries_tokens"] == int(r.prompt_tokens.sum())  # each request once


def test_the_caching_off_runs_are_fitted_and_every_caching_run_held_out(comparison, runs):
    assert comparison.split == "none" and comparison.base is None
    assert set(comparison.fit.profile.parameters["fitted_runs"]) == {
        f"none@{load}" for load in LOADS}
    assert comparison.table["run"].to_list() == [f"none-prefix@{load}" for load in LOADS]
    assert comparison.table["repeats"].to_list() == [3] * len(LOADS)


def test_caching_cuts_vllms_ttft_at_every_load_and_the_simulator_says_so(comparison):
    """The effect the prediction is about: at every load vLLM's median TTFT with the
    cache is well below its TTFT without, and so is the simulated one."""
    t = comparison.table
    assert (t["measured_ttft_ms"] < 0.8 * t["off_ttft_ms"]).all()
    assert (t["simulated_ttft_ms"] < 0.8 * t["off_ttft_ms"]).all()


def test_one_client_at_a_time_the_simulator_finds_vllms_hits(comparison):
    """With one request in flight nothing races: the block ids computed from the token
    ids replay exactly the hits vLLM counted."""
    c1 = comparison.table.row(0, named=True)
    assert c1["run"] == "none-prefix@c1"
    assert c1["hit_rate_spread"] == 0.0  # the same requests hit the same blocks each round
    assert abs(c1["hit_rate_diff"]) < 0.005
    assert c1["hit_rate_within"]


def test_the_lone_requests_ttft_line_sets_what_a_short_prefill_pays(comparison, runs,
                                                                     monkeypatch):
    """A caching run at C = 1 prefills ~100 new tokens a request, where the caching-off
    runs' median TTFTs each price ~340: by themselves they do not tell the per-request
    overhead from the per-token cost, and the fit without the lone requests' TTFT line
    puts the overhead in the API server's time and predicts C = 1 far outside its bound.
    The line of the caching-off runs' 36 C = 1 requests and the open loop's lone ones,
    fitted at both ends, brings it within; the overhead the profile charges lies within
    two standard errors of the line's intercept, and its prompts (326 to 674 tokens) are
    too long for that intercept to be known to better than about its own size."""
    fit = comparison.fit
    line = fit.line
    assert line.unused == "" and line.requests >= 36 and fit.lone == line.requests
    assert tuple(line.ends) == (326, 674)
    simulated = lone_ttft_ms(fit.profile, line.ends, fit.engine.max_num_batched_tokens)
    assert simulated == pytest.approx(line.at(line.ends), rel=0.10)
    _, intercept_sd = line.standard_errors()
    own = fit.line_fit
    assert abs(own["intercept_ms"] - line.intercept_ms) < 2 * intercept_sd
    assert own["intercept_sd_ms"] > 0.5 * own["intercept_ms"]  # the long prompts' limit
    assert comparison.table["ttft_within"].all()
    # without the line (too few lone requests to fit it), the same runs and split
    monkeypatch.setattr(vllm_fit, "MIN_LONE", 10**6)
    without = compare_prefix(runs, RECORDED, engine=load_engine(RECORDED / "manifest.json"))
    assert without.fit.lone == 0 and "not fitted" in without.fit.line_sentence()
    c1, c1_without = comparison.table.row(0, named=True), without.table.row(0, named=True)
    assert not c1_without["ttft_within"] and c1_without["ttft_error"] > 0.4
    assert c1["ttft_within"] and c1["ttft_error"] < c1_without["ttft_error"] / 2
    assert without.fit.theta_ms["frontend_ms"] > 2 * fit.theta_ms["frontend_ms"]


def test_the_headline_counts_what_the_table_finds(comparison):
    h = comparison.headline()
    t = comparison.table
    assert h["ttft_within_bounds"] == int(t["ttft_within"].sum())
    assert h["hit_rate_within_bounds"] == int(t["hit_rate_within"].sum())
    assert t["hit_rate_within"].to_list() == [
        abs(d) <= HIT_RATE_BOUND + 1e-12 for d in t["hit_rate_diff"]]
    assert len(h["outside_bounds"]) == 2 * t.height - h["ttft_within_bounds"] \
        - h["hit_rate_within_bounds"]


def test_docs_carry_the_comparison(comparison):
    """docs/validation.md shows the table as the code computes it now (regenerate:
    DSPARK_SIM_WRITE_DOCS=1 python -m pytest tests/validation/test_vllm_prefix_recorded.py)."""
    check_block(DOC, "vllm-cpu:prefix-1", prefix_markdown(comparison))
