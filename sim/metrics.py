"""Per-request and per-run metrics, under vLLM ``bench serve`` names where one exists.

Definitions (stated because sources differ, see PUBLISHED_FIGURES.md):

* TPOT = (E2E - TTFT) / (output_tokens - 1) (vLLM); interactivity = 1000 / TPOT_ms
  tokens/s/user (InferenceX, AIPerf).
* ITL = time between successive token-emitting steps of a request (a speculative
  step emits several tokens at once, as vLLM's streamed chunks do).
* ``spec_decode_acceptance_length`` = 1 + accepted / drafts (vLLM; includes the
  bonus token, = DSpark's tau); ``acceptance_per_position[k]`` is vLLM's
  *unconditional* ``num_accepted_tokens_per_pos / num_drafts``.
* ``mean_verify_tokens_per_request_step`` counts the bonus slot, so MTP-1 is 2
  (DSpark Fig. 8's "verification budget").
* ``verification_waste`` = rejected draft tokens / verified draft tokens.
* Throughputs are over the benchmark duration: first arrival to last completion.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from dspark_sim.sim.engine import ITL_EDGES_S, RequestLog, StepStats


def requests_frame(log: RequestLog) -> pl.DataFrame:
    finished = ~np.isnan(log.finish_s)
    ttft = log.first_token_s - log.arrival_s
    e2e = log.finish_s - log.arrival_s
    n = log.generated
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(n > 1, (e2e - ttft) / np.maximum(n - 1, 1), np.nan)
        inter = np.where(tpot > 0, 1.0 / tpot, np.nan)
    return pl.DataFrame({
        "request_id": np.arange(len(n), dtype=np.int64),
        "replica": log.replica,
        "arrival_s": log.arrival_s,
        "prompt_tokens": log.prompt_tokens,
        "output_tokens": log.output_tokens,
        "generated_tokens": n,
        "finished": finished,
        "ttft_ms": ttft * 1e3,
        "tpot_ms": tpot * 1e3,
        "e2e_ms": e2e * 1e3,
        "interactivity_tok_s": inter,
        "steps": log.steps,
        "draft_tokens_verified": log.draft_tokens_verified,
        "accepted_tokens": log.accepted_tokens,
        "preemptions": log.preemptions,
        "trace_row": log.trace_row,
    }).with_columns(
        pl.col(c).fill_nan(None) for c in ("ttft_ms", "tpot_ms", "e2e_ms", "interactivity_tok_s")
    )


def _stats(prefix: str, v: np.ndarray) -> dict[str, float | None]:
    v = v[np.isfinite(v)]
    if v.size == 0:
        return {f"mean_{prefix}": None, f"median_{prefix}": None, f"p90_{prefix}": None,
                f"p99_{prefix}": None}
    return {
        f"mean_{prefix}": float(v.mean()),
        f"median_{prefix}": float(np.median(v)),
        f"p90_{prefix}": float(np.percentile(v, 90)),
        f"p99_{prefix}": float(np.percentile(v, 99)),
    }


def _hist_percentile(hist: np.ndarray, q: float) -> float | None:
    total = hist.sum()
    if total == 0:
        return None
    k = int(np.searchsorted(np.cumsum(hist), q / 100.0 * total))
    k = min(max(k, 1), len(ITL_EDGES_S) - 1)
    return float(np.sqrt(ITL_EDGES_S[k - 1] * ITL_EDGES_S[k]))  # geometric bin centre


def summarize(
    log: RequestLog,
    stats: StepStats,
    *,
    gpus: int,
    slo_ttft_ms: float | None,
    slo_tpot_ms: float | None,
    stable: bool,
    queue_growth_per_s: float,
) -> dict:
    fin = ~np.isnan(log.finish_s)
    n_done = int(fin.sum())
    start = float(np.nanmin(log.arrival_s)) if len(log.arrival_s) else 0.0
    end = float(np.nanmax(log.finish_s)) if n_done else start
    duration = max(end - start, 1e-9)
    out_tokens = int(log.generated[fin].sum())
    in_tokens = int(log.prompt_tokens[fin].sum())
    ttft = (log.first_token_s - log.arrival_s)[fin] * 1e3
    e2e = (log.finish_s - log.arrival_s)[fin] * 1e3
    n = log.generated[fin]
    multi = n > 1
    tpot = np.full(n_done, np.nan)
    tpot[multi] = (e2e[multi] - ttft[multi]) / (n[multi] - 1)
    inter = np.where(tpot > 0, 1000.0 / tpot, np.nan)

    s: dict = {
        "completed": n_done,
        "num_requests": int(len(log.arrival_s)),
        "unfinished": int(len(log.arrival_s) - n_done),
        "preempted": int((log.preemptions > 0).sum()),
        "preemptions": int(log.preemptions.sum()),
        "duration": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": n_done / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + in_tokens) / duration,
        "output_throughput_per_gpu": out_tokens / duration / gpus,
        "num_gpus": gpus,
    }
    for name, v in (("ttft_ms", ttft), ("tpot_ms", tpot), ("e2el_ms", e2e)):
        s |= _stats(name, v)
    itl_n = int(stats.itl_hist.sum())
    s["mean_itl_ms"] = stats.itl_sum_s / itl_n * 1e3 if itl_n else None
    for q in (50, 90, 99):
        p = _hist_percentile(stats.itl_hist, q)
        s[f"{'median' if q == 50 else f'p{q}'}_itl_ms"] = None if p is None else p * 1e3
    fi = inter[np.isfinite(inter)]
    s["median_interactivity"] = float(np.median(fi)) if fi.size else None
    s["p90_interactivity"] = float(np.percentile(fi, 90)) if fi.size else None
    s["p10_interactivity"] = float(np.percentile(fi, 10)) if fi.size else None

    drafts = stats.request_steps
    accepted = int((stats.accept_hist * np.arange(stats.accept_hist.size)).sum())
    verified = int((stats.ell_hist * np.arange(stats.ell_hist.size)).sum())
    s["num_drafts"] = drafts
    s["num_draft_tokens_verified"] = verified
    s["num_accepted_tokens"] = accepted
    s["spec_decode_acceptance_length"] = 1.0 + accepted / drafts if drafts else None
    s["spec_decode_acceptance_rate"] = accepted / verified if verified else None
    if drafts and stats.gamma:
        ge = stats.accept_hist[::-1].cumsum()[::-1]  # count of steps with accepted >= k
        s["acceptance_per_position"] = [float(x) / drafts for x in ge[1 : stats.gamma + 1]]
        vge = stats.ell_hist[::-1].cumsum()[::-1]
        s["verified_per_position"] = [float(x) / drafts for x in vge[1 : stats.gamma + 1]]
    else:
        s["acceptance_per_position"] = []
        s["verified_per_position"] = []
    s["mean_verify_tokens_per_request_step"] = stats.verify_tokens / drafts if drafts else None
    s["mean_draft_tokens_per_request_step"] = verified / drafts if drafts else None
    s["verification_waste"] = (verified - accepted) / verified if verified else 0.0
    s["engine_steps"] = stats.steps
    s["mean_step_ms"] = stats.busy_s / stats.steps * 1e3 if stats.steps else None
    s["mean_batch_tokens"] = stats.batch_tokens / stats.steps if stats.steps else None
    s["mean_decode_batch"] = drafts / stats.steps if stats.steps else None
    s["budget_limited_steps"] = stats.budget_limited_steps
    s["kv_blocked_steps"] = stats.kv_blocked_steps

    ok = np.ones(n_done, bool)
    if slo_ttft_ms is not None:
        ok &= ttft <= slo_ttft_ms
    if slo_tpot_ms is not None:
        ok &= ~(tpot > slo_tpot_ms)  # single-token requests have no TPOT: they pass
    s["slo_ttft_ms"] = slo_ttft_ms
    s["slo_tpot_ms"] = slo_tpot_ms
    s["goodput"] = float(ok.sum()) / duration if (slo_ttft_ms or slo_tpot_ms) else None
    s["stable"] = bool(stable)
    s["queue_growth_per_s"] = float(queue_growth_per_s)
    return s
