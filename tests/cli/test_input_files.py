"""Input files as real tools write them: a byte-order mark (Excel, PowerShell), CRLF line
ends (Windows), blank lines at the end (editors, ``echo >>``), ``", "`` separators
(hand-written or spreadsheet CSV) and integral floats for counts (pandas' JSON). Each
reads exactly as the plain file does; what is really wrong (a fractional or boolean
count) is still refused, naming the file and the line."""

from __future__ import annotations

import json

import pytest
from polars.testing import assert_frame_equal

from dspark_sim.errors import InputError
from dspark_sim.sim.workload import read_workload
from dspark_sim.traces.importers import import_per_position

MOONCAKE = [{"timestamp": 0, "input_length": 100, "output_length": 20},
            {"timestamp": 500, "input_length": 50, "output_length": 10},
            {"timestamp": 900, "input_length": 70, "output_length": 5}]
AZURE = ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
         "2023-11-16 18:15:50.9951690,396,109\n2023-11-16 18:15:51.2000000,100,10\n")
PP_ROWS = [("a", 0, 2), ("a", 1, 0), ("a", 2, 3), ("b", 0, 1), ("b", 1, 4)]
PER_POSITION = "request_id,position,accept_len\n" + "".join(f"{r},{p},{a}\n"
                                                           for r, p, a in PP_ROWS)


def _variants(text: str) -> dict[str, tuple[str, str]]:
    """name -> (text, encoding) of the same content as other writers leave it."""
    return {"bom": (text, "utf-8-sig"), "crlf": (text.replace("\n", "\r\n"), "utf-8"),
            "blank-tail": (text + "\n\n", "utf-8"), "no-final-newline": (text.rstrip("\n"), "utf-8")}


def _write(path, text: str, encoding: str = "utf-8"):
    with open(path, "w", encoding=encoding, newline="") as fh:
        fh.write(text)
    return path


@pytest.mark.parametrize("variant", ["bom", "crlf", "blank-tail", "no-final-newline", "spaces"])
@pytest.mark.parametrize("kind", ["mooncake", "azure"])
def test_workload_files_read_as_the_plain_file(tmp_path, kind, variant):
    if kind == "mooncake":
        plain, suffix = "".join(json.dumps(r) + "\n" for r in MOONCAKE), ".jsonl"
        # ", " is JSON's own separator: the spaced variant writes integral floats instead
        spaced = plain.replace('"input_length": 100', '"input_length": 100.0')
    else:
        plain, suffix = AZURE, ".csv"
        spaced = AZURE.replace(",", ", ")
    want = read_workload(_write(tmp_path / f"plain{suffix}", plain))
    assert want["prompt_tokens"].to_list() == ([100, 50, 70] if kind == "mooncake"
                                               else [374, 396, 100])
    text, encoding = (spaced, "utf-8") if variant == "spaces" else _variants(plain)[variant]
    got = read_workload(_write(tmp_path / f"{variant}{suffix}", text, encoding))
    assert_frame_equal(got, want)


@pytest.mark.parametrize("variant", ["bom", "crlf", "blank-tail", "no-final-newline", "spaces"])
def test_per_position_csv_reads_as_the_plain_file(tmp_path, variant):
    want = import_per_position(_write(tmp_path / "plain.csv", PER_POSITION))
    text, encoding = (PER_POSITION.replace(",", ", "), "utf-8") if variant == "spaces" \
        else _variants(PER_POSITION)[variant]
    got = import_per_position(_write(tmp_path / "v.csv", text, encoding), domain="plain")
    assert got.accept_len.tolist() == want.accept_len.tolist() == [2, 0, 3, 1, 4]
    assert list(got.req_ids) == list(want.req_ids) == ["a", "b"]


def test_per_position_jsonl_with_a_byte_order_mark_reads_as_the_plain_file(tmp_path):
    text = "".join(json.dumps({"request_id": r, "position": p, "accept_len": a}) + "\n"
                   for r, p, a in PP_ROWS)
    want = import_per_position(_write(tmp_path / "plain.jsonl", text))
    got = import_per_position(_write(tmp_path / "bom.jsonl", text, "utf-8-sig"), domain="plain")
    assert got.accept_len.tolist() == want.accept_len.tolist() == [2, 0, 3, 1, 4]


