"""Are the sweeps' request counts enough? Doubling them must move no headline figure by
more than 2 %. Prints figures; never a timed or asserted test.

Two checks:

* **points** (default): a few closed-loop points of the case study's deployment (one
  rank of the default profile, its DSpark-5 trace) and open-loop points of the
  default deployment, each sized by the sweep's rule (``Sizing``: ``max(N, K x clients)``
  requests, doubled while the steady window is short), then rerun with twice that
  count. For each figure: the value at N and 2N and the change, steady-state and
  whole-run side by side, and whether the steady change is within 2 %.
* ``--headline``: the case study (``benchmarks/case_study.py``) sized by the rule (each
  point ends at some count N*), then every point rerun at exactly 2 N*, and the change
  of each headline number (per-user TPS gain at matched throughput, min/max/mean;
  throughput at each SLA tier).

    python benchmarks/steady_sizing.py                      # points, ~2-4 min on 2 cores
    python benchmarks/steady_sizing.py --headline           # + case study twice, longer
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import case_study  # noqa: E402
from case_study import (  # noqa: E402
    SIZING_DOUBLINGS,
    SIZING_MIN_REQUESTS,
    SIZING_PER_CLIENT,
    SIZING_TARGET_RSE,
)

from dspark_sim.sim.api import simulate  # noqa: E402
from dspark_sim.sim.config import SimConfig, WorkloadConfig  # noqa: E402
from dspark_sim.sim.sweep import Sizing, build_points, run_point  # noqa: E402

FIGURES = ("output_throughput_per_gpu", "median_interactivity", "median_tpot_ms",
           "median_ttft_ms", "median_e2el_ms", "spec_decode_acceptance_length",
           "mean_verify_tokens_per_request_step")
# The figures fronts and headlines are made of; TTFT/TPOT/E2E medians are printed for
# information (they follow the sampled length mix, whole-run figures alike).
HEADLINE_FIGURES = ("output_throughput_per_gpu", "median_interactivity",
                    "spec_decode_acceptance_length", "mean_verify_tokens_per_request_step")
TOLERANCE = 0.02




def _pct(v) -> str:
    return "-" if v is None else f"{v:.2%}"


def _change(a, b) -> float | None:
    if a is None or b is None or a == 0:
        return None
    return b / a - 1.0


def check_points(args) -> list[float]:
    sizing = Sizing(requests_per_client=args.requests_per_client,
                    max_doublings=args.max_doublings, target_rse=args.target_rse)
    # the case study's deployment (one rank of the default profile, its trace and gamma)
    closed = case_study.case_base(None, args.num_requests, case_study.DEFAULT_TRACE,
                                  case_study.DEFAULT_GAMMA_MAX)
    points = build_points(closed, concurrency=args.concurrency, policies=args.policies,
                          sizing=sizing)
    if args.qps:
        open_ = replace(SimConfig(), workload=WorkloadConfig(num_requests=args.num_requests))
        points += build_points(open_, qps=args.qps, policies=args.open_policies, sizing=sizing)
    worst: list[float] = []
    print(f"sizing: max({args.num_requests}, {args.requests_per_client} x clients) requests, "
          f"up to {args.max_doublings} doublings while the steady window is short or a "
          f"front figure's RSE > {args.target_rse:.2%}; then 2x that count\n")
    for pt in points:
        t0 = time.perf_counter()
        row = run_point(pt)
        n = int(row["num_requests"])
        w = pt.config.workload
        twice = replace(pt.config, workload=replace(
            w, num_requests=2 * n, duration_s=None if w.duration_s is None else
            w.duration_s * 2 ** (row["size_doublings"] + 1)))
        s2 = simulate(twice).summary
        wall = time.perf_counter() - t0
        print(f"{row['policy']:17s} {pt.load_kind}={pt.load:g}: N={n:,} "
              f"(doublings {row['size_doublings']}, RSE throughput "
              f"{_pct(row.get('steady_output_throughput_rse'))}, interactivity "
              f"{_pct(row.get('steady_median_interactivity_rse'))}, "
              f"window {row['steady_window_s']:.1f} s, "
              f"{row['steady_window_requests']:,} requests in it"
              f"{', SHORT' if row['steady_window_short'] else ''}) vs 2N; {wall:.0f} s wall")
        for f in FIGURES:
            a, b = row.get("steady_" + f), s2.get("steady_" + f)
            wa, wb = row.get(f), s2.get(f)
            c, cw = _change(a, b), _change(wa, wb)
            if c is None:
                continue
            if f == "spec_decode_acceptance_length" and a == 1.0:
                continue  # no speculation
            if f in HEADLINE_FIGURES:
                worst.append(abs(c))
                flag = "ok" if abs(c) <= TOLERANCE else "MOVES"
            else:
                flag = "(info)"
            whole = f"   whole run {wa:10.4g} -> {wb:10.4g} ({cw:+.1%})" if cw is not None else ""
            print(f"    {f:38s} steady {a:10.4g} -> {b:10.4g} ({c:+.1%}) {flag}{whole}")
    return worst


def check_headline(args) -> list[float]:
    """The case study sized by the rule (N* per point), then every point rerun at exactly
    2 N* (no sizing), and the headline numbers of both."""
    import polars as pl

    from dspark_sim.sim.sweep import run_points

    out = Path(args.out)
    argv = ["--out", str(out / "x1"), "--num-requests", str(args.num_requests),
            "--requests-per-client", str(args.requests_per_client),
            "--max-doublings", str(args.max_doublings), "--target-rse", str(args.target_rse),
            "--executor", args.executor]
    print(f"\ncase study sized by the rule: {' '.join(argv)}")
    first = case_study.main(argv)
    df1 = pl.read_parquet(out / "x1" / "results.parquet")
    points = []
    for pol, c, n in df1.select("policy_spec", "concurrency", "num_requests").iter_rows():
        cfg = first["config"]
        base = case_study.case_base(cfg["max_num_seqs"], 2 * int(n), cfg["trace"],
                                    cfg["gamma_max"])
        points += build_points(base, concurrency=[int(c)], policies=[pol])
    print(f"\nthe same {len(points)} points at exactly twice their requests")
    df2 = run_points(points, out=out / "x2", executor=args.executor)
    policies = list(dict.fromkeys(df1["policy_spec"].to_list()))
    conc = [int(c) for c in case_study.DEFAULT_CONCURRENCY.split(",")]
    tiers = [80.0, 120.0]
    runs = {1: first,
            2: dict(zip(("headline_main", "headline_extended"),
                        (case_study.pack(h[0]) for h in case_study.headlines(
                            df2, policies, max(conc), tiers, "steady")), strict=True))}
    worst = []
    print("\nheadline numbers, N* -> 2 N* requests per point")
    for key in ("headline_main", "headline_extended"):
        a, b = runs[1][key], runs[2][key]
        items = [(f"matched gain {m}", a["matched"][m], b["matched"][m])
                 for m in ("gain_min", "gain_max", "gain_mean")]
        for ta, tb in zip(a["tiers"], b["tiers"], strict=True):
            items.append((f"tier {ta['tier']:g} candidate tok/s/GPU", ta["candidate"],
                          tb["candidate"]))
            items.append((f"tier {ta['tier']:g} baseline tok/s/GPU", ta["baseline"],
                          tb["baseline"]))
        for name, va, vb in items:
            if va is None or vb is None:
                print(f"  {key:18s} {name:34s} {va} -> {vb}")
                continue
            # gains are fractions (0.6 = +60 %): compare the ratio 1 + gain
            base_a, base_b = (1 + va, 1 + vb) if name.startswith("matched") else (va, vb)
            c = _change(base_a, base_b)
            worst.append(abs(c))
            print(f"  {key:18s} {name:34s} {va:10.4g} -> {vb:10.4g} ({c:+.1%}) "
                  f"{'ok' if abs(c) <= TOLERANCE else 'MOVES'}")
    return worst


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=SIZING_MIN_REQUESTS)
    ap.add_argument("--requests-per-client", type=int, default=SIZING_PER_CLIENT)
    ap.add_argument("--max-doublings", type=int, default=SIZING_DOUBLINGS)
    ap.add_argument("--target-rse", type=float, default=SIZING_TARGET_RSE)
    ap.add_argument("--concurrency", default="8,64,256,1024")
    ap.add_argument("--policies", default="none,mtp1,confidence")
    ap.add_argument("--qps", default="200", help="open-loop points on the default deployment")
    ap.add_argument("--open-policies", default="confidence,confidence-async")
    ap.add_argument("--headline", action="store_true", help="also the case study at 1x and 2x")
    ap.add_argument("--out", default="runs/steady-sizing")
    ap.add_argument("--executor", default="process")
    args = ap.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    args.policies = [p for p in args.policies.split(",") if p]
    args.qps = [float(q) for q in args.qps.split(",") if q]
    args.open_policies = [p for p in args.open_policies.split(",") if p]
    t0 = time.perf_counter()
    worst = check_points(args)
    if args.headline:
        worst += check_headline(args)
    w = max(worst) if worst else 0.0
    print(f"\nlargest change of a headline figure on doubling: {w:.1%} "
          f"({'within' if w <= TOLERANCE else 'OVER'} the {TOLERANCE:.0%} target); "
          f"{time.perf_counter() - t0:.0f} s wall")


if __name__ == "__main__":
    main()
