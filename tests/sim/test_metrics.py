"""Metrics against values worked out by hand: a hand-filled request log and step
aggregates, and one request through a flat-cost engine whose every step time is known."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dspark_sim.calibration.profile import DraftCost, EngineProfile
from dspark_sim.sim.api import simulate
from dspark_sim.sim.config import DeploymentConfig, EngineConfig, SimConfig, WorkloadConfig
from dspark_sim.sim.engine import ITL_EDGES_S, RequestLog, StepStats
from dspark_sim.sim.metrics import requests_frame, summarize
from dspark_sim.traces.synth import synth_iid

NAN = math.nan


def _log() -> RequestLog:
    """Five requests. 0-2 finish with 11, 5 and 1 tokens; 3 never finishes; 4 finishes.

    TPOT = (E2E - TTFT) / (tokens - 1): request 0 (1.2 - 0.2) / 10 = 100 ms,
    request 1 (2.5 - 0.5) / 4 = 500 ms, request 2 has one token (no TPOT),
    request 4 (4.0 - 1.0) / 3 = 1000 ms.
    """
    log = RequestLog.empty(5)
    log.arrival_s[:] = [0.0, 0.5, 1.0, 1.5, 2.0]
    log.prompt_tokens[:] = [10, 20, 30, 40, 50]
    log.output_tokens[:] = [11, 5, 1, 9, 4]
    log.first_token_s[:] = [0.2, 1.0, 1.1, 1.8, 3.0]
    log.finish_s[:] = [1.2, 3.0, 1.1, NAN, 6.0]
    log.generated[:] = [11, 5, 1, 0, 4]
    log.steps[:] = [4, 2, 0, 0, 3]
    log.draft_tokens_verified[:] = [12, 6, 0, 0, 3]
    log.accepted_tokens[:] = [6, 2, 0, 0, 0]
    log.preemptions[:] = [0, 1, 0, 2, 0]
    log.replica[:] = [0, 1, 0, 1, 0]
    return log


def _stats() -> StepStats:
    """gamma 3; four request-steps accepting 0, 0, 1, 3 of 3, 1, 3, 3 verified drafts."""
    st = StepStats(gamma=3)
    st.steps = 3
    st.busy_s = 0.6
    st.request_steps = 4
    st.verify_tokens = 4 + 10
    st.batch_tokens = 30
    st.accept_hist[:] = [2, 1, 0, 1, 0]
    st.ell_hist[:] = [0, 1, 0, 3, 0]
    st.budget_limited_steps = 1
    st.kv_blocked_steps = 2
    # inter-token gaps: 3 x 10 ms and 1 x 40 ms
    for gap in (0.010, 0.010, 0.010, 0.040):
        st.itl_hist[np.searchsorted(ITL_EDGES_S, gap)] += 1
        st.itl_sum_s += gap
    return st


def _summary(**kw):
    args = dict(gpus=4, slo_ttft_ms=None, slo_tpot_ms=None, stable=True, queue_growth_per_s=0.0)
    args.update(kw)
    return summarize(_log(), _stats(), **args)


def test_request_frame_by_hand():
    r = requests_frame(_log())
    assert r["finished"].to_list() == [True, True, True, False, True]
    assert r["ttft_ms"].to_list() == pytest.approx([200.0, 500.0, 100.0, 300.0, 1000.0])
    assert r["e2e_ms"].to_list()[:3] == pytest.approx([1200.0, 2500.0, 100.0])
    assert r["e2e_ms"][3] is None
    tpot = r["tpot_ms"].to_list()
    assert tpot[0] == pytest.approx(100.0) and tpot[1] == pytest.approx(500.0)
    assert tpot[2] is None and tpot[3] is None and tpot[4] == pytest.approx(1000.0)
    inter = r["interactivity_tok_s"].to_list()
    assert inter[0] == pytest.approx(10.0) and inter[1] == pytest.approx(2.0)
    assert inter[4] == pytest.approx(1.0) and inter[2] is None
    assert r["accepted_tokens"].to_list() == [6, 2, 0, 0, 0]
    assert r["draft_tokens_verified"].to_list() == [12, 6, 0, 0, 3]
    assert r["steps"].to_list() == [4, 2, 0, 0, 3]
    assert r["preemptions"].to_list() == [0, 1, 0, 2, 0]
    assert r["generated_tokens"].to_list() == [11, 5, 1, 0, 4]
    assert r["request_id"].to_list() == [0, 1, 2, 3, 4]


def test_summary_latency_and_throughput_by_hand():
    s = _summary()
    assert s["completed"] == 4 and s["unfinished"] == 1 and s["num_requests"] == 5
    assert s["preempted"] == 2 and s["preemptions"] == 3
    # first arrival 0.0 to last completion 6.0
    assert s["duration"] == pytest.approx(6.0)
    assert s["total_output_tokens"] == 11 + 5 + 1 + 4
    assert s["total_input_tokens"] == 10 + 20 + 30 + 50
    assert s["request_throughput"] == pytest.approx(4 / 6)
    assert s["output_throughput"] == pytest.approx(21 / 6)
    assert s["total_token_throughput"] == pytest.approx((21 + 110) / 6)
    assert s["output_throughput_per_gpu"] == pytest.approx(21 / 6 / 4)
    # TTFT of the finished requests: 200, 500, 100, 1000 ms
    assert s["mean_ttft_ms"] == pytest.approx(450.0)
    assert s["median_ttft_ms"] == pytest.approx(350.0)
    # TPOT: 100, 500, 1000 ms (the one-token request has none)
    assert s["mean_tpot_ms"] == pytest.approx(1600 / 3)
    assert s["median_tpot_ms"] == pytest.approx(500.0)
    assert s["p90_tpot_ms"] == pytest.approx(500 + 0.8 * 500)  # linear between 500 and 1000
    assert s["p99_tpot_ms"] == pytest.approx(500 + 0.98 * 500)
    # E2E: 1200, 2500, 100, 4000 ms
    assert s["mean_e2el_ms"] == pytest.approx(7800 / 4)
    assert s["median_e2el_ms"] == pytest.approx(1850.0)
    # interactivity 10, 2, 1 tok/s/user
    assert s["median_interactivity"] == pytest.approx(2.0)
    assert s["p90_interactivity"] == pytest.approx(2 + 0.8 * 8)
    assert s["p10_interactivity"] == pytest.approx(1 + 0.2 * 1)
    assert s["num_gpus"] == 4


def test_summary_speculation_counters_by_hand():
    s = _summary()
    # 4 request-steps accepting 0 + 0 + 1 + 3 = 4 of 3 + 1 + 3 + 3 = 10 verified drafts
    assert s["num_drafts"] == 4
    assert s["num_accepted_tokens"] == 4
    assert s["num_draft_tokens_verified"] == 10
    assert s["spec_decode_acceptance_length"] == pytest.approx(1 + 4 / 4)
    assert s["spec_decode_acceptance_rate"] == pytest.approx(4 / 10)
    # P(accepted >= k) over the 4 request-steps: 2/4, 1/4, 1/4
    assert s["acceptance_per_position"] == pytest.approx([0.5, 0.25, 0.25])
    # P(verified >= k): 4/4, 3/4, 3/4
    assert s["verified_per_position"] == pytest.approx([1.0, 0.75, 0.75])
    assert s["mean_verify_tokens_per_request_step"] == pytest.approx(14 / 4)
    assert s["mean_draft_tokens_per_request_step"] == pytest.approx(10 / 4)
    assert s["verification_waste"] == pytest.approx(6 / 10)
    assert s["engine_steps"] == 3
    assert s["mean_step_ms"] == pytest.approx(200.0)
    assert s["mean_batch_tokens"] == pytest.approx(10.0)
    assert s["mean_decode_batch"] == pytest.approx(4 / 3)
    assert s["budget_limited_steps"] == 1 and s["kv_blocked_steps"] == 2


def test_itl_mean_exact_and_percentiles_at_bin_centres():
    s = _summary()
    assert s["mean_itl_ms"] == pytest.approx(70 / 4)
    # 1/100-decade bins from 10 us: 10 ms sits on the edge 10^-2 s (bin (10^-2.01, 10^-2],
    # centre 10^-2.005 s); 40 ms in (10^-1.40, 10^-1.39], centre 10^-1.395 s. Three of the
    # four gaps are 10 ms, so the median and p90 (the 3rd and 4th of 4) pick those bins.
    assert s["median_itl_ms"] == pytest.approx(10 ** -2.005 * 1e3, rel=1e-9)
    assert s["p90_itl_ms"] == pytest.approx(10 ** -1.395 * 1e3, rel=1e-9)
    assert s["p99_itl_ms"] == pytest.approx(10 ** -1.395 * 1e3, rel=1e-9)


def test_slo_goodput_by_hand():
    # TTFT <= 600 ms passes requests 0, 1, 2; TPOT <= 600 ms passes 0, 1 and 2 (no TPOT)
    s = _summary(slo_ttft_ms=600.0, slo_tpot_ms=600.0)
    assert s["goodput"] == pytest.approx(3 / 6)
    s = _summary(slo_ttft_ms=None, slo_tpot_ms=200.0)  # 0 and 2 pass
    assert s["goodput"] == pytest.approx(2 / 6)
    s = _summary(slo_ttft_ms=150.0, slo_tpot_ms=None)  # only request 2
    assert s["goodput"] == pytest.approx(1 / 6)
    assert _summary()["goodput"] is None


def test_no_speculation_and_no_requests():
    st = StepStats(gamma=0)
    log = RequestLog.empty(0)
    s = summarize(log, st, gpus=1, slo_ttft_ms=None, slo_tpot_ms=None, stable=True,
                  queue_growth_per_s=0.0)
    assert s["completed"] == 0 and s["num_drafts"] == 0
    assert s["spec_decode_acceptance_length"] is None and s["acceptance_per_position"] == []
    assert s["verification_waste"] == 0.0 and s["mean_itl_ms"] is None
    assert s["changed_token_fraction"] == 0.0
    assert s["median_tpot_ms"] is None and s["median_interactivity"] is None


@pytest.mark.parametrize(("gap_bin", "centre_bin"), [(0, 1), (len(ITL_EDGES_S), len(ITL_EDGES_S) - 1)],
                         ids=["below-first-edge", "above-last-edge"])
def test_itl_percentiles_outside_the_histogram_report_its_end_bins(gap_bin, centre_bin):
    """Gaps at or below the first edge (10 us) land in bin 0, gaps above the last
    (1000 s) in bin len(edges): there is no bin centre beyond the edges, so they are
    reported at the first / last bin's geometric centre (ITL_EDGES_S[j-1] x [j])."""
    st = StepStats(gamma=0)
    st.itl_hist[gap_bin] = 3
    st.itl_sum_s = 3 * (5e-6 if gap_bin == 0 else 2e3)
    s = summarize(RequestLog.empty(0), st, gpus=1, slo_ttft_ms=None, slo_tpot_ms=None,
                  stable=True, queue_growth_per_s=0.0)
    centre_ms = math.sqrt(ITL_EDGES_S[centre_bin - 1] * ITL_EDGES_S[centre_bin]) * 1e3
    for q in ("median", "p90", "p99"):
        assert s[f"{q}_itl_ms"] == pytest.approx(centre_ms, rel=1e-12)

