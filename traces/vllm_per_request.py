"""vLLM's own per-request acceptance -> a schema-v1 trace with each request's real steps.

A vLLM server started with ``--per-request-spec-decode-metrics detailed`` returns, with
each response, the ordered count of drafts proposed and accepted at every verify step of
that request: ``metrics.speculative_decoding.per_step_drafted`` and ``per_step_accepted``.
A step listed with drafted 0 is a step where the drafter proposed nothing; vLLM 0.32's
n-gram runs list only the steps that verified a proposal (every recorded step drafts
``k``), and their other steps show only in the response's token count (padded below). The
importer reads any of:

* a JSON file holding one response or a list of them, or a JSONL of responses, one per
  line (``/v1/completions`` or ``/v1/chat/completions``; the counts are read from the
  response's ``metrics.speculative_decoding``, else from each choice's
  ``speculative_decoding_stats``, one request per choice);
* a JSONL of just the ``metrics.speculative_decoding`` objects, one per request.

Each request becomes the trace rows of its own steps, as a fixed-``K`` chain replays
them: the step that starts at output position ``t`` (``t`` = the tokens its earlier steps
produced, accepted drafts + 1 each) is row ``t`` with ``accept_len`` = its accepted
drafts and ``draft_tokens`` = its proposed drafts, so ``draft_tokens`` 0 is a step with
**no proposal** and ``draft_tokens > 0, accept_len 0`` a proposal that was rejected
whole. Rows inside an accepted run (``t + j``, ``1 <= j <= accepted``) hold the rest of
the same draft (``accept_len - j``, ``draft_tokens - j``): what a policy that verified
fewer drafts at ``t`` would have found next. A ``fixed:K`` replay at the server's ``K``
(or any larger ``k``) therefore visits exactly the recorded steps, in order, and its
acceptance length ``1 + accepted / steps with a proposal`` is vLLM's for the same
requests. Where the response's usage says more tokens were generated than the steps
cover (the first token comes from prefill), the rest is padded with no-proposal rows and
counted in the metadata (``padded_positions``). The response does not say where those
steps fell, so they follow the recorded ones: spreading them evenly between them instead
moves the simulated n-gram runs of ``tests/data/vllm-cpu/run-4`` at four requests a
further 4-7 % above vLLM's throughput, so the order as given is kept.

Malformed input raises :class:`~dspark_sim.errors.InputError` naming the file and line
(or item).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from dspark_sim.errors import InputError
from dspark_sim.io import loads_json, not_a_file
from dspark_sim.traces.schema import INT32_MAX, AcceptanceTrace, TraceMeta

FORMAT = "vllm-per-request"
GAMMA_LIMIT = 127  # accept_len and draft_tokens are stored as int8
SERVER_FLAG = ("--per-request-spec-decode-metrics", "detailed")


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= INT32_MAX


def _items(p: Path, where: str):
    """``(label, object)`` per response or metrics object: a JSON document (an object or a
    list of them) or JSONL, one per non-blank line."""
    try:
        text = p.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(where, f"not UTF-8 text ({exc.reason})") from None
    except OSError as exc:
        raise InputError(where, f"cannot read ({exc.strerror})") from None
    if not text.strip():
        raise InputError(where, "is empty: no responses")
    try:
        doc = loads_json(text)
    except json.JSONDecodeError:
        doc = None  # JSONL, read line by line below
    if isinstance(doc, dict):
        yield "the response", doc
        return
    if isinstance(doc, list):
        for i, d in enumerate(doc):
            if not isinstance(d, dict):
                raise InputError(where, f"item {i}: expected a JSON object")
            yield f"item {i}", d
        return
    from dspark_sim.traces.importers import json_lines

    for i, d in json_lines(p, where):
        yield f"line {i}", d


def _requests_of(d: dict, label: str, where: str) -> list[tuple[Any, dict, dict | None]]:
    """``(request id or None, speculative object, usage or None)`` for each request in
    one item."""
    if "per_step_accepted" in d or "per_step_drafted" in d:
        return [(d.get("request_id"), d, None)]
    usage = d.get("usage") if isinstance(d.get("usage"), dict) else None
    rid = d.get("id")
    metrics = d.get("metrics")
    if isinstance(metrics, dict) and "speculative_decoding" in metrics:
        return [(rid, _spec_object(metrics["speculative_decoding"], label, where), usage)]
    choices = d.get("choices")
    if isinstance(choices, list) and any(isinstance(c, dict) and "speculative_decoding_stats"
                                         in c for c in choices):
        out = []
        for j, c in enumerate(choices):
            cid = rid if len(choices) == 1 or rid is None else f"{rid}-{j}"
            out.append((cid, _spec_object(c.get("speculative_decoding_stats"), label, where),
                        usage if len(choices) == 1 else None))
        return out
    raise InputError(where, f"{label}: no per-request speculative-decoding metrics (a "
                            "response's metrics.speculative_decoding, or an object with "
                            "per_step_accepted and per_step_drafted)")


def _spec_object(s: Any, label: str, where: str) -> dict:
    if not isinstance(s, dict):
        raise InputError(where, f"{label}: speculative-decoding metrics are {s!r}: the "
                                "request was not speculated, or the server ran without "
                                f"{' '.join(SERVER_FLAG)}")
    return s


def _steps(s: dict, label: str, where: str) -> tuple[np.ndarray, np.ndarray]:
    acc, dra = s.get("per_step_accepted"), s.get("per_step_drafted")
    if acc is None or dra is None:
        raise InputError(where, f"{label}: no per_step_accepted / per_step_drafted (the "
                                f"server's per-request metrics must be 'detailed': "
                                f"{' '.join(SERVER_FLAG)})")
    for name, v in (("per_step_accepted", acc), ("per_step_drafted", dra)):
        if not isinstance(v, list) or not all(_is_count(x) for x in v):
            raise InputError(where, f"{label}: {name} must be a list of counts >= 0")
    if len(acc) != len(dra):
        raise InputError(where, f"{label}: per_step_accepted has {len(acc)} steps, "
                                f"per_step_drafted {len(dra)}")
    a = np.asarray(acc, np.int64)
    d = np.asarray(dra, np.int64)
    over = np.flatnonzero(a > d)
    if over.size:
        i = int(over[0])
        raise InputError(where, f"{label}: step {i} accepted {a[i]} drafts of {d[i]} "
                                "proposed")
    _check_totals(s, a, d, label, where)
    return a, d


def _check_totals(s: dict, a: np.ndarray, d: np.ndarray, label: str, where: str) -> None:
    """The summary fields beside the arrays, where present, must be their sums (a file
    whose arrays were cut or edited says so here, not in a wrong trace)."""
    for key, want in (("num_accepted_draft_tokens", int(a.sum())),
                      ("num_draft_tokens", int(d.sum()))):
        if key in s and s[key] != want:
            raise InputError(where, f"{label}: {key} {s[key]!r} is not the sum of the "
                                    f"per-step counts ({want})")
    # steps are counted with or without the no-proposal ones, by engine version
    if "num_spec_steps" in s and s["num_spec_steps"] not in (len(a), int((d > 0).sum())):
        raise InputError(where, f"{label}: num_spec_steps {s['num_spec_steps']!r} is "
                                f"neither the per-step arrays' length ({len(a)}) nor "
                                f"their steps with a proposal ({int((d > 0).sum())})")


def step_rows(accepted: np.ndarray, drafted: np.ndarray, positions: int | None = None
              ) -> tuple[np.ndarray, np.ndarray, int]:
    """One request's trace rows ``(accept_len, draft_tokens, padded)`` from its per-step
    counts (see the module docstring); ``positions``: at least this many rows, padded
    with no-proposal rows."""
    a = np.asarray(accepted, np.int64)
    d = np.asarray(drafted, np.int64)
    run = a + 1
    starts = np.r_[0, np.cumsum(run)[:-1]].astype(np.int64) if a.size else np.zeros(0, np.int64)
    step = np.repeat(np.arange(a.size), run)
    j = np.arange(step.size) - starts[step]
    m = a[step] - j
    dt = np.maximum(d[step] - j, 0)
    want = max(1, int(positions or 0))  # a request with no decode step still has a row
    pad = max(0, want - m.size)
    if pad:
        m = np.r_[m, np.zeros(pad, np.int64)]
        dt = np.r_[dt, np.zeros(pad, np.int64)]
    return m, dt, pad


def vllm_tau(accepted: np.ndarray, drafted: np.ndarray) -> float | None:
    """vLLM's mean acceptance length: ``1 + accepted / steps with a proposal`` (a step
    the drafter proposed nothing at is no draft in vLLM's counters)."""
    steps = int((np.asarray(drafted) > 0).sum())
    return 1.0 + float(np.sum(accepted)) / steps if steps else None


