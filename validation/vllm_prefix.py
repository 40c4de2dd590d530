"""vLLM with automatic prefix caching on, measured live and predicted by the simulator.

**Measuring.** A setting ``none+prefix`` (``ngram:K+prefix``, ...) is a server started
with ``--enable-prefix-caching``; its runs are named ``none-prefix@c4`` and so on, beside
the caching-off settings of the same measurement. Each of its runs starts from an empty
cache: the server answers one warm-up request of its own (the client's warm-up would
cache the run's first prompt), its cache is emptied (``POST /reset_prefix_cache``, which
vLLM serves with ``VLLM_SERVER_DEV_MODE=1``), and ``/metrics`` is scraped before and after
the bench client runs. The difference of vLLM's own counters, ``vllm:prefix_cache_hits``
over ``vllm:prefix_cache_queries`` (prompt tokens, counted once per request at its first
scheduling), is the run's hit rate, saved in ``prefix/<run>.json`` with the server's
block (``vllm:cache_config_info``: the token granularity a hit lands on).

Once per measurement, vLLM's own client code (its dataset sampler, the model's tokenizer
and chat template, in vLLM's interpreter) lists, for every request count the loads use,
the requests the client sends, in its order, as token ids: ``prefix/samples.json``. A
bench result lists its requests in that order (each one's prompt length is checked).

**Predicting.** Each prompt's full blocks get ids from its token ids, chained as vLLM
chains its block hashes (a block's id names its content and every block before it, so
two prompts share a block's id exactly when they share every token up to its end), at
the server's block. Each caching-on run is simulated on its own requests with those ids
as a workload file's ``hash_ids`` and the simulator's prefix cache on, with a profile
fitted to the caching-off runs only; its median TTFT and hit rate are held against
vLLM's (:func:`compare_prefix`).
"""

from __future__ import annotations

import json
import math
import tempfile
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import polars as pl

from dspark_sim.errors import InputError
from dspark_sim.io import loads_json, write_json_atomic, write_text_atomic
from dspark_sim.traces.importers import _PROM_SAMPLE, _prom_labels

if TYPE_CHECKING:
    from dspark_sim.sim.config import EngineConfig
    from dspark_sim.validation.vllm_compare import Comparison
    from dspark_sim.validation.vllm_fit import BenchRun, FitResult
    from dspark_sim.validation.vllm_live import LiveConfig, VllmServer

FOLDER = "prefix"  # beside runs/: the samples and each caching run's counters
SAMPLES = "samples.json"
QUERIES = "vllm:prefix_cache_queries_total"
HITS = "vllm:prefix_cache_hits_total"
CACHE_INFO = "vllm:cache_config_info"
# the labels of vllm:cache_config_info that may give the hits' granularity, finest first
# (vLLM fills the first two only where hashes are finer than its block)
BLOCK_LABELS = ("cache_hit_alignment_tokens", "hash_block_size", "block_size")
# A held-out caching run's hit rate is within bounds when it is within this many points
# (as a fraction) of vLLM's; its median TTFT has the comparison's TTFT bound.
HIT_RATE_BOUND = 0.05
WARMUP_PROMPT = "Say hello."
RESET_TIMEOUT_S = 60.0
# Run in vLLM's interpreter: its benchmark client's own sampling of the prompt file (its
# chat template, shuffle or file order, oversampling) at each request count, every
# request's prompt as the tokenizer's ids, which the server computes from the same text.
SAMPLE_CODE = (
    "import argparse, json, sys\n"
    "from vllm.benchmarks.datasets import get_samples\n"
    "from vllm.benchmarks.serve import add_cli_args\n"
    "from vllm.tokenizers import get_tokenizer\n"
    "out, counts = sys.argv[1], json.loads(sys.argv[2])\n"
    "p = argparse.ArgumentParser(); add_cli_args(p)\n"
    "args = p.parse_args(sys.argv[3:])\n"
    "tok = get_tokenizer(args.tokenizer or args.model, tokenizer_mode=args.tokenizer_mode,\n"
    "                    trust_remote_code=args.trust_remote_code)\n"
    "res = {}\n"
    "for n in counts:\n"
    "    args.num_prompts = n\n"
    "    res[str(n)] = [[s.prompt_len, tok(s.prompt).input_ids]\n"
    "                   for s in get_samples(args, tok)]\n"
    "json.dump(res, open(out, 'w'))\n")


