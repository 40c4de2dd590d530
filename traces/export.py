"""Export a trace's acceptance curve to a real engine.

``vllm-synthetic``: the ``--speculative-config`` fragment for vLLM's synthetic rejection
sampler. vLLM's ``SpeculativeConfig`` (``vllm/config/speculative.py``) documents
``synthetic_acceptance_rates`` as *unconditional* per-position rates: "position i's entry
is the marginal probability that the first i+1 draft tokens are all accepted; the list
must have length num_speculative_tokens, each entry in [0, 1], and be monotonically
non-increasing. Only valid when rejection_sample_method is 'synthetic'." The rejection
sampler turns them into conditional rates and draws every position of every verify step
independently (``unconditional_to_conditional_rates`` in
``vllm/v1/sample/rejection_sampler.py``), so the engine serves
``1 + sum(rates)`` tokens per step whatever the trace's ordering was.

Two weightings of a trace's survival ``P(m >= j)``, ``j = 1..K``:

* ``served`` (default): over the verify steps a fixed-``K`` chain visits
  (:meth:`AcceptanceTrace.served_survival`). The engine then serves the trace's served
  tau at ``K``, the tau a simulated ``fixed:K`` run reports, and its ``/metrics``
  per-position counters reproduce these rates. On a trace with ``draft_tokens`` (a
  drafter that proposes nothing at some positions) the rates are over the steps that
  carry drafts, as vLLM counts them; where the engine drafts is its own drafter's.
* ``positions``: over every position once (:meth:`AcceptanceTrace.survival`): the
  per-position mean tau, higher than served on bursty traces.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from dspark_sim.errors import InputError
from dspark_sim.io import write_json_atomic
from dspark_sim.traces.schema import AcceptanceTrace

EXPORT_FORMATS = ("vllm-synthetic",)
WEIGHTINGS = ("served", "positions")


def vllm_synthetic_config(trace: AcceptanceTrace, *, num_speculative_tokens: int | None = None,
                          weighting: str = "served", method: str | None = None,
                          model: str | None = None) -> dict[str, Any]:
    """The ``--speculative-config`` JSON object (add ``method``/``model`` for your drafter,
    or pass them here)."""
    k = trace.gamma_max if num_speculative_tokens is None else num_speculative_tokens
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= trace.gamma_max:
        raise InputError("--num-speculative-tokens",
                         f"must be an integer in [1, {trace.gamma_max}] (the trace's gamma_max), "
                         f"got {k!r}")
    if weighting == "served":
        rates = trace.served_survival(k)
    elif weighting == "positions":
        rates = trace.survival()[:k]
    else:
        raise InputError("--weighting", f"must be one of {', '.join(WEIGHTINGS)}, got {weighting!r}")
    # Rounding is monotone, so the list stays non-increasing as vLLM requires.
    rates = [round(float(x), 6) for x in np.clip(rates, 0.0, 1.0)]
    cfg: dict[str, Any] = {}
    if method:
        cfg["method"] = method
    if model:
        cfg["model"] = model
    cfg.update({"num_speculative_tokens": k, "rejection_sample_method": "synthetic",
                "synthetic_acceptance_rates": rates})
    return cfg


def export_trace(trace: AcceptanceTrace, fmt: str, out: str | Path, **opts: Any) -> dict[str, Any]:
    """Write ``trace`` in format ``fmt`` to ``out`` (atomically); returns what was written."""
    if fmt != "vllm-synthetic":
        raise InputError("--format", f"unknown export format {fmt!r}; one of {', '.join(EXPORT_FORMATS)}")
    cfg = vllm_synthetic_config(trace, **opts)
    write_json_atomic(Path(out), cfg)
    return cfg
