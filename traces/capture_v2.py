"""Schema-v2 fields of a capture (see :mod:`dspark_sim.traces.schema_v2` for the columns).

Called by :func:`dspark_sim.traces.capture.draft_rows` once per sub-batch of anchors,
after the chain draft. On top of the chain it needs one *teacher-forced* drafter pass
(the drafter fed the target's true tokens as its previous tokens: ``mtp1`` re-unrolls,
``dspark`` re-runs its Markov head on the true parents, ``parallel`` is unchanged) and the
target's rows that the chain already reads. The K-wide tf tree is then verified with the
project's tree kernel (:func:`dspark_sim.kernels.verify_tree_greedy`) against the target's
recorded greedy tokens, and its accepted length must equal the one read off
``true_rank`` (an internal cross-check of the two derivations; a mismatch raises).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dspark_sim.errors import InputError
from dspark_sim.traces.schema_v2 import RANK_CAP, TOPK, V2Fields

F16_MAX = 65504.0
# The correctness label decodes each prompt that has an answer key this far (greedy, to
# EOS at most): the trace's own positions stop at max_new_tokens, often before the answer.
ANSWER_TOKENS = 512


def correctness_labels(target: Any, prompts: list[Any], max_prompt_tokens: int) -> np.ndarray:
    """[len(prompts)] int8: 1 / 0 where the prompt's dataset ships an answer key
    (:mod:`dspark_sim.traces.answers`), -1 elsewhere. The target's greedy continuation
    of up to ``ANSWER_TOKENS`` tokens (cached) is decoded and exact-matched."""
    from dspark_sim.traces.answers import answer_key, correctness
    from dspark_sim.traces.targets import generate_cached

    out = np.full(len(prompts), -1, np.int8)
    keyed = [i for i, p in enumerate(prompts) if answer_key(p.dataset) is not None]
    if not keyed:
        return out
    recs = generate_cached(target, [prompts[i] for i in keyed], ANSWER_TOKENS,
                           [target.num_layers], batch_size=len(keyed),
                           max_prompt_tokens=max_prompt_tokens)
    for i, r in zip(keyed, recs, strict=True):
        text = target.tokenizer.decode(r["tokens"].tolist(), skip_special_tokens=True)
        out[i] = correctness(prompts[i].dataset, prompts[i].index, text)
    return out


def _f16(x: torch.Tensor) -> np.ndarray:
    return x.float().clamp(-F16_MAX, F16_MAX).cpu().numpy().astype(np.float16)


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), -1)
    return -(logp.exp() * logp).sum(-1).clamp(min=0)


def _rank_of(probs: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    """Rank of ``tok`` in ``probs`` [..., V] (0 = argmax; ties by token id, as argmax)."""
    p_tok = probs.gather(-1, tok[..., None])
    ids = torch.arange(probs.shape[-1], device=probs.device)
    ahead = (probs > p_tok) | ((probs == p_tok) & (ids < tok[..., None]))
    return ahead.sum(-1)


def target_side(store: Any, anchors: np.ndarray, gamma: int, depth_ok: torch.Tensor,
                chain_tokens: torch.Tensor, shared: Any, target_rows: Any,
                probs_fn: Any) -> dict[str, np.ndarray]:
    """Target-only columns at ``anchors``: top-1 logit and the chain token's logit at the
    row judging each depth, entropy and argmax token at depth 1."""
    dev = chain_tokens.device
    n = len(anchors)
    nf = store.hidden.shape[1] - 1
    seq = np.searchsorted(store.starts, anchors, side="right") - 1
    last = torch.as_tensor(store.starts[seq] + store.lens[seq] - 1)  # last index of the sequence
    rows = (torch.as_tensor(anchors)[:, None] + torch.arange(gamma)[None]).minimum(last[:, None] - 1)
    h = store.hidden[rows.reshape(-1), nf].to(dev, shared.head_weight.dtype)  # [n*g, d]
    tgt_probs = probs_fn(rows.reshape(-1))  # [n*g, V]
    am = tgt_probs.argmax(-1)
    w = shared.head_weight
    top1 = (h * w[am]).sum(-1).view(n, gamma)
    d_tok = chain_tokens.clamp(min=0).reshape(-1)
    d_logit = (h * w[d_tok]).sum(-1).view(n, gamma)
    p0 = tgt_probs.view(n, gamma, -1)[:, 0]
    ent = -(p0 * torch.log(p0.clamp(min=1e-30))).sum(-1)
    top1 = torch.where(depth_ok, top1, 0.0)
    d_logit = torch.where(depth_ok & (chain_tokens >= 0), d_logit, 0.0)
    return {
        "tgt_top1_logit": _f16(top1),
        "draft_tgt_logit": _f16(d_logit),
        "target_entropy": _f16(ent),
        "tgt_token": store.tokens[torch.as_tensor(anchors) + 1].numpy().astype(np.int32),
    }


def drafter_side(model: Any, b: Any, d: dict[str, torch.Tensor], shared: Any, gamma: int,
                 depth_ok: torch.Tensor) -> dict[str, np.ndarray]:
    """Drafter columns: tf top-K, rank and probability of the true token; the chain's
    own-token probability and entropy."""
    chain_logits = d["logits"].float()
    p_chain = torch.softmax(chain_logits, -1)
    out = {
        "draft_prob": _f16(torch.where(depth_ok, p_chain.gather(-1, d["tokens"][..., None])[..., 0], 0.0)),
        "draft_entropy": _f16(torch.where(depth_ok, _entropy(chain_logits), 0.0)),
    }
    try:
        with torch.no_grad():
            tf = model.teacher_forced_logits(b, shared)[:, :gamma].float()
    except InputError:  # inference-only drafters (DeepSpec checkpoints): chain columns only
        return out
    p_tf = torch.softmax(tf, -1)
    true = b.future[:, :gamma]
    rank = torch.where(depth_ok, _rank_of(p_tf, true).clamp(max=RANK_CAP), -1)
    top = p_tf.topk(TOPK, dim=-1).values
    out.update({
        "alt_prob": _f16(torch.where(depth_ok[..., None], top, 0.0)),
        "true_rank": rank.cpu().numpy().astype(np.int8),
        "true_prob": _f16(torch.where(depth_ok, p_tf.gather(-1, true[..., None])[..., 0], 0.0)),
    })
    out["_tf_top_tokens"] = p_tf.topk(TOPK, dim=-1).indices  # for the tree cross-check
    out["_true"] = true
    return out


def tree_check(top_tokens: torch.Tensor, true: torch.Tensor, depth_ok: torch.Tensor,
               rank: np.ndarray) -> None:
    """Verify each anchor's K-wide tf tree with the tree kernel; compare with ``rank``.

    Depth j holds the K tf alternatives, all children of the depth-(j-1) node that is the
    true token (or of its slot 0 when the true token is not among the K: that subtree is
    then unreachable anyway). The target's argmax of a node's row is known only on the
    true path (the recorded greedy token); elsewhere it is -1, which no token matches."""
    from dspark_sim.kernels import Blocks, DraftTree, verify_tree_greedy

    n, g, k = top_tokens.shape
    if n == 0:
        return
    dev = top_tokens.device
    rank_t = torch.as_tensor(rank, dtype=torch.long, device=dev)
    on_true = (rank_t >= 0) & (rank_t < k)
    par_slot = torch.where(on_true, rank_t, 0)  # which slot of depth j the next depth hangs off
    parents = torch.full((n, g, k), -1, dtype=torch.long, device=dev)
    # parent of depth j >= 1 nodes = node (j-1, par_slot[j-1])
    parents[:, 1:] = ((torch.arange(g - 1, device=dev) * k)[None, :, None]
                      + par_slot[:, :-1, None]).expand(n, g - 1, k)
    toks = torch.where(depth_ok[..., None], top_tokens, -3)  # past EOS: never matches
    # argmax rows: root = true token at depth 1; the node that is the true token at
    # depth j has row argmax = true token at depth j+1; every other row -1.
    am = torch.full((n, 1 + g * k), -1, dtype=torch.long, device=dev)
    am[:, 0] = true[:, 0]
    nxt = torch.cat([true[:, 1:], torch.full((n, 1), -1, dtype=torch.long, device=dev)], 1)
    nxt_ok = torch.cat([depth_ok[:, 1:], torch.zeros(n, 1, dtype=torch.bool, device=dev)], 1)
    slot_true = torch.where(on_true, rank_t, k)  # k = "no slot"
    hit = slot_true[..., None] == torch.arange(k, device=dev)
    node_am = torch.where(hit & nxt_ok[..., None], nxt[..., None], -1)
    am[:, 1:] = node_am.reshape(n, g * k)
    cu = torch.arange(n + 1, device=dev) * (g * k)
    # Built here by construction (n equal trees of g * k nodes, depth g): no checks, no sync.
    tree = DraftTree(parents.reshape(-1), Blocks(cu, g * k, n * g * k), max_depth=g)
    res = verify_tree_greedy(toks.reshape(-1), am.reshape(-1), tree)
    want = np.cumprod((rank >= 0) & (rank < k), axis=1).sum(1)
    got = res.accepted_len.cpu().numpy()
    if not np.array_equal(got, want):
        bad = int(np.flatnonzero(got != want)[0])
        raise RuntimeError(f"tree kernel and true_rank disagree at anchor {bad}: "
                           f"{got[bad]} vs {want[bad]}")


def rows_for_batch(model: Any, b: Any, d: dict[str, torch.Tensor] | None, store: Any,
                   anchors: np.ndarray, valid: torch.Tensor, chain_tokens: torch.Tensor,
                   shared: Any, target_rows: Any, probs_fn: Any, gamma: int) -> dict[str, np.ndarray]:
    """All v2 columns of one sub-batch (``d`` None for drafters without distributions)."""
    depth_ok = torch.arange(gamma, device=chain_tokens.device)[None] < valid[:, None]
    out = target_side(store, anchors, gamma, depth_ok, chain_tokens, shared, target_rows, probs_fn)
    if d is not None:
        ds = drafter_side(model, b, d, shared, gamma, depth_ok)
        top, true = ds.pop("_tf_top_tokens", None), ds.pop("_true", None)
        if top is not None:
            tree_check(top, true, depth_ok, ds["true_rank"].astype(np.int64))
        out.update(ds)
    else:  # lookup: one-hot drafts; a draft exists where chain_tokens >= 0
        out["draft_prob"] = (depth_ok & (chain_tokens >= 0)).cpu().numpy().astype(np.float16)
    return out


def merge(parts: list[dict[str, np.ndarray]]) -> V2Fields:
    if not parts:
        return V2Fields()
    names = set(parts[0])
    for p in parts[1:]:
        names &= set(p)
    return V2Fields(**{k: np.concatenate([p[k] for p in parts]) for k in sorted(names)})
