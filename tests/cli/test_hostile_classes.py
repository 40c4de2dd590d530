"""Hostile input by class, each class pinned by a few of its members:

* a named input is read or refused, never ignored: one the chosen policy (or every policy
  of a sweep) never reads is refused naming the option and the policy, whether an option
  or a config file's key named it; one that is read but missing is refused;
* one exit-code contract (docs/cli.md): bad input, an unreadable or unwritable path
  included (a name past the file system's limit, a full disk), is one line and exit 2,
  with every file whole; a bug stays a traceback, exit 1;
* importers: no user column collides with a helper column, suffixes in any case, errors
  blame the file (never an option that was not given);
* silent changes: a workload request of 0 tokens is refused, not served as 1;
* cost in proportion: a fixed-k chain through one long request takes logarithmically
  many passes, as through many short ones.
"""

from __future__ import annotations

import errno
import json
import math
import os
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from hand_oracles import served_tau_by_hand
from input_checks import one_line_error
from typer.testing import CliRunner

from dspark_sim.cli import app
from dspark_sim.errors import InputError
from dspark_sim.traces import schema
from dspark_sim.traces.schema import AcceptanceTrace, TraceMeta, read_trace

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "traces" / "data" / "mtp1-synthetic.parquet"
runner = CliRunner()
TINY_RUN = ["run", "--preset", "tiny", "--num-requests", "20", "--quiet"]
LONG = "a" * 300  # past ext4's 255-byte names


def _lengths_csv(tmp_path: Path, output_tokens: int = 6) -> Path:
    """A per-position CSV of two requests that carry their own prompt and output lengths."""
    src = tmp_path / "pp.csv"
    src.write_text("request_id,position,accept_len,prompt_tokens,output_tokens\n"
                   + "".join(f"{r},{p},{p % 3},12,{output_tokens}\n"
                             for r in ("a", "b") for p in range(6)))
    return src


def _imported(tmp_path: Path, src: Path) -> Path:
    out = tmp_path / "imported.parquet"
    r = runner.invoke(app, ["traces", "import", "--format", "per-position", str(src),
                            "--out", str(out)])
    assert r.exit_code == 0, r.output
    return out


# -- a named input is read or refused ------------------------------------------------------
@pytest.mark.parametrize("args,needles", [
    (["--policy", "none", "--trace", "missing.parquet"], ["--trace", "--policy none"]),
    (["--policy", "none", "--domain", "nonexistent"], ["--domain", "--policy none"]),
    (["--policy", "none", "--trace", "dspark-synthetic"], ["--trace", "--policy none"]),
    (["--policy", "fixed:3", "--calibration", "identity"], ["--calibration", "fixed:3"]),
    (["--policy", "mtp1", "--gamma-max", "5"], ["--gamma-max", "--policy mtp1"]),
])
def test_a_named_input_the_policy_never_reads_is_refused(args, needles, no_simulation):
    one_line_error(runner.invoke(app, [*TINY_RUN, *args]), *needles, "leave one of the two out")


def test_a_config_files_unread_input_is_refused_naming_its_key(tmp_path, no_simulation):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[run]\npolicy = "none"\ntrace = "missing.parquet"\n'
                   '[workload]\ndomain = "math"\n')
    r = runner.invoke(app, [*TINY_RUN, "--config", str(cfg)])
    one_line_error(r, f"{cfg} [run] trace", "--policy none")


def test_a_sweep_refuses_a_trace_none_of_its_policies_reads(tmp_path, no_simulation):
    out = tmp_path / "sweep"
    r = runner.invoke(app, ["sweep", "--policies", "none", "--traces", "missing.parquet",
                            "--out", str(out), "--quiet"])
    one_line_error(r, "--traces", "--policies none")
    assert not out.exists()


