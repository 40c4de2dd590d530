"""Compiled (numba) twins of the engine step's batch arithmetic: admission, the replay
of a chain step and the removal of rows. ``sim/engine.py`` keeps the readable numpy code as the
reference and calls these when ``policies.compiled.NUMBA`` is on (``DSPARK_SIM_KERNELS``;
see that module): each replaces a dozen small numpy calls on the batch matrix by one
loop over its rows, with the same integer results (``tests/sim/test_compiled.py`` holds both
paths to the golden runs' bytes).
"""

from __future__ import annotations

import numpy as np

from dspark_sim.policies import compiled
from dspark_sim.policies.compiled import njit, prefetch

# the batch matrix's columns (``sim.engine``; repeated here because a compiled function
# reads module globals as constants and the engine imports this module)
REQUEST_ID, PROMPT_TOKENS, PREFILL_TARGET, PREFILLED, GENERATED, GENERATED_AT_ADMIT = range(6)
OUTPUT_TOKENS, TRACE_START, TRACE_LEN, STEPS, VERIFIED, ACCEPTED = range(6, 12)
# the rows of a replica's decision buffer (``Replica.decision_rows``), one array for the
# three that a compiled decision reads or writes per decoding row: each array a compiled
# call takes costs its unboxing
DECISION_ROWS = 3
TRACE_IDX_ROW, ELL_ROW, ACCEPTED_ROW = range(DECISION_ROWS)


@njit(cache=True)
def replay_chain(batch, n_dec, ell, accepted, chunk, hists, hist_bins, dt, itl_edges, now,
                 log_steps, log_verified, log_accepted, log_finish, log_generated,
                 log_first_token, trace_survival, compact, records, record, replica,
                 waiting, verify_tokens, prefill_tokens, drafting, hit, missed):
    """A chain step's replay (``Replica._replay`` with no tree or lossy plan): each
    decoding row emits ``min(accepted + 1, what is left of its output)`` and counts its
    step, verified and accepted drafts; the histograms (``hists``, ``StepStats.hists``'
    layout: ``hist_bins`` bins each of ``accepted`` and ``ell``, then the gaps') count
    ``accepted`` and ``ell``, and the inter-token gap ``dt`` of every decoding row
    (``bisect_left`` on ``itl_edges``);
    prefilling rows (after ``n_dec``) take their ``chunk`` (empty: none), and those it
    completes emit their first token (``log_first_token``, where not set before: a
    preempted request's stays). The decoding rows' next rows of ``trace_survival``
    (none: zero rows) are prefetched, for the next step's gather: a request's position
    moves a cache line or so a step, in a table that does not stay cached, and the
    gather otherwise waits on a miss a row. The step's ``engine.StepRecord`` goes into
    row ``record`` of ``records`` (``StepRecorder.rows``), from this step's counts and
    the caller's (``replica``, the ``waiting`` queue, ``verify_tokens`` and
    ``prefill_tokens``, the ``drafting`` rows, the prefix cache's ``hit`` and ``missed``
    tokens). Where ``compact``, rows that have finished then leave
    (:func:`drop_finished`); else they stay, counted, for the caller to read first.
    Returns (the rows now in ``batch``, emitted, accepted, completed prefills, rows that
    finished, the KV tokens those held: 0 where they stay)."""
    emitted = 0
    n_accepted = 0
    for r in range(n_dec):
        left = batch[r, OUTPUT_TOKENS] - batch[r, GENERATED]
        adv = min(accepted[r] + 1, left)
        batch[r, GENERATED] += adv
        batch[r, STEPS] += 1
        batch[r, VERIFIED] += ell[r]
        batch[r, ACCEPTED] += accepted[r]
        emitted += adv
        n_accepted += accepted[r]
        hists[accepted[r]] += 1
        hists[hist_bins + ell[r]] += 1
    if trace_survival.shape[0]:
        last = trace_survival.shape[1] - 1  # a row may straddle two lines
        for r in range(n_dec):
            pos = batch[r, GENERATED] - 1
            length = batch[r, TRACE_LEN]
            if pos >= length or pos < 0:  # as gather_trace_rows: a modulo only here
                pos %= length
            row = batch[r, TRACE_START] + pos
            prefetch(trace_survival, row, 0)
            prefetch(trace_survival, row, last)
    if n_dec:
        lo, hi = 0, itl_edges.size  # bisect.bisect_left, NaN included
        while lo < hi:
            mid = (lo + hi) // 2
            if itl_edges[mid] < dt:
                lo = mid + 1
            else:
                hi = mid
        hists[2 * hist_bins + lo] += n_dec
    n_done = take_chunks(batch, n_dec, chunk, log_first_token, now)
    n = batch.shape[0]
    write_record(records[record], now, dt, replica, n_dec, n, waiting,
                 verify_tokens + prefill_tokens, prefill_tokens, verify_tokens - n_dec,
                 emitted + n_done, n_accepted, 0, drafting, hit, missed)
    if compact:
        n_keep, n_gone, kv = drop_finished(batch, now, log_steps, log_verified,
                                           log_accepted, log_finish, log_generated)
        return n_keep, emitted, n_accepted, n_done, n_gone, kv
    n_gone = 0
    for r in range(n):
        n_gone += batch[r, GENERATED] >= batch[r, OUTPUT_TOKENS]
    return n, emitted, n_accepted, n_done, n_gone, 0


