"""Atomic file output: write to a temporary sibling, then rename.

A crash or a validation error half-way never leaves a truncated file behind and
never clobbers a good file that was already there. Also the one file digest the
run manifests and the drafter/target caches key on.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

INTERRUPTS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP")
                   if hasattr(signal, name))


@contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold Ctrl-C, SIGTERM and SIGHUP back until the block ends, then deliver the first
    one to the handler it would have reached.

    Why: polars writes a parquet file on its own threads, and an interrupt raised in the
    calling thread does not stop them, so the file kept growing after the ``finally``
    meant to delete it had run: a half-written ``.NAME.*.tmp`` (or a ``.run-*`` folder)
    stayed beside the output. Deferred, the write finishes, is renamed into place or
    removed, and the command then stops as it would have. Costs the length of one write
    (a second or so for a million-row parquet). Only the main thread can set handlers;
    elsewhere the block runs undeferred."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: pending.append(signum))
                for sig in INTERRUPTS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if pending:
            signal.raise_signal(pending[0])


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; move it into place on success. An
    interrupt during the block is held back until the file is in place or removed
    (:func:`deferred_interrupts`)."""
    path = Path(path)
    if _special(path):
        from dspark_sim.errors import InputError

        raise InputError(str(path), "not a regular file (a device, pipe or socket): writing "
                                    "would replace it")
    with deferred_interrupts(), os_errors_name(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        tmp_path = Path(tmp)
        try:
            yield tmp_path
            # mkstemp creates 0600; give the file the mode a plain open() would have.
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp_path, 0o666 & ~umask)
            os.replace(tmp_path, path)
        finally:
            if tmp_path.exists():
                tmp_path.unlink()


# polars (Rust) reports a failed read or write as its own ComputeError, the OS's error
# number only in the text: "... underlying IO error: No space left on device (os error 28)"
# (pyarrow's OSError may carry its number only in the text too: "[Errno 28] ...")
_WRAPPED_OS_ERROR = re.compile(r"\(os error (\d+)\)|\[Errno (\d+)\]")


def as_os_error(exc: BaseException, path: str | Path | None = None) -> OSError | None:
    """The file-system error behind ``exc`` (itself when an ``OSError``, else one that a
    library wrapped in its own exception), or None when there is none. ``path``: the
    file to name when the error names none, or names a temporary sibling of ``path``
    (the user never saw ``.out.parquet.x1y2.tmp``)."""
    from dspark_sim.errors import InputError

    if isinstance(exc, InputError):  # already one line, quoting an OS error perhaps
        return None
    m = _WRAPPED_OS_ERROR.search(str(exc))
    if isinstance(exc, OSError) and (exc.errno is not None or m is None):
        err = exc
    elif m is None:
        return None
    else:
        code = int(m.group(1) or m.group(2))
        err = OSError(code, os.strerror(code), getattr(exc, "filename", None))
    if path is not None and (err.filename is None
                             or Path(str(err.filename)).name.startswith((".", "previous-"))
                             or ".run-" in str(err.filename)):
        err = type(err)(err.errno, err.strerror or str(err), str(path))
    return err


@contextmanager
def os_errors_name(path: str | Path) -> Iterator[None]:
    """A file-system error in the block (a full disk half-way through a parquet file) is
    an ``OSError`` naming ``path``, whichever library raised it and whatever temporary
    file it was writing."""
    try:
        yield
    except Exception as exc:
        err = as_os_error(exc, path)
        if err is None or err is exc:
            raise
        raise err from exc


# what to do about a file-system error, by its number; the error's own words say what
OS_ERROR_REMEDY = {
    errno.ENOSPC: "the disk is full: free space or write elsewhere",
    errno.EDQUOT: "the disk quota is used up: free space or write elsewhere",
    errno.ENAMETOOLONG: "a name in the path is longer than the file system allows: "
                        "choose a shorter one",
    errno.EACCES: "no permission: choose a folder you can write to",
    errno.EPERM: "not permitted: choose a folder you can write to",
    errno.EROFS: "a read-only file system: choose another folder",
}


