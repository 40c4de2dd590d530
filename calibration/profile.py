"""Engine throughput profiles: SPS(B) as a table, draft cost, and the TOML file format.

A profile answers one question for the simulator and the schedulers: *how long
does one engine step take?*  Following Vidur, cost is a table lookup, never a
model evaluated per token:

``step_s = draft_s(drafter, n_requests, gamma) + target_s(B) + kv_s_per_token * kv_tokens
+ logits_s_per_row * logit_rows + attn_s_per_query_ctx * sum(query_tokens * context)
+ multi_kv_s_per_token * multi_kv_tokens + request_s * ctx_requests``

* ``target_s(B)`` is the target forward time for ``B`` tokens in the batch (decode
  verify tokens + prefill chunk tokens). It is stored as a table so the jagged
  CUDA-graph staircase survives: with ``interpolation = "step"`` a batch of ``B``
  tokens costs what the smallest tabulated size ``>= B`` costs (the graph it is
  padded into). Past the last row the cost grows linearly with the last
  segment's slope (never negative) plus ``eager_penalty_ms`` (no graph is captured there).
* ``logits_s_per_row`` (optional, default 0) charges the LM-head projection per row
  whose logits the engine computes: every verify token, and the last token of a
  prefill that completes in the step. A table measured with logits on *every* row
  leaves it at 0; a table measured with one logit row per request sets it, so prefill
  chunks are not charged for vocabulary projections real engines skip.
* ``attn_s_per_query_ctx`` (optional, default 0) charges attention work that grows with
  query tokens x the context they attend to: a verify block of ``1 + l`` tokens over a
  context of ``L`` costs ``(1 + l) * L`` units, a prefill chunk of ``c`` tokens after ``f``
  filled ones ``c * (f + c / 2)``. ``kv_s_per_token`` alone (one read of each request's
  KV) cannot express that verify cost grows with context.
* ``kv_s_per_token`` charges the attention KV reads for context tokens in the
  batch (memory traffic that grows with context, not with ``B``).
* ``multi_kv_s_per_token`` (optional, default 0) is the *extra* cost per context token
  attended by a multi-token query block (a verify block with ``l >= 1``, or a prefill
  chunk continuing after ``f > 0`` filled tokens). Single-token decode attention takes a
  different kernel path than multi-query attention (on CPU SDPA needs no mask for one
  query; on GPUs decode and prefill/verify attention are different kernels), so a
  request verifying ``l = 0`` drafts pays ``kv_s_per_token`` per context token and one
  verifying ``l >= 1`` pays ``kv_s_per_token + multi_kv_s_per_token``.
* ``request_s`` (optional, default 0) is a fixed cost per request that attends to a KV
  cache in the step (every decoding request, and a prefill chunk continuing after
  filled tokens): per-sequence attention set-up, cache indexing and masks. On the CPU
  default target it is ~4 ms per request per step, which a table in ``B`` alone charges
  to the wrong shapes (8 requests x 1 token and 1 request x 8 tokens share ``B = 8``).
* ``frontend_us_per_request`` (optional, default 0) is the time the serving front end
  (an OpenAI-compatible API server: parsing, chat template, tokenisation) spends on each
  request before the engine sees it, one request at a time: requests sent together reach
  the engine one after another, so an idle engine starts a step with the first alone
  while the rest queue behind it (vLLM's single API-server process). Not a step cost.
* ``attn_window_tokens`` (optional) caps the context one query token attends to in
  the attention term (sparse or sliding-window attention: DeepSeek-V4 attends to at
  most ~2k selected tokens however long the context).
* ``draft_s`` is tabulated over the number of drafted requests for each drafter
  kind at ``gamma_ref``; ``gamma_slope`` is the extra fraction per drafted token
  beyond ``gamma_ref`` (0 for a parallel drafter in its memory-bound regime: one pass
  whatever ``gamma``); ``kv_us_per_token`` (optional) charges the drafter's own reads of
  the drafted requests' context (an autoregressive EAGLE head attends to the whole KV).
  Which ``[draft.<name>]`` table a run uses: the one named like the trace's drafter
  (``trace.meta.drafter``, e.g. ``dspark``, ``mtp1``, ``eagle``) when the profile has
  it, else the policy's drafter kind (``dspark`` for block-drafter policies, ``mtp1``
  for MTP-1); a missing table is an error listing the tables the profile has.
* ``default_trace`` (optional, in ``[profile]``) names the acceptance trace of the model
  the profile serves, as its published setup replays it (a built-in trace name, or a
  parquet path relative to the profile file): a block-drafter run on this profile that
  names no ``--trace`` replays it instead of the package default, and says so in its
  deployment line; ``--trace`` still wins. A profile fitted to published figures is
  fitted with its setup's drafter, so another trace would not give those figures.
* ``default_replicas`` (optional, in ``[profile]``) is how many replicas a run on this
  profile simulates when it names no replica count (``--replicas``, a config file's
  ``[deployment] replicas``, a preset's); its deployment line says so. A profile fitted
  to one server's runs (``calibrate vllm``) sets 1: the simulator's default of four
  replicas would be another deployment than the one measured.
* ``[engine]`` (optional) states the per-replica limits the deployment implies:
  ``max_num_seqs``, ``max_num_batched_tokens``, ``kv_capacity_tokens`` (HBM left after
  weights and activations, divided by the KV bytes per token) and ``max_model_len``
  (prompt + output one request may have). Engine options given explicitly win; a
  profile without the table falls back to the simulator's defaults, said in the
  summary.

File format (TOML)::

    [profile]
    name = "v4flash-h200"
    kind = "analytic"            # or "measured"
    gpus_per_replica = 16
    interpolation = "step"       # or "linear"
    description = "..."
    default_trace = "dspark-v4flash-synthetic"  # trace a run replays without --trace (optional)
    default_replicas = 1         # replicas a run simulates without --replicas (optional)
    [profile.parameters]         # whatever produced the table (hardware sheet, device, date)
    ...
    [target]
    tokens = [1, 2, 4, 8, ...]   # B, strictly increasing
    step_ms = [...]              # same length, > 0
    step_std_ms = [...]          # optional spread (measured profiles)
    kv_us_per_token = 0.001      # per context token in the batch
    logits_us_per_row = 0.0      # per row whose logits are computed (optional)
    attn_ns_per_query_ctx = 0.0  # per query token x context token (optional)
    multi_kv_us_per_token = 0.0  # extra per context token of multi-token blocks (optional)
    request_us = 0.0             # per request with a KV context in the step (optional)
    frontend_us_per_request = 0.0  # serial front-end time before the engine (optional)
    attn_window_tokens = 2048    # context per query token in the attention term (optional)
    eager_penalty_ms = 0.0
    [engine]                     # per-replica limits (optional)
    max_num_seqs = 256
    max_num_batched_tokens = 8192
    kv_capacity_tokens = 2000000
    max_model_len = 131072
    [draft.dspark]
    batch = [1, 8, 64, 256]      # requests drafted in the step
    time_ms = [...]
    gamma_ref = 7
    gamma_slope = 0.0
    kv_us_per_token = 0.0        # per context token of the drafted requests (optional)
    block = true                 # drafts its whole block whatever is verified (optional)
    [draft.selfspec]             # self-speculation over a sparse KV (optional terms)
    batch = [1, 8, 64, 256]      # one draft pass (a token per request) at no context
    time_ms = [...]
    gamma_ref = 1
    gamma_slope = 1.0            # each drafted token is one more pass
    kv_budget_tokens = 2048      # KV tokens each drafted token attends (sparse budget)
    sparse_kv_us_per_token = 0.0 # per attended KV token per drafted token
    select_us_per_context_token = 0.0  # per context token of a drafting request, per step
    [draft.mtp1]
    ...
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from dspark_sim.errors import (
    MAX_KV_CAPACITY_TOKENS,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    MAX_REPLICAS,
    InputError,
    check_known_keys,
)
from dspark_sim.io import loads_toml, not_a_file

# analytic: a roofline from hardware/model sheets; measured: timed on a device;
# published: a third party's published cost fit, transcribed (sourced in the file).
PROFILE_KINDS = ("analytic", "measured", "published")
PREFILL_MODES = ("chunked", "disaggregated")
INTERPOLATIONS = ("step", "linear")


@dataclass(frozen=True, eq=False)
class DraftCost:
    """Draft time for ``n`` requests at ``gamma_ref`` tokens, linear in between."""

    batch: np.ndarray  # requests, increasing
    time_s: np.ndarray
    gamma_ref: int = 1
    gamma_slope: float = 0.0
    kv_s_per_token: float = 0.0  # per context token of the drafted requests
    # A block drafter (DSpark, a parallel backbone) drafts its whole block every step,
    # whatever the policy verifies; an autoregressive one stops at the verify length.
    block: bool = False
    # Self-speculation over a sparse KV (``[draft.selfspec]``): each drafted token attends
    # at most ``kv_budget_tokens`` of its request's context (``sparse_kv_s_per_token`` per
    # attended token), and each drafting step first selects that budget from the whole
    # context (``select_s_per_context_token`` per context token of a drafting request).
    kv_budget_tokens: int | None = None
    sparse_kv_s_per_token: float = 0.0
    select_s_per_context_token: float = 0.0

    @property
    def has_context_terms(self) -> bool:
        """The draft cost depends on each request's own context (not just the batch's)."""
        return bool(self.sparse_kv_s_per_token or self.select_s_per_context_token)

    def context_s(self, context_tokens: np.ndarray, drafted: np.ndarray) -> float:
        """The context-dependent part for requests of ``context_tokens`` each drafting
        ``drafted`` tokens: ``sparse * sum(drafted * min(context, budget)) + select *
        sum(context of the requests that draft)``."""
        ctx = np.asarray(context_tokens, dtype=np.float64)
        d = np.asarray(drafted, dtype=np.float64)
        t = 0.0
        if self.sparse_kv_s_per_token:
            attended = ctx if self.kv_budget_tokens is None \
                else np.minimum(ctx, self.kv_budget_tokens)
            t += self.sparse_kv_s_per_token * float(np.dot(d, attended))
        if self.select_s_per_context_token:
            t += self.select_s_per_context_token * float(ctx[d > 0].sum())
        return t

    def time(self, n_requests: int, gamma: int, kv_tokens: float = 0.0) -> float:
        """Draft time for ``n_requests`` drafting ``gamma`` tokens each over
        ``kv_tokens`` context tokens in all."""
        if n_requests <= 0 or gamma <= 0:
            return 0.0
        return self.base_time(n_requests, gamma) + self.kv_s_per_token * kv_tokens

    def base_time(self, n_requests: int, gamma: int) -> float:
        """The table part (no context term)."""
        base = float(np.interp(n_requests, self.batch, self.time_s))
        if n_requests > self.batch[-1] and len(self.batch) > 1:
            slope = (self.time_s[-1] - self.time_s[-2]) / (self.batch[-1] - self.batch[-2])
            # as the target table's: a table ending on a downward segment (measurement
            # noise) would extrapolate to a negative draft time, a negative step delay
            slope = max(float(slope), 0.0)
            base = float(self.time_s[-1] + slope * (n_requests - self.batch[-1]))
        return base * max(0.0, 1.0 + self.gamma_slope * (gamma - self.gamma_ref))


@dataclass(frozen=True)
class Limit:
    """What is said of one engine limit: the value a run takes where neither its options
    nor its profile's ``[engine]`` table state one, what bounds it (a count's
    ``maximum``, or the modes it ``choices``), and the help and unit of the run option
    that sets it. The option and the profile's table are capped alike: the engine sizes
    its step table and batch matrices by the first two limits, and the KV capacity and
    the model length are counts of tokens a replica holds."""

    default: int | str | None
    help: str
    unit: str | None = None
    maximum: int | None = None
    choices: tuple[str, ...] = ()


def _limit(default: int | str | None, help: str, unit: str | None = None, *,
           maximum: int | None = None, choices: tuple[str, ...] = ()) -> Any:
    """An :class:`EngineLimits` field: unset (``None``: this layer does not say), its
    :class:`Limit` in the field's metadata."""
    return field(default=None, metadata={"limit": Limit(default, help, unit, maximum,
                                                         choices)})


