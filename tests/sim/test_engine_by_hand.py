"""Engine mechanics on hand-built batches and tiny runs, every expected value worked out by
hand in the test: recompute preemption (which rows, what they keep), the token budget's
trim of chain and tree/lossy plans, what a step costs (tree branches, skipped verifiers,
attention units, a lossy plan's earlier unverified commits), the scheduler's SPS curve and
draft prices (a context-priced drafter), the router's order and the default limits.
Each test pins a behaviour a plausible one-token slip in ``sim/engine.py`` would change
(see docs/testing.md, "Mutation testing")."""

from __future__ import annotations

from collections import deque
from dataclasses import replace

import numpy as np
import pytest

from dspark_sim.calibration.confmap import CalibrationMap
from dspark_sim.calibration.profile import DraftCost, EngineLimits, EngineProfile
from dspark_sim.policies.base import Replayed, Verification
from dspark_sim.policies.registry import Policy, Reads, get_policy
from dspark_sim.sim import api, engine
from dspark_sim.sim.api import simulate
from dspark_sim.sim.config import DeploymentConfig, EngineConfig, SimConfig, WorkloadConfig
from dspark_sim.sim.engine import (
    ACCEPTED,
    GENERATED,
    GENERATED_AT_ADMIT,
    NUM_COLUMNS,
    OUTPUT_TOKENS,
    PREFILL_TARGET,
    PREFILLED,
    PROMPT_TOKENS,
    REQUEST_ID,
    STEPS,
    VERIFIED,
    RequestLog,
    SimContext,
)
from dspark_sim.traces.synth import synth_iid


def _flat(step_s: float = 0.010, *, draft_s: float = 0.0, **kw) -> EngineProfile:
    """A target that costs ``step_s`` at any batch size and a constant-cost drafter."""
    drafts = {"dspark": DraftCost(np.array([1.0, 2.0]), np.array([draft_s, draft_s]), 7)}
    return EngineProfile(name="flat", kind="measured", gpus_per_replica=1,
                         tokens=np.array([1, 8192]), step_s=np.array([step_s, step_s]),
                         interpolation="step", drafts=kw.pop("drafts", drafts), **kw)


def _run_with(policy: Policy, cfg: SimConfig, **kw):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(api, "get_policy", lambda spec: policy)
        return simulate(cfg, **kw)


def _one_replica(policy: str = "none", *, engine_cfg: EngineConfig | None = None,
                 n: int = 1, lengths: str = "fixed:10:11", concurrency: int = 1) -> SimConfig:
    return SimConfig(policy=policy, deployment=DeploymentConfig(replicas=1),
                     engine=engine_cfg or EngineConfig(prefill="chunked"),
                     workload=WorkloadConfig(arrival="closed", max_concurrency=concurrency,
                                             num_requests=n, lengths=lengths))


# -- recompute preemption on a hand-built batch ------------------------------------------------

def _row(rid, prompt, target, prefilled, generated, at_admit, steps=0, verified=0, accepted=0):
    r = np.zeros(NUM_COLUMNS, np.int64)
    r[[REQUEST_ID, PROMPT_TOKENS, PREFILL_TARGET, PREFILLED, GENERATED, GENERATED_AT_ADMIT,
       OUTPUT_TOKENS, STEPS, VERIFIED, ACCEPTED]] = \
        (rid, prompt, target, prefilled, generated, at_admit, 1000, steps, verified, accepted)
    return r


def _replica_holding(capacity: int):
    """A replica (policy ``none``, no trace: one verify slot per row) whose batch is, oldest
    first:

    ====  ======  =======================  ==========  =========  ===================
    rid   prompt  prefill target / done    generated   at admit   KV held / freed
    ====  ======  =======================  ==========  =========  ===================
    0     100     100 / 100                20          0          120 / 121
    2     30      30 / 30                  5           0          35 / 36
    1     50      60 / 60 (preempted once  15          10         65 / 66
                  with 10 tokens out)
    3     40      40 / 25 (mid-prefill)    0           0          25 / 41
    ====  ======  =======================  ==========  =========  ===================

    "freed": what preempting the row returns (prefill target + generated since admission
    + its verify slot). KV held 245, pending prefill 15, committed 245 + 15 + 4 = 264.
    Request 9 waits."""
    cfg = SimConfig(policy="none", deployment=DeploymentConfig(replicas=1),
                    engine=EngineConfig(kv_capacity_tokens=capacity, prefill="chunked"))
    ctx = SimContext(cfg, _flat(), get_policy("none"), None, CalibrationMap(),
                     RequestLog.empty(10), lambda k: None)
    assert ctx.verify_slots == 1
    ctx.rows = np.zeros((10, NUM_COLUMNS), np.int64)
    rep = ctx.replicas[0]
    rep.batch = np.stack([_row(0, 100, 100, 100, 20, 0, steps=20, verified=0),
                          _row(2, 30, 30, 30, 5, 0, steps=5),
                          _row(1, 50, 60, 60, 15, 10, steps=7, verified=9, accepted=4),
                          _row(3, 40, 40, 25, 0, 0)])
    rep.kv_tokens, rep.pending_prefill, rep.n_prefilling = 245, 15, 1
    rep.waiting = deque([9])
    rep.outstanding = 5
    rep.check_invariants()
    assert rep._committed_kv() == 264
    return ctx, rep


def test_preemption_frees_the_fewest_newest_rows_and_requeues_them_first():
    """264 committed in a 159-token cache: 105 over. The newest row frees 41, the next 66
    (107 >= 105): two victims, requests 3 and 1, back at the queue's front in admission
    order, rows reset for recompute (prompt + what they generated), counters flushed to
    the log, one preemption each; the mid-prefill victim takes its 15 pending prefill
    tokens with it."""
    ctx, rep = _replica_holding(264 - 105)
    rep._preempt_if_full()
    assert rep.batch[:, REQUEST_ID].tolist() == [0, 2]
    assert list(rep.waiting) == [1, 3, 9]
    assert (rep.kv_tokens, rep.pending_prefill, rep.n_prefilling) == (120 + 35, 0, 0)
    rep.check_invariants()
    log = ctx.log
    assert log.preemptions.tolist() == [0, 1, 0, 1, 0, 0, 0, 0, 0, 0]
    assert (log.steps[1], log.draft_tokens_verified[1], log.accepted_tokens[1]) == (7, 9, 4)
    assert log.steps[[0, 2, 3]].tolist() == [0, 0, 0]  # still running / never stepped
    one, three = ctx.rows[1], ctx.rows[3]
    # request 1 recomputes its prompt and all 15 tokens it generated (not 60 + 15)
    assert (one[PROMPT_TOKENS], one[PREFILL_TARGET], one[PREFILLED]) == (50, 65, 0)
    assert (one[GENERATED], one[GENERATED_AT_ADMIT]) == (15, 15)
    assert one[STEPS:].tolist() == [0, 0, 0]
    assert (three[PREFILL_TARGET], three[PREFILLED], three[GENERATED]) == (40, 0, 0)


def test_preemption_takes_one_more_row_when_two_do_not_free_enough():
    """110 over: the two newest free 107, so the third newest (request 2, 36) goes too."""
    ctx, rep = _replica_holding(264 - 110)
    rep._preempt_if_full()
    assert rep.batch[:, REQUEST_ID].tolist() == [0]
    assert list(rep.waiting) == [2, 1, 3, 9]
    assert (rep.kv_tokens, rep.pending_prefill, rep.n_prefilling) == (120, 0, 0)
    rep.check_invariants()
    assert ctx.log.preemptions.tolist() == [0, 1, 1, 1, 0, 0, 0, 0, 0, 0]


