"""The compiled step (``policies/compiled.py``, ``sim/fast.py``) against the numpy
reference it replaces: the same bits, on the golden runs and on random batches.

Both paths run in one process: the dispatchers read ``compiled.NUMBA`` on every call, so
flipping it selects the path. Without numba the compiled half skips; the numpy path is
then the only one and ``test_golden.py`` holds it to the stored bytes.
"""

from __future__ import annotations

import importlib.util
import json
from collections import deque
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dspark_sim.policies import compiled, scheduler
from dspark_sim.policies.base import StepCost, readonly

numba = pytest.importorskip("numba")

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden"
_spec = importlib.util.spec_from_file_location("make_golden", GOLDEN / "make_golden.py")
MAKER = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(MAKER)


def _run_golden(name, out, monkeypatch, use_numba: bool) -> bytes:
    monkeypatch.setattr(compiled, "NUMBA", use_numba)
    MAKER.run(name, out)
    return (out / "summary.json").read_bytes()


@pytest.mark.parametrize("name", sorted(MAKER.RUNS))
def test_both_paths_give_the_same_bytes_on_the_golden_runs(tmp_path, monkeypatch, name):
    """Summaries (which carry the requests parquet's hash) byte for byte; the stored
    bytes themselves are test_golden.py's (whichever path is the default)."""
    ref = _run_golden(name, tmp_path / "numpy", monkeypatch, False)
    fast = _run_golden(name, tmp_path / "numba", monkeypatch, True)
    assert json.loads(ref)["engine_steps"] > 0
    assert fast == ref


def _run_both_paths(tmp_path, monkeypatch, args) -> dict[bool, Path]:
    """``dspark-sim`` with ``args`` on the numpy path and the compiled one, each writing
    into its own folder under ``tmp_path`` (``False``, ``True``): the folders by path."""
    from typer.testing import CliRunner

    from dspark_sim.cli import app

    outs = {}
    for use in (False, True):
        monkeypatch.setattr(compiled, "NUMBA", use)
        outs[use] = out = tmp_path / str(use)
        res = CliRunner().invoke(app, [*args, "--out", str(out)])
        assert res.exit_code == 0, res.output
    return outs


@pytest.mark.parametrize("kv_mode", ["preempt", "reserve"])
def test_both_paths_agree_with_chunked_prefill_and_preemption(tmp_path, monkeypatch,
                                                              kv_mode):
    """The confidence scheduler over chunked prefill, a finite token budget and a KV
    capacity that preempts or (reserving each request's prompt + output) holds requests
    back (the golden confidence run is disaggregated): every summary field equal."""
    args = ["run", "--policy", "confidence", "--qps", "30", "--num-requests", "250",
            "--seed", "5", "--replicas", "1", "--profile", "qwen3-8b-h100",
            "--max-num-seqs", "64", "--max-num-batched-tokens", "512",
            "--kv-capacity-tokens", "60000", "--kv-mode", kv_mode]
    got = {use: json.loads((out / "summary.json").read_text())
           for use, out in _run_both_paths(tmp_path, monkeypatch, args).items()}
    # the run reaches the paths it is here for
    assert got[False]["preemptions" if kv_mode == "preempt" else "kv_blocked_steps"] > 0
    assert got[True] == got[False]


def test_both_paths_agree_when_a_step_admits_more_rows_than_the_buffers_hold(
        tmp_path, monkeypatch):
    """A closed loop of 300 clients sends 300 requests at once, all admitted in the first
    step and prefilled in chunks: the compiled admission's batch buffer and the prefill
    chunks' buffer (``engine.BATCH_BUF_ROWS`` rows at first) grow past doubling in one
    step; the summary and the per-request rows as the numpy path's."""
    from dspark_sim.sim.engine import BATCH_BUF_ROWS

    clients = 300
    args = ["run", "--policy", "confidence", "--max-concurrency", str(clients),
            "--num-requests", str(clients), "--seed", "3", "--replicas", "1",
            "--profile", "qwen3-8b-h100", "--prefill", "chunked", "--max-num-seqs", "512",
            "--max-num-batched-tokens", "8192", "--kv-capacity-tokens", "2000000"]
    got = {use: (json.loads((out / "summary.json").read_text()),
                 (out / "requests.parquet").read_bytes())
           for use, out in _run_both_paths(tmp_path, monkeypatch, args).items()}
    # every request sent at t = 0, room for all of them and nothing held back for KV:
    # the first step admitted them all
    summary = got[False][0]
    assert clients > 2 * BATCH_BUF_ROWS and summary["completed"] == clients
    assert summary["kv_blocked_steps"] == 0 and summary["preemptions"] == 0
    assert (pl.read_parquet(tmp_path / "False" / "requests.parquet")["arrival_s"] == 0).all()
    assert got[True] == got[False]


