"""Inputs a hostile user tried that lost data or made it silently wrong, each pinned at
its cause:

* an output written over one of the command's own inputs (``run --trace
  D/requests.parquet --out D``), for every file input of ``run`` and ``sweep``;
* a point file whose footer reads but whose data does not, counted as done; a parquet
  in ``points/`` that is no point, merged into the results;
* a point id that hashes an input file's path, not its contents;
* integers past the trace schema's int32 columns, wrapped round on writing;
* an engine profile's ``[engine]`` limits past the options' caps;
* a draft-time table extrapolated to a negative time;
* a seed read through a float.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from dspark_sim.calibration.profile import DraftCost, load_profile, profile_from_dict
from dspark_sim.cli import app
from dspark_sim.errors import MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, InputError
from dspark_sim.io import loads_toml
from dspark_sim.sim import sweep
from dspark_sim.sim.config import preset
from dspark_sim.sim.sweep import (
    SweepWarning,
    build_points,
    combine,
    input_digests,
    parse_numbers,
    point_hash,
    run_sweep,
)
from dspark_sim.traces.schema import read_trace, write_trace
from dspark_sim.traces.synth import synth_iid

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "traces" / "data" / "mtp1-synthetic.parquet"
PROFILE = ROOT / "calibration" / "data" / "v4flash-h200.toml"
CALIBRATION = ROOT / "calibration" / "data" / "calibration" / "cure-qwen3-8b-synthetic-sts.toml"
runner = CliRunner()


def one_line_error(r, *needles: str) -> str:
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.fixture
def base():
    cfg = preset("tiny")
    return replace(cfg, workload=replace(cfg.workload, num_requests=40))


# -- outputs over inputs -----------------------------------------------------------------
def test_run_refuses_to_write_its_request_log_over_its_own_trace(tmp_path):
    """Ran to the end, exit 0, and replaced the trace with the run's request log."""
    out = tmp_path / "d"
    out.mkdir()
    trace = out / "requests.parquet"
    shutil.copy(TRACE, trace)
    before = trace.read_bytes()
    r = runner.invoke(app, ["run", "--preset", "tiny", "--num-requests", "20", "--policy",
                            "mtp1", "--mtp-trace", str(trace), "--out", str(out), "--quiet"])
    one_line_error(r, "error: --out: ", "requests.parquet", "the --mtp-trace file")
    assert trace.read_bytes() == before
    assert not (out / "summary.json").exists()


def _run_input(tmp_path: Path, option: str, name: str) -> list[str]:
    """``run`` arguments whose ``option`` names ``D/name``, a valid file of its kind."""
    d = tmp_path / "d"
    d.mkdir(exist_ok=True)
    f = d / name
    if option in ("--trace", "--mtp-trace"):
        shutil.copy(TRACE, f)
    elif option == "--profile":
        shutil.copy(PROFILE, f)
    elif option == "--calibration":
        shutil.copy(CALIBRATION, f)
    elif option == "--workload":
        f.write_text('{"timestamp": 0, "input_length": 8, "output_length": 4}\n')
    elif option == "--config":
        f.write_text("[workload]\nqps = 5.0\n")
    elif option == "config-trace":  # a config file's key names it, not an option
        shutil.copy(TRACE, f)
        cfg = tmp_path / "c.toml"
        cfg.write_text(f"[run]\ntrace = {json.dumps(str(f))}\n")
        return ["--config", str(cfg)]
    return [option, str(f)]


@pytest.mark.parametrize("option,name,what", [
    ("--trace", "requests.parquet", "the --trace file"),
    ("--mtp-trace", "requests.parquet", "the --mtp-trace file"),
    ("--profile", "summary.json", "the --profile file"),
    ("--calibration", "summary.json", "the --calibration file"),
    ("--workload", "summary.json", "the --workload file"),
    ("--config", "summary.json", "the --config file"),
    ("config-trace", "requests.parquet", "the --trace file"),
])
def test_no_run_output_lands_on_a_run_input(tmp_path, no_simulation, option, name, what):
    args = _run_input(tmp_path, option, name)
    f = tmp_path / "d" / name
    before = f.read_bytes()
    r = runner.invoke(app, ["run", "--preset", "tiny", *args, "--out", str(tmp_path / "d")])
    one_line_error(r, "error: --out: ", str(f), what, "choose another folder")
    assert f.read_bytes() == before


