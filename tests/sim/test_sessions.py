"""Multi-turn sessions (``sim/sessions.py``, ``arrivals.SessionLoop``): each turn resends
the history, is sent a think time after the previous answer, the turns find the earlier
ones in the prefix cache, closed-loop clients run sessions in turn, and the same
workload with ``--prefix-cache off`` is the comparison."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_sim.errors import InputError
from dspark_sim.sim.api import simulate
from dspark_sim.sim.config import (
    DeploymentConfig,
    EngineConfig,
    SimConfig,
    WorkloadConfig,
    resolve_config,
)


def _cfg(*, cache=None, arrival="closed", clients=1, n=3, turns=3, think="fixed:2",
         system=40, lengths="fixed:50:20", qps=1.0, replicas=1, block=16) -> SimConfig:
    wl = WorkloadConfig(arrival=arrival, max_concurrency=clients, qps=qps, num_requests=n,
                        session_turns=turns, think_time_s=think, system_prompt_tokens=system,
                        lengths=lengths)
    return SimConfig(policy="none", workload=wl,
                     engine=EngineConfig(prefill="chunked", prefix_block_tokens=block,
                                         prefix_cache=cache),
                     deployment=DeploymentConfig(replicas=replicas, profile="qwen3-8b-h100"))


def test_each_turn_resends_the_history_a_think_time_after_the_answer():
    r = simulate(_cfg())
    df = r.requests.sort("request_id")
    # system 40 + message 50, then + answer 20 + message 50 per turn
    assert df["prompt_tokens"].to_list() == [90, 160, 230]
    arrival, finish = df["arrival_s"].to_numpy(), df["finish_s"].to_numpy()
    assert arrival[0] == 0.0
    np.testing.assert_allclose(arrival[1:], finish[:-1] + 2.0)
    # turn 1 finds turn 0's 110 tokens' 6 full blocks, turn 2 turn 1's 180's 11
    s = r.summary
    assert s["prefill_tokens_saved"] == 6 * 16 + 11 * 16
    assert s["prefix_cache_lookups"] == 3
    assert s["prefix_cache_hit_rate_blocks"] == pytest.approx(17 / (5 + 10 + 14))


def test_sessions_share_the_system_prompt_and_clients_run_them_in_turn():
    # one client, two sessions of two turns: the second session starts when the first
    # ends, and its first turn finds the system prompt's 4 full blocks (64 of 70 tokens)
    r = simulate(_cfg(n=4, turns=2, system=70, think="fixed:0"))
    df = r.requests.sort("request_id")
    arrival, finish = df["arrival_s"].to_numpy(), df["finish_s"].to_numpy()
    assert arrival[2] == finish[1] and arrival[1] == finish[0]
    # turn 1: 70 + 50 + 20 = 140 tokens cached (8 blocks = 128); session 2's turns:
    # the system prompt's 4 blocks, then its own first turn's 8
    assert r.summary["prefill_tokens_saved"] == 128 + 64 + 128


def test_open_loop_sessions_start_as_arrivals_and_count_their_turns():
    r = simulate(_cfg(arrival="poisson", qps=4.0, n=40, turns=4, think="exp:1",
                      lengths="fixed:200:30"))
    s = r.summary
    assert s["completed"] == 40
    assert "10 sessions of 4 turns" in s["workload"]
    df = r.requests.sort("request_id")
    starts = df["arrival_s"].to_numpy()[::4]
    assert np.all(np.diff(starts) >= 0) and starts[0] == 0.0


def test_the_same_sessions_with_the_cache_off_prefill_everything_later():
    kw = dict(arrival="poisson", qps=2.0, n=200, turns=5, think="exp:3", system=1024,
              lengths="azure-conv", replicas=2)
    on, off = simulate(_cfg(**kw)).summary, simulate(_cfg(cache="off", **kw)).summary
    assert "prefix_cache_hit_rate_tokens" not in off
    assert on["prefix_cache_hit_rate_tokens"] > 0.4
    assert on["median_ttft_ms"] < off["median_ttft_ms"]
    assert on["completed"] == off["completed"] == 200


def test_session_settings_are_checked():
    with pytest.raises(InputError, match="--think-time-s"):
        simulate(_cfg(think="weibull:3"))
    with pytest.raises(InputError, match="--session-turns"):
        resolve_config(options={"session_turns": 0})
    with pytest.raises(InputError, match="--session-turns"):
        resolve_config(options={"session_turns": 3, "workload": "w.jsonl"})
    cfg = resolve_config(options={"session_turns": 4, "think_time_s": "lognormal:2:0.5",
                                  "system_prompt_tokens": 500, "max_concurrency": 8})
    assert cfg.workload.arrival == "closed" and cfg.workload.session_turns == 4
