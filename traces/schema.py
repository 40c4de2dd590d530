"""Acceptance traces, schema v1: position-indexed, one row per (request, output position).

Columns (parquet):

==============  =======================  ==============================================
column          type                     meaning
==============  =======================  ==============================================
request_id      int or string            trace request (prompt) id; imported traces keep
                                         the source's ids (strings allowed)
domain          string                   ``math`` / ``code`` / ``chat`` / anything
position        int32                    output position ``t`` (0-based, contiguous)
accept_len      int8                     ``m_t``: accepted run length of a
                                         ``gamma_max``-token draft started at ``t``
                                         (an integer column in ``[0, gamma_max]``)
conf            array<float32, gamma>    optional: raw drafter confidences
                                         ``c_t[1..gamma]``: P(token k accepted | 1..k-1
                                         accepted). Only confidence policies read it.
tv_accept       array<float32, gamma>    optional: ``1 - 0.5 * ||p_d - p_t||_1`` per
                                         draft position (captured traces)
prompt_tokens   int32                    optional, per request (same on each of its
                                         rows): the request's prompt length
output_tokens   int32                    optional, per request: its output length
draft_tokens    int8                     optional: drafts the drafter proposed at ``t``,
                                         in ``[0, gamma_max]`` (an n-gram / prompt-lookup
                                         drafter proposes none where it finds no match);
                                         absent: ``gamma_max`` everywhere. ``accept_len
                                         <= draft_tokens`` on every row
==============  =======================  ==============================================

Schema v2 adds optional per-position columns for tree, long-context and lossy policies
(draft alternatives, entropies, ASD's logits, a per-request correctness label); they are
defined, read and validated in :mod:`dspark_sim.traces.schema_v2` and held in
``AcceptanceTrace.v2``. Files with none of them are written as v1; v1 files still read.

File metadata (parquet key ``dspark_sim.trace``, JSON): ``schema_version`` (1 or 2),
``drafter``, ``target``, ``gamma_max``, ``temperature``, ``source``
(``synthetic`` | ``captured`` | ``imported``), ``domains``, ``generator``
(parameters), optionally ``calibration`` (the built-in confidence map fitted for this
drafter) and any capture or import facts (device, kernel backend, checkpoint hash,
date, source file).

Rows are ordered by request (integer ids ascending; string ids in the order they first
appear in the file), then position; trace row ``r`` is the ``r``-th request in that order.

Replay (see :mod:`dspark_sim.sim.engine`): verifying ``l`` tokens at position ``t``
accepts ``min(l, m_t)`` and emits one bonus token, so the next step starts at
``t + min(l, m_t) + 1``. For greedy decoding this is exact whatever the policy. Where
``draft_tokens`` is below ``l`` the engine verifies only those (none: the step emits
the one token of a plain decode); ``m_t <= draft_tokens`` makes the replay the same.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from dspark_sim.errors import InputError
from dspark_sim.io import (
    LazyModule,
    atomic_path,
    check_unique_columns,
    loads_json,
    not_a_file,
)
from dspark_sim.traces import cache, schema_v2
from dspark_sim.traces.schema_v2 import V2Fields

# imported where a trace is parsed or written: a trace read from the array cache
# (traces/cache.py) needs neither
pl = LazyModule("polars")
pq = LazyModule("pyarrow.parquet")

SCHEMA_VERSION = 1  # written for traces without v2 columns
SCHEMA_VERSIONS = (1, 2)  # read
META_KEY = b"dspark_sim.trace"
SOURCES = ("synthetic", "captured", "imported")
REQUIRED_COLUMNS = ("request_id", "domain", "position", "accept_len")
LENGTH_COLUMNS = ("prompt_tokens", "output_tokens")
# The largest value the int32 columns (position, prompt_tokens, output_tokens) hold: a
# larger one would wrap round on writing (2**31 becomes -2**31, a file that does not
# read back), so readers, importers and the writer refuse it where it enters.
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class TraceMeta:
    drafter: str
    target: str
    gamma_max: int
    source: str = "synthetic"
    temperature: float = 0.0
    domains: tuple[str, ...] = ()
    generator: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        d = {
            "schema_version": SCHEMA_VERSION,
            "drafter": self.drafter,
            "target": self.target,
            "gamma_max": int(self.gamma_max),
            "source": self.source,
            "temperature": float(self.temperature),
            "domains": list(self.domains),
            "generator": self.generator,
        }
        d.update(self.extra)
        return json.dumps(d, sort_keys=True)

    @property
    def replay_exact(self) -> bool:
        """Replay is exact for greedy decoding only (temperature 0 or synthetic)."""
        return self.source == "synthetic" or self.temperature == 0.0


@dataclass(frozen=True, eq=False)
class AcceptanceTrace:
    """A schema-v1 trace held as flat numpy arrays (rows sorted by request, position)."""

    meta: TraceMeta
    accept_len: np.ndarray  # int8 [N]
    conf: np.ndarray | None  # float32 [N, gamma_max]; None: the trace has no confidences
    req_offsets: np.ndarray  # int64 [R + 1]: rows of request r are offsets[r]:offsets[r+1]
    req_domain: np.ndarray  # str [R]
    req_ids: np.ndarray  # int32 [R], or str [R] (an imported source's ids)
    tv_accept: np.ndarray | None = None  # float32 [N, gamma_max]
    source_path: str = "<memory>"
    req_prompt_tokens: np.ndarray | None = None  # int64 [R]: each request's prompt length
    req_output_tokens: np.ndarray | None = None  # int64 [R]: each request's output length
    v2: V2Fields | None = None  # schema-v2 columns (see schema_v2); None: a v1 trace
    # int8 [N]: drafts proposed at each position; None: gamma_max at every position
    draft_tokens: np.ndarray | None = None

    @property
    def gamma_max(self) -> int:
        return int(self.meta.gamma_max)

    @property
    def num_requests(self) -> int:
        return len(self.req_ids)

    @property
    def num_positions(self) -> int:
        return len(self.accept_len)

    @property
    def req_lengths(self) -> np.ndarray:
        return np.diff(self.req_offsets)

    @property
    def has_conf(self) -> bool:
        return self.conf is not None

    @property
    def draft_fraction(self) -> float:
        """Fraction of positions at which the drafter proposed any draft (1 without the
        ``draft_tokens`` column)."""
        if self.draft_tokens is None:
            return 1.0
        return float(np.count_nonzero(self.draft_tokens) / max(self.num_positions, 1))

    @property
    def has_lengths(self) -> bool:
        """Each request carries its own prompt and output length (imported traces)."""
        return self.req_prompt_tokens is not None and self.req_output_tokens is not None

    # -- derived statistics ------------------------------------------------------
    def tau(self, ell: int | None = None) -> float:
        """Mean tokens per verification step (incl. bonus) when verifying ``ell`` tokens,
        averaged over positions (the per-position expectation, i.e. E[min(l, m)] + 1)."""
        ell = self.gamma_max if ell is None else int(ell)
        return float(np.minimum(self.accept_len, ell).mean() + 1.0)

    def served_tau(self, k: int | None = None) -> float:
        """Tokens per verification step (incl. bonus) *as served*: a fixed-``k`` chain
        replayed through every request, pooled the way a run counts it (total tokens /
        total steps). DSpark Table 1's and vLLM's ``spec_decode_acceptance_length``.

        Each request starts at position 0; at position ``t`` a step accepts
        ``min(k, m_t)`` drafts plus the bonus token and the next step starts at
        ``t + min(k, m_t) + 1``, until the request's rows are used up (the last step
        counts in full). The chain skips positions a step has already produced, so it
        visits hard stretches of text more often than easy ones: ``served_tau(k) <=
        tau(k)`` on bursty traces, equal on i.i.d. ones. A position where the drafter
        proposed nothing (``draft_tokens`` 0, so ``m_t`` 0) is a step of one token, as a
        run counts it.
        """
        k = self.gamma_max if k is None else int(k)
        tokens, steps = _served_chain(self.accept_len, self.req_offsets, k)
        return float(tokens.sum() / max(int(steps.sum()), 1))

    def served_tau_per_request(self, k: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens, steps)`` of the fixed-``k`` chain per request (see :meth:`served_tau`)."""
        k = self.gamma_max if k is None else int(k)
        return _served_chain(self.accept_len, self.req_offsets, k)

    def served_survival(self, k: int | None = None) -> np.ndarray:
        """``P(m >= j)``, ``j = 1..k``, over the verify steps a fixed-``k`` chain visits:
        what vLLM's per-position counters (``num_accepted_tokens_per_pos / num_drafts``)
        report for a run at ``num_speculative_tokens = k``. vLLM counts only the steps
        that carry drafts, so with a ``draft_tokens`` column the steps at positions with
        none are left out; ``1 + sum`` of it is then vLLM's acceptance length, and
        :meth:`served_tau` (all steps) is ``1 + draft fraction x sum``; without the
        column the two agree. :meth:`survival` weights every position once instead."""
        k = self.gamma_max if k is None else int(k)
        hist = np.zeros(k + 1, np.int64)
        _served_chain(self.accept_len, self.req_offsets, k, hist, self.draft_tokens)
        ge = np.cumsum(hist[::-1])[::-1]  # ge[j] = steps with min(k, m) >= j
        return ge[1:] / max(int(hist.sum()), 1)

    def acceptance_length(self, k: int | None = None) -> float:
        """vLLM's ``spec_decode_acceptance_length`` of a fixed-``k`` run: tau per
        proposal, ``1 + sum`` of :meth:`served_survival` (the steps where the drafter
        proposed nothing are not counted). :meth:`served_tau` is tau per request-step;
        the two agree when the drafter proposes at every step."""
        return 1.0 + float(self.served_survival(k).sum())

    def conditional_acceptance(self) -> np.ndarray:
        """DSpark Fig. 2: P(position k accepted | 1..k-1 accepted), k = 1..gamma; NaN
        where no chain reached position k (0 / 0: no data, which is not a 0 rate)."""
        m = self.accept_len.astype(np.int64)
        reached = np.array([(m >= k - 1).sum() for k in range(1, self.gamma_max + 1)], float)
        accepted = np.array([(m >= k).sum() for k in range(1, self.gamma_max + 1)], float)
        return np.divide(accepted, reached, out=np.full_like(accepted, np.nan),
                         where=reached > 0)

    def survival(self) -> np.ndarray:
        """vLLM-style unconditional per-position acceptance P(m >= k)."""
        m = self.accept_len.astype(np.int64)
        return np.array([(m >= k).mean() for k in range(1, self.gamma_max + 1)])

    def select_domain(self, domain: str) -> AcceptanceTrace:
        keep = np.flatnonzero(self.req_domain == domain)
        if keep.size == 0:
            # the option is what the user can change; the trace is named beside it
            raise InputError("--domain", f"no requests of domain {domain!r} in "
                             f"{self.source_path}; it has {', '.join(sorted(map(str, set(self.req_domain))))}")
        return replace(self.take_requests(keep), meta=replace(self.meta, domains=(domain,)))

    def take_requests(self, idx: np.ndarray) -> AcceptanceTrace:
        """The requests ``idx``, in that order, with their rows (metadata as it is)."""
        idx = np.asarray(idx, dtype=np.int64)
        offsets, rows = ragged_take(self.req_offsets, idx)
        return replace(
            self,
            accept_len=self.accept_len[rows],
            conf=_take(self.conf, rows),
            tv_accept=_take(self.tv_accept, rows),
            req_offsets=offsets,
            req_domain=self.req_domain[idx],
            req_ids=self.req_ids[idx],
            req_prompt_tokens=_take(self.req_prompt_tokens, idx),
            req_output_tokens=_take(self.req_output_tokens, idx),
            v2=None if self.v2 is None else self.v2.take(rows, idx),
            draft_tokens=_take(self.draft_tokens, rows),
        )

    # -- frames ----------------------------------------------------------------
    def to_polars(self) -> pl.DataFrame:
        lengths = self.req_lengths
        ids = np.asarray(self.req_ids)
        rid = np.repeat(ids, lengths)
        rid = rid.astype(np.int32) if np.issubdtype(ids.dtype, np.integer) else rid.astype(str)
        pos = (np.arange(self.num_positions) - np.repeat(self.req_offsets[:-1], lengths)).astype(
            np.int32
        )
        g = self.gamma_max
        cols: dict[str, Any] = {
            "request_id": rid,
            "domain": np.repeat(self.req_domain, lengths).astype(str),
            "position": pos,
            "accept_len": self.accept_len.astype(np.int8),
        }
        if self.conf is not None:
            cols["conf"] = pl.Series("conf", self.conf.astype(np.float32),
                                     dtype=pl.Array(pl.Float32, g))
        if self.tv_accept is not None:
            cols["tv_accept"] = pl.Series(
                "tv_accept", self.tv_accept.astype(np.float32), dtype=pl.Array(pl.Float32, g)
            )
        for col, per_req in (("prompt_tokens", self.req_prompt_tokens),
                             ("output_tokens", self.req_output_tokens)):
            if per_req is not None:
                cols[col] = np.repeat(self._int32_lengths(col, per_req), lengths)
        if self.draft_tokens is not None:
            cols["draft_tokens"] = self.draft_tokens.astype(np.int8)
        cols.update(schema_v2.to_columns(self.v2, lengths, g))
        return pl.DataFrame(cols)

    def _int32_lengths(self, col: str, per_req: np.ndarray) -> np.ndarray:
        """``per_req`` as the int32 column it is stored in; a value past int32 is refused
        naming its request (cast, it would wrap round into a file that does not read back)."""
        v = np.asarray(per_req)
        out_of_range = (v < 0) | (v > INT32_MAX)
        if out_of_range.any():
            r = int(np.flatnonzero(out_of_range)[0])
            raise InputError(self.source_path, f"{col} {v[r]} of request {self.req_ids[r]} "
                                               f"is outside the trace's int32 range "
                                               f"[0, {INT32_MAX:,}]")
        return v.astype(np.int32)

    @property
    def schema_version(self) -> int:
        """2 when the trace carries any schema-v2 column, else 1."""
        return 2 if self.v2 is not None and not self.v2.empty else SCHEMA_VERSION