@njit(cache=True)
def take_chunks(batch, n_dec, chunk, log_first_token, now):
    """The prefilling rows (after ``n_dec``) take their ``chunk``; those it completes
    emit their first token, at ``now`` in ``log_first_token`` where none was written
    before (a preempted request's stays). Returns how many completed (in row order)."""
    n_done = 0
    for i in range(chunk.size):
        r = n_dec + i
        batch[r, PREFILLED] += chunk[i]
        if batch[r, PREFILLED] >= batch[r, PREFILL_TARGET]:
            n_done += 1
    for r in range(n_dec, n_dec + n_done):
        batch[r, GENERATED] += 1
        rid = batch[r, REQUEST_ID]
        if log_first_token[rid] != log_first_token[rid]:
            log_first_token[rid] = now
    return n_done


@njit(cache=True)
def write_record(rec, end_s, dt_s, replica, decode_batch, running, waiting, batch_tokens,
                 prefill_tokens, verified_drafts, emitted_tokens, accepted_tokens,
                 unverified_tokens, drafting_requests, prefix_hit_tokens,
                 prefix_miss_tokens):
    """One ``engine.StepRecord``, its fields in its order, into the recorder's row
    ``rec``."""
    rec[0] = end_s
    rec[1] = dt_s
    rec[2] = replica
    rec[3] = decode_batch
    rec[4] = running
    rec[5] = waiting
    rec[6] = batch_tokens
    rec[7] = prefill_tokens
    rec[8] = verified_drafts
    rec[9] = emitted_tokens
    rec[10] = accepted_tokens
    rec[11] = unverified_tokens
    rec[12] = drafting_requests
    rec[13] = prefix_hit_tokens
    rec[14] = prefix_miss_tokens


@njit(cache=True)
def drop_finished(batch, now, log_steps, log_verified, log_accepted, log_finish,
                  log_generated):
    """The rows that reached their output length leave ``batch``, as ``Replica._finish``
    takes them: their counters, ``now`` and their output into the log; the rows that
    stay move up in place, in order (the caller keeps ``batch[:n_keep]``): numba's boxing
    of an array handed back (~1 us) would cost more than the step's replay. Returns (the
    rows kept, the rows gone, the KV tokens those held)."""
    n_keep = n_gone = kv = 0
    for r in range(batch.shape[0]):
        if batch[r, GENERATED] < batch[r, OUTPUT_TOKENS]:
            if n_gone:
                batch[n_keep] = batch[r]
            n_keep += 1
            continue
        n_gone += 1
        kv += batch[r, PREFILLED] + batch[r, GENERATED] - batch[r, GENERATED_AT_ADMIT]
        rid = count_into_log(batch[r], log_steps, log_verified, log_accepted)
        log_finish[rid] = now
        log_generated[rid] = batch[r, GENERATED]
    return n_keep, n_gone, kv


