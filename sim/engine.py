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
from dataclasses import dataclass, replace
from dataclasses import fields as dataclass_fields
from functools import partial
from itertools import islice
from operator import attrgetter
from typing import NamedTuple

import numpy as np
import simpy

from dspark_sim.calibration.confmap import CalibrationMap
from dspark_sim.calibration.profile import EngineProfile, resolve_limits
from dspark_sim.errors import InputError
from dspark_sim.policies import compiled
from dspark_sim.policies.base import (
    ReplayView,
    StepCost,
    Verification,
    readonly,
)
from dspark_sim.policies.registry import Policy
from dspark_sim.sim import fast
from dspark_sim.sim.config import SimConfig
from dspark_sim.sim.cost import CostModel
from dspark_sim.sim.prefix_cache import PrefixCache, PromptBlocks
from dspark_sim.traces.cache import release_pages
from dspark_sim.traces.schema import AcceptanceTrace

# Columns of the running-batch matrix, one row per request. A request's row is built
# once (``request_rows``) and copied into a replica's batch on admission; a preempted row
# is written back with its prefill target reset (recompute, as vLLM does).
REQUEST_ID = 0  # index into the RequestLog
PROMPT_TOKENS = 1  # prompt length
PREFILL_TARGET = 2  # tokens to prefill on this admission (prompt, + output so far if preempted)
PREFILLED = 3  # of PREFILL_TARGET, already in the KV cache
GENERATED = 4  # output tokens emitted so far (the trace position is GENERATED - 1)
GENERATED_AT_ADMIT = 5  # GENERATED when admitted (those tokens are re-prefilled, not new KV)
OUTPUT_TOKENS = 6  # output length: the request finishes when GENERATED reaches it
TRACE_START = 7  # first row of the request's acceptance-trace request
TRACE_LEN = 8  # positions in that trace request (replay wraps modulo it)
# Per-request counters kept in the batch (cheap column updates), flushed to the log
# when the row leaves the batch.
STEPS = 9  # verification steps
VERIFIED = 10  # draft tokens verified (sum of l)
ACCEPTED = 11  # draft tokens accepted (sum of min(l, m))
NUM_COLUMNS = 12

# Why a request was refused at arrival (RequestLog.rejected): it can never be served.
REJECT_REASONS = {1: "max_model_len", 2: "kv_capacity"}


def _lengths(ell, policy: str, n_dec: int) -> np.ndarray:
    """A policy's verify lengths as the engine's own writable int64 array (it trims them
    in place). Any integer-valued array is taken; a wrong shape, a fraction or a
    negative length is the policy's bug, named here rather than as a numpy error later."""
    arr = np.asarray(ell)
    integral = np.issubdtype(arr.dtype, np.integer)  # the built-ins': one cheap check
    if arr.shape != (n_dec,) or not (integral or np.issubdtype(arr.dtype, np.floating)) \
            or (arr < 0).any() or (not integral and not (np.isfinite(arr)
                                                         & (arr == np.floor(arr))).all()):
        raise RuntimeError(f"policy {policy}: verify lengths must be {n_dec} non-negative "
                           f"integers, got {arr.dtype} {arr.shape}")
    if arr.dtype != np.int64 or not arr.flags.writeable or arr is not ell:
        return arr.astype(np.int64)  # a copy: the policy's array stays as it was
    return arr


_NO_CHUNK = np.zeros(0, np.int64)  # a step without prefill, to the compiled replay
BATCH_BUF_ROWS = 64  # a replica's first batch buffer (Replica.batch_buf)

# Inter-token-latency histogram: log-spaced bins from 10 us to 1000 s.
ITL_EDGES_S = np.logspace(-5, 3, 801)


class StepRecord(NamedTuple):
    """One engine step of one replica, as the per-step series keeps it (one row per step
    of any replica, in completion order): the steady-state window and its figures are
    computed from the series afterwards (``sim.metrics``)."""

    end_s: float
    dt_s: float
    replica: int
    decode_batch: int
    running: int  # batch rows at the step's end, before finished rows leave
    waiting: int
    batch_tokens: int
    prefill_tokens: int
    verified_drafts: int
    emitted_tokens: int  # accepted + bonus per decoding row, first tokens of prefills
    accepted_tokens: int  # drafts the verifier accepted
    unverified_tokens: int  # drafts committed without the verifier (lossy skips)
    # decoding rows whose drafter proposed (vLLM's drafts): all of them unless the trace
    # says an n-gram / lookup drafter found no match at some positions
    drafting_requests: int
    # prompt tokens the replica's prefix cache held, and did not hold, for the requests
    # admitted at the step's start (zeros without a cache in the replica: with
    # disaggregated prefill the prefill instances' cache counts in the summary and
    # requests.parquet, their steps not being in this series)
    prefix_hit_tokens: int
    prefix_miss_tokens: int


STEP_FIELDS = StepRecord._fields


class LossyStep(NamedTuple):
    """A tree or lossy policy's step, as it is priced and committed: the policy's replay
    of its plan (accepted drafts, changed tokens, state), which rows the verifier ran for
    (``bonus``; None: all), extra drafted tokens per row (tree branches) and KV writes of
    earlier unverified commits (``fill_tokens``)."""

    replay: object
    bonus: np.ndarray | None
    draft_tokens: np.ndarray | None
    fill_tokens: np.ndarray | None


class StepPlan(NamedTuple):
    """What one step verifies and prefills: ``ell`` and ``accepted`` per decoding row
    (the first ``n_dec`` rows of the batch), the tree or lossy part, the verify tokens
    it carries, and the prefill ``chunk`` per prefilling row (None: no prefilling rows)
    with the tokens each had ``remaining``."""

    n_dec: int
    ell: np.ndarray
    accepted: np.ndarray
    lossy: LossyStep | None
    verify_tokens: int
    chunk: np.ndarray | None
    remaining: np.ndarray | None
    prefill_tokens: int
    # the step's seconds where its decision's kernel priced it too (a decode-only chain
    # step: ``Replica._compiled_decision``), else None: ``Replica._step_time_s`` prices it
    step_s: float | None = None


# The step record's times; its other fields are counts, kept as int32 where they fit.
_STEP_TIMES = ("end_s", "dt_s")


class StepRecorder:
    """The per-step series: one row of a :class:`StepRecord`'s fields per engine step (15
    float64, 120 bytes; no per-token or per-request work) in a buffer of
    ``CHUNK_STEPS`` rows that, full, moves into a column a field: the times as float64,
    the counts as int32 (68 bytes a step; float64 from a chunk whose counts do not fit).
    Read as float64 (``metrics.StepSeries``), the same values. A chain step's replay
    kernel writes its row itself (``fast.replay_chain``, at :attr:`n_rows`; the engine
    then calls :meth:`advance`): a tuple of the fields converted a step costs more. A
    column grows by doubling into a fresh array, whose pages are memory only once
    written, and the one it replaces is returned to the system whole: chunks joined at
    the end, freed into the heap, would have held the series' size again."""

    CHUNK_STEPS = 4096
    FIRST_CAPACITY = 1 << 16

    def __init__(self) -> None:
        self.rows = np.empty((self.CHUNK_STEPS, len(STEP_FIELDS)))
        self.n_rows = 0  # steps in the buffer
        self._cols: dict[str, np.ndarray] = {}
        self._n = 0  # steps in the columns

    def record(self, fields: tuple) -> None:
        """One step's fields, in :class:`StepRecord`'s order."""
        self.rows[self.n_rows] = fields
        self.advance()

    def advance(self) -> None:
        """The buffer's next row has been written."""
        self.n_rows += 1
        if self.n_rows == self.CHUNK_STEPS:
            self._compact()

    def _compact(self) -> None:
        """The buffer's steps moved onto the columns; the buffer emptied."""
        a = self.rows[: self.n_rows]
        n, k = self._n, len(a)
        for i, name in enumerate(STEP_FIELDS):
            col = a[:, i]
            store = self._cols.get(name)
            if name in _STEP_TIMES or (store is not None and store.dtype == np.float64):
                dtype = np.float64
            else:
                with np.errstate(invalid="ignore"):  # a count past int32: float64 then
                    fits = np.array_equal(col.astype(np.int32), col)
                dtype = np.int32 if fits else np.float64
            if store is None or n + k > len(store) or store.dtype != dtype:
                grown = np.empty(max(self.FIRST_CAPACITY, 2 * (n + k)), dtype)
                if store is not None:
                    grown[:n] = store[:n]
                self._cols[name] = store = grown
            store[n: n + k] = col
        self.n_rows = 0
        self._n = n + k

    def columns(self) -> dict[str, np.ndarray]:
        """Every step recorded so far (since the last :meth:`take`), a column a field."""
        if self.n_rows:
            self._compact()
        if not self._n:
            return {name: np.zeros(0) for name in STEP_FIELDS}
        return {name: self._cols[name][: self._n] for name in STEP_FIELDS}

    def take(self) -> dict[str, np.ndarray]:
        """The steps recorded since the last call, as :meth:`columns`, and the recorder
        emptied: a streamed run spills the series in chunks instead of holding a day's
        steps."""
        cols = self.columns()
        self._cols, self._n = {}, 0
        return cols


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
    accepted_tokens: np.ndarray  # sum of min(l, m) over its steps: what the verifier accepted
    generated: np.ndarray
    preemptions: np.ndarray
    rejected: np.ndarray  # 0, or a REJECT_REASONS code: refused at arrival, never served
    changed_tokens: np.ndarray  # emitted tokens that differ from the target's (lossy)
    # prompt tokens the prefix cache held at its admissions (summed over a preempted
    # request's); None in a run without the cache, whose requests.parquet has no column
    cached_prompt_tokens: np.ndarray | None = None

    @classmethod
    def empty(cls, n: int) -> RequestLog:
        nan = np.full(n, np.nan)
        z = np.zeros(n, np.int64)
        return cls(nan.copy(), z.copy(), z.copy(), z.copy(), np.full(n, -1, np.int64),
                   nan.copy(), nan.copy(), z.copy(), z.copy(), z.copy(), z.copy(), z.copy(),
                   np.zeros(n, np.int8), z.copy())

    def view(self, sl: slice) -> RequestLog:
        """The requests in slots ``sl`` (views, not copies)."""
        return RequestLog(*(None if (a := getattr(self, f.name)) is None else a[sl]
                            for f in dataclass_fields(self)))

    def clear(self, sl: slice) -> None:
        """Slots ``sl`` back to :meth:`empty`'s values, for the next requests they hold."""
        for f in dataclass_fields(self):
            a = getattr(self, f.name)
            if a is None:
                continue
            a[sl] = np.nan if a.dtype.kind == "f" else (-1 if f.name == "replica" else 0)