def test_a_blank_line_inside_a_csv_keeps_the_line_numbers_of_the_rows_after_it(tmp_path):
    # header 1, a: 2-4, blank 5, b: 6-7
    text = PER_POSITION.replace("b,0,1\n", "\nb,0,1\n").replace("b,1,4\n", "b,1,-4\n")
    with pytest.raises(InputError, match=r"bad\.csv: line 7: accept_len .* got '-4'"):
        import_per_position(_write(tmp_path / "bad.csv", text))


@pytest.mark.parametrize("value, message", [
    ("100.7", "token count 100.7 is not a whole number"),
    ("true", "token count True is not a number"),
    ("[100]", "token count \\[100\\] is not a number"),
    # 10**30 made a 128-bit polars column (a traceback); past the --lengths limit
    (str(10**30), f"token count {10**30} is above the per-request limit of 16,777,216"),
    (str((1 << 24) + 1), "token count 16777217 is above the per-request limit of 16,777,216"),
    pytest.param("true", "timestamp True is not a number", id="timestamp-true"),
])
def test_mooncake_counts_that_are_not_whole_numbers_are_refused(tmp_path, value, message):
    key = "timestamp" if "timestamp" in message else "input_length"
    old = '"timestamp": 500' if key == "timestamp" else '"input_length": 50'
    text = "".join(json.dumps(r) + "\n" for r in MOONCAKE).replace(old, f'"{key}": {value}')
    with pytest.raises(InputError, match=f"bad.jsonl: line 2: not a Mooncake record \\({message}\\)"):
        read_workload(_write(tmp_path / "bad.jsonl", text))


def test_azure_token_counts_past_the_per_request_limit_are_refused(tmp_path):
    """An int64-sized count (9223372036854775807) was taken as a request and refused at
    arrival; the file holds a count no --lengths spec may give: refused, naming the row."""
    text = AZURE.replace(",396,", f",{(1 << 63) - 1},")
    with pytest.raises(InputError, match="big.csv: prompt_tokens above the per-request "
                                         "limit of 16,777,216 in data row 2"):
        read_workload(_write(tmp_path / "big.csv", text))
    assert read_workload(_write(tmp_path / "ok.csv", AZURE.replace(",396,", f",{1 << 24},"))
                         )["prompt_tokens"].max() == 1 << 24


def test_toml_files_with_a_byte_order_mark_read_as_without(tmp_path):
    """Notepad and PowerShell write UTF-8 with a BOM: a profile, a config, a calibration
    map and a sheet read the same with it (tomllib alone calls it invalid TOML)."""
    from importlib import resources

    from dspark_sim.calibration.confmap import load_calibration
    from dspark_sim.calibration.profile import load_profile
    from dspark_sim.calibration.roofline import profile_from_sheets
    from dspark_sim.sim.config import load_config

    def both(name: str, text: str):
        return (_write(tmp_path / f"plain-{name}", text),
                _write(tmp_path / f"bom-{name}", text, "utf-8-sig"))

    data = resources.files("dspark_sim.calibration") / "data"
    plain, bom = both("p.toml", (data / "qwen3-8b-h100.toml").read_text())
    assert load_profile(bom).to_toml() == load_profile(plain).to_toml()
    plain, bom = both("c.toml", "[engine]\nmax_num_seqs = 32\n[workload]\nqps = 5.0\n")
    assert load_config(bom) == load_config(plain)
    assert load_config(bom).engine.max_num_seqs == 32
    plain, bom = both("m.toml", (data / "calibration" / "smollm2-dspark-sts.toml").read_text())
    assert load_calibration(bom).to_toml() == load_calibration(plain).to_toml()
    plain, bom = both("s.toml", 'hardware = "H100"\nmodel = "qwen3-8b"\n[deployment]\n'
                                "gpus_per_replica = 1\noverhead_ms = 1\n")
    assert profile_from_sheets(bom, name="s").to_toml() == \
        profile_from_sheets(plain, name="s").to_toml()


