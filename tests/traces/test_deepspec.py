"""Bring-your-own DeepSpec drafter: a random-weight checkpoint written in DeepSpec's
format (config.json + model.safetensors) is loaded, drafts, and captures."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from capture_env import cache_root, tiny_prompts, tiny_target  # noqa: E402

from dspark_sim.errors import InputError  # noqa: E402
from dspark_sim.traces.deepspec import load_deepspec_drafter  # noqa: E402
from dspark_sim.traces.drafters import DraftBatch, SequenceStore, Shared, load_drafter  # noqa: E402

# Slow (a capture run with a real DeepSpec-style drafter): out of the default run, in .ci/run's slow leg.
pytestmark = pytest.mark.slow

D, H, KV, DH, FF, V = 64, 4, 2, 16, 128, 256
BLOCK, RANK = 4, 8


def write_checkpoint(out, hidden=D, markov=True, confidence=True, arch="Qwen3DSparkModel",
                     layer_ids=(-1, 0), n_layers=1, seed=0):
    """A DeepSpec-format drafter directory (names as Qwen3DSparkModel.save_pretrained)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape, scale=0.08):
        return torch.randn(*shape, generator=g) * scale

    cfg = {
        "architectures": [arch], "model_type": "qwen3", "hidden_size": hidden,
        "num_attention_heads": H, "num_key_value_heads": KV, "head_dim": DH,
        "intermediate_size": FF, "vocab_size": V, "num_hidden_layers": n_layers,
        "num_target_layers": 2, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "attention_bias": False, "target_layer_ids": list(layer_ids), "tie_word_embeddings": False,
    }
    if arch == "Qwen3DSparkModel":
        cfg.update(block_size=BLOCK, mask_token_id=V - 1, num_anchors=16,
                   markov_rank=RANK if markov else 0, enable_confidence_head=confidence)
        if markov:
            cfg["markov_head_type"] = "vanilla"
        if confidence:
            cfg["confidence_head_with_markov"] = markov
    else:
        cfg.update(ttt_length=7, step_loss_decay=0.8, draft_num_hidden_layers=n_layers)
    d = hidden
    attn_in = 2 * d if arch == "Qwen3Eagle3Model" else d
    sd = {"embed_tokens.weight": w(V, d, scale=1.0), "lm_head.weight": w(V, d, scale=0.5),
          "fc.weight": w(d, len(layer_ids) * d), "norm.weight": 1 + w(d)}
    if arch == "Qwen3DSparkModel":
        sd["hidden_norm.weight"] = 1 + w(d)
    for i in range(n_layers):
        p = f"layers.{i}."
        sd.update({
            p + "self_attn.q_proj.weight": w(H * DH, attn_in),
            p + "self_attn.k_proj.weight": w(KV * DH, attn_in),
            p + "self_attn.v_proj.weight": w(KV * DH, attn_in),
            p + "self_attn.o_proj.weight": w(d, H * DH),
            p + "self_attn.q_norm.weight": 1 + w(DH), p + "self_attn.k_norm.weight": 1 + w(DH),
            p + "mlp.gate_proj.weight": w(FF, d), p + "mlp.up_proj.weight": w(FF, d),
            p + "mlp.down_proj.weight": w(d, FF),
            p + "input_layernorm.weight": 1 + w(d), p + "post_attention_layernorm.weight": 1 + w(d),
        })
        if arch == "Qwen3Eagle3Model":
            sd[p + "hidden_norm.weight"] = 1 + w(d)
    if arch == "Qwen3DSparkModel" and markov:
        sd["markov_head.markov_w1.weight"] = w(V, RANK, scale=1.0)
        sd["markov_head.markov_w2.weight"] = w(V, RANK, scale=0.5)
    if arch == "Qwen3DSparkModel" and confidence:
        sd["confidence_head.proj.weight"] = w(1, d + (RANK if markov else 0))
        sd["confidence_head.proj.bias"] = w(1)
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with cache_root(tmp_path_factory, "deepspec") as root:
        yield root


def _store(target, layers, n_new=10):
    from dspark_sim.traces.targets import generate_cached

    recs = generate_cached(target, tiny_prompts(2), n_new, layers + [target.num_layers],
                           batch_size=2)
    return SequenceStore.from_records(recs)


def test_load_and_draft(env):
    target = tiny_target()
    ck = write_checkpoint(env / "dspark")
    model, info = load_deepspec_drafter(ck, target)
    assert info["family"] == "dspark" and info["feature_layers"] == [0, 1]
    assert len(info["sha256"]) == 64 and info["embed_head_from_target"] == []
    store = _store(target, info["feature_layers"])
    shared = Shared.of(target)
    a = np.array([store.starts[i] + store.prompt_lens[i] + t for i in range(2) for t in (0, 3, 6)])
    outs = []
    for window in (64, 200):  # padding copies of the first position must not matter
        b = store.batch(a, window, BLOCK, None, with_future=False)
        outs.append(model.draft(b, shared, BLOCK))
    d = outs[0]
    assert d["tokens"].shape == (len(a), BLOCK) and d["conf"].shape == (len(a), BLOCK)
    assert d["logits"].shape == (len(a), BLOCK, V)
    assert ((d["conf"] >= 0) & (d["conf"] <= 1)).all()
    assert torch.equal(d["tokens"], outs[1]["tokens"])
    assert torch.allclose(d["conf"], outs[1]["conf"], atol=1e-5)
    again = model.draft(store.batch(a, 64, BLOCK, None, with_future=False), shared, BLOCK)
    assert torch.equal(again["tokens"], d["tokens"]) and torch.equal(again["conf"], d["conf"])
    # a shorter draft is the prefix of the block
    short = model.draft(store.batch(a, 64, BLOCK, None, with_future=False), shared, 2)
    assert torch.equal(short["tokens"], d["tokens"][:, :2])
    with pytest.raises(InputError):
        model.draft(store.batch(a, 64, BLOCK, None, with_future=False), shared, BLOCK + 1)


