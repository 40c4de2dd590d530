"""Sweeps: option parsing, grid expansion, parquet parts, resume, determinism."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace

import polars as pl
import pytest

from dspark_sim.errors import InputError
from dspark_sim.sim import sweep
from dspark_sim.sim.config import WorkloadConfig, preset
from dspark_sim.sim.sweep import (
    SweepWarning,
    build_points,
    combine,
    parse_list,
    parse_numbers,
    point_hash,
    run_points,
    run_sweep,
)

HAS_RAY = importlib.util.find_spec("ray") is not None


@pytest.fixture(scope="module")
def base():
    cfg = preset("tiny")
    return replace(cfg, workload=replace(cfg.workload, num_requests=40))


def _metrics(df: pl.DataFrame) -> pl.DataFrame:
    return df.drop("wall_s").sort("point_id")


# -- parsing -------------------------------------------------------------------------------
def test_parse_range_inclusive_and_step():
    assert parse_numbers("10:400:20") == [10.0 + 20 * i for i in range(20)]  # 390 last
    assert parse_numbers("10:50:20") == [10.0, 30.0, 50.0]  # stop included when it lands
    assert parse_numbers("0.5:1.5:0.5") == [0.5, 1.0, 1.5]


def test_parse_lists_geometric_and_mixed():
    assert parse_numbers("1,2,4", integer=True) == [1, 2, 4]
    assert parse_numbers("1:256:x2", integer=True) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert parse_numbers("1,2,4:16:x2,100,2", integer=True) == [1, 2, 4, 8, 16, 100]
    assert parse_numbers([5, 10.0]) == [5.0, 10.0]
    assert parse_numbers(None) is None  # not given; given but empty is refused below
    assert parse_numbers("0,1", integer=True, allow_zero=True) == [0, 1]
    assert parse_list("mtp1, confidence-async,,mtp1") == ["mtp1", "confidence-async"]
    assert parse_list(None) is None
    # tree specs carry commas in their arguments (a leading empty one too)
    assert parse_list("fixed:16, pctree:16,1,cure:24,2,3,0.4,dspark-tree:,2,none") == [
        "fixed:16", "pctree:16,1", "cure:24,2,3,0.4", "dspark-tree:,2", "none"]
    # one-scalar policies: a bare number is another of the same policy, not a tuple
    assert parse_list("fixed:3,5,7,threshold:0.5,0.7,skip:0.9,0.95,asd:0.5,1,8") == [
        "fixed:3", "fixed:5", "fixed:7", "threshold:0.5", "threshold:0.7", "skip:0.9",
        "skip:0.95", "asd:0.5,1,8"]
    assert parse_list("skip:0.9@fixed:3,4") == ["skip:0.9@fixed:3,4"]  # refused by the registry


@pytest.mark.parametrize("spec,why", [
    ("a", "bad value 'a'"), ("1:2", "bad value '1:2'"), ("10:5:1", "stop < start"),
    ("1:10:0", "step must be > 0"), ("1:10:x1", "factor > 1"), ("0:10:x2", "start > 0"),
    ("0", "positive"), ("-3", "positive"), ("1.5", "integers")])
def test_parse_rejects_bad_specs(spec, why):
    # each spec has its own defect, and the error names the option and that defect
    with pytest.raises(InputError, match=f"^--concurrency: .*{re.escape(why)}"):
        parse_numbers(spec, integer=True, option="--concurrency")


def test_a_rate_that_rounds_to_zero_is_refused_as_typed():
    # the error names 1e-10 as typed, not the 0.0 it rounds to (a value nobody typed)
    with pytest.raises(InputError, match=r"^--qps: 1e-10 rounds to 0: values keep 9 "
                                         r"decimals, got '5,1e-10'"):
        parse_numbers("5,1e-10")
    assert parse_numbers("1e-9,0.1:0.3:0.1") == [1e-9, 0.1, 0.2, 0.3]  # float noise kept out


def test_values_keep_nine_decimals_and_zero_where_allowed():
    assert parse_numbers("0.1234567891") == [0.123456789]
    assert parse_numbers("0,0.5", allow_zero=True) == [0.0, 0.5]


def test_option_caps_are_the_documented_ones():
    """docs/cli.md: an option expands to at most 10,000 values, integers below 2**63."""
    assert len(parse_numbers("1:10000:1", integer=True)) == 10_000
    for spec in ("1:10001:1", ",".join(map(str, range(1, 10_002)))):
        with pytest.raises(InputError, match="^--qps: .*more than 10,000 values"):
            parse_numbers(spec, integer=True)
    for big in (2**63, 2**64):
        with pytest.raises(InputError, match=r"^--seeds: values must be below 2\*\*63"):
            parse_numbers(str(big), integer=True, allow_zero=True, option="--seeds")


def test_the_grid_cap_is_100000_points(base):
    """docs/cli.md: loads x profiles x traces x policies x seeds at most 100,000 points,
    counted before any is built. 10 loads x 10,000 seeds is within the cap: the grid is
    built, and its first closed-loop point then fails on the base without a request
    count; 11 x 10,000 is refused as a grid."""
    unbounded = replace(base, workload=replace(base.workload, num_requests=None))
    seeds = "0:9999:1"
    with pytest.raises(InputError, match="^--num-requests: closed-loop sweeps need"):
        build_points(unbounded, concurrency="1:10:1", seeds=seeds, policies=["none"])
    with pytest.raises(InputError, match=r"^--qps/--concurrency: the grid has 110,000 points"):
        build_points(unbounded, qps=[5], concurrency="1:10:1", seeds=seeds, policies=["none"])


def test_grid_names_must_be_strings_and_the_base_profile_must_load(base):
    for kw, option in (({"policies": [None]}, "--policies"),
                       ({"policies": ["none"], "profiles": [None]}, "--profiles")):
        with pytest.raises(InputError, match=f"^{option}: .* names must be strings, got None"):
            build_points(base, qps=[5], **kw)
    # the base's own profile is loaded up front too, not first in a worker
    nowhere = replace(base, deployment=replace(base.deployment, profile="no-such-profile"))
    with pytest.raises(InputError, match="unknown profile 'no-such-profile'"):
        build_points(nowhere, qps=[5], policies=["none"])


def test_a_single_point_starts_no_worker_process(base, tmp_path, monkeypatch):
    """Never more workers than points: one point runs in this process, whatever
    --workers says (a spawned interpreter for it would only cost its start-up)."""

    def no_pool(*args, **kwargs):
        raise AssertionError("a worker pool was started for one point")

    monkeypatch.setattr(sweep, "ProcessPoolExecutor", no_pool)
    out = tmp_path / "new" / "sweep"  # its parents made as needed
    df = run_sweep(base, qps=[5], policies=["none"], out=out, executor="process",
                   workers=4, progress=False)
    assert df.height == 1 and df["completed"][0] == 40
    # into the same folder again: the finished point is reused, nothing is rerun
    monkeypatch.setattr(sweep, "run_point", no_pool)
    again = run_sweep(base, qps=[5], policies=["none"], out=out, executor="process",
                      workers=4, progress=False)
    assert again.equals(df)


def test_a_failed_write_closes_the_executors_row_stream_first(base, tmp_path, monkeypatch):
    """The executors shut their pool down (or cancel their ray tasks) when their row
    stream is closed: run_points closes it before a failure reaches the caller, not
    whenever the traceback holding it is freed."""
    closed = []

    def rows(points, workers):
        try:
            for pt in points:
                yield {"point_id": pt.point_id}
        finally:
            closed.append(True)

    def failing_write(out, row):
        raise OSError("disk full (simulated)")

    monkeypatch.setitem(sweep._EXECUTORS, "serial", rows)
    monkeypatch.setattr(sweep, "write_part", failing_write)
    points = build_points(base, qps=[1, 2], policies=["none"])
    with pytest.raises(OSError, match="simulated") as failure:
        sweep.run_points(points, out=tmp_path, executor="serial", progress=False)
    assert closed == [True]  # while the caller still holds the error (and its traceback)
    assert failure.value.args == ("disk full (simulated)",)


def test_the_worker_pool_is_sized_by_workers_then_cores_then_points(base, tmp_path,
                                                                    monkeypatch):
    sizes = []

    class Recorded(Exception):
        pass

    def fake_pool(*, max_workers, **kwargs):
        sizes.append(max_workers)
        raise Recorded

    monkeypatch.setattr(sweep, "ProcessPoolExecutor", fake_pool)
    monkeypatch.setattr(sweep.os, "cpu_count", lambda: 3)
    points = build_points(base, qps=[1, 2, 3, 4, 5], policies=["none"])
    for workers in (2, None):  # --workers; else one per core (3 here)
        with pytest.raises(Recorded):
            sweep.run_points(points, out=tmp_path, workers=workers, progress=False)
    with pytest.raises(Recorded):  # never more than the points
        sweep.run_points(points[:2], out=tmp_path, workers=None, progress=False)
    assert sizes == [2, 3, 2]
    # a machine that does not say how many cores it has: one worker, in this process
    monkeypatch.setattr(sweep.os, "cpu_count", lambda: None)
    assert sweep.run_points(points[:2], out=tmp_path, progress=False).height == 2


@pytest.mark.parametrize("spec", ["", " ", ",", " , ,", []])
def test_given_but_empty_lists_are_refused_not_read_as_not_given(spec):
    # None means "option not given" (callers then use their default); an empty value
    # read as None would make `--profiles ''` silently sweep the default profile
    with pytest.raises(InputError, match="^--profiles: name at least one profile"):
        parse_list(spec, option="--profiles", what="profile")
    with pytest.raises(InputError, match="^--seeds: name at least one value"):
        parse_numbers(spec, integer=True, allow_zero=True, option="--seeds")


# -- grid ----------------------------------------------------------------------------------
def test_build_points_grid_and_loads(base):
    pts = build_points(base, qps=[5, 10], concurrency=[4], policies=["mtp1", "confidence"],
                       seeds=[0, 1])
    assert len(pts) == 3 * 2 * 2
    closed = [p for p in pts if p.load_kind == "concurrency"]
    assert len(closed) == 4
    assert all(p.config.workload.arrival == "closed" and p.config.workload.max_concurrency == 4
               for p in closed)
    open_ = [p for p in pts if p.load_kind == "qps"]
    assert {p.config.workload.qps for p in open_} == {5.0, 10.0}
    assert all(p.config.workload.arrival == "poisson" for p in open_)
    assert len({p.point_id for p in pts}) == len(pts)
    # a gamma (bursty) base keeps its arrival process for qps points
    bursty = replace(base, workload=replace(base.workload, arrival="gamma", burstiness=0.5))
    assert build_points(bursty, qps=[5], policies=["mtp1"])[0].config.workload.arrival == "gamma"
    # neither qps nor concurrency: the base's own load
    (only,) = build_points(base, policies=["none"])
    assert only.load_kind == "base" and only.load == base.workload.qps


def test_qps_over_a_workload_file_replays_it_rescaled_as_run_does(base, tmp_path):
    """A base replaying a workload file (or sending its requests from a closed loop) keeps
    the file under --qps, not Poisson arrivals that silently drop it (a missing one
    never noticed). As in run, the rate rescales the file's replay."""
    import json

    from dspark_sim.sim.api import simulate

    wl = tmp_path / "w.jsonl"
    wl.write_text("".join(json.dumps({"timestamp": 1000 * i, "input_length": 10 + i,
                                      "output_length": 5}) + "\n" for i in range(6)))
    for arrival in ("replay", "closed"):
        b = replace(base, workload=replace(base.workload, arrival=arrival,
                                           workload_path=str(wl), max_concurrency=2))
        pts = build_points(b, qps=[2.0], policies=["mtp1"])
        w = pts[0].config.workload
        assert (w.arrival, w.replay_qps, pts[0].params()["qps"]) == ("replay", 2.0, 2.0)
    s = simulate(pts[0].config).summary
    assert "time-scaled to 2 req/s" in s["workload"] and s["completed"] == 6
    gone = replace(b, workload=replace(b.workload, workload_path=str(tmp_path / "no.csv")))
    with pytest.raises(InputError, match="no.csv: workload file not found"):
        simulate(build_points(gone, qps=[2.0], policies=["mtp1"])[0].config)


