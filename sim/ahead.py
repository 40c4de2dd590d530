"""An open loop's arrivals and prefill instances, computed ahead of the decode replicas.

With disaggregated prefill and an open loop, nothing the decode replicas do reaches back
to the requests' way to them: arrivals come at the stream's timestamps, the front end
(``frontend_s`` per request) and the prefill instances' one FIFO queue see only each
other. So that part of the run is one compiled pass (:func:`front_end`) over the
stream, event for event what :class:`~dspark_sim.sim.arrivals.OpenLoop` and
:class:`~dspark_sim.sim.prefill.PrefillPool` do as SimPy processes (their timeouts, wake-ups
and ties in the order SimPy takes them). The SimPy run keeps only the hand-offs to the
decode replicas (:class:`Handoffs`): one event per instant a prefill step hands requests
over while a replica idles, none while every replica is stepping. That saves the three
events and dozens of Python calls each request costs there; the SimPy processes stay the
reference (``tests/sim/test_ahead.py`` holds both to the same bytes).

What cannot be computed ahead is the order of two events at exactly the same time, one
of them a decode replica's: a hand-off at the instant a replica's step ends, or a
front-end event at the instant the run stops. Either raises :class:`NotAhead`, and
the run is simulated again with the SimPy processes (``sim.api.run_in_memory``).
"""

from __future__ import annotations

import math

import numpy as np
import simpy

from dspark_sim.policies.compiled import njit
from dspark_sim.sim.engine import RequestLog, Router, request_rows
from dspark_sim.sim.prefill import PrefillPool

# event kinds of the compiled pass, in the processes they stand for
_ARRIVAL = 0  # OpenLoop._run's timeout to the next arrival
_FRONTEND = 1  # a request through the front end (_Source.submit_next's timeout)
_WAKE = 2  # an idle prefill instance woken by a submission
_STEP_END = 3  # a prefill instance's step ends


class NotAhead(Exception):
    """What the compiled pass cannot know: the order of two events at exactly the same
    time, or a step of prompts with no tokens (which holds no bound on its prompts)."""


@njit(cache=True)
def _push(h_time, h_int, hs, t, kind, arg):
    """Schedule an event: a binary heap ordered by (time, sequence number), as SimPy's
    event queue is (every event here has SimPy's normal priority). ``h_int`` rows are
    (sequence, kind, argument); ``hs`` = [size, next sequence number]."""
    i = hs[0]
    seq = hs[1]
    hs[0] += 1
    hs[1] += 1
    while i > 0:
        parent = (i - 1) // 2
        if h_time[parent] < t or (h_time[parent] == t and h_int[parent, 0] < seq):
            break
        h_time[i] = h_time[parent]
        h_int[i] = h_int[parent]
        i = parent
    h_time[i] = t
    h_int[i, 0], h_int[i, 1], h_int[i, 2] = seq, kind, arg


@njit(cache=True)
def _pop(h_time, h_int, hs):
    """Take the first event off the heap: returns (time, kind, argument)."""
    t0, kind, arg = h_time[0], h_int[0, 1], h_int[0, 2]
    hs[0] -= 1
    size = hs[0]
    t, seq = h_time[size], h_int[size, 0]
    last = h_int[size].copy()
    i = 0
    while True:
        child = 2 * i + 1
        if child >= size:
            break
        right = child + 1
        if right < size and (h_time[right] < h_time[child] or (
                h_time[right] == h_time[child] and h_int[right, 0] < h_int[child, 0])):
            child = right
        if t < h_time[child] or (t == h_time[child] and seq < h_int[child, 0]):
            break
        h_time[i] = h_time[child]
        h_int[i] = h_int[child]
        i = child
    if size:
        h_time[i] = t
        h_int[i] = last
    return t0, kind, arg


@njit(cache=True)
def _to_pool(rid, now, ring_f, queue, qs, idle, ids, h_time, h_int, hs):
    """``PrefillPool.submit``: the request joins the FIFO (``qs`` = [head, tail], counts
    of requests, a ring as ``queue``) and wakes the first idle instance (``idle`` a ring,
    ``ids`` = [head, count])."""
    ring_f[rid % ring_f.shape[0], _SUBMITTED] = now
    queue[qs[1] % queue.size] = rid
    qs[1] += 1
    if ids[1]:
        j = idle[ids[0]]
        ids[0] = (ids[0] + 1) % idle.size
        ids[1] -= 1
        _push(h_time, h_int, hs, now, _WAKE, j)


