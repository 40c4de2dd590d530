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
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from dspark_sim.errors import InputError
from dspark_sim.io import (
    LazyModule,
    deferred_interrupts,
    loads_json,
    os_errors_name,
    sha256_file,
)

pl = LazyModule("polars")  # imported when a frame is built: a run writing no files needs none

SUMMARY = "summary.json"
REQUESTS = "requests.parquet"
MANIFEST_KEY = "outputs"


def write_run(out: str | Path, summary: dict,
              requests: pl.DataFrame | pl.LazyFrame | Callable[[Path], object], *,
              extra: dict[str, pl.DataFrame] | None = None) -> Path:
    """Write ``summary.json`` (with the manifest) and ``requests.parquet`` into ``out``
    as one unit (module docstring); ``extra`` adds more tables to the same unit (file
    name -> frame, e.g. a real server's ``steps.parquet``), each in the manifest and
    committed, or rolled back, with the pair. A lazy frame (a streamed run's parts) is
    sunk to its file in batches, never loaded whole; a function writes the table to the
    path it is given (a streamed run's, sunk ahead). Returns ``out``."""
    tables = {REQUESTS: requests, **(extra or {})}
    return write_unit(out, SUMMARY, summary,
                      {name: _writer(frame) for name, frame in tables.items()})


def _writer(frame) -> Callable[[Path], object]:
    if isinstance(frame, pl.LazyFrame):
        return frame.sink_parquet
    return frame.write_parquet if isinstance(frame, pl.DataFrame) else frame


def write_unit(out: str | Path, index: str, obj: dict,
               files: dict[str, Callable[[Path], object]]) -> Path:
    """The general form of :func:`write_run`: each ``files[name](path)`` writes one
    file, then the JSON ``index`` file (``obj`` plus the manifest of the others) is
    committed last; a failure before the commit restores every file it replaced."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with deferred_interrupts():  # an interrupt waits for the commit or the rollback
        return _write_unit(out, index, obj, files)


def _write_unit(out: Path, index: str, obj: dict,
                files: dict[str, Callable[[Path], object]]) -> Path:
    stage = Path(tempfile.mkdtemp(prefix=".run-", dir=out))
    umask = os.umask(0)
    os.umask(umask)
    placed: list[tuple[str, bool]] = []  # (name, had a previous file) renamed into place
    try:
        manifest = {}
        for name, write in files.items():
            with os_errors_name(out / name):  # not the staging folder the user never saw
                write(stage / name)
            manifest[name] = {"sha256": sha256_file(stage / name),
                              "bytes": (stage / name).stat().st_size}
        (stage / index).write_text(json.dumps({**obj, MANIFEST_KEY: manifest}, indent=2,
                                              sort_keys=True) + "\n")
        for name in [*files, index]:  # the mode a plain open() gives (mkdtemp is 0700)
            os.chmod(stage / name, 0o666 & ~umask)
        try:
            for name in files:
                had_prev = (out / name).is_file()
                if had_prev:
                    _keep_previous(out / name, stage / f"previous-{name}")
                os.replace(stage / name, out / name)
                placed.append((name, had_prev))
            os.replace(stage / index, out / index)  # the commit point
        except BaseException:
            for name, had_prev in reversed(placed):
                if had_prev:
                    os.replace(stage / f"previous-{name}", out / name)
                else:
                    with contextlib.suppress(OSError):
                        (out / name).unlink()
            raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return out


def _keep_previous(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # no hard links here (some network / FAT file systems)
        shutil.copy2(src, dst)


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
        summary = loads_json(s_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(str(s_path), f"not a JSON file ({exc})") from exc
    if not isinstance(summary, dict):
        raise InputError(str(s_path), "not a run summary")
    manifest = summary.get(MANIFEST_KEY) or {}
    for name, entry in manifest.items():  # requests.parquet, and any extra table
        path = out / name
        if not path.is_file():
            raise InputError(str(path), f"not found, but {SUMMARY}'s manifest lists it")
        if sha256_file(path) != (entry or {}).get("sha256"):
            raise InputError(str(s_path), f"does not match {name} (sha256 differs): the two "
                                          "come from different runs or a write was interrupted")
    try:
        requests = pl.read_parquet(r_path)
    except Exception as exc:  # polars raises several kinds on a damaged file
        raise InputError(str(r_path), f"not a parquet file ({exc.__class__.__name__})") from exc
    return summary, requests


__all__ = ["MANIFEST_KEY", "read_run", "sha256_file", "write_run", "write_unit"]
