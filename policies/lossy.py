"""Lossy verification policies: ``asd:g,m,B`` (approximate speculative decoding, arXiv
2608.03447) and ``skip:P`` (verifier skipping, arXiv 2608.14787). See docs/lossy.md.

Both wrap a chain policy (the *base*: ``@BASE``, default ``confidence``) that chooses the verify
length ``l``; they change what a verify step accepts (``asd``) or whether the verifier
runs at all (``skip``). Their emitted tokens may differ from the target's greedy output,
so they are flagged ``lossy``: summaries count the changed tokens and bound the task
score (:mod:`dspark_sim.sim.quality`), and fronts draw them apart from lossless points.

**asd** (greedy only). At a mismatch (the draft ``d_j`` is not the target's argmax) the
draft is accepted anyway when its normalised regret ``rho_j = r_j / q_j <= g``, with
``r_j`` = target top-1 logit minus the target's logit of ``d_j`` (trace columns
``tgt_top1_logit``, ``draft_tgt_logit``) and ``q_j`` the drafter's probability of its own
token (``draft_prob``); at most ``m`` such acceptances per block, and only while the
request's cumulative ``sum rho`` stays ``<= B`` (per-request replay state). ``B = 0`` is
strict decoding: a mismatch never costs less than :data:`MIN_REGRET` (a float16 tie of
the two logits still hides a gap), so nothing is ever accepted at zero cost.

**What the trace cannot know after a lossy acceptance.** The trace records the target
along its *greedy* stream. The first mismatch of a block (depth ``accept_len + 1``) is
judged exactly: its prefix is the greedy prefix. Once a changed token is committed, the
real continuation diverges from the recorded stream; the replay keeps reading the
recorded rows: deeper drafts of the same block are judged by the recorded target row
(a draft "matches" where its recorded regret is 0, i.e. it equals the greedy token at
that position), the bonus token is taken as unchanged, and later steps replay the
greedy stream's rows at the same output position. Direction: the drafts after a changed
token were drafted *from* it, and the recorded target row judges them against the
greedy prefix instead, so in-block matches after a lossy acceptance are undercounted
(tau gain understated); the later rows' acceptance statistics are the greedy stream's
(neutral in expectation); and changed tokens count positional substitutions only, a
lower bound on how much of the text differs from the greedy output (after the first
change the real text may differ everywhere). A request with *no* changed token is
exactly the greedy output; that is what the task-score bounds rest on.

**skip** (any temperature the base supports). When the calibrated prefix survival of
the drafts clears ``P`` for ``k >= 1`` leading drafts, the request commits those ``k``
drafts without calling the verifier: no bonus token, no verify slot, its KV is not read
by the target that step. The target never saw them, so they must still be written to its
KV: the request's next verified step carries them as ``D`` extra input tokens
(``Verification.fill_tokens``: batch tokens, neither drafts nor verified). ``k`` is at
most the base's verify cap (the drafts it drafts), and a request skips again only while
``D + k`` stays within it (at most one block unverified). ``P > 1`` never skips (survival is at most 1): the policy
is then exactly its base. Changed tokens of a skipped commit: the drafts from the first
one the target would have rejected (depth ``accept_len + 1``) on; deeper ones count as
unchanged only where the trace records them equal to the greedy token (``regret == 0``),
else all of them count.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from dspark_sim.errors import InputError
from dspark_sim.policies.base import BatchSnapshot, Replayed, ReplayView, Verification
from dspark_sim.policies.registry import DEFAULT_POLICY, Policy, get_policy, register

# A mismatch's regret is never below this (nats): float16 logits near 20 resolve 1/64, so
# a recorded tie can hide a small gap; treating it as free would make B = 0 lossy.
MIN_REGRET = 1e-3
DEFAULT_BASE = DEFAULT_POLICY
# The defaults of ``asd`` with no argument: the setting synth_lossy calibrates its regret
# model at (ASD's own g, m, B are not in our references: see docs/lossy.md).
ASD_DEFAULTS = (0.5, 1, 8.0)
ASD_TARGET_COLUMNS = ("tgt_top1_logit", "draft_tgt_logit", "draft_prob")


@dataclass(frozen=True)
class AsdConfig:
    g: float  # largest normalised regret r / q accepted at a mismatch
    m: int  # most lossy acceptances per block
    budget: float  # B: most cumulative normalised regret per request (0: strict)


def check_greedy(trace) -> None:
    meta = trace.meta
    if meta.source != "synthetic" and meta.temperature != 0.0:
        raise InputError(trace.source_path, f"asd is defined for greedy decoding only; this "
                                            f"trace was captured at temperature {meta.temperature:g}")


def check_columns(trace, names=ASD_TARGET_COLUMNS) -> None:
    v2 = trace.v2
    missing = [f for f in names if v2 is None or getattr(v2, f) is None]
    if missing:
        raise InputError(trace.source_path, f"asd needs the trace's {', '.join(missing)} "
                                            "(schema v2: the shipped dspark-gsm8k-lossy-synthetic "
                                            "or a `dspark-sim capture` trace has them)")


def regret_at(trace, rows: np.ndarray) -> np.ndarray:
    """[n, gamma] float32 regret ``r`` (target top-1 logit minus the draft token's)."""
    v2 = trace.v2
    top = v2.tgt_top1_logit[rows].astype(np.float32)
    return np.maximum(top - v2.draft_tgt_logit[rows].astype(np.float32), 0.0)


def asd_block(tokens: np.ndarray, accept_len: np.ndarray, regret: np.ndarray,
              draft_prob: np.ndarray, spent: np.ndarray, cfg: AsdConfig
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One verify step of ASD for ``n`` requests, vectorised over requests (a loop over
    the ``<= gamma`` depths only). Returns (accepted, changed, spent after).

    tokens [n] drafts verified; accept_len [n] the target's greedy run; regret / draft_prob
    [n, gamma]; spent [n] cumulative normalised regret so far."""
    n = len(tokens)
    accepted = np.zeros(n, np.int64)
    changed = np.zeros(n, np.int64)
    spent = np.asarray(spent, np.float64).copy()
    alive = tokens > 0
    depth = int(tokens.max()) if n else 0
    for j in range(min(depth, regret.shape[1])):
        on = alive & (j < tokens)
        if not on.any():
            break
        r = regret[:, j].astype(np.float64)
        # exact: the target accepts its greedy run; deeper than the first mismatch (only
        # reached after a lossy acceptance) the recorded row says whether the draft is
        # the greedy token there (the approximation of the module docstring)
        match = (j < accept_len) | ((j > accept_len) & (r == 0.0))
        q = draft_prob[:, j].astype(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            rho = np.where(q > 0, np.maximum(r, MIN_REGRET) / q, np.inf)
        lossy = ~match & (changed < cfg.m) & (rho <= cfg.g) & (spent + rho <= cfg.budget)
        take = on & (match | lossy)
        lossy &= take
        accepted += take
        changed += lossy
        spent[lossy] += rho[lossy]
        alive = take
    return accepted, changed, spent


def _asd_replay(cfg: AsdConfig):
    checked: set[int] = set()

    def replay(plan: Verification, view: ReplayView) -> Replayed:
        trace = view.trace
        if id(trace) not in checked:
            check_greedy(trace)
            check_columns(trace)
            checked.add(id(trace))
        rows = view.rows
        acc, changed, spent = asd_block(plan.tokens, view.accept_len, regret_at(trace, rows),
                                        trace.v2.draft_prob[rows], view.state, cfg)
        return Replayed(acc, changed=changed, state=spent)

    return replay


def _wrap_chain(base, decide_plan):
    def decide(s: BatchSnapshot) -> Verification:
        return decide_plan(s, np.asarray(base.decide(s), dtype=np.int64))

    return decide


def _base_of(arg: str | None) -> tuple[str | None, str]:
    """``ARGS@BASE`` -> (ARGS or None, BASE or the default base)."""
    args, _, base = (arg or "").partition("@")
    return args.strip() or None, base.strip() or DEFAULT_BASE


def make_asd(arg: str | None) -> Policy:
    """``asd[:g,m,B][@BASE]``; B may be ``inf``."""
    g, m, budget = ASD_DEFAULTS
    arg, base_spec = _base_of(arg)
    if arg:
        parts = arg.split(",")
        if len(parts) != 3:
            raise InputError("--policy", f"'asd:{arg}': expected asd:g,m,B[@BASE]")
        try:
            g, m, budget = float(parts[0]) + 0.0, int(parts[1]), float(parts[2]) + 0.0
        except ValueError as exc:
            raise InputError("--policy", f"'asd:{arg}': g and B must be numbers, m an "
                                         "integer") from exc
        if not (g >= 0 and m >= 0 and budget >= 0) or np.isnan(g) or np.isnan(budget):
            raise InputError("--policy", f"'asd:{arg}': g, m and B must be >= 0")
    base = _chain_base(base_spec, "asd")
    cfg = AsdConfig(float(g), int(m), float(budget))
    name = f"asd:{cfg.g:g},{cfg.m},{cfg.budget:g}" + \
        ("" if base.name == DEFAULT_BASE else f"@{base.name}")
    return replace(base, name=name,
                   decide=_wrap_chain(base, lambda s, ell: Verification(ell)),
                   replay=_asd_replay(cfg), lossy=True,
                   reads=replace(base.reads, state=True),
                   description=f"ASD (lossy, greedy): accept a mismatch when regret/q <= "
                               f"{cfg.g:g}, at most {cfg.m} per block, cumulative <= "
                               f"{cfg.budget:g} per request; verify lengths of {base.name}")


def _chain_base(spec: str, who: str) -> Policy:
    # a lossy base is refused before it is built: built first, asd@asd@...@fixed:3
    # recursed once per '@' (a RecursionError traceback past ~300 of them)
    lossy_base = spec.partition("@")[0].partition(":")[0].strip().lower() in ("asd", "skip")
    base = None if lossy_base else get_policy(spec)
    if base is None or base.plans or not base.speculates:
        raise InputError("--policy", f"{who}: base {spec!r} must be a speculative chain "
                                     "policy (e.g. confidence, fixed:7)")
    return base


@dataclass(frozen=True, eq=False)
class SkipPlan:
    skip: np.ndarray  # [n] bool: commit without the verifier
    commit: np.ndarray  # [n] drafts a skipping request commits


def skip_block(survival: np.ndarray, ell: np.ndarray, pending: np.ndarray, p: float,
               cap: int) -> Verification:
    """The decision. ``pending`` [n] = tokens committed without the verifier and not yet
    in the target's KV; ``cap`` = the base's verify cap (drafts beyond it are not drafted).
    A request skips when ``k >= 1`` leading drafts clear ``p`` and ``pending + k <= cap``
    (at most one block unverified); a verifying request writes its pending tokens."""
    pending = np.asarray(pending, np.int64)
    k = np.minimum((survival >= p).sum(axis=1), cap).astype(np.int64)  # survival falls
    skip = (k >= 1) & (pending + k <= cap)
    return Verification(np.where(skip, 0, ell), plan=SkipPlan(skip, np.where(skip, k, 0)),
                        fill_tokens=np.where(skip, 0, pending))


def skip_replay(plan: Verification, view: ReplayView) -> Replayed:
    sp: SkipPlan = plan.plan
    m = view.accept_len.astype(np.int64)
    accepted = np.where(sp.skip, sp.commit, np.minimum(plan.tokens, m))
    past = np.maximum(sp.commit - m, 0)  # committed drafts from the first rejected one on
    v2 = view.trace.v2
    if past.any() and v2 is not None and v2.tgt_top1_logit is not None \
            and v2.draft_tgt_logit is not None:
        r = regret_at(view.trace, view.rows)
        j = np.arange(r.shape[1])[None, :]
        beyond = (j > m[:, None]) & (j < sp.commit[:, None])  # deeper than the first miss
        past = past - (beyond & (r == 0.0)).sum(axis=1)
    state = np.where(sp.skip, view.state + sp.commit, 0)
    return Replayed(accepted, changed=np.where(sp.skip, past, 0), bonus=~sp.skip,
                    state=state)


def make_skip(arg: str | None) -> Policy:
    """``skip[:P][@BASE]``."""
    p_text, base_spec = _base_of(arg)
    try:
        p = float(p_text) + 0.0 if p_text else 0.9
    except ValueError as exc:
        raise InputError("--policy", f"'skip:{arg}': P must be a number") from exc
    if not p >= 0 or np.isnan(p):
        raise InputError("--policy", f"'skip:{arg}': P must be >= 0")
    base = _chain_base(base_spec, "skip")

    def plan(s: BatchSnapshot, ell: np.ndarray) -> Verification:
        pending = s.state if s.state is not None else np.zeros(s.num_requests)
        cap = s.gamma_max if base.draft_gamma is None else min(base.draft_gamma, s.gamma_max)
        return skip_block(s.survival, ell, pending, p, cap)

    name = f"skip:{p:g}" + ("" if base.name == DEFAULT_BASE else f"@{base.name}")
    return replace(base, name=name, decide=_wrap_chain(base, plan), replay=skip_replay,
                   lossy=True, reads=replace(base.reads, survival=True, state=True),
                   description=f"verifier skipping (lossy): commit the drafts whose survival "
                               f">= {p:g} without the verifier; verify lengths of {base.name}")


def _wrapper_arg(spec: str) -> str | None:
    """``NAME[:ARGS][@BASE]`` -> ``ARGS@BASE`` (the base after the first ``@``)."""
    head, at, base = spec.partition("@")
    arg = head.partition(":")[2].strip() + (f"@{base}" if at else "")
    return arg or None


@register("asd", grammar="[:g,m,B][@BASE]", example="asd",
          summary="**lossy**, greedy only (ASD): accept a mismatched draft when its regret "
                  "r/q ≤ g, at most m per block, while the request's cumulative regret ≤ B "
                  "(B = 0: strict); wraps the chain policy BASE "
                  f"(default `{DEFAULT_BASE}`) ([lossy](lossy.md))")
def asd(spec: str, arg: str | None) -> Policy:
    return make_asd(_wrapper_arg(spec))


@register("skip", grammar="[:P][@BASE]", example="skip:0.9",
          summary="**lossy** (verifier skipping): commit drafts whose survival ≥ P without "
                  "calling the verifier; P > 1 never skips; wraps the chain policy BASE "
                  f"(default `{DEFAULT_BASE}`) ([lossy](lossy.md))")
def skip(spec: str, arg: str | None) -> Policy:
    return make_skip(_wrapper_arg(spec))
