"""Verification policies, chosen by name: the :class:`Policy` protocol and the registry.

A policy is one module of this package that registers itself::

    @register("threshold", grammar="[:P]", example="threshold:0.5",
              summary="verify draft tokens whose survival >= P (default 0.5)")
    def threshold(spec: str, arg: str | None) -> Policy: ...

The registry finds every module of ``dspark_sim.policies`` on the first lookup, so a new
file is all a new policy takes: ``get_policy``, the ``--policy`` help, ``dspark-sim
policies`` and the table in docs/policies.md are read from what registered. What a
policy reads (survival, the SPS curve, the step's costs, lagged views, schema-v2 fields)
is declared on the :class:`Policy` it builds (its :class:`Reads`); the listing shows it
from the example spec.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from dspark_sim.errors import InputError
from dspark_sim.policies.base import BatchSnapshot, StepCost, readonly

# What `dspark-sim run` runs when no policy is named; the sweep headline's candidate and
# the base a lossy policy wraps unless told otherwise are this one too.
DEFAULT_POLICY = "confidence"


@dataclass(frozen=True, kw_only=True)
class Reads:
    """What a policy's decision reads of the step; the snapshot carries that and nothing
    more (each costs the engine work per step).

    survival:  the calibrated survival of each draft (False: the snapshot's are zeros).
    sps:       the SPS curve over admitted drafts, its B counting ``"batch"`` tokens (the
               verify tokens plus the pending prefill that still fits: vLLM's ``T + B``)
               or ``"decode"`` tokens alone (Algorithm 1's ``B = sum(1 + l)``); None: not
               read (a table lookup per step saved).
    cost:      the step's cost ingredients (:class:`StepCost`).
    lag_steps: the view of this many steps ago (survival, SPS, cost): DSpark's pipeline
               decides two steps ahead, vLLM's one; 0: none.
    lag_rows:  at least this many lagged survival rows (older steps stacked).
    fields:    drafter-visible schema-v2 trace columns, gathered at the decoding rows.
    state:     the per-request state the policy's replay carries.
    """

    survival: bool = False
    sps: str | None = None
    cost: bool = False
    lag_steps: int = 0
    lag_rows: int = 0
    fields: tuple[str, ...] = ()
    state: bool = False

    @property
    def step_price(self) -> bool:
        """It reads what the step costs (the SPS curve or the cost ingredients)."""
        return self.sps is not None or self.cost

    def text(self) -> str:
        """What it reads beyond its drafts' count, in words (the policy listing's)."""
        out = ["survival"] if self.survival else []
        if self.sps is not None:
            out.append("SPS curve" + (" (decode tokens)" if self.sps == "decode" else ""))
        if self.cost:
            out.append("step costs")
        if self.lag_steps:
            out.append(f"{self.lag_steps}-step-old view")
        out += [f"v2 {f}" for f in self.fields]
        if self.state:
            out.append("per-request state")
        return ", ".join(out) or "nothing"


@dataclass(frozen=True)
class DecisionKernel:
    """A compiled twin of one ``decide`` function over the engine's own arrays, which it
    writes what ``decide`` would into, with the engine's budget trim and accepted drafts
    (l, accepted), returning (the sum of l, whether the budget trimmed it). ``twin_of`` is
    that ``decide``: a policy whose ``decide`` is replaced (wrapped to record its
    snapshots, say) runs its own.

    signature: the arrays ``run`` takes, and so which call of the engine makes it:
               ``"lagged"``: ``policies.compiled.confidence_step``'s (the decoding rows'
               survivals and trace rows, a ring of the last steps' survivals, the step's
               cost terms, two output buffers), for a decision over survivals and a
               lagged view; ``"constant"``: ``compiled.constant_lengths``'s (the trace
               rows, the engine's ``verify_max``, the drafts proposed), for a decision that
               reads nothing of the step.
    run_proposed: the ``"lagged"`` twin on a trace with draft_tokens
               (``compiled.vllm_adaptive_proposed``'s signature), or None: ``decide``
               runs there.
    """

    twin_of: Callable
    run: Callable
    signature: str
    run_proposed: Callable | None = None


class CompiledDecision(NamedTuple):
    """The kernel the engine runs in place of a policy's ``decide``, and its signature:
    ``"lagged"``, ``"constant"`` (:class:`DecisionKernel`) or ``"proposed"`` (the lagged
    decision on a trace with draft_tokens)."""

    signature: str
    run: Callable


# The drafter that proposes a block of drafts per step, whose length --gamma-max sets.
BLOCK_DRAFTER = "dspark"


@dataclass(frozen=True, kw_only=True)
class Policy:
    """A verification policy: the decision, and what it needs of the engine to make it
    (the engine asks, the policy answers: :attr:`speculates`, :attr:`reads`,
    :meth:`verify_max`, :meth:`compiled_decision`, :attr:`history`, ...)."""

    name: str  # canonical spec, e.g. "fixed:5"
    drafter: str | None  # "dspark" | "mtp1" | "selfspec" | None (no speculation)
    decide: Callable[[BatchSnapshot], np.ndarray]
    reads: Reads = Reads()  # what the decision reads of the step
    draft_gamma: int | None = None  # tokens drafted per request; None = the trace's gamma_max
    description: str = ""
    # Tree and lossy policies (they return a Verification): the replay that judges a plan
    # against the trace's ground truth, the most batch tokens one request may verify (tree
    # nodes; None: the verify length), and whether the emitted tokens may differ from the
    # target's (drawn on their own axis, never as lossless).
    replay: Callable | None = None
    max_tokens: int | None = None
    lossy: bool = False
    # The drafter stops at each request's verify length this step (a controller deciding
    # while it drafts, SparseSpec-L): the engine charges the passes it ran, not a block.
    stops_drafting: bool = False
    # A compiled twin of the whole decision (DecisionKernel), which the engine runs over
    # its own arrays when the compiled kernels are on; ``decide`` stays the reference.
    kernel: DecisionKernel | None = None
    # The drafter method a serving engine's implementation of this policy runs with
    # (vLLM's adaptive verification: its ``dspark`` method), or None: any drafter with
    # what the policy reads.
    engine_method: str | None = None

    @property
    def speculates(self) -> bool:
        """It verifies drafts, and so needs a drafter and the trace that replays it."""
        return self.drafter is not None

    @property
    def drafts_block(self) -> bool:
        """Its drafter proposes a block per step, whose length ``--gamma-max`` sets."""
        return self.drafter == BLOCK_DRAFTER

    @property
    def plans(self) -> bool:
        """It returns a :class:`Verification` (a tree, lossy commits) and replays it
        itself; a chain policy returns verify lengths the engine replays as
        ``min(l, m)``."""
        return self.replay is not None

    @property
    def kind(self) -> str:
        """``"chain"``, ``"tree"`` or ``"lossy"``: what it verifies and whether the output
        stays the target's."""
        if self.lossy:
            return "lossy"
        return "tree" if self.plans else "chain"

    def verify_max(self, gamma: int) -> int:
        """The most batch tokens one request verifies beyond its bonus slot when the
        drafter drafts ``gamma`` positions: its draft length (``fixed:K``: K) cut to
        them, or a tree's node cap; a KV slot each."""
        if self.max_tokens is not None and gamma:  # a tree verifies nodes, not depth
            return int(self.max_tokens)
        return min(self.draft_gamma if self.draft_gamma is not None else gamma, gamma)

    def compiled_decision(self, *, draft_tokens: bool = False) -> CompiledDecision | None:
        """The compiled kernel that makes this policy's decision over the engine's arrays
        (``draft_tokens``: on a trace whose drafter proposed fewer at some positions), or
        None: ``decide`` runs. None where no kernel twins ``decide`` (none declared, or
        ``decide`` replaced), where the policy reads what the kernel's signature does not
        feed (the SPS curve, schema-v2 fields, per-request state; a constant one reads
        nothing), plans trees or lossy commits, or stops drafting."""
        k = self.kernel
        if k is None or k.twin_of is not self.decide or self.plans or self.stops_drafting:
            return None
        r = self.reads
        if k.signature == "constant":
            return CompiledDecision("constant", k.run) if r == Reads() else None
        if not (r.survival and r.lag_steps) or r.sps is not None or r.fields or r.state:
            return None
        if not draft_tokens:
            return CompiledDecision("lagged", k.run)
        return None if k.run_proposed is None else CompiledDecision("proposed", k.run_proposed)

    def __call__(self, snap: BatchSnapshot) -> np.ndarray:
        return self.decide(snap)

    @property
    def history(self) -> int:
        """Snapshots the engine keeps for this policy's lagged view."""
        r = self.reads
        return r.lag_steps + r.lag_rows if r.lag_steps else 0

    def lagged(self, history) -> tuple:
        """(survival, sps, cost, proposed) of ``lag_steps`` steps ago from ``history``
        (oldest first), or Nones; with ``lag_rows``, the survivals of that step and the
        ones before it until they hold that many rows (a small batch's two-step-old drafts
        are a noisy sample of its next ones). ``history`` holds only the rows that
        proposed drafts (:meth:`snapshot`), so the rows counted are requests that drafted;
        ``proposed`` is None where every row proposed the whole block."""
        lag_steps, lag_rows = self.reads.lag_steps, self.reads.lag_rows
        if not lag_steps or len(history) < lag_steps:
            return None, None, None, None
        newest = len(history) - lag_steps
        survival, sps, cost, proposed = history[newest]
        if lag_rows > len(survival):
            parts, props, rows = [survival], [proposed], len(survival)
            for i in range(newest - 1, -1, -1):
                parts.append(history[i][0])
                props.append(history[i][3])
                rows += len(history[i][0])
                if rows >= lag_rows:
                    break
            survival = readonly(np.concatenate(parts))
            if any(p is not None for p in props):
                g = survival.shape[1]
                proposed = readonly(np.concatenate(
                    [np.full(len(s), g, np.int64) if p is None else p
                     for s, p in zip(parts, props, strict=True)]))
        return survival, sps, cost, proposed

    def snapshot(self, history, survival: np.ndarray, gamma_max: int, token_budget: int, *,
                 sps: np.ndarray | None = None, cost: StepCost | None = None,
                 fields: dict[str, np.ndarray] | None = None,
                 state: np.ndarray | None = None,
                 proposed: np.ndarray | None = None) -> BatchSnapshot:
        """The read-only snapshot this policy decides on, with its lagged view read from
        ``history`` (a deque of ``maxlen >= max(1, self.history)``, oldest first); this
        step's view joins ``history`` when the policy reads lagged ones, its rows that
        proposed drafts only (``proposed``: drafts proposed per request, None: all of
        them). ``survival`` and ``sps`` are this step's own arrays and are frozen in
        place (no copy: the engine calls this once a step). The simulator's engine and
        the validation server both build their snapshots here, so a policy sees the same
        thing in both."""
        survival.flags.writeable = False
        if sps is not None:
            sps.flags.writeable = False
        if proposed is not None:
            proposed = readonly(proposed)
        if not self.reads.lag_steps:
            return BatchSnapshot(survival, gamma_max, token_budget, sps=sps, cost=cost,
                                 fields=fields, state=state, proposed=proposed)
        lagged = self.lagged(history)
        snap = BatchSnapshot(survival, gamma_max, token_budget, sps=sps,
                             lagged_survival=lagged[0], lagged_sps=lagged[1],
                             cost=cost, lagged_cost=lagged[2], fields=fields, state=state,
                             proposed=proposed, lagged_proposed=lagged[3])
        if proposed is None:
            history.append((survival, sps, cost, None))
        else:
            drafted = proposed > 0
            history.append((readonly(survival[drafted]), sps, cost,
                            readonly(np.asarray(proposed[drafted], np.int64))))
        return snap


@dataclass(frozen=True)
class PolicyKind:
    """One registered policy name.

    grammar: what may follow the name (``""``: nothing, ``":K"``: a required argument,
             ``"[:P]"``: an optional one, ``"[@BASE]"``: a wrapped chain policy).
    example: a spec that builds (the listing reads its inputs from the built policy).
    build:   ``(spec, arg) -> Policy``; ``arg`` is the text after the first ``:`` (None
             when empty), ``spec`` the whole stripped spec (for error messages and ``@``).
    """

    name: str
    grammar: str
    summary: str
    example: str
    build: Callable[[str, str | None], Policy]
    aliases: tuple[str, ...] = ()

    @property
    def usage(self) -> str:
        return self.name + self.grammar

    @property
    def takes_argument(self) -> bool:
        return bool(self.grammar)

    @property
    def wraps(self) -> bool:
        return "@BASE" in self.grammar


_KINDS: dict[str, PolicyKind] = {}
_ALIASES: dict[str, str] = {}
_discovered = False


def register(name: str, *, summary: str, grammar: str = "", example: str | None = None,
             aliases: tuple[str, ...] = ()) -> Callable:
    """Register the decorated ``(spec, arg) -> Policy`` builder under ``name``."""

    def add(build: Callable[[str, str | None], Policy]) -> Callable:
        kind = PolicyKind(name, grammar, summary, example or name, build, aliases)
        for key in (name, *aliases):
            old = _ALIASES.get(key)
            if old is not None and _KINDS[old].build.__module__ != build.__module__:
                raise RuntimeError(f"policy name {key!r} registered twice: "
                                   f"{_KINDS[old].build.__module__} and {build.__module__}")
        _KINDS[name] = kind
        _ALIASES.update(dict.fromkeys((name, *aliases), name))
        return build

    return add


def _discover() -> None:
    """Import every module of this package once, so each registers its policies."""
    global _discovered
    if _discovered:
        return
    package = importlib.import_module(__package__)
    for mod in pkgutil.iter_modules(package.__path__):
        if not mod.name.startswith("_"):
            importlib.import_module(f"{__package__}.{mod.name}")
    _discovered = True


def kinds() -> list[PolicyKind]:
    """Every registered policy, by name."""
    _discover()
    return [_KINDS[k] for k in sorted(_KINDS)]


def _kind_of(spec: str) -> PolicyKind:
    _discover()
    head = spec.partition(":")[0].strip().lower()
    key = _ALIASES.get(head)
    if key is None and "@" in head:  # asd@fixed:3: a wrapper and the chain it wraps
        key = _ALIASES.get(head.partition("@")[0].strip())
        if key is not None and not _KINDS[key].wraps:
            key = None
    if key is None:
        raise InputError("--policy", f"unknown policy {spec!r}; known: "
                                     f"{', '.join(k.usage for k in kinds())}")
    return _KINDS[key]


def get_policy(spec: str) -> Policy:
    """Build a policy from its spec string ``NAME[:ARG]``."""
    if not isinstance(spec, str) or not spec.strip():
        raise InputError("--policy", "empty policy name")
    spec = spec.strip()
    kind = _kind_of(spec)
    head, _, arg = spec.partition(":")
    arg = arg.strip() or None
    # an argument given to a policy without one is refused, not dropped
    # (``confidence:0.9`` would run plain confidence under a name the user did not ask for)
    if arg is not None and not kind.takes_argument:
        raise InputError("--policy", f"{spec!r}: {head.strip().lower()} takes no argument")
    return kind.build(spec, arg)


def parse_count(spec: str, arg: str | None, default: int | None) -> int:
    """A policy's integer argument (>= 0), or ``default`` when none is given."""
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


def engine_support(policy: Policy, *, drafter: str | None, confidence_head: bool,
                   proposes_everywhere: bool) -> tuple[bool, str]:
    """Whether a deployment whose drafter is the measured one (``drafter``: the trace's
    drafter name; ``confidence_head``: the trace carries the drafter's own confidences;
    ``proposes_everywhere``: it drafts at every step, unlike an n-gram or lookup drafter)
    can run ``policy`` in its engine, and a sentence saying why not or what it runs. A
    policy it cannot run is still simulated: the figure is what the policy would do with
    that drafter's acceptances, not what the deployment can serve today."""
    kind = "proposes only where it finds a match (n-gram / lookup)" \
        if not proposes_everywhere else f"drafter {drafter}"
    why = []
    if policy.reads.survival and policy.drafts_block and not confidence_head:
        why.append("it ranks drafts by confidence and the measured drafter has no "
                   "confidence head (the run's confidences are assumed: --conf-source)")
    if policy.engine_method is not None and \
            not (drafter or "").lower().startswith(policy.engine_method):
        why.append(f"the engine runs it only with its {policy.engine_method} drafter "
                   f"method (the measured one: {drafter})")
    if not why:
        return True, f"runs with the measured drafter ({kind})"
    runs = "none, fixed:K" + (" and the confidence policies" if confidence_head else "")
    return False, (f"simulated only: {'; '.join(why)}. The measured drafter ({kind}) "
                   f"runs {runs}")


# -- the listing: `dspark-sim policies`, the --policy help and docs/policies.md ----------
def plain(markdown: str) -> str:
    """A summary for a terminal: no emphasis or code marks, links as their doc's path."""
    text = re.sub(r"\[([^\]]+)\]\(([^)#]+)(#[^)]*)?\)", r"\1: docs/\2", markdown)
    return text.replace("**", "").replace("*", "").replace("`", "")


def policy_rows(markdown: bool = True) -> list[dict[str, str]]:
    """One row per registered policy: its spec grammar, other names, what it does (as
    markdown, or :func:`plain`), its drafter, whether it verifies a chain or a tree or is
    lossy, and what it reads (from its example); ``default`` is ``"yes"`` on the default
    policy's row."""
    rows = []
    for kind in kinds():
        built = get_policy(kind.example)
        rows.append({"policy": kind.usage, "aliases": ", ".join(kind.aliases),
                     "default": "yes" if kind.name == DEFAULT_POLICY else "",
                     "what it does": kind.summary if markdown else plain(kind.summary),
                     "drafter": built.drafter or "none",
                     "kind": built.kind, "reads": built.reads.text()})
    return rows


def policy_table_markdown() -> str:
    """The policy table of docs/policies.md."""
    cols = ("policy", "what it does", "drafter", "kind", "reads")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in policy_rows():
        name = f"`{row['policy']}`" + (" (default)" if row["default"] else "")
        if row["aliases"]:
            name += f" (also `{row['aliases']}`)"
        cells = [name, *(row[c] for c in cols[1:])]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def policy_help() -> str:
    """The ``--policy`` option's help: every name with its grammar, and the default."""
    return (f"NAME[:ARG]: {', '.join(k.usage for k in kinds())}. Default: {DEFAULT_POLICY}. "
            "dspark-sim policies lists what each does (docs/policies.md).")
