"""The prefix cache (``sim/prefix_cache.py``) and its place in the engine: hand-checked
hits, least-recently-freed eviction, referenced blocks kept, the summary's figures, a
Mooncake replay against the reuse its hash_ids imply, and cache-on never prefilling more
than cache-off."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_sim.errors import InputError
from dspark_sim.sim import api
from dspark_sim.sim.config import DeploymentConfig, EngineConfig, SimConfig, WorkloadConfig
from dspark_sim.sim.prefix_cache import (
    HashIdBlocks,
    PrefixCache,
    PromptBlocks,
    chain_hashes,
    resolve_blocks,
)
from dspark_sim.sim.workload import read_workload

B = 512  # a Mooncake hash block


def _jsonl(path, records) -> str:
    """A Mooncake file: (timestamp ms, input, output, hash_ids) per request."""
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": i,
                                        "output_length": o, "hash_ids": h}) + "\n"
                            for t, i, o, h in records))
    return str(path)


def _cfg(path, *, cache="on", kv=None, prefill="chunked", replicas=1, closed=None,
         block=None, n=None, policy="none") -> SimConfig:
    wl = WorkloadConfig(arrival="replay", workload_path=path, num_requests=n) if closed is None \
        else WorkloadConfig(arrival="closed", workload_path=path, max_concurrency=closed,
                            num_requests=n)
    return SimConfig(policy=policy, workload=wl,
                     engine=EngineConfig(prefix_cache=cache, prefill=prefill,
                                         kv_capacity_tokens=kv, prefix_block_tokens=block),
                     deployment=DeploymentConfig(replicas=replicas, profile="qwen3-8b-h100"))


def _run(cfg: SimConfig):
    """The finished in-memory run (its context: caches, per-step series) and summary."""
    inp = api.prepare(cfg)
    cfg, policy, profile, trace, calibration, pp = (inp.cfg, inp.policy, inp.profile,
                                                    inp.trace, inp.calibration,
                                                    inp.policy_profile)
    rng = np.random.default_rng(cfg.seed)
    stream, rows = api._request_log(cfg, rng, trace, None, profile)
    run = api.run_in_memory(cfg, policy, profile, trace, calibration, pp, stream, rows)
    return run, api.finish_run(run, run.ctx.steps.columns()).summary


def _prefilled(run) -> int:
    return int(run.ctx.steps.columns()["prefill_tokens"].sum())


# -- hashing --------------------------------------------------------------------------
def test_a_blocks_hash_covers_its_whole_prefix():
    # two sequences with the same second block's content after different first blocks
    h = chain_hashes(np.array([0, 2, 4, 5]), np.array([7, 8, 9, 8, 7]))
    assert h[1] != h[3]  # same content, different prefix
    assert h[0] == h[4]  # same content, same (empty) prefix
    assert len(set(h[:4].tolist())) == 4


def test_hash_ids_cut_into_smaller_blocks_keep_their_sharing():
    reuse = HashIdBlocks(np.array([0, 2, 4]), np.array([5, 6, 5, 9]), np.array([1000, 1100]))
    b = reuse.at(128)
    # 1000 // 128 = 7 full blocks of 2 hash blocks; the first 4 (hash 5) shared
    assert b.prompt_blocks.tolist() == [7, 8]
    first, second = b.hashes[:7], b.hashes[7:]
    assert (first[:4] == second[:4]).all() and (first[4:] != second[4:7]).all()
    with pytest.raises(InputError, match="--prefix-block-tokens"):
        resolve_blocks("on", 100, reuse)
    with pytest.raises(InputError, match="--prefix-cache"):
        resolve_blocks("on", None, None)
    assert resolve_blocks(None, None, None) is None and resolve_blocks("off", 16, reuse) is None


# -- the cache by hand --------------------------------------------------------------------
def _blocks(*seqs: list[int], bt=16) -> PrefixCache:
    offsets = np.cumsum([0, *map(len, seqs)])
    content = np.concatenate([np.asarray(s, np.int64) for s in seqs])
    return PrefixCache(PromptBlocks.from_contents(bt, offsets, content,
                                                  np.array([len(s) for s in seqs])))


def test_least_recently_freed_blocks_go_first_a_requests_tail_first():
    cache = _blocks([1, 2, 3], [4, 5], [1, 2, 6])
    for rid in (0, 1):
        cache.acquire(rid, cache.lookup(rid)[0], 100)
        cache.fill(rid)
    cache.release(0)
    cache.release(1)
    assert cache.free_tokens == 5 * 16
    assert cache.evict(20) == 32  # two blocks: request 0's tail first (3, then 2)
    slots, free = cache.lookup(2)
    assert slots.size == 1 and free == 1  # block 1 still cached, 2 is gone
    assert cache.evict(1000) == 3 * 16 and cache.cached_blocks == 0
    cache.check()


def test_referenced_blocks_are_never_evicted_and_counted_once():
    cache = _blocks([1, 2, 3], [1, 2, 3])
    cache.acquire(0, cache.lookup(0)[0], 48)
    cache.fill(0)
    slots, free = cache.lookup(1)
    assert slots.size == 3 and free == 0
    cache.acquire(1, slots, 48)
    assert cache.shared_tokens == 48  # request 1's row counts what request 0's holds
    cache.release(0)
    assert cache.evict(10_000) == 0  # request 1 still references all three
    assert cache.shared_tokens == 0 and cache.free_tokens == 0
    cache.release(1)
    assert cache.evict(10_000) == 48
    cache.check()


def test_a_second_request_sharing_three_blocks_prefills_only_the_rest(tmp_path):
    a = 4 * B + 100
    b = 4 * B + 300
    path = _jsonl(tmp_path / "w.jsonl", [(0, a, 20, [1, 2, 3, 4, 5]),
                                         (60_000, b, 20, [1, 2, 3, 9, 10])])
    run, s = _run(_cfg(path))
    assert _prefilled(run) == a + (b - 3 * B)
    off, s_off = _run(_cfg(path, cache="off"))
    assert _prefilled(off) == a + b
    assert s["prefill_tokens_saved"] == 3 * B
    assert s["prefix_cache_hit_rate_tokens"] == pytest.approx(3 * B / (a + b))
    assert s["prefix_cache_hit_rate_blocks"] == pytest.approx(3 / 8)  # 4 + 4 full blocks
    assert s["prefix_cache_lookups"] == 2
    assert s["median_ttft_ms"] < s_off["median_ttft_ms"]
    assert "prefix_cache_hit_rate_tokens" not in s_off  # off: the summary as it was
    run.ctx.replicas[0].cache.check()


def test_hash_ids_of_another_block_size_are_cached_at_that_block(tmp_path):
    """A file whose hash ids name 128-token blocks (``hash_block_tokens``, a vLLM CPU
    server's block) caches at 128 by default: the second prompt shares its first three
    ids, 384 tokens."""
    path = tmp_path / "w.jsonl"
    recs = [(0, 5 * 128 + 10, [1, 2, 3, 4, 5]), (60_000, 4 * 128 + 7, [1, 2, 3, 9])]
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": i, "output_length": 20,
                                        "hash_ids": h, "hash_block_tokens": 128}) + "\n"
                            for t, i, h in recs))
    run, s = _run(_cfg(str(path)))
    assert s["prefix_block_tokens"] == 128 and s["prefill_tokens_saved"] == 3 * 128
    assert _prefilled(run) == 5 * 128 + 10 + 128 + 7
    _, finer = _run(_cfg(str(path), block=64))  # a divisor of the ids' block cuts them
    assert finer["prefill_tokens_saved"] == 3 * 128
    with pytest.raises(InputError, match="does not divide"):
        _run(_cfg(str(path), block=512))
    lines = path.read_text().splitlines()
    path.write_text(lines[0] + "\n" + lines[1].replace('"hash_block_tokens": 128',
                                                       '"hash_block_tokens": 16') + "\n")
    with pytest.raises(InputError, match="line 2: .*hash_block_tokens 16 here, 128 in the "
                                         "first record") as exc:
        read_workload(path)
    assert exc.value.where == str(path)
    path.write_text(lines[0].replace('"hash_block_tokens": 128', '"hash_block_tokens": 0'))
    with pytest.raises(InputError, match="hash_block_tokens must be an integer"):
        read_workload(path)


@pytest.mark.parametrize("prefill", ["chunked", "disaggregated"])
def test_hits_are_counted_per_step_and_per_request(tmp_path, prefill):
    a, b = 4 * B + 100, 4 * B + 300
    path = _jsonl(tmp_path / "w.jsonl", [(0, a, 20, [1, 2, 3, 4, 5]),
                                         (60_000, b, 20, [1, 2, 3, 9, 10])])
    cfg = _cfg(path, prefill=prefill)
    run, s = _run(cfg)
    requests = api.simulate(cfg).requests.sort("request_id")
    # the second request found its first three blocks cached, the first nothing
    assert requests["cached_prompt_tokens"].to_list() == [0, 3 * B]
    assert s["prefill_tokens_saved"] == 3 * B
    steps = run.ctx.steps.columns()
    if prefill == "chunked":  # each admission's lookup in the step that admitted it
        admitted = np.flatnonzero(steps["prefix_hit_tokens"] + steps["prefix_miss_tokens"])
        assert steps["prefix_hit_tokens"][admitted].tolist() == [0, 3 * B]
        assert steps["prefix_miss_tokens"][admitted].tolist() == [a, b - 3 * B]
        assert steps["end_s"][admitted[1]] > 60.0
    else:  # the prefill instances' cache: their steps are not the replicas' series
        assert not steps["prefix_hit_tokens"].any() and not steps["prefix_miss_tokens"].any()
    off = api.simulate(_cfg(path, cache="off", prefill=prefill)).requests
    assert "cached_prompt_tokens" not in off.columns  # off: the table as it was


def test_a_fully_cached_prompt_still_computes_its_last_token(tmp_path):
    path = _jsonl(tmp_path / "w.jsonl", [(0, 2 * B, 5, [1, 2]), (60_000, 2 * B, 5, [1, 2])])
    run, s = _run(_cfg(path))
    assert _prefilled(run) == 2 * B + 1
    assert s["prefill_tokens_saved"] == 2 * B - 1


def test_eviction_under_tight_kv_loses_the_oldest_prefix(tmp_path):
    # 8-block prompts A, B, C, A, C one at a time in a KV of 17 blocks (and a little):
    # C's admission evicts 7 free blocks, A's tail first, leaving A's first block; A's
    # return hits that one and evicts B's; C's return finds all of C
    recs = [(0, 8 * B, 4, list(range(1, 9))), (60_000, 8 * B, 4, list(range(11, 19))),
            (120_000, 8 * B, 4, list(range(21, 29))), (180_000, 8 * B, 4, list(range(1, 9))),
            (240_000, 8 * B, 4, list(range(21, 29)))]
    path = _jsonl(tmp_path / "w.jsonl", recs)
    _, roomy = _run(_cfg(path))
    _, tight = _run(_cfg(path, kv=17 * B + 64))
    assert roomy["prefill_tokens_saved"] == 2 * (8 * B - 1)
    assert tight["prefill_tokens_saved"] == B + (8 * B - 1)
    assert tight["prefix_cache_evicted_blocks"] >= 8


def test_both_kernel_paths_give_the_same_bytes_with_the_cache(tmp_path, monkeypatch):
    """Chunked prefill, a tight KV that preempts, the confidence scheduler: the compiled
    and numpy paths agree field for field with the prefix cache on."""
    pytest.importorskip("numba")
    from dspark_sim.policies import compiled

    rng = np.random.default_rng(3)
    recs = []
    for i in range(120):
        conv = int(rng.integers(0, 12))
        n = int(rng.integers(2, 9))
        recs.append((i * 20, n * B - int(rng.integers(0, 300)), int(rng.integers(20, 600)),
                     [conv * 100 + j for j in range(n)]))
    path = _jsonl(tmp_path / "w.jsonl", recs)
    cfg = _cfg(path, kv=16_000, policy="confidence", replicas=2)
    got = {}
    for use in (False, True):
        monkeypatch.setattr(compiled, "NUMBA", use)
        got[use] = api.simulate(cfg).summary
    assert got[False]["preemptions"] > 0 and got[False]["prefill_tokens_saved"] > 0
    assert got[True] == got[False]


# -- Mooncake ---------------------------------------------------------------------------------
def _implied_reuse(path: str, n: int, max_len: int) -> float:
    """The token hit rate the file's hash_ids imply for its first ``n`` requests sent one
    at a time, counted apart from the simulator: a request's leading blocks whose ids an
    earlier request's full prompt blocks carried (less the last token of a fully cached
    prompt), over all prompt tokens; requests longer than ``max_len`` are never served."""
    df = read_workload(path).head(n)
    df = df.filter(df["prompt_tokens"] + df["output_tokens"] <= max_len)
    seen: set[int] = set()
    hit = total = 0
    for prompt, ids in zip(df["prompt_tokens"].to_list(), df["hash_ids"].to_list(),
                           strict=True):
        full = ids[: prompt // B]
        k = 0
        while k < len(full) and full[k] in seen:
            k += 1
        hit += min(k * B, prompt - 1)
        total += prompt
        seen.update(full)
    return hit / total


def test_mooncake_unbounded_hit_rate_is_the_reuse_its_hash_ids_imply(shared_dir):
    path = str(shared_dir / "data/workloads/mooncake_conversation_trace.jsonl")
    n = 150
    rates = []
    for kv in (10**8, 1_000_000, 500_000):
        _, s = _run(_cfg(path, kv=kv, closed=1, n=n))
        assert s["completed"] + s["rejected"] == n
        assert set(s["rejected_reasons"]) <= {"max_model_len"}
        rates.append(s["prefix_cache_hit_rate_tokens"])
    assert rates[0] == pytest.approx(_implied_reuse(path, n, s["max_model_len"]), abs=1e-12)
    assert rates[0] > rates[1] > rates[2] > 0


def test_mooncake_replay_turns_the_cache_on_and_cuts_ttft(shared_dir):
    path = str(shared_dir / "data/workloads/mooncake_conversation_trace.jsonl")
    _, on = _run(_cfg(path, cache=None, n=400, replicas=2))
    _, off = _run(_cfg(path, cache="off", n=400, replicas=2))
    assert on["prefix_cache_hit_rate_tokens"] > 0.1
    assert on["prefill_tokens_saved_per_gpu"] == on["prefill_tokens_saved"] / 2
    assert on["median_ttft_ms"] < off["median_ttft_ms"]


# -- property -------------------------------------------------------------------------------
@settings(max_examples=12, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 6), st.integers(0, 511),
                          st.integers(1, 40), st.integers(0, 3000)), min_size=1, max_size=12),
       st.sampled_from(["chunked", "disaggregated"]))
def test_cache_on_never_prefills_more_than_cache_off(tmp_path_factory, reqs, prefill):
    recs, t = [], 0
    for conv, blocks, short, out, gap in reqs:
        t += gap
        recs.append((t, max(1, blocks * B - short), out, [conv * 10 + j for j in range(blocks)]))
    path = _jsonl(tmp_path_factory.mktemp("w") / "w.jsonl", recs)
    runs = {c: _run(_cfg(path, cache=c, prefill=prefill, replicas=2)) for c in ("on", "off")}
    prompts = sum(r[1] for r in recs)
    if prefill == "chunked":
        on, off = (_prefilled(runs[c][0]) for c in ("on", "off"))
    else:  # the prefill instances' tokens: the prompts less what the cache saved
        on = prompts - runs["on"][1]["prefill_tokens_saved"]
        off = prompts
    assert on <= off
    assert on == prompts - runs["on"][1]["prefill_tokens_saved"]


# -- routing ------------------------------------------------------------------------------
def _routed(path, router, replicas=2):
    cfg = _cfg(path, replicas=replicas)
    cfg = SimConfig(policy=cfg.policy, workload=cfg.workload, engine=cfg.engine,
                    deployment=DeploymentConfig(replicas=replicas, profile="qwen3-8b-h100",
                                                router=router))
    return api.simulate(cfg)


def test_prefix_affinity_sends_a_turn_to_the_replica_holding_its_prefix(tmp_path):
    # a (replica 0) and b (replica 1) are cached; c, sharing a's first 3 blocks, goes to
    # replica 0 though both are idle (least-outstanding takes the first: 0 too, so d,
    # sharing b's, tells them apart: affinity sends it to 1, least-outstanding to 0)
    recs = [(0, 4 * B, 5, [1, 2, 3, 4]), (0, 4 * B, 5, [5, 6, 7, 8]),
            (60_000, 4 * B, 5, [1, 2, 3, 9]), (120_000, 4 * B, 5, [5, 6, 7, 10])]
    path = _jsonl(tmp_path / "w.jsonl", recs)
    aff = _routed(path, "prefix-affinity")
    least = _routed(path, "least-outstanding")
    assert aff.requests.sort("request_id")["replica"].to_list() == [0, 1, 0, 1]
    assert least.requests.sort("request_id")["replica"].to_list() == [0, 1, 0, 0]
    assert aff.summary["prefill_tokens_saved"] == 2 * 3 * B
    assert least.summary["prefill_tokens_saved"] == 3 * B


def test_prefix_affinity_raises_the_hit_rate_on_mooncake(shared_dir):
    path = str(shared_dir / "data/workloads/mooncake_conversation_trace.jsonl")
    rate = {}
    for router in ("prefix-affinity", "least-outstanding", "round-robin"):
        cfg = _cfg(path, n=300, replicas=4)
        cfg = SimConfig(policy="none", workload=cfg.workload, engine=cfg.engine,
                        deployment=DeploymentConfig(replicas=4, profile="qwen3-8b-h100",
                                                    router=router))
        rate[router] = api.simulate(cfg).summary["prefix_cache_hit_rate_tokens"]
    assert rate["prefix-affinity"] > max(rate["least-outstanding"], rate["round-robin"])