def import_vllm_per_request(src: str | Path, *, drafter: str = "vllm", target: str | None = None,
                            domain: str | None = None, gamma_max: int | None = None
                            ) -> AcceptanceTrace:
    """Read ``src`` (see the module docstring) into a trace, one request per response
    (per choice), in file order."""
    p = Path(src)
    where = str(src)
    if not p.is_file():
        raise InputError(where, not_a_file(p, "source file"))
    ids, rows_m, rows_d, prompt, output, pads = [], [], [], [], [], []
    acc_all, dra_all = [], []
    k_max = 0
    model = None
    for label, item in _items(p, where):
        model = model or (item.get("model") if isinstance(item.get("model"), str) else None)
        for rid, s, usage in _requests_of(item, label, where):
            a, d = _steps(s, label, where)
            k = s.get("num_spec_tokens")
            if k is not None and not (_is_count(k) and k >= int(d.max(initial=0))):
                raise InputError(where, f"{label}: num_spec_tokens {k!r} is below a step's "
                                        f"proposed drafts ({int(d.max(initial=0))})")
            k_max = max(k_max, int(k or 0), int(d.max(initial=0)))
            n_out = usage.get("completion_tokens") if usage else None
            n_in = usage.get("prompt_tokens") if usage else None
            for name, v in (("completion_tokens", n_out), ("prompt_tokens", n_in)):
                if v is not None and not _is_count(v):
                    raise InputError(where, f"{label}: usage.{name} must be a count, "
                                            f"got {v!r}")
            # the first token is the prefill's: the steps produce the rest
            m, dt, pad = step_rows(a, d, None if n_out is None else n_out - 1)
            rows_m.append(m)
            rows_d.append(dt)
            pads.append(pad)
            acc_all.append(a)
            dra_all.append(d)
            ids.append(rid)
            prompt.append(n_in)
            output.append(n_out)
    if not rows_m:
        raise InputError(where, "no requests")
    g = k_max if gamma_max is None else gamma_max
    if isinstance(g, bool) or not isinstance(g, int) or not 1 <= g <= GAMMA_LIMIT:
        raise InputError("--gamma-max" if gamma_max is not None else where,
                         f"gamma_max must be an integer in [1, {GAMMA_LIMIT}], got {g!r}")
    if g < k_max:
        raise InputError("--gamma-max", f"{g} is below the {k_max} drafts a step proposed: "
                                        "the recorded steps would not replay")
    return _trace(where, ids, rows_m, rows_d, prompt, output, pads,
                  np.concatenate(acc_all), np.concatenate(dra_all), g,
                  drafter=drafter, target=target or model or "vLLM",
                  domain=domain or "vllm")