@njit(cache=True)
def remove_rows(batch, keep, log_steps, log_verified, log_accepted):
    """``Replica._remove``: split the batch into kept and gone rows (order kept), add the
    gone rows' counters to the log. Returns (kept, gone, KV tokens freed, prefill tokens
    still pending in the gone rows, how many of them were still prefilling)."""
    n, c = batch.shape
    n_keep = 0
    for r in range(n):
        if keep[r]:
            n_keep += 1
    kept = np.empty((n_keep, c), dtype=batch.dtype)
    gone = np.empty((n - n_keep, c), dtype=batch.dtype)
    i = j = 0
    kv = pending = prefilling = 0
    for r in range(n):
        if keep[r]:
            kept[i] = batch[r]
            i += 1
            continue
        gone[j] = batch[r]
        j += 1
        kv += batch[r, PREFILLED] + batch[r, GENERATED] - batch[r, GENERATED_AT_ADMIT]
        pending += batch[r, PREFILL_TARGET] - batch[r, PREFILLED]
        if batch[r, PREFILLED] < batch[r, PREFILL_TARGET]:
            prefilling += 1
        count_into_log(batch[r], log_steps, log_verified, log_accepted)
    return kept, gone, kv, pending, prefilling


@njit(cache=True)
def count_into_log(row, log_steps, log_verified, log_accepted):
    """A leaving batch ``row``'s step, verified and accepted counters added to its
    request's log entries. Returns the request's id."""
    rid = row[REQUEST_ID]
    log_steps[rid] += row[STEPS]
    log_verified[rid] += row[VERIFIED]
    log_accepted[rid] += row[ACCEPTED]
    return rid


@njit(cache=True)
def admit_fcfs(batch, n_prefilling, rows, head, used, reserve, admit_need, verify_slots,
               kv_capacity, out):
    """``Replica._admit``: the waiting requests ``head`` (the queue's first, as many as
    the batch has room for) join in order while their KV fits (``used`` so far; a request
    needs its prompt + output when ``reserve``, else its prefill target and verify slots),
    the first that does not blocking the rest, unless the batch would be empty. The new
    batch is written into ``out`` (:func:`admit_rows`). Returns (its rows: ``batch``'s
    where none joined, and then ``out`` is untouched), :func:`admit_rows`' other three
    results, how many joined and whether KV held one back."""
    taken = 0
    blocked = False
    for i in range(head.size):
        rid = head[i]
        need = admit_need[rid] if reserve else rows[rid, PREFILL_TARGET] + verify_slots
        if used + need > kv_capacity and (batch.shape[0] or taken):
            blocked = True
            break
        taken += 1
        used += need
    if taken == 0:
        return batch.shape[0], 0, 0, 0, 0, blocked
    n, kv, pending, n_new = admit_rows(batch, n_prefilling, rows, head[:taken], out)
    return n, kv, pending, n_new, taken, blocked


@njit(cache=True)
def admit_rows(batch, n_prefilling, rows, taken, out):
    """``Replica._admit``'s batch update: the ``taken`` requests' rows join the batch,
    those already prefilled (disaggregated prefill) after its decoding rows and the rest
    at its end, so the batch stays [decoding | prefilling]. Written into ``out`` (room
    for them all), whose first rows may be ``batch`` itself (the replica's buffer: its
    decoding rows then stay where they are); numba's boxing of an array handed back
    (~1 us) would cost more than the admission. Returns (the new batch's rows, the KV
    tokens the prefilled rows bring, the prefill tokens the others bring, how many
    others)."""
    n_old = batch.shape[0]
    k = taken.size
    if out.shape[0] < n_old + k:  # unchecked writes past it would corrupt memory
        raise ValueError("admit_rows: out has fewer rows than the new batch")
    ready = np.zeros(k, dtype=np.bool_)
    n_ready = 0
    for i in range(k):
        r = taken[i]
        if rows[r, PREFILLED] >= rows[r, PREFILL_TARGET]:
            ready[i] = True
            n_ready += 1
    n_dec = n_old - n_prefilling
    apart = n_old > 0 and batch.ctypes.data != out.ctypes.data
    if apart:
        for r in range(n_dec):
            out[r] = batch[r]
    # the prefilling rows move down past the prefilled newcomers, the last first: where
    # ``out`` is ``batch``, a row is read before its place is written
    if apart or n_ready:
        for r in range(n_old - 1, n_dec - 1, -1):
            out[r + n_ready] = batch[r]
    at = n_dec
    kv = 0
    for i in range(k):
        if ready[i]:
            r = taken[i]
            out[at] = rows[r]
            at += 1
            kv += rows[r, PREFILLED] + rows[r, GENERATED] - rows[r, GENERATED_AT_ADMIT]
    at = n_old + n_ready
    pending = 0
    for i in range(k):
        if not ready[i]:
            r = taken[i]
            out[at] = rows[r]
            at += 1
            pending += rows[r, PREFILL_TARGET]
    return n_old + k, kv, pending, k - n_ready


