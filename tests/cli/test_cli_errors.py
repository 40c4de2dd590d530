"""One-line errors pinned for options that behave well but had no test: exit code 2, one
line starting ``error:`` that names the option (or file) and says what is wrong, no
traceback, and nothing written."""

from __future__ import annotations

import json

import pytest
from input_checks import one_line_error as judged_one_line
from typer.testing import CliRunner

from dspark_sim.cli import app

runner = CliRunner()


def one_line_error(args: list[str], *needles: str) -> str:
    return judged_one_line(runner.invoke(app, args), *needles)


@pytest.mark.parametrize("args,needles", [
    (["--router", "bogus"], ["--router", "round-robin", "least-outstanding", "'bogus'"]),
    (["--kv-mode", "bogus"], ["--kv-mode", "preempt", "reserve", "'bogus'"]),
    (["--replicas", "0"], ["--replicas", "positive integer", "got 0"]),
    (["--max-num-seqs", "0"], ["--max-num-seqs", "positive integer", "got 0"]),
    (["--max-num-seqs", "512", "--max-num-batched-tokens", "256"],
     ["--max-num-seqs", "must not exceed max_num_batched_tokens"]),
    (["--kv-capacity-tokens", "0"], ["--kv-capacity-tokens", "positive integer", "got 0"]),
    (["--preset", "bogus"], ["--preset", "'bogus'", "tiny"]),
    (["--replay-qps", "5"], ["--replay-qps", "does not apply"]),
    (["--duration-s", "-1"], ["--duration-s", "positive number", "-1.0"]),
    (["--burstiness", "-1"], ["--burstiness", "positive number", "-1.0"]),
    (["--max-concurrency", "0"], ["--max-concurrency", "positive integer", "got 0"]),
    (["--num-requests", "0"], ["--num-requests", "positive integer", "got 0"]),
    (["--slo", "foo:5"], ["--slo", "ttft:MS,tpot:MS", "'foo:5'"]),
    (["--policy", "threshold:2"], ["--policy", "'threshold:2'", "[0, 1]"]),
])
def test_run_options_are_refused_before_simulating(no_simulation, args, needles):
    one_line_error(["run", *args], *needles)


@pytest.mark.parametrize("args,needles", [
    (["--lengths", "bogus"], ["--lengths", "'bogus'", "fixed:IN:OUT"]),
    (["--lengths", "fixed:0:5"], ["--lengths", "'fixed:0:5'", "at least 1"]),
    (["--lengths", "fixed:1.5:2"], ["--lengths", "'fixed:1.5:2'", "whole numbers"]),  # ran 1
    (["--lengths", "lognormal:10:10:-1"], ["--lengths", "'lognormal:10:10:-1'", "above 0"]),
    (["--trace", "no-such-trace"], ["--trace", "unknown trace 'no-such-trace'"]),
    (["--mtp-trace", "/no/such.parquet", "--policy", "mtp1"],
     ["/no/such.parquet", "trace file not found"]),
    (["--calibration", "/no/such.toml"], ["/no/such.toml", "calibration map not found"]),
    (["--config", "/no/such.toml"], ["/no/such.toml", "config file not found"]),
    (["--workload", "/no/such.csv"], ["/no/such.csv", "workload file not found"]),
    # a folder or a device is not "not found": say what it is
    (["--workload", "/dev/null"], ["/dev/null", "not a regular file (a workload file"]),
    (["--trace", "/dev/null"], ["/dev/null", "not a regular file (a trace file"]),
    (["--config", "/"], ["/:", "is a folder, not a config file"]),
    (["--calibration", "/"], ["/:", "is a folder, not a calibration map"]),
    (["--profile", "/"], ["/:", "is a folder, not a profile file"]),
    (["--policy-profile", "no-such-profile", "--policy", "confidence"],
     ["unknown profile 'no-such-profile'"]),
    (["--domain", "klingon"], ["--domain", "no requests of domain 'klingon'", "math"]),
    (["--profile", ""], ["--profile", "empty"]),  # not "" (the working dir)
])
def test_run_files_and_names(tmp_path, args, needles):
    out = tmp_path / "out"
    one_line_error(["run", "--num-requests", "20", "--replicas", "1", *args, "--out", str(out)],
                   *needles)
    assert not out.exists()