@njit(cache=True)
def _start_step(j, now, ring_f, ring_i, queue, qs, held, comp, budget, table,
                attn_s_per_query_ctx, window, logits_s_per_row):
    """``PrefillPool._fill`` and ``prefill_step_s`` for instance ``j``: its held prompt,
    then the queue's head, up to the budget (``comp[j]``'s first column its count, then
    (request, tokens done, chunk) triples). Returns the step's duration."""
    size = ring_i.shape[0]
    left = budget
    m = 0
    if held[j, 0] >= 0:
        r, d = held[j, 0], held[j, 1]
        c = min(ring_i[r % size, _PROMPT] - d, left)
        comp[j, 1], comp[j, 2], comp[j, 3] = r, d, c
        m = 1
        left -= c
    while left > 0 and qs[0] < qs[1]:
        r = queue[qs[0] % queue.size]
        qs[0] += 1
        ring_f[r % size, _STARTED] = now
        c = min(ring_i[r % size, _PROMPT], left)
        comp[j, 1 + 3 * m], comp[j, 2 + 3 * m], comp[j, 3 + 3 * m] = r, 0, c
        m += 1
        left -= c
    comp[j, 0] = m
    units = 0.0  # in prefill_step_s's order of operations
    tokens = 0
    completing = 0
    for k in range(m):
        r, d, c = comp[j, 1 + 3 * k], comp[j, 2 + 3 * k], comp[j, 3 + 3 * k]
        ctx = d + c / 2.0
        units += c * (ctx if window < 0 else min(ctx, window))
        tokens += c
        if d + c >= ring_i[r % size, _PROMPT]:
            completing += 1
    return table[tokens] + attn_s_per_query_ctx * units + logits_s_per_row * completing


@njit(cache=True)
def _end_step(j, now, ring_i, held, comp, hand_rid, hand_s, n_hand):
    """``PrefillPool._serve`` after its timeout: what the instance still holds, and the
    step's completed prompts handed off in order. Returns the hand-offs so far."""
    size = ring_i.shape[0]
    m = comp[j, 0]
    r, d, c = comp[j, 3 * m - 2], comp[j, 3 * m - 1], comp[j, 3 * m]
    if d + c >= ring_i[r % size, _PROMPT]:
        held[j, 0] = -1
    else:
        held[j, 0], held[j, 1] = r, d + c
    for k in range(m):
        r, d, c = comp[j, 1 + 3 * k], comp[j, 2 + 3 * k], comp[j, 3 + 3 * k]
        if d + c >= ring_i[r % size, _PROMPT]:
            hand_rid[n_hand] = r
            hand_s[n_hand] = now
            n_hand += 1
    return n_hand


# columns of the front end's per-request ring: ``ring_f`` (floats), ``ring_i`` (ints)
_ARRIVAL_AT, _ARRIVED, _SUBMITTED, _STARTED = 0, 1, 2, 3
_PROMPT, _REJECTED = 0, 1
# ``state``'s fields: the heap's size and next sequence number, the FIFO's head and
# tail, the idle ring's head and count, the next request to send, OpenLoop._run back
# from its timeout (0/1), requests loaded, requests in all, where to go on (0: the
# arrivals, 1: the next event), then the hand-offs and steps the last call wrote
_HS, _QS, _IDS, _NEXT, _RESUMED, _LOADED, _N, _PHASE, _N_HAND, _N_STEPS = (
    0, 2, 4, 6, 7, 8, 9, 10, 11, 12)
_STATE_INTS = 13
# ``clock``'s fields: the front end free at, OpenLoop._run's last and pending arrival
# times, the env's time
_FREE, _T_PREV, _PENDING_T, _NOW = 0, 1, 2, 3
# what a call of :func:`front_end_run` stopped at
NEEDS_ARRIVALS, DONE, BUFFERS_FULL = 0, 1, 2


