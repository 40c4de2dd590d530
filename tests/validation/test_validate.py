"""The validation harness on a tiny random-weight Llama: the real server is lossless
(its outputs are the target's greedy continuation), its log/metrics are consistent, and
``validate`` produces a comparison table with finite errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dspark_sim.calibration.profile import EngineProfile  # noqa: E402
from dspark_sim.policies.registry import get_policy  # noqa: E402
from dspark_sim.sim.metrics import summarize  # noqa: E402

N_REQ, N_OUT = 8, 16


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                      max_position_embeddings=1024)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def workload():
    from dspark_sim.validation.harness import poisson_workload, prompt_pool

    prompts, domains = prompt_pool(None, N_REQ, 24, seed=1, vocab=256)
    return poisson_workload(prompts, domains, rate=200.0, max_new_tokens=N_OUT, seed=1)


def _engine(max_num_batched_tokens: int):
    from dspark_sim.sim.config import EngineConfig

    return EngineConfig(max_num_seqs=4, max_num_batched_tokens=max_num_batched_tokens,
                        kv_capacity_tokens=4096, kv_mode="reserve")


def _profile():
    return EngineProfile("tiny", "measured", 1, np.array([1, 32, 256]),
                         np.array([1e-3, 2e-3, 8e-3]), kv_s_per_token=1e-7)


@pytest.mark.parametrize("policy", ["mtp1", "fixed:3", "confidence", "none"])
def test_server_is_lossless_and_consistent(tiny, workload, policy):
    from dspark_sim.traces.drafters import Lookup
    from dspark_sim.validation.server import DraftRunner, ServerConfig, SpecServer, greedy_reference

    torch.set_num_threads(1)
    srv = SpecServer(tiny, DraftRunner(Lookup()), ServerConfig(
        _engine(40), clock="cpu"),
        max_len=128, profile=_profile())
    pol = get_policy(policy)
    res = srv.serve(workload.prompts, list(workload.output_tokens), list(workload.arrival_s), pol)
    for i, p in enumerate(workload.prompts):  # speculative decoding is lossless
        assert res.outputs[i] == greedy_reference(tiny, p, N_OUT), f"request {i}"
    log, st = res.log, res.stats
    assert np.all(log.generated == N_OUT)
    assert np.all(log.arrival_s <= log.first_token_s)
    assert np.all(log.first_token_s <= log.finish_s)
    assert np.all(np.isfinite(log.finish_s))
    # every verification step emits accepted + 1 tokens (the last one may be truncated)
    assert np.all(log.accepted_tokens + log.steps >= log.generated - 1)
    assert np.all(log.accepted_tokens <= log.draft_tokens_verified)
    assert st.request_steps == int(log.steps.sum())
    assert int((st.ell_hist * np.arange(st.ell_hist.size)).sum()) == int(log.draft_tokens_verified.sum())
    assert st.verify_tokens == st.request_steps + int(log.draft_tokens_verified.sum())
    s = summarize(log, st, gpus=1, slo_ttft_ms=None, slo_tpot_ms=None, stable=True,
                  queue_growth_per_s=0.0)
    assert s["completed"] == N_REQ and s["total_output_tokens"] == N_REQ * N_OUT
    assert s["output_throughput"] > 0 and s["median_tpot_ms"] > 0
    if pol.drafter is None:  # no speculation: one token per step, nothing drafted
        assert int(log.draft_tokens_verified.sum()) == 0
        assert np.all(log.steps == N_OUT - 1)
    else:
        assert s["spec_decode_acceptance_length"] >= 1.0
        if policy == "mtp1":
            assert s["mean_verify_tokens_per_request_step"] == pytest.approx(2.0)
        if policy == "fixed:3":
            assert s["mean_verify_tokens_per_request_step"] <= 4.0


def test_lookup_online_matches_offline():
    from dspark_sim.traces.drafters import Lookup
    from dspark_sim.validation.server import OnlineLookup

    rng = np.random.default_rng(3)
    seq = (rng.integers(0, 12, size=40).tolist() * 2)[:70]
    toks, conf = Lookup(max_ngram=3).draft_sequence(seq, 20, 5)
    online = OnlineLookup(3)
    for i, a in enumerate(range(20, len(seq))):
        t, c = online.draft(seq[: a + 1], 5)
        assert t.tolist() == toks[i].tolist()
        assert np.allclose(c, conf[i])


def test_validate_table(tiny, tmp_path):
    import polars as pl

    from dspark_sim.validation.harness import METRICS, ValidationSetup, validate

    setup = ValidationSetup(policies=("mtp1", "confidence"), rates=(100.0,), num_requests=6,
                            max_new_tokens=12, out_dir=tmp_path, target=(tiny, None),
                            drafter="lookup", profiles=(_profile(), "insitu", "insitu-self"),
                            max_num_seqs=4, max_num_batched_tokens=64, max_prompt_tokens=24,
                            sim_seeds=2)
    result = validate(setup, log=None)
    df = result.frame
    assert isinstance(df, pl.DataFrame)
    assert df.height == 2 * 3 * len(METRICS)
    assert set(df["profile"]) == {"tiny", "insitu-loo", "insitu-self"}
    for col in ("real", "sim", "rel_error", "paired", "paired_rel_error"):
        assert all(v is not None and math.isfinite(v) for v in df[col].to_list()), col
    tau = df.filter((pl.col("metric") == "spec_decode_acceptance_length")
                    & (pl.col("policy") == "mtp1") & (pl.col("profile") == "tiny"))
    # with a fixed verify length, replaying each request's own trace row reproduces its
    # acceptance exactly (confidence's lengths depend on the batch, which timing shifts)
    assert tau["paired_rel_error"].abs().max() < 1e-9
    assert (tmp_path / "mtp1-r100" / "real" / "summary.json").is_file()
    assert (tmp_path / "mtp1-r100" / "real" / "requests.parquet").is_file()
    assert (tmp_path / "confidence-r100" / "sim" / "summary.json").is_file()
    assert (tmp_path / "comparison.parquet").is_file()
    assert "mtp1" in result.table()
    # the headline: the first profile's worst |error| on throughput and median TPOT
    head = df.filter((pl.col("profile") == "tiny")
                     & pl.col("metric").is_in(["output_throughput", "median_tpot_ms"]))
    assert result.worst_error() == pytest.approx(max(abs(v) for v in head["rel_error"]))
    assert result.passed(tolerance=result.worst_error()) and not result.passed(tolerance=-1.0)


def test_step_model_check_charges_logit_rows():
    """Records carry the prefills finishing in a step; the check adds the profile's LM-head
    term for verify rows + finishing prefills, and the server's SPS curve charges verify rows
    exactly as the simulator's engine does."""
    from dataclasses import replace

    from dspark_sim.validation.server_profile import step_model_check

    base = _profile()
    prof = replace(base, logits_s_per_row=1e-4)
    # (step s, forward s, decoding, verify tokens, prefill tokens, kv tokens, finishing)
    recs = [(5e-3, 4e-3, 2, 8, 0, 100, 0), (9e-3, 8e-3, 1, 4, 60, 50, 1)]
    a = step_model_check(recs, base, None, 3)
    b = step_model_check(recs, prof, None, 3)
    assert b["decode_predicted_ms"] == pytest.approx(a["decode_predicted_ms"] + 8 * 0.1)
    assert b["prefill_predicted_ms"] == pytest.approx(a["prefill_predicted_ms"] + 5 * 0.1)
    # old 6-column records still work (no finishing column: verify rows only)
    c = step_model_check([r[:6] for r in recs], prof, None, 3)
    assert c["prefill_predicted_ms"] == pytest.approx(a["prefill_predicted_ms"] + 4 * 0.1)