def test_preemption_keeps_one_row_and_leaves_an_exact_fit_alone():
    ctx, rep = _replica_holding(264)  # committed == capacity: nothing to free
    rep._preempt_if_full()
    assert rep.batch[:, REQUEST_ID].tolist() == [0, 2, 1, 3] and list(rep.waiting) == [9]
    ctx, rep = _replica_holding(10)  # everything over: all but the oldest go
    rep._preempt_if_full()
    assert rep.batch[:, REQUEST_ID].tolist() == [0]
    assert list(rep.waiting) == [2, 1, 3, 9]
    # a two-row batch over capacity gives up its newer row
    ctx, rep = _replica_holding(200)
    rep.batch = rep.batch[:2]
    rep.kv_tokens, rep.pending_prefill, rep.n_prefilling = 155, 0, 0
    assert rep._committed_kv() == 157
    rep._preempt_if_full()
    assert rep.batch[:, REQUEST_ID].tolist() == [0, 2]  # 157 fits in 200
    ctx.kv_capacity = 156
    rep._preempt_if_full()
    assert rep.batch[:, REQUEST_ID].tolist() == [0] and list(rep.waiting) == [2, 9]


def test_requests_that_exactly_fill_the_cache_run_together():
    """Two 100-token prompts, one output token each (the prefill step emits it and they
    finish), policy none: each commits 100 + 1 verify slot, 202 in all, exactly the
    cache. Both are admitted, prefilled in one step and never preempted."""
    cfg = _one_replica(engine_cfg=EngineConfig(kv_capacity_tokens=202, prefill="chunked"),
                       n=2, concurrency=2, lengths="fixed:100:1")
    s = simulate(cfg, profile=_flat()).summary
    assert (s["completed"], s["engine_steps"], s["preemptions"]) == (2, 1, 0)
    tight = simulate(replace(cfg, engine=replace(cfg.engine, kv_capacity_tokens=201)),
                     profile=_flat()).summary
    assert (tight["completed"], tight["engine_steps"]) == (2, 2)  # one at a time


# -- the token budget --------------------------------------------------------------------------

def test_a_chain_over_the_token_budget_is_trimmed_and_counted():
    """One request, a 4-token budget, fixed:7 on a trace that accepts nothing: each of the
    10 decode steps trims 1 + 7 to 1 + 3 tokens and counts one budget-limited step."""
    trace = synth_iid(0.0, 7, num_requests=2, positions=64)
    cfg = _one_replica("fixed:7", engine_cfg=EngineConfig(
        max_num_batched_tokens=4, max_num_seqs=1, prefill="chunked"), lengths="fixed:4:11")
    s = simulate(cfg, profile=_flat(), trace=trace).summary
    assert s["engine_steps"] == 11 and s["budget_limited_steps"] == 10
    assert s["num_draft_tokens_verified"] == 30 and s["num_accepted_tokens"] == 0


def _plan(tokens: int, *, fill: int | None = None, draft: int | None = None,
          bonus: bool = True, lossy: bool = False) -> Policy:
    """A toy tree/lossy policy: every decoding request verifies ``tokens`` (plus ``fill``
    earlier commits, ``draft`` extra drafted tokens); its replay accepts nothing and
    takes the bonus token unless ``bonus`` is False (it skips the verifier)."""
    def decide(s):
        n = s.num_requests
        return Verification(np.full(n, tokens, np.int64),
                            fill_tokens=None if fill is None else np.full(n, fill, np.int64),
                            draft_tokens=None if draft is None else np.full(n, draft, np.int64))

    def replay(p, v):
        n = len(p.tokens)
        if bonus:
            return Replayed(np.zeros(n, np.int64))
        return Replayed(np.minimum(p.tokens, 1), bonus=np.zeros(n, bool))

    return replace(get_policy("fixed:7"), name="plan", decide=decide, replay=replay, lossy=lossy)


@pytest.mark.parametrize("budget,tokens,fill,verified,limited", [
    (8, 7, None, 7, 0),  # 1 + 7 = 8 fits exactly: no trim
    (6, 7, None, 5, 10),  # trimmed to (6 - 1) // 1 = 5
    (8, 7, 2, 5, 10),  # 1 + 7 + 2 fill > 8: trimmed to (8 - 1 - 2) // 1 = 5
    (8, 7, 7, 0, 10),  # the fill leaves no room: (8 - 1 - 7) // 1 = 0
    (8, 7, 0, 7, 0),  # no fill: as without one
    (6, 7, -3, 5, 10),  # a negative fill counts as none: it frees no budget
    (64, 9, None, 7, 0),  # at most verify_max (7) tokens
    (64, -2, None, 0, 0),  # a negative count verifies nothing
])
def test_a_plan_over_the_token_budget_is_trimmed_around_its_fill(budget, tokens, fill,
                                                                verified, limited):
    """One request, 10 decode steps of a plan (nothing accepted)."""
    trace = synth_iid(0.0, 7, num_requests=2, positions=64)
    cfg = _one_replica(engine_cfg=EngineConfig(max_num_batched_tokens=budget, max_num_seqs=1,
                                               prefill="chunked"), lengths="fixed:4:11")
    s = _run_with(_plan(tokens, fill=fill), cfg, profile=_flat(), trace=trace).summary
    assert s["engine_steps"] == 11 and s["budget_limited_steps"] == limited
    assert s["num_draft_tokens_verified"] == 10 * verified


@pytest.mark.parametrize("claim", [
    lambda p: np.r_[-1, np.zeros(len(p.tokens) - 1, np.int64)],  # a negative count
    lambda p: p.tokens + np.r_[np.zeros(len(p.tokens) - 1, np.int64), 1],  # > tokens
    lambda p: np.zeros(len(p.tokens) + 1, np.int64),  # one count too many
], ids=["negative", "beyond-tokens", "shape"])
def test_a_replay_claiming_what_was_not_verified_is_refused(claim):
    """Two requests verify 3 tokens each: a replay may accept 0..3 per request, one count
    per request; one bad count among good ones is enough to refuse it (both would finish
    in their first decode step: 5 tokens out)."""
    trace = synth_iid(0.0, 7, num_requests=2, positions=64)
    pol = replace(_plan(3), replay=lambda p, v: Replayed(claim(p)))
    with pytest.raises(RuntimeError, match="replay accepted outside"):
        _run_with(pol, _one_replica(n=2, concurrency=2, lengths="fixed:10:5"),
                  profile=_flat(), trace=trace)


# -- what a step costs -------------------------------------------------------------------------

def test_tree_branches_cost_the_draft_tables_per_token_share():
    """Two requests (10-token prompts, 11 output tokens) prefill in one 10 ms step, then
    decode together for 10 steps of 10 ms target + the 7-token draft at 2 requests (4 ms x
    (1 + 0.5 x (7 - 1)) = 16 ms). Drafting 3 extra tree tokens each adds, per step, 3 x
    the table's per-token share at 2 requests (4 ms x gamma_slope 0.5 = 2 ms): 10 x 6 ms."""
    drafts = {"dspark": DraftCost(np.array([1.0, 2.0]), np.array([0.002, 0.004]), 1,
                                  gamma_slope=0.5)}
    prof = _flat(drafts=drafts)
    trace = synth_iid(0.0, 7, num_requests=2, positions=64)
    cfg = _one_replica(n=2, concurrency=2)
    plain = _run_with(_plan(3), cfg, profile=prof, trace=trace).requests
    branched = _run_with(_plan(3, draft=3), cfg, profile=prof, trace=trace).requests
    assert plain["e2e_ms"].to_list() == pytest.approx([10 + 10 * (10 + 16)] * 2)
    np.testing.assert_allclose(branched["e2e_ms"] - plain["e2e_ms"], [60.0, 60.0])


