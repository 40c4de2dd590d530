"""Does long context keep self-speculation profitable at large batch?

Sweeps closed-loop concurrency on the two shipped self-speculation profiles (the KV-bound
``selfspec-llama8b-8xh200`` and the compute-bound-attention ``selfspec-v3-h200``), with
long prompts (``--lengths``: the synthetic ``long-context`` preset by default, or
``mooncake``), disaggregated prefill (the decode replica's own throughput: a chunked
32k-token prefill would otherwise fill every step) and reserved KV (a request is admitted
when its prompt + output fit: a preempted 32k-token request re-prefilled in the decode
batch would swamp the comparison), replaying ``selfspec-synthetic``
(the target drafting for itself over a 2048-token sparse KV, with entropies). Prints, per
load, steady-state output tok/s/GPU of ``none`` and each policy, the speed-up over
``none``, the decode batch actually running (KV capacity caps it), and the SparseSpec-L
controller's mean draft length.

    python benchmarks/long_context.py                     # 2 profiles x 6 loads (~3 min)
    python benchmarks/long_context.py --lengths mooncake --loads 16,64,256
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from dspark_sim.calibration.profile import load_profile
from dspark_sim.sim.api import simulate
from dspark_sim.sim.config import DeploymentConfig, EngineConfig, SimConfig, WorkloadConfig

PROFILES = "selfspec-llama8b-8xh200,selfspec-v3-h200"
POLICIES = ("fixed:1", "fixed:3", "fixed:7", "sparsespec", "sparsespec:conf")


def point(profile: str, load: int, lengths: str, requests_per_client: int,
          policies: tuple[str, ...] = POLICIES) -> dict:
    prof = load_profile(profile)
    base = SimConfig(trace="selfspec-synthetic",
                     # a prefill instance per client: a closed loop never holds more prompts
                     # than clients, so none waits; the table is the decode side's regime
                     deployment=DeploymentConfig(replicas=1, profile=profile,
                                                 prefill_instances=load),
                     engine=EngineConfig(prefill="disaggregated", kv_mode="reserve"),
                     workload=WorkloadConfig(arrival="closed", max_concurrency=load,
                                             num_requests=max(32, requests_per_client * load),
                                             lengths=lengths))
    out = {}
    for pol in ("none", *policies):
        # none replays no trace: it is given none, as a lone run of it would be
        s = simulate(replace(base, policy=pol, trace=None if pol == "none" else base.trace),
                     profile=prof).summary

        def get(key: str, s=s) -> float:
            v = s.get(f"steady_{key}")
            return float(v if v is not None else s[key])

        out[pol] = {"thr": get("output_throughput_per_gpu"), "batch": get("mean_decode_batch"),
                    "verify": get("mean_verify_tokens_per_request_step")}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", default=PROFILES)
    ap.add_argument("--loads", default="4,16,32,64,128,256")
    ap.add_argument("--lengths", default="long-context")
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--doc", default=None, help="also write each profile's table into this "
                    "doc's `<!-- bench: long_context PROFILE LENGTHS -->` block")
    args = ap.parse_args(argv)
    from doc_blocks import print_table, write_tables  # benchmarks/ is the script's path

    tables: dict[str, list[str]] = {}
    for profile in args.profiles.split(","):
        print(f"\n## {profile}, lengths {args.lengths}  (tok/s/GPU; x = over `none`; "
              "batch = decode requests per step; k = sparsespec's mean draft length)")
        tables[f"long_context {profile} {args.lengths}"] = lines = [
            "| C | batch | none | " + " | ".join(POLICIES) + " | k sparsespec / :conf |",
            "|---:|---:|---:|" + "---:|" * len(POLICIES) + "---|"]
        print_table(lines, (_row(load, point(profile, load, args.lengths,
                                             args.requests_per_client))
                            for load in (int(x) for x in args.loads.split(","))))
    write_tables(args.doc, tables, "benchmarks/long_context.py", argv)
    return 0


def _row(load: int, r: dict) -> str:
    ar = r["none"]["thr"]
    cells = " | ".join(f"{r[p]['thr']:,.0f} ({r[p]['thr'] / ar:.2f}x)" for p in POLICIES)
    return (f"| {load} | {r['none']['batch']:.0f} | {ar:,.0f} | {cells} "
            f"| {r['sparsespec']['verify'] - 1:.2f} / {r['sparsespec:conf']['verify'] - 1:.2f} |")


if __name__ == "__main__":
    raise SystemExit(main())