def test_a_replay_past_the_clock_names_the_file_unless_a_rate_was_given(tmp_path):
    """Timestamps 1e300 ms apart are the file's fault (no option was given to blame);
    with --replay-qps the rate is what makes the span (0.001 req/s over 3 requests is
    2,000 s: fine; 1e-12 req/s is 2e12 s: past the clock)."""
    from typer.testing import CliRunner

    from dspark_sim.cli import app

    wide = _write(tmp_path / "wide.jsonl", "".join(
        json.dumps(r | {"timestamp": r["timestamp"] * 1e300}) + "\n" for r in MOONCAKE))
    r = CliRunner().invoke(app, ["run", "--workload", str(wide), "--quiet"])
    assert r.exit_code == 2 and r.output.startswith(f"error: {wide}: the replay spans 9e+299 s")
    plain = _write(tmp_path / "plain.jsonl", "".join(json.dumps(r) + "\n" for r in MOONCAKE))
    r = CliRunner().invoke(app, ["run", "--workload", str(plain), "--replay-qps", "1e-12",
                                 "--quiet"])
    assert r.exit_code == 2 and r.output.startswith("error: --replay-qps: the replay spans 2e+12 s")


DEEP_JSON = "[" * 100_000 + "]" * 100_000  # past the C parser's recursion limit
DEEP_TOML = "x = " + DEEP_JSON + "\n"       # tomllib recurses per nested array too


def _deep_trace(path):
    import pyarrow.parquet as pq

    from dspark_sim.traces.schema import META_KEY, load_trace

    table = load_trace("mtp1-synthetic").to_polars().head(4).to_arrow()
    pq.write_table(table.replace_schema_metadata({META_KEY: DEEP_JSON.encode()}), path)
    return load_trace(path)


def _deep_run_folder(path):
    from dspark_sim.sim.outputs import read_run

    path.mkdir()
    (path / "summary.json").write_text(DEEP_JSON)
    (path / "requests.parquet").write_bytes(b"")
    return read_run(path)


def _loaders():
    from dspark_sim.calibration.confmap import load_calibration
    from dspark_sim.calibration.profile import load_profile
    from dspark_sim.calibration.roofline import profile_from_sheets
    from dspark_sim.sim.config import load_config
    from dspark_sim.sim.report import read_vllm_results
    from dspark_sim.traces.importers import import_specdecode_bench, read_vllm_counters

    def load_prompts(folder):
        # imported here, not at collection: traces.targets needs torch, and the mutation
        # runner (tools/mutation.py) collects this file with torch blocked
        return pytest.importorskip("dspark_sim.traces.targets").load_prompts(folder)

    def file(name, text, load):
        return lambda d: load(_write(d / name, text))

    return {
        "trace metadata": lambda d: _deep_trace(d / "t.parquet"),
        "mooncake workload": file("w.jsonl", DEEP_JSON + "\n", read_workload),
        "vllm results": file("r.json", DEEP_JSON, read_vllm_results),
        "vllm counters": file("b.json", "{" + f'"a": {DEEP_JSON}' + "}", read_vllm_counters),
        "specdecode-bench": file("s.jsonl", DEEP_JSON + "\n", import_specdecode_bench),
        "per-position jsonl": file("p.jsonl", DEEP_JSON + "\n", import_per_position),
        "prompts": lambda d: load_prompts(_write(d / "gsm8k.jsonl", DEEP_JSON + "\n").parent),
        "run summary": lambda d: _deep_run_folder(d / "run"),
        "config": file("c.toml", DEEP_TOML, load_config),
        "profile": file("p.toml", DEEP_TOML, load_profile),
        "calibration map": file("m.toml", DEEP_TOML, load_calibration),
        "sheet": file("s.toml", DEEP_TOML, lambda p: profile_from_sheets(p, name="s")),
    }


@pytest.mark.parametrize("kind", list(_loaders()))
def test_a_document_nested_too_deeply_is_malformed_input_not_a_recursion_error(tmp_path, kind):
    """``json.loads`` and ``tomllib`` raise RecursionError on ~10^5 nested brackets, which
    the readers' ``except JSONDecodeError`` / ``TOMLDecodeError`` missed: a traceback from
    every command reading the file. It is malformed JSON / TOML like any other."""
    with pytest.raises(InputError, match="nested too deeply") as err:
        _loaders()[kind](tmp_path)
    assert str(tmp_path) in str(err.value) and "\n" not in str(err.value)