@pytest.mark.parametrize("body,needles", [
    ("[deployment]\nreplicas = 0\n", ["[deployment] replicas", "positive integer, got 0"]),
    ("[engine]\nmax_num_seqs = 9000\nmax_num_batched_tokens = 100\n",
     ["[engine] max_num_seqs", "must not exceed"]),
    ("[run]\nseed = -1\n", ["[run] seed", "[0, 2**63)"]),
])
def test_a_bad_value_in_the_config_file_names_the_file_and_key(tmp_path, body, needles):
    """A value the config file gave wrongly is blamed on the file's table and key, not on
    an option the user never typed (found by tests/cli/test_hostile_properties.py)."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(body)
    out = tmp_path / "out"
    line = one_line_error(["run", "--config", str(cfg), "--num-requests", "20", "--out",
                           str(out)], str(cfg), *needles)
    assert "--" not in line.split(":")[1]
    assert not out.exists()


def test_the_same_bad_value_given_as_an_option_names_the_option(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[deployment]\nreplicas = 2\n")
    one_line_error(["run", "--config", str(cfg), "--replicas", "0", "--num-requests", "20",
                    "--out", str(tmp_path / "out")], "--replicas", "got 0")


def _limits_refusal(tmp_path, args: list[str], where: str) -> str:
    out = tmp_path / "out"
    line = one_line_error(["run", *args, "--num-requests", "3", "--out", str(out)])
    assert line.startswith(f"error: {where}: 8 is below max_num_seqs (256, ")
    assert not out.exists()
    return line


def test_too_few_batched_tokens_names_what_the_user_gave_not_max_num_seqs(tmp_path,
                                                                         no_simulation):
    """--max-num-batched-tokens 8 under the profile's 256 sequences: the error names the
    option given (not --max-num-seqs, which the user never typed) and comes before
    simulating; the 256 is the default profile's own [engine] max_num_seqs."""
    from dspark_sim.calibration.profile import load_profile

    assert load_profile("v4flash-h200").limits.max_num_seqs == 256
    line = _limits_refusal(tmp_path, ["--max-num-batched-tokens", "8"],
                           "--max-num-batched-tokens")
    assert "--max-num-seqs" not in line and "v4flash-h200" in line


def test_too_few_batched_tokens_in_a_config_file_names_its_key(tmp_path, no_simulation):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[engine]\nmax_num_batched_tokens = 8\n")
    line = _limits_refusal(tmp_path, ["--config", str(cfg)],
                           f"{cfg} [engine] max_num_batched_tokens")
    assert "--" not in line


def test_too_few_batched_tokens_from_a_preset_names_the_preset(tmp_path, monkeypatch,
                                                              no_simulation):
    from dataclasses import replace

    from dspark_sim.sim import config

    small = replace(config.PRESETS["tiny"], engine=config.EngineConfig(max_num_batched_tokens=8))
    monkeypatch.setitem(config.PRESETS, "small", small)
    _limits_refusal(tmp_path, ["--preset", "small"], "--preset small")
    # a limit the command line gives over the preset's is judged on its own
    cfg = config.resolve_config(preset_name="small", options={"max_num_seqs": 8})
    assert (cfg.engine.max_num_seqs, cfg.engine.max_num_batched_tokens) == (8, 8)


@pytest.mark.parametrize("args,needles", [
    (["--concurrency", "0"], ["--concurrency", "positive", "'0'"]),
    (["--seeds", "-1", "--qps", "1"], ["--seeds", "non-negative", "'-1'"]),
    (["--executor", "bogus", "--qps", "1"], ["--executor", "process, ray, serial", "'bogus'"]),
    (["--policies", "bogus", "--qps", "1"], ["--policies", "unknown policy 'bogus'"]),
    (["--basis", "median", "--qps", "1"], ["--basis", "steady, whole", "'median'"]),
    (["--target-rse", "1.5", "--qps", "1"], ["--target-rse", "[0, 1)", "1.5"]),
    (["--max-doublings", "-1", "--qps", "1"], ["--max-doublings", "non-negative", "-1"]),
    (["--requests-per-client", "-2", "--qps", "1"],
     ["--requests-per-client", "non-negative", "-2"]),
    (["--max-requests", "0", "--qps", "1"], ["--max-requests", "positive", "0"]),
])
def test_sweep_options(tmp_path, args, needles):
    out = tmp_path / "sw"
    one_line_error(["sweep", "--out", str(out), *args], *needles)
    assert not (out / "results.parquet").exists()


