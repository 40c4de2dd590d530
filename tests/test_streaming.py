"""Streamed runs (sim.stream): the window of request slots, the spilled parts and the
summary read back from them give what an in-memory run of the same requests gives."""

from __future__ import annotations

import json
import tempfile
from dataclasses import replace

import polars as pl
import pytest

from dspark_sim.sim import api
from dspark_sim.sim.config import preset
from dspark_sim.sim.outputs import read_run


def _cfg(**workload):
    cfg = preset("tiny")
    return replace(cfg, engine=replace(cfg.engine, prefill="chunked"),
                   workload=replace(cfg.workload, **{"qps": 6.0, "num_requests": 300,
                                                     **workload}))


def _streamed(monkeypatch, cfg, chunk: int, chunks: int, **kw):
    monkeypatch.setattr(api, "STREAM_ABOVE", 10)
    monkeypatch.setattr(api, "STREAM_CHUNK", chunk)
    monkeypatch.setattr(api, "STREAM_CHUNKS", chunks)
    return api.simulate(cfg, **kw)


@pytest.fixture(scope="module")
def in_memory():
    return api.simulate(_cfg())


@pytest.mark.parametrize(("chunk", "chunks"), [(32, 5), (50, 3), (16, 12)])
def test_streamed_run_equals_in_memory(monkeypatch, in_memory, chunk, chunks):
    # 300 requests through 150-192 slots: the oldest chunks are written out and their
    # slots reused while the run goes on
    assert chunk * chunks < 300
    res = _streamed(monkeypatch, _cfg(), chunk, chunks)
    assert isinstance(res.requests, pl.LazyFrame)
    assert res.summary == in_memory.summary
    assert res.requests.collect().equals(in_memory.requests)


def test_streamed_closed_loop_equals_in_memory(monkeypatch):
    cfg = _cfg(arrival="closed", max_concurrency=8, num_requests=120)
    want = api.simulate(cfg)
    res = _streamed(monkeypatch, cfg, 16, 3)
    assert res.summary == want.summary
    assert res.requests.collect().equals(want.requests)


def test_streamed_lossy_run_equals_in_memory(monkeypatch):
    # a lossy policy's quality cost reads the trace rows and changed tokens back
    from dspark_sim.sim.config import DeploymentConfig, SimConfig, WorkloadConfig

    cfg = SimConfig(policy="asd:0.5,1,1@fixed:4", trace="dspark-gsm8k-lossy-synthetic",
                    deployment=DeploymentConfig(replicas=1),
                    workload=WorkloadConfig(arrival="closed", max_concurrency=8,
                                            num_requests=120, lengths="fixed:16:64"))
    want = api.simulate(cfg)
    assert want.summary["lossy"] and want.summary["changed_tokens"] > 0
    res = _streamed(monkeypatch, cfg, 16, 3)
    assert res.summary == want.summary
    assert res.requests.collect().equals(want.requests)


def test_streamed_run_writes_and_reads_back(monkeypatch, in_memory, tmp_path):
    res = _streamed(monkeypatch, _cfg(), 32, 5)
    out = res.write(tmp_path / "run")
    summary, requests = read_run(out)
    summary.pop("outputs")
    assert summary == json.loads(json.dumps(in_memory.summary))
    assert requests.equals(in_memory.requests)
    assert requests["request_id"].to_list() == list(range(300))


def test_spill_folder_goes_with_the_result(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    res = _streamed(monkeypatch, _cfg(), 32, 5)
    spills = list(tmp_path.glob("dspark-sim-spill-*"))
    assert len(spills) == 1 and any(spills[0].iterdir())
    del res
    assert not spills[0].exists()


def test_failed_streamed_run_leaves_no_spill(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def broken(parts):
        raise OSError("disk full")

    monkeypatch.setattr(api, "read_steps", broken)
    with pytest.raises(OSError, match="disk full"):
        _streamed(monkeypatch, _cfg(), 32, 5)
    assert not list(tmp_path.glob("dspark-sim-spill-*"))


def test_window_full_of_live_requests_stops_the_run(monkeypatch):
    # 20 req/s overloads the tiny deployment: ~90 requests are in the system at once,
    # more than a 64-slot window holds
    res = _streamed(monkeypatch, _cfg(qps=20.0, num_requests=200), 16, 4)
    s = res.summary
    assert s["bounded_by"] == "window"
    assert s["num_requests"] < 200 and s["unfinished"] > 0 and not s["stable"]
    frame = res.requests.collect()
    assert frame.height == s["num_requests"]
    assert frame["arrival_s"].is_not_nan().all()  # only requests that were sent


def test_streamed_disaggregated_run_equals_in_memory(monkeypatch):
    # the prefill instances' per-request queue times share the slots and the parts
    cfg = _cfg()
    cfg = replace(cfg, engine=replace(cfg.engine, prefill="disaggregated"))
    want = api.simulate(cfg)
    assert want.summary["prefill"] == "disaggregated"
    assert want.summary["prefill_steps"] > 0
    res = _streamed(monkeypatch, cfg, 32, 5)
    assert res.summary == want.summary
    assert res.requests.collect().equals(want.requests)


def test_default_window_is_bounded():
    # what a streamed run holds in memory does not depend on its request count
    from dspark_sim.sim.stream import RequestWindow

    big = RequestWindow.slots(17_280_000, api.STREAM_CHUNK, api.STREAM_CHUNKS)
    assert big == RequestWindow.slots(50_000_000, api.STREAM_CHUNK, api.STREAM_CHUNKS)
    assert big == api.STREAM_CHUNK * api.STREAM_CHUNKS <= api.STREAM_ABOVE + api.STREAM_CHUNK
