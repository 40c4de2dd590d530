"""Tree verification policies on schema-v2 traces: ``cure``, ``pctree``, ``dspark-tree``.

A tree is held *depth-slotted*: at each draft depth ``j`` a request has ``S`` node slots;
a node is (its parent's slot at depth ``j - 1``, the tf rank of its token among the
drafter's alternatives there). The true path is the chain of ranks ``true_rank[:, j]``:
a node is accepted iff its parent is and its rank is the target's. So a tree accepts the
number of leading depths whose true node it holds, exactly (schema v2 docstring). Decisions
read only drafter-visible fields (``alt_prob``, the calibrated chain survival); the replay
alone reads ``true_rank``.

Approximation, stated once: the trace records the drafter's distribution at depth ``j``
teacher-forced on the *true* prefix only. A node hanging off any other parent is scored
with that same distribution (the one the tree would see on the path that can still be
accepted); its own children can never be accepted, so the approximation only moves which
dead nodes a budget spends, never what an accepted path yields.

* ``pctree:N,k`` (parent-conditioned branching, PCTree): every kept parent proposes its
  ``K`` alternatives (the Markov head run once per concrete parent); a per-depth frontier
  keeps the ``k`` best nodes by joint drafter probability; the ``N`` best nodes over all
  depths are verified (ancestor-closed: a child's joint probability never exceeds its
  parent's, and ties keep the shallower node first). Drafter cost: one Markov-head token
  per verified parent off the chain spine (the block pass covers the spine).
* ``cure:N,b,F,M`` (budget-aware repair trees, CURE): a block-parallel draft (the chain)
  opens ``b`` repair branches (ranks 1..b) at each position whose confidence margin
  ``p_top1 - p_top2`` is below ``M``, on every live path there; a branch continues with the
  parallel draft's own (parent-independent) tokens; at most ``F`` live paths per depth (the
  active frontier) by joint probability; the ``N`` best nodes verified, one tree
  verification. Drafter cost: one token per verified repair node (the drafter's state is
  resynchronised on the repaired token; continuations reuse the block's tokens).
* ``dspark-tree:N,k`` (Algorithm 1 over trees): each request's candidate tree is the
  ``pctree`` frontier (width ``k``), each node scored by its *path survival*: the calibrated
  chain confidence ``c_j`` for a rank-0 child, ``(1 - c_j) p_r / (1 - p_0)`` for rank ``r``
  (the rejected mass split as the drafter splits it). A tree's expected accepted length is
  the sum of its nodes' path survivals (exactly one path is true), so Algorithm 1's batch
  budget applies unchanged to nodes: K = argmax (n + sum of the K best survivals) / C_K
  over the whole batch, ``C`` the step priced by the engine as ``confidence`` prices it
  (``scheduler.budget_displacement``'s step: table at the tokens carried, extra terms,
  displaced prefill). Each request verifies its nodes among the batch's K best (at most
  ``N``). The budget is sized on this step's survivals (tree verification under greedy
  decoding is lossless whatever chooses the tree). Markov-head cost as ``pctree``.

Every verified node is a batch token (``Verification.tokens``); branch drafting is
``Verification.draft_tokens``, priced by the engine at the draft table's per-token slope.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dspark_sim.errors import InputError
from dspark_sim.policies.base import BatchSnapshot, Replayed, Verification
from dspark_sim.policies.registry import Policy, Reads, register

UNUSED = -2  # parent of an unused slot (never matches a live path)
NEVER = np.iinfo(np.int64).max  # order of an unused slot (never verified)


@dataclass(frozen=True, eq=False)
class TreePlan:
    """A batch of depth-slotted trees (arrays [n, depth, S]).

    parent: slot of the parent at depth j - 1 (-1: the root), ``UNUSED`` for empty slots.
    rank:   tf rank of the node's token among its parent's alternatives.
    order:  the node's place in its request's verification order (ancestors first);
            the request verifies its nodes with ``order < tokens``; ``NEVER`` if unused.
    """

    parent: np.ndarray
    rank: np.ndarray
    order: np.ndarray


def tree_accepted(plan: TreePlan, tokens: np.ndarray, true_rank: np.ndarray) -> np.ndarray:
    """[n] drafts each tree accepts: the leading depths whose true node is verified
    (``true_rank`` [n, >= depth]; -1 past EOS never matches)."""
    n, g, s = plan.rank.shape
    verified = plan.order < np.asarray(tokens, np.int64)[:, None, None]
    cur = np.full(n, -1, np.int64)  # slot of the accepted node at the previous depth
    acc = np.zeros(n, np.int64)
    truth = true_rank[:, :g].astype(np.int64)
    for j in range(g):
        hit = verified[:, j] & (plan.parent[:, j] == cur[:, None]) \
            & (plan.rank[:, j] == truth[:, j, None])
        found = hit.any(axis=1)
        if not found.any():
            break
        acc += found
        cur = np.where(found, hit.argmax(axis=1), UNUSED - 1)
    return acc


def _frontier(score: np.ndarray, allowed: np.ndarray, width: int):
    """Grow per-depth frontiers: every kept node at depth j - 1 proposes the children
    ``allowed`` at depth j; the ``width`` best by path score are kept.

    score:   [n, g, K] per-child factor (the path score multiplies along the path).
    allowed: [n, g, K] bool, which ranks a parent may propose at depth j.
    Returns (parent, rank, path_score, spine) each [n, g, width]; empty slots have
    score -1 and parent ``UNUSED``; ``spine`` marks the all-rank-0 path (the chain)."""
    n, g, k = score.shape
    parent = np.full((n, g, width), UNUSED, np.int64)
    rank = np.zeros((n, g, width), np.int64)
    path = np.full((n, g, width), -1.0)
    spine = np.zeros((n, g, width), bool)
    rows = np.arange(n)[:, None]
    prev_path = np.ones((n, 1))  # the root
    prev_spine = np.ones((n, 1), bool)
    for j in range(g):
        s_prev = prev_path.shape[1]
        cand = prev_path[:, :, None] * score[:, j, None, :]  # [n, s_prev, K]
        ok = (prev_path[:, :, None] > 0) & allowed[:, j, None, :]
        cand = np.where(ok, cand, -1.0).reshape(n, s_prev * k)
        keep = min(width, s_prev * k)
        # best first; stable so equal scores keep (parent slot, rank) order
        idx = np.argsort(-cand, axis=1, kind="stable")[:, :keep]
        val = np.take_along_axis(cand, idx, axis=1)
        live = val > 0  # a zero-probability node is never worth a batch token
        par, rk = idx // k, idx % k
        parent[:, j, :keep] = np.where(live, par if j else -1, UNUSED)  # -1: the root
        rank[:, j, :keep] = rk
        path[:, j, :keep] = np.where(live, val, -1.0)
        spine[:, j, :keep] = live & (rk == 0) & prev_spine[rows, par]
        prev_path, prev_spine = path[:, j, :keep], spine[:, j, :keep]
    return parent, rank, path, spine


def _order(path: np.ndarray) -> np.ndarray:
    """Each request's nodes ranked by path score, descending (ties: shallower first, so a
    parent always precedes its children); unused slots ``NEVER``."""
    n, g, s = path.shape
    flat = path.reshape(n, g * s)
    idx = np.argsort(-flat, axis=1, kind="stable")
    order = np.empty_like(idx)
    np.put_along_axis(order, idx, np.broadcast_to(np.arange(g * s), (n, g * s)), axis=1)
    return np.where(flat >= 0, order, NEVER).reshape(n, g, s)


def _parents_used(parent: np.ndarray, verified: np.ndarray) -> np.ndarray:
    """[n, g, S] bool: the node has at least one verified child."""
    n, g, s = parent.shape
    used = np.zeros((n, g, s), bool)
    slots = np.arange(s)
    for j in range(g - 1):
        used[:, j] = ((parent[:, j + 1, :, None] == slots) & verified[:, j + 1, :, None]).any(1)
    return used


def _alt(snap: BatchSnapshot) -> np.ndarray:
    g = snap.survival.shape[1]
    return np.asarray(snap.fields["alt_prob"][:, :g], dtype=np.float64)


def _plan(parent, rank, path, spine, tokens, draft_tokens) -> Verification:
    return Verification(tokens=tokens, draft_tokens=draft_tokens,
                        plan=TreePlan(parent, rank, _order(path)))


def _markov_cost(plan_parent, order, spine, tokens) -> np.ndarray:
    """One Markov-head token per verified parent off the chain spine."""
    verified = order < tokens[:, None, None]
    return (_parents_used(plan_parent, verified) & ~spine).sum(axis=(1, 2))


# -- the three policies ----------------------------------------------------------------

# _frontier_width: a frontier wider than the request's node budget N changes nothing, so
# the policies keep min(width, N) slots per depth. A node outside its depth's top N has N
# nodes of that depth at least as good ahead of it in _order (same depth: frontier order
# breaks ties), so its order is >= N and it is never verified; its descendants score no
# more and come after it. The verified nodes, their order and the tokens are the same;
# the arrays [n, gamma, width] are not: pctree:64,100000 took minutes per step and
# dspark-tree:1,99999999 exhausted memory.


def pctree_decide(budget: int, width: int):
    width = min(width, budget)  # exact: see _frontier_width

    def decide(s: BatchSnapshot) -> Verification:
        p = _alt(s)
        allowed = np.ones(p.shape, bool)
        parent, rank, path, spine = _frontier(p, allowed, width)
        order = _order(path)
        tokens = np.minimum((path >= 0).sum(axis=(1, 2)), budget)
        return Verification(tokens=tokens, plan=TreePlan(parent, rank, order),
                            draft_tokens=_markov_cost(parent, order, spine, tokens))

    return decide


def cure_decide(budget: int, branches: int, frontier: int, margin: float):
    frontier = min(frontier, budget)  # exact: see _frontier_width

    def decide(s: BatchSnapshot) -> Verification:
        p = _alt(s)
        n, g, k = p.shape
        low = (p[:, :, 0] - p[:, :, 1]) < margin  # repair points
        ranks = np.arange(k)
        allowed = (ranks == 0) | (low[:, :, None] & (ranks >= 1) & (ranks <= branches))
        parent, rank, path, _ = _frontier(p, allowed, frontier)
        order = _order(path)
        tokens = np.minimum((path >= 0).sum(axis=(1, 2)), budget)
        repairs = ((order < tokens[:, None, None]) & (rank > 0)).sum(axis=(1, 2))
        return Verification(tokens=tokens, plan=TreePlan(parent, rank, order),
                            draft_tokens=repairs)

    return decide


def node_survival_factors(survival: np.ndarray, alt_prob: np.ndarray) -> np.ndarray:
    """[n, g, K] P(child of rank r accepted | parent accepted): the calibrated chain
    confidence ``c_j`` for rank 0, the rejected mass ``1 - c_j`` split over ranks >= 1 as
    the drafter splits its own (``p_r / (1 - p_0)``)."""
    n, g = survival.shape
    prev = np.concatenate([np.ones((n, 1)), survival[:, :-1]], axis=1)
    c = np.divide(survival, prev, out=np.zeros_like(survival), where=prev > 0)
    c = np.clip(c, 0.0, 1.0)
    rest = np.maximum(1.0 - alt_prob[:, :, :1], 1e-6)
    f = (1.0 - c)[:, :, None] * alt_prob / rest
    f[:, :, 0] = c
    return np.clip(f, 0.0, 1.0)


def _tree_step_s(cost, n: int, size: int) -> np.ndarray:
    """``StepCost.step_s`` for up to ``size - 1`` nodes, which may exceed the chain's
    ``n * gamma`` drafts the engine's ``extra_s`` covers: past its end the extra terms grow
    at their mean per-token slope (LM head and attention rows are linear in verify tokens)."""
    extra = np.asarray(cost.extra_s, np.float64)
    if size > extra.size:
        slope = (extra[-1] - extra[0]) / max(extra.size - 1, 1)
        tail = extra[-1] + slope * np.arange(1, size - extra.size + 1)
        extra = np.concatenate([extra, tail])
    verify = n + np.arange(size)
    table = cost.table_s
    if not cost.pending_prefill:
        return table[verify] + extra[:size]
    room = np.maximum(cost.budget - verify, 0)
    carried = np.minimum(cost.pending_prefill, room)
    return table[verify + carried] + extra[:size] \
        + cost.prefill_s_per_token * (cost.pending_prefill - carried)


def dspark_tree_decide(cap: int, width: int):
    width = min(width, cap)  # exact: see _frontier_width

    def decide(s: BatchSnapshot) -> Verification:
        p = _alt(s)
        n, g, k = p.shape
        f = node_survival_factors(np.asarray(s.survival, np.float64), p)
        parent, rank, path, spine = _frontier(f, np.ones(p.shape, bool), width)
        order = _order(path)
        # a request's nodes past its cap never compete for the batch budget
        score = np.where(order < cap, path, -1.0).reshape(-1)
        # the batch's nodes best first: the same stable, row-major order as _order's
        ranked = np.argsort(-score, kind="stable")[: int(np.count_nonzero(score > 0))]
        size = min(ranked.size + 1, s.cost.budget - n + 1)
        if size <= 1:
            tokens = np.zeros(n, np.int64)
        else:
            ranked = ranked[: size - 1]
            tau = n + np.concatenate([[0.0], np.cumsum(score[ranked])])
            step_s = _tree_step_s(s.cost, n, size)
            if s.cost.draft_token_s:
                step_s = step_s + s.cost.draft_token_s * _markov_tokens(ranked, parent, spine)
            best = int(np.argmax(tau / step_s))
            tokens = np.bincount(ranked[:best] // (g * width), minlength=n).astype(np.int64)
        return Verification(tokens=tokens, plan=TreePlan(parent, rank, order),
                            draft_tokens=_markov_cost(parent, order, spine, tokens))

    return decide


def _markov_tokens(ranked: np.ndarray, parent: np.ndarray, spine: np.ndarray) -> np.ndarray:
    """[len(ranked) + 1] Markov-head tokens the first ``i`` nodes of ``ranked`` (flat
    indices into [n, g, S]) need: one per distinct parent off the chain spine."""
    n, g, w = parent.shape
    j = (ranked // w) % g
    par = parent.reshape(-1)[ranked]
    pid = np.where(j > 0, ranked - (ranked % w) - w + par, -1)  # the parent's flat index
    off = (j > 0) & ~spine.reshape(-1)[np.maximum(pid, 0)]
    first = np.zeros(ranked.size, bool)
    _, at = np.unique(np.where(off, pid, -1), return_index=True)
    first[at] = True
    new = off & first
    return np.concatenate([[0], np.cumsum(new)])


def tree_replay(plan: Verification, view) -> Replayed:
    """Judge a :class:`TreePlan` against the trace's true ranks at the decoding rows."""
    v2 = view.trace.v2
    true_rank = v2.true_rank[view.rows]
    return Replayed(tree_accepted(plan.plan, plan.tokens, true_rank))