def _served_chain(accept_len: np.ndarray, offsets: np.ndarray, k: int,
                  hist: np.ndarray | None = None, draft_tokens: np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Replay a fixed-``k`` chain through every request at once: ``(tokens, steps)`` per
    request. The step at position ``t`` produces ``min(k, m_t) + 1`` tokens and the next
    starts that many positions on, so the steps visited are a walk along those jumps
    from each request's first position (:func:`_walk`: a logarithmic number of passes
    over all positions, whatever the requests' lengths; a pass per step made one long
    request cost as many numpy calls as it has steps). ``hist`` (length ``k + 1``), if
    given, counts the visited steps by accepted drafts ``min(k, m_t)``; with
    ``draft_tokens`` only the steps at positions that carry drafts (vLLM's counters'
    steps). The tokens and steps need no ``draft_tokens``: ``m_t <= draft_tokens``."""
    if k < 0:
        raise InputError("k", f"verify length must be >= 0, got {k}")
    offsets = np.asarray(offsets, np.int64)
    n = int(offsets[-1])
    length = np.diff(offsets)
    adv = np.minimum(accept_len[:n].astype(np.int64), k) + 1
    # each position's next step: past its request's last position, the shared sink n
    nxt = np.arange(n, dtype=np.int64) + adv
    nxt[nxt >= np.repeat(offsets[1:], length)] = n
    visited, _ = _walk(np.append(nxt, n), offsets[:-1][length > 0])
    visited = visited[:n]
    counted = np.where(visited, adv, 0)
    tokens = np.diff(np.concatenate([[0], np.cumsum(counted)])[offsets])
    steps = np.diff(np.concatenate([[0], np.cumsum(visited)])[offsets])
    if hist is not None:
        at = visited if draft_tokens is None else visited & (draft_tokens[:n] > 0)
        hist += np.bincount(adv[at] - 1, minlength=k + 1)
    return tokens, steps


def _walk(nxt: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, int]:
    """``(visited, passes)``: the nodes a walk from each of ``starts`` reaches by following
    ``nxt`` (the last node is the sink every walk ends in, its own successor; walks stay
    apart), by pointer doubling: after pass ``t`` the marked nodes are each walk's first
    ``2**t`` and ``jump`` leaps ``2**t`` steps, so ``ceil(log2(longest walk))`` passes of
    O(nodes) each mark every walk."""
    sink = len(nxt) - 1
    visited = np.zeros(len(nxt), bool)
    visited[starts] = True
    jump = nxt
    passes = 0
    while not np.all(jump[starts] == sink):
        visited[jump[np.flatnonzero(visited)]] = True
        jump = jump[jump]
        passes += 1
    return visited, passes


def _take(a: np.ndarray | None, idx: np.ndarray) -> np.ndarray | None:
    return None if a is None else a[idx]


def ragged_take(offsets: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Segments ``idx`` of a ragged array (segment ``i`` is ``offsets[i]:offsets[i+1]``),
    in that order: their new offsets and the rows to gather, in one vectorised pass."""
    offsets = np.asarray(offsets, dtype=np.int64)
    lengths = np.diff(offsets)[idx]
    out = np.zeros(len(idx) + 1, np.int64)
    np.cumsum(lengths, out=out[1:])
    rows = np.repeat(offsets[idx] - out[:-1], lengths) + np.arange(out[-1])
    return out, rows


