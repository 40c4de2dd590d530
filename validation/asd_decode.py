"""ASD on a real target: what a lossy acceptance does to the text, measured (docs/lossy.md).

:func:`asd_decode_greedy` is chain speculative decoding with the real target and a real
drafter, one request at a time, judging each block with ASD's rule
(:func:`dspark_sim.policies.lossy.asd_block`, the very function the simulator's ``asd``
replays). Unlike the replay, every depth here is judged by the target **under the chain's
own prefix** (one forward over ``context + chain``), so a changed token's consequences
are real: the continuation diverges and the text is what ASD would emit. With ``B = 0``
it must reproduce the target's greedy output token for token (the test of the loop).

A KV cache holds the committed context; each step forwards the uncached tail (the last
committed token) and the chain, then crops the cache back to what was committed.

:func:`measure_gsm8k` runs it on the shipped GSM8K prompts against the target's greedy
output and reports exact-match accuracy both ways, the changed-token fraction (positional,
as the simulator counts it) and how many answers flipped. Slow on CPU (minutes for a few
dozen prompts); kept out of CI. The recorded result is in docs/lossy.md, written there
by ``--write-doc`` (the command it was made with is in the block)::

    nice -n 10 python -m dspark_sim.validation.asd_decode --prompts 30 --max-new-tokens 192 \\
        --settings 0,0,0 0.5,1,8 2,2,inf --time-limit-s 1020 --write-doc docs/lossy.md
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np
import torch

from dspark_sim.policies.lossy import AsdConfig, asd_block
from dspark_sim.traces.drafters import DraftBatch
from dspark_sim.traces.targets import _cache_of


@torch.no_grad()
def asd_decode_greedy(target: Any, drafter: Any, shared: Any, prompt: list[int],
                      max_new_tokens: int, cfg: AsdConfig, gamma: int = 7,
                      layers: list[int] | None = None) -> dict[str, Any]:
    """Decode up to ``max_new_tokens`` (stopping after EOS) with ASD-judged chains.

    Returns ``tokens``, ``steps`` (target forwards after the prompt), ``accepted`` and
    ``changed`` (per step), ``spent`` (the cumulative normalised regret at the end)."""
    from transformers import DynamicCache

    dev = target.device
    layers = layers or (drafter.cfg.feature_layers or target.feature_layers(3)) + [target.num_layers]
    eos = target.eos_ids
    window = drafter.cfg.window
    ctx = list(prompt)
    cache = DynamicCache()
    fw = target.model(input_ids=torch.tensor([ctx[:-1]], device=dev), cache=cache,
                      use_cache=True, output_hidden_states=True)
    cache = _cache_of(fw, cache)
    hid = torch.stack([fw.hidden_states[j][0] for j in layers], 1).float()  # ctx[:-1]
    cached = len(ctx) - 1
    out: list[int] = []
    accepted, changed = [], []
    spent = np.zeros(1)
    while len(out) < max_new_tokens:
        a = len(ctx) - 1  # the newest committed token, not yet forwarded
        lo = max(0, a - window)
        idx = torch.arange(a - window, a).clamp(min=lo)
        b = DraftBatch(feats=hid[idx][:, :-1][None].to(dev), h_last=hid[a - 1, -1][None].to(dev),
                       last_tok=torch.tensor([ctx[-1]], device=dev))
        d = drafter.draft(b, shared, gamma)
        chain = d["tokens"][0].tolist()
        q = torch.softmax(d["logits"][0].float(), -1).gather(
            -1, torch.tensor(chain, device=dev)[:, None])[:, 0].cpu().numpy()
        tail = ctx[cached:] + chain
        pos = torch.arange(cached, cached + len(tail), device=dev)
        fw = target.model(input_ids=torch.tensor([tail], device=dev), position_ids=pos[None],
                          cache=cache, use_cache=True, output_hidden_states=True)
        cache = _cache_of(fw, cache)
        u = len(tail) - len(chain)  # uncached committed tokens (the newest one)
        rows = fw.logits[0, u - 1:].float()  # rows[j] judges chain[j]; rows[k] the bonus
        am = rows.argmax(-1).tolist()
        m = 0
        while m < len(chain) and chain[m] == am[m]:
            m += 1
        chain_t = torch.tensor(chain, device=dev)
        top = rows[:len(chain)].max(-1).values
        regret = (top - rows[:len(chain)].gather(-1, chain_t[:, None])[:, 0]).clamp(min=0)
        acc, ch, spent = asd_block(np.array([len(chain)]), np.array([m]),
                                   regret.cpu().numpy()[None], q[None], spent, cfg)
        k = int(acc[0])
        accepted.append(k)
        changed.append(int(ch[0]))
        new = chain[:k] + [am[k]]
        hs = torch.stack([fw.hidden_states[j][0] for j in layers], 1).float()
        hid = torch.cat([hid, hs[: u + k]])  # committed tokens forwarded this step
        cached += u + k
        # drop the rejected tail (negative: a count to remove, in every transformers version)
        extra = cache.get_seq_length() - cached
        if extra > 0:
            cache.crop(-extra)
        for t in new:
            out.append(t)
            ctx.append(t)
            if t in eos or len(out) >= max_new_tokens:
                return {"tokens": out, "steps": len(accepted), "accepted": accepted,
                        "changed": changed, "spent": float(spent[0])}
    return {"tokens": out, "steps": len(accepted), "accepted": accepted, "changed": changed,
            "spent": float(spent[0])}


def measure_gsm8k(settings: list[AsdConfig], *, prompts: int = 40, max_new_tokens: int = 512,
                  drafter_spec: str = "dspark", gamma: int = 7, seed_offset: int = 0,
                  time_limit_s: float | None = None, progress: bool = True) -> dict[str, Any]:
    """ASD vs greedy on the first ``prompts`` GSM8K prompts (from ``seed_offset``) with
    the real SmolLM2 target and a shipped drafter: exact-match accuracy of both, changed
    tokens (positional, vs the greedy text), answers flipped each way, tau.

    Prompt by prompt (greedy, then every setting), so a ``time_limit_s`` stops between
    prompts with every setting measured on the same prompts."""
    from dspark_sim.traces.answers import correctness
    from dspark_sim.traces.capture import resolve_drafter_spec
    from dspark_sim.traces.drafters import Shared, load_drafter
    from dspark_sim.traces.targets import PROMPT_DIR, load_prompts, load_target

    torch.set_num_threads(1)  # a shared CPU: one thread, no OpenMP spinning
    target = load_target("smollm2")
    drafter, _ = load_drafter(resolve_drafter_spec(drafter_spec), target)
    shared = Shared.of(target)
    ps = load_prompts(PROMPT_DIR, ["gsm8k"])[seed_offset: seed_offset + prompts]
    t0 = time.perf_counter()

    def score(p, toks) -> int:
        return correctness(p.dataset, p.index,
                           target.tokenizer.decode(toks, skip_special_tokens=True))

    base: list[int] = []
    greedy_tokens = 0
    rows: list[list[dict]] = [[] for _ in settings]
    for i, p in enumerate(ps):
        if time_limit_s is not None and time.perf_counter() - t0 > time_limit_s:
            break
        e = target.encode_prompt(list(p.turns), 192)
        g = target.greedy([e], max_new_tokens)[0]["tokens"].tolist()
        base.append(score(p, g))
        greedy_tokens += len(g)
        for cfg, out in zip(settings, rows, strict=True):
            r = asd_decode_greedy(target, drafter, shared, e, max_new_tokens, cfg, gamma)
            toks = r["tokens"]
            n = min(len(toks), len(g))
            differ = sum(a != b for a, b in zip(toks[:n], g[:n], strict=True)) + \
                abs(len(toks) - len(g))
            out.append({"correct": score(p, toks), "greedy": base[-1], "tokens": len(toks),
                        "subst": sum(r["changed"]), "differ": differ, "steps": r["steps"],
                        "accepted": sum(r["accepted"]), "same_text": toks == g,
                        "spent": r["spent"]})
        if progress:
            print(f"  prompt {i + 1}/{len(ps)} ({time.perf_counter() - t0:.0f} s)", flush=True)
    done = len(base)
    report: dict[str, Any] = {
        "target": "SmolLM2-135M-Instruct (Q4_1, CPU)", "drafter": drafter_spec, "gamma": gamma,
        "prompts": done, "prompts_asked": len(ps), "max_new_tokens": max_new_tokens,
        "greedy_tokens": greedy_tokens,
        "greedy_accuracy": float(np.mean(base)) if done else None, "settings": []}
    for cfg, out in zip(settings, rows, strict=True):
        tok = sum(x["tokens"] for x in out)
        report["settings"].append({
            "asd": [cfg.g, cfg.m, cfg.budget],
            "accuracy": float(np.mean([x["correct"] for x in out])) if out else None,
            "tau": 1 + sum(x["accepted"] for x in out) / max(sum(x["steps"] for x in out), 1),
            "tokens": tok,
            "substituted_fraction": sum(x["subst"] for x in out) / max(tok, 1),
            "positional_differ_fraction": sum(x["differ"] for x in out) / max(tok, 1),
            "changed_requests": sum(not x["same_text"] for x in out),
            "substituting_requests": sum(x["subst"] > 0 for x in out),
            "flipped_right_to_wrong": sum(x["greedy"] == 1 and x["correct"] == 0 for x in out),
            "flipped_wrong_to_right": sum(x["greedy"] == 0 and x["correct"] == 1 for x in out),
            "max_spent": max((x["spent"] for x in out), default=0.0),
        })
    report["wall_s"] = time.perf_counter() - t0
    return report


DOC_BEGIN = "<!-- asd-decode: begin (written by python -m dspark_sim.validation.asd_decode) -->"
DOC_END = "<!-- asd-decode: end -->"


def doc_block(report: dict[str, Any], command: str) -> str:
    """The measured result as the markdown block docs/lossy.md carries."""
    n = report["prompts"]
    lines = [DOC_BEGIN, "",
             f"`{command}`: {report['target']}, drafter `{report['drafter']}` (shipped), "
             f"chain of {report['gamma']}, the first {n} GSM8K prompts of the shipped set, at "
             f"most {report['max_new_tokens']} new tokens, one CPU thread, "
             f"{report['wall_s'] / 60:.1f} min. Greedy decoding: "
             f"{_pct(report['greedy_accuracy'])} exact match "
             f"({round((report['greedy_accuracy'] or 0) * n)}/{n}), "
             f"{report['greedy_tokens']:,} tokens.", "",
             "| asd g,m,B | τ | exact match | tokens substituted by ASD | tokens differing "
             "from greedy (positional) | requests whose text changed | right→wrong | "
             "wrong→right |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for st in report["settings"]:
        g, m, b = st["asd"]
        lines.append(
            f"| {g:g},{m},{b:g} | {st['tau']:.3f} | {_pct(st['accuracy'])} | "
            f"{_pct(st['substituted_fraction'], 2)} | {_pct(st['positional_differ_fraction'], 1)}"
            f" | {st['changed_requests']}/{n} | {st['flipped_right_to_wrong']} | "
            f"{st['flipped_wrong_to_right']} |")
    lines += ["", DOC_END]
    return "\n".join(lines)


def _pct(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f} %"


def write_doc(path: str, block: str) -> None:
    """Replace the block between the markers in ``path`` (atomically)."""
    from pathlib import Path

    from dspark_sim.errors import InputError
    from dspark_sim.io import write_text_atomic

    text = Path(path).read_text()
    if DOC_BEGIN not in text or DOC_END not in text:
        raise InputError(path, "asd-decode markers missing")
    head, rest = text.split(DOC_BEGIN, 1)
    tail = rest.split(DOC_END, 1)[1]
    write_text_atomic(path, head + block + tail)


def main(argv: list[str] | None = None) -> None:
    import sys

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--settings", nargs="+", default=["0,0,0", "0.5,1,8"],
                    help="g,m,B per ASD setting (0,0,0 = strict: must equal greedy)")
    ap.add_argument("--time-limit-s", type=float, default=None,
                    help="stop between prompts after this long (all settings on the same prompts)")
    ap.add_argument("--write-doc", default=None,
                    help="replace the asd-decode block of this markdown file (docs/lossy.md)")
    args = ap.parse_args(argv)
    cfgs = []
    for s in args.settings:
        g, m, b = s.split(",")
        cfgs.append(AsdConfig(float(g), int(m), float(b)))
    report = measure_gsm8k(cfgs, prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                           drafter_spec=args.drafter, time_limit_s=args.time_limit_s)
    print(json.dumps(report, indent=1))
    if args.write_doc:
        cmd = "python -m dspark_sim.validation.asd_decode " + " ".join(
            a for a in (argv if argv is not None else sys.argv[1:]) if a)
        write_doc(args.write_doc, doc_block(report, cmd))


if __name__ == "__main__":
    main()
