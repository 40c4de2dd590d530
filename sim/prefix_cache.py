"""Automatic prefix caching, as vLLM's: prompts hashed by block, a cache of computed blocks.

A request's token sequence is cut into blocks of ``block_tokens``; each full block gets a
hash chained over the blocks before it (block ``i``'s hash mixes block ``i - 1``'s hash
with its own content), so two requests share a block's hash exactly when they share the
whole prefix up to its end. A workload that carries reuse says what each block holds: a
Mooncake file's ``hash_ids`` (512-token blocks, replayed as given), or the synthetic
multi-turn sessions (``sim/sessions.py``). The simulator never sees tokens, only these
per-block contents (:class:`PromptBlocks`).

:class:`PrefixCache` is one replica's cache (with disaggregated prefill, the prefill
instances'). At admission a request's leading cached blocks are looked up and referenced
(they skip prefill); when its prefill completes, its computed prompt blocks join the
cache, referenced by it; when it leaves (finished or preempted) its references drop, and
a block no request references is free: it stays cached, evictable least-recently-freed
first (a request's blocks tail first, as vLLM frees them). Cached blocks live in the
replica's KV capacity: a referenced block is counted once however many running requests
share it (``shared_tokens`` is what their rows count twice), a free block counts until
it is evicted to make room.

Every operation is per request and per block of that request, done in C-level loops
(``map`` over a dict, numpy over the slots); nothing happens per token or per step.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from dspark_sim.errors import InputError
from dspark_sim.traces.schema import ragged_take

# vLLM's default KV block; a Mooncake file's hash_ids name blocks of 512 tokens
DEFAULT_BLOCK_TOKENS = 16
MOONCAKE_BLOCK_TOKENS = 512

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_ROOT = np.uint64(0x9E3779B97F4A7C15)  # the parent of a sequence's first block


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over uint64 (wrapping arithmetic): a well-spread 64-bit
    hash of each element."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def chain_hashes(offsets: np.ndarray, content: np.ndarray) -> np.ndarray:
    """Each block's chained hash: ``h_0 = mix(ROOT ^ mix(c_0))``, ``h_i = mix(h_{i-1} ^
    mix(c_i))`` within each sequence ``offsets[r] .. offsets[r + 1]``. Vectorised over the
    sequences, one numpy pass per block position. Returned as int64 (dict keys)."""
    offsets = np.asarray(offsets, dtype=np.int64)
    c = _mix(np.asarray(content, dtype=np.int64).view(np.uint64))
    h = np.empty_like(c)
    lengths = np.diff(offsets)
    for j in range(int(lengths.max(initial=0))):
        idx = offsets[:-1][lengths > j] + j
        parent = _ROOT if j == 0 else h[idx - 1]
        h[idx] = _mix(parent ^ c[idx])
    return h.view(np.int64)


@dataclass(frozen=True, eq=False)
class PromptBlocks:
    """Every request's blocks, as chained hashes (:func:`chain_hashes`): request ``r``'s
    are ``hashes[offsets[r]:offsets[r + 1]]``. The first ``prompt_blocks[r]`` are its
    prompt's full blocks (looked up at admission, cached when its prefill completes); any
    after them are blocks its answer fills (a session's turn, whose answer the next turn
    resends), cached when it finishes."""

    block_tokens: int
    offsets: np.ndarray  # int64 [N + 1]
    hashes: np.ndarray  # int64 [offsets[-1]]
    prompt_blocks: np.ndarray  # int64 [N]

    def __post_init__(self) -> None:
        # plain ints, sliced per request: a dict is probed with them in one C loop
        object.__setattr__(self, "hash_list", self.hashes.tolist())
        object.__setattr__(self, "start", self.offsets.tolist())

    @property
    def size(self) -> int:
        return len(self.prompt_blocks)

    def take(self, idx: np.ndarray) -> PromptBlocks:
        """The blocks of requests ``idx``, in that order."""
        idx = np.asarray(idx, dtype=np.int64)
        offsets, pos = ragged_take(self.offsets, idx)
        return PromptBlocks(self.block_tokens, offsets, self.hashes[pos],
                            self.prompt_blocks[idx])

    @classmethod
    def from_contents(cls, block_tokens: int, offsets: np.ndarray, content: np.ndarray,
                      prompt_blocks: np.ndarray) -> PromptBlocks:
        return cls(int(block_tokens), np.asarray(offsets, dtype=np.int64),
                   chain_hashes(offsets, content), np.asarray(prompt_blocks, dtype=np.int64))


LOOKUP_RUN = 64  # blocks a lookup checks at once (see PrefixCache._leading)


class PrefixCache:
    """One replica's cached blocks (see the module's docstring). ``blocks``: every
    request's hashes. The replica calls :meth:`lookup` and :meth:`acquire` at admission,
    :meth:`fill` when a request's prefill completes, :meth:`release` when it leaves,
    and :meth:`evict` to make room in its KV capacity."""

    def __init__(self, blocks: PromptBlocks) -> None:
        self.blocks = blocks
        self.block_tokens = blocks.block_tokens
        self.slot_of: dict[int, int] = {}  # hash -> slot
        size = 1024
        self.hash_of = np.zeros(size, np.int64)
        self.refs = np.zeros(size, np.int64)  # requests referencing the slot's block
        self.stamp = np.full(size, -1, np.int64)  # when it was last freed (-1: not free)
        self.spare: list[int] = list(range(size - 1, -1, -1))  # unused slots
        self.held: dict[int, np.ndarray] = {}  # request -> the slots it references
        self.free_lru: list[tuple[int, np.ndarray]] = []  # heap of (stamp, slots) freed
        self.tick = 0
        self.free_tokens = 0  # cached blocks no request references (evictable)
        self.shared_tokens = 0  # references beyond a block's first, in tokens
        self.cached_blocks = 0
        # counters over every lookup at admission (a preempted request's again)
        self.lookups = 0
        self.query_blocks = 0
        self.hit_blocks = 0
        self.query_tokens = 0
        self.hit_tokens = 0
        self.evicted_blocks = 0
        # the same hits and lookups since the replica's last step (its per-step series
        # takes them, :meth:`take_step`), and each request's hits over its admissions
        # (the run's log column, shared by every cache of the run; None: not kept)
        self.step_hit_tokens = 0
        self.step_query_tokens = 0
        self.request_hit_tokens: np.ndarray | None = None

    # -- lookup and references --------------------------------------------------------
    def _leading(self, rid: int) -> list[int]:
        """The hashes of ``rid``'s leading prompt blocks that are cached (up to its first
        block that is not). Checked a run of blocks at a time with set operations, which
        run in C: a long prompt has hundreds of blocks, and a lookup per block in Python
        cost as much as the engine steps of the request."""
        b = self.blocks
        start = int(b.start[rid])
        hashes = b.hash_list[start: start + int(b.prompt_blocks[rid])]
        cached = self.slot_of.keys()
        n = len(hashes)
        lo = 0
        while lo < n:
            run = hashes[lo: lo + LOOKUP_RUN]
            if cached >= set(run):
                lo += len(run)
                continue
            for h in run:
                if h not in cached:
                    return hashes[:lo]
                lo += 1
        return hashes

    def lookup(self, rid: int) -> tuple[np.ndarray, int]:
        """The slots of ``rid``'s leading cached prompt blocks, and how many of them are
        free (no request references them: admitting ``rid`` takes them out of the
        evictable pool). Changes nothing."""
        lead = self._leading(rid)
        slots = np.fromiter(map(self.slot_of.__getitem__, lead), np.int64, len(lead))
        return slots, int(np.count_nonzero(self.refs[slots] == 0))

    def acquire(self, rid: int, slots: np.ndarray, prompt_tokens: int) -> int:
        """``rid`` (a prompt of ``prompt_tokens``) is admitted with ``slots`` (its
        :meth:`lookup`) cached: reference them and count the lookup. Returns the tokens
        that skip prefill: the cached blocks', less one when they cover the whole prompt
        (the last token is computed again for its logits, as vLLM does)."""
        bt = self.block_tokens
        refs = self.refs
        shared = int(np.count_nonzero(refs[slots]))
        self.free_tokens -= (slots.size - shared) * bt
        self.shared_tokens += shared * bt
        refs[slots] += 1
        self.stamp[slots] = -1
        self.held[rid] = slots
        hit = min(slots.size * bt, prompt_tokens - 1)
        self.lookups += 1
        self.query_blocks += int(self.blocks.prompt_blocks[rid])
        self.hit_blocks += slots.size
        self.query_tokens += prompt_tokens
        self.hit_tokens += hit
        self.step_query_tokens += prompt_tokens
        self.step_hit_tokens += hit
        if self.request_hit_tokens is not None:
            self.request_hit_tokens[rid] += hit
        return hit

    def take_step(self) -> tuple[int, int]:
        """(hit, missed) prompt tokens of the lookups since the last call, and the
        counts back to zero: one step's admissions."""
        hit, query = self.step_hit_tokens, self.step_query_tokens
        self.step_hit_tokens = self.step_query_tokens = 0
        return hit, query - hit

    def fill(self, rid: int, answer: bool = False) -> None:
        """``rid``'s prompt blocks are computed (``answer``: and the blocks its answer
        filled, when it finishes): those not cached yet join the cache, referenced by it.
        A block another request cached meanwhile stays that request's: ``rid`` computed
        its own copy, which is not cached (as vLLM keeps the first)."""
        held = self.held.get(rid)
        if held is None:
            return
        b = self.blocks
        prompt = int(b.prompt_blocks[rid])
        lo, hi = (prompt, b.start[rid + 1] - b.start[rid]) if answer else (held.size, prompt)
        if hi <= lo:
            return
        hashes = b.hash_list[b.start[rid] + lo: b.start[rid] + hi]
        cached = self.slot_of.keys()
        # usually none of them is cached (a request's own new blocks): one check in C
        new = hashes if cached.isdisjoint(hashes) else [h for h in hashes if h not in cached]
        if not new:
            return
        slots = self._take_slots(len(new))
        self.slot_of.update(zip(new, slots.tolist(), strict=True))
        self.hash_of[slots] = new
        self.refs[slots] = 1
        self.stamp[slots] = -1
        self.cached_blocks += slots.size
        self.held[rid] = np.concatenate([held, slots])

    def release(self, rid: int) -> None:
        """``rid`` leaves the replica: its references drop; blocks left unreferenced are
        free, evicted later than any freed before them, a request's last block first."""
        slots = self.held.pop(rid, None)
        if slots is None or not slots.size:
            return
        bt = self.block_tokens
        refs = self.refs
        refs[slots] -= 1
        freed = slots[refs[slots] == 0][::-1]
        self.shared_tokens -= (slots.size - freed.size) * bt
        if freed.size:
            self.free_tokens += freed.size * bt
            self.tick += 1
            self.stamp[freed] = self.tick
            heapq.heappush(self.free_lru, (self.tick, freed))

    def evict(self, tokens: int) -> int:
        """Evict free blocks, least recently freed first, until ``tokens`` are freed or
        none is left. Returns the tokens freed."""
        bt = self.block_tokens
        want = -(-tokens // bt)
        done = 0
        lru = self.free_lru
        while want > done and lru:
            tick, slots = lru[0]
            # only the entry's head is looked at: a growing batch evicts a few blocks a
            # step from a freed prompt of hundreds, and filtering the whole entry each
            # time cost more than the rest of the step
            head = slots[: want - done]
            # referenced again since, or freed again later (a newer entry holds it)
            take = head[self.stamp[head] == tick]
            if take.size:
                list(map(self.slot_of.pop, self.hash_of[take].tolist()))
                self.stamp[take] = -1
                self.spare.extend(take.tolist())
                done += take.size
            if head.size < slots.size:  # the rest stays first in line (a view)
                heapq.heapreplace(lru, (tick, slots[head.size:]))
            else:
                heapq.heappop(lru)
        self.free_tokens -= done * bt
        self.cached_blocks -= done
        self.evicted_blocks += done
        return done * bt

    def cached_prefix_blocks(self, rid: int) -> int:
        """How many of ``rid``'s leading prompt blocks this cache holds (for routing)."""
        return len(self._leading(rid))

    def _take_slots(self, k: int) -> np.ndarray:
        if len(self.spare) < k:
            old = self.hash_of.size
            size = max(2 * old, old + k)
            self.hash_of = np.concatenate([self.hash_of, np.zeros(size - old, np.int64)])
            self.refs = np.concatenate([self.refs, np.zeros(size - old, np.int64)])
            self.stamp = np.concatenate([self.stamp, np.full(size - old, -1, np.int64)])
            self.spare.extend(range(size - 1, old - 1, -1))
        out = self.spare[-k:]
        del self.spare[-k:]
        return np.array(out[::-1], np.int64)

    def check(self) -> None:
        """The counters equal their definitions (tests)."""
        live = np.array(sorted(self.slot_of.values()), np.int64)
        refs = self.refs[live]
        assert self.cached_blocks == live.size
        assert self.free_tokens == int(np.count_nonzero(refs == 0)) * self.block_tokens
        assert self.shared_tokens == int(np.maximum(refs - 1, 0).sum()) * self.block_tokens
        held = np.concatenate([np.zeros(0, np.int64), *self.held.values()])
        assert np.array_equal(np.bincount(held, minlength=self.refs.size)[live], refs)


@dataclass(frozen=True)
class CacheCounts:
    """A cache's run totals as plain ints: what a replica group hands back to be merged
    (it pickles, and :func:`summary` reads it as it reads a cache)."""

    block_tokens: int
    lookups: int
    query_blocks: int
    hit_blocks: int
    query_tokens: int
    hit_tokens: int
    evicted_blocks: int

    @classmethod
    def of(cls, cache: PrefixCache | CacheCounts) -> CacheCounts:
        return cls(*(int(getattr(cache, f)) for f in cls.__dataclass_fields__))

    @classmethod
    def total(cls, counts: list[CacheCounts]) -> CacheCounts:
        """The sum of several caches' counts (one block size)."""
        return cls(counts[0].block_tokens, *(sum(getattr(c, f) for c in counts)
                                             for f in list(cls.__dataclass_fields__)[1:]))


def summary(caches: list[PrefixCache | CacheCounts], gpus: int) -> dict:
    """The summary's prefix-cache figures over ``caches``: hit rates by tokens and by
    blocks over every admission lookup, and the prefill tokens the hits saved (per GPU
    too: ``gpus`` that prefill)."""
    q_tok = sum(c.query_tokens for c in caches)
    h_tok = sum(c.hit_tokens for c in caches)
    q_blk = sum(c.query_blocks for c in caches)
    h_blk = sum(c.hit_blocks for c in caches)
    return {
        "prefix_cache": True,
        "prefix_block_tokens": caches[0].block_tokens if caches else None,
        "prefix_cache_lookups": sum(c.lookups for c in caches),
        "prefix_cache_hit_rate_tokens": h_tok / q_tok if q_tok else None,
        "prefix_cache_hit_rate_blocks": h_blk / q_blk if q_blk else None,
        "prefill_tokens_saved": h_tok,
        "prefill_tokens_saved_per_gpu": h_tok / gpus if gpus else None,
        "prefix_cache_evicted_blocks": sum(c.evicted_blocks for c in caches),
    }


class HashIdBlocks:
    """A Mooncake file's ``hash_ids``: request ``r``'s prompt blocks of ``native`` tokens
    (Mooncake's 512, or the file's ``hash_block_tokens``) are
    ``ids[offsets[r]:offsets[r + 1]]``, equal ids naming equal content (the trace's own
    hashes already chain over the prefix; chaining again changes nothing). :meth:`at`
    cuts them into cache blocks of any size that divides ``native``; only a prompt's full
    blocks are cached (the last, partial one is not)."""

    def __init__(self, offsets: np.ndarray, ids: np.ndarray, prompt_tokens: np.ndarray,
                 native: int = MOONCAKE_BLOCK_TOKENS) -> None:
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.ids = np.asarray(ids, dtype=np.int64)
        self.prompt_tokens = np.asarray(prompt_tokens, dtype=np.int64)
        self.native = int(native)

    def take(self, idx: np.ndarray) -> HashIdBlocks:
        idx = np.asarray(idx, dtype=np.int64)
        offsets, pos = ragged_take(self.offsets, idx)
        return HashIdBlocks(offsets, self.ids[pos], self.prompt_tokens[idx], self.native)

    def at(self, block_tokens: int) -> PromptBlocks:
        per = self.native // block_tokens  # cache blocks per hash id
        given = np.diff(self.offsets) * per
        full = np.minimum(self.prompt_tokens // block_tokens, given)
        offsets = np.zeros(full.size + 1, np.int64)
        np.cumsum(full, out=offsets[1:])
        pos = np.arange(offsets[-1]) - np.repeat(offsets[:-1], full)
        src = np.repeat(self.offsets[:-1], full) + pos // per
        content = self.ids[src] * per + pos % per
        return PromptBlocks.from_contents(block_tokens, offsets, content, full)


def resolve_blocks(prefix_cache: str | None, block_tokens: int | None,
                   reuse) -> PromptBlocks | None:
    """The run's prompt blocks when it caches prefixes, else None. ``prefix_cache``:
    ``"on"``, ``"off"`` or None (on exactly when the workload carries ``reuse``: a
    :class:`HashIdBlocks` or a session workload's blocks, each with an ``at(block)``)."""
    if prefix_cache == "off" or (prefix_cache is None and reuse is None):
        return None
    if reuse is None:
        raise InputError("--prefix-cache", "on needs a workload that carries reuse (a "
                         "Mooncake file with hash_ids, or --session-turns): this one says "
                         "nothing about which prompts share a prefix")
    native = getattr(reuse, "native", None)
    bt = block_tokens or native or DEFAULT_BLOCK_TOKENS
    if native is not None and native % bt:
        raise InputError("--prefix-block-tokens", f"{bt} does not divide the workload's "
                         f"{native}-token hash blocks")
    return reuse.at(bt)
