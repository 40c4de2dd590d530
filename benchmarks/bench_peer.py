"""dspark-sim beside its compiled peer, Doubleword's inference-lab (Rust), on the peer's
matched workload, in one run (prints figures and ratios; never a timed test).

The matched workload (``../shared/peers/inference-lab/README.md``): a Qwen3-8B-class
target on one H100, Poisson 20 req/s, 512 prompt / 256 output tokens, 256 sequences /
8,192 batched tokens, chunked prefill, per-token acceptance 0.8, the drafter priced the
same way in both tools. Cases: ``none``, ``fixed:3`` and ``confidence`` here against the
peer's ``none``, fixed 3 and goodput-adaptive (γ ≤ 7); 10k and 100k requests.

Each round runs every (case, size) once in each tool, the two alternating (which goes
first flips each round), so a spell of the shared machine falls on both; the table keeps
each figure's median over the rounds. Figures are of the whole process, as a user runs
it (``os.wait4``'s rusage): CPU seconds (user + system), peak RSS, and CPU µs per engine
step (the process's CPU over the engine steps its run took: the steps differ, since the
peer prices datasheet peaks and takes ~3.3x more, shorter steps). A ratio is
dspark-sim's figure over the peer's (below 1: dspark-sim costs less).

It also prints the fixed cost of a process: ``dspark-sim run --num-requests 1`` on the
same workload beside ``python -c pass`` and ``python -c "import numpy"``.

The peer's binary is built once per machine outside this repository (the peer folder's
README: ``cargo build --release --offline``); name it with ``--peer PATH`` or
``INFERENCE_LAB_ILRUN``. Without it the peer's columns are left empty, saying so.

    python benchmarks/bench_peer.py --peer /work/peer-build/peer-il/target/release/ilrun
    python benchmarks/bench_peer.py --sizes 10000 --rounds 5 --cases none
    python benchmarks/bench_peer.py --peer ... --doc docs/performance.md   # write the table
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PEER_DIR = REPO.parent / "shared" / "peers" / "inference-lab"

# case: (this project's options beyond the common ones, the peer's config)
CASES = {
    "none": (["--profile", "{peer}/profiles/qwen3-8b-h100-ilblk3.toml", "--policy", "none"],
             "il_none.toml"),
    "fixed:3": (["--profile", "{peer}/profiles/qwen3-8b-h100-ilblk3.toml", "--policy",
                 "fixed:3", "--trace", "{peer}/traces/iid-a0.8-g7.parquet", "--gamma-max", "3"],
                "il_fixed3.toml"),
    "confidence": (["--profile", "{peer}/profiles/qwen3-8b-h100-ilblk7.toml", "--policy",
                    "confidence", "--trace", "{peer}/traces/iid-a0.8-g7.parquet"],
                   "il_goodput7.toml"),
}
PEER_NAME = {"none": "none", "fixed:3": "fixed 3", "confidence": "goodput-adaptive"}


def dspark_cmd(case: str, requests: int, peer_dir: Path, quiet: bool = True) -> list[str]:
    extra = [a.format(peer=peer_dir) for a in CASES[case][0]]
    return [sys.executable, "-m", "dspark_sim.cli", "run", "--replicas", "1", "--qps", "20",
            "--num-requests", str(requests), "--lengths", "fixed:512:256", "--seed", "0",
            *(["--quiet"] if quiet else []), *extra]


def peer_cmd(binary: Path, case: str, requests: int, peer_dir: Path) -> list[str]:
    return [str(binary), "--config", str(peer_dir / "cfg" / CASES[case][1]),
            "--workload", str(peer_dir / "cfg" / f"wl_r20_n{requests}.toml")]


def child_env(site: Path | None = None) -> dict[str, str]:
    """As a user's shell runs it: bytecode cached (a development shell may turn that off,
    which recompiles every module of the project in every process); ``site``: a
    revision installed by ``bench_sim.install_revision``, imported first."""
    env = dict(os.environ, COLUMNS="200")
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if site is not None:
        env["PYTHONPATH"] = str(site)
    return env


# A child's peak RSS as the kernel reports it to its parent includes the memory of the
# process it was forked from (Linux records the old image's high-water mark at exec), so
# each command runs under /usr/bin/time, a small process, which reports its own child's.
TIME = "/usr/bin/time"


def measure(cmd: list[str], env: dict[str, str]) -> dict:
    """One process: CPU seconds (user + system), wall seconds, peak RSS (MB), stdout."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            tempfile.NamedTemporaryFile("r") as rss:
        timed = [TIME, "-f", "%M", "-o", rss.name, *cmd] if os.path.exists(TIME) else cmd
        t0 = time.perf_counter()
        # cwd outside the checkout: ``-m`` puts it first on sys.path, and an installed
        # revision must win over the work tree
        proc = subprocess.Popen(timed, stdout=out, stderr=err, env=env,
                                cwd=tempfile.gettempdir())
        _, status, usage = os.wait4(proc.pid, 0)  # the child's CPU, its children's too
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        text, error = (f.read().decode(errors="replace") for f in (out, err))
        kb = rss.read().split() if timed is not cmd else []
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}: exit {proc.returncode}\n{error[-2000:]}")
    peak_kb = int(kb[-1]) if kb and kb[-1].isdigit() else usage.ru_maxrss
    return {"cpu_s": usage.ru_utime + usage.ru_stime, "wall_s": wall,
            "rss_mb": peak_kb / 1024, "stdout": text}