@njit(cache=True)
def _arrivals(now, next_rid, resumed, t_prev, pending_t, frontend_free, loaded, n,
              frontend_s, ring_f, ring_i, queue, qs, idle, ids, h_time, h_int, hs):
    """``OpenLoop._run`` at ``now``: the requests arriving now sent (to the front end, or
    to the prefill queue), then its timeout to the next arrival, or a stop where that
    arrival is not loaded yet (``paused``: to go on from there once it is). Returns the
    process's state."""
    size = ring_f.shape[0]
    while next_rid < n:
        if next_rid == loaded:
            return next_rid, resumed, t_prev, pending_t, frontend_free, True
        t = ring_f[next_rid % size, _ARRIVAL_AT]
        if resumed:
            t_prev = pending_t
            resumed = False
        elif t > t_prev:
            pending_t = t
            _push(h_time, h_int, hs, now + (t - t_prev), _ARRIVAL, 0)
            break
        rid = next_rid  # _Source.submit_next
        next_rid += 1
        ring_f[rid % size, _ARRIVED] = now
        if ring_i[rid % size, _REJECTED]:
            continue
        if frontend_s:
            frontend_free = max(now, frontend_free) + frontend_s
            _push(h_time, h_int, hs, now + (frontend_free - now), _FRONTEND, rid)
        else:
            _to_pool(rid, now, ring_f, queue, qs, idle, ids, h_time, h_int, hs)
    return next_rid, resumed, t_prev, pending_t, frontend_free, False


@njit(cache=True)
def front_end_run(ring_f, ring_i, queue, h_time, h_int, state, clock, idle, held, comp,
                  hand_rid, hand_s, step_start, step_dt, frontend_s, budget, table,
                  attn_s_per_query_ctx, window, logits_s_per_row):
    """The open loop's arrivals (the env's clock as ``OpenLoop._run`` advances it), the
    front end and the prefill instances, run from ``state`` and ``clock`` (the
    front end's state, kept between calls) until the arrivals need a request not yet
    loaded (``NEEDS_ARRIVALS``), the stream is done (``DONE``) or the output buffers
    may not hold the next event's (``BUFFERS_FULL``). Per request (row ``rid`` modulo the
    rows of ``ring_f``/``ring_i``, which hold the loaded requests the run still reads):
    the time it arrived (its log's ``arrival_s``), reached the prefill queue and had its
    first chunk scheduled (NaN: not yet), written as they happen. Each call writes the
    hand-offs to the decode replicas in order (request, time) and the prefill steps in
    the order they started (start time, duration) from the buffers' starts, and their
    counts into ``state``. Every event before ``clock[_NOW]`` has been run when it
    returns; ``window`` < 0: no attention window."""
    hs = state[_HS:_HS + 2]  # the heap's [size, next sequence number]
    qs = state[_QS:_QS + 2]
    ids = state[_IDS:_IDS + 2]
    next_rid = state[_NEXT]
    resumed = state[_RESUMED] != 0
    loaded = state[_LOADED]
    n = state[_N]
    frontend_free = clock[_FREE]
    t_prev = clock[_T_PREV]
    pending_t = clock[_PENDING_T]
    now = clock[_NOW]
    instances = idle.size
    n_hand = 0
    n_steps = 0
    hand_room = hand_rid.size - budget - 1  # a step hands off at most budget + 1 prompts
    # the process starts as if from a timeout that sends nothing, and goes on where it
    # stopped: in the arrivals, or at the next event
    kind = _ARRIVAL if state[_PHASE] == 0 else -1
    status = DONE
    while True:
        if kind == _ARRIVAL:  # OpenLoop._run
            next_rid, resumed, t_prev, pending_t, frontend_free, paused = _arrivals(
                now, next_rid, resumed, t_prev, pending_t, frontend_free, loaded, n,
                frontend_s, ring_f, ring_i, queue, qs, idle, ids, h_time, h_int, hs)
            if paused:  # to go on from here once it is
                status = NEEDS_ARRIVALS
                state[_PHASE] = 0
                break
        if hs[0] == 0:
            break
        if n_steps >= step_start.size or n_hand > hand_room:
            status = BUFFERS_FULL
            state[_PHASE] = 1
            break
        now, kind, arg = _pop(h_time, h_int, hs)
        if kind == _ARRIVAL:
            resumed = True
            continue
        if kind == _FRONTEND:
            _to_pool(arg, now, ring_f, queue, qs, idle, ids, h_time, h_int, hs)
            continue
        if kind == _STEP_END:
            n_hand = _end_step(arg, now, ring_i, held, comp, hand_rid, hand_s, n_hand)
        # the top of PrefillPool._serve's loop (a woken instance, or one whose step ended)
        if held[arg, 0] < 0 and qs[0] == qs[1]:
            idle[(ids[0] + ids[1]) % instances] = arg
            ids[1] += 1
            continue
        dt = _start_step(arg, now, ring_f, ring_i, queue, qs, held, comp, budget, table,
                         attn_s_per_query_ctx, window, logits_s_per_row)
        step_start[n_steps] = now
        step_dt[n_steps] = dt
        n_steps += 1
        _push(h_time, h_int, hs, now + dt, _STEP_END, arg)
    state[_NEXT] = next_rid
    state[_RESUMED] = 1 if resumed else 0
    state[_N_HAND] = n_hand
    state[_N_STEPS] = n_steps
    clock[_FREE] = frontend_free
    clock[_T_PREV] = t_prev
    clock[_PENDING_T] = pending_t
    clock[_NOW] = now
    return status