@pytest.mark.parametrize("option", ["--profiles", "--traces"])
def test_sweep_checks_profiles_and_traces_before_running(no_simulation, tmp_path, option):
    one_line_error(["sweep", "--out", str(tmp_path / "sw"), option, "no-such", "--qps", "1",
                    "--num-requests", "10", "--replicas", "1", "--executor", "serial"],
                   option, "no-such")


@pytest.mark.parametrize("args,needles", [
    (["--policies", ",,,"], ["--policies", "at least one policy", "',,,'"]),
    # given but empty was read as not given: the default profiles, traces, seeds and a
    # base-load sweep ran silently, and --sla '' was a TypeError after every point
    (["--policies", "", "--qps", "1"], ["--policies", "at least one policy"]),
    (["--qps", "1", "--profiles", ""], ["--profiles", "at least one profile", "''"]),
    (["--qps", "1", "--traces", " , "], ["--traces", "at least one trace"]),
    (["--qps", ""], ["--qps", "at least one value"]),
    (["--concurrency", ","], ["--concurrency", "at least one value"]),
    (["--qps", "1", "--seeds", ""], ["--seeds", "at least one value"]),
    (["--qps", "1", "--sla", " "], ["--sla", "at least one value"]),
    (["--concurrency", "1:1000000:1"], ["--concurrency", "'1:1000000:1'", "10,000 values"]),
    (["--qps", "1:1e12:1"], ["--qps", "'1:1e12:1'", "10,000 values"]),
    (["--qps", "1:2:x1.0000001"], ["--qps", "10,000 values"]),
    (["--qps", "1:1e400:1"], ["--qps", "'1:1e400:1'", "finite"]),
    (["--qps", "1", "--seeds", "1e30"], ["--seeds", "2**63", "'1e30'"]),
    (["--qps", "1:300:1", "--seeds", "0:400:1"], ["grid has 240,600 points", "100,000"]),
    (["--qps", "1", "--candidate", "fixed:9"], ["--candidate", "'fixed:9'", "mtp1, none"]),
    (["--qps", "1", "--baseline", "bogus"], ["--baseline", "'bogus'", "mtp1, none"]),
    (["--qps", "1", "--gpus", "0"], ["--gpus", "positive integer", "got 0"]),
    (["--qps", "1", "--vllm-results", "/no/such/dir"], ["--vllm-results", "/no/such/dir",
                                                         "not found"]),
    (["--qps", "1", "--lengths", "bogus"], ["--lengths", "'bogus'", "fixed:IN:OUT"]),
    (["--concurrency", "50000001"], ["--concurrency", "50,000,001", "limit"]),
])
def test_sweep_grid_and_headline_options_are_refused_before_any_point_runs(
        no_simulation, tmp_path, args, needles):
    """The sweep poked as the hostile-input suite pokes run: an empty list, a
    million-value range, a misspelt --candidate (which would drop the headline),
    --gpus 0 and a bad --lengths / --vllm-results are each one line before any point
    runs, not a traceback, a million points or an error after the points had run."""
    out = tmp_path / "sw"
    one_line_error(["sweep", "--out", str(out), "--policies", "mtp1,none", "--num-requests",
                    "10", "--executor", "serial", *args], *needles)
    assert not out.exists()


