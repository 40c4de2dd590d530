"""The SimPy engine: replicas that step whole batches, a router, arrival sources.

One SimPy process per replica; one event per engine step (never per token, Vidur
style). A replica's running batch is a small int64 matrix (one row per request,
columns below) so every step is a handful of vectorised numpy operations.

A step, in order:

1. admit waiting requests under ``max_num_seqs`` and the KV capacity;
2. if the committed KV (prompt + generated + verify slots) exceeds capacity,
   preempt the newest requests (recompute, as vLLM does) -- counted, never silent;
3. the policy chooses ``l`` per decoding request from a read-only snapshot;
4. verify tokens (``n + sum l``) are scheduled first; chunked prefill takes what is
   left of ``max_num_batched_tokens`` (so over-verification delays prefill);
5. step time = draft cost + target cost at ``B`` batch tokens + KV-read term;
6. replay: a decoding request at output position ``t`` accepts ``min(l, m_t)`` and
   emits one bonus token; requests finishing prefill emit their first token.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import simpy
from dspark_sim.calibration.confmap import CalibrationMap
from dspark_sim.calibration.profile import EngineProfile
from dspark_sim.policies.base import BatchSnapshot, readonly
from dspark_sim.policies.registry import Policy
from dspark_sim.sim.config import SimConfig
from dspark_sim.traces.schema import AcceptanceTrace

# Columns of the running-batch matrix.
RID, PROMPT, NEED, FILLED, GEN, GEN0, OUT, TOFF, TLEN = range(9)
NCOLS = 9

# Inter-token-latency histogram: log-spaced bins from 10 us to 1000 s.
ITL_EDGES_S = np.logspace(-5, 3, 801)


@dataclass
class RequestLog:
    """Per-request outcome arrays, indexed by request id (filled during the run)."""

    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    trace_row: np.ndarray
    replica: np.ndarray
    first_token_s: np.ndarray
    finish_s: np.ndarray
    steps: np.ndarray  # decode (verification) steps
    draft_tokens_verified: np.ndarray  # sum of l over its steps
    accepted_tokens: np.ndarray  # sum of min(l, m) over its steps
    generated: np.ndarray
    preemptions: np.ndarray

    @classmethod
    def empty(cls, n: int) -> RequestLog:
        nan = np.full(n, np.nan)
        z = np.zeros(n, np.int64)
        return cls(nan.copy(), z.copy(), z.copy(), z.copy(), np.full(n, -1, np.int64),
                   nan.copy(), nan.copy(), z.copy(), z.copy(), z.copy(), z.copy(), z.copy())


@dataclass
class StepStats:
    """Aggregates over all engine steps of all replicas."""

    gamma: int
    steps: int = 0
    busy_s: float = 0.0
    request_steps: int = 0  # sum over steps of decoding requests
    verify_tokens: int = 0  # sum of (1 + l)
    prefill_tokens: int = 0
    batch_tokens: int = 0
    budget_limited_steps: int = 0

    def __post_init__(self) -> None:
        self.accept_hist = np.zeros(self.gamma + 2, np.int64)  # index = accepted count
        self.ell_hist = np.zeros(self.gamma + 2, np.int64)
        self.itl_hist = np.zeros(len(ITL_EDGES_S) + 1, np.int64)
        self.itl_sum_s = 0.0


class Replica:
    """One engine replica (N GPUs) stepping its whole batch per SimPy event."""

    def __init__(self, index: int, ctx: SimContext) -> None:
        self.index = index
        self.ctx = ctx
        self.waiting: deque[np.ndarray] = deque()
        self.batch = np.empty((0, NCOLS), np.int64)
        self.last_token_s = np.empty(0, np.float64)
        self.wake: simpy.Event | None = None
        self.lag: deque[tuple[np.ndarray, np.ndarray]] = deque(maxlen=2)
        self.steps = 0
        self.preemptions = 0

    @property
    def outstanding(self) -> int:
        return len(self.waiting) + len(self.batch)

    def submit(self, row: np.ndarray) -> None:
        self.waiting.append(row)
        if self.wake is not None and not self.wake.triggered:
            self.wake.succeed()

    # -- admission and KV --------------------------------------------------------------
    def _committed_kv(self, b: np.ndarray) -> int:
        if self.ctx.reserve:
            return int((b[:, PROMPT] + b[:, OUT]).sum())
        return int((b[:, NEED] + b[:, GEN] - b[:, GEN0]).sum())

    def _admit(self) -> None:
        c = self.ctx
        room = c.max_num_seqs - len(self.batch)
        if room <= 0 or not self.waiting:
            return
        used = self._committed_kv(self.batch) + len(self.batch) * c.verify_slots
        rows = []
        while self.waiting and room > 0:
            r = self.waiting[0]
            need = (r[PROMPT] + r[OUT]) if c.reserve else (r[NEED] + c.verify_slots)
            if used + need > c.kv_capacity and (len(self.batch) or rows):
                break  # head-of-line blocks (FCFS), as in vLLM
            self.waiting.popleft()
            rows.append(r)
            used += need
            room -= 1
        if rows:
            self.batch = np.vstack([self.batch, np.stack(rows)])
            self.last_token_s = np.concatenate([self.last_token_s, np.full(len(rows), np.nan)])

    def _preempt_if_full(self) -> None:
        c = self.ctx
        if c.reserve or len(self.batch) <= 1:
            return
        b = self.batch
        kv = b[:, NEED] + b[:, GEN] - b[:, GEN0] + c.verify_slots
        total = int(kv.sum())
        if total <= c.kv_capacity:
            return
        # Free the newest requests first (vLLM recompute preemption), keep at least one.
        excess = total - c.kv_capacity
        freed = np.cumsum(kv[::-1])
        k = min(int(np.searchsorted(freed, excess)) + 1, len(b) - 1)
        victims = b[len(b) - k:].copy()
        self.batch = b[: len(b) - k]
        self.last_token_s = self.last_token_s[: len(b) - k]
        for r in victims[::-1]:  # newest first -> ends up in admission order at the front
            r[GEN0] = r[GEN]
            r[NEED] = r[PROMPT] + r[GEN]  # recompute prompt and generated tokens
            r[FILLED] = 0
            self.waiting.appendleft(r)
        c.log.preemptions[victims[:, RID]] += 1
        self.preemptions += k

    # -- the step ------------------------------------------------------------------
    def run(self):
        c = self.ctx
        env = c.env
        prof = c.profile
        policy = c.policy
        trace_m = c.trace.accept_len if c.trace is not None else None
        gamma = c.gamma
        budget = c.max_num_batched_tokens
        log = c.log
        st = c.stats
        while True:
            if not len(self.batch) and not self.waiting:
                self.wake = env.event()
                yield self.wake
                self.wake = None
            self._admit()
            self._preempt_if_full()
            b = self.batch
            decoding = b[:, FILLED] >= b[:, NEED]
            di = np.flatnonzero(decoding)
            pi = np.flatnonzero(~decoding)
            n_dec = di.size

            # 3. verification lengths
            if n_dec and gamma:
                idx = b[di, TOFF] + (b[di, GEN] - 1) % b[di, TLEN]
                m = trace_m[idx].astype(np.int64)
                ell = self._decide(idx, n_dec, pi, b)
                ell = np.minimum(ell, gamma)
                over = n_dec + int(ell.sum()) - budget
                if over > 0:  # never exceed the token budget: trim uniformly
                    ell = np.minimum(ell, max(0, (budget - n_dec) // n_dec))
                    st.budget_limited_steps += 1
            else:
                m = ell = np.zeros(n_dec, np.int64)
            verify_tokens = n_dec + int(ell.sum())

            # 4. chunked prefill takes what verification left of the budget
            if pi.size:
                rem = b[pi, NEED] - b[pi, FILLED]
                left = max(0, budget - verify_tokens)
                before = np.cumsum(rem) - rem
                chunk = np.clip(np.minimum(rem, left - before), 0, None)
                prefill_tokens = int(chunk.sum())
            else:
                chunk = None
                prefill_tokens = 0
            batch_tokens = verify_tokens + prefill_tokens
            if batch_tokens == 0:
                # Nothing fits (a prompt larger than the budget cannot happen: chunks
                # always make progress). Defensive: never spin at zero time.
                raise RuntimeError("engine step with no work")

            # 5. step time
            kv_tokens = int((b[:, FILLED] + b[:, GEN] - b[:, GEN0]).sum())
            draft_s = c.draft_time(n_dec) if n_dec else 0.0
            dt = draft_s + c.target_time(batch_tokens) + prof.kv_s_per_token * kv_tokens
            yield env.timeout(dt)
            now = env.now

            # 6. replay
            self.steps += 1
            st.steps += 1
            st.busy_s += dt
            st.batch_tokens += batch_tokens
            st.prefill_tokens += prefill_tokens
            if n_dec:
                acc = np.minimum(ell, m)
                adv = np.minimum(acc + 1, b[di, OUT] - b[di, GEN])
                b[di, GEN] += adv
                rids = b[di, RID]
                log.steps[rids] += 1
                log.draft_tokens_verified[rids] += ell
                log.accepted_tokens[rids] += acc
                gaps = now - self.last_token_s[di]
                self.last_token_s[di] = now
                st.itl_sum_s += float(gaps.sum())
                st.itl_hist += np.bincount(np.searchsorted(ITL_EDGES_S, gaps),
                                           minlength=st.itl_hist.size)
                st.accept_hist += np.bincount(acc, minlength=st.accept_hist.size)
                st.ell_hist += np.bincount(ell, minlength=st.ell_hist.size)
                st.request_steps += n_dec
                st.verify_tokens += verify_tokens
            if chunk is not None:
                b[pi, FILLED] += chunk
                done = pi[b[pi, FILLED] >= b[pi, NEED]]
                if done.size:
                    b[done, GEN] += 1  # the step that completes prefill samples a token
                    rids = b[done, RID]
                    first = log.first_token_s[rids]
                    log.first_token_s[rids] = np.where(np.isnan(first), now, first)
                    self.last_token_s[done] = now
            fin = b[:, GEN] >= b[:, OUT]
            if fin.any():
                rids = b[fin, RID]
                log.finish_s[rids] = now
                log.generated[rids] = b[fin, GEN]
                keep = ~fin
                self.batch = b[keep]
                self.last_token_s = self.last_token_s[keep]
                c.on_finish(len(rids))

    def _decide(self, idx: np.ndarray, n_dec: int, pi: np.ndarray, b: np.ndarray) -> np.ndarray:
        c = self.ctx
        policy = c.policy
        if not c.needs_survival:
            return policy(BatchSnapshot(c.empty_survival(n_dec), c.gamma, c.max_num_batched_tokens))
        survival = c.calibration.survival(c.trace.conf[idx])
        sps = None
        if policy.needs_sps:
            # B for i admitted draft tokens: n + i verify tokens plus whatever prefill
            # still fits in the budget (verification displaces prefill).
            pending = int((b[pi, NEED] - b[pi, FILLED]).sum()) if pi.size else 0
            i = np.arange(n_dec * c.gamma + 1)
            verify = n_dec + i
            total = np.minimum(verify + pending, c.max_num_batched_tokens)
            kv = int((b[:, FILLED] + b[:, GEN] - b[:, GEN0]).sum())
            t = c.draft_time(n_dec) + c.profile.target_time_s(total) + c.profile.kv_s_per_token * kv
            sps = np.where(verify <= c.max_num_batched_tokens, 1.0 / t, 0.0)
        lag_s = lag_sps = None
        if policy.needs_lag and len(self.lag) == 2:
            lag_s, lag_sps = self.lag[0]
        snap = BatchSnapshot(
            survival=readonly(survival),
            gamma_max=c.gamma,
            token_budget=c.max_num_batched_tokens,
            sps=None if sps is None else readonly(sps),
            lagged_survival=lag_s,
            lagged_sps=lag_sps,
        )
        ell = np.asarray(policy(snap), dtype=np.int64)
        if policy.needs_lag:
            self.lag.append((snap.survival, snap.sps))
        return ell


class SimContext:
    """Everything the replicas share: config, profile, trace, policy, outputs."""

    def __init__(self, cfg: SimConfig, profile: EngineProfile, policy: Policy,
                 trace: AcceptanceTrace | None, calibration: CalibrationMap,
                 log: RequestLog, on_finish: Callable[[int], None]) -> None:
        self.env = simpy.Environment()
        self.cfg = cfg
        self.profile = profile
        self.policy = policy
        self.trace = trace
        self.calibration = calibration
        self.log = log
        self._on_finish = on_finish
        e = cfg.engine
        self.max_num_seqs = e.max_num_seqs
        self.max_num_batched_tokens = e.max_num_batched_tokens
        self.kv_capacity = e.kv_capacity_tokens
        self.reserve = e.kv_mode == "reserve"
        self.gamma = 0 if (trace is None or policy.drafter is None) else trace.gamma_max
        self.draft_gamma = (policy.draft_gamma if policy.draft_gamma is not None else self.gamma)
        self.draft_gamma = min(self.draft_gamma, self.gamma)
        self.verify_slots = 1 + self.draft_gamma
        self.needs_survival = policy.needs_survival
        self._draft_key = None
        if policy.drafter is not None and self.draft_gamma > 0:
            key = trace.meta.drafter if trace.meta.drafter in profile.drafts else policy.drafter
            self._draft_key = key
            profile.draft_time_s(key, 1, self.draft_gamma)  # fail early on a missing section
        self._tokens = [int(x) for x in profile.tokens]
        self._steps = [float(x) for x in profile.step_s]
        self._draft_cache: dict[int, float] = {}
        self.stats = StepStats(self.gamma)
        self.replicas = [Replica(i, self) for i in range(cfg.deployment.replicas)]
        self._empty: dict[int, np.ndarray] = {}

    def empty_survival(self, n: int) -> np.ndarray:
        s = self._empty.get(n)
        if s is None:
            s = readonly(np.zeros((n, self.gamma)))
            self._empty[n] = s
        return s

    def target_time(self, b: int) -> float:
        # Scalar fast path of EngineProfile.target_time_s (the hot loop calls it per step).
        if self.profile.interpolation == "step" and b <= self._tokens[-1]:
            return self._steps[bisect.bisect_left(self._tokens, b)]
        return float(self.profile.target_time_s(b))

    def draft_time(self, n: int) -> float:
        if self._draft_key is None:
            return 0.0
        t = self._draft_cache.get(n)
        if t is None:
            t = self.profile.draft_time_s(self._draft_key, n, self.draft_gamma)
            self._draft_cache[n] = t
        return t

    def on_finish(self, k: int) -> None:
        self._on_finish(k)


class Router:
    def __init__(self, replicas: list[Replica], kind: str) -> None:
        self.replicas = replicas
        self.kind = kind
        self._next = 0

    def route(self) -> Replica:
        if self.kind == "round-robin" or len(self.replicas) == 1:
            r = self.replicas[self._next % len(self.replicas)]
            self._next += 1
            return r
        loads = [r.outstanding for r in self.replicas]
        return self.replicas[loads.index(min(loads))]
