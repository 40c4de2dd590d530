"""Where does DFly's discretised budget cost throughput against the continuous one?

For each profile and a ladder of closed-loop concurrencies, runs ``none`` (autoregressive),
``fixed:gamma`` (= ``dfly:100``), ``dfly`` (K from 25/50/75/100 % of the slots), ``dcut``
(the cut at any slot, this step's survivals) and ``confidence`` (the default continuous
budget, sized on two-step-old survivals) and prints steady-state output throughput per
GPU, the speed-up over autoregressive decoding, the mean verify tokens per request and
step (the bonus included), and two ratios: ``dcut / dfly`` (the cost of the 25-point grid: the two differ in
nothing else) and ``confidence / dcut`` (the cost of deciding without this step's drafts).

    python benchmarks/shared_budget.py                          # 2 profiles x 11 loads (~3 min)
    python benchmarks/shared_budget.py --profiles v4flash-h200 --loads 4,16,64
    python benchmarks/shared_budget.py --loads 4,8,16,32,48,64,96,128 \
        --profiles benchmarks/sheets/a21b-8xh20.sheet.toml     # the papers' setting, approximated

A ``*.sheet.toml`` profile is built from its roofline sheets first
(``profile_from_sheets``; ``benchmarks/sheets/a21b-8xh20.sheet.toml`` approximates DFly's
Hy3-A21B on 8 x H20, its assumptions stated in the file).
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import replace
from pathlib import Path

from dspark_sim.calibration.profile import load_profile
from dspark_sim.calibration.roofline import profile_from_sheets
from dspark_sim.sim.api import simulate
from dspark_sim.sim.config import DeploymentConfig, SimConfig, WorkloadConfig

POLICIES = ("none", "fixed:7", "dfly", "dcut", "confidence")


def resolve_profile(spec: str, tmp: Path) -> str:
    """A profile name or TOML path as is; a roofline sheet built into a profile file."""
    if not spec.endswith(".sheet.toml"):
        return spec
    prof = profile_from_sheets(spec)
    out = tmp / f"{prof.name}.toml"
    out.write_text(prof.to_toml())
    return str(out)


def point(profile: str, load: int, requests_per_client: int, lengths: str | None,
          trace: str | None) -> dict[str, dict]:
    prof = load_profile(profile)
    base = SimConfig(deployment=DeploymentConfig(replicas=1, profile=profile), trace=trace,
                     workload=WorkloadConfig(arrival="closed", max_concurrency=load,
                                             num_requests=max(64, requests_per_client * load),
                                             lengths=lengths))
    out = {}
    for pol in POLICIES:
        s = simulate(replace(base, policy=pol), profile=prof).summary

        def get(key: str, s=s) -> float:
            v = s.get(f"steady_{key}")
            return float(v if v is not None else s[key])

        out[pol] = {"thr": get("output_throughput_per_gpu"),
                    "verify": get("mean_verify_tokens_per_request_step"),
                    "tau": get("spec_decode_acceptance_length")}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", default="v4flash-h200,qwen3-8b-h100")
    ap.add_argument("--loads", default="4,8,16,32,48,64,96,128,192,256,512")
    ap.add_argument("--requests-per-client", type=int, default=6)
    ap.add_argument("--lengths", default=None, help="as for run (default: the preset's)")
    ap.add_argument("--trace", default=None)
    ap.add_argument("--doc", default=None, help="also write each profile's table into this "
                    "doc's `<!-- bench: shared_budget PROFILE -->` block (benchmarks/doc_blocks.py)")
    args = ap.parse_args(argv)
    from doc_blocks import print_table, write_tables  # benchmarks/ is the script's path

    tmp = Path(tempfile.mkdtemp(prefix="shared-budget-"))
    tables: dict[str, list[str]] = {}
    for spec in args.profiles.split(","):
        profile = resolve_profile(spec, tmp)
        print(f"\n## {spec}  (tok/s/GPU; x AR = over `none`; 1+l = mean verify tokens "
              "per request step, the bonus included)")
        lines = tables[f"shared_budget {spec}"] = [
            "| C | none | fixed:7 | dfly | dcut | confidence | dfly × AR | dcut × AR "
            "| 1+l dfly / dcut / conf | dcut ÷ dfly | conf ÷ dcut |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
        print_table(lines, (_row(load, point(profile, load, args.requests_per_client,
                                             args.lengths, args.trace))
                            for load in (int(x) for x in args.loads.split(","))))
    write_tables(args.doc, tables, "benchmarks/shared_budget.py", argv)
    return 0


def _row(load: int, r: dict) -> str:
    t = {p: r[p]["thr"] for p in POLICIES}
    return (f"| {load} | {t['none']:,.0f} | {t['fixed:7']:,.0f} | {t['dfly']:,.0f} "
            f"| {t['dcut']:,.0f} | {t['confidence']:,.0f} "
            f"| {t['dfly'] / t['none']:.2f} | {t['dcut'] / t['none']:.2f} "
            f"| {r['dfly']['verify']:.2f} / {r['dcut']['verify']:.2f} / "
            f"{r['confidence']['verify']:.2f} "
            f"| {t['dcut'] / t['dfly'] - 1:+.1%} | {t['confidence'] / t['dcut'] - 1:+.1%} |")


if __name__ == "__main__":
    raise SystemExit(main())