def test_window_and_padding_do_not_change_a_draft(env):
    """Metamorphic: drafting one anchor through the store's padded window equals drafting
    it from the bare full prefix (no window, no padding). The independent reference, the
    checkpoint recomputed with transformers' Qwen3 modules, is
    test_matches_transformers_qwen3_reference."""
    target = tiny_target()
    model, info = load_deepspec_drafter(write_checkpoint(env / "ref", seed=3), target)
    store = _store(target, info["feature_layers"])
    shared = Shared.of(target)
    s, p = int(store.starts[0]), int(store.prompt_lens[0])
    a = s + p + 2
    b = store.batch(np.array([a]), 128, BLOCK, None, with_future=False)
    got = model.draft(b, shared, BLOCK)
    # the bare prefix: context = every position before a, absolute positions from 0
    nf = store.hidden.shape[1] - 1
    feats = store.hidden[s:a, :nf].float()[None]
    ref_b = DraftBatch(feats=feats, h_last=feats[:, -1, 0], last_tok=store.tokens[a : a + 1])
    ref = model.draft(ref_b, shared, BLOCK)
    assert torch.equal(got["tokens"], ref["tokens"])
    assert torch.allclose(got["conf"], ref["conf"], atol=1e-5)


def test_dflash_and_eagle3(env):
    target = tiny_target()
    m, info = load_deepspec_drafter(write_checkpoint(env / "dflash", markov=False,
                                                     confidence=False, n_layers=2), target)
    assert info["family"] == "dflash"
    store = _store(target, info["feature_layers"])
    shared = Shared.of(target)
    a = np.array([store.starts[1] + store.prompt_lens[1] + 1])
    d = m.draft(store.batch(a, 32, BLOCK, None, with_future=False), shared, BLOCK)
    assert ((d["conf"] >= 0) & (d["conf"] <= 1)).all()
    # no confidence head: a greedy block whose confidence is the drafter's probability of
    # each token (it checked the range only)
    assert torch.equal(d["tokens"], d["logits"].argmax(-1))
    want = torch.softmax(d["logits"].float(), -1).gather(-1, d["tokens"][..., None])[..., 0]
    torch.testing.assert_close(d["conf"], want, rtol=1e-6, atol=1e-7)
    e, einfo = load_deepspec_drafter(write_checkpoint(env / "eagle3", arch="Qwen3Eagle3Model"),
                                     target)
    assert einfo["family"] == "eagle3"
    b = store.batch(a, 16, 5, None, with_future=False)
    ctx = (torch.as_tensor(a)[:, None] - 16 + 1 + torch.arange(16)[None]).clamp(
        min=int(store.starts[1]))
    b.ctx_tokens = store.tokens[ctx]
    d = e.draft(b, shared, 5)
    assert d["tokens"].shape == (1, 5) and ((d["conf"] >= 0) & (d["conf"] <= 1)).all()
    assert torch.equal(d["tokens"], d["logits"].argmax(-1))
    with pytest.raises(InputError, match="capture"):
        load_drafter(f"deepspec:{env / 'eagle3'}", target)


def test_capture_with_deepspec_spec(env):
    from dspark_sim.traces.capture import capture
    from dspark_sim.traces.schema import read_trace

    target = tiny_target()
    ck = write_checkpoint(env / "ckpt-cap", seed=1)
    out = capture(target, [f"deepspec:{ck}"], prompts=tiny_prompts(3), gamma_max=BLOCK,
                  max_new_tokens=12, out=env / "out", batch_size=3, progress=False,
                  target_slug="tiny")
    tr = read_trace(out["ckpt-cap"])
    assert tr.meta.extra["drafter_checkpoint_sha256"] == load_deepspec_drafter(ck, target)[1]["sha256"]
    conf = np.asarray(tr.to_polars()["conf"].to_list())
    assert conf.shape[1] == BLOCK and ((conf >= 0) & (conf <= 1)).all()
    acc = np.asarray(tr.to_polars()["accept_len"].to_list())
    assert ((acc >= 0) & (acc <= BLOCK)).all()
    with pytest.raises(InputError, match="gamma"):
        capture(tiny_target(), [f"deepspec:{ck}"], prompts=tiny_prompts(3), gamma_max=BLOCK + 1,
                max_new_tokens=12, out=env / "out2", batch_size=3, progress=False)


