"""Multi-turn sessions: the traffic whose prompts resend their history.

A session is ``session_turns`` turns. Turn ``k``'s prompt is the shared system prompt,
every earlier turn's user message and answer, and its own new message; ``--lengths``
draws each message (as a prompt length) and answer (as an output length). Turn ``k + 1``
is sent a think time (``--think-time-s``) after turn ``k``'s answer ends, so the
sessions' arrivals depend on the engine and are a SimPy process
(:class:`~dspark_sim.sim.arrivals.SessionLoop`): sessions start as the open loop's
arrivals (``--qps`` sessions/s, Poisson or gamma), or each closed-loop client runs one
session after another. Request ``s * turns + k`` is session ``s``'s turn ``k``.

What the turns share is stated as block contents for the prefix cache
(:class:`SessionBlocks`): the system prompt's full blocks are the same in every session,
the rest of a session's token stream is its own, and a turn's answer is cached when it
ends (vLLM caches the blocks a request's decode fills), so the next turn finds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dspark_sim.sim.config import MAX_TOKENS_PER_REQUEST, WorkloadConfig, parse_think_time
from dspark_sim.sim.prefix_cache import PromptBlocks


@dataclass(frozen=True, eq=False)
class SessionPlan:
    """The sessions' shape: ``turns`` per session, each session's start (open loop; None:
    the clients of a closed loop start them), the think time before each turn
    (``think_s[s, k]``, ``k >= 1``) and the clients (closed loop)."""

    turns: int
    sessions: int
    start_s: np.ndarray | None
    think_s: np.ndarray
    clients: int | None

    @property
    def size(self) -> int:
        return self.sessions * self.turns


@dataclass(frozen=True, eq=False)
class SessionBlocks:
    """Each turn's blocks: request ``r`` of session ``r // turns`` holds its prompt and
    answer, ``system_tokens`` of them the shared system prompt."""

    turns: int
    system_tokens: int
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray

    def at(self, block_tokens: int) -> PromptBlocks:
        bt = block_tokens
        full = (self.prompt_tokens + self.output_tokens) // bt  # the prompt's and answer's
        offsets = np.zeros(full.size + 1, np.int64)
        np.cumsum(full, out=offsets[1:])
        pos = np.arange(offsets[-1]) - np.repeat(offsets[:-1], full)
        session = np.repeat(np.arange(full.size, dtype=np.int64) // self.turns, full)
        shared = (pos + 1) * bt <= self.system_tokens
        content = np.where(shared, pos, ((session + 1) << 32) | pos)
        return PromptBlocks.from_contents(bt, offsets, content, self.prompt_tokens // bt)


def draw_sessions(w: WorkloadConfig, rng: np.random.Generator, lengths) -> tuple:
    """The sessions of ``w`` (its ``num_requests`` rounded up to whole sessions):
    ``(prompt_tokens, output_tokens, plan, blocks, description, trace_rows)``, each
    request's lengths built from the messages and answers ``lengths(n)`` draws (it
    returns ``(messages, answers, description, trace_rows)``)."""
    turns = int(w.session_turns)
    sessions = -(-int(w.num_requests) // turns)
    n = sessions * turns
    message, answer, ldesc, rows = lengths(n)
    message = message.reshape(sessions, turns)
    answer = answer.reshape(sessions, turns)
    # turn k resends the system prompt, every earlier message and answer, and its own
    history = np.cumsum(message + answer, axis=1) - (message + answer)
    prompt = np.minimum(w.system_prompt_tokens + history + message,
                        MAX_TOKENS_PER_REQUEST).reshape(-1).astype(np.int64)
    output = answer.reshape(-1).astype(np.int64)
    think = _think(w.think_time_s, rng, (sessions, turns))
    think[:, 0] = 0.0
    if w.arrival == "closed":
        start, clients = None, int(w.max_concurrency)
        how = f"closed loop, {clients} clients each running sessions in turn"
    else:
        shape = 1.0 if w.arrival == "poisson" else float(w.burstiness)
        start = np.cumsum(rng.gamma(shape, 1.0 / (w.qps * shape), size=sessions))
        start -= start[0]
        clients = None
        how = f"sessions starting at {w.qps:g}/s ({'Poisson' if shape == 1.0 else 'gamma'})"
    plan = SessionPlan(turns, sessions, start, think, clients)
    blocks = SessionBlocks(turns, int(w.system_prompt_tokens), prompt, output)
    desc = (f"{sessions} sessions of {turns} turns, {how}, think {w.think_time_s} s, "
            f"{w.system_prompt_tokens} system-prompt tokens; messages and answers: {ldesc}")
    return prompt, output, plan, blocks, desc, rows


def _think(spec: str, rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    kind, a, sigma = parse_think_time(spec)
    if kind == "fixed":
        return np.full(shape, a)
    if kind == "exp":
        return rng.exponential(a, size=shape) if a > 0 else np.zeros(shape)
    return a * np.exp(sigma * rng.standard_normal(shape))
