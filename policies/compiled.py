"""Compiled (numba) twins of the scheduler's per-step arithmetic, and the switch between
them and the numpy reference.

A step of the default scheduler is a dozen numpy calls on arrays of a few hundred
elements, so it pays numpy's per-call overhead a dozen times for microseconds of
arithmetic. These kernels do the same operations, in the same order, in one compiled
loop each: the results are the same bits (sums are sequential, as ``np.cumsum``'s are;
divisions and the first-maximum ``argmax`` are the same IEEE operations; a sort's values
do not depend on the algorithm), which ``tests/sim/test_compiled.py`` holds on every golden
run and on random batches.

``DSPARK_SIM_KERNELS=numpy`` selects the readable numpy path (the reference, in
``policies/scheduler.py`` and ``sim/engine.py``); ``numba`` (the default when numba is
installed, as the package requires) the kernels. Without numba (a platform without its
wheels) the numpy path runs and nothing here is compiled. The kernels are bound when one
first runs (:func:`njit`): to the module compiled ahead of time for this machine
(``policies/aot.py``: no numba or LLVM in the process), or, until it is built (in the
background, ~30 s, started by the first run), where it cannot be built or
``DSPARK_SIM_KERNELS=jit`` asks, to numba's dispatchers, whose compiled functions are
cached on disk (``cache=True``, in ``__pycache__`` or ``NUMBA_CACHE_DIR``), so only the
first run on a machine pays their compile (``benchmarks/bench_sim.py`` prints the cold
and warm start-up). ``DSPARK_SIM_KERNELS=aot`` waits for the module (building it if no
process is) rather than run the dispatchers.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable

import numpy as np

BACKENDS = ("numba", "numpy", "jit", "aot")


def _choose() -> bool:
    want = os.environ.get("DSPARK_SIM_KERNELS", "").strip().lower()
    if want and want not in BACKENDS:
        raise SystemExit(f"DSPARK_SIM_KERNELS: {want!r} is not one of {', '.join(BACKENDS)}")
    if want == "numpy":
        return False
    if importlib.util.find_spec("numba") is None:
        if want in ("numba", "jit", "aot"):
            raise SystemExit(f"DSPARK_SIM_KERNELS={want}: numba is not installed "
                             "(pip install numba)")
        return False
    return True


# Read on every call by the dispatching functions (tests flip it to run both paths).
NUMBA = _choose()

# Without the module compiled ahead of time, the first kernel a process runs imports numba
# and loads the cached kernels: ~0.8 s of CPU and ~100 MB, which a run of a few thousand
# engine steps does not win back (the numpy path, the same bytes, costs 30-80 us more a
# step: break-even near 10,000 steps, ~3,000 requests of the default deployment). A
# command that runs one simulation (``dspark-sim run``) then takes the numpy path below
# this many requests, unless DSPARK_SIM_KERNELS names a backend.
NUMPY_BELOW_REQUESTS = 2_000
# While the module is being built (a machine's first minute: the build runs in the
# background, ``aot.start_build``) numba's cache is as cold: its dispatchers would compile
# the kernels a run uses first, ~13 s of CPU, which the numpy path's extra ~95 us a
# request (confidence, 200 req/s) costs only past ~140,000 requests.
NUMPY_WHILE_BUILDING = 150_000


def choose_for_run(requests: int | None) -> bool:
    """Take the numpy path for a process's one run of ``requests`` (None: unknown, such
    as a workload file's) when it is too short to win back loading the kernels: with the
    module compiled ahead of time built they cost nothing to load and run at any size;
    without it (its build started in the background here if it is not under way) below
    :data:`NUMPY_WHILE_BUILDING` requests, or :data:`NUMPY_BELOW_REQUESTS` where its build
    failed (numba's cache is what runs, warm after a first run). Returns whether the
    kernels run."""
    global NUMBA
    chosen = os.environ.get("DSPARK_SIM_KERNELS", "").strip()
    if chosen or not NUMBA:
        return NUMBA
    state = _aot_state()
    below = {"built": 0, "failed": NUMPY_BELOW_REQUESTS}.get(state, NUMPY_WHILE_BUILDING)
    if requests is not None and requests < below:
        NUMBA = False
    return NUMBA


def _aot_state() -> str:
    """``built``, ``failed``, or ``building`` (started now if no process is building)."""
    from dspark_sim.policies import aot

    if aot.available():
        return "built"
    if aot.failed():
        return "failed"
    aot.start_build()
    return "building"


# Every kernel of this module and of the engine's (``sim/fast.py``): (its module's
# globals, its name, the Python function, numba's options). The kernels are bound when
# one is first called: loading them costs a process time and memory, which a command
# that never steps an engine (``--help``, a refused option, a listing) need not pay.
_KERNELS: list[tuple[dict, str, Callable, dict]] = []
_bound = False  # the names rebound: to the compiled module's functions, or to numba's
_jit = False  # the names rebound to numba's dispatchers
_exports: dict[str, Callable] = {}  # qualified name -> the compiled module's function


def njit(**options) -> Callable[[Callable], Callable]:
    """``numba.njit(**options)``, applied when a kernel of this project first runs:
    until then the module's name for the function is a stand-in that binds every
    kernel, then calls the compiled one. Kernels calling kernels see compiled ones
    (the names are rebound before numba types the caller)."""
    def decorate(func: Callable) -> Callable:
        _KERNELS.append((func.__globals__, func.__name__, func, options))
        if _bound:  # a module imported after the first kernel ran
            exported = _exports.get(f"{func.__module__}.{func.__name__}")
            if exported is not None and not _jit:
                return exported
            from numba import njit as numba_njit

            _use_intrinsics(func.__globals__)
            return numba_njit(**options)(func)

        @functools.wraps(func)
        def first_call(*args):
            bind()
            bound = func.__globals__[func.__name__]
            if bound is first_call:  # not in the compiled module: numba's, every kernel
                bind_jit()
                bound = func.__globals__[func.__name__]
            return bound(*args)
        return first_call
    return decorate


def bind() -> None:
    """Rebind every kernel's name to its function in the module compiled ahead of time
    for this machine, or where there is none yet (its build started in the background)
    or can be none to numba's dispatcher (once)."""
    global _bound
    if _bound:
        return
    want = os.environ.get("DSPARK_SIM_KERNELS", "").strip().lower()
    if want != "jit":
        from dspark_sim.policies import aot

        _exports.update(aot.load(wait=want == "aot") or {})
    if not _exports:
        bind_jit()
        return
    for namespace, name, func, _options in _KERNELS:
        exported = _exports.get(f"{func.__module__}.{name}")
        if exported is not None:
            namespace[name] = exported
    _bound = True


def bind_jit() -> None:
    """Import numba and rebind every kernel's name to its dispatcher (once): where there
    is no compiled module, or for a call it was not compiled for (``aot.fallback``)."""
    global _bound, _jit
    if _jit:
        return
    from numba import njit as numba_njit

    for namespace, name, func, options in _KERNELS:
        _use_intrinsics(namespace)
        namespace[name] = numba_njit(**options)(func)
    _bound = _jit = True


def prefetch(array, row, col) -> None:
    """Ask the CPU to bring ``array[row, col]``'s cache line in, without waiting for it
    (LLVM's ``llvm.prefetch``; an address outside the array is never read). A kernel
    that names it compiles numba's intrinsic in its place (:func:`_use_intrinsics`); this
    stand-in, which does nothing, is never what a kernel runs."""


@functools.cache
def _prefetch_intrinsic() -> Callable:
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    @intrinsic
    def prefetch_line(typingctx, array, row, col):
        def codegen(context, builder, signature, args):
            aryty = signature.args[0]
            ary = context.make_array(aryty)(context, builder, args[0])
            ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1], args[2]],
                                           wraparound=False)
            i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                "llvm.prefetch.p0")
            # a read, kept in every cache level, of data (not instructions)
            builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
            return context.get_dummy_value()
        return types.void(array, row, col), codegen
    return prefetch_line


