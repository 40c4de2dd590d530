"""What the prefix cache costs the simulator: wall and CPU seconds per request with
``--prefix-cache on`` and ``off`` on the same Mooncake-like workload (prints figures;
never a timed test).

The workload is the synthetic multi-turn sessions (``sim/sessions.py``) shaped like the
Mooncake conversation trace: a 2,048-token shared system prompt, user messages of a
lognormal 1,500 tokens and answers of 350, 6 turns a session, 30 s of think time, at the
trace's native rate (~3.4 requests/s), 4 decode replicas with chunked prefill, so each
turn's prompt (up to ~13k tokens) is cut into 16-token blocks and looked up at admission.
Both settings run the same SimPy path (sessions wait on the engine), but not the same
deployment: with the cache, hits shorten prefill, so the same traffic takes more, shorter
engine steps with larger decode batches. The per-request ratio carries that; the
per-step ratio is closer to the cache's own work (hashing at start-up, the lookups and
fills, the eviction).

A day at that rate is ~300k requests; ``--requests`` (default 6,000: ~30 simulated
minutes, a few seconds a run on 2 shared cores) scales it down. Cost per request does not
grow with the run's length here (the cache's work is per request and per block of that
request, and the cache is bounded by the replicas' KV), so a shorter run measures the
same ratio. ``--rounds`` alternates on, off, on, off, ... and keeps each setting's
fastest run (a shared box's speed drifts between minutes).

    python benchmarks/bench_prefix_cache.py
    python benchmarks/bench_prefix_cache.py --requests 20000 --rounds 3
    python benchmarks/bench_prefix_cache.py --workload mooncake   # the trace's hash_ids
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from dspark_sim.sim.api import simulate
from dspark_sim.sim.config import DeploymentConfig, EngineConfig, SimConfig, WorkloadConfig

MOONCAKE_REQUESTS_PER_S = 12_031 / 3_537  # the conversation trace's own rate
TURNS = 6


MOONCAKE = Path(__file__).resolve().parents[2] / "shared/data/workloads" \
    / "mooncake_conversation_trace.jsonl"


def config(cache: str, requests: int, seed: int = 0, workload: str = "sessions") -> SimConfig:
    if workload == "mooncake":  # the trace itself, its first requests at its own rate
        wl = WorkloadConfig(arrival="replay", workload_path=str(MOONCAKE),
                            num_requests=requests)
        return SimConfig(policy="confidence", seed=seed, workload=wl,
                         engine=EngineConfig(prefill="chunked", prefix_cache=cache),
                         deployment=DeploymentConfig(replicas=4, profile="qwen3-8b-h100"))
    wl = WorkloadConfig(qps=MOONCAKE_REQUESTS_PER_S / TURNS, num_requests=requests,
                        session_turns=TURNS, think_time_s="exp:30",
                        system_prompt_tokens=2048, lengths="lognormal:1500:350")
    return SimConfig(policy="confidence", seed=seed, workload=wl,
                     engine=EngineConfig(prefill="chunked", prefix_cache=cache),
                     deployment=DeploymentConfig(replicas=4, profile="qwen3-8b-h100"))


def measure(cache: str, requests: int, workload: str) -> tuple[float, float, dict]:
    wall, cpu = time.perf_counter(), time.process_time()
    summary = simulate(config(cache, requests, workload=workload)).summary
    return time.perf_counter() - wall, time.process_time() - cpu, summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=6000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workload", choices=("sessions", "mooncake"), default="sessions",
                    help="mooncake: the trace in ../shared (its hash_ids, 512-token blocks)")
    args = ap.parse_args()
    measure("off", 200, args.workload)  # imports and compiled kernels, outside the timings
    best: dict[str, tuple[float, float]] = {}
    summaries = {}
    for _ in range(args.rounds):
        for cache in ("on", "off"):
            wall, cpu, summaries[cache] = measure(cache, args.requests, args.workload)
            w0, c0 = best.get(cache, (wall, cpu))
            best[cache] = (min(w0, wall), min(c0, cpu))
    n = args.requests
    for cache in ("on", "off"):
        wall, cpu = best[cache]
        s = summaries[cache]
        print(f"cache {cache:3}: {wall / n * 1e6:7.1f} us wall, {cpu / n * 1e6:7.1f} us CPU "
              f"per request ({n:,} requests, {s['engine_steps']:,} steps, "
              f"{s['duration']:.0f} simulated s, hit rate "
              f"{s.get('prefix_cache_hit_rate_tokens') or 0:.3f})")
    print(f"on / off: {best['on'][0] / best['off'][0]:.3f} wall, "
          f"{best['on'][1] / best['off'][1]:.3f} CPU per request")
    # with the cache on the simulated deployment itself differs (hits shorten prefill, so
    # steps are shorter and more of them cover the same traffic, with larger decode
    # batches): per engine step is the closer measure of what the cache's own work costs
    steps = {c: summaries[c]["engine_steps"] for c in ("on", "off")}
    print(f"engine steps on / off: {steps['on'] / steps['off']:.3f}; CPU per step on / off: "
          f"{best['on'][1] / steps['on'] / (best['off'][1] / steps['off']):.3f}")


if __name__ == "__main__":
    main()
