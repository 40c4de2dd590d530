"""Verification policies, chosen by name: ``none``, ``mtp1``, ``fixed:K``,
``confidence`` (the default: steady-state priced, asynchronous, global search),
``confidence-sync`` (Algorithm 1 as written: early stop, decode tokens only),
``confidence-async`` (§5.2 as vLLM prices it: pending prefill in B), ``threshold:P``.

Each policy says which drafter it runs (its trace and draft cost come from that
drafter), how many tokens that drafter proposes per step, and whether it needs
the SPS curve in its snapshot (computing it costs a table lookup per step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from dspark_sim.errors import InputError
from dspark_sim.policies.base import BatchSnapshot, readonly
from dspark_sim.policies.scheduler import (
    budget_displacement,
    schedule_async,
    schedule_sync,
    schedule_topk,
    sorted_desc,
    stretch_sorted,
)
from dspark_sim.policies.shared_budget import make_shared_budget
from dspark_sim.policies.sparsespec import make_sparsespec
from dspark_sim.policies.trees import TREE_SPECS, tree_policy_kwargs


@dataclass(frozen=True, kw_only=True)
class Policy:
    name: str  # canonical spec, e.g. "fixed:5"
    drafter: str | None  # "dspark" | "mtp1" | None (no speculation)
    decide: Callable[[BatchSnapshot], np.ndarray]
    needs_sps: bool = False  # the snapshot carries the SPS curve (a table lookup per step)
    needs_lag: bool = False  # the snapshot carries the survival/SPS of lag_steps ago
    lag_steps: int = 2  # DSpark's pipeline decides two steps ahead; vLLM's one
    lag_rows: int = 0  # at least this many lagged survival rows (older steps stacked)
    needs_survival: bool = False  # False: the snapshot's survival is zeros (cheaper)
    needs_cost: bool = False  # the snapshot carries the step's cost ingredients (StepCost)
    # the SPS curve's B is the decode tokens alone (Algorithm 1's B = sum(1 + l)), not
    # plus the pending prefill that fits (vLLM's T + B)
    sps_decode_only: bool = False
    draft_gamma: int | None = None  # tokens drafted per request; None = the trace's gamma_max
    description: str = ""
    # Tree and lossy policies (they return a Verification): the replay that judges a plan
    # against the trace's ground truth, the most batch tokens one request may verify (tree
    # nodes; None: the verify length), the drafter-visible trace fields the decision reads
    # (schema v2), whether the replay carries per-request state, and whether the emitted
    # tokens may differ from the target's (drawn on their own axis, never as lossless).
    replay: Callable | None = None
    max_tokens: int | None = None
    fields: tuple[str, ...] = ()
    uses_state: bool = False
    lossy: bool = False
    # The drafter stops at each request's verify length this step (a controller deciding
    # while it drafts, SparseSpec-L): the engine charges the passes it ran, not a block.
    stops_drafting: bool = False

    def __call__(self, snap: BatchSnapshot) -> np.ndarray:
        return self.decide(snap)

    @property
    def history(self) -> int:
        """Snapshots the engine keeps for this policy's lagged view."""
        return self.lag_steps + self.lag_rows if self.needs_lag else 0

    def lagged(self, history) -> tuple:
        """(survival, sps, cost) of ``lag_steps`` steps ago from ``history`` (oldest
        first), or Nones; with ``lag_rows``, the survivals of that step and the ones before
        it until they hold that many rows (a small batch's two-step-old drafts are a noisy
        sample of its next ones). The engine and the validation server both call this."""
        if not self.needs_lag or len(history) < self.lag_steps:
            return None, None, None
        newest = len(history) - self.lag_steps
        survival, sps, cost = history[newest]
        if self.lag_rows > len(survival):
            parts, rows = [survival], len(survival)
            for i in range(newest - 1, -1, -1):
                parts.append(history[i][0])
                rows += len(history[i][0])
                if rows >= self.lag_rows:
                    break
            survival = readonly(np.concatenate(parts))
        return survival, sps, cost


def _const(k: int) -> Callable[[BatchSnapshot], np.ndarray]:
    def decide(s: BatchSnapshot) -> np.ndarray:
        return np.full(s.num_requests, min(k, s.gamma_max), dtype=np.int64)

    return decide


def _confidence_sync(s: BatchSnapshot) -> np.ndarray:
    return schedule_sync(s.survival, s.sps)


# The default scheduler sizes its budget on at least this many draft rows two or more
# steps old: one step of a large batch, the last few dozen steps of a small one (a single
# request's drafts two steps ago say little about its next ones).
CONFIDENCE_LAG_ROWS = 64


def _confidence(s: BatchSnapshot) -> np.ndarray:
    """The budget for this step's costs, sized on the survivals of two steps ago (DSpark's
    production pipeline: the decision never waits for this step's drafts), stretched to
    this batch; tokens by current survival."""
    if s.lagged_survival is None or s.lagged_survival.shape[0] == 0:
        return schedule_topk(s.survival, budget_displacement(s.survival, s.cost))
    n, gamma = s.survival.shape
    estimate = stretch_sorted(sorted_desc(s.lagged_survival), n * gamma)
    return schedule_topk(s.survival, budget_displacement(s.survival, s.cost, n, estimate))


