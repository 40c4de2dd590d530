"""A drafter that proposes nothing at some steps (vLLM's n-gram drafter finds no match at
most of them): "no proposal" is a state of its own, apart from a proposed draft the
verifier rejects. Such a request has nothing to verify, costs no draft slot, and says
nothing about the survival of the drafts the others propose; the confidence scheduler
spends its budget on the requests that proposed."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from dspark_sim.calibration.confidence_source import apply_conf_source
from dspark_sim.policies.base import StepCost, readonly
from dspark_sim.policies.registry import engine_support, get_policy
from dspark_sim.policies.scheduler import schedule_topk
from dspark_sim.sim.api import simulate
from dspark_sim.sim.config import DeploymentConfig, SimConfig, WorkloadConfig
from dspark_sim.traces.synth import synth_iid

RECORDED = Path(__file__).parents[1] / "data" / "vllm-cpu" / "run-1"
SOURCES = ("position", "synthetic:0.7", "synthetic:0.85", "synthetic:0.95")


def _ngram_like(alpha=0.8, gamma=3, fraction=0.4, seed=0):
    """An i.i.d. trace whose drafter proposes its block at ``fraction`` of positions."""
    t = synth_iid(alpha, gamma, num_requests=16, positions=400, seed=seed)
    rng = np.random.default_rng(seed + 1)
    d = np.where(rng.random(t.num_positions) < fraction, gamma, 0).astype(np.int8)
    return replace(t, accept_len=np.minimum(t.accept_len, d), draft_tokens=d, conf=None)


def test_a_tie_at_zero_never_spends_the_budget_on_a_draft_not_proposed():
    survival = np.array([[0.0, 0.0], [0.9, 0.0], [0.0, 0.0]])
    # row 0 proposed nothing, row 2 proposed drafts the head is sure will fail
    proposed = np.array([0, 2, 2])
    assert schedule_topk(survival, 3, proposed).tolist() == [0, 2, 1]
    assert schedule_topk(survival, 3).tolist() == [2, 1, 0]  # row-major ties otherwise


def test_the_lagged_view_holds_only_the_rows_that_proposed():
    """Requests without a proposal never enter the budget's estimate: a step where only
    they ran leaves nothing for it, and the next estimate is the proposing rows'."""
    policy = get_policy("confidence")
    history = __import__("collections").deque(maxlen=policy.history)
    table = readonly(0.1 + 1e-3 * np.arange(64))
    cost = StepCost(table, readonly(np.zeros(3 * 3 + 1)), 0, 0.0)
    surv = np.array([[0.9, 0.8, 0.7], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    for _ in range(3):
        snap = policy.snapshot(history, surv.copy(), 3, 64, cost=cost,
                               proposed=np.array([3, 0, 0]))
    assert snap.lagged_survival.shape[1] == 3
    assert (snap.lagged_survival == surv[0]).all()  # one row a step, the proposing one
    assert snap.lagged_proposed.tolist() == [3] * len(snap.lagged_survival)
    # verification is nearly free here: the one request that proposed verifies all three,
    # the ones that did not verify nothing
    assert policy(snap).tolist() == [3, 0, 0]


@pytest.mark.parametrize("policy", ["confidence", "vllm-adaptive", "dcut", "dfly",
                                    "confidence-async", "confidence-sync", "threshold:0"])
def test_every_chain_policy_verifies_only_what_was_proposed(policy):
    """At a light load where verifying costs next to nothing, every confidence policy
    verifies what fixed:gamma verifies: every draft proposed, none where none was."""
    t = _ngram_like()
    cfg = SimConfig(policy=policy, conf_source="synthetic:0.85",
                    deployment=DeploymentConfig(replicas=1),
                    workload=WorkloadConfig(arrival="closed", max_concurrency=2,
                                            num_requests=40, lengths="fixed:64:200"))
    fixed = simulate(replace(cfg, policy="fixed:3", conf_source=None), trace=t).summary
    s = simulate(cfg, trace=t).summary
    assert s["num_drafts"] < 0.6 * s["engine_steps"] * 2  # most request-steps propose none
    assert s["mean_draft_tokens_per_request_step"] <= fixed["mean_draft_tokens_per_request_step"]
    if policy in ("confidence", "dcut", "threshold:0"):  # the others decide on less
        assert s["mean_draft_tokens_per_request_step"] == pytest.approx(
            fixed["mean_draft_tokens_per_request_step"], rel=0.05)


def test_a_confidence_source_gives_no_confidence_to_a_draft_never_proposed():
    t = _ngram_like()
    for src in SOURCES:
        conf = apply_conf_source(t, src, seed=0)[0].conf
        assert not conf[t.draft_tokens == 0].any()
        assert conf[t.draft_tokens == 3].all()
    # scored over the drafts proposed: the stated quality, not diluted by the steps
    # without a proposal
    assert apply_conf_source(t, "synthetic:0.85", seed=0)[1].auc == pytest.approx(0.85,
                                                                                abs=0.03)


def test_the_summary_names_the_confidences_and_what_the_drafter_can_run():
    t = _ngram_like()
    cfg = SimConfig(policy="confidence", conf_source="synthetic:0.85",
                    deployment=DeploymentConfig(replicas=1),
                    workload=WorkloadConfig(arrival="closed", max_concurrency=2,
                                            num_requests=20, lengths="fixed:64:100"))
    s = simulate(cfg, trace=t).summary
    assert s["confidences"].startswith("synthetic:0.85")
    assert s["engine_can_run"] is False and "no confidence head" in s["engine_note"]
    assert "n-gram" in s["engine_note"]
    f = simulate(replace(cfg, policy="fixed:3", conf_source=None), trace=t).summary
    assert f["confidences"] is None and f["engine_can_run"] is True
    # vLLM's adaptive verification needs its dspark method, confidence head or not
    ok, note = engine_support(get_policy("vllm-adaptive"), drafter="eagle3",
                              confidence_head=True, proposes_everywhere=True)
    assert not ok and "dspark" in note
    assert engine_support(get_policy("vllm-adaptive"), drafter="dspark-synthetic",
                          confidence_head=True, proposes_everywhere=True)[0]


def test_the_two_taus_are_named_apart():
    """tau per proposal (vLLM's acceptance length) counts the steps that proposed, tau
    per request-step every step; each holds one definition in both the steady and the
    whole-run figures."""
    t = _ngram_like()
    cfg = SimConfig(policy="fixed:3", deployment=DeploymentConfig(replicas=1),
                    workload=WorkloadConfig(arrival="closed", max_concurrency=4,
                                            num_requests=200, lengths="fixed:64:200"))
    s = simulate(cfg, trace=t).summary
    f = t.draft_fraction
    assert s["spec_decode_acceptance_length"] == pytest.approx(t.acceptance_length(3),
                                                               rel=0.03)
    assert s["tokens_per_request_step"] == pytest.approx(t.served_tau(3), rel=0.03)
    for key in ("spec_decode_acceptance_length", "tokens_per_request_step"):
        assert s[f"steady_{key}"] == pytest.approx(s[key], rel=0.05), key
    assert s["tokens_per_request_step"] - 1 == pytest.approx(
        f * (s["spec_decode_acceptance_length"] - 1), rel=0.05)


# -- on a real recording ------------------------------------------------------------------
@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """The vLLM n-gram run as docs/validation.md calibrates it: the engine profile fitted
    on none at every load plus ngram k = 3 at C = 1 and 16, and the acceptance trace of
    those k = 3 runs' counters and per-request results; the workload every k = 3
    closed-loop run sent."""
    from dspark_sim.validation.vllm_compare import load_engine, parse_split
    from dspark_sim.validation.vllm_fit import fit_profile, read_bench_runs

    runs = read_bench_runs([RECORDED / "runs"])
    engine = load_engine(RECORDED / "manifest.json")
    fitted = parse_split("none,ngram-k3@c1,ngram-k3@c16", runs)
    fit = fit_profile([r for r in runs if r.name in fitted], engine=engine)
    wl = tmp_path_factory.mktemp("ngram") / "k3-requests.jsonl"
    with wl.open("w", encoding="utf-8") as fh:
        for r in runs:
            if r.setting == "ngram-k3" and r.concurrency:
                for p, o in zip(r.prompt_tokens, r.output_tokens, strict=True):
                    fh.write(json.dumps({"timestamp": 0.0, "input_length": int(p),
                                         "output_length": int(o)}) + "\n")
    return fit.profile, fit.trace, engine, wl


@pytest.mark.slow
@pytest.mark.parametrize("concurrency", [1, 4, 8, 16])
def test_confidence_matches_the_best_fixed_k_on_a_recorded_ngram_run(recorded, concurrency):
    """The drafter proposes at under half the request-steps: confidence, whatever source
    states its confidences, serves within 3 % of the best fixed length or better. (Not of
    ``none``, which runs no drafter: the n-gram search is paid every step by any policy
    that verifies drafts, so where it no longer pays, C = 16 here, only switching
    speculation off beats it.)"""
    profile, trace, engine, wl = recorded
    assert trace.draft_tokens is not None and 0.2 < trace.draft_fraction < 0.6

    def run(policy, source=None):
        cfg = SimConfig(engine=engine, deployment=DeploymentConfig(replicas=1),
                        workload=WorkloadConfig(arrival="closed", max_concurrency=concurrency,
                                                workload_path=str(wl), num_requests=None),
                        policy=policy, conf_source=source)
        return simulate(cfg, profile=profile, trace=trace).summary["output_throughput"]

    best = max(run(f"fixed:{k}") for k in range(1, trace.gamma_max + 1))
    for src in SOURCES:
        assert run("confidence", src) >= 0.97 * best, src