def _int_column(df: pl.DataFrame, col: str, source: str) -> np.ndarray:
    """An integer column as int64; a float, string or boolean column is refused (a float
    ``accept_len`` would otherwise be truncated silently)."""
    s = df[col]
    if not s.dtype.is_integer():
        raise InputError(source, f"column '{col}' must hold integers, got {s.dtype}")
    if s.null_count():
        bad = int(s.is_null().arg_max())
        raise InputError(source, f"column '{col}' has a missing value at row {bad}")
    # non-strict: a uint64 value past int64 becomes null (strict, a polars traceback)
    v = s.cast(pl.Int64, strict=False)
    if v.null_count():
        bad = int(v.is_null().arg_max())
        raise InputError(source, f"column '{col}' value {s[bad]} at row {bad} is past the "
                                 "int64 range")
    return v.to_numpy()


def trace_from_frame(df: pl.DataFrame, meta: TraceMeta, source: str = "<memory>") -> AcceptanceTrace:
    """Validate a frame with the v1 columns and build the flat representation."""
    missing = [c for c in REQUIRED_COLUMNS if c not in df.columns]
    if missing:
        raise InputError(source, f"not a schema-v1 trace: missing column(s) {', '.join(missing)}")
    if df.height == 0:
        raise InputError(source, "trace has no rows")
    g = int(meta.gamma_max)
    if g < 1:
        raise InputError(source, f"gamma_max must be >= 1, got {g}")
    ids = df["request_id"]
    if not (ids.dtype.is_integer() or ids.dtype in (pl.Utf8, pl.Categorical)):
        raise InputError(source, f"column 'request_id' must hold integers or strings, got {ids.dtype}")
    if ids.null_count():
        raise InputError(source, f"column 'request_id' has a missing value at row "
                                 f"{int(ids.is_null().arg_max())}")
    # Integer ids sort numerically; string ids (an imported source's) keep the order in
    # which they first appear in the file. Positions sort within each request.
    if ids.dtype.is_integer():
        df = df.sort(["request_id", "position"], maintain_order=True)
    else:
        # the sort keys in a frame of their own: a helper column added to ``df`` could
        # take the name of one of the file's columns
        key = (pl.DataFrame({"request_id": ids, "position": df["position"]})
               .with_row_index("row")
               .with_columns(first=pl.col("row").min().over("request_id")))
        df = df[key.sort(["first", "position", "row"])["row"]]
    pos = _int_column(df, "position", source)
    m = _int_column(df, "accept_len", source)
    rid_s = df["request_id"]
    starts = np.flatnonzero(np.concatenate([[True], (rid_s[1:] != rid_s[:-1]).to_numpy()]))
    conf = _matrix(df, "conf", g, source) if "conf" in df.columns else None
    tv = _matrix(df, "tv_accept", g, source) if "tv_accept" in df.columns else None
    if np.any(m < 0) or np.any(m > g):
        bad = int(np.flatnonzero((m < 0) | (m > g))[0])
        raise InputError(source, f"accept_len out of [0, {g}] at row {bad} (value {m[bad]})")
    if conf is not None and (not np.all(np.isfinite(conf)) or np.any(conf < 0) or np.any(conf > 1)):
        raise InputError(source, "conf has values outside [0, 1] or NaN")
    offsets = np.concatenate([starts, [df.height]]).astype(np.int64)
    expected = np.arange(df.height) - np.repeat(starts, np.diff(offsets))
    if not np.array_equal(pos, expected):
        bad = int(np.flatnonzero(pos != expected)[0])
        raise InputError(
            source, f"positions of request {rid_s[bad]} are not contiguous from 0 (row {bad})"
        )
    req_len: dict[str, np.ndarray] = {}
    for col in LENGTH_COLUMNS:
        if col not in df.columns:
            continue
        v = _int_column(df, col, source)
        if np.any(v < 0):
            raise InputError(source, f"negative {col} at row {int(np.flatnonzero(v < 0)[0])}")
        if np.any(v > INT32_MAX):
            bad = int(np.flatnonzero(v > INT32_MAX)[0])
            raise InputError(source, f"{col} {v[bad]} at row {bad} is past the trace's "
                                     f"int32 range (at most {INT32_MAX:,})")
        per_req = v[starts]
        differ = v != np.repeat(per_req, np.diff(offsets))
        if differ.any():
            bad = int(np.flatnonzero(differ)[0])
            raise InputError(source, f"{col} differs between rows of request {rid_s[bad]} (row {bad})")
        req_len[col] = per_req
    domain = _req_domains(df["domain"], starts, source)
    domains = tuple(sorted(set(domain.tolist())))
    if not meta.domains:
        meta = replace(meta, domains=domains)
    return AcceptanceTrace(
        meta=meta,
        accept_len=m.astype(np.int8),
        conf=conf,
        req_offsets=offsets,
        req_domain=domain,
        req_ids=_req_ids(rid_s, starts),
        tv_accept=tv,
        source_path=source,
        req_prompt_tokens=req_len.get("prompt_tokens"),
        req_output_tokens=req_len.get("output_tokens"),
        v2=_v2_or_none(schema_v2.from_frame(df, g, starts, source)),
        draft_tokens=_draft_tokens(df, m, g, source) if "draft_tokens" in df.columns else None,
    )


