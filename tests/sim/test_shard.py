"""Replica groups simulated apart and merged (``sim.shard``, ``run --executor ray``):
the serial run's bytes, or the serial run with the reason when the run does not allow it."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from dspark_sim.sim import shard
from dspark_sim.sim.api import simulate
from dspark_sim.sim.config import DeploymentConfig, EngineConfig, SimConfig, WorkloadConfig


def _cfg(policy="confidence", replicas=3, qps=150.0, n=500, seed=9, **engine) -> SimConfig:
    return SimConfig(policy=policy, seed=seed,
                     deployment=DeploymentConfig(replicas=replicas, router="round-robin"),
                     engine=EngineConfig(**engine),
                     workload=WorkloadConfig(qps=qps, num_requests=n))


def _same(a, b) -> None:
    assert json.dumps(a.summary, sort_keys=True) == json.dumps(b.summary, sort_keys=True)
    assert a.requests.equals(b.requests)


@pytest.mark.parametrize("cfg,workers", [
    (_cfg(), 2),  # the default deployment: queued prefill instances, the compiled decision
    (_cfg(replicas=4), 4),
    (_cfg("fixed:3", replicas=2, qps=40.0, n=300, prefill="chunked", max_num_seqs=32,
          max_num_batched_tokens=512, kv_capacity_tokens=40000), 2),  # chunked + preemption
    (_cfg("none", replicas=3), 3),
    (_cfg("vllm-adaptive", replicas=2), 2),
])
def test_groups_merged_give_the_serial_runs_bytes(cfg, workers):
    serial = simulate(cfg)
    got, why = shard.simulate_replicas(cfg, executor="serial", workers=workers)
    assert why is None
    assert serial.summary["engine_steps"] > 100
    _same(got, serial)


def test_a_lossy_and_a_tree_policy_merge_exactly_too():
    for policy, trace in (("asd", "dspark-gsm8k-lossy-synthetic"),
                          ("dspark-tree", "cure-qwen3-8b-synthetic")):
        cfg = replace(_cfg(policy, replicas=2, qps=60.0, n=200), trace=trace)
        got, why = shard.simulate_replicas(cfg, executor="serial", workers=2)
        assert why is None
        _same(got, simulate(cfg))


@pytest.mark.parametrize("change,reason", [
    ({"deployment": DeploymentConfig(replicas=3)}, "least-outstanding"),
    ({"deployment": DeploymentConfig(replicas=1, router="round-robin")}, "one replica"),
    ({"workload": WorkloadConfig(arrival="closed", max_concurrency=16, num_requests=100)},
     "closed loop"),
    ({"workload": WorkloadConfig(qps=2.0, num_requests=60, session_turns=3,
                                 think_time_s="exp:1")}, "next turn waits"),
])
def test_a_run_whose_routing_reads_replica_state_runs_serially_and_says_why(change, reason):
    cfg = replace(_cfg(n=200), **change)
    got, why = shard.simulate_replicas(cfg, executor="serial", workers=3)
    assert why is not None and reason in why
    _same(got, simulate(cfg))


def test_one_worker_runs_serially():
    got, why = shard.simulate_replicas(_cfg(n=100), executor="serial", workers=1)
    assert why == "one worker"


def test_the_merge_refuses_what_it_cannot_order_or_bound():
    """Steps of two replicas ending at one instant (their serial order is SimPy's), and
    a merged run that reaches the step bound (the serial run stops there)."""
    cfg = _cfg(replicas=2, n=200)
    groups = [shard.run_group(cfg, part) for part in shard.groups_of(2, 2)]
    with pytest.raises(shard.SerialFallback, match="step bound"):
        shard.merge(groups, 2, max_engine_steps=10)
    tied = groups[1].steps | {"end_s": groups[1].steps["end_s"].copy()}
    tied["end_s"][0] = groups[0].steps["end_s"][0]
    with pytest.raises(shard.SerialFallback, match="same instant"):
        shard.merge([groups[0], replace(groups[1], steps=tied)], 2, 10**9)
    log, stats, steps = shard.merge(groups, 2, 10**9)
    assert np.all(np.diff(steps["end_s"]) > 0)
    assert stats.steps == steps["end_s"].size == sum(g.stats.steps for g in groups)


def test_groups_split_the_replicas_round_robin():
    assert shard.groups_of(5, 2) == [(0, 2, 4), (1, 3)]
    assert shard.groups_of(2, 8) == [(0,), (1,)]


@pytest.mark.slow
def test_ray_tasks_give_the_serial_runs_bytes(tmp_path):
    """``run --executor ray`` through the CLI: the same summary.json bytes as serial."""
    pytest.importorskip("ray")
    from typer.testing import CliRunner

    from dspark_sim.cli import app

    args = ["run", "--policy", "confidence", "--qps", "100", "--num-requests", "300",
            "--replicas", "3", "--router", "round-robin", "--seed", "4", "--quiet"]
    r = CliRunner()
    a = r.invoke(app, [*args, "--out", str(tmp_path / "serial")])
    b = r.invoke(app, [*args, "--out", str(tmp_path / "ray"), "--executor", "ray",
                       "--workers", "2"])
    assert a.exit_code == 0 and b.exit_code == 0, (a.output, b.output)
    assert "ran serially" not in b.output
    assert (tmp_path / "serial" / "summary.json").read_bytes() == \
        (tmp_path / "ray" / "summary.json").read_bytes()


@pytest.mark.parametrize("args,needles", [
    (["--executor", "dask"], ["--executor", "serial or ray", "'dask'"]),
    (["--workers", "2"], ["--workers", "--executor ray"]),
])
def test_bad_executor_options_are_refused_in_one_line(args, needles):
    from input_checks import one_line_error
    from typer.testing import CliRunner

    from dspark_sim.cli import app

    r = CliRunner().invoke(app, ["run", "--num-requests", "20", "--qps", "5", "--quiet",
                                 *args])
    one_line_error(r, *needles)


def test_a_run_that_streams_its_rows_runs_serially(monkeypatch):
    """Above ``STREAM_ABOVE`` requests the rows live in a window of slots that a merge by
    request cannot read: the streamed serial run, with the reason, and its arrivals
    are never drawn whole for the groups."""
    from dspark_sim.sim import api

    monkeypatch.setattr(api, "STREAM_ABOVE", 100)
    cfg = replace(_cfg(n=None), workload=WorkloadConfig(qps=100.0, duration_s=2.0))
    got, why = shard.simulate_replicas(cfg, executor="serial", workers=3)
    assert why == "the run streams its rows"
    serial = simulate(cfg)
    assert json.dumps(got.summary, sort_keys=True) == json.dumps(serial.summary, sort_keys=True)
    assert got.requests.collect().equals(serial.requests.collect())  # streamed: scans


@pytest.mark.parametrize("prefill", ["chunked", "disaggregated"])
def test_a_caching_run_merges_its_cache_counts_to_the_serial_runs_bytes(tmp_path, prefill):
    # a Mooncake file whose prompts share leading hash blocks, round-robin over 2 replicas
    rng = np.random.default_rng(1)
    t_ms, lines = 0, []
    for _ in range(300):
        t_ms += int(rng.integers(5, 40))
        blocks = int(rng.integers(1, 6))
        first = int(rng.integers(0, 20)) * 100
        lines.append(json.dumps({"timestamp": t_ms,
                                 "input_length": blocks * 512 + int(rng.integers(0, 500)),
                                 "output_length": int(rng.integers(5, 60)),
                                 "hash_ids": list(range(first, first + blocks))}))
    (tmp_path / "w.jsonl").write_text("\n".join(lines) + "\n")
    cfg = SimConfig(policy="none",
                    workload=WorkloadConfig(arrival="replay",
                                            workload_path=str(tmp_path / "w.jsonl")),
                    engine=EngineConfig(prefix_cache="on", prefill=prefill),
                    deployment=DeploymentConfig(replicas=2, router="round-robin",
                                                profile="qwen3-8b-h100"))
    serial = simulate(cfg)
    got, why = shard.simulate_replicas(cfg, executor="serial", workers=2)
    assert why is None
    assert serial.summary["prefix_cache_lookups"] == 300
    assert serial.summary["prefill_tokens_saved"] > 0
    _same(got, serial)
    assert got.requests["cached_prompt_tokens"].sum() == serial.summary["prefill_tokens_saved"]