@dataclass(frozen=True)
class EngineLimits:
    """A replica's scheduler limits, each declared once, here, with its default, its bound
    and its option's help (:class:`Limit`). A profile's ``[engine]`` table holds them, a
    run's ``EngineConfig`` inherits them as its options (``sim/config.py``), and the
    engine runs on the :class:`ResolvedLimits` of the two (``None``: this layer does not
    say). The defaults: vLLM's for the first two, a KV cache no chat load of the default
    replica exhausts, no cap on a request's length but the KV cache, prefill in the decode
    batch (vLLM's)."""

    max_num_seqs: int | None = _limit(256, "Per replica.", "sequences", maximum=MAX_NUM_SEQS)
    max_num_batched_tokens: int | None = _limit(8192, "Per step, per replica.", "tokens",
                                                maximum=MAX_NUM_BATCHED_TOKENS)
    # prompt + generated + verify slots
    kv_capacity_tokens: int | None = _limit(2_000_000, "KV cache per replica.", "tokens",
                                            maximum=MAX_KV_CAPACITY_TOKENS)
    # requests longer (prompt + output) than this are refused at arrival
    max_model_len: int | None = _limit(None, "Refuse requests whose prompt + output exceed "
                                       "this (default: the profile's).", "tokens",
                                       maximum=MAX_KV_CAPACITY_TOKENS)
    # "chunked": prompts are prefilled in the decode batch, sharing the token budget with
    # verification (vLLM/SGLang colocated); "disaggregated": separate prefill instances
    # send each request's KV and first token to the decode replica (DeepSeek's serving).
    prefill: str | None = _limit("chunked", "chunked (prefill shares the step's token "
                                 "budget) | disaggregated (prefill instances; default: the "
                                 "profile's choice)", choices=PREFILL_MODES)