@njit(cache=True)
def decode_attention_units(batch, n_dec, ell, window):
    """``Replica._attention_units`` of a step without prefill chunks or skipped rows:
    (sum over decoding rows of (1 + l) x attended context, context of the rows that
    verify a draft), both integer sums; ``window`` < 0: no window."""
    query_ctx = 0
    multi_kv = 0
    for r in range(n_dec):
        context = batch[r, PREFILLED] + batch[r, GENERATED] - batch[r, GENERATED_AT_ADMIT]
        attended = context if window < 0 else min(context, window)
        query_ctx += (1 + ell[r]) * attended
        if ell[r] > 0:
            multi_kv += context
    return query_ctx, multi_kv


@njit(cache=True)
def extra_terms(n_dec, kv_tokens, batch_rows, draft_s, profile_terms):
    """``EngineProfile.extra_terms`` (per token, offset, kink) from the profile's scalars
    ``profile_terms`` (:func:`profile_terms`), the same operations in the same order."""
    logits, kv_s, attn, request_s, multi, window = profile_terms
    mean_ctx = kv_tokens / max(1, batch_rows)
    per_token = logits
    base = draft_s + kv_s * kv_tokens
    if n_dec:
        per_token += attn * (mean_ctx if window < 0 else min(mean_ctx, window))
        base += request_s * n_dec
    kink = multi * mean_ctx if n_dec and multi != 0.0 else 0.0
    return per_token, base + per_token * n_dec, kink


def profile_terms(profile) -> np.ndarray | None:
    """What :func:`extra_terms` reads of an ``EngineProfile`` (-1: no attention window);
    None for a window of a fraction of a token (the kernels take a whole one)."""
    window = profile.attn_window_tokens
    if window is not None and window != int(window):
        return None
    return np.array([profile.logits_s_per_row, profile.kv_s_per_token,
                     profile.attn_s_per_query_ctx, profile.request_s,
                     profile.multi_kv_s_per_token, -1.0 if window is None else window],
                    dtype=np.float64)


@njit(cache=True)
def decision_inputs(batch, n_dec, trace_survival, trace_idx, survival, flat, kv_tokens,
                    draft_s, profile_terms):
    """:func:`gather_trace_rows`, then the step's :func:`extra_terms` (the batch's rows
    are its ``batch_rows``): what the compiled decision reads, in one call."""
    gather_trace_rows(batch, n_dec, trace_survival, trace_idx, survival, flat)
    return extra_terms(n_dec, kv_tokens, batch.shape[0], draft_s, profile_terms)


@njit(cache=True)
def decision_runs(batch, n_dec, trace_survival, rows, survival_buf, flat_buf, kv_tokens,
                  draft_s, profile_terms, ring, slots, ring_state, lag_steps, lag_rows,
                  bounds):
    """:func:`decision_inputs`, then ``compiled.lagged_runs`` on the survivals gathered:
    a lagged decision's kernels before numpy's sorts, in one call (a call's dispatch and
    its arguments' unboxing cost more than a small batch's arithmetic). Takes the
    replica's whole buffers and slices its ``n_dec`` rows here (``rows``: the
    :data:`DECISION_ROWS` layout, of which it writes the trace positions; the survivals
    as ``survival_buf`` rows and, flattened, at the start of ``flat_buf``): a view made
    in Python, and each array a compiled call unboxes, cost more. Returns (per token,
    offset, kink, the lagged slot, the runs)."""
    survival = survival_buf[:n_dec]
    flat = flat_buf[: n_dec * survival_buf.shape[1]]
    per_token, offset, kink = decision_inputs(batch, n_dec, trace_survival,
                                              rows[TRACE_IDX_ROW, :n_dec], survival, flat,
                                              kv_tokens, draft_s, profile_terms)
    slot, runs = compiled.lagged_runs(survival, flat, ring, slots, ring_state, lag_steps,
                                      lag_rows, bounds)
    return per_token, offset, kink, slot, runs


