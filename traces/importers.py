"""Importers: other engines' acceptance data -> schema-v1 traces.

Formats (``dspark-sim traces import --format F SRC --out trace.parquet``):

``specdecode-bench``
    The JSONL of SpecDecode-Bench (the simulator of "Speculative Decoding: Performance
    or Illusion?", arXiv 2601.11580; github.com/SpecDecode-Bench/simulator,
    ``data/<model>/combined_<dataset>.jsonl``). One request per line: ``id``,
    ``prompt_token_ids``, ``generated_token_ids`` and, per output position,
    ``acc_eagle.acc_len`` / ``acc_ngram.acc_len``: the tokens one verify step started
    there produces (accepted drafts + 1). ``column`` picks the drafter. A request's
    output length is the length of that list (what SpecDecode-Bench's simulator
    replays), its prompt length that of ``prompt_token_ids``. Source ``imported``.

``per-position``
    A generic JSONL or CSV (by suffix), one row per (request, position): ``request_id``
    (any string or integer), ``position`` (0-based), and exactly one of ``accept_len``
    (accepted drafts) or ``tokens_per_step`` (accepted drafts + 1, SpecDecode-Bench's and
    vLLM's acceptance-length unit); optionally ``domain``, ``prompt_tokens``,
    ``output_tokens`` and confidences (JSONL: a list ``conf``; CSV: ``conf_1`` ..
    ``conf_G``). Source ``imported``.

``vllm-counters``
    vLLM's speculative-decoding counters, from a ``/metrics`` Prometheus scrape, text
    format or OpenMetrics (``vllm:spec_decode_num_drafts_total`` and
    ``vllm:spec_decode_num_accepted_tokens_per_pos_total{position="i"}``, summed over
    engines and servers of one ``model_name``; several models need ``model_name``) or a
    ``vllm bench serve`` result JSON (``spec_decode_per_position_acceptance_rates``,
    ``spec_decode_num_drafts``). Totals beside them (accepted and draft tokens, the
    acceptance length) are checked against them. These
    give only the unconditional survival ``r_j = P(m >= j)`` over verify steps at
    ``num_speculative_tokens`` = ``len(r)``, nothing per request or per position. The
    importer therefore writes a *synthetic* trace (source ``synthetic``, the counters in
    ``generator``): ``m`` drawn independently per position with ``P(m >= j) = r_j``, so
    its served tau at ``K = len(r)`` is vLLM's acceptance length ``1 + sum(r)`` in
    expectation, and at ``k < K`` it is ``1 + sum(r[:k])``. Burstiness between
    positions is not in the counters and not in the trace.

    vLLM counts only the steps whose drafter proposed drafts (an n-gram drafter drafts
    only where it finds a match), so ``r`` is conditional on drafting. Where the input
    tells how many request-steps there were (``output tokens - accepted drafts -
    finished requests``: a bench serve result's ``total_output_tokens``,
    ``spec_decode_accepted_tokens``, ``completed``; a scrape's
    ``vllm:generation_tokens_total``, ``vllm:spec_decode_num_accepted_tokens_total``,
    ``vllm:request_success_total``), each position drafts ``K`` with probability
    ``draft_fraction = num_drafts / request_steps``, else none (``m = 0``), written as
    the ``draft_tokens`` column and drawn after ``m`` with the same generator (a trace
    without the column is the same as without this rule). At a fraction ``>= 0.999``,
    or when a count is missing, no column is written; ``generator.draft_fraction`` and
    ``draft_fraction_from`` say which.

Malformed input raises :class:`~dspark_sim.errors.InputError` naming the file and the
line (or data row).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from dspark_sim.errors import InputError, check_seed, is_decimal
from dspark_sim.io import (
    finite_number,
    is_int64,
    loads_bench_serve_json,
    loads_json,
    not_a_file,
    read_csv_strings,
    tidy_csv_lines,
)
from dspark_sim.traces.schema import INT32_MAX, AcceptanceTrace, TraceMeta

FORMATS = ("specdecode-bench", "per-position", "vllm-counters", "vllm-per-request")
SPECDECODE_COLUMNS = ("eagle", "ngram")
GAMMA_LIMIT = 127  # accept_len is stored as int8
# Any count read from a file (accepted runs, token counts) above this is refused, with
# its line, before numpy sees it: a JSON integer past int64 would overflow there, and the
# trace stores its counts as int32 (one past it wrapped round to -2**31 on writing).
MAX_COUNT = INT32_MAX
MAX_SYNTH_CELLS = 20_000_000  # requests x positions of a counters trace (~20 MB of int8)


# The options each format reads (as the command line names them); any other given is refused
FORMAT_OPTIONS = {"specdecode-bench": {"--column", "--domain", "--gamma-max"},
                  "per-position": {"--domain", "--gamma-max"},
                  "vllm-counters": {"--domain", "--requests", "--positions", "--seed",
                                    "--model-name"},
                  "vllm-per-request": {"--domain", "--gamma-max"}}


def check_format_options(fmt: str, given: dict[str, Any]) -> None:
    """``fmt`` is a known format and reads every option of ``given`` (option -> value;
    None: not given) that was given."""
    fmt = fmt.strip().lower()
    if fmt not in FORMATS:
        raise InputError("--format", f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    for opt, val in given.items():
        if val is not None and opt not in FORMAT_OPTIONS[fmt]:
            raise InputError(opt, f"does not apply to --format {fmt}")


def import_trace(fmt: str, src: str | Path, **opts: Any) -> AcceptanceTrace:
    """Dispatch on ``fmt`` (one of :data:`FORMATS`); options as the format's function."""
    fmt = fmt.strip().lower()
    if fmt == "specdecode-bench":
        return import_specdecode_bench(src, **opts)
    if fmt == "per-position":
        return import_per_position(src, **opts)
    if fmt == "vllm-counters":
        return import_vllm_counters(src, **opts)
    if fmt == "vllm-per-request":  # vLLM's own per-step counts: traces/vllm_per_request.py
        from dspark_sim.traces.vllm_per_request import import_vllm_per_request

        return import_vllm_per_request(src, **opts)
    raise InputError("--format", f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")


def _check_file(src: str | Path) -> tuple[Path, str]:
    p = Path(src)
    if not p.is_file():
        raise InputError(str(src), not_a_file(p, "source file"))
    return p, str(src)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_id(x: Any) -> bool:
    """A request id: a non-empty string, or an integer that fits int64 (ids become a
    column; a JSON integer past int64 would overflow there)."""
    return (isinstance(x, str) and x != "") or (_is_int(x) and -(1 << 63) <= x < (1 << 63))


def json_lines(p: Path, where: str):
    """(line number, object) for every non-blank line; one-line errors for the rest."""
    try:
        fh = p.open(encoding="utf-8-sig")  # -sig: a leading byte-order mark is not data
    except OSError as exc:
        raise InputError(where, f"cannot read ({exc.strerror})") from exc
    with fh:
        try:
            for i, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    d = loads_json(line)
                except json.JSONDecodeError as exc:
                    raise InputError(where, f"line {i}: not JSON ({exc.msg})") from None
                if not isinstance(d, dict):
                    raise InputError(where, f"line {i}: expected a JSON object")
                yield i, d
        except UnicodeDecodeError as exc:
            raise InputError(where, f"not UTF-8 text ({exc.reason})") from None


def _gamma(observed_max: int, gamma_max: int | None, where: str) -> int:
    if gamma_max is None:
        g = max(1, observed_max)
    else:
        if isinstance(gamma_max, bool) or not isinstance(gamma_max, int) or gamma_max < 1:
            raise InputError("--gamma-max", f"must be an integer >= 1, got {gamma_max!r}")
        g = gamma_max
    if g > GAMMA_LIMIT and gamma_max is None:
        raise InputError(where, f"an accepted run of {g} drafts, past the {GAMMA_LIMIT} draft "
                                "positions a trace holds; --gamma-max G (at most "
                                f"{GAMMA_LIMIT}) cuts the runs at G, exact for verify "
                                "lengths up to it")
    if g > GAMMA_LIMIT:
        raise InputError("--gamma-max", f"{g} is past the {GAMMA_LIMIT} draft positions a "
                                        "trace holds")
    return g


def _build(where: str, meta: TraceMeta, m_rows: list[np.ndarray], ids: list,
           domains: list[str], prompt: list[int] | None, output: list[int] | None,
           conf_rows: list[np.ndarray] | None = None) -> AcceptanceTrace:
    lengths = np.fromiter((len(r) for r in m_rows), np.int64, len(m_rows))
    if len(m_rows) == 0 or lengths.sum() == 0:
        raise InputError(where, "no request with at least one output position")
    all_int = all(_is_int(x) for x in ids)
    if not all_int and any(_is_int(x) for x in ids):
        raise InputError(where, "request ids mix integers and strings")
    if all_int:
        # integer ids are stored in ascending order (how a trace file is read back)
        order = sorted(range(len(ids)), key=ids.__getitem__)
        m_rows, ids, domains = [m_rows[i] for i in order], [ids[i] for i in order], \
            [domains[i] for i in order]
        prompt = None if prompt is None else [prompt[i] for i in order]
        output = None if output is None else [output[i] for i in order]
        conf_rows = None if conf_rows is None else [conf_rows[i] for i in order]
        lengths = lengths[order]
    g = meta.gamma_max
    m = np.concatenate(m_rows).astype(np.int64)
    clipped = int((m > g).sum())
    m = np.minimum(m, g)
    rid = np.asarray(ids, dtype=np.int64 if all_int else str)
    if all_int and (rid.min() < np.iinfo(np.int32).min or rid.max() > np.iinfo(np.int32).max):
        rid = rid.astype(str)
    elif all_int:
        rid = rid.astype(np.int32)
    extra = dict(meta.extra)
    if clipped:
        extra["clipped_positions"] = clipped
    meta = TraceMeta(drafter=meta.drafter, target=meta.target, gamma_max=g, source=meta.source,
                     temperature=meta.temperature,
                     domains=tuple(sorted(set(domains))), generator=meta.generator, extra=extra)
    return AcceptanceTrace(
        meta=meta,
        accept_len=m.astype(np.int8),
        conf=None if conf_rows is None else np.concatenate(conf_rows).astype(np.float32),
        req_offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        req_domain=np.asarray(domains, dtype=str),
        req_ids=rid,
        source_path=where,
        req_prompt_tokens=None if prompt is None else np.asarray(prompt, np.int64),
        req_output_tokens=None if output is None else np.asarray(output, np.int64),
    )


def _default_domain(p: Path) -> str:
    stem = p.name.split(".")[0]
    return stem.removeprefix("combined_") or "imported"


def _sdb_acc_len(d: dict, key: str, used: dict[str, int], where: str, i: int) -> list[int]:
    """Line ``i``'s acceptance list: ``key`` (``acc_eagle``/``acc_ngram``), else the single
    ``acc`` table SpecDecode-Bench's request.py falls back to. ``used`` (table -> first
    line) keeps a file to one table: a mix would put two drafters' data in one trace."""
    read_key = key if key in d or "acc" not in d else "acc"
    if used and read_key not in used:
        other = next(iter(used))
        raise InputError(where, f"line {i}: acceptance read from '{read_key}', but from "
                                f"'{other}' on line {used[other]}; one table per file")
    used.setdefault(read_key, i)
    acc = d.get(read_key)
    if not isinstance(acc, dict) or not isinstance(acc.get("acc_len"), list):
        raise InputError(where, f"line {i}: no '{key}.acc_len' list")
    acc_len = acc["acc_len"]
    if not all(_is_int(x) and 1 <= x <= MAX_COUNT for x in acc_len):
        bad = next(x for x in acc_len if not (_is_int(x) and 1 <= x <= MAX_COUNT))
        raise InputError(where, f"line {i}: '{read_key}.acc_len' values must be integers in "
                                f"[1, 2**31 - 1] (tokens per verify step incl. bonus), got {bad!r}")
    return acc_len


# -- SpecDecode-Bench --------------------------------------------------------------------
def import_specdecode_bench(src: str | Path, *, column: str = "eagle", domain: str | None = None,
                            gamma_max: int | None = None, drafter: str | None = None,
                            target: str = "llama3.1-8b-instruct (SpecDecode-Bench)",
                            temperature: float = 0.0) -> AcceptanceTrace:
    p, where = _check_file(src)
    if column not in SPECDECODE_COLUMNS:
        raise InputError("--column", f"must be one of {', '.join(SPECDECODE_COLUMNS)}, got {column!r}")
    dom = domain or _default_domain(p)
    key = f"acc_{column}"
    m_rows: list[np.ndarray] = []
    ids: list = []
    prompt: list[int] = []
    output: list[int] = []
    seen: dict = {}
    used: dict[str, int] = {}  # the table read ('acc_<column>' or 'acc') -> first line
    skipped = mismatched = 0
    for i, d in json_lines(p, where):
        rid = d.get("id")
        if not _is_id(rid):
            raise InputError(where, f"line {i}: 'id' must be a non-empty string or an int64 "
                                    f"integer, got {rid!r}")
        if rid in seen:
            raise InputError(where, f"line {i}: duplicate id {rid!r} (first on line {seen[rid]})")
        seen[rid] = i
        toks = d.get("prompt_token_ids")
        if not isinstance(toks, list):
            raise InputError(where, f"line {i}: 'prompt_token_ids' must be a list")
        acc_len = _sdb_acc_len(d, key, used, where, i)
        if not acc_len:  # SpecDecode-Bench's simulator drops these too
            skipped += 1
            continue
        gen = d.get("generated_token_ids")
        if isinstance(gen, list) and len(gen) != len(acc_len):
            mismatched += 1
        m_rows.append(np.asarray(acc_len, np.int64) - 1)
        ids.append(rid)
        prompt.append(len(toks))
        output.append(len(acc_len))
    observed = max((int(r.max()) for r in m_rows if r.size), default=0)
    g = _gamma(observed, gamma_max, where)
    table = next(iter(used), key)  # what was read: acc_<column>, or the fallback 'acc'
    meta = TraceMeta(
        drafter=drafter or f"specdecode-bench-{table.removeprefix('acc_')}", target=target,
        gamma_max=g, source="imported", temperature=float(temperature),
        generator={"kind": "import", "format": "specdecode-bench", "column": f"{table}.acc_len",
                   "file": p.name, "observed_max_accept_len": observed,
                   "skipped_empty_requests": skipped,
                   "output_tokens": f"len({table}.acc_len), the positions SpecDecode-Bench's "
                                    "simulator replays",
                   "requests_where_generated_token_ids_length_differs": mismatched},
    )
    return _build(where, meta, m_rows, ids, [dom] * len(m_rows), prompt, output)


# -- generic per-position ----------------------------------------------------------------
_PP_INT = ("position", "accept_len", "tokens_per_step", "prompt_tokens", "output_tokens")


def import_per_position(src: str | Path, *, domain: str | None = None,
                        gamma_max: int | None = None, drafter: str | None = None,
                        target: str = "unknown", temperature: float = 0.0) -> AcceptanceTrace:
    p, where = _check_file(src)
    if p.suffix.lower() in (".jsonl", ".json", ".ndjson"):
        records, lines, conf = _pp_jsonl(p, where)
    elif p.suffix.lower() in (".csv", ".tsv"):
        records, lines, conf = _pp_csv(p, where)
    else:
        raise InputError(where, "per-position input must be .jsonl or .csv")
    if not records["request_id"]:
        raise InputError(where, "no rows")
    has_m = "accept_len" in records
    has_t = "tokens_per_step" in records
    if has_m == has_t:
        raise InputError(where, "needs exactly one of the columns 'accept_len' (accepted "
                                "drafts) or 'tokens_per_step' (accepted drafts + 1)")
    m = np.asarray(records["accept_len"] if has_m else records["tokens_per_step"], np.int64)
    if has_t:
        m = m - 1
    if (m < 0).any():
        j = int(np.flatnonzero(m < 0)[0])
        what = "accept_len must be >= 0" if has_m else "tokens_per_step must be >= 1"
        raise InputError(where, f"line {lines[j]}: {what}")
    pos = np.asarray(records["position"], np.int64)
    ids = records["request_id"]
    # group rows by request in first-appearance order, positions sorted within each
    order_key: dict = {}
    first = np.fromiter((order_key.setdefault(r, len(order_key)) for r in ids), np.int64, len(ids))
    order = np.lexsort((pos, first))
    first_s, pos_s = first[order], pos[order]
    starts = np.flatnonzero(np.r_[True, first_s[1:] != first_s[:-1]])
    expect = np.arange(len(pos_s)) - np.repeat(starts, np.diff(np.r_[starts, len(pos_s)]))
    if not np.array_equal(pos_s, expect):
        j = int(np.flatnonzero(pos_s != expect)[0])
        line = lines[order[j]]
        rid = ids[order[j]]
        raise InputError(where, f"line {line}: positions of request {rid!r} are not 0, 1, 2, ... "
                                f"(duplicate or gap at position {pos_s[j]}; a per-step log, "
                                "its positions jumping by each step's tokens, is not "
                                "per-position data)")
    req_ids = list(order_key)
    bounds = np.r_[starts, len(pos_s)]
    m_rows = [m[order[a:b]] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    observed = int(m.max(initial=0))
    if conf is not None:
        width = conf.shape[1]
        if width > GAMMA_LIMIT:  # the file's own width: no --gamma-max can fix it
            raise InputError(where, f"line {lines[0]}: {width} confidences per row, past "
                                    f"the {GAMMA_LIMIT} draft positions a trace holds")
        if gamma_max is not None and gamma_max != width:
            raise InputError("--gamma-max", f"the confidences have {width} columns; gamma_max "
                                            f"must equal that, got {gamma_max}")
        if observed > width:
            j = int(np.flatnonzero(m > width)[0])
            raise InputError(where, f"line {lines[j]}: accepted run {m[j]} is longer than the "
                                    f"{width} confidences")
        gamma_max = width
    g = _gamma(observed, gamma_max, where)
    per_req = {}
    for col in ("prompt_tokens", "output_tokens", "domain"):
        if col not in records:
            continue
        v = np.asarray(records[col], dtype=object)[order]
        firsts = v[starts]
        differ = v != np.repeat(firsts, np.diff(bounds))
        if differ.any():
            j = int(np.flatnonzero(differ)[0])
            raise InputError(where, f"line {lines[order[j]]}: {col} differs between rows of "
                                    f"request {ids[order[j]]!r}")
        per_req[col] = firsts.tolist()
    doms = per_req.get("domain") or [domain or _default_domain(p)] * len(req_ids)
    conf_rows = None if conf is None else [conf[order[a:b]]
                                           for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    meta = TraceMeta(drafter=drafter or "imported", target=target, gamma_max=g, source="imported",
                     temperature=float(temperature),
                     generator={"kind": "import", "format": "per-position", "file": p.name,
                                "unit": "accept_len" if has_m else "tokens_per_step"})
    return _build(where, meta, m_rows, req_ids, [str(x) for x in doms],
                  per_req.get("prompt_tokens"), per_req.get("output_tokens"), conf_rows)


def _pp_check_value(col: str, v: Any, where: str, line: int) -> Any:
    if col == "request_id":
        if not _is_id(v):
            raise InputError(where, f"line {line}: request_id must be a non-empty string or "
                                    f"an int64 integer, got {v!r}")
        return v
    if col == "domain":
        if not isinstance(v, str):
            raise InputError(where, f"line {line}: domain must be a string, got {v!r}")
        return v
    if not _is_int(v) or not 0 <= v <= MAX_COUNT:
        raise InputError(where, f"line {line}: {col} must be an integer in [0, 2**31 - 1], "
                                f"got {v!r}")
    return v


def _conf_row(v: Any, where: str, line: int, width: int | None) -> list[float]:
    if not isinstance(v, list) or not v:
        raise InputError(where, f"line {line}: conf must be a non-empty list of numbers")
    out = []
    for x in v:
        if isinstance(x, bool) or not isinstance(x, int | float) or not 0.0 <= x <= 1.0:
            raise InputError(where, f"line {line}: conf values must be numbers in [0, 1], got {x!r}")
        out.append(float(x))
    if width is not None and len(out) != width:
        raise InputError(where, f"line {line}: conf has {len(out)} values, earlier rows {width}")
    return out


def _pp_jsonl(p: Path, where: str):
    cols = ("request_id", "position", "accept_len", "tokens_per_step", "domain",
            "prompt_tokens", "output_tokens")
    records: dict[str, list] = {"request_id": [], "position": []}
    lines: list[int] = []
    conf: list[list[float]] = []
    width: int | None = None
    present: set[str] | None = None
    for i, d in json_lines(p, where):
        keys = {c for c in cols if c in d}
        if "conf" in d:
            keys.add("conf")
        for need in ("request_id", "position"):
            if need not in d:
                raise InputError(where, f"line {i}: no '{need}'")
        if present is None:
            present = keys
            for c in keys - {"conf"}:
                records.setdefault(c, [])
        elif keys != present:
            diff = sorted(keys ^ present)
            raise InputError(where, f"line {i}: fields {', '.join(diff)} present on some rows "
                                    "but not others")
        for c in keys - {"conf"}:
            records[c].append(_pp_check_value(c, d[c], where, i))
        if "conf" in keys:
            row = _conf_row(d["conf"], where, i, width)
            width = len(row)
            conf.append(row)
        lines.append(i)
    return records, lines, (np.asarray(conf, np.float32) if conf else None)


def _pp_csv(p: Path, where: str):
    try:
        df = read_csv_strings(p, where, "\t" if p.suffix.lower() == ".tsv" else ",")
    except InputError:
        raise
    except Exception as exc:  # polars raises a zoo of parse errors
        raise InputError(where, f"cannot parse CSV ({exc.__class__.__name__})") from None
    df, lines = tidy_csv_lines(df)
    for need in ("request_id", "position"):
        if need not in df.columns:
            raise InputError(where, f"CSV needs a '{need}' column")
    conf_cols = sorted((c for c in df.columns if re.fullmatch(r"conf_\d+", c)),
                       key=lambda c: int(c[5:]))
    if conf_cols and [int(c[5:]) for c in conf_cols] != list(range(1, len(conf_cols) + 1)):
        raise InputError(where, f"confidence columns must be conf_1 .. conf_G, got {conf_cols}")
    records: dict[str, list] = {}
    for col in ("request_id", "domain"):
        if col in df.columns:
            s = df[col].str.strip_chars()
            if s.null_count() or (s.str.len_chars() == 0).any():
                j = int((s.is_null() | (s.str.len_chars() == 0)).arg_max())
                raise InputError(where, f"line {lines[j]}: empty {col}")
            records[col] = s.to_list()
    for col in _PP_INT:
        if col not in df.columns:
            continue
        v = df[col].str.strip_chars().cast(pl.Int64, strict=False)
        bad = v.is_null() | (v < 0) | (v > MAX_COUNT)
        if bad.any():
            j = int(bad.arg_max())
            raise InputError(where, f"line {lines[j]}: {col} must be an integer in "
                                    f"[0, 2**31 - 1], got {df[col][j]!r}")
        records[col] = v.to_list()
    conf = None
    if conf_cols:
        c = df.select(pl.col(conf_cols).str.strip_chars().cast(pl.Float64, strict=False))
        arr = c.to_numpy()
        bad = ~np.isfinite(arr) | (arr < 0) | (arr > 1)
        if bad.any():
            j = int(np.flatnonzero(bad.any(axis=1))[0])
            raise InputError(where, f"line {lines[j]}: conf values must be numbers in [0, 1]")
        conf = arr.astype(np.float32)
    return records, lines, conf


# -- vLLM counters -----------------------------------------------------------------------
# One sample line of the Prometheus text format or OpenMetrics: a name, an optional label
# set (values are quoted and may hold escaped quotes, commas or braces), the value, an
# optional timestamp and an optional OpenMetrics exemplar ("# {labels} value [ts]").
_PROM_SAMPLE = re.compile(r'^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)'
                          r'(?:\{(?P<labels>(?:[^"}]|"(?:[^"\\]|\\.)*")*)\})?'
                          r'[ \t]+(?P<value>[^ \t#]+)(?:[ \t]+[^ \t#]+)?(?:[ \t]+#.*)?$')
_PROM_LABEL = re.compile(r'[ \t]*(?P<key>[A-Za-z_][A-Za-z0-9_]*)[ \t]*=[ \t]*'
                         r'"(?P<value>(?:[^"\\]|\\.)*)"[ \t]*(?:,|$)')
_PROM_REST_BLANK = re.compile(r"[ \t]*$")
# The counters read, by the sample name prometheus_client prints for them (``_total``;
# the ``_created`` timestamps beside them and vLLM V0's gauges are not read).
_VLLM_COUNTERS = {"vllm:spec_decode_num_drafts_total": "drafts",
                  "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
                  "vllm:spec_decode_num_accepted_tokens_total": "accepted",
                  "vllm:spec_decode_num_accepted_tokens_per_pos_total": "per_pos",
                  # how many request-steps there were (the draft fraction's denominator)
                  "vllm:generation_tokens_total": "generation_tokens",
                  "vllm:request_success_total": "request_success"}
_SPEC_KINDS = ("drafts", "draft_tokens", "accepted", "per_pos")
_COUNTER_PREFIXES = ("vllm:spec_decode_num_", "vllm:generation_tokens_total",
                     "vllm:request_success_total")
# The counts that give the request-steps, by the names a scrape and a bench serve
# result give them: output tokens, accepted drafts, finished requests.
_STEP_COUNTS = {"prometheus": ("vllm:generation_tokens_total",
                               "vllm:spec_decode_num_accepted_tokens_total",
                               "vllm:request_success_total"),
                "bench-serve": ("total_output_tokens", "spec_decode_accepted_tokens",
                                "completed")}
# At or above this fraction of request-steps with drafts, every position drafts: the
# trace gets no draft_tokens column (the gap is rounding and a scrape's timing).
ALWAYS_DRAFTS = 0.999
# Counters vLLM increments one after the other may be scraped between two increments: a
# total and the sum of its parts may then differ by a step's worth. The slack allowed:
COUNTER_TOLERANCE = 0.01


def read_vllm_counters(src: str | Path, model_name: str | None = None) -> dict[str, Any]:
    """``{"num_drafts", "accepted_per_pos", "survival", "source_kind", ...}`` from a
    ``/metrics`` scrape (text) or a ``vllm bench serve`` result (JSON). ``model_name``
    picks one model's counters from a scrape that holds several."""
    p, where = _check_file(src)
    try:
        text = p.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(where, f"not UTF-8 text ({exc.reason})") from None
    except OSError as exc:
        raise InputError(where, f"cannot read ({exc.strerror})") from None
    if text.lstrip().startswith(("{", "[")):
        return _bench_serve_counters(text, where, model_name)
    return _prometheus_counters(text, where, model_name)


def _bench_serve_json(text: str, where: str) -> dict:
    try:
        d = loads_bench_serve_json(text, where)
    except json.JSONDecodeError as exc:
        raise InputError(where, f"line {exc.lineno}: not JSON ({exc.msg})") from None
    if not isinstance(d, dict):
        raise InputError(where, "expected a vllm bench serve result (a JSON object), got a "
                                f"JSON {type(d).__name__}")
    return d


def _bench_serve_counters(text: str, where: str, model_name: str | None) -> dict[str, Any]:
    d = _bench_serve_json(text, where)
    if model_name is not None and d.get("model_id") != model_name:
        raise InputError("--model-name", f"{where} is a bench serve result for model_id "
                                         f"{d.get('model_id')!r}, not {model_name!r}")
    rates = d.get("spec_decode_per_position_acceptance_rates")
    drafts = d.get("spec_decode_num_drafts")
    if not any(k.startswith("spec_decode_") for k in d):
        raise InputError(where, "no spec_decode_* keys: not a vllm bench serve result, or "
                                "one whose server ran without speculative decoding (or drafted "
                                "nothing in the benchmark window)")
    if not isinstance(rates, list) or not rates:
        raise InputError(where, "bench serve result has no per-position rates "
                                "('spec_decode_per_position_acceptance_rates' absent or "
                                "empty: the server exposed no per-position counters); a mean "
                                "acceptance length alone does not give them")
    if not all(finite_number(x) for x in rates):
        raise InputError(where, "spec_decode_per_position_acceptance_rates must be numbers")
    if not (is_int64(drafts) or (isinstance(drafts, float) and drafts.is_integer()
                                 and drafts < 2.0**63)) or drafts <= 0:
        raise InputError(where, "spec_decode_num_drafts must be a positive integer (vLLM "
                                "writes it beside its per-position rates; without it the rates "
                                f"cannot be told to be vLLM's counters), got {drafts!r}")
    surv = _check_survival([float(x) for x in rates], where)
    accepted = d.get("spec_decode_accepted_tokens")
    c = {"num_drafts": int(drafts), "survival": surv, "source_kind": "bench-serve",
         "accepted_per_pos": [round(x * drafts) for x in surv],
         "num_draft_tokens": d.get("spec_decode_draft_tokens"),
         "num_accepted_tokens": accepted, "model_name": d.get("model_id")}
    al = d.get("spec_decode_acceptance_length")
    if al is not None and not (finite_number(al) and abs(al - 1 - sum(surv)) <= 0.01):
        raise InputError(where, f"spec_decode_acceptance_length {al!r} is not 1 + the sum of "
                                f"the per-position rates ({1 + sum(surv):.4f}); vLLM writes both "
                                "from the same counters (its length includes the bonus token; "
                                "TensorRT-LLM's AL - 1 or conditional per-position rates would "
                                "not match)")
    _check_totals(c, where, "spec_decode_accepted_tokens", "spec_decode_draft_tokens")
    _request_steps(c, where, (d.get("total_output_tokens"), accepted, d.get("completed")))
    return c


def _prom_labels(text: str, where: str, line: int) -> dict[str, str]:
    labels: dict[str, str] = {}
    at = 0
    while not _PROM_REST_BLANK.match(text, at):  # (not text[at:]: quadratic on long sets)
        mt = _PROM_LABEL.match(text, at)
        if mt is None:
            raise InputError(where, f"line {line}: malformed label set {{{text}}}")
        if mt["key"] in labels:
            raise InputError(where, f"line {line}: label {mt['key']!r} given twice")
        labels[mt["key"]] = re.sub(r"\\(.)", lambda e: "\n" if e[1] == "n" else e[1],
                                   mt["value"])
        at = mt.end()
    return labels


def _prom_samples(text: str, where: str) -> list[tuple[int, str, dict[str, str], float]]:
    """(line, kind, labels, value) of every counter sample of :data:`_VLLM_COUNTERS`;
    one series twice (two scrapes pasted into one file) is refused, not summed."""
    out = []
    first: dict[tuple, int] = {}
    for i, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line.startswith(_COUNTER_PREFIXES):
            continue  # comments (HELP, TYPE, EOF), other metrics, blank lines
        mt = _PROM_SAMPLE.match(line)
        if mt is None:
            raise InputError(where, f"line {i}: not a Prometheus sample")
        kind = _VLLM_COUNTERS.get(mt["name"])
        if kind is None:
            continue
        labels = _prom_labels(mt["labels"] or "", where, i)
        try:
            val = float(mt["value"])
        except ValueError:
            raise InputError(where, f"line {i}: value {mt['value']!r} is not a number") from None
        if not math.isfinite(val) or val < 0:
            raise InputError(where, f"line {i}: counter value must be finite and >= 0")
        key = (mt["name"], tuple(sorted(labels.items())))
        if key in first:
            raise InputError(where, f"line {i}: the series on line {first[key]} again (two "
                                    "scrapes in one file?); import one scrape")
        first[key] = i
        out.append((i, kind, labels, val))
    return out


def _pick_model(samples: list, where: str, model_name: str | None) -> str | None:
    """The one model whose counters are read: summing two models' counters would mix two
    drafters' acceptance into one curve that belongs to neither."""
    models = sorted({s[2].get("model_name", "") for s in samples})
    shown = ", ".join(repr(m) if m else "(no model_name label)" for m in models)
    if model_name is not None:
        if model_name not in models:
            raise InputError("--model-name", f"{where} has no counters of model "
                                             f"{model_name!r}; it has {shown}")
        return model_name
    if len(models) > 1:
        raise InputError(where, f"counters of {len(models)} models in one scrape ({shown}); "
                                "pick one with --model-name")
    return models[0] if models else None


def _prometheus_counters(text: str, where: str, model_name: str | None) -> dict[str, Any]:
    samples = _prom_samples(text, where)
    # a model served without speculation has output and request counters but no drafter
    model = _pick_model([s for s in samples if s[1] in _SPEC_KINDS], where, model_name)
    totals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for i, kind, labels, val in samples:
        if labels.get("model_name", "") != (model or ""):
            continue
        if kind == "per_pos":
            pos = labels.get("position", "")
            if not is_decimal(pos, 6):
                got = f"its position label is {pos!r}" if "position" in labels else \
                    "it has no position label"
                raise InputError(where, f"line {i}: per-position counter whose position is "
                                        f"not \"0\", \"1\", ... in ASCII digits ({got})")
            per_pos[int(pos)] = per_pos.get(int(pos), 0.0) + val
        else:
            totals[kind] = totals.get(kind, 0.0) + val
    if "drafts" not in totals or not per_pos:
        hint = (" (a vLLM log? its 'SpecDecoding metrics' lines are rounded 10 s windows: "
                "import a /metrics scrape instead)" if "SpecDecoding metrics" in text else "")
        raise InputError(where, "no vllm:spec_decode_num_drafts_total and vllm:spec_decode_"
                                "num_accepted_tokens_per_pos_total samples (no speculative "
                                "decoding, or a vLLM without per-position counters: V0 "
                                f"engines report only totals){hint}")
    if sorted(per_pos) != list(range(len(per_pos))):
        raise InputError(where, f"per-position counters are not positions 0..K-1: {sorted(per_pos)}")
    drafts = totals["drafts"]
    if drafts <= 0:
        raise InputError(where, "vllm:spec_decode_num_drafts_total is 0: no drafts were verified")
    acc = [per_pos[k] for k in range(len(per_pos))]
    c = {"num_drafts": int(drafts), "accepted_per_pos": [int(x) for x in acc],
         "survival": _check_survival([x / drafts for x in acc], where),
         "source_kind": "prometheus", "model_name": model,
         "num_draft_tokens": totals.get("draft_tokens"), "num_accepted_tokens": totals.get("accepted")}
    _check_totals(c, where, "vllm:spec_decode_num_accepted_tokens_total",
                  "vllm:spec_decode_num_draft_tokens_total")
    _request_steps(c, where, (totals.get("generation_tokens"), totals.get("accepted"),
                              totals.get("request_success")))
    return c


def _request_steps(c: dict[str, Any], where: str, counts: tuple) -> None:
    """``c["request_steps"]``: decode steps summed over requests, ``output tokens -
    accepted drafts - finished requests`` (each request's first token comes from its
    prefill, every other step emits its accepted drafts plus one), or None with the
    names of the counts the file lacks in ``c["request_steps_missing"]``."""
    names = _STEP_COUNTS[c["source_kind"]]
    missing = [n for n, v in zip(names, counts, strict=True) if v is None]
    c["request_steps"], c["request_steps_missing"] = None, missing
    if missing:
        return
    for name, v in zip(names, counts, strict=True):
        if not finite_number(v) or v < 0:
            raise InputError(where, f"{name} must be a count >= 0, got {v!r}")
    steps = round(counts[0] - counts[1] - counts[2])
    if steps < 1:
        raise InputError(where, f"{names[0]} - {names[1]} - {names[2]} is {steps}: no decode "
                                f"steps, yet {c['num_drafts']} drafts (the counts are not of "
                                "one run)")
    c["request_steps"] = steps


def _check_totals(c: dict[str, Any], where: str, accepted_name: str, drafted_name: str) -> None:
    """The totals beside the per-position counts, where the file has them: accepted
    tokens are the per-position counts' sum (vLLM counts both from one draft), and no
    draft is longer than K positions (more draft tokens than that: positions missing)."""
    drafts, k = c["num_drafts"], len(c["survival"])
    accepted = drafts * sum(c["survival"])
    for name, v in ((accepted_name, c.get("num_accepted_tokens")),
                    (drafted_name, c.get("num_draft_tokens"))):
        if v is not None and (not finite_number(v) or v < 0):
            raise InputError(where, f"{name} must be a count >= 0, got {v!r}")
    drafted = c.get("num_draft_tokens")
    if drafted is not None and drafted > k * drafts * (1 + COUNTER_TOLERANCE):
        raise InputError(where, f"{drafted_name} is {drafted:g}, more than {k} positions x "
                                f"{drafts} drafts: per-position counters are missing")
    got = c.get("num_accepted_tokens")
    if got is not None and abs(got - accepted) > COUNTER_TOLERANCE * max(accepted, 100.0):
        raise InputError(where, f"{accepted_name} is {got:g} but the per-position counts sum "
                                f"to {accepted:.0f}: the totals and the per-position counters "
                                "are not from the same drafts")
    if drafted is not None and drafted < accepted * (1 - COUNTER_TOLERANCE):
        raise InputError(where, f"{drafted_name} is {drafted:g}, fewer than the "
                                f"{accepted:.0f} accepted tokens")


def _check_survival(surv: list[float], where: str) -> list[float]:
    if any(not 0.0 <= x <= 1.0 for x in surv):
        raise InputError(where, "per-position acceptance rates must lie in [0, 1]")
    if any(b > a + 1e-9 for a, b in zip(surv, surv[1:], strict=False)):
        raise InputError(where, "per-position acceptance rates increase along the draft; "
                                "vLLM's counters are unconditional survival P(m >= k), which "
                                "cannot increase")
    return surv


def survival_to_pmf(surv: np.ndarray) -> np.ndarray:
    """P(m = j), j = 0..K, from the unconditional survival ``P(m >= j)``, j = 1..K."""
    s = np.r_[1.0, np.asarray(surv, np.float64), 0.0]
    return np.clip(s[:-1] - s[1:], 0.0, None)


def import_vllm_counters(src: str | Path, *, requests: int = 64, positions: int = 512,
                         seed: int = 0, domain: str = "vllm", drafter: str | None = None,
                         target: str | None = None,
                         model_name: str | None = None) -> AcceptanceTrace:
    where = str(src)
    for name, v in (("--requests", requests), ("--positions", positions)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InputError(name, f"must be an integer >= 1, got {v!r}")
    check_seed(seed)  # numpy's own refusal of a negative seed is a traceback
    if requests * positions > MAX_SYNTH_CELLS:
        raise InputError("--requests x --positions",  # either may be the large one
                         f"{requests:,} x {positions:,} = {requests * positions:,} exceeds "
                         f"{MAX_SYNTH_CELLS:,}; import fewer requests or positions")
    c = read_vllm_counters(src, model_name)
    surv = np.asarray(c["survival"], np.float64)
    k = len(surv)
    if k > GAMMA_LIMIT:
        raise InputError(where, f"{k} draft positions exceed {GAMMA_LIMIT}")
    pmf = survival_to_pmf(surv)
    rng = np.random.default_rng(seed)
    n = requests * positions
    m = rng.choice(k + 1, size=n, p=pmf / pmf.sum())
    generator = {"kind": "vllm-counters", "file": Path(src).name,
                 "counters_from": c["source_kind"], "num_speculative_tokens": k,
                 "num_drafts": c["num_drafts"], "accepted_per_pos": c["accepted_per_pos"],
                 "survival_per_step": [round(x, 6) for x in surv.tolist()],
                 "acceptance_length": round(1.0 + float(surv.sum()), 6),
                 "model": "m i.i.d. per position with P(m >= j) = survival_per_step[j-1]",
                 "requests": requests, "positions": positions, "seed": seed}
    if c["model_name"]:
        generator["model_name"] = c["model_name"]
    if c["num_draft_tokens"] is not None:
        # below K: drafts shorter than K (an n-gram without a full match, grammar-masked
        # tokens); the survival counts those positions as rejected, the replay verifies K
        generator["draft_tokens_per_draft"] = round(c["num_draft_tokens"] / c["num_drafts"], 6)
    # drawn after m: a trace without the column is the one written before it existed
    m, draft_tokens = _draw_drafting(c, k, m, rng, generator)
    if target is None:
        target = f"{c['model_name'] or 'unknown'} (vLLM counters)"
    meta = TraceMeta(drafter=drafter or "vllm-counters", target=target, gamma_max=k,
                     source="synthetic", domains=(domain,), generator=generator)
    return AcceptanceTrace(
        meta=meta, accept_len=m.astype(np.int8), conf=None,
        req_offsets=np.arange(0, n + 1, positions, dtype=np.int64),
        req_domain=np.full(requests, domain), req_ids=np.arange(requests, dtype=np.int32),
        source_path=where, draft_tokens=draft_tokens,
    )


def _draw_drafting(c: dict[str, Any], k: int, m: np.ndarray, rng: np.random.Generator,
                   generator: dict[str, Any]) -> tuple[np.ndarray, np.ndarray | None]:
    """Which positions carry drafts: each independently with probability ``num_drafts /
    request_steps`` (vLLM counts drafts only at steps whose drafter proposed some, an
    n-gram drafter only where it matched), all ``K`` drafts, else none and ``m = 0``.
    vLLM's rates are over drafting steps, so ``m`` keeps its draw where a draft exists.
    Without the request-step counts, or at a fraction of ~1, every position drafts and
    no column is written; the generator says which."""
    steps = c.get("request_steps")
    if steps is None:
        generator["draft_fraction"] = None
        generator["draft_fraction_from"] = (
            f"not in the file ({', '.join(c['request_steps_missing'])} missing): every "
            "position drafts K, no draft_tokens column")
        return m, None
    fraction = min(1.0, c["num_drafts"] / steps)
    generator["request_steps"] = steps
    generator["draft_fraction"] = round(fraction, 6)
    names = _STEP_COUNTS[c["source_kind"]]
    generator["draft_fraction_from"] = (
        f"num_drafts / ({names[0]} - {names[1]} - {names[2]}) = {c['num_drafts']} / {steps}"
        + ("" if fraction < ALWAYS_DRAFTS else "; every position drafts K, no draft_tokens "
           "column"))
    if fraction >= ALWAYS_DRAFTS:
        return m, None
    generator["model"] += "; only at positions that draft (draft_fraction), m = 0 elsewhere"
    drafted = rng.random(m.shape[0]) < fraction
    return np.where(drafted, m, 0), np.where(drafted, k, 0).astype(np.int8)


def per_request_trace(survival: np.ndarray, output_tokens: np.ndarray,
                      decode_steps: np.ndarray, *, seed: int = 0, drafter: str = "vllm",
                      domain: str = "vllm", source: str = "<bench serve>",
                      generator: dict | None = None) -> AcceptanceTrace:
    """One row per served request, from a ``bench serve --save-detailed`` result: each
    request's own tokens per step, from its streamed chunks (a chunk per engine step, so
    ``len(itls)`` decode steps for its ``output_tokens - 1`` decoded tokens), on top of
    the pooled per-draft survival ``P(m >= j)`` of vLLM's counters.

    Requests differ far more than positions: an n-gram drafter copies long runs from one
    prompt and finds nothing in the next (1.2 to 3.7 tokens per step among the shipped
    HumanEval prompts at k = 3). Request ``i`` drafts at each position with probability
    ``f_i = (tau_i - 1) / sum(survival)`` (capped at 1), its drafts' accepted run drawn
    from the pooled distribution; a request above the pooled acceptance length drafts
    everywhere, its distribution exponentially tilted towards longer runs until its mean
    is ``tau_i - 1``. Served greedily, row ``i`` then takes ``tau_i`` tokens per step in
    expectation, and the rows together keep the counters' shape."""
    surv = np.asarray(survival, np.float64)
    k = len(surv)
    out = np.asarray(output_tokens, np.int64)
    steps = np.maximum(np.asarray(decode_steps, np.int64), 1)
    if out.shape != steps.shape or out.size == 0 or k == 0:
        raise InputError(source, "need per-request output lengths and step counts")
    if k > GAMMA_LIMIT:
        raise InputError(source, f"{k} draft positions exceed {GAMMA_LIMIT}")
    check_seed(seed)
    tau = np.clip((out - 1) / steps, 1.0, 1.0 + k)
    pmf = survival_to_pmf(surv)
    pmf = pmf / pmf.sum()
    mean_m = float((np.arange(k + 1) * pmf).sum())
    frac = np.minimum(1.0, (tau - 1.0) / max(mean_m, 1e-9))
    theta = _tilt_to_mean(pmf, np.where(frac >= 1.0, tau - 1.0, mean_m))
    positions = out + k + 1  # the last step may start a draft near the end
    offsets = np.r_[0, np.cumsum(positions)].astype(np.int64)
    row = np.repeat(np.arange(out.size), positions)
    rng = np.random.default_rng(seed)
    w = pmf[None, :] * np.exp(theta[:, None] * np.arange(k + 1)[None, :])
    cdf = np.cumsum(w / w.sum(axis=1, keepdims=True), axis=1)
    m = (rng.random(row.size)[:, None] > cdf[row]).sum(axis=1).clip(0, k)
    drafts = rng.random(row.size) < frac[row]
    m = np.where(drafts, m, 0)
    draft_tokens = np.where(drafts, k, 0).astype(np.int8) if not drafts.all() else None
    gen = {**(generator or {}), "kind": "vllm-bench-serve-requests",
           "num_speculative_tokens": k, "requests": int(out.size), "seed": seed,
           "survival_per_draft": [round(float(x), 6) for x in surv],
           "tokens_per_step_per_request": [round(float(x), 4) for x in tau],
           "model": "row i: drafts at each position with f_i = (tau_i - 1) / E[m] (<= 1), "
                    "m from the pooled per-draft distribution, tilted where tau_i - 1 > "
                    "E[m]; tau_i = (output_tokens_i - 1) / decode chunks_i"}
    meta = TraceMeta(drafter=drafter, target="vLLM (bench serve per request)", gamma_max=k,
                     source="synthetic", domains=(domain,), generator=gen)
    return AcceptanceTrace(
        meta=meta, accept_len=m.astype(np.int8), conf=None, req_offsets=offsets,
        req_domain=np.full(out.size, domain), req_ids=np.arange(out.size, dtype=np.int32),
        source_path=source, draft_tokens=draft_tokens)


def _tilt_to_mean(pmf: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Per target mean, the ``theta`` with ``sum(j p_j e^(theta j)) / sum(p_j e^(theta j))
    = target`` (bisection, vectorised; the mean rises with theta)."""
    j = np.arange(pmf.size, dtype=np.float64)
    lo = np.full(target.shape, -30.0)
    hi = np.full(target.shape, 30.0)
    logp = np.log(np.maximum(pmf, 1e-300))
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        a = logp[None, :] + mid[:, None] * j[None, :]
        a = np.exp(a - a.max(axis=1, keepdims=True))
        mean = (a * j).sum(axis=1) / a.sum(axis=1)
        below = mean < target
        lo = np.where(below, mid, lo)
        hi = np.where(below, hi, mid)
    return np.where(np.abs(target - float((j * pmf).sum())) < 1e-12, 0.0, 0.5 * (lo + hi))
