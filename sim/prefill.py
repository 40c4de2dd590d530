"""Disaggregated prefill: prefill instances as servers with one FIFO queue.

With ``prefill = "disaggregated"`` a request's prompt is prefilled on one of
``deployment.prefill_instances`` prefill instances before it reaches a decode replica.
The instances share one queue, served in arrival order (the front end hands each request
to whichever instance frees first). An instance runs the target's engine as a
prefill-only server does (chunked prefill without decode rows): each step takes the
prompt it is part-way through, then requests from the head of the queue, up to
``max_num_batched_tokens`` prompt tokens; a prompt longer than what is left of the
budget is chunked and stays on the instance that started it.

A step costs what the target profile charges a step of as many tokens (its
``target_time_s``), plus each chunk's attention over the prompt before it and one logit
row per prompt the step completes (a prompt alone on an idle instance: its full chunks,
then the rest, each with its attention, and one logit row). The step that completes a prompt samples its first
token (the request's TTFT) and hands the request to the decode replicas with its KV (the
KV transfer itself is not timed). One SimPy timeout per step of a busy instance, never
per token; an idle instance waits on one event until a request arrives.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import numpy as np
import simpy

from dspark_sim.calibration.profile import EngineProfile
from dspark_sim.sim.prefix_cache import PrefixCache


def prefill_step_s(profile: EngineProfile, chunk_tokens: Sequence[int],
                   done_tokens: Sequence[int], completing: int,
                   table: Sequence[float] | None = None) -> float:
    """One prefill step: ``chunk_tokens[i]`` new tokens of a prompt of which
    ``done_tokens[i]`` are already prefilled (attention over the chunk's midpoint context,
    capped by the profile's window), ``completing`` prompts finished by it (their first
    token's logit row). ``table``: the profile's step time per token count, looked up
    instead of interpolated (plain floats: a step has a handful of prompts)."""
    window = profile.attn_window_tokens
    units = 0.0
    for c, d in zip(chunk_tokens, done_tokens, strict=True):
        ctx = d + c / 2.0
        units += c * (ctx if window is None else min(ctx, window))
    tokens = int(sum(chunk_tokens))
    t = table[tokens] if table is not None else float(profile.target_time_s(tokens))
    return t + profile.attn_s_per_query_ctx * units + profile.logits_s_per_row * completing


class PrefillPool:
    """``instances`` prefill instances serving one FIFO queue of request ids.

    ``on_prefilled(rid)`` is called at the end of the step that completes ``rid``'s
    prompt (set by the arrival source before the first :meth:`submit`). Kept for the
    summary: each instance's busy time, the step count, and per request the time its
    first chunk was scheduled (``start_s``; the queue wait is ``start_s`` - submission).
    """

    def __init__(self, env: simpy.Environment, profile: EngineProfile, instances: int,
                 budget_tokens: int, prompt_tokens: np.ndarray, serve: bool = True) -> None:
        self.env = env
        self.profile = profile
        self.instances = int(instances)
        self.budget = int(budget_tokens)
        self.prompt = np.asarray(prompt_tokens, dtype=np.int64).tolist()  # plain ints, per step
        # the step time per token count: a step never holds more than the budget
        self.table = np.asarray(profile.target_time_s(np.arange(self.budget + 1)),
                                dtype=np.float64).tolist()
        self.on_prefilled: Callable[[int], None] = lambda rid: None
        self.queue: deque[int] = deque()
        self.idle: deque[simpy.Event] = deque()  # one wake-up event per idle instance
        self.submitted_s = np.full(len(self.prompt), np.nan)
        self.start_s = np.full(len(self.prompt), np.nan)
        self.busy_s = 0.0
        self.steps = 0
        # the instances' prefix cache (one pool over their KV, as a disaggregated
        # deployment's shared KV store), and the tokens it may hold; None: no caching
        self.cache: PrefixCache | None = None
        self.cache_tokens = 0
        if serve:  # False: the instances are computed ahead (``sim.ahead``)
            for _ in range(self.instances):
                env.process(self._serve())

    def submit(self, rid: int) -> None:
        self.submitted_s[rid] = self.env.now
        self.queue.append(rid)
        if self.idle:
            self.idle.popleft().succeed()

    def _serve(self):
        held: list[int] = []  # [rid, tokens done] of the prompt this instance is part-way through
        while True:
            if not held and not self.queue:
                wake = self.env.event()
                self.idle.append(wake)
                yield wake
                continue  # another instance may have taken the request at the same instant
            rids, done, chunks = self._fill(held)
            prompt = self.prompt
            finished = [d + c >= prompt[r] for r, d, c in zip(rids, done, chunks, strict=True)]
            dt = prefill_step_s(self.profile, chunks, done, sum(finished), self.table)
            self.busy_s += dt
            self.steps += 1
            yield self.env.timeout(dt)
            # FIFO filling leaves at most the step's last prompt unfinished
            held = [] if finished[-1] else [rids[-1], done[-1] + chunks[-1]]
            if self.cache is not None:
                self._cache_prefilled([r for r, fin in zip(rids, finished, strict=True)
                                       if fin])
            for rid, fin in zip(rids, finished, strict=True):
                if fin:
                    self.on_prefilled(rid)

    def _cache_prefilled(self, rids: list[int]) -> None:
        """Completed prompts' blocks join the cache and are free once their KV has gone
        to the decode replica; the least recently freed go when it is over its size."""
        cache = self.cache
        for rid in rids:
            cache.fill(rid)
            cache.release(rid)
        over = cache.cached_blocks * cache.block_tokens - self.cache_tokens
        if over > 0:
            cache.evict(over)

    def _fill(self, held: list[int]) -> tuple[list[int], list[int], list[int]]:
        """The step's prompts (request ids), tokens each has done, and its chunk of each:
        the held prompt first, then the queue's head, until the budget is spent."""
        rids, done, chunks = [], [], []
        left = self.budget
        if held:
            rid, d = held
            c = min(self.prompt[rid] - d, left)
            rids.append(rid), done.append(d), chunks.append(c)
            left -= c
        while left > 0 and self.queue:
            rid = self.queue.popleft()
            self.start_s[rid] = self.env.now
            d = 0
            if self.cache is not None:  # its leading cached blocks skip prefill
                slots, _ = self.cache.lookup(rid)
                d = self.cache.acquire(rid, slots, self.prompt[rid])
            c = min(self.prompt[rid] - d, left)
            rids.append(rid), done.append(d), chunks.append(c)
            left -= c
        return rids, done, chunks

    def summary(self, duration_s: float, gpus_per_instance: int) -> dict:
        """The summary's prefill fields: instances, their GPUs, how busy they were over
        the run, and the queue wait before a request's first prefill chunk."""
        wait_ms = (self.start_s - self.submitted_s) * 1e3
        wait_ms = wait_ms[np.isfinite(wait_ms)]
        return {
            "prefill_instances": self.instances,
            "num_prefill_gpus": self.instances * gpus_per_instance,
            "prefill_steps": self.steps,
            "prefill_utilization": self.busy_s / (self.instances * duration_s)
            if duration_s > 0 else None,
            "mean_prefill_wait_ms": float(wait_ms.mean()) if wait_ms.size else None,
            "p99_prefill_wait_ms": float(np.percentile(wait_ms, 99)) if wait_ms.size else None,
        }
