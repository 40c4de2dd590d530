"""vLLM's per-request acceptance (``--per-request-spec-decode-metrics detailed``) imported
as a trace: every request's real steps, "no proposal" apart from "proposed and rejected",
replayed per request, and vLLM's tau reproduced. Fixtures: tests/data/vllm-per-request/
(six requests at k = 3, n-gram-like: some steps propose nothing, some propose 2)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from dspark_sim.cli import app
from dspark_sim.errors import InputError
from dspark_sim.traces.importers import import_trace
from dspark_sim.traces.schema import read_trace
from dspark_sim.traces.vllm_per_request import step_rows, vllm_tau

DATA = Path(__file__).parents[1] / "data" / "vllm-per-request"


def _recorded(name: str = "completions.jsonl") -> list[dict]:
    """The fixture's per-request objects, read by hand."""
    out = []
    for line in (DATA / name).read_text().splitlines():
        d = json.loads(line)
        s = d["metrics"]["speculative_decoding"] if "metrics" in d else d
        out.append({"acc": s["per_step_accepted"], "dra": s["per_step_drafted"],
                    "usage": d.get("usage")})
    return out


def test_step_rows_mark_no_proposal_apart_from_rejection():
    # steps: proposed 3 accepted 2; proposed nothing; proposed 3, all rejected; 2 of 2
    m, d, pad = step_rows(np.array([2, 0, 0, 2]), np.array([3, 0, 3, 2]))
    assert m.tolist() == [2, 1, 0, 0, 0, 2, 1, 0]
    assert d.tolist() == [3, 2, 1, 0, 3, 2, 1, 0]
    assert pad == 0
    assert d[3] == 0 and m[3] == 0  # no proposal
    assert d[4] == 3 and m[4] == 0  # proposed and rejected whole
    m, d, pad = step_rows(np.array([1]), np.array([1]), positions=5)
    assert m.tolist() == [1, 0, 0, 0, 0] and d.tolist() == [1, 0, 0, 0, 0] and pad == 3
    m, d, pad = step_rows(np.array([], np.int64), np.array([], np.int64))
    assert m.tolist() == [0] and d.tolist() == [0]  # one token from prefill: one row
    assert vllm_tau(np.array([2, 0, 0, 2]), np.array([3, 0, 3, 2])) == pytest.approx(1 + 4 / 3)


def test_the_three_shapes_import_to_the_same_steps():
    full = import_trace("vllm-per-request", DATA / "completions.jsonl")
    bare = import_trace("vllm-per-request", DATA / "spec-metrics.jsonl")
    chat = import_trace("vllm-per-request", DATA / "chat.json")
    rec = _recorded()
    assert full.num_requests == bare.num_requests == 6 and chat.num_requests == 3
    assert full.gamma_max == 3 and full.meta.source == "imported"
    assert list(full.req_ids) == [f"cmpl-{i:03d}" for i in range(6)]
    assert full.req_output_tokens.tolist() == [r["usage"]["completion_tokens"] for r in rec]
    assert full.meta.extra["request_input_lens"] == [r["usage"]["prompt_tokens"] for r in rec]
    # every step's tokens cover the output after the prefill's first token: nothing padded
    assert full.meta.extra["padded_positions"] == 0
    assert full.req_lengths.tolist() == [r["usage"]["completion_tokens"] - 1 for r in rec]
    # the bare objects carry no lengths, the same rows
    assert bare.req_prompt_tokens is None
    assert np.array_equal(bare.accept_len, full.accept_len)
    assert np.array_equal(bare.draft_tokens, full.draft_tokens)
    n3 = int(full.req_offsets[3])
    assert np.array_equal(chat.accept_len, full.accept_len[:n3])
    assert chat.meta.target == "smollm2-hf"


def test_served_chain_at_k_visits_the_recorded_steps_and_gives_vllms_tau():
    trace = import_trace("vllm-per-request", DATA / "completions.jsonl")
    rec = _recorded()
    tokens, steps = trace.served_tau_per_request(3)
    assert steps.tolist() == [len(r["acc"]) for r in rec]
    assert tokens.tolist() == [sum(r["acc"]) + len(r["acc"]) for r in rec]
    acc = np.concatenate([r["acc"] for r in rec])
    dra = np.concatenate([r["dra"] for r in rec])
    tau = 1 + acc.sum() / (dra > 0).sum()  # vLLM: per step with a proposal
    assert trace.meta.extra["vllm_acceptance_length"] == pytest.approx(tau, abs=1e-6)
    assert 1 + trace.served_survival(3).sum() == pytest.approx(tau, rel=1e-12)
    # per request-step (every step, with or without a proposal) it is lower
    assert trace.served_tau(3) == pytest.approx((acc + 1).sum() / acc.size)
    assert trace.served_tau(3) < tau


