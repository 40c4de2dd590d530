"""Parameter sweeps: a grid of loads x policies x profiles x traces x prefix-cache
settings x seeds.

Every grid point is one :func:`dspark_sim.sim.api.simulate` run, independent of the
others and deterministic given its seed, so points run in parallel (processes by
default, Ray tasks with ``executor="ray"``) and in any order.

On disk (``out/``)::

    points/<point_id>.parquet   one row per finished point, written atomically with
                                the SHA-256 of its data (a damaged part is recomputed)
    results.parquet             all points combined (rewritten at the end of a run)

``point_id`` is a stable hash of the point's full :class:`SimConfig`, the contents of
every file it reads (profile, traces, calibration map, workload) and the package and
row-format versions, so a killed sweep resumes without redoing finished points, a
point shared by two sweeps into the same folder is computed once, and an edited input
file makes new points. Delete ``points/`` (or the folder) after changing the simulator.

Each row holds every scalar summary metric under its vLLM ``bench serve`` name,
the list-valued ones (``acceptance_per_position``, ``verified_per_position``) as
list columns, where the policy's confidences came from and whether the measured drafter
can run it in the engine (``confidences``, ``engine_can_run``, ``engine_note``: the report
labels a policy it cannot run), and the point's parameters: ``point_id``, ``policy_spec``,
``profile_spec``, ``trace_spec``, ``prefix_cache_spec`` (the swept ``on`` | ``off``,
null where the sweep left the cache to the workload's default), ``seed``, ``load_kind`` (``qps`` | ``concurrency``
| ``base``), ``load`` (the number swept), ``qps``, ``concurrency``, ``arrival``,
``num_requests_cfg``; ``mean_concurrency`` (Little's law: request throughput x
mean E2E latency), ``steady_mean_concurrency`` (the time-averaged requests in the
system over the steady window), ``size_doublings`` (see below) and ``wall_s`` (run time
of the point, seconds; the one column that differs between two runs of the same point).

**Sizing** (:class:`Sizing`): steady-state figures need a steady window spanning many
request lifetimes (``dspark_sim.sim.metrics``). ``requests_per_client = K`` runs each
closed-loop point with ``max(num_requests, K x clients)`` requests (warm-up and drain
each cost about one request per client, the window needs many more);
``max_doublings = D`` reruns a point with twice the requests (and twice the duration)
while its steady window is flagged short or, with ``target_rse = r``, while the relative
standard error of its steady throughput or median interactivity (batch means,
``dspark_sim.sim.metrics``) exceeds ``r``; at most ``D`` times and up to
``max_requests``. ``benchmarks/steady_sizing.py`` checks the rule: doubling the request
count moves no headline figure by more than 2 %.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import numbers
import os
import re
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq

from dspark_sim import __version__
from dspark_sim.calibration.profile import load_profile
from dspark_sim.errors import InputError, check_positive_int
from dspark_sim.io import atomic_path, check_writable, file_or_none, sha256_file
from dspark_sim.policies.registry import get_policy
from dspark_sim.sim.config import (
    SETTINGS,
    SimConfig,
    blame_config,
    check_draft_length,
    files_read,
    input_files,
)

ROW_FORMAT = 3  # 2: steady-state columns, sizing; 3: the request sample goodput reads
EXECUTORS = ("process", "ray", "serial")
# What a sweep writes in its --out folder (name -> "file" or "dir"): checked before any
# point runs, so an entry of the other kind in the way is refused up front
SWEEP_OUTPUTS = {"points": "dir", "results.parquet": "file", "report.html": "file"}
LIST_METRICS = ("acceptance_per_position", "verified_per_position")
# Each point keeps its finished requests' latencies and lengths (at most SAMPLE_MAX, evenly
# spread by arrival), so goodput under any SLO is counted when the report is written: an
# SLO judges a run's requests and changes nothing the run does, so a new SLO reruns no
# point. 5,000 requests put a goodput fraction's binomial error under 0.7 points.
SAMPLE_COLUMNS = {"sample_arrival_s": "arrival_s", "sample_ttft_ms": "ttft_ms",
                  "sample_tpot_ms": "tpot_ms", "sample_output_tokens": "generated_tokens"}
SAMPLE_MAX = 5_000
# the summary's goodput was judged under the point's own SLO, which its id leaves out
ROW_DROPPED = ("goodput", "slo_ttft_ms", "slo_tpot_ms")
# A grid option expands to at most this many values, and a grid to at most this many
# points: a typo like 1:1000000:1 is refused in microseconds instead of building (and
# then simulating) a million points. 100k points is already weeks of simulation.
MAX_VALUES_PER_OPTION = 10_000
MAX_POINTS = 100_000
MAX_INTEGER_VALUE = 2**63 - 1  # seeds and client counts are int64 downstream
# confidences and engine_note are None for some policies and text for others: typed as
# text in every point, so the points stack whatever mix of policies a sweep holds
STRING_COLUMNS = ("policy_spec", "profile_spec", "trace_spec", "prefix_cache_spec", "load_kind",
                  "arrival", "trace",
                  "trace_drafter", "trace_source", "point_id", "policy", "profile",
                  "steady_window_rule", "steady_window_note", "confidences", "engine_note")
INT_COLUMNS = ("seed", "concurrency", "num_requests_cfg", "trace_gamma_max", "size_doublings")
PARAM_COLUMNS = ("point_id", "policy_spec", "profile_spec", "trace_spec", "prefix_cache_spec",
                 "seed", "load_kind", "load", "qps", "concurrency", "arrival",
                 "num_requests_cfg")


# -- option parsing -------------------------------------------------------------
def parse_numbers(spec: str | Sequence[float] | None, *, integer: bool = False,
                  option: str = "--qps", allow_zero: bool = False
                  ) -> list[float] | list[int] | None:
    """Parse ``"10:400:20"`` (start:stop:step, stop inclusive when it lands),
    ``"1:256:x2"`` (geometric: multiply by 2), ``"1,2,4,8"`` or a mix
    (``"1,2,4:64:x2,100"``). Order is kept, duplicates dropped. Values must be > 0
    (``allow_zero``: >= 0, e.g. seeds). ``None`` (the option not given) -> None; given
    but empty (``""``, ``","``) is an :class:`InputError` naming ``option``, never
    read as "not given" (``sweep --seeds ''`` would silently sweep the default seed).
    """
    if spec is None:
        return None
    if not isinstance(spec, str):
        items = [str(v) for v in spec]
    else:
        items = [s for s in spec.replace(" ", "").split(",") if s]
    out: list[float] = []
    for item in items:
        out.extend(_parse_item(item, option, integer))
        if len(out) > MAX_VALUES_PER_OPTION:
            raise InputError(option, f"{spec!r} expands to more than "
                                     f"{MAX_VALUES_PER_OPTION:,} values")
    if not out:
        raise InputError(option, f"name at least one value, got {spec!r}")
    if any(not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero) for v in out):
        kind = "non-negative" if allow_zero else "positive"
        raise InputError(option, f"values must be {kind} numbers, got {spec!r}")
    if integer:
        if any(abs(v - round(v)) > 1e-9 for v in out):
            raise InputError(option, f"values must be integers, got {spec!r}")
        if any(v > MAX_INTEGER_VALUE for v in out):
            raise InputError(option, f"values must be below 2**63, got {spec!r}")
        return list(dict.fromkeys(int(round(v)) for v in out))
    tiny = [v for v in out if v > 0 and round(v, 9) == 0]
    if tiny:  # else read as 0 and refused as 'got [0.0]', a value the user never typed
        raise InputError(option, f"{tiny[0]:g} rounds to 0: values keep 9 decimals, got "
                                 f"{spec!r}")
    return list(dict.fromkeys(round(v, 9) for v in out))


def _parse_item(item: str, option: str, integer: bool = False) -> list[float]:
    """One comma-separated item's values. ``integer``: numbers written as integers are
    read as Python ints, exactly (a float would read seed 2**53 + 1 as 2**53, another
    seed), and a range of them steps in integer arithmetic."""
    parts = item.split(":")
    num = functools.partial(_exact_number, option=option) if integer else float
    try:
        if not item.isascii():  # float() reads Arabic-Indic or full-width digits too
            raise ValueError
        if len(parts) == 1:
            return [num(parts[0])]
        if len(parts) != 3:
            raise ValueError
        start, stop = num(parts[0]), num(parts[1])
        step = parts[2]
        geometric = step[:1] in ("x", "*")
        f = num(step[1:] if geometric else step)
    except InputError:  # a ValueError too: _exact_number's own words stand
        raise
    except ValueError:
        raise InputError(option, f"bad value {item!r}: use N, START:STOP:STEP or "
                                 "START:STOP:xFACTOR") from None
    if not all(math.isfinite(v) for v in (start, stop, f)):
        raise InputError(option, f"bad range {item!r}: start, stop and step must be finite")
    if stop < start:
        raise InputError(option, f"bad range {item!r}: stop < start")
    if geometric:
        if f <= 1 or start <= 0:
            raise InputError(option, f"bad range {item!r}: geometric ranges need "
                                     "start > 0 and factor > 1")
        _check_count(item, option, math.log(stop / start) / math.log(f))
        vals, v = [], start
        while v <= (stop if isinstance(v, int) else stop * (1 + 1e-9)):
            vals.append(v)
            v *= f
        return vals
    if f <= 0:
        raise InputError(option, f"bad range {item!r}: step must be > 0")
    _check_count(item, option, (stop - start) / f)
    n = int(math.floor((stop - start) / f + 1e-9))
    return [start + i * f for i in range(n + 1)]


def _exact_number(text: str, option: str) -> int | float:
    """``text`` as an int when it is written as one (``"7"``, ``"1e3"``, ``"4.0"``); a
    float otherwise, for the caller's "must be integers". A decimal point or exponent
    at or above 2**53 has already lost digits in the float: refused, not rounded."""
    try:
        n = int(text)
    except ValueError:
        v = float(text)
    else:  # past int64 now, before float arithmetic on it overflows
        if abs(n) > MAX_INTEGER_VALUE:
            raise InputError(option, f"values must be below 2**63, got {text!r}")
        return n
    if not math.isfinite(v) or v != math.floor(v):
        return v
    if abs(v) > MAX_INTEGER_VALUE:
        raise InputError(option, f"values must be below 2**63, got {text!r}")
    if abs(v) >= 2**53:
        raise InputError(option, f"{text!r} is at or past 2**53, where a decimal point or an "
                                 "exponent loses digits: write the integer in digits")
    return int(v)


def _check_count(item: str, option: str, steps: float) -> None:
    """Refuse a range of more than MAX_VALUES_PER_OPTION values before building it."""
    if not steps + 1 <= MAX_VALUES_PER_OPTION:  # also catches a NaN / inf step count
        raise InputError(option, f"range {item!r} expands to more than "
                                 f"{MAX_VALUES_PER_OPTION:,} values")


# policies whose one argument is a scalar: a bare number after one is another of them
SCALAR_ARG = re.compile(r"^(?P<name>fixed|threshold|skip):[^,@]*$", re.I)


def parse_list(spec: str | Sequence[str] | None, *, option: str = "--policies",
               what: str = "policy") -> list[str] | None:
    """``"mtp1,confidence-async"`` -> list, duplicates dropped. ``None`` (the option not
    given) -> None; given but empty (``""``, ``" , "``, ``[]``) is an :class:`InputError`
    naming ``option`` ("name at least one ``what``"), never read as "not given"
    (``sweep --profiles ''`` would silently sweep the default profile). A bare number right
    after an item with arguments continues it: ``"asd:0.5,1,8,mtp1"`` -> ``["asd:0.5,1,8",
    "mtp1"]`` (policies whose argument is a comma-separated tuple), except after a
    one-scalar policy, where it is another of the same: ``"fixed:3,5,7"`` -> ``["fixed:3",
    "fixed:5", "fixed:7"]``."""
    if spec is None:
        return None
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[str] = []
    for s in (s.strip() for s in items if s and s.strip()):
        if isinstance(spec, str) and out and ":" in out[-1] and _is_number(s):
            scalar = SCALAR_ARG.match(out[-1])
            if scalar:
                out.append(f"{scalar['name']}:{s}")
            else:
                out[-1] += f",{s}"
        else:
            out.append(s)
    if not out:
        raise InputError(option, f"name at least one {what}, got {spec!r}")
    return list(dict.fromkeys(out))


def _is_number(s: str) -> bool:
    try:
        float(s.partition("@")[0])  # asd:g,m,B@BASE: the base rides on the last number
    except ValueError:
        return False
    return True


# -- points ---------------------------------------------------------------------
@dataclass(frozen=True)
class Sizing:
    """How many requests each point runs (module docstring). The default changes
    nothing: every point runs the base's ``num_requests`` / ``duration_s``."""

    requests_per_client: int = 0  # closed loop: at least this many requests per client
    max_doublings: int = 0  # rerun with 2x requests while the steady window is short ...
    target_rse: float = 0.0  # ... or a front figure's relative standard error exceeds this
    max_requests: int = 1_000_000  # never size a point beyond this

    def validate(self) -> Sizing:
        for name in ("requests_per_client", "max_doublings"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise InputError(f"--{name.replace('_', '-')}",
                                 f"must be a non-negative integer, got {v!r}")
        if not isinstance(self.target_rse, int | float) or not 0 <= self.target_rse < 1:
            raise InputError("--target-rse", f"must be a fraction in [0, 1), got "
                                             f"{self.target_rse!r}")
        if not isinstance(self.max_requests, int) or self.max_requests < 1:
            raise InputError("--max-requests", f"must be a positive integer, got "
                                               f"{self.max_requests!r}")
        return self

    @property
    def active(self) -> bool:
        return self != Sizing()


@dataclass(frozen=True)
class SweepPoint:
    config: SimConfig
    policy_spec: str
    profile_spec: str
    trace_spec: str | None
    load_kind: str  # "qps" | "concurrency" | "base"
    load: float
    sizing: Sizing = Sizing()
    prefix_cache_spec: str | None = None  # the swept setting; None: not a grid dimension

    @property
    def point_id(self) -> str:
        return point_hash(self.config, self.sizing)

    def params(self) -> dict:
        w = self.config.workload
        return {
            "point_id": self.point_id,
            "policy_spec": self.policy_spec,
            "profile_spec": self.profile_spec,
            "trace_spec": self.trace_spec,
            "prefix_cache_spec": self.prefix_cache_spec,
            "seed": self.config.seed,
            "load_kind": self.load_kind,
            "load": float(self.load),
            "qps": float(w.qps) if w.arrival != "closed" else None,
            "concurrency": int(w.max_concurrency) if w.arrival == "closed" else None,
            "arrival": w.arrival,
            "num_requests_cfg": w.num_requests,
        }


def input_digests(cfg: SimConfig) -> dict[str, str]:
    """SHA-256 of each file ``cfg`` reads (:func:`~dspark_sim.sim.config.input_files`),
    by option. A point depends on a file's bytes, not its path: an edited profile, trace,
    calibration map or workload file makes a new point. A built-in name is no file and
    stays out (its bytes ship with the package version)."""
    return {option: _file_digest(p) for option, p in input_files(cfg).items()}


_DIGESTS: dict[tuple, str] = {}


# A file modified this recently is hashed every time: an edit within one tick of the
# file system's clock keeps the size and mtime it had (git's "racy" files).
RACY_NS = 2_000_000_000


def _file_digest(p: Path) -> str:
    """:func:`sha256_file`, once per file version (path, inode, size, mtime): every
    point of a grid shares the same few files, some of them gigabytes."""
    try:
        st = p.stat()
        key = (str(p.resolve()), st.st_ino, st.st_size, st.st_mtime_ns)
        if key in _DIGESTS:
            return _DIGESTS[key]
        digest = sha256_file(p)
    except OSError as exc:
        raise InputError(str(p), f"cannot read ({exc.strerror or exc})") from None
    if time.time_ns() - st.st_mtime_ns > RACY_NS:
        _DIGESTS[key] = digest
    return digest


def point_hash(cfg: SimConfig, sizing: Sizing | None = None) -> str:
    """Stable 16-hex-digit id of a configuration, the contents of the files it reads
    (:func:`input_digests`) and its sizing (independent of dict order and process)."""
    config = asdict(cfg)
    for name in ROW_DROPPED[1:]:  # the SLOs judge the requests after the run (SAMPLE_MAX)
        config.pop(name, None)
    payload = {"row_format": ROW_FORMAT, "version": __version__, "config": config}
    digests = input_digests(cfg)
    if digests:  # none for built-ins only: their ids stay what they were
        payload["inputs"] = digests
    if sizing is not None and sizing.max_doublings:  # the count a point ends at depends on it
        payload["sizing"] = asdict(sizing)
    text = json.dumps(payload, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# a point's config names run's options; for a grid axis the sweep's user typed its own
SWEEP_OPTION = {s.option: s.swept for s in SETTINGS.values() if s.swept}


def as_sweep_error(exc: InputError) -> InputError:
    """``exc`` re-addressed to the sweep option the user typed (a point's check names
    run's singular option)."""
    return exc.readdressed(SWEEP_OPTION)


def check_sweep_out(out: Path, base: SimConfig, config: Path | None,
                    profiles: list[str] | None, traces: list[str] | None,
                    vllm_results: Path | None = None) -> None:
    """``out`` can take the sweep's outputs, none of which may land on a file it reads:
    the base config's, ``config`` (``--config``), a ``--profiles`` or ``--traces`` file,
    or the ``--vllm-results`` file or folder (the report reads its JSON files; the
    sweep's ``points/`` is the sweep's own, so those may not lie in it)."""
    reads = files_read(base, {"--config": config})
    for option, specs in (("--profiles", profiles), ("--traces", traces)):
        reads.update({f"the {option} file {s}": file_or_none(s) for s in specs or ()})
    if vllm_results is not None:
        reads["the --vllm-results input"] = vllm_results
        points = (out / "points").resolve()
        if vllm_results.is_dir() and points == vllm_results.resolve():
            raise InputError("--out", f"{vllm_results} is the --vllm-results folder but is "
                             f"also {out}'s points/, which the sweep writes: move the result "
                             "files or choose another folder")
    check_writable(out, "--out", inside=SWEEP_OUTPUTS, not_over=reads)


def check_grid(base: SimConfig, policies: list[str], profiles: list[str] | None,
               traces: list[str] | None, layers: list) -> None:
    """Every policy, profile and trace of a sweep's grid, before any point runs (a bad name
    found by a worker would surface only after other points ran); ``fixed:K`` must fit
    each trace's ``gamma_max``. Errors name the sweep's options, or where the config
    file gave the value (``layers``: the base config's) when no sweep option replaced it
    (a [run] trace with no --traces)."""
    try:
        _check_grid_names(base, policies, profiles, traces)
    except InputError as exc:
        if not {"--policy": policies, "--profile": profiles, "--trace": traces}.get(exc.where):
            with blame_config(layers):
                raise exc from None
        raise as_sweep_error(exc) from None


def _check_grid_names(base: SimConfig, policies: list[str], profiles: list[str] | None,
                      traces: list[str] | None) -> None:
    import numpy as np

    from dspark_sim.sim.api import check_inputs_read, resolve_trace
    from dspark_sim.sim.workload import sample_lengths, uses_trace_lengths

    for spec in profiles or ():
        load_profile(spec)
    lengths = base.workload.lengths
    if lengths is not None and not uses_trace_lengths(base.workload):
        sample_lengths(lengths, 1, np.random.default_rng(0))  # names a bad spec
    pols = [get_policy(p) for p in policies]
    for spec in traces or [None]:
        cfg = base if spec is None else replace(base, trace=spec)
        check_inputs_read(cfg, pols, policy_option="--policies")
        for pol in pols:
            check_draft_length(pol, resolve_trace(cfg, pol))


def _validate_point(cfg: SimConfig) -> None:
    try:
        cfg.validate()
    except InputError as exc:
        raise as_sweep_error(exc) from None


def _grid_numbers(values, option: str, *, integer: bool = False,
                  allow_zero: bool = False) -> list | None:
    """A grid axis given from Python: a string is the option's text (``"1:256:x2"``), a
    number one value, a sequence its values, each checked as the CLI checks them
    (:func:`parse_numbers`). ``int()`` made concurrency 2.7 two clients and seed True
    seed 1, silently; 'abc', None, NaN were ValueError/TypeError/OverflowError
    tracebacks. None or an empty sequence: not given."""
    if values is None:
        return None
    if isinstance(values, numbers.Real) and not isinstance(values, bool):
        values = [values]
    if not isinstance(values, str):
        try:
            values = list(values)
        except TypeError:
            raise InputError(option, f"must be a list of numbers, got {values!r}") from None
        if not values:
            return None
        bad = [v for v in values if isinstance(v, bool)]
        if bad:
            raise InputError(option, f"values must be numbers, got {bad[0]!r}")
    return parse_numbers(values, integer=integer, option=option, allow_zero=allow_zero)


def _grid_names(values, option: str, what: str, *, allow_none: bool = False) -> list | None:
    """A grid axis of names from Python: a string is a comma list (as the option's text;
    iterated, 'v4flash-h200' swept a profile per character), a sequence's items must be
    strings (``None`` too where it means the base's). None or empty: not given."""
    if values is None:
        return None
    if isinstance(values, str):
        return parse_list(values, option=option, what=what)
    try:
        values = list(values)
    except TypeError:
        raise InputError(option, f"must be a list of {what} names, got {values!r}") from None
    bad = [v for v in values if not (isinstance(v, str) or (allow_none and v is None))]
    if bad:
        raise InputError(option, f"{what} names must be strings, got {bad[0]!r}")
    return values or None


def _check_reuse(w) -> None:
    """Prefix caching on needs a workload that carries reuse: sessions, or a file with
    hash_ids. Checked before the sweep, from the file's first record, not when the first
    point runs (an hour into a sweep); --lengths replaces the file's prompts, and their
    reuse."""
    if w.session_turns:
        return
    if not w.workload_path:
        raise InputError("--prefix-cache", "on needs a workload that carries reuse (a "
                         "Mooncake file with hash_ids, or --session-turns)")
    from dspark_sim.sim.workload import says_reuse

    if w.lengths is not None or says_reuse(w.workload_path) is False:
        why = "--lengths replaces its prompts" if w.lengths is not None \
            else "its records carry no hash_ids"
        raise InputError("--prefix-cache", f"on needs a workload that carries reuse: "
                         f"{w.workload_path}: {why}")


def build_points(base: SimConfig, *, qps: Sequence[float] | None = None,
                 concurrency: Sequence[int] | None = None, policies: Sequence[str],
                 profiles: Sequence[str] | None = None,
                 traces: Sequence[str | None] | None = None,
                 seeds: Sequence[int] | None = None,
                 sizing: Sizing | None = None,
                 prefix_cache: Sequence[str] | None = None) -> list[SweepPoint]:
    """Expand the grid (validated up front, so a bad option fails before any work).
    ``sizing.requests_per_client`` raises each closed-loop point's request count.
    ``prefix_cache`` (``["on", "off"]``): each point runs with each setting (the
    ranking with caching on and off); None: the base's setting, not a dimension."""
    sizing = (sizing or Sizing()).validate()
    policies = _grid_names(policies, "--policies", "policy")
    if not policies:
        raise InputError("--policies", "give at least one policy")
    given_profiles = _grid_names(profiles, "--profiles", "profile")
    profiles = given_profiles or [base.deployment.profile]
    traces = _grid_names(traces, "--traces", "trace", allow_none=True) or [None]
    seeds = _grid_numbers(seeds, "--seeds", integer=True, allow_zero=True) or [base.seed]
    caches = _prefix_cache_values(prefix_cache)
    if "on" in caches:
        _check_reuse(base.workload)
    try:  # unknown names fail here, before any point runs (a profile only in a worker)
        for p in policies:
            get_policy(p)
        for p in given_profiles or ():
            load_profile(p)
    except InputError as exc:
        raise as_sweep_error(exc) from None
    if not given_profiles:  # the base's, blamed where it was set (--profile, a file's key)
        load_profile(base.deployment.profile)
    loads: list[tuple[str, float]] = []
    loads += [("qps", float(q)) for q in _grid_numbers(qps, "--qps") or []]
    loads += [("concurrency", int(c))
              for c in _grid_numbers(concurrency, "--concurrency", integer=True) or []]
    if not loads:
        w = base.workload
        loads = [("base", float(w.max_concurrency if w.arrival == "closed" else w.qps))]
    size = len(loads) * len(profiles) * len(traces) * len(caches) * len(policies) * len(seeds)
    if size > MAX_POINTS:
        raise InputError("--qps/--concurrency", f"the grid has {size:,} points (loads x "
                         f"profiles x traces x prefix-cache settings x policies x seeds); "
                         f"the limit is "
                         f"{MAX_POINTS:,}")
    points: list[SweepPoint] = []
    for kind, load in loads:
        w = base.workload
        if kind == "qps" and w.workload_path:
            # as in run: a rate over a workload file replays it, its timestamps rescaled
            # to the rate, rather than drawing Poisson arrivals that ignore the file
            w = replace(w, arrival="replay", qps=float(load), replay_qps=float(load))
        elif kind == "qps":
            arrival = w.arrival if w.arrival in ("poisson", "gamma") else "poisson"
            w = replace(w, arrival=arrival, qps=float(load))
        elif kind == "concurrency":
            w = replace(w, arrival="closed", max_concurrency=int(load))
            if w.num_requests is None:
                raise InputError("--num-requests", "closed-loop sweeps need --num-requests")
            if sizing.requests_per_client:
                n = min(max(w.num_requests, sizing.requests_per_client * int(load)),
                        max(w.num_requests, sizing.max_requests))
                w = replace(w, num_requests=n)
        for profile, trace, cache, policy, seed in itertools.product(
                profiles, traces, caches, policies, seeds):
            engine = base.engine if cache is None else replace(base.engine, prefix_cache=cache)
            cfg = replace(base, workload=w, policy=policy, seed=int(seed), engine=engine,
                          deployment=replace(base.deployment, profile=profile),
                          trace=trace if trace is not None else base.trace)
            _validate_point(cfg)
            points.append(SweepPoint(cfg, policy, profile, trace, kind, load, sizing,
                                     prefix_cache_spec=cache))
    unique = {p.point_id: p for p in points}
    return list(unique.values())


def _prefix_cache_values(values: Sequence[str] | str | None) -> list[str | None]:
    """The swept prefix-cache settings (``"on,off"`` or a list), each once; ``[None]``
    (the base's own setting) when not given."""
    if values is None:
        return [None]
    items = values.split(",") if isinstance(values, str) else list(values)
    out = list(dict.fromkeys(str(v).strip().lower() for v in items if str(v).strip()))
    if not out:  # each value is checked with its point's config (on | off)
        raise InputError("--prefix-cache", f"is empty: give on, off or on,off, got {values!r}")
    return out


def run_point(point: SweepPoint) -> dict:
    """Simulate one point; return its row (parameters + metrics). Runs in a worker."""
    from dspark_sim.sim.api import prepare, simulate

    t0 = time.perf_counter()
    cfg = point.config
    res = simulate(prepare(cfg, grid_point=True))
    doublings = 0
    while _needs_more(res.summary, point.sizing) and doublings < point.sizing.max_doublings:
        bigger = _doubled(cfg, point.sizing.max_requests)
        if bigger is None:
            break
        cfg = bigger
        res = simulate(prepare(cfg, grid_point=True))
        doublings += 1
    row = dict(point.params())
    row["size_doublings"] = doublings
    for k, v in res.summary.items():
        if k in row or k in ROW_DROPPED:
            continue
        if isinstance(v, dict):
            continue
        row[k] = v
    # Little's law: mean requests in the system (Fig. 8's x axis for open-loop points)
    thr, e2e = row.get("request_throughput"), row.get("mean_e2el_ms")
    row["mean_concurrency"] = thr * e2e / 1e3 if thr and e2e else None
    row["steady_mean_concurrency"] = row.get("steady_mean_in_system")
    row |= request_sample(res.requests)
    row["wall_s"] = time.perf_counter() - t0
    return row


def request_sample(requests: pl.DataFrame | pl.LazyFrame) -> dict[str, list[float]]:
    """The finished requests' arrival, TTFT, TPOT (NaN: a single token, no TPOT) and
    output tokens, in arrival order, thinned evenly to at most :data:`SAMPLE_MAX`."""
    frame = requests.lazy().filter(pl.col("finished")).sort("arrival_s").select(
        [pl.col(c).cast(pl.Float64).fill_null(float("nan")).alias(k)
         for k, c in SAMPLE_COLUMNS.items()]).collect()
    if frame.height > SAMPLE_MAX:
        frame = frame.gather_every(math.ceil(frame.height / SAMPLE_MAX))
    return {k: frame[k].to_list() for k in SAMPLE_COLUMNS}


def _needs_more(summary: dict, sizing: Sizing) -> bool:
    """The point's steady window is short, or a front figure is less precise than
    ``sizing.target_rse`` (an unknown error counts as too large)."""
    if summary.get("steady_window_short"):
        return True
    if not sizing.target_rse:
        return False
    errs = [summary.get("steady_output_throughput_rse"),
            summary.get("steady_median_interactivity_rse")]
    return any(e is None or e > sizing.target_rse for e in errs)


def _doubled(cfg: SimConfig, max_requests: int) -> SimConfig | None:
    """``cfg`` with twice the requests (and arrival window); None at the cap or when a
    replayed workload has no more requests to give."""
    w = cfg.workload
    n = w.num_requests
    if n is not None and (2 * n > max_requests
                          or (w.arrival == "replay" and _replay_rows(w) <= n)):
        return None
    return replace(cfg, workload=replace(
        w, num_requests=None if n is None else 2 * n,
        duration_s=None if w.duration_s is None else 2 * w.duration_s))


def _replay_rows(w) -> int:
    from dspark_sim.sim.workload import read_workload

    return read_workload(w.workload_path).height


def row_frame(row: dict) -> pl.DataFrame:
    cols = {}
    for k, v in row.items():
        if k in LIST_METRICS or isinstance(v, list):
            cols[k] = pl.Series(k, [[float(x) for x in (v or [])]], dtype=pl.List(pl.Float64))
        elif k in STRING_COLUMNS:
            cols[k] = pl.Series(k, [v], dtype=pl.Utf8)
        elif k in INT_COLUMNS:
            cols[k] = pl.Series(k, [v], dtype=pl.Int64)
        elif isinstance(v, bool):
            cols[k] = pl.Series(k, [v], dtype=pl.Boolean)
        elif isinstance(v, str):
            cols[k] = pl.Series(k, [v], dtype=pl.Utf8)
        elif isinstance(v, int):
            cols[k] = pl.Series(k, [v], dtype=pl.Int64)
        else:  # float or None: metrics that may be missing are numeric
            cols[k] = pl.Series(k, [None if v is None else float(v)], dtype=pl.Float64)
    return pl.DataFrame(cols)


class SweepWarning(UserWarning):
    """A file in a sweep folder that is left out or recomputed (the CLI prints it as one
    ``warning:`` line)."""


# Parquet key-value metadata of a point file: the SHA-256 of its row (_row_digest). A
# file whose footer reads may still hold damaged data pages, and some damage decodes
# to other numbers without an error; the digest tells both from a good file.
POINT_META_KEY = b"dspark_sim.point_sha256"


def _row_digest(table) -> bytes:
    """SHA-256 (hex) of a point's arrow table's values as JSON (floats at full
    precision)."""
    text = json.dumps(table.to_pylist(), sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest().encode()


class BadPart(Exception):
    """A file in ``points/`` that is no usable point: ``damaged`` (unreadable, or its data
    not what was written) or not a sweep point at all."""

    def __init__(self, why: str, damaged: bool) -> None:
        super().__init__(why)
        self.damaged = damaged


def write_part(out: Path, row: dict) -> Path:
    path = Path(out) / "points" / f"{row['point_id']}.parquet"
    table = row_frame(row).to_arrow()
    table = table.replace_schema_metadata({POINT_META_KEY: _row_digest(table)})
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)
    return path


def read_part(path: str | Path) -> pl.DataFrame:
    """A point file read whole and checked: one row whose ``point_id`` is the file's
    name, its data matching the digest written with it (a file from before digests:
    read whole). Raises :class:`BadPart` saying why not."""
    path = Path(path)
    # pyarrow, and the data checked before polars sees it: polars panics (a
    # BaseException, past any `except Exception`) on some damaged footers and strings
    try:
        table = pq.read_table(path)
        table.validate(full=True)
        stored = (table.schema.metadata or {}).get(POINT_META_KEY)
        if stored is not None and stored != _row_digest(table):
            raise BadPart("damaged (its data does not match the digest written with it)",
                          damaged=True)
    except BadPart:
        raise
    except Exception as exc:  # pyarrow raises a zoo of errors on damaged bytes
        raise BadPart(f"cannot be read ({exc.__class__.__name__})", damaged=True) from None
    df = pl.from_arrow(table)
    missing = [c for c in PARAM_COLUMNS if c not in df.columns]
    if missing or df.height != 1 or df["point_id"][0] != path.stem:
        why = (f"no {', '.join(missing)} column" if missing else
               f"{df.height} rows" if df.height != 1 else
               f"its point_id is {df['point_id'][0]!r}")
        raise BadPart(f"not a sweep point ({why})", damaged=False)
    return df


def combine(out: str | Path, point_ids: Iterable[str] | None = None) -> pl.DataFrame:
    """Stack ``out/points/*.parquet`` (optionally only ``point_ids``) into
    ``out/results.parquet`` (written atomically) and return the frame. A file that is
    no good point (:func:`read_part`) is left out, with a :class:`SweepWarning`."""
    out = Path(out)
    parts = sorted((out / "points").glob("*.parquet"))
    if point_ids is not None:
        keep = set(point_ids)
        parts = [p for p in parts if p.stem in keep]
    frames = []
    for p in parts:
        try:
            frames.append(read_part(p))
        except BadPart as exc:
            warnings.warn(f"{p}: {exc}; left out of {out / 'results.parquet'}",
                          SweepWarning, stacklevel=2)
    df = pl.concat(frames, how="diagonal_relaxed") if frames else pl.DataFrame(
        {c: [] for c in PARAM_COLUMNS})
    sort_cols = [c for c in ("profile_spec", "trace_spec", "policy_spec", "load_kind", "load",
                             "seed") if c in df.columns]
    if df.height:
        df = df.sort(sort_cols, nulls_last=True)
    with atomic_path(out / "results.parquet") as tmp:
        df.write_parquet(tmp)
    return df


def finished_ids(out: str | Path, point_ids: Iterable[str]) -> set[str]:
    """Those of ``point_ids`` whose part on disk is a good point (:func:`read_part`); a
    part there that is not is said so (:class:`SweepWarning`): its point is recomputed."""
    done = set()
    for pid in point_ids:
        p = Path(out) / "points" / f"{pid}.parquet"
        if not p.exists():
            continue
        try:
            read_part(p)
        except BadPart as exc:
            warnings.warn(f"{p}: {exc}; recomputing the point", SweepWarning, stacklevel=2)
            continue
        done.add(pid)
    return done


# -- executors --------------------------------------------------------------------
# Each takes the points and returns an iterator of finished rows (any order). The
# work is submitted before the function returns, so worker processes are forked
# before the progress bar starts its refresh thread.
def _run_serial(points: list[SweepPoint], workers: int | None) -> Iterator[dict]:
    return (run_point(pt) for pt in points)


def _die_with_parent(parent_pid: int) -> None:
    """Worker initializer: a worker must not outlive its sweep (a SIGKILLed parent runs
    no cleanup, and an orphaned worker would run its point to the end, ~200 MB each).

    Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` makes the kernel kill the worker when its
    parent dies. Everywhere (and as a second line on Linux): a daemon thread that polls
    the parent pid once a second and exits the process when the worker is re-parented.
    The parent may already be gone before either is set up: checked right after."""
    import signal
    import sys
    import threading

    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            PR_SET_PDEATHSIG = 1
            libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):  # no libc prctl: the watchdog still runs
            pass

    def watchdog() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    if os.getppid() != parent_pid:
        os._exit(1)
    threading.Thread(target=watchdog, name="sweep-parent-watchdog", daemon=True).start()


def _run_process(points: list[SweepPoint], workers: int | None) -> Iterator[dict]:
    import multiprocessing as mp

    workers = min(workers or os.cpu_count() or 1, len(points))
    if workers <= 1:
        return _run_serial(points, workers)
    # spawn, not fork: forking a process whose polars/rayon thread pools are live can
    # deadlock the child. Scripts calling run_sweep need an ``if __name__ == "__main__"``
    # guard (notebooks and the CLI do not).
    ex = ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"),
                             initializer=_die_with_parent, initargs=(os.getpid(),))
    pending: set[Future] = {ex.submit(run_point, pt) for pt in points}

    def rows() -> Iterator[dict]:
        nonlocal pending
        try:
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    yield fut.result()
        except BrokenProcessPool as exc:
            raise RuntimeError(
                "a sweep worker process died (out of memory, killed, or a script without an "
                "`if __name__ == '__main__':` guard; or use executor='serial')") from exc
        finally:
            ex.shutdown(wait=True, cancel_futures=True)

    return rows()