def test_step_model_check_charges_attention():
    """The 8th record field is the step's query tokens x attended context; the check adds
    the profile's attention term for it (older 7-field records: none)."""
    from dataclasses import replace

    from dspark_sim.validation.server_profile import step_model_check

    base = _profile()
    prof = replace(base, attn_s_per_query_ctx=1e-8)
    recs = [(5e-3, 4e-3, 2, 8, 0, 100, 0, 400.0), (9e-3, 8e-3, 1, 4, 60, 50, 1, 2000.0)]
    a = step_model_check(recs, base, None, 3)
    b = step_model_check(recs, prof, None, 3)
    assert b["decode_predicted_ms"] == pytest.approx(a["decode_predicted_ms"] + 400 * 1e-5)
    assert b["prefill_predicted_ms"] == pytest.approx(a["prefill_predicted_ms"] + 2000 * 1e-5)
    c = step_model_check([r[:7] for r in recs], prof, None, 3)
    assert c["decode_predicted_ms"] == pytest.approx(a["decode_predicted_ms"])
    # 9th / 10th fields: context of multi-token blocks and requests with a context
    prof2 = replace(base, multi_kv_s_per_token=1e-6, request_s=2e-3)
    recs2 = [r + (90.0, 2) for r in recs]
    d = step_model_check(recs2, prof2, None, 3)
    assert d["decode_predicted_ms"] == pytest.approx(a["decode_predicted_ms"] + 0.09 + 4.0)