def _use_intrinsics(namespace: dict) -> None:
    """A kernel module's stand-ins for numba's intrinsics (:func:`prefetch`) replaced by
    them, before numba compiles its kernels (this module keeps its own, what the others
    import)."""
    if namespace is not globals() and namespace.get("prefetch") is prefetch:
        namespace["prefetch"] = _prefetch_intrinsic()


def jit_dispatcher(qualified: str) -> Callable:
    """Numba's dispatcher of the kernel ``module.name`` (every kernel rebound to its
    dispatcher first)."""
    bind_jit()
    module, name = qualified.rsplit(".", 1)
    return next(ns[n] for ns, n, func, _ in _KERNELS if func.__module__ == module and n == name)


def kernel(func: Callable | None) -> Callable | None:
    """The compiled function behind a kernel's name (binding them first), so a caller
    that holds a kernel, such as ``Policy.kernel``, skips the stand-in's extra call."""
    if func is None or hasattr(func, "py_func"):  # none, or a dispatcher already
        return func
    bind()
    target = getattr(func, "__wrapped__", func)
    if not hasattr(target, "__globals__"):  # the compiled module's function already
        return target
    return target.__globals__[target.__name__]


@njit(cache=True)
def stretch_sorted(sorted_survival, size):
    """``scheduler.stretch_sorted``: a descending curve resampled to ``size``."""
    out = np.zeros(max(size, 0))
    m = sorted_survival.size
    if size <= 0 or m == 0:
        return out
    # index (i * m) // size, without an integer division per element: q * size + rem
    # stays (i + 1) * m with 0 <= rem < size
    q = rem = 0
    for i in range(size):
        out[i] = sorted_survival[q]
        rem += m
        while rem >= size:
            rem -= size
            q += 1
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
    for r in range(n):  # counted without a branch on the values (a new draw each step)
        c = 0
        for j in range(g):
            v = survival[r, j]
            c += v >= t
            above += v > t
        out[r] = c
        at_least += c
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


