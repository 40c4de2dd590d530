"""Disaggregated prefill (sim/prefill.py): prefill instances are servers with a count and a
FIFO queue, so TTFT responds to load and to the prefill count; the summary reports
per-GPU throughput over the decode GPUs and, beside it, over decode + prefill GPUs.

The hand-worked cases use a two-row step table (10 ms at <= 4 tokens, 12 ms above),
1 us per query-context unit of attention and 0.5 ms per logit row.
"""

from __future__ import annotations

import numpy as np
import pytest
import simpy
from typer.testing import CliRunner

from dspark_sim.calibration.profile import EngineProfile
from dspark_sim.cli import app
from dspark_sim.errors import InputError
from dspark_sim.sim.api import simulate
from dspark_sim.sim.config import (
    DeploymentConfig,
    EngineConfig,
    SimConfig,
    WorkloadConfig,
    resolve_config,
)
from dspark_sim.sim.prefill import PrefillPool, prefill_step_s

T4, T8, ATTN, LOGIT = 0.010, 0.012, 1e-6, 5e-4
PROF = EngineProfile(name="t", kind="measured", gpus_per_replica=1, tokens=np.array([4, 8]),
                     step_s=np.array([T4, T8]), attn_s_per_query_ctx=ATTN,
                     logits_s_per_row=LOGIT)


def _prefilled_at(prompts, *, instances=1, budget=8, submit_s=None) -> list[float]:
    """When each request's prompt is done, requests submitted at ``submit_s`` (default:
    all at 0) in id order."""
    env = simpy.Environment()
    pool = PrefillPool(env, PROF, instances, budget, np.array(prompts))
    done = [None] * len(prompts)
    pool.on_prefilled = lambda rid: done.__setitem__(rid, env.now)
    at = submit_s or [0.0] * len(prompts)

    def arrivals():
        for rid, t in enumerate(at):
            if t > env.now:
                yield env.timeout(t - env.now)
            pool.submit(rid)

    env.process(arrivals())
    env.run()
    return done


def test_the_second_of_two_requests_arriving_together_waits_for_the_first():
    """One instance, 8-token budget, two 8-token prompts at t = 0: the first fills the
    step (12 ms + attention 8 x 4 units + a logit row); the second waits for it, then
    costs the same."""
    one = T8 + ATTN * 8 * 4 + LOGIT
    assert _prefilled_at([8, 8]) == pytest.approx([one, 2 * one], rel=1e-12)
    # two instances serve them at once: no wait
    assert _prefilled_at([8, 8], instances=2) == pytest.approx([one, one], rel=1e-12)


def test_a_step_fills_its_budget_from_the_queue_in_arrival_order():
    """Two 6-token prompts, budget 8: step 1 takes all of the first and 2 tokens of the
    second (attention 6 x 3 + 2 x 1, one logit row); step 2 the second's last 4 (4 tokens
    over 2 done: 4 x 4 units, 10 ms, its logit row)."""
    t1 = T8 + ATTN * (6 * 3 + 2 * 1) + LOGIT
    t2 = t1 + T4 + ATTN * 4 * 4 + LOGIT
    assert _prefilled_at([6, 6]) == pytest.approx([t1, t2], rel=1e-12)
    # the same step's cost, by the step function itself
    assert prefill_step_s(PROF, [6, 2], [0, 0], 1) == pytest.approx(t1, rel=1e-12)


def test_a_long_prompt_runs_full_chunks_then_the_rest_and_keeps_its_instance():
    """A 20-token prompt alone: 8 + 8 + 4 (attention over the growing prompt, 20 x 20/2
    units in all, one logit row); a 3-token prompt arriving meanwhile on a second
    instance is served at once, and on the same busy instance it waits for the long one's
    steps to free budget (the long prompt stays first)."""
    long_s = 2 * T8 + T4 + ATTN * 20 * 10 + LOGIT
    assert _prefilled_at([20]) == pytest.approx([long_s], rel=1e-12)
    # 16 tokens: 8 + 8, no empty third step
    assert _prefilled_at([16]) == pytest.approx([2 * T8 + ATTN * 16 * 8 + LOGIT], rel=1e-12)
    got = _prefilled_at([20, 3], instances=2, submit_s=[0.0, 0.001])
    assert got == pytest.approx([long_s, 0.001 + T4 + ATTN * 3 * 1.5 + LOGIT], rel=1e-12)
    # one instance: steps 1, 2 are the long prompt's (8 each); step 3 its last 4 and the
    # short prompt's 3 (7 tokens: 12 ms), both complete
    t2 = 2 * T8 + ATTN * (8 * 4 + 8 * 12)
    t3 = t2 + T8 + ATTN * (4 * 18 + 3 * 1.5) + 2 * LOGIT
    assert _prefilled_at([20, 3], submit_s=[0.0, 0.001]) == pytest.approx([t3, t3], rel=1e-12)


def test_an_instance_freed_at_the_moment_of_an_arrival_serves_it_once():
    """Request 1 arrives exactly when the one instance finishes request 0: it is served
    once, from that moment (the idle instance's wake-up finds it taken or takes it)."""
    one = T8 + ATTN * 8 * 4 + LOGIT
    assert _prefilled_at([8, 8], submit_s=[0.0, one]) == pytest.approx([one, 2 * one])


# -- through the simulator: TTFT against load and the prefill count ----------------------

def _disagg(qps: float, instances: int, n: int = 1500) -> dict:
    """Four decode replicas without speculation (~15 req/s each at most: decode keeps up)."""
    cfg = SimConfig(policy="none", engine=EngineConfig(prefill="disaggregated"),
                    deployment=DeploymentConfig(replicas=4, prefill_instances=instances),
                    workload=WorkloadConfig(qps=qps, num_requests=n), seed=1)
    return simulate(cfg).summary