def dspark_steps(case: str, requests: int, peer_dir: Path, env: dict[str, str]) -> int:
    """The run's engine steps, from its printed summary (the same seed, the same steps;
    the timed runs are ``--quiet``, as the peer's README runs them)."""
    text = measure(dspark_cmd(case, requests, peer_dir, quiet=False), env)["stdout"]
    m = re.search(r"engine steps\s*│[^│]*│\s*([\d,]+)", text)
    if not m:
        raise SystemExit(f"no 'engine steps' row in dspark-sim's summary:\n{text[-2000:]}")
    return int(m.group(1).replace(",", ""))


def peer_steps(stdout: str) -> int:
    return int(json.loads(stdout.strip().splitlines()[-1])["engine_steps"])


def fmt(x: float | None, spec: str) -> str:
    return "" if x is None else format(x, spec)


def ratio(a: float | None, b: float | None) -> str:
    return "" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peer", type=Path, default=os.environ.get("INFERENCE_LAB_ILRUN"),
                    help="the peer's built ilrun binary (default: $INFERENCE_LAB_ILRUN)")
    ap.add_argument("--peer-dir", type=Path, default=PEER_DIR,
                    help="the peer's folder: profiles, trace, configs (default: %(default)s)")
    ap.add_argument("--before", default=None, metavar="REV",
                    help="also run this revision (installed as bench_sim.py does), "
                    "alternating with the work tree and the peer")
    ap.add_argument("--sizes", default="10000,100000", help="requests per run, comma-separated")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated, of: "
                    + ", ".join(CASES))
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (medians kept)")
    ap.add_argument("--startup-rounds", type=int, default=5,
                    help="rounds of the fixed-cost processes (0: leave them out)")
    ap.add_argument("--doc", default=None, help="also write the tables into this doc's "
                    "`<!-- bench: peer -->` and `<!-- bench: peer_startup -->` blocks")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    cases = [c for c in args.cases.split(",") if c]
    unknown = set(cases) - set(CASES)
    if unknown:
        ap.error(f"unknown case(s) {sorted(unknown)}: of {', '.join(CASES)}")
    peer_dir = args.peer_dir.resolve()
    if not (peer_dir / "cfg").is_dir():
        raise SystemExit(f"{peer_dir}: not the peer's folder (no cfg/); give --peer-dir")
    peer = args.peer
    if peer is None or not Path(peer).is_file():
        print(f"peer: {'no --peer given' if peer is None else f'{peer} is not built'}; its "
              f"columns stay empty (build it as {peer_dir / 'README.md'} says, then give "
              "--peer PATH or INFERENCE_LAB_ILRUN)", flush=True)
        peer = None
    for n in sizes:
        if peer is not None and not (peer_dir / "cfg" / f"wl_r20_n{n}.toml").is_file():
            raise SystemExit(f"the peer has no workload for {n} requests "
                             f"({peer_dir / 'cfg'}/wl_r20_n{n}.toml)")
    # this project's processes: the work tree, and the revision before where asked
    envs = {"dspark": child_env()}
    if args.before:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_sim import install_revision  # benchmarks/ is the script's path

        root = Path(tempfile.mkdtemp(prefix="bench-peer-"))
        sha, site = install_revision(args.before, root)
        envs[sha] = child_env(site)
        print(f"before: {args.before} ({sha}) installed in {site}", flush=True)
    ours = list(envs)

    runs, steps = run_rounds(envs, peer, peer_dir, cases, sizes, args.rounds)
    tables = {"peer": peer_table(runs, steps, ours, cases, sizes)}
    if args.startup_rounds:
        tables["peer_startup"] = startup_table(envs, peer_dir, args.startup_rounds)
    if args.doc:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from doc_blocks import command_line, replace_blocks  # benchmarks/ is the script's path

        replace_blocks(args.doc, tables, command_line("benchmarks/bench_peer.py", argv))