@njit(cache=True)
def extra_from_terms(size, per_token, offset, kink, n_dec):
    """``EngineProfile.step_extra_s`` from its terms (``EngineProfile.extra_terms``):
    ``i * per_token + offset``, plus ``kink * min(i, n_dec)`` when the kink is priced."""
    extra = np.empty(size)
    for i in range(size):
        extra[i] = i * per_token
        extra[i] += offset
    if kink != 0.0:
        for i in range(size):
            extra[i] += kink * min(float(i), float(n_dec))
    return extra


def ring_capacity(rows: int, g: int, lag_steps: int, lag_rows: int) -> int:
    """Survivals the decision's ring holds for steps of up to ``rows`` rows of ``g``: the
    steps a later decision can still read (the ``lag_steps`` newest, and older ones
    stacked while they hold fewer than ``lag_rows`` rows: under ``(lag_steps + 1) * rows
    + lag_rows`` rows), plus a step written, plus what a write that wraps leaves unused
    (a step each)."""
    return ((lag_steps + 4) * rows + lag_rows) * g


def empty_ring(rows: int, g: int, lag_steps: int, lag_rows: int, history: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The decision's ring for ``history`` steps of up to ``rows`` rows: (the survivals,
    each step's ascending and in one piece, one after another round a buffer of
    :func:`ring_capacity`; ``slots`` [history, 2], each step's rows and where its
    survivals start; ``state`` = [next slot, steps held, where the next step is
    written]). A ring of slots a step wide would spread a step's survivals over
    ``history`` times as much memory, each written again only ``history`` steps later,
    when it has left the cache."""
    return (np.zeros(ring_capacity(rows, g, lag_steps, lag_rows)),
            np.zeros((max(1, history), 2), np.int64), np.zeros(3, np.int64))


def widen_ring(ring: np.ndarray, slots: np.ndarray, state: np.ndarray, rows: int, g: int,
               lag_steps: int, lag_rows: int) -> np.ndarray:
    """The ring's survivals moved into a buffer for steps of up to ``rows`` rows: the
    newest steps, as many as leave room for a step written and a wrap (every step a
    later decision reads is among them), in order from the start; ``slots`` and
    ``state`` updated in place. Returns the new buffer."""
    capacity = ring_capacity(rows, g, lag_steps, lag_rows)
    h = slots.shape[0]
    head, count = int(state[0]), int(state[1])
    keep, size = 0, 0
    while keep < count:
        s = (head - 1 - keep) % h
        m = int(slots[s, 0]) * g
        if size + m > capacity - 3 * rows * g:
            break
        keep += 1
        size += m
    wider = np.zeros(capacity)
    at = 0
    for j in range(keep - 1, -1, -1):
        s = (head - 1 - j) % h
        m = int(slots[s, 0]) * g
        start = int(slots[s, 1])
        wider[at: at + m] = ring[start: start + m]
        slots[s, 1] = at
        at += m
    state[1] = keep
    state[2] = at
    return wider


@njit(cache=True)
def lagged_slot(slots, ring_state, lag_steps, lag_rows):
    """Where ``Policy.lagged``'s view over the ring of past steps lies: the ring slot of
    the step ``lag_steps`` ago when that one step holds ``lag_rows`` rows (read where it
    is), -1 before there are that many steps, -2 when older steps must be stacked onto it
    (:func:`stacked_lagged`)."""
    if ring_state[1] < lag_steps:
        return -1
    slot = (ring_state[0] - lag_steps) % slots.shape[0]
    return slot if lag_rows <= slots[slot, 0] else -2


# numpy sorts up to 256 float64s with one SIMD sorting network, ~3x faster an element than
# the partitioning sort it takes above that (~0.8 us for 256, ~6 us for 560, ~28 us for
# 1,800 here): a step's survivals are split into runs of about this many, by value, and
# each run sorted alone. Runs a little over the target stay under 256.
SORT_RUN = 200
SORT_RUNS_MAX = 64


@njit(cache=True)
def lagged_runs(survival, current, ring, slots, ring_state, lag_steps, lag_rows, bounds):
    """:func:`lagged_slot`, and ``current`` (``survival`` flattened) arranged for numpy to
    sort in runs of about :data:`SORT_RUN`: its values split by value at pivots read from
    the newest step the ring holds (its survivals, sorted, at even ranks), each run after
    those below it, so the runs sorted one by one are the whole sorted (a sort's values do
    not depend on how it ran; NaN, never below a pivot, stays in the last run). Returns
    (the slot, the runs); ``bounds`` [runs + 1] gets where each run starts and the end.
    One run (a small step, no step held yet, a NaN pivot): ``current`` is left as it is."""
    slot = lagged_slot(slots, ring_state, lag_steps, lag_rows)
    n, g = survival.shape
    m = n * g
    bounds[0] = 0
    bounds[1] = m
    runs = min((m + SORT_RUN - 1) // SORT_RUN, bounds.size - 1)
    if runs <= 1 or ring_state[1] == 0:
        return slot, 1
    newest = (ring_state[0] - 1) % slots.shape[0]
    held = slots[newest, 0] * g
    start = slots[newest, 1]
    if held == 0:
        return slot, 1
    pivots = np.empty(runs - 1)
    for i in range(1, runs):
        p = ring[start + (i * held) // runs]
        if p != p:  # NaN: the values below it are not counted by v < p
            return slot, 1
        pivots[i - 1] = p
    flat = survival.reshape(m)
    for i in range(1, runs):  # where run i starts: the values below the i-th pivot
        p = pivots[i - 1]
        below = 0
        for x in range(m):
            below += flat[x] < p
        bounds[i + 1] = below
    bounds[1] = 0
    # each value written at its run's next place (bounds[b + 1]: run b's, its end once
    # every value is placed), with no branch on the value: the survivals are a new draw
    # every step, and a branch on them is often mispredicted
    last = runs - 1
    for x in range(m):
        v = flat[x]
        b = last
        for i in range(last):
            b -= v < pivots[i]
        current[bounds[b + 1]] = v
        bounds[b + 1] += 1
    return slot, runs


@njit(cache=True)
def stacked_lagged(ring, slots, ring_state, lag_steps, lag_rows, g, out):
    """The lagged view where :func:`lagged_slot` says -2: the survivals of ``lag_steps``
    steps ago with the steps before it until they hold ``lag_rows`` rows (or all the ring
    holds), written into the first places of ``out`` (at least the ring's size: an array
    handed back would cost its boxing, ~1 us), and whether they are sorted. Each step's
    are held sorted ascending, so the steps' runs are merged (the sorted values: a sort's
    values do not depend on how it ran), unless one is NaN (then the caller sorts them as
    numpy orders NaN). Returns (how many, whether sorted)."""
    h = slots.shape[0]
    head = ring_state[0]
    count = ring_state[1]
    newest = count - lag_steps
    total = slots[(head - count + newest) % h, 0]
    first = newest
    for j in range(newest - 1, -1, -1):
        total += slots[(head - count + j) % h, 0]
        first = j
        if total >= lag_rows:
            break
    if out.size < total * g:  # unchecked writes past it would corrupt memory
        raise ValueError("stacked_lagged: out is smaller than the lagged view")
    values = out[: total * g]
    bounds = np.empty(newest - first + 2, dtype=np.int64)  # where each step's run starts
    at = 0
    nan = False
    for j in range(first, newest + 1):
        s = (head - count + j) % h
        m = slots[s, 0] * g
        start = slots[s, 1]
        bounds[j - first] = at
        for i in range(m):
            v = ring[start + i]
            nan |= v != v
            values[at + i] = v
        at += m
    bounds[newest - first + 1] = at
    if nan or first == newest:
        return at, not nan
    merged = merged_runs(values, bounds)
    if merged.ctypes.data != values.ctypes.data:
        values[:] = merged
    return at, True


@njit(cache=True)
def merged_runs(values, bounds):
    """``values`` sorted, from the ascending runs that start at ``bounds`` (the last
    bound its end): pairs of neighbouring runs merged until one is left."""
    src = values
    dst = np.empty_like(values)
    runs = bounds.copy()
    k = runs.size - 1
    while k > 1:
        out = 0
        for p in range(0, k - 1, 2):
            lo, mid, hi = runs[p], runs[p + 1], runs[p + 2]
            i, j, o = lo, mid, lo
            while i < mid and j < hi:
                if src[j] < src[i]:
                    dst[o] = src[j]
                    j += 1
                else:
                    dst[o] = src[i]
                    i += 1
                o += 1
            dst[o: o + mid - i] = src[i: mid]
            o += mid - i
            dst[o: o + hi - j] = src[j: hi]
            runs[out] = lo
            out += 1
        if k % 2:  # an odd run out: carried over as it is
            lo, hi = runs[k - 1], runs[k]
            dst[lo: hi] = src[lo: hi]
            runs[out] = lo
            out += 1
        runs[out] = runs[k]
        k = out
        src, dst = dst, src
    return src


@njit(cache=True)
def lagged_topk_lengths(survival, current, lagged, slot, trace_idx, trace_accept_len, ring,
                        slots, ring_state, table_s, per_token, offset, kink,
                        pending_prefill, prefill_s_per_token, budget_tokens, ell, accepted,
                        stretch, displacement):
    """:func:`confidence_step` (and :func:`vllm_adaptive_step`) after the gather and the
    sorts (``current``: this step's survivals sorted ascending; the lagged view's, sorted
    ascending, in ring ``slot`` when it is one step's, else ``lagged``, empty before there
    is a lagged view). ``stretch``: the lagged curve resampled to this batch's candidates
    (the default scheduler), else read as it is (vLLM's); ``displacement``: the prefill
    verification pushes out of the step priced. Writes ``ell`` and ``accepted``; returns
    (the sum of l, trimmed)."""
    n_dec, g = survival.shape
    m = n_dec * g
    h = slots.shape[0]
    head = ring_state[0]
    count = ring_state[1]
    extra = extra_from_terms(m + 1, per_token, offset, kink, n_dec)
    if slot >= 0:
        lagged = ring[slots[slot, 1]: slots[slot, 1] + slots[slot, 0] * g]
    if lagged.size and stretch:  # a call each: the stretched curve stays contiguous
        k = budget_displacement(stretch_sorted(lagged[::-1], m), n_dec, table_s, extra,
                                pending_prefill, prefill_s_per_token, displacement)
    elif lagged.size:
        k = budget_displacement(lagged[::-1], n_dec, table_s, extra, pending_prefill,
                                prefill_s_per_token, displacement)
    else:
        k = budget_displacement(current[::-1], n_dec, table_s, extra, pending_prefill,
                                prefill_s_per_token, displacement)
    at = ring_state[2]
    if at + m > ring.size:  # round the buffer: this step's survivals stay in one piece
        at = 0
    ring[at: at + m] = current
    slots[head, 0] = n_dec
    slots[head, 1] = at
    ring_state[0] = (head + 1) % h
    ring_state[1] = min(count + 1, h)
    ring_state[2] = at + m
    k = max(0, min(k, m))
    if k == 0:
        ell[:] = 0
    elif k == m:
        ell[:] = g
    else:  # the k-th best survival: what np.partition finds at m - k
        ell[:] = counts_at(survival, current[m - k], k)
    trimmed = False
    total = n_dec
    for r in range(n_dec):
        total += ell[r]
    if total > budget_tokens:  # never exceed the token budget: trim uniformly
        cap = max(0, (budget_tokens - n_dec) // n_dec)
        for r in range(n_dec):
            ell[r] = min(ell[r], cap)
        trimmed = True
    drafts = 0
    for r in range(n_dec):
        accepted[r] = min(ell[r], trace_accept_len[trace_idx[r]])
        drafts += ell[r]
    return drafts, trimmed


_NO_LAG = np.empty(0)
# where stacked_lagged writes a lagged view stacked from several steps: the view is read
# by the decision that asked for it, before any other replica's, so one buffer serves all
_LAG_BUF = np.empty(0)
# where lagged_runs writes a step's sort runs: every entry it reads is written first in
# the same call, so one buffer serves every step (one allocation less per step)
RUN_BOUNDS = np.empty(SORT_RUNS_MAX + 1, np.int64)


def confidence_step(survival, current, trace_idx, trace_accept_len, ring, slots,
                    ring_state, lag_steps, lag_rows, table_s, per_token, offset, kink,
                    pending_prefill, prefill_s_per_token, budget_tokens, ell, accepted):
    """The default scheduler's whole decision for a step's decoding rows, as
    ``Replica._verify_lengths`` runs ``policies.confidence._confidence``, given their
    survivals [n, gamma] at their trace rows ``trace_idx`` (and flattened, ``current``,
    which this sorts in place): size the budget on the lagged survivals (the ring of
    :func:`empty_ring`: the last steps' survivals, each step's sorted ascending)
    stretched to this batch at this step's costs, admit the top-K drafts by current
    survival, trim to the token budget. This step's survivals then join the ring. Writes l and the accepted drafts into ``ell`` and
    ``accepted`` (the caller's buffers, reused from step to step); returns (the sum of l,
    trimmed to the budget).

    Kernels around numpy's sorts: numpy's SIMD sort is ~10x numba's on the survivals (a
    quicksort slows down on their many equal values), and fastest on runs of up to 256
    (:func:`lagged_runs`). Each step's survivals are sorted once and kept sorted, so a
    lagged window of one step (any batch of ``lag_rows`` or more) is read where it is."""
    return _lagged_step(survival, current, trace_idx, trace_accept_len, ring, slots,
                        ring_state, lag_steps, lag_rows, table_s, per_token, offset, kink,
                        pending_prefill, prefill_s_per_token, budget_tokens, ell, accepted,
                        True, True)


def vllm_adaptive_step(survival, current, trace_idx, trace_accept_len, ring, slots,
                       ring_state, lag_steps, lag_rows, table_s, per_token, offset, kink,
                       pending_prefill, prefill_s_per_token, budget_tokens, ell, accepted):
    """``policies.vllm_adaptive``'s whole decision, :func:`confidence_step`'s signature:
    the budget sized on the survivals of the step before as they are (not stretched to
    this batch) at this step's ``T + B`` costs (no displacement priced), then the top-B
    drafts by current survival, trimmed to the token budget."""
    return _lagged_step(survival, current, trace_idx, trace_accept_len, ring, slots,
                        ring_state, lag_steps, lag_rows, table_s, per_token, offset, kink,
                        pending_prefill, prefill_s_per_token, budget_tokens, ell, accepted,
                        False, False)


def _lagged_step(survival, current, trace_idx, trace_accept_len, ring, slots, ring_state,
                 lag_steps, lag_rows, table_s, per_token, offset, kink, pending_prefill,
                 prefill_s_per_token, budget_tokens, ell, accepted, stretch, displacement):
    """:func:`lagged_runs`, :func:`sorted_lagged`, then :func:`lagged_topk_lengths`."""
    slot, runs = lagged_runs(survival, current, ring, slots, ring_state, lag_steps, lag_rows,
                             RUN_BOUNDS)
    lagged = sorted_lagged(current, slot, runs, ring, slots, ring_state, lag_steps, lag_rows,
                           survival.shape[1])
    return lagged_topk_lengths(survival, current, lagged, slot, trace_idx,
                               trace_accept_len, ring, slots, ring_state, table_s, per_token,
                               offset, kink, pending_prefill, prefill_s_per_token,
                               budget_tokens, ell, accepted, stretch, displacement)


def sorted_lagged(current, slot, runs, ring, slots, ring_state, lag_steps, lag_rows, g):
    """The sorts of a lagged step between its kernels: ``current`` sorted in place, in
    the ``runs`` that :func:`lagged_runs` wrote into :data:`RUN_BOUNDS` (numpy's sort,
    ~10x numba's here), and the lagged view where ``slot`` says the ring's steps are
    stacked (:func:`stacked_lagged`, in :data:`_LAG_BUF`; else empty: the kernel reads the
    ring's slot)."""
    global _LAG_BUF
    if runs == 1:
        current.sort()
    else:
        at = RUN_BOUNDS[: runs + 1].tolist()
        for i in range(runs):
            current[at[i]: at[i + 1]].sort()
    if slot != -2:
        return _NO_LAG
    if _LAG_BUF.size < ring.size:
        _LAG_BUF = np.empty(max(ring.size, 2 * _LAG_BUF.size))
    n, is_sorted = stacked_lagged(ring, slots, ring_state, lag_steps, lag_rows, g, _LAG_BUF)
    return _LAG_BUF[:n] if is_sorted else np.sort(_LAG_BUF[:n])


# The lagged decisions whose steps the engine runs itself, around fused kernels of its
# own (``sim/fast.py``: fewer calls a step), and their (stretch, displacement) flags of
# :func:`lagged_topk_lengths`; another ``"lagged"`` kernel is called as it is.
LAGGED_STEPS = {confidence_step: (True, True), vllm_adaptive_step: (False, False)}


@njit(cache=True)
def constant_lengths(trace_idx, verify, trace_accept_len, trace_draft_tokens,
                     budget_tokens, ell, accepted):
    """The decision of a policy that verifies the same ``verify`` drafts for every
    request (``none``, ``mtp1``, ``fixed:K``: ``policies.constant``), as
    ``Replica._verify_lengths`` runs it for the rows at trace rows ``trace_idx``: capped
    at the drafts proposed there (``trace_draft_tokens``; empty: every row its whole
    block), trimmed uniformly to the token budget, and the drafts each accepts. Writes
    ``ell`` and ``accepted``; returns (the sum of l, trimmed)."""
    n_dec = trace_idx.size
    total = n_dec
    for r in range(n_dec):
        v = verify
        if trace_draft_tokens.size:
            v = min(v, trace_draft_tokens[trace_idx[r]])
        ell[r] = v
        total += v
    trimmed = False
    if total > budget_tokens:
        cap = max(0, (budget_tokens - n_dec) // n_dec)
        for r in range(n_dec):
            ell[r] = min(ell[r], cap)
        trimmed = True
    drafts = 0
    for r in range(n_dec):
        accepted[r] = min(ell[r], trace_accept_len[trace_idx[r]])
        drafts += ell[r]
    return drafts, trimmed


@njit(cache=True)
def vllm_adaptive_proposed(survival, candidates, proposed, trace_idx, trace_accept_len, last,
                           last_state, table_s, per_token, offset, kink, pending_prefill,
                           prefill_s_per_token, budget_tokens, ell, accepted):
    """:func:`vllm_adaptive_step` on a trace with ``draft_tokens``, where some requests'
    drafters proposed fewer drafts (none): the candidates are the drafts proposed
    (``candidates``, sorted ascending; ``survival`` holds -1 where a row proposed none,
    as ``scheduler.schedule_topk`` masks it; ``proposed`` per row), and the budget is
    sized on the candidates of the step before (``last``, ``last_state`` = [a step held,
    its candidates]; this step's own when that step had none), which this step's then
    replace. Writes ``ell`` and ``accepted``; returns (the sum of l, trimmed)."""
    n_dec, g = survival.shape
    m = n_dec * g
    c = candidates.size
    extra = extra_from_terms(m + 1, per_token, offset, kink, n_dec)
    if last_state[0] and last_state[1]:
        k = budget_displacement(last[: last_state[1]][::-1], n_dec, table_s, extra,
                                pending_prefill, prefill_s_per_token, False)
    else:
        k = budget_displacement(candidates[::-1], n_dec, table_s, extra, pending_prefill,
                                prefill_s_per_token, False)
    last[:c] = candidates
    last_state[0] = 1
    last_state[1] = c
    k = max(0, min(k, c, m))
    if k == 0:
        ell[:] = 0
    elif k == m:
        ell[:] = g
    else:  # the k-th best proposed draft; the -1s never reach it
        ell[:] = counts_at(survival, candidates[c - k], k)
    total = n_dec
    for r in range(n_dec):
        ell[r] = min(ell[r], proposed[r])
        total += ell[r]
    trimmed = False
    if total > budget_tokens:  # never exceed the token budget: trim uniformly
        cap = max(0, (budget_tokens - n_dec) // n_dec)
        for r in range(n_dec):
            ell[r] = min(ell[r], cap)
        trimmed = True
    drafts = 0
    for r in range(n_dec):
        accepted[r] = min(ell[r], trace_accept_len[trace_idx[r]])
        drafts += ell[r]
    return drafts, trimmed