# -- specs ---------------------------------------------------------------------------

# name -> (argument names, defaults, types)
TREE_SPECS: dict[str, tuple[tuple[str, ...], tuple, tuple]] = {
    "cure": (("N", "b", "F", "M"), (32, 2, 4, 0.5), (int, int, int, float)),
    "pctree": (("N", "k"), (64, 4), (int, int)),
    "dspark-tree": (("N", "k"), (64, 4), (int, int)),
}
# Most nodes one request's tree may verify (N): each is a batch token and a KV slot held
# for the whole request, so a huge N would refuse every request at arrival as over the
# KV capacity (or allocate N-sized statistics: cure:10**14 runs out of memory). The
# published trees verify 32-64 nodes.
MAX_TREE_NODES = 1024


def parse_tree_spec(spec: str, name: str, arg: str | None) -> tuple:
    names, defaults, types = TREE_SPECS[name]
    parts = [] if arg is None else [a.strip() for a in arg.split(",")]
    if len(parts) > len(names):
        raise InputError("--policy", f"{spec!r}: at most {len(names)} arguments "
                                     f"({','.join(names)})")
    vals = list(defaults)
    for i, a in enumerate(parts):
        if not a:
            continue
        try:
            vals[i] = types[i](a) + 0  # + 0: -0 reads (and is named) 0
        except ValueError as exc:
            raise InputError("--policy", f"{spec!r}: {names[i]} must be "
                                         f"{'an integer' if types[i] is int else 'a number'}"
                             ) from exc
    for nm, v, t in zip(names, vals, types, strict=True):
        if t is int and v < 1:
            raise InputError("--policy", f"{spec!r}: {nm} must be >= 1")
        if nm == "N" and v > MAX_TREE_NODES:
            raise InputError("--policy", f"{spec!r}: N (nodes per request) must be at most "
                                         f"{MAX_TREE_NODES:,}")
        if t is float and not 0.0 <= v <= 1.0:
            raise InputError("--policy", f"{spec!r}: {nm} must lie in [0, 1]")
    return tuple(vals)