# -- /metrics -----------------------------------------------------------------------------
def prefix_counters(text: str, where: str) -> dict:
    """From one ``/metrics`` scrape: ``queries_tokens`` and ``hits_tokens`` (vLLM's prefix
    cache counters, summed over its engines), ``block_tokens`` (the granularity of a hit,
    from ``vllm:cache_config_info``) and ``enabled`` (the server's prefix caching)."""
    totals = {QUERIES: 0.0, HITS: 0.0}
    seen: set[str] = set()
    info: dict[str, str] | None = None
    for i, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line.startswith((QUERIES, HITS, CACHE_INFO)):
            continue
        m = _PROM_SAMPLE.match(line)
        if m is None:
            raise InputError(where, f"line {i}: not a Prometheus sample")
        name = m["name"]
        if name == CACHE_INFO:
            info = _prom_labels(m["labels"] or "", where, i)
        elif name in totals:
            try:
                value = float(m["value"])
            except ValueError:
                raise InputError(where, f"line {i}: value {m['value']!r} is not a "
                                        "number") from None
            if not math.isfinite(value) or value < 0:
                raise InputError(where, f"line {i}: counter value must be finite and >= 0")
            totals[name] += value
            seen.add(name)
    if seen != set(totals):
        missing = " and ".join(sorted(set(totals) - seen))
        raise InputError(where, f"no {missing} samples (a vLLM before its V1 prefix-cache "
                                "counters, or not a vLLM /metrics scrape)")
    if info is None:
        raise InputError(where, f"no {CACHE_INFO} sample: the server's block is not known")
    block = next((int(info[k]) for k in BLOCK_LABELS if info.get(k, "").isdigit()), None)
    if block is None or block < 1:
        raise InputError(where, f"{CACHE_INFO} gives no block size ({', '.join(BLOCK_LABELS)})")
    return {"queries_tokens": int(totals[QUERIES]), "hits_tokens": int(totals[HITS]),
            "block_tokens": block,
            "enabled": info.get("enable_prefix_caching", "").lower() == "true"}


# -- live: around each caching run ---------------------------------------------------------
def _post(url: str, body: dict | None, timeout_s: float) -> dict:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read().decode("utf-8") or "{}")


def before_run(cfg: LiveConfig, server: VllmServer) -> dict:
    """Warm the server up with one request of its own, empty its prefix cache, and return
    its counters (:func:`prefix_counters`) as the run starts."""
    _post(server.base_url + "/v1/completions",
          {"model": str(cfg.model_dir), "prompt": WARMUP_PROMPT,
           "max_tokens": cfg.output_tokens, "temperature": 0, "ignore_eos": True},
          cfg.bench_timeout_s)
    deadline = time.monotonic() + RESET_TIMEOUT_S
    while not _post(server.base_url + "/reset_prefix_cache", None, 30.0).get("success"):
        # vLLM refuses while blocks are held (a request still finishing): try again
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM server ({server.setting.name}) did not empty its "
                               f"prefix cache within {RESET_TIMEOUT_S:g} s")
        time.sleep(1.0)
    before = prefix_counters(server.scrape(), f"{server.setting.name} /metrics")
    if not before["enabled"]:
        raise RuntimeError(f"vLLM server ({server.setting.name}) reports prefix caching "
                           f"off in {CACHE_INFO}")
    return before


def record_path(out: Path, run_file: str) -> Path:
    """``prefix/<run>.json`` for the result file ``runs/<run>.json``."""
    return out / FOLDER / run_file