def test_rows_that_skip_the_verifier_read_no_target_kv():
    """A lossy plan whose rows all commit without the verifier: the target reads none of
    their KV, so a KV price changes nothing; the same plan through the verifier pays it."""
    trace = synth_iid(0.0, 7, num_requests=2, positions=64)
    cfg = _one_replica(n=2, concurrency=2, lengths="fixed:10:21")
    free, priced = _flat(), _flat(kv_s_per_token=1e-4)
    skip = _plan(3, bonus=False, lossy=True)
    a = _run_with(skip, cfg, profile=free, trace=trace).summary
    b = _run_with(skip, cfg, profile=priced, trace=trace).summary
    assert a["engine_steps"] == b["engine_steps"] == 21
    assert b["mean_step_ms"] == pytest.approx(a["mean_step_ms"], rel=1e-12)
    # both requests skip the verifier in each of the 20 decode steps; each step's batch is
    # their 2 x 3 tokens without the bonus slots, after one 20-token prefill step
    assert (a["verifier_skipped_request_steps"], a["verifier_call_fraction"]) == (40, 0.0)
    assert a["mean_batch_tokens"] == pytest.approx((20 + 20 * 6) / 21)
    verified = _plan(3)
    c = _run_with(verified, cfg, profile=free, trace=trace).summary
    d = _run_with(verified, cfg, profile=priced, trace=trace).summary
    assert d["mean_step_ms"] > c["mean_step_ms"]


def test_rows_that_skip_the_verifier_are_left_out_of_the_targets_kv_reads():
    """Request 0 always commits without the verifier, request 1 always verifies; both emit
    one token a step, so at decode step k = 1..20 each holds 10 + k tokens. The target
    reads request 1's only: 1e-4 s x (200 + 210) = 41 ms more with the KV priced."""
    trace = synth_iid(0.0, 7, num_requests=2, positions=64)
    cfg = _one_replica(n=2, concurrency=2, lengths="fixed:10:21")

    def replay(p, v):
        return Replayed(np.array([1, 0]), bonus=np.array([False, True]))

    mixed = replace(_plan(3, lossy=True), replay=replay)
    free = _run_with(mixed, cfg, profile=_flat(), trace=trace).requests
    priced = _run_with(mixed, cfg, profile=_flat(kv_s_per_token=1e-4), trace=trace).requests
    assert free["generated_tokens"].to_list() == [21, 21]
    np.testing.assert_allclose(priced["e2e_ms"] - free["e2e_ms"], [41.0, 41.0])


def test_a_step_where_every_request_skips_the_verifier_costs_only_the_draft():
    """A lossy plan verifying nothing that commits one draft per request and step without
    the verifier: the 20 decode steps run no target forward, only the 2 ms draft."""
    trace = synth_iid(0.0, 7, num_requests=2, positions=64)
    n = 2

    def replay(p, v):
        return Replayed(np.ones(n, np.int64), bonus=np.zeros(n, bool))

    pol = replace(_plan(0, lossy=True), replay=replay)
    r = _run_with(pol, _one_replica(n=n, concurrency=n, lengths="fixed:10:21"),
                  profile=_flat(draft_s=0.002), trace=trace).requests
    assert r["e2e_ms"].to_list() == pytest.approx([10 + 20 * 2.0] * 2)


def test_a_step_with_as_many_verify_as_prefill_tokens_runs_the_target():
    """Budget 8, fixed:3: request 0 (4-token prompt) prefills beside request 1's first 4
    of 12 tokens, then each decode step verifies 1 + 3 tokens and leaves 4 for request 1's
    prefill: three 10 ms steps to request 1's first token."""
    trace = synth_iid(0.0, 7, num_requests=2, positions=64)
    cfg = SimConfig(policy="fixed:3", deployment=DeploymentConfig(replicas=1),
                    engine=EngineConfig(max_num_batched_tokens=8, max_num_seqs=2,
                                        prefill="chunked"),
                    workload=WorkloadConfig(arrival="closed", max_concurrency=2, num_requests=2,
                                            lengths="fixed:4:6"))
    pinned = replace(trace, req_prompt_tokens=np.array([4, 12]),
                     req_output_tokens=np.array([6, 6]))
    r = simulate(replace(cfg, workload=replace(cfg.workload, lengths="trace")),
                 profile=_flat(), trace=pinned, trace_rows=np.arange(2)).requests
    assert r["prompt_tokens"].to_list() == [4, 12]
    assert r["ttft_ms"].to_list() == pytest.approx([10.0, 30.0])