def _run_ray(points: list[SweepPoint], workers: int | None) -> Iterator[dict]:
    from dspark_sim.sim.ray_start import start_ray

    ray = start_ray(workers)
    remote = ray.remote(run_point)
    pending = [remote.remote(pt) for pt in points]

    def rows() -> Iterator[dict]:
        nonlocal pending
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                for ref in done:
                    yield ray.get(ref)
        finally:
            for ref in pending:
                ray.cancel(ref, force=True)

    return rows()


_EXECUTORS: dict[str, Callable[[list[SweepPoint], int | None], Iterator[dict]]] = {
    "serial": _run_serial, "process": _run_process, "ray": _run_ray}


# Workers per core at most: the points are CPU-bound, so more gain nothing, and each
# worker is an interpreter of its own (~200 MB): --workers 1000 spawned one per point
# until the memory ran out.
WORKERS_PER_CORE = 4


def check_executor(executor: str, workers: int | None) -> None:
    """``--executor`` one of :data:`EXECUTORS`; ``--workers`` None (one per core) or a
    positive integer up to ``WORKERS_PER_CORE`` x this machine's cores."""
    if executor not in EXECUTORS:
        raise InputError("--executor", f"must be one of {', '.join(EXECUTORS)}, got {executor!r}")
    check_positive_int("--workers", workers, WORKERS_PER_CORE * (os.cpu_count() or 1))


