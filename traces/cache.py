"""A parquet trace's validated arrays kept on disk, so a file is parsed once per machine.

Reading a trace through pyarrow and polars costs a process the two imports, the parse and
the validation (~0.3 s of CPU and ~250 MB of peak memory for a 600,000-row trace, most of
it the frames' intermediate copies), while the run reads only the flat arrays of
:class:`~dspark_sim.traces.schema.AcceptanceTrace`. So the first read of a file writes
those arrays as ``.npy`` files under a folder named by the file's SHA-256 (its content,
not its name or time stamp: a file rewritten in place, or corrupted, never hits an old
entry), and every later read of the same bytes loads them with ``numpy.load``: arrays of
``MMAP_FROM_BYTES`` or more are memory-mapped read-only, so a large trace's pages are read
as the run touches them and shared between processes.

The cache lives in ``DSPARK_SIM_CACHE_DIR`` (default ``$XDG_CACHE_HOME/dspark-sim``, else
``~/.cache/dspark-sim``), under ``traces/``; ``DSPARK_SIM_CACHE_DIR=off`` turns it off.
A folder that cannot be written leaves the read as it was (parsed every time). Traces
with schema-v2 columns are parsed every time (their fields are not flat arrays).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import tempfile
from dataclasses import asdict, fields
from pathlib import Path

import numpy as np

# Entries are written and read by this layout; a change of layout changes the version,
# so an old entry is never read as a new one.
FORMAT = 1
MMAP_FROM_BYTES = 8 << 20
_ARRAYS = ("accept_len", "conf", "req_offsets", "req_domain", "req_ids", "tv_accept",
           "req_prompt_tokens", "req_output_tokens", "draft_tokens")


def cache_root() -> Path | None:
    """The trace cache's folder, or None when turned off."""
    root = os.environ.get("DSPARK_SIM_CACHE_DIR", "").strip()
    if root.lower() == "off":
        return None
    if not root:
        base = os.environ.get("XDG_CACHE_HOME", "").strip() or Path.home() / ".cache"
        root = Path(base) / "dspark-sim"
    return Path(root) / "traces"


def file_key(path: Path) -> str:
    """The entry's name: the format and the SHA-256 of the file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return f"v{FORMAT}-{h.hexdigest()}"


def load(path: Path):
    """The trace cached for ``path``'s bytes, ``source_path`` set to ``path`` as given;
    None when there is no entry (or no cache)."""
    root = cache_root()
    if root is None:
        return None
    from dspark_sim.traces.schema import AcceptanceTrace, TraceMeta

    entry = root / file_key(path)
    try:
        meta_doc = json.loads((entry / "meta.json").read_text())
        arrays = {}
        for name in meta_doc["arrays"]:
            f = entry / f"{name}.npy"
            big = f.stat().st_size >= MMAP_FROM_BYTES
            arrays[name] = np.load(f, mmap_mode="r" if big else None, allow_pickle=False)
    except (OSError, ValueError, KeyError):
        return None
    m = meta_doc["meta"]
    meta = TraceMeta(**{**m, "domains": tuple(m["domains"])})
    return AcceptanceTrace(meta=meta, source_path=str(path),
                           **{name: arrays.get(name) for name in _ARRAYS})


def release_pages(array: np.ndarray | None) -> None:
    """Drop the pages of a memory-mapped array (an entry's, or a view of one) from this
    process's resident memory; a later read maps them again from the file. A run that
    has read a large trace's confidences once into what it replays (their survivals)
    need not keep them resident too. Any other array is left as it is."""
    mapped = getattr(array, "_mmap", None)  # numpy.memmap's map, shared by its views
    if isinstance(mapped, mmap.mmap) and hasattr(mapped, "madvise"):
        mapped.madvise(mmap.MADV_DONTNEED)


def store(path: Path, trace) -> None:
    """Write ``trace``'s arrays as the entry for ``path``'s bytes (atomically: a folder
    renamed into place); nothing when the cache is off or cannot be written, or when the
    trace holds what ``.npy`` files cannot (schema-v2 fields, object arrays)."""
    root = cache_root()
    if root is None or trace.v2 is not None:
        return
    arrays = {name: getattr(trace, name) for name in _ARRAYS
              if getattr(trace, name) is not None}
    if any(a.dtype.hasobject for a in arrays.values()):
        return
    held = {f.name for f in fields(trace)} - {"meta", "source_path", "v2"}
    if held != set(_ARRAYS):  # a field this layout does not know: parse every time
        return
    try:
        entry = root / file_key(path)
        if entry.is_dir():
            return
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
        try:
            for name, a in arrays.items():
                np.save(tmp / f"{name}.npy", np.ascontiguousarray(a), allow_pickle=False)
            meta = asdict(trace.meta)
            meta["domains"] = list(meta["domains"])
            (tmp / "meta.json").write_text(json.dumps({"meta": meta, "arrays": list(arrays)}))
            os.replace(tmp, entry)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not entry.is_dir():
                raise
    except OSError:
        return