def _log_short_and_rejected() -> RequestLog:
    """0: two tokens, TTFT 500 ms, the second 4 ms later (TPOT 4 ms, 250 tok/s);
    1: eleven tokens, 5 ms apart in all (TPOT 0.5 ms, 2000 tok/s); 2 and 3: refused at
    arrival for KV capacity (never served); 4: unfinished after 3 tokens."""
    log = RequestLog.empty(5)
    log.arrival_s[:] = [0.0, 1.0, 2.0, 3.0, 3.5]
    log.prompt_tokens[:] = [8, 8, 8, 8, 8]
    log.output_tokens[:] = [2, 11, 4, 4, 9]
    log.first_token_s[:] = [0.5, 1.25, NAN, NAN, 4.0]
    log.finish_s[:] = [0.504, 1.255, NAN, NAN, NAN]
    log.generated[:] = [2, 11, 0, 0, 3]
    log.rejected[:] = [0, 0, 2, 2, 0]
    return log


def test_two_token_and_sub_millisecond_tpot_and_rejections():
    log = _log_short_and_rejected()
    r = requests_frame(log)
    tpot = r["tpot_ms"].to_list()
    assert tpot[0] == pytest.approx(4.0) and tpot[1] == pytest.approx(0.5)
    assert tpot[2:] == [None, None, None]
    assert r["interactivity_tok_s"].to_list()[:2] == pytest.approx([250.0, 2000.0])
    assert r["rejected_reason"].to_list() == [None, None, "kv_capacity", "kv_capacity", None]
    s = summarize(log, StepStats(gamma=0), gpus=1, slo_ttft_ms=None, slo_tpot_ms=None)
    assert s["median_tpot_ms"] == pytest.approx((4.0 + 0.5) / 2)
    assert s["median_interactivity"] == pytest.approx((250.0 + 2000.0) / 2)
    # 5 requests: 2 completed, 2 rejected, so 1 unfinished; only the reason seen is listed
    assert (s["completed"], s["rejected"], s["unfinished"]) == (2, 2, 1)
    assert s["rejected_reasons"] == {"kv_capacity": 2}
    assert s["stable"] is False  # something was left unfinished