def run_sweep(
    base: SimConfig,
    *,
    qps: Sequence[float] | None = None,
    concurrency: Sequence[int] | None = None,
    policies: Sequence[str],
    profiles: Sequence[str] | None = None,
    traces: Sequence[str | None] | None = None,
    seeds: Sequence[int] | None = None,
    prefix_cache: Sequence[str] | None = None,
    out: str | Path,
    executor: str = "process",
    workers: int | None = None,
    progress: bool = True,
    sizing: Sizing | None = None,
) -> pl.DataFrame:
    """Run the grid ``(qps | concurrency) x policies x profiles x traces x seeds``.

    ``qps`` points use open-loop arrivals (the base's ``gamma`` burstiness is kept,
    otherwise Poisson; a base with a workload file replays it, rescaled to the rate, as
    ``run --workload F --qps R`` does); ``concurrency`` points use a closed loop of that many
    clients. With neither, the base workload's own load is the single load.
    ``profiles`` defaults to the base's profile, ``traces`` to ``[None]`` (the
    base's/built-in trace), ``seeds`` to the base's seed. Finished points already in
    ``out/points/`` are not rerun. Returns the rows of *this* grid (also written,
    with any other points in the folder, to ``out/results.parquet``). ``sizing``: how
    many requests each point runs (:class:`Sizing`; default: the base's count).
    ``prefix_cache`` (``["on", "off"]``) runs every point with each setting.
    """
    check_executor(executor, workers)
    points = build_points(base, qps=qps, concurrency=concurrency, policies=policies,
                          profiles=profiles, traces=traces, seeds=seeds, sizing=sizing,
                          prefix_cache=prefix_cache)
    return run_points(points, out=out, executor=executor, workers=workers, progress=progress)