@pytest.mark.parametrize("args,needles", [
    (["--gamma-max", "4"], ["--gamma-max", "mtp1", "never reads it"]),
    (["--max-num-seqs", "0"], ["--max-num-seqs", "positive integer", "got 0"]),
    (["--kv-mode", "bogus"], ["--kv-mode", "preempt", "reserve", "'bogus'"]),
    (["--burstiness", "-1"], ["--burstiness", "positive number", "-1.0"]),
])
def test_sweep_and_run_refuse_a_shared_setting_alike(no_simulation, tmp_path, args, needles):
    """A setting the sweep shares with run is run's option, refused by the same rule in
    the same words: one a policy never reads (--gamma-max for mtp1), one out of range."""
    out = tmp_path / "sw"
    swept = one_line_error(["sweep", "--out", str(out), "--policies", "mtp1", "--qps", "1",
                            "--executor", "serial", *args], *needles)
    ran = one_line_error(["run", "--policy", "mtp1", "--qps", "1", *args], *needles)
    assert swept.replace("--policies", "--policy") == ran
    assert not out.exists()


def test_sweep_headline_names_match_by_alias(tmp_path):
    """--candidate is matched to the swept spec by the policy it names (an alias is the
    same policy), and the headline is printed for it."""
    out = tmp_path / "sw"
    r = runner.invoke(app, ["sweep", "--out", str(out), "--policies", "mtp1,fixed:3",
                            "--candidate", "FIXED:3", "--qps", "2", "--num-requests", "30",
                            "--executor", "serial", "--quiet"])
    assert r.exit_code == 0, r.output
    assert "fixed:3" in r.output and "vs mtp1" in r.output


@pytest.mark.parametrize("args,needles", [
    (["traces", "synth", "--kind", "bogus"], ["--kind", "iid, dspark or mtp1", "'bogus'"]),
    (["traces", "synth", "--kind", "iid", "--gamma", "0"], ["--gamma", ">= 1", "got 0"]),
    (["traces", "synth", "--kind", "iid", "--requests", "0"], ["--requests", ">= 1", "got 0"]),
    (["traces", "synth", "--kind", "mtp1", "--positions", "-2"], ["--positions", "got -2"]),
    # found poking synth as the hostile suite pokes run: a NaN or negative spread wrote a
    # trace of NaN (or order-flipped) confidences; --seed -1 was a numpy traceback
    (["traces", "synth", "--kind", "dspark", "--noise", "nan"], ["--noise", "finite", "nan"]),
    (["traces", "synth", "--kind", "dspark", "--noise", "-1"], ["--noise", ">= 0", "-1.0"]),
    (["traces", "synth", "--kind", "mtp1", "--overconfidence", "0"], ["--overconfidence", "> 0"]),
    (["traces", "synth", "--kind", "iid", "--seed", "-1"], ["--seed", "non-negative", "-1"]),
])
def test_traces_synth_options(tmp_path, args, needles):
    out = tmp_path / "t.parquet"
    one_line_error([*args, "--out", str(out)], *needles)
    assert not out.exists()


def test_traces_synth_checks_its_output_before_generating(tmp_path):
    # an unwritable --out was a FileNotFoundError traceback after the trace was built
    one_line_error(["traces", "synth", "--kind", "dspark", "--out", "/proc/t.parquet"],
                   "--out", "/proc")
    one_line_error(["traces", "synth", "--out", str(tmp_path)], "--out", "folder")


def test_inspect_profiles_and_calibrate(tmp_path):
    one_line_error(["traces", "inspect", "/no/such.parquet"], "/no/such.parquet", "not found")
    one_line_error(["profiles", "show", "no-such"], "argument 'name'", "unknown profile 'no-such'")
    out = tmp_path / "map.toml"
    base = ["calibrate", "confidence", "--trace", "dspark-synthetic", "--out", str(out)]
    one_line_error([*base, "--method", "bogus"], "--method", "temperature", "isotonic",
                   "'bogus'")
    one_line_error([*base, "--holdout", "1.5"], "--holdout", "[0, 1)", "1.5")
    one_line_error([*base, "--holdout", "nan"], "--holdout", "[0, 1)", "nan")
    one_line_error([*base, "--seed", "-1"], "--seed", "non-negative", "-1")  # was a traceback
    one_line_error([*base[:-1], "/proc/map.toml"], "--out", "/proc")  # was a traceback
    one_line_error([*base, "--html", "/proc/r.html"], "--html", "/proc")
    one_line_error(["calibrate", "confidence", "--trace", "/no/such.parquet", "--out", str(out)],
                   "/no/such.parquet", "not found")
    assert not out.exists()


