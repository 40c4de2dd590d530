"""Tree verification (``cure``, ``pctree``, ``dspark-tree``) beside the CURE and PCTree
papers' numbers: every figure of docs/trees.md comes from this script.

1. **Accepted length, offline.** Served tau (tokens per verify step, bonus included, as
   vLLM counts it) of the unrepaired chain (all 16 drafts verified) and of each row-local
   tree policy's tree, replayed statically through every request of the shipped block-16
   synthetic v2 traces, per domain. Papers: CURE +4.2-7.5 % tau over the unrepaired
   parallel draft; PCTree tau 9.41 -> 11.16 (the PCTree trace's rank spread is *solved*
   so that the default ``pctree`` tree serves 11.16: that one number is an input, every
   other tree figure is a prediction).
2. **Speedup at concurrency 1** (one client, closed loop, ``--profile``): median per-user
   decode speed (1000 / TPOT) of each policy over target-only (``none``). Papers: CURE
   2.66-3.49x over target-only (Qwen3-8B); PCTree 6.14x (matched DSpark chain) -> 6.60x.
3. **A front under load**: closed-loop concurrency sweep, tree policies against the chain
   ``confidence`` scheduler and ``mtp1`` (which replays its own MTP-1 trace), steady-state
   throughput per GPU and median interactivity, with the verify tokens each request puts
   in a step: a tree's width is batch tokens a chain does not spend.
4. **Captured v2 traces** (``--captured``, default the shipped SmolLM2 captures of the
   DSpark and block-parallel drafters): parts 1 and 2 on each, at concurrency 1 on the
   measured CPU profile.

    python benchmarks/trees.py --markdown docs/trees.md   # ~90 s on 2 busy cores
    python benchmarks/trees.py --concurrency 1,16 --front-requests 32 --captured ""  # smoke

Prints markdown tables; ``--out`` also gets them as JSON (``trees.json``).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from dspark_sim.calibration.profile import load_profile
from dspark_sim.io import write_json_atomic, write_text_atomic
from dspark_sim.sim.api import DEFAULT_MTP_TRACE, simulate
from dspark_sim.sim.config import WorkloadConfig, preset
from dspark_sim.sim.sweep import parse_list, parse_numbers
from dspark_sim.sim.tree_synth import CURE_TRACE, PCTREE_TRACE, served_tau_of, static_accept_len
from dspark_sim.traces.schema import load_trace

BEGIN = "<!-- trees:begin (python benchmarks/trees.py --markdown; do not edit by hand) -->"
END = "<!-- trees:end -->"
ROW_LOCAL = ("cure", "pctree")
CHAIN = "fixed:16"  # the unrepaired / matched chain: every drafted token verified
# CURE publishes no budgets in the figures we hold: its gain across a small grid of them
CURE_GRID = ("cure:8,1,2,0.2", "cure:16,1,2,0.3", "cure:16,2,4,0.5", "cure:32,2,4,0.5",
             "cure:64,3,8,0.8")
# PCTree's implied step-cost ratio, tree over chain: (tau ratio) / (speedup ratio)
PCTREE_STEP_RATIO = (11.16 / 9.41) / (6.60 / 6.14)  # trees that depend on their own row only (static replay)
C1_POLICIES = "none,fixed:16,confidence,cure,pctree,dspark-tree"
FRONT_POLICIES = "confidence,mtp1,fixed:16,cure,pctree,dspark-tree"
PAPERS = {
    PCTREE_TRACE: "PCTree (Qwen3-4B, GSM8K, block 16): tau 9.41 -> 11.16 (+18.6 %); "
                  "speedup 6.14x -> 6.60x (+7.5 %)",
    CURE_TRACE: "CURE (Qwen3-8B, block 16): +4.2-7.5 % tau over unrepaired parallel "
                "drafting; 2.66-3.49x over target-only",
}


def offline_rows(trace_spec: str, policies: list[str]) -> list[dict]:
    """Per domain (and overall): the chain's served tau and each row-local tree's."""
    full = load_trace(trace_spec)
    rows = []
    for dom in [None, *full.meta.domains] if len(full.meta.domains) > 1 else [None]:
        tr = full if dom is None else full.select_domain(dom)
        chain = tr.served_tau(tr.gamma_max)
        row = {"trace": trace_spec, "domain": dom or "all", "chain_tau": chain}
        for spec in policies:
            acc = static_accept_len(tr, spec)
            tau = served_tau_of(acc, tr)
            row[spec] = tau
            row[f"{spec} gain"] = tau / chain - 1.0
        rows.append(row)
    return rows


def _metric(s: dict, key: str) -> float:
    v = s.get(f"steady_{key}")
    return float(s[key] if v is None else v)


def c1_rows(trace_spec: str, profile: str, policies: list[str], num_requests: int,
            lengths: str, domain: str | None) -> list[dict]:
    """One client: each policy's median decode speed over target-only's."""
    base = preset("single-replica")
    base = replace(base, trace=trace_spec, mtp_trace=DEFAULT_MTP_TRACE,
                   deployment=replace(base.deployment, profile=profile),
                   workload=replace(WorkloadConfig(), arrival="closed", max_concurrency=1,
                                    num_requests=num_requests, lengths=lengths, domain=domain))
    out = []
    for spec in policies:
        s = simulate(replace(base, policy=spec)).summary
        out.append({"policy": s["policy"], "spec": spec,
                    "interactivity": float(s["median_interactivity"]),
                    "accept_len": s["spec_decode_acceptance_length"],
                    "verify_tokens": s["mean_verify_tokens_per_request_step"],
                    "step_ms": s["mean_step_ms"],
                    "draft_tokens": s["mean_draft_tokens_per_request_step"]})
    ref = next((r["interactivity"] for r in out if r["spec"] == "none"), None)
    for r in out:
        r["speedup"] = r["interactivity"] / ref if ref else float("nan")
    return out


def front_rows(trace_spec: str, profile: str, policies: list[str], concurrency: list[int],
               min_requests: int, per_client: int) -> list[dict]:
    base = preset("single-replica")
    base = replace(base, trace=trace_spec, mtp_trace=DEFAULT_MTP_TRACE,
                   deployment=replace(base.deployment, profile=profile))
    rows = []
    for c in concurrency:
        w = replace(WorkloadConfig(), arrival="closed", max_concurrency=c,
                    num_requests=max(min_requests, per_client * c))
        for spec in policies:
            s = simulate(replace(base, policy=spec, workload=w)).summary
            rows.append({"concurrency": c, "policy": s["policy"], "spec": spec,
                         "throughput_per_gpu": _metric(s, "output_throughput_per_gpu"),
                         "interactivity": _metric(s, "median_interactivity"),
                         "accept_len": _metric(s, "spec_decode_acceptance_length"),
                         "verify_tokens": _metric(s, "mean_verify_tokens_per_request_step"),
                         "decode_batch": _metric(s, "mean_decode_batch"),
                         "steady": s["steady_output_throughput_per_gpu"] is not None})
    return rows


def pareto_policies(rows: list[dict]) -> set[str]:
    """Policies with at least one point no other point beats on both axes."""
    pts = np.array([[r["interactivity"], r["throughput_per_gpu"]] for r in rows])
    on = set()
    for i, r in enumerate(rows):
        dominated = np.any((pts[:, 0] >= pts[i, 0]) & (pts[:, 1] >= pts[i, 1])
                           & ((pts[:, 0] > pts[i, 0]) | (pts[:, 1] > pts[i, 1])))
        if not dominated:
            on.add(r["spec"])
    return on


# -- markdown ------------------------------------------------------------------------


def md_offline(rows: list[dict], policies: list[str]) -> str:
    head = "| trace | domain | chain tau (whole block verified) | " + " | ".join(
        f"`{p}` tau (gain)" for p in policies) + " |"
    lines = [head, "|" + "---|" * (3 + len(policies))]
    for r in rows:
        cells = " | ".join(f"{r[p]:.2f} ({r[f'{p} gain']:+.1%})" for p in policies)
        lines.append(f"| {Path(r['trace']).stem} | {r['domain']} | {r['chain_tau']:.2f} | "
                     f"{cells} |")
    return "\n".join(lines)


def md_c1(title: str, rows: list[dict]) -> str:
    lines = [f"{title}", "", "| policy | accepted / step | verify tokens / request step | "
             "mean step (ms) | step / chain step | tok/s/user | speedup over `none` |",
             "|---|---|---|---|---|---|---|"]
    chain = next((r["step_ms"] for r in rows if r["spec"].startswith("fixed:")), None)
    for r in rows:
        rel = f"{r['step_ms'] / chain:.2f}" if chain else "-"
        lines.append(f"| `{r['policy']}` | {r['accept_len']:.2f} | {r['verify_tokens']:.1f} | "
                     f"{r['step_ms']:.2f} | {rel} | {r['interactivity']:.1f} | "
                     f"{r['speedup']:.2f}x |")
    return "\n".join(lines)


def md_front(rows: list[dict]) -> str:
    on = pareto_policies(rows)
    lines = ["| concurrency | policy | tok/s/GPU | tok/s/user | accepted / step | "
             "verify tokens / request step | decode batch |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['concurrency']} | `{r['policy']}` | {r['throughput_per_gpu']:,.0f} | "
                     f"{r['interactivity']:.1f} | {r['accept_len']:.2f} | "
                     f"{r['verify_tokens']:.1f} | {r['decode_batch']:.1f}"
                     f"{'' if r['steady'] else ' (whole run)'} |")
    best = []
    for c in sorted({r["concurrency"] for r in rows}):
        at = [r for r in rows if r["concurrency"] == c]
        top = max(at, key=lambda r: r["throughput_per_gpu"])
        best.append(f"C={c}: `{top['policy']}`")
    lines += ["", "highest throughput per concurrency: " + ", ".join(best),
              "", "policies with a point on the Pareto front (all points): "
              + ", ".join(f"`{p}`" for p in sorted(on))]
    return "\n".join(lines)


def _chain_for(spec_list: list[str], gamma: int) -> list[str]:
    """The policy list with the chain ``fixed:16`` set to the trace's own block."""
    return [f"fixed:{gamma}" if p == CHAIN else p for p in spec_list]