def _vllm_adaptive(s: BatchSnapshot) -> np.ndarray:
    """vLLM's ``enable_adaptive_verification`` (PR 47808): B* = argmax (N + sum of the B
    best survivals) / (draft + verify_cost[T + B]) with T the step's non-draft tokens,
    sized on the confidence array one step old, as it is (not stretched to this batch),
    then the top-B drafts by current survival."""
    if s.lagged_survival is None or s.lagged_survival.shape[0] == 0:
        return schedule_topk(s.survival, budget_displacement(s.survival, s.cost,
                                                             displacement=False))
    lagged = sorted_desc(s.lagged_survival)
    k = budget_displacement(s.survival, s.cost, s.num_requests, lagged, displacement=False)
    return schedule_topk(s.survival, k)


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


# Policies without a parameter: an argument given to one is refused, not dropped
# (``confidence:0.9`` ran plain confidence under a name the user did not ask for).
NO_ARGUMENT = ("none", "mtp1", "confidence", "confidence-sync", "alg1", "confidence-async",
               "confidence_async", "vllm-adaptive", "vllm_adaptive")


def _make(spec: str) -> Policy:
    name, _, arg = spec.strip().partition(":")
    name = name.strip().lower()
    arg = arg.strip() or None
    if arg is not None and name in NO_ARGUMENT:
        raise InputError("--policy", f"{spec!r}: {name} takes no argument")
    if name == "none":
        return Policy(name="none", drafter=None, decide=_const(0), draft_gamma=0,
                      description="no speculation")
    if name == "mtp1":
        return Policy(name="mtp1", drafter="mtp1", decide=_const(1), draft_gamma=1,
                      description="MTP-1: one draft token from the MTP head, always verified")
    if name == "fixed":
        k = _parse_int(spec, arg, None)
        return Policy(name=f"fixed:{k}", drafter="dspark" if k else None, decide=_const(k),
                      draft_gamma=k, description=f"verify a fixed {k} draft tokens per request")
    if name == "confidence":
        return Policy(name="confidence", drafter="dspark", decide=_confidence, needs_cost=True,
                      needs_lag=True, lag_rows=CONFIDENCE_LAG_ROWS, needs_survival=True,
                      description="budget from 2-step-old survivals at this step's costs "
                                  "(global search, prefill displacement priced), top-K")
    if name in ("confidence-sync", "alg1"):
        return Policy(name="confidence-sync", drafter="dspark", decide=_confidence_sync,
                      needs_sps=True, needs_survival=True, sps_decode_only=True,
                      description="Algorithm 1 as written: survival-ranked prefix "
                                  "scheduling, early stop")
    if name in ("confidence-async", "confidence_async"):
        return Policy(name="confidence-async", drafter="dspark", decide=_confidence_async,
                      needs_sps=True, needs_lag=True, needs_survival=True,
                      description="§5.2: budget from 2-step-old survivals, global search, "
                                  "dynamic top-K")
    if name in ("vllm-adaptive", "vllm_adaptive"):
        return Policy(name="vllm-adaptive", drafter="dspark", decide=_vllm_adaptive,
                      needs_cost=True, needs_lag=True, lag_steps=1, needs_survival=True,
                      description="vLLM adaptive verification: 1-step-old confidences, "
                                  "current T + B cost table, global search, top-B")
    if name == "threshold":
        try:
            # + 0.0: -0 is 0, one canonical name (threshold:-0 was a policy of its own)
            p = float(arg) + 0.0 if arg is not None else 0.5
        except ValueError as exc:
            raise InputError("--policy", f"{spec!r}: threshold must be a number") from exc
        if not 0.0 <= p <= 1.0:
            raise InputError("--policy", f"{spec!r}: threshold must lie in [0, 1]")
        return Policy(name=f"threshold:{p:g}", drafter="dspark", decide=_threshold(p),
                      needs_survival=True,
                      description=f"verify draft tokens whose survival >= {p:g}")
    if name in TREE_SPECS:  # cure, pctree, dspark-tree (policies/trees.py)
        return Policy(**tree_policy_kwargs(spec, name, arg))
    if name.partition("@")[0] in ("asd", "skip"):  # lossy (policies/lossy.py): wrap a chain
        from dspark_sim.policies import lossy

        return lossy.make(spec.strip(), get_policy)
    if name in ("dfly", "dcut"):  # batch-shared budgets (policies/shared_budget.py)
        return make_shared_budget(name, spec, arg, Policy)
    if name == "sparsespec":  # long-context self-speculation (policies/sparsespec.py)
        return make_sparsespec(spec, arg, Policy)
    raise InputError("--policy", f"unknown policy {spec!r}; known: {', '.join(POLICY_NAMES)}")


POLICY_NAMES = ("none", "mtp1", "fixed:K", "confidence", "confidence-sync", "confidence-async",
                "vllm-adaptive", "threshold:P", "cure:N,b,F,M", "pctree:N,k",
                "dspark-tree:N,k", "asd:g,m,B", "skip:P", "dfly[:R,...]", "dcut",
                "sparsespec[:T|:conf]")


def get_policy(spec: str) -> Policy:
    """Build a policy from its spec string ``NAME[:ARG]``."""
    if not isinstance(spec, str) or not spec.strip():
        raise InputError("--policy", "empty policy name")
    return _make(spec)

