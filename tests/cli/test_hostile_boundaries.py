"""Hostile input at the tool's boundaries, each class pinned where it enters:

* file-system errors on a path option or a file the tool writes (a name past the file
  system's limit, a disk that fills half-way, an existing sub-folder that refuses a
  write): one checker up front, one line for the rest, no file lost or half-written;
* a roofline sheet's HF model config with fields missing, zero or of the wrong type;
* integers a 64-bit column cannot hold (10**400 in JSON or TOML, uint64 >= 2**63 in a
  parquet trace) and digits ``int()`` refuses (``'²'``);
* a column name given twice (CSV, parquet);
* options the command would silently ignore (``--gamma-max`` with ``mtp1``, ``--alpha``
  with ``--kind dspark``, ``--replay-qps`` over one instant);

then Hypothesis' draws at the same boundaries.
"""

from __future__ import annotations

import errno
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from dspark_sim.cli import app
from dspark_sim.errors import InputError, is_decimal
from dspark_sim.io import check_writable, loads_json, loads_toml, path_too_long
from dspark_sim.traces.schema import read_trace, write_trace
from dspark_sim.traces.synth import synth_iid

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "traces" / "data" / "mtp1-synthetic.parquet"
runner = CliRunner()
LONG = "a" * 300  # past ext4's 255-byte names
TINY_RUN = ["run", "--preset", "tiny", "--num-requests", "20", "--quiet"]


def one_line(r, code: int, *needles: str) -> str:
    assert r.exit_code == code, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def no_temporaries(folder: Path) -> None:
    left = [p.name for p in folder.rglob("*") if p.name.startswith(".")]
    assert not left, left


# -- names past the file system's limit ------------------------------------------------
@pytest.mark.parametrize("args", [
    ["run", "--out", "{d}/" + LONG],
    ["run", "--workload", "{d}/" + LONG],
    ["run", "--config", "{d}/" + LONG + "/c.toml"],
    ["sweep", "--out", "{d}/" + LONG],
    ["traces", "synth", "--out", "{d}/" + LONG + ".parquet"],
    ["traces", "import", "{d}/" + LONG, "--out", "{d}/t.parquet", "--format", "per-position"],
    ["calibrate", "engine", "--sheet", "{d}/" + LONG, "--out", "{d}/p.toml"],
])
def test_a_path_option_with_a_name_too_long_is_refused_up_front(tmp_path, args, no_simulation):
    """Path.exists() raises ENAMETOOLONG, so these were tracebacks wherever a path was
    first looked at."""
    r = runner.invoke(app, [a.format(d=tmp_path) for a in args])
    one_line(r, 2, "bytes long", "255")


def test_an_output_name_that_leaves_no_room_for_its_temporary_is_refused_first(tmp_path):
    """250 bytes is a legal name, but the atomic write's ``.NAME.XXXXXXXX.tmp`` is not:
    it failed at the rename's mkstemp, after the trace had been generated."""
    out = tmp_path / ("t" * 242 + ".parquet")
    assert path_too_long(out) is None and path_too_long(out, sibling=True) is not None
    r = runner.invoke(app, ["traces", "synth", "--out", str(out), "--requests", "2",
                            "--positions", "8"])
    one_line(r, 2, "--out", ".XXXXXXXX.tmp")
    assert not out.exists()
    no_temporaries(tmp_path)


def test_a_name_argument_too_long_is_one_line(tmp_path):
    """A built-in name or path (``traces inspect TRACE``) is no Path option: the last net
    catches the file system's refusal."""
    r = runner.invoke(app, ["traces", "inspect", str(tmp_path / LONG)])
    assert r.exit_code != 0 and "Traceback" not in r.output
    one_line(r, r.exit_code, "too long")


def test_the_path_checker_counts_bytes_not_characters(tmp_path):
    assert path_too_long(tmp_path / ("é" * 127)) is None  # 254 bytes
    assert "256 bytes" in path_too_long(tmp_path / ("é" * 128))
    assert path_too_long(tmp_path / ("d/" * 3000)) is not None  # past PATH_MAX