@pytest.mark.parametrize(("counts", "bins"), [
    # the q-th percentile is the bin holding the ceil(q/100 x n)-th smallest gap
    ({100: 50, 200: 40, 300: 9, 400: 1}, (100, 200, 300)),  # 50th, 90th, 99th of 100
    ({250: 1}, (250, 250, 250)),  # one gap is every percentile
    ({100: 985, 200: 15}, (100, 100, 200)),  # the 990th of 1000 is past the 985th
])
def test_itl_percentiles_pick_the_bin_of_the_rank(counts, bins):
    """Bin j of the ITL histogram is (10^(-5 + (j-1)/100), 10^(-5 + j/100)] s, reported
    at its geometric centre 10^(-5 + (j - 1/2)/100) s."""
    st = StepStats(gamma=0)
    for j, c in counts.items():
        st.itl_hist[j] = c
        st.itl_sum_s += c * 10 ** (-5 + (j - 0.5) / 100)
    s = summarize(RequestLog.empty(0), st, gpus=1, slo_ttft_ms=None, slo_tpot_ms=None)
    for name, j in zip(("median_itl_ms", "p90_itl_ms", "p99_itl_ms"), bins, strict=True):
        assert s[name] == pytest.approx(10 ** (-5 + (j - 0.5) / 100) * 1e3, rel=1e-9), name
    assert s["mean_itl_ms"] == pytest.approx(st.itl_sum_s / sum(counts.values()) * 1e3)