def _c1(result: dict, key: str, prefix: str) -> dict | None:
    return next((r for r in result["c1"].get(key, []) if r["spec"].startswith(prefix)), None)


def _span(vals: list[float], fmt: str) -> str:
    lo, hi = min(vals), max(vals)
    return format(lo, fmt) if f"{lo:{fmt}}" == f"{hi:{fmt}}" else f"{lo:{fmt}} to {hi:{fmt}}"


def md_summary(result: dict) -> str:
    """The papers' figures beside the simulator's, from this run's results."""
    off = {(r["trace"], r["domain"]): r for r in result["offline"]}
    rows = ["| figure | paper | simulator | note |", "|---|---|---|---|"]
    pc = off.get((PCTREE_TRACE, "all"))
    if pc:
        rows.append(f"| PCTree chain tau (Qwen3-4B GSM8K, block 16) | 9.41 | "
                    f"{pc['chain_tau']:.2f} | input: the trace's chain is fitted to it |")
        rows.append(f"| PCTree tree tau | 11.16 | {pc['pctree']:.2f} (`pctree:64,4`) | input: "
                    "the rank spread is solved on it |")
        key = f"{PCTREE_TRACE}:all"
        ch, tr = _c1(result, key, "fixed:"), _c1(result, key, "pctree")
        if ch and tr:
            rows.append(f"| PCTree speedup, chain -> tree | 6.14x -> 6.60x | {ch['speedup']:.2f}x "
                        f"-> {tr['speedup']:.2f}x | concurrency 1, {result['profile']} |")
            prof = load_profile(result["profile"])
            v_t, v_c = tr["verify_tokens"], ch["verify_tokens"]
            verify_ms = 1e3 * (prof.target_time_s(round(v_t)) - prof.target_time_s(round(v_c))
                               + prof.logits_s_per_row * (v_t - v_c))
            extra = tr["step_ms"] - ch["step_ms"]
            rows.append(f"| PCTree tree step / chain step | {PCTREE_STEP_RATIO:.2f} (implied) | "
                        f"{tr['step_ms'] / ch['step_ms']:.2f} | prediction: of the "
                        f"{extra:+.2f} ms, {verify_ms:.2f} ms is the target's table and "
                        f"LM-head rows for {v_t - v_c:.0f} more verify tokens, the rest "
                        "branch drafting and attention rows |")
    cure_doms = [r for r in result["offline"] if r["trace"] == CURE_TRACE and r["domain"] != "all"]
    if cure_doms:
        rows.append("| CURE tau gain over the unrepaired chain (Qwen3-8B, block 16) | "
                    f"+4.2 to +7.5 % | {_span([100 * r['cure gain'] for r in cure_doms], '+.1f')} % "
                    "(`cure:32,2,4,0.5`, per domain) | prediction |")
        grid = [r for r in result["cure_grid"] if r["domain"] != "all"]
        for spec in CURE_GRID:
            if spec == "cure:32,2,4,0.5" or not grid:
                continue
            rows.append(f"| | | {_span([100 * r[f'{spec} gain'] for r in grid], '+.1f')} % "
                        f"(`{spec}`) | budget grid |")
        sp = [_c1(result, f"{CURE_TRACE}:{r['domain']}", "cure") for r in cure_doms]
        chs = [_c1(result, f"{CURE_TRACE}:{r['domain']}", "fixed:") for r in cure_doms]
        if all(sp) and all(chs):
            rows.append(f"| CURE speedup over target-only | 2.66x to 3.49x | "
                        f"{_span([r['speedup'] for r in sp], '.2f')}x (`cure`; chain "
                        f"{_span([r['speedup'] for r in chs], '.2f')}x) | partly input: the "
                        "chain's tau levels were read off these speedups |")
    return "### Papers beside the simulator\n\n" + "\n".join(rows) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default=f"{PCTREE_TRACE},{CURE_TRACE}")
    ap.add_argument("--profile", default="qwen3-8b-h100",
                    help="engine profile (no Qwen3-4B profile ships: the 8B one for both)")
    ap.add_argument("--c1-policies", default=C1_POLICIES)
    ap.add_argument("--c1-requests", type=int, default=48)
    ap.add_argument("--c1-lengths", default="fixed:256:512",
                    help="GSM8K-like prompts and answers (the papers' decode-speed setting)")
    ap.add_argument("--front-traces", default=f"{CURE_TRACE},{PCTREE_TRACE}")
    ap.add_argument("--front-policies", default=FRONT_POLICIES)
    ap.add_argument("--concurrency", default="1,4,16,64,256")
    ap.add_argument("--front-requests", type=int, default=96)
    ap.add_argument("--per-client", type=int, default=4)
    ap.add_argument("--skip-front", action="store_true")
    ap.add_argument("--captured", default="captured-smollm2-dspark,captured-smollm2-parallel",
                    help="comma-separated captured schema-v2 traces ('' for none)")
    ap.add_argument("--captured-profile", default="smollm2-cpu")
    ap.add_argument("--captured-lengths", default="fixed:128:160")
    ap.add_argument("--out", default=None, help="folder for trees.json")
    ap.add_argument("--markdown", default=None,
                    help="write the tables here; a file with the trees:begin/end markers "
                         "(docs/trees.md) gets them spliced between the markers")
    return ap.parse_args(argv)