def _trace(where, ids, rows_m, rows_d, prompt, output, pads, acc, dra, g, *, drafter,
           target, domain) -> AcceptanceTrace:
    n = len(rows_m)
    if any(x is None for x in ids) or len(set(map(str, ids))) != n:
        req_ids = np.arange(n, dtype=np.int32)  # file order
    else:
        req_ids = np.asarray([str(x) for x in ids], dtype=str)
    lengths = np.array([len(m) for m in rows_m], np.int64)
    has_len = all(x is not None for x in prompt) and all(x is not None for x in output)
    steps = int(acc.size)
    proposals = int((dra > 0).sum())
    tau = vllm_tau(acc, dra)
    extra = {"import_format": FORMAT, "source_file": Path(where).name,
             "verify_steps": steps, "steps_with_proposal": proposals,
             "steps_without_proposal": steps - proposals,
             "vllm_acceptance_length": None if tau is None else round(tau, 6),
             "tokens_per_request_step": round(float((acc + 1).sum()) / max(steps, 1), 6),
             "padded_positions": int(sum(pads))}
    if has_len:
        # the paired replay matches a bench run's requests to these rows by prompt length
        extra["request_input_lens"] = [int(x) for x in prompt]
    meta = TraceMeta(drafter=drafter, target=target, gamma_max=g, source="imported",
                     temperature=0.0, domains=(domain,),
                     generator={"kind": FORMAT, "num_speculative_tokens": g}, extra=extra)
    return AcceptanceTrace(
        meta=meta, accept_len=np.concatenate(rows_m).astype(np.int8), conf=None,
        req_offsets=np.r_[0, np.cumsum(lengths)].astype(np.int64),
        req_domain=np.full(n, domain), req_ids=req_ids, source_path=where,
        req_prompt_tokens=np.asarray(prompt, np.int64) if has_len else None,
        req_output_tokens=np.asarray(output, np.int64) if has_len else None,
        draft_tokens=np.concatenate(rows_d).astype(np.int8))
