"""Render the README's front picture (PNG) from a sweep's results.parquet.

The interactive report (`dspark-sim sweep ... --out DIR` -> DIR/report.html) is the real
artefact; this static PNG only exists so the README can show the front.

    python benchmarks/case_study.py            # writes runs/case-study/results.parquet
    pip install matplotlib && python docs/img/make_front_png.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dspark_sim.sim.frontier import compute_fronts, metric_view  # noqa: E402
from dspark_sim.sim.sweep import load_results  # noqa: E402


def main(results: str = "runs/case-study", out: str = "docs/img/front-defaults.png") -> None:
    df = metric_view(load_results(results))  # steady-state figures, as the fronts
    fig, ax = plt.subplots(figsize=(8, 4.6), dpi=110)
    for (label, front), color in zip(compute_fronts(df).items(), ("C3", "C0", "C2", "C1"),
                                     strict=False):
        pts = df.filter(df["policy_spec"] == label)
        ax.scatter(pts["median_interactivity"], pts["output_throughput_per_gpu"], s=14,
                   color=color, alpha=0.5)
        ax.plot(front.x, front.y, "-o", ms=3, color=color, label=label)
    for tier in (80, 120):
        ax.axvline(tier, color="grey", lw=0.8, ls="--")
        ax.text(tier, ax.get_ylim()[1] * 0.97, f" {tier} tok/s/user", fontsize=8, va="top")
    ax.set_xlabel("median interactivity (tok/s/user, steady state)")
    ax.set_ylabel("output throughput (tok/s/GPU, steady state)")
    ax.set_title("DSpark-5 vs MTP-1: one V4-Flash-like EP32 decode rank (H200), "
                 "closed loop 1..1024 clients", fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(*sys.argv[1:])