def test_an_input_one_policy_of_a_sweep_reads_is_read():
    from dspark_sim.policies.registry import get_policy
    from dspark_sim.sim.api import check_inputs_read
    from dspark_sim.sim.config import SimConfig

    cfg = SimConfig(trace="missing.parquet")
    check_inputs_read(cfg, [get_policy("none"), get_policy("fixed:3")])  # fixed:3 reads it
    with pytest.raises(InputError, match="none of --policies none, mtp1 reads"):
        # mtp1 replays --mtp-trace when one is named, so --trace is left unread
        check_inputs_read(SimConfig(trace="missing.parquet", mtp_trace="mtp1-synthetic"),
                          [get_policy("none"), get_policy("mtp1")], policy_option="--policies")


@pytest.mark.parametrize("args", [
    ["--policy", "fixed:3", "--trace", "missing.parquet"],
    ["--policy", "confidence", "--calibration", "missing.toml"],
    # read for the lengths alone, when the run draws its requests
    ["--policy", "none", "--lengths", "trace", "--trace", "missing.parquet"],
])
def test_a_named_input_that_is_read_but_missing_is_refused(args):
    one_line_error(runner.invoke(app, [*TINY_RUN, *args]), "missing.", "not found")


def test_none_reads_the_trace_and_domain_its_lengths_come_from(tmp_path):
    trace = _imported(tmp_path, _lengths_csv(tmp_path))
    r = runner.invoke(app, [*TINY_RUN, "--policy", "none", "--lengths", "trace",
                            "--trace", str(trace), "--domain", "pp"])
    assert r.exit_code == 0, r.output


# -- one exit-code contract --------------------------------------------------------------
@pytest.mark.parametrize("args", [
    [*TINY_RUN, "--trace", LONG + ".parquet"],
    [*TINY_RUN, "--profile", LONG + ".toml"],
    ["traces", "inspect", LONG + ".parquet"],
])
def test_a_name_too_long_for_the_file_system_is_bad_input(args, no_simulation):
    one_line_error(runner.invoke(app, args), "File name too long")


def test_a_full_disk_while_importing_is_exit_2_and_keeps_the_previous_file(tmp_path,
                                                                         monkeypatch):
    src = _lengths_csv(tmp_path)
    out = tmp_path / "t.parquet"
    out.write_bytes(b"the previous trace")

    def full(table, where, **k):
        Path(where).write_bytes(b"PAR1half")  # half a file, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(where))

    monkeypatch.setattr(pq, "write_table", full)
    r = runner.invoke(app, ["traces", "import", "--format", "per-position", str(src),
                            "--out", str(out)])
    line = one_line_error(r, str(out), "No space left on device")
    assert ".tmp" not in line
    assert out.read_bytes() == b"the previous trace"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pp.csv", "t.parquet"]


def test_writing_into_a_full_device_is_exit_2(tmp_path, monkeypatch):
    """The kernel's own ENOSPC (/dev/full), wrapped as polars wraps it, not a made-up one."""
    import polars as pl

    def to_dev_full(self, path, *a, **k):
        try:
            with open("/dev/full", "wb") as fh:
                fh.write(b"PAR1")
                fh.flush()
        except OSError as exc:
            raise pl.exceptions.ComputeError(f"underlying IO error: {exc.strerror} "
                                             f"(os error {exc.errno})") from None

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    monkeypatch.setattr(pl.DataFrame, "write_parquet", to_dev_full)
    out = tmp_path / "d"
    r = runner.invoke(app, [*TINY_RUN, "--out", str(out)])
    one_line_error(r, "No space left on device", "disk is full")
    assert not out.exists() or not [p for p in out.rglob("*") if p.is_file()]


def test_a_bug_stays_a_traceback_with_exit_1(monkeypatch):
    from dspark_sim.sim import api

    def bug(*a, **k):
        raise ZeroDivisionError("a bug, not the user's input")

    monkeypatch.setattr(api, "simulate", bug)
    r = runner.invoke(app, TINY_RUN)
    assert r.exit_code == 1 and isinstance(r.exception, ZeroDivisionError), r.output