# -- an existing sub-folder that refuses a write -------------------------------------------
def test_a_sweep_whose_points_folder_refuses_writes_fails_before_any_point(tmp_path,
                                                                           monkeypatch):
    """A ``points/`` the sweep cannot write (here /proc, which refuses even root) was found
    only when the first point finished."""
    from dspark_sim.sim import sweep as sweep_mod

    monkeypatch.setattr(sweep_mod, "run_sweep",
                        lambda *a, **k: pytest.fail("the sweep ran before --out was probed"))
    out = tmp_path / "s"
    out.mkdir()
    (out / "points").symlink_to("/proc/self")
    r = runner.invoke(app, ["sweep", "--out", str(out), "--policies", "mtp1", "--qps", "5"])
    one_line(r, 2, "--out", "cannot write under", "points")


def test_check_writable_probes_each_existing_subfolder(tmp_path):
    (tmp_path / "runs").symlink_to("/proc/self")
    with pytest.raises(InputError, match="cannot write under .*runs"):
        check_writable(tmp_path, "--out", inside={"runs": "dir", "manifest.json": "file"})
    check_writable(tmp_path, "--out", inside={"other": "dir"})  # not written: not probed


# -- a disk that fills half-way --------------------------------------------------------------
def _full_disk_after(nbytes: int):
    """A writer that puts ``nbytes`` into the file, then fails as polars does on ENOSPC."""
    def write(self, path, *a, **k):
        Path(path).write_bytes(b"PAR1" + b"\0" * nbytes)
        raise pl.exceptions.ComputeError("parquet: File out of specification: underlying IO "
                                         "error: No space left on device (os error 28)")
    return write


def test_a_full_disk_mid_run_keeps_the_previous_run_whole(tmp_path, monkeypatch):
    out = tmp_path / "d"
    assert runner.invoke(app, [*TINY_RUN, "--out", str(out)]).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(pl.DataFrame, "write_parquet", _full_disk_after(4096))
    r = runner.invoke(app, [*TINY_RUN, "--out", str(out), "--seed", "1"])
    one_line(r, 2, str(out / "requests.parquet"), "No space left on device", "disk is full")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    no_temporaries(out)


def test_a_full_disk_writing_a_trace_names_the_file_not_its_temporary(tmp_path, monkeypatch):
    out = tmp_path / "t.parquet"
    out.write_bytes(b"the previous trace")

    def full(table, where, **k):
        Path(where).write_bytes(b"PAR1half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(where))

    monkeypatch.setattr(pq, "write_table", full)
    r = runner.invoke(app, ["traces", "synth", "--out", str(out), "--requests", "2",
                            "--positions", "8"])
    line = one_line(r, 2, str(out), "No space left on device")
    assert ".tmp" not in line
    assert out.read_bytes() == b"the previous trace"
    no_temporaries(tmp_path)


def test_a_full_disk_writing_json_is_one_line(tmp_path, monkeypatch):
    out = tmp_path / "spec.json"

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))

    monkeypatch.setattr(Path, "write_text", full)
    r = runner.invoke(app, ["traces", "export", str(TRACE), "--out", str(out)])
    one_line(r, 2, str(out), "No space left on device")
    assert not out.exists()
    no_temporaries(tmp_path)


def test_any_file_system_error_reaching_the_cli_is_one_line(monkeypatch, tmp_path):
    """The last net: an OSError no check foresaw (an I/O error on a read) is one line
    naming the file, exit 2 as for any input the user can fix, never Python's traceback."""
    from dspark_sim.sim import api

    def eio(*a, **k):
        raise OSError(errno.EIO, os.strerror(errno.EIO), "/data/trace.parquet")

    monkeypatch.setattr(api, "simulate", eio)
    r = runner.invoke(app, TINY_RUN)
    one_line(r, 2, "/data/trace.parquet", "Input/output error")


