"""The live vLLM runner's process handling and bench plumbing, against a stand-in
interpreter (tests/fake_vllm.py) that serves /health and /metrics and writes bench
results: no vLLM needed. The real thing is `dspark-sim vllm validate` (docs/validation.md)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from dspark_sim.errors import InputError
from dspark_sim.validation.vllm_fit import read_bench_runs
from dspark_sim.validation.vllm_live import (
    CpuPins,
    LiveConfig,
    Setting,
    VllmServer,
    bench_args,
    measure,
    parse_pins,
    parse_settings,
)

FAKE = Path(__file__).parents[1] / "fake_vllm.py"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); it is dead for our purposes
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.fixture
def fake_python(tmp_path):
    """An interpreter path that runs the stand-in with this Python."""
    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} \"$@\"\n")
    wrapper.chmod(0o755)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return wrapper, model


def test_parse_settings():
    assert parse_settings("none,ngram:3,draft:2") == (Setting("none"), Setting("ngram", 3),
                                                      Setting("draft", 2))
    assert [s.name for s in parse_settings("none, ngram:1")] == ["none", "ngram-k1"]
    for bad, match in [("ngram", "K must be"), ("ngram:0", "K must be"), ("eagle:3", "a setting"),
                       ("none:2", "takes no K"), ("ngram:3,ngram:3", "twice"),
                       ("ngram:99", "K must be")]:
        with pytest.raises(InputError, match=match) as exc:
            parse_settings(bad)
        assert exc.value.where == "--settings"


def test_draft_setting_needs_a_draft_model():
    with pytest.raises(InputError, match="needs --draft-model"):
        Setting("draft", 3).speculative_config(None)
    cfg = Setting("draft", 3).speculative_config(Path("/m"))
    assert cfg == {"method": "draft_model", "model": "/m", "num_speculative_tokens": 3}
    assert Setting("ngram", 2).speculative_config(None)["num_speculative_tokens"] == 2
    assert Setting("none").speculative_config(None) is None


def test_server_starts_answers_and_its_process_group_is_stopped(tmp_path, fake_python,
                                                                monkeypatch):
    python, model = fake_python
    pidfile = tmp_path / "pid"
    monkeypatch.setenv("FAKE_VLLM_PIDFILE", str(pidfile))
    cfg = LiveConfig(python=python, model_dir=model, startup_timeout_s=60)
    server = VllmServer(cfg, Setting("ngram", 3), tmp_path / "logs" / "s.log")
    cmd = server.command()
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"  # never another interface
    assert "--no-enable-prefix-caching" in cmd and "--enforce-eager" in cmd
    assert json.loads(cmd[cmd.index("--speculative-config") + 1])["method"] == "ngram"
    with server:
        assert "spec_decode_num_drafts_total" in server.scrape()
        pid = int(pidfile.read_text())
        assert _alive(pid)
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "the server outlived its with block"


def test_server_that_dies_at_start_up_is_reported_with_its_log(tmp_path):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 'RuntimeError: no model here' >&2\nexit 3\n")
    python.chmod(0o755)
    cfg = LiveConfig(python=python, model_dir=tmp_path, startup_timeout_s=30)
    with pytest.raises(RuntimeError, match="exited with 3 during start-up") as exc:
        with VllmServer(cfg, Setting("none"), tmp_path / "s.log"):
            pass
    assert "no model here" in str(exc.value)


def test_bench_args_closed_and_open_loop(tmp_path, fake_python):
    python, model = fake_python
    cfg = LiveConfig(python=python, model_dir=model, output_tokens=32)
    server = VllmServer(cfg, Setting("ngram", 1), tmp_path / "s.log")
    closed = bench_args(cfg, server, Path("p.jsonl"), tmp_path, "x.json", 8, None)
    assert closed[closed.index("--max-concurrency") + 1] == "8"
    assert closed[closed.index("--request-rate") + 1] == "inf"
    assert closed[closed.index("--num-prompts") + 1] == "32"  # 4 per client
    assert "--ignore-eos" in closed and closed[closed.index("--temperature") + 1] == "0"
    assert closed[closed.index("--custom-output-len") + 1] == "32"
    opened = bench_args(cfg, server, Path("p.jsonl"), tmp_path, "x.json", None, 0.5)
    assert "--max-concurrency" not in opened
    assert opened[opened.index("--request-rate") + 1] == "0.5"


def test_measure_writes_every_run_and_resumes(tmp_path, fake_python):
    python, model = fake_python
    cfg = LiveConfig(python=python, model_dir=model, settings=parse_settings("none,ngram:2"),
                     concurrencies=(1, 4), rates=(0.5,), startup_timeout_s=60)
    out = tmp_path / "live"
    manifest = json.loads(measure(cfg, out).read_text())
    names = sorted(p.name for p in (out / "runs").glob("*.json"))
    assert names == sorted(f"{s}-{load}.json" for s in ("none", "ngram-k2")
                           for load in ("c1", "c4", "r0.5"))
    assert manifest["runs"] == names and manifest["kv_capacity_tokens"] == 51712
    assert manifest["prefix_caching"] is False and manifest["vllm_version"] == "0.0-fake"
    assert (out / "scrapes" / "ngram-k2.txt").read_text().startswith("vllm:spec_decode")
    runs = {r.name: r for r in read_bench_runs([out / "runs"])}
    assert runs["ngram-k2@c4"].k == 2 and runs["ngram-k2@c4"].concurrency == 4
    assert runs["none@r0.5"].rate == 0.5 and runs["none@r0.5"].concurrency is None
    # a second call finds every run done and starts no server
    stamp = {p: p.stat().st_mtime_ns for p in (out / "runs").iterdir()}
    measure(cfg, out)
    assert {p: p.stat().st_mtime_ns for p in (out / "runs").iterdir()} == stamp


def test_gpu_servers_drop_the_cpu_flags_and_take_their_own(tmp_path, fake_python):
    python, model = fake_python
    cfg = LiveConfig(python=python, model_dir=model, cpu_defaults=False,
                     extra_server_args=("--tensor-parallel-size", "2"))
    cmd = VllmServer(cfg, Setting("none"), tmp_path / "s.log").command()
    assert "--enforce-eager" not in cmd and "float32" not in cmd
    assert cmd[-2:] == ["--tensor-parallel-size", "2"]
    assert "--speculative-config" not in cmd  # none speculates nothing


def test_cpu_pins_parse_and_refuse_in_one_line():
    assert parse_pins("auto", {0, 1}) == CpuPins((0,), (1,))
    assert parse_pins("auto", {0, 1, 2, 3}) == CpuPins((0, 1, 2), (3,))
    assert parse_pins("auto", {0}) is None  # one CPU: nothing to keep apart
    assert parse_pins("off", {0, 1}) is None
    assert parse_pins("0-2,5:3", set(range(8))) == CpuPins((0, 1, 2, 5), (3,))
    for bad, why in (("0:0", "overlap"), ("0:9", "CPU 9 is not available"),
                     ("0", "WORKER:REST"), ("0-:1", "a CPU list"), ("a:1", "a CPU list")):
        with pytest.raises(InputError, match=why) as exc:
            parse_pins(bad, {0, 1})
        assert str(exc.value).startswith("--pin-cpus") and "\n" not in str(exc.value)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to split")
def test_pinned_measure_binds_the_worker_and_confines_the_rest(tmp_path, fake_python,
                                                              monkeypatch):
    python, model = fake_python
    cpus = sorted(os.sched_getaffinity(0))
    cpufile = tmp_path / "cpus.jsonl"
    monkeypatch.setenv("FAKE_VLLM_CPUFILE", str(cpufile))
    pins = CpuPins(tuple(cpus[:-1]), (cpus[-1],))
    cfg = LiveConfig(python=python, model_dir=model, settings=parse_settings("none"),
                     concurrencies=(1,), rates=(), startup_timeout_s=60, pins=pins)
    manifest = json.loads(measure(cfg, tmp_path / "live").read_text())
    seen = [json.loads(line) for line in cpufile.read_text().splitlines()]
    assert {s["role"] for s in seen} == {"server", "bench"}
    for s in seen:  # neither the server's processes nor the client share the worker's CPUs
        assert s["cpus"] == [cpus[-1]]
    assert next(s for s in seen if s["role"] == "server")["bind"] == pins.omp_bind
    assert manifest["cpu_pins"] == {"worker": cpus[:-1], "rest": [cpus[-1]]}
    # unpinned, nothing is confined and vLLM binds its worker itself
    cpufile.unlink()
    measure(LiveConfig(python=python, model_dir=model, settings=parse_settings("none"),
                       concurrencies=(2,), rates=(), startup_timeout_s=60),
            tmp_path / "free")
    seen = [json.loads(line) for line in cpufile.read_text().splitlines()]
    assert all(s["cpus"] == cpus for s in seen)
    assert all(s["bind"] is None for s in seen)
