"""Headlines of one sweep for several candidate/baseline pairs, as a docs table.

Runs the sweep (resumable: points already in ``--out`` are reused), then computes the
sweep's headline (:func:`dspark_sim.sim.frontier.headline`, steady-state basis) for each
``CANDIDATE:BASELINE`` pair and prints one row per pair: the per-user TPS gain at matched
throughput (min … max, mean) and the throughput gain at each interactivity tier.

    python benchmarks/headlines.py                       # DFly / D-cut on v4flash-h200 (~3 min)
    python benchmarks/headlines.py --doc docs/frontiers.md   # also rewrite its table

The default is the sweep of docs/frontiers.md's "Batch-shared budgets on the front"
section (its ``<!-- bench: headlines shared_budget -->`` block).
"""

from __future__ import annotations

import argparse
import tempfile

from dspark_sim.sim.config import DeploymentConfig, SimConfig, WorkloadConfig
from dspark_sim.sim.frontier import headline
from dspark_sim.sim.sweep import Sizing, parse_list, parse_numbers, run_sweep

DEFAULT_PAIRS = "dcut:dfly,confidence:dfly,dcut:confidence,dfly:mtp1"


# a side whose front stays above a tier gives a lower bound on its throughput there
BOUND_TEXT = {"exact": "",
              "lower": " (≥: the candidate's front stays above the tier, a lower bound)",
              "upper": " (≤: the baseline's front stays above the tier, a lower bound)"}


def _pct(x: float) -> str:
    return f"{x:+,.0%}".replace("%", " %")


def pair_row(df, candidate: str, baseline: str, tiers: list[float]) -> str:
    """One markdown row: ``candidate`` vs ``baseline`` on the sweep ``df``."""
    (h,) = headline(df, candidate=candidate, baseline=baseline, tiers=tiers)
    m = h["matched"]
    matched = (f"{_pct(m['gain_min'])} … {_pct(m['gain_max'])} (mean {_pct(m['gain_mean'])})"
               if m["feasible"] else f"no matched range ({m['reason']})")
    cells = []
    for t in h["tiers"]:
        if t["gain"] is None:  # infeasible, or both fronts above the tier: no ratio
            cells.append(t["text"])
        else:
            cells.append(_pct(t["gain"]) + BOUND_TEXT[t["bound"]])
    return f"| `{candidate}` vs `{baseline}` | {matched} | {' / '.join(cells)} |"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default="dfly,dcut,confidence,mtp1")
    ap.add_argument("--concurrency", default="1:256:x2")
    ap.add_argument("--profile", default="v4flash-h200")
    ap.add_argument("--num-requests", type=int, default=1000)
    # 1,000 requests leave C = 256 without a latency sample in its steady window (the
    # window is shorter than a p99 lifetime): its points would drop off every front
    ap.add_argument("--requests-per-client", type=int, default=8,
                    help="size each point at max(--num-requests, K x clients)")
    ap.add_argument("--pairs", default=DEFAULT_PAIRS, help="CANDIDATE:BASELINE,...")
    ap.add_argument("--tiers", default="80,120")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--out", default=None, help="sweep folder (default: a temporary one)")
    ap.add_argument("--doc", default=None, help="also write the table into this doc's "
                    "`<!-- bench: headlines shared_budget -->` block (benchmarks/doc_blocks.py)")
    args = ap.parse_args(argv)
    tiers = parse_numbers(args.tiers, option="--tiers")
    base = SimConfig(deployment=DeploymentConfig(replicas=1, profile=args.profile),
                     workload=WorkloadConfig(arrival="closed", num_requests=args.num_requests))
    with tempfile.TemporaryDirectory() as tmp:
        df = run_sweep(base, concurrency=parse_numbers(args.concurrency, integer=True,
                                                       option="--concurrency"),
                       policies=parse_list(args.policies), out=args.out or tmp,
                       workers=args.workers,
                       sizing=Sizing(requests_per_client=args.requests_per_client))
    pairs = [p.split(":") for p in args.pairs.split(",")]
    lines = ["| candidate vs baseline | per-user TPS at matched throughput | throughput at "
             + " / ".join(f"{t:g}" for t in tiers) + " tok/s/user |", "|---|---|---|"]
    lines += [pair_row(df, c, b, tiers) for c, b in pairs]
    print(f"{args.profile}, closed loop, concurrency {args.concurrency}, "
          f"max({args.num_requests}, {args.requests_per_client} x clients) requests per "
          f"point, steady state ({df.height} points)")
    print("\n".join(lines))
    if args.doc:
        from doc_blocks import command_line, replace_blocks  # benchmarks/ is the script's path

        cmd = command_line("benchmarks/headlines.py", argv)
        if args.out:  # where the points were kept does not change the table
            cmd = cmd.replace(f" --out {args.out}", "")
        replace_blocks(args.doc, {"headlines shared_budget": lines}, cmd)


if __name__ == "__main__":
    main()