@pytest.fixture(scope="module")
def ladder() -> dict[tuple[float, int], dict]:
    """The default profile's prefill instances (~24k prompt tokens/s each at a full
    budget) under chat prompts (~1,160 tokens): 4 instances at 30 and 60 req/s (~40 %
    and ~60 % busy: a busier instance batches more prompts per step, so its busy time
    grows less than the load), and 60 req/s on 8."""
    return {(q, k): _disagg(q, k) for q, k in ((30.0, 4), (60.0, 4), (60.0, 8))}


def test_ttft_rises_with_load_at_a_fixed_prefill_count(ladder):
    lo, hi = ladder[(30.0, 4)], ladder[(60.0, 4)]
    assert hi["prefill_utilization"] > 1.3 * lo["prefill_utilization"]
    assert hi["mean_prefill_wait_ms"] > 4 * lo["mean_prefill_wait_ms"]
    # (the queue-free model gave every load the same TTFT: one prefill time per prompt)
    assert hi["median_ttft_ms"] > 1.5 * lo["median_ttft_ms"]
    assert hi["steady_median_ttft_ms"] > 1.5 * lo["steady_median_ttft_ms"]
    assert hi["p99_ttft_ms"] > 1.3 * lo["p99_ttft_ms"]


def test_ttft_falls_when_the_prefill_count_grows(ladder):
    few, many = ladder[(60.0, 4)], ladder[(60.0, 8)]
    assert many["median_ttft_ms"] < few["median_ttft_ms"] / 1.5
    assert many["p99_ttft_ms"] < few["p99_ttft_ms"] / 1.5
    assert many["prefill_utilization"] == pytest.approx(few["prefill_utilization"] / 2, rel=0.15)


def test_too_few_prefill_instances_make_the_run_unstable(ladder):
    """One instance for 60 req/s of ~1,160-token prompts (~70k tokens/s against ~24k):
    the prefill queue grows without bound, and the verdict says so; on 8 the requests in
    the system grow at a small fraction of that rate."""
    s = _disagg(60.0, 1, n=600)
    assert s["prefill_utilization"] > 0.8 and s["mean_prefill_wait_ms"] > 1000
    assert not s["stable"] and "the queue grows" in s["stability_note"]
    assert ladder[(60.0, 8)]["queue_growth_per_s"] < s["queue_growth_per_s"] / 5


def test_per_gpu_over_all_gpus_is_the_decode_figure_times_their_share(ladder):
    s = ladder[(60.0, 4)]
    assert (s["num_gpus"], s["num_prefill_gpus"], s["prefill_instances"]) == (4, 4, 4)
    for key in ("output_throughput_per_gpu", "steady_output_throughput_per_gpu"):
        assert s[f"{key}_incl_prefill"] == pytest.approx(s[key] * 4 / 8, rel=1e-12)
    assert s["output_throughput_per_gpu"] == pytest.approx(
        s["total_output_tokens"] / s["duration"] / 4, rel=1e-12)
    eight = ladder[(60.0, 8)]  # 4 decode + 8 prefill GPUs
    assert eight["output_throughput_per_gpu_incl_prefill"] == pytest.approx(
        eight["output_throughput_per_gpu"] * 4 / 12, rel=1e-12)


def test_the_deployment_line_says_a_replica_is_one_rank_of_an_ep_group():
    s = _disagg(30.0, 3, n=50)
    assert s["deployment"].startswith(
        "4 decode replica(s) = 4 GPUs, each replica one rank (1 GPU) of an EP32 group; "
        "3 prefill instance(s) x 1 GPU = 3 GPUs (7 GPUs in all)")


def test_chunked_prefill_has_no_prefill_instances_and_refuses_a_count():
    cfg = SimConfig(policy="none", engine=EngineConfig(prefill="chunked"),
                    deployment=DeploymentConfig(replicas=1),
                    workload=WorkloadConfig(qps=10.0, num_requests=30))
    s = simulate(cfg).summary
    assert not any("incl_prefill" in k or k.startswith("prefill_") for k in s)
    assert s["output_throughput_per_gpu"] > 0
    # a count given for it would be ignored: refused where given, whoever chose chunked
    with pytest.raises(InputError, match="prefill is chunked") as err:
        resolve_config(options={"prefill_instances": 3, "prefill": "chunked"})
    assert err.value.where == "--prefill-instances"
    with pytest.raises(InputError, match="prefill is chunked"):  # the profile's choice
        resolve_config(options={"prefill_instances": 3, "profile": "qwen3-8b-h100"})
    # the single-replica preset's own count is no given count
    assert resolve_config(preset_name="single-replica", options={"prefill": "chunked"})


def test_the_prefill_count_is_an_option_and_a_config_key(tmp_path):
    cfg = resolve_config(options={"prefill_instances": 6})
    assert cfg.deployment.prefill_instances == 6
    f = tmp_path / "c.toml"
    f.write_text("[deployment]\nprefill_instances = 0\n")
    with pytest.raises(InputError, match=r"c.toml \[deployment\] prefill_instances"):
        resolve_config(config_path=f)
    res = CliRunner().invoke(app, ["run", "--prefill-instances", "0", "--num-requests", "10"])
    assert res.exit_code != 0
    assert "--prefill-instances" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(app, ["run", "--policy", "none", "--replicas", "1", "--qps",
                                   "20", "--num-requests", "60", "--prefill-instances", "2"])
    assert res.exit_code == 0, res.output
    assert "decode + prefill (3 GPUs)" in res.output and "prefill instances" in res.output
