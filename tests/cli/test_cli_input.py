"""Hostile and conflicting input at the command line: one line
naming the option or file, exit code 2, no traceback, and nothing simulated first."""

from __future__ import annotations

import json

import polars as pl
import pytest
from input_checks import one_line_error
from typer.testing import CliRunner

from dspark_sim.cli import app

runner = CliRunner()
SMALL = ["--num-requests", "40", "--replicas", "1", "--qps", "20", "--quiet"]


def invoke(*args: str):
    return runner.invoke(app, list(args))


@pytest.mark.parametrize("args,needles", [
    (["--seed", "-1"], ["--seed"]),
    (["--num-requests", "1e9"], ["--num-requests"]),  # typer cannot parse it: still one line
    (["--num-requests", "1000000000"], ["--num-requests", "limit"]),
    (["--max-num-batched-tokens", "1000000000"], ["--max-num-batched-tokens", "limit"]),
    (["--max-num-seqs", "100000000"], ["--max-num-seqs", "limit"]),
    (["--replicas", "100000"], ["--replicas", "limit"]),
    (["--qps", "1e-300"], ["--qps", "clock"]),
    (["--burstiness", "1e-320"], ["--burstiness"]),
    (["--qps", "0.001", "--duration-s", "1"], ["--qps", "--duration-s", "none"]),
    (["--qps", "nan"], ["--qps"]),
    (["--qps", "5", "--max-concurrency", "4"], ["--qps", "--max-concurrency"]),
    (["--max-concurrency", "4", "--burstiness", "2"], ["--burstiness", "closed"]),
    (["--max-concurrency", "4", "--num-requests", "8", "--duration-s", "5"], ["--duration-s"]),
    (["--policy", "fixed:1000"], ["--policy", "gamma_max = 7"]),
    (["--lengths", "fixed:10:1000000000000"], ["--lengths"]),
    (["--slo", "ttft:inf"], ["--slo"]),
    (["--slo", "tpot:5,TPOT:6"], ["--slo", "tpot given twice"]),  # kept the last
    # given but empty was read as not given: the default lengths, trace, preset, no SLO
    (["--slo", ""], ["--slo", "ttft:MS,tpot:MS"]),
    (["--lengths", ""], ["--lengths", "empty"]),
    (["--trace", " "], ["--trace", "empty"]),
    (["--mtp-trace", ""], ["--mtp-trace", "empty"]),
    (["--domain", ""], ["--domain", "empty"]),
    (["--calibration", ""], ["--calibration", "empty"]),  # the error named no option
    (["--policy-profile", ""], ["--policy-profile", "empty"]),  # it named --profile
    (["--preset", ""], ["--preset", "empty"]),
    (["--no-such-option"], ["--no-such-option"]),
])
def test_bad_options_are_refused_before_simulating(no_simulation, args, needles):
    one_line_error(invoke("run", *args), *needles)


def test_an_echoed_huge_value_is_shortened(no_simulation):
    """The line names the option and the problem, not 100,000 characters of the value."""
    spec = "x" * 99_990 + "tail:1"
    echoed = f"'{spec}';"  # the word the error holds: quoted, then a semicolon
    line = one_line_error(invoke("run", "--policy", spec), "--policy", "unknown policy",
                          f"({len(echoed):,} characters)", "xxtail:1';", "known: ",
                          "none, ")
    assert len(line) < 1_000, len(line)