@pytest.fixture(scope="module")
def ngram_trace(tmp_path_factory):
    """A trace with ``draft_tokens``: an n-gram drafter that proposed nothing at about
    two steps in three (``tests/policies/test_draft_tokens.py``'s vLLM counters)."""
    from dspark_sim.traces.importers import import_vllm_counters

    src = tmp_path_factory.mktemp("ngram") / "bench.json"
    src.write_text(json.dumps({
        "completed": 8, "total_output_tokens": 512, "spec_decode_num_drafts": 108,
        "spec_decode_draft_tokens": 320, "spec_decode_accepted_tokens": 204,
        "spec_decode_per_position_acceptance_rates": [0.7407, 0.6204, 0.5278],
        "spec_decode_acceptance_length": 2.889}))
    return import_vllm_counters(src, requests=64, positions=512, seed=0)


@pytest.mark.parametrize("policy", ["vllm-adaptive", "fixed:3", "mtp1", "none"])
@pytest.mark.parametrize("draft_tokens", [False, True])
@pytest.mark.parametrize("prefill", ["chunked", "disaggregated"])
def test_both_paths_agree_for_each_compiled_chain_policy(monkeypatch, ngram_trace, policy,
                                                         draft_tokens, prefill):
    """Each chain policy with a compiled decision, run on the compiled path and on the
    numpy reference: the same summary and the same per-request rows, with chunked
    prefill (vLLM's pricing of the prefill a step carries) and with a token budget that
    trims the drafts, and on a trace whose drafter proposed nothing at some steps."""
    from dataclasses import replace

    from dspark_sim.sim import engine
    from dspark_sim.sim.api import simulate
    from dspark_sim.sim.config import DeploymentConfig, EngineConfig, SimConfig, WorkloadConfig

    cfg = SimConfig(policy=policy, seed=3, deployment=DeploymentConfig(replicas=1),
                    engine=EngineConfig(prefill=prefill, max_num_seqs=64,
                                        max_num_batched_tokens=160),
                    workload=WorkloadConfig(max_concurrency=64, num_requests=160,
                                            duration_s=None, lengths="fixed:64:120"),
                    conf_source="position" if draft_tokens and policy == "vllm-adaptive"
                    else None)
    trace = ngram_trace if draft_tokens else None
    if policy == "mtp1" and not draft_tokens:
        trace = replace(ngram_trace, draft_tokens=None)  # an MTP-1 drafter's trace
    calls = []
    for name in ("_compiled_decision", "_constant_decision", "_proposed_decision"):
        real = getattr(engine.Replica, name)
        monkeypatch.setattr(engine.Replica, name,
                            lambda self, *a, real=real: calls.append(1) or real(self, *a))
    got = []
    for use in (False, True):
        monkeypatch.setattr(compiled, "NUMBA", use)
        calls.clear()
        res = simulate(cfg, trace=trace)
        got.append((res.summary, res.requests.write_ipc(None).getvalue()))
        # the compiled path decides in the policy's kernel (none decides nothing)
        assert bool(calls) == (use and policy != "none")
    assert got[1][0] == got[0][0]
    assert got[1][1] == got[0][1]
    assert got[0][0]["engine_steps"] > 0
    if policy == "fixed:3" and prefill == "disaggregated":  # vllm-adaptive fits it
        assert got[0][0]["budget_limited_steps"] > 0


def _survival(draw_values, n, g):
    # a non-increasing prefix per row, values from a small set so ties are common
    a = np.array(draw_values[: n * g], dtype=np.float64).reshape(n, g)
    return np.minimum.accumulate(a, axis=1)


@given(n=st.integers(0, 40), g=st.integers(1, 8),
       values=st.lists(st.sampled_from([0.0, 0.125, 0.25, 0.5, 0.75, 0.9, 1.0]),
                       min_size=320, max_size=320),
       k=st.integers(-3, 330), lag_rows=st.integers(0, 80), pending=st.integers(0, 3000),
       budget=st.integers(1, 600), slope=st.floats(0.0, 1e-4), displacement=st.booleans())