@dataclass
class StepStats:
    """Aggregates over all engine steps of all replicas."""

    gamma: int
    steps: int = 0
    busy_s: float = 0.0
    request_steps: int = 0  # sum over steps of decoding requests
    verify_tokens: int = 0  # sum of (1 + l)
    batch_tokens: int = 0
    budget_limited_steps: int = 0
    kv_blocked_steps: int = 0  # steps whose admission stopped at the KV capacity
    changed_tokens: int = 0  # tokens a lossy policy emitted that differ from the target's
    skipped_request_steps: int = 0  # request-steps that committed without the verifier
    unverified_tokens: int = 0  # drafts those request-steps committed
    # request-steps at positions where the drafter proposed nothing (an n-gram drafter
    # without a match): vLLM counts no draft there
    unproposed_request_steps: int = 0
    hist_size: int = 0  # bins of the per-step accepted / verified histograms (0: gamma + 2)

    def __post_init__(self) -> None:
        size = self.hist_bins = max(self.gamma + 2, self.hist_size)
        # the three histograms are views of one array, which the chain replay's kernel
        # takes whole (one array to unbox a step, not three): ``hist_bins`` bins of
        # accepted drafts, as many of verified drafts, then the inter-token gaps'
        self.hists = np.zeros(2 * size + len(ITL_EDGES_S) + 1, np.int64)
        self.accept_hist = self.hists[:size]  # index = accepted count
        self.ell_hist = self.hists[size: 2 * size]
        self.itl_hist = self.hists[2 * size:]
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
        self.batch = np.empty((0, NUM_COLUMNS), np.int64)
        # where the compiled admission writes the batch (``self.batch`` is then its first
        # rows), grown by doubling: a new array a step would cost more to hand back than
        # the admission itself
        self.batch_buf = np.empty((BATCH_BUF_ROWS, NUM_COLUMNS), np.int64)
        # the compiled prefill chunks and the tokens each row had left, as two rows (the
        # step's plan holds views of them until its replay)
        self.prefill_buf = np.empty((2, BATCH_BUF_ROWS), np.int64)
        self.wake: simpy.Event | None = None
        self.step_end_s = self.last_step_end_s = -1.0
        # requests waiting or in the batch (what least-outstanding routing reads for every
        # request): one more per submission, one less per finished request
        self.outstanding = 0
        # the policy's snapshots of the last steps (survival, sps, cost), newest last
        self.lag: deque[tuple] = deque(maxlen=max(1, ctx.policy.history))
        self.kv_tokens = 0  # sum(PREFILLED + GENERATED - GENERATED_AT_ADMIT): KV held
        # the replica's prefix cache (chunked prefill over a workload that carries reuse)
        self.cache: PrefixCache | None = None
        self.pending_prefill = 0  # sum(PREFILL_TARGET - PREFILLED)
        self.n_prefilling = 0  # rows with PREFILLED < PREFILL_TARGET
        # this step's drafts proposed per decoding row (a trace with draft_tokens), else None
        self.proposed: np.ndarray | None = None
        # the call that runs the policy's compiled decision (``SimContext.decision``), or
        # None: the policy decides on a snapshot
        self.decision_call = None
        signature = ctx.decision.signature if ctx.decision is not None else None
        if signature == "lagged":
            # the compiled decision's lagged view: the last steps' survivals
            # (``compiled.empty_ring``), sized for the batch by _widen_decision
            reads = ctx.policy.reads
            self.ring, self.ring_slots, self.ring_state = compiled.empty_ring(
                0, ctx.trace_survival.shape[1], reads.lag_steps, reads.lag_rows,
                ctx.policy.history)
        if signature == "proposed":
            # on a trace with draft_tokens, the step before's candidates in place of the
            # ring ([a step held, its candidates]: a vLLM-style one-step lag)
            self.last_buf = np.zeros(0)
            self.last_state = np.zeros(2, np.int64)
        if signature is not None:
            lagged = self._compiled_decision if ctx.lagged_flags is not None \
                else self._lagged_kernel_decision
            self.decision_call = {"lagged": lagged,
                                  "constant": self._constant_decision,
                                  "proposed": self._proposed_decision}[signature]
            # and its inputs and outputs, written in place by the kernels instead of five
            # arrays allocated and handed back per step: this step's plan holds views of
            # them until its replay, and the next step's decision comes after that
            self.ell_buf = np.zeros(0, np.int64)
            self._widen_decision(0)

    def _widen_decision(self, rows: int) -> None:
        """Make room for ``rows`` decoding rows (at least doubling) in the compiled
        decision's buffers and in its ring, which keeps the steps a decision can still
        read (a decision over survivals)."""
        rows = max(rows, 2 * len(self.ell_buf))
        # the trace positions, l and the accepted drafts per decoding row, as one array
        # (``fast.DECISION_ROWS``' layout) for the fused kernels, and each row as its own
        self.decision_rows = np.zeros((fast.DECISION_ROWS, rows), np.int64)
        self.trace_idx_buf = self.decision_rows[fast.TRACE_IDX_ROW]
        self.ell_buf = self.decision_rows[fast.ELL_ROW]
        self.accepted_buf = self.decision_rows[fast.ACCEPTED_ROW]
        signature = self.ctx.decision.signature
        if signature == "proposed":
            g = self.ctx.trace_survival.shape[1]
            last = np.zeros(rows * g)
            last[: len(self.last_buf)] = self.last_buf
            self.last_buf = last
            self.proposed_buf = np.zeros(rows, np.int64)
            self.survival_buf = np.zeros((rows, g))
            self.flat_buf = np.zeros(rows * g)
            return
        if signature == "constant":  # a constant policy's decision keeps no survivals
            return
        g = self.ctx.trace_survival.shape[1]
        reads = self.ctx.policy.reads
        self.ring = compiled.widen_ring(self.ring, self.ring_slots, self.ring_state, rows, g,
                                        reads.lag_steps, reads.lag_rows)
        self.survival_buf = np.zeros((rows, g))
        self.flat_buf = np.zeros(rows * g)

    def submit(self, rid: int) -> None:
        self.waiting.append(rid)
        self.outstanding += 1
        if self.wake is not None and not self.wake.triggered:
            self.wake.succeed()

    def check_invariants(self) -> None:
        """The incremental aggregates equal their definitions (used by tests)."""
        batch = self.batch
        assert self.kv_tokens == int((batch[:, PREFILLED] + batch[:, GENERATED]
                                      - batch[:, GENERATED_AT_ADMIT]).sum())
        assert self.pending_prefill == int((batch[:, PREFILL_TARGET] - batch[:, PREFILLED]).sum())
        prefilling = batch[:, PREFILLED] < batch[:, PREFILL_TARGET]
        assert self.n_prefilling == int(prefilling.sum())
        assert self.outstanding == len(self.waiting) + len(batch)
        # decoding rows first, then prefilling rows (what makes both groups slices)
        assert not prefilling[: len(batch) - self.n_prefilling].any()

    # -- admission and KV --------------------------------------------------------------
    def _committed_kv(self) -> int:
        # Preempt mode: prompt (being) prefilled + generated + verify slots.
        return self.kv_tokens + self.pending_prefill + len(self.batch) * self.ctx.verify_slots

    def _admit(self) -> None:
        ctx = self.ctx
        room = ctx.max_num_seqs - len(self.batch)
        if room <= 0 or not self.waiting:
            return
        if self.cache is not None:
            self._admit_cached(room)
            return
        if ctx.reserve:
            batch = self.batch
            used = int((batch[:, PROMPT_TOKENS] + batch[:, OUTPUT_TOKENS]).sum())
        else:
            used = self._committed_kv()
        rows = ctx.rows
        if compiled.NUMBA:  # the queue's head decided and admitted in one call
            waiting = self.waiting
            n_waiting = len(waiting)
            # most steps find a request or two waiting, all of which fit: the whole
            # queue, no slice of it, and emptied at once
            head = np.fromiter(waiting, np.int64, n_waiting) if n_waiting <= room \
                else np.fromiter(islice(waiting, room), np.int64, room)
            batch = self.batch
            buf = self.batch_buf
            if len(batch) + len(head) > len(buf):  # at least doubled: rarely
                buf = self.batch_buf = np.empty((max(len(batch) + len(head), 2 * len(buf)),
                                                 NUM_COLUMNS), np.int64)
            n, kv, pending, n_new, taken, blocked = fast.admit_fcfs(
                batch, self.n_prefilling, rows, head, used, ctx.reserve,
                ctx.admit_need, ctx.verify_slots, ctx.kv_capacity, buf)
            if taken:
                self.batch = buf[:n]
            if taken == n_waiting:
                waiting.clear()
            else:
                for _ in range(taken):
                    waiting.popleft()
            ctx.stats.kv_blocked_steps += blocked
            self.kv_tokens += kv
            self.pending_prefill += pending
            self.n_prefilling += n_new
            return
        taken: list[int] = []
        while self.waiting and room > 0:
            rid = self.waiting[0]
            need = int(ctx.admit_need[rid]) if ctx.reserve \
                else int(rows[rid, PREFILL_TARGET]) + ctx.verify_slots
            if used + need > ctx.kv_capacity and (len(self.batch) or taken):
                ctx.stats.kv_blocked_steps += 1  # held back for KV: counted, never silent
                break  # head-of-line blocks (FCFS), as in vLLM
            self.waiting.popleft()
            taken.append(rid)
            used += need
            room -= 1
        if taken:
            new = rows[taken]
            prefilled = new[:, PREFILLED] >= new[:, PREFILL_TARGET]
            if prefilled.any():
                # Disaggregated prefill: these arrive with their KV and first token from a
                # prefill instance and decode at once; the batch stays [decoding | prefilling].
                n_dec = len(self.batch) - self.n_prefilling
                self.batch = np.concatenate([self.batch[:n_dec], new[prefilled],
                                             self.batch[n_dec:], new[~prefilled]])
                self.kv_tokens += int((new[prefilled, PREFILLED] + new[prefilled, GENERATED]
                                       - new[prefilled, GENERATED_AT_ADMIT]).sum())
                new = new[~prefilled]
            else:
                self.batch = np.concatenate([self.batch, new])
            # the other admitted rows have PREFILLED = 0 and GENERATED = GENERATED_AT_ADMIT
            # (new, or recompute-preempted)
            self.pending_prefill += int(new[:, PREFILL_TARGET].sum())
            self.n_prefilling += len(new)

    def _used_kv(self) -> int:
        """KV the batch commits with a prefix cache: a block several rows share counts
        once (each row counts its context, the cache knows what is shared)."""
        if self.ctx.reserve:
            batch = self.batch
            return int((batch[:, PROMPT_TOKENS] + batch[:, OUTPUT_TOKENS]).sum())
        return self._committed_kv() - self.cache.shared_tokens

    def _admit_cached(self, room: int) -> None:
        """:meth:`_admit` with a prefix cache: each request at the queue's head looks up
        its leading cached blocks, which skip prefill and need no new KV; free cached
        blocks are evicted (least recently freed first) to make room, never ones a
        running request references. FCFS, head-of-line blocking, as without."""
        ctx = self.ctx
        cache = self.cache
        bt = cache.block_tokens
        used = self._used_kv()
        rows = ctx.rows
        taken: list[int] = []
        hits: list[int] = []
        while self.waiting and room > 0:
            rid = self.waiting[0]
            slots, free = cache.lookup(rid)
            target = int(rows[rid, PREFILL_TARGET])
            hit = min(slots.size * bt, int(rows[rid, PROMPT_TOKENS]) - 1, target - 1)
            need = int(ctx.admit_need[rid]) if ctx.reserve else target - hit + ctx.verify_slots
            if used + need > ctx.kv_capacity and (len(self.batch) or taken):
                ctx.stats.kv_blocked_steps += 1
                break
            self.waiting.popleft()
            cache.acquire(rid, slots, int(rows[rid, PROMPT_TOKENS]))
            over = used + need + cache.free_tokens - ctx.kv_capacity
            if over > 0:
                cache.evict(over)
            taken.append(rid)
            hits.append(max(hit, 0))
            used += need
            room -= 1
        if not taken:
            return
        new = rows[taken]  # a copy: the request's own row keeps PREFILLED as it was
        hit = np.array(hits, np.int64)
        new[:, PREFILLED] = hit
        self.batch = np.concatenate([self.batch, new])
        self.kv_tokens += int(hit.sum())
        self.pending_prefill += int((new[:, PREFILL_TARGET] - hit).sum())
        self.n_prefilling += len(new)

    def _leave(self, batch: np.ndarray, n_dec: int, n_done: int, n_gone: int) -> None:
        """After a step's replay (``batch`` as it ended, before rows left): prompts it
        completed join the prefix cache, finished requests free their blocks (their
        answer's full blocks cached first: a session's next turn resends them), and the
        sessions hear which requests finished. ``n_gone``: how many finished, when the
        compiled replay counted them (-1: not counted)."""
        cache = self.cache
        if cache is not None and n_done:
            for rid in batch[n_dec: n_dec + n_done, REQUEST_ID].tolist():
                cache.fill(rid)
        if not n_gone:  # most steps finish nothing: no scan of the batch for them
            return
        done = batch[:, GENERATED] >= batch[:, OUTPUT_TOKENS]
        if not done.any():
            return
        rids = batch[done, REQUEST_ID]
        if cache is not None:
            for rid in rids.tolist():
                cache.fill(rid, answer=True)
                cache.release(rid)
        if self.ctx.on_finished is not None:
            self.ctx.on_finished(rids)

    def _remove(self, keep: np.ndarray, *, finished: bool = False) -> np.ndarray:
        """Drop rows where ``keep`` is False; returns them, aggregates updated.
        ``finished`` rows are fully prefilled, so only the KV count changes."""
        if compiled.NUMBA:
            log = self.ctx.log
            self.batch, gone, kv, pending, prefilling = fast.remove_rows(
                self.batch, keep, log.steps, log.draft_tokens_verified, log.accepted_tokens)
            self.kv_tokens -= kv
            if not finished:
                self.pending_prefill -= pending
                self.n_prefilling -= prefilling
            return gone
        gone = self.batch[~keep]
        self.batch = self.batch[keep]
        self.kv_tokens -= int(gone[:, PREFILLED].sum() + gone[:, GENERATED].sum()
                              - gone[:, GENERATED_AT_ADMIT].sum())
        if not finished:
            self.pending_prefill -= int((gone[:, PREFILL_TARGET] - gone[:, PREFILLED]).sum())
            self.n_prefilling -= int(np.count_nonzero(gone[:, PREFILLED] < gone[:, PREFILL_TARGET]))
        log = self.ctx.log
        rids = gone[:, REQUEST_ID]
        log.steps[rids] += gone[:, STEPS]
        log.draft_tokens_verified[rids] += gone[:, VERIFIED]
        log.accepted_tokens[rids] += gone[:, ACCEPTED]
        return gone

    def flush(self) -> None:
        """End of run: record the progress of requests still running or waiting (their
        counters live in the batch until they leave it), so per-request rows add up to
        the step totals. Call once, after the event loop has stopped."""
        log = self.ctx.log
        batch = self.batch
        rids = batch[:, REQUEST_ID]
        log.steps[rids] += batch[:, STEPS]
        log.draft_tokens_verified[rids] += batch[:, VERIFIED]
        log.accepted_tokens[rids] += batch[:, ACCEPTED]
        log.generated[rids] = batch[:, GENERATED]
        batch[:, STEPS:] = 0
        if self.waiting:  # preempted requests keep the tokens generated before preemption
            waiting = np.fromiter(self.waiting, np.int64, len(self.waiting))
            log.generated[waiting] = self.ctx.rows[waiting, GENERATED]

    def _preempt_if_full(self) -> None:
        ctx = self.ctx
        if self.cache is not None:
            self._preempt_cached()
            return
        n = len(self.batch)
        # _committed_kv without the call: this is checked every step
        committed = self.kv_tokens + self.pending_prefill + n * ctx.verify_slots
        if ctx.reserve or n <= 1 or committed <= ctx.kv_capacity:
            return
        self._preempt_newest(self._committed_kv() - ctx.kv_capacity)

    def _preempt_newest(self, excess: int) -> np.ndarray:
        """Preempt the newest requests until ``excess`` KV tokens are freed (at least one
        request stays); they queue at the front for recompute. Returns their rows."""
        ctx = self.ctx
        batch = self.batch
        kv = batch[:, PREFILL_TARGET] + batch[:, GENERATED] - batch[:, GENERATED_AT_ADMIT] \
            + ctx.verify_slots
        # Free the newest requests first (vLLM recompute preemption), keep at least one.
        freed = np.cumsum(kv[::-1])
        k = min(int(np.searchsorted(freed, excess)) + 1, len(batch) - 1)
        keep = np.ones(len(batch), bool)
        keep[len(batch) - k:] = False
        victims = self._remove(keep)
        victims[:, STEPS:] = 0
        victims[:, GENERATED_AT_ADMIT] = victims[:, GENERATED]
        victims[:, PREFILL_TARGET] = victims[:, PROMPT_TOKENS] + victims[:, GENERATED]  # recompute prompt + output
        victims[:, PREFILLED] = 0
        ctx.rows[victims[:, REQUEST_ID]] = victims
        # newest first -> the victims end up at the queue front in admission order
        self.waiting.extendleft(victims[::-1, REQUEST_ID].tolist())
        ctx.log.preemptions[victims[:, REQUEST_ID]] += 1
        return victims

    def _preempt_cached(self) -> None:
        """:meth:`_preempt_if_full` with a prefix cache: free cached blocks are evicted
        before any running request is preempted; a victim's blocks are freed (they stay
        cached until evicted, so its recompute may find them)."""
        ctx = self.ctx
        cache = self.cache
        used = self._used_kv()
        over = used + cache.free_tokens - ctx.kv_capacity
        if over > 0:
            cache.evict(over)
        if ctx.reserve or len(self.batch) <= 1 or used <= ctx.kv_capacity:
            return
        victims = self._preempt_newest(used - ctx.kv_capacity)
        for rid in victims[:, REQUEST_ID].tolist():
            cache.release(rid)

    # -- the step ------------------------------------------------------------------
    def run(self):
        """The replica's SimPy process: one event per engine step."""
        ctx = self.ctx
        env = ctx.env
        handoffs = ctx.handoffs
        # bound once: the loop runs once per engine step
        timeout, admit, preempt_if_full = env.timeout, self._admit, self._preempt_if_full
        plan_step, step_time_s, replay = self._plan, self._step_time_s, self._replay
        deliver_before = handoffs.deliver_before if handoffs is not None else None
        while True:
            if not len(self.batch) and not self.waiting:
                self.wake = env.event()
                if handoffs is not None:  # requests must now reach this replica on time
                    handoffs.replica_idle()
                yield self.wake
                self.wake = None
            if self.waiting:  # _admit admits nothing from an empty queue
                admit()
            preempt_if_full()
            batch = self.batch
            plan = plan_step(batch)
            dt = plan.step_s
            if dt is None:
                dt = step_time_s(batch, plan)
            # when this step ends (and the one before did): a hand-off computed ahead of
            # the run must not come at the same instant
            self.last_step_end_s = self.step_end_s
            self.step_end_s = env.now + dt
            yield timeout(dt)
            if deliver_before is not None:  # the requests prefilled while this step ran
                deliver_before(env.now)
            replay(batch, plan, dt)

    def _plan(self, batch: np.ndarray) -> StepPlan:
        """Steps 3 and 4: what this step verifies and prefills."""
        # Rows are ordered [decoding | prefilling]: admission appends, prefill chunks
        # are handed out FCFS so prefills complete in row order, and removal keeps
        # order. Both groups are therefore slices (views), never fancy indexes.
        n_prefilling = self.n_prefilling
        n_dec = len(batch) - n_prefilling
        decision_call = self.decision_call
        if decision_call is not None and n_dec:  # _verify_lengths' compiled path, one frame
            self.proposed = None
            ell, accepted, lossy, drafts, step_s = decision_call(batch, n_dec)
        else:
            ell, accepted, lossy, drafts = self._verify_lengths(batch, n_dec)
            step_s = None
        verify_tokens = n_dec + drafts
        if lossy is None and not n_prefilling:  # a chain's decode-only step
            if not verify_tokens:
                raise RuntimeError("engine step with no work")
            return StepPlan(n_dec, ell, accepted, None, verify_tokens, None, None, 0, step_s)
        skipped = 0
        if lossy is not None:
            if lossy.bonus is not None:
                # requests that commit drafts without the verifier take no bonus slot
                skipped = int(np.count_nonzero(~lossy.bonus))
                verify_tokens -= skipped
                self.ctx.stats.skipped_request_steps += skipped
            if lossy.fill_tokens is not None:  # KV writes of earlier unverified commits
                verify_tokens += int(lossy.fill_tokens.sum())
        if self.n_prefilling and compiled.NUMBA:
            n_pre = len(batch) - n_dec
            bufs = self.prefill_buf
            if n_pre > bufs.shape[1]:
                bufs = self.prefill_buf = np.empty((2, max(n_pre, 2 * bufs.shape[1])),
                                                   np.int64)
            prefill_tokens = fast.prefill_chunks(
                batch, n_dec, max(0, self.ctx.max_num_batched_tokens - verify_tokens), bufs)
            chunk, remaining = bufs[0, :n_pre], bufs[1, :n_pre]
        elif self.n_prefilling:
            chunk, remaining = self._prefill_chunks(batch, n_dec, verify_tokens)
            prefill_tokens = int(chunk.sum())
        else:
            chunk = remaining = None
            prefill_tokens = 0
        if verify_tokens + prefill_tokens == 0 and not skipped:
            raise RuntimeError("engine step with no work")  # a prefill chunk always progresses
        return StepPlan(n_dec, ell, accepted, lossy, verify_tokens, chunk, remaining,
                        prefill_tokens)

    def _verify_lengths(self, batch: np.ndarray, n_dec: int
                        ) -> tuple[np.ndarray, np.ndarray, LossyStep | None, int]:
        """Step 3: ``l`` per decoding request (the policy's choice, capped at gamma, at the
        drafts the trace says were proposed at its position, and at the token budget) and
        the drafts each accepts: ``min(l, m)`` at its position for a chain; for a
        :class:`Verification` (tree / lossy) policy, what its replay says against the
        trace's ground truth. Last, the sum of ``l``."""
        ctx = self.ctx
        self.proposed = None
        if not (n_dec and ctx.gamma):
            none = np.zeros(n_dec, np.int64)
            return none, none, None, 0
        if self.decision_call is not None:
            return self.decision_call(batch, n_dec)[:4]
        decoding = slice(0, n_dec)
        trace_idx = batch[decoding, TRACE_START] \
            + (batch[decoding, GENERATED] - 1) % batch[decoding, TRACE_LEN]
        accept_len = ctx.trace_accept_len[trace_idx]
        decision = self._decide(trace_idx, n_dec, batch)
        if isinstance(decision, Verification):
            return self._replay_plan(decision, batch, n_dec, trace_idx, accept_len)
        ell = decision
        np.minimum(ell, ctx.gamma, out=ell)
        if ctx.trace_draft_tokens is not None:
            # an n-gram / lookup drafter proposed fewer (none without a match): there is
            # nothing more to verify, and the budget trim below sees the real demand
            self.proposed = ctx.trace_draft_tokens[trace_idx]
            np.minimum(ell, self.proposed, out=ell)
        budget = ctx.max_num_batched_tokens
        if n_dec + int(ell.sum()) > budget:  # never exceed the token budget: trim uniformly
            np.minimum(ell, max(0, (budget - n_dec) // n_dec), out=ell)
            ctx.stats.budget_limited_steps += 1
        return ell, np.minimum(ell, accept_len), None, int(ell.sum())

    def _compiled_decision(self, batch: np.ndarray, n_dec: int
                           ) -> tuple[np.ndarray, np.ndarray, None, int, float | None]:
        """:meth:`_verify_lengths` of a policy whose compiled ``"lagged"`` decision the
        engine runs itself (``compiled.LAGGED_STEPS``: the default scheduler's), in two
        kernel calls around numpy's sorts instead of the policy's four: the gather, the
        cost terms and the sort runs (``fast.decision_runs``), then the decision, the
        budget trim and the accepted drafts, which on a decode-only step whose draft is
        priced per step also price the step (``fast.priced_topk_lengths``: the step's
        seconds returned last; else None). The same bits as the policy's kernel and the
        reference (``tests/sim/test_compiled.py``)."""
        ctx = self.ctx
        sched = ctx.sched_cost
        if n_dec > len(self.ell_buf):
            self._widen_decision(n_dec)
        reads = ctx.policy.reads
        lag_steps, lag_rows = reads.lag_steps, reads.lag_rows
        # the fused kernels take the whole buffers and n_dec, and slice them themselves:
        # the views are made here only for the calls that need them
        rows, survival_buf, flat_buf = self.decision_rows, self.survival_buf, self.flat_buf
        g = survival_buf.shape[1]
        current = flat_buf[: n_dec * g]
        ring, slots, ring_state = self.ring, self.ring_slots, self.ring_state
        kv_tokens = self.kv_tokens
        sched_terms = ctx.sched_terms
        if sched_terms is not None:
            sched_draft_s = sched.draft_time(n_dec, kv_tokens)
            per_token, offset, kink, slot, runs = fast.decision_runs(
                batch, n_dec, ctx.trace_survival, rows, survival_buf, flat_buf, kv_tokens,
                sched_draft_s, sched_terms, ring, slots, ring_state, lag_steps, lag_rows,
                compiled.RUN_BOUNDS)
        else:
            context = self._decode_context(batch, n_dec) if sched.draft_context is not None \
                else None
            per_token, offset, kink = sched.extra_terms(n_dec, kv_tokens, len(batch), context)
            survival = survival_buf[:n_dec]
            fast.gather_trace_rows(batch, n_dec, ctx.trace_survival, self.trace_idx_buf,
                                   survival, current)
            slot, runs = compiled.lagged_runs(survival, current, ring, slots, ring_state,
                                              lag_steps, lag_rows, compiled.RUN_BOUNDS)
        lagged = compiled.sorted_lagged(current, slot, runs, ring, slots, ring_state,
                                        lag_steps, lag_rows, g)
        stretch, displacement = ctx.lagged_flags
        step_terms = ctx.step_terms
        step_s = None
        if step_terms is not None and not self.n_prefilling:  # _step_time_s' first case
            cost = ctx.cost
            # the same draft time when the scheduler prices with the engine's own model
            draft_s = sched_draft_s if cost is sched and sched_terms is not None \
                else cost.draft_time(n_dec, kv_tokens)
            drafts, trimmed, step_s = fast.priced_topk_lengths(
                n_dec, survival_buf, flat_buf, lagged, slot, rows, ctx.trace_accept_len,
                ring, slots, ring_state, sched.dense_step_s, per_token, offset, kink,
                self.pending_prefill, sched.prefill_s_per_token, ctx.max_num_batched_tokens,
                stretch, displacement, batch, cost.dense_step_s, kv_tokens, draft_s,
                step_terms, cost.has_context_terms)
        else:
            drafts, trimmed = compiled.lagged_topk_lengths(
                survival_buf[:n_dec], current, lagged, slot, self.trace_idx_buf[:n_dec],
                ctx.trace_accept_len, ring, slots, ring_state, sched.dense_step_s,
                per_token, offset, kink, self.pending_prefill, sched.prefill_s_per_token,
                ctx.max_num_batched_tokens, self.ell_buf[:n_dec],
                self.accepted_buf[:n_dec], stretch, displacement)
        if trimmed:
            ctx.stats.budget_limited_steps += 1
        return self.ell_buf[:n_dec], self.accepted_buf[:n_dec], None, drafts, step_s

    def _lagged_kernel_decision(self, batch: np.ndarray, n_dec: int
                                ) -> tuple[np.ndarray, np.ndarray, None, int, None]:
        """:meth:`_verify_lengths` of a policy with another compiled ``"lagged"``
        decision: the snapshot, then the policy's kernel (the decision, the budget trim
        and the accepted drafts) in one call, the same bits as the reference."""
        ctx = self.ctx
        sched = ctx.sched_cost
        if n_dec > len(self.ell_buf):
            self._widen_decision(n_dec)
        reads = ctx.policy.reads
        trace_idx, survival = self.trace_idx_buf[:n_dec], self.survival_buf[:n_dec]
        current = self.flat_buf[: survival.size]
        sched_terms = ctx.sched_terms
        if sched_terms is not None:  # the gather and the cost terms in one call
            kv_tokens = self.kv_tokens
            per_token, offset, kink = fast.decision_inputs(
                batch, n_dec, ctx.trace_survival, trace_idx, survival, current,
                kv_tokens, sched.draft_time(n_dec, kv_tokens), sched_terms)
        else:
            context = self._decode_context(batch, n_dec) if sched.draft_context is not None \
                else None
            per_token, offset, kink = sched.extra_terms(n_dec, self.kv_tokens, len(batch),
                                                        context)
            fast.gather_trace_rows(batch, n_dec, ctx.trace_survival, trace_idx, survival,
                                   current)
        ell, accepted = self.ell_buf[:n_dec], self.accepted_buf[:n_dec]
        drafts, trimmed = ctx.decision_kernel(
            survival, current, trace_idx, ctx.trace_accept_len, self.ring, self.ring_slots,
            self.ring_state, reads.lag_steps, reads.lag_rows, sched.dense_step_s,
            per_token, offset, kink, self.pending_prefill, sched.prefill_s_per_token,
            ctx.max_num_batched_tokens, ell, accepted)
        if trimmed:
            ctx.stats.budget_limited_steps += 1
        return ell, accepted, None, drafts, None

    def _proposed_decision(self, batch: np.ndarray, n_dec: int
                           ) -> tuple[np.ndarray, np.ndarray, None, int, float | None]:
        """:meth:`_compiled_decision` on a trace with draft_tokens: the candidates are the
        drafts proposed (``compiled.vllm_adaptive_proposed``)."""
        ctx = self.ctx
        sched = ctx.sched_cost
        if n_dec > len(self.ell_buf):
            self._widen_decision(n_dec)
        trace_idx, survival = self.trace_idx_buf[:n_dec], self.survival_buf[:n_dec]
        proposed = self.proposed_buf[:n_dec]
        c = fast.gather_proposed(batch, n_dec, ctx.trace_survival, ctx.trace_draft_tokens,
                                 trace_idx, survival, proposed, self.flat_buf)
        candidates = self.flat_buf[:c]
        candidates.sort()  # numpy's SIMD sort, as confidence_step's
        context = self._decode_context(batch, n_dec) if sched.draft_context is not None \
            else None
        if ctx.sched_terms is not None:
            per_token, offset, kink = fast.extra_terms(
                n_dec, self.kv_tokens, len(batch), sched.draft_time(n_dec, self.kv_tokens),
                ctx.sched_terms)
        else:
            per_token, offset, kink = sched.extra_terms(n_dec, self.kv_tokens, len(batch),
                                                        context)
        ell, accepted = self.ell_buf[:n_dec], self.accepted_buf[:n_dec]
        drafts, trimmed = ctx.decision_kernel(
            survival, candidates, proposed, trace_idx, ctx.trace_accept_len, self.last_buf,
            self.last_state, sched.dense_step_s, per_token, offset, kink,
            self.pending_prefill, sched.prefill_s_per_token, ctx.max_num_batched_tokens,
            ell, accepted)
        self.proposed = ctx.trace_draft_tokens[trace_idx]  # what the step's draft reads
        if trimmed:
            ctx.stats.budget_limited_steps += 1
        return ell, accepted, None, drafts, None

    def _constant_decision(self, batch: np.ndarray, n_dec: int
                           ) -> tuple[np.ndarray, np.ndarray, None, int, float | None]:
        """:meth:`_verify_lengths` of a policy that verifies ``verify_max`` drafts for
        every request (``compiled.constant_lengths``): no snapshot; the trace positions in
        one call, then the cap at the drafts proposed, the budget trim and the accepted
        drafts in another."""
        ctx = self.ctx
        if n_dec > len(self.ell_buf):
            self._widen_decision(n_dec)
        trace_idx = self.trace_idx_buf[:n_dec]
        fast.trace_positions(batch, n_dec, trace_idx)
        ell, accepted = self.ell_buf[:n_dec], self.accepted_buf[:n_dec]
        drafts, trimmed = ctx.decision_kernel(
            trace_idx, ctx.verify_max, ctx.trace_accept_len, ctx.constant_draft_tokens,
            ctx.max_num_batched_tokens, ell, accepted)
        if ctx.trace_draft_tokens is not None:  # what the step's draft and stats read
            self.proposed = ctx.trace_draft_tokens[trace_idx]
        if trimmed:
            ctx.stats.budget_limited_steps += 1
        return ell, accepted, None, drafts, None

    def _replay_plan(self, plan: Verification, batch, n_dec, trace_idx, accept_len
                     ) -> tuple[np.ndarray, np.ndarray, LossyStep, int]:
        """A tree or lossy policy: its tokens trimmed to the budget and its own replay of
        the plan against the ground truth (checked: it can emit no more than it verified,
        unless it commits drafts without the verifier)."""
        ctx = self.ctx
        tokens = np.maximum(np.asarray(plan.tokens, dtype=np.int64), 0)
        np.minimum(tokens, ctx.verify_max, out=tokens)
        budget = ctx.max_num_batched_tokens
        fill = None if plan.fill_tokens is None else \
            np.maximum(np.asarray(plan.fill_tokens, dtype=np.int64), 0)
        filled = 0 if fill is None else int(fill.sum())
        if n_dec + int(tokens.sum()) + filled > budget:
            np.minimum(tokens, max(0, (budget - n_dec - filled) // n_dec), out=tokens)
            ctx.stats.budget_limited_steps += 1
        plan = replace(plan, tokens=readonly(tokens))  # the replay sees what is verified
        rids = batch[:n_dec, REQUEST_ID]
        state = readonly(ctx.request_state[rids]) if ctx.request_state is not None \
            else None
        rep = ctx.policy.replay(plan, ReplayView(readonly(accept_len), readonly(trace_idx),
                                                 ctx.trace, state))
        accepted = np.asarray(rep.accepted, dtype=np.int64)
        bonus = None if rep.bonus is None else np.asarray(rep.bonus, dtype=bool)
        verified = tokens if bonus is None else np.where(bonus, tokens, ctx.gamma)
        if accepted.shape != (n_dec,) or (accepted < 0).any() or (accepted > verified).any():
            raise RuntimeError(f"policy {ctx.policy.name}: replay accepted outside 0..tokens")
        if rep.state is not None and ctx.request_state is not None:
            ctx.request_state[rids] = rep.state
        return tokens, accepted, LossyStep(rep, bonus, plan.draft_tokens, fill), \
            int(tokens.sum())

    def _prefill_chunks(self, batch: np.ndarray, n_dec: int, verify_tokens: int
                        ) -> tuple[np.ndarray, np.ndarray]:
        """Step 4: chunked prefill takes what verification left of the token budget,
        FCFS over the prefilling rows (there are some). Returns (chunk per row, tokens
        each had left)."""
        prefilling = slice(n_dec, None)
        remaining = batch[prefilling, PREFILL_TARGET] - batch[prefilling, PREFILLED]
        left = max(0, self.ctx.max_num_batched_tokens - verify_tokens)
        before = np.cumsum(remaining) - remaining
        chunk = np.maximum(np.minimum(remaining, left - before), 0)
        return chunk, remaining

    def _step_time_s(self, batch: np.ndarray, plan: StepPlan) -> float:
        """Step 5: draft + target at B tokens + KV reads of the batch + the LM head for
        rows whose logits are needed (verify rows, finishing prefills) + the optional
        context-dependent terms."""
        ctx = self.ctx
        cost = ctx.cost
        n_dec, ell, lossy, verify_tokens = plan.n_dec, plan.ell, plan.lossy, plan.verify_tokens
        step_terms = ctx.step_terms
        if step_terms is not None and n_dec and lossy is None and not plan.prefill_tokens:
            # a decode-only chain step with its draft priced per step: one kernel
            kv_tokens = self.kv_tokens
            return fast.decode_step_s(batch, n_dec, ell, verify_tokens, cost.dense_step_s,
                                      kv_tokens, cost.draft_time(n_dec, kv_tokens),
                                      step_terms, cost.has_context_terms)
        if ctx.step_terms is not None and lossy is None and plan.prefill_tokens:
            # a chain step with prefill chunks: one kernel too, unless its units leave
            # exact float range (NaN: priced below)
            dt = fast.chunked_step_s(batch, n_dec, ell, plan.verify_tokens, plan.chunk,
                                     plan.remaining, cost.dense_step_s, self.kv_tokens,
                                     cost.draft_time(n_dec, self.kv_tokens) if n_dec else 0.0,
                                     ctx.step_terms, cost.has_context_terms)
            if dt == dt:
                return dt
        prof = cost.profile
        decoding = slice(0, n_dec)
        target_kv = self.kv_tokens
        skip = None if lossy is None or lossy.bonus is None or lossy.bonus.all() \
            else ~lossy.bonus
        if skip is not None:
            # rows that skip the verifier are not in the target's forward: it reads none
            # of their KV (and a step where every row skips runs no target forward at all)
            target_kv -= int(self._context(batch, decoding)[skip].sum())
        if n_dec and ctx.draft_per_request:
            # the draft's cost depends on each request's context (self-speculation over a
            # sparse KV) or on what each request drafts this step (a stopping controller,
            # an autoregressive drafter that proposed fewer at the request's position)
            dt = cost.draft_step_s(self._decode_context(batch, n_dec), ell, self.kv_tokens,
                                   self.proposed)
        else:
            dt = cost.draft_time(n_dec, self.kv_tokens) if n_dec else 0.0
        # two additions in this order, (draft + target) + KV: a float sum depends on its
        # order, and the golden runs (tests/sim/test_golden.py) pin these bits
        tokens = plan.verify_tokens + plan.prefill_tokens
        dt += cost.target_time(tokens) if tokens else 0.0
        dt += prof.kv_s_per_token * target_kv
        if lossy is not None and lossy.draft_tokens is not None and n_dec:
            # tree branches: the drafter's per-token share of its block, per extra token
            dt += cost.draft_branch_s(n_dec) * float(np.sum(lossy.draft_tokens)) / n_dec
        if prof.logits_s_per_row:
            finishing = int(np.count_nonzero(plan.chunk == plan.remaining)) \
                if plan.prefill_tokens else 0
            dt += prof.logits_s_per_row * (plan.verify_tokens + finishing)
        if cost.has_context_terms:
            if compiled.NUMBA and lossy is None and not plan.prefill_tokens:
                # a decode-only chain step: integer sums, the same figures in one kernel
                window = prof.attn_window_tokens
                query_ctx, multi_kv = fast.decode_attention_units(
                    batch, n_dec, ell, -1 if window is None else window)
                query_ctx, multi_kv, ctx_requests = float(query_ctx), float(multi_kv), n_dec
            else:
                query = ell if lossy is None or lossy.fill_tokens is None \
                    else ell + lossy.fill_tokens
                query_ctx, multi_kv, ctx_requests = self._attention_units(
                    batch, n_dec, query, plan.chunk if plan.prefill_tokens else None,
                    prof.attn_window_tokens, skip)
            dt += prof.attn_s_per_query_ctx * query_ctx + prof.multi_kv_s_per_token * multi_kv \
                + prof.request_s * ctx_requests
        return dt

    def _replay(self, batch: np.ndarray, plan: StepPlan, dt: float) -> None:
        """Step 6: a decoding request emits its accepted drafts and a bonus token (a
        chain: ``min(l, m)``; a tree or lossy policy: what its replay said, the bonus only
        when the verifier ran for it); a request completing prefill emits its first token;
        finished requests leave."""
        # the plan's fields unpacked once, and the context's read into locals: this runs
        # every engine step, and each attribute lookup is a dict probe
        n_dec, ell, accepted, lossy, verify_tokens, chunk, _remaining, prefill_tokens, _ = plan
        ctx = self.ctx
        stats = ctx.stats
        now = ctx.env.now
        steps = stats.steps = stats.steps + 1
        if steps >= ctx.max_engine_steps and not ctx.stop.triggered:
            ctx.stop.succeed("steps")  # the run's step bound: stated in the summary
        stats.busy_s += dt
        batch_tokens = verify_tokens + prefill_tokens
        stats.batch_tokens += batch_tokens
        fused = lossy is None and compiled.NUMBA
        cache = self.cache
        leave = cache is not None or ctx.on_finished is not None
        drafting = self._drafting(n_dec) if self.proposed is not None else n_dec
        hit, missed = (0, 0) if cache is None else cache.take_step()
        if fused:  # the finished rows leave in the same call (their log rows written),
            # unless _leave reads them first, and the call writes the step's record
            log = ctx.log
            recorder = ctx.steps
            n_kept, emitted, n_accepted, n_done, n_gone, kv_gone = fast.replay_chain(
                batch, n_dec, ell, accepted, chunk if prefill_tokens else _NO_CHUNK,
                stats.hists, stats.hist_bins, dt, ITL_EDGES_S, now, log.steps,
                log.draft_tokens_verified, log.accepted_tokens, log.finish_s, log.generated,
                log.first_token_s, ctx.next_rows, not leave, recorder.rows,
                recorder.n_rows, self.index, len(self.waiting), verify_tokens,
                prefill_tokens, drafting, hit, missed)
            recorder.advance()
            n_unverified = 0
        else:
            emitted, n_accepted, n_unverified, n_done = self._replay_rows(batch, plan, dt)
        if leave:
            self._leave(batch, n_dec, n_done, n_gone if fused else -1)
            if fused and n_gone:
                log = ctx.log
                n_kept, _, kv_gone = fast.drop_finished(
                    batch, now, log.steps, log.draft_tokens_verified, log.accepted_tokens,
                    log.finish_s, log.generated)
        if n_dec:
            self.kv_tokens += emitted
            # Every decoding request gets a token every step, and its previous token
            # came at the end of the previous step: its inter-token gap is this dt
            # (in the histogram from the kernel, or _replay_rows).
            stats.itl_sum_s += dt * n_dec
            stats.request_steps += n_dec
            stats.verify_tokens += verify_tokens
        if prefill_tokens:
            self.kv_tokens += prefill_tokens
            self.pending_prefill -= prefill_tokens
            if n_done:
                self.kv_tokens += n_done
                emitted += n_done
                self.n_prefilling -= n_done
                if not fused:  # the kernel wrote the first tokens' times
                    rids = batch[n_dec: n_dec + n_done, REQUEST_ID]
                    first = ctx.log.first_token_s[rids]
                    ctx.log.first_token_s[rids] = np.where(np.isnan(first), now, first)
        if not fused:
            verified_drafts = int(ell.sum()) if lossy is not None else verify_tokens - n_dec
            # a StepRecord's fields as a plain tuple: building the named one costs more
            ctx.record_step((now, dt, self.index, n_dec, len(batch), len(self.waiting),
                             batch_tokens, prefill_tokens, verified_drafts, emitted,
                             n_accepted, n_unverified, drafting, hit, missed))
            self._finish(batch, now)
        elif n_gone:  # the kernel moved the rest up
            self.batch = batch[:n_kept]
            self.kv_tokens -= kv_gone
            self.outstanding -= n_gone
            ctx.on_finish(n_gone)

    def _drafting(self, n_dec: int) -> int:
        """The decoding rows whose drafter proposed this step (``self.proposed``); those
        it did not are counted in the stats."""
        if not n_dec:
            return 0
        unproposed = int(np.count_nonzero(self.proposed == 0))
        self.ctx.stats.unproposed_request_steps += unproposed
        return n_dec - unproposed

    def _replay_rows(self, batch: np.ndarray, plan: StepPlan, dt: float
                     ) -> tuple[int, int, int, int]:
        """:meth:`_replay`'s numpy path (every tree or lossy step, and chain steps without
        the compiled kernel): the decoding rows, their inter-token gap, the prefill chunks.
        Returns (emitted, accepted, committed unverified, prefills completed)."""
        emitted, n_accepted, n_unverified = self._replay_decoding(batch, plan)
        n_dec = plan.n_dec
        if n_dec:
            self.ctx.stats.itl_hist[bisect.bisect_left(self.ctx.itl_edges, dt)] += n_dec
        n_done = 0
        if plan.prefill_tokens:
            batch[n_dec:, PREFILLED] += plan.chunk
            n_done = int(np.count_nonzero(batch[n_dec:, PREFILLED]
                                          >= batch[n_dec:, PREFILL_TARGET]))
            # the step that completes prefill samples a token (prefills complete in row
            # order)
            batch[n_dec: n_dec + n_done, GENERATED] += 1
        return emitted, n_accepted, n_unverified, n_done

    def _finish(self, batch: np.ndarray, now: float) -> None:
        """The requests that reached their output length leave the batch, their finish
        written to the log (the numpy path; the fused replay removes them itself)."""
        done = batch[:, GENERATED] >= batch[:, OUTPUT_TOKENS]
        if done.any():
            ctx = self.ctx
            gone = self._remove(~done, finished=True)
            rids = gone[:, REQUEST_ID]
            ctx.log.finish_s[rids] = now
            ctx.log.generated[rids] = gone[:, GENERATED]
            self.outstanding -= len(rids)
            ctx.on_finish(len(rids))

    def _replay_decoding(self, batch: np.ndarray, plan: StepPlan) -> tuple[int, int, int]:
        """The numpy replay of the decoding rows (every tree or lossy step, and chain steps
        without the compiled kernel). Returns (emitted, accepted, committed unverified)."""
        n_dec, ell, accepted, lossy = plan.n_dec, plan.ell, plan.accepted, plan.lossy
        if not n_dec:
            return 0, 0, 0
        ctx = self.ctx
        stats = ctx.stats
        decoding = slice(0, n_dec)
        generated = batch[decoding, GENERATED]
        bonus = 1 if lossy is None or lossy.bonus is None else lossy.bonus.astype(np.int64)
        advance = np.minimum(accepted + bonus, batch[decoding, OUTPUT_TOKENS] - generated)
        if lossy is not None and lossy.replay.changed is not None:
            changed = np.minimum(np.asarray(lossy.replay.changed, dtype=np.int64), advance)
            ctx.log.changed_tokens[batch[decoding, REQUEST_ID]] += changed
            stats.changed_tokens += int(changed.sum())
        batch[decoding, GENERATED] = generated + advance
        batch[decoding, STEPS] += 1
        batch[decoding, VERIFIED] += ell
        n_unverified = 0
        if lossy is not None and lossy.bonus is not None:
            # a request that skipped the verifier committed drafts it never judged: they
            # are emitted (and count in the acceptance length) but are no acceptances;
            # the acceptance rate, the waste and the per-position figures are the
            # verifier's, so what it accepted is at most what it verified
            judged = np.minimum(accepted, ell)
            n_unverified = int((accepted - judged).sum())
            accepted = judged
        batch[decoding, ACCEPTED] += accepted
        stats.unverified_tokens += n_unverified
        stats.accept_hist += np.bincount(accepted, minlength=stats.accept_hist.size)
        stats.ell_hist += np.bincount(ell, minlength=stats.accept_hist.size)
        return int(advance.sum()), int(accepted.sum()), n_unverified

    @staticmethod
    def _context(batch, decoding) -> np.ndarray:
        """KV context tokens of the decoding rows."""
        return batch[decoding, PREFILLED] + batch[decoding, GENERATED] \
            - batch[decoding, GENERATED_AT_ADMIT]

    @staticmethod
    def _decode_context(batch: np.ndarray, n_dec: int) -> np.ndarray:
        """Context tokens (KV held) of each decoding row."""
        return batch[:n_dec, PREFILLED] + batch[:n_dec, GENERATED] \
            - batch[:n_dec, GENERATED_AT_ADMIT]

    @staticmethod
    def _attention_units(batch, n_dec, ell, chunk, window=None,
                         skip=None) -> tuple[float, float, int]:
        """The step's units of the profile's context-dependent terms, in one pass over the
        batch slices: (sum over rows of query tokens x attended context, context tokens
        attended by multi-token query blocks, requests with a KV context). A decoding row
        is a multi-token block when it verifies ``l >= 1`` drafts; a prefill chunk of
        ``c`` after ``f`` filled tokens attends ``c * (f + c / 2)`` and is a multi-token
        block with a context when ``f > 0``. With an attention ``window`` each query
        attends to at most ``window`` context tokens. Rows in ``skip`` (lossy policies
        that commit without the verifier) are not in the target's forward."""
        query_ctx = multi_kv = 0.0
        ctx_requests = n_dec
        decoding, prefilling = slice(0, n_dec), slice(n_dec, None)
        if n_dec:
            context = batch[decoding, PREFILLED] + batch[decoding, GENERATED] \
                - batch[decoding, GENERATED_AT_ADMIT]
            if skip is not None:
                context = np.where(skip, 0, context)
                ctx_requests -= int(np.count_nonzero(skip))
            attended = context if window is None else np.minimum(context, window)
            query_ctx += float(((1 + ell) * attended).sum())
            multi_kv += float(context[ell > 0].sum())
        if chunk is not None:
            filled = batch[prefilling, PREFILLED]
            attended = filled + chunk / 2.0
            if window is not None:
                attended = np.minimum(attended, window)
            query_ctx += float((chunk * attended).sum())
            continuing = (chunk > 0) & (filled > 0)
            multi_kv += float(filled[continuing].sum())
            ctx_requests += int(np.count_nonzero(continuing))
        return query_ctx, multi_kv, ctx_requests

    def _decide(self, trace_idx: np.ndarray, n_dec: int, batch: np.ndarray) -> np.ndarray:
        """Build the policy's read-only snapshot and ask it for ``l`` per decoding row."""
        ctx = self.ctx
        policy = ctx.policy
        reads = policy.reads
        if not reads.survival:
            ell = policy(policy.snapshot(self.lag, ctx.empty_survival(n_dec), ctx.gamma,
                                         ctx.max_num_batched_tokens))
            return ell if isinstance(ell, Verification) else _lengths(ell, policy.name, n_dec)
        survival = ctx.trace_survival[trace_idx]
        sps = cost = None
        if reads.step_price:
            sched = ctx.sched_cost
            context = self._decode_context(batch, n_dec) \
                if sched.draft_context is not None or policy.stops_drafting else None
            extra = sched.extra_s(n_dec, ctx.gamma, self.kv_tokens, len(batch), context)
            if reads.sps is not None:
                sps = sps_curve(sched.dense_step_s, extra, n_dec, ctx.gamma,
                                self.pending_prefill, ctx.max_num_batched_tokens,
                                decode_only=reads.sps == "decode")
            if reads.cost:
                extra.flags.writeable = False
                cost = StepCost(sched.dense_step_s, extra, self.pending_prefill,
                                sched.prefill_s_per_token,
                                ctx.cost.draft_branch_s(n_dec) / n_dec if policy.plans else 0.0)
                if policy.stops_drafting:  # the draft is priced apart: per pass, per step
                    cost = replace(cost, draft_pass_s=sched.draft_pass_s(n_dec, context),
                                   draft_fixed_s=sched.draft_fixed_s(context, self.kv_tokens))
        fields = state = None
        if reads.fields:
            v2 = ctx.trace.v2
            fields = {f: readonly(getattr(v2, f)[trace_idx]) for f in reads.fields}
        if ctx.request_state is not None:
            state = readonly(ctx.request_state[batch[:n_dec, REQUEST_ID]])
        # which requests' drafters proposed (and how many drafts) is known when the step
        # is scheduled: the drafts exist before they are verified
        proposed = None if ctx.trace_draft_tokens is None \
            else ctx.trace_draft_tokens[trace_idx].astype(np.int64)
        ell = policy(policy.snapshot(self.lag, survival, ctx.gamma, ctx.max_num_batched_tokens,
                                     sps=sps, cost=cost, fields=fields, state=state,
                                     proposed=proposed))
        return ell if isinstance(ell, Verification) else _lengths(ell, policy.name, n_dec)


def sps_curve(dense_step_s: np.ndarray, extra_s: np.ndarray, n_dec: int, gamma: int,
              pending_prefill: int, budget: int, *, decode_only: bool) -> np.ndarray:
    """Steps/s of a step of ``n_dec`` decoding requests when ``i`` = 0 .. n*gamma draft
    tokens are admitted: ``1 / (dense_step_s[B] + extra_s[i])``. B is the ``n + i`` verify
    tokens plus whatever ``pending_prefill`` still fits in the budget (vLLM's ``T + B``:
    verification displaces prefill), or the verify tokens alone with ``decode_only``
    (Algorithm 1's ``sum(1 + l)``); ``budget`` is ``max_num_batched_tokens`` (the table
    covers 0 .. budget tokens) and entries past it are 0. The one definition of the
    curve: the simulator's engine and the real validation server both price with it."""
    verify = n_dec + np.arange(n_dec * gamma + 1)
    total = verify if decode_only else verify + pending_prefill
    step_s = dense_step_s[np.minimum(total, budget)]  # a fresh array: safe to fill in place
    step_s += extra_s
    sps = np.reciprocal(step_s, out=step_s)
    over = n_dec * (1 + gamma) - budget
    if over > 0:
        sps[-over:] = 0.0
    return sps


def request_rows(prompt_tokens: np.ndarray, output_tokens: np.ndarray,
                 trace: AcceptanceTrace | None, trace_row: np.ndarray,
                 disaggregated: bool = False, first_id: int = 0) -> np.ndarray:
    """Every request's batch row, built at once (vectorised); replicas index into it.
    ``disaggregated``: a prefill instance has computed the prompt's KV and the first
    token before the request reaches the decode replica. ``first_id``: the log slot of
    the first row (a streamed run's window holds a chunk of requests from there)."""
    n = len(prompt_tokens)
    rows = np.zeros((n, NUM_COLUMNS), np.int64)
    rows[:, REQUEST_ID] = np.arange(first_id, first_id + n)
    rows[:, PROMPT_TOKENS] = prompt_tokens
    rows[:, PREFILL_TARGET] = prompt_tokens
    rows[:, OUTPUT_TOKENS] = np.maximum(1, output_tokens)
    if disaggregated:
        rows[:, PREFILLED] = prompt_tokens
        rows[:, GENERATED] = 1
    if trace is not None:
        rows[:, TRACE_START] = trace.req_offsets[trace_row]
        rows[:, TRACE_LEN] = trace.req_lengths[trace_row]
    else:
        rows[:, TRACE_LEN] = 1
    return rows


def _run_gamma(cfg: SimConfig, policy: Policy, trace: AcceptanceTrace | None) -> int:
    """Draft positions per step: the trace's, or ``--gamma-max``'s block for the block
    drafter (DSpark-5 on a gamma-7 trace; MTP-1 keeps its one); ``api.prepare`` has
    checked that the policy's draft length fits it."""
    gamma = 0 if (trace is None or not policy.speculates) else trace.gamma_max
    block_gamma = cfg.gamma_max if policy.drafts_block else None
    if block_gamma is not None and trace is not None:
        gamma = min(gamma, block_gamma)
    return gamma


class SimContext:
    """Everything the replicas share: config, limits, trace, policy, the cost models
    (``cost`` times the steps, ``sched_cost`` is what the scheduler believes), outputs."""

    def __init__(self, cfg: SimConfig, profile: EngineProfile, policy: Policy,
                 trace: AcceptanceTrace | None, calibration: CalibrationMap,
                 log: RequestLog, on_finish: Callable[[int], None],
                 policy_profile: EngineProfile | None = None) -> None:
        self.env = simpy.Environment()
        self.profile = profile
        self.policy = policy
        self.trace = trace
        self.trace_accept_len = trace.accept_len if trace is not None else None
        self.log = log
        self.on_finish = on_finish
        self.limits = resolve_limits(cfg.engine, profile)
        self.max_num_seqs = self.limits.max_num_seqs
        self.max_num_batched_tokens = self.limits.max_num_batched_tokens
        self.kv_capacity = self.limits.kv_capacity_tokens
        self.reserve = cfg.engine.kv_mode == "reserve"
        self.max_engine_steps = cfg.max_engine_steps
        self.stop = self.env.event()  # triggered by the step bound or the time horizon
        # an open loop's hand-offs from prefill instances computed ahead (``sim.ahead``)
        self.handoffs = None
        self.gamma = _run_gamma(cfg, policy, trace)
        # Verify at most this many drafts per request (fixed:K: K); a KV slot each.
        self.verify_max = policy.verify_max(self.gamma)
        self.verify_slots = 1 + self.verify_max
        # Survival depends only on a trace row and the calibration map: compute it once
        # for the whole trace (N x gamma float64, in C order, as the kernels take it)
        # instead of per step; a position's survival reads only the positions before it.
        self.trace_survival = (calibration.survival(trace.conf[:, : self.gamma])
                               if policy.reads.survival and trace is not None else None)
        if self.trace_survival is not None:  # read once: the file's pages need not stay
            release_pages(trace.conf)
        self._init_draft_tokens(trace, policy)
        self._init_cost(profile, policy, trace, policy_profile)
        # what the fused replay prefetches of the next step's survivals (zero rows: the
        # policy's decision reads none)
        self.next_rows = self.trace_survival if self.trace_survival is not None \
            else np.empty((0, 1))
        # the profiles' scalars for the compiled step-time and decision terms (None: the
        # Python path prices them: no kernels, or a draft priced per request)
        self.step_terms = fast.profile_terms(self.cost.profile) \
            if compiled.NUMBA and not self.draft_per_request else None
        self.sched_terms = fast.profile_terms(self.sched_cost.profile) \
            if compiled.NUMBA and self.sched_cost.draft_context is None \
            and not self.sched_cost.stops_drafting else None
        # the kernel that makes the policy's decision, which the policy names
        # (``Policy.compiled_decision``: its signature says which call of the replica
        # runs it), on the compiled path of a run that drafts; None: it decides on a
        # snapshot
        self.decision = policy.compiled_decision(
            draft_tokens=self.trace_draft_tokens is not None) \
            if compiled.NUMBA and self.gamma else None
        self.decision_kernel = compiled.kernel(self.decision.run) \
            if self.decision is not None else None
        # (stretch, displacement) where the engine runs the lagged decision's step itself
        # (``Replica._compiled_decision``), else None
        self.lagged_flags = compiled.LAGGED_STEPS.get(self.decision_kernel) \
            if self.decision is not None and self.decision.signature == "lagged" else None
        self.constant_draft_tokens = self.trace_draft_tokens \
            if self.trace_draft_tokens is not None else np.empty(0, np.int8)
        self.itl_edges = ITL_EDGES_S.tolist()  # bisect on a list: ~10x faster than numpy
        self.stats = StepStats(self.gamma, hist_size=self.verify_max + 2)
        self.request_state: np.ndarray | None = None  # per request, set with the rows
        self.steps = StepRecorder()
        self.record_step = self.steps.record  # bound once: the step's only recorder call
        self.replicas = [Replica(i, self) for i in range(cfg.deployment.replicas)]
        self.rows = np.empty((0, NUM_COLUMNS), np.int64)  # every request's row, set by the runner
        # every request's prompt blocks when the run has a prefix cache (set_prefix_blocks)
        self.prefix_blocks: PromptBlocks | None = None
        # told the ids of the requests each step finishes (multi-turn sessions), or None
        self.on_finished: Callable[[np.ndarray], None] | None = None
        self.admit_need = np.empty(0, np.int64)  # reserve mode: prompt + output per request
        self._empty: dict[int, np.ndarray] = {}

    def _init_cost(self, profile: EngineProfile, policy: Policy,
                   trace: AcceptanceTrace | None, policy_profile: EngineProfile | None) -> None:
        """The engine's cost model and the scheduler's (the same object unless the
        scheduler is given a profile of its own), and whether a step prices its draft per
        request."""
        # Tokens drafted per request and step: a block drafter (DSpark, a parallel
        # backbone) proposes its whole block whatever is verified; an autoregressive one
        # (EAGLE, MTP, lookup) stops at what the policy verifies.
        draft_key, draft_gamma = None, self.verify_max
        if policy.speculates and self.verify_max > 0:
            draft_key = profile.draft_key(trace.meta.drafter, policy.drafter)  # fails if missing
            if profile.drafts[draft_key].block:
                draft_gamma = self.gamma
        budget = self.max_num_batched_tokens
        stops = policy.stops_drafting
        self.cost = CostModel(profile, budget, draft_key, draft_gamma, stops_drafting=stops)
        self.sched_cost = self.cost if policy_profile is None or policy_profile is profile \
            else CostModel(policy_profile, budget, draft_key, draft_gamma,
                           stops_drafting=stops, role="policy ")
        # Per-request draft pricing: a drafter whose cost depends on each request's own
        # context (sparse-KV self-speculation), a policy whose drafter stops at each
        # request's verify length this step (a controller deciding while it drafts), or
        # an autoregressive drafter the trace says proposed fewer at some positions.
        draft = self.cost.draft
        self.draft_per_request = draft is not None and (
            draft.has_context_terms or stops
            or (self.trace_draft_tokens is not None and not draft.block))

    def _init_draft_tokens(self, trace: AcceptanceTrace | None, policy: Policy) -> None:
        """``trace_draft_tokens``: the drafts proposed per trace row where the trace says
        some positions had fewer than the run's gamma, else None (no cap: the step's hot
        path then pays nothing for it). The scheduler sees only proposed drafts (vLLM's
        has the draft tokens), so their survival beyond ``draft_tokens`` is 0."""
        self.trace_draft_tokens = None
        d = trace.draft_tokens if trace is not None and self.gamma else None
        if d is None or not (d < self.gamma).any():
            return
        if policy.plans:
            # a tree's or a lossy plan's tokens are not a chain prefix: a cap on the chain's
            # proposed drafts does not say which of them exist
            raise InputError(trace.source_path, f"policy {policy.name} plans trees or lossy "
                             "commits, which a trace with draft_tokens (positions where the "
                             "drafter proposed fewer drafts) cannot replay; run a chain policy")
        self.trace_draft_tokens = d
        if self.trace_survival is not None:
            proposed = np.arange(self.trace_survival.shape[1]) < d[:, None]
            self.trace_survival = np.where(proposed, self.trace_survival, 0.0)

    def set_rows(self, rows: np.ndarray) -> None:
        self.rows = rows
        self.admit_need = rows[:, PROMPT_TOKENS] + rows[:, OUTPUT_TOKENS]
        if self.policy.reads.state:
            self.request_state = np.zeros(len(rows))

    def set_prefix_blocks(self, blocks: PromptBlocks) -> None:
        """Turn prefix caching on: with chunked prefill each replica holds a cache (with
        disaggregated prefill the prefill instances hold it: ``sim.prefill``)."""
        self.prefix_blocks = blocks
        if self.limits.prefill != "disaggregated":
            for rep in self.replicas:
                rep.cache = PrefixCache(blocks)

    def caches(self) -> list[PrefixCache]:
        return [rep.cache for rep in self.replicas if rep.cache is not None]

    def empty_survival(self, n: int) -> np.ndarray:
        s = self._empty.get(n)
        if s is None:
            s = readonly(np.zeros((n, self.gamma)))
            self._empty[n] = s
        return s


_OUTSTANDING = attrgetter("outstanding")


class Router:
    """Which replica a request goes to: ``route()``, called once per request, or for
    ``prefix-affinity`` over replicas that cache prefixes ``by_prefix(rid)``: the replica
    holding the longest cached prefix of the request's prompt, the least outstanding
    among equals (vLLM's router and SGLang's cache-aware one prefer the cache the same
    way). Without caches in the replicas it routes as least-outstanding."""

    def __init__(self, replicas: list[Replica], kind: str) -> None:
        self.replicas = replicas
        self._next = 0
        self.by_prefix: Callable[[int], Replica] | None = None
        if kind != "round-robin" and len(replicas) > 1:
            # least-outstanding, the first of the least loaded: one C call, no frame
            self.route = partial(min, replicas, key=_OUTSTANDING)
            if kind == "prefix-affinity" and all(r.cache is not None for r in replicas):
                self.by_prefix = self._by_prefix

    def _by_prefix(self, rid: int) -> Replica:
        # the first of the equals, as least-outstanding's min
        return min(self.replicas,
                   key=lambda rep: (-rep.cache.cached_prefix_blocks(rid), rep.outstanding))

    def route(self) -> Replica:
        r = self.replicas[self._next % len(self.replicas)]
        self._next += 1
        return r