def _draft_tokens(df: pl.DataFrame, m: np.ndarray, g: int, source: str) -> np.ndarray:
    """The optional ``draft_tokens`` column: integers in ``[0, gamma_max]``, never below
    ``accept_len`` on its row (a step cannot accept a draft that was not proposed)."""
    d = _int_column(df, "draft_tokens", source)
    if np.any(d < 0) or np.any(d > g):
        bad = int(np.flatnonzero((d < 0) | (d > g))[0])
        raise InputError(source, f"draft_tokens out of [0, {g}] at row {bad} (value {d[bad]})")
    if np.any(m > d):
        bad = int(np.flatnonzero(m > d)[0])
        raise InputError(source, f"accept_len {m[bad]} exceeds draft_tokens {d[bad]} at row "
                                 f"{bad}: a step cannot accept more drafts than were proposed")
    return d.astype(np.int8)


def _req_domains(dom: pl.Series, starts: np.ndarray, source: str) -> np.ndarray:
    # a null became the domain "None" and a number "3": refused like any mistyped column
    if dom.dtype not in (pl.Utf8, pl.Categorical) and not isinstance(dom.dtype, pl.Enum):
        raise InputError(source, f"column 'domain' must hold strings, got {dom.dtype}")
    if dom.null_count():
        raise InputError(source, f"column 'domain' has a missing value at row "
                                 f"{int(dom.is_null().arg_max())}")
    return dom.cast(pl.Utf8).to_numpy()[starts].astype(str)


