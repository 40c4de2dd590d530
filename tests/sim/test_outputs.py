"""A run's summary.json + requests.parquet are one unit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest

from dspark_sim.errors import InputError
from dspark_sim.sim import outputs
from dspark_sim.sim.api import simulate
from dspark_sim.sim.outputs import read_run, sha256_file, write_run


@pytest.fixture(scope="module")
def two_runs():
    from dspark_sim.sim.config import preset

    cfg = replace(preset("tiny"), workload=replace(preset("tiny").workload, num_requests=30))
    return simulate(cfg), simulate(replace(cfg, seed=1))


def test_write_then_read_round_trip(tmp_path, two_runs):
    a, _ = two_runs
    out = a.write(tmp_path / "run")
    assert sorted(p.name for p in out.iterdir()) == ["requests.parquet", "summary.json"]
    summary, req = read_run(out)
    manifest = summary.pop("outputs")
    assert summary == json.loads(json.dumps(a.summary))
    assert manifest["requests.parquet"]["sha256"] == sha256_file(out / "requests.parquet")
    assert req.equals(a.requests)


def _fail_the_commit(monkeypatch) -> list[str]:
    """outputs' os.replace fails on summary.json, the commit, as a full disk would; the
    returned list collects the file names it was asked to rename into place."""
    real, calls = os.replace, []

    def failing(src, dst):
        calls.append(os.path.basename(dst))
        if os.path.basename(dst) == "summary.json":
            raise OSError("disk full (simulated)")
        return real(src, dst)

    monkeypatch.setattr(outputs.os, "replace", failing)
    return calls


@pytest.mark.parametrize("hard_links", [True, False], ids=["linked", "copied"])
def test_failure_between_the_two_renames_keeps_the_previous_pair(tmp_path, two_runs,
                                                                 monkeypatch, hard_links):
    a, b = two_runs
    out = a.write(tmp_path / "run")
    if not hard_links:  # a file system without them: the previous parquet is copied aside

        def no_link(src, dst):
            raise OSError("hard links not supported (simulated)")

        monkeypatch.setattr(outputs.os, "link", no_link)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    calls = _fail_the_commit(monkeypatch)
    with pytest.raises(OSError, match="simulated"):
        write_run(out, b.summary, b.requests)
    monkeypatch.undo()
    # the parquet of b had been renamed into place, then was rolled back
    assert calls[0] == "requests.parquet" and "summary.json" in calls
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no staging left
    summary, req = read_run(out)
    assert summary["seed"] == a.summary["seed"] and req.equals(a.requests)


def test_a_failed_first_write_leaves_no_file_behind(tmp_path, two_runs, monkeypatch):
    """Into a new folder (its parents made as needed): a failed commit removes the
    parquet it had renamed into place, as there was no previous one to restore."""
    a, _ = two_runs
    out = tmp_path / "new" / "run"
    _fail_the_commit(monkeypatch)
    with pytest.raises(OSError, match="simulated"):
        write_run(out, a.summary, a.requests)
    monkeypatch.undo()
    assert out.is_dir() and list(out.iterdir()) == []


def test_committed_files_get_the_mode_a_plain_open_gives(tmp_path):
    """The staging folder is mkdtemp's (0700) and a writer may make its file private
    (0600): committed files get 0666 less the umask, as open() gives (0644 under 022),
    and the process umask is left as it was found."""

    def private(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, b"x")
        os.close(fd)

    old = os.umask(0o022)
    try:
        outputs.write_unit(tmp_path / "u", "index.json", {"k": 1}, {"data.bin": private})
        assert os.umask(0o022) == 0o022
    finally:
        os.umask(old)
    for name in ("index.json", "data.bin"):
        assert (tmp_path / "u" / name).stat().st_mode & 0o777 == 0o644, name


def test_a_kill_between_the_renames_is_detected_by_readers(tmp_path, two_runs):
    """SIGKILL-like: the process dies (os._exit) right after the parquet rename, so no
    rollback runs; the reader refuses the mixed pair instead of reading it."""
    a, b = two_runs
    out = a.write(tmp_path / "run")
    b.requests.write_parquet(tmp_path / "b.parquet")
    (tmp_path / "b.json").write_text(json.dumps(b.summary))
    script = textwrap.dedent(f"""
        import json, os
        import polars as pl
        from dspark_sim.sim import outputs
        real = os.replace
        def dying(src, dst):
            if os.path.basename(dst) == "summary.json":
                os._exit(9)
            return real(src, dst)
        outputs.os.replace = dying
        outputs.write_run({str(out)!r}, json.loads(open({str(tmp_path / 'b.json')!r}).read()),
                          pl.read_parquet({str(tmp_path / 'b.parquet')!r}))
    """)
    rc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path).returncode
    assert rc == 9
    assert json.loads((out / "summary.json").read_text())["seed"] == a.summary["seed"]
    with pytest.raises(InputError, match="does not match requests.parquet") as exc:
        read_run(out)
    assert "\n" not in str(exc.value)
    # the previous parquet survives in the staging folder
    (stage,) = out.glob(".run-*")
    assert sha256_file(stage / "previous-requests.parquet") == json.loads(
        (out / "summary.json").read_text())["outputs"]["requests.parquet"]["sha256"]


def test_read_run_errors_name_the_file(tmp_path):
    with pytest.raises(InputError, match="summary.json"):
        read_run(tmp_path)
    (tmp_path / "summary.json").write_text("{not json")
    (tmp_path / "requests.parquet").write_bytes(b"PAR1")
    with pytest.raises(InputError, match="not a JSON file"):
        read_run(tmp_path)
    (tmp_path / "summary.json").write_text("{}")  # no manifest (older version): unchecked
    with pytest.raises(InputError, match="not a parquet file"):
        read_run(tmp_path)


def test_extra_tables_are_part_of_the_unit(tmp_path, two_runs, monkeypatch):
    """A third table (a real server's steps.parquet) is in the manifest, rolled back with
    the pair when the commit fails, and checked by readers."""
    import polars as pl

    a, b = two_runs
    steps_a = pl.DataFrame({"step_s": [0.5, 0.25]})
    steps_b = pl.DataFrame({"step_s": [1.0]})
    out = write_run(tmp_path / "run", a.summary, a.requests, extra={"steps.parquet": steps_a})
    summary, _ = read_run(out)
    assert set(summary["outputs"]) == {"requests.parquet", "steps.parquet"}
    assert summary["outputs"]["steps.parquet"]["sha256"] == sha256_file(out / "steps.parquet")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    _fail_the_commit(monkeypatch)
    with pytest.raises(OSError, match="simulated"):
        write_run(out, b.summary, b.requests, extra={"steps.parquet": steps_b})
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # both rolled back
    assert pl.read_parquet(out / "steps.parquet").equals(steps_a)
    steps_b.write_parquet(out / "steps.parquet")  # another run's steps beside this summary
    with pytest.raises(InputError, match="does not match steps.parquet"):
        read_run(out)
    (out / "steps.parquet").unlink()
    with pytest.raises(InputError, match="steps.parquet: not found"):
        read_run(out)


def test_validation_harness_writes_its_run_folders_as_one_unit(tmp_path, two_runs):
    """validation/harness.py's real/sim folders (summary + requests [+ steps]) go
    through the same writer: a manifest readers check."""
    import polars as pl

    from dspark_sim.validation.harness import STEP_COLUMNS, _write_run

    a, _ = two_runs
    records = [tuple(float(i + j) for j in range(len(STEP_COLUMNS))) for i in range(3)]
    _write_run(tmp_path / "real", a.summary, a.requests, steps=records)
    summary, req = read_run(tmp_path / "real")
    assert req.equals(a.requests)
    steps = pl.read_parquet(tmp_path / "real" / "steps.parquet")
    assert steps.columns == STEP_COLUMNS and steps.row(2) == records[2]
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == [
        "requests.parquet", "steps.parquet", "summary.json"]
    _write_run(tmp_path / "paired", a.summary, None)  # a summary alone: one atomic file
    assert [p.name for p in (tmp_path / "paired").iterdir()] == ["summary.json"]


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_an_interrupt_during_a_write_waits_for_the_file_then_stops(tmp_path, two_runs,
                                                                    signame):
    """polars writes a parquet on its own threads: an interrupt raised in the calling
    thread would stop the call but not the write, which would go on after the cleanup
    had run, leaving a half-written ``.run-*/requests.parquet`` or ``.NAME.*.tmp`` beside
    the output. So the signal is held until the write is committed (or rolled back), then
    delivered: a complete new pair, nothing else in the folder, then the interrupt."""
    import signal

    from dspark_sim.io import write_atomic

    a, b = two_runs
    out = a.write(tmp_path / "run")
    sig = getattr(signal, signame)
    caught: list[int] = []

    def handler(signum, _frame):
        caught.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(sig, handler)
    try:
        def interrupted_write(path):
            signal.raise_signal(sig)  # arrives mid-write: must wait
            assert not caught
            b.requests.write_parquet(path)

        with pytest.raises(KeyboardInterrupt):
            outputs.write_unit(out, "summary.json", b.summary,
                               {"requests.parquet": interrupted_write})
        assert caught == [sig]
        summary, req = read_run(out)
        assert summary["seed"] == b.summary["seed"] and req.equals(b.requests)
        assert sorted(p.name for p in out.iterdir()) == ["requests.parquet", "summary.json"]

        caught.clear()
        def interrupted_text(path):
            signal.raise_signal(sig)
            path.write_text("xxxxx")

        with pytest.raises(KeyboardInterrupt):
            write_atomic(tmp_path / "t.txt", interrupted_text)
        assert caught == [sig] and (tmp_path / "t.txt").read_text() == "xxxxx"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "t.txt"]
        assert signal.getsignal(sig) is handler  # the deferral put the handler back
    finally:
        signal.signal(sig, previous)


def test_an_interrupt_between_the_diagram_and_the_map_writes_both(tmp_path):
    """calibrate confidence --html writes the diagram, then the map: a SIGTERM between the
    two must not leave a new diagram beside the old map (or none). They are one write: both
    land, then the command stops (exit 143, no traceback)."""
    out, html = tmp_path / "m.toml", tmp_path / "m.html"
    script = textwrap.dedent(f"""
        import os, signal, sys
        from dspark_sim.calibration import fit
        from dspark_sim.cli import app
        real = fit.write_reliability_html
        def write_then_get_killed(*a, **k):
            real(*a, **k)
            os.kill(os.getpid(), signal.SIGTERM)
        fit.write_reliability_html = write_then_get_killed
        sys.argv = ["dspark-sim", "calibrate", "confidence", "--trace", "dspark-synthetic",
                    "--out", {str(out)!r}, "--html", {str(html)!r}]
        app()
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 143, r.stderr
    assert "Traceback" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.html", "m.toml"]
    from dspark_sim.calibration.confmap import load_calibration

    assert load_calibration(out).method == "temperature"


def test_sigterm_ends_a_command_like_ctrl_c(tmp_path):
    """``kill`` (SIGTERM) killed the process outright, mid-write: the temporary file
    stayed beside the output. Now every ``finally`` runs: the trace being written is
    completed and renamed into place, nothing else is left, exit code 143."""
    out = tmp_path / "t.parquet"
    script = textwrap.dedent(f"""
        import os, signal, sys
        import pyarrow.parquet as pq
        from dspark_sim.cli import app
        real = pq.write_table
        def write_then_get_killed(*a, **k):
            os.kill(os.getpid(), signal.SIGTERM)
            return real(*a, **k)
        pq.write_table = write_then_get_killed
        sys.argv = ["dspark-sim", "traces", "synth", "--out", {str(out)!r}, "--requests", "3",
                    "--positions", "16"]
        app()
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 143, r.stderr
    assert "Traceback" not in r.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["t.parquet"]
    from dspark_sim.traces.schema import read_trace

    assert read_trace(out).num_requests == 3
