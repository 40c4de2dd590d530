"""Trace schema v2: optional per-position columns for tree, long-context and lossy policies.

A v2 file is a v1 file (every v1 column, same meaning) plus any of the columns below;
:mod:`dspark_sim.traces.schema` reads both versions and writes ``schema_version = 2``
exactly when a trace carries one of them. Everything here is exact for greedy decoding
(temperature 0): the committed stream is the target's greedy output, the ground truth
against which every alternative is judged.

Notation: position ``t`` of a request, draft depth ``j = 1..gamma`` (the token that would
be ``y_{t+j}``), ``K = TOPK`` alternatives per depth. *Teacher-forced* ("tf") means the
drafter conditioned on the **true** prefix ``y_{t+1..t+j-1}`` -- what it sees on any tree
path that can still be accepted. For a chain, depths ``<= accept_len + 1`` are
teacher-forced anyway; deeper chain depths hang off a rejected token and can never be
accepted.

==================  =========================  ===========  ==========================================
column              type                       bytes (γ=7)  meaning
==================  =========================  ===========  ==========================================
alt_prob            array<float16, (γ, K)>     56           tf drafter's top-K probabilities at depth j,
                                                            descending (slot 0 = its greedy pick)
true_rank           array<int8, γ>             7            rank of the target's token ``y_{t+j}`` in the
                                                            tf drafter distribution (0 = the drafter's
                                                            argmax; ties by token id like argmax; capped
                                                            at 127; -1 = no target token: past EOS)
true_prob           array<float16, γ>          14           tf drafter probability of ``y_{t+j}``
draft_prob          array<float16, γ>          14           drafter probability of its own chain token
                                                            ``d_j`` (chain-conditioned: ASD's ``q``)
draft_entropy       array<float16, γ>          14           entropy (nats) of the drafter's chain
                                                            distribution at depth j (online-visible;
                                                            SparseSpec-L's controller)
target_entropy      float16                    2            entropy (nats) of the target's next-token
                                                            distribution at ``t`` (temperature 1)
tgt_token           int32                      4            the target's argmax token ``y_{t+1}`` (the
                                                            committed stream; -1 past EOS)
tgt_top1_logit      array<float16, γ>          14           target's top-1 logit at the row judging depth
                                                            j (realised prefix ``y_{..t+j-1}``)
draft_tgt_logit     array<float16, γ>          14           target's logit of the chain token ``d_j`` at
                                                            that row (ASD regret = top-1 minus this)
req_correct         int8 (per request)         1            continuation reaches the right answer:
                                                            1 / 0, -1 = no answer key (constant within a
                                                            request)
==================  =========================  ===========  ==========================================

Size budget at γ = 7, K = 4: 140 bytes per position raw on top of v1's 65 (accept_len +
conf + tv_accept + ids); after zstd a 6.6k-position captured trace grows from 0.51 MB
(v1) to 1.25 MB (the float16 probabilities and logits barely compress). Token ids of the alternatives are deliberately not
stored: a replay only needs *whether* an alternative is the target's token (``true_rank``)
and the probabilities that rank it.

Derived exactly (no extra column): alternative ``i`` at depth ``j`` is accepted (given its
parent path is) iff ``i == true_rank[j]``; the run the drafter then gets accepted after it
is :func:`run_after` (leading depths ``> j`` whose ``true_rank`` is 0 -- the drafter
continuing from the true token, e.g. a Markov head re-run on that parent); a tree holding
the top-``w`` tf alternatives at every depth accepts :func:`tree_accept_len` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from dspark_sim.errors import InputError
from dspark_sim.io import LazyModule

pl = LazyModule("polars")  # imported where a frame is read or built

TOPK = 4  # alternatives recorded per depth (CURE branches per point / PCTree frontier k)
RANK_CAP = 127  # int8

# name -> (shape kind, numpy dtype): "gk" [N, gamma, K], "g" [N, gamma], "s" [N], "r" per request
COLUMNS: dict[str, tuple[str, Any]] = {
    "alt_prob": ("gk", np.float16),
    "true_rank": ("g", np.int8),
    "true_prob": ("g", np.float16),
    "draft_prob": ("g", np.float16),
    "draft_entropy": ("g", np.float16),
    "target_entropy": ("s", np.float16),
    "tgt_token": ("s", np.int32),
    "tgt_top1_logit": ("g", np.float16),
    "draft_tgt_logit": ("g", np.float16),
    "req_correct": ("r", np.int8),
}
PROB_COLUMNS = ("alt_prob", "true_prob", "draft_prob")


def _pl_dtype(dt: type) -> Any:
    """The polars dtype of a v2 column's numpy one (named here, not in a module-level
    table: reading them would import polars with this module)."""
    return {np.float16: pl.Float16, np.int8: pl.Int8, np.int32: pl.Int32}[dt]


@dataclass(frozen=True, eq=False)
class V2Fields:
    """The optional v2 columns of one trace (rows as in the owning trace; ``None`` = absent).
    ``req_correct`` is per request [R]."""

    alt_prob: np.ndarray | None = None
    true_rank: np.ndarray | None = None
    true_prob: np.ndarray | None = None
    draft_prob: np.ndarray | None = None
    draft_entropy: np.ndarray | None = None
    target_entropy: np.ndarray | None = None
    tgt_token: np.ndarray | None = None
    tgt_top1_logit: np.ndarray | None = None
    draft_tgt_logit: np.ndarray | None = None
    req_correct: np.ndarray | None = None

    def present(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]

    @property
    def empty(self) -> bool:
        return not self.present()

    def take(self, rows: np.ndarray, reqs: np.ndarray) -> V2Fields:
        """Rows ``rows`` (and requests ``reqs`` for the per-request column)."""
        out = {}
        for name in self.present():
            arr = getattr(self, name)
            out[name] = arr[reqs] if COLUMNS[name][0] == "r" else arr[rows]
        return V2Fields(**out)

    # -- derived (exact under greedy) ------------------------------------------------
    def run_after(self) -> np.ndarray:
        """[N, gamma] int8: after a correct token at depth j, how many further depths the
        drafter gets right in a row continuing from it (leading ``true_rank == 0``)."""
        rank = _need(self, "true_rank")
        n, g = rank.shape
        out = np.zeros((n, g), np.int8)
        run = np.zeros(n, np.int64)
        for j in range(g - 1, -1, -1):  # out[:, j] = run over depths j+1..
            out[:, j] = run
            run = np.where(rank[:, j] == 0, run + 1, 0)
        return out

    def alt_accepted(self) -> np.ndarray:
        """[N, gamma, K] bool: alternative i at depth j is the target's token."""
        rank = _need(self, "true_rank").astype(np.int64)
        k = _need(self, "alt_prob").shape[2]
        return rank[:, :, None] == np.arange(k)[None, None, :]

    def tree_accept_len(self, width: int) -> np.ndarray:
        """[N] accepted length of a tree holding the top-``width`` tf alternatives at every
        depth along every accepted path (width 1 = the chain's ``accept_len``)."""
        rank = _need(self, "true_rank").astype(np.int64)
        hit = (rank >= 0) & (rank < width)
        return np.cumprod(hit, axis=1).sum(axis=1)

    def regret(self) -> np.ndarray:
        """[N, gamma] float32 ASD regret of the chain token: target top-1 logit minus the
        target logit of the draft token (0 where the draft is the argmax)."""
        top = _need(self, "tgt_top1_logit").astype(np.float32)
        return np.maximum(top - _need(self, "draft_tgt_logit").astype(np.float32), 0.0)


