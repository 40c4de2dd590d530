"""Drafters that propose nothing at some positions (n-gram, prompt lookup, suffix
decoding): the trace's ``draft_tokens`` caps what a step verifies and what an
autoregressive drafter drafts; served tau counts the one-token steps as a run does."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from dspark_sim.calibration.profile import DraftCost, load_profile
from dspark_sim.errors import InputError
from dspark_sim.policies.registry import get_policy
from dspark_sim.sim.api import resolve_calibration, simulate
from dspark_sim.sim.config import DeploymentConfig, SimConfig, WorkloadConfig
from dspark_sim.sim.engine import SimContext
from dspark_sim.sim.metrics import RequestLog
from dspark_sim.traces.importers import import_vllm_counters
from dspark_sim.traces.synth import synth_iid

# vLLM 0.32 CPU, n-gram k = 3: 108 drafts over 512 - 204 - 8 = 300 request-steps
NGRAM_BENCH = {"completed": 8, "total_output_tokens": 512, "spec_decode_num_drafts": 108,
               "spec_decode_draft_tokens": 320, "spec_decode_accepted_tokens": 204,
               "spec_decode_per_position_acceptance_rates": [0.7407, 0.6204, 0.5278],
               "spec_decode_acceptance_length": 2.889}
LIGHT = SimConfig(policy="fixed:3", deployment=DeploymentConfig(replicas=1),
                  workload=WorkloadConfig(qps=2.0, num_requests=60, lengths="fixed:64:400"))


@pytest.fixture(scope="module")
def ngram_trace(tmp_path_factory):
    src = tmp_path_factory.mktemp("ngram") / "bench.json"
    src.write_text(json.dumps(NGRAM_BENCH))
    return import_vllm_counters(src, requests=64, positions=512, seed=0)


def test_fixed_k_verifies_only_where_the_drafter_drafted(ngram_trace):
    """fixed:3 at draft fraction f verifies ~3f drafts per request-step (1 + 3f tokens
    with the bonus), and serves the trace's served tau."""
    f = ngram_trace.draft_fraction
    s = simulate(LIGHT, trace=ngram_trace).summary
    assert s["num_drafts"] > 3000  # drafting request-steps only
    assert s["mean_draft_tokens_per_request_step"] == pytest.approx(3 * f, rel=0.03)
    assert s["mean_verify_tokens_per_request_step"] == pytest.approx(1 + 3 * f, rel=0.02)
    # vLLM's acceptance length counts only the steps that drafted: what the counters said
    assert s["spec_decode_acceptance_length"] == pytest.approx(
        1 + ngram_trace.served_survival(3).sum(), rel=0.02)
    assert s["spec_decode_acceptance_length"] == pytest.approx(
        NGRAM_BENCH["spec_decode_acceptance_length"], rel=0.03)
    # without the column the same acceptances are replayed at 3 verify tokens every step,
    # and every request-step counts as a draft
    full = simulate(LIGHT, trace=replace(ngram_trace, draft_tokens=None)).summary
    assert full["mean_draft_tokens_per_request_step"] == pytest.approx(3.0)
    assert full["spec_decode_acceptance_length"] == pytest.approx(ngram_trace.served_tau(3),
                                                                  rel=0.02)
    assert s["num_drafts"] == pytest.approx(f * full["num_drafts"], rel=0.05)


def test_the_cap_comes_before_the_budget_trim(ngram_trace):
    """A saturated budget is shared among the requests that have drafts: the trim sees
    the capped demand, so fewer steps are budget-limited than when every row drafts."""
    cfg = replace(LIGHT, workload=WorkloadConfig(max_concurrency=64, num_requests=256,
                                                 lengths="fixed:64:200"))
    cfg = replace(cfg, engine=replace(cfg.engine, max_num_seqs=64, max_num_batched_tokens=160))
    capped = simulate(cfg, trace=ngram_trace).summary
    full = simulate(cfg, trace=replace(ngram_trace, draft_tokens=None)).summary
    assert full["budget_limited_steps"] > 0
    assert capped["budget_limited_steps"] < full["budget_limited_steps"]
    # trimmed uniformly, every row verified 1; capped, the drafting rows verify 3
    assert capped["spec_decode_acceptance_length"] > full["spec_decode_acceptance_length"]