def test_slo_goodput_passes_a_request_exactly_at_the_slo():
    # request 1 has TTFT 500 ms and TPOT 500 ms exactly (binary-exact times): at an SLO of
    # 500 ms on both it passes, with 0 and 2 (request 4's TTFT is 1000 ms)
    s = _summary(slo_ttft_ms=500.0, slo_tpot_ms=500.0)
    assert s["goodput"] == pytest.approx(3 / 6)


def test_changed_token_fraction_is_over_all_generated_tokens():
    st = _stats()
    st.changed_tokens = 3
    s = summarize(_log(), st, gpus=1, slo_ttft_ms=None, slo_tpot_ms=None)
    # 11 + 5 + 1 + 0 + 4 = 21 tokens generated
    assert s["changed_tokens"] == 3 and s["changed_token_fraction"] == pytest.approx(3 / 21)



# -- one request through an engine whose step times are known -------------------------------


def _flat_profile(step_s: float = 0.010, logit_s: float = 0.001) -> EngineProfile:
    return EngineProfile(
        name="flat", kind="measured", gpus_per_replica=1,
        tokens=np.array([1, 8192]), step_s=np.array([step_s, step_s]), interpolation="step",
        logits_s_per_row=logit_s,
        drafts={"dspark": DraftCost(np.array([1.0, 2.0]), np.array([0.0, 0.0]), 7)},
    )


