"""Several source files, or a folder of them, imported as one schema-v1 trace.

``dspark-sim traces import --format F SRC [SRC ...] --out trace.parquet`` (or
:func:`import_files`): each file is read by the format's importer
(:func:`~dspark_sim.traces.importers.import_trace`) and the traces are stacked in the
order given, a folder's files in name order. How they were combined is returned as one
sentence (:attr:`Imported.note`), which the command prints.

* **Folders** give their files whose suffix the format reads (:data:`SUFFIXES`; hidden
  files and subfolders are not read); the files skipped are counted in the note. A file
  given twice (or a file and the folder holding it) is refused: its requests would count
  twice.
* **One format.** The files must all be the ``--format`` given: each is sniffed by the
  fields it names (:func:`sniff_format`), and a file that reads as another format is
  refused in one line naming the files and what each looks like, before any is parsed.
* **One gamma_max.** Where a file's ``gamma_max`` is only its longest accepted run
  (``specdecode-bench``; ``per-position`` without confidences; no ``--gamma-max``), the
  trace takes the longest over all files, which changes no row. Where it is the
  server's draft length or the width of the confidences (``vllm-counters``,
  ``vllm-per-request``, confidences), files that differ are refused, naming each file's
  value: one trace replays one draft length.
* **Confidences** in some files but not others are refused: a trace holds them for
  every request or for none. **Per-request lengths** in some files only are dropped, and
  the note says so.
* **Request ids** stay as the files give them while they are unique across the files
  (integers then sort, as a trace file is read back); where two files share an id, every
  id becomes ``<file stem>:<id>`` (the stem followed by ``#<n>`` where two files share
  a stem), in file order.
* ``vllm-counters`` draws each file's synthetic trace with ``seed + i`` for the ``i``-th
  file, so two files with the same counters do not give the same rows twice.
* **Metadata.** Domains are the union; the generator is ``{"kind": "combined",
  "format": F, "parts": [...]}`` with each file's own; the counts in ``extra``
  (verify steps, padded and clipped positions) are summed, vLLM's acceptance length is
  recomputed over all the steps, ``request_input_lens`` are concatenated, and
  ``combined_from`` lists each file with its requests, positions and ``gamma_max``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from dspark_sim.errors import InputError
from dspark_sim.traces.importers import FORMATS, import_trace
from dspark_sim.traces.schema import AcceptanceTrace, concat_traces

# the suffixes a folder's files are read by, per format (a file named on its own is read
# whatever its suffix)
SUFFIXES: dict[str, tuple[str, ...]] = {
    "specdecode-bench": (".jsonl",),
    "per-position": (".jsonl", ".json", ".ndjson", ".csv", ".tsv"),
    "vllm-counters": (".txt", ".prom", ".metrics", ".json"),
    "vllm-per-request": (".json", ".jsonl"),
}
SNIFF_BYTES = 1 << 18  # a SpecDecode-Bench line holds its prompt's token ids: read past it
# extra keys that count something per file: the combined trace's is the sum
SUMMED_EXTRA = ("verify_steps", "steps_with_proposal", "steps_without_proposal",
                "padded_positions", "clipped_positions")


@dataclass(frozen=True)
class Imported:
    """The combined trace, the files read (in order) and how they were combined."""

    trace: AcceptanceTrace
    files: tuple[Path, ...]
    note: str


def source_files(fmt: str, sources: Sequence[str | Path]) -> tuple[list[Path], int]:
    """The files ``sources`` name, in order (a folder's files of ``fmt``'s suffixes in
    name order) and how many of the folders' files were skipped for their suffix."""
    files: list[Path] = []
    skipped = 0
    for src in sources:
        p = Path(src)
        if p.is_dir():
            inside = sorted(q for q in p.iterdir() if not q.name.startswith("."))
            keep = [q for q in inside if q.is_file() and q.suffix.lower() in SUFFIXES[fmt]]
            skipped += sum(q.is_file() for q in inside) - len(keep)
            if not keep:
                raise InputError(str(src), f"holds no {fmt} file (read: "
                                           f"{', '.join(SUFFIXES[fmt])})")
            files += keep
        else:  # the format's importer refuses what is no readable file, as for one
            files.append(p)
    seen: dict[Path, Path] = {}
    for f in files:
        key = f.resolve()
        if key in seen:
            raise InputError(str(f), f"given twice (as {seen[key]} too): its requests would "
                                     "count twice")
        seen[key] = f
    return files, skipped