@njit(cache=True)
def priced_topk_lengths(n_dec, survival_buf, flat_buf, lagged, slot, rows, trace_accept_len,
                        ring, slots, ring_state, table_s, per_token, offset, kink,
                        pending_prefill, prefill_s_per_token, budget_tokens, stretch,
                        displacement, batch, dense_step_s, kv_tokens, draft_s,
                        profile_terms, context_terms):
    """``compiled.lagged_topk_lengths`` of a decode-only chain step (no prefilling rows),
    then its price, :func:`decode_step_s` at the verify tokens decided (the decoding rows
    and their drafts), in one call: the engine then has no step to price. The buffers
    are whole, as :func:`decision_runs` takes them (``current``: ``flat_buf``'s first
    ``n_dec`` x gamma values, sorted; ``rows``' trace positions read, its l and accepted drafts
    written). Returns (the sum of l, trimmed, the step's seconds)."""
    ell = rows[ELL_ROW, :n_dec]
    drafts, trimmed = compiled.lagged_topk_lengths(
        survival_buf[:n_dec], flat_buf[: n_dec * survival_buf.shape[1]], lagged, slot,
        rows[TRACE_IDX_ROW, :n_dec], trace_accept_len, ring, slots, ring_state, table_s,
        per_token, offset, kink, pending_prefill, prefill_s_per_token, budget_tokens, ell,
        rows[ACCEPTED_ROW, :n_dec], stretch, displacement)
    dt = decode_step_s(batch, n_dec, ell, n_dec + drafts, dense_step_s, kv_tokens, draft_s,
                       profile_terms, context_terms)
    return drafts, trimmed, dt


@njit(cache=True)
def decode_step_s(batch, n_dec, ell, verify_tokens, dense_step_s, kv_tokens, draft_s,
                  profile_terms, context_terms):
    """``Replica._step_time_s`` of a decode-only chain step whose draft is priced per
    step (``draft_s``): draft + target at the verify tokens + KV reads + the LM head of
    each verify token + the context terms (``context_terms``: the profile has some;
    :func:`decode_attention_units`), summed in the reference's order."""
    logits, kv_s, attn, request_s, multi, window = profile_terms
    dt = draft_s
    dt += dense_step_s[verify_tokens]
    dt += kv_s * kv_tokens
    if logits != 0.0:
        dt += logits * verify_tokens
    if context_terms:
        query_ctx, multi_kv = decode_attention_units(batch, n_dec, ell,
                                                     -1 if window < 0 else int(window))
        dt += attn * query_ctx + multi * multi_kv + request_s * n_dec
    return dt


@njit(cache=True)
def prefill_chunks(batch, n_dec, left, out):
    """``Replica._prefill_chunks``: the prefilling rows' (after ``n_dec``) chunks, FCFS
    from the ``left`` tokens of the budget, and the tokens each had left, written into
    the first columns of ``out``'s two rows (arrays handed back would cost their boxing).
    Returns the chunks' sum."""
    n = batch.shape[0] - n_dec
    if out.shape[1] < n:  # unchecked writes past it would corrupt memory
        raise ValueError("prefill_chunks: out has fewer columns than prefilling rows")
    chunk = out[0]
    remaining = out[1]
    before = 0
    total = 0
    for i in range(n):
        r = batch[n_dec + i, PREFILL_TARGET] - batch[n_dec + i, PREFILLED]
        remaining[i] = r
        c = max(min(r, left - before), 0)
        chunk[i] = c
        total += c
        before += r
    return total


# The chunks' attention units are sums of multiples of 0.5 (a chunk of c tokens after f
# filled attends f + c / 2 each), exact in float64 below 2**52 in any order: numpy's
# pairwise sum and a loop give the same bits there, and a step past it (none seen) is
# left to numpy.
EXACT_HALVES = 1 << 53