def test_point_hash_is_stable_and_config_sensitive(base):
    a = replace(base, policy="mtp1")
    assert point_hash(a) == point_hash(replace(base, policy="mtp1"))
    assert len(point_hash(a)) == 16 and int(point_hash(a), 16) >= 0
    assert point_hash(a) != point_hash(replace(a, seed=1))
    assert point_hash(a) != point_hash(replace(a, workload=replace(a.workload, qps=21.0)))


def test_bad_inputs_fail_before_any_work(base, tmp_path):
    with pytest.raises(InputError, match="policy"):
        run_sweep(base, qps=[5], policies=["mtp1", "bogus"], out=tmp_path, progress=False)
    with pytest.raises(InputError, match="executor"):
        run_sweep(base, qps=[5], policies=["mtp1"], out=tmp_path, executor="threads",
                  progress=False)
    # a worker per point past the cores: --workers 1000 spawned interpreters (~200 MB
    # each) until the memory ran out; True was one worker
    cap = sweep.WORKERS_PER_CORE * (os.cpu_count() or 1)
    for run in (run_sweep, run_points):
        args = (base,) if run is run_sweep else (build_points(base, qps=[5], policies=["mtp1"]),)
        kw = {"qps": [5], "policies": ["mtp1"]} if run is run_sweep else {}
        with pytest.raises(InputError, match=f"^--workers: {cap + 1:,} is above the limit of "
                                             f"{cap:,}"):
            run(*args, **kw, out=tmp_path, workers=cap + 1, progress=False)
        with pytest.raises(InputError, match="^--workers: must be a positive integer"):
            run(*args, **kw, out=tmp_path, workers=True, progress=False)
    assert not list(tmp_path.glob("points/*.parquet"))


