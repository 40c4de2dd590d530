"""The SparseSpec-L draft-length controller (arXiv 2607.27735): long-context
self-speculation, the target drafting over a sparse, recallable KV.

With ``p_i`` the predicted acceptance of draft depth ``i``, ``C_d`` what one draft pass
costs and ``C_v`` what verification costs, the controller drafts and verifies

    k* = argmax_k (1 + sum_{m<=k} prod_{i<=m} p_i) / (k * C_d + C_v)

tokens: expected tokens per step (the bonus plus the expected accepted run) over the
step's time. Choices named here (the paper's text is not in this repository):

* **One k per batch.** The formula is per sequence; in a batched server every request's
  draft pass runs in the same batched forward, so the step pays for the deepest request's
  passes (a pass costs about the same for 1 or 64 requests: the weights are read once).
  Per-request ``k*`` in a batch of 64 made the batch run ~gamma passes every step. The
  controller here maximises the *batch's* expected tokens over the step:
  ``k* = argmax_k (n + sum_r sum_{m<=k} prod_{i<=m} p_{r,i}) / (k C_d + C_v(k))``, which
  is the paper's formula for a batch of one.
* ``p_i``: ``sparsespec[:T]`` reads the drafter's per-depth entropy ``H_i`` (schema v2
  ``draft_entropy``, visible online) as ``p_i = exp(-H_i / T)`` (default ``T = 1``: one
  over the distribution's perplexity, a lower bound on its top-1 probability, so the
  controller errs towards shorter drafts; a larger ``T`` trusts the drafter more).
  ``sparsespec:conf`` uses the calibrated confidence survival instead (the snapshot's
  ``survival``: ``prod p_i`` directly).
* ``C_d``: one draft pass over the batch at its contexts
  (:attr:`StepCost.draft_pass_s`): the drafter's table at ``n`` requests plus each
  request's sparse-KV reads (``min(context, kv_budget)`` tokens, the profile's
  ``[draft.selfspec]``), so it grows with context up to the KV budget.
* ``C_v(k)``: the verify step with ``n * k`` drafts admitted (the scheduler's
  :class:`StepCost`, the once-per-step draft terms included): constant in ``k`` where
  attention / KV reads dominate (the KV-bound regime, the paper's setting) and rising
  where verify tokens cost compute, which a constant ``C_v`` would not see. ``k`` whose
  verify tokens do not fit the token budget are never chosen.
* The drafter stops at ``k*`` (``Policy.stops_drafting``): the engine charges ``k*``
  passes, and none when ``k* = 0``. The formula takes ``p_1..p_k`` as known when it
  chooses; an online controller that must draft a depth to see its entropy would pay up
  to one more pass (not charged: the formula's own assumption).

Cost: ``O(n * gamma)`` per step (cumulative products, a column sum, one argmax).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dspark_sim.errors import InputError
from dspark_sim.policies.base import BatchSnapshot, StepCost
from dspark_sim.policies.registry import Policy, Reads, register


def controller_k(survival: np.ndarray, c_d: float, c_v) -> int:
    """``k*`` for the batch: argmax over ``k = 0..gamma`` (first maximum) of
    ``(n + sum_r sum_{m<=k} survival[r, m]) / (k * c_d + c_v[k])``; ``survival``
    [n, gamma] is ``prod_{i<=m} p_i``, ``c_v`` a scalar or one entry per ``k`` (``inf``:
    not allowed)."""
    survival = np.asarray(survival, dtype=np.float64)
    n, gamma = survival.shape
    gain = np.empty(gamma + 1)
    gain[0] = n
    np.cumsum(survival.sum(axis=0), out=gain[1:])
    gain[1:] += n
    k = np.arange(gamma + 1, dtype=np.float64)
    cost = k * float(c_d) + np.broadcast_to(np.asarray(c_v, dtype=np.float64), (gamma + 1,))
    return int(np.argmax(gain / cost))  # inf cost: rate 0, never above k = 0's


def verify_cost_by_k(cost: StepCost, n: int, gamma: int) -> np.ndarray:
    """``C_v(k)``, k = 0..gamma: the step with ``n * k`` drafts admitted plus the
    once-per-step draft terms; ``inf`` where ``n + n * k`` exceeds the token budget."""
    size = min(n * gamma + 1, cost.budget - n + 1, cost.extra_s.size)
    out = np.full(gamma + 1, np.inf)
    if size <= 0:
        return out
    idx = n * np.arange(gamma + 1)
    ok = idx < size
    out[ok] = cost.step_s(n, size)[idx[ok]] + cost.draft_fixed_s
    return out


def entropy_survival(entropy: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """``prod_{i<=m} exp(-H_i / T)`` = ``exp(-cumsum H / T)``."""
    h = np.maximum(np.asarray(entropy, dtype=np.float64), 0.0)
    return np.exp(-np.cumsum(h, axis=1) / temperature)


def _decide(temperature: float | None) -> Callable[[BatchSnapshot], np.ndarray]:
    use_entropy = temperature is not None

    def decide(s: BatchSnapshot) -> np.ndarray:
        n, gamma = s.survival.shape
        if n == 0 or gamma == 0:
            return np.zeros(n, dtype=np.int64)
        if use_entropy:
            surv = entropy_survival(s.fields["draft_entropy"][:, :gamma], temperature)
        else:
            surv = s.survival
        k = controller_k(surv, s.cost.draft_pass_s, verify_cost_by_k(s.cost, n, gamma))
        return np.full(n, k, dtype=np.int64)

    return decide


@register("sparsespec", grammar="[:T|:conf]", example="sparsespec",
          summary="SparseSpec-L's controller for long-context self-speculation: one draft "
                  "length for the batch, k* = argmax (1 + Σ∏p)/(k·C_d + C_v), p from the "
                  "drafter's entropy (`exp(−H/T)`) or confidence; the target drafts over a "
                  "sparse KV (`[draft.selfspec]`, profiles `selfspec-*`, trace "
                  "`selfspec-synthetic`)")
def sparsespec(spec: str, arg: str | None) -> Policy:
    if arg is not None and arg.lower() == "conf":
        temperature, name, signal = None, "sparsespec:conf", "calibrated confidence"
    else:
        try:
            temperature = 1.0 if arg is None else float(arg)
        except ValueError:
            temperature = float("nan")
        if not (0.01 <= temperature <= 100.0):
            raise InputError("--policy", f"{spec!r}: sparsespec takes an entropy temperature "
                                         "T in [0.01, 100] or 'conf'")
        name = "sparsespec" if arg is None else f"sparsespec:{temperature:g}"
        signal = f"entropy, p = exp(-H / {temperature:g})"
    return Policy(
        name=name, drafter="selfspec", decide=_decide(temperature), stops_drafting=True,
        reads=Reads(survival=True, cost=True,
                    fields=("draft_entropy",) if temperature is not None else ()),
        description="SparseSpec-L controller: k* = argmax (n + sum prod p) / (k C_d + C_v) "
                    f"for the batch, p from the drafter's {signal}; self-speculation over a "
                    "sparse KV")
