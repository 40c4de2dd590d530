"""A ``BenchRun`` built by hand from its requests' timings (send, time to first token,
gaps between streamed chunks), for the tests of what the vLLM fit reads from them: shared
by test_vllm_step_table and test_vllm_steps."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dspark_sim.validation.vllm_fit import BenchRun


def timed_run(send_s, ttft_s, itls_s, k=0, concurrency=None) -> BenchRun:
    """A run of ``len(send_s)`` requests with these timings (seconds): closed loop at
    ``concurrency``, else open loop at 1 req/s; speculative at ``k`` drafts, else none."""
    n = len(send_s)
    return BenchRun(Path("x.json"), "none" if not k else f"ngram-k{k}", k, concurrency,
                    None if concurrency else 1.0, np.full(n, 10),
                    np.array([len(g) + 1 for g in itls_s]), np.asarray(send_s, float),
                    {"median_tpot_ms": 50.0, "output_throughput": 20.0}, {}, None, None,
                    (), None, np.asarray(ttft_s, float),
                    tuple(np.asarray(g, float) for g in itls_s))