def _need(v: V2Fields, name: str) -> np.ndarray:
    arr = getattr(v, name)
    if arr is None:
        raise InputError(None, f"trace has no '{name}' column (schema v2, captured traces)")
    return arr


def concat(parts: list[V2Fields]) -> V2Fields:
    """Stack; a column survives only if every part has it."""
    if not parts:
        return V2Fields()
    names = set(parts[0].present())
    for p in parts[1:]:
        names &= set(p.present())
    return V2Fields(**{n: np.concatenate([getattr(p, n) for p in parts]) for n in sorted(names)})


def to_columns(v: V2Fields | None, req_lengths: np.ndarray, gamma: int) -> dict[str, pl.Series]:
    """Polars series of the present columns (per-request values repeated per row)."""
    if v is None:
        return {}
    out: dict[str, pl.Series] = {}
    for name in v.present():
        kind, dt = COLUMNS[name]
        arr = getattr(v, name).astype(dt)
        if kind == "r":
            arr = np.repeat(arr, req_lengths)
        if kind == "gk":
            dtype: Any = pl.Array(_pl_dtype(dt), (gamma, arr.shape[2]))
        elif kind == "g":
            dtype = pl.Array(_pl_dtype(dt), gamma)
        else:
            dtype = _pl_dtype(dt)
        out[name] = pl.Series(name, arr, dtype=dtype)
    return out


