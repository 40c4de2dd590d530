"""DSpark §5.4 case study: DSpark-5 (``confidence``) vs MTP-1 on the V4-Flash-like profile.

Closed-loop concurrency sweep (1..256 clients per rank, plus 384..1024 with ``--extend``,
the default: more clients than the rank's 256 seats, so they queue) on one
data-parallel attention rank of the EP32 group (profile ``v4flash-h200``, disaggregated
prefill), DSpark-5 (``--gamma-max 5``) replaying ``dspark-v4flash-synthetic`` and MTP-1
replaying ``mtp1-synthetic``, then the paper's headline numbers: per-user TPS gain at
matched throughput (over the whole shared range and over its practical middle, 25-75 %
of its top) and the throughput gain at the 80 and 120 tok/s/user SLA tiers, plus the
Fig. 8 verification-budget table. Resumable: rerunning reuses
finished points in ``--out``. Every figure is steady-state (warm-up and drain excluded,
``dspark_sim.sim.metrics``; ``--basis whole`` for the whole-run figures). Each point runs
``max(--num-requests, --requests-per-client x concurrency)`` requests, doubled up to
``--max-doublings`` times while its steady window is flagged short or its steady
throughput or median interactivity has a relative standard error above
``--target-rse`` (the sweep's ``Sizing``; ``benchmarks/steady_sizing.py --headline``
checks that doubling every point's requests moves no headline figure by more than 2 %).
``--max-num-seqs`` overrides the profile's 256 seats.

    python benchmarks/case_study.py            # ~12 min on 2 cores (docs/frontiers.md#enough-requests)
    python benchmarks/case_study.py --target-rse 0.005 --max-doublings 3  # ~3x faster, looser
    python benchmarks/case_study.py --num-requests 300 --concurrency 1,8,64 --extend "" \
        --max-doublings 0                               # smoke run
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import polars as pl

from dspark_sim.io import write_json_atomic
from dspark_sim.sim.api import DEFAULT_MTP_TRACE
from dspark_sim.sim.config import SimConfig, WorkloadConfig, preset
from dspark_sim.sim.frontier import (
    basis_used,
    budget_table,
    format_headline,
    headline,
    matched_throughput_gain,
    waste_table,
)
from dspark_sim.sim.report import build_report
from dspark_sim.sim.sweep import Sizing, parse_list, parse_numbers, run_sweep

DEFAULT_CONCURRENCY = "1,2,4,8,16,24,32,48,64,96,128,192,256"
# The sizing rule, checked by benchmarks/steady_sizing.py (doubling moves no headline
# figure by more than 2 %).
SIZING_MIN_REQUESTS = 2000
SIZING_PER_CLIENT = 32
SIZING_DOUBLINGS = 4
SIZING_TARGET_RSE = 0.0025
EXTENDED_CONCURRENCY = "384,512,768,1024"
DEFAULT_TRACE = "dspark-v4flash-synthetic"
DEFAULT_GAMMA_MAX = 5  # DSpark-5


def _git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def case_base(max_num_seqs: int | None, num_requests: int, trace: str | None,
              gamma_max: int | None) -> SimConfig:
    """One rank of the default profile, closed loop (``max_num_seqs`` None: the profile's
    seats)."""
    base = preset("single-replica")
    return replace(base, engine=replace(base.engine, max_num_seqs=max_num_seqs),
                   trace=trace, mtp_trace=DEFAULT_MTP_TRACE, gamma_max=gamma_max,
                   workload=replace(WorkloadConfig(), arrival="closed",
                                    num_requests=num_requests))


def headlines(df: pl.DataFrame, policies: list[str], main_max: int, tiers, basis: str
              ) -> tuple[list[dict], list[dict]]:
    """Candidate (first policy) vs baseline (last) over concurrency <= ``main_max`` and
    over every point."""
    main_df = df.filter(pl.col("concurrency") <= main_max)
    kw = {"candidate": policies[0], "baseline": policies[-1], "tiers": tiers, "basis": basis}
    return headline(main_df, **kw), headline(df, **kw)


def pack(e: dict) -> dict:
    """A headline entry as plain JSON."""
    return {
        "matched": e["matched"],
        "tiers": [{"tier": t["tier"], "gain": t["gain"], "text": t["text"],
                   "candidate": t["candidate"].throughput,
                   "candidate_status": t["candidate"].status,
                   "baseline": t["baseline"].throughput,
                   "baseline_status": t["baseline"].status,
                   "baseline_max_interactivity": t["baseline"].max_interactivity}
                  for t in e["tiers"]],
        "fronts": {f.label: {"x": f.x.round(1).tolist(), "y": f.y.round(1).tolist()}
                   for f in (e["candidate_front"], e["baseline_front"]) if f is not None},
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/case-study", help="sweep folder (resumable)")
    ap.add_argument("--concurrency", default=DEFAULT_CONCURRENCY)
    ap.add_argument("--policies", default="confidence,mtp1")
    ap.add_argument("--trace", default=DEFAULT_TRACE)
    ap.add_argument("--gamma-max", type=int, default=DEFAULT_GAMMA_MAX, help="DSpark-5")
    ap.add_argument("--num-requests", type=int, default=SIZING_MIN_REQUESTS)
    ap.add_argument("--requests-per-client", type=int, default=SIZING_PER_CLIENT)
    ap.add_argument("--max-doublings", type=int, default=SIZING_DOUBLINGS)
    ap.add_argument("--target-rse", type=float, default=SIZING_TARGET_RSE,
                    help="double a point while its steady throughput or median "
                         "interactivity has a larger relative standard error")
    ap.add_argument("--basis", default="steady", help="steady | whole")
    ap.add_argument("--extend", default=EXTENDED_CONCURRENCY,
                    help="extra concurrencies beyond 256 ('' for none)")
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--tiers", default="80,120")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--executor", default="process")
    return ap.parse_args(argv)


def _summary(args, base, df, wall, grid: dict, h_main, h, practical, budget, waste) -> dict:
    """What case_study.json holds: provenance, the configuration and sizing used,
    the headline numbers and the budget and waste tables."""
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "git": _git_rev(),
        "host": platform.node(),
        "points": df.height,
        "sweep_wall_s": round(wall, 1),
        "cpu_s_points": round(float(df["wall_s"].sum()), 1),
        "basis": basis_used(df, args.basis),
        "config": {"profile": base.deployment.profile, "replicas": base.deployment.replicas,
                   "sizing": {"min_requests": args.num_requests,
                              "requests_per_client": args.requests_per_client,
                              "max_doublings": args.max_doublings,
                              "target_rse": args.target_rse},
                   "num_requests": {f"{r['policy']}@{r['concurrency']}": r["num_requests"]
                                    for r in df.select("policy", "concurrency",
                                                       "num_requests").to_dicts()},
                   "short_windows": int(df["steady_window_short"].sum())
                   if "steady_window_short" in df.columns else None,
                   "trace": args.trace, "gamma_max": args.gamma_max,
                   "max_num_seqs": args.max_num_seqs, **grid},
        "headline_main": pack(h_main[0]),
        "matched_practical": practical,
        "headline_extended": pack(h[0]),
        "budget": budget.to_dicts(),
        "waste": waste.to_dicts(),
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)

    base = case_base(args.max_num_seqs, args.num_requests, args.trace, args.gamma_max)
    conc = parse_numbers(args.concurrency, integer=True, option="--concurrency")
    ext = (parse_numbers(args.extend, integer=True, option="--extend")
           if args.extend.strip() else [])  # '': none
    policies = parse_list(args.policies)
    seeds = parse_numbers(args.seeds, integer=True, option="--seeds", allow_zero=True)
    tiers = parse_numbers(args.tiers, option="--tiers")
    out = Path(args.out)
    sizing = Sizing(requests_per_client=args.requests_per_client,
                    max_doublings=args.max_doublings, target_rse=args.target_rse)
    t0 = time.perf_counter()
    df = run_sweep(base, concurrency=[*conc, *ext], policies=policies, seeds=seeds, out=out,
                   executor=args.executor, workers=args.workers, sizing=sizing)
    wall = time.perf_counter() - t0
    basis = args.basis
    h_main, h = headlines(df, policies, max(conc), tiers, basis)
    practical = matched_throughput_gain(h_main[0]["candidate_front"], h_main[0]["baseline_front"],
                                        floor_fraction=0.25, ceil_fraction=0.75)
    md = (f"### concurrency 1..{max(conc)}\n\n{format_headline(h_main)}\n\n"
          f"per-user TPS gain at matched *practical* throughput (25-75 % of the shared "
          f"range's top): {practical['gain_min']:+.0%} to {practical['gain_max']:+.0%} "
          f"(mean {practical['gain_mean']:+.0%}) over {practical['y_lo']:,.0f}-"
          f"{practical['y_hi']:,.0f} tok/s/GPU\n\n"
          f"### concurrency 1..{max([*conc, *ext])}\n\n{format_headline(h)}")
    budget = budget_table(df, basis).select(
        "policy", "concurrency_x", "mean_verify_tokens_per_request_step",
        "spec_decode_acceptance_length", "output_throughput_per_gpu", "median_interactivity",
        "median_ttft_ms", "median_e2el_ms", "mean_decode_batch", "stable")
    waste = waste_table(df, basis).select("policy", "load", "verification_waste")
    report = build_report(df, out / "report.html", policies=policies, candidate=policies[0],
                          baseline=policies[-1], tiers=tiers, basis=basis,
                          title="DSpark §5.4 case study (simulated)")

    grid = {"concurrency": [*conc, *ext], "policies": policies, "seeds": seeds}
    summary = _summary(args, base, df, wall, grid, h_main, h, practical, budget, waste)
    write_json_atomic(out / "case_study.json", summary)
    print(md)
    with pl.Config(tbl_rows=60, tbl_cols=12, tbl_width_chars=160):
        print(budget)
    print(f"\n{df.height} points, sweep {wall:.0f} s wall; report: {report}")
    return summary


if __name__ == "__main__":
    main()