@pytest.mark.parametrize("grid,needle", [
    # int() made 2.7 clients two and seed 1.9 (or True) seed 1, silently
    ({"concurrency": [2.7]}, "--concurrency: values must be integers"),
    ({"concurrency": [True]}, "--concurrency: values must be numbers"),
    ({"seeds": [1.9]}, "--seeds: values must be integers"),
    ({"seeds": [True]}, "--seeds: values must be numbers"),
    # ValueError / TypeError / OverflowError tracebacks of the wrong kind
    ({"qps": ["abc"]}, "--qps: bad value 'abc'"), ({"qps": [None]}, "--qps: bad value"),
    ({"concurrency": [float("nan")]}, "--concurrency: values must be positive"),
    ({"concurrency": [float("inf")]}, "--concurrency: values must be positive"),
    ({"seeds": ["x"]}, "--seeds: bad value 'x'"), ({"qps": object()}, "--qps: must be a list"),
    ({"profiles": [5]}, "--profiles: profile names must be strings"),
    ({"traces": [None, 3]}, "--traces: trace names must be strings"),
    # found only when a worker ran the point
    ({"profiles": ["no-such"]}, "--profiles: unknown profile 'no-such'"),
    ({"policies": [""]}, "--policies: empty policy name"),
])
def test_grid_values_from_python_are_checked_as_the_cli_checks_them(base, grid, needle):
    with pytest.raises(InputError) as e:
        build_points(base, **{"policies": ["mtp1"], **grid})
    assert str(e.value).startswith(needle), str(e.value)


