"""Per-request replay (--lengths trace): each simulated request takes one trace request's
prompt and output lengths and replays that request's own row, in open and closed loop."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from dspark_sim.cli import app
from dspark_sim.errors import InputError
from dspark_sim.sim.api import simulate
from dspark_sim.sim.config import preset
from dspark_sim.traces.importers import import_specdecode_bench
from dspark_sim.traces.schema import write_trace

FIXTURE = Path(__file__).parents[1] / "data" / "specdecode_bench" / "combined_fixture.jsonl"


def _chain(m: np.ndarray, out: int, k: int) -> tuple[int, int]:
    """(steps, accepted drafts) of one request decoded alone at fixed k: the first token
    comes from prefill, step j verifies position generated - 1, the last step is cut at
    the output length (SpecDecode-Bench's simulator counts the same way)."""
    gen, steps, acc = 1, 0, 0
    while gen < out:
        a = min(k, int(m[gen - 1]))
        steps += 1
        acc += a
        gen += min(a + 1, out - gen)
    return steps, acc


@pytest.fixture(scope="module")
def trace():
    return import_specdecode_bench(FIXTURE)


@pytest.mark.parametrize("k", [1, 3])
def test_closed_loop_replays_each_requests_own_row(trace, k):
    cfg = preset("tiny")
    cfg = replace(cfg, policy=f"fixed:{k}",
                  workload=replace(cfg.workload, arrival="closed", max_concurrency=1,
                                   num_requests=9, lengths="trace"))
    res = simulate(cfg, trace=trace)
    df = res.requests.sort("request_id")
    rows = np.arange(9) % trace.num_requests  # cycled in order
    assert df["trace_row"].to_list() == rows.tolist()
    assert df["prompt_tokens"].to_list() == trace.req_prompt_tokens[rows].tolist()
    assert df["output_tokens"].to_list() == trace.req_output_tokens[rows].tolist()
    assert df["finished"].all()
    for i, r in enumerate(rows):
        m = trace.accept_len[trace.req_offsets[r]:trace.req_offsets[r + 1]]
        steps, acc = _chain(m, int(trace.req_output_tokens[r]), k)
        assert df["steps"][i] == steps and df["accepted_tokens"][i] == acc, i


def test_open_loop_samples_rows_with_the_seed(trace):
    cfg = preset("tiny")
    cfg = replace(cfg, policy="fixed:2", seed=4,
                  workload=replace(cfg.workload, qps=5.0, num_requests=30,
                                   lengths="trace:sample"))
    a = simulate(cfg, trace=trace).requests.sort("request_id")
    b = simulate(cfg, trace=trace).requests.sort("request_id")
    assert a["trace_row"].to_list() == b["trace_row"].to_list()
    rows = a["trace_row"].to_numpy()
    assert len(set(rows.tolist())) > 1  # drawn, not cycled
    assert a["output_tokens"].to_list() == trace.req_output_tokens[rows].tolist()
    assert a["prompt_tokens"].to_list() == trace.req_prompt_tokens[rows].tolist()
    assert "drawn with the seed" in simulate(cfg, trace=trace).summary["workload"]


def test_none_serves_the_same_requests(tmp_path, trace):
    p = write_trace(trace, tmp_path / "t.parquet")
    cfg = preset("tiny")
    cfg = replace(cfg, policy="none", trace=str(p),
                  workload=replace(cfg.workload, arrival="closed", max_concurrency=2,
                                   num_requests=6, lengths="trace"))
    df = simulate(cfg).requests.sort("request_id")
    assert df["output_tokens"].to_list() == trace.req_output_tokens.tolist()
    # no speculation: one token per step after the prefill token
    assert df["steps"].to_list() == (trace.req_output_tokens - 1).tolist()


def test_trace_without_lengths_is_refused():
    cfg = preset("tiny")
    cfg = replace(cfg, policy="fixed:3", workload=replace(cfg.workload, lengths="trace"))
    with pytest.raises(InputError, match="--lengths.*no.*prompt and output lengths|has none"):
        simulate(cfg)


def test_trace_lengths_past_the_per_request_limit_are_refused(trace):
    """A trace request's own length above 2^24 (the --lengths and workload-file limit) was
    replayed and refused at arrival, every request of it; it is the trace's fault."""
    big = trace.req_prompt_tokens.copy()
    big[1] = (1 << 24) + 1
    cfg = preset("tiny")
    cfg = replace(cfg, policy="fixed:3", workload=replace(cfg.workload, lengths="trace"))
    with pytest.raises(InputError, match=rf"^big.parquet: prompt_tokens of request "
                                         rf"{trace.req_ids[1]} \(16,777,217\) is above"):
        simulate(cfg, trace=replace(trace, req_prompt_tokens=big, source_path="big.parquet"))
    big[1] = 1 << 24  # the limit itself is a length
    ok = simulate(replace(cfg, workload=replace(cfg.workload, num_requests=2)),
                  trace=replace(trace, req_prompt_tokens=big))
    assert ok.summary["completed"] + ok.summary["rejected"] == 2


def test_cli_closed_loop_trace_lengths(tmp_path, trace):
    p = write_trace(trace, tmp_path / "t.parquet")
    r = CliRunner().invoke(app, ["run", "--trace", str(p), "--policy", "fixed:3", "--lengths",
                                 "trace", "--max-concurrency", "2", "--num-requests", "6",
                                 "--out", str(tmp_path / "o"), "--quiet"])
    assert r.exit_code == 0, r.output
    # the written requests are the trace's six, each its own row's fixed-3 chain by hand
    import polars as pl

    df = pl.read_parquet(tmp_path / "o" / "requests.parquet").sort("request_id")
    assert df["trace_row"].to_list() == list(range(trace.num_requests)) == list(range(6))
    assert df["output_tokens"].to_list() == trace.req_output_tokens.tolist()
    for r in range(6):
        m = trace.accept_len[trace.req_offsets[r]:trace.req_offsets[r + 1]]
        assert (df["steps"][r], df["accepted_tokens"][r]) == _chain(
            m, int(trace.req_output_tokens[r]), 3), r
    r = CliRunner().invoke(app, ["run", "--policy", "fixed:3", "--lengths", "trace",
                                 "--max-concurrency", "2", "--num-requests", "6", "--quiet"])
    assert r.exit_code == 2 and "--lengths" in r.output