def _tree_policy(name: str, vals: tuple, decide, description: str, *,
                 cost: bool = False) -> Policy:
    """A tree policy named canonically by its parsed arguments ``vals`` (``N`` first);
    ``cost``: its decision reads the step's costs."""
    canon = f"{name}:{','.join(f'{v:g}' if isinstance(v, float) else str(v) for v in vals)}"
    # the snapshot carries fields only with survival
    return Policy(name=canon, drafter="dspark", replay=tree_replay, decide=decide,
                  reads=Reads(survival=True, cost=cost, fields=("alt_prob",)),
                  max_tokens=vals[0], description=description)


@register("pctree", grammar="[:N,k]", example="pctree:64,4",
          summary="PCTree parent-conditioned branching: per-depth top-`k` frontier by joint "
                  "probability, global top-`N` nodes (schema-v2 traces; [trees](trees.md))")
def pctree(spec: str, arg: str | None) -> Policy:
    n_max, width = vals = parse_tree_spec(spec, "pctree", arg)
    return _tree_policy("pctree", vals, pctree_decide(n_max, width),
                        f"PCTree: per-depth top-{width} frontier by joint probability, global "
                        f"top-{n_max} nodes, Markov head per parent")


@register("cure", grammar="[:N,b,F,M]", example="cure:32,2,4,0.5",
          summary="CURE repair trees: `b` runner-up branches where the draft's confidence "
                  "margin < `M`, frontier `F`, `N` nodes, one tree verification (schema-v2 "
                  "traces; [trees](trees.md))")
def cure(spec: str, arg: str | None) -> Policy:
    n_max, b, fr, m = vals = parse_tree_spec(spec, "cure", arg)
    return _tree_policy("cure", vals, cure_decide(n_max, b, fr, m),
                        f"CURE: {b} repair branches where the margin < {m:g}, frontier {fr}, "
                        f"{n_max} nodes, one tree verification")


@register("dspark-tree", grammar="[:N,k]", example="dspark-tree:64,4",
          summary="Algorithm 1 over trees: one batch node budget ranked by path survival at "
                  "this step's costs, ≤ `N` nodes per request (schema-v2 traces; "
                  "[trees](trees.md))")
def dspark_tree(spec: str, arg: str | None) -> Policy:
    n_max, width = vals = parse_tree_spec(spec, "dspark-tree", arg)
    return _tree_policy("dspark-tree", vals, dspark_tree_decide(n_max, width),
                        f"Algorithm 1 over trees: batch node budget by path survival at this "
                        f"step's costs, frontier {width}, <= {n_max} nodes each",
                        cost=True)