def os_error_line(err: OSError) -> str:
    """One line for a file-system error: the file, what the system said, the remedy."""
    what = err.strerror or str(err)
    where = err.filename if err.filename is not None else None
    if err.filename2 is not None:
        where = f"{err.filename} -> {err.filename2}"
    remedy = OS_ERROR_REMEDY.get(err.errno)
    line = f"{what} ({remedy})" if remedy else what
    return f"{where}: {line}" if where is not None else line


def sha256_file(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MiB chunks (checkpoints are gigabytes)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_atomic(path: str | Path, writer: Callable[[Path], None]) -> Path:
    with atomic_path(path) as tmp:
        writer(tmp)
    return Path(path)


def write_text_atomic(path: str | Path, text: str) -> Path:
    return write_atomic(path, lambda p: p.write_text(text))


def write_json_atomic(path: str | Path, obj: object) -> Path:
    return write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def progress_bar(*columns: Any, **kw: Any) -> Any:
    """A rich ``Progress`` whose task descriptions print as written: a label carries user
    text (a target model's folder name, a policy spec) in which ``[...]`` is data, not
    rich markup (``[/bold]`` in a label would crash the bar with a MarkupError, ``[v2]``
    vanish). ``columns``: rich's default ones when none are given, the description
    column first; put :func:`description_column` where a custom layout shows it."""
    from rich.progress import Progress

    if not columns:
        columns = (description_column(), *Progress.get_default_columns()[1:])
    return Progress(*columns, **kw)


def description_column() -> Any:
    """The task description, markup off (rich's default column parses it as markup)."""
    from rich.progress import TextColumn

    return TextColumn("{task.description}", markup=False, style="progress.description")


def loads_json(text: str | bytes):
    """``json.loads`` for user files: a document nested too deeply for the parser is a
    ``json.JSONDecodeError`` like any other malformed JSON. (``json.loads("[" * 10**5)``
    raises RecursionError, which no reader's ``except JSONDecodeError`` caught: a
    traceback instead of the one-line error.)"""
    try:
        return json.loads(text, parse_int=_int64)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", "", 0) from None


# Every integer column and count the tool keeps is at most 64 bits. A JSON integer is
# read exactly, so each reader's field check names the field past its range (10**400 in
# an acc_len list); one of more digits than Python converts (4,300) raised ValueError,
# past every reader's ``except JSONDecodeError``: it is malformed JSON here.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_JSON_INT_DIGITS = 1000


def _int64(digits: str) -> int:
    if len(digits) - digits.startswith("-") > MAX_JSON_INT_DIGITS:
        raise json.JSONDecodeError(f"the integer {_digits(digits)} is longer than any count "
                                   "or id", "", 0)
    return int(digits)


def is_int64(v) -> bool:
    """``v`` is an integer (never a bool) that a 64-bit column holds."""
    return isinstance(v, int) and not isinstance(v, bool) and INT64_MIN <= v <= INT64_MAX


def finite_number(v) -> bool:
    """``v`` is a finite number, never a bool: a float not NaN or inf, or an integer
    within 64 bits (``math.isfinite(10**400)`` raises OverflowError, it does not say no)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return False
    return is_int64(v) if isinstance(v, int) else math.isfinite(v)


def _digits(digits: str) -> str:
    return digits if len(digits) <= 24 else f"{digits[:8]}...({len(digits)} digits)"


def _check_toml_ints(obj) -> None:
    if isinstance(obj, dict):
        for v in obj.values():
            _check_toml_ints(v)
    elif isinstance(obj, list):
        for v in obj:
            _check_toml_ints(v)
    elif isinstance(obj, int) and not isinstance(obj, bool) and not INT64_MIN <= obj <= INT64_MAX:
        import tomllib

        # TOML's own rule: an integer a 64-bit one cannot hold is an error
        raise tomllib.TOMLDecodeError(f"the integer {_digits(str(obj))} is past TOML's "
                                      "64-bit range")


def loads_bench_serve_json(text: str, where: str):
    """:func:`loads_json` of a ``vllm bench serve`` result, which holds one run: a file
    written with ``--append-result`` (one run per line) is said to be one (an
    ``InputError`` naming ``where``); any other malformed JSON is a ``JSONDecodeError``
    for the caller to word."""
    from dspark_sim.errors import InputError

    try:
        return loads_json(text)
    except json.JSONDecodeError as exc:
        if exc.msg != "Extra data":
            raise
        raise InputError(where, f"line {exc.lineno}: a second JSON document; bench serve "
                                "--append-result writes one run per line: keep one run "
                                "per file") from None


def loads_toml(text: str) -> dict:
    """``tomllib.loads`` for user files: nesting too deep for the (recursive) parser is a
    ``TOMLDecodeError`` like any other malformed TOML, never a RecursionError."""
    import tomllib

    try:
        data = tomllib.loads(text)
    except RecursionError:
        raise tomllib.TOMLDecodeError("arrays or tables nested too deeply") from None
    except ValueError as exc:  # an integer past Python's 4,300-digit conversion limit
        if isinstance(exc, tomllib.TOMLDecodeError):
            raise
        raise tomllib.TOMLDecodeError(f"an integer too long to read ({exc})") from None
    _check_toml_ints(data)
    return data


def file_or_none(spec: str) -> str | None:
    """A spec (a path or a built-in name) that names an existing file: a file an output
    must not overwrite; None for a built-in name."""
    return spec if Path(spec).is_file() else None


def not_a_file(p: Path, what: str) -> str:
    """Why ``p`` (not ``p.is_file()``) cannot be read as a ``what``: a missing path is
    told apart from a folder or a device given by mistake ("not found" misled there)."""
    if p.is_dir():
        return f"is a folder, not a {what}"
    if p.exists():
        return f"is not a regular file (a {what} must be one)"
    return f"{what} not found"


def read_toml(path: str | Path, what: str = "file") -> dict:
    """Parse a TOML file; a missing, unreadable or malformed file is an ``InputError``
    naming it (one line), never a traceback."""
    import tomllib

    from dspark_sim.errors import InputError

    p = Path(path)
    if not p.is_file():
        raise InputError(str(p), not_a_file(p, what))
    try:
        return loads_toml(p.read_text(encoding="utf-8-sig"))  # a BOM is not TOML
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InputError(str(p), f"invalid TOML: {exc}") from exc


def check_unique_columns(names, where: str) -> None:
    """Refuse a table with one column name twice: a parquet file may hold that (pyarrow
    writes it; polars then fails with its own traceback), and a CSV reader renames the
    second ``x`` to ``x_duplicated_0``, so which of the two is read is chance."""
    from dspark_sim.errors import InputError

    seen: dict[str, int] = {}
    for i, name in enumerate(names, 1):
        if name in seen:
            raise InputError(where, f"column {name!r} appears twice (columns {seen[name]} and "
                                    f"{i}): which one is meant? rename or drop one")
        seen[name] = i


def read_csv_strings(p: str | Path, where: str, separator: str = ","):
    """A CSV (or TSV) read as all strings by polars, its header first checked for a name
    given twice (after the spaces a spreadsheet leaves are stripped); the readers parse
    the values themselves."""
    import csv

    import polars as pl

    try:
        with open(p, encoding="utf-8-sig", newline="") as fh:
            header = next(csv.reader(fh, delimiter=separator), [])
    except (csv.Error, UnicodeDecodeError):
        header = []  # not text the csv module reads: polars's parse reports it
    check_unique_columns([name.strip() for name in header], where)
    return pl.read_csv(p, infer_schema_length=0, separator=separator)


def tidy_csv(df):
    """A CSV read by polars as all strings, as a spreadsheet or a ``", "`` writer leaves
    it: header names stripped of spaces, blank lines (rows with every field empty)
    dropped."""
    return tidy_csv_lines(df)[0]


def tidy_csv_lines(df):
    """:func:`tidy_csv`'s frame and the file's line number of each row it keeps (the
    header is line 1), so errors name the right line. The numbers are a list beside the
    frame, not a column in it: any name a helper column took could be one of the user's."""
    import numpy as np
    import polars as pl

    df = df.rename({c: c.strip() for c in df.columns})
    keep = df.select(~pl.all_horizontal(pl.all().is_null())).to_series().to_numpy()
    return df.filter(keep), (np.flatnonzero(keep) + 2).tolist()


def jsonable(d):
    """``d`` with numpy scalars turned into Python numbers and non-finite floats into None
    (what ``json.dumps`` can write and any reader can parse)."""
    import numpy as np

    if isinstance(d, dict):
        return {k: jsonable(v) for k, v in d.items()}
    if isinstance(d, list | tuple):
        return [jsonable(v) for v in d]
    if isinstance(d, np.generic):
        return d.item()
    if isinstance(d, float) and not np.isfinite(d):
        return None
    return d


# A write is a rename onto the path, which would replace a device node itself: --out
# /dev/full (or /dev/null, as root) became a regular file holding the output.
SPECIAL_FILE = ("{} is not a regular file (a device, pipe or socket): writing the output "
                "would replace it; give a file path")


def _special(p: Path) -> bool:
    """``p`` exists and is neither a regular file nor a folder (symlinks followed)."""
    try:
        return p.exists() and not (p.is_file() or p.is_dir())
    except OSError:
        return False


def _same_file(a: Path, b: Path) -> bool:
    """``a`` and ``b`` name one file: the same path once resolved (symlinks followed, so a
    file not written yet compares too), or one inode (a hard link)."""
    if a.resolve() == b.resolve():
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _check_not_over(p: Path, option: str, kind: str, not_over: dict, inside: dict) -> None:
    """Refuse an output that is one of ``not_over``'s files: ``p`` itself, or for a folder
    a file of ``inside`` in it; and an input lying in a folder of ``inside`` (a sweep's
    ``points/``), which the command owns: it writes there and reads back every file."""
    from dspark_sim.errors import InputError

    files, dirs = [p], []
    if kind == "dir":
        files += [p / name for name, k in inside.items() if k == "file"]
        dirs = [p / name for name, k in inside.items() if k == "dir"]
    noun = "file" if kind == "file" else "folder"
    for what, other in not_over.items():
        if other is None:
            continue
        for q in files:
            if _same_file(q, Path(other)):
                raise InputError(option, f"{q} is also {what}: writing it would destroy "
                                         f"that; choose another {noun}")
        for d in dirs:
            if d.resolve() in Path(other).resolve().parents:
                raise InputError(option, f"{other} is {what} but lies in {d}, which this "
                                         f"writes: move it or choose another {noun}")


def check_writable(path: str | Path, option: str, *, kind: str = "dir",
                   not_over: dict[str, str | Path | None] | None = None,
                   inside: dict[str, str] | None = None) -> Path:
    """Fail fast, before any expensive work, when ``path`` cannot receive output.

    ``kind="dir"``: a folder (created later if missing); ``kind="file"``: a file written
    atomically beside its siblings. Probes the nearest existing folder with a temporary
    file (permission bits say nothing to root, and /proc or a read-only mount only show
    themselves on a real write); creates nothing that stays. ``not_over`` (what -> path;
    None entries skipped): files the command reads or also writes; an output that is one
    of them is refused, since writing it would destroy the input (``traces export T --out
    T`` once replaced the trace with its JSON) or the other output; for a folder, each
    file of ``inside`` is such an output (``run --trace D/requests.parquet --out D``).
    ``inside`` (``kind="dir"``; name -> "file" or "dir"): what the command writes in the
    folder; an entry already there of the other kind is refused now (a folder named
    ``results.parquet`` failed the rename only after every sweep point had run).
    """
    from dspark_sim.errors import InputError

    p = Path(path)
    # first: a name past the file system's limit makes even p.exists() raise
    for q, sibling in [(p, kind == "file"), *((p / n, True) for n in (inside or {}))]:
        if (why := path_too_long(q, sibling=sibling)) is not None:
            raise InputError(option, why)
    _check_not_over(p, option, kind, not_over or {}, inside or {})
    if kind == "dir" and p.exists() and not p.is_dir():
        raise InputError(option, f"{p} exists and is not a folder")
    if kind == "file" and p.is_dir():
        raise InputError(option, f"{p} is a folder, not a file")
    if kind == "file" and _special(p):
        raise InputError(option, SPECIAL_FILE.format(p))
    for name, entry_kind in (inside or {}).items():
        q = p / name
        if entry_kind == "file" and q.is_dir():
            raise InputError(option, f"{q} is a folder, so the {name} this writes cannot "
                                     "replace it")
        if entry_kind == "file" and _special(q):
            raise InputError(option, SPECIAL_FILE.format(q))
        if entry_kind == "dir" and q.exists() and not q.is_dir():
            raise InputError(option, f"{q} exists and is not a folder, so the {name}/ this "
                                     "writes cannot be created")
    probe = p if kind == "dir" else p.parent
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise InputError(option, f"{probe} is not a folder, so {p} cannot be created")
    _probe(probe, option)
    # a sub-folder the command writes into that exists already is written only after the
    # work (a sweep's points/ after its first point): probe it now as well
    for name, entry_kind in (inside or {}).items():
        if entry_kind == "dir" and (p / name).is_dir():
            _probe(p / name, option)
    return p


def _probe(folder: Path, option: str) -> None:
    """Refuse ``folder`` unless a file can be created in it (and is removed again)."""
    from dspark_sim.errors import InputError

    try:
        fd, tmp = tempfile.mkstemp(prefix=".dspark-probe.", dir=folder)
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        raise InputError(option, f"cannot write under {folder}: {exc.strerror or exc}") from None


# an atomic write first creates ".NAME." + 8 random characters + ".tmp" beside NAME
ATOMIC_SIBLING_BYTES = len("..") + 8 + len(".tmp")


def _limit(folder: str, name: str, default: int) -> int:
    try:
        return os.pathconf(folder, name)
    except (OSError, ValueError):
        return default


def path_too_long(path: str | Path, *, sibling: bool = False) -> str | None:
    """Why the file system would refuse ``path`` as too long (ENAMETOOLONG), or None: a
    name (component) past the folder's NAME_MAX bytes (255 on ext4), or the whole path
    past PATH_MAX. ``sibling``: the file is written atomically, so its name must leave
    room for the temporary sibling's. Checked on the string alone, before any call
    that would raise on such a name (``Path.exists`` does)."""
    p = Path(path)
    anchor = os.path.abspath(p)
    while not os.path.isdir(anchor) and os.path.dirname(anchor) != anchor:
        anchor = os.path.dirname(anchor)
    name_max = _limit(anchor, "PC_NAME_MAX", 255)
    path_max = _limit(anchor, "PC_PATH_MAX", 4096)
    for i, part in enumerate(p.parts):
        size = len(os.fsencode(part))
        extra = ATOMIC_SIBLING_BYTES if sibling and i == len(p.parts) - 1 else 0
        if size > name_max:
            return (f"the name {_short(part)} is {size} bytes long, past the {name_max} "
                    "a name may have on this file system: choose a shorter one")
        if size + extra > name_max:
            return (f"the name {_short(part)} is {size} bytes long; written atomically, it "
                    f"is first created as .{_short(part)}.XXXXXXXX.tmp, {size + extra} "
                    f"bytes, past the {name_max} a name may have on this file system: "
                    f"choose a name of at most {name_max - extra} bytes")
    size = len(os.fsencode(os.path.abspath(p))) + (ATOMIC_SIBLING_BYTES if sibling else 0)
    if size >= path_max:
        return (f"the path {_short(str(p))} is {size} bytes long, past the {path_max} a "
                "path may have on this file system: choose a shorter one")
    return None


def _short(text: str) -> str:
    return text if len(text) <= 60 else f"{text[:40]}...{text[-12:]}"


class LazyModule:
    """A module imported when one of its names is first read (``pl = LazyModule("polars")``).

    polars and pyarrow cost a process ~0.3 s to import, and a run that reads its trace from
    the array cache and writes no files never calls them; a module-level ``import`` would
    charge every process that imports the module. Every read goes to the module itself
    (not a copy of its names), so what patches the module patches what is read here."""

    def __init__(self, name: str):
        self._lazy_name = name
        self._module = None

    def __getattr__(self, attr: str):
        if attr.startswith("__"):  # copy/pickle probes: not the module's names
            raise AttributeError(attr)
        module = self._module
        if module is None:
            import importlib

            module = self._module = importlib.import_module(self._lazy_name)
        return getattr(module, attr)
