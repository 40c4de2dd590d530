"""Simulator speed, before and after, side by side in one run (prints figures; never a
timed test).

Each revision named by ``--before`` is installed non-editably (``git archive`` + ``pip
install --no-deps --target``) into a temporary folder and measured in a subprocess with
``PYTHONPATH`` pointing there; "after" is the code this interpreter imports (the working
tree), or ``--after REV`` installed the same way. The same measuring code (this file, in worker mode) runs against every revision,
on the same machine, in the same run, so the ratios compare like with like.

What it measures (CPU seconds of the worker process: wall time on a shared 2-core box is
noisier; both are printed where they matter):

* **per step**: microseconds per engine step at decode batches of 1, 12, 64 and 256 for
  ``none`` and ``confidence`` (one replica, a closed loop of B clients with short prompts
  and 1024-token outputs, profile qwen3-8b-h100). The difference of a run of 1 and one
  of 1 + R rounds of B requests (R sized to ~3,000 steps), so the run's setup and output
  frame cancel out; best of ``--repeats``.
* **standard**: ``confidence``, 200 req/s Poisson, 600 simulated seconds, each revision's
  own default deployment (printed: the defaults have changed over time).
* **matched 10k**: the workload docs/performance.md compares with Vidur (10,000
  requests, one replica, azure-conv lengths, qwen3-8b-h100, 128 seqs, 512 batched tokens,
  seed 0; ``none`` at 5.75 req/s and ``confidence`` at 14 req/s).
* **start-up**: a fresh process's import + first small run, with an empty compiled-kernel
  cache (cold: the JIT compiles, or the module compiled ahead of time is built) and with
  the cache the cold run left (warm: after any build it started in the background has
  ended); and the same for ``dspark-sim run --num-requests 1`` (CPU s of the process),
  which takes the numpy path while the module is missing.
* **day** (``--day``, long): ``run --duration-s 86400 --qps 200`` through the CLI, wall
  time and peak RSS (``--day-s`` to measure a shorter span and extrapolate).

``--rounds N`` measures every revision N times, interleaved (A, B, A, B, ...), and keeps
each figure's fastest run: on a shared VM one revision's speed has been seen to vary
5.8-8.6 s between runs minutes apart, so a single round's ratio can be off by a third.

    python benchmarks/bench_sim.py                           # vs 2e06095, a few minutes
    python benchmarks/bench_sim.py --only standard --rounds 3
    python benchmarks/bench_sim.py --before 2e06095 --before HEAD
    python benchmarks/bench_sim.py --before none --cprofile  # where the time goes now
    python benchmarks/bench_sim.py --only standard --standard-s 120
    python benchmarks/bench_sim.py --day --day-s 3600        # the simulated day, shortened
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import os
import pstats
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BATCHES = (1, 12, 64, 256)
POLICIES = ("none", "confidence")
MATCHED = {"none": 5.75, "confidence": 14.0}  # req/s of the matched 10k-request workload
TASKS = ("startup", "step", "standard", "matched")


# -- worker: runs inside the revision under test ---------------------------------------
def _config(policy: str, *, engine: dict | None = None, deployment: dict | None = None,
            workload: dict | None = None, seed: int = 0):
    """A SimConfig built from the fields this revision has (older ones lack some)."""
    from dspark_sim.sim.config import SimConfig

    cfg = SimConfig(policy=policy, seed=seed)

    def merged(obj, values):
        names = {f.name for f in dataclasses.fields(obj)}
        missing = set(values) - names
        if missing:
            raise SystemExit(f"this revision's config lacks {sorted(missing)}")
        return dataclasses.replace(obj, **values)

    return dataclasses.replace(cfg, engine=merged(cfg.engine, engine or {}),
                               deployment=merged(cfg.deployment, deployment or {}),
                               workload=merged(cfg.workload, workload or {}))


def _timed(cfg) -> dict:
    from dspark_sim.sim.api import simulate

    t0, c0 = time.perf_counter(), time.process_time()
    res = simulate(cfg)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    s = res.summary
    return {"wall_s": wall, "cpu_s": cpu, "steps": s["engine_steps"],
            "requests": s["num_requests"], "mean_decode_batch": s.get("mean_decode_batch"),
            "deployment": s.get("deployment"), "output_throughput": s["output_throughput"]}


def _step_cfg(policy: str, batch: int, rounds: int):
    return _config(policy, deployment={"replicas": 1, "profile": "qwen3-8b-h100"},
                   engine={"max_num_seqs": 256, "max_num_batched_tokens": 8192},
                   workload={"arrival": "closed", "max_concurrency": batch,
                             "num_requests": batch * rounds, "duration_s": None,
                             "lengths": "fixed:32:1024"})


def work_step(repeats: int, policies: list[str], steps: int = 3000) -> dict:
    """The difference of a 1-round run and a (1 + R)-round run, R sized so the difference
    holds ~``steps`` engine steps (a small batch's round is few steps: CPU-time noise of
    a few ms would swamp it)."""
    out = {}
    for policy in policies:
        for batch in BATCHES:
            first = _timed(_step_cfg(policy, batch, 1))  # first-use costs (profile, trace)
            rounds = 1 + max(2, -(-steps // max(1, first["steps"])))
            best = None
            for _ in range(repeats):
                short, long = _timed(_step_cfg(policy, batch, 1)), \
                    _timed(_step_cfg(policy, batch, rounds))
                us = (long["cpu_s"] - short["cpu_s"]) / (long["steps"] - short["steps"]) * 1e6
                best = us if best is None else min(best, us)
            out[f"{policy}@{batch}"] = {"us_per_step": best,
                                        "mean_decode_batch": long["mean_decode_batch"]}
    return out


def work_standard(duration_s: float, profile: bool) -> dict:
    cfg = _config("confidence", workload={"qps": 200.0, "duration_s": duration_s,
                                          "num_requests": None})
    rss0_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux: KiB
    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    r = _timed(cfg)
    if prof:
        prof.disable()
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    r["rss_growth_mib"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0_kib) / 1024
    return r


def work_matched(pairs: int) -> dict:
    out = {}
    for policy, qps in MATCHED.items():
        cfg = _config(policy, deployment={"replicas": 1, "profile": "qwen3-8b-h100"},
                      engine={"max_num_seqs": 128, "max_num_batched_tokens": 512},
                      workload={"qps": qps, "num_requests": 10_000, "duration_s": None,
                                "lengths": "azure-conv"})
        runs = [_timed(cfg) for _ in range(pairs)]
        out[policy] = min(runs, key=lambda r: r["cpu_s"])
    return out


def work_startup() -> dict:
    t0 = time.perf_counter()
    from dspark_sim.sim.api import simulate

    cfg = _config("confidence", workload={"num_requests": 50, "duration_s": None})
    simulate(cfg)
    return {"first_run_s": time.perf_counter() - t0}


def _wait_for_kernels() -> None:
    """At a revision that builds the kernels' module in the background, build it (or wait
    for the build under way) before measuring: the figures are then the module's, as a
    machine's later runs see them, and no build shares the CPU with them."""
    import inspect

    try:
        from dspark_sim.policies import aot
    except ImportError:  # a revision without the module
        return
    if "wait" in inspect.signature(aot.load).parameters:
        aot.load(wait=True)


