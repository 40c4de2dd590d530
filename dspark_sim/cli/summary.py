"""A run's summary as ``run`` prints it: what ran, one line each, then the metrics."""

from __future__ import annotations

from rich.table import Table

from dspark_sim.cli.terminal import _fmt, console
from dspark_sim.sim.quality import quality_rows


def _print_head(s: dict) -> None:
    """What ran: policy, deployment, workload, trace and calibration, one line each."""
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold cyan")
    head.add_column()
    head.add_row("policy", f"{s['policy']}  ({s['policy_description']})")
    head.add_row("deployment", s["deployment"])
    head.add_row("workload", s["workload"])
    if s.get("trace"):
        head.add_row("trace", f"{s['trace']}  [{s['trace_source']}, drafter {s['trace_drafter']}, "
                     f"gamma_max {s['trace_gamma_max']}]")
    if s.get("trace_extrapolation"):
        head.add_row("extrapolation", s["trace_extrapolation"])
    head.add_row("calibration", s["calibration"])
    if s.get("conf_source"):
        measured = "no confidences replayed" if s.get("conf_source_ece") is None else (
            f"measured over the drafts a chain reaches: ECE {_fmt(s['conf_source_ece'], 4)}, "
            f"AUC {_fmt(s.get('conf_source_auc'), 4)}")
        head.add_row("confidences", f"{s['conf_source']}  ({measured})")
    elif s.get("confidences"):
        head.add_row("confidences", s["confidences"])
    if s.get("engine_can_run") is False:  # a policy the measured drafter cannot run
        head.add_row("engine", s["engine_note"])
    console.print(head)


def _summary_table(s: dict) -> Table:
    """The run table's frame: its title and three columns."""
    lossy = " (LOSSY policy: output differs from the target's greedy)" if s.get("lossy") else ""
    t = Table(title="dspark-sim run" + lossy, show_header=True, header_style="bold")
    t.add_column("metric")
    t.add_column("steady state", justify="right")
    t.add_column("whole run", justify="right")
    return t


def print_summary(s: dict, wall_s: float | None = None) -> None:
    _print_head(s)
    t = _summary_table(s)

    def both(key: str, nd: int = 1) -> tuple[str, str]:
        return _fmt(s.get(f"steady_{key}"), nd), _fmt(s.get(key), nd)

    def pair(a: str, b: str, nd: int = 1) -> tuple[str, str]:
        sa, wa = both(a, nd)
        sb, wb = both(b, nd)
        return f"{sa} / {sb}", f"{wa} / {wb}"

    rejected = s.get("rejected", 0)
    reasons = ", ".join(f"{v:,} {k}" for k, v in (s.get("rejected_reasons") or {}).items())
    rows = [
        ("completed / unfinished / rejected", "",
         f"{s['completed']:,} / {s['unfinished']:,} / {rejected:,}"
         + (f" ({reasons})" if reasons else "")),
        ("preempted requests / steps held back by KV", "",
         f"{s['preempted']:,} / {s['kv_blocked_steps']:,}"),
        ("window (s)",
         f"{_fmt(s.get('steady_window_start_s'), 2)} - {_fmt(s.get('steady_window_end_s'), 2)}",
         f"0 - {_fmt(s['duration'], 2)}"),
        ("request throughput (req/s)", *both("request_throughput", 2)),
        ("output throughput (tok/s)", *both("output_throughput")),
        ("output throughput per decode GPU (tok/s/GPU)", *both("output_throughput_per_gpu")),
        ("median / p90 interactivity (tok/s/user)",
         *pair("median_interactivity", "p90_interactivity")),
        ("median / p99 TTFT (ms)", *pair("median_ttft_ms", "p99_ttft_ms")),
        ("median / p99 TPOT (ms)", *pair("median_tpot_ms", "p99_tpot_ms", 2)),
        ("median E2E latency (ms)", *both("median_e2el_ms")),
        ("tau per proposal, vLLM's acceptance length (incl. bonus)",
         *both("spec_decode_acceptance_length", 2)),
        ("tau per request-step (incl. bonus)", *both("tokens_per_request_step", 2)),
        ("verify tokens per request-step (incl. bonus)",
         *both("mean_verify_tokens_per_request_step", 2)),
        ("verification waste (rejected / verified)", *both("verification_waste", 3)),
        ("acceptance per position, P(m >= k)", "",
         " ".join(f"{x:.2f}" for x in s["acceptance_per_position"]) or "-"),
        ("mean step (ms) / mean decode batch",
         f"{_fmt(s.get('steady_mean_step_ms'), 2)} / {_fmt(s.get('steady_mean_decode_batch'))}",
         f"{_fmt(s['mean_step_ms'], 2)} / {_fmt(s['mean_decode_batch'])}"),
        ("engine steps", "", f"{s['engine_steps']:,}"),
    ]
    if "output_throughput_per_gpu_incl_prefill" in s:  # disaggregated: beside the decode GPUs'
        rows.insert(6, (f"output throughput per GPU, decode + prefill "
                        f"({s['num_gpus'] + s['num_prefill_gpus']:,} GPUs)",
                        *both("output_throughput_per_gpu_incl_prefill")))
        rows.append(("prefill instances / utilization / mean, p99 queue wait (ms)", "",
                     f"{s['prefill_instances']:,} / {_fmt(s['prefill_utilization'], 2)} / "
                     f"{_fmt(s['mean_prefill_wait_ms'])}, {_fmt(s['p99_prefill_wait_ms'])}"))
    if s.get("goodput") is not None:
        rows.append((f"goodput (req/s, SLO ttft {s['slo_ttft_ms']} ms, tpot {s['slo_tpot_ms']} ms)",
                     "", _fmt(s["goodput"], 2)))
    if "max_num_seqs" in s:
        rows.append(("limits: seqs / batched tokens / KV tokens / prefill", "",
                     f"{s['max_num_seqs']:,} / {s['max_num_batched_tokens']:,} / "
                     f"{s['kv_capacity_tokens']:,} / {s['prefill']}"))
    if s.get("bounded_by"):
        rows.append(("stopped by", "", f"the {s['bounded_by']} bound (max_engine_steps "
                                       f"{s['max_engine_steps']:,}, horizon "
                                       f"{s['horizon_s']:,.0f} s): requests cut short"))
    # why it is unstable, in the summary's words (summary.json's stability_note says why
    # a stable run is, too)
    verdict = "yes" if s["stable"] else f"NO: {s.get('stability_note') or 'the queue grows'}"
    if s.get("steady_window_short"):
        verdict += f" (short window: {s.get('steady_window_note', 'run more requests')})"
    rows.append(("stable", "", verdict))
    rows += quality_rows(s)
    for k, a, b in rows:
        t.add_row(k, a, b)
    console.print(t)
    if wall_s is not None:
        steps = s["engine_steps"]
        console.print(f"simulated {s['num_requests']:,} requests in {wall_s:.2f} s wall "
                      f"({s['num_requests'] / wall_s:,.0f} req/s, {steps / wall_s:,.0f} steps/s)",
                      style="dim")

