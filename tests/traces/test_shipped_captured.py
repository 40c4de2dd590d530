"""The shipped captured SmolLM2 traces carry schema v2 and its fields agree with each
other, with the v1 columns and across the four drafters (one target stream).

Every expectation is derived from the files themselves or from how the fields are
defined (docs/traces.md, "Schema v2"), never from numbers copied out of them: the chain's
``accept_len`` (verified against the target's recorded tokens) must equal the run of
leading teacher-forced rank-0 depths; a rank inside the top K must point at the
alternative whose probability is the true token's; an accepted chain token is the
target's argmax, so its target logit is the row's top-1 logit; depth j at position t is
judged by the same target row as depth 1 at position t + j - 1."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest

from dspark_sim.traces.schema import read_trace
from dspark_sim.traces.schema_v2 import COLUMNS, TOPK

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "traces" / "data"
LEARNED = ("mtp1", "parallel", "dspark")
DRAFTERS = (*LEARNED, "lookup")
# what a drafter without distributions (lookup: n-gram copies) cannot record
DISTRIBUTION_COLUMNS = {"alt_prob", "true_rank", "true_prob", "draft_entropy"}


@pytest.fixture(scope="module")
def traces():
    return {d: read_trace(DATA / f"captured-smollm2-{d}.parquet") for d in DRAFTERS}


def _datasets(tr) -> np.ndarray:
    """Each request's dataset: request ids index the capture's prompt keys."""
    keys = tr.meta.generator["prompts"]["keys"]
    return np.array([keys[int(r)].split(":")[0] for r in tr.req_ids])


@pytest.mark.parametrize("name", DRAFTERS)
def test_shipped_trace_is_schema_v2_with_its_columns(traces, name):
    tr = traces[name]
    assert tr.schema_version == 2 and tr.v2 is not None
    assert tr.meta.source == "captured" and tr.meta.temperature == 0.0
    want = set(COLUMNS) - (DISTRIBUTION_COLUMNS if name == "lookup" else set())
    assert set(tr.v2.present()) == want
    # the calibration map fitted on the v1 columns still travels with the trace
    assert tr.meta.extra.get("calibration", "").startswith(f"smollm2-{name}-")


@pytest.mark.parametrize("name", LEARNED)
def test_shipped_trace_came_from_the_shipped_drafter(traces, name):
    blob = (DATA / "drafters" / name / "drafter.safetensors").read_bytes()
    assert traces[name].meta.extra["drafter_checkpoint_sha256"] == hashlib.sha256(blob).hexdigest()
    # the trace states the drafter's whole training budget (a warm start's chain included)
    side = json.loads((DATA / "drafters" / name / "drafter.json").read_text())
    assert traces[name].meta.extra["drafter_train_steps"] == side.get("total_steps", side["steps"])


def _chain(tr):
    """A shipped trace's schema-v2 fields, its gamma, the chain's accepted length per
    position (int64) and the depth index row [1, gamma] to compare them against."""
    return tr.v2, tr.gamma_max, tr.accept_len.astype(np.int64), np.arange(tr.gamma_max)[None, :]


@pytest.mark.parametrize("name", LEARNED)
def test_tree_fields_agree_with_the_chain(traces, name):
    v, g, m, depth = _chain(traces[name])
    rank = v.true_rank.astype(np.int64)
    # the chain accepts exactly the leading depths where the teacher-forced drafter's
    # argmax is the target's token (brute force over rows, not tree_accept_len)
    lead = np.array([next((j for j in range(g) if rank[i, j] != 0), g) for i in range(len(m))])
    assert np.array_equal(lead, m)
    assert np.array_equal(v.tree_accept_len(1), m)
    assert np.all(rank[depth < m[:, None]] == 0)
    # -1 (no target token: past EOS) only as a suffix of the depths
    known = rank >= 0
    assert np.all(known[:, :1]) and np.all(np.diff(known.astype(np.int8), axis=1) <= 0)
    # wider trees accept at least as much, never more than gamma
    widths = np.stack([v.tree_accept_len(w) for w in range(1, TOPK + 1)])
    assert np.all(np.diff(widths, axis=0) >= 0) and widths.max() <= g
    assert widths[-1].mean() > widths[0].mean()  # alternatives do get accepted
    # alt_prob descending; rank r < K points at the slot holding the true token's
    # probability; a rank >= K means the true token is less likely than slot K-1
    alt = v.alt_prob.astype(np.float32)
    tp = v.true_prob.astype(np.float32)
    assert np.all(np.diff(alt, axis=2) <= 0)
    in_k = known & (rank < TOPK)
    slot = np.take_along_axis(alt, np.clip(rank, 0, TOPK - 1)[..., None], 2)[..., 0]
    assert np.array_equal(slot[in_k], tp[in_k])
    assert np.all(tp[rank >= TOPK] <= alt[..., TOPK - 1][rank >= TOPK])
    assert np.all(alt[~known] == 0) and np.all(tp[~known] == 0)
    # on accepted depths the chain token is the true token on the true prefix: the
    # chain's own probability is the teacher-forced one
    acc = depth < m[:, None]
    assert np.array_equal(v.draft_prob[acc], v.true_prob[acc])
    # run_after: after an accepted depth j the chain goes on accepting m - j - 1 more
    ra = v.run_after().astype(np.int64)
    rows, cols = np.nonzero(acc)
    assert np.all(ra[rows, cols] >= m[rows] - cols - 1)


@pytest.mark.parametrize("name", DRAFTERS)
def test_lossy_fields_agree_with_the_chain(traces, name):
    tr = traces[name]
    v, g, m, depth = _chain(tr)
    top = v.tgt_top1_logit.astype(np.float32)
    dl = v.draft_tgt_logit.astype(np.float32)
    acc = depth < m[:, None]
    # an accepted chain token is the target's argmax: regret exactly 0
    assert np.array_equal(dl[acc], top[acc])
    assert np.all(v.regret()[acc] == 0)
    assert np.all(dl <= top)  # nothing beats the top-1 logit
    # a rejected first depth has positive regret except at float16 ties (rare)
    rej = (depth == m[:, None]) & (dl != 0)
    assert np.mean(dl[rej] == top[rej]) < 0.01
    # depth j at position t is judged by the target row of position t + j - 1: the same
    # top-1 logit as depth 1 there (within a request, where that depth has a draft)
    for r in range(tr.num_requests):
        lo, hi = tr.req_offsets[r], tr.req_offsets[r + 1]
        t = top[lo:hi]
        for j in range(1, g):
            a, b = t[: hi - lo - j, j], t[j:, 0]
            have = (a != 0) & (b != 0)  # both depths drafted (lookup may have no draft)
            assert np.array_equal(a[have], b[have])
    if name == "lookup":  # one-hot drafts: probability 1 where a draft exists
        assert set(np.unique(v.draft_prob.astype(np.float32))) <= {0.0, 1.0}
        assert np.all(v.draft_prob[acc] == 1)
    else:
        p = v.draft_prob.astype(np.float32)
        assert np.all((p >= 0) & (p <= 1)) and np.all(v.draft_entropy >= 0)


def test_one_target_stream_across_the_drafters(traces):
    """The four traces replay the same greedy target output: the target-side columns,
    the correctness labels and the request layout are identical."""
    base = traces["mtp1"]
    for name in DRAFTERS[1:]:
        tr = traces[name]
        assert np.array_equal(tr.req_ids, base.req_ids)
        assert np.array_equal(tr.req_lengths, base.req_lengths)
        for col in ("tgt_token", "target_entropy", "req_correct"):
            assert np.array_equal(getattr(tr.v2, col), getattr(base.v2, col)), (name, col)
        if name in LEARNED:  # lookup zeroes the rows where it has no draft
            assert np.array_equal(tr.v2.tgt_top1_logit, base.v2.tgt_top1_logit)
    assert np.all(base.v2.target_entropy >= 0)
    assert np.all(base.v2.tgt_token >= 0)


def test_correctness_labels_only_where_an_answer_key_ships(traces):
    """req_correct is 1/0 exactly for the GSM8K requests (the dataset with an answer key
    under traces/data/answers) and -1 elsewhere; one value per request."""
    tr = traces["dspark"]
    keyed = {p.stem for p in (DATA / "answers").glob("*.json")}
    ds = _datasets(tr)
    rc = tr.v2.req_correct
    assert rc.shape == (tr.num_requests,)
    assert np.all(np.isin(rc[np.isin(ds, list(keyed))], (0, 1)))
    assert np.all(rc[~np.isin(ds, list(keyed))] == -1)
    assert "gsm8k" in keyed and np.any(ds == "gsm8k")


def test_capture_doc_quotes_the_shipped_gsm8k_accuracy_and_sizes(traces):
    """docs/traces-capture.md states the target's GSM8K exact match on the shipped
    traces ("GSM8K exact match ... **k / n**") and each file's size in MB."""
    text = (ROOT / "docs" / "traces-capture.md").read_text()
    m = re.search(r"GSM8K exact match[^*]*\*\*(\d+) / (\d+)\*\*", text)
    assert m, "docs/traces-capture.md no longer states the GSM8K exact match"
    tr = traces["dspark"]
    gsm = tr.v2.req_correct[_datasets(tr) == "gsm8k"]
    assert (int(m.group(1)), int(m.group(2))) == (int((gsm == 1).sum()), len(gsm))
    for name in DRAFTERS:
        mm = re.search(rf"`captured-smollm2-{name}\.parquet` \| ([\d.]+) MB", text)
        assert mm, f"docs/traces-capture.md has no size for the {name} trace"
        size = (DATA / f"captured-smollm2-{name}.parquet").stat().st_size / 1e6
        assert float(mm.group(1)) == pytest.approx(size, abs=0.01)
