"""The trace array cache (traces/cache.py): a parquet trace parsed once, its arrays read
back for the same bytes, never for other bytes at the same path."""

from __future__ import annotations

from dataclasses import fields, replace

import numpy as np
import pytest

from dspark_sim.traces import cache, schema
from dspark_sim.traces.schema import read_trace, write_trace
from dspark_sim.traces.synth import synth_iid


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("DSPARK_SIM_CACHE_DIR", str(root))
    return root / "traces"


def _same(a, b) -> None:
    assert a.meta == b.meta and a.source_path == b.source_path
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), f.name
        else:
            assert x == y, f.name


def test_a_second_read_takes_the_arrays_without_parsing(tmp_path, cache_dir, monkeypatch):
    t = synth_iid(0.8, 5, num_requests=6, positions=40, seed=1)
    t = replace(t, req_prompt_tokens=np.arange(6, dtype=np.int64) + 10,
                req_output_tokens=np.full(6, 40, np.int64))
    p = write_trace(t, tmp_path / "t.parquet")
    parsed = read_trace(p)
    assert len(list(cache_dir.iterdir())) == 1
    monkeypatch.setattr(schema, "trace_from_frame", None)  # a parse would fail now
    _same(read_trace(p), parsed)
    # another name for the same bytes: the same entry, its own source path
    q = tmp_path / "copy.parquet"
    q.write_bytes(p.read_bytes())
    got = read_trace(q)
    assert got.source_path == str(q) and len(list(cache_dir.iterdir())) == 1
    _same(replace(got, source_path=parsed.source_path), parsed)


def test_a_file_rewritten_in_place_is_read_again(tmp_path, cache_dir):
    p = tmp_path / "t.parquet"
    write_trace(synth_iid(0.8, 4, num_requests=3, positions=20, seed=1), p)
    first = read_trace(p)
    write_trace(synth_iid(0.3, 4, num_requests=3, positions=20, seed=2), p)
    second = read_trace(p)
    assert not np.array_equal(first.accept_len, second.accept_len)
    _same(second, read_trace(p))
    assert len(list(cache_dir.iterdir())) == 2


def test_string_ids_and_no_confidences_round_trip(tmp_path, cache_dir):
    t = synth_iid(0.6, 3, num_requests=2, positions=10, seed=4)
    t = replace(t, conf=None, req_ids=np.array(["q-b", "q-a"]))
    p = write_trace(t, tmp_path / "s.parquet")
    parsed = read_trace(p)
    hit = read_trace(p)
    assert hit.conf is None and hit.req_ids.tolist() == ["q-b", "q-a"]
    _same(hit, parsed)


def test_large_arrays_are_memory_mapped_read_only(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setattr(cache, "MMAP_FROM_BYTES", 1024)
    p = write_trace(synth_iid(0.8, 7, num_requests=4, positions=100, seed=0),
                    tmp_path / "big.parquet")
    parsed = read_trace(p)
    hit = read_trace(p)
    assert isinstance(hit.conf, np.memmap) and not hit.conf.flags.writeable  # 11 KB
    assert not isinstance(hit.req_offsets, np.memmap)  # 40 bytes: read whole
    _same(hit, parsed)


def _resident_file_kb() -> int | None:
    try:
        status = open("/proc/self/status").read()
    except OSError:
        return None
    return next((int(line.split()[1]) for line in status.splitlines()
                 if line.startswith("RssFile:")), None)


def test_released_pages_leave_the_resident_memory_and_read_back(tmp_path, cache_dir):
    """A memory-mapped entry's pages, once released, are no longer this process's
    resident memory, and reading the array again gives the same values; an array read
    whole is left as it is."""
    p = write_trace(synth_iid(0.8, 7, num_requests=40, positions=8000, seed=0),
                    tmp_path / "big.parquet")  # 320,000 x 7 float32: 9 MB, mapped
    read_trace(p)
    conf = read_trace(p).conf
    assert isinstance(conf, np.memmap)
    before = float(conf.astype(np.float64).sum())  # every page touched
    resident = _resident_file_kb()
    cache.release_pages(conf[:, :3])  # a view releases the whole map
    after = _resident_file_kb()
    if resident is not None:
        assert resident - after >= 8000  # the 8.96 MB of the map
    assert float(conf.astype(np.float64).sum()) == before
    small = np.ones(4)
    cache.release_pages(small)
    assert small.tolist() == [1.0] * 4


def test_off_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_SIM_CACHE_DIR", "off")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    p = write_trace(synth_iid(0.8, 2, num_requests=2, positions=5), tmp_path / "t.parquet")
    read_trace(p)
    read_trace(p)
    assert not (tmp_path / "home").exists()


def test_an_unwritable_cache_leaves_the_read_as_it_was(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("DSPARK_SIM_CACHE_DIR", str(blocker))
    p = write_trace(synth_iid(0.8, 2, num_requests=2, positions=5), tmp_path / "t.parquet")
    assert read_trace(p).num_requests == 2 and read_trace(p).num_requests == 2
