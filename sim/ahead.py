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
from dspark_sim.sim.engine import RequestLog, Router
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
def _to_pool(rid, now, submitted, queue, qs, idle, ids, h_time, h_int, hs):
    """``PrefillPool.submit``: the request joins the FIFO (``qs`` = [head, tail]) and
    wakes the first idle instance (``idle`` a ring, ``ids`` = [head, count])."""
    submitted[rid] = now
    queue[qs[1]] = rid
    qs[1] += 1
    if ids[1]:
        j = idle[ids[0]]
        ids[0] = (ids[0] + 1) % idle.size
        ids[1] -= 1
        _push(h_time, h_int, hs, now, _WAKE, j)


@njit(cache=True)
def _start_step(j, now, prompt, queue, qs, started, held, comp, budget, table,
                attn_s_per_query_ctx, window, logits_s_per_row):
    """``PrefillPool._fill`` and ``prefill_step_s`` for instance ``j``: its held prompt,
    then the queue's head, up to the budget (``comp[j]``'s first column its count, then
    (request, tokens done, chunk) triples). Returns the step's duration."""
    left = budget
    m = 0
    if held[j, 0] >= 0:
        r, d = held[j, 0], held[j, 1]
        c = min(prompt[r] - d, left)
        comp[j, 1], comp[j, 2], comp[j, 3] = r, d, c
        m = 1
        left -= c
    while left > 0 and qs[0] < qs[1]:
        r = queue[qs[0]]
        qs[0] += 1
        started[r] = now
        c = min(prompt[r], left)
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
        if d + c >= prompt[r]:
            completing += 1
    return table[tokens] + attn_s_per_query_ctx * units + logits_s_per_row * completing


@njit(cache=True)
def _end_step(j, now, prompt, held, comp, hand_rid, hand_s, n_hand):
    """``PrefillPool._serve`` after its timeout: what the instance still holds, and the
    step's completed prompts handed off in order. Returns the hand-offs so far."""
    m = comp[j, 0]
    r, d, c = comp[j, 3 * m - 2], comp[j, 3 * m - 1], comp[j, 3 * m]
    if d + c >= prompt[r]:
        held[j, 0] = -1
    else:
        held[j, 0], held[j, 1] = r, d + c
    for k in range(m):
        r, d, c = comp[j, 1 + 3 * k], comp[j, 2 + 3 * k], comp[j, 3 + 3 * k]
        if d + c >= prompt[r]:
            hand_rid[n_hand] = r
            hand_s[n_hand] = now
            n_hand += 1
    return n_hand