def test_a_hard_link_to_an_input_is_the_input(tmp_path, no_simulation):
    d = tmp_path / "d"
    d.mkdir()
    trace = tmp_path / "t.parquet"
    shutil.copy(TRACE, trace)
    (d / "requests.parquet").hardlink_to(trace)
    r = runner.invoke(app, ["run", "--preset", "tiny", "--trace", str(trace), "--out", str(d)])
    one_line_error(r, "error: --out: ", "is also the --trace file")


@pytest.mark.parametrize("option,name", [
    ("--traces", "results.parquet"),
    ("--profiles", "report.html"),
    ("--config", "results.parquet"),
    ("--traces", "points/mine.parquet"),  # read back as a point: in a folder sweep owns
])
def test_no_sweep_output_lands_on_a_sweep_input(tmp_path, no_simulation, option, name):
    d = tmp_path / "d"
    f = d / name
    f.parent.mkdir(parents=True)
    {"--traces": lambda: shutil.copy(TRACE, f), "--profiles": lambda: shutil.copy(PROFILE, f),
     "--config": lambda: f.write_text("[workload]\nnum_requests = 20\n")}[option]()
    before = f.read_bytes()
    r = runner.invoke(app, ["sweep", "--out", str(d), "--policies", "mtp1", "--qps", "5",
                            "--executor", "serial", "--quiet", option, str(f)])
    one_line_error(r, "error: --out: ", str(f))
    assert f.read_bytes() == before
    assert not (d / "results.parquet").exists() or name == "results.parquet"


def test_a_missing_input_is_no_clash(tmp_path, monkeypatch, no_simulation):
    # only files that exist are inputs an output could destroy; a missing one is the
    # loader's to refuse
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, ["run", "--preset", "tiny", "--trace", "requests.parquet",
                            "--out", "."])
    one_line_error(r, "requests.parquet", "not found")


# -- point files ---------------------------------------------------------------------------
def _damage_data_pages(p: Path) -> None:
    """Overwrite every column chunk's data pages of a parquet file; the footer (schema,
    offsets) stays intact, so the schema still reads."""
    md = pq.read_metadata(p)
    raw = bytearray(p.read_bytes())
    rg = md.row_group(0)
    for i in range(rg.num_columns):
        c = rg.column(i)
        start = c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset
        raw[start:start + c.total_compressed_size] = b"\xa5" * c.total_compressed_size
    p.write_bytes(bytes(raw))


def test_a_point_with_damaged_data_pages_is_recomputed_and_said_so(base, tmp_path,
                                                                   monkeypatch):
    out = tmp_path / "sw"
    kw = dict(qps=[5, 10], policies=["none"], out=out, executor="serial", progress=False)
    first = run_sweep(base, **kw)
    victim = sorted((out / "points").glob("*.parquet"))[0]
    _damage_data_pages(victim)
    assert pl.read_parquet_schema(victim)  # the footer reads, so only the pages show the damage
    calls = []
    real = sweep.run_point
    monkeypatch.setattr(sweep, "run_point", lambda pt: calls.append(pt.point_id) or real(pt))
    with pytest.warns(SweepWarning, match=rf"{victim.name}: .*; recomputing the point"):
        again = run_sweep(base, **kw)
    assert calls == [victim.stem]
    assert again.height == 2 and set(again["point_id"]) == set(first["point_id"])
    assert pl.read_parquet(out / "results.parquet").height == 2


