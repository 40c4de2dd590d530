"""Streamed runs (sim.stream): the window of request slots, the spilled parts and the
summary read back from them give what an in-memory run of the same requests gives."""

from __future__ import annotations

import json
import tempfile
from dataclasses import replace

import numpy as np
import polars as pl
import pytest

from dspark_sim.sim import api, stream
from dspark_sim.sim.config import preset
from dspark_sim.sim.outputs import read_run


def _workload_file(path, n: int = 300, qps: float = 6.0, seed: int = 0):
    """A Mooncake JSONL of ``n`` Poisson arrivals with mixed lengths: a stream read
    whole, so a streamed run and an in-memory run serve the same requests."""
    rng = np.random.default_rng(seed)
    t_ms = np.cumsum(rng.exponential(1e3 / qps, n))
    lines = [json.dumps({"timestamp": float(t), "input_length": int(a), "output_length": int(b)})
             for t, a, b in zip(t_ms, rng.integers(16, 2048, n), rng.integers(1, 400, n),
                                strict=True)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    return _workload_file(tmp_path_factory.mktemp("wl") / "poisson.jsonl")


def _cfg(path, **workload):
    cfg = preset("tiny")
    return replace(cfg, engine=replace(cfg.engine, prefill="chunked"),
                   workload=replace(cfg.workload, **{"arrival": "replay", "workload_path": path,
                                                     "num_requests": None, **workload}))


def _streamed(monkeypatch, cfg, chunk: int, chunks: int, **kw):
    monkeypatch.setattr(api, "STREAM_ABOVE", 10)
    monkeypatch.setattr(api, "STREAM_CHUNK", chunk)
    monkeypatch.setattr(api, "STREAM_CHUNKS", chunks)
    return api.simulate(cfg, **kw)


@pytest.fixture(scope="module")
def in_memory(workload):
    return api.simulate(_cfg(workload))


@pytest.mark.parametrize(("chunk", "chunks"), [(32, 5), (50, 3), (16, 12)])
def test_streamed_run_equals_in_memory(monkeypatch, workload, in_memory, chunk, chunks):
    # 300 requests through 150-192 slots: the oldest chunks are written out and their
    # slots reused while the run goes on
    assert chunk * chunks < 300
    res = _streamed(monkeypatch, _cfg(workload), chunk, chunks)
    assert isinstance(res.requests, pl.LazyFrame)
    assert res.summary == in_memory.summary
    assert res.requests.collect().equals(in_memory.requests)


@pytest.mark.parametrize("change", [
    {"max_engine_steps": 60},  # cut short: requests never sent are written, unsent
    {"engine": {"max_model_len": 1024}},  # some prompts refused at arrival
])
def test_streamed_bounded_or_refusing_run_equals_in_memory(monkeypatch, workload, change):
    cfg = _cfg(workload)
    if "engine" in change:
        cfg = replace(cfg, engine=replace(cfg.engine, **change["engine"]))
    else:
        cfg = replace(cfg, **change)
    want = api.simulate(cfg)
    assert want.summary["bounded_by"] == "steps" or want.summary["rejected"] > 0
    res = _streamed(monkeypatch, cfg, 32, 5)
    assert res.summary == want.summary
    assert res.requests.collect().equals(want.requests)


def test_streamed_closed_loop_equals_in_memory(monkeypatch, workload):
    cfg = _cfg(workload, arrival="closed", max_concurrency=8, num_requests=120)
    want = api.simulate(cfg)
    res = _streamed(monkeypatch, cfg, 16, 3)
    assert res.summary == want.summary
    assert res.requests.collect().equals(want.requests)


def test_streamed_lossy_run_equals_in_memory(monkeypatch, workload):
    # a lossy policy's quality cost reads the trace rows and changed tokens back
    from dspark_sim.sim.config import DeploymentConfig, SimConfig, WorkloadConfig

    cfg = SimConfig(policy="asd:0.5,1,1@fixed:4", trace="dspark-gsm8k-lossy-synthetic",
                    deployment=DeploymentConfig(replicas=1),
                    workload=WorkloadConfig(arrival="closed", max_concurrency=8,
                                            num_requests=120, lengths="fixed:16:64",
                                            workload_path=workload))
    want = api.simulate(cfg)
    assert want.summary["lossy"] and want.summary["changed_tokens"] > 0
    res = _streamed(monkeypatch, cfg, 16, 3)
    assert res.summary == want.summary
    assert res.requests.collect().equals(want.requests)


def test_streamed_run_writes_and_reads_back(monkeypatch, workload, in_memory, tmp_path):
    res = _streamed(monkeypatch, _cfg(workload), 32, 5)
    out = res.write(tmp_path / "run")
    summary, requests = read_run(out)
    summary.pop("outputs")
    assert summary == json.loads(json.dumps(in_memory.summary))
    assert requests.equals(in_memory.requests)
    assert requests["request_id"].to_list() == list(range(300))


def test_spill_folder_goes_with_the_result(monkeypatch, workload, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    res = _streamed(monkeypatch, _cfg(workload), 32, 5)
    spills = list(tmp_path.glob("dspark-sim-spill-*"))
    assert len(spills) == 1 and any(spills[0].iterdir())
    del res
    assert not spills[0].exists()


def _disk_full(*args, **kwargs):
    raise OSError("disk full")


@pytest.mark.parametrize("where", ["summary", "part"])
def test_failed_streamed_run_leaves_no_spill(monkeypatch, workload, tmp_path, where):
    # a part the background thread fails to write fails the run as the summary does
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    if where == "summary":
        monkeypatch.setattr(stream.SpillFolder, "kept_steps", _disk_full)
    else:
        monkeypatch.setattr(stream, "requests_frame", _disk_full)
    with pytest.raises(OSError, match="disk full"):
        _streamed(monkeypatch, _cfg(workload), 32, 5)
    assert not list(tmp_path.glob("dspark-sim-spill-*"))


def test_failed_background_sink_fails_the_write_and_leaves_nothing(monkeypatch, workload,
                                                                    tmp_path):
    # requests.parquet is sunk while the summary is computed: its failure is the write's
    sink = pl.LazyFrame.sink_parquet  # the parts are written by it too

    def sink_fails(frame, path, **kw):
        if str(path).endswith("requests.parquet"):
            raise OSError("disk full")
        return sink(frame, path, **kw)

    monkeypatch.setattr(pl.LazyFrame, "sink_parquet", sink_fails)
    res = _streamed(monkeypatch, _cfg(workload), 32, 5)
    with pytest.raises(OSError, match="disk full"):
        res.write(tmp_path / "run")
    assert not [p for p in (tmp_path / "run").iterdir()]


def test_streamed_run_writes_its_sunk_file_where_it_cannot_link(monkeypatch, workload,
                                                                in_memory, tmp_path):
    res = _streamed(monkeypatch, _cfg(workload), 32, 5)
    res.write(tmp_path / "linked")
    monkeypatch.setattr(stream.os, "link", _disk_full)  # another file system
    res.write(tmp_path / "copied")
    for out in ("linked", "copied"):
        assert read_run(tmp_path / out)[1].equals(in_memory.requests)
    assert ((tmp_path / "linked" / "requests.parquet").read_bytes()
            == (tmp_path / "copied" / "requests.parquet").read_bytes())


def test_window_full_of_live_requests_stops_the_run(monkeypatch, tmp_path):
    # 20 req/s overloads the tiny deployment: ~90 requests are in the system at once,
    # more than a 64-slot window holds
    path = _workload_file(tmp_path / "busy.jsonl", n=200, qps=20.0)
    res = _streamed(monkeypatch, _cfg(path), 16, 4)
    s = res.summary
    assert s["bounded_by"] == "window"
    assert s["num_requests"] < 200 and s["unfinished"] > 0 and not s["stable"]
    frame = res.requests.collect()
    assert frame.height == s["num_requests"]
    assert frame["arrival_s"].is_not_nan().all()  # only requests that were sent


def test_streamed_disaggregated_run_equals_in_memory(monkeypatch, workload):
    # the prefill instances' per-request queue times share the slots and the parts
    cfg = _cfg(workload)
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


# -- streams drawn a chunk at a time --------------------------------------------------
def _drawn(**workload):
    cfg = preset("tiny")
    return replace(cfg, engine=replace(cfg.engine, prefill="chunked"),
                   workload=replace(cfg.workload, **{"qps": 6.0, "num_requests": 300,
                                                     **workload}))


def test_chunked_stream_draws_the_window_it_was_asked_for():
    from dspark_sim.sim.workload import ChunkedStream

    w = _drawn(qps=50.0, num_requests=None, duration_s=400.0).workload
    s = ChunkedStream(w, 3, 1000)
    chunks = list(s.chunks())
    assert [c.first for c in chunks] == list(range(0, s.size, 1000))
    assert all(len(c.prompt_tokens) == 1000 for c in chunks[:-1])
    arr = np.concatenate([c.arrival_s for c in chunks])
    assert arr.size == s.size and arr[0] == 0.0 and np.all(np.diff(arr) >= 0)
    assert arr[-1] == s.last_arrival_s < 400.0
    assert abs(s.size - 20_000) < 5 * np.sqrt(20_000)  # Poisson count at 50 req/s
    # drawn again from the seed: the same requests; another seed: others
    again = list(ChunkedStream(w, 3, 1000).chunks())
    assert all(np.array_equal(a.output_tokens, b.output_tokens)
               for a, b in zip(chunks, again, strict=True))
    other = next(ChunkedStream(w, 4, 1000).chunks())
    assert not np.array_equal(other.arrival_s, chunks[0].arrival_s)
    capped = ChunkedStream(replace(w, num_requests=2500), 3, 1000)
    assert capped.size == 2500 and [len(c.arrival_s) for c in capped.chunks()] == [1000, 1000, 500]


def test_streamed_drawn_run_serves_every_request(monkeypatch):
    cfg = _drawn()
    res = _streamed(monkeypatch, cfg, 32, 5)
    s = res.summary
    assert s["bounded_by"] is None and s["stable"]
    assert s["num_requests"] == s["completed"] == 300
    frame = res.requests.collect()
    assert frame["request_id"].to_list() == list(range(300))
    assert frame["arrival_s"][0] == 0.0 and frame["arrival_s"].is_sorted()
    assert frame["finished"].all() and (frame["generated_tokens"] == frame["output_tokens"]).all()
    assert s["total_output_tokens"] == frame["generated_tokens"].sum()
    # the seed determines the run
    assert _streamed(monkeypatch, cfg, 32, 5).summary == s


def test_streamed_drawn_closed_loop(monkeypatch):
    res = _streamed(monkeypatch, _drawn(arrival="closed", max_concurrency=8), 32, 5)
    s = res.summary
    assert s["completed"] == s["num_requests"] == 300 and s["stable"]
    assert res.requests.collect()["replica"].min() >= 0


def test_step_recorder_take_empties_in_place():
    from dspark_sim.sim.engine import STEP_FIELDS, StepRecorder

    rec = StepRecorder()
    record = rec.record  # bound once, as the engine binds it
    record(tuple(range(len(STEP_FIELDS))))
    first = rec.take()
    record(tuple(10.0 + i for i in range(len(STEP_FIELDS))))
    assert first["end_s"].tolist() == [0.0] and first["unverified_tokens"].tolist() == [11.0]
    assert rec.take()["end_s"].tolist() == [10.0]
    assert len(rec.take()["end_s"]) == 0


def test_step_recorder_keeps_counts_as_int32_and_every_value(monkeypatch):
    """Chunks of the series move out of the buffer as columns: the times float64, the
    counts int32 unless a chunk's do not fit (then float64); read back as float64 by
    ``StepSeries``, every value as recorded."""
    from dspark_sim.sim.engine import STEP_FIELDS, StepRecorder
    from dspark_sim.sim.metrics import StepSeries

    monkeypatch.setattr(StepRecorder, "CHUNK_STEPS", 3)
    rec = StepRecorder()
    rows = [[s * 100.0 + i + (0.25 if i < 2 else 0.0) for i in range(len(STEP_FIELDS))]
            for s in range(7)]
    rows[4][STEP_FIELDS.index("waiting")] = 2.0 ** 40  # past int32, in the second chunk
    for row in rows:
        rec.record(tuple(row))
    cols = rec.columns()
    want = np.array(rows)
    assert cols["end_s"].dtype == np.float64 and cols["decode_batch"].dtype == np.int32
    assert cols["waiting"].dtype == np.float64
    series = StepSeries.from_columns(cols)
    for i, name in enumerate(STEP_FIELDS):
        got = getattr(series, name)
        assert got.dtype == np.float64 and got.tolist() == want[:, i].tolist(), name
    assert len(rec.take()["end_s"]) == 7 and len(rec.columns()["end_s"]) == 0


def test_kept_counts_are_narrow_only_where_they_fit():
    chunks = [stream._mapped(np.array([1, 2], np.int64), narrow=True),
              stream._mapped(np.array([2 ** 40], np.int64), narrow=True)]
    assert [c.dtype for c in chunks] == [np.int32, np.int64]
    joined = stream._joined(chunks, widest=True)
    assert joined.dtype == np.int64 and joined.tolist() == [1, 2, 2 ** 40]
    assert not chunks  # each let go once copied


def test_request_log_clear_resets_only_its_slots():
    from dspark_sim.sim.engine import RequestLog

    log = RequestLog.empty(6)
    log.finish_s[:] = 1.0
    log.replica[:] = 3
    log.generated[:] = 7
    log.clear(slice(2, 4))
    assert np.isnan(log.finish_s[2:4]).all() and (log.finish_s[[0, 1, 4, 5]] == 1.0).all()
    assert log.replica.tolist() == [3, 3, -1, -1, 3, 3]
    assert log.view(slice(1, 3)).generated.tolist() == [7, 0]


def test_streamed_day_keeps_the_default_step_allowance_per_request():
    cfg = _drawn()
    day = api._streamed_step_bound(cfg, 17_280_000)
    assert day.max_engine_steps == 86_400_000  # 5 a request, as 5 M are for 1 M requests
    assert api._streamed_step_bound(cfg, 1_000_001).max_engine_steps == 5_000_005
    assert api._streamed_step_bound(cfg, 50_000_000).max_engine_steps == 100_000_000  # the limit
    chosen = replace(cfg, max_engine_steps=1234)
    assert api._streamed_step_bound(chosen, 17_280_000) is chosen  # a bound given is kept
