"""ASD decoding on a real (tiny, random-weight) target: with B = 0 it is the target's
greedy output token for token; with a budget it may change tokens, never spends more
than B, and its changes are substitutions the target did not choose."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from capture_env import (  # noqa: E402
    cache_root,
    smollm2_with_shipped_dspark,
    tiny_prompts,
    train_tiny_drafters,
    varied_target,
)

from dspark_sim.policies.lossy import AsdConfig  # noqa: E402
from dspark_sim.traces.drafters import Shared, load_drafter  # noqa: E402
from dspark_sim.validation.asd_decode import asd_decode_greedy  # noqa: E402

# Slow (strict ASD decoding on the real SmolLM2 target): out of the default run, in .ci/run's slow leg.
pytestmark = pytest.mark.slow

GAMMA = 4
NEW = 24


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with cache_root(tmp_path_factory, "asd") as root:
        target = varied_target()
        train_tiny_drafters(target, root, ("dspark",), GAMMA, dspark_kw={"query_init": "fused"})
        model, _ = load_drafter(root / "dspark", target)
        yield target, model, Shared.of(target)


def test_strict_asd_is_greedy_decoding(env):
    target, model, shared = env
    for pr in tiny_prompts(3):
        ids = target.encode_prompt(list(pr.turns))
        ref = target.greedy([ids], NEW)[0]["tokens"].tolist()
        got = asd_decode_greedy(target, model, shared, ids, NEW, AsdConfig(5.0, 3, 0.0), GAMMA)
        assert got["tokens"] == ref and sum(got["changed"]) == 0 and got["spent"] == 0.0


def test_a_budget_changes_tokens_within_it(env):
    target, model, shared = env
    budget = 30.0
    changed = 0
    for pr in tiny_prompts(3):
        ids = target.encode_prompt(list(pr.turns))
        ref = target.greedy([ids], NEW)[0]["tokens"].tolist()
        got = asd_decode_greedy(target, model, shared, ids, NEW, AsdConfig(50.0, 2, budget),
                                GAMMA)
        assert got["spent"] <= budget and max(got["changed"]) <= 2
        changed += sum(got["changed"])
        if sum(got["changed"]) == 0:
            assert got["tokens"] == ref  # nothing accepted lossily: still greedy
        else:
            # the first change is a token greedy decoding did not choose at that position
            first = int(np.flatnonzero(np.array(got["tokens"][:len(ref)])
                                       != np.array(ref[:len(got["tokens"])]))[0])
            assert got["tokens"][first] != ref[first]
    assert changed > 0  # the random target disagrees with the tiny drafter: not vacuous


def test_strict_asd_on_smollm2_is_its_greedy_output(monkeypatch):
    """The real CPU target with the shipped DSpark drafter: ASD with B = 0 (and generous
    g, m, so only the budget holds it back) emits the target's greedy tokens exactly, with
    drafts accepted along the way (the chain is exercised, not bypassed)."""
    tgt, model, shared = smollm2_with_shipped_dspark(monkeypatch)
    accepted = 0
    for q in ("Natalia sold 48 clips in April and half as many in May. How many in total?",
              "Write a Python function that adds two numbers."):
        ids = tgt.encode_prompt([q])
        ref = tgt.greedy([ids], 40)[0]["tokens"].tolist()
        got = asd_decode_greedy(tgt, model, shared, ids, 40, AsdConfig(1e9, 7, 0.0), gamma=7)
        assert got["tokens"] == ref and sum(got["changed"]) == 0
        accepted += sum(got["accepted"])
    assert accepted > 0