def test_scheduler_kernels_equal_the_numpy_reference(n, g, values, k, lag_rows, pending,
                                                      budget, slope, displacement):
    survival = _survival(values, n, g)
    rng = np.random.default_rng(n * 1000 + g)
    lagged = np.minimum.accumulate(rng.choice([0.1, 0.5, 0.8, 1.0], (lag_rows, g)), axis=1)
    table = readonly(0.01 + 2e-5 * np.arange(budget + 1) + rng.random(budget + 1) * 1e-4)
    extra = readonly(1e-3 + 3e-6 * np.arange(n * g + 1))
    cost = StepCost(table, extra, pending, slope)

    def both(f):
        out, was = [], compiled.NUMBA
        try:
            for use in (False, True):
                compiled.NUMBA = use
                out.append(f())
        finally:
            compiled.NUMBA = was
        return out

    for ref, fast in (
        both(lambda: scheduler.schedule_topk(survival, k)),
        both(lambda: scheduler.stretch_sorted(scheduler.sorted_desc(lagged), n * g)),
    ):
        assert ref.dtype == fast.dtype and ref.tobytes() == fast.tobytes()
    estimate = scheduler.stretch_sorted(scheduler.sorted_desc(lagged), n * g)
    ref, fast = both(lambda: scheduler.budget_displacement(survival, cost, n, estimate,
                                                           displacement=displacement))
    assert ref == fast
    ref, fast = both(lambda: scheduler.budget_displacement(survival, cost))
    assert ref == fast


def test_the_switch_names_a_bad_backend(monkeypatch):
    monkeypatch.setenv("DSPARK_SIM_KERNELS", "fortran")
    with pytest.raises(SystemExit, match="DSPARK_SIM_KERNELS: 'fortran'"):
        compiled._choose()
    monkeypatch.setenv("DSPARK_SIM_KERNELS", "numpy")
    assert compiled._choose() is False
    monkeypatch.setenv("DSPARK_SIM_KERNELS", "numba")
    assert compiled._choose() is True


@pytest.mark.parametrize("name", ["confidence", "vllm-adaptive"])
@given(steps=st.lists(st.integers(1, 30), min_size=1, max_size=90),
       gamma=st.integers(1, 7), budget=st.integers(40, 400), pending=st.integers(0, 500),
       kink=st.sampled_from([0.0, 2e-7]), seed=st.integers(0, 2**16))