# Each limit's Limit, by name, in declaration order.
LIMITS: dict[str, Limit] = {f.name: f.metadata["limit"] for f in fields(EngineLimits)}
ENGINE_LIMITS = tuple(LIMITS)
# The limits a run takes where neither its options nor the profile's [engine] table
# state them.
DEFAULT_LIMITS = EngineLimits(**{name: lim.default for name, lim in LIMITS.items()})


@dataclass(frozen=True)
class ResolvedLimits(EngineLimits):
    """The limits a run uses, every one filled in (``max_model_len`` may stay ``None``:
    no cap), and where each came from: limit -> "option" | "profile" | "default"."""

    sources: dict[str, str] = field(default_factory=dict)


def resolve_limits(given: object, profile: EngineProfile) -> ResolvedLimits:
    """Each limit from ``given`` (anything with the limits' attributes: a run's
    ``EngineConfig``), else the profile's [engine] table, else :data:`DEFAULT_LIMITS`."""
    values: dict[str, int | str | None] = {}
    sources: dict[str, str] = {}
    for name in ENGINE_LIMITS:
        mine = getattr(given, name, None)
        from_profile = getattr(profile.limits, name)
        if mine is not None:
            values[name], sources[name] = mine, "option"
        elif from_profile is not None:
            values[name], sources[name] = from_profile, "profile"
        else:
            values[name], sources[name] = getattr(DEFAULT_LIMITS, name), "default"
    if values["max_num_seqs"] > values["max_num_batched_tokens"]:
        raise _limits_conflict(values, sources, profile.name)
    return ResolvedLimits(**values, sources=sources)