def worker(args) -> None:
    import dspark_sim

    res: dict = {"dspark_sim": str(Path(dspark_sim.__file__).parent)}
    tasks = args.worker.split(",")
    if "startup" in tasks:
        res["startup"] = work_startup()
    else:  # the other tasks measure steady speed: compile / warm imports first
        from dspark_sim.sim.api import simulate

        _wait_for_kernels()
        simulate(_config("confidence", workload={"num_requests": 50, "duration_s": None}))
    if "step" in tasks:
        res["step"] = work_step(args.repeats, args.policies.split(","))
    if "standard" in tasks:
        res["standard"] = work_standard(args.standard_s, args.cprofile)
    if "matched" in tasks:
        res["matched"] = work_matched(args.pairs)
    print("BENCH-JSON " + json.dumps(res))


# -- orchestrator ----------------------------------------------------------------------
def install_revision(rev: str, root: Path) -> tuple[str, Path]:
    """``rev`` as a non-editable install under ``root``; returns (short hash, site dir)."""
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout.strip()
    src, site = root / f"src-{sha}", root / f"site-{sha}"
    if site.exists():
        return sha, site
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", sha], cwd=REPO, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--target", str(site), str(src)], check=True,
                   capture_output=True)
    return sha, site


def run_worker(tasks: list[str], site: Path | None, cache: Path, args) -> dict:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))
    if site is not None:
        env["PYTHONPATH"] = str(site)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", ",".join(tasks),
           "--repeats", str(args.repeats), "--standard-s", str(args.standard_s),
           "--pairs", str(args.pairs), "--policies", args.policies] + (["--cprofile"] if args.cprofile else [])
    # cwd outside the checkout: a revision's own install must win over the work tree
    p = subprocess.run(cmd, env=env, cwd=tempfile.gettempdir(), capture_output=True,
                       text=True)
    if args.cprofile and p.stderr:
        print(p.stderr, file=sys.stderr)
    if p.returncode:
        raise SystemExit(f"worker {tasks} ({site or 'work tree'}) failed:\n{p.stderr[-3000:]}")
    line = next(x for x in p.stdout.splitlines() if x.startswith("BENCH-JSON "))
    return json.loads(line[len("BENCH-JSON "):])