def sniff_format(path: Path) -> str | None:
    """The import format ``path``'s first bytes look like, by the fields they name; None
    where they name none of them (the importer then says what is wrong)."""
    try:
        with path.open("rb") as fh:
            head = fh.read(SNIFF_BYTES).decode("utf-8-sig", errors="replace")
    except OSError:
        return None
    if "per_step_drafted" in head:
        return "vllm-per-request"
    if "vllm:spec_decode" in head or "spec_decode_per_position_acceptance_rates" in head:
        return "vllm-counters"
    if '"prompt_token_ids"' in head and re.search(r'"acc(_eagle|_ngram)?"', head):
        return "specdecode-bench"
    first = next((ln for ln in head.splitlines() if ln.strip()), "")
    if '"request_id"' in first and '"position"' in first:
        return "per-position"
    if {"request_id", "position"} <= {c.strip().strip('"') for c in re.split(r"[,\t]", first)}:
        return "per-position"
    return None


def import_files(fmt: str, sources: Sequence[str | Path], **opts: Any) -> Imported:
    """Import every file ``sources`` name (files or folders) as format ``fmt`` into one
    trace; options as :func:`~dspark_sim.traces.importers.import_trace`'s. One file is
    imported as it is alone (the note is empty)."""
    fmt = fmt.strip().lower()
    if fmt not in FORMATS:
        raise InputError("--format", f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    if not sources:
        raise InputError("SRC", "no source file given")
    files, skipped = source_files(fmt, sources)
    folders = [str(s) for s in sources if Path(s).is_dir()]
    if len(files) == 1:
        note = "" if not folders else (
            f"read {files[0].name}, the one {fmt} file in {folders[0]}"
            + (f" (skipped {skipped} of other suffixes)" if skipped else ""))
        return Imported(import_trace(fmt, files[0], **opts), tuple(files), note)
    _check_one_format(fmt, files)
    seed = opts.pop("seed", 0) if fmt == "vllm-counters" else None
    parts = [import_trace(fmt, f, **opts, **({} if seed is None else {"seed": seed + i}))
             for i, f in enumerate(files)]
    with_conf = [f.name for f, t in zip(files, parts, strict=True) if t.has_conf]
    if with_conf and len(with_conf) < len(files):
        without = [f.name for f, t in zip(files, parts, strict=True) if not t.has_conf]
        raise InputError(None, f"{_names(with_conf)} {_s(with_conf, 'carries', 'carry')} "
                               f"confidences, {_names(without)} {_s(without, 'does', 'do')} "
                               "not: a trace holds them for every request or none")
    parts, raised = _one_gamma(fmt, files, parts, given="gamma_max" in opts)
    lengths_dropped = [f.name for f, t in zip(files, parts, strict=True) if not t.has_lengths]
    if len(lengths_dropped) == len(files):
        lengths_dropped = []
    trace = concat_traces(parts, _meta(fmt, files, parts))
    ids, how = _ids(files, parts)
    trace = replace(trace, req_ids=ids, source_path=", ".join(map(str, files)))
    if ids.dtype.kind in "iu":
        order = np.argsort(ids, kind="stable")
        if not np.array_equal(order, np.arange(order.size)):
            trace = _take_requests(trace, order)
    note = (f"combined {len(files)} {fmt} files in "
            f"{'name' if folders else 'the given'} order "
            f"({', '.join(f'{f.name}: {t.num_requests:,}' for f, t in zip(files, parts, strict=True))}"
            f" requests); request ids {how}")
    if skipped:
        note += f"; skipped {skipped} file{'s' * (skipped != 1)} of other suffixes"
    if raised:
        note += f"; gamma_max {trace.gamma_max}, the longest accepted run over all files"
    if lengths_dropped:
        note += (f"; no per-request lengths: {_names(lengths_dropped)} "
                 f"{_s(lengths_dropped, 'has', 'have')} none")
    return Imported(trace, tuple(files), note)


def _names(names: Sequence[str], most: int = 4) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _s(names: Sequence[str], one: str, many: str) -> str:
    return one if len(names) == 1 else many


def _check_one_format(fmt: str, files: list[Path]) -> None:
    looks: dict[str, list[str]] = {}
    for f in files:
        s = sniff_format(f)
        if s is not None and s != fmt:
            looks.setdefault(s, []).append(f.name)
    if looks:
        theirs = "; ".join(f"{_names(n)} {_s(n, 'is', 'are')} {s}"
                           for s, n in looks.items())
        raise InputError("--format", f"mixed formats: {fmt} given, but {theirs}: import each "
                                     "format on its own")


def _one_gamma(fmt: str, files: list[Path], parts: list[AcceptanceTrace], *,
               given: bool) -> tuple[list[AcceptanceTrace], bool]:
    """The parts at one gamma_max, and whether any was raised to it."""
    gs = [t.gamma_max for t in parts]
    if len(set(gs)) == 1:
        return parts, False
    # a gamma_max that is only the file's longest run: raising it changes no row
    free = not given and all(fmt == "specdecode-bench" or (fmt == "per-position"
                                                           and not t.has_conf) for t in parts)
    if not free:
        per = ", ".join(f"{f.name} {g}" for f, g in zip(files, gs, strict=True))
        why = ("the servers' draft lengths differ" if fmt.startswith("vllm")
               else "the confidences' widths differ")
        raise InputError(None, f"gamma_max mismatch across files ({per}): {why}; one trace replays "
                         "one draft length")
    g = max(gs)
    return [t if t.gamma_max == g else replace(t, meta=replace(t.meta, gamma_max=g))
            for t in parts], True


def _meta(fmt: str, files: list[Path], parts: list[AcceptanceTrace]):
    first = parts[0].meta

    def one(attr: str) -> Any:
        vals = list(dict.fromkeys(getattr(t.meta, attr) for t in parts))
        return vals[0] if len(vals) == 1 else " + ".join(map(str, vals))

    extras = [t.meta.extra for t in parts]
    extra: dict[str, Any] = {}
    for k in dict.fromkeys(k for e in extras for k in e):
        vals = [e.get(k) for e in extras]
        if k in SUMMED_EXTRA:
            extra[k] = int(sum(v or 0 for v in vals))
        elif k == "request_input_lens":
            if all(isinstance(v, list) for v in vals):
                extra[k] = [x for v in vals for x in v]
        elif all(v == vals[0] for v in vals) and k != "source_file":
            extra[k] = vals[0]
    _pooled_acceptance(extras, extra)
    extra["combined_from"] = [{"file": f.name, "requests": t.num_requests,
                               "positions": t.num_positions, "gamma_max": t.gamma_max}
                              for f, t in zip(files, parts, strict=True)]
    return replace(first, drafter=one("drafter"), target=one("target"),
                   gamma_max=max(t.gamma_max for t in parts),
                   domains=tuple(sorted({d for t in parts for d in t.meta.domains})),
                   generator={"kind": "combined", "format": fmt,
                              "parts": [{"file": f.name, **t.meta.generator}
                                        for f, t in zip(files, parts, strict=True)]},
                   extra=extra)


def _pooled_acceptance(extras: list[dict], extra: dict) -> None:
    """vLLM's acceptance length (1 + accepted / steps with a proposal) and tokens per
    request-step over every file's steps, from each file's figure and step counts."""
    if not all(e.get("steps_with_proposal") is not None for e in extras):
        return
    if all(e.get("vllm_acceptance_length") is not None for e in extras):
        steps = sum(e["steps_with_proposal"] for e in extras)
        acc = sum((e["vllm_acceptance_length"] - 1) * e["steps_with_proposal"] for e in extras)
        extra["vllm_acceptance_length"] = round(1 + acc / steps, 6) if steps else None
    if all(e.get("tokens_per_request_step") is not None and e.get("verify_steps")
           for e in extras):
        steps = sum(e["verify_steps"] for e in extras)
        extra["tokens_per_request_step"] = round(
            sum(e["tokens_per_request_step"] * e["verify_steps"] for e in extras) / steps, 6)


def _ids(files: list[Path], parts: list[AcceptanceTrace]) -> tuple[np.ndarray, str]:
    ids = [t.req_ids for t in parts]
    if all(a.dtype.kind in "iu" for a in ids):
        joined = np.concatenate(ids)
        if np.unique(joined).size == joined.size:
            return joined.astype(np.int32), "kept (unique across the files)"
    text = np.concatenate([a.astype(str) for a in ids])
    if np.unique(text).size == text.size:
        return text, "kept (unique across the files)"
    stems = [f.stem for f in files]
    tags = [s if stems.count(s) == 1 else f"{s}#{i + 1}" for i, s in enumerate(stems)]
    prefixed = np.concatenate([np.char.add(f"{tag}:", a.astype(str))
                               for tag, a in zip(tags, ids, strict=True)])
    return prefixed, "prefixed by their file's stem (<stem>:<id>): files share ids"


def _take_requests(t: AcceptanceTrace, order: np.ndarray) -> AcceptanceTrace:
    """``t`` with its requests in ``order`` (rows moved with them, and the per-request
    input lengths its metadata carries)."""
    extra = dict(t.meta.extra)
    if isinstance(extra.get("request_input_lens"), list):
        extra["request_input_lens"] = [extra["request_input_lens"][i] for i in order]
    return replace(t.take_requests(order), meta=replace(t.meta, extra=extra))