def test_a_point_whose_data_decodes_to_other_values_is_damaged(base, tmp_path):
    """Damage that decodes without an error: the digest written with the row tells."""
    out = tmp_path / "sw"
    run_sweep(base, qps=[5], policies=["none"], out=out, executor="serial", progress=False)
    (part,) = (out / "points").glob("*.parquet")
    table = pq.read_table(part)
    i = table.schema.get_field_index("load")
    forged = table.set_column(i, "load", pl.Series([6.0]).to_arrow())
    pq.write_table(forged.replace_schema_metadata(table.schema.metadata), part)
    with pytest.raises(sweep.BadPart, match="does not match the digest") as exc:
        sweep.read_part(part)
    assert exc.value.damaged


def test_the_cli_says_which_point_it_recomputes_in_one_line(tmp_path):
    args = ["sweep", "--out", str(tmp_path), "--policies", "none", "--qps", "5",
            "--num-requests", "20", "--replicas", "1", "--executor", "serial", "--quiet"]
    assert runner.invoke(app, args).exit_code == 0
    (part,) = (tmp_path / "points").glob("*.parquet")
    _damage_data_pages(part)
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    (line,) = [ln for ln in r.output.splitlines() if "recomputing" in ln]
    assert line.startswith(f"warning: {part}: ")
    assert pl.read_parquet(tmp_path / "results.parquet").height == 1


@pytest.mark.parametrize("frame,why", [
    (pl.DataFrame({"x": [1, 2, 3]}), "no point_id"),
    (None, "its point_id is"),  # a real point's row under another name
])
def test_a_parquet_in_points_that_is_no_point_is_left_out_with_a_warning(base, tmp_path,
                                                                         frame, why):
    run_sweep(base, qps=[5], policies=["none"], out=tmp_path, executor="serial",
              progress=False)
    (part,) = (tmp_path / "points").glob("*.parquet")
    foreign = tmp_path / "points" / "0123456789abcdef.parquet"
    if frame is None:
        shutil.copy(part, foreign)
    else:
        frame.write_parquet(foreign)
    with pytest.warns(SweepWarning, match=rf"{foreign.name}: not a sweep point \({why}"):
        df = combine(tmp_path)
    assert df.height == 1 and df["point_id"].to_list() == [part.stem]
    assert pl.read_parquet(tmp_path / "results.parquet").height == 1


def test_good_points_are_reused_without_a_warning(base, tmp_path):
    kw = dict(qps=[5], policies=["none"], out=tmp_path, executor="serial", progress=False)
    run_sweep(base, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SweepWarning)
        assert run_sweep(base, **kw).height == 1


# -- point ids hash contents -----------------------------------------------------------------
@pytest.mark.parametrize("field", ["profile", "trace", "mtp_trace", "calibration",
                                   "workload"])
def test_an_edited_input_file_is_a_new_point(base, tmp_path, field):
    f = tmp_path / "input"
    f.write_bytes(b"first")
    if field == "profile":
        cfg = replace(base, deployment=replace(base.deployment, profile=str(f)))
    elif field == "workload":
        cfg = replace(base, workload=replace(base.workload, workload_path=str(f)))
    else:
        cfg = replace(base, **{field: str(f)})
    before = point_hash(cfg)
    f.write_bytes(b"other")  # same path, same size
    assert point_hash(cfg) != before
    assert len(input_digests(cfg)) == 1


def test_a_sweep_resumed_after_a_profile_edit_recomputes(base, tmp_path, monkeypatch):
    prof = tmp_path / "p.toml"
    shutil.copy(PROFILE, prof)
    kw = dict(qps=[5], policies=["none"], profiles=[str(prof)], out=tmp_path / "sw",
              executor="serial", progress=False)
    first = run_sweep(base, **kw)
    text = prof.read_text()
    assert "\nrequest_us = " in text
    prof.write_text(text.replace("\nrequest_us = ", "\nrequest_us = 1", 1))  # a costlier request
    calls = []
    real = sweep.run_point
    monkeypatch.setattr(sweep, "run_point", lambda pt: calls.append(pt.point_id) or real(pt))
    again = run_sweep(base, **kw)
    assert len(calls) == 1 and calls[0] != first["point_id"][0]
    assert again["point_id"].to_list() == calls


