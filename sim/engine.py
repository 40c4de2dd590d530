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
from dspark_sim.errors import InputError
from dspark_sim.policies.base import BatchSnapshot, readonly
from dspark_sim.policies.registry import Policy
from dspark_sim.sim.config import SimConfig
from dspark_sim.traces.schema import AcceptanceTrace

# Columns of the running-batch matrix. STEPS/VERIFIED/ACCEPTED are per-request
# counters kept in the batch (cheap column updates) and flushed to the log when the
# request leaves the batch.
RID, PROMPT, NEED, FILLED, GEN, GEN0, OUT, TOFF, TLEN, STEPS, VERIFIED, ACCEPTED = range(12)
NCOLS = 12

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
    kv_blocked_steps: int = 0  # steps whose admission stopped at the KV capacity

    def __post_init__(self) -> None:
        self.accept_hist = np.zeros(self.gamma + 2, np.int64)  # index = accepted count
        self.ell_hist = np.zeros(self.gamma + 2, np.int64)
        self.itl_hist = np.zeros(len(ITL_EDGES_S) + 1, np.int64)
        self.itl_sum_s = 0.0


class Replica:
    """One engine replica (N GPUs) stepping its whole batch per SimPy event.

    Aggregates the step needs every time (KV tokens held, prefill tokens pending,
    rows still prefilling) are kept as Python ints and updated incrementally, so the
    common all-decoding step costs ~25 small numpy operations and no full-batch sums.
    """

    def __init__(self, index: int, ctx: SimContext) -> None:
        self.index = index
        self.ctx = ctx
        # Waiting request ids; their rows live in ctx.rows (preempted rows are written
        # back there), so admission is one fancy index, not a stack of small arrays.
        self.waiting: deque[int] = deque()
        self.batch = np.empty((0, NCOLS), np.int64)
        self.wake: simpy.Event | None = None
        self.lag: deque[tuple[np.ndarray, np.ndarray]] = deque(maxlen=2)
        self.kv_tokens = 0  # sum(FILLED + GEN - GEN0): KV held by the batch
        self.pending_prefill = 0  # sum(NEED - FILLED)
        self.n_prefilling = 0  # rows with FILLED < NEED

    @property
    def outstanding(self) -> int:
        return len(self.waiting) + len(self.batch)

    def submit(self, rid: int) -> None:
        self.waiting.append(rid)
        if self.wake is not None and not self.wake.triggered:
            self.wake.succeed()

    def check_invariants(self) -> None:
        """The incremental aggregates equal their definitions (used by tests)."""
        b = self.batch
        assert self.kv_tokens == int((b[:, FILLED] + b[:, GEN] - b[:, GEN0]).sum())
        assert self.pending_prefill == int((b[:, NEED] - b[:, FILLED]).sum())
        prefilling = b[:, FILLED] < b[:, NEED]
        assert self.n_prefilling == int(prefilling.sum())
        # decoding rows first, then prefilling rows (what makes both groups slices)
        assert not prefilling[: len(b) - self.n_prefilling].any()

    # -- admission and KV --------------------------------------------------------------
    def _committed_kv(self) -> int:
        # Preempt mode: prompt (being) prefilled + generated + verify slots.
        return self.kv_tokens + self.pending_prefill + len(self.batch) * self.ctx.verify_slots

    def _admit(self) -> None:
        c = self.ctx
        room = c.max_num_seqs - len(self.batch)
        if room <= 0 or not self.waiting:
            return
        if c.reserve:
            b = self.batch
            used = int((b[:, PROMPT] + b[:, OUT]).sum())
        else:
            used = self._committed_kv()
        rows = c.rows
        need_col = c.admit_need
        taken: list[int] = []
        while self.waiting and room > 0:
            rid = self.waiting[0]
            need = int(need_col[rid]) if c.reserve else int(rows[rid, NEED]) + c.verify_slots
            if used + need > c.kv_capacity and (len(self.batch) or taken):
                c.stats.kv_blocked_steps += 1  # held back for KV: counted, never silent
                break  # head-of-line blocks (FCFS), as in vLLM
            self.waiting.popleft()
            taken.append(rid)
            used += need
            room -= 1
        if taken:
            new = rows[taken]
            self.batch = np.concatenate([self.batch, new])
            # admitted rows have FILLED = 0 and GEN = GEN0 (new or recompute-preempted)
            self.pending_prefill += int(new[:, NEED].sum())
            self.n_prefilling += len(taken)

    def _remove(self, keep: np.ndarray, *, finished: bool = False) -> np.ndarray:
        """Drop rows where ``keep`` is False; returns them, aggregates updated.
        ``finished`` rows are fully prefilled, so only the KV count changes."""
        b = self.batch
        gone = b[~keep]
        self.batch = b[keep]
        self.kv_tokens -= int(gone[:, FILLED].sum() + gone[:, GEN].sum() - gone[:, GEN0].sum())
        if not finished:
            self.pending_prefill -= int((gone[:, NEED] - gone[:, FILLED]).sum())
            self.n_prefilling -= int(np.count_nonzero(gone[:, FILLED] < gone[:, NEED]))
        log = self.ctx.log
        rids = gone[:, RID]
        log.steps[rids] += gone[:, STEPS]
        log.draft_tokens_verified[rids] += gone[:, VERIFIED]
        log.accepted_tokens[rids] += gone[:, ACCEPTED]
        return gone

    def _preempt_if_full(self) -> None:
        c = self.ctx
        if c.reserve or len(self.batch) <= 1 or self._committed_kv() <= c.kv_capacity:
            return
        b = self.batch
        kv = b[:, NEED] + b[:, GEN] - b[:, GEN0] + c.verify_slots
        # Free the newest requests first (vLLM recompute preemption), keep at least one.
        freed = np.cumsum(kv[::-1])
        k = min(int(np.searchsorted(freed, self._committed_kv() - c.kv_capacity)) + 1, len(b) - 1)
        keep = np.ones(len(b), bool)
        keep[len(b) - k:] = False
        victims = self._remove(keep)
        victims[:, STEPS:] = 0
        victims[:, GEN0] = victims[:, GEN]
        victims[:, NEED] = victims[:, PROMPT] + victims[:, GEN]  # recompute prompt + output
        victims[:, FILLED] = 0
        c.rows[victims[:, RID]] = victims
        # newest first -> the victims end up at the queue front in admission order
        self.waiting.extendleft(victims[::-1, RID].tolist())
        c.log.preemptions[victims[:, RID]] += 1

    # -- the step ------------------------------------------------------------------
    def run(self):
        c = self.ctx
        env = c.env
        kv_s_per_token = c.profile.kv_s_per_token
        logits_s_per_row = c.profile.logits_s_per_row
        attn_s = c.profile.attn_s_per_query_ctx
        multi_kv_s = c.profile.multi_kv_s_per_token
        request_s = c.profile.request_s
        trace_m = c.trace.accept_len if c.trace is not None else None
        gamma = c.gamma
        budget = c.max_num_batched_tokens
        log = c.log
        st = c.stats
        itl_edges = ITL_EDGES_S.tolist()
        n_hist = st.accept_hist.size
        while True:
            if not len(self.batch) and not self.waiting:
                self.wake = env.event()
                yield self.wake
                self.wake = None
            self._admit()
            self._preempt_if_full()
            b = self.batch
            # Rows are ordered [decoding | prefilling]: admission appends, prefill chunks
            # are handed out FCFS so prefills complete in row order, and removal keeps
            # order. Both groups are therefore slices (views), never fancy indexes.
            n_dec = len(b) - self.n_prefilling
            di = slice(0, n_dec)
            pi = slice(n_dec, None) if self.n_prefilling else None

            # 3. verification lengths
            if n_dec and gamma:
                idx = b[di, TOFF] + (b[di, GEN] - 1) % b[di, TLEN]
                m = trace_m[idx]
                ell = self._decide(idx, n_dec, b)
                np.minimum(ell, gamma, out=ell)
                ell_sum = int(ell.sum())
                if n_dec + ell_sum > budget:  # never exceed the token budget: trim uniformly
                    np.minimum(ell, max(0, (budget - n_dec) // n_dec), out=ell)
                    ell_sum = int(ell.sum())
                    st.budget_limited_steps += 1
            else:
                m = ell = np.zeros(n_dec, np.int64)
                ell_sum = 0
            verify_tokens = n_dec + ell_sum

            # 4. chunked prefill takes what verification left of the budget
            prefill_tokens = 0
            if pi is not None:
                rem = b[pi, NEED] - b[pi, FILLED]
                left = max(0, budget - verify_tokens)
                before = np.cumsum(rem) - rem
                chunk = np.maximum(np.minimum(rem, left - before), 0)
                prefill_tokens = int(chunk.sum())
            batch_tokens = verify_tokens + prefill_tokens
            if batch_tokens == 0:  # cannot happen: a prefill chunk always makes progress
                raise RuntimeError("engine step with no work")

            # 5. step time: draft + target at B tokens + KV reads of the batch + the LM
            # head for rows whose logits are needed (verify rows, finishing prefills)
            dt = (c.draft_time(n_dec) if n_dec else 0.0) + c.target_time(batch_tokens) \
                + kv_s_per_token * self.kv_tokens
            if logits_s_per_row:
                finishing = 0
                if prefill_tokens:
                    finishing = int(np.count_nonzero(chunk == rem))
                dt += logits_s_per_row * (verify_tokens + finishing)
            if attn_s or multi_kv_s or request_s:
                qc, mkv, nrq = self._attention_units(b, di, ell, n_dec, pi,
                                                     chunk if prefill_tokens else None)
                dt += attn_s * qc + multi_kv_s * mkv + request_s * nrq
            yield env.timeout(dt)
            now = env.now

            # 6. replay
            st.steps += 1
            st.busy_s += dt
            st.batch_tokens += batch_tokens
            st.prefill_tokens += prefill_tokens
            if n_dec:
                acc = np.minimum(ell, m)
                gen = b[di, GEN]
                adv = np.minimum(acc + 1, b[di, OUT] - gen)
                b[di, GEN] = gen + adv
                b[di, STEPS] += 1
                b[di, VERIFIED] += ell
                b[di, ACCEPTED] += acc
                self.kv_tokens += int(adv.sum())
                # Every decoding request gets a token every step, and its previous token
                # came at the end of the previous step: its inter-token gap is this dt.
                st.itl_hist[bisect.bisect_left(itl_edges, dt)] += n_dec
                st.itl_sum_s += dt * n_dec
                st.accept_hist += np.bincount(acc, minlength=n_hist)
                st.ell_hist += np.bincount(ell, minlength=n_hist)
                st.request_steps += n_dec
                st.verify_tokens += verify_tokens
            if prefill_tokens:
                b[pi, FILLED] += chunk
                self.kv_tokens += prefill_tokens
                self.pending_prefill -= prefill_tokens
                n_done = int(np.count_nonzero(b[pi, FILLED] >= b[pi, NEED]))
                if n_done:
                    done = slice(n_dec, n_dec + n_done)  # prefills complete in row order
                    b[done, GEN] += 1  # the step that completes prefill samples a token
                    self.kv_tokens += n_done
                    self.n_prefilling -= n_done
                    rids = b[done, RID]
                    first = log.first_token_s[rids]
                    log.first_token_s[rids] = np.where(np.isnan(first), now, first)
            fin = b[:, GEN] >= b[:, OUT]
            if fin.any():
                gone = self._remove(~fin, finished=True)
                rids = gone[:, RID]
                log.finish_s[rids] = now
                log.generated[rids] = gone[:, GEN]
                c.on_finish(len(rids))

    @staticmethod
    def _attention_units(b, di, ell, n_dec, pi, chunk) -> tuple[float, float, int]:
        """The step's units of the profile's context-dependent terms, in one pass over the
        batch slices: (sum over rows of query tokens x attended context, context tokens
        attended by multi-token query blocks, requests with a KV context). A decoding row
        is a multi-token block when it verifies ``l >= 1`` drafts; a prefill chunk of
        ``c`` after ``f`` filled tokens attends ``c * (f + c / 2)`` and is a multi-token
        block with a context when ``f > 0``."""
        qc = mkv = 0.0
        nrq = n_dec
        if n_dec:
            ctx = b[di, FILLED] + b[di, GEN] - b[di, GEN0]
            qc += float(((1 + ell) * ctx).sum())
            mkv += float(ctx[ell > 0].sum())
        if chunk is not None:
            filled = b[pi, FILLED]
            qc += float((chunk * (filled + chunk / 2.0)).sum())
            cont = (chunk > 0) & (filled > 0)
            mkv += float(filled[cont].sum())
            nrq += int(np.count_nonzero(cont))
        return qc, mkv, nrq

    def _decide(self, idx: np.ndarray, n_dec: int, b: np.ndarray) -> np.ndarray:
        c = self.ctx
        policy = c.policy
        if not c.needs_survival:
            return policy(BatchSnapshot(c.empty_survival(n_dec), c.gamma, c.max_num_batched_tokens))
        survival = c.trace_survival[idx]
        sps = None
        if policy.needs_sps:
            # B for i admitted draft tokens: n + i verify tokens plus whatever prefill
            # still fits in the budget (verification displaces prefill).
            # The scheduler's own table (``policy_profile``; by default the cost profile).
            sp = c.sps_profile
            verify = n_dec + c.arange(n_dec * c.gamma + 1)
            total = np.minimum(verify + self.pending_prefill, c.max_num_batched_tokens)
            t = c.sps_dense_step_s[total]
            t += c.sps_draft_time(n_dec) + sp.kv_s_per_token * self.kv_tokens
            t += sp.verify_terms_s(verify, n_dec, self.kv_tokens / max(1, len(b)))
            sps = np.reciprocal(t, out=t)
            over = n_dec * (1 + c.gamma) - c.max_num_batched_tokens
            if over > 0:
                sps[-over:] = 0.0
        lag_s = lag_sps = None
        if policy.needs_lag and len(self.lag) == 2:
            lag_s, lag_sps = self.lag[0]
        # Both arrays are fresh (gathered / computed this step): freeze them in place.
        survival.flags.writeable = False
        if sps is not None:
            sps.flags.writeable = False
        snap = BatchSnapshot(
            survival=survival,
            gamma_max=c.gamma,
            token_budget=c.max_num_batched_tokens,
            sps=sps,
            lagged_survival=lag_s,
            lagged_sps=lag_sps,
        )
        ell = policy(snap)
        if ell.dtype != np.int64 or not ell.flags.writeable:
            ell = np.array(ell, dtype=np.int64)  # the engine trims it in place
        if policy.needs_lag:
            self.lag.append((snap.survival, snap.sps))
        return ell


class SimContext:
    """Everything the replicas share: config, profile, trace, policy, outputs."""

    def __init__(self, cfg: SimConfig, profile: EngineProfile, policy: Policy,
                 trace: AcceptanceTrace | None, calibration: CalibrationMap,
                 log: RequestLog, on_finish: Callable[[int], None],
                 policy_profile: EngineProfile | None = None) -> None:
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
        # Survival depends only on a trace row and the calibration map: compute it once
        # for the whole trace (N x gamma float64) instead of per step.
        self.trace_survival = (calibration.survival(trace.conf)
                               if self.needs_survival and trace is not None else None)
        self._draft_key = None
        if policy.drafter is not None and self.draft_gamma > 0:
            key = trace.meta.drafter if trace.meta.drafter in profile.drafts else policy.drafter
            self._draft_key = key
            profile.draft_time_s(key, 1, self.draft_gamma)  # fail early on a missing section
        # Target time for every B in 0..max_num_batched_tokens, looked up once: the hot
        # loop then indexes instead of searching (8k floats, 64 KiB).
        self.dense_step_s = np.asarray(
            profile.target_time_s(np.arange(self.max_num_batched_tokens + 1)), dtype=np.float64)
        self._dense_list = self.dense_step_s.tolist()
        self._draft_cache: dict[int, float] = {}
        # The table the *scheduler* believes (SPS curve of the confidence policies): the
        # cost profile unless a separate one is given, e.g. the profile a real server's
        # scheduler was configured with while the step costs come from another source,
        # or a what-if on a stale / mis-calibrated SPS table.
        self.sps_profile = policy_profile if policy_profile is not None else profile
        if self.sps_profile is profile:
            self.sps_dense_step_s = self.dense_step_s
            self.sps_draft_time = self.draft_time
        else:
            sp = self.sps_profile
            self.sps_dense_step_s = np.asarray(
                sp.target_time_s(np.arange(self.max_num_batched_tokens + 1)), dtype=np.float64)
            key = self._draft_key
            if key is not None and key not in sp.drafts:
                raise InputError(sp.source, f"policy profile has no [draft.{key}] section")
            cache: dict[int, float] = {}

            def sps_draft_time(n: int) -> float:
                if key is None:
                    return 0.0
                if n not in cache:
                    cache[n] = sp.draft_time_s(key, n, self.draft_gamma)
                return cache[n]

            self.sps_draft_time = sps_draft_time
        self.stats = StepStats(self.gamma)
        self.replicas = [Replica(i, self) for i in range(cfg.deployment.replicas)]
        self.rows = np.empty((0, NCOLS), np.int64)  # every request's row, set by the runner
        self.admit_need = np.empty(0, np.int64)  # reserve mode: prompt + output per request

    def set_rows(self, rows: np.ndarray) -> None:
        self.rows = rows
        self.admit_need = rows[:, PROMPT] + rows[:, OUT]
        self._empty: dict[int, np.ndarray] = {}
        self._arange = np.arange(4096, dtype=np.int64)

    def arange(self, n: int) -> np.ndarray:
        a = self._arange
        if a.size < n:
            a = self._arange = np.arange(max(n, 2 * a.size), dtype=np.int64)
        return a[:n]

    def empty_survival(self, n: int) -> np.ndarray:
        s = self._empty.get(n)
        if s is None:
            s = readonly(np.zeros((n, self.gamma)))
            self._empty[n] = s
        return s

    def target_time(self, b: int) -> float:
        # A step never exceeds the token budget, so the dense table covers every B.
        return self._dense_list[b]

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