def test_grid_strings_are_the_options_text_not_one_value_per_character(base):
    """A string was iterated: profiles='v4flash-h200' swept 12 one-letter profiles and
    policies='confidence' refused 'c'. It reads as the option's text, a number as one
    value; each gives the same points as the list."""
    as_text = build_points(base, qps="5,10", concurrency=4, policies="mtp1,fixed:3,5",
                           profiles="v4flash-h200", traces="dspark-synthetic", seeds="0:1:1")
    as_list = build_points(base, qps=[5, 10], concurrency=[4],
                           policies=["mtp1", "fixed:3", "fixed:5"], profiles=["v4flash-h200"],
                           traces=["dspark-synthetic"], seeds=[0, 1])
    assert [p.point_id for p in as_text] == [p.point_id for p in as_list]
    assert len(as_list) == 3 * 3 * 2


# -- running -------------------------------------------------------------------------------
def test_sweep_rows_parts_and_resume(base, tmp_path, monkeypatch):
    out = tmp_path / "sw"
    df = run_sweep(base, qps=[5, 20], policies=["mtp1", "confidence-async"], out=out,
                   executor="serial", progress=False)
    assert df.height == 4
    parts = sorted((out / "points").glob("*.parquet"))
    assert {p.stem for p in parts} == set(df["point_id"])
    assert (out / "results.parquet").is_file()
    for col in ("policy_spec", "load", "qps", "seed", "output_throughput_per_gpu",
                "median_interactivity", "verification_waste", "stable", "mean_concurrency"):
        assert col in df.columns, col
    assert df.schema["acceptance_per_position"] == pl.List(pl.Float64)
    conf = df.filter(pl.col("policy") == "confidence-async")
    assert conf["acceptance_per_position"].list.len().to_list() == [7, 7]
    assert (df["completed"] == 40).all()
    # throughput rises with offered load
    for pol in ("mtp1", "confidence-async"):
        g = df.filter(pl.col("policy") == pol).sort("load")
        assert g["output_throughput_per_gpu"][1] > g["output_throughput_per_gpu"][0]

    # kill one point: a rerun recomputes exactly that one
    mtimes = {p.stem: p.stat().st_mtime_ns for p in parts}
    victim = parts[1]
    victim.unlink()
    calls = []
    real = sweep.run_point

    def counting(point):
        calls.append(point.point_id)
        return real(point)

    monkeypatch.setattr(sweep, "run_point", counting)
    df2 = run_sweep(base, qps=[5, 20], policies=["mtp1", "confidence-async"], out=out,
                    executor="serial", progress=False)
    assert calls == [victim.stem]
    assert victim.is_file()
    for p in (out / "points").glob("*.parquet"):
        if p.stem != victim.stem:
            assert p.stat().st_mtime_ns == mtimes[p.stem]
    assert _metrics(df2).equals(_metrics(df))
    # a third run does nothing at all
    calls.clear()
    run_sweep(base, qps=[5, 20], policies=["mtp1", "confidence-async"], out=out,
              executor="serial", progress=False)
    assert calls == []


