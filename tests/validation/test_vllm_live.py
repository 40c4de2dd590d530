"""The live vLLM runner's process handling and bench plumbing, against a stand-in
interpreter (tests/fake_vllm.py) that serves /health and /metrics and writes bench
results: no vLLM needed. The real thing is `dspark-sim vllm validate` (docs/validation.md)."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from fake_vllm import events

from dspark_sim.errors import InputError
from dspark_sim.validation.vllm_fit import read_bench_runs
from dspark_sim.validation.vllm_live import (
    CpuPins,
    LiveConfig,
    Setting,
    VllmServer,
    bench_args,
    default_prompts,
    live_config,
    measure,
    parse_pins,
    parse_settings,
    repeat_options,
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
    assert cmd[cmd.index("--per-request-spec-decode-metrics") + 1] == "detailed"
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
    assert closed[closed.index("--num-prompts") + 1] == "48"  # 6 per client
    light = bench_args(cfg, server, Path("p.jsonl"), tmp_path, "x.json", 1, None)
    assert light[light.index("--num-prompts") + 1] == "12"  # a point's least
    assert "--ignore-eos" in closed and closed[closed.index("--temperature") + 1] == "0"
    assert closed[closed.index("--custom-output-len") + 1] == "32"
    opened = bench_args(cfg, server, Path("p.jsonl"), tmp_path, "x.json", None, 0.5)
    assert "--max-concurrency" not in opened
    assert opened[opened.index("--request-rate") + 1] == "0.5"
    tagged = bench_args(cfg, server, Path("p.jsonl"), tmp_path, "x.json", 2, None, round_no=3)
    assert tagged[tagged.index("--metadata") + 1:][:3] == [
        "dspark_setting=ngram-k1", "dspark_k=1", "dspark_round=3"]


def test_measure_repeats_in_rounds_with_resident_servers_and_resumes(tmp_path, fake_python,
                                                                    monkeypatch):
    python, model = fake_python
    log = tmp_path / "fake.jsonl"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    cfg = LiveConfig(python=python, model_dir=model, settings=parse_settings("none,ngram:2"),
                     concurrencies=(1, 4), rates=(0.5,), startup_timeout_s=60)
    assert cfg.rounds == 3
    out = tmp_path / "live"
    manifest = json.loads(measure(cfg, out).read_text())
    names = sorted(p.name for p in (out / "runs").glob("*.json"))
    assert names == sorted(f"{s}-{load}.round{n}.json" for s in ("none", "ngram-k2")
                           for load in ("c1", "c4", "r0.5") for n in (1, 2, 3))
    assert manifest["runs"] == names and manifest["kv_capacity_tokens"] == 51712
    assert manifest["prefix_caching"] is False and manifest["vllm_version"] == "0.0-fake"
    assert manifest["rounds"] == 3 and manifest["resident_groups"] == [["none", "ngram-k2"]]
    assert (manifest["requests_per_client"], manifest["min_requests"]) == (6, 12)
    assert (out / "scrapes" / "ngram-k2.txt").read_text().startswith("vllm:spec_decode")
    # each server started once and both were up together through every round
    servers = events(log, "server")
    assert sorted(e["k"] for e in servers) == [0, 2]
    assert all(e["kv_gib"] is None for e in servers)  # no bound asked for
    assert [e["detailed"] for e in sorted(servers, key=lambda e: e["k"])] == [False, True]
    benches = events(log, "bench")
    assert len(benches) == 18 and max(e["t"] for e in servers) < min(e["t"] for e in benches)
    # rounds in order; within a round each load runs every setting, the order rotated
    assert [e["round"] for e in benches] == sorted(e["round"] for e in benches)
    firsts = [benches[i]["setting"] for i in range(0, 18, 2)]
    assert firsts == ["none"] * 3 + ["ngram-k2"] * 3 + ["none"] * 3
    # and the loads' order rotated by one a round: each load runs first, midway and last
    loads = [("c" if benches[i]["load"] in ("1", "4") else "r") + benches[i]["load"]
             for i in range(0, 18, 2)]
    assert loads == ["c1", "c4", "r0.5", "c4", "r0.5", "c1", "r0.5", "c1", "c4"]
    # every repeat is a run of its point; the manifest holds medians, spreads, noise floor
    runs = read_bench_runs([out / "runs"])
    assert {r.round for r in runs} == {1, 2, 3}
    point = manifest["points"]["ngram-k2@c4"]
    assert point["repeats"] == 3 and len(point["files"]) == 3
    mid = next(r for r in runs if r.name == "ngram-k2@c4" and r.round == 2)
    assert point["output_throughput"]["median"] == pytest.approx(
        mid.measured["output_throughput"])
    assert point["median_ttft_ms"]["spread"] == pytest.approx(0.04, rel=1e-3)
    assert manifest["noise_floor"]["median_ttft_ms"] == pytest.approx(0.04, rel=1e-3)
    assert manifest["noise_floor"]["output_throughput"] == pytest.approx(0.02, rel=0.05)
    # a second call finds every run done and starts no server
    stamp = {p: p.stat().st_mtime_ns for p in (out / "runs").iterdir()}
    measure(cfg, out)
    assert {p: p.stat().st_mtime_ns for p in (out / "runs").iterdir()} == stamp
    assert len(events(log, "server")) == 2
    # one more round resumes: only its runs are measured
    measure(replace(cfg, rounds=4), out)
    assert len(events(log, "bench")) == 18 + 6
    assert len(list((out / "runs").glob("*.round4.json"))) == 6


def test_resident_groups_start_one_group_at_a_time(tmp_path, fake_python, monkeypatch):
    """A GPU user whose servers do not all fit: --resident 1 keeps one up at a time, each
    still started once for all its rounds."""
    python, model = fake_python
    log = tmp_path / "fake.jsonl"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    cfg = LiveConfig(python=python, model_dir=model, settings=parse_settings("none,ngram:1"),
                     concurrencies=(2,), rates=(), startup_timeout_s=60, rounds=2,
                     resident=1, per_request=False, cpu_defaults=False, kv_cache_gib=2.0)
    assert [[s.name for s in g] for g in cfg.groups()] == [["none"], ["ngram-k1"]]
    manifest = json.loads(measure(cfg, tmp_path / "live").read_text())
    assert manifest["resident_groups"] == [["none"], ["ngram-k1"]]
    servers, benches = events(log, "server"), events(log, "bench")
    assert [e["k"] for e in servers] == [0, 1]
    assert all(e["kv_bytes"] == str(2 * 2**30) and e["kv_gib"] is None for e in servers)
    # the second server starts after every round of the first
    assert [e["setting"] for e in benches] == ["none", "none", "ngram-k1", "ngram-k1"]
    assert benches[1]["t"] < servers[1]["t"] < benches[2]["t"]
    assert manifest["acceptance"] == []  # --no-per-request


def test_measure_collects_per_request_acceptance_for_speculative_settings(tmp_path,
                                                                          fake_python,
                                                                          monkeypatch):
    from dspark_sim.traces.importers import import_trace

    python, model = fake_python
    log = tmp_path / "fake.jsonl"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    cfg = LiveConfig(python=python, model_dir=model, settings=parse_settings("none,ngram:3"),
                     concurrencies=(1,), rates=(), startup_timeout_s=60, rounds=1,
                     kv_cache_gib=1.0)
    out = tmp_path / "live"
    manifest = json.loads(measure(cfg, out).read_text())
    assert manifest["acceptance"] == ["ngram-k3.jsonl"]  # none speculates nothing
    assert all(e["kv_gib"] == "1" for e in events(log, "server"))  # CPU: the env bound
    lines = (out / "acceptance" / "ngram-k3.jsonl").read_text().splitlines()
    prompts = (Path(default_prompts())).read_text().splitlines()
    assert len(lines) == len(prompts)
    assert [json.loads(x)["dspark_prompt_index"] for x in lines] == list(range(len(prompts)))
    trace = import_trace("vllm-per-request", out / "acceptance" / "ngram-k3.jsonl")
    assert trace.num_requests == len(prompts) and trace.gamma_max == 3
    assert (trace.draft_tokens == 0).any()  # steps with no proposal are kept as such
    # the trace's fixed-3 chain visits exactly the steps the server reported
    steps = [len(json.loads(x)["metrics"]["speculative_decoding"]["per_step_accepted"])
             for x in lines]
    assert trace.served_tau_per_request(3)[1].tolist() == steps
    # resumed: the acceptance file is kept, no server starts
    n = len(events(log, "server"))
    measure(cfg, out)
    assert len(events(log, "server")) == n


def test_repeat_options_refuse_in_one_line():
    assert repeat_options(3, None, "auto", True, True)["kv_cache_gib"] == 1.0
    assert repeat_options(3, None, "auto", True, False)["kv_cache_gib"] is None
    assert repeat_options(3, 2, "0.5", False, False) == {
        "rounds": 3, "resident": 2, "kv_cache_gib": 0.5, "per_request": False}
    for args, opt in (((0, None, "auto"), "--rounds"), ((3, 0, "auto"), "--resident"),
                      ((3, None, "lots"), "--kv-cache-gib"), ((3, None, "0"), "--kv-cache-gib")):
        with pytest.raises(InputError) as exc:
            repeat_options(*args, True, True)
        assert exc.value.where == opt


def test_requests_per_client_is_checked_and_recorded(tmp_path, fake_python):
    python, model = fake_python
    cfg = live_config(python, model, "none", "1,2,8", "", 64, None, prompts_per_client=3)
    assert [cfg.num_prompts(c) for c in (1, 2, 8)] == [12, 12, 24]
    for bad in (0, 1001):
        with pytest.raises(InputError) as exc:
            live_config(python, model, "none", "1", "", 64, None, prompts_per_client=bad)
        assert exc.value.where == "--requests-per-client"


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