def _req_ids(rid: pl.Series, starts: np.ndarray) -> np.ndarray:
    """Integer ids are held as int32; ids past its range keep their digits as strings, as
    the importers keep them (cast to int32 they wrapped round: 2**32 became request 0,
    two requests one id)."""
    i32 = np.iinfo(np.int32)
    if rid.dtype.is_integer() and i32.min <= rid.min() and rid.max() <= i32.max:
        return rid.cast(pl.Int32).to_numpy()[starts]
    return rid.cast(pl.Utf8).to_numpy()[starts].astype(str)


def _v2_or_none(v: V2Fields) -> V2Fields | None:
    return None if v.empty else v


def _matrix(df: pl.DataFrame, col: str, g: int, source: str) -> np.ndarray:
    s = df[col]
    try:
        if isinstance(s.dtype, pl.List):
            lens = s.list.len().to_numpy()
            if np.any(lens != g):
                raise InputError(source, f"'{col}' rows must have gamma_max={g} values")
            s = s.cast(pl.Array(pl.Float32, g))
        if not isinstance(s.dtype, pl.Array) or s.dtype.size != g:
            raise InputError(source, f"'{col}' must be an array of {g} floats (gamma_max)")
        arr = s.cast(pl.Array(pl.Float32, g)).to_numpy()
    except InputError:
        raise
    except Exception as exc:
        raise InputError(source, f"'{col}' is not a float array column ({exc})") from exc
    return np.ascontiguousarray(arr, dtype=np.float32).reshape(-1, g)