class FrontEnd:
    """:func:`front_end_run`'s state between calls, over a ring of ``rows`` requests:
    request ``rid``'s inputs and times in row ``rid % rows`` (``rows``: every request of
    an in-memory run; a streamed run's loaded requests that are still read)."""

    def __init__(self, n: int, rows: int, instances: int, params: tuple, hand_rows: int,
                 step_rows: int) -> None:
        # front_end_run's last arguments: frontend_s, budget, table, attention s per
        # query x context token, the attention window (< 0: none), logits s per row
        self.params = params
        budget = params[1]
        rows = max(1, rows)
        self.ring_f = np.full((rows, 4), np.nan)
        self.ring_i = np.zeros((rows, 2), np.int64)
        self.queue = np.empty(rows, np.int64)  # the prefill FIFO: requests loaded, not done
        # pending: one arrival, front-end timeouts (of loaded requests), the instances'
        cap = rows + 2 * instances + 2
        self.h_time = np.empty(cap)
        self.h_int = np.empty((cap, 3), dtype=np.int64)
        self.state = np.zeros(_STATE_INTS, np.int64)
        self.state[_N] = n
        self.clock = np.zeros(4)
        self.idle = np.arange(instances)  # each instance's process starts idle, in order
        self.state[_IDS + 1] = instances
        self.held = np.full((instances, 2), -1, dtype=np.int64)  # (request, done) or -1
        self.comp = np.zeros((instances, 1 + 3 * (budget + 1)), dtype=np.int64)
        self.hand_rid = np.empty(hand_rows + budget + 1, dtype=np.int64)
        self.hand_s = np.empty(hand_rows + budget + 1)
        self.step_start = np.empty(max(1, step_rows))
        self.step_dt = np.empty(max(1, step_rows))

    @property
    def loaded(self) -> int:
        return int(self.state[_LOADED])

    @property
    def sent(self) -> int:
        """Requests the arrivals have sent (the next one's arrival not yet run)."""
        return int(self.state[_NEXT])

    @property
    def now(self) -> float:
        """Every event before this time has been run."""
        return float(self.clock[_NOW])

    def load(self, arrival_s: np.ndarray, rejected: np.ndarray, prompt: np.ndarray) -> None:
        """The next requests' inputs, into their rows (which the caller has let go)."""
        lo = self.loaded
        k = len(arrival_s)
        rows = np.arange(lo, lo + k) % len(self.ring_f)
        self.ring_f[rows] = np.nan
        self.ring_f[rows, _ARRIVAL_AT] = arrival_s
        self.ring_i[rows, _PROMPT] = prompt
        self.ring_i[rows, _REJECTED] = rejected
        self.state[_LOADED] = lo + k

    def run(self) -> int:
        """Run on to the next stop (:func:`front_end_run`'s status); the hand-offs and
        steps it wrote are ``hand_rid[:n_hand]`` ... (:meth:`written`)."""
        return int(front_end_run(self.ring_f, self.ring_i, self.queue, self.h_time,
                                 self.h_int, self.state, self.clock, self.idle, self.held,
                                 self.comp, self.hand_rid, self.hand_s, self.step_start,
                                 self.step_dt, *self.params))

    def written(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The last call's hand-offs (request, time) and steps (start, duration)."""
        h, k = int(self.state[_N_HAND]), int(self.state[_N_STEPS])
        return self.hand_rid[:h], self.hand_s[:h], self.step_start[:k], self.step_dt[:k]


def pool_params(pool: PrefillPool, frontend_s: float) -> tuple:
    """:class:`FrontEnd`'s ``params`` for ``pool``'s instances behind a front end of
    ``frontend_s`` per request."""
    prof = pool.profile
    window = prof.attn_window_tokens
    return (float(frontend_s), pool.budget, np.asarray(pool.table, dtype=np.float64),
            float(prof.attn_s_per_query_ctx), -1.0 if window is None else float(window),
            float(prof.logits_s_per_row))


def front_end(arrival_s, rejected, prompt, frontend_s, instances, budget, table,
              attn_s_per_query_ctx, window, logits_s_per_row, steps_cap):
    """The open loop's arrivals, the front end and the prefill instances, run to the end
    of the stream at once (:func:`front_end_run`). Returns, per request, the time it
    arrived (its log's ``arrival_s``), reached the prefill queue and had its first chunk
    scheduled (NaN: never); the hand-offs to the decode replicas in order (request,
    time); and the prefill steps in the order they started (start time, duration).
    ``window`` < 0: no attention window; ``steps_cap``: at least the steps."""
    n = arrival_s.size
    fe = FrontEnd(n, n, instances, (float(frontend_s), int(budget), table,
                                    float(attn_s_per_query_ctx), float(window),
                                    float(logits_s_per_row)), n, steps_cap)
    fe.load(arrival_s, rejected, prompt)
    if fe.run() != DONE:
        raise AssertionError("the front end's buffers hold a whole run")
    hand_rid, hand_s, step_start, step_dt = fe.written()
    f = fe.ring_f[:n]
    return (f[:, _ARRIVED].copy(), f[:, _SUBMITTED].copy(), f[:, _STARTED].copy(),
            hand_rid, hand_s, step_start, step_dt)


def _delay_to(now: float, at: float) -> float:
    """The delay whose SimPy timeout lands at exactly ``at`` (``now + delay`` in floats;
    ``at - now`` can round one way or the other)."""
    delay = at - now
    while now + delay < at:
        delay = math.nextafter(delay, math.inf)
    while now + delay > at:
        delay = math.nextafter(delay, -math.inf)
    return delay


class Handoffs:
    """The open loop as the decode replicas see it: requests arriving from the prefill
    instances with their first token, at the times :func:`front_end` computed. Stands
    where ``OpenLoop`` stands for ``sim.api`` (its ``last_arrival_s``, ``on_finish``);
    :meth:`finish` writes the arrivals and the prefill pool's figures for what the run
    reached, as the SimPy processes would have left them.

    A hand-off routes the request at its instant, by the replicas' state then. While
    every replica is stepping, that state changes only at a step's end, and nothing waits
    on the request before the replica it goes to starts its next step: so each replica,
    as its step ends, hands over the requests prefilled while it ran
    (:meth:`deliver_before`), with no SimPy event of their own. While a replica idles, a
    request may have to wake it, and the hand-offs are SimPy events at their instants."""

    def __init__(self, env: simpy.Environment, router: Router, log: RequestLog,
                 arrival_s: np.ndarray, pool: PrefillPool, frontend_s: float,
                 stepping: list) -> None:
        self.env = env
        self.router = router
        self.log = log
        self.pool = pool
        self.stepping = stepping  # the replicas this run steps (a replica group's own)
        self.n = len(arrival_s)
        self.last_arrival_s = float(arrival_s[-1]) if self.n else 0.0
        prompt = np.asarray(pool.prompt, dtype=np.int64)
        if self.n and int(prompt.min()) < 1:
            raise NotAhead("a prompt of no tokens")
        # a step holds a prompt's first chunk or a held prompt's next one
        steps = 2 * self.n + int(prompt.sum()) // max(1, pool.budget) + 16
        params = pool_params(pool, frontend_s)
        (self.arrived, self.submitted, self.started, self.hand_rid, self.hand_s,
         self.step_start, self.step_dt) = front_end(
            np.asarray(arrival_s, dtype=np.float64), np.asarray(log.rejected), prompt,
            params[0], pool.instances, *params[1:], steps)
        self._at = self.hand_s.tolist() + [math.inf]  # plain floats, and a sentinel
        self._rid = self.hand_rid.tolist()
        self._one_token = (log.output_tokens[self.hand_rid] <= 1).tolist()
        self.next_s = self._at[0]  # the next hand-off's instant (inf: none left)
        self._i = 0
        self._idle_wait: simpy.Event | None = None
        env.process(self._run())

    def on_finish(self, k: int) -> None:  # an open loop ignores completions
        pass

    def deliver_before(self, now: float) -> None:
        """A replica's step ends at ``now``: the requests prefilled before it go to their
        replicas (one prefilled at this very instant: :class:`NotAhead`)."""
        while self.next_s < now:
            self._deliver()
        if self.next_s == now:
            raise NotAhead(f"a prefill hand-off and a replica's step end at t = {now!r} s")

    def replica_idle(self) -> None:
        """A replica waits for work: hand-offs become events again."""
        if self._idle_wait is not None and not self._idle_wait.triggered:
            self._idle_wait.succeed()

    def _deliver(self) -> None:
        """Route the requests of the next hand-off instant, in the order they were
        prefilled."""
        log = self.log
        # the log's columns and the router's call read once: most instants hand over a
        # request or two, so the lookups would cost as much as the writes
        first_token_s, replica_of, route = log.first_token_s, log.replica, self.router.route
        at, rid_at, one = self._at, self._rid, self._one_token
        i = self._i
        now = at[i]
        while at[i] == now:
            rid = rid_at[i]
            first_token_s[rid] = now
            if one[i]:  # the first token was the whole answer
                log.finish_s[rid] = now
                log.generated[rid] = 1
                self.on_finish(1)
            else:
                replica = route()
                replica_of[rid] = replica.index
                replica.submit(rid)
            i += 1
        self._i = i
        self.next_s = at[i]

    def _run(self):
        env = self.env
        stepping = self.stepping
        while self.next_s < math.inf:
            if all(rep.wake is None for rep in stepping):
                self._idle_wait = env.event()  # every replica steps: they hand over
                yield self._idle_wait
                self._idle_wait = None
                continue
            at = self.next_s
            if at > env.now:
                yield env.timeout(_delay_to(env.now, at))
                if self.next_s != at:
                    continue
            for rep in stepping:  # a replica's step ends at this instant: which first?
                if rep.step_end_s == at or rep.last_step_end_s == at:
                    raise NotAhead(f"a prefill hand-off and replica {rep.index}'s step "
                                   f"end at t = {at!r} s")
            self._deliver()

    def finish(self) -> None:
        """After the run, stopped at ``env.now``: what the SimPy processes would have
        done by then (an event at exactly that instant: :class:`NotAhead`)."""
        stop = self.env.now
        # what every replica was still stepping through when the run stopped
        self.deliver_before(stop)
        ends = self.step_start + self.step_dt
        for name, times in (("arrival", self.arrived), ("submission", self.submitted),
                            ("prefill step", self.step_start), ("prefill step end", ends)):
            if np.any(times == stop):
                raise NotAhead(f"a {name} at the run's end, t = {stop!r} s")
        reached = self.arrived < stop
        self.log.arrival_s[:] = np.where(reached, self.arrived, np.nan)
        pool = self.pool
        pool.submitted_s = np.where(self.submitted < stop, self.submitted, np.nan)
        pool.start_s = np.where(self.started < stop, self.started, np.nan)
        k = int(np.searchsorted(self.step_start, stop, side="left"))
        pool.steps = k
        pool.busy_s = float(np.cumsum(self.step_dt[:k])[-1]) if k else 0.0


class StreamedHandoffs(Handoffs):
    """:class:`Handoffs` for a streamed run (``sim.stream.RequestWindow``): the front end
    is run a chunk of arrivals at a time (:class:`FrontEnd`, its state kept between
    chunks), as far as the decode replicas need to know the next hand-off. It reads the
    stream's chunks ahead of the window (the window's ``requests``, a
    ``sim.stream.ChunkTee``) into a ring of its own, the window's slots and
    ``AHEAD_CHUNKS`` chunks more; a run that would need it further ahead (a long stretch
    of refused requests) is :class:`NotAhead`.

    The window takes a chunk where ``OpenLoop._run`` does, as the request before the
    chunk's first arrives (a SimPy timeout to that instant, one per chunk); the chunk it
    lets go gets its arrival and prefill times from the ring first. A window full of live
    requests (the run would stop there) is :class:`NotAhead` too: such a run's order of
    events at that instant is left to the processes."""

    AHEAD_CHUNKS = 3

    def __init__(self, env: simpy.Environment, router: Router, log: RequestLog, window,
                 pool: PrefillPool, frontend_s: float, stepping: list) -> None:
        self.env = env
        self.router = router
        self.log = log
        self.pool = pool
        self.stepping = stepping
        self.window = window
        self.n = window.n
        self.last_arrival_s = window.last_arrival_s
        self.chunk = window.chunk
        self.slots = window.size
        self.rows = self.slots + self.AHEAD_CHUNKS * self.chunk
        self.fe = FrontEnd(self.n, self.rows, pool.instances, pool_params(pool, frontend_s),
                           self.chunk, 2 * self.chunk)
        self._one = np.zeros(self.rows, bool)  # per ring row: a one-token answer
        self._fed = 0  # chunks loaded into the front end
        self._status = -1  # the front end's last stop (-1: not run yet)
        # hand-offs at or after the front end's clock: more may come at their instant
        self._hold_rid = np.zeros(0, np.int64)
        self._hold_s = np.zeros(0)
        # prefill steps not yet summed (started after the decode clock when last summed),
        # and the ends of summed ones not yet past it
        self._step_start: list[np.ndarray] = []
        self._step_dt: list[np.ndarray] = []
        self._pending_steps = 0
        self._open_ends = np.zeros(0)
        self.steps = 0
        self.busy_s = 0.0
        self._last_s = -1.0  # the last hand-off instant delivered
        self._at, self._rid, self._one_token, self._i = [math.inf], [], [], 0
        self.next_s = math.inf
        self._more()
        self._idle_wait: simpy.Event | None = None
        env.process(self._run())
        if self.n > self.slots:
            env.process(self._admits())

    @property
    def _done(self) -> bool:
        return self._status == DONE

    def _feed(self) -> None:
        """The stream's next chunk into the front end's ring."""
        window, q = self.window, self._fed
        lo = q * self.chunk
        if lo + self.chunk > window.flushed * self.chunk + self.rows:
            raise NotAhead(f"the front end would run more than {self.AHEAD_CHUNKS} chunks "
                           "ahead of the window")
        c = window.requests.get(q)
        if c.first != lo:
            raise ValueError(f"chunk {q} starts at request {c.first}, not {lo}")
        prompt = np.asarray(c.prompt_tokens, dtype=np.int64)
        if len(prompt) and int(prompt.min()) < 1:
            raise NotAhead("a prompt of no tokens")
        ctx = window.ctx
        rows = request_rows(c.prompt_tokens, c.output_tokens, ctx.trace, c.trace_rows,
                            disaggregated=True)
        self._one[np.arange(lo, lo + len(prompt)) % self.rows] = c.output_tokens <= 1
        self.fe.load(np.asarray(c.arrival_s, dtype=np.float64), window.reject(rows, ctx),
                     prompt)
        self._fed += 1

    def _advance(self) -> None:
        """Run the front end to its next stop (a chunk fed first where it needs one)."""
        if self._status == NEEDS_ARRIVALS:
            self._feed()
        self._status = self.fe.run()
        hand_rid, hand_s, step_start, step_dt = self.fe.written()
        rid = np.concatenate((self._hold_rid, hand_rid))
        at = np.concatenate((self._hold_s, hand_s))
        # those before the front end's clock are all there are before it
        k = len(at) if self._done else int(np.searchsorted(at, self.fe.now, side="left"))
        self._hold_rid, self._hold_s = rid[k:], at[k:]
        if k:
            del self._at[:self._i]
            self._at[-1:] = at[:k].tolist() + [math.inf]
            del self._rid[:self._i], self._one_token[:self._i]
            self._rid += (rid[:k] % self.slots).tolist()
            self._one_token += self._one[rid[:k] % self.rows].tolist()
            self._i = 0
        self.next_s = self._at[self._i]
        if len(step_start):
            self._step_start.append(step_start.copy())
            self._step_dt.append(step_dt.copy())
            self._pending_steps += len(step_start)
            if self._pending_steps > 4 * self.chunk:
                self._sum_steps(self.env.now)

    def _more(self) -> None:
        """Run the front end until the next hand-off is known, or none is left."""
        while self._i == len(self._at) - 1 and not self._done:
            self._advance()

    def _deliver(self) -> None:
        self._last_s = self.next_s
        super()._deliver()
        if self._i == len(self._at) - 1:  # every hand-off known so far delivered
            self._more()

    def _sum_steps(self, before: float) -> None:
        """The prefill steps started before ``before`` into the pool's count and busy
        time, summed in the order they started as ``PrefillPool._serve`` adds them."""
        if not self._step_start:
            return
        start = np.concatenate(self._step_start)
        dt = np.concatenate(self._step_dt)
        k = int(np.searchsorted(start, before, side="left"))
        if k:
            self.busy_s = float(np.cumsum(np.concatenate(([self.busy_s], dt[:k])))[-1])
            self.steps += k
            ends = start[:k] + dt[:k]
            self._open_ends = np.concatenate((self._open_ends[self._open_ends >= before],
                                              ends[ends >= before]))
        self._step_start, self._step_dt = [start[k:]], [dt[k:]]
        self._pending_steps = len(start) - k

    def _settle(self, q: int, stop: float) -> None:
        """Chunk ``q``'s arrival and prefill times into its slots, those before ``stop``
        (NaN: not reached by then, or not yet loaded into the front end)."""
        lo, hi, sl = self.window._span(q)
        times = np.full((hi - lo, 3), np.nan)
        k = max(0, min(hi, self.fe.loaded) - lo)
        if k:
            row = lo % self.rows
            times[:k] = self.fe.ring_f[row:row + k, _ARRIVED:_STARTED + 1]
        times[~(times < stop)] = np.nan
        self.log.arrival_s[sl] = times[:, 0]
        self.pool.submitted_s[sl] = times[:, 1]
        self.pool.start_s[sl] = times[:, 2]

    def _admits(self):
        """The window's chunks taken in, each as ``OpenLoop._run`` takes it: after the
        request before its first is sent. (A :class:`NotAhead` raised here ends the run
        at once: nothing has stopped it before.)"""
        env, window, chunk = self.env, self.window, self.chunk
        for q in range(self.slots // chunk, -(-self.n // chunk)):
            rid = q * chunk - 1
            while self.fe.sent <= rid:
                self._advance()
            at = float(self.fe.ring_f[rid % self.rows, _ARRIVED])
            if at > env.now:
                yield env.timeout(_delay_to(env.now, at))
            for rep in self.stepping:
                if rep.step_end_s == at or rep.last_step_end_s == at:
                    raise NotAhead(f"an arrival and replica {rep.index}'s step end at "
                                   f"t = {at!r} s")
            self.deliver_before(at)  # raises at a hand-off at this instant
            if self._last_s == at:
                raise NotAhead(f"an arrival and a prefill hand-off at t = {at!r} s")
            _lo, _hi, sl = window._span(window.flushed)
            if (np.isnan(self.log.finish_s[sl]) & (self.log.rejected[sl] == 0)).any():
                # the window stops the run (``RequestWindow.admit``) at this instant
                raise NotAhead("the window is full of live requests at "
                               f"t = {at!r} s")
            self._settle(window.flushed, math.inf)
            window.admit(q * chunk)

    def finish(self) -> None:
        """After the run, stopped at ``env.now``: the loaded chunks' times as the SimPy
        processes would have left them (an event at exactly that instant:
        :class:`NotAhead`)."""
        stop = self.env.now
        self.deliver_before(stop)
        while not self._done and self.fe.now <= stop:  # every event at the stop run
            self._advance()
        window, fe = self.window, self.fe
        lo = window.flushed * self.chunk
        f = fe.ring_f[np.arange(lo, fe.loaded) % self.rows]
        self._sum_steps(stop)
        start = np.concatenate(self._step_start) if self._step_start else np.zeros(0)
        dt = np.concatenate(self._step_dt) if self._step_start else np.zeros(0)
        for name, times in (("arrival", f[:, _ARRIVED]), ("submission", f[:, _SUBMITTED]),
                            ("prefill step", start), ("prefill step end", start + dt),
                            ("prefill step end", self._open_ends)):
            if np.any(times == stop):
                raise NotAhead(f"a {name} at the run's end, t = {stop!r} s")
        for q in range(window.flushed, window.loaded):
            self._settle(q, stop)
        self.pool.steps = self.steps
        self.pool.busy_s = self.busy_s