def test_built_in_names_keep_their_point_ids(base):
    # no input file: the id is the config's alone, as points already on disk have it
    import hashlib
    from dataclasses import asdict

    from dspark_sim import __version__

    assert input_digests(base) == {}
    config = {k: v for k, v in asdict(base).items() if k not in ("slo_ttft_ms", "slo_tpot_ms")}
    payload = {"row_format": sweep.ROW_FORMAT, "version": __version__, "config": config}
    text = json.dumps(payload, sort_keys=True, default=str, separators=(",", ":"))
    assert point_hash(base) == hashlib.sha256(text.encode()).hexdigest()[:16]
    assert build_points(base, qps=[5], policies=["none"])[0].point_id == point_hash(
        replace(base, policy="none", workload=replace(base.workload, qps=5.0)))
    # the SLOs judge a point's requests after the run: changing them reruns nothing
    assert point_hash(replace(base, slo_ttft_ms=500.0, slo_tpot_ms=50.0)) == point_hash(base)


# -- integers past the trace schema ------------------------------------------------------
@pytest.mark.parametrize("suffix,text", [
    (".jsonl", '{"request_id": "a", "position": 0, "accept_len": 1, '
               '"prompt_tokens": 2147483648}\n'),
    (".csv", "request_id,position,accept_len,output_tokens\na,0,1,2147483648\n"),
])
def test_a_count_past_int32_is_refused_at_import_naming_the_line(tmp_path, suffix, text):
    src = tmp_path / f"pp{suffix}"
    src.write_text(text)
    out = tmp_path / "t.parquet"
    r = runner.invoke(app, ["traces", "import", "--format", "per-position", str(src),
                            "--out", str(out)])
    line = one_line_error(r, str(src), "2**31 - 1")
    assert ("line 1" if suffix == ".jsonl" else "line 2") in line  # CSV: the header is line 1
    assert not out.exists()