def _meta_from_json(raw: bytes, source: str) -> TraceMeta:
    try:
        d = loads_json(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(source, f"trace metadata is not valid JSON ({exc})") from exc
    if not isinstance(d, dict):
        raise InputError(source, "trace metadata must be a JSON object")
    version = d.get("schema_version")
    # an integer, compared by type too: true == 1 and 1.0 == 1 in Python, so `in` took them
    if isinstance(version, bool) or not isinstance(version, int) \
            or version not in SCHEMA_VERSIONS:
        raise InputError(source, f"unsupported trace schema_version {version!r} (an integer: "
                                 f"{' or '.join(map(str, SCHEMA_VERSIONS))})")
    for key in ("drafter", "target", "gamma_max"):
        if key not in d:
            raise InputError(source, f"trace metadata lacks '{key}'")

    def bad(key: str, want: str) -> InputError:
        return InputError(source, f"trace metadata '{key}' must be {want}, got {d[key]!r}")

    for key in ("drafter", "target"):
        if not isinstance(d[key], str):
            raise bad(key, "a string")
    g = d["gamma_max"]
    if isinstance(g, bool) or not isinstance(g, int) or not 1 <= g <= 127:
        raise bad("gamma_max", "an integer in [1, 127]")
    src = d.get("source", "synthetic")
    if src not in SOURCES:
        raise InputError(source, f"trace metadata 'source' must be one of {SOURCES}, got {src!r}")
    temp = d.get("temperature", 0.0)
    # compared, not converted: np.isfinite(2**70) raises, float(10**400) overflows
    if isinstance(temp, bool) or not isinstance(temp, int | float) or not 0 <= temp <= 1e300:
        raise bad("temperature", "a finite number >= 0")
    domains = d.get("domains", [])
    if not isinstance(domains, list) or not all(isinstance(x, str) for x in domains):
        raise bad("domains", "a list of strings")
    if not isinstance(d.get("generator", {}), dict):
        raise bad("generator", "an object")
    if "calibration" in d and not isinstance(d["calibration"], str):
        raise bad("calibration", "a calibration map name (string)")
    known = {"schema_version", "drafter", "target", "gamma_max", "source", "temperature",
             "domains", "generator"}
    return TraceMeta(
        drafter=d["drafter"],
        target=d["target"],
        gamma_max=int(g),
        source=src,
        temperature=float(temp),
        domains=tuple(domains),
        generator=dict(d.get("generator", {})),
        extra={k: v for k, v in d.items() if k not in known},
    )


def read_trace(path: str | Path) -> AcceptanceTrace:
    """Read and validate a schema-v1 parquet trace. Raises :class:`InputError`."""
    source = str(path)
    p = Path(path)
    if not p.is_file():
        raise InputError(source, not_a_file(p, "trace file"))
    cached = cache.load(p)
    if cached is not None:
        return cached
    try:
        pf = pq.ParquetFile(p)
        kv = pf.schema_arrow.metadata or {}
        table = pf.read()
    except Exception as exc:  # pyarrow raises ArrowInvalid/OSError on garbage
        raise InputError(source, f"not a parquet file ({exc.__class__.__name__})") from exc
    check_unique_columns(table.column_names, source)
    if META_KEY not in kv:
        raise InputError(source, "parquet file has no dspark_sim.trace metadata (not a trace)")
    meta = _meta_from_json(kv[META_KEY], source)
    trace = trace_from_frame(pl.from_arrow(table), meta, source)
    # the metadata's domains are what per-domain views iterate (traces inspect): one the
    # data lacks would be blamed on a --domain nobody gave, one it leaves out never shown
    held = sorted(set(trace.req_domain.tolist()))
    if meta.domains and sorted(set(meta.domains)) != held:
        raise InputError(source, f"trace metadata 'domains' lists {', '.join(meta.domains)} "
                                 f"but the 'domain' column holds {', '.join(held)}: make the "
                                 "two agree")
    cache.store(p, trace)
    return trace


def write_trace(trace: AcceptanceTrace, path: str | Path) -> Path:
    """Write atomically (a temporary file renamed into place)."""
    table = trace.to_polars().to_arrow()
    md = dict(table.schema.metadata or {})
    meta = json.loads(trace.meta.to_json())
    meta["schema_version"] = trace.schema_version
    md[META_KEY] = json.dumps(meta, sort_keys=True).encode()
    table = table.replace_schema_metadata(md)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")
    return Path(path)


def concat_traces(traces: list[AcceptanceTrace], meta: TraceMeta | None = None) -> AcceptanceTrace:
    """Stack traces with the same gamma_max; request ids are renumbered."""
    if not traces:
        raise InputError(None, "no traces to concatenate")
    g = traces[0].gamma_max
    if any(t.gamma_max != g for t in traces):
        raise InputError(None, "cannot concatenate traces with different gamma_max")
    lengths = np.concatenate([t.req_lengths for t in traces])
    has_tv = all(t.tv_accept is not None for t in traces)
    has_conf = all(t.conf is not None for t in traces)
    has_len = all(t.has_lengths for t in traces)
    meta = meta or replace(
        traces[0].meta, domains=tuple(sorted({d for t in traces for d in t.meta.domains}))
    )
    return AcceptanceTrace(
        meta=meta,
        accept_len=np.concatenate([t.accept_len for t in traces]),
        conf=np.concatenate([t.conf for t in traces]) if has_conf else None,
        req_offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        req_domain=np.concatenate([t.req_domain for t in traces]),
        req_ids=np.arange(len(lengths), dtype=np.int32),
        tv_accept=np.concatenate([t.tv_accept for t in traces]) if has_tv else None,
        req_prompt_tokens=(np.concatenate([t.req_prompt_tokens for t in traces])
                           if has_len else None),
        req_output_tokens=(np.concatenate([t.req_output_tokens for t in traces])
                           if has_len else None),
        v2=(_v2_or_none(schema_v2.concat([t.v2 for t in traces]))
            if all(t.v2 is not None for t in traces) else None),
        draft_tokens=_concat_draft_tokens(traces, g),
    )


def _concat_draft_tokens(traces: list[AcceptanceTrace], g: int) -> np.ndarray | None:
    """A trace without the column drafted ``gamma_max`` at every position: filled so."""
    if all(t.draft_tokens is None for t in traces):
        return None
    return np.concatenate([np.full(t.num_positions, g, np.int8) if t.draft_tokens is None
                           else t.draft_tokens.astype(np.int8) for t in traces])


def builtin_traces() -> list[str]:
    root = resources.files("dspark_sim.traces") / "data"
    return sorted(p.name[: -len(".parquet")] for p in root.iterdir() if p.name.endswith(".parquet"))


def load_trace(path_or_name: str | Path) -> AcceptanceTrace:
    """A schema v1 or v2 file path, or the name of a trace shipped in the package."""
    spec = str(path_or_name)
    if not spec.strip():  # Path("") is the working directory: name the option instead
        raise InputError("--trace", "empty trace name or path")
    p = Path(spec)
    if p.suffix.lower() == ".parquet" or p.exists():  # T.PARQUET too
        return read_trace(p)
    res = resources.files("dspark_sim.traces") / "data" / f"{spec}.parquet"
    if not res.is_file():
        raise InputError("--trace", f"unknown trace {spec!r}; built-in: {', '.join(builtin_traces())}")
    with resources.as_file(res) as fp:
        t = read_trace(fp)
    return replace(t, source_path=f"builtin:{spec}")