@pytest.mark.parametrize("name,body,needles", [
    ("combined_x.jsonl", '{"id": "1", "prompt_token_ids": [1], "acc_eagle": {"acc_len": '
     '[1000000000000000000000000000000, 2]}}\n', ["line 1", "acc_eagle.acc_len", "2**31"]),
    ("combined_y.jsonl", '{"id": 100000000000000000000000, "prompt_token_ids": [1], '
     '"acc_eagle": {"acc_len": [1, 2]}}\n', ["line 1", "'id'", "int64"]),
    ("pp.jsonl", '{"request_id": 100000000000000000000000, "position": 0, "accept_len": 1}\n',
     ["line 1", "request_id", "int64"]),
    ("pp2.jsonl", '{"request_id": 1, "position": 0, "accept_len": 1, "prompt_tokens": '
     '100000000000000000000000}\n', ["line 1", "prompt_tokens", "2**31"]),
    ("pp.csv", "request_id,position,accept_len\n1,0,9000000000000000000\n",
     ["line 2", "accept_len", "2**31"]),
])
def test_imported_integers_past_int64_are_one_line_errors(tmp_path, name, body, needles):
    """JSON integers have no size limit: past int64 numpy overflowed with a traceback."""
    src = tmp_path / name
    src.write_text(body)
    fmt = "specdecode-bench" if name.startswith("combined") else "per-position"
    out = tmp_path / "t.parquet"
    one_line_error(["traces", "import", str(src), "--out", str(out), "--format", fmt],
                   str(src), *needles)
    assert not out.exists()


@pytest.mark.parametrize("args,needles", [
    (["--batch-requests", "0"], ["--batch-requests", ">= 1", "'0'"]),
    (["--verify-lengths", "1,-1"], ["--verify-lengths", ">= 0", "'1,-1'"]),
    (["--context-lengths", "x"], ["--context-lengths", "integers", "'x'"]),
    (["--warmup", "-1"], ["--warmup", ">= 0"]),
    (["--repeats", "0"], ["--repeats", ">= 1"]),
    (["--repeats", "1001"], ["--repeats", "limit of 1,000"]),  # timed for days before
    (["--warmup", "1001"], ["--warmup", "limit of 1,000"]),
    (["--device", "tpu"], ["--device", "cpu or cuda", "'tpu'"]),
    (["--out", "/proc/p.toml"], ["--out", "/proc"]),
    # SmolLM2-135M: 8,192 positions; 30 layers x 2 x 3 KV heads x 64 x 4 bytes per token
    # (these two read the default model's config: the capture install)
    pytest.param(["--context-lengths", "1000000000000"],
                 ["--context-lengths", "8,192 positions"], marks=pytest.mark.capture),
    pytest.param(["--batch-requests", "100000000"],
                 ["--batch-requests/--context-lengths", "100,000,000 requests x 520 positions",
                  "2,231,597.9 GiB"], marks=pytest.mark.capture),
])
def test_calibrate_engine_refuses_before_building_a_model(tmp_path, args, needles):
    """Each was a traceback (an allocator error after the model load, torch's device
    parser) or went on to measure; now one line before any model is built."""
    pytest.importorskip("torch")
    out = tmp_path / "p.toml"
    one_line_error(["calibrate", "engine", "--out", str(out), *args], *needles)
    assert not out.exists()


# Llama-3.1-70B's attention and vocabulary, 2,000 layers of a 65,536-wide MLP: ~7.6 T
# parameters, ~27.6 TiB in float32, more than any machine has free
HUGE_LLAMA = {"model_type": "llama", "hidden_size": 16384, "intermediate_size": 65536,
              "num_hidden_layers": 2000, "num_attention_heads": 128, "num_key_value_heads": 8,
              "vocab_size": 128256, "max_position_embeddings": 131072,
              "tie_word_embeddings": False}