def test_same_seed_identical_rows_and_parallel_matches_serial(base, tmp_path):
    kw = dict(qps=[10], policies=["mtp1", "confidence"], seeds=[0, 1], progress=False)
    a = run_sweep(base, out=tmp_path / "a", executor="serial", **kw)
    b = run_sweep(base, out=tmp_path / "b", executor="process", workers=2, **kw)
    assert a.height == 4
    assert _metrics(a).equals(_metrics(b))
    s0 = a.filter((pl.col("policy") == "confidence") & (pl.col("seed") == 0))
    s1 = a.filter((pl.col("policy") == "confidence") & (pl.col("seed") == 1))
    assert s0["output_throughput"][0] != s1["output_throughput"][0]


def test_closed_loop_points_complete(base, tmp_path):
    df = run_sweep(base, concurrency=[2, 8], policies=["mtp1"], out=tmp_path,
                   executor="serial", progress=False)
    assert df["load_kind"].to_list() == ["concurrency", "concurrency"]
    assert sorted(df["concurrency"].to_list()) == [2, 8]
    assert (df["completed"] == 40).all()
    g = df.sort("concurrency")
    assert g["output_throughput_per_gpu"][1] > g["output_throughput_per_gpu"][0]


def test_combine_merges_sweeps_and_skips_damaged_parts(base, tmp_path):
    run_sweep(base, qps=[5], policies=["none"], out=tmp_path, executor="serial", progress=False)
    run_sweep(base, qps=[5], policies=["mtp1"], out=tmp_path, executor="serial", progress=False)
    (tmp_path / "points" / "garbage.parquet").write_bytes(b"not parquet")
    with pytest.warns(SweepWarning, match="garbage.parquet: cannot be read"):
        df = combine(tmp_path)
    assert sorted(df["policy"].to_list()) == ["mtp1", "none"]
    assert pl.read_parquet(tmp_path / "results.parquet").height == 2