def test_a_closed_stdout_ends_the_command_quietly():
    """``dspark-sim profiles list | head -1``: the reader leaves, the next write raises
    BrokenPipeError; that is the reader's choice, not an error to report."""
    code = ("import os, sys\n"
            "r, w = os.pipe(); os.close(r); os.dup2(w, 1)\n"
            "from dspark_sim.cli import app\n"
            "app(['profiles', 'list'])\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1, p.stderr
    assert p.stderr == ""  # no traceback, not even "Exception ignored" at exit


# -- a sheet's HF model config -------------------------------------------------------------
QWEN3_8B = {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16"}
MOE = {**QWEN3_8B, "num_experts": 64, "num_experts_per_tok": 8, "moe_intermediate_size": 768}


def _sheet(tmp_path: Path, cfg) -> Path:
    (tmp_path / "config.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    sheet = tmp_path / "hf.toml"
    sheet.write_text('hardware = "H200-bf16"\n[model]\nhf_config = "config.json"\n'
                     "[deployment]\ngpus_per_replica = 1\n")
    return sheet


def _without(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


@pytest.mark.parametrize("cfg,needle", [
    (_without(QWEN3_8B, "intermediate_size"), "'intermediate_size'"),  # a KeyError
    ({**QWEN3_8B, "num_attention_heads": 0}, "'num_attention_heads'"),
    ({**_without(QWEN3_8B, "head_dim"), "num_attention_heads": 0}, "'num_attention_heads'"),
    ({**QWEN3_8B, "num_key_value_heads": "eight"}, "'num_key_value_heads'"),
    ({**QWEN3_8B, "num_key_value_heads": 64}, "exceeds"),
    ({**QWEN3_8B, "hidden_size": 4096.5}, "'hidden_size'"),
    ({**QWEN3_8B, "hidden_size": True}, "'hidden_size'"),
    ({**QWEN3_8B, "num_hidden_layers": -2}, "'num_hidden_layers'"),
    ({**QWEN3_8B, "tie_word_embeddings": "false"}, "'tie_word_embeddings'"),  # truthy
    ({**QWEN3_8B, "torch_dtype": 16}, "'torch_dtype'"),
    (_without(MOE, "moe_intermediate_size"), "'moe_intermediate_size'"),  # int(None)
    ({**MOE, "num_experts_per_tok": 65}, "exceeds"),
    ({**MOE, "first_k_dense_replace": 37}, "exceeds"),
    ({**QWEN3_8B, "kv_lora_rank": "512"}, "'kv_lora_rank'"),
    ({**QWEN3_8B, "use_sliding_window": True, "sliding_window": "4k"}, "'sliding_window'"),
    ({**QWEN3_8B, "max_position_embeddings": [131072]}, "'max_position_embeddings'"),
    ({**QWEN3_8B, "vocab_size": 1 << 50}, "'vocab_size'"),
    ([QWEN3_8B], "JSON object"),
])
def test_a_bad_hf_config_in_a_sheet_is_one_line_naming_the_key(tmp_path, cfg, needle):
    sheet = _sheet(tmp_path, cfg)
    r = runner.invoke(app, ["calibrate", "engine", "--sheet", str(sheet), "--out",
                            str(tmp_path / "p.toml")])
    one_line(r, 2, "config.json", needle)
    assert not (tmp_path / "p.toml").exists()


def test_an_hf_config_integer_past_64_bits_is_one_line(tmp_path):
    """10**400 parsed exactly, then overflowed float() in the parameter count."""
    text = json.dumps(QWEN3_8B).replace("151936", "1" + "0" * 400)
    r = runner.invoke(app, ["calibrate", "engine", "--sheet", str(_sheet(tmp_path, text)),
                            "--out", str(tmp_path / "p.toml")])
    one_line(r, 2, "config.json", "'vocab_size'")


def test_a_good_hf_config_still_makes_a_profile(tmp_path):
    r = runner.invoke(app, ["calibrate", "engine", "--sheet", str(_sheet(tmp_path, QWEN3_8B)),
                            "--out", str(tmp_path / "p.toml")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "p.toml").is_file()


# -- integers past 64 bits, and digits int() refuses -------------------------------------------
PROM = ('vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} 10\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",'
        'position="{pos}"}} 5\n')


@pytest.mark.parametrize("pos", ["\u00b2", "\u0663", "\uff10", "1" * 40, "-1", "0x1"])
def test_a_prometheus_position_that_is_no_plain_number_is_one_line(tmp_path, pos):
    """'²'.isdigit() is True and int('²') a ValueError: a 54-line traceback; '٣' read as 3."""
    src = tmp_path / "metrics.txt"
    src.write_text(PROM.format(pos=pos), encoding="utf-8")
    r = runner.invoke(app, ["traces", "import", str(src), "--out", str(tmp_path / "t.parquet"),
                            "--format", "vllm-counters"])
    one_line(r, 2, str(src), "line 2", "position")


def test_a_prometheus_position_in_ascii_digits_still_imports(tmp_path):
    src = tmp_path / "metrics.txt"
    src.write_text(PROM.format(pos="0"), encoding="utf-8")
    r = runner.invoke(app, ["traces", "import", str(src), "--out", str(tmp_path / "t.parquet"),
                            "--format", "vllm-counters"])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("fmt,line", [
    ("specdecode-bench", '{"turn_accept_lengths": [1, 2, 1%s]}'),
    ("specdecode-bench", '{"turn_accept_lengths": [1, 2, 1' + "0" * 5000 + '%s]}'),
    ("per-position", '{"request_id": 1%s, "position": 0, "accept_len": 1}'),
    ("per-position", '{"request_id": 1, "position": 0, "accept_len": 1, "prompt_tokens": 1%s}'),
])
def test_a_json_integer_past_64_bits_is_one_line(tmp_path, fmt, line):
    src = tmp_path / "src.jsonl"
    src.write_text(line % ("0" * 400) + "\n")
    r = runner.invoke(app, ["traces", "import", str(src), "--out", str(tmp_path / "t.parquet"),
                            "--format", fmt])
    one_line(r, 2, str(src), "line 1")


@pytest.mark.parametrize("key", ["total_output_tokens", "spec_decode_acceptance_length",
                                 "spec_decode_num_drafts", "spec_decode_accepted_tokens"])
def test_a_bench_serve_count_past_64_bits_is_one_line(tmp_path, key):
    """math.isfinite(10**400) raises OverflowError, 10**400 - 1.5 too: tracebacks from the
    counters' checks."""
    src = tmp_path / "bench.json"
    d = {"spec_decode_per_position_acceptance_rates": [0.5], "spec_decode_num_drafts": 10,
         "completed": 1, "total_output_tokens": 70, "spec_decode_accepted_tokens": 5,
         "spec_decode_acceptance_length": 1.5}
    src.write_text(json.dumps({**d, key: 7}).replace(": 7", ": 7" + "0" * 400, 1))
    r = runner.invoke(app, ["traces", "import", str(src), "--out", str(tmp_path / "t.parquet"),
                            "--format", "vllm-counters"])
    one_line(r, 2, str(src))


@pytest.mark.parametrize("text", [
    "[workload]\nnum_requests = 1" + "0" * 30 + "\n",
    "[workload]\nnum_requests = " + "9" * 5000 + "\n",  # Python's int-conversion limit
    "seed = 18446744073709551616\n",
])
def test_a_toml_integer_past_64_bits_is_one_line(tmp_path, text, no_simulation):
    cfg = tmp_path / "c.toml"
    cfg.write_text(text)
    r = runner.invoke(app, ["run", "--config", str(cfg), "--quiet"])
    one_line(r, 2, str(cfg))


@pytest.mark.parametrize("col", ["position", "accept_len", "prompt_tokens", "request_id"])
def test_a_uint64_column_past_int64_in_a_trace_is_one_line(tmp_path, col):
    t = synth_iid(0.7, 3, num_requests=2, positions=4, seed=0)
    path = write_trace(t, tmp_path / "ok.parquet")
    table = pq.read_table(path)
    if col not in table.column_names:
        table = table.append_column(col, pa.array(np.full(table.num_rows, 5, np.uint64)))
    big = np.array(table[col].to_numpy(), dtype=np.uint64)
    # the last row (for the id: every row of the last request)
    big[big == big[-1] if col == "request_id" else -1] = np.uint64(1 << 63) + np.uint64(7)
    i = table.column_names.index(col)
    table = table.set_column(i, col, pa.array(big, pa.uint64()))
    pq.write_table(table, tmp_path / "big.parquet")
    if col == "request_id":  # ids past int64 keep their digits, as an importer keeps them
        assert read_trace(tmp_path / "big.parquet").num_requests == 2
        return
    r = runner.invoke(app, ["traces", "inspect", str(tmp_path / "big.parquet")])
    one_line(r, 2, "big.parquet", col)


# -- a column name twice ---------------------------------------------------------------------
def test_a_csv_header_naming_a_column_twice_is_refused(tmp_path):
    """polars renamed the second to acceptance_duplicated_0: which one counted was chance."""
    src = tmp_path / "dup.csv"
    src.write_text("request_id,position,accept_len,accept_len\n1,0,1,0\n")
    r = runner.invoke(app, ["traces", "import", str(src), "--out", str(tmp_path / "t.parquet"),
                            "--format", "per-position"])
    one_line(r, 2, str(src), "'accept_len' appears twice", "columns 3 and 4")


def test_a_csv_header_twice_after_stripping_spaces_is_refused(tmp_path):
    src = tmp_path / "w.csv"
    src.write_text("TIMESTAMP,ContextTokens, ContextTokens,GeneratedTokens\n"
                   "2023-11-16 18:15:46.6805900,10,20,5\n")
    r = runner.invoke(app, [*TINY_RUN, "--workload", str(src)])
    one_line(r, 2, str(src), "'ContextTokens' appears twice")


def test_a_parquet_trace_naming_a_column_twice_is_refused(tmp_path):
    t = synth_iid(0.7, 3, num_requests=2, positions=4, seed=0)
    table = pq.read_table(write_trace(t, tmp_path / "ok.parquet"))
    table = table.append_column(pa.field("accept_len", pa.int8()), table["accept_len"])
    pq.write_table(table, tmp_path / "dup.parquet")
    r = runner.invoke(app, ["traces", "inspect", str(tmp_path / "dup.parquet")])
    one_line(r, 2, "dup.parquet", "'accept_len' appears twice")


def test_a_parquet_in_points_with_a_column_twice_is_no_point(tmp_path):
    from dspark_sim.sim.sweep import BadPart, read_part

    p = tmp_path / "abc.parquet"
    pq.write_table(pa.table([pa.array([1]), pa.array([2])], names=["x", "x"]), p)
    with pytest.raises(BadPart):
        read_part(p)


# -- options a command would ignore ---------------------------------------------------------
@pytest.mark.parametrize("args,needles", [
    (["--policy", "mtp1", "--gamma-max", "5"], ["--gamma-max", "--policy mtp1"]),
    (["--policy", "none", "--gamma-max", "5"], ["--gamma-max", "--policy none"]),
    (["--policy", "fixed:3", "--mtp-trace", "mtp1-synthetic"], ["--mtp-trace", "fixed:3"]),
    (["--policy", "none", "--extrapolate-gamma", "9"], ["--extrapolate-gamma", "none"]),
    (["--policy", "none", "--conf-source", "position"], ["--conf-source", "none"]),
])
def test_a_run_option_the_policy_never_reads_is_refused(args, needles, no_simulation):
    one_line(runner.invoke(app, [*TINY_RUN, *args]), 2, *needles)


def test_gamma_max_with_the_block_drafter_still_runs(tmp_path):
    r = runner.invoke(app, [*TINY_RUN, "--policy", "fixed:3", "--gamma-max", "4"])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("args,needles", [
    (["--kind", "dspark", "--alpha", "0.9"], ["--alpha", "--kind iid only", "--kind dspark"]),
    (["--kind", "mtp1", "--alpha", "0.9"], ["--alpha", "--kind mtp1"]),
    (["--kind", "mtp1", "--gamma", "5"], ["--gamma", "--kind mtp1"]),
    (["--kind", "iid", "--noise", "0.1"], ["--noise", "--kind iid"]),
    (["--kind", "iid", "--overconfidence", "2"], ["--overconfidence", "--kind iid"]),
])
def test_a_synth_option_its_kind_never_reads_is_refused(tmp_path, args, needles):
    out = tmp_path / "t.parquet"
    one_line(runner.invoke(app, ["traces", "synth", "--out", str(out), *args]), 2, *needles)
    assert not out.exists()


def test_synth_defaults_are_what_the_options_were(tmp_path):
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    small = ["--requests", "3", "--positions", "16"]
    assert runner.invoke(app, ["traces", "synth", "--out", str(a), *small]).exit_code == 0
    assert runner.invoke(app, ["traces", "synth", "--out", str(b), *small, "--alpha", "0.8",
                               "--gamma", "7"]).exit_code == 0
    assert read_trace(a).accept_len.tobytes() == read_trace(b).accept_len.tobytes()


@pytest.mark.parametrize("rows", [1, 3])
def test_replay_qps_over_one_instant_is_refused(tmp_path, rows):
    """No span, no native rate: the rescale was skipped without a word."""
    w = tmp_path / "w.jsonl"
    w.write_text("".join('{"timestamp": 5, "input_length": 8, "output_length": 4}\n'
                         for _ in range(rows)))
    r = runner.invoke(app, [*TINY_RUN, "--workload", str(w), "--replay-qps", "3"])
    one_line(r, 2, "--replay-qps", "one instant")


# -- Hypothesis at the same boundaries ---------------------------------------------------------
PROPS = settings(max_examples=60, deadline=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture])


@PROPS
@given(st.text(min_size=1, max_size=12))
def test_is_decimal_accepts_exactly_what_int_reads_as_ascii(text):
    if is_decimal(text):
        assert int(text) >= 0 and text.isascii()
    elif text.isascii() and text.isdigit():
        assert len(text) > 18


@PROPS
@given(st.integers(min_value=1, max_value=3000))
def test_json_integers_parse_exactly_or_are_malformed_json(digits):
    """Exactly, so a reader's field check names the field; past any count's length, a
    JSONDecodeError every reader words as one line (a ValueError was a traceback)."""
    v = int("9" * digits)
    text = json.dumps({"n": [v, -v]})
    if digits <= 1000:
        assert loads_json(text) == {"n": [v, -v]}
    else:
        with pytest.raises(json.JSONDecodeError, match="longer than any count"):
            loads_json(text)


@PROPS
@given(st.one_of(st.integers(min_value=-(1 << 70), max_value=1 << 70),
                 st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none()))
def test_finite_number_never_raises_and_agrees_with_float(v):
    from dspark_sim.io import finite_number

    want = (not isinstance(v, bool) and v is not None
            and (abs(v) < (1 << 63) if isinstance(v, int) else math.isfinite(v)))
    assert finite_number(v) == want


@PROPS
@given(st.integers(min_value=-(1 << 70), max_value=1 << 70))
def test_toml_integers_parse_exactly_inside_64_bits_and_refuse_outside(v):
    import tomllib

    if -(1 << 63) <= v < (1 << 63):
        assert loads_toml(f"n = {v}") == {"n": v}
    else:
        with pytest.raises(tomllib.TOMLDecodeError, match="64-bit"):
            loads_toml(f"a = [{{n = {v}}}]")


NAME_CHARS = st.characters(blacklist_categories=("Cs",), blacklist_characters="/\0")


@PROPS
@given(st.lists(st.text(NAME_CHARS, min_size=1, max_size=90), min_size=1, max_size=4),
       st.booleans())
def test_the_path_checker_agrees_with_the_file_system(tmp_path_factory, parts, sibling):
    """Whatever the checker passes, the file system takes (the temporary sibling too);
    whatever it refuses, the file system refuses."""
    assume(not any(x in (".", "..") for x in parts))
    base = tmp_path_factory.mktemp("p")
    p = base.joinpath(*parts)
    why = path_too_long(p, sibling=sibling)
    longest = max(len(os.fsencode(x)) for x in parts)
    last = len(os.fsencode(parts[-1])) + (14 if sibling else 0)
    assert (why is None) == (longest <= 255 and last <= 255)
    if why is None:
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            target = p.parent / (("." + parts[-1] + ".12345678.tmp") if sibling else parts[-1])
            target.write_bytes(b"")
        except OSError as exc:
            assert exc.errno != errno.ENAMETOOLONG, (p, exc)


@PROPS
@given(st.lists(st.sampled_from(["request_id", "position", "accept_len", "conf_1", " position"]),
                min_size=3, max_size=6))
def test_a_csv_header_is_read_only_when_its_names_are_distinct(tmp_path_factory, header):
    src = tmp_path_factory.mktemp("c") / "h.csv"
    src.write_text(",".join(header) + "\n" + ",".join("0" for _ in header) + "\n")
    out = src.parent / "t.parquet"
    r = runner.invoke(app, ["traces", "import", str(src), "--out", str(out),
                            "--format", "per-position"])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.output
    names = [h.strip() for h in header]
    if len(set(names)) < len(names):
        one_line(r, 2, "appears twice")
        assert not out.exists()


@PROPS
@given(st.dictionaries(st.sampled_from(sorted(QWEN3_8B) + ["num_experts",
                                                          "moe_intermediate_size",
                                                          "kv_lora_rank"]),
                       st.one_of(st.none(), st.booleans(), st.integers(-3, 1 << 45),
                                 st.floats(allow_nan=True), st.text(max_size=4),
                                 st.lists(st.integers(0, 3), max_size=2)),
                       max_size=5))
def test_any_hf_config_edit_is_a_profile_or_one_line(tmp_path_factory, edits):
    """Over a good config, any fields replaced by any JSON value: a profile, or one line
    naming the config file; never a traceback."""
    d = tmp_path_factory.mktemp("h")
    cfg = {**QWEN3_8B, **edits}
    sheet = _sheet(d, json.dumps(cfg).replace("NaN", "0.5"))
    r = runner.invoke(app, ["calibrate", "engine", "--sheet", str(sheet), "--out",
                            str(d / "p.toml")])
    assert r.exception is None or isinstance(r.exception, SystemExit), (edits, r.output)
    if r.exit_code != 0:
        one_line(r, 2)


@pytest.mark.parametrize("exc,want", [
    (pl.exceptions.ComputeError("underlying IO error: No space left on device (os error 28)"),
     errno.ENOSPC),
    (OSError("[Errno 28] Error writing bytes to file"), errno.ENOSPC),  # pyarrow's form
    (OSError(errno.EACCES, "Permission denied", "/d/.out.parquet.ab12cd34.tmp"), errno.EACCES),
    (InputError("--trace", "cannot read ([Errno 2] No such file)"), None),  # already a line
    (ValueError("no file here"), None),
])
def test_an_os_error_is_found_whichever_library_wrapped_it(exc, want):
    from dspark_sim.io import as_os_error

    err = as_os_error(exc, "/d/out.parquet")
    assert (err and err.errno) == want
    if err is not None:
        assert err.filename == "/d/out.parquet"  # never the temporary the user never saw