def test_calibrate_engine_refuses_a_model_larger_than_free_memory(tmp_path, monkeypatch):
    """A 70B config.json on a CPU allocated random weights for a minute, then died with a
    73-line allocator traceback: the weights' size (parameters from the config's shapes
    x the dtype's bytes) is checked against free memory before any model is built."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from dspark_sim.calibration import measure

    def boom(*_a, **_k):
        raise AssertionError("a model was built before its size was checked")

    monkeypatch.setattr(measure, "_Runner", boom)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(HUGE_LLAMA))
    out = tmp_path / "p.toml"
    line = one_line_error(["calibrate", "engine", "--model", str(cfg), "--out", str(out)],
                          "--model", "config.json", "7,587.6 B parameters",
                          "28,265.9 GiB in float32", "GiB free")
    assert line.count("GiB") == 2
    assert not out.exists()


def test_model_parameters_are_counted_from_the_config_shapes():
    """Exact for dense decoders (untied and tied heads); a lower bound where experts or
    other parts the count leaves out are present (it must never refuse what fits)."""
    pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from dspark_sim.calibration.measure import estimate_parameters

    small = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
    for kind, extra, exact in [("llama", {}, True),
                               ("llama", {"tie_word_embeddings": True}, True),
                               ("qwen2", {"head_dim": 96}, False),  # Q/K/V biases
                               ("mixtral", {"num_local_experts": 4}, False),  # router
                               ("qwen2_moe", {"num_experts": 4, "moe_intermediate_size": 128,
                                              "shared_expert_intermediate_size": 384}, False)]:
        cfg = CONFIG_MAPPING[kind](**small, **extra)
        with torch.device("meta"):
            built = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
        n = estimate_parameters(cfg)
        assert (n == built) if exact else (0.95 * built <= n < built), (kind, extra, n, built)


def test_available_host_memory_is_memavailable_without_psutil(monkeypatch):
    """Free pages alone understate what a new allocation can get (the page cache is
    reclaimable): the KV and weight checks read MemAvailable."""
    from pathlib import Path

    from dspark_sim.calibration.measure import _available_host_bytes

    meminfo = Path("/proc/meminfo")
    if not meminfo.is_file():
        pytest.skip("no /proc/meminfo (not Linux)")
    monkeypatch.setitem(__import__("sys").modules, "psutil", None)
    kib = next(int(ln.split()[1]) for ln in meminfo.read_text().splitlines()
               if ln.startswith("MemAvailable:"))
    assert abs(_available_host_bytes() - kib * 1024) < 2**28  # it moves while we read


def test_an_output_that_is_the_commands_own_input_is_refused(tmp_path, monkeypatch):
    """`traces export T --out T` replaced the trace T with its JSON (and `traces import S
    --out S`, `calibrate confidence --trace T --out T` or `--html` = `--out`, `calibrate
    engine --sheet S --out S` the same): the output would destroy what the command reads or
    also writes. Refused in one line naming the option, the input byte-identical; through a
    symlink or a hard link too. A built-in trace name is not a file: an output of that name
    in the working folder is an ordinary output."""
    import os
    import shutil
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    trace = tmp_path / "t.parquet"
    shutil.copy(root / "traces" / "data" / "mtp1-synthetic.parquet", trace)
    src = tmp_path / "pp.jsonl"
    src.write_text('{"request_id": "a", "position": 0, "accept_len": 1}\n')
    sheet = tmp_path / "sheet.toml"
    shutil.copy(sorted((root / "calibration" / "data" / "sheets").glob("*.toml"))[0], sheet)
    (tmp_path / "link.parquet").symlink_to(trace)
    os.link(trace, tmp_path / "hard.parquet")
    before = {p: p.read_bytes() for p in (trace, src, sheet)}
    cases = [
        (["traces", "export", str(trace), "--out", str(trace)], "--out", "the trace"),
        (["traces", "export", str(trace), "--out", str(tmp_path / "link.parquet")],
         "--out", "the trace"),
        (["traces", "export", str(tmp_path / "hard.parquet"), "--out", str(trace)],
         "--out", "the trace"),
        (["traces", "import", str(src), "--format", "per-position", "--out", str(src)],
         "--out", "the source file"),
        (["calibrate", "confidence", "--trace", str(trace), "--out", str(trace)],
         "--out", "the trace"),
        (["calibrate", "confidence", "--trace", "mtp1-synthetic", "--out",
          str(tmp_path / "m.toml"), "--html", str(tmp_path / "m.toml")], "--html", "--out"),
        (["calibrate", "engine", "--sheet", str(sheet), "--out", str(sheet)],
         "--out", "the --sheet"),
    ]
    for args, option, what in cases:
        line = one_line_error(args, f"error: {option}: ", f"is also {what}")
        assert "choose another file" in line
    assert {p: p.read_bytes() for p in before} == before
    assert not (tmp_path / "m.toml").exists()
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, ["traces", "export", "mtp1-synthetic", "--out", "mtp1-synthetic"])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "mtp1-synthetic").read_text())["num_speculative_tokens"] == 1


def test_calibrate_confidence_with_string_request_ids_and_its_two_outputs(tmp_path,
                                                                         monkeypatch):
    """String request ids are schema-v1 (imports keep them): the held-out report keeps
    them as strings (cast to int, 'r0' is a ValueError and '0' matches none of the
    held-out requests). Both files are written; and when the diagram refuses, --out
    keeps its previous bytes."""
    import polars as pl
    import pyarrow.parquet as pq

    from dspark_sim.calibration import fit
    from dspark_sim.calibration.confmap import load_calibration
    from dspark_sim.errors import InputError
    from dspark_sim.traces.schema import write_trace
    from dspark_sim.traces.synth import synth_drafter

    good = tmp_path / "good.parquet"
    write_trace(synth_drafter(gamma=3, requests_per_domain=4, positions=24, seed=1), good)
    table = pq.read_table(good)
    for ids in ("r", ""):  # 'r0', 'r1', ... and '0', '1', ... (digits, still strings)
        trace = tmp_path / f"ids{ids}.parquet"
        df = pl.from_arrow(table).with_columns(pl.lit(ids) + pl.col("request_id").cast(pl.String))
        pq.write_table(df.to_arrow().replace_schema_metadata(table.schema.metadata), trace)
        out, html = tmp_path / f"m{ids}.toml", tmp_path / f"r{ids}.html"
        r = runner.invoke(app, ["calibrate", "confidence", "--trace", str(trace), "--out",
                                str(out), "--html", str(html), "--holdout", "0.5"])
        assert r.exit_code == 0, r.output
        assert load_calibration(out).method == "temperature"
        assert "Plotly.newPlot" in html.read_text()
    out.write_bytes(b"previous map")

    def refuse(*_a, **_k):
        raise InputError("diagram", "refused")

    monkeypatch.setattr(fit, "write_reliability_html", refuse)
    one_line_error(["calibrate", "confidence", "--trace", str(good), "--out", str(out),
                    "--html", str(html)], "diagram")
    assert out.read_bytes() == b"previous map"


@pytest.mark.parametrize("command,entry,kind", [
    ("run", "summary.json", "dir"), ("run", "requests.parquet", "dir"),
    ("sweep", "results.parquet", "dir"), ("sweep", "report.html", "dir"),
    ("sweep", "points", "file"),
])
def test_an_output_folder_holding_the_wrong_kind_of_entry_is_refused_first(
        no_simulation, tmp_path, command, entry, kind):
    """A folder where the command writes a file (or a file where it writes its points/
    folder) failed the final rename with IsADirectoryError / FileExistsError: a traceback
    after every point had run. Refused before simulating, naming --out and the entry;
    the entry and the folder's other files untouched."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("keep")
    if kind == "dir":
        (out / entry).mkdir()
    else:
        (out / entry).write_text("not a folder")
    args = {"run": ["run", "--num-requests", "5", "--quiet", "--out", str(out)],
            "sweep": ["sweep", "--out", str(out), "--policies", "mtp1", "--qps", "1",
                      "--executor", "serial", "--quiet"]}[command]
    one_line_error(args, "--out", str(out / entry))
    assert sorted(p.name for p in out.iterdir()) == sorted([entry, "keep.txt"])
    assert (out / entry).is_dir() == (kind == "dir")
