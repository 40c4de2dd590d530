"""Sweeps with the prefix cache on and off as a grid dimension: each point runs both ways,
the per-load answer is given per setting, and the report sets the two rankings side by
side."""

from __future__ import annotations

from dataclasses import replace

import polars as pl
import pytest

from dspark_sim.errors import InputError
from dspark_sim.sim import frontier as fr
from dspark_sim.sim.config import DeploymentConfig, EngineConfig, SimConfig, WorkloadConfig
from dspark_sim.sim.report import build_report
from dspark_sim.sim.sweep import build_points, run_sweep


def test_each_point_runs_with_the_cache_on_and_off_and_says_which():
    base = SimConfig(deployment=DeploymentConfig(replicas=1),
                     workload=WorkloadConfig(qps=2.0, num_requests=40, session_turns=3))
    pts = build_points(base, qps=[1, 2], policies=["none", "fixed:3"],
                       prefix_cache="on,off")
    assert len(pts) == 8 and len({p.point_id for p in pts}) == 8
    assert {(p.prefix_cache_spec, p.config.engine.prefix_cache) for p in pts} == \
        {("on", "on"), ("off", "off")}
    assert {p.params()["prefix_cache_spec"] for p in pts} == {"on", "off"}
    # not a dimension unless asked: the base's own setting, one point per policy and load
    assert [p.params()["prefix_cache_spec"] for p in build_points(
        base, qps=[1], policies=["none"])] == [None]
    # on needs a workload that says which prompts share a prefix, before any point runs
    plain = replace(base, workload=replace(base.workload, session_turns=None))
    with pytest.raises(InputError, match="--prefix-cache: on needs a workload"):
        build_points(plain, qps=[1], policies=["none"], prefix_cache=["on", "off"])


def test_on_for_a_workload_file_without_hash_ids_is_refused_before_any_point(tmp_path):
    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"timestamp": 0, "input_length": 600, "output_length": 20}\n')
    hashed = tmp_path / "hashed.jsonl"
    hashed.write_text('{"timestamp": 0, "input_length": 600, "output_length": 20, '
                      '"hash_ids": [1]}\n')
    csv = tmp_path / "azure.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                   "2023-11-16 18:15:46.6805900,600,20\n")

    def build(path, **wl):
        base = SimConfig(deployment=DeploymentConfig(replicas=1),
                         workload=WorkloadConfig(arrival="replay", workload_path=str(path),
                                                 **wl))
        return build_points(base, qps=[1], policies=["none"], prefix_cache="on,off")

    for path in (plain, csv):
        with pytest.raises(InputError, match=f"on needs a workload that carries reuse: "
                                             f".*{path.name}: its records carry no hash_ids"):
            build(path)
    with pytest.raises(InputError, match="--lengths replaces its prompts"):
        build(hashed, lengths="fixed:100:10")
    assert len(build(hashed)) == 2  # each setting once


def _row(policy: str, cache: str, inter: float) -> dict:
    return {"policy": policy, "policy_spec": policy, "profile_spec": "p", "trace_spec": None,
            "prefix_cache_spec": cache, "load_kind": "qps", "load": 4.0, "qps": 4.0,
            "arrival": "poisson", "seed": 0, "stable": True, "num_requests": 500,
            "point_id": f"{policy}-{cache}", "median_interactivity": inter,
            "output_throughput_per_gpu": 1000.0, "steady_median_interactivity_rse": 0.01}


def test_the_answer_is_per_cache_setting_and_a_changed_ranking_is_said():
    df = pl.DataFrame([_row("none", "on", 50), _row("fixed:3", "on", 110),
                       _row("confidence", "on", 100), _row("none", "off", 40),
                       _row("fixed:3", "off", 70), _row("confidence", "off", 90)])
    rows = fr.answer(df)
    assert [(r["context"], r["best"]) for r in rows] == [
        ("prefix cache off", "confidence"), ("prefix cache on", "fixed:3")]
    # the same policy, load and seed under each setting is two points, not a rerun
    assert fr.one_run_per_point(df)[1].height == 0
    (cmp,) = fr.by_prefix_cache(rows)
    assert cmp["on"]["ranking"] == ["fixed:3", "confidence", "none"]
    assert cmp["off"]["ranking"] == ["confidence", "fixed:3", "none"]
    assert cmp["on"]["gain"] == pytest.approx(110 / 50 - 1)
    assert cmp["off"]["gain"] == pytest.approx(90 / 40 - 1)
    assert not cmp["same_best"]
    (text,) = fr.by_prefix_cache_rows([cmp])
    assert text["caching changes"] == "the best: fixed:3 (on) vs confidence (off)"
    assert text["ranking, cache on"] == "fixed:3 > confidence > none"
    # a sweep that does not vary the cache has nothing to set side by side
    assert fr.by_prefix_cache(fr.answer(df.filter(pl.col("prefix_cache_spec") == "on"))) == []


def test_a_mooncake_sweep_reports_the_ranking_with_caching_on_and_off(shared_dir, tmp_path):
    path = str(shared_dir / "data/workloads/mooncake_conversation_trace.jsonl")
    base = SimConfig(deployment=DeploymentConfig(replicas=1),
                     engine=EngineConfig(prefill="chunked"),
                     workload=WorkloadConfig(workload_path=path, num_requests=200))
    df = run_sweep(base, qps=[1.0], policies=["none", "fixed:3"], prefix_cache=["on", "off"],
                   out=tmp_path / "sw", executor="serial", progress=False)
    by = {c: df.filter(pl.col("prefix_cache_spec") == c) for c in ("on", "off")}
    assert by["on"].height == by["off"].height == 2
    assert (by["on"]["prefix_cache_hit_rate_tokens"] > 0.03).all()
    assert by["off"]["prefix_cache_hit_rate_tokens"].is_null().all()
    # the cache saves prefill, so the same requests see their first token sooner
    ttft = {c: by[c].sort("policy")["median_ttft_ms"].to_list() for c in by}
    assert all(a < b for a, b in zip(ttft["on"], ttft["off"], strict=True))
    report = build_report(tmp_path / "sw" / "results.parquet", tmp_path / "r.html")
    page = report.read_text()
    assert "Prefix cache on vs off" in page and "prefix cache off" in page
