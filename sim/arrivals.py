"""Arrival sources: how requests reach the router, as SimPy processes.

* ``OpenLoop``: requests arrive at the stream's timestamps (Poisson, gamma or a
  replayed workload file), whatever the engine is doing.
* ``ClosedLoop``: ``max_concurrency`` clients; each sends its next request when its
  previous one finishes (vLLM ``bench serve --max-concurrency``, InferenceX points).
* ``SessionLoop``: multi-turn sessions (``sim/sessions.py``): a session's next turn a
  think time after its previous one finishes; sessions start at the open loop's times,
  or each closed-loop client runs one after another.

Both submit request ``rid`` to the replica the router picks and stamp its arrival time
and replica in the request log; the closed loop is driven by the engine's finish
callback (``on_finish``), one call per finishing step, never per token. With
disaggregated prefill (``prefill`` given, a :class:`~dspark_sim.sim.prefill.PrefillPool`)
a request first queues for a prefill instance and reaches the decode replica with its
first token, which is its TTFT. A front end with ``frontend_s`` per request (the profile's
``frontend_us_per_request``: an API server that parses and tokenises one request at a
time) delays each request's way to the engine behind the ones sent before it.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import simpy

from dspark_sim.sim.engine import RequestLog, Router
from dspark_sim.sim.prefill import PrefillPool
from dspark_sim.sim.sessions import SessionPlan


class Window(Protocol):
    """A streamed run's request window (``sim.stream.RequestWindow``): the log holds
    ``size`` slots, request ``rid`` lives in slot ``rid % size``, and ``admit(rid)``
    makes room for it (False: the slot's previous request is still in the system, so
    the run stops there)."""

    size: int
    n: int  # requests in the stream
    last_arrival_s: float
    arrival_at: np.ndarray  # each slot's arrival time, set when its chunk is admitted

    def admit(self, rid: int) -> bool: ...


class _Source:
    def __init__(self, env: simpy.Environment, router: Router, log: RequestLog, n: int,
                 prefill: PrefillPool | None = None, frontend_s: float = 0.0,
                 window: Window | None = None) -> None:
        self.env = env
        self.window = window  # None: the log holds every request, slot = request id
        self.router = router
        self.log = log
        self.n = n
        self.prefill = prefill  # the prefill instances (disaggregated), or None
        if prefill is not None:
            prefill.on_prefilled = lambda rid: self._to_decode(rid, first_token=True)
        self.frontend_s = frontend_s
        self.frontend_free_s = 0.0  # when the front end is done with what it holds
        self.issued = 0  # requests submitted so far (ids 0..issued-1)

    def submit_next(self) -> bool:
        """Send the next request; False when it was refused (``log.rejected``: it can
        never be served), which leaves it unrouted and answered at once."""
        rid = self.issued
        if self.window is not None:
            if not self.window.admit(rid):
                self.n = rid  # the window is full of live requests: no more are sent
                return False
            rid %= self.window.size
        self.issued += 1
        return self._submit(rid)

    def _submit(self, rid: int) -> bool:
        """Request ``rid`` arrives now: refused, or on its way to the engine."""
        self.log.arrival_s[rid] = self.env.now
        if self.log.rejected[rid]:
            return False
        if self.frontend_s:
            self.frontend_free_s = max(self.env.now, self.frontend_free_s) + self.frontend_s
            through = self.env.timeout(self.frontend_free_s - self.env.now)
            through.callbacks.append(lambda _event, rid=rid: self._to_engine(rid))
        else:
            self._to_engine(rid)
        return True

    def _to_engine(self, rid: int) -> None:
        if self.prefill is None:
            self._to_decode(rid)
        else:
            self.prefill.submit(rid)

    def _to_decode(self, rid: int, first_token: bool = False) -> None:
        log = self.log
        if first_token:  # the prefill instance sampled it
            log.first_token_s[rid] = self.env.now
            if log.output_tokens[rid] <= 1:  # and that was the whole answer
                log.finish_s[rid] = self.env.now
                log.generated[rid] = 1
                self.on_finish(1)
                self.finished((rid,))
                return
        router = self.router
        replica = router.route() if router.by_prefix is None else router.by_prefix(rid)
        log.replica[rid] = replica.index
        replica.submit(rid)

    def on_finish(self, k: int) -> None:  # noqa: B027 - open loop ignores completions
        pass

    def finished(self, rids) -> None:  # noqa: B027 - only sessions follow which finished
        pass


class OpenLoop(_Source):
    """Submit request ``i`` at ``arrival_s[i]`` (non-decreasing, seconds); with a
    ``window`` (``arrival_s`` None) at its slot's ``arrival_at``, the slot's chunk
    admitted first."""

    def __init__(self, env, router, log, arrival_s, prefill=None, frontend_s=0.0,
                 window=None) -> None:
        n = len(arrival_s) if window is None else window.n
        super().__init__(env, router, log, n, prefill, frontend_s, window)
        self.arrival_s = arrival_s
        env.process(self._run())

    @property
    def last_arrival_s(self) -> float:
        if self.window is not None:
            return self.window.last_arrival_s
        return float(self.arrival_s[-1]) if self.n else 0.0

    def _run(self):
        t_prev = 0.0
        window = self.window
        while self.issued < self.n:  # n shrinks when a streamed run's window stops it
            rid = self.issued
            if window is None:
                t = float(self.arrival_s[rid])
            elif window.admit(rid):
                t = float(window.arrival_at[rid % window.size])
            else:
                self.n = rid
                return
            if t > t_prev:
                yield self.env.timeout(t - t_prev)
                t_prev = t
            self.submit_next()


class ClosedLoop(_Source):
    """``clients`` requests in flight: one new request per finished one, until ``n``."""

    def __init__(self, env, router, log, n: int, clients: int, prefill=None,
                 frontend_s=0.0, window=None) -> None:
        super().__init__(env, router, log, n, prefill, frontend_s, window)
        self.on_finish(min(clients, n))

    def on_finish(self, k: int) -> None:
        """``k`` clients are free: each sends requests until one is accepted (a refused
        request is answered at once, as a server's 400 is)."""
        while k and self.issued < self.n:
            k -= self.submit_next()


class SessionLoop(_Source):
    """Multi-turn sessions (:class:`~dspark_sim.sim.sessions.SessionPlan`): session ``s``'s
    turn ``k`` is request ``s * turns + k``, sent ``think_s[s, k]`` after turn ``k - 1``
    finished (the engine says which requests finished: :meth:`finished`). Sessions start
    at ``start_s`` (open loop) or, with ``clients``, each client starts the next session
    when its last one ends. A refused turn ends its session: every later turn, longer
    still, is refused at once too."""

    def __init__(self, env, router, log, plan: SessionPlan, prefill=None,
                 frontend_s=0.0) -> None:
        super().__init__(env, router, log, plan.size, prefill, frontend_s)
        self.plan = plan
        self.started = 0  # sessions started so far
        if plan.start_s is None:
            for _ in range(min(plan.clients, plan.sessions)):
                self._start()
        else:
            env.process(self._run())

    def _run(self):
        t_prev = 0.0
        for t in self.plan.start_s.tolist():
            if t > t_prev:
                yield self.env.timeout(t - t_prev)
                t_prev = t
            self._start()

    def _start(self) -> None:
        self.started += 1
        self._send((self.started - 1) * self.plan.turns)

    def _send(self, rid: int) -> None:
        turns = self.plan.turns
        while not self._submit(rid):
            if (rid + 1) % turns == 0:
                self._ended()
                return
            rid += 1

    def finished(self, rids) -> None:
        turns = self.plan.turns
        think = self.plan.think_s.reshape(-1)
        for rid in np.asarray(rids).tolist():
            if (rid + 1) % turns == 0:
                self._ended()
                continue
            wait = self.env.timeout(float(think[rid + 1]))
            wait.callbacks.append(lambda _event, nxt=rid + 1: self._send(nxt))

    def _ended(self) -> None:
        """A session ended: a closed loop's client starts the next one."""
        if self.plan.start_s is None and self.started < self.plan.sessions:
            self._start()