def _ctx(trace, policy="fixed:3", block=False):
    """A run's context on a profile whose drafter is autoregressive (one pass per drafted
    token, context reads) or a block drafter."""
    prof = load_profile()
    ar = DraftCost(np.array([1.0, 64.0]), np.array([1e-3, 3e-3]), gamma_ref=1,
                   gamma_slope=1.0, kv_s_per_token=1e-9, block=block)
    prof = replace(prof, drafts={"dspark": ar})
    cfg = replace(LIGHT, policy=policy)
    return SimContext(cfg, prof, get_policy(policy), trace, resolve_calibration(cfg, trace),
                      RequestLog.empty(0), lambda k: None)


def test_an_autoregressive_drafter_drafts_what_it_proposed():
    t = synth_iid(0.7, 3, num_requests=4, positions=40, seed=0)
    d = np.tile(np.array([3, 0, 2, 0], np.int8), t.num_positions // 4)
    t = replace(t, accept_len=np.minimum(t.accept_len, d), draft_tokens=d)
    ctx = _ctx(t)
    assert ctx.draft_per_request
    d_cost = ctx.profile.drafts["dspark"]
    context = np.array([100, 200, 300, 400])
    kv = 5000
    ell = np.array([3, 0, 2, 0])
    # two requests draft, to the longer proposal (3 passes); the others' KV is not read
    want = d_cost.base_time(2, 3) + 1e-9 * (kv - 200 - 400)
    assert ctx.cost.draft_step_s(context, ell, kv, np.array([3, 0, 2, 0], np.int8)) == \
        pytest.approx(want, rel=1e-12)
    assert ctx.cost.draft_step_s(context, ell * 0, kv, np.zeros(4, np.int8)) == 0.0
    # every request proposing its full draft is the table's figure, to the bit
    assert ctx.cost.draft_step_s(context, ell, kv, np.full(4, 3, np.int8)) == ctx.cost.draft_time(4, kv)
    # a block drafter drafts its whole block whatever it proposed: priced as before
    block = _ctx(t, block=True)
    assert not block.draft_per_request
    # the scheduler sees no survival past the proposed drafts
    conf = _ctx(t, policy="threshold:0.1")
    assert not conf.trace_survival[d == 0].any()
    assert (conf.trace_survival[d == 2, 2] == 0).all() and conf.trace_survival[d == 3].all()


def test_a_trace_that_drafts_everywhere_costs_nothing_on_the_hot_path():
    t = synth_iid(0.7, 3, num_requests=4, positions=40, seed=0)
    ctx = _ctx(replace(t, draft_tokens=np.full(t.num_positions, 3, np.int8)))
    assert ctx.trace_draft_tokens is None and not ctx.draft_per_request


@pytest.mark.parametrize("policy", ["pctree:16,2", "skip:0.9"])
def test_tree_and_lossy_policies_refuse_a_trace_with_draft_tokens(policy):
    """Their plans are not a chain prefix that a count of proposed drafts could cap."""
    from dspark_sim.traces.synth import DomainCurve
    from dspark_sim.traces.synth_v2 import synth_tree

    t = synth_tree((DomainCurve("a", p1=0.85, tau=3.0, k=4),), gamma=4, requests_per_domain=2,
                   positions=32, seed=0)
    d = np.where(np.arange(t.num_positions) % 2, t.gamma_max, 0).astype(np.int8)
    t = replace(t, accept_len=np.minimum(t.accept_len, d), draft_tokens=d,
                source_path="ngram.parquet")
    with pytest.raises(InputError, match=rf"^ngram\.parquet: policy {policy}.*draft_tokens"):
        cfg = replace(LIGHT, policy=policy)
        SimContext(cfg, load_profile(), get_policy(policy), t, resolve_calibration(cfg, t),
                   RequestLog.empty(0), lambda k: None)