def _limits_conflict(values: dict, sources: dict[str, str], profile_name: str) -> InputError:
    """More sequences than batched tokens (a step must hold one token per sequence),
    blamed on the limit the run itself gave: an option beats the profile, which beats
    the default, so ``--max-num-batched-tokens 8`` under the default sequences names
    ``--max-num-batched-tokens``, not the ``--max-num-seqs`` the user never typed.
    (``config.resolve_config`` turns the option into the config key that gave it.)"""
    seqs, tokens = values["max_num_seqs"], values["max_num_batched_tokens"]
    origin = {"option": "given", "default": "the simulator's default",
              "profile": f"from profile {profile_name}'s [engine] table"}
    if sources["max_num_batched_tokens"] == "option" and sources["max_num_seqs"] != "option":
        return InputError("--max-num-batched-tokens", f"{tokens} is below max_num_seqs "
                          f"({seqs}, {origin[sources['max_num_seqs']]}): a step holds one "
                          f"token per sequence; lower max_num_seqs to {tokens} or less too")
    given = sources["max_num_seqs"] == "option"
    return InputError("--max-num-seqs" if given else f"profile {profile_name}",
                      f"{'' if given else 'its max_num_seqs '}{seqs} must not exceed "
                      f"max_num_batched_tokens ({tokens}, "
                      f"{origin[sources['max_num_batched_tokens']]})")