# -- importers ---------------------------------------------------------------------------
@pytest.mark.parametrize("extra", ["_line", "_row", "index", "_first"])
def test_a_user_column_never_collides_with_a_helper_column(tmp_path, extra):
    src = tmp_path / "pp.csv"
    src.write_text(f"request_id,position,accept_len,{extra}\n"
                   "b,0,2,x\nb,1,0,x\na,0,1,x\n")
    t = read_trace(_imported(tmp_path, src))
    assert t.req_ids.tolist() == ["b", "a"]
    assert t.accept_len.tolist() == [2, 0, 1]


def test_a_trace_file_with_columns_named_like_helpers_reads(tmp_path):
    """String ids keep their first-appearance order; the file's own ``_row`` and
    ``_first`` columns are data, never the sort's keys."""
    import pyarrow as pa

    table = pq.read_table(_imported(tmp_path, _lengths_csv(tmp_path)))[::-1]  # b first
    n = table.num_rows
    table = table.append_column("_row", pa.array([0] * n)).append_column(
        "_first", pa.array([n] * n))
    p = tmp_path / "extra.parquet"
    pq.write_table(table, p)
    back = read_trace(p)
    assert back.req_ids.tolist() == ["b", "a"]
    assert back.accept_len.tolist() == [0, 1, 2] * 4


@pytest.mark.parametrize("name,sep", [("pp.TSV", "\t"), ("pp.Tsv", "\t"), ("pp.CSV", ",")])
def test_suffixes_are_read_in_any_case(tmp_path, name, sep):
    src = tmp_path / name
    src.write_text(sep.join(["request_id", "position", "accept_len"]) + "\n"
                   + "\n".join(sep.join(row) for row in (["7", "0", "1"], ["7", "1", "0"])))
    t = read_trace(_imported(tmp_path, src))
    assert t.req_ids.tolist() == ["7"] and t.accept_len.tolist() == [1, 0]


@pytest.mark.parametrize("args,needle", [
    (["traces", "inspect", "MISSING.PARQUET"], "MISSING.PARQUET: trace file not found"),
    ([*TINY_RUN, "--profile", "MISSING.TOML"], "MISSING.TOML: profile file not found"),
])
def test_an_upper_case_suffix_is_a_path_not_a_built_in_name(args, needle, no_simulation):
    one_line_error(runner.invoke(app, args), needle)


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_confidences_wider_than_a_trace_blame_the_file_not_gamma_max(tmp_path, fmt):
    width = 200
    if fmt == "jsonl":
        src = tmp_path / "wide.jsonl"
        src.write_text(json.dumps({"request_id": 1, "position": 0, "accept_len": 1,
                                   "conf": [0.5] * width}) + "\n")
    else:
        src = tmp_path / "wide.csv"
        src.write_text("request_id,position,accept_len,"
                       + ",".join(f"conf_{i}" for i in range(1, width + 1)) + "\n"
                       + "1,0,1," + ",".join(["0.5"] * width) + "\n")
    r = runner.invoke(app, ["traces", "import", "--format", "per-position", str(src),
                            "--out", str(tmp_path / "t.parquet")])
    line = one_line_error(r, str(src), f"{width} confidences", "127")
    assert "--gamma-max" not in line
    assert not (tmp_path / "t.parquet").exists()


def test_an_accepted_run_past_the_limit_names_the_file(tmp_path):
    src = tmp_path / "long.jsonl"
    src.write_text(json.dumps({"request_id": 1, "position": 0, "accept_len": 300}) + "\n")
    r = runner.invoke(app, ["traces", "import", "--format", "per-position", str(src),
                            "--out", str(tmp_path / "t.parquet")])
    one_line_error(r, str(src), "300", "127")


def _with_meta_domains(tmp_path: Path, domains: list[str]) -> Path:
    src = _imported(tmp_path, _lengths_csv(tmp_path))
    table = pq.read_table(src)
    meta = json.loads(table.schema.metadata[schema.META_KEY])
    meta["domains"] = domains
    out = tmp_path / "meta.parquet"
    pq.write_table(table.replace_schema_metadata(
        {**table.schema.metadata, schema.META_KEY: json.dumps(meta).encode()}), out)
    return out


