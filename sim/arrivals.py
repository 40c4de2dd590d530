"""Arrival sources: how requests reach the router, as SimPy processes.

* ``OpenLoop``: requests arrive at the stream's timestamps (Poisson, gamma or a
  replayed workload file), whatever the engine is doing.
* ``ClosedLoop``: ``max_concurrency`` clients; each sends its next request when its
  previous one finishes (vLLM ``bench serve --max-concurrency``, InferenceX points).

Both submit request ``rid`` to the replica the router picks and stamp its arrival time
and replica in the request log; the closed loop is driven by the engine's finish
callback (``on_finish``), one call per finishing step, never per token.
"""

from __future__ import annotations

import simpy

from dspark_sim.sim.engine import RequestLog, Router


class _Source:
    def __init__(self, env: simpy.Environment, router: Router, log: RequestLog, n: int) -> None:
        self.env = env
        self.router = router
        self.log = log
        self.n = n
        self.issued = 0  # requests submitted so far (ids 0..issued-1)

    def submit_next(self) -> None:
        rid = self.issued
        replica = self.router.route()
        self.log.arrival_s[rid] = self.env.now
        self.log.replica[rid] = replica.index
        replica.submit(rid)
        self.issued += 1

    def on_finish(self, k: int) -> None:  # noqa: B027 - open loop ignores completions
        pass


class OpenLoop(_Source):
    """Submit request ``i`` at ``arrival_s[i]`` (non-decreasing, seconds)."""

    def __init__(self, env, router, log, arrival_s) -> None:
        super().__init__(env, router, log, len(arrival_s))
        self.arrival_s = arrival_s
        env.process(self._run())

    @property
    def last_arrival_s(self) -> float:
        return float(self.arrival_s[-1]) if self.n else 0.0

    def _run(self):
        t_prev = 0.0
        for rid in range(self.n):
            t = float(self.arrival_s[rid])
            if t > t_prev:
                yield self.env.timeout(t - t_prev)
                t_prev = t
            self.submit_next()


class ClosedLoop(_Source):
    """``clients`` requests in flight: one new request per finished one, until ``n``."""

    def __init__(self, env, router, log, n: int, clients: int) -> None:
        super().__init__(env, router, log, n)
        for _ in range(min(clients, n)):
            self.submit_next()

    def on_finish(self, k: int) -> None:
        for _ in range(min(k, self.n - self.issued)):
            self.submit_next()