@pytest.mark.parametrize("k", [0, 1, 3])
def test_tpot_of_one_request_from_its_step_times(k):
    """One request, 11 output tokens, nothing ever accepted. Prefill step: 10 ms + one
    LM-head row (1 ms) = 11 ms, first token. Each decode step: 10 ms + (1 + k) rows = 11 +
    k ms and exactly one token. So E2E = 11 + 10 (11 + k) ms, TTFT = 11 ms, TPOT = 11 + k."""
    trace = synth_iid(0.0, 7, num_requests=2, positions=64)
    cfg = SimConfig(policy=f"fixed:{k}", deployment=DeploymentConfig(replicas=1),
                    workload=WorkloadConfig(arrival="closed", max_concurrency=1, num_requests=1,
                                            lengths="fixed:10:11"))
    r = simulate(cfg, profile=_flat_profile(), trace=trace)
    s, req = r.summary, r.requests
    assert req["ttft_ms"][0] == pytest.approx(11.0)
    assert req["e2e_ms"][0] == pytest.approx(11 + 10 * (11 + k))
    assert req["tpot_ms"][0] == pytest.approx(11 + k)
    assert s["median_tpot_ms"] == pytest.approx(11 + k)
    assert s["median_interactivity"] == pytest.approx(1000 / (11 + k))
    assert s["mean_itl_ms"] == pytest.approx(11 + k)
    # ITL percentiles come from a histogram of 1/100-decade bins from 10 us (engine.py):
    # a gap g falls in the bin (10^(j-1), 10^j] in those units, reported at its geometric
    # centre 10^(j - 1/2)
    j = math.ceil((math.log10((11 + k) / 1e3) + 5) * 100)
    centre_ms = 10 ** (-5 + (j - 0.5) / 100) * 1e3
    for q in ("median", "p90", "p99"):
        assert s[f"{q}_itl_ms"] == pytest.approx(centre_ms, rel=1e-9)
    # batch tokens: the prefill step carries the 10-token prompt, each decode step 1 + k
    assert s["mean_batch_tokens"] == pytest.approx((10 + 10 * (1 + k)) / 11)
    assert s["mean_step_ms"] == pytest.approx((11 + 10 * (11 + k)) / 11)
    assert s["engine_steps"] == 11 and s["num_drafts"] == 10
    assert s["num_draft_tokens_verified"] == 10 * k and s["num_accepted_tokens"] == 0
    assert s["duration"] == pytest.approx((11 + 10 * (11 + k)) / 1e3)
    assert s["output_throughput"] == pytest.approx(11 / s["duration"])


def test_tpot_counts_tokens_not_steps_when_drafts_are_accepted():
    """Every draft accepted (alpha = 1), fixed:3: each decode step emits 4 tokens. 13 output
    tokens = 1 at prefill + 3 decode steps of 4. Steps cost 10 ms + rows: prefill 11 ms,
    decode 14 ms. TPOT = (E2E - TTFT) / 12 = 3 * 14 / 12 = 3.5 ms."""
    trace = synth_iid(1.0, 7, num_requests=2, positions=64)
    cfg = SimConfig(policy="fixed:3", deployment=DeploymentConfig(replicas=1),
                    workload=WorkloadConfig(arrival="closed", max_concurrency=1, num_requests=1,
                                            lengths="fixed:10:13"))
    r = simulate(cfg, profile=_flat_profile(), trace=trace)
    assert r.requests["e2e_ms"][0] == pytest.approx(11 + 3 * 14)
    assert r.requests["tpot_ms"][0] == pytest.approx(3.5)
    assert r.requests["steps"][0] == 3 and r.requests["accepted_tokens"][0] == 9
    s = r.summary
    assert s["spec_decode_acceptance_length"] == pytest.approx(4.0)
    assert s["acceptance_per_position"] == pytest.approx([1.0] * 3 + [0.0] * 4)
    # ITL is per token-emitting step: 14 ms each, not TPOT's 3.5 ms
    assert s["mean_itl_ms"] == pytest.approx(14.0)


