"""Verification policies, chosen by name: ``none``, ``mtp1``, ``fixed:K``,
``confidence``, ``confidence-async``, ``threshold:P``.

Each policy says which drafter it runs (its trace and draft cost come from that
drafter), how many tokens that drafter proposes per step, and whether it needs
the SPS curve in its snapshot (computing it costs a table lookup per step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from dspark_sim.errors import InputError
from dspark_sim.policies.base import BatchSnapshot
from dspark_sim.policies.scheduler import schedule_async, schedule_sync, schedule_topk


@dataclass(frozen=True)
class Policy:
    name: str  # canonical spec, e.g. "fixed:5"
    drafter: str | None  # "dspark" | "mtp1" | None (no speculation)
    needs_sps: bool
    needs_lag: bool
    decide: Callable[[BatchSnapshot], np.ndarray]
    draft_gamma: int | None = None  # tokens drafted per request; None = the trace's gamma_max
    description: str = ""
    needs_survival: bool = False  # False: the snapshot's survival is zeros (cheaper)

    def __call__(self, snap: BatchSnapshot) -> np.ndarray:
        return self.decide(snap)


def _const(k: int) -> Callable[[BatchSnapshot], np.ndarray]:
    def decide(s: BatchSnapshot) -> np.ndarray:
        return np.full(s.num_requests, min(k, s.gamma_max), dtype=np.int64)

    return decide


def _confidence(s: BatchSnapshot) -> np.ndarray:
    return schedule_sync(s.survival, s.sps)


def _confidence_async(s: BatchSnapshot) -> np.ndarray:
    if s.lagged_survival is None or s.lagged_sps is None or s.lagged_survival.shape[0] == 0:
        # Warm-up (no history yet): size the budget from the current step instead.
        return schedule_async(s.survival, s.survival, s.sps)
    return schedule_async(s.survival, s.lagged_survival, s.lagged_sps)


def _threshold(p: float) -> Callable[[BatchSnapshot], np.ndarray]:
    def decide(s: BatchSnapshot) -> np.ndarray:
        # survival is non-increasing along the block, so the count is a prefix length
        return (s.survival >= p).sum(axis=1).astype(np.int64)

    return decide


def _parse_int(spec: str, arg: str | None, default: int | None) -> int:
    if arg is None:
        if default is None:
            raise InputError("--policy", f"{spec!r} needs an argument, e.g. fixed:5")
        return default
    try:
        k = int(arg)
    except ValueError as exc:
        raise InputError("--policy", f"{spec!r}: argument must be an integer") from exc
    if k < 0:
        raise InputError("--policy", f"{spec!r}: argument must be >= 0")
    return k


def _make(spec: str) -> Policy:
    name, _, arg = spec.strip().partition(":")
    name = name.strip().lower()
    arg = arg.strip() or None
    if name == "none":
        return Policy("none", None, False, False, _const(0), 0, "no speculation")
    if name == "mtp1":
        return Policy("mtp1", "mtp1", False, False, _const(1), 1,
                      "MTP-1: one draft token from the MTP head, always verified")
    if name == "fixed":
        k = _parse_int(spec, arg, None)
        return Policy(f"fixed:{k}", "dspark" if k else None, False, False, _const(k), k,
                      f"verify a fixed {k} draft tokens per request")
    if name == "confidence":
        return Policy("confidence", "dspark", True, False, _confidence, None,
                      "Algorithm 1: survival-ranked prefix scheduling, early stop", True)
    if name in ("confidence-async", "confidence_async"):
        return Policy("confidence-async", "dspark", True, True, _confidence_async, None,
                      "§5.2: budget from 2-step-old survivals, global search, dynamic top-K",
                      True)
    if name == "threshold":
        try:
            p = float(arg) if arg is not None else 0.5
        except ValueError as exc:
            raise InputError("--policy", f"{spec!r}: threshold must be a number") from exc
        if not 0.0 <= p <= 1.0:
            raise InputError("--policy", f"{spec!r}: threshold must lie in [0, 1]")
        return Policy(f"threshold:{p:g}", "dspark", False, False, _threshold(p), None,
                      f"verify draft tokens whose survival >= {p:g}", True)
    raise InputError("--policy", f"unknown policy {spec!r}; known: {', '.join(POLICY_NAMES)}")


POLICY_NAMES = ("none", "mtp1", "fixed:K", "confidence", "confidence-async", "threshold:P")


def get_policy(spec: str) -> Policy:
    """Build a policy from its spec string ``NAME[:ARG]``."""
    if not isinstance(spec, str) or not spec.strip():
        raise InputError("--policy", "empty policy name")
    return _make(spec)


def topk_policy(k: int) -> Policy:
    """Verify the k most likely tokens of the whole batch (used by tests and sweeps)."""
    return Policy(f"topk:{k}", "dspark", False, False, lambda s: schedule_topk(s.survival, k),
                  None, f"verify the {k} most likely draft tokens of the batch", True)