@dataclass(frozen=True, eq=False)
class EngineProfile:
    """Step-time model of one replica. All times in seconds."""

    name: str
    kind: str
    gpus_per_replica: int
    tokens: np.ndarray  # int64, strictly increasing
    step_s: np.ndarray  # float64, target forward time at ``tokens``
    step_std_s: np.ndarray | None = None
    kv_s_per_token: float = 0.0
    logits_s_per_row: float = 0.0
    attn_s_per_query_ctx: float = 0.0
    multi_kv_s_per_token: float = 0.0
    request_s: float = 0.0
    frontend_s_per_request: float = 0.0  # serial API-server time before the engine
    attn_window_tokens: int | None = None  # context cap per query in the attention term
    eager_penalty_s: float = 0.0
    interpolation: str = "step"
    drafts: dict[str, DraftCost] = field(default_factory=dict)
    limits: EngineLimits = field(default_factory=EngineLimits)
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    source: str = "<memory>"
    # the acceptance trace a block-drafter run replays when it names none (a built-in
    # name or an absolute path; None: the package default)
    default_trace: str | None = None
    # the replicas a run simulates when it names no count (None: the simulator's default)
    default_replicas: int | None = None

    # -- lookups -------------------------------------------------------------
    @property
    def max_tokens(self) -> int:
        return int(self.tokens[-1])

    def target_time_s(self, batch_tokens):
        """Target forward time for ``batch_tokens`` (scalar or array), no KV term."""
        b = np.asarray(batch_tokens, dtype=np.int64)
        scalar = b.ndim == 0
        b = np.atleast_1d(b)
        out = np.zeros(b.shape, dtype=np.float64)
        busy = b > 0
        inside = busy & (b <= self.tokens[-1])
        if self.interpolation == "step":
            idx = np.searchsorted(self.tokens, b[inside], side="left")
            out[inside] = self.step_s[idx]
        else:
            out[inside] = np.interp(b[inside], self.tokens, self.step_s)
        beyond = b > self.tokens[-1]
        if beyond.any():
            if len(self.tokens) > 1:
                slope = (self.step_s[-1] - self.step_s[-2]) / (self.tokens[-1] - self.tokens[-2])
            else:
                slope = self.step_s[-1] / self.tokens[-1]
            # A measured table can end on a noisy downward segment; more tokens never
            # make a step cheaper (and a negative extrapolation would be a negative time).
            slope = max(float(slope), 0.0)
            out[beyond] = (
                self.step_s[-1] + slope * (b[beyond] - self.tokens[-1]) + self.eager_penalty_s
            )
        return float(out[0]) if scalar else out

    def draft_key(self, trace_drafter: str | None, policy_drafter: str) -> str:
        """The ``[draft.<name>]`` table a run uses: the trace's drafter's own table when
        the profile has one, else the policy's drafter kind. A missing table is an
        error naming the tables present (charging nothing would be silently wrong)."""
        if trace_drafter and trace_drafter in self.drafts:
            return trace_drafter
        if policy_drafter in self.drafts:
            return policy_drafter
        have = ", ".join(f"[draft.{k}]" for k in self.drafts) or "none"
        wanted = f"[draft.{policy_drafter}]" + (
            f" (or [draft.{trace_drafter}] for the trace's drafter)"
            if trace_drafter and trace_drafter != policy_drafter else "")
        hint = (" (the shipped selfspec-llama8b-8xh200 and selfspec-v3-h200 profiles have one)"
                if policy_drafter == "selfspec" else "")
        raise InputError(self.source, f"profile has no {wanted} table; it has {have}{hint}")

    def draft_time_s(self, drafter: str | None, n_requests: int, gamma: int,
                     kv_tokens: float = 0.0) -> float:
        if drafter is None or n_requests <= 0 or gamma <= 0:
            return 0.0
        cost = self.drafts.get(drafter)
        if cost is None:
            # A drafter the profile does not know: charge nothing, but never silently.
            raise InputError(self.source, f"profile has no [draft.{drafter}] table; it has "
                             f"{', '.join(self.drafts) or 'none'}")
        return cost.time(n_requests, gamma, kv_tokens)

    def step_time_s(self, batch_tokens, kv_tokens: float = 0.0, draft_s: float = 0.0):
        return self.target_time_s(batch_tokens) + self.kv_s_per_token * kv_tokens + draft_s

    def extra_terms(self, n_dec: int, kv_tokens: float, batch_rows: int,
                    draft_s: float) -> tuple[float, float, float]:
        """:meth:`step_extra_s` as its three terms: the step time beyond the target table
        with ``i`` drafts admitted is ``i * per_token + offset``, plus ``kink * min(i,
        n_dec)`` (0: none). The compiled scheduler builds the curve from these."""
        mean_ctx = kv_tokens / max(1, batch_rows)
        per_token = self.logits_s_per_row
        base = draft_s + self.kv_s_per_token * kv_tokens
        if n_dec:
            per_token += self.attn_s_per_query_ctx * float(self.attended(mean_ctx))
            base += self.request_s * n_dec
        kink = self.multi_kv_s_per_token * mean_ctx if n_dec and self.multi_kv_s_per_token \
            else 0.0
        return per_token, base + per_token * n_dec, kink

    def step_extra_s(self, n_dec: int, gamma: int, kv_tokens: float, batch_rows: int,
                     draft_s: float) -> np.ndarray:
        """The step time beyond the target table when ``i = 0..n_dec*gamma`` drafts are
        admitted: the draft, the KV reads of the batch, the per-request cost, and the terms
        of the ``n_dec + i`` verify tokens: one LM-head row each, each attending the
        batch's mean context, and ``~min(i, n_dec)`` multi-token KV blocks (a scheduler
        admits first drafts first: they have the highest survival). Written as one linear
        function of ``i`` plus that kink (:meth:`extra_terms`), because it runs every
        engine step. Shared by the simulator's schedulers and the validation server's, so
        both price a verify length identically."""
        per_token, offset, kink = self.extra_terms(n_dec, kv_tokens, batch_rows, draft_s)
        i = np.arange(n_dec * gamma + 1, dtype=np.float64)
        extra = i * per_token
        extra += offset
        if kink:
            extra += kink * np.minimum(i, n_dec)
        return extra

    def prefill_s_per_token(self, budget: int) -> float:
        """What a prefill token pushed out of a step costs when it runs later: prompts
        fill large steps, so the target table's secant slope over the top half of the
        token budget (never negative)."""
        top, half = self.target_time_s(np.array([budget, budget // 2]))
        return max(0.0, float((top - half) / max(1, budget - budget // 2)))

    def attended(self, context_tokens):
        """Context one query token attends to (capped by ``attn_window_tokens``); a
        scalar takes Python's min (the scheduler asks for one every engine step)."""
        window = self.attn_window_tokens
        if window is None:
            return context_tokens
        if isinstance(context_tokens, int | float):
            return min(context_tokens, window)
        return np.minimum(context_tokens, window)

    def sps(self, batch_tokens, kv_tokens: float = 0.0, draft_s: float = 0.0):
        """Engine steps per second at ``batch_tokens`` (the paper's SPS(B))."""
        t = self.step_time_s(batch_tokens, kv_tokens, draft_s)
        return 1.0 / np.maximum(t, 1e-12)

    # -- serialisation ---------------------------------------------------------
    def to_toml(self) -> str:
        lines = ["[profile]"]
        lines += [
            f"name = {_q(self.name)}",
            f"kind = {_q(self.kind)}",
            f"gpus_per_replica = {int(self.gpus_per_replica)}",
            f"interpolation = {_q(self.interpolation)}",
            f"description = {_q(self.description)}",
            *([f"default_trace = {_q(self.default_trace)}"] if self.default_trace else []),
            *([f"default_replicas = {int(self.default_replicas)}"]
              if self.default_replicas is not None else []),
            "",
            "[profile.parameters]",
        ]
        for k, v in self.parameters.items():
            lines.append(f"{k} = {_toml_value(v)}")
        lines += [
            "",
            "[target]",
            f"tokens = {_toml_value([int(x) for x in self.tokens])}",
            f"step_ms = {_toml_value([round(float(x) * 1e3, 6) for x in self.step_s])}",
        ]
        if self.step_std_s is not None:
            lines.append(
                f"step_std_ms = {_toml_value([round(float(x) * 1e3, 6) for x in self.step_std_s])}"
            )
        lines += [
            f"kv_us_per_token = {self.kv_s_per_token * 1e6!r}",
            *([f"logits_us_per_row = {self.logits_s_per_row * 1e6!r}"]
              if self.logits_s_per_row else []),
            *([f"attn_ns_per_query_ctx = {self.attn_s_per_query_ctx * 1e9!r}"]
              if self.attn_s_per_query_ctx else []),
            *([f"multi_kv_us_per_token = {self.multi_kv_s_per_token * 1e6!r}"]
              if self.multi_kv_s_per_token else []),
            *([f"request_us = {self.request_s * 1e6!r}"] if self.request_s else []),
            *([f"frontend_us_per_request = {self.frontend_s_per_request * 1e6!r}"]
              if self.frontend_s_per_request else []),
            *([f"attn_window_tokens = {int(self.attn_window_tokens)}"]
              if self.attn_window_tokens is not None else []),
            f"eager_penalty_ms = {self.eager_penalty_s * 1e3!r}",
        ]
        set_limits = [(k, getattr(self.limits, k)) for k in ENGINE_LIMITS
                      if getattr(self.limits, k) is not None]
        if set_limits:
            lines += ["", "[engine]", *(f"{k} = {_toml_value(v)}" for k, v in set_limits)]
        for name, d in self.drafts.items():
            lines += [
                "",
                f"[draft.{name}]",
                f"batch = {_toml_value([int(x) for x in d.batch])}",
                f"time_ms = {_toml_value([round(float(x) * 1e3, 6) for x in d.time_s])}",
                f"gamma_ref = {int(d.gamma_ref)}",
                f"gamma_slope = {float(d.gamma_slope)!r}",
                *([f"kv_us_per_token = {d.kv_s_per_token * 1e6!r}"] if d.kv_s_per_token else []),
                *(["block = true"] if d.block else []),
                *([f"kv_budget_tokens = {int(d.kv_budget_tokens)}"]
                  if d.kv_budget_tokens is not None else []),
                *([f"sparse_kv_us_per_token = {d.sparse_kv_s_per_token * 1e6!r}"]
                  if d.sparse_kv_s_per_token else []),
                *([f"select_us_per_context_token = {d.select_s_per_context_token * 1e6!r}"]
                  if d.select_s_per_context_token else []),
            ]
        return "\n".join(lines) + "\n"

    def summary(self) -> str:
        return (
            f"{self.name} ({self.kind}, {self.gpus_per_replica} GPU/replica, "
            f"{len(self.tokens)} table rows up to B={self.max_tokens})"
        )


def _q(s: str) -> str:
    return '"' + str(s).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | np.integer):
        return str(int(v))
    if isinstance(v, float | np.floating):
        f = float(v)
        return repr(f) if math.isfinite(f) else _q(str(f))
    if isinstance(v, list | tuple | np.ndarray):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    return _q(str(v))


# Token counts above this are refused: the engine expands the step table to one float
# per batch token, and int64 arithmetic on counts near 2**63 overflows silently.
MAX_PROFILE_TOKENS = 1 << 30


def _array(where: str, table: dict, key: str, *, positive: bool = True) -> np.ndarray:
    if key not in table:
        raise InputError(where, f"missing key '{key}'")
    values = table[key]
    if not isinstance(values, list) or not values \
            or any(isinstance(v, bool) or not isinstance(v, int | float) for v in values):
        raise InputError(where, f"'{key}' must be a non-empty list of numbers")
    arr = np.asarray(values, dtype=np.float64)
    if not np.all(np.isfinite(arr)):
        raise InputError(where, f"'{key}' contains NaN or infinite values")
    if positive and np.any(arr <= 0):
        raise InputError(where, f"'{key}' must be > 0 everywhere")
    return arr


def _number(where: str, table: dict, key: str, default: float = 0.0) -> float:
    """An optional finite number >= 0 (a string or a bool is a type error, not a 0)."""
    v = table.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
        raise InputError(where, f"'{key}' must be a finite number >= 0, got {v!r}")
    return float(v)


def _count(where: str, table: dict, key: str, default: int | None = None,
           minimum: int = 1, maximum: int = MAX_PROFILE_TOKENS) -> int | None:
    """An optional whole count in [minimum, maximum]."""
    v = table.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not minimum <= v <= maximum:
        raise InputError(where, f"'{key}' must be an integer in [{minimum}, {maximum:,}]"
                                f", got {v!r}")
    return int(v)


def _flag(where: str, table: dict, key: str, default: bool = False) -> bool:
    v = table.get(key, default)
    if not isinstance(v, bool):
        raise InputError(where, f"'{key}' must be true or false, got {v!r}")
    return v


def _table(where: str, data: dict, key: str, *, required: bool = False) -> dict:
    v = data.get(key)
    if v is None and not required:
        return {}
    if not isinstance(v, dict):
        raise InputError(where, f"[{key}] must be a table")
    return v


PROFILE_TABLES = ("profile", "target", "engine", "draft")
PROFILE_KEYS = ("name", "kind", "gpus_per_replica", "interpolation", "description",
                "default_trace", "default_replicas", "parameters")
TARGET_KEYS = ("tokens", "step_ms", "step_std_ms", "kv_us_per_token", "logits_us_per_row",
               "attn_ns_per_query_ctx", "multi_kv_us_per_token", "request_us",
               "frontend_us_per_request", "attn_window_tokens", "eager_penalty_ms")


DRAFT_KEYS = ("batch", "time_ms", "gamma_ref", "gamma_slope", "kv_us_per_token", "block",
              "kv_budget_tokens", "sparse_kv_us_per_token", "select_us_per_context_token")


def check_default_trace(where: str, value: Any, base: Path | None) -> str:
    """A profile's (or sheet's) ``default_trace``: a built-in trace name, or a parquet file
    (relative to ``base``, the file's folder; returned absolute). Checked where the file
    is read, so a misspelt name is refused naming the file and key, not at the first run
    that happens to need it."""
    from dspark_sim.traces.schema import builtin_traces

    if not isinstance(value, str) or not value.strip():
        raise InputError(where, f"'default_trace' must be a trace name or path, got {value!r}")
    if value in builtin_traces():
        return value
    p = Path(value)
    if base is not None and not p.is_absolute():
        p = base / p
    if p.suffix.lower() == ".parquet" and p.is_file():
        return str(p.resolve())
    raise InputError(where, f"'default_trace' names unknown trace {value!r} (no such built-in "
                            f"trace or parquet file); built-in: {', '.join(builtin_traces())}")


def _draft_cost(where: str, d: dict) -> DraftCost:
    if not isinstance(d, dict):
        raise InputError(where, "must be a table")
    check_known_keys(where, d, DRAFT_KEYS)  # a misspelt cost term would be a silent zero
    sparse_us = _number(where, d, "sparse_kv_us_per_token")
    budget = _count(where, d, "kv_budget_tokens")
    if sparse_us and budget is None:
        raise InputError(where, "'sparse_kv_us_per_token' needs 'kv_budget_tokens' (the KV "
                                "tokens each drafted token attends)")
    batch = _array(where, d, "batch")
    time_ms = _array(where, d, "time_ms", positive=False)
    if batch.shape != time_ms.shape or np.any(np.diff(batch) <= 0) or np.any(time_ms < 0):
        raise InputError(where, "batch must increase and match time_ms (>= 0) in length")
    slope = d.get("gamma_slope", 0.0)
    if isinstance(slope, bool) or not isinstance(slope, int | float) or not math.isfinite(slope):
        raise InputError(where, f"'gamma_slope' must be a finite number, got {slope!r}")
    return DraftCost(
        batch=batch,
        time_s=time_ms / 1e3,
        gamma_ref=_count(where, d, "gamma_ref", 1),
        gamma_slope=float(slope),
        kv_s_per_token=_number(where, d, "kv_us_per_token") / 1e6,
        block=_flag(where, d, "block"),
        kv_budget_tokens=budget,
        sparse_kv_s_per_token=sparse_us / 1e6,
        select_s_per_context_token=_number(where, d, "select_us_per_context_token") / 1e6,
    )


def profile_from_dict(data: dict, source: str = "<memory>") -> EngineProfile:
    """Validate a parsed profile document. Raises :class:`InputError` naming ``source``."""
    if not isinstance(data, dict) or "profile" not in data or "target" not in data:
        raise InputError(source, "not an engine profile: needs [profile] and [target] tables")
    head = _table(source, data, "profile", required=True)
    target = _table(source, data, "target", required=True)
    where_h, where_t = f"{source} [profile]", f"{source} [target]"
    # a misspelt key would be ignored: a cost term silently zero ([target] kv_us_per_tokn),
    # a table silently unused ([drafts.dspark]); refused as [engine] and [draft.*] keys are
    check_known_keys(source, data, PROFILE_TABLES)
    check_known_keys(where_h, head, PROFILE_KEYS)
    check_known_keys(where_t, target, TARGET_KEYS)
    kind, interp = _profile_head(source, head)
    gpus = _count(where_h, head, "gpus_per_replica", 1)
    tokens, step_ms, std = _target_table(source, target)
    limits = _engine_limits(f"{source} [engine]", _table(source, data, "engine"))
    drafts_table = _table(source, data, "draft")
    drafts = {str(name): _draft_cost(f"{source} [draft.{name}]", d)
              for name, d in drafts_table.items()}
    params = head.get("parameters", {})
    if not isinstance(params, dict):
        raise InputError(source, "[profile.parameters] must be a table")
    default_trace = None
    if "default_trace" in head:
        # a built-in profile's path could only be the package's own folder: names only
        base = None if source.startswith(("builtin:", "<")) else Path(source).parent
        default_trace = check_default_trace(where_h, head["default_trace"], base)
    return EngineProfile(
        name=str(head.get("name", Path(source).stem)),
        kind=kind,
        gpus_per_replica=gpus,
        tokens=tokens.astype(np.int64),
        step_s=step_ms / 1e3,
        step_std_s=std,
        kv_s_per_token=_number(where_t, target, "kv_us_per_token") / 1e6,
        logits_s_per_row=_number(where_t, target, "logits_us_per_row") / 1e6,
        attn_s_per_query_ctx=_number(where_t, target, "attn_ns_per_query_ctx") / 1e9,
        multi_kv_s_per_token=_number(where_t, target, "multi_kv_us_per_token") / 1e6,
        request_s=_number(where_t, target, "request_us") / 1e6,
        frontend_s_per_request=_number(where_t, target, "frontend_us_per_request") / 1e6,
        attn_window_tokens=_count(where_t, target, "attn_window_tokens"),
        eager_penalty_s=_number(where_t, target, "eager_penalty_ms") / 1e3,
        interpolation=interp,
        drafts=drafts,
        limits=limits,
        description=str(head.get("description", "")),
        parameters=dict(params),
        source=source,
        default_trace=default_trace,
        default_replicas=_count(where_h, head, "default_replicas", maximum=MAX_REPLICAS),
    )


def _profile_head(source: str, head: dict) -> tuple[str, str]:
    """The ``[profile]`` table's strings checked; its kind and interpolation."""
    for key in ("name", "description"):  # name = 5 would show as "5"
        if not isinstance(head.get(key, ""), str):
            raise InputError(f"{source} [profile]", f"'{key}' must be a string, got "
                                                    f"{head[key]!r}")
    kind = head.get("kind", "analytic")
    if kind not in PROFILE_KINDS:
        raise InputError(source, f"[profile] kind must be one of {PROFILE_KINDS}, got {kind!r}")
    interp = head.get("interpolation", "step")
    if interp not in INTERPOLATIONS:
        raise InputError(source, f"[profile] interpolation must be one of {INTERPOLATIONS}")
    return kind, interp


def _target_table(source: str, target: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The ``[target]`` table's step times: (tokens, step_ms, step_std_s or None)."""
    where_t = f"{source} [target]"
    tokens = _array(where_t, target, "tokens")
    step_ms = _array(where_t, target, "step_ms")
    if tokens.shape != step_ms.shape:
        raise InputError(source, "[target] tokens and step_ms differ in length")
    if np.any(np.diff(tokens) <= 0) or np.any(tokens != np.round(tokens)):
        raise InputError(source, "[target] tokens must be strictly increasing integers")
    if tokens[-1] > MAX_PROFILE_TOKENS:
        raise InputError(source, f"[target] tokens above {MAX_PROFILE_TOKENS:,} are not supported")
    std = None
    if "step_std_ms" in target:
        std = _array(where_t, target, "step_std_ms", positive=False) / 1e3
        if std.shape != tokens.shape:
            raise InputError(source, "[target] step_std_ms differs in length from tokens")
    return tokens, step_ms, std


def _engine_limits(where: str, engine: dict) -> EngineLimits:
    """The ``[engine]`` table's limits, each within its :class:`Limit`'s bound."""
    check_known_keys(where, engine, ENGINE_LIMITS)
    values = {}
    for name, lim in LIMITS.items():
        if not lim.choices:
            values[name] = _count(where, engine, name, maximum=lim.maximum)
            continue
        v = engine.get(name)
        if v is not None and v not in lim.choices:
            raise InputError(where, f"'{name}' must be one of {', '.join(lim.choices)}, "
                                    f"got {v!r}")
        values[name] = v
    return EngineLimits(**values)


def builtin_profiles() -> list[str]:
    root = resources.files("dspark_sim.calibration") / "data"
    return sorted(p.name[: -len(".toml")] for p in root.iterdir() if p.name.endswith(".toml"))


DEFAULT_PROFILE = "v4flash-h200"


def load_profile(path_or_name: str | Path | None = None) -> EngineProfile:
    """Load a profile from a TOML path or a built-in name (default: the V4-like H200 one)."""
    spec = str(path_or_name) if path_or_name is not None else DEFAULT_PROFILE
    if not spec.strip():  # Path("") is the working directory: name the option instead
        raise InputError("--profile", "empty profile name or path")
    p = Path(spec)
    if p.suffix.lower() == ".toml" or p.exists():
        if not p.is_file():
            raise InputError(spec, not_a_file(p, "profile file"))
        source = str(p)
        try:
            text = p.read_text(encoding="utf-8-sig")  # a BOM is not TOML
        except UnicodeDecodeError:
            raise InputError(source, "not a TOML profile (binary or not UTF-8)") from None
        except OSError as exc:
            raise InputError(source, f"cannot read profile ({exc.strerror or exc})") from None
    else:
        res = resources.files("dspark_sim.calibration") / "data" / f"{spec}.toml"
        if not res.is_file():
            raise InputError(
                "--profile", f"unknown profile {spec!r}; built-in: {', '.join(builtin_profiles())}"
            )
        text = res.read_text()
        source = f"builtin:{spec}"
    try:
        data = loads_toml(text)
    except tomllib.TOMLDecodeError as exc:
        raise InputError(source, f"invalid TOML: {exc}") from exc
    return profile_from_dict(data, source)