def test_ray_missing_is_one_line_error(base, tmp_path, monkeypatch):
    # ray hidden (a None entry makes `import ray` raise ImportError): this test was
    # skipped wherever ray is installed, which is where the suite runs
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(InputError, match="ray is not installed") as exc:
        run_sweep(base, qps=[5], policies=["none"], out=tmp_path, executor="ray",
                  progress=False)
    assert "\n" not in str(exc.value)


@pytest.mark.skipif(not HAS_RAY, reason="ray not installed (optional extra)")
def test_ray_executor_matches_serial(base, tmp_path):
    kw = dict(qps=[5], policies=["none", "mtp1"], progress=False)
    a = run_sweep(base, out=tmp_path / "a", executor="serial", **kw)
    b = run_sweep(base, out=tmp_path / "b", executor="ray", workers=2, **kw)
    assert _metrics(a).equals(_metrics(b))


def test_open_loop_workload_keeps_lengths(tmp_path):
    cfg = replace(preset("tiny"), workload=WorkloadConfig(qps=10.0, num_requests=30,
                                                          lengths="fixed:64:32"))
    df = run_sweep(cfg, qps=[10], policies=["none"], out=tmp_path, executor="serial",
                   progress=False)
    assert df["total_output_tokens"][0] == 30 * 32


# -- sizing ---------------------------------------------------------------------------------
def test_sizing_requests_per_client(base):
    pts = build_points(base, concurrency=[2, 8], qps=[5], policies=["mtp1"],
                       sizing=sweep.Sizing(requests_per_client=10))
    n = {(p.load_kind, p.load): p.config.workload.num_requests for p in pts}
    # max(40, 10 x clients); open-loop points keep the base's count
    assert n == {("concurrency", 2): 40, ("concurrency", 8): 80, ("qps", 5.0): 40}
    capped = build_points(base, concurrency=[8], policies=["mtp1"],
                          sizing=sweep.Sizing(requests_per_client=10, max_requests=60))
    assert capped[0].config.workload.num_requests == 60
    with pytest.raises(InputError, match="requests-per-client"):
        build_points(base, qps=[5], policies=["mtp1"], sizing=sweep.Sizing(-1))


