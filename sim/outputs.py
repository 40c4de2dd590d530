"""A run's outputs (``summary.json`` + ``requests.parquet``) written and read as one unit.

Two files cannot be renamed into place in one atomic step, so the pair is tied
together and the commit is ordered:

1. both files are written into a staging folder inside the output folder (same file
   system, so the renames below are atomic); ``summary.json`` carries a manifest,
   ``outputs = {"requests.parquet": {"sha256": ..., "bytes": ...}}``;
2. the previous ``requests.parquet`` (if any) is hard-linked into the staging folder;
3. the new ``requests.parquet`` is renamed into place, then ``summary.json`` (the
   commit point);
4. if the second rename fails (an exception, ``KeyboardInterrupt`` included) the
   previous parquet is renamed back: the previous good pair is intact, nothing is
   mixed. The staging folder is removed either way.

A process killed between the two renames (SIGKILL, power loss) leaves the new parquet
beside the previous summary, whose manifest no longer matches it: :func:`read_run`
refuses such a pair with a one-line error (the previous parquet is still in the hidden
``.run-*`` staging folder), so a summary is never silently read beside another run's
requests. Other files in the output folder are never touched.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import polars as pl

from dspark_sim.errors import InputError

SUMMARY = "summary.json"
REQUESTS = "requests.parquet"
MANIFEST_KEY = "outputs"


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_run(out: str | Path, summary: dict, requests: pl.DataFrame) -> Path:
    """Write ``summary.json`` (with the manifest) and ``requests.parquet`` into ``out``
    as one unit (module docstring). Returns ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".run-", dir=out))
    try:
        new_req = stage / REQUESTS
        requests.write_parquet(new_req)
        manifest = {REQUESTS: {"sha256": sha256_file(new_req), "bytes": new_req.stat().st_size}}
        new_sum = stage / SUMMARY
        new_sum.write_text(json.dumps({**summary, MANIFEST_KEY: manifest}, indent=2,
                                      sort_keys=True) + "\n")
        for p in (new_req, new_sum):  # the mode a plain open() gives (mkdtemp is 0700)
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(p, 0o666 & ~umask)
        prev = stage / f"previous-{REQUESTS}"
        had_prev = (out / REQUESTS).is_file()
        if had_prev:
            try:
                os.link(out / REQUESTS, prev)
            except OSError:  # no hard links here (some network / FAT file systems)
                shutil.copy2(out / REQUESTS, prev)
        os.replace(new_req, out / REQUESTS)
        try:
            os.replace(new_sum, out / SUMMARY)
        except BaseException:
            if had_prev:
                os.replace(prev, out / REQUESTS)
            else:
                with contextlib.suppress(OSError):
                    (out / REQUESTS).unlink()
            raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return out


def read_run(out: str | Path) -> tuple[dict, pl.DataFrame]:
    """``(summary, requests)`` of a run folder, after checking that ``requests.parquet``
    is the one ``summary.json``'s manifest names (a summary without a manifest, from an
    older version, is read unchecked). A mismatch or a missing file is an
    :class:`InputError` naming the file."""
    out = Path(out)
    s_path, r_path = out / SUMMARY, out / REQUESTS
    for p in (s_path, r_path):
        if not p.is_file():
            raise InputError(str(p), "not found (not a run folder?)")
    try:
        summary = json.loads(s_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(str(s_path), f"not a JSON file ({exc})") from exc
    if not isinstance(summary, dict):
        raise InputError(str(s_path), "not a run summary")
    entry = (summary.get(MANIFEST_KEY) or {}).get(REQUESTS)
    if entry is not None and sha256_file(r_path) != entry.get("sha256"):
        raise InputError(str(s_path), f"does not match {REQUESTS} (sha256 differs): the two "
                                      "come from different runs or a write was interrupted")
    try:
        requests = pl.read_parquet(r_path)
    except Exception as exc:  # polars raises several kinds on a damaged file
        raise InputError(str(r_path), f"not a parquet file ({exc.__class__.__name__})") from exc
    return summary, requests


__all__ = ["MANIFEST_KEY", "read_run", "sha256_file", "write_run"]