def test_server_sps_includes_logits(tiny):
    from dataclasses import replace

    from dspark_sim.traces.drafters import Lookup
    from dspark_sim.validation.server import DraftRunner, ServerConfig, SpecServer

    srv = SpecServer(tiny, DraftRunner(Lookup()), ServerConfig(
        _engine(40), clock="cpu"),
        max_len=128, profile=_profile())
    s0 = srv._sps(2, 3, 10, 64)
    srv.profile = replace(_profile(), logits_s_per_row=2e-4)
    s1 = srv._sps(2, 3, 10, 64)
    verify = 2 + np.arange(2 * 3 + 1)
    np.testing.assert_allclose(1.0 / s1, 1.0 / s0 + 2e-4 * verify)
    # attention: each verify token over the batch's mean context (kv tokens / rows)
    srv.profile = replace(_profile(), attn_s_per_query_ctx=1e-7)
    s2 = srv._sps(2, 3, 10, 64, 4)
    np.testing.assert_allclose(1.0 / s2, 1.0 / s0 + 1e-7 * verify * 64 / 4)
    # per-request cost (level) and multi-token KV: ~min(i, n) requests verify drafts
    srv.profile = replace(_profile(), request_s=1e-3, multi_kv_s_per_token=1e-6)
    s3 = srv._sps(2, 3, 10, 64, 4)
    np.testing.assert_allclose(1.0 / s3, 1.0 / s0 + 2e-3 + 1e-6 * 16 * np.minimum(verify - 2, 2))


def test_server_records_finishing_prefills(tiny, workload):
    from dspark_sim.traces.drafters import Lookup
    from dspark_sim.validation.server import DraftRunner, ServerConfig, SpecServer

    torch.set_num_threads(1)
    srv = SpecServer(tiny, DraftRunner(Lookup()), ServerConfig(
        _engine(40), clock="cpu"),
        max_len=128, profile=_profile())
    prompts = workload.prompts[:3]
    res = srv.serve(prompts, [4] * 3, list(workload.arrival_s[:3]), get_policy("mtp1"))
    a = np.asarray(res.step_records)
    assert a.shape[1] == 10
    assert int(a[:, 6].sum()) == len(prompts)  # every prompt finishes its prefill once
    assert np.all(a[a[:, 6] > 0, 4] > 0)  # only in steps carrying prefill tokens
    # query x context: at least every query token over its own context
    assert np.all(a[:, 7] > 0) and np.all(a[:, 7] >= a[:, 3] + a[:, 4] - 1)
    # mtp1 verifies 1 draft per decoding request: every decoding request is a multi-token
    # block over its whole context (the KV tokens of decoding rows), and each has a context
    dec_only = (a[:, 4] == 0) & (a[:, 2] > 0)
    np.testing.assert_allclose(a[dec_only, 8], a[dec_only, 5])
    np.testing.assert_array_equal(a[dec_only, 9], a[dec_only, 2])


def test_server_learned_drafter_lossless(tiny, workload):
    """A (random-weight) DSpark drafter fed the server's own target features."""
    from dspark_sim.traces.drafters import Shared, build_drafter
    from dspark_sim.traces.targets import Target
    from dspark_sim.validation.server import DraftRunner, ServerConfig, SpecServer, greedy_reference

    torch.manual_seed(1)
    tgt = Target(name="tiny", model=tiny, tokenizer=None, device=torch.device("cpu"))
    drafter = build_drafter("dspark", tgt, gamma=4).eval()
    srv = SpecServer(tiny, DraftRunner(drafter, Shared.of(tgt)), ServerConfig(
        _engine(40), clock="cpu"),
        max_len=128, profile=_profile())
    prompts = workload.prompts[:4]
    res = srv.serve(prompts, [N_OUT] * 4, list(workload.arrival_s[:4]), get_policy("confidence"))
    for i, p in enumerate(prompts):
        assert res.outputs[i] == greedy_reference(tiny, p, N_OUT)
    assert res.stats.request_steps > 0


