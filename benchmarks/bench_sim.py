"""Simulator speed benchmark (prints figures; never a timed test).

Standard workload: Poisson arrivals at 200 req/s for 600 simulated seconds, the
``confidence`` policy, the default profile and deployment. Targets on the 2-core
dev machine: under 15 s wall for the standard workload, under 5 s for the default
``dspark-sim run``; memory: the standard run's peak-RSS growth under 1 GiB (the
simulator keeps per-request rows and per-step counters, never per-token state, so it
grows with requests, not with tokens or steps x batch).

    python benchmarks/bench_sim.py                 # standard + default run
    python benchmarks/bench_sim.py --duration-s 60 # shorter
    python benchmarks/bench_sim.py --cprofile      # where the time goes
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import resource
import subprocess
import sys
import time
from dataclasses import replace

from dspark_sim.sim.api import simulate
from dspark_sim.sim.config import SimConfig, WorkloadConfig


def standard(duration_s: float, policy: str) -> SimConfig:
    return replace(SimConfig(policy=policy),
                   workload=WorkloadConfig(qps=200.0, duration_s=duration_s, num_requests=None))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration-s", type=float, default=600.0)
    ap.add_argument("--policy", default="confidence")
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--skip-cli", action="store_true")
    args = ap.parse_args()

    cfg = standard(args.duration_s, args.policy)
    simulate(replace(cfg, workload=replace(cfg.workload, duration_s=2.0)))  # warm imports
    rss0_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux: KiB
    if args.cprofile:
        prof = cProfile.Profile()
        prof.enable()
    t0, c0 = time.perf_counter(), time.process_time()
    res = simulate(cfg)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0_kib) / 1024
    if args.cprofile:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    s = res.summary
    n, steps = s["num_requests"], s["engine_steps"]
    print(f"standard workload: {args.policy}, 200 req/s Poisson, {args.duration_s:g} s simulated")
    print(f"  requests {n:,}  engine steps {steps:,}  wall {wall:.2f} s  (cpu {cpu:.2f} s)")
    print(f"  {n / wall:,.0f} simulated requests per wall-second")
    print(f"  {steps / wall:,.0f} engine steps per wall-second  ({wall / steps * 1e6:.0f} us/step)")
    print(f"  simulated/wall time ratio {args.duration_s / wall:.1f}x")
    print(f"  target: < 15 s wall -> {'OK' if wall < 15 else 'MISSED'} ({wall / 15:.2f} of budget)")
    print(f"  peak RSS grew {grown_mib:,.0f} MiB during the run ({grown_mib * 1024 / n:.2f} KiB "
          f"per request; requests frame {res.requests.estimated_size() / 2**20:,.1f} MiB)")
    print(f"  target: < 1024 MiB -> {'OK' if grown_mib < 1024 else 'MISSED'} "
          f"({grown_mib / 1024:.2f} of budget)")
    if not args.skip_cli:
        t0 = time.perf_counter()
        subprocess.run(["dspark-sim", "run", "--policy", "confidence", "--qps", "200", "--quiet"],
                       check=True)
        cli = time.perf_counter() - t0
        print(f"default `dspark-sim run --policy confidence --qps 200`: {cli:.2f} s wall "
              f"(target < 5 s -> {'OK' if cli < 5 else 'MISSED'})")


if __name__ == "__main__":
    sys.exit(main())
