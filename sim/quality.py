"""Quality on the lossy axis: what a lossy policy's output is worth, never mixed with
lossless throughput (see docs/lossy.md).

The trace's per-request label ``req_correct`` (schema v2) says whether the *target's
greedy* continuation reaches the right answer (e.g. GSM8K exact match of the real
target's output). A simulated request replays trace request ``trace_row``:

* with **no changed token** its output is exactly the greedy output: its label holds;
* with **changed tokens** the trace cannot say where the diverged text ends up. Two
  bounds: ``task_score_low`` counts every changed request wrong; ``task_score_high``
  lets it keep its greedy label (no harm). ``task_score_high`` is an upper bound only
  under the assumption that a change never repairs a wrong answer; the strict upper
  bound (every changed request right) is ``task_score_low + changed_keyed_fraction``.

Only finished requests whose trace request has a key (label 0 or 1) count.
"""

from __future__ import annotations

import numpy as np

TASK_KEYS = ("task_score_greedy", "task_score_low", "task_score_high", "task_score_requests",
             "changed_requests", "changed_keyed_fraction")


def task_score(changed_tokens: np.ndarray, finished: np.ndarray, trace_row: np.ndarray,
               req_correct: np.ndarray | None) -> dict[str, float | int | None]:
    """The task-score bounds over finished, keyed requests (Nones without labels).

    changed_tokens [n] per simulated request; finished [n] bool; trace_row [n] the trace
    request each replays; req_correct [R] int8 labels (1 / 0, -1 = no key) or None."""
    changed = np.asarray(changed_tokens) > 0
    out: dict[str, float | int | None] = dict.fromkeys(TASK_KEYS)
    out["changed_requests"] = int(np.count_nonzero(changed & finished))
    if req_correct is None:
        return out
    label = np.asarray(req_correct)[np.asarray(trace_row, dtype=np.int64)]
    keyed = finished & (label >= 0)
    n = int(keyed.sum())
    out["task_score_requests"] = n
    if not n:
        return out
    right = (label == 1) & keyed
    out["task_score_greedy"] = float(right.sum()) / n
    out["task_score_low"] = float((right & ~changed).sum()) / n
    out["task_score_high"] = out["task_score_greedy"]
    out["changed_keyed_fraction"] = float((changed & keyed).sum()) / n
    return out


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def quality_rows(s: dict) -> list[tuple[str, str, str]]:
    """Rows of the printed run table for a lossy summary (metric, steady, whole run)."""
    if not s.get("lossy"):
        return []
    rows = [("LOSSY: changed tokens (differ from greedy)", "",
             f"{s.get('changed_tokens', 0):,} ({_pct(s.get('changed_token_fraction'))})"),
            ("LOSSY: requests with a changed token", "", f"{s.get('changed_requests') or 0:,}")]
    if s.get("verifier_skipped_request_steps"):
        rows.append(("LOSSY: request-steps that skipped the verifier", "",
                     f"{s['verifier_skipped_request_steps']:,} (verifier called on "
                     f"{_pct(s.get('verifier_call_fraction'))})"))
    if s.get("task_score_requests"):
        rows.append((f"LOSSY: task score, {s['task_score_requests']:,} keyed requests "
                     "(greedy; bounds)", "",
                     f"{_pct(s['task_score_greedy'])}; {_pct(s['task_score_low'])} - "
                     f"{_pct(s['task_score_high'])}"))
    return rows
