"""Each speculative setting's acceptance in the fit and the comparison: its own measured
per-request trace where the run folder has one, else the pooled counters.

``vllm measure`` saves, per speculative setting, one pass of every prompt through the
server's API with vLLM's per-request, per-step proposed and accepted drafts:
``acceptance/<setting>.jsonl`` beside ``runs/``. Where that file is there, every bench run
of the setting replays it (:func:`dspark_sim.traces.vllm_per_request.import_vllm_per_request`),
request by request: each ``k`` measured, none extrapolated, and a ``fixed:k`` replay
visits the steps the server reported, so the simulated acceptance length is vLLM's for
the same requests. Where it is missing (bench files from elsewhere, ``--no-per-request``,
the recorded runs from before the pass), the setting replays the trace pooled from the
fitted runs' counters (:func:`dspark_sim.validation.vllm_fit.pooled_trace`: largest
fitted ``k``, positions past it extrapolated), and a warning says so.

**Matching a bench request to its trace row.** The benchmark samples the prompt file in a
seeded shuffle while the acceptance pass sends it in file order, and a bench result holds
no prompt text, only each request's prompt length in tokens (``input_lens``) and, with
``--save-detailed``, its generated text. A request is matched:

1. by its prompt length, allowing one constant offset for the whole run (the bench counts
   the templated prompt with the tokenizer's own special tokens, so a tokenizer that adds
   a BOS counts one more than the chat API's ``usage.prompt_tokens``): the offset in
   ``0, +1, -1, +2, -2`` that matches the most requests;
2. among prompts of that length, to the one whose generated text is the request's
   (greedy decoding gives a prompt the same text in both passes);
3. else to the least-used of them in file order (prompts of equal length whose text
   differs or is missing; a run that sends a prompt twice reuses its row).

This relies on nothing in the benchmark's sampling (its shuffle, its seed, how it
oversamples), only on what both passes record. A request whose length matches no row is
given a row drawn from a seeded generator, and counted in a warning.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dspark_sim.errors import InputError
from dspark_sim.traces.schema import AcceptanceTrace

if TYPE_CHECKING:
    from dspark_sim.validation.vllm_fit import BenchRun

FOLDER = "acceptance"
OFFSETS = (0, 1, -1, 2, -2)  # prompt-length offsets tried, bench minus API


def acceptance_file(run: BenchRun) -> Path | None:
    """``acceptance/<setting>.jsonl`` beside the run's file, or beside its ``runs/``
    folder (``vllm measure``'s layout); None where neither exists."""
    for folder in (run.path.parent, run.path.parent.parent):
        p = folder / FOLDER / f"{run.setting}.jsonl"
        if p.is_file():
            return p
    return None


def expected_file(run: BenchRun) -> Path:
    """Where ``vllm measure`` would have written the run's acceptance file."""
    folder = run.path.parent.parent if run.path.parent.name == "runs" else run.path.parent
    return folder / FOLDER / f"{run.setting}.jsonl"


def response_texts(path: Path) -> list[str | None]:
    """The generated text of every request in an acceptance file, in file order (None for
    a line without one, e.g. a bare metrics object)."""
    out: list[str | None] = []
    for line in path.read_text(encoding="utf-8-sig").splitlines():
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            return []  # a JSON document, not JSONL: match on lengths alone
        choices = d.get("choices") if isinstance(d, dict) else None
        if not isinstance(choices, list) or not choices:
            out.append(None)
            continue
        for c in choices:
            msg = c.get("message") if isinstance(c, dict) else None
            text = msg.get("content") if isinstance(msg, dict) else (
                c.get("text") if isinstance(c, dict) else None)
            out.append(text if isinstance(text, str) else None)
    return out


def _positions(first: int, last: int) -> str:
    return f"position {first}" if first == last else f"positions {first}-{last}"


@dataclass(frozen=True, eq=False)
class Measured:
    """One setting's measured per-request trace, with what its rows are matched on."""

    setting: str
    path: Path
    trace: AcceptanceTrace
    texts: tuple[str | None, ...]  # per trace row, its generated text (may be empty)


def match_rows(bench_prompt: np.ndarray, bench_texts: list[str] | None,
               row_prompt: np.ndarray, row_texts: tuple[str | None, ...]
               ) -> tuple[np.ndarray, np.ndarray]:
    """Each bench request's trace row (see the module docstring) and a mask of the
    requests whose prompt length matched no row (their entry is -1)."""
    bench = np.asarray(bench_prompt, np.int64)
    rows_len = np.asarray(row_prompt, np.int64)
    present = set(rows_len.tolist())
    offset = max(OFFSETS, key=lambda d: sum(int(x) - d in present for x in bench))
    by_len: dict[int, list[int]] = {}
    for r, n in enumerate(rows_len.tolist()):
        by_len.setdefault(n, []).append(r)
    texts = bench_texts if bench_texts is not None and len(bench_texts) == len(bench) \
        and len(row_texts) == len(rows_len) else None
    used: Counter[int] = Counter()
    out = np.full(len(bench), -1, np.int64)
    for i, n in enumerate(bench.tolist()):
        cands = by_len.get(n - offset)
        if not cands:
            continue
        if texts is not None:
            same = [r for r in cands if row_texts[r] is not None and row_texts[r] == texts[i]]
            cands = same or cands
        r = min(cands, key=lambda r: (used[r], r))
        used[r] += 1
        out[i] = r
    return out, out < 0


@dataclass(frozen=True, eq=False)
class SettingTraces:
    """What every speculative run replays: its setting's measured trace (``measured``,
    with each run's matched rows in ``rows``, by file), else ``pooled``."""

    measured: dict[str, Measured] = field(default_factory=dict)
    pooled: AcceptanceTrace | None = None
    pooled_from: str = ""  # the runs the pooled counters came from
    rows: dict[Path, np.ndarray] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    sources: dict[str, str] = field(default_factory=dict)  # per setting, in words

    def for_run(self, run: BenchRun) -> tuple[AcceptanceTrace | None, np.ndarray | None]:
        """The run's trace and, where each request has its own row, the rows (request
        order); ``(None, None)`` for a run without speculation."""
        from dspark_sim.validation.vllm_fit import paired_rows, trace_for_k

        if run.k == 0:
            return None, None
        m = self.measured.get(run.setting)
        if m is not None:
            return m.trace, self.rows.get(run.path)
        trace = trace_for_k(self.pooled, run.k, run.name)
        return trace, paired_rows(run, trace)

    def headline(self, runs: list[BenchRun]) -> AcceptanceTrace | None:
        """The one trace a calibration writes: that of the largest ``k`` in ``runs``,
        measured where it was, else the pooled one."""
        spec = [r for r in runs if r.k]
        if not spec:
            return self.pooled
        top = max(spec, key=lambda r: (r.k, r.setting in self.measured))
        m = self.measured.get(top.setting)
        return m.trace if m is not None else self.pooled


def setting_traces(runs: list[BenchRun], pooled_from: list[BenchRun], seed: int = 0
                   ) -> SettingTraces:
    """Each speculative setting of ``runs``: its measured trace where its acceptance file
    is there, else the counters of ``pooled_from``'s largest ``k`` (one warning line per
    setting so substituted, saying with what)."""
    from dspark_sim.traces.vllm_per_request import import_vllm_per_request
    from dspark_sim.validation.vllm_fit import pooled_trace

    settings: dict[str, list[BenchRun]] = {}
    for r in runs:
        if r.k:
            settings.setdefault(r.setting, []).append(r)
    measured: dict[str, Measured] = {}
    for s, rs in settings.items():
        path = next((p for p in map(acceptance_file, rs) if p is not None), None)
        if path is None:
            continue
        trace = import_vllm_per_request(path, drafter="vllm", domain="vllm")
        k = max(r.k for r in rs)
        if trace.gamma_max < k:
            raise InputError(str(path), f"proposes at most {trace.gamma_max} drafts a step, "
                                        f"but {s}'s runs speculate {k}: not this setting's "
                                        "acceptance")
        measured[s] = Measured(s, path, trace, tuple(response_texts(path)))
    missing = [s for s in settings if s not in measured]
    pooled = pooled_trace(pooled_from, seed) if missing or not measured else None
    names = pooled.meta.extra.get("pooled_runs", "") if pooled is not None else ""
    warnings: list[str] = []
    sources: dict[str, str] = {}
    rng = np.random.default_rng(seed)
    rows: dict[Path, np.ndarray] = {}
    for s, rs in settings.items():
        m = measured.get(s)
        if m is None:
            k = max(r.k for r in rs)
            src = "pooled counters" + (f" of {names}" if names else "") + (
                f", {_positions(pooled.gamma_max + 1, k)} extrapolated from k = "
                f"{pooled.gamma_max}" if pooled is not None and k > pooled.gamma_max else "")
            what = "has no trace: no speculative run is fitted to pool counters from" \
                if pooled is None else f"replays the {src}"
            warnings.append(f"{expected_file(rs[0])}: not found (vllm measure's per-request "
                            f"pass): {s} {what}")
            sources[s] = src
            continue
        sources[s] = f"measured per request ({m.path.parent.name}/{m.path.name})"
        lens = m.trace.req_prompt_tokens
        unmatched = total = 0
        for r in rs:
            total += len(r.prompt_tokens)
            if lens is None or any("per-request lengths" in x for x in r.substituted):
                rows[r.path] = rng.integers(0, m.trace.num_requests, len(r.prompt_tokens))
                unmatched += len(r.prompt_tokens)
                continue
            got, miss = match_rows(r.prompt_tokens, r.generated_texts, lens, m.texts)
            got[miss] = rng.integers(0, m.trace.num_requests, int(miss.sum()))
            rows[r.path] = got
            unmatched += int(miss.sum())
        if unmatched:
            why = "its responses carry no usage.prompt_tokens" if lens is None else \
                "their prompt lengths match no response's"
            warnings.append(f"{m.path}: {unmatched} of {total} bench requests of {s} have no "
                            f"row ({why}): each replays a row drawn at random")
    return SettingTraces(measured, pooled, names, rows, tuple(warnings), sources)
