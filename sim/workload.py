"""Request streams: arrival times and (prompt, output) lengths.

Arrival kinds: ``poisson``; ``gamma`` with burstiness (vLLM: gaps ~ Gamma(shape=b,
scale=1/(qps*b)), b = 1 is Poisson); ``closed`` (a fixed number of clients, each
sends its next request when the previous one finishes: this module supplies only the
lengths, in the order the clients send them; ``ClosedLoop`` in ``sim/arrivals.py``
issues a request whenever one finishes); ``replay`` of an Azure LLM inference CSV (TIMESTAMP,
ContextTokens, GeneratedTokens) or a Mooncake JSONL (timestamp ms, input_length,
output_length), optionally rescaled in time to a target rate. A closed loop given a
workload file sends the file's requests (their lengths, in the file's timestamp order);
the timestamps themselves play no part.

Lengths: from the workload file, a named empirical distribution shipped with the
package (``azure-conv``, ``azure-code``, ``mooncake``: samples of the public traces,
CC-BY 4.0 / Apache-2.0; ``sim/data/LENGTHS.md`` says which files and how they were
sampled), ``fixed:IN:OUT`` or ``lognormal:IN_MEDIAN:OUT_MEDIAN[:SIGMA]``, the synthetic
``long-context[:IN:OUT[:SIGMA]]`` (lognormal, default 32768 / 512 / 0.5),
or ``trace`` / ``trace:sample``: each request takes the prompt and output length of one
acceptance-trace request (an imported trace carries them) and replays that request's
row, rows cycled in order (``trace``) or drawn with the run's seed (``trace:sample``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import NamedTuple

import numpy as np

from dspark_sim.errors import InputError
from dspark_sim.io import LazyModule, loads_json, not_a_file, read_csv_strings, tidy_csv
from dspark_sim.sim.config import (
    MAX_LOGNORMAL_SIGMA,
    MAX_PREFIX_BLOCK_TOKENS,
    MAX_SIM_TIME_S,
    MAX_TOKENS_PER_REQUEST,
    WorkloadConfig,
)
from dspark_sim.sim.prefix_cache import MOONCAKE_BLOCK_TOKENS, HashIdBlocks
from dspark_sim.sim.sessions import SessionBlocks, SessionPlan, draw_sessions

pl = LazyModule("polars")  # imported where a workload file or length table is read
NAMED_LENGTHS = ("azure-conv", "azure-code", "mooncake")
# Synthetic long-context preset: lognormal prompts around 32k tokens (sigma 0.5: ~90 %
# between 17k and 62k), outputs around 512 (long-context serving: documents, agents).
LONG_CONTEXT = "long-context"
LONG_CONTEXT_DEFAULT = (32768.0, 512.0, 0.5)
TRACE_LENGTHS = ("trace", "trace:sample")
DEFAULT_LENGTHS = "azure-conv"


@dataclass(frozen=True, eq=False)
class RequestStream:
    arrival_s: np.ndarray  # float64 [N], non-decreasing (closed loop: zeros, unused)
    prompt_tokens: np.ndarray  # int64 [N]
    output_tokens: np.ndarray  # int64 [N]
    description: str
    # --lengths trace: request i replays trace row trace_rows[i] (its lengths came from it)
    trace_rows: np.ndarray | None = None
    # what each request's prompt blocks hold, for the prefix cache (sim/prefix_cache.py):
    # a Mooncake file's hash_ids; None: the workload says nothing about reuse
    reuse: HashIdBlocks | SessionBlocks | None = None
    # multi-turn sessions: their turns are sent as earlier turns end (sim/sessions.py)
    sessions: SessionPlan | None = None

    @property
    def size(self) -> int:
        return len(self.prompt_tokens)


# -- workload files ---------------------------------------------------------------
def read_workload(path: str | Path) -> pl.DataFrame:
    """Return columns arrival_s (from 0), prompt_tokens, output_tokens, and hash_ids (a
    list per request) for a Mooncake file whose records carry them."""
    source = str(path)
    p = Path(path)
    if not p.is_file():
        raise InputError(source, not_a_file(p, "workload file"))
    try:
        if p.suffix.lower() in (".jsonl", ".json"):
            df = _read_mooncake(p, source)
        else:
            df = _read_azure(p, source)
    except InputError:
        raise
    except Exception as exc:  # polars raises a zoo of parse errors
        raise InputError(source, f"cannot parse workload ({exc.__class__.__name__}: {exc})") from exc
    if df.height == 0:
        raise InputError(source, "workload has no requests")
    arr = df["arrival_s"].to_numpy()
    if not np.all(np.isfinite(arr)):
        raise InputError(source, "workload has unparseable timestamps")
    for col in ("prompt_tokens", "output_tokens"):
        v = df[col].to_numpy()
        if np.any(v < 0):
            raise InputError(source, f"negative token count in {col}")
        if np.any(v == 0):
            # a request of no prompt or no output cannot be served as written (vLLM refuses
            # both); serving it as one token would change the workload without a word
            raise InputError(source, f"data row {int(np.argmax(v == 0)) + 1}: {col} is 0; a "
                             "request needs at least one prompt and one output token: drop "
                             "the row or give its real length")
        if np.any(v > MAX_TOKENS_PER_REQUEST):  # the limit a --lengths spec has
            raise InputError(source, f"{col} above the per-request limit of "
                             f"{MAX_TOKENS_PER_REQUEST:,} in data row "
                             f"{int(np.argmax(v > MAX_TOKENS_PER_REQUEST)) + 1}")
    df = df.sort("arrival_s", maintain_order=True)
    return df.with_columns(pl.col("arrival_s") - pl.col("arrival_s").min())


def _read_azure(p: Path, source: str) -> pl.DataFrame:
    df = tidy_csv(read_csv_strings(p, source))  # all strings: we parse ourselves
    need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
    if not need <= set(df.columns):
        raise InputError(source, f"Azure CSV needs columns {', '.join(sorted(need))}")
    ts = pl.col("TIMESTAMP").str.strip_chars()
    # 7 fractional digits (100 ns): trim to microseconds so chrono can parse it.
    ts = ts.str.replace(r"(\.\d{6})\d+$", "$1").str.to_datetime(
        "%Y-%m-%d %H:%M:%S%.f", strict=False
    )
    out = df.select(
        (ts.dt.epoch("us").cast(pl.Float64) / 1e6).alias("arrival_s"),
        pl.col("ContextTokens").str.strip_chars().cast(pl.Int64, strict=False)
        .alias("prompt_tokens"),
        pl.col("GeneratedTokens").str.strip_chars().cast(pl.Int64, strict=False)
        .alias("output_tokens"),
    )
    if out.null_count().sum_horizontal().item() > 0:
        bad = out.with_row_index().filter(pl.any_horizontal(pl.all().is_null()))["index"][0]
        raise InputError(source, f"unparseable value in data row {bad + 1}")
    return out


def _count(v) -> int:
    """A token count: an integer, or a float with an integral value (some JSON writers
    emit 100.0); never a bool, and never a fraction silently truncated."""
    if isinstance(v, bool) or not isinstance(v, int | float | str):
        raise TypeError(f"token count {v!r} is not a number")
    if isinstance(v, float) and not v.is_integer():  # NaN and inf included
        raise ValueError(f"token count {v!r} is not a whole number")
    n = int(v)
    if n > MAX_TOKENS_PER_REQUEST:  # 10**30 became a 128-bit polars column: a traceback
        raise ValueError(f"token count {n} is above the per-request limit of "
                         f"{MAX_TOKENS_PER_REQUEST:,}")
    return n


def _timestamp_ms(v) -> float:
    """A Mooncake timestamp (ms): a number, never a bool (true read as 1 ms)."""
    if isinstance(v, bool):
        raise TypeError(f"timestamp {v!r} is not a number")
    return float(v)


def _read_mooncake(p: Path, source: str) -> pl.DataFrame:
    rows = []
    hashes: list[list[int]] | None = None  # set by the first record: all carry them or none
    block = MOONCAKE_BLOCK_TOKENS  # the tokens each hash id names: the first record's
    with p.open(encoding="utf-8-sig") as fh:  # -sig: a leading byte-order mark is not data
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                d = loads_json(line)
                rows.append((_timestamp_ms(d["timestamp"]) / 1e3, _count(d["input_length"]),
                             _count(d["output_length"])))
                if len(rows) == 1 and "hash_ids" in d:
                    hashes = []
                    block = _hash_block_tokens(d.get("hash_block_tokens", block))
                if hashes is not None:
                    hashes.append(_hash_ids(d["hash_ids"]))
                    if d.get("hash_block_tokens", block) != block:
                        raise ValueError(f"hash_block_tokens {d['hash_block_tokens']!r} "
                                         f"here, {block} in the first record")
                elif "hash_ids" in d:
                    raise ValueError("hash_ids here but not in the first record")
            except json.JSONDecodeError as exc:
                raise InputError(source, f"line {i}: not JSON ({exc.msg})") from None
            except KeyError as exc:
                raise InputError(source, f"line {i}: not a Mooncake record (no {exc})") from None
            except (TypeError, ValueError) as exc:
                raise InputError(source, f"line {i}: not a Mooncake record ({exc})") from None
    df = pl.DataFrame(rows, schema=["arrival_s", "prompt_tokens", "output_tokens"], orient="row")
    if hashes is not None:
        df = df.with_columns(pl.Series("hash_ids", hashes, dtype=pl.List(pl.Int64)),
                             hash_block_tokens=pl.lit(block, dtype=pl.Int64))
    return df


def _hash_block_tokens(v) -> int:
    """A record's ``hash_block_tokens``: the tokens each of its ``hash_ids`` names
    (Mooncake's are 512; a file of another engine's blocks says so)."""
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_PREFIX_BLOCK_TOKENS:
        raise ValueError(f"hash_block_tokens must be an integer in [1, "
                         f"{MAX_PREFIX_BLOCK_TOKENS}], got {v!r:.60}")
    return v


def _hash_ids(v) -> list[int]:
    """A record's ``hash_ids``: a list of non-negative integers (its prompt's blocks)."""
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool)
                                          and 0 <= x < 1 << 62 for x in v):
        raise ValueError(f"hash_ids must be a list of non-negative integers, got {v!r:.60}")
    return v


def says_reuse(path: str | Path) -> bool | None:
    """Whether a workload file carries ``hash_ids``, from its first record alone (they are
    in every record or in none): False for a file of another kind; None when the first
    record cannot be read (the run's own reading names the problem)."""
    p = Path(path)
    if p.suffix.lower() not in (".jsonl", ".json"):
        return False  # an Azure CSV says nothing about shared prefixes
    try:
        with p.open(encoding="utf-8-sig") as fh:
            for line in fh:
                if line.strip():
                    d = loads_json(line)
                    return isinstance(d, dict) and "hash_ids" in d
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return None


def file_reuse(df: pl.DataFrame, idx: np.ndarray) -> HashIdBlocks | None:
    """Rows ``idx``'s prompt blocks from a Mooncake file's ``hash_ids`` (None: it has none)."""
    if "hash_ids" not in df.columns:
        return None
    ids = df["hash_ids"]
    lengths = ids.list.len().to_numpy().astype(np.int64)
    offsets = np.zeros(lengths.size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = ids.explode().drop_nulls().to_numpy().astype(np.int64)
    return HashIdBlocks(offsets, flat, df["prompt_tokens"].to_numpy(),
                        int(df["hash_block_tokens"][0])).take(idx)


# -- length distributions -------------------------------------------------------
def _named_lengths(name: str) -> tuple[np.ndarray, np.ndarray]:
    res = resources.files("dspark_sim.sim") / "data" / "lengths.parquet"
    with resources.as_file(res) as fp:
        df = pl.read_parquet(fp).filter(pl.col("dataset") == name)
    return df["prompt_tokens"].to_numpy(), df["output_tokens"].to_numpy()


def sample_lengths(spec: str, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, str]:
    kind, _, rest = spec.partition(":")
    args = [a for a in rest.split(":") if a] if rest else []
    try:
        nums = [float(a) for a in args]
    except ValueError:
        raise InputError("--lengths", f"bad length spec {spec!r}") from None
    if kind in NAMED_LENGTHS and not args:
        prompt_tokens, output_tokens = _named_lengths(kind)
        idx = rng.integers(0, len(prompt_tokens), size=n)
        return (prompt_tokens[idx].astype(np.int64), output_tokens[idx].astype(np.int64),
                f"{kind} empirical lengths")
    if kind == "fixed" and len(nums) == 2 and min(nums) >= 1:
        if not all(v.is_integer() for v in nums):  # int() would run fixed:1.5:2 as 1 in
            raise InputError("--lengths", f"{spec!r}: fixed token counts must be whole "
                                          "numbers")
        return (np.full(n, int(nums[0]), np.int64), np.full(n, int(nums[1]), np.int64),
                f"fixed {int(nums[0])} in / {int(nums[1])} out")
    if kind == LONG_CONTEXT and len(nums) in (0, 2, 3) and min(nums, default=1) > 0:
        # synthetic long-context prompts: lognormal around a long median, a narrow spread
        nums = nums or list(LONG_CONTEXT_DEFAULT)
        if len(nums) == 2:
            nums.append(LONG_CONTEXT_DEFAULT[2])
        kind = "lognormal"
    if kind == "lognormal" and len(nums) in (2, 3) and min(nums) > 0:
        sigma = nums[2] if len(nums) == 3 else 0.8
        if sigma > MAX_LOGNORMAL_SIGMA:
            raise InputError("--lengths", f"{spec!r}: sigma {sigma:g} is above the limit of "
                             f"{MAX_LOGNORMAL_SIGMA:g}")
        # draws are capped at the per-request limit (a wide sigma's far tail)
        draw = [np.clip(np.round(median * np.exp(sigma * rng.standard_normal(n))), 1,
                        MAX_TOKENS_PER_REQUEST).astype(np.int64) for median in nums[:2]]
        return draw[0], draw[1], f"lognormal medians {nums[0]:g}/{nums[1]:g}"
    if kind == "fixed" and len(nums) == 2:
        raise InputError("--lengths", f"{spec!r}: fixed token counts must be at least 1")
    if kind in ("lognormal", LONG_CONTEXT) and len(nums) in (2, 3):
        raise InputError("--lengths", f"{spec!r}: medians and sigma must be above 0")
    raise InputError(
        "--lengths",
        f"bad length spec {spec!r}; use one of {', '.join(NAMED_LENGTHS)}, fixed:IN:OUT, "
        "lognormal:IN:OUT[:SIGMA], long-context[:IN:OUT[:SIGMA]], trace, trace:sample",
    )


def uses_trace_lengths(w: WorkloadConfig) -> bool:
    return w.lengths is not None and w.lengths.strip() in TRACE_LENGTHS


def _lengths(w: WorkloadConfig, n: int, rng: np.random.Generator, trace,
             default: str = DEFAULT_LENGTHS, first: int = 0):
    """``(prompt_tokens, output_tokens, description, trace_rows)`` for ``n`` requests;
    ``trace_rows`` is set (and the lengths are the trace requests' own) for
    ``--lengths trace`` / ``trace:sample``, else None. ``first``: the index of the first
    of the ``n`` (a chunk of a streamed run: ``trace`` cycles the rows from there)."""
    spec = (w.lengths or default).strip()
    if spec not in TRACE_LENGTHS:
        return (*sample_lengths(spec, n, rng), None)
    if trace is None or not trace.has_lengths:
        where = "no trace" if trace is None else f"trace {trace.source_path}"
        raise InputError("--lengths", f"{spec!r} needs a trace whose requests carry their prompt "
                         f"and output lengths (an imported trace); {where} has none")
    for col, v in (("prompt_tokens", trace.req_prompt_tokens),
                   ("output_tokens", trace.req_output_tokens)):
        if np.any(v > MAX_TOKENS_PER_REQUEST):  # the limit a --lengths spec or file row has
            bad = int(np.argmax(v > MAX_TOKENS_PER_REQUEST))
            raise InputError(trace.source_path, f"{col} of request {trace.req_ids[bad]} "
                             f"({int(v[bad]):,}) is above the per-request limit of "
                             f"{MAX_TOKENS_PER_REQUEST:,}")
        if np.any(v < 1):  # as a workload file's row: never served as one token unsaid
            bad = int(np.argmax(v < 1))
            raise InputError(trace.source_path, f"{col} of request {trace.req_ids[bad]} is "
                             f"{int(v[bad])}; --lengths {spec} needs at least one prompt "
                             "and one output token per request")
    if spec == "trace":
        rows = np.arange(first, first + n, dtype=np.int64) % trace.num_requests
        how = "cycled in order"
    else:
        rows = rng.integers(0, trace.num_requests, size=n)
        how = "drawn with the seed"
    prompt_tokens = trace.req_prompt_tokens[rows].astype(np.int64)
    output_tokens = trace.req_output_tokens[rows].astype(np.int64)
    return (prompt_tokens, output_tokens,
            f"lengths of {trace.num_requests} trace requests ({how}), each replaying its own row",
            rows)


# -- streams --------------------------------------------------------------------
def _gaps(w: WorkloadConfig, n: int, rng: np.random.Generator) -> np.ndarray:
    shape = 1.0 if w.arrival == "poisson" else float(w.burstiness)
    return rng.gamma(shape, 1.0 / (w.qps * shape), size=n)


def build_stream(w: WorkloadConfig, rng: np.random.Generator, trace=None) -> RequestStream:
    """Arrival times and lengths for an open-loop run (closed loop: lengths only).
    ``trace`` (an :class:`~dspark_sim.traces.schema.AcceptanceTrace`) supplies the lengths
    of ``--lengths trace``."""
    if w.session_turns is not None:
        prompt, output, plan, blocks, desc, rows = draw_sessions(
            w, rng, lambda n: _lengths(w, n, rng, trace))
        return RequestStream(np.zeros(plan.size), prompt, output, desc, rows, blocks, plan)
    if w.arrival == "replay":
        return _replay_stream(w, rng, trace)
    if w.arrival == "closed":
        return _closed_stream(w, rng, trace)
    return _open_stream(w, rng, trace)


def _file_requests(w: WorkloadConfig, df: pl.DataFrame, idx: np.ndarray,
                   rng: np.random.Generator, trace=None):
    """The file's lengths for rows ``idx``, unless ``--lengths`` overrides them (the
    description then says so: the file then gives only the arrivals or the count)."""
    if w.lengths is not None:  # explicit lengths override the file's
        prompt_tokens, output_tokens, ldesc, rows = _lengths(w, idx.size, rng, trace)
        return prompt_tokens, output_tokens, f"{ldesc}, overriding the file's lengths", rows
    prompt_tokens = df["prompt_tokens"].to_numpy()[idx].astype(np.int64)
    output_tokens = df["output_tokens"].to_numpy()[idx].astype(np.int64)
    return prompt_tokens, output_tokens, f"lengths of {Path(w.workload_path).name}", None


def _replay_stream(w: WorkloadConfig, rng: np.random.Generator, trace=None) -> RequestStream:
    df = read_workload(w.workload_path)
    arr = df["arrival_s"].to_numpy().astype(np.float64)
    native_qps = (len(arr) - 1) / arr[-1] if arr[-1] > 0 else float("inf")
    desc = f"replay of {Path(w.workload_path).name} ({native_qps:.2f} req/s native"
    if w.replay_qps is not None and not np.isfinite(native_qps):
        # no span to rescale: the rate would be dropped without a word
        raise InputError("--replay-qps", f"the {len(arr):,} request(s) of "
                         f"{w.workload_path} all arrive at one instant, so there is no rate "
                         f"to scale to {w.replay_qps:g} req/s: leave the rate out (or give "
                         "the file's requests their own timestamps)")
    if w.replay_qps is not None:
        arr = arr * (native_qps / w.replay_qps)
        desc += f", time-scaled to {w.replay_qps:g} req/s"
    desc += ")"
    keep = np.ones(len(arr), bool)
    if w.duration_s is not None:
        keep &= arr < w.duration_s
    idx = np.flatnonzero(keep)
    if w.num_requests is not None:
        idx = idx[: w.num_requests]
    if idx.size == 0:
        raise InputError(w.workload_path, "no requests inside the requested window")
    if arr[idx[-1]] > MAX_SIM_TIME_S:
        # the rate given is at fault where one was given, else the file's own timestamps
        where = "--replay-qps" if w.replay_qps is not None else w.workload_path
        raise InputError(where, f"the replay spans {arr[idx[-1]]:.3g} s; the simulated "
                         f"clock is limited to {MAX_SIM_TIME_S:g} s: raise the rate "
                         "(--replay-qps) or cap --num-requests / --duration-s")
    prompt_tokens, output_tokens, ldesc, rows = _file_requests(w, df, idx, rng, trace)
    if w.lengths is not None:  # the file's own lengths go without saying in a replay
        desc += f", {ldesc}"
    reuse = None if w.lengths is not None else file_reuse(df, idx)
    return RequestStream(arr[idx], prompt_tokens, output_tokens, desc, rows, reuse)


def _closed_stream(w: WorkloadConfig, rng: np.random.Generator, trace=None) -> RequestStream:
    clients = f"closed loop, {w.max_concurrency} clients"
    if w.workload_path is None:
        n = int(w.num_requests)
        prompt_tokens, output_tokens, ldesc, rows = _lengths(w, n, rng, trace)
        return RequestStream(np.zeros(n), prompt_tokens, output_tokens, f"{clients}, {ldesc}",
                             rows)
    # The clients send the file's requests in timestamp order; the times play no part.
    df = read_workload(w.workload_path)
    n = df.height if w.num_requests is None else min(int(w.num_requests), df.height)
    prompt_tokens, output_tokens, ldesc, rows = _file_requests(w, df, np.arange(n), rng, trace)
    if n < df.height:
        which = f"the file's first {n} of {df.height} requests"
    elif w.num_requests is not None and w.num_requests > n:
        which = f"all {n} requests of the file, fewer than --num-requests {w.num_requests}"
    else:
        which = f"all {n} requests of the file"
    reuse = None if w.lengths is not None else file_reuse(df, np.arange(n))
    return RequestStream(np.zeros(n), prompt_tokens, output_tokens,
                         f"{clients}, {ldesc} ({which}, in order)", rows, reuse)


def _open_stream(w: WorkloadConfig, rng: np.random.Generator, trace=None) -> RequestStream:
    """Poisson or gamma gaps, bounded by count and/or duration."""
    if w.num_requests is not None:
        arr = np.cumsum(_gaps(w, int(w.num_requests), rng))
        if w.duration_s is not None:
            arr = arr[arr < w.duration_s]
    else:
        expect = int(w.qps * w.duration_s * 1.2 + 10 * np.sqrt(w.qps * w.duration_s) + 10)
        arr = np.cumsum(_gaps(w, expect, rng))
        while arr[-1] < w.duration_s:
            arr = np.concatenate([arr, arr[-1] + np.cumsum(_gaps(w, expect, rng))])
        arr = arr[arr < w.duration_s]
    if arr.size == 0:
        raise InputError("--qps/--duration-s", f"no request arrived inside the "
                         f"{w.duration_s:g} s window at {w.qps:g} req/s: the run would "
                         "simulate nothing")
    arr = arr - arr[0]  # the first request arrives at t = 0
    prompt_tokens, output_tokens, ldesc, rows = _lengths(w, arr.size, rng, trace)
    kind = "Poisson" if w.arrival == "poisson" or w.burstiness == 1.0 \
        else f"gamma(burstiness={w.burstiness:g})"
    return RequestStream(arr, prompt_tokens, output_tokens,
                         f"{kind} arrivals at {w.qps:g} req/s, {ldesc}", rows)


# -- streams drawn in chunks -------------------------------------------------------------
class StreamChunk(NamedTuple):
    """Requests ``first .. first + len(prompt_tokens) - 1`` of a stream: arrival times
    (closed loop: zeros, unused), lengths and each request's trace row."""

    first: int
    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    trace_rows: np.ndarray


def draws_in_chunks(w: WorkloadConfig) -> bool:
    """The stream is drawn, not read from a workload file: Poisson or gamma arrivals, or
    a closed loop's lengths (:class:`ChunkedStream` can draw it a chunk at a time)."""
    return w.workload_path is None and w.arrival in ("poisson", "gamma", "closed") \
        and w.session_turns is None


class ChunkedStream:
    """A drawn stream (:func:`draws_in_chunks`) a chunk at a time, for a streamed run:
    its size and last arrival are known up front (one pass over the arrival gaps that
    keeps no more than a chunk), its requests come chunk by chunk from :meth:`chunks`.

    The gaps, the lengths and the trace rows each come from a child of the seed
    (``SeedSequence(seed).spawn(3)``), drawn in chunk order, so a run is determined by
    its seed and chunk size. An in-memory run (:func:`build_stream`) draws them all from
    one generator in turn, so it sees other requests for the same seed.
    ``rows_of``: the trace whose rows requests replay (None: rows are zeros);
    ``trace``: the one ``--lengths trace`` takes lengths from."""

    def __init__(self, w: WorkloadConfig, seed: int, chunk: int, *, trace=None,
                 rows_of=None) -> None:
        self.w = w
        self.seed = seed
        self.chunk = chunk
        self.trace = trace
        self.rows_of = rows_of
        # a zero-size draw checks the lengths spec (and a trace's lengths) up front
        ldesc = _lengths(w, 0, np.random.default_rng(0), trace)[2]
        if w.arrival == "closed":
            self.size = int(w.num_requests)
            self.offset_s = 0.0
            self.last_arrival_s = 0.0
            self.description = f"closed loop, {w.max_concurrency} clients, {ldesc}"
            return
        n, first, last = 0, None, 0.0
        for arr in self._arrivals():
            n += arr.size
            first = arr[0] if first is None else first
            last = float(arr[-1])
        if n == 0:
            raise InputError("--qps/--duration-s", f"no request arrived inside the "
                             f"{w.duration_s:g} s window at {w.qps:g} req/s: the run would "
                             "simulate nothing")
        self.size = n
        self.offset_s = float(first)  # the first request arrives at t = 0
        self.last_arrival_s = last - self.offset_s
        kind = "Poisson" if w.arrival == "poisson" or w.burstiness == 1.0 \
            else f"gamma(burstiness={w.burstiness:g})"
        self.description = f"{kind} arrivals at {w.qps:g} req/s, {ldesc}"

    def _children(self) -> list[np.random.Generator]:
        return [np.random.default_rng(s) for s in np.random.SeedSequence(self.seed).spawn(3)]

    def _arrivals(self, rng: np.random.Generator | None = None):
        """The arrival times (before the shift to t = 0), a chunk at a time."""
        w = self.w
        rng = rng or self._children()[0]
        cap = np.inf if w.num_requests is None else int(w.num_requests)
        end = np.inf if w.duration_s is None else w.duration_s
        n, t = 0, 0.0
        while n < cap:
            k = int(min(self.chunk, cap - n))
            arr = t + np.cumsum(_gaps(w, k, rng))
            if arr[-1] >= end:
                arr = arr[arr < end]
                if arr.size:
                    yield arr
                return
            yield arr
            n += k
            t = float(arr[-1])

    def chunks(self):
        """Every request, in chunks of ``chunk`` (the last one shorter), in order."""
        gaps, lengths, rows = self._children()
        w = self.w
        if w.arrival == "closed":
            arrivals = (np.zeros(min(self.chunk, self.size - lo))
                        for lo in range(0, self.size, self.chunk))
        else:
            arrivals = (arr - self.offset_s for arr in self._arrivals(gaps))
        first = 0
        for arr in arrivals:
            k = arr.size
            prompt_tokens, output_tokens, _, trace_rows = _lengths(w, k, lengths, self.trace,
                                                                   first=first)
            if self.rows_of is None:
                trace_rows = np.zeros(k, np.int64)
            elif trace_rows is None:
                trace_rows = rows.integers(0, self.rows_of.num_requests, size=k)
            yield StreamChunk(first, arr, prompt_tokens, output_tokens, trace_rows)
            first += k