def run_points(points: Sequence[SweepPoint], *, out: str | Path, executor: str = "process",
               workers: int | None = None, progress: bool = True) -> pl.DataFrame:
    """Run already-built points (any mix of configurations) into ``out`` as
    :func:`run_sweep` does: resumable parts, ``results.parquet``; returns their rows."""
    check_executor(executor, workers)
    points = list({p.point_id: p for p in points}.values())
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    done = finished_ids(out, [p.point_id for p in points])
    todo = [p for p in points if p.point_id not in done]

    rows = _EXECUTORS[executor](todo, workers) if todo else iter(())
    bar = None
    task = None
    if progress:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        from dspark_sim.io import description_column, progress_bar

        bar = progress_bar(TextColumn("sweep"), BarColumn(), MofNCompleteColumn(),
                           TimeElapsedColumn(), TimeRemainingColumn(),
                           description_column(), transient=False)
        task = bar.add_task(f"{len(points) - len(todo)} reused", total=len(points),
                            completed=len(points) - len(todo))
        bar.start()

    try:
        for row in rows:
            write_part(out, row)
            if bar is not None:
                bar.update(task, advance=1, description=(
                    f"{row['policy_spec']} {row['load_kind']}={row['load']:g}"))
    finally:
        close = getattr(rows, "close", None)
        if close is not None:
            close()
        if bar is not None:
            bar.stop()
    combine(out)
    ids = [p.point_id for p in points]
    df = pl.read_parquet(out / "results.parquet")
    return df.filter(pl.col("point_id").is_in(ids))


def load_results(path: str | Path) -> pl.DataFrame:
    """A sweep folder (its ``results.parquet``, rebuilt from the parts if missing) or a
    ``results.parquet`` file."""
    p = Path(path)
    if p.is_dir():
        if not (p / "results.parquet").is_file():
            if not (p / "points").is_dir():
                raise InputError(str(p), "not a sweep folder (no results.parquet, no points/)")
            return combine(p)
        p = p / "results.parquet"
    if not p.is_file():
        raise InputError(str(p), "sweep results not found")
    try:
        return pl.read_parquet(p)
    except Exception as exc:
        raise InputError(str(p), f"not a parquet file ({exc.__class__.__name__})") from exc


__all__ = ["Sizing", "SweepPoint", "build_points", "combine", "load_results", "parse_list",
           "parse_numbers", "point_hash", "run_point", "run_points", "run_sweep"]
