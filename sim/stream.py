"""Streamed runs: memory that does not grow with the request count.

A run of more than ``sim.api.STREAM_ABOVE`` requests does not size the request log and
the batch rows for every request. They live in a window of slots (:class:`RequestWindow`:
request ``rid`` in slot ``rid % size``, ``size`` a whole number of chunks); when the
arrivals reach a chunk whose slots are still taken, the oldest chunk, all of whose
requests have finished (or were refused), is written to a parquet part file and its
slots are refilled with the next chunk's requests. The per-step series is spilled at
the same moments. The columns the summary reads are kept in memory as the parts are
written (:meth:`SpillFolder.kept_log`, :meth:`SpillFolder.kept_steps`: the same figures,
from the same functions, as an in-memory run of the same requests), so the summary reads
no part back; ``requests.parquet`` is the parts' concatenation, sunk from a lazy scan of
them in the background while the summary is computed (:meth:`SpillFolder.sink_requests`)
and placed with ``summary.json`` by ``sim.outputs.write_run``.

A request still in the system after ``size`` later requests have arrived (only a run
whose queue grows without bound gets there: the default window holds about 87 minutes
of arrivals at 200 req/s) stops the run, as the step bound does: ``bounded_by`` is
``"window"`` and the requests not yet sent are left out of the outputs.
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import fields
from pathlib import Path

import numpy as np

from dspark_sim.io import LazyModule
from dspark_sim.sim.engine import (
    OUTPUT_TOKENS,
    PROMPT_TOKENS,
    STEP_FIELDS,
    RequestLog,
    SimContext,
    request_rows,
)
from dspark_sim.sim.metrics import StepSeries, requests_frame
from dspark_sim.sim.prefill import PrefillPool
from dspark_sim.sim.workload import RequestStream, StreamChunk

pl = LazyModule("polars")  # imported when a frame is built: a run writing no files needs none

# Step fields no summary figure reads (sim.metrics): not kept, to keep a day's series
# (~12 M steps) from costing a quarter more memory than it needs (a streamed run has no
# prefix cache: its hit counts are zeros).
UNREAD_STEP_FIELDS = ("replica", "waiting", "prefill_tokens", "prefix_hit_tokens",
                      "prefix_miss_tokens")


class SpillFolder:
    """A temporary folder of parquet parts: the requests' chunks and the step series'
    chunks, in order. :meth:`close` removes it (a run's result holds it until then).

    The parts are written by one background thread, on the machine's second core while
    the run goes on (polars builds and writes a frame without the GIL); each gets data
    the run no longer writes to, and a part's path is known when it is asked for.
    :meth:`wait` before reading the kept columns; at most ``BACKLOG`` writes wait at once.

    The columns the summary reads (``KEPT_REQUEST_FIELDS``, ~37 bytes a request, the
    counts as int32; the step fields but ``UNREAD_STEP_FIELDS``, 72 bytes a step; the
    prefill times) are kept as each part is written, chunk by chunk: reading them back from the parts after the
    run cost a day half a minute of parquet decoding, for the same arrays. ``lossy``:
    the trace rows and changed tokens (only a lossy policy's quality cost reads them)
    are kept too."""

    BACKLOG = 4

    def __init__(self, *, lossy: bool = False) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="dspark-sim-spill-"))
        self.request_parts: list[Path] = []
        self.step_parts: list[Path] = []
        self.prefill_parts: list[Path] = []
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dspark-spill")
        self._writes: deque[Future] = deque()
        kept = KEPT_REQUEST_FIELDS + (LOSSY_REQUEST_FIELDS if lossy else ())
        self._requests: dict[str, list[np.ndarray]] = {f: [] for f in kept}
        self._steps: dict[str, list[np.ndarray]] = {
            f: [] for f in STEP_FIELDS if f not in UNREAD_STEP_FIELDS}
        self._prefill: dict[str, list[np.ndarray]] = {"submitted_s": [], "start_s": []}
        self._sunk: Future | None = None

    def _write(self, fn: Callable, *args) -> None:
        while self._writes and (self._writes[0].done() or len(self._writes) >= self.BACKLOG):
            self._writes.popleft().result()  # a failed write fails the run here
        self._writes.append(self._writer.submit(fn, *args))

    def write_requests(self, log: RequestLog, first_id: int) -> None:
        """``log`` (the run's no longer) as requests.parquet's rows from ``first_id``."""
        path = self.path / f"requests-{len(self.request_parts):06d}.parquet"

        def write() -> None:
            requests_frame(log, first_id=first_id).write_parquet(path)
            for f, chunks in self._requests.items():
                chunks.append(_mapped(getattr(log, f), narrow=f in NARROW_REQUEST_FIELDS))
        self._write(write)
        self.request_parts.append(path)

    def write_steps(self, cols: dict[str, np.ndarray]) -> None:
        if not len(cols[STEP_FIELDS[0]]):
            return
        path = self.path / f"steps-{len(self.step_parts):06d}.parquet"

        def write() -> None:
            pl.DataFrame(cols).write_parquet(path)
            for f, chunks in self._steps.items():  # copies: the recorder's columns are
                chunks.append(_mapped(cols[f]))   # views of buffers up to twice as long
        self._write(write)
        self.step_parts.append(path)

    def write_prefill(self, submitted_s: np.ndarray, start_s: np.ndarray) -> None:
        path = self.path / f"prefill-{len(self.prefill_parts):06d}.parquet"

        def write() -> None:
            pl.DataFrame({"submitted_s": submitted_s, "start_s": start_s}).write_parquet(path)
            self._prefill["submitted_s"].append(_mapped(submitted_s))
            self._prefill["start_s"].append(_mapped(start_s))
        self._write(write)
        self.prefill_parts.append(path)

    def wait(self) -> None:
        """Every part asked for written (a failed write raises here)."""
        while self._writes:
            self._writes.popleft().result()

    def requests(self) -> pl.LazyFrame:
        """All request parts as one frame, in request order (scanned, not loaded)."""
        self.wait()
        return pl.scan_parquet(self.request_parts)

    def kept_log(self) -> RequestLog:
        """The request log the summary reads (``requests_frame``'s rows as
        ``requests.parquet`` holds them; the per-request counters no summary figure reads
        are left empty, and the trace rows and changed tokens only a lossy policy's
        quality cost reads are zeros for the others). Each column is joined and its
        chunks let go before the next, so the kept columns are held about once."""
        self.wait()
        cols = {f: _joined(chunks, widest=True) for f, chunks in self._requests.items()}
        empty = np.zeros(0, np.int64)
        zeros = np.broadcast_to(np.int64(0), cols["arrival_s"].shape)
        return RequestLog(
            arrival_s=cols["arrival_s"], prompt_tokens=cols["prompt_tokens"],
            output_tokens=empty, trace_row=cols.get("trace_row", zeros), replica=empty,
            first_token_s=cols["first_token_s"], finish_s=cols["finish_s"], steps=empty,
            draft_tokens_verified=empty, accepted_tokens=empty, generated=cols["generated"],
            preemptions=cols["preemptions"], rejected=cols["rejected"],
            changed_tokens=cols.get("changed_tokens", zeros))

    def kept_prefill(self, pool: PrefillPool) -> PrefillPool:
        """``pool`` with every request's prefill submission and start times, for its
        summary."""
        self.wait()
        pool.submitted_s = _joined(self._prefill["submitted_s"])
        pool.start_s = _joined(self._prefill["start_s"])
        return pool

    def kept_steps(self) -> StepSeries:
        """The per-step series (the fields no figure reads as zeros)."""
        self.wait()
        if not self.step_parts:
            return StepSeries.from_columns({f: np.zeros(0) for f in STEP_FIELDS})
        cols = {f: _joined(chunks) for f, chunks in self._steps.items()}
        n = len(cols["end_s"])
        cols |= {f: np.broadcast_to(0.0, (n,)) for f in UNREAD_STEP_FIELDS}
        return StepSeries.from_columns(cols)

    def sink_requests(self) -> None:
        """Start writing ``requests.parquet`` (the parts' concatenation, sunk from their
        scan as ``sim.outputs.write_run`` sinks a lazy frame: the same bytes) into this
        folder, in the background: polars sinks without the GIL, on the core the
        summary leaves free. Started before a run's outputs are asked for, since the
        run ends before its caller says whether it writes them; a run that never
        writes them has spent the idle core on it."""
        self.wait()
        path = self.path / "requests.parquet"
        self._sunk = self._writer.submit(
            lambda: pl.scan_parquet(self.request_parts).sink_parquet(path))

    def write_requests_file(self, path: Path) -> None:
        """``requests.parquet`` at ``path`` (a writer for ``sim.outputs.write_run``): the
        sunk file linked there, or copied where ``path`` is on another file system;
        sunk now if :meth:`sink_requests` was not called. A failed sink raises here."""
        if self._sunk is None:
            self.sink_requests()
        self._sunk.result()
        src = self.path / "requests.parquet"
        try:
            os.link(src, path)
        except OSError:  # another file system, or one without hard links
            shutil.copyfile(src, path)

    def close(self) -> None:
        self._writer.shutdown(wait=True, cancel_futures=True)
        self._writes.clear()
        self._sunk = None
        for kept in (self._requests, self._steps, self._prefill):
            for chunks in kept.values():
                chunks.clear()
        shutil.rmtree(self.path, ignore_errors=True)


class RequestWindow:
    """The request slots of a streamed run (module docstring). ``reject(rows, ctx)``
    gives each new request's refusal code (``sim.api.rejections``)."""

    def __init__(self, ctx: SimContext, requests: Iterator[StreamChunk], n: int,
                 last_arrival_s: float, spill: SpillFolder, reject: Callable, *, chunk: int,
                 chunks: int, disaggregated: bool = False) -> None:
        self.ctx = ctx
        self.requests = requests  # the stream's chunks, in order (each ``chunk`` long)
        self.spill = spill
        self.reject = reject
        self.disaggregated = disaggregated
        self.n = n
        self.last_arrival_s = last_arrival_s
        self.chunk = chunk
        self.size = len(ctx.log.arrival_s)
        # each slot's arrival time (the open loop's clock reads it before sending)
        self.arrival_at = np.zeros(self.size)
        if self.size % chunk or self.size < chunk * min(chunks, -(-self.n // chunk)):
            raise ValueError("the log must hold a whole number of chunks")
        # disaggregated prefill: the prefill instances' per-request state shares the slots
        self.pool: PrefillPool | None = None
        self.loaded = 0  # chunks whose requests have been put into slots
        self.flushed = 0  # chunks written to the spill folder
        while self.loaded * chunk < min(self.n, self.size):
            self._load()

    @staticmethod
    def slots(n: int, chunk: int, chunks: int) -> int:
        """Slots a run of ``n`` requests needs: at most ``chunks`` chunks."""
        return min(chunks, -(-n // chunk)) * chunk

    def admit(self, rid: int) -> bool:
        """Make room for request ``rid`` (its chunk loaded into its slots); False when
        the chunk it replaces still has requests in the system: the run stops."""
        if rid % self.chunk or rid < self.size or self.loaded * self.chunk > rid:
            return True
        base = rid % self.size
        log = self.ctx.log
        old = slice(base, base + self.chunk)
        if (np.isnan(log.finish_s[old]) & (log.rejected[old] == 0)).any():
            if not self.ctx.stop.triggered:
                self.ctx.stop.succeed("window")
            return False
        self._flush()
        self._load()
        return True

    def finish(self) -> None:
        """After the run (and the replicas' ``flush``): write every chunk still in slots,
        and the chunks of requests never sent (their arrival empty, as an in-memory run
        leaves them), unless the window stopped the run. Then the step series' rest."""
        stopped = self.ctx.stop.triggered and self.ctx.stop.value == "window"
        while self.flushed < self.loaded:
            self._flush()
            if not stopped and self.loaded * self.chunk < self.n:
                self._load()
        self.spill.write_steps(self.ctx.steps.take())

    def _span(self, q: int) -> tuple[int, int, slice]:
        lo = q * self.chunk
        hi = min(lo + self.chunk, self.n)
        base = lo % self.size
        return lo, hi, slice(base, base + hi - lo)

    def _load(self) -> None:
        ctx, log = self.ctx, self.ctx.log
        lo, hi, sl = self._span(self.loaded)
        c = next(self.requests)
        if c.first != lo or len(c.prompt_tokens) != hi - lo:
            raise ValueError(f"chunk {self.loaded}: requests {c.first}.. of "
                             f"{len(c.prompt_tokens)}, expected {lo}..{hi - 1}")
        log.clear(slice(sl.start, sl.start + self.chunk))
        self.arrival_at[sl] = c.arrival_s
        log.prompt_tokens[sl] = c.prompt_tokens
        log.output_tokens[sl] = c.output_tokens
        log.trace_row[sl] = c.trace_rows
        rows = request_rows(c.prompt_tokens, c.output_tokens, ctx.trace, c.trace_rows,
                            disaggregated=self.disaggregated, first_id=sl.start)
        ctx.rows[sl] = rows
        ctx.admit_need[sl] = rows[:, PROMPT_TOKENS] + rows[:, OUTPUT_TOKENS]
        if ctx.request_state is not None:
            ctx.request_state[sl] = 0.0
        log.rejected[sl] = self.reject(rows, ctx)
        if self.pool is not None:
            self.pool.prompt[sl] = c.prompt_tokens.tolist()
            self.pool.submitted_s[sl] = np.nan
            self.pool.start_s[sl] = np.nan
        self.loaded += 1

    def attach(self, pool: PrefillPool) -> None:
        """Keep ``pool``'s per-request state (built over the slots) with the chunks."""
        self.pool = pool

    def _flush(self) -> None:
        lo, _hi, sl = self._span(self.flushed)
        # copies: the slots take the next chunk while the parts are written
        log = self.ctx.log.view(sl)
        self.spill.write_requests(RequestLog(*(None if (a := getattr(log, f.name)) is None
                                               else a.copy() for f in fields(log))), lo)
        if self.pool is not None:
            self.spill.write_prefill(self.pool.submitted_s[sl].copy(),
                                     self.pool.start_s[sl].copy())
        self.spill.write_steps(self.ctx.steps.take())
        self.flushed += 1


class ChunkTee:
    """A stream's chunks read twice: in order by the window (an iterator), and by index,
    ahead of it, by the front end of a streamed run computed ahead
    (``sim.ahead.StreamedHandoffs``). Each chunk is held until both have read it."""

    def __init__(self, chunks: Iterator[StreamChunk]) -> None:
        self.source = iter(chunks)
        self.held: dict[int, StreamChunk] = {}
        self.pulled = 0  # chunks taken from the source
        self.window_next = 0  # the next chunk the window reads
        self.ahead_next = 0  # the chunks the front end has read

    def __iter__(self) -> ChunkTee:
        return self

    def __next__(self) -> StreamChunk:
        c = self._chunk(self.window_next)
        self.window_next += 1
        self._drop()
        return c

    def get(self, q: int) -> StreamChunk:
        c = self._chunk(q)
        self.ahead_next = max(self.ahead_next, q + 1)
        self._drop()
        return c

    def _chunk(self, q: int) -> StreamChunk:
        while self.pulled <= q:
            self.held[self.pulled] = next(self.source)
            self.pulled += 1
        return self.held[q]

    def _drop(self) -> None:
        read = min(self.window_next, self.ahead_next)
        for q in [q for q in self.held if q < read]:
            del self.held[q]


def sliced(stream: RequestStream, trace_row: np.ndarray, chunk: int) -> Iterator[StreamChunk]:
    """A stream held whole (read from a workload file, or rows given by the caller) in
    :class:`RequestWindow`'s chunks."""
    for lo in range(0, stream.size, chunk):
        hi = lo + chunk
        yield StreamChunk(lo, stream.arrival_s[lo:hi], stream.prompt_tokens[lo:hi],
                          stream.output_tokens[lo:hi], trace_row[lo:hi])


# The request log's fields the summary reads, and those only a lossy policy's reads.
KEPT_REQUEST_FIELDS = ("arrival_s", "prompt_tokens", "first_token_s", "finish_s",
                       "generated", "preemptions", "rejected")
LOSSY_REQUEST_FIELDS = ("trace_row", "changed_tokens")
# Counts kept as int32 where a chunk's values fit (a day's 17 M requests: 12 bytes a
# request less at the summary's peak): the summary only sums them (numpy sums int32 in
# int64), compares them and divides floats by them, the same figures as from int64.
NARROW_REQUEST_FIELDS = ("prompt_tokens", "generated", "preemptions")


def _mapped(a: np.ndarray, *, narrow: bool = False) -> np.ndarray:
    """A copy of ``a`` in its own anonymous memory map, unmapped when the copy is let
    go. The kept chunks are joined after the run, each let go once copied; copies from
    the heap (chunks of a few hundred kB, between the run's own allocations and frees)
    would stay resident once freed, holding every kept column twice at the summary.
    ``narrow``: int64 values as int32 where they all fit."""
    dtype = a.dtype
    if narrow and dtype == np.int64 and (not a.size or (
            a.min() >= np.iinfo(np.int32).min and a.max() <= np.iinfo(np.int32).max)):
        dtype = np.dtype(np.int32)
    out = np.frombuffer(mmap.mmap(-1, max(a.size * dtype.itemsize, 1)), dtype, len(a))
    out[:] = a
    return out


def _joined(chunks: list[np.ndarray], *, widest: bool = False) -> np.ndarray:
    """The chunks as one array of the first's dtype (as a column read back from the
    parts reads: a step count past int32 in a later chunk is cast as it would be), or
    ``widest`` of the widest chunk's (a request count kept narrow in some chunks only),
    each chunk let go once copied: the whole column once, never a second copy of it."""
    if not chunks:
        return np.zeros(0)
    dtype = np.result_type(*{c.dtype for c in chunks}) if widest else chunks[0].dtype
    out = np.empty(sum(len(c) for c in chunks), dtype)
    at = 0
    while chunks:
        c = chunks.pop(0)
        out[at: at + len(c)] = c
        at += len(c)
    return out


__all__ = ["ChunkTee", "RequestWindow", "SpillFolder", "sliced"]
