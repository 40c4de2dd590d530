"""Tree speculative decoding on a real target (greedy, lossless), for tests and checks.

Each step: the drafter drafts a ``gamma`` chain from the target's features (as in
capture); the tree is the chain plus, at every depth, the drafter's next ``width - 1``
alternatives as siblings of the chain token (CURE-style repair leaves). One target
forward over ``context + tree`` under :func:`dspark_sim.kernels.tree_attention_mask`
(positions = context length - 1 + node depth) gives a row per node;
:func:`dspark_sim.kernels.verify_tree_greedy` picks the longest accepted path and the
bonus token. The committed stream must equal the target's plain greedy decoding: the
test of losslessness. No KV cache (each step re-forwards the context): simple and exact,
fine for the short checks it serves.
"""

from __future__ import annotations

from typing import Any

import torch

from dspark_sim.traces.drafters import DraftBatch


@torch.no_grad()
def tree_decode_greedy(target: Any, drafter: Any, shared: Any, prompt: list[int],
                       max_new_tokens: int, gamma: int = 4, width: int = 2,
                       layers: list[int] | None = None) -> dict[str, Any]:
    """Decode ``max_new_tokens`` (stopping after EOS) with draft trees.

    Returns ``tokens`` (generated ids), ``steps`` (target forwards), ``accepted`` (per
    step accepted length), ``nodes`` (per step tree size)."""
    from dspark_sim.kernels import DraftTree, tree_attention_mask, verify_tree_greedy

    dev = target.device
    layers = layers or (drafter.cfg.feature_layers or target.feature_layers(3)) + [target.num_layers]
    eos = target.eos_ids
    window = drafter.cfg.window
    ctx = list(prompt)
    out: list[int] = []
    steps, accepted, sizes = 0, [], []
    # hidden states of every context position but the last (what a drafter may see)
    hid = _hidden(target, ctx[:-1], layers) if len(ctx) > 1 else None
    while len(out) < max_new_tokens:
        a = len(ctx) - 1  # anchor: index of y_t (the root)
        lo = max(0, a - window)
        idx = torch.arange(a - window, a).clamp(min=lo)
        feats = hid[idx][:, :-1][None].float()
        h_last = hid[a - 1, -1][None].float()
        b = DraftBatch(feats=feats.to(dev), h_last=h_last.to(dev),
                       last_tok=torch.tensor([ctx[-1]], device=dev))
        d = drafter.draft(b, shared, gamma)
        chain = d["tokens"][0]
        alts = d["logits"][0].float().topk(width, dim=-1).indices  # [g, width]
        tokens, parents = [], []
        prev = -1
        for j in range(gamma):
            me = len(tokens)
            tokens.append(int(chain[j]))
            parents.append(prev)
            for t in alts[j].tolist():
                if t != int(chain[j]) and len(tokens) - me < width:
                    tokens.append(t)
                    parents.append(prev)
            prev = me
        n = len(tokens)
        par = torch.tensor(parents, dtype=torch.long, device=dev)
        cu = torch.tensor([0, n], dtype=torch.long, device=dev)
        tree = DraftTree.build(par, cu)  # checked once; the mask and the verify share it
        tm = tree_attention_mask(tree)
        L = len(ctx)
        mask = torch.zeros((L + n, L + n), dtype=torch.bool, device=dev)
        mask[:L, :L] = torch.tril(torch.ones(L, L, dtype=torch.bool, device=dev))
        mask[L:, :L] = True
        mask[L:, L:] = tm.mask[0, 1:, 1:]
        pos = torch.cat([torch.arange(L, device=dev), L - 1 + tm.depth])
        ids = torch.tensor([ctx + tokens], device=dev)
        fw = target.model(input_ids=ids, attention_mask=mask[None, None], position_ids=pos[None],
                          output_hidden_states=True, use_cache=False)
        steps += 1
        rows = fw.logits[0, L - 1:].float().contiguous()  # root row, then node rows
        res = verify_tree_greedy(torch.tensor(tokens, device=dev), rows, tree)
        k = int(res.accepted_len[0])
        path = res.path[0, :k].tolist()
        new = [tokens[i] for i in path] + [int(res.next_token[0])]
        accepted.append(k)
        sizes.append(n)
        hs = torch.stack([fw.hidden_states[j][0] for j in layers], 1).float()
        # hidden of the old context's last token (the root) and the accepted path nodes
        keep = torch.cat([hs[L - 1:L], hs[[L + i for i in path]]]) if path else hs[L - 1:L]
        hid = keep if hid is None else torch.cat([hid[: L - 1], keep])
        for t in new:
            out.append(t)
            ctx.append(t)
            if t in eos or len(out) >= max_new_tokens:
                return {"tokens": out, "steps": steps, "accepted": accepted, "nodes": sizes}
    return {"tokens": out, "steps": steps, "accepted": accepted, "nodes": sizes}


@torch.no_grad()
def _hidden(target: Any, ids: list[int], layers: list[int]) -> torch.Tensor:
    fw = target.model(input_ids=torch.tensor([ids], device=target.device),
                      output_hidden_states=True, use_cache=False)
    return torch.stack([fw.hidden_states[j][0] for j in layers], 1).float()