def write_markdown(path: str | Path, md: str) -> None:
    """Write ``md``; a file holding the markers gets it spliced between them."""
    path = Path(path)
    old = path.read_text() if path.exists() else ""
    if BEGIN in old and END in old:  # splice between the markers (docs/trees.md)
        head, rest = old.split(BEGIN, 1)
        md = head + BEGIN + "\n" + md + END + rest.split(END, 1)[1]
    write_text_atomic(path, md)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)

    t0 = time.perf_counter()
    blocks: list[str] = []

    def emit(text: str) -> None:
        blocks.append(text)
        print(text)

    traces = parse_list(args.traces, option="--traces", what="trace")
    c1_pols = parse_list(args.c1_policies, option="--c1-policies")
    result: dict = {"profile": args.profile, "offline": [], "cure_grid": [], "c1": {},
                    "front": [], "captured": {}, "pctree_step_ratio": PCTREE_STEP_RATIO}
    emit("### 1. Accepted length, offline (static replay of every request)\n")
    for t in traces:
        result["offline"] += offline_rows(t, list(ROW_LOCAL))
    emit(md_offline(result["offline"], list(ROW_LOCAL)))
    emit("\nPapers: " + "; ".join(PAPERS.get(t, t) for t in traces) + "\n")
    if CURE_TRACE in traces:
        result["cure_grid"] = offline_rows(CURE_TRACE, list(CURE_GRID))
        emit(f"CURE's budgets (N nodes, b branches, F frontier, M margin) on {CURE_TRACE}:"
              "\n")
        emit(md_offline(result["cure_grid"], list(CURE_GRID)) + "\n")

    emit(f"### 2. Concurrency 1 on {args.profile} ({args.c1_requests} requests, "
          f"{args.c1_lengths})\n")
    emit(f"PCTree's published figures imply a tree step {PCTREE_STEP_RATIO:.3f}x the matched "
          "chain's ((11.16 / 9.41) / (6.60 / 6.14)).\n")
    for t in traces:
        tr = load_trace(t)
        doms = tr.meta.domains
        for dom in [None, *doms] if len(doms) > 1 else [None]:
            key = f"{t}:{dom or 'all'}"
            rows = c1_rows(t, args.profile, _chain_for(c1_pols, tr.gamma_max),
                           args.c1_requests, args.c1_lengths, dom)
            result["c1"][key] = rows
            emit(md_c1(f"**{t}**, domain {dom or 'all'}", rows) + "\n")

    if not args.skip_front:
        conc = parse_numbers(args.concurrency, integer=True, option="--concurrency")
        front_pols = parse_list(args.front_policies, option="--front-policies")
        for t in parse_list(args.front_traces, option="--front-traces", what="trace"):
            emit(f"### 3. Front under load: {t} on {args.profile} (closed loop; "
                  f"max({args.front_requests}, {args.per_client} x C) requests)\n")
            g = load_trace(t).gamma_max
            rows = front_rows(t, args.profile, _chain_for(front_pols, g),
                              conc, args.front_requests, args.per_client)
            result["front"] += [dict(r, trace=t) for r in rows]
            emit(md_front(rows) + "\n")

    captured = (parse_list(args.captured, option="--captured", what="trace")
                if args.captured.strip() else [])  # '': none
    for path in captured:
        tr = load_trace(path)
        emit(f"### 4. Captured trace {Path(path).stem}\n\n{tr.meta.drafter} drafting for {tr.meta.target}, "
              f"block {tr.gamma_max}, {tr.num_positions} positions, {tr.num_requests} "
              "requests\n")
        cap = {"offline": offline_rows(path, list(ROW_LOCAL)),
               "c1": c1_rows(path, args.captured_profile, _chain_for(c1_pols, tr.gamma_max),
                             args.c1_requests, args.captured_lengths, None),
               "meta": {"drafter": tr.meta.drafter, "target": tr.meta.target,
                        "gamma_max": tr.gamma_max, "positions": tr.num_positions}}
        result["captured"][path] = cap
        emit(md_offline(cap["offline"], list(ROW_LOCAL)) + "\n")
        emit(md_c1(f"**{Path(path).stem}**, concurrency 1 on {args.captured_profile} "
                    f"({args.captured_lengths})", cap["c1"]) + "\n")
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    summary = md_summary(result)
    print(summary)
    print(f"(wall {result['wall_s']} s)")
    if args.out:
        write_json_atomic(Path(args.out) / "trees.json", result)
    if args.markdown:
        write_markdown(args.markdown, "\n".join([summary, *blocks]).rstrip() + "\n")
    return result


if __name__ == "__main__":
    main()