def test_the_compiled_decision_equals_the_policy_on_its_snapshots(
        name, steps, gamma, budget, pending, kink, seed):
    """A policy's compiled decision (``compiled.confidence_step``,
    ``compiled.vllm_adaptive_step``) against its ``decide`` on the snapshots
    ``Policy.snapshot`` builds from a history deque, over a run of steps whose batch sizes
    vary (up to 90 steps: the 66-step ring wraps), ties included; and the engine's trim
    to the token budget and accepted drafts, bit for bit."""
    from dspark_sim.policies.registry import get_policy
    from dspark_sim.sim import engine, fast

    policy = get_policy(name)
    assert policy.compiled_decision().signature == "lagged"
    step = policy.compiled_decision().run
    rng = np.random.default_rng(seed)
    n_trace = 200
    survival_table = np.minimum.accumulate(
        rng.choice([0.05, 0.3, 0.5, 0.5, 0.8, 1.0], (n_trace, gamma)), axis=1)
    accept_len = rng.integers(0, gamma + 1, n_trace).astype(np.int8)
    table = readonly(0.01 + 2e-5 * np.arange(budget + 1) + rng.random(budget + 1) * 1e-4)
    history = deque(maxlen=policy.history)
    # a ring sized for the first step's batch, widened as the engine widens it, so its
    # survivals wrap round the buffer and move when it grows
    rows = steps[0]
    lag_steps, lag_rows = policy.reads.lag_steps, policy.reads.lag_rows
    ring, slots, state = compiled.empty_ring(rows, gamma, lag_steps, lag_rows, policy.history)
    for n in steps:
        if n > rows:
            rows = max(n, 2 * rows)
            ring = compiled.widen_ring(ring, slots, state, rows, gamma, lag_steps, lag_rows)
        batch = np.zeros((n, engine.NUM_COLUMNS), np.int64)
        batch[:, engine.TRACE_START] = rng.integers(0, n_trace - 20, n)
        batch[:, engine.TRACE_LEN] = 20
        batch[:, engine.GENERATED] = rng.integers(1, 60, n)
        idx = batch[:, engine.TRACE_START] + (batch[:, engine.GENERATED] - 1) % 20
        per_token, offset = 3e-6 * rng.random(), 1e-3 * rng.random()
        extra = per_token * np.arange(n * gamma + 1, dtype=np.float64)
        extra += offset
        if kink:
            extra += kink * np.minimum(np.arange(n * gamma + 1, dtype=np.float64), n)
        cost = StepCost(table, readonly(extra), pending, 2e-5)
        ref = policy(policy.snapshot(history, survival_table[idx], gamma, budget, cost=cost))
        ref = ref.astype(np.int64)
        trimmed_ref = n + int(ref.sum()) > budget
        if trimmed_ref:
            np.minimum(ref, max(0, (budget - n) // n), out=ref)
        # the engine's buffers are longer than the batch and hold other values: only
        # the batch's part is written
        gathered_idx, gathered = np.full(n + 3, -1), np.full((n + 3, gamma), -1.0)
        flat = np.full((n + 3) * gamma, -1.0)
        fast.gather_trace_rows(batch, n, survival_table, gathered_idx, gathered, flat)
        assert gathered_idx[:n].tolist() == idx.tolist()
        assert gathered[:n].tobytes() == survival_table[idx].tobytes()
        assert flat[: n * gamma].tobytes() == survival_table[idx].tobytes()
        assert (gathered_idx[n:] == -1).all() and (flat[n * gamma:] == -1).all()
        ell, accepted = np.full(n, -1), np.full(n, -1)
        drafts, trimmed = step(
            gathered[:n], flat[: n * gamma], gathered_idx[:n], accept_len, ring, slots,
            state, lag_steps, lag_rows, table, per_token, offset, kink,
            pending, 2e-5, budget, ell, accepted)
        assert ell.tobytes() == ref.tobytes() and drafts == int(ref.sum())
        assert trimmed == trimmed_ref
        assert accepted.tolist() == np.minimum(ref, accept_len[idx]).tolist()


@given(steps=st.lists(st.integers(1, 30), min_size=1, max_size=40),
       gamma=st.integers(1, 7), budget=st.integers(40, 400), pending=st.integers(0, 500),
       none_p=st.sampled_from([0.0, 0.5, 1.0]), seed=st.integers(0, 2**16))
def test_the_compiled_vllm_decision_equals_the_policy_where_drafters_propose_fewer(
        steps, gamma, budget, pending, none_p, seed):
    """``compiled.vllm_adaptive_proposed`` against ``policies.vllm_adaptive`` on a trace
    whose drafters proposed from none to all of their drafts at each position (steps
    where no row proposed included): the candidates, the lagged view of the rows that
    proposed, the top-B among the proposed drafts, the cap, the trim and the accepted
    drafts, bit for bit."""
    from dspark_sim.policies.registry import get_policy
    from dspark_sim.sim import engine, fast

    policy = get_policy("vllm-adaptive")
    assert policy.compiled_decision(draft_tokens=True).signature == "proposed"
    step = policy.compiled_decision(draft_tokens=True).run
    rng = np.random.default_rng(seed)
    n_trace = 200
    draft_tokens = rng.integers(0, gamma + 1, n_trace).astype(np.int8)
    draft_tokens[rng.random(n_trace) < none_p] = 0
    survival_table = np.minimum.accumulate(
        rng.choice([0.0, 0.05, 0.3, 0.5, 0.5, 0.8, 1.0], (n_trace, gamma)), axis=1)
    # the engine's survivals are 0 past the drafts proposed (SimContext)
    survival_table = np.where(np.arange(gamma) < draft_tokens[:, None], survival_table, 0.0)
    accept_len = rng.integers(0, gamma + 1, n_trace).astype(np.int8)
    table = readonly(0.01 + 2e-5 * np.arange(budget + 1) + rng.random(budget + 1) * 1e-4)
    history = deque(maxlen=max(1, policy.history))
    rows = max(steps)
    last, last_state = np.zeros(rows * gamma), np.zeros(2, np.int64)
    for n in steps:
        batch = np.zeros((n, engine.NUM_COLUMNS), np.int64)
        batch[:, engine.TRACE_START] = rng.integers(0, n_trace - 20, n)
        batch[:, engine.TRACE_LEN] = 20
        batch[:, engine.GENERATED] = rng.integers(1, 60, n)
        idx = batch[:, engine.TRACE_START] + (batch[:, engine.GENERATED] - 1) % 20
        per_token, offset = 3e-6 * rng.random(), 1e-3 * rng.random()
        extra = per_token * np.arange(n * gamma + 1, dtype=np.float64)
        extra += offset
        cost = StepCost(table, readonly(extra), pending, 2e-5)
        proposed_ref = draft_tokens[idx]
        ref = policy(policy.snapshot(history, survival_table[idx], gamma, budget, cost=cost,
                                     proposed=proposed_ref.astype(np.int64)))
        ref = np.minimum(ref.astype(np.int64), proposed_ref)
        trimmed_ref = n + int(ref.sum()) > budget
        if trimmed_ref:
            np.minimum(ref, max(0, (budget - n) // n), out=ref)
        trace_idx, survival = np.zeros(n, np.int64), np.zeros((n, gamma))
        proposed, flat = np.zeros(n, np.int64), np.zeros(n * gamma)
        c = fast.gather_proposed(batch, n, survival_table, draft_tokens, trace_idx, survival,
                                 proposed, flat)
        assert trace_idx.tolist() == idx.tolist() and c == int(proposed_ref.sum())
        candidates = flat[:c]
        candidates.sort()
        ell, accepted = np.full(n, -1), np.full(n, -1)
        drafts, trimmed = step(survival, candidates, proposed, trace_idx, accept_len, last,
                               last_state, table, per_token, offset, 0.0, pending, 2e-5,
                               budget, ell, accepted)
        assert ell.tobytes() == ref.tobytes() and drafts == int(ref.sum())
        assert trimmed == trimmed_ref
        assert accepted.tolist() == np.minimum(ref, accept_len[idx]).tolist()


@given(n_dec=st.integers(0, 300), kv=st.integers(0, 10**7), rows=st.integers(0, 400),
       draft_s=st.floats(0.0, 0.05), window=st.sampled_from([None, 1, 512, 4096]),
       scalars=st.lists(st.sampled_from([0.0, 1e-9, 3.7e-7, 2.5e-5, 1e-3]), min_size=5,
                        max_size=5))
def test_the_compiled_cost_terms_equal_the_profiles(n_dec, kv, rows, draft_s, window,
                                                    scalars):
    """``fast.extra_terms`` (the scheduler's cost terms) is ``EngineProfile.extra_terms``
    bit for bit, with and without an attention window."""
    from dataclasses import replace

    from dspark_sim.calibration.profile import load_profile
    from dspark_sim.sim import fast

    logits, kv_s, attn, request_s, multi = scalars
    prof = replace(load_profile("qwen3-8b-h100"), logits_s_per_row=logits,
                   kv_s_per_token=kv_s, attn_s_per_query_ctx=attn, request_s=request_s,
                   multi_kv_s_per_token=multi, attn_window_tokens=window)
    ref = prof.extra_terms(n_dec, kv, rows, draft_s)
    got = fast.extra_terms(n_dec, kv, rows, draft_s, fast.profile_terms(prof))
    assert np.array(got).tobytes() == np.array(ref, dtype=np.float64).tobytes()


@given(rows=st.lists(st.tuples(st.integers(0, 3000), st.integers(1, 3000)), min_size=1,
                    max_size=20),
       n_dec=st.integers(0, 6), budget=st.integers(16, 9000), kv=st.integers(0, 10**6),
       window=st.sampled_from([None, 1, 512, 4096]),
       scalars=st.lists(st.sampled_from([0.0, 1e-9, 3.7e-7, 2.5e-5]), min_size=5,
                        max_size=5))
def test_a_compiled_step_with_prefill_chunks_is_priced_as_the_reference(
        rows, n_dec, budget, kv, window, scalars):
    """A chain step with prefill chunks, planned and priced by the kernels
    (``fast.prefill_chunks``, ``fast.chunked_step_s``) and by the numpy reference in the
    engine: the same chunks and the same step time, bit for bit, with and without an
    attention window and each cost term."""
    from dataclasses import replace

    from dspark_sim.calibration.confmap import CalibrationMap
    from dspark_sim.calibration.profile import load_profile
    from dspark_sim.policies.registry import get_policy
    from dspark_sim.sim.config import DeploymentConfig, EngineConfig, SimConfig
    from dspark_sim.sim.engine import (
        GENERATED,
        NUM_COLUMNS,
        OUTPUT_TOKENS,
        PREFILL_TARGET,
        PREFILLED,
        PROMPT_TOKENS,
        RequestLog,
        SimContext,
    )

    logits, kv_s, attn, request_s, multi = scalars
    prof = replace(load_profile("qwen3-8b-h100"), logits_s_per_row=logits,
                   kv_s_per_token=kv_s, attn_s_per_query_ctx=attn, request_s=request_s,
                   multi_kv_s_per_token=multi, attn_window_tokens=window)
    cfg = SimConfig(deployment=DeploymentConfig(replicas=1),
                    engine=EngineConfig(max_num_seqs=8, max_num_batched_tokens=budget,
                                        prefill="chunked"))
    batch = np.zeros((n_dec + len(rows), NUM_COLUMNS), np.int64)
    batch[:n_dec, PROMPT_TOKENS] = batch[:n_dec, PREFILLED] = 100
    batch[:n_dec, PREFILL_TARGET] = 100
    batch[:n_dec, GENERATED] = 5
    for i, (filled, left) in enumerate(rows):
        batch[n_dec + i, [PROMPT_TOKENS, PREFILL_TARGET]] = filled + left
        batch[n_dec + i, PREFILLED] = filled
    batch[:, OUTPUT_TOKENS] = 50
    got = {}
    for use in (False, True):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(compiled, "NUMBA", use)
            ctx = SimContext(cfg, prof, get_policy("none"), None, CalibrationMap(),
                             RequestLog.empty(len(batch)), lambda k: None)
            rep = ctx.replicas[0]
            rep.n_prefilling, rep.kv_tokens = len(rows), kv
            plan = rep._plan(batch.copy())
            got[use] = (plan.chunk.tolist(), plan.remaining.tolist(), plan.prefill_tokens,
                        np.float64(rep._step_time_s(batch, plan)).tobytes())
    assert got[True] == got[False]


def test_a_step_past_exact_float_units_is_left_to_the_reference():
    """Chunk units at or past 2**52 tokens would no longer sum exactly in any order: the
    kernel says NaN and the engine prices the step with numpy."""
    from dspark_sim.sim import fast
    from dspark_sim.sim.engine import NUM_COLUMNS, PREFILLED

    batch = np.zeros((2, NUM_COLUMNS), np.int64)
    batch[:, PREFILLED] = 1 << 45
    chunk = np.array([1 << 7, 1 << 7], np.int64)
    terms = np.array([0.0, 0.0, 1e-9, 0.0, 0.0, -1.0])
    dt = fast.chunked_step_s(batch, 0, np.zeros(0, np.int64), 0, chunk, chunk + 1,
                             np.zeros(300), 0, 0.0, terms, True)
    assert np.isnan(dt)
    batch[:, PREFILLED] = 1 << 20
    assert not np.isnan(fast.chunked_step_s(batch, 0, np.zeros(0, np.int64), 0, chunk,
                                            chunk + 1, np.zeros(300), 0, 0.0, terms, True))


@given(st.lists(st.lists(st.sampled_from([0.0, 0.125, 0.5, 0.7, 0.7, 1.0]), max_size=30),
                min_size=1, max_size=9))
def test_merging_the_lagged_steps_runs_is_sorting_them(runs):
    """The lagged view stacked from several steps, each held sorted: merged, the values
    numpy's sort gives, ties and empty steps included."""
    values = np.concatenate([np.sort(np.array(r, dtype=np.float64)) for r in runs])
    bounds = np.cumsum([0] + [len(r) for r in runs]).astype(np.int64)
    got = compiled.merged_runs(values.copy(), bounds)
    assert got.tobytes() == np.sort(values).tobytes()


def _batch(rng, n, rows_total):
    from dspark_sim.sim.engine import NUM_COLUMNS, REQUEST_ID

    batch = rng.integers(0, 50, (n, NUM_COLUMNS)).astype(np.int64)
    batch[:, REQUEST_ID] = rng.permutation(rows_total)[:n]
    return batch


@given(st.integers(0, 6), st.integers(0, 6), st.lists(st.booleans(), max_size=6),
       st.booleans(), st.integers(0, 2**32 - 1))
def test_admission_into_the_replicas_buffer_is_the_references_concatenation(
        n_dec, n_pre, ready, in_place, seed):
    """``fast.admit_rows`` writes [decoding | prefilled newcomers | prefilling | the other
    newcomers], as ``Replica._admit``'s numpy path concatenates them, into a separate
    buffer or into the buffer whose first rows the batch already is."""
    from dspark_sim.sim import fast
    from dspark_sim.sim.engine import PREFILL_TARGET, PREFILLED

    rng = np.random.default_rng(seed)
    rows = _batch(rng, 40, 40)
    batch = _batch(rng, n_dec + n_pre, 40)
    taken = rng.permutation(40)[: len(ready)].astype(np.int64)
    for r, is_ready in zip(taken, ready, strict=True):
        rows[r, PREFILLED] = rows[r, PREFILL_TARGET] + (0 if is_ready else -1)
    new = rows[taken]
    done = new[:, PREFILLED] >= new[:, PREFILL_TARGET]
    want = np.concatenate([batch[:n_dec], new[done], batch[n_dec:], new[~done]])
    out = np.full((len(want) + 3, batch.shape[1]), -7, np.int64)
    if in_place:
        out[: len(batch)] = batch
        batch = out[: len(batch)]
    n, kv, pending, others = fast.admit_rows(batch, n_pre, rows, taken, out)
    assert n == len(want) and (out[:n] == want).all() and (out[n:] == -7).all()
    assert others == int((~done).sum())
    assert pending == int(new[~done, PREFILL_TARGET].sum())


@given(st.lists(st.booleans(), max_size=12), st.booleans(), st.integers(0, 2**32 - 1))
def test_the_finished_rows_leave_in_place_as_the_reference_removes_them(finished, compact,
                                                                        seed):
    """``fast.replay_chain`` with no decoding rows: the finished rows leave the batch in
    place (the rest moved up in order) with their counters, finish time and output in
    the log, as ``Replica._remove`` takes them; or, not ``compact``, stay and are
    counted. The step's record goes into the row it is given."""
    from dspark_sim.sim import fast
    from dspark_sim.sim.engine import (
        ACCEPTED,
        GENERATED,
        ITL_EDGES_S,
        OUTPUT_TOKENS,
        REQUEST_ID,
        STEP_FIELDS,
        STEPS,
        VERIFIED,
        StepRecord,
    )

    rng = np.random.default_rng(seed)
    batch = _batch(rng, len(finished), 20)
    for r, f in enumerate(finished):
        batch[r, OUTPUT_TOKENS] = batch[r, GENERATED] + (0 if f else 1)
    before = batch.copy()
    logs = [np.zeros(20, np.int64) for _ in range(3)]
    finish, generated, first = np.full(20, np.nan), np.zeros(20, np.int64), np.zeros(20)
    none = np.zeros(0, np.int64)
    records = np.full((3, len(STEP_FIELDS)), -1.0)
    n, *_, n_gone, _ = fast.replay_chain(
        batch, 0, none, none, none, np.zeros(8, np.int64), 2, 0.5, ITL_EDGES_S, 3.0, *logs,
        finish, generated, first, np.empty((0, 1)), compact, records, 1, 7, 4, 0, 0, 0, 5, 6)
    gone = np.array(finished, bool)
    assert n_gone == gone.sum()
    # the step's record, in StepRecord's order, in the row asked for and only there
    want = StepRecord(3.0, 0.5, 7, 0, len(finished), 4, 0, 0, 0, 0, 0, 0, 0, 5, 6)
    assert records[1].tolist() == list(want)
    assert (records[[0, 2]] == -1).all()
    if not compact:
        assert n == len(batch) and (batch == before).all() and np.isnan(finish).all()
        return
    assert n == (~gone).sum() and (batch[:n] == before[~gone]).all()
    rids = before[gone, REQUEST_ID]
    assert (finish[rids] == 3.0).all() and np.isnan(np.delete(finish, rids)).all()
    assert (generated[rids] == before[gone, GENERATED]).all()
    for log, col in zip(logs, (STEPS, VERIFIED, ACCEPTED), strict=True):
        assert (log[rids] == before[gone, col]).all() and log.sum() == before[gone, col].sum()


@pytest.mark.parametrize("lag_steps", [1, 2])
def test_a_stacked_lagged_view_fills_a_buffer_of_exactly_its_size(lag_steps):
    """``compiled.stacked_lagged`` writes the steps it stacks, merged, into the first
    places of the buffer it is given, one of exactly their size included, and refuses a
    smaller one rather than write past it."""
    g = 2
    # three steps held, each sorted: one row, two rows, one row (slot, rows, values)
    steps = [[0.1, 0.5], [0.2, 0.3, 0.6, 0.9], [0.05, 0.7]]
    ring = np.concatenate([np.array(v) for v in steps])
    slots = np.zeros((4, 2), np.int64)
    slots[:3, 0] = [len(v) // g for v in steps]
    slots[:3, 1] = np.cumsum([0] + [len(v) for v in steps])[:3]
    state = np.array([3, 3], np.int64)  # the next slot written, the steps held
    newest = 3 - lag_steps
    want = np.sort(np.concatenate(steps[newest - 1: newest + 1]))  # 3 rows from 2 steps
    out = np.full(want.size, -1.0)
    n, is_sorted = compiled.stacked_lagged(ring, slots, state, lag_steps, 3, g, out)
    assert (n, is_sorted) == (want.size, True) and out.tolist() == want.tolist()
    with pytest.raises(ValueError, match="smaller"):
        compiled.stacked_lagged(ring, slots, state, lag_steps, 3, g, out[:-1].copy())


def test_the_replay_kernel_writes_the_step_record_in_its_fields_order():
    import inspect

    from dspark_sim.sim import fast
    from dspark_sim.sim.engine import STEP_FIELDS

    write = getattr(fast.write_record, "py_func", fast.write_record)
    assert tuple(inspect.signature(write).parameters)[1:] == STEP_FIELDS


def test_a_window_of_a_fraction_of_a_token_takes_the_python_path():
    from dataclasses import replace

    from dspark_sim.calibration.profile import load_profile
    from dspark_sim.sim import fast

    prof = load_profile("qwen3-8b-h100")
    assert fast.profile_terms(replace(prof, attn_window_tokens=100.5)) is None
    assert fast.profile_terms(replace(prof, attn_window_tokens=100))[-1] == 100.0


@pytest.mark.parametrize("profile", __import__(
    "dspark_sim.calibration.profile", fromlist=["builtin_profiles"]).builtin_profiles())
def test_both_paths_agree_on_every_shipped_profile(monkeypatch, profile):
    """Each shipped profile's cost terms (LM head, windows, per-request and multi-token
    terms, draft tables) priced by the kernels and by the Python reference: the same
    summary, on a short disaggregated run and a chunked-prefill one."""
    from dataclasses import replace

    from dspark_sim.sim.api import simulate
    from dspark_sim.sim.config import SimConfig

    cfg = SimConfig(policy="confidence", seed=1)
    runs = [replace(cfg, deployment=replace(cfg.deployment, profile=profile, replicas=1),
                    workload=replace(cfg.workload, qps=50.0, num_requests=40,
                                     duration_s=None, lengths="fixed:64:40"))]
    runs.append(replace(runs[0], engine=replace(runs[0].engine, prefill="chunked")))
    for run in runs:
        got = []
        for use in (False, True):
            monkeypatch.setattr(compiled, "NUMBA", use)
            got.append(simulate(run).summary)
        assert got[0]["engine_steps"] > 0 and got[1] == got[0]


def test_the_engine_runs_the_compiled_decision_only_where_it_applies(monkeypatch):
    """The default scheduler's compiled decision is the engine's on the compiled path,
    never on the numpy reference path, and not once its ``decide`` is replaced (a
    wrapper that records snapshots must see them); a constant policy's is the constant
    kernel, and a run that drafts nothing decides nothing."""
    from dataclasses import replace

    from dspark_sim.calibration.confmap import CalibrationMap
    from dspark_sim.calibration.profile import load_profile
    from dspark_sim.policies.registry import get_policy
    from dspark_sim.sim.config import DeploymentConfig, SimConfig
    from dspark_sim.sim.engine import RequestLog, SimContext
    from dspark_sim.traces.schema import load_trace

    trace = load_trace("dspark-synthetic")
    prof = load_profile("qwen3-8b-h100")
    cfg = SimConfig(deployment=DeploymentConfig(replicas=1))
    conf = get_policy("confidence")
    wrapped = replace(conf, decide=lambda s: conf.decide(s))
    for use, policy, engaged in ((True, conf, "lagged"), (False, conf, None),
                                 (True, get_policy("vllm-adaptive"), "lagged"),
                                 (True, get_policy("confidence-async"), None),
                                 (True, get_policy("fixed:3"), "constant"),
                                 (False, get_policy("fixed:3"), None),
                                 (True, get_policy("none"), None), (True, wrapped, None)):
        monkeypatch.setattr(compiled, "NUMBA", use)
        ctx = SimContext(cfg, prof, policy, trace, CalibrationMap(),
                         RequestLog.empty(0), lambda k: None)
        got = ctx.decision.signature if ctx.decision is not None else None
        assert got == engaged, (use, policy.name)


def test_numba_is_imported_only_when_a_kernel_first_runs():
    """A command that never steps an engine (``--help``, a refused option) does not pay
    numba's import; the first kernel call binds every kernel, callers' too, to numba's
    dispatchers where the module compiled ahead of time is not asked for."""
    code = ("import sys\nimport dspark_sim.cli\nfrom dspark_sim.policies import compiled\n"
            "from dspark_sim.sim import fast\n"
            "assert 'numba' not in sys.modules, 'imported with the CLI'\n"
            "import numpy as np\n"
            "assert compiled.stretch_sorted(np.array([3.0, 1.0]), 4).tolist() == "
            "[3.0, 3.0, 1.0, 1.0]\n"
            "assert 'numba' in sys.modules\n"
            "assert hasattr(fast.replay_chain, 'py_func') and "
            "hasattr(compiled.budget_displacement, 'py_func')\n"
            "assert compiled.kernel(compiled.counts_at) is compiled.counts_at\n")
    _in_a_fresh_process(code, "jit")


def test_a_kernel_defined_after_the_first_kernel_ran_is_compiled():
    """A module with kernels imported once the others are bound (``sim.ahead`` after an
    engine has stepped, say) gets numba's dispatchers at once, not a stand-in that would
    wait for a binding that has already happened."""
    _in_a_fresh_process("import numpy as np\nfrom dspark_sim.policies import compiled\n"
                        "compiled.stretch_sorted(np.array([3.0, 1.0]), 4)\n"
                        "@compiled.njit(cache=False)\ndef late(x):\n    return x + 1\n"
                        "assert hasattr(late, 'py_func') and late(1) == 2\n")


def _in_a_fresh_process(code: str, kernels: str = "numba") -> None:
    import os
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "DSPARK_SIM_KERNELS": kernels})
    assert res.returncode == 0, res.stderr