def test_per_request_trace_replays_each_requests_steps_in_the_simulator(tmp_path):
    """Closed loop, each request pinned to its own row (the paired replay): the simulated
    fixed:3 run takes each request's recorded steps, accepts its recorded drafts, and its
    acceptance length is vLLM's."""
    from dspark_sim.calibration.profile import EngineLimits
    from dspark_sim.sim.api import simulate
    from dspark_sim.sim.config import DeploymentConfig, EngineConfig, SimConfig, WorkloadConfig
    from dspark_sim.validation.vllm_fit import make_profile

    trace = import_trace("vllm-per-request", DATA / "completions.jsonl")
    rec = _recorded()
    wl = tmp_path / "w.jsonl"
    wl.write_text("".join(json.dumps({"timestamp": 0.0, "input_length": r["usage"]["prompt_tokens"],
                                      "output_length": r["usage"]["completion_tokens"]}) + "\n"
                          for r in rec))
    engine = EngineConfig(max_num_seqs=8, max_num_batched_tokens=1024, prefill="chunked")
    profile = make_profile(np.array([10.0, 0.1, 0.5, 0.1, 1.0, 0.5, 0.1]), name="t",
                           max_batched_tokens=1024,
                           limits=EngineLimits(max_num_seqs=8, max_num_batched_tokens=1024,
                                               prefill="chunked"))
    cfg = SimConfig(engine=engine, deployment=DeploymentConfig(replicas=1),
                    workload=WorkloadConfig(arrival="closed", max_concurrency=2,
                                            workload_path=str(wl), num_requests=None),
                    policy="fixed:3", seed=0)
    res = simulate(cfg, profile=profile, trace=trace, trace_rows=np.arange(6))
    req = res.requests.sort("request_id")
    assert req["trace_row"].to_list() == list(range(6))
    assert req["steps"].to_list() == [len(r["acc"]) for r in rec]
    assert req["accepted_tokens"].to_list() == [sum(r["acc"]) for r in rec]
    acc = np.concatenate([r["acc"] for r in rec])
    dra = np.concatenate([r["dra"] for r in rec])
    tau = res.summary["spec_decode_acceptance_length"]
    assert tau == pytest.approx(1 + acc.sum() / (dra > 0).sum(), rel=0.02)


def test_cli_imports_and_writes_the_no_proposal_column(tmp_path):
    out = tmp_path / "t.parquet"
    r = CliRunner().invoke(app, ["traces", "import", "--format", "vllm-per-request",
                                 str(DATA / "completions.jsonl"), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "vLLM acceptance length" in r.output
    t = read_trace(out)
    assert t.draft_tokens is not None and (t.draft_tokens == 0).any()
    assert ((t.draft_tokens > 0) & (t.accept_len == 0)).any()  # rejected, not unproposed
    bad = CliRunner().invoke(app, ["traces", "import", "--format", "vllm-per-request",
                                   str(DATA / "completions.jsonl"), "--out", str(out),
                                   "--requests", "4"])
    assert bad.exit_code == 2 and "--requests" in bad.output


@pytest.mark.parametrize(("text", "match"), [
    ('{"metrics": {"speculative_decoding": null}}', "not speculated"),
    ('{"per_step_accepted": [1], "num_spec_steps": 1}', "per_step_drafted"),
    ('{"per_step_accepted": [1, 0], "per_step_drafted": [3]}', "has 2 steps"),
    ('{"per_step_accepted": [2], "per_step_drafted": [1]}', "step 0 accepted 2 drafts of 1"),
    ('{"per_step_accepted": [1.0], "per_step_drafted": [3]}', "list of counts"),
    ('{"per_step_accepted": [1], "per_step_drafted": [3], "num_accepted_draft_tokens": 2}',
     "not the sum"),
    ('{"per_step_accepted": [1], "per_step_drafted": [3], "num_spec_tokens": 2}',
     "below a step's proposed"),
    ('{"choices": [{"text": "x"}]}', "no per-request speculative-decoding metrics"),
    ('{"per_step_accepted": [1], "per_step_drafted": [3]}\n[1]', "line 2: expected a JSON"),
    ("", "is empty"),
])
def test_bad_input_is_refused_in_one_line_naming_the_file(tmp_path, text, match):
    src = tmp_path / "r.jsonl"
    src.write_text(text)
    with pytest.raises(InputError, match=match) as exc:
        import_trace("vllm-per-request", src)
    assert exc.value.where == str(src) and "\n" not in str(exc.value)