def after_run(server: VllmServer, before: dict, out: Path, run_file: str,
              round_no: int) -> Path:
    """Scrape the counters after the run and save the run's own (the difference)."""
    after = prefix_counters(server.scrape(), f"{server.setting.name} /metrics")
    queries = after["queries_tokens"] - before["queries_tokens"]
    hits = after["hits_tokens"] - before["hits_tokens"]
    rec = {"run": run_file, "setting": server.setting.name, "round": round_no,
           "block_tokens": after["block_tokens"], "queries_tokens": queries,
           "hits_tokens": hits, "hit_rate_tokens": hits / queries if queries else None,
           "before": before, "after": after}
    path = record_path(out, run_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_json_atomic(path, rec)


def record_samples(cfg: LiveConfig, prompts: Path, counts: list[int], path: Path) -> Path:
    """``prefix/samples.json``: for each request count, the requests vLLM's client sends
    (indices into ``token_ids``, each distinct prompt's token ids once), in its order."""
    import subprocess

    from dspark_sim.validation.vllm_live import dataset_args, foreign_env

    path.parent.mkdir(parents=True, exist_ok=True)
    raw = path.with_name(path.name + ".raw")
    cmd = [str(cfg.python), "-c", SAMPLE_CODE, str(raw), json.dumps(counts),
           *dataset_args(cfg, prompts, max(counts))]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=foreign_env(),
                          stdin=subprocess.DEVNULL, timeout=cfg.startup_timeout_s, check=False)
    if proc.returncode != 0 or not raw.is_file():
        raise RuntimeError(f"vLLM's sampler failed (exit {proc.returncode}):\n"
                           + "\n".join(proc.stderr.splitlines()[-15:]))
    sampled = json.loads(raw.read_text(encoding="utf-8"))
    raw.unlink()
    ids: dict[tuple[int, ...], int] = {}
    requests = {}
    for n, rows in sampled.items():
        order = []
        for prompt_len, tokens in rows:
            if prompt_len != len(tokens):
                raise RuntimeError(f"vLLM's client counts {prompt_len} prompt tokens where "
                                   f"its tokenizer gives {len(tokens)}")
            order.append(ids.setdefault(tuple(tokens), len(ids)))
        requests[n] = order
    doc = {"prompts": prompts.name, "prompt_order": cfg.prompt_order, "seed": cfg.seed,
           "model": str(cfg.model_dir), "requests": requests,
           "token_ids": [list(t) for t in ids]}
    return write_text_atomic(path, json.dumps(doc, separators=(",", ":")) + "\n")


# -- the simulated side -------------------------------------------------------------------
def block_hash_ids(token_ids: list[list[int]], block_tokens: int) -> list[list[int]]:
    """Each prompt's full blocks of ``block_tokens`` as ids: a block's id is the same for
    two prompts exactly when their tokens are the same up to the block's end (chained
    over the blocks before it, as vLLM's block hashes are), numbered from 0 in first-seen
    order. A prompt's last, partial block has none (vLLM caches full blocks only)."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    seen: dict[tuple[int, tuple[int, ...]], int] = {}
    out = []
    for tokens in token_ids:
        parent, ids = -1, []
        for j in range(len(tokens) // block_tokens):
            key = (parent, tuple(tokens[j * block_tokens:(j + 1) * block_tokens]))
            parent = seen.setdefault(key, len(seen))
            ids.append(parent)
        out.append(ids)
    return out


@dataclass(frozen=True)
class Samples:
    """``prefix/samples.json``: the requests vLLM's client sent, per request count."""

    path: Path
    token_ids: list[list[int]]
    requests: dict[int, list[int]]

    @classmethod
    def read(cls, folder: Path) -> Samples:
        path = folder / FOLDER / SAMPLES
        if not path.is_file():
            raise InputError(str(path), "missing: vllm measure records the caching runs' "
                                        "prompts as token ids there")
        try:
            d = loads_json(path.read_text(encoding="utf-8"))
            tokens = d["token_ids"]
            requests = {int(n): [int(i) for i in v] for n, v in d["requests"].items()}
        except (ValueError, KeyError, TypeError) as exc:
            raise InputError(str(path), f"not a samples file ({exc})") from None
        if not all(0 <= i < len(tokens) for v in requests.values() for i in v):
            raise InputError(str(path), "a request names a prompt it does not list")
        return cls(path, tokens, requests)

    def for_run(self, run: BenchRun) -> list[list[int]]:
        """The token ids of each of ``run``'s requests, in its result's order (checked
        against its prompt lengths)."""
        n = len(run.prompt_tokens)
        order = self.requests.get(n)
        if order is None:
            raise InputError(str(run.path), f"{n} requests, a count {self.path} does not "
                                            f"list ({sorted(self.requests)})")
        lens = [len(self.token_ids[i]) for i in order]
        if lens != [int(x) for x in run.prompt_tokens]:
            raise InputError(str(run.path), f"its prompt lengths are not those of the "
                                            f"{n} requests {self.path} lists (another prompt "
                                            "file, order, seed or tokenizer)")
        return [self.token_ids[i] for i in order]