def test_sizing_doubles_while_the_window_is_short(base):
    # 40 and 80 requests both leave fewer than 100 in the steady window (flagged short);
    # the cap stops the doubling before 160
    sz = sweep.Sizing(max_doublings=5, max_requests=100)
    (pt,) = build_points(base, qps=[10], policies=["none"], sizing=sz)
    (plain,) = build_points(base, qps=[10], policies=["none"])
    assert pt.point_id != plain.point_id  # the sizing is part of the point's identity
    row = sweep.run_point(pt)
    assert row["size_doublings"] == 1 and row["num_requests"] == 80
    assert row["num_requests_cfg"] == 40 and row["steady_window_short"]
    row2 = sweep.run_point(plain)
    assert row2["size_doublings"] == 0 and row2["num_requests"] == 40
    # doubling up to the cap exactly is allowed, past it is not (the window doubles too)
    cfg = replace(plain.config, workload=replace(plain.config.workload, duration_s=5.0))
    doubled = sweep._doubled(cfg, max_requests=80).workload
    assert (doubled.num_requests, doubled.duration_s) == (80, 10.0)
    assert sweep._doubled(cfg, max_requests=79) is None


# -- a killed sweep leaves no workers ------------------------------------------------------
def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(d))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigkill_of_a_sweep_leaves_no_worker(tmp_path):
    """The first point is quick, the others run for minutes: once the first part is on
    disk both workers are busy with long points. SIGKILL the sweep; they must die."""
    out = tmp_path / "sw"
    script = textwrap.dedent(f"""
        from dataclasses import replace
        from dspark_sim.sim.config import SimConfig, WorkloadConfig
        from dspark_sim.sim.sweep import run_sweep
        if __name__ == "__main__":
            base = SimConfig(policy="none", workload=WorkloadConfig(
                qps=1.0, num_requests=None, duration_s=3000.0, lengths="fixed:32:8"))
            run_sweep(base, qps=[0.1, 300, 301], policies=["none"], out={str(out)!r},
                      executor="process", workers=2, progress=False)
    """)
    (tmp_path / "sweep_script.py").write_text(script)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "sweep_script.py")],
                            cwd=tmp_path, start_new_session=True)
    kids: list[int] = []
    try:
        deadline = time.monotonic() + 180
        while not list((out / "points").glob("*.parquet")):
            assert proc.poll() is None, "the sweep ended before it could be killed"
            assert time.monotonic() < deadline, "the first point never finished"
            time.sleep(0.2)
        kids = _children(proc.pid)
        assert len(kids) >= 2  # two workers (and the resource tracker)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 20
        while any(_alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [k for k in kids if _alive(k)], "orphaned sweep processes"
    finally:
        proc.kill()
        for k in kids:
            with contextlib.suppress(OSError):
                os.kill(k, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_worker_watchdog_exits_when_the_parent_dies(tmp_path):
    """The portable half of the guard alone (prctl skipped, as on macOS): a worker whose
    parent dies is re-parented, notices within a second and exits."""
    grandchild = textwrap.dedent("""
        import os, sys, time
        from dspark_sim.sim.sweep import _die_with_parent
        real, sys.platform = sys.platform, "darwin"  # no prctl: only the watchdog guards
        _die_with_parent(os.getppid())
        sys.platform = real
        print("ready", flush=True)
        time.sleep(120)
    """)
    child = textwrap.dedent(f"""
        import os, subprocess, sys
        p = subprocess.Popen([sys.executable, "-c", {grandchild!r}], stdout=subprocess.PIPE)
        assert p.stdout.readline().strip() == b"ready"
        print(p.pid, flush=True)
        os._exit(0)  # like SIGKILL: no cleanup, the grandchild is orphaned
    """)
    res = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    pid = int(res.stdout.strip())
    try:
        deadline = time.monotonic() + 20
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid)
    finally:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def test_a_ray_that_cannot_start_is_one_line(base, tmp_path, monkeypatch):
    import types

    def init(**_k):
        raise Exception("The current node timed out during startup.")

    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(
        is_initialized=lambda: False, init=init, shutdown=lambda: None))
    with pytest.raises(InputError, match="--executor process.*RAY_ADDRESS") as exc:
        run_sweep(base, qps=[5], policies=["none"], out=tmp_path, executor="ray",
                  progress=False)
    assert "\n" not in str(exc.value)