def test_server_profile_dense_chunks_and_drafter_between(tiny):
    """The engine-in-the-loop profile times every prefill chunk size up to 64 (the CPU
    forward is jagged in B), runs the drafter before every timed pass (the cache state of
    a serving step), and times context-0 shapes as prefill chunks with one logit row."""
    from dspark_sim.calibration.measure import Shape
    from dspark_sim.traces.drafters import Lookup
    from dspark_sim.validation.server import (
        DraftRunner,
        ServerConfig,
        SpecServer,
        time_server_shapes,
    )
    from dspark_sim.validation.server_profile import measure_server_profile

    srv = SpecServer(tiny, DraftRunner(Lookup()), ServerConfig(
        _engine(80), clock="cpu"),
        max_len=128, profile=_profile())
    calls: list[int] = []
    shapes = [Shape(2, 1, 8), Shape(1, 5, 0), Shape(3, 0, 16)]
    times = time_server_shapes(srv, shapes, warmup=1, repeats=2, between=calls.append)
    assert [len(t) for t in times] == [2, 2, 2] and all(x > 0 for t in times for x in t)
    assert sorted(calls) == sorted([2, 1, 3] * 3)  # warm-up + 2 timed passes
    drafted: list[int] = []
    orig = srv.drafter.draft
    srv.drafter.draft = lambda reqs, g: (drafted.append(len(reqs)), orig(reqs, g))[1]
    prof = measure_server_profile(srv, requests=(1, 2), verify_lengths=(0, 1), contexts=(8,),
                                  draft_gammas=(1, 3), repeats=1, logit_rows=(1, 4), log=None)
    chunks = prof.parameters["prefill_chunks"]
    assert chunks == list(range(2, 65)) + [80]
    assert set(chunks) <= set(prof.tokens.tolist())
    # 4 verify shapes + 64 chunks, warm-up + 1 pass, each preceded by a draft; then the
    # draft-cost timing itself (2 gammas x 2 batch sizes x 2 passes)
    assert len(drafted) == 2 * (4 + len(chunks)) + 2 * 2 * 2
    assert prof.parameters["between_passes"].startswith("the server's drafter")
    assert measure_server_profile(srv, requests=(1,), verify_lengths=(0,), contexts=(8,),
                                  prefill_chunks=(4, 8), draft_gammas=(1,), repeats=1,
                                  logit_rows=(1, 4), drafter_between=False,
                                  log=None).parameters["between_passes"] == "nothing"


def test_rescale_to_steps_recovers_scale_and_draft_cost():
    """Synthetic serving steps costing 1.15 x the base profile's forward terms plus a
    draft of 20 ms + 5 ms per request (gamma 7) and 4 ms + 1 ms/request (gamma 1):
    the fit recovers the scale and the point's own gamma's draft line."""
    from dspark_sim.calibration.profile import DraftCost
    from dspark_sim.validation.server_profile import rescale_to_steps

    base = EngineProfile("b", "measured", 1, np.array([1, 64, 256]),
                         np.array([0.05, 0.2, 0.5]), kv_s_per_token=1e-5, request_s=2e-3,
                         multi_kv_s_per_token=2e-5,
                         drafts={"dspark": DraftCost(np.array([1.0, 8.0]),
                                                     np.array([0.01, 0.02]), 7)})
    rng = np.random.default_rng(0)

    def steps(g, a0, a1, k=60):
        out = []
        for _ in range(k):
            n = int(rng.integers(1, 9))
            ver = n * (1 + int(rng.integers(0, g + 1)))
            kv = n * int(rng.integers(50, 300))
            fwd = float(base.target_time_s(ver)) + 1e-5 * kv + 2e-3 * n + 2e-5 * kv
            out.append((1.15 * fwd + a0 + a1 * n, 1.15 * fwd, n, ver, 0, kv, 0, 0.0, kv, n))
        return out

    recs = [steps(7, 0.020, 0.005), steps(1, 0.004, 0.001)]
    p = rescale_to_steps(recs, base, "dspark", [7, 1], 7)
    assert p.parameters["forward_scale"] == pytest.approx(1.15, rel=1e-3)
    assert p.request_s == pytest.approx(1.15 * 2e-3, rel=1e-3)
    assert p.draft_time_s("dspark", 4, 7) == pytest.approx(0.020 + 0.005 * 4, rel=1e-3)
    q = rescale_to_steps(recs, base, "dspark", [7, 1], 1)
    assert q.draft_time_s("dspark", 4, 1) == pytest.approx(0.004 + 0.001 * 4, rel=1e-3)


@pytest.mark.parametrize("block", [True, False])
def test_server_profile_marks_a_block_drafter_as_one(block):
    """The in-loop profile's draft cost carries the server drafter's ``block`` flag: the
    server drafts a block drafter's whole block at every verify length, so the simulator
    must price mtp1 / fixed:3 steps at the block, not at 1 / 3 tokens (without the flag
    the dspark-drafter validation ran mtp1 69 % fast). Timing by a fake clock: a pass
    costs 1 ms + 2 ms per request + 0.5 ms per drafted token."""
    from types import SimpleNamespace

    from dspark_sim.validation.server_profile import _draft_cost

    clock = [0.0]

    def draft(reqs, g):
        clock[0] += 1e-3 + 2e-3 * len(reqs) + 0.5e-3 * g

    drafter = SimpleNamespace(block=block, gamma_max=7, draft=draft)
    pool = [SimpleNamespace(lookup=None) for _ in range(4)]
    cost = _draft_cost(drafter, pool, (1, 4), (1, 7), repeats=2, now=lambda: clock[0])
    assert cost.block is block and cost.gamma_ref == 7
    np.testing.assert_allclose(cost.time_s, [1e-3 + 2e-3 + 3.5e-3, 1e-3 + 8e-3 + 3.5e-3])