def test_tpot_by_hand_from_per_request_times_in_a_loaded_run():
    """Many requests sharing steps: TPOT recomputed by hand from each request's own E2E,
    TTFT and token count, and the summary's statistics from those by hand."""
    cfg = SimConfig(policy="fixed:3", deployment=DeploymentConfig(replicas=1),
                    engine=EngineConfig(max_num_seqs=16),
                    workload=WorkloadConfig(qps=40.0, num_requests=80,
                                            lengths="lognormal:200:40:0.8"))
    r = simulate(cfg)
    req = r.requests.filter(r.requests["finished"])
    n = req["generated_tokens"].to_numpy()
    e2e, ttft = req["e2e_ms"].to_numpy(), req["ttft_ms"].to_numpy()
    multi = n > 1
    assert multi.sum() > 60 and (~multi).sum() >= 0
    by_hand = (e2e[multi] - ttft[multi]) / (n[multi] - 1)
    got = req["tpot_ms"].to_numpy()[multi]
    np.testing.assert_allclose(got, by_hand, rtol=1e-12)
    s = r.summary
    srt = np.sort(by_hand)
    mid = len(srt) // 2
    median = srt[mid] if len(srt) % 2 else (srt[mid - 1] + srt[mid]) / 2
    assert s["median_tpot_ms"] == pytest.approx(median, rel=1e-12)
    assert s["mean_tpot_ms"] == pytest.approx(sum(by_hand) / len(by_hand), rel=1e-12)
    inter = sorted(1000.0 / v for v in by_hand)
    med_i = inter[mid] if len(inter) % 2 else (inter[mid - 1] + inter[mid]) / 2
    assert s["median_interactivity"] == pytest.approx(med_i, rel=1e-12)
    first, last = r.requests["arrival_s"].min(), max(
        a + e / 1e3 for a, e in zip(req["arrival_s"], req["e2e_ms"], strict=True))
    assert s["duration"] == pytest.approx(last - first, rel=1e-12)
    assert s["output_throughput"] == pytest.approx(int(n.sum()) / (last - first), rel=1e-12)


def test_without_a_step_series_stability_is_nothing_left_unfinished():
    """A real server's log has no step series: ``stable`` then means no request was left
    unfinished (kills ``unfinished == 0`` -> ``== 1``). Request 3 of ``_log`` is unfinished;
    finishing it by hand (at 2.5 s, 9 tokens) makes the run stable."""
    args = dict(gpus=1, slo_ttft_ms=None, slo_tpot_ms=None)
    assert summarize(_log(), _stats(), **args)["stable"] is False
    done = _log()
    done.finish_s[3], done.generated[3] = 2.5, 9
    s = summarize(done, _stats(), **args)
    assert s["unfinished"] == 0 and s["stable"] is True
    assert s["queue_growth_per_s"] == 0.0


def test_whole_run_duration_starts_at_the_first_arrival_not_at_zero():
    # the same five requests arriving 100 s later: the whole-run window is first arrival
    # (100.0) to last completion (106.0), 6 s as before, so every throughput is unchanged
    log = _log()
    for col in ("arrival_s", "first_token_s", "finish_s"):
        getattr(log, col)[:] += 100.0
    s = summarize(log, _stats(), gpus=4, slo_ttft_ms=None, slo_tpot_ms=None, stable=True,
                  queue_growth_per_s=0.0)
    assert s["duration"] == pytest.approx(6.0)
    assert s["output_throughput"] == pytest.approx(21 / 6)
    assert s["request_throughput"] == pytest.approx(4 / 6)
