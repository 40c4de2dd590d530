"""Compiled (numba) twins of the scheduler's per-step arithmetic, and the switch between
them and the numpy reference.

A step of the default scheduler is a dozen numpy calls on arrays of a few hundred
elements, so it pays numpy's per-call overhead a dozen times for microseconds of
arithmetic. These kernels do the same operations, in the same order, in one compiled
loop each: the results are the same bits (sums are sequential, as ``np.cumsum``'s are;
divisions and the first-maximum ``argmax`` are the same IEEE operations; a sort's values
do not depend on the algorithm; sorting itself stays numpy's, whose SIMD sort no
compiled loop beats), which ``tests/test_compiled.py`` holds on every golden
run and on random batches.

``DSPARK_SIM_KERNELS=numpy`` selects the readable numpy path (the reference, in
``policies/scheduler.py`` and ``sim/engine.py``); ``numba`` (the default when numba is
installed, as the package requires) the kernels. Without numba (a platform without its
wheels) the numpy path runs and nothing here is compiled. Compiled functions are cached on disk (``cache=True``, in
``__pycache__`` or ``NUMBA_CACHE_DIR``), so only the first run on a machine pays the
compile (``benchmarks/bench_sim.py`` prints the cold and warm start-up).
"""

from __future__ import annotations

import os

import numpy as np

BACKENDS = ("numba", "numpy")


def _choose() -> bool:
    want = os.environ.get("DSPARK_SIM_KERNELS", "").strip().lower()
    if want and want not in BACKENDS:
        raise SystemExit(f"DSPARK_SIM_KERNELS: {want!r} is not one of {', '.join(BACKENDS)}")
    if want == "numpy":
        return False
    try:
        import numba  # noqa: F401
    except ImportError:
        if want == "numba":
            raise SystemExit("DSPARK_SIM_KERNELS=numba: numba is not installed "
                             "(pip install numba)") from None
        return False
    return True


# Read on every call by the dispatching functions (tests flip it to run both paths).
NUMBA = _choose()

if NUMBA:
    from numba import njit
else:  # the kernels below stay plain Python; the dispatchers never call them
    def njit(*args, **kwargs):
        return args[0] if args and callable(args[0]) else (lambda f: f)


@njit(cache=True)
def stretch_sorted(sorted_survival, size):
    """``scheduler.stretch_sorted``: a descending curve resampled to ``size``."""
    out = np.zeros(max(size, 0))
    m = sorted_survival.size
    if size <= 0 or m == 0:
        return out
    for i in range(size):
        out[i] = sorted_survival[(i * m) // size]
    return out


@njit(cache=True)
def budget_displacement(a, n, table_s, extra_s, pending_prefill, prefill_s_per_token,
                        displacement):
    """``scheduler.budget_displacement`` with ``StepCost.step_s`` inlined: the first
    ``argmax`` of ``tau_i / C_i``."""
    if n == 0:
        return 0
    budget = table_s.size - 1
    size = min(a.size + 1, budget - n + 1, extra_s.size)
    if size <= 0:
        return 0
    best = 0.0
    best_i = 0
    cum = 0.0
    for i in range(size):
        if i:
            cum += a[i - 1]
        tau = cum + n
        if pending_prefill == 0:
            step = table_s[n + i] + extra_s[i]
        else:
            verify = n + i
            carried = min(pending_prefill, max(budget - verify, 0))
            step = table_s[verify + carried] + extra_s[i]
            if displacement:
                step = step + prefill_s_per_token * (pending_prefill - carried)
        r = tau / step
        if np.isnan(r):  # np.argmax returns the first NaN
            return i
        if i == 0 or r > best:  # the first maximum
            best, best_i = r, i
    return best_i


@njit(cache=True)
def counts_at(survival, t, k):
    """``scheduler._counts_at``: per-request counts of the k best candidates when the
    k-th best value is ``t``; ties at ``t`` taken in row-major order."""
    n, g = survival.shape
    out = np.zeros(n, dtype=np.int64)
    at_least = 0
    above = 0
    for r in range(n):
        for j in range(g):
            v = survival[r, j]
            if v >= t:
                at_least += 1
                out[r] += 1
                if v > t:
                    above += 1
    if at_least == k:
        return out
    need = k - above
    taken = 0
    for r in range(n):
        c = 0
        for j in range(g):
            v = survival[r, j]
            if v > t:
                c += 1
            elif v == t and taken < need:
                taken += 1
                c += 1
        out[r] = c
    return out