@njit(cache=True)
def front_end(arrival_s, rejected, prompt, frontend_s, instances, budget, table,
              attn_s_per_query_ctx, window, logits_s_per_row, steps_cap):
    """The open loop's arrivals (the env's clock as ``OpenLoop._run`` advances it), the
    front end and the prefill instances, run to the end of the stream. Returns, per
    request, the time it arrived (its log's ``arrival_s``), reached the prefill queue and
    had its first chunk scheduled (NaN: never); the hand-offs to the decode replicas in
    order (request, time); and the prefill steps in the order they started (start time,
    duration). ``window`` < 0: no attention window; ``steps_cap``: at least the steps."""
    n = arrival_s.size
    arrived = np.full(n, np.nan)
    submitted = np.full(n, np.nan)
    started = np.full(n, np.nan)
    hand_rid = np.empty(n, dtype=np.int64)
    hand_s = np.empty(n)
    n_hand = 0
    step_start = np.empty(steps_cap)
    step_dt = np.empty(steps_cap)
    n_steps = 0
    cap = n + 2 * instances + 2  # pending: one arrival, front-end timeouts, instances' events
    h_time = np.empty(cap)
    h_int = np.empty((cap, 3), dtype=np.int64)
    hs = np.zeros(2, dtype=np.int64)
    queue = np.empty(n, dtype=np.int64)  # the prefill FIFO (each request joins it once)
    qs = np.zeros(2, dtype=np.int64)
    idle = np.arange(instances)  # each instance's process starts idle, in order
    ids = np.array([0, instances])
    held = np.full((instances, 2), -1, dtype=np.int64)  # (request, tokens done) or -1
    comp = np.zeros((instances, 1 + 3 * (budget + 1)), dtype=np.int64)  # steps in flight
    frontend_free = 0.0
    next_rid = 0
    t_prev = pending_t = now = 0.0
    resumed = False  # OpenLoop._run back from its timeout, with request next_rid to send
    kind = _ARRIVAL  # the process starts as if from a timeout that sends nothing
    while True:
        if kind == _ARRIVAL:  # OpenLoop._run
            while next_rid < n:
                t = arrival_s[next_rid]
                if resumed:
                    t_prev = pending_t
                    resumed = False
                elif t > t_prev:
                    pending_t = t
                    _push(h_time, h_int, hs, now + (t - t_prev), _ARRIVAL, 0)
                    break
                rid = next_rid  # _Source.submit_next
                next_rid += 1
                arrived[rid] = now
                if rejected[rid]:
                    continue
                if frontend_s:
                    frontend_free = max(now, frontend_free) + frontend_s
                    _push(h_time, h_int, hs, now + (frontend_free - now), _FRONTEND, rid)
                else:
                    _to_pool(rid, now, submitted, queue, qs, idle, ids, h_time, h_int, hs)
        if hs[0] == 0:
            break
        now, kind, arg = _pop(h_time, h_int, hs)
        if kind == _ARRIVAL:
            resumed = True
            continue
        if kind == _FRONTEND:
            _to_pool(arg, now, submitted, queue, qs, idle, ids, h_time, h_int, hs)
            continue
        if kind == _STEP_END:
            n_hand = _end_step(arg, now, prompt, held, comp, hand_rid, hand_s, n_hand)
        # the top of PrefillPool._serve's loop (a woken instance, or one whose step ended)
        if held[arg, 0] < 0 and qs[0] == qs[1]:
            idle[(ids[0] + ids[1]) % instances] = arg
            ids[1] += 1
            continue
        dt = _start_step(arg, now, prompt, queue, qs, started, held, comp, budget, table,
                         attn_s_per_query_ctx, window, logits_s_per_row)
        step_start[n_steps] = now
        step_dt[n_steps] = dt
        n_steps += 1
        _push(h_time, h_int, hs, now + dt, _STEP_END, arg)
    return (arrived, submitted, started, hand_rid[:n_hand], hand_s[:n_hand],
            step_start[:n_steps], step_dt[:n_steps])


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
        prof = pool.profile
        prompt = np.asarray(pool.prompt, dtype=np.int64)
        window = prof.attn_window_tokens
        if self.n and int(prompt.min()) < 1:
            raise NotAhead("a prompt of no tokens")
        # a step holds a prompt's first chunk or a held prompt's next one
        steps = 2 * self.n + int(prompt.sum()) // max(1, pool.budget) + 16
        (self.arrived, self.submitted, self.started, self.hand_rid, self.hand_s,
         self.step_start, self.step_dt) = front_end(
            np.asarray(arrival_s, dtype=np.float64), np.asarray(log.rejected), prompt,
            float(frontend_s), pool.instances, pool.budget,
            np.asarray(pool.table, dtype=np.float64), float(prof.attn_s_per_query_ctx),
            -1.0 if window is None else float(window), float(prof.logits_s_per_row),
            steps)
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
        at, rid_at, one = self._at, self._rid, self._one_token
        i = self._i
        now = at[i]
        while at[i] == now:
            rid = rid_at[i]
            log.first_token_s[rid] = now
            if one[i]:  # the first token was the whole answer
                log.finish_s[rid] = now
                log.generated[rid] = 1
                self.on_finish(1)
            else:
                replica = self.router.route()
                log.replica[rid] = replica.index
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