@pytest.mark.parametrize("domains", [["pp", "ghost"], ["ghost"]])
@pytest.mark.parametrize("cmd", ["inspect", "run"])
def test_metadata_domains_the_data_lacks_blame_the_file(tmp_path, domains, cmd, no_simulation):
    bad = _with_meta_domains(tmp_path, domains)
    args = (["traces", "inspect", str(bad)] if cmd == "inspect" else
            [*TINY_RUN, "--policy", "fixed:3", "--trace", str(bad)])
    line = one_line_error(runner.invoke(app, args), str(bad), "metadata 'domains'", "ghost")
    assert "--domain" not in line


def test_metadata_domains_that_agree_with_the_data_read(tmp_path):
    assert read_trace(_with_meta_domains(tmp_path, ["pp"])).meta.domains == ("pp",)


# -- silent changes ------------------------------------------------------------------------
@pytest.mark.parametrize("name,text,needles", [
    ("w.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
              "2023-11-16 18:15:46.000,374,44\n2023-11-16 18:15:47.000,12,0\n",
     ["data row 2", "output_tokens is 0"]),
    ("w.jsonl", '{"timestamp": 0, "input_length": 0, "output_length": 4}\n',
     ["data row 1", "prompt_tokens is 0"]),
])
@pytest.mark.parametrize("loop", [[], ["--max-concurrency", "2"]])
def test_a_workload_request_of_zero_tokens_is_refused(tmp_path, name, text, needles, loop):
    w = tmp_path / name
    w.write_text(text)
    one_line_error(runner.invoke(app, [*TINY_RUN, "--workload", str(w), *loop]),
                   str(w), *needles)


def test_trace_lengths_of_zero_output_tokens_are_refused(tmp_path):
    trace = _imported(tmp_path, _lengths_csv(tmp_path, output_tokens=0))
    r = runner.invoke(app, [*TINY_RUN, "--policy", "fixed:2", "--lengths", "trace",
                            "--trace", str(trace)])
    one_line_error(r, str(trace), "output_tokens of request a is 0")


# -- cost in proportion ------------------------------------------------------------------
def _trace(rows: list[np.ndarray], gamma: int) -> AcceptanceTrace:
    lengths = [len(r) for r in rows]
    return AcceptanceTrace(
        meta=TraceMeta(drafter="d", target="t", gamma_max=gamma),
        accept_len=np.concatenate(rows).astype(np.int8), conf=None,
        req_offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        req_domain=np.array(["x"] * len(rows)), req_ids=np.arange(len(rows), dtype=np.int32))


def _passes(monkeypatch) -> list[int]:
    seen: list[int] = []
    walk = schema._walk

    def counted(nxt, starts):
        visited, passes = walk(nxt, starts)
        seen.append(passes)
        return visited, passes

    monkeypatch.setattr(schema, "_walk", counted)
    return seen


def test_one_long_request_costs_logarithmically_many_passes(monkeypatch):
    """A chain of k = 0 steps once per position: 2**14 steps in one request take 14
    passes over the positions (one numpy pass per step took 16,384), and the same
    positions as 128 requests of 128 take 7."""
    seen = _passes(monkeypatch)
    one = _trace([np.zeros(1 << 14)], 3)
    many = _trace([np.zeros(128)] * 128, 3)
    assert one.served_tau(0) == many.served_tau(0) == 1.0
    assert seen == [14, 7]


def test_the_chain_through_long_and_short_requests_matches_the_plain_loop(monkeypatch):
    seen = _passes(monkeypatch)
    rng = np.random.default_rng(5)
    rows = [rng.integers(0, 8, n) for n in (50_000, 1, 0, 7, 300)]
    t = _trace(rows, 7)
    for k in (0, 1, 3, 7):
        assert math.isclose(t.served_tau(k),
                            served_tau_by_hand([r.tolist() for r in rows], k), rel_tol=1e-12)
    # the longest walk has at most 50,000 steps: at most ceil(log2(50,000)) = 16 passes
    assert max(seen) <= 16