def test_mismatch_names_the_file(env):
    target = tiny_target()
    ck = write_checkpoint(env / "wide", hidden=2 * D)
    with pytest.raises(InputError) as ei:
        load_deepspec_drafter(ck, target)
    msg = str(ei.value)
    assert "config.json" in msg and "hidden 128" in msg and "\n" not in msg
    ck = write_checkpoint(env / "deep", layer_ids=(0, 1))  # layer 1 = final layer
    with pytest.raises(InputError, match="target_layer_ids"):
        load_deepspec_drafter(ck, target)
    ck = write_checkpoint(env / "trunc")
    from safetensors.torch import load_file, save_file

    sd = load_file(str(ck / "model.safetensors"))
    sd.pop("fc.weight")
    save_file(sd, str(ck / "model.safetensors"))
    with pytest.raises(InputError, match=r"model\.safetensors.*fc\.weight"):
        load_deepspec_drafter(ck, target)
    with pytest.raises(InputError, match="config.json"):
        load_deepspec_drafter(env / "nothing-here", target)


@torch.no_grad()
def test_matches_transformers_qwen3_reference(env):
    """One anchor recomputed from the raw checkpoint with transformers' Qwen3 RMSNorm,
    MLP and rotary embedding (eager attention over every context position < t)."""
    from safetensors.torch import load_file
    from transformers import Qwen3Config
    from transformers.models.qwen3 import modeling_qwen3 as q3

    target = tiny_target()
    ck = write_checkpoint(env / "hf-ref", seed=5, n_layers=2)
    model, info = load_deepspec_drafter(ck, target)
    cfgd = json.loads((ck / "config.json").read_text())
    hf = Qwen3Config(**{k: v for k, v in cfgd.items() if k != "architectures"})
    sd = {k: v.float() for k, v in load_file(str(ck / "model.safetensors")).items()}
    store = _store(target, info["feature_layers"])
    s, p = int(store.starts[1]), int(store.prompt_lens[1])
    a = s + p + 4
    n_ctx = a - s

    def norm(x, name, dim=D):
        n = q3.Qwen3RMSNorm(dim, eps=hf.rms_norm_eps)
        n.weight.data.copy_(sd[name])
        return n(x)

    def lin(x, name):
        return x @ sd[name].T

    nf = store.hidden.shape[1] - 1
    feats = store.hidden[s:a, :nf].float().reshape(1, n_ctx, -1)
    ctx = norm(lin(feats, "fc.weight"), "hidden_norm.weight")
    ids = torch.full((1, BLOCK), V - 1)
    ids[0, 0] = store.tokens[a]
    x = sd["embed_tokens.weight"][ids]
    pos = torch.arange(n_ctx + BLOCK)[None]
    cos, sin = q3.Qwen3RotaryEmbedding(hf)(x, pos)
    for i in range(2):
        pre = f"layers.{i}."
        h = norm(x, pre + "input_layernorm.weight")
        kv_in = torch.cat([ctx, h], 1)
        q = norm(lin(h, pre + "self_attn.q_proj.weight").view(1, BLOCK, H, DH),
                 pre + "self_attn.q_norm.weight", DH).transpose(1, 2)
        k = norm(lin(kv_in, pre + "self_attn.k_proj.weight").view(1, -1, KV, DH),
                 pre + "self_attn.k_norm.weight", DH).transpose(1, 2)
        v = lin(kv_in, pre + "self_attn.v_proj.weight").view(1, -1, KV, DH).transpose(1, 2)
        q, _ = q3.apply_rotary_pos_emb(q, q, cos[:, -BLOCK:], sin[:, -BLOCK:])
        _, k = q3.apply_rotary_pos_emb(k, k, cos, sin)
        k, v = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
        att = torch.softmax(q @ k.transpose(-1, -2) * DH**-0.5, -1) @ v
        x = x + lin(att.transpose(1, 2).reshape(1, BLOCK, -1), pre + "self_attn.o_proj.weight")
        mlp = q3.Qwen3MLP(hf)
        for n in ("gate_proj", "up_proj", "down_proj"):
            getattr(mlp, n).weight.data.copy_(sd[pre + f"mlp.{n}.weight"])
        x = x + mlp(norm(x, pre + "post_attention_layernorm.weight"))
    hk = norm(x, "norm.weight")[0]
    prev, toks, confs = int(store.tokens[a]), [], []
    for k in range(BLOCK):
        e = sd["markov_head.markov_w1.weight"][prev]
        lg = hk[k] @ sd["lm_head.weight"].T + sd["markov_head.markov_w2.weight"] @ e
        c = torch.sigmoid(torch.cat([hk[k], e]) @ sd["confidence_head.proj.weight"][0]
                          + sd["confidence_head.proj.bias"][0])
        prev = int(lg.argmax())
        toks.append(prev)
        confs.append(float(c))
    got = model.draft(store.batch(np.array([a]), 96, BLOCK, None, with_future=False),
                      Shared.of(target), BLOCK)
    assert got["tokens"][0].tolist() == toks
    assert np.allclose(got["conf"][0].numpy(), confs, atol=1e-4)