def run_day(site: Path | None, cache: Path, day_s: float) -> dict:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))
    if site is not None:
        env["PYTHONPATH"] = str(site)
    out = Path(tempfile.mkdtemp(prefix="bench-day-"))
    code = ("import sys; from dspark_sim.cli import main; sys.argv = ['dspark-sim'] + "
            "sys.argv[1:]; main()")
    t0 = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.run([sys.executable, "-c", code, "run", "--duration-s", f"{day_s:g}",
                        "--qps", "200", "--quiet", "--out",
                        str(out / "run")], env=env, cwd=tempfile.gettempdir(),
                       capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    shutil.rmtree(out, ignore_errors=True)
    if p.returncode:
        return {"error": p.stderr.strip().splitlines()[-1] if p.stderr.strip() else "failed"}
    return {"wall_s": wall, "cpu_s": after.ru_utime - before.ru_utime
            + after.ru_stime - before.ru_stime, "peak_rss_mib": after.ru_maxrss / 1024}


def run_cli_startup(site: Path | None, cache: Path) -> dict:
    """``dspark-sim run --num-requests 1`` in a fresh process: wall and CPU s."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))
    env.pop("DSPARK_SIM_KERNELS", None)
    if site is not None:
        env["PYTHONPATH"] = str(site)
    code = ("import sys; from dspark_sim.cli import main; sys.argv = ['dspark-sim'] + "
            "sys.argv[1:]; main()")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", code, "run", "--num-requests", "1", "--quiet"],
                       env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode:
        raise SystemExit(f"run --num-requests 1 ({site or 'work tree'}) failed:\n"
                         f"{p.stderr[-3000:]}")
    return {"wall_s": wall, "cpu_s": after.ru_utime - before.ru_utime
            + after.ru_stime - before.ru_stime}


def wait_for_builds(cache: Path) -> None:
    """Wait for the kernels' module a run left building in the background (its build
    holds the key's lock, ``policies/aot.py``): the next figure is then the module's,
    not the build's, and the build does not share the CPU with it."""
    import fcntl

    for lock in sorted(cache.glob("**/*.lock")):
        with open(lock, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)


def keep_best(col: dict, res: dict) -> None:
    """Merge a worker's figures into ``col``, keeping each figure's fastest run: the
    standard run and each matched policy by CPU s, each per-step cell by its us."""
    col.setdefault("dspark_sim", res["dspark_sim"])
    if "standard" in res and ("standard" not in col
                              or res["standard"]["cpu_s"] < col["standard"]["cpu_s"]):
        col["standard"] = res["standard"]
    for task, figure in (("matched", "cpu_s"), ("step", "us_per_step")):
        for key, run in res.get(task, {}).items():
            best = col.setdefault(task, {}).get(key)
            if best is None or run[figure] < best[figure]:
                col[task][key] = run


def _ratio(before: float | None, after: float | None) -> str:
    return f"{before / after:6.2f}x" if before and after else "      -"


def report(cols: list[tuple[str, dict]], args) -> None:
    names = [n for n, _ in cols]
    w = 12
    head = "".join(f"{n:>{w}}" for n in names)
    ratios = "".join(f"{'x ' + n:>{w}}" for n in names[:-1])
    where = ", ".join(f"{n} = {c['dspark_sim']}" for n, c in cols)
    print(f"\ncolumns: {where}")
    print(f"ratios: the column's figure / {names[-1]}'s (above 1: {names[-1]} is faster)")

    def row(label, get, fmt="{:.2f}"):
        vals = [get(c) for _, c in cols]
        cells = "".join(f"{fmt.format(v) if v is not None else '-':>{w}}" for v in vals)
        rs = "".join(f"{_ratio(v, vals[-1]):>{w}}" for v in vals[:-1])
        print(f"  {label:<34}{cells}{rs}")

    def get(*keys):
        def f(c):
            for k in keys:
                if not isinstance(c, dict) or k not in c:
                    return None
                c = c[k]
            return c
        return f

    if "startup" in args.only:
        print(f"\nstart-up: import + a 50-request run in a fresh process (wall s){head}{ratios}")
        row("cold (empty kernel cache)", get("startup_cold", "first_run_s"))
        row("warm (cache kept)", get("startup_warm", "first_run_s"))
        row("run --num-requests 1, cold: CPU s", get("cli_cold", "cpu_s"))
        row("run --num-requests 1, cold: wall s", get("cli_cold", "wall_s"))
        row("run --num-requests 1, warm: CPU s", get("cli_warm", "cpu_s"))
    if "step" in args.only:
        print(f"\nus of CPU per engine step (closed loop, 1 replica){' ' * 6}{head}{ratios}")
        for policy in args.policies.split(","):
            for b in BATCHES:
                row(f"{policy} @ batch {b}", get("step", f"{policy}@{b}", "us_per_step"),
                    "{:.1f}")
    if "standard" in args.only:
        best = f", best of {args.rounds}" if args.rounds > 1 else ""
        print(f"\nstandard: confidence, 200 req/s, {args.standard_s:g} s simulated{best}"
              f"{head}{ratios}")
        row("CPU s", get("standard", "cpu_s"))
        row("wall s", get("standard", "wall_s"))
        row("us CPU per step", lambda c: c["standard"]["cpu_s"] / c["standard"]["steps"] * 1e6
            if "standard" in c else None, "{:.1f}")
        row("engine steps", get("standard", "steps"), "{:,.0f}")
        row("peak RSS growth MiB", get("standard", "rss_growth_mib"), "{:.0f}")
        for n, c in cols:
            if "standard" in c:
                print(f"    {n}: {c['standard']['deployment']}")
    if "matched" in args.only:
        print(f"\nmatched 10k requests (best of {args.pairs * args.rounds}; Vidur 33.7 s wall)"
              f"{' ' * 5}"
              f"{head}{ratios}")
        for policy, qps in MATCHED.items():
            row(f"{policy} @ {qps:g} req/s: CPU s", get("matched", policy, "cpu_s"))
            row(f"{policy} @ {qps:g} req/s: wall s", get("matched", policy, "wall_s"))
            row("  Vidur 33.7 s / wall", lambda c, p=policy: 33.7 / c["matched"][p]["wall_s"]
                if "matched" in c else None, "{:.1f}x")
    if args.day:
        scale = 86400 / args.day_s
        print(f"\nsimulated day: run --duration-s {args.day_s:g} --qps 200"
              f"{' (x' + format(scale, 'g') + ' extrapolated to a day)' if scale != 1 else ''}"
              f"{head}{ratios}")
        row("wall s", get("day", "wall_s"))
        row("CPU s", get("day", "cpu_s"))
        row("peak RSS MiB", get("day", "peak_rss_mib"), "{:.0f}")
        if scale != 1:
            row("wall s, a day (linear)", lambda c: c["day"]["wall_s"] * scale
                if "wall_s" in c.get("day", {}) else None)
        if 200 * args.day_s <= 1e6:
            # sim.api.STREAM_ABOVE: a run this short holds every request in memory, so its
            # peak RSS says nothing of a day's (streamed: it stays flat)
            print("    (<= 1,000,000 requests: held in memory, not streamed as a day is; "
                  "its peak RSS does not extrapolate)")
        for n, c in cols:
            if "error" in c.get("day", {}):
                print(f"    {n}: {c['day']['error']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", action="append",
                    help="git revision to compare against (repeatable; 'none': after only); "
                         "default 2e06095")
    ap.add_argument("--after", default="worktree",
                    help="what 'after' is: the imported work tree (default) or a revision")
    ap.add_argument("--only", default=",".join(TASKS),
                    help=f"comma-separated subset of {','.join(TASKS)}")
    ap.add_argument("--standard-s", type=float, default=600.0)
    ap.add_argument("--repeats", type=int, default=2, help="per-step runs, best of")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help="comma-separated policies the per-step figures run (e.g. "
                         "none,fixed:3,confidence,vllm-adaptive); default %(default)s")
    ap.add_argument("--pairs", type=int, default=1, help="matched-workload runs, best of")
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure every revision this many times, interleaved; best of")
    ap.add_argument("--day", action="store_true", help="also the simulated day (long)")
    ap.add_argument("--day-s", type=float, default=86400.0)
    ap.add_argument("--cprofile", action="store_true", help="profile the standard run")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    args.only = args.only.split(",")
    if args.rounds < 1:
        raise SystemExit(f"--rounds: need a whole number >= 1, got {args.rounds}")
    bad = set(args.only) - set(TASKS)
    if bad:
        raise SystemExit(f"--only: unknown {sorted(bad)}; use {','.join(TASKS)}")
    revs = [r for r in (args.before or ["2e06095"]) if r != "none"]
    root = Path(tempfile.mkdtemp(prefix="bench-sim-"))
    try:
        targets: list[tuple[str, Path | None]] = [install_revision(r, root) for r in revs]
        if args.after == "worktree":
            targets.append(("after", None))
        else:  # a committed revision, installed like the ones before
            targets.append(("after", install_revision(args.after, root)[1]))
        cols: dict[str, dict] = {name: {} for name, _ in targets}
        rest = [t for t in args.only if t != "startup"]
        # Rounds interleave the revisions (A, B, A, B, ...) and keep each one's best: a
        # shared VM's speed drifts by tens of percent over minutes, and a drift lands on
        # every revision alike instead of on whichever ran during it.
        for rnd in range(args.rounds):
            for name, site in targets:
                cache = root / f"numba-{name}"
                col = cols[name]
                if rnd == 0 and "startup" in args.only:
                    col["startup_cold"] = run_worker(["startup"], site, cache, args)["startup"]
                    wait_for_builds(cache)
                    col["startup_warm"] = run_worker(["startup"], site, cache, args)["startup"]
                    cli_cache = root / f"numba-{name}-cli"
                    col["cli_cold"] = run_cli_startup(site, cli_cache)
                    wait_for_builds(cli_cache)
                    col["cli_warm"] = run_cli_startup(site, cli_cache)
                if rest:
                    wait_for_builds(cache)
                    keep_best(col, run_worker(rest, site, cache, args))
                if rnd == 0 and args.day:
                    col["day"] = run_day(site, cache, args.day_s)
                col.setdefault("dspark_sim", str(site or "work tree"))
                print(f"measured {name} (round {rnd + 1} of {args.rounds})", file=sys.stderr)
        report(list(cols.items()), args)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