def test_unusable_out_is_found_before_simulating(no_simulation, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("keep me")
    one_line_error(invoke("run", "--out", str(a_file)), "--out", "not a folder")
    one_line_error(invoke("run", "--out", str(a_file / "sub")), "--out", "not a folder")
    one_line_error(invoke("run", "--out", "/proc/dspark-out"), "--out")
    assert a_file.read_text() == "keep me"
    one_line_error(invoke("sweep", "--out", str(a_file), "--qps", "1"), "--out")


@pytest.mark.parametrize("args", [
    ["traces", "synth", "--requests", "2", "--positions", "8"],
    ["traces", "export", "mtp1-synthetic"],
    ["calibrate", "confidence", "--trace", "mtp1-synthetic"],
    ["run", "--num-requests", "3", "--replicas", "1"],
    ["sweep", "--qps", "1", "--policies", "fixed:1"],
], ids=["synth", "export", "calibrate", "run", "sweep"])
def test_an_out_that_is_a_device_or_pipe_is_refused(no_simulation, tmp_path, args):
    """A write renames a temporary file onto the path, which replaced a device node itself:
    --out /dev/full became a regular file holding the trace (as root, /dev/null would
    too). A FIFO stands in for the device here; the run folder's summary.json and the
    sweep's results.parquet are checked the same way."""
    import os
    import stat

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    out = fifo
    if args[0] in ("run", "sweep"):
        out = tmp_path / "o"
        out.mkdir()
        os.symlink(fifo, out / ("summary.json" if args[0] == "run" else "results.parquet"))
    one_line_error(invoke(*args, "--out", str(out)), "--out", "not a regular file")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_atomic_writes_never_replace_a_device_or_pipe(tmp_path):
    import os

    from dspark_sim.errors import InputError
    from dspark_sim.io import write_text_atomic

    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(InputError, match="pipe: not a regular file"):
        write_text_atomic(tmp_path / "pipe", "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


@pytest.mark.parametrize("command", ["run", "sweep"])
def test_an_error_naming_a_file_keeps_the_files_name(tmp_path, command):
    """Re-addressing errors to the config file's key must leave one that names a file
    alone: a path is not an option, even one with a folder called 'workload' in it."""
    bad = tmp_path / "workload" / "trace" / "w.csv"
    bad.parent.mkdir(parents=True)
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,10,5\n")
    cfg = _write_config(tmp_path, f'[workload]\nworkload_path = "{bad}"\n')
    extra = ["--concurrency", "2", "--executor", "serial", "--out", str(tmp_path / "sw")] \
        if command == "sweep" else []
    one_line_error(invoke(command, "--config", str(cfg), "--quiet", *extra),
                   f"error: {bad}: unparseable value in data row 1")


def test_run_that_draws_no_request_says_so(tmp_path):
    # 1.5 expected arrivals pass the up-front check, but seed 4's first Poisson gap at
    # 1 req/s is 3.8 s (numpy's Generator, drawn first): nothing arrives in the 1.5 s
    # window, and the run says so instead of reporting an empty "stable" run.
    one_line_error(invoke("run", "--qps", "1", "--duration-s", "1.5", "--replicas", "1",
                          "--seed", "4", "--out", str(tmp_path / "o")), "no request arrived")
    assert not (tmp_path / "o").exists()


def _write_config(tmp_path, text: str):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


def test_config_file_beats_defaults_and_flags_beat_the_file(tmp_path):
    cfg = _write_config(tmp_path, '[run]\npolicy = "mtp1"\nseed = 7\n'
                        '[workload]\nnum_requests = 30\nqps = 10\n[deployment]\nreplicas = 1\n')
    out = tmp_path / "a"
    r = invoke("run", "--config", str(cfg), "--out", str(out), "--quiet")
    assert r.exit_code == 0, r.output
    s = json.loads((out / "summary.json").read_text())
    assert (s["policy"], s["seed"], s["completed"], s["replicas"]) == ("mtp1", 7, 30, 1)
    out = tmp_path / "b"
    r = invoke("run", "--config", str(cfg), "--seed", "3", "--policy", "fixed:2",
               "--out", str(out), "--quiet")
    assert r.exit_code == 0, r.output
    s = json.loads((out / "summary.json").read_text())
    assert (s["policy"], s["seed"], s["completed"]) == ("fixed:2", 3, 30)


def test_preset_flag_beats_the_files_preset(tmp_path):
    cfg = _write_config(tmp_path, 'preset = "single-replica"\n[workload]\nnum_requests = 20\n')
    out = tmp_path / "a"
    assert invoke("run", "--config", str(cfg), "--out", str(out), "--quiet").exit_code == 0
    assert "closed loop, 64 clients" in json.loads((out / "summary.json").read_text())["workload"]
    out = tmp_path / "b"
    assert invoke("run", "--config", str(cfg), "--preset", "tiny", "--out", str(out),
                  "--quiet").exit_code == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["workload"].startswith("Poisson arrivals at 20 req/s") and s["completed"] == 20


@pytest.mark.parametrize("command", ["run", "sweep"])
@pytest.mark.parametrize("text,needles", [
    # mistyped or out of range: refused when the file is read
    ('[run]\nseed = "abc"\n', ["[run] seed", "integer"]),
    ("[run]\nseed = 1.5\n", ["[run] seed", "integer"]),
    ("[workload]\nnum_requests = true\n", ["num_requests", "integer"]),
    ("[workload]\nlengths = 5\n", ["lengths", "string"]),
    ('[workload]\nqps = "fast"\n', ["qps", "number"]),
    ('[engine]\nmax_num_seqz = 3\n', ["[engine]", "unknown key", "max_num_seqz"]),
    ('[bogus]\nx = 1\n', ["unknown table"]),
    ('preset = 3\n', ["preset"]),
    ('[workload]\narrival = "closed"\nqps = 5.0\n', ["qps", "closed"]),
    # an empty string was read as not given: the default lengths and trace ran
    ('[workload]\nlengths = ""\n', ["[workload] lengths", "empty"]),
    ('[run]\ntrace = " "\n', ["[run] trace", "empty"]),
    # an unknown arrival kind was a KeyError traceback; the keys no option sets were
    # blamed on options that do not exist (--drain-timeout-s, --max-engine-steps) or
    # were not typed (--slo)
    ('[workload]\narrival = "bogus"\n', ["[workload] arrival", "one of", "'bogus'"]),
    ("[run]\ndrain_timeout_s = nan\n", ["[run] drain_timeout_s", "positive"]),
    ("[run]\nmax_engine_steps = 0\n", ["[run] max_engine_steps", "positive integer"]),
    ("[run]\nslo_tpot_ms = -1.0\n", ["[run] slo_tpot_ms", "positive"]),
    # found bad only when loaded (a policy, profile, trace, domain, length spec, preset),
    # which run does as it starts simulating: the value was blamed on the option
    # (--policy, --profile, ...) the user never typed
    ('[run]\npolicy = "bogus"\n', ["[run] policy", "unknown policy"]),
    ('[deployment]\nprofile = "nosuch"\n', ["[deployment] profile", "unknown profile"]),
    ('[run]\ntrace = "nosuch"\n', ["[run] trace", "unknown trace"]),
    ('[workload]\ndomain = "nosuch"\n', ["[workload] domain", "no requests of domain"]),
    ('[workload]\nlengths = "bogus"\n', ["[workload] lengths", "bad length spec"]),
    ('preset = "nosuch"\n', [" preset: unknown preset"]),
])
def test_a_bad_config_value_names_the_files_key(request, tmp_path, command, text, needles):
    """One line naming the file, its table and key, from `run` and from `sweep` (which
    reads the same file as its base); a value mistyped in the file before anything runs."""
    if "unknown" not in needles[-1] and "no requests" not in needles[-1] \
            and "bad length" not in needles[-1]:
        request.getfixturevalue("no_simulation")
    cfg = _write_config(tmp_path, text)
    needles = [str(cfg), *needles]
    extra = ["--qps", "5", "--executor", "serial", "--out", str(tmp_path / "sw")] \
        if command == "sweep" else []
    if command == "sweep" and "policy =" in text:
        extra += ["--policies", "bogus-too"]  # sweep's --policies replaces [run] policy
        needles = ["--policies", "unknown policy 'bogus-too'"]
    one_line_error(invoke(command, "--config", str(cfg), "--num-requests", "5", "--quiet",
                          *extra), *needles)


@pytest.mark.parametrize("file_workload,flag,described,completed", [
    # a rate flag opens the file's closed loop: the flag, typed last, wins
    ('arrival = "closed"\nnum_requests = 10\n', ["--qps", "5"],
     "Poisson arrivals at 5 req/s", 10),
    # --max-concurrency closes the file's open loop; the file's rate no longer applies
    ("qps = 5.0\nnum_requests = 12\n", ["--max-concurrency", "3"], "closed loop, 3 clients", 12),
])
def test_an_arrival_flag_overrides_the_files_arrival_kind(tmp_path, file_workload, flag,
                                                          described, completed):
    # explicit flag > config file, the arrival kind included
    cfg = _write_config(tmp_path, f"[workload]\n{file_workload}[deployment]\nreplicas = 1\n")
    out = tmp_path / "o"
    r = invoke("run", "--config", str(cfg), *flag, "--out", str(out), "--quiet")
    assert r.exit_code == 0, r.output
    s = json.loads((out / "summary.json").read_text())
    assert described in s["workload"] and s["completed"] == completed


def test_workload_file_in_a_closed_loop_sends_the_files_requests(tmp_path):
    lengths = [(5, 3), (40, 9), (7, 21), (120, 2), (16, 16), (3, 30)]
    wl = tmp_path / "w.jsonl"
    wl.write_text("".join(json.dumps({"timestamp": 1000 * (9 - i), "input_length": p,
                                      "output_length": o}) + "\n"
                          for i, (p, o) in enumerate(lengths)))
    out = tmp_path / "o"
    r = invoke("run", "--workload", str(wl), "--max-concurrency", "2", "--replicas", "1",
               "--out", str(out), "--quiet")
    assert r.exit_code == 0, r.output
    s = json.loads((out / "summary.json").read_text())
    assert "closed loop, 2 clients" in s["workload"] and "w.jsonl" in s["workload"]
    req = pl.read_parquet(out / "requests.parquet").sort("request_id")
    # in the order the file issued them (timestamp order; here the lines run backwards)
    sent = lengths[::-1]
    assert list(zip(req["prompt_tokens"], req["output_tokens"], strict=True)) == sent
    assert req["finished"].all()
    # a closed loop of 2 clients: the first two start at t = 0, the rest when one finishes
    arr = req["arrival_s"].to_list()
    assert arr[:2] == [0.0, 0.0] and all(a > 0 for a in arr[2:])
    # --num-requests takes the file's first N
    out2 = tmp_path / "o2"
    r = invoke("run", "--workload", str(wl), "--max-concurrency", "2", "--num-requests", "4",
               "--replicas", "1", "--out", str(out2), "--quiet")
    assert r.exit_code == 0, r.output
    req = pl.read_parquet(out2 / "requests.parquet").sort("request_id")
    assert req["prompt_tokens"].to_list() == [p for p, _ in sent[:4]]


@pytest.fixture
def no_model_load(monkeypatch):
    """Fails the test if a target model starts loading: checks must come first.
    Its tests carry the ``capture`` marker: the commands check the default target's
    package and the model stack among their arguments, so without the capture install
    they refuse that instead of the argument under test."""
    pytest.importorskip("torch")
    from dspark_sim.traces import targets

    def boom(*_a, **_k):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(targets, "_load_gguf", boom)
    monkeypatch.setattr(targets, "_load_dir", boom)


# what each model-loading command needs besides --out and the argument under test
LOADING_BASE = {"capture": ["--drafters", "lookup"], "validate": []}


@pytest.mark.parametrize("command,args,needles", [
    ("capture", ["--drafters", "bogus"], ["--drafters", "bogus"]),
    ("capture", ["--drafters", "mtp1,nope"], ["--drafters", "nope"]),
    ("capture", ["--drafters", "deepspec:/no/such/dir"], ["--drafters", "/no/such/dir"]),
    ("capture", ["--target", "/no/such/model"], ["--target"]),
    ("capture", ["--device", "tpu"], ["--device"]),
    ("capture", ["--gamma-max", "0"], ["--gamma-max"]),
    ("capture", ["--max-new-tokens", "1"], ["--max-new-tokens"]),
    ("capture", ["--max-new-tokens", "32769"], ["--max-new-tokens", "limit of 32,768"]),
    ("capture", ["--prompts", "/no/such/prompts"], ["--prompts"]),
    ("validate", ["--drafter", "bogus"], ["--drafter", "bogus"]),
    ("validate", ["--profile", "no-such-profile"], ["--profile"]),
    ("validate", ["--profile", "insitu"], ["--profile", "insitu"]),
    ("validate", ["--clock", "sundial"], ["--clock"]),
    ("validate", ["--device", "tpu"], ["--device"]),
    ("validate", ["--num-requests", "0"], ["--num-requests"]),
    ("validate", ["--sim-seeds", "0"], ["--sim-seeds"]),
    ("validate", ["--rates", "0.5,-1"], ["--rates"]),
    # an empty list was tuple(None), a TypeError traceback; the registry's refusal named
    # run's --policy
    ("capture", ["--drafters", ","], ["--drafters", "at least one"]),
    ("validate", ["--policies", ""], ["--policies", "at least one"]),
    ("validate", ["--rates", " "], ["--rates", "at least one"]),
    ("validate", ["--profile", ","], ["--profile", "at least one"]),
    ("validate", ["--policies", "mtp1,bogus"], ["error: --policies:", "bogus"]),
    # no caps: an absurd value served (or slept) for days instead of failing
    ("validate", ["--num-requests", "1001"], ["--num-requests", "limit of 1,000"]),
    ("validate", ["--rates", "0.001"], ["--rates", "0.001 req/s", "[0.01, 1000]"]),
    ("validate", ["--rates", "0.5,1e6"], ["--rates", "1e+06 req/s", "[0.01, 1000]"]),
    ("validate", ["--rates", "1:17:1"], ["--rates", "17 rates", "limit of 16"]),
    ("validate", ["--sim-seeds", "101"], ["--sim-seeds", "limit of 100"]),
    ("validate", ["--max-new-tokens", "1000000"], ["--max-new-tokens", "limit of 32,768"]),
])
@pytest.mark.capture
def test_model_loading_commands_check_every_argument_first(no_model_load, tmp_path, command,
                                                            args, needles):
    one_line_error(invoke(command, "--out", str(tmp_path / command), *LOADING_BASE[command],
                          *args), *needles)


@pytest.mark.capture
def test_out_and_train_arguments_checked_first(no_model_load, tmp_path):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    for command, base in LOADING_BASE.items():
        one_line_error(invoke(command, "--out", str(a_file), *base), "--out")
    one_line_error(invoke("train-drafter", "--drafter", "bogus"), "--drafter")
    one_line_error(invoke("train-drafter", "--steps", "0"), "--steps")
    one_line_error(invoke("train-drafter", "--steps", "100001"), "--steps", "limit of 100,000")
    one_line_error(invoke("train-drafter", "--target", "/no/such"), "--target")
    one_line_error(invoke("train-drafter", "--device", "gpu"), "--device")
    one_line_error(invoke("train-drafter", "--out", str(a_file)), "--out")


@pytest.mark.capture
def test_caps_are_in_the_help_and_the_largest_allowed_value_passes(no_model_load, tmp_path):
    import typer

    from dspark_sim.calibration.measure import MAX_TIMED_PASSES
    from dspark_sim.traces.capture import MAX_NEW_TOKENS
    from dspark_sim.traces.train import MAX_TRAIN_STEPS, check_steps
    from dspark_sim.validation import harness as h

    def helps(command):
        return {p.opts[0]: p.help for p in typer.main.get_command(app).commands[command].params}

    v = helps("validate")
    lo, hi = h.RATE_RANGE
    assert f"at most {h.MAX_RATES}, each in [{lo:g}, {hi:g}]" in v["--rates"]
    for opt, cap in (("--num-requests", h.MAX_REQUESTS), ("--sim-seeds", h.MAX_SIM_SEEDS),
                     ("--max-new-tokens", MAX_NEW_TOKENS)):
        assert f"at most {cap:,}" in v[opt], (opt, v[opt])
    assert f"at most {MAX_TRAIN_STEPS:,}" in helps("train-drafter")["--steps"]
    assert f"at most {MAX_NEW_TOKENS:,}" in helps("capture")["--max-new-tokens"]
    engine = {p.opts[0]: p.help for p in
              typer.main.get_command(app).commands["calibrate"].commands["engine"].params}
    for opt in ("--warmup", "--repeats"):
        assert f"at most {MAX_TIMED_PASSES:,}" in engine[opt], (opt, engine[opt])
    # the caps themselves are allowed (a > vs >= slip would refuse them)
    check_steps(MAX_TRAIN_STEPS)
    h.ValidationSetup(rates=(lo, hi) + (1.0,) * (h.MAX_RATES - 2), num_requests=h.MAX_REQUESTS,
                      max_new_tokens=MAX_NEW_TOKENS, sim_seeds=h.MAX_SIM_SEEDS,
                      out_dir=tmp_path / "v", profiles=("smollm2-cpu",)).check()


@pytest.mark.parametrize("command", ["capture", "train-drafter"])
@pytest.mark.parametrize("body,needle", [
    (b"\xff\xfe\x00binary", "not UTF-8"),
    (b'{"turns": 5}\n', "non-empty list of strings"),  # was a TypeError traceback
    (b'{"turns": "What is 2+2?"}\n', "non-empty list of strings"),  # was split into chars
    (b'{"turns": []}\n', "non-empty list of strings"),
    (b'{"turns": [1, 2]}\n', "non-empty list of strings"),
    (b'{"turn": ["x"]}\n', "turns"),
    (None, "cannot read"),  # a folder named gsm8k.jsonl: IsADirectoryError
    (b"\n  \n", "no prompt in the file"),  # train-drafter: torch.cat raised, target loaded
])
@pytest.mark.capture
def test_prompt_files_are_read_before_a_model_loads(no_model_load, tmp_path, command, body,
                                                    needle):
    """Capture and training read their prompt files only after loading the target (and
    training after generating from it): a bad line was a traceback, or a one-line error
    minutes late. Now one line naming the file, before any model loads."""
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    bad = prompts / "gsm8k.jsonl"
    if body is None:
        bad.mkdir()
    else:
        bad.write_bytes(body)
    args = {"capture": ["--drafters", "lookup"], "train-drafter": []}[command]
    one_line_error(invoke(command, "--out", str(tmp_path / "o"), "--prompts", str(prompts),
                          *args), str(bad), needle)
    assert not (tmp_path / "o").exists()


@pytest.mark.capture
def test_train_drafter_refuses_a_negative_seed_before_the_model_loads(no_model_load, tmp_path):
    # default_rng(-1) raised only after the target had loaded and generated its data
    one_line_error(invoke("train-drafter", "--out", str(tmp_path / "o"), "--seed", "-1"),
                   "--seed")


@pytest.mark.parametrize("body,needle", [
    ("method = 'isotonic'\n[[calibration.isotonic]]\nx = [0.0, nan, 1.0]\ny = [0.0, 0.5, 1.0]\n",
     "finite"),
    ("method = 'isotonic'\n[[calibration.isotonic]]\nx = [0.0, 0.5, inf]\ny = [0.0, 0.5, 1.0]\n",
     "finite"),
    ("method = 'isotonic'\n[[calibration.isotonic]]\nx = [0.0, 0.7, 0.5]\ny = [0.0, 0.5, 1.0]\n",
     "non-decreasing"),
    ("method = 'isotonic'\n[[calibration.isotonic]]\nx = [0.0, 0.5, 1.0]\ny = [0.0, 0.9, 0.5]\n",
     "non-decreasing"),
    ("method = 'isotonic'\n[[calibration.isotonic]]\nx = [0.0, 1.0]\ny = [0.0, 1.5]\n", "[0, 1]"),
    ("method = 'isotonic'\n[[calibration.isotonic]]\nx = ['a', 'b']\ny = [0.0, 1.0]\n",
     "list of numbers"),
    ("method = 'isotonic'\nisotonic = [1, 2]\n", "rows"),
    ("method = 'temperature'\ntemperatures = ['hot']\n", "list of numbers"),
    ("method = 'temperature'\ntemperatures = [1.0, nan]\n", "positive"),
    ("method = 'temperature'\ntemperatures = 2.0\n", "list of numbers"),
    ("method = 'temperature'\ndrafter = 5\ntemperatures = [1.0]\n", "drafter"),
    ("method = 'magic'\n", "method"),
])
def test_bad_calibration_maps_are_one_line_errors(tmp_path, body, needle):
    from dspark_sim.calibration.confmap import load_calibration
    from dspark_sim.errors import InputError

    p = tmp_path / "map.toml"
    p.write_text("[calibration]\n" + body)
    with pytest.raises(InputError) as err:
        load_calibration(p)
    assert str(p) in str(err.value) and needle in str(err.value), str(err.value)
    one_line_error(invoke("run", *SMALL, "--calibration", str(p)), str(p), needle)


def test_good_isotonic_map_loads_and_interpolates(tmp_path):
    from dspark_sim.calibration.confmap import load_calibration

    p = tmp_path / "map.toml"
    p.write_text("[calibration]\nmethod = 'isotonic'\n[[calibration.isotonic]]\n"
                 "x = [0, 0.5, 1]\ny = [0.0, 0.2, 0.9]\n")  # integer knots are numbers too
    m = load_calibration(p)
    # piecewise linear: 0.25 -> 0.1, 0.75 -> 0.55; every position reuses the one row
    assert m.apply([[0.25, 0.75]])[0].tolist() == pytest.approx([0.1, 0.55])


def test_user_text_is_printed_verbatim():
    # rich would turn ":100:" into an emoji; the option must read back as given
    one_line_error(invoke("run", "--lengths", "lognormal:100:100:1000"), "lognormal:100:100:1000",
                   "sigma")


def test_wide_lognormal_lengths_are_capped_not_garbage(tmp_path):
    out = tmp_path / "o"
    r = invoke("run", "--lengths", "lognormal:1000000:3:4", "--num-requests", "30",
               "--replicas", "1", "--out", str(out), "--quiet")
    assert r.exit_code == 0, r.output
    req = pl.read_parquet(out / "requests.parquet")
    assert req["prompt_tokens"].min() >= 1 and req["prompt_tokens"].max() <= 1 << 24
    assert req["output_tokens"].min() >= 1
    # and the bounds are reached, not just respected: P(1e6 e^(4Z) > 2^24) = P(Z > 0.70)
    # ~ 0.24 of the prompts sit at the cap, P(3 e^(4Z) < 1.5) ~ 0.43 of the outputs at 1
    # (the seeded 30 draws: 10 and 13), and the rest lie between
    capped = (req["prompt_tokens"] == 1 << 24).sum()
    floored = (req["output_tokens"] == 1).sum()
    assert 3 <= capped <= 15 and 6 <= floored <= 20, (capped, floored)


def test_sweep_refuses_a_fixed_k_the_drafter_cannot_draft(no_simulation, tmp_path):
    one_line_error(invoke("sweep", "--out", str(tmp_path / "sw"), "--policies", "mtp1,fixed:9",
                          "--qps", "1", "--executor", "serial"), "--policies", "gamma_max = 7")
    assert not (tmp_path / "sw" / "results.parquet").exists()


def _path_parameters():
    """(command words, flag or None for an argument, name) of every Path-typed option and
    argument of every command, read from the app itself: a new one is covered too."""
    import typing
    from pathlib import Path

    import typer

    found = []

    def walk(cmd, words):
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, [*words, name])
        if getattr(cmd, "commands", None):
            return
        by_name = {p.name: p for p in cmd.params}
        for name, hint in typing.get_type_hints(cmd.callback).items():
            if hint is Path or Path in typing.get_args(hint):
                opts = by_name[name].opts
                found.append((words, opts[0] if opts[0].startswith("--") else None, name))

    walk(typer.main.get_command(app), [])
    return found


PATH_PARAMETERS = _path_parameters()


@pytest.mark.parametrize("args,needles", [
    (["calibrate", "confidence", "--trace", "", "--out", "m.toml"],
     ["--trace", "empty trace name or path"]),
    # Path("") is the current folder: the error named "." ("directory holds neither ...")
    pytest.param(["calibrate", "engine", "--model", " ", "--out", "p.toml"],
                 ["--model", "empty model path or name"], marks=pytest.mark.capture),
    # positional: the loaders' checks named --trace / --profile, options not typed here
    (["traces", "inspect", ""], ["'trace'", "empty name"]),
    (["traces", "export", " ", "--out", "x.json"], ["'trace'", "empty name"]),
    (["profiles", "show", ""], ["'name'", "empty name"]),
    (["traces", "inspect", "no-such"], ["argument 'trace'", "unknown trace 'no-such'"]),
    (["traces", "export", "no-such", "--out", "x.json"],
     ["argument 'trace'", "unknown trace 'no-such'"]),
])
def test_an_empty_or_unknown_name_is_refused_naming_where_it_was_given(
        tmp_path, monkeypatch, args, needles):
    # Path("") is the current folder: the error named "." ("trace file not found")
    monkeypatch.chdir(tmp_path)
    line = one_line_error(invoke(*args), *needles)
    if args[0] != "calibrate":
        assert "--trace" not in line and "--profile" not in line
    assert list(tmp_path.iterdir()) == []


def test_every_output_option_is_among_the_path_parameters():
    outs = {" ".join(w) for w, flag, _ in PATH_PARAMETERS if flag == "--out"}
    assert outs >= {"run", "sweep", "capture", "validate", "train-drafter", "traces synth",
                    "traces import", "traces export", "calibrate engine",
                    "calibrate confidence"}, outs


@pytest.mark.parametrize("words,flag,name", PATH_PARAMETERS,
                         ids=[f"{' '.join(w)} {f or n}" for w, f, n in PATH_PARAMETERS])
@pytest.mark.parametrize("empty", ["", " "])
def test_an_empty_path_is_refused_not_read_as_the_current_folder(
        no_simulation, tmp_path, monkeypatch, words, flag, name, empty):
    # typer made --out '' Path('.'): run and sweep wrote their outputs into the current
    # folder, capture and validate loaded a model to write there
    monkeypatch.chdir(tmp_path)
    given = [flag, empty] if flag else [empty]
    one_line_error(invoke(*words, *given), flag or name, "empty path")
    assert list(tmp_path.iterdir()) == []