def from_frame(df: pl.DataFrame, gamma: int, req_starts: np.ndarray, source: str) -> V2Fields:
    """Read and validate the v2 columns present in a (sorted) trace frame."""
    got: dict[str, np.ndarray] = {}
    n = df.height
    for name, (kind, dt) in COLUMNS.items():
        if name not in df.columns:
            continue
        s = df[name]
        leaf = s.dtype
        while isinstance(leaf, pl.List | pl.Array):
            leaf = leaf.inner
        if dt != np.float16 and not leaf.is_integer():
            # a float rank 0.5 would truncate to 0 (a hit), a boolean read as 0 / 1
            raise InputError(source, f"'{name}' must hold integers, got {s.dtype}")
        try:
            if kind in ("g", "gk") and isinstance(s.dtype, pl.List):
                s = s.list.to_array(int(s.list.len().max() or 0))
            raw = s.to_numpy() if kind in ("g", "gk") else \
                s.cast(pl.Float64 if dt == np.float16 else pl.Int64).to_numpy()
            if dt != np.float16 and raw.dtype.kind == "f" and not np.isfinite(raw).all():
                # a null (or NaN) in an integer column reads as NaN: casting it would make
                # a garbage integer and a range error that names the wrong fault
                raise InputError(source, f"'{name}' has missing or non-finite values")
            arr = np.asarray(raw, dtype=np.float64 if dt == np.float16 else np.int64)
        except InputError:
            raise
        except Exception as exc:  # polars raises several types on bad casts
            raise InputError(source, f"'{name}' is not a numeric column ({exc})") from exc
        # the column is stored as ``dt``: a value past its range would wrap (integers) or
        # become infinite (float16) silently
        top = np.finfo(dt).max if dt == np.float16 else np.iinfo(dt).max
        low = -top if dt == np.float16 else np.iinfo(dt).min
        if arr.size and np.isfinite(arr).all() and (arr.min() < low or arr.max() > top):
            raise InputError(source, f"'{name}' has values past the range of "
                                     f"{np.dtype(dt).name} ([{int(low)}, {int(top)}])")
        want = {"gk": (n, gamma), "g": (n, gamma), "s": (n,), "r": (n,)}[kind]
        if arr.shape[: len(want)] != want or (kind == "gk" and arr.ndim != 3) or \
                (kind != "gk" and arr.ndim != len(want)):
            raise InputError(source, f"'{name}' must have shape {want}{' x K' if kind == 'gk' else ''} "
                                     f"(gamma_max={gamma}), got {arr.shape}")
        if dt == np.float16:
            if not np.all(np.isfinite(arr)):
                raise InputError(source, f"'{name}' has NaN or infinite values")
            if name in PROB_COLUMNS and (np.any(arr < 0) or np.any(arr > 1)):
                raise InputError(source, f"'{name}' has probabilities outside [0, 1]")
            if name.endswith("entropy") and np.any(arr < 0):
                raise InputError(source, f"'{name}' has negative entropies")
        if name == "true_rank" and (np.any(arr < -1) or np.any(arr > RANK_CAP)):
            raise InputError(source, f"'true_rank' must be in [-1, {RANK_CAP}]")
        if name == "req_correct":
            if np.any(~np.isin(arr, (-1, 0, 1))):
                raise InputError(source, "'req_correct' must be -1, 0 or 1")
            per_req = arr[req_starts]
            if not np.array_equal(np.repeat(per_req, np.diff(np.append(req_starts, n))), arr):
                raise InputError(source, "'req_correct' must be constant within each request")
            arr = per_req
        got[name] = np.ascontiguousarray(arr.astype(dt))
    if "alt_prob" in got and np.any(np.diff(got["alt_prob"].astype(np.float32), axis=2) > 0):
        raise InputError(source, "'alt_prob' must be in descending order per depth")
    return V2Fields(**got)


def with_correct(v: V2Fields | None, req_correct: np.ndarray) -> V2Fields:
    return replace(v or V2Fields(), req_correct=np.asarray(req_correct, np.int8))