def test_the_largest_int32_count_imports_and_reads_back(tmp_path):
    src = tmp_path / "pp.jsonl"
    src.write_text('{"request_id": "a", "position": 0, "accept_len": 1, '
                   '"prompt_tokens": 2147483647}\n')
    out = tmp_path / "t.parquet"
    r = runner.invoke(app, ["traces", "import", "--format", "per-position", str(src),
                            "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert read_trace(out).req_prompt_tokens.tolist() == [2**31 - 1]


@pytest.mark.parametrize("value,dtype,needle", [
    (2**31, pl.Int64, "int32 range"),
    (2**63, pl.UInt64, "int64 range"),
])
def test_a_trace_file_with_lengths_past_the_schema_is_refused(tmp_path, value, dtype,
                                                              needle):
    good = tmp_path / "good.parquet"
    write_trace(synth_iid(0.7, 3, num_requests=2, positions=4), good)
    table = pq.read_table(good)
    df = pl.from_arrow(table).with_columns(pl.lit(value, dtype=dtype).alias("prompt_tokens"))
    bad = tmp_path / "bad.parquet"
    pq.write_table(df.to_arrow().replace_schema_metadata(table.schema.metadata), bad)
    with pytest.raises(InputError, match=needle) as exc:
        read_trace(bad)
    assert str(bad) in str(exc.value) and "row 0" in str(exc.value)


def test_the_writer_refuses_a_length_it_would_wrap(tmp_path):
    t = synth_iid(0.7, 3, num_requests=2, positions=4)
    t = replace(t, req_prompt_tokens=np.array([5, 2**31], np.int64),
                req_output_tokens=np.array([4, 4], np.int64))
    with pytest.raises(InputError, match="prompt_tokens 2147483648 of request 1"):
        write_trace(t, tmp_path / "t.parquet")
    assert not (tmp_path / "t.parquet").exists()


# -- profile limits ----------------------------------------------------------------------
@pytest.mark.parametrize("key,limit", [("max_num_batched_tokens", MAX_NUM_BATCHED_TOKENS),
                                       ("max_num_seqs", MAX_NUM_SEQS)])
def test_a_profiles_engine_limits_obey_the_options_caps(key, limit):
    data = loads_toml(PROFILE.read_text())
    data.setdefault("engine", {})[key] = limit
    assert getattr(profile_from_dict(data, "p.toml").limits, key) == limit
    data["engine"][key] = 1 << 30
    with pytest.raises(InputError, match=rf"p.toml \[engine\]: '{key}' must be an integer in "
                                         rf"\[1, {limit:,}\], got {1 << 30}"):
        profile_from_dict(data, "p.toml")


# -- draft extrapolation ---------------------------------------------------------------
def test_the_draft_table_never_extrapolates_below_its_last_time():
    cost = DraftCost(batch=np.array([1.0, 8.0]), time_s=np.array([0.004, 0.001]))
    assert cost.base_time(8, 1) == pytest.approx(0.001)
    assert cost.base_time(1000, 1) == pytest.approx(0.001)  # extrapolated: -0.42 s


def test_a_falling_draft_table_runs_past_its_end(tmp_path, base):
    """A batch that outgrows the draft table is priced at its last entry, not handed to
    SimPy as a negative delay."""
    from dspark_sim.sim.api import simulate

    text = PROFILE.read_text()
    assert "[draft.dspark]" in text and load_profile(PROFILE).drafts["dspark"]
    lines = text.splitlines()
    at = lines.index("[draft.dspark]")
    ends = next((i for i in range(at + 1, len(lines)) if lines[i].startswith("[")), len(lines))
    table = [ln for ln in lines[at + 1:ends] if not ln.startswith(("batch", "time_ms"))]
    lines[at + 1:ends] = ["batch = [1, 2]", "time_ms = [300.0, 0.5]", *table]
    prof = tmp_path / "falling.toml"
    prof.write_text("\n".join(lines) + "\n")
    cost = load_profile(prof).drafts["dspark"]
    assert cost.base_time(64, cost.gamma_ref) == pytest.approx(0.0005)
    cfg = replace(base, policy="fixed:3", deployment=replace(base.deployment, profile=str(prof)))
    s = simulate(cfg).summary
    assert s["completed"] == 40


# -- seeds -----------------------------------------------------------------------------
@pytest.mark.parametrize("spec,want", [
    ("9007199254740993", [2**53 + 1]),  # through a float: 2**53, another seed
    ("9223372036854775807", [2**63 - 1]),
    ("9007199254740993:9007199254740995:1", [2**53 + 1, 2**53 + 2, 2**53 + 3]),
    ("1e3,4.0", [1000, 4]),
])
def test_seeds_are_read_as_integers_exactly(spec, want):
    got = parse_numbers(spec, integer=True, allow_zero=True, option="--seeds")
    assert got == want and all(type(v) is int for v in got)


@pytest.mark.parametrize("spec,needle", [
    ("9007199254740993.0", "2**53"),
    ("1e18", "2**53"),
    ("1e30", "below 2**63"),
    ("1" + "0" * 400, "below 2**63"),
    ("\u0661\u0662", "bad value"),  # Arabic-Indic digits float() reads as 12
])
def test_seeds_that_a_float_would_change_are_refused(spec, needle):
    with pytest.raises(InputError, match=re.escape(needle)) as exc:
        parse_numbers(spec, integer=True, allow_zero=True, option="--seeds")
    assert str(exc.value).startswith("--seeds: ")


def test_the_sweep_runs_the_seed_it_was_given(base):
    (pt,) = build_points(base, qps=[5], policies=["none"], seeds="9007199254740993")
    assert pt.config.seed == 2**53 + 1