@njit(cache=True)
def chunked_step_s(batch, n_dec, ell, verify_tokens, chunk, remaining, dense_step_s,
                   kv_tokens, draft_s, profile_terms, context_terms):
    """``Replica._step_time_s`` of a chain step with prefill chunks (``chunk``, the
    tokens each prefilling row had ``remaining``) whose draft is priced per step
    (``draft_s``, 0 without decoding rows): draft + target at the step's tokens + KV
    reads + the LM head of each verify token and finishing prefill + the context terms
    (``Replica._attention_units``), summed in the reference's order; NaN where the
    chunks' units leave exact float range."""
    logits, kv_s, attn, request_s, multi, window = profile_terms
    prefill_tokens = 0
    finishing = 0
    for i in range(chunk.size):
        prefill_tokens += chunk[i]
        if chunk[i] == remaining[i]:
            finishing += 1
    if prefill_tokens == 0:  # no chunk this step: none finishes
        finishing = 0
    dt = draft_s
    tokens = verify_tokens + prefill_tokens
    dt += dense_step_s[tokens] if tokens else 0.0
    dt += kv_s * kv_tokens
    if logits != 0.0:
        dt += logits * (verify_tokens + finishing)
    if context_terms:
        query_ctx = multi_kv = 0.0
        ctx_requests = n_dec
        if n_dec:
            q, m = decode_attention_units(batch, n_dec, ell, -1 if window < 0 else int(window))
            query_ctx += float(q)
            multi_kv += float(m)
        halves = 0  # the chunks' query x attended context, in half tokens
        filled_kv = 0
        for i in range(chunk.size):
            c = chunk[i]
            f = batch[n_dec + i, PREFILLED]
            twice = 2 * f + c
            if window >= 0:
                twice = min(twice, 2 * int(window))
            halves += c * twice
            if abs(halves) >= EXACT_HALVES:
                return np.nan
            if c > 0 and f > 0:
                filled_kv += f
                ctx_requests += 1
        query_ctx += float(halves) / 2.0
        multi_kv += float(filled_kv)
        dt += attn * query_ctx + multi * multi_kv + request_s * ctx_requests
    return dt

@njit(cache=True)
def trace_positions(batch, n_dec, trace_idx):
    """The first ``n_dec`` rows' trace positions, as :func:`gather_trace_rows` writes
    them, for a decision that reads no survivals."""
    for r in range(n_dec):
        pos = batch[r, GENERATED] - 1
        length = batch[r, TRACE_LEN]
        if pos >= length or pos < 0:  # Python's modulo, only where it changes pos
            pos %= length
        trace_idx[r] = batch[r, TRACE_START] + pos


@njit(cache=True)
def gather_proposed(batch, n_dec, trace_survival, trace_draft_tokens, trace_idx, survival,
                    proposed, candidates):
    """The first ``n_dec`` rows' trace positions, the drafts proposed there
    (``proposed``), their survivals with -1 where none was proposed (``survival``) and
    the proposed ones' flat in ``candidates``; returns how many those are."""
    trace_positions(batch, n_dec, trace_idx)
    g = trace_survival.shape[1]
    c = 0
    for r in range(n_dec):
        t = trace_idx[r]
        d = trace_draft_tokens[t]
        proposed[r] = d
        for j in range(g):
            if j < d:
                v = trace_survival[t, j]
                survival[r, j] = v
                candidates[c] = v
                c += 1
            else:
                survival[r, j] = -1.0
    return c


@njit(cache=True)
def gather_trace_rows(batch, n_dec, trace_survival, trace_idx, survival, flat):
    """The first ``n_dec`` rows' trace positions (``TRACE_START + (GENERATED - 1) mod
    TRACE_LEN``, as ``Replica._verify_lengths`` computes them) and their survivals, written
    into the caller's buffers (``trace_idx`` [n_dec], ``survival`` [n_dec, gamma] and
    ``flat``, the same survivals flattened)."""
    g = trace_survival.shape[1]
    # the positions first, then the rows: the loads of scattered rows, each a likely
    # cache miss, are then independent of the (division's) arithmetic and overlap
    for r in range(n_dec):
        pos = batch[r, GENERATED] - 1
        length = batch[r, TRACE_LEN]
        if pos >= length or pos < 0:  # Python's modulo, only where it changes pos
            pos %= length
        trace_idx[r] = batch[r, TRACE_START] + pos
    for r in range(n_dec):
        t = trace_idx[r]
        for j in range(g):
            v = trace_survival[t, j]
            survival[r, j] = v
            flat[r * g + j] = v