def run_rounds(envs: dict[str, dict], peer: Path | None, peer_dir: Path, cases: list[str],
               sizes: list[int], rounds: int) -> tuple[dict, dict]:
    """Every (case, size) in every tool, round after round, the order flipped each round."""
    ours = list(envs)
    # warm-up, untimed: bytecode and the compiled-kernel cache written, the steps read
    steps = {}
    for tool in ours:
        for case in cases:
            for n in sizes:
                steps[tool, case, n] = dspark_steps(case, n, peer_dir, envs[tool])
    runs: dict[tuple[str, str, int], list[dict]] = {}
    for r in range(rounds):
        for case in cases:
            for n in sizes:
                tools = ours + (["peer"] if peer is not None else [])
                for tool in (tools if r % 2 == 0 else tools[::-1]):
                    if tool == "peer":
                        m = measure(peer_cmd(Path(peer), case, n, peer_dir), envs["dspark"])
                        m["steps"] = peer_steps(m["stdout"])
                    else:
                        m = measure(dspark_cmd(case, n, peer_dir), envs[tool])
                        m["steps"] = steps[tool, case, n]
                    runs.setdefault((tool, case, n), []).append(m)
                    print(f"round {r + 1}: {tool:8s} {case:10s} {n:>7,}: "
                          f"{m['cpu_s']:6.2f} s CPU, {m['wall_s']:6.2f} s wall, "
                          f"{m['rss_mb']:5.0f} MB", flush=True)
    return runs, steps


def peer_table(runs: dict, steps: dict, ours: list[str], cases: list[str],
               sizes: list[int]) -> list[str]:
    """Each figure's median over the rounds, with the ratios."""
    def med(tool: str, case: str, n: int, key: str) -> float | None:
        got = runs.get((tool, case, n))
        if not got:
            return None
        if key == "us_step":
            return statistics.median(g["cpu_s"] / g["steps"] * 1e6 for g in got)
        return statistics.median(g[key] for g in got)

    before = ours[1] if len(ours) > 1 else None
    head = ["case (dspark-sim / peer)", "requests", "CPU s", "peer CPU s", "ratio",
            "µs CPU per step", "peer µs per step", "peak RSS MB", "peer MB"]
    if before:
        head[3:3] = [f"{before} CPU s", f"×{before}"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    rows = []
    for case in cases:
        for n in sizes:
            d = {k: med("dspark", case, n, k) for k in ("cpu_s", "us_step", "rss_mb")}
            p = {k: med("peer", case, n, k) for k in ("cpu_s", "us_step", "rss_mb")}
            cells = [f"{case} / {PEER_NAME[case]}", f"{n:,}", fmt(d["cpu_s"], ".2f"),
                     fmt(p["cpu_s"], ".2f"), ratio(d["cpu_s"], p["cpu_s"]),
                     fmt(d["us_step"], ".1f"), fmt(p["us_step"], ".1f"),
                     fmt(d["rss_mb"], ".0f"), fmt(p["rss_mb"], ".0f")]
            if before:
                b = med(before, case, n, "cpu_s")
                cells[3:3] = [fmt(b, ".2f"), ratio(b, d["cpu_s"])]
            rows.append("| " + " | ".join(cells) + " |")
    print()
    print("\n".join(lines + rows))
    return lines + rows


def startup_table(envs: dict[str, dict], peer_dir: Path, rounds: int) -> list[str]:
    """The fixed cost of a process: a one-request run beside Python's and numpy's."""
    ours = list(envs)
    procs = {"python -c pass": ([sys.executable, "-c", "pass"], envs["dspark"]),
             'python -c "import numpy"': ([sys.executable, "-c", "import numpy"],
                                          envs["dspark"])}
    for tool in ours:
        label = "" if tool == "dspark" else f", {tool}"
        for case in ("none", "confidence"):
            procs[f"dspark-sim run --num-requests 1 ({case}{label})"] = (
                dspark_cmd(case, 1, peer_dir), envs[tool])
    got: dict[str, list[dict]] = {k: [] for k in procs}
    for _ in range(rounds):
        for name, (cmd, env) in procs.items():
            got[name].append(measure(cmd, env))
    base = statistics.median(g["cpu_s"] for g in got['python -c "import numpy"'])
    start = ["| process | CPU s | wall s | peak RSS MB | CPU beyond `import numpy`'s |",
             "|---|---:|---:|---:|---:|"]
    for name, ms in got.items():
        cpu = statistics.median(m["cpu_s"] for m in ms)
        start.append(f"| `{name}` | {cpu:.3f} | "
                     f"{statistics.median(m['wall_s'] for m in ms):.3f} | "
                     f"{statistics.median(m['rss_mb'] for m in ms):.0f} | "
                     f"{cpu - base:+.3f} |")
    print()
    print("\n".join(start))
    return start


if __name__ == "__main__":
    main()
