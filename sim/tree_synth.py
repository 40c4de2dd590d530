"""The shipped synthetic tree traces (schema v2, block 16) at the CURE and PCTree papers'
settings, and the static tree replays they are fitted and checked with.

The rank spread of :mod:`dspark_sim.traces.synth_v2` is solved on ONE published number,
PCTree's tree tau (11.16 over the matched chain's 9.41, Qwen3-4B GSM8K, block 16), with the
``pctree`` policy's own tree at its default budget replayed statically through every
request. The CURE trace reuses that solved spread at CURE's acceptance levels, so CURE's
published gain (+4.2-7.5 % tau) is a prediction the docs hold the simulator to, not an input.
This lives in ``sim/`` because it joins a trace generator (``traces/``) to a policy
(``policies/``), which import neither each other::

    python -c "from dspark_sim.sim.tree_synth import write_shipped; \\
               write_shipped('traces/data', 'calibration/data/calibration')"
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dspark_sim.calibration.fit import write_trace_with_map
from dspark_sim.policies.base import BatchSnapshot, Verification, readonly
from dspark_sim.policies.registry import get_policy
from dspark_sim.policies.trees import tree_accepted
from dspark_sim.traces.schema import AcceptanceTrace, _served_chain
from dspark_sim.traces.synth_v2 import (
    CURE_CURVES,
    PCTREE_CURVES,
    PCTREE_TREE_TAU,
    RankModel,
    synth_tree,
)

REFERENCE_POLICY = "pctree"  # its default budget is the PCTree reference tree
PCTREE_TRACE = "pctree-qwen3-4b-gsm8k-synthetic"
CURE_TRACE = "cure-qwen3-8b-synthetic"


def static_accept_len(trace: AcceptanceTrace, spec: str) -> np.ndarray:
    """[N] drafts each trace row accepts under a row-local tree policy (``cure``,
    ``pctree``: the tree at a row depends on that row alone), every node verified up to the
    policy's budget."""
    policy = get_policy(spec)
    g = trace.gamma_max
    snap = BatchSnapshot(survival=readonly(np.zeros((trace.num_positions, g))), gamma_max=g,
                         token_budget=1 << 30, fields={"alt_prob": readonly(trace.v2.alt_prob)})
    plan = policy(snap)
    if not isinstance(plan, Verification) or policy.reads.cost:
        raise ValueError(f"{spec}: not a row-local tree policy")
    return tree_accepted(plan.plan, plan.tokens, trace.v2.true_rank)


def served_tau_of(accept_len: np.ndarray, trace: AcceptanceTrace) -> float:
    """Tokens per verify step as served (``AcceptanceTrace.served_tau``) for per-row
    accepted lengths ``accept_len``."""
    tokens, steps = _served_chain(accept_len, trace.req_offsets, int(accept_len.max(initial=0)))
    return float(tokens.sum() / max(int(steps.sum()), 1))


def served_tree_tau(trace: AcceptanceTrace, spec: str) -> float:
    return served_tau_of(static_accept_len(trace, spec), trace)


def pctree_trace(seed: int = 11) -> AcceptanceTrace:
    """PCTree's setting; the rank spread solved so the reference tree serves 11.16."""
    return synth_tree(PCTREE_CURVES, gamma=16, requests_per_domain=48, positions=256,
                      reference=(PCTREE_TREE_TAU,
                                 lambda t: served_tree_tau(t, REFERENCE_POLICY)),
                      drafter="dspark-b16-synthetic",
                      target="qwen3-4b-like, GSM8K (PCTree, published figures)", seed=seed,
                      extra={"calibration": f"{PCTREE_TRACE}-sts",
                             "reference_policy": get_policy(REFERENCE_POLICY).name})


def cure_trace(rank_model: RankModel, seed: int = 12) -> AcceptanceTrace:
    """CURE's setting with the rank spread solved on PCTree's (not on CURE's gain)."""
    return synth_tree(CURE_CURVES, gamma=16, requests_per_domain=24, positions=256,
                      rank_model=rank_model, drafter="parallel-b16-synthetic",
                      target="qwen3-8b-like (CURE, published figures)", seed=seed,
                      extra={"calibration": f"{CURE_TRACE}-sts"})


def write_shipped(trace_dir, calibration_dir) -> list[Path]:
    """Regenerate both traces and fit their STS maps (as ``write_shipped_synthetic``)."""
    trace_dir, calibration_dir = Path(trace_dir), Path(calibration_dir)
    pc = pctree_trace()
    rm = RankModel(**pc.meta.generator["rank_model"])
    written = []
    for name, trace in ((PCTREE_TRACE, pc), (CURE_TRACE, cure_trace(rm))):
        written += write_trace_with_map(trace, trace_dir / f"{name}.parquet", calibration_dir)
    return written
