"""``traces import`` of several files or a folder: one trace holding every file's requests
as each file alone imports them, ids unique across the files, and one-line refusals of
mixed formats, gamma_max mismatches and confidences in some files only."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from input_checks import one_line_error
from typer.testing import CliRunner

from dspark_sim.cli import app
from dspark_sim.traces.import_files import import_files
from dspark_sim.traces.importers import import_trace
from dspark_sim.traces.schema import read_trace

DATA = Path(__file__).parents[1] / "data"
SDB = DATA / "specdecode_bench" / "combined_fixture.jsonl"
VPR = DATA / "vllm-per-request"
runner = CliRunner()


def _rows(t, i: int) -> list[int]:
    return t.accept_len[t.req_offsets[i]:t.req_offsets[i + 1]].tolist()


def _pp(path: Path, runs: dict, conf: bool = False) -> Path:
    """A per-position JSONL: request id -> its accept_len per position."""
    lines = [{"request_id": rid, "position": j, "accept_len": m}
             | ({"conf": [0.5, 0.5, 0.5, 0.5]} if conf else {})
             for rid, ms in runs.items() for j, m in enumerate(ms)]
    path.write_text("".join(json.dumps(d) + "\n" for d in lines))
    return path


def test_a_folder_is_every_file_in_name_order_with_ids_prefixed_where_they_collide(tmp_path):
    d = tmp_path / "bench"
    d.mkdir()
    lines = SDB.read_text().splitlines()
    (d / "combined_b.jsonl").write_text("\n".join(lines[:4]) + "\n")
    shutil.copy(SDB, d / "combined_a.jsonl")
    (d / "notes.md").write_text("not data\n")
    out = tmp_path / "t.parquet"
    r = runner.invoke(app, ["traces", "import", "--format", "specdecode-bench", str(d),
                            "--out", str(out)])
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())
    assert "combined 2 specdecode-bench files in name order" in said
    assert "combined_a.jsonl: 6, combined_b.jsonl: 4 requests" in said
    assert "prefixed by their file's stem" in said and "skipped 1 file" in said
    t = read_trace(out)
    a, b = import_trace("specdecode-bench", d / "combined_a.jsonl"), \
        import_trace("specdecode-bench", d / "combined_b.jsonl")
    assert t.num_requests == 10 and len(set(t.req_ids.tolist())) == 10
    assert t.req_ids.tolist() == [f"combined_a:{i}" for i in a.req_ids] + \
        [f"combined_b:{i}" for i in b.req_ids]
    assert [_rows(t, i) for i in range(10)] == \
        [_rows(a, i) for i in range(6)] + [_rows(b, i) for i in range(4)]
    assert t.req_output_tokens.tolist() == a.req_output_tokens.tolist() + \
        b.req_output_tokens.tolist()
    assert set(t.meta.domains) == {"a", "b"}
    assert [p["file"] for p in t.meta.extra["combined_from"]] == ["combined_a.jsonl",
                                                                  "combined_b.jsonl"]


def test_unique_ids_are_kept_and_gamma_max_is_the_longest_run_of_all_files(tmp_path):
    one = _pp(tmp_path / "one.jsonl", {7: [0, 2, 1], 3: [1, 0]})
    two = _pp(tmp_path / "two.jsonl", {5: [4, 0, 0, 1]})
    got = import_files("per-position", [two, one])
    t = got.trace
    assert t.gamma_max == 4 and "gamma_max 4, the longest accepted run" in got.note
    assert "request ids kept" in got.note
    assert t.req_ids.tolist() == [3, 5, 7]  # integers sort, as a trace file reads back
    assert [_rows(t, i) for i in range(3)] == [[1, 0], [4, 0, 0, 1], [0, 2, 1]]
    # the same rows whichever order the files come in
    u = import_files("per-position", [one, two]).trace
    assert np.array_equal(u.accept_len, t.accept_len) and u.req_ids.tolist() == [3, 5, 7]
    # one file alone imports as before, with nothing to say
    alone = import_files("per-position", [one])
    assert alone.note == "" and alone.trace.gamma_max == 2


def test_vllm_per_request_files_pool_their_acceptance_length(tmp_path):
    got = import_files("vllm-per-request", [VPR])
    parts = [import_trace("vllm-per-request", f) for f in sorted(VPR.iterdir())]
    t, e = got.trace, [p.meta.extra for p in parts]
    assert t.num_requests == sum(p.num_requests for p in parts)
    steps = sum(x["steps_with_proposal"] for x in e)
    assert t.meta.extra["steps_with_proposal"] == steps
    accepted = sum(round((x["vllm_acceptance_length"] - 1) * x["steps_with_proposal"])
                   for x in e)
    assert t.meta.extra["vllm_acceptance_length"] == pytest.approx(1 + accepted / steps,
                                                                   abs=1e-6)
    assert np.array_equal(t.draft_tokens, np.concatenate([p.draft_tokens for p in parts]))
    assert "no per-request lengths: spec-metrics.jsonl has none" in got.note


def test_mixed_formats_gamma_mismatch_and_partial_confidences_are_refused(tmp_path):
    pp = _pp(tmp_path / "pp.jsonl", {1: [0, 1]})
    out = tmp_path / "t.parquet"

    def refused(fmt, *srcs, needles):
        r = runner.invoke(app, ["traces", "import", "--format", fmt, *map(str, srcs),
                                "--out", str(out)])
        one_line_error(r, *needles)
        assert not out.exists()

    refused("per-position", pp, SDB, needles=["mixed formats", "combined_fixture.jsonl is "
                                              "specdecode-bench"])
    k5 = tmp_path / "k5.jsonl"
    k5.write_text((VPR / "spec-metrics.jsonl").read_text().replace(
        '"num_spec_tokens": 3', '"num_spec_tokens": 5'))
    refused("vllm-per-request", VPR / "spec-metrics.jsonl", k5,
            needles=["gamma_max mismatch", "spec-metrics.jsonl 3", "k5.jsonl 5"])
    conf = _pp(tmp_path / "conf.jsonl", {2: [0, 3]}, conf=True)
    refused("per-position", conf, pp, needles=["conf.jsonl carries confidences",
                                               "pp.jsonl does not"])
    refused("per-position", pp, tmp_path / "pp.jsonl", needles=["given twice"])
