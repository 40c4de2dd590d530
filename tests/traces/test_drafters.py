"""Drafters and their training on a tiny random-weight Llama target (seconds on CPU)."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from capture_env import VOCAB, tiny_prompts, tiny_target  # noqa: E402

from dspark_sim.traces import drafters as D  # noqa: E402
from dspark_sim.traces.targets import Prompt  # noqa: E402
from dspark_sim.traces.train import train_drafter  # noqa: E402

# Slow (trains drafters on the real target): out of the default run, in .ci/run's slow leg.
pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(2)
    return tiny_target()


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_SIM_CACHE", str(tmp_path / "cache"))


def _store(target, n=6, new=24):
    from dspark_sim.traces.targets import generate_cached

    layers = target.feature_layers(3) + [target.num_layers]
    recs = generate_cached(target, tiny_prompts(n), new, layers, batch_size=4)
    return D.SequenceStore.from_records(recs)


def test_greedy_matches_full_forward(target):
    recs = target.greedy([[1, 5, 6, 7], [1, 9, 9]], 10, layers=[2])
    for r in recs:
        seq = torch.cat([r["prompt"], r["tokens"]])
        # brute force: re-decode one token at a time without cache or padding
        cur = r["prompt"].tolist()
        for t in r["tokens"].tolist():
            nxt = int(target.model(input_ids=torch.tensor([cur])).logits[0, -1].argmax())
            assert nxt == t
            cur.append(nxt)
        assert r["hidden"].shape == (len(seq), 1, 64)
        assert float(r["greedy_agree"]) == 1.0


@pytest.mark.parametrize("kind", ["mtp1", "parallel", "dspark"])
def test_draft_shapes_and_conf(target, kind):
    store = _store(target)
    shared = D.Shared.of(target)
    model = D.build_drafter(kind, target, gamma=5)
    a = store.anchors(5, full_lookahead=True)[:9]
    out = model.draft(store.batch(a, model.cfg.window, 5, None, with_future=False), shared, 5)
    assert out["tokens"].shape == (9, 5)
    assert out["logits"].shape == (9, 5, VOCAB)
    c = out["conf"]
    assert torch.all((c >= 0) & (c <= 1))
    # a greedy draft: each token is its logits' argmax (it checked shapes and ranges only)
    assert torch.equal(out["tokens"], out["logits"].argmax(-1))
    if kind != "dspark":  # the confidence is the drafter's probability of its token
        p = torch.softmax(out["logits"].float(), -1)
        want = p.gather(-1, out["tokens"][..., None])[..., 0]
        torch.testing.assert_close(c, want, rtol=1e-6, atol=1e-7)


def test_dspark_markov_head_is_sequential(target):
    """Changing the previous draft token changes the next logits (Markov head)."""
    store = _store(target)
    shared = D.Shared.of(target)
    m = D.build_drafter("dspark", target, gamma=4)
    torch.nn.init.normal_(m.markov_u.weight, std=0.5)
    a = store.anchors(4, full_lookahead=True)[:4]
    b = store.batch(a, m.cfg.window, 4, None, with_future=False)
    hk = m.backbone(b, shared, 4)
    l1, _ = m._logits_conf(hk[:, 1], torch.full((4,), 10), shared)
    l2, _ = m._logits_conf(hk[:, 1], torch.full((4,), 200), shared)
    assert not torch.allclose(l1, l2)


@pytest.mark.parametrize("kind", ["mtp1", "parallel", "dspark"])
def test_training_reduces_loss_and_saves(target, kind, tmp_path):
    store = _store(target, n=6, new=32)
    side = train_drafter(kind, target, tiny_prompts(6), steps=40, out_dir=tmp_path / kind,
                         gamma=4, batch_size=16, lr=3e-3, store=store, progress=False,
                         log_every=1)
    curve = [c["loss"] for c in side["loss_curve"]]
    assert np.mean(curve[-8:]) < np.mean(curve[:8])
    meta = json.loads((tmp_path / kind / "drafter.json").read_text())
    assert meta["steps"] == 40 and meta["train_prompts"]["keys"]
    assert len(meta["sha256"]) == 64
    # own weights only: no embedding/head-sized tensor in the checkpoint
    from safetensors.torch import load_file

    sd = load_file(str(tmp_path / kind / "drafter.safetensors"))
    assert all(v.dtype == torch.bfloat16 for v in sd.values())
    assert all(VOCAB not in v.shape for v in sd.values())
    model, info = D.load_drafter(tmp_path / kind, target)
    assert info["sha256"] == meta["sha256"] and model.kind == kind


def test_lookup_drafter_counts():
    lk = D.Lookup(max_ngram=2)
    seq = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6]
    toks, conf = lk.draft_sequence(seq, start=4, gamma=3)
    # anchor a=9 (token 6): bigram (5, 6) seen at ends 1 and 5; most recent -> 7, 9, 5
    assert toks[-1].tolist() == [7, 9, 5]
    assert conf[-1, 0] == pytest.approx(2 / 3)  # both continue with 7 -> 2/(2+1)
    assert conf[-1, 1] == pytest.approx(1 / 3)  # one of them continues with 9
    # anchor a=4 (token 5): unigram 5 seen at 0 -> 6, 7, 8
    assert toks[0].tolist() == [6, 7, 8]
    assert np.all((conf >= 0) & (conf < 1))


def test_prompt_split_is_deterministic_and_disjoint():
    from dspark_sim.traces.targets import select_prompts

    ps = [Prompt(ds, i, (f"q{i}",)) for ds in ("gsm8k", "mbpp", "mt-bench") for i in range(40)]
    tr = select_prompts(ps, "train", 5)
    ho = select_prompts(ps, "heldout", 5)
    assert len(tr) == len(ho) == 15
    assert not {p.key for p in tr} & {p.key for p in ho}
    assert [p.key for p in select_prompts(ps, "train", 5)] == [p.key for p in tr]
