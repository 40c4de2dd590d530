"""The validation server's clocks (no torch: the harness checks ``--clock`` with them
before any model loads).

``"wall"``: ``time.perf_counter``; idle waits sleep. ``"cpu"``: a virtual clock that
advances by the serving thread's CPU time (``time.thread_time``) and jumps over idle gaps
to the next arrival -- on a CPU shared with other jobs it is what a dedicated machine
would show (and how the CPU profile is measured); on CUDA only ``wall`` is meaningful.
``"auto"``: ``cpu`` on CPU with one torch thread, ``wall`` otherwise.
"""

from __future__ import annotations

import time

CLOCKS = ("auto", "wall", "cpu")


class ServerClock:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._t0 = time.perf_counter()
        self._c0 = time.thread_time()
        self._offset = 0.0  # cpu clock: idle time jumped over

    def now(self) -> float:
        if self.kind == "wall":
            return time.perf_counter() - self._t0
        return time.thread_time() - self._c0 + self._offset

    def wait_until(self, t: float) -> None:
        now = self.now()
        if t <= now:
            return
        if self.kind == "wall":
            time.sleep(t - now)
        else:
            self._offset += t - now


def resolve_clock(clock: str, device_type: str, threads: int) -> str:
    """``auto`` -> ``cpu`` on a CPU device with one thread, else ``wall``."""
    if clock == "auto":
        return "cpu" if device_type == "cpu" and threads == 1 else "wall"
    return clock