def read_record(folder: Path, run: BenchRun) -> dict:
    """The run's vLLM counters (:func:`after_run`), checked."""
    path = record_path(folder, run.path.name)
    if not path.is_file():
        raise InputError(str(path), f"missing: {run.path.name} ran on a caching server, and "
                                    "vllm measure records its prefix-cache counters there")
    try:
        rec = loads_json(path.read_text(encoding="utf-8"))
        queries, hits, block = (int(rec["queries_tokens"]), int(rec["hits_tokens"]),
                                int(rec["block_tokens"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise InputError(str(path), f"not a prefix-cache record ({exc})") from None
    if queries <= 0 or not 0 <= hits <= queries or block < 1:
        raise InputError(str(path), f"counters out of range: {hits} hits of {queries} "
                                    f"queried tokens, block {block}")
    return {"queries_tokens": queries, "hits_tokens": hits, "block_tokens": block,
            "hit_rate_tokens": hits / queries}


def prefix_workload_file(run: BenchRun, hash_ids: list[list[int]], block_tokens: int,
                         folder: Path) -> Path:
    """The run's requests as a Mooncake JSONL in send order, as
    :func:`~dspark_sim.validation.vllm_fit.workload_file` writes them, each with its
    prompt's ``hash_ids`` and their ``hash_block_tokens``."""
    from dspark_sim.validation.vllm_fit import _send_order

    path = folder / f"{run.name.replace('@', '_')}.prefix.jsonl"
    send = run.send_s if run.send_s is not None else np.zeros(len(run.prompt_tokens))
    with path.open("w", encoding="utf-8") as fh:
        for i in _send_order(run):
            fh.write(json.dumps({"timestamp": round(float(send[i]) * 1e3, 3),
                                 "input_length": int(run.prompt_tokens[i]),
                                 "output_length": int(run.output_tokens[i]),
                                 "hash_ids": hash_ids[i],
                                 "hash_block_tokens": block_tokens}) + "\n")
    return path


def simulate_prefix_run(run: BenchRun, profile, traces, engine: EngineConfig,
                        workload: Path, block_tokens: int, seed: int = 0) -> dict:
    """The run simulated with the prefix cache on at ``block_tokens``: its median TTFT,
    throughput, TPOT and hit rate (tokens)."""
    from dspark_sim.sim.api import simulate
    from dspark_sim.validation.vllm_fit import _send_order, run_config

    cfg = run_config(run, workload, replace(engine, prefix_cache="on",
                                            prefix_block_tokens=block_tokens), seed)
    tr, rows = traces.for_run(run) if traces is not None else (None, None)
    if rows is not None:  # the workload file lists the requests in send order
        rows = rows[_send_order(run)]
    s = simulate(cfg, profile=profile, trace=tr, trace_rows=rows).summary
    keys = ("median_ttft_ms", "output_throughput", "median_tpot_ms",
            "prefix_cache_hit_rate_tokens")
    return {k: float("nan") if s.get(k) is None else float(s[k]) for k in keys}


# -- the comparison -------------------------------------------------------------------------
def judge(*, measured_ttft_ms: float, simulated_ttft_ms: float, ttft_spread: float,
          measured_hit_rates, simulated_hit_rate: float) -> dict:
    """One caching-on point against its bounds: the median TTFT's relative error within
    the comparison's TTFT bound, or the point's own spread where wider; the simulated hit
    rate within :data:`HIT_RATE_BOUND` of vLLM's (the median of its repeats')."""
    from dspark_sim.validation.vllm_compare import BOUNDS

    err = simulated_ttft_ms / measured_ttft_ms - 1.0
    allowed = max(BOUNDS["median_ttft_ms"], ttft_spread)
    hit = np.asarray(measured_hit_rates, float)
    med = float(np.median(hit))
    diff = simulated_hit_rate - med
    return {"measured_ttft_ms": measured_ttft_ms, "simulated_ttft_ms": simulated_ttft_ms,
            "ttft_error": err, "ttft_spread": ttft_spread, "ttft_allowed": allowed,
            "ttft_within": bool(abs(err) <= allowed + 1e-12),
            "measured_hit_rate": med, "hit_rate_spread": float((hit.max() - hit.min()) / 2),
            "simulated_hit_rate": simulated_hit_rate, "hit_rate_diff": diff,
            # a hair of slack: 0.55 - 0.50 is 0.0500000004 in binary
            "hit_rate_within": bool(abs(diff) <= HIT_RATE_BOUND + 1e-12)}


@dataclass(frozen=True, eq=False)
class PrefixComparison:
    """The caching-on points predicted with a profile fitted to caching-off runs."""

    table: pl.DataFrame  # one row per caching-on point
    fit: FitResult
    split: str
    base: Comparison | None = None  # the caching-off runs' own, where some are held out

    @property
    def warnings(self) -> tuple[str, ...]:
        return () if self.base is None else self.base.warnings

    def headline(self) -> dict:
        t = self.table
        ttft = t.filter(~pl.col("ttft_within"))
        hit = t.filter(~pl.col("hit_rate_within"))
        worst_t = t.row(int(t["ttft_error"].abs().arg_max()), named=True)
        worst_h = t.row(int(t["hit_rate_diff"].abs().arg_max()), named=True)
        return {"split": self.split, "prefix_points": t.height,
                "block_tokens": sorted(set(t["block_tokens"].to_list())),
                "ttft_within_bounds": t.height - ttft.height,
                "hit_rate_within_bounds": t.height - hit.height,
                "outside_bounds": [f"{r['run']} median TTFT" for r in ttft.iter_rows(named=True)]
                + [f"{r['run']} hit rate" for r in hit.iter_rows(named=True)],
                "worst_ttft_error": {"run": worst_t["run"], "error": worst_t["ttft_error"]},
                "worst_hit_rate_diff": {"run": worst_h["run"],
                                        "diff": worst_h["hit_rate_diff"]},
                "constants": self.fit.uncertainty,
                "ttft_line": self.fit.line_record()}


def _fit_for_prefix(runs: list[BenchRun], plain: list[BenchRun], cached: list[BenchRun],
                    engine: EngineConfig, split: str | None, seed: int, step_table: str):
    """The fit on the caching-off runs the split names: the caching-off comparison's
    where it holds some of them out, else a fit of them all."""
    from dspark_sim.validation.vllm_acceptance import setting_traces
    from dspark_sim.validation.vllm_compare import compare, default_split, parse_split
    from dspark_sim.validation.vllm_fit import fit_profile

    split = split or default_split(plain)
    fitted = parse_split(split, runs)  # the caching runs count: none of them is fitted
    wrong = sorted({r.name for r in cached} & fitted)
    if wrong:
        raise InputError("--fit", f"names caching runs ({', '.join(wrong)}): the profile "
                                  "is fitted to caching-off runs, the caching ones are "
                                  "predicted")
    if {r.name for r in plain} - fitted:
        base = compare(plain, engine=engine, split=split, seed=seed, step_table=step_table)
        return split, base.fit, base
    fitted_runs = [r for r in plain if r.name in fitted]
    traces = setting_traces(fitted_runs, fitted_runs, seed)
    return split, fit_profile(fitted_runs, engine=engine, seed=seed, traces=traces,
                              step_table=step_table), None


def compare_prefix(runs: list[BenchRun], folder: Path, *, engine: EngineConfig,
                   split: str | None = None, seed: int = 0,
                   step_table: str = "auto") -> PrefixComparison:
    """Fit on the caching-off runs (``split``, by default the caching-off comparison's),
    and predict every caching-on point's median TTFT and hit rate, each against its bound:
    TTFT within the comparison's bound or the point's own spread where wider, the hit
    rate within :data:`HIT_RATE_BOUND` of vLLM's (its counters, median over repeats)."""
    from dspark_sim.validation.vllm_acceptance import setting_traces
    from dspark_sim.validation.vllm_live import PREFIX_SUFFIX, caches_prefixes
    from dspark_sim.validation.vllm_repeats import group_points

    cached = [r for r in runs if caches_prefixes(r.setting)]
    plain = [r for r in runs if not caches_prefixes(r.setting)]
    if not cached or not plain:
        raise InputError(str(folder), "a prefix comparison needs runs with prefix caching "
                                      "on (SETTING+prefix) and runs without, to fit on")
    split, fit, base = _fit_for_prefix(runs, plain, cached, engine, split, seed, step_table)
    samples = Samples.read(folder)
    traces = setting_traces(cached, [r for r in plain if r.k], seed) \
        if any(r.k for r in cached) else None
    off = {p.name: p for p in group_points(plain)}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for p in group_points(cached):
            r = p.run
            recs = [read_record(folder, x) for x in p.runs]
            blocks = {x["block_tokens"] for x in recs}
            if len(blocks) > 1:
                raise InputError(str(folder / FOLDER), f"{p.name}'s repeats ran at blocks "
                                                       f"{sorted(blocks)}")
            block = blocks.pop()
            ids = block_hash_ids(samples.for_run(r), block)
            wl = prefix_workload_file(r, ids, block, Path(tmp))
            sim = simulate_prefix_run(r, fit.profile, traces, engine, wl, block, seed)
            twin = off.get(p.name.replace(PREFIX_SUFFIX + "@", "@"))
            rows.append({"run": p.name, "setting": r.setting, "load": r.load,
                         "repeats": p.repeats, "block_tokens": block,
                         "off_ttft_ms": None if twin is None
                         else twin.run.measured["median_ttft_ms"],
                         **judge(measured_ttft_ms=r.measured["median_ttft_ms"],
                                 simulated_ttft_ms=sim["median_ttft_ms"],
                                 ttft_spread=p.spread("median_ttft_ms") or 0.0,
                                 measured_hit_rates=[x["hit_rate_tokens"] for x in recs],
                                 simulated_hit_rate=sim["prefix_cache_hit_rate_tokens"]),
                         "simulated_output_throughput": sim["output_throughput"],
                         "measured_output_throughput": r.measured["output_throughput"]})
    return PrefixComparison(pl.DataFrame(rows), fit, split, base)


def prefix_markdown(pc: PrefixComparison) -> str:
    """The caching-on points as Markdown: headline, bounds, one row per point."""
    from dspark_sim.validation.vllm_compare import BOUNDS, markdown
    from dspark_sim.validation.vllm_repeats import constants_line

    h = pc.headline()
    t = pc.table
    fitted = len(pc.fit.profile.parameters.get("fitted_runs", []))
    blocks = ", ".join(map(str, h["block_tokens"]))
    lines = [] if pc.base is None else [markdown(pc.base), "**With prefix caching on**", ""]
    lines += [f"Fitted on: `{pc.split}` ({fitted} runs, prefix caching off); predicted: "
              f"{t.height} runs with prefix caching on, each replaying its requests' "
              f"block ids from their token ids ({blocks}-token blocks, vLLM's), the "
              "simulator's prefix cache on.", ""]
    outside = [f"{r['run']} median TTFT {r['ttft_error']:+.1%} (allowed "
               f"{r['ttft_allowed']:.1%})" for r in t.iter_rows(named=True)
               if not r["ttft_within"]]
    outside += [f"{r['run']} hit rate {r['hit_rate_diff'] * 100:+.1f} points"
                for r in t.iter_rows(named=True) if not r["hit_rate_within"]]
    lines += [f"**Against the bounds** (median TTFT {BOUNDS['median_ttft_ms']:.0%}, or a "
              f"point's own spread where wider; vLLM's hit rate {HIT_RATE_BOUND * 100:.0f} "
              f"points): median TTFT {h['ttft_within_bounds']} of {t.height} within, hit "
              f"rate {h['hit_rate_within_bounds']} of {t.height} within"
              + ("." if not outside else "; outside: " + ", ".join(outside) + "."), ""]
    lines += ["| run | repeats | median TTFT ms, caching off (measured) | median TTFT ms "
              "meas / sim (err) | hit rate (tokens), vLLM / sim (diff) |",
              "|---|---|---|---|---|"]
    for r in t.iter_rows(named=True):
        rep = r["repeats"] > 1
        off = "" if r["off_ttft_ms"] is None else f"{r['off_ttft_ms']:.3g}"
        ttft = (f"{r['measured_ttft_ms']:.3g}" + (f" ±{r['ttft_spread']:.0%}" if rep else "")
                + f" / {r['simulated_ttft_ms']:.3g} ({r['ttft_error']:+.1%})")
        hit = (f"{r['measured_hit_rate']:.3f}"
               + (f" ±{r['hit_rate_spread']:.3f}" if rep else "")
               + f" / {r['simulated_hit_rate']:.3f} ({r['hit_rate_diff'] * 100:+.1f})")
        lines.append(f"| {r['run']} | {r['repeats']} | {off} | {ttft} | {hit} |")
    lines += ["", pc.fit.line_sentence(), "", "Fitted step cost (ms, ± one standard error): "
              + constants_line(pc.fit.uncertainty, pc.fit.points, pc.fit.steps, pc.fit.lone)
              + f"; {pc.fit.iterations} iterations."]
    return "\n".join(lines) + "\n"


def write_prefix_comparison(pc: PrefixComparison, out: Path) -> dict[str, Path]:
    """``prefix.parquet``, ``comparison.md``, ``comparison.json`` (the caching-off
    headline, where there is one, with ``prefix``), ``profile.toml``, and the caching-off
    comparison's tables where some caching-off runs were held out."""
    from dspark_sim.io import write_atomic
    from dspark_sim.validation.vllm_compare import write_comparison

    out.mkdir(parents=True, exist_ok=True)
    paths = write_comparison(pc.base, out) if pc.base is not None else {}
    paths["prefix"] = write_atomic(out / "prefix.parquet",
                                   lambda p: pc.table.write_parquet(p))
    head = pc.base.headline() if pc.base is not None else {"split": pc.split}
    paths["json"] = write_json_atomic(out / "comparison.json",
                                      {**head, "prefix": pc.headline()})
    paths["markdown"] = write_text_atomic(out / "comparison.md", prefix_markdown(pc))
    paths["profile"] = write_text_atomic(out / "profile.toml", pc.fit.profile.to_toml())
    return paths


def has_caching_runs(runs: list[BenchRun]) -> bool:
    from dspark_sim.validation.vllm_live import caches_prefixes

    return any(caches_prefixes(r.setting) for r in runs)