def _step_series(run) -> dict[str, np.ndarray]:
    """The per-step record (``StepRecorder.columns``) of the one run ``run()`` makes."""
    made = []

    def context(*a, **k):
        made.append(SimContext(*a, **k))
        return made[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(api, "SimContext", context)
        run()
    return made[0].steps.columns()


def test_the_step_series_by_hand():
    """The per-step record of the all-skipping plan (two 10-token prompts, 21 tokens out):
    one 20-token prefill step emitting both first tokens, then 20 steps of 2 x 3 batch
    tokens (no bonus slots), 6 drafts verified, 2 accepted and emitted, 10 ms each."""
    trace = synth_iid(0.0, 7, num_requests=2, positions=64)
    cfg = _one_replica(n=2, concurrency=2, lengths="fixed:10:21")
    cols = _step_series(lambda: _run_with(_plan(3, bonus=False, lossy=True), cfg,
                                          profile=_flat(), trace=trace))
    assert len(cols["end_s"]) == 21
    np.testing.assert_allclose(cols["end_s"], 0.010 * np.arange(1, 22), rtol=1e-9)
    np.testing.assert_allclose(cols["dt_s"], 0.010, rtol=1e-12)
    want = {"replica": 0, "decode_batch": 2, "running": 2, "waiting": 0, "batch_tokens": 6,
            "prefill_tokens": 0, "verified_drafts": 6, "emitted_tokens": 2,
            "accepted_tokens": 2}
    first = {"decode_batch": 0, "batch_tokens": 20, "prefill_tokens": 20, "verified_drafts": 0,
             "accepted_tokens": 0}
    for name, value in want.items():
        assert cols[name].tolist() == [first.get(name, value)] + [value] * 20, name


def test_decode_context_counts_kv_held_since_admission():
    batch = np.stack([_row(0, 8, 8, 8, 3, 1),  # 8 prefilled + 3 generated, 1 of them
                      _row(1, 15, 20, 20, 10, 5),  # before admission (re-prefilled)
                      _row(2, 50, 50, 30, 0, 0)])
    assert engine.Replica._decode_context(batch, 2).tolist() == [10, 25]
    assert engine.Replica._context(batch, slice(0, 2)).tolist() == [10, 25]


def test_attention_units_by_hand():
    """Two decoding rows (contexts 10 and 20; the second admitted after 5 tokens out), one
    prefilling row 30 tokens in that gets a 6-token chunk and one 4 tokens in that gets
    none this step."""
    batch = np.stack([_row(0, 8, 8, 8, 3, 1),  # context 8 + 3 - 1 = 10
                      _row(1, 15, 15, 15, 10, 5),  # context 20
                      _row(2, 50, 50, 30, 0, 0),
                      _row(3, 50, 50, 4, 0, 0),
                      _row(4, 50, 50, 1, 0, 0),
                      _row(5, 50, 50, 0, 0, 0)])
    ell = np.array([2, 0])
    chunk = np.array([6, 0, 1, 2])
    units = engine.Replica._attention_units(batch, 2, ell, chunk)
    # decode: (1 + 2) x 10 + (1 + 0) x 20 = 50; prefill chunks: 6 x (30 + 6/2) + 0
    # + 1 x (1 + 1/2) + 2 x (0 + 2/2) = 198 + 1.5 + 2; multi-token blocks: row 0 (l = 2)
    # over 10, the continuing chunks over 30 and 1 (row 3 runs nothing, row 5 starts from
    # nothing); rows with a context: both decoding rows and the two continuing chunks
    assert units == (50 + 201.5, 10.0 + 30 + 1, 4)
    # a window of 12 tokens caps each query's context: 3 x 10 + 12 + 6 x min(33, 12) + ...
    units = engine.Replica._attention_units(batch, 2, ell, chunk, window=12)
    assert units == (30.0 + 12 + 72 + 1.5 + 2, 41.0, 4)
    # a row that skips the verifier is not in the forward
    units = engine.Replica._attention_units(batch, 2, ell, None,
                                            skip=np.array([True, False]))
    assert units == (20.0, 0.0, 1)
    # one draft verified is already a multi-token (2-token) query block: (1 + 1) x 10 + 20
    units = engine.Replica._attention_units(batch, 2, np.array([1, 0]), None)
    assert units == (40.0, 10.0, 2)


@pytest.mark.parametrize("tokens,fill", [(3, 2), (0, 2)])
def test_earlier_unverified_commits_are_query_tokens_of_the_targets_attention(tokens, fill):
    """A lossy plan that verifies ``tokens`` drafts and writes ``fill`` earlier unverified
    commits to the target's KV (one request, 10-token prompt, 6 tokens out: one prefill
    step, then 5 decode steps emitting the bonus token each). Attention priced at 10 us per
    query token x context token, 1 us per context token of a multi-token query block and
    0.1 ms per request with a context. Decode step k = 1..5 holds 10 + k tokens and runs
    1 + tokens + fill query tokens over them (a multi-token block even when nothing is
    verified); the prefill step's 10-token chunk attends 10 x (0 + 10 / 2) = 50 units."""
    trace = synth_iid(0.0, 7, num_requests=2, positions=64)
    prof = _flat(attn_s_per_query_ctx=1e-5, multi_kv_s_per_token=1e-6, request_s=1e-4)
    cfg = _one_replica(lengths="fixed:10:6")
    cols = _step_series(lambda: _run_with(_plan(tokens, fill=fill, lossy=True), cfg,
                                          profile=prof, trace=trace))
    context = 10 + np.arange(1, 6)
    decode_s = 0.010 + 1e-5 * (1 + tokens + fill) * context + 1e-6 * context + 1e-4
    np.testing.assert_allclose(cols["dt_s"], np.r_[0.010 + 1e-5 * 50, decode_s], rtol=1e-12)
    # the fill is batch tokens but neither drafts nor verified
    assert cols["batch_tokens"].tolist() == [10] + [1 + tokens + fill] * 5
    assert cols["verified_drafts"].tolist() == [0] + [tokens] * 5


def _recorded(policy_name: str):
    inner = get_policy(policy_name)
    seen = []

    def decide(snap):
        seen.append(snap)
        return inner(snap)

    return replace(inner, decide=decide), seen


@pytest.mark.parametrize("budget", [12, 15, 16])
def test_the_scheduler_sees_the_step_time_it_will_pay(budget):
    """Two requests decoding, a linear table t(B) = 10 ms + 1 ms x (B - 1), a constant 4 ms
    draft: admitting i of the 2 x 7 drafts makes B = 2 + i, so SPS[i] = 1 / (t(2 + i) +
    4 ms) while 2 + i fits in the budget, 0 past it (confidence-async's curve). The step
    cost the confidence scheduler gets has the 4 ms draft as the only extra and, for a
    chain policy, charges no tree branches."""
    prof = replace(_flat(draft_s=0.004), interpolation="linear", tokens=np.array([1, 64]),
                   step_s=np.array([0.010, 0.073]))
    trace = synth_iid(0.5, 7, num_requests=4, positions=64, seed=2)
    cfg = _one_replica("confidence", engine_cfg=EngineConfig(
        max_num_batched_tokens=budget, max_num_seqs=2, prefill="chunked"), n=2, concurrency=2,
        lengths="fixed:6:20")
    i = np.arange(15)
    want = np.where(2 + i <= budget, 1.0 / (0.010 + 0.001 * (2 + i - 1) + 0.004), 0.0)
    pol, seen = _recorded("confidence-async")
    _run_with(pol, cfg, profile=prof, trace=trace)
    both = [snap for snap in seen if snap.num_requests == 2]  # both prefill at once
    assert len(both) >= 5
    for snap in both:
        np.testing.assert_allclose(snap.sps, want, rtol=1e-12)
    pol, seen = _recorded("confidence")
    _run_with(pol, cfg, profile=prof, trace=trace)
    assert len(seen) >= 5
    for snap in seen:
        assert snap.cost.pending_prefill == 0
        np.testing.assert_allclose(snap.cost.extra_s, np.full(1 + 7 * snap.num_requests, 0.004),
                                   rtol=1e-12)
        assert snap.cost.draft_token_s == 0.0


def test_lengths_of_any_numeric_dtype_or_read_only_are_taken():
    """A policy that reads survivals may hand back its lengths as floats, int32 or a
    read-only array: the engine trims its own int64 copy and the run equals fixed:3."""
    trace = synth_iid(0.6, 7, num_requests=4, positions=64, seed=1)
    cfg = _one_replica("fixed:3", n=3, concurrency=3, lengths="fixed:10:30")
    want = simulate(cfg, profile=_flat(), trace=trace).summary

    def frozen(n):
        a = np.full(n, 3, np.int64)
        a.flags.writeable = False
        return a

    makes = (lambda n: np.full(n, 3.0), lambda n: np.full(n, 3, np.int32), frozen,
             lambda n: [3] * n)
    # both ways the engine asks: with survivals, and without (fixed:k reads none)
    for reads_survival in (True, False):
        for make in makes:
            pol = replace(get_policy("fixed:3"), reads=Reads(survival=reads_survival),
                          decide=lambda s, make=make: make(s.num_requests))
            got = _run_with(pol, cfg, profile=_flat(), trace=trace).summary
            assert got["num_accepted_tokens"] == want["num_accepted_tokens"] > 0
            assert got["engine_steps"] == want["engine_steps"]


@pytest.mark.parametrize("reads_survival", [True, False])
@pytest.mark.parametrize("bad", [lambda n: np.full(n, 2.5), lambda n: np.full(n, -1),
                                 lambda n: np.full(n, np.inf), lambda n: np.full(n, np.nan),
                                 lambda n: np.full(n + 1, 3), lambda n: np.full(n, True),
                                 lambda n: np.full(n, "3")])
def test_lengths_that_are_not_counts_name_the_policy(reads_survival, bad):
    """A fraction, a negative, a non-finite length, a wrong shape or a non-number is the
    policy's bug: one error naming it, not a numpy casting error or a silent cast."""
    trace = synth_iid(0.6, 7, num_requests=4, positions=64, seed=1)
    cfg = _one_replica("fixed:3", n=3, concurrency=3, lengths="fixed:10:30")
    pol = replace(get_policy("fixed:3"), reads=Reads(survival=reads_survival),
                  decide=lambda s: bad(s.num_requests))
    with pytest.raises(RuntimeError, match=r"policy fixed:3: verify lengths must be \d+ "
                                           r"non-negative integers"):
        _run_with(pol, cfg, profile=_flat(), trace=trace)


def test_a_trace_without_confidences_serves_a_fixed_length():
    """fixed:k never reads the confidences, so a trace without them is enough."""
    trace = synth_iid(0.6, 7, num_requests=4, positions=64, seed=1)
    cfg = _one_replica("fixed:3", n=3, concurrency=3, lengths="fixed:10:30")
    want = simulate(cfg, profile=_flat(), trace=trace).summary
    got = simulate(cfg, profile=_flat(), trace=replace(trace, conf=None)).summary
    assert got["num_accepted_tokens"] == want["num_accepted_tokens"]


def test_no_drafter_prices_no_draft():
    cfg = SimConfig(policy="none", deployment=DeploymentConfig(replicas=1))
    ctx = SimContext(cfg, _flat(draft_s=0.5), get_policy("none"), None, CalibrationMap(),
                     RequestLog.empty(0), lambda k: None)
    context = np.array([10, 20])
    assert ctx.cost.draft_time(2, 100) == ctx.cost.draft_branch_s(2) == 0.0
    assert ctx.sched_cost.draft_pass_s(2, context) == ctx.sched_cost.draft_fixed_s(context, 100) == 0.0
    assert ctx.trace_survival is None


def test_a_trees_step_cost_prices_each_branch_token_at_the_tables_share():
    """A tree policy that prices its own branches sees, per drafted token beyond the block,
    the engine's price: the table's per-token share at n requests over n (2 requests: 4 ms
    x 0.5 / 2 = 1 ms)."""
    drafts = {"dspark": DraftCost(np.array([1.0, 2.0]), np.array([0.002, 0.004]), 1,
                                  gamma_slope=0.5)}
    seen = []
    plan = _plan(3, draft=1)

    def decide(snap):
        seen.append(snap)
        return plan.decide(snap)

    pol = replace(plan, decide=decide, reads=Reads(survival=True, cost=True))
    trace = synth_iid(0.0, 7, num_requests=2, positions=64)
    _run_with(pol, _one_replica(n=2, concurrency=2), profile=_flat(drafts=drafts), trace=trace)
    assert len(seen) == 10
    assert [s.cost.draft_token_s for s in seen] == pytest.approx([0.001] * 10, rel=1e-12)


def test_without_a_trace_nothing_is_drafted_and_no_draft_table_is_needed():
    cfg = SimConfig(policy="fixed:3", deployment=DeploymentConfig(replicas=1))
    ctx = SimContext(cfg, _flat(drafts={}), get_policy("fixed:3"), None, CalibrationMap(),
                     RequestLog.empty(0), lambda k: None)
    assert (ctx.gamma, ctx.verify_max, ctx.verify_slots) == (0, 0, 1)
    assert ctx.cost.draft_time(4, 100) == 0.0


# -- routing and defaults ----------------------------------------------------------------------

def test_round_robin_sends_request_i_to_replica_i_mod_n():
    cfg = SimConfig(deployment=DeploymentConfig(replicas=3, router="round-robin"),
                    workload=WorkloadConfig(qps=50.0, num_requests=10, lengths="fixed:8:4"))
    r = simulate(cfg, profile=_flat()).requests.sort("arrival_s")
    assert r["replica"].to_list() == [i % 3 for i in range(10)]


def test_default_limits_are_vllms():
    """With neither an option nor a profile [engine] table: vLLM's max_num_seqs 256 and
    max_num_batched_tokens 8192, a 2M-token KV cache, chunked prefill."""
    lim = engine.resolve_limits(EngineConfig(), replace(_flat(), limits=EngineLimits()))
    assert (lim.max_num_seqs, lim.max_num_batched_tokens, lim.kv_capacity_tokens,
            lim.max_model_len, lim.prefill) == (256, 8192, 2_000_000, None, "chunked")
    assert set(lim.sources.values()) == {"default"}


def test_least_outstanding_fills_the_emptiest_replica_first():
    """Six clients start at once on three replicas: each submission goes to the replica
    with the fewest outstanding requests (ties: the lowest index), 0, 1, 2, 0, 1, 2."""
    cfg = SimConfig(policy="none", deployment=DeploymentConfig(replicas=3,
                                                               router="least-outstanding"),
                    workload=WorkloadConfig(arrival="closed", max_concurrency=6,
                                            num_requests=6, lengths="fixed:8:4"))
    r = simulate(cfg, profile=_flat()).requests.sort("request_id")
    assert r["replica"].to_list() == [0, 1, 2, 0, 1, 2]


# -- admission ---------------------------------------------------------------------------------

def _admitting(capacity: int, *, max_num_seqs: int = 8, kv_mode: str = "preempt"):
    """A replica holding request 0 (decoding: 10 prompt + 3 generated in KV) and request 1
    (prefilling, 5 of 20 done), committed 18 + 15 + 2 verify slots = 35; waiting: request 2
    (arrived prefilled by a prefill instance: 8 + its first token), request 3 (preempted
    after 4 tokens: recomputes 6 + 4 = 10), request 4 (a new 30-token prompt)."""
    cfg = SimConfig(policy="none", deployment=DeploymentConfig(replicas=1),
                    engine=EngineConfig(kv_capacity_tokens=capacity, max_num_seqs=max_num_seqs,
                                        kv_mode=kv_mode, prefill="chunked"))
    ctx = SimContext(cfg, _flat(), get_policy("none"), None, CalibrationMap(),
                     RequestLog.empty(5), lambda k: None)
    rows = np.stack([_row(0, 10, 10, 10, 3, 0), _row(1, 20, 20, 5, 0, 0),
                     _row(2, 8, 8, 8, 1, 0), _row(3, 6, 10, 0, 4, 4), _row(4, 30, 30, 0, 0, 0)])
    rows[:, OUTPUT_TOKENS] = [20, 10, 5, 10, 10]
    ctx.set_rows(rows)
    rep = ctx.replicas[0]
    rep.batch = rows[:2].copy()
    rep.kv_tokens, rep.pending_prefill, rep.n_prefilling = 18, 15, 1
    rep.waiting = deque([2, 3, 4])
    rep.outstanding = 5
    rep.check_invariants()
    return ctx, rep


def test_admission_takes_what_fits_in_order_and_keeps_decoders_first():
    """Capacity 35 + 9 + 11 = 55: requests 2 (needs 8 + 1 + 1 slot) and 3 (10 + 1) fit
    exactly, 4 (31) is held back, once. Request 2 decodes at once, so it joins the
    decoding rows ahead of request 1's prefill; request 3 prefills after it."""
    ctx, rep = _admitting(55)
    rep._admit()
    assert rep.batch[:, REQUEST_ID].tolist() == [0, 2, 1, 3] and list(rep.waiting) == [4]
    assert (rep.kv_tokens, rep.pending_prefill, rep.n_prefilling) == (18 + 9, 15 + 10, 2)
    rep.check_invariants()
    assert ctx.stats.kv_blocked_steps == 1
    ctx, rep = _admitting(54)  # one token short for request 3: it blocks request 4 too
    rep._admit()
    assert rep.batch[:, REQUEST_ID].tolist() == [0, 2, 1] and list(rep.waiting) == [3, 4]
    ctx, rep = _admitting(1000, max_num_seqs=3)  # room for one more: no KV hold-up counted
    rep._admit()
    assert rep.batch[:, REQUEST_ID].tolist() == [0, 2, 1] and ctx.stats.kv_blocked_steps == 0
    ctx, rep = _admitting(1000)  # everything fits
    rep._admit()
    assert rep.batch[:, REQUEST_ID].tolist() == [0, 2, 1, 3, 4]
    assert (rep.kv_tokens, rep.pending_prefill, rep.n_prefilling) == (27, 55, 3)
    rep.check_invariants()


def test_reserve_admission_counts_prompt_plus_output():
    """Reserve mode holds prompt + output for each running request: 30 + 30 = 60 in use;
    request 2 needs 8 + 5, request 3 6 + 10 (its prompt, not its recompute), request 4
    30 + 10. Capacity 89 takes 2 and 3 and holds 4 back."""
    ctx, rep = _admitting(89, kv_mode="reserve")
    rep._admit()
    assert rep.batch[:, REQUEST_ID].tolist() == [0, 2, 1, 3] and list(rep.waiting) == [4]
    assert ctx.stats.kv_blocked_steps == 1
    ctx, rep = _admitting(88, kv_mode="reserve")
    rep._admit()
    assert rep.batch[:, REQUEST_ID].tolist() == [0, 2, 1] and list(rep.waiting) == [3, 4]


def test_an_empty_replica_admits_its_head_request_whatever_it_needs():
    ctx, rep = _admitting(10)
    rep.batch = rep.batch[:0]
    rep.kv_tokens = rep.pending_prefill = rep.n_prefilling = 0
    rep._admit()  # request 2 needs 10: fits; request 3 would need 21
    assert rep.batch[:, REQUEST_ID].tolist() == [2]
    rep.waiting.popleft()
    rep.batch = rep.batch[:0]
    rep.kv_tokens = 0
    rep._admit()  # request 4 alone needs 31 > 10: admitted anyway (it runs, or nothing does)
    assert rep.batch[:, REQUEST_ID].tolist() == [4]


# -- prefill -----------------------------------------------------------------------------------

def test_chunked_prefill_pays_the_logit_row_only_on_its_last_chunk():
    """A 10-token prompt in a 4-token budget: chunks 4, 4, 2 at 10 ms each, the last also
    computes the first token's logit row (1 ms): TTFT 31 ms."""
    cfg = _one_replica(engine_cfg=EngineConfig(max_num_batched_tokens=4, max_num_seqs=1,
                                               prefill="chunked"), lengths="fixed:10:1")
    r = simulate(cfg, profile=_flat(logits_s_per_row=0.001)).requests
    assert r["ttft_ms"].to_list() == pytest.approx([31.0])


def test_a_run_cut_short_keeps_each_requests_progress():
    """The step bound stops a run mid-flight: request 0 (alone, fixed:3, nothing accepted)
    has had its prefill step and 4 decode steps of 3 verified drafts, 5 tokens out."""
    trace = synth_iid(0.0, 7, num_requests=2, positions=64)
    cfg = replace(_one_replica("fixed:3", lengths="fixed:10:100"), max_engine_steps=5)
    res = simulate(cfg, profile=_flat(), trace=trace)
    r = res.requests
    assert (r["steps"][0], r["draft_tokens_verified"][0], r["generated_tokens"][0]) == (4, 12, 5)
    assert res.summary["unfinished"] == 1


# -- policies that read schema-v2 fields -------------------------------------------------------

def test_a_policy_needing_a_v2_field_the_trace_lacks_fails_up_front():
    from dspark_sim.errors import InputError
    from dspark_sim.sim.api import check_policy_fields
    from dspark_sim.traces.schema_v2 import V2Fields

    pol = get_policy("sparsespec")
    assert pol.reads.fields == ("draft_entropy",)
    trace = synth_iid(0.5, 7, num_requests=2, positions=8)
    other = replace(trace, v2=V2Fields(true_prob=np.ones((16, 7), np.float32)))
    for t in (trace, other):
        with pytest.raises(InputError, match="draft_entropy"):
            check_policy_fields(pol, t)
    check_policy_fields(pol, None)  # nothing drafted: nothing read
    has = replace(trace, v2=V2Fields(draft_entropy=np.ones((16, 7), np.float16)))
    check_policy_fields(pol, has)


# -- the scheduler's draft prices --------------------------------------------------------------

def test_a_separate_scheduler_profile_prices_the_draft_its_own_way():
    """``policy_profile``: the scheduler's draft price is its table at the run's draft
    length plus its own KV price (none unless KV tokens are given); the steps still cost
    the run's profile. A scheduler profile without the run's draft table is refused."""
    from dspark_sim.errors import InputError

    trace = synth_iid(0.5, 7, num_requests=2, positions=8)
    cfg = SimConfig(policy="confidence", deployment=DeploymentConfig(replicas=1))
    cost = _flat(draft_s=0.004, drafts={"dspark": DraftCost(
        np.array([1.0, 2.0]), np.array([0.004, 0.004]), 7, kv_s_per_token=1e-4)})
    sched = _flat(0.020, drafts={"dspark": DraftCost(np.array([1.0, 3.0]),
                                                     np.array([0.001, 0.003]), 7,
                                                     kv_s_per_token=1e-5)})

    def ctx_for(policy_profile):
        return SimContext(cfg, cost, get_policy("confidence"), trace, CalibrationMap(),
                          RequestLog.empty(0), lambda k: None, policy_profile=policy_profile)

    ctx = ctx_for(sched)
    assert ctx.sched_cost.draft_time(2, 100) == pytest.approx(0.002 + 1e-5 * 100, rel=1e-12)
    assert ctx.sched_cost.draft_time(2) == pytest.approx(0.002, rel=1e-12)
    assert ctx.sched_cost.draft_time(3, 10) == pytest.approx(0.003 + 1e-4, rel=1e-12)
    assert ctx.cost.draft_time(2, 100) == pytest.approx(0.004 + 1e-4 * 100, rel=1e-12)
    assert ctx.cost.draft_time(2) == pytest.approx(0.004, rel=1e-12)
    assert ctx.sched_cost.dense_step_s[[1, 5000]].tolist() == [0.020, 0.020]
    assert ctx.cost.dense_step_s[[1, 5000]].tolist() == [0.010, 0.010]
    with pytest.raises(InputError, match=r"\[draft.dspark\]"):
        ctx_for(replace(sched, drafts={}))


def test_a_stopping_drafters_pass_and_fixed_prices_by_hand():
    """A drafter that stops at each request's verify length (sparsespec over a sparse KV):
    one more pass over 3 requests is the table's one-token time at 3 plus each request's
    sparse reads, min(context, 1000 budget) at 0.05 us; what a drafting step pays once is
    the selection over the whole context (0.003 us per token) and the KV reads (0.002 us)."""
    d = DraftCost(np.array([1.0, 64.0]), np.array([0.008, 0.012]), 1, gamma_slope=1.0,
                  kv_s_per_token=2e-9, kv_budget_tokens=1000, sparse_kv_s_per_token=5e-8,
                  select_s_per_context_token=3e-9)
    prof = _flat(drafts={"selfspec": d})
    trace = synth_iid(0.5, 7, num_requests=2, positions=8)
    cfg = SimConfig(policy="sparsespec:conf", deployment=DeploymentConfig(replicas=1))
    ctx = SimContext(cfg, prof, get_policy("sparsespec:conf"), trace, CalibrationMap(),
                     RequestLog.empty(0), lambda k: None)
    context = np.array([500, 3000, 20000])
    table3 = 0.008 + 0.004 * 2 / 63
    assert ctx.sched_cost.draft_pass_s(3, context) == pytest.approx(
        table3 + 5e-8 * (500 + 1000 + 1000), rel=1e-12)
    assert ctx.sched_cost.draft_fixed_s(context, 1234) == pytest.approx(
        3e-9 * 23500 + 2e-9 * 1234, rel=1e-12)
    # the engine's own pass price is the same table lookup, cached per n
    assert ctx.cost.draft_pass_table_s(3) == ctx.cost.draft_pass_table_s(3) == \
        pytest.approx(table3, rel=1e-12)


def _a_decoding_pair(policy: Policy, prof: EngineProfile, policy_profile=None):
    """A replica holding two decoding rows (contexts 10 and 20, the second admitted after
    5 tokens out) and one prefilling row 30 of 50 tokens in: 60 KV tokens, 20 pending.
    The trace is a self-speculation drafter's (its own ``[draft.selfspec]`` table)."""
    trace = synth_iid(0.5, 7, num_requests=2, positions=8)
    trace = replace(trace, meta=replace(trace.meta, drafter="selfspec"))
    cfg = SimConfig(policy=policy.name, deployment=DeploymentConfig(replicas=1))
    ctx = SimContext(cfg, prof, policy, trace, CalibrationMap(), RequestLog.empty(3),
                     lambda k: None, policy_profile=policy_profile)
    ctx.rows = np.zeros((3, NUM_COLUMNS), np.int64)
    rep = ctx.replicas[0]
    rep.batch = np.stack([_row(0, 8, 8, 8, 3, 1), _row(1, 15, 15, 15, 10, 5),
                          _row(2, 50, 50, 30, 0, 0)])
    rep.kv_tokens, rep.pending_prefill, rep.n_prefilling = 60, 20, 1
    rep.outstanding = 3
    rep.check_invariants()
    return ctx, rep


# a context-priced drafter: 4 ms at 2 requests x 7 drafts, 1 ns per KV token of the batch,
# 10 ns per drafted token x min(context, 15), 0.1 ns per context token of a drafting request
_SPARSE = DraftCost(np.array([1.0, 2.0]), np.array([0.002, 0.004]), 7, kv_s_per_token=1e-9,
                    kv_budget_tokens=15, sparse_kv_s_per_token=1e-8,
                    select_s_per_context_token=1e-10)


@pytest.mark.parametrize("where", ["one", "scheduler", "cost", "neither"])
def test_the_scheduler_prices_a_context_priced_draft_per_request(where):
    """The confidence scheduler's step cost on :func:`_a_decoding_pair`: a flat 10 ms
    target with no other extra terms, so every entry of ``extra_s`` (0..2 x 7 drafts
    admitted) is the draft the scheduler's profile prices. Both decoding rows draft the
    whole 7-token block: 4 ms + 1 ns x 60 KV tokens + 10 ns x 7 x (min(10, 15) + min(20,
    15)) + 0.1 ns x (10 + 20); the prefilling row drafts nothing. The context terms come
    from the scheduler's profile: the one profile of the run ("one"), or a separate
    ``policy_profile`` whatever the cost profile says."""
    plain = replace(_SPARSE, kv_budget_tokens=None, sparse_kv_s_per_token=0.0,
                    select_s_per_context_token=0.0)
    cost_table, sched_table = {"one": (_SPARSE, None), "scheduler": (plain, _SPARSE),
                               "cost": (_SPARSE, plain), "neither": (plain, plain)}[where]
    pol, seen = _recorded("confidence")
    ctx, rep = _a_decoding_pair(pol, _flat(drafts={"selfspec": cost_table}),
                                None if sched_table is None
                                else _flat(drafts={"selfspec": sched_table}))
    rep._decide(np.array([0, 1]), 2, rep.batch)
    table = 0.004 + 1e-9 * 60
    priced = where in ("one", "scheduler")
    context = 1e-8 * 7 * (10 + 15) + 1e-10 * (10 + 20) if priced else 0.0
    (snap,) = seen
    np.testing.assert_allclose(snap.cost.extra_s, np.full(15, table + context), rtol=1e-12)
    assert snap.cost.pending_prefill == 20


@pytest.mark.parametrize("n_replicas", [2, 3])
def test_least_outstanding_picks_the_emptiest_whatever_the_order(n_replicas):
    """With loads (3, 1[, 2]) every pick is the replica holding 1, where round-robin would
    start at replica 0 (two replicas is the smallest case that tells them apart)."""
    from types import SimpleNamespace

    reps = [SimpleNamespace(outstanding=n) for n in (3, 1, 2)[:n_replicas]]
    lo = engine.Router(reps, "least-outstanding")
    assert [lo.route() for _ in range(3)] == [reps[1]] * 3
    rr = engine.Router(reps, "round-robin")
    assert [rr.route() for _ in range(3)] == [reps[i % n_replicas] for i in range(3)]
    one = engine.Router(reps[:1], "least-outstanding")
    assert [one.route() for _ in range(2)] == [reps[0]] * 2
    # a tie goes to the first of the least loaded, and a load read at each call
    tied = [SimpleNamespace(outstanding=n) for n in (2, 1, 1)]
    lo = engine.Router(tied, "least-outstanding")
    assert lo.route() is tied[1]
    tied[1].outstanding = 2
    assert lo.route() is tied[2]


# -- from the full sim/engine.py mutation run (tools/mutation.py) ------------------------

@pytest.mark.parametrize("bad", [lambda n: np.r_[-1, np.full(n - 1, 3)],
                                 lambda n: np.r_[2.5, np.full(n - 1, 3.0)]])
def test_one_bad_length_among_good_ones_names_the_policy(bad):
    """Every length is checked, not only the first or all together: one negative or one
    fraction among valid lengths (only when two or more requests decode, so the first
    one-request steps pass) is refused."""
    trace = synth_iid(0.6, 7, num_requests=4, positions=64, seed=1)
    cfg = _one_replica("fixed:3", n=3, concurrency=3, lengths="fixed:10:30")
    pol = replace(get_policy("fixed:3"), reads=Reads(survival=True),
                  decide=lambda s: bad(s.num_requests) if s.num_requests > 1
                  else np.full(s.num_requests, 3))
    with pytest.raises(RuntimeError, match="policy fixed:3: verify lengths must be"):
        _run_with(pol, cfg, profile=_flat(), trace=trace)


def test_lengths_past_the_drafted_block_are_cut_to_it():
    """A policy asking for 12 of a 7-token block verifies the 7 drafted: the run equals
    fixed:7 token for token (the verified count included)."""
    trace = synth_iid(0.6, 7, num_requests=4, positions=64, seed=1)
    cfg = _one_replica("fixed:7", n=3, concurrency=3, lengths="fixed:10:30")
    want = simulate(cfg, profile=_flat(), trace=trace).summary
    pol = replace(get_policy("fixed:7"), reads=Reads(survival=True),
                  decide=lambda s: np.full(s.num_requests, 12))
    got = _run_with(pol, cfg, profile=_flat(), trace=trace).summary
    for key in ("num_draft_tokens_verified", "num_accepted_tokens", "engine_steps"):
        assert got[key] == want[key], key


def test_the_policy_reads_its_snapshot_read_only():
    """Survivals, the SPS curve and the step cost's extra terms are handed to a policy
    read-only: a policy cannot change what the engine or the next step reads."""
    trace = synth_iid(0.5, 7, num_requests=4, positions=64, seed=2)
    cfg = _one_replica("confidence", n=2, concurrency=2, lengths="fixed:6:20")
    # confidence reads the step cost, confidence-async the (lagged) SPS curve
    for name, arrays in (("confidence", lambda s: (s.survival, s.cost.extra_s)),
                         ("confidence-async", lambda s: (s.survival, s.sps))):
        pol, seen = _recorded(name)
        _run_with(pol, cfg, profile=_flat(), trace=trace)
        assert seen
        for snap in seen:
            for arr in arrays(snap):
                assert not arr.flags.writeable
                with pytest.raises(ValueError, match="read-only"):
                    arr[...] = 0


def test_gamma_max_shortens_the_block_drafters_block_only():
    """--gamma-max 3 on a gamma-7 trace: the DSpark block drafter drafts (and a policy
    verifies) at most 3 per step; MTP-1 keeps the trace's block and never reads it (given
    to mtp1 it is refused); a fixed:7 that the shortened block cannot feed, a fixed:9
    the trace cannot, or a gamma_max past the trace, is refused."""
    from dspark_sim.errors import InputError

    trace = synth_iid(0.9, 7, num_requests=4, positions=64, seed=3)
    base = _one_replica("confidence", n=3, concurrency=3, lengths="fixed:10:30")
    short = replace(base, gamma_max=3)
    s = simulate(short, profile=_flat(), trace=trace).summary
    assert s["gamma_max"] == 3
    assert 0 < s["num_draft_tokens_verified"] <= 3 * s["num_drafts"]
    full = simulate(base, profile=_flat(), trace=trace).summary
    assert full["gamma_max"] == 7 and full["num_draft_tokens_verified"] > 3 * full["num_drafts"]
    both = _flat(drafts={"dspark": DraftCost(np.array([1.0, 2.0]), np.zeros(2), 7),
                         "mtp1": DraftCost(np.array([1.0, 2.0]), np.zeros(2), 1)})
    assert simulate(replace(base, policy="mtp1"), profile=both,
                    trace=trace).summary["gamma_max"] == 7
    with pytest.raises(InputError, match="--gamma-max: 3 .* mtp1 .* never reads it"):
        simulate(replace(base, policy="mtp1", gamma_max=3), profile=both, trace=trace)
    with pytest.raises(InputError, match="--policy"):
        simulate(replace(base, policy="fixed:7", gamma_max=3), profile=_flat(), trace=trace)
    with pytest.raises(InputError, match="--gamma-max"):
        simulate(replace(base, gamma_max=9), profile=_flat(), trace=trace)
    # without --gamma-max the trace's 7 is the limit, in simulate() as in the CLI: else
    # fixed:9 would run as fixed:7 under the name fixed:9, asd@fixed:9 alike
    for spec in ("fixed:9", "asd@fixed:9", "skip@fixed:8"):
        with pytest.raises(InputError, match=r"^--policy: .* gamma_max = 7"):
            simulate(replace(base, policy=spec), profile=_flat(), trace=trace)


def test_limits_allow_as_many_sequences_as_batched_tokens_and_are_frozen():
    import dataclasses

    lim = engine.resolve_limits(EngineConfig(max_num_seqs=16, max_num_batched_tokens=16), _flat())
    assert (lim.max_num_seqs, lim.max_num_batched_tokens) == (16, 16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        lim.max_num_seqs = 8
    from dspark_sim.errors import InputError

    with pytest.raises(InputError, match="--max-num-seqs"):
        engine.resolve_limits(EngineConfig(max_num_seqs=17, max_num_batched_tokens=16), _flat())
    # only the token budget given: it is the one named (the 256 sequences are the default)
    flat = replace(_flat(), limits=EngineLimits())
    with pytest.raises(InputError, match=r"^--max-num-batched-tokens: 16 is below "
                                         r"max_num_seqs \(256, the simulator's default\)"):
        engine.resolve_limits(EngineConfig(max_num_batched_tokens=16), flat)


def test_a_budget_under_two_tokens_per_request_trims_every_chain_to_nothing():
    """Three one-token prompts, a 4-token budget, fixed:7: one 3-token prefill step, then
    10 decode steps of 3 requests, where 3 + 3 x 7 > 4 and the uniform trim is
    (4 - 3) // 3 = 0 drafts each: no draft is verified, every decode step is counted
    budget-limited, and no step goes past the budget."""
    trace = synth_iid(0.9, 7, num_requests=4, positions=64, seed=4)
    cfg = _one_replica("fixed:7", engine_cfg=EngineConfig(
        max_num_batched_tokens=4, max_num_seqs=3, prefill="chunked"), n=3, concurrency=3,
        lengths="fixed:1:11")
    s = simulate(cfg, profile=_flat(), trace=trace).summary
    assert s["engine_steps"] == 11 and s["budget_limited_steps"] == 10
    assert s["num_draft_tokens_verified"] == 0 and s["num_accepted_tokens"] == 0
    assert s["total_output_tokens"] == 33


@pytest.mark.parametrize("policy,budget,prompt", [("fixed:3", 4, 10), ("fixed:2", 7, 9),
                                                  ("confidence", 6, 12)])
def test_no_step_runs_past_the_token_budget(policy, budget, prompt):
    """A decoder whose verify tokens fill the budget exactly leaves nothing for a prompt
    still prefilling (a chunk then waits for a step with room), and no step's batch tokens
    exceed the budget, whatever the policy asks."""
    trace = synth_iid(0.9, 7, num_requests=4, positions=64, seed=5)
    cfg = _one_replica(policy, engine_cfg=EngineConfig(
        max_num_batched_tokens=budget, max_num_seqs=2, prefill="chunked"), n=4,
        concurrency=2, lengths=f"fixed:{prompt}:12")
    cols = _step_series(lambda: simulate(cfg, profile=_flat(), trace=trace))
    assert cols["batch_tokens"].max() <= budget
    full = cols["batch_tokens"] == budget
    assert full.any()


def test_a_chain_that_fills_the_budget_exactly_is_not_trimmed():
    """One request, a 4-token budget, fixed:3: 1 + 3 = 4 tokens fit exactly, so no
    decode step is trimmed or counted budget-limited and every step verifies 3 drafts."""
    trace = synth_iid(0.0, 7, num_requests=2, positions=64)
    cfg = _one_replica("fixed:3", engine_cfg=EngineConfig(
        max_num_batched_tokens=4, max_num_seqs=1, prefill="chunked"), lengths="fixed:4:11")
    s = simulate(cfg, profile=_flat(), trace=trace).summary
    assert s["engine_steps"] == 11 and s["budget_limited_steps"] == 0
    assert s["num_draft_tokens_verified"] == 30


def test_requests_answered_by_the_prefill_instance_never_reach_a_replica():
    """Disaggregated prefill: a one-token answer is the prefill instance's first token, so
    the request finishes there and its replica stays unassigned (-1); longer answers are
    routed to the one decode replica (0)."""
    for out_tokens, replica in ((1, -1), (5, 0)):
        cfg = _one_replica("none", engine_cfg=EngineConfig(prefill="disaggregated"), n=3,
                           concurrency=3, lengths=f"fixed:8:{out_tokens}")
        res = simulate(cfg, profile=_flat())
        assert res.summary["completed"] == 3
        assert res.requests["replica"].to_list() == [replica] * 3
    # a one-token answer frees its client there: two clients send six requests in pairs,
    # each pair when the previous pair's prefill (P each, equal prompts) ends
    cfg = _one_replica("none", engine_cfg=EngineConfig(prefill="disaggregated"), n=6,
                       concurrency=2, lengths="fixed:8:1")
    req = simulate(cfg, profile=_flat()).requests
    p = req["first_token_s"][0] - req["arrival_s"][0]
    assert p > 0
    assert req["arrival_s"].to_list() == pytest.approx([0, 0, p, p, 2 * p, 2 * p])
    assert req["finish_s"].to_list() == pytest.approx([p, p, 2 * p, 2 * p, 3 * p, 3 * p])


def test_requests_arriving_together_share_their_first_step(tmp_path):
    """Requests with one timestamp are all submitted before the engine looks at its
    queue: its first step prefills all four (4 x 8 prompt tokens fit the budget), so
    they share a first token, one 10 ms step after they arrive."""
    from dspark_sim.sim.config import resolve_config

    w = tmp_path / "w.csv"
    w.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "2023-11-16 18:15:00.0,8,3\n" * 4)
    cfg = resolve_config(options={"workload": w, "replicas": 1, "policy": "none",
                                  "prefill": "chunked"})
    req = simulate(cfg, profile=_flat()).requests
    assert req["arrival_s"].to_list() == [0.0] * 4
    assert req["first_token_s"].to_list() == pytest.approx([0.010] * 4)


def test_the_async_curve_prices_the_prefill_still_waiting_in_the_step():
    """While a prompt is still prefilling, confidence-async's SPS curve prices the verify
    tokens plus the pending prefill that fills the rest of the budget (vLLM's T + B):
    SPS[i] = 1 / (t(min(n + i + pending, budget)) + 4 ms) on the linear table
    t(B) = 10 ms + 1 ms x (B - 1), 0 where n + i passes the budget."""
    import sys

    prof = replace(_flat(draft_s=0.004), interpolation="linear", tokens=np.array([1, 64]),
                   step_s=np.array([0.010, 0.073]))
    trace = synth_iid(0.5, 7, num_requests=4, positions=64, seed=2)
    budget = 16
    cfg = _one_replica("confidence-async", engine_cfg=EngineConfig(
        max_num_batched_tokens=budget, max_num_seqs=2, prefill="chunked"), n=3, concurrency=2,
        lengths="fixed:40:20")
    inner = get_policy("confidence-async")
    seen = []

    def decide(snap):
        frame = sys._getframe(1)  # the deciding replica's pending prefill, read by hand
        while not isinstance(frame.f_locals.get("self"), engine.Replica):
            frame = frame.f_back
        seen.append((snap, frame.f_locals["self"].pending_prefill))
        return inner(snap)

    _run_with(replace(inner, decide=decide), cfg, profile=prof, trace=trace)
    assert any(p > 0 for _, p in seen)
    for snap, p in seen:
        n = snap.num_requests
        i = np.arange(n * 7 + 1)
        tokens = np.minimum(n + i + p, budget)
        want = np.where(n + i <= budget, 1.0 / (0.010 + 0.001 * (tokens - 1) + 0.004), 0.0)
        np.testing.assert_allclose(snap.sps, want, rtol=1e-12)
