"""Self-distillation training of the learned drafters (``mtp1``, ``parallel``, ``dspark``).

The target greedily answers the *training split* of the prompt sets (deterministic hash
split, :func:`dspark_sim.traces.targets.select_prompts`); generations and the target's
hidden states are cached on disk (``$DSPARK_SIM_CACHE/gen``) and shared by all drafters.
Each step samples ``batch_size`` output positions and trains the drafter to reproduce the
target's next ``gamma`` greedy tokens from the target features available there
(``mtp1``/``parallel``: position-weighted CE; ``dspark``: 0.1 CE + 0.9 TV + 1.0 BCE on the
confidence head). Checkpoints: ``<out_dir>/drafter.safetensors`` (bf16, the drafter's own
weights only) + ``drafter.json`` (training prompts, steps, loss curve, sha256).

Entry point (what ``dspark-sim train-drafter`` wraps)::

    train_drafter(kind, target="smollm2", prompts=None, steps=300, out_dir=None,
                  gamma=7, batch_size=32, lr=6e-4, per_domain=32, max_new_tokens=128,
                  device="cpu", seed=0, split_seed=SPLIT_SEED, prompt_dir=PROMPT_DIR,
                  progress=True) -> dict   # the sidecar written next to the weights

``drafter_kw`` goes to :class:`~dspark_sim.traces.drafters.DrafterConfig` (e.g.
``{"query_init": "fused", "rank": 256}``); ``extra_sidecar`` is merged into the sidecar.
``kind``: mtp1 | parallel | dspark. ``prompts=None`` takes ``per_domain`` training-split
prompts of each of math/code/chat. ``out_dir=None`` writes to the shipped location
``traces/data/drafters/<kind>/``. CUDA: pass ``device="cuda"`` (the target runs in bf16).
"""

from __future__ import annotations

import datetime as _dt
import math
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspark_sim.errors import InputError, check_positive_int, check_seed
from dspark_sim.traces.drafters import (
    LEARNED_KINDS,
    SequenceStore,
    Shared,
    build_drafter,
    num_params,
    save_drafter,
)
from dspark_sim.traces.targets import (
    PROMPT_DIR,
    SPLIT_SEED,
    TRAIN_FRACTION,
    Prompt,
    Target,
    generate_cached,
    load_prompts,
    load_target,
    select_prompts,
)

SHIPPED_DIR = Path(__file__).resolve().parent / "data" / "drafters"
# A generous cap, so a typo fails at once instead of training for weeks: 50x the longest
# documented run (the shipped dspark's 1,900 steps, hours on the CPU target)
MAX_TRAIN_STEPS = 100_000


def check_steps(steps: Any) -> None:
    """``--steps``: a positive integer up to :data:`MAX_TRAIN_STEPS` (run's caps' words)."""
    check_positive_int("--steps", steps, MAX_TRAIN_STEPS)


def training_prompts(per_domain: int = 32, split_seed: int = SPLIT_SEED,
                     prompt_dir: str | Path = PROMPT_DIR) -> list[Prompt]:
    return select_prompts(load_prompts(prompt_dir), "train", per_domain, seed=split_seed)


def training_data(target: Target, prompts: list[Prompt], max_new_tokens: int = 128,
                  batch_size: int = 16, progress: bool = True) -> SequenceStore:
    """Greedy generations + hidden states of ``prompts`` (cached), as a flat store."""
    layers = target.feature_layers(3) + [target.num_layers]
    recs = _generate_with_progress(target, prompts, max_new_tokens, layers, batch_size,
                                   progress, "generating (train split)")
    return SequenceStore.from_records(recs)


def _generate_with_progress(target, prompts, max_new_tokens, layers, batch_size, progress, label):
    if not progress:
        return generate_cached(target, prompts, max_new_tokens, layers, batch_size)
    from dspark_sim.io import progress_bar

    with progress_bar(transient=False) as bar:
        task = bar.add_task(label, total=len(prompts))
        return generate_cached(target, prompts, max_new_tokens, layers, batch_size,
                               progress=lambda n: bar.advance(task, n))


def train_drafter(
    kind: str,
    target: str | Path | Target = "smollm2",
    prompts: list[Prompt] | None = None,
    steps: int = 300,
    out_dir: str | Path | None = None,
    gamma: int = 7,
    batch_size: int = 32,
    lr: float = 6e-4,
    per_domain: int = 32,
    max_new_tokens: int = 128,
    device: str = "cpu",
    seed: int = 0,
    split_seed: int = SPLIT_SEED,
    prompt_dir: str | Path = PROMPT_DIR,
    progress: bool = True,
    store: SequenceStore | None = None,
    log_every: int = 10,
    drafter_kw: dict[str, Any] | None = None,
    extra_sidecar: dict[str, Any] | None = None,
    init_from: str | Path | None = None,
) -> dict[str, Any]:
    """Train one drafter by self-distillation; returns the sidecar dict it wrote."""
    if kind not in LEARNED_KINDS:
        raise InputError("--drafter", f"only {', '.join(LEARNED_KINDS)} are trained (got {kind!r})")
    check_steps(steps)
    check_seed(seed)
    if prompts is None:
        prompts = training_prompts(per_domain, split_seed, prompt_dir)
    tgt = target if isinstance(target, Target) else load_target(target, device=device)
    if store is None:
        store = training_data(tgt, prompts, max_new_tokens, progress=progress)
    anchors = store.anchors(gamma, full_lookahead=True)
    if anchors.size == 0:
        raise InputError("--prompts", "generations too short to train on (need > gamma tokens)")
    seq_of = np.searchsorted(store.starts, anchors, side="right") - 1

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = build_drafter(kind, tgt, gamma=gamma, **(drafter_kw or {}))
    warm_info = _warm_start(model, kind, init_from, tgt)
    t0 = time.time()
    curve = _optimise(model, kind, tgt, store, anchors, seq_of, rng, steps=steps, gamma=gamma,
                      batch_size=batch_size, lr=lr, log_every=log_every, progress=progress)
    sidecar = _sidecar(model, kind, tgt, prompts, warm_info, curve, time.time() - t0,
                       gamma=gamma, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                       split_seed=split_seed, max_new_tokens=max_new_tokens,
                       train_positions=int(anchors.size))
    sidecar.update(extra_sidecar or {})
    out = Path(out_dir) if out_dir is not None else SHIPPED_DIR / kind
    save_drafter(model, out, sidecar)
    sidecar["path"] = str(out)
    return sidecar


def _warm_start(model, kind: str, init_from: str | Path | None, tgt: Target
                ) -> dict[str, Any] | None:
    """Same architecture, weights from a checkpoint; returns its sidecar (None: cold)."""
    if init_from is None:
        return None
    from dspark_sim.traces.drafters import load_drafter

    prev, warm_info = load_drafter(init_from, tgt)
    if prev.kind != kind or {k: v.shape for k, v in prev.state_dict().items()} != \
            {k: v.shape for k, v in model.state_dict().items()}:
        raise InputError(str(init_from), f"cannot warm-start a {kind} drafter from this "
                                         f"{prev.kind} checkpoint (different architecture)")
    model.load_state_dict(prev.state_dict())
    return warm_info


def _optimise(model, kind: str, tgt: Target, store: SequenceStore, anchors: np.ndarray,
              seq_of: np.ndarray, rng: np.random.Generator, *, steps: int, gamma: int,
              batch_size: int, lr: float, log_every: int, progress: bool
              ) -> list[dict[str, float]]:
    """AdamW with linear warm-up then cosine decay to 10 %, gradients clipped at 1;
    returns the loss curve (every ``log_every`` steps and the last). Leaves the model in
    eval mode."""
    model.train()
    shared = Shared.of(tgt)
    if shared.embed_weight.dtype != torch.float32:
        shared = Shared(shared.embed_weight.float(), shared.head_weight.float())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                            weight_decay=0.01, betas=(0.9, 0.98))
    warm = max(1, min(20, steps // 10))

    def lr_at(s: int) -> float:
        if s < warm:
            return lr * (s + 1) / warm
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm))))

    curve: list[dict[str, float]] = []
    window = model.cfg.window
    need_tl = kind == "dspark"
    bar = None
    if progress:
        from dspark_sim.io import progress_bar

        bar = progress_bar(transient=False)
        bar.start()
        task = bar.add_task(f"training {kind}", total=steps)
    try:
        ema = None
        for s in range(steps):
            pick = rng.integers(0, anchors.size, size=batch_size)
            b = store.batch(anchors[pick], window, gamma, shared if need_tl else None,
                            seq_of=seq_of[pick], device=tgt.device)
            for g in opt.param_groups:
                g["lr"] = lr_at(s)
            loss, logs = model.loss(b, shared)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            lv = float(loss.detach())
            ema = lv if ema is None else 0.9 * ema + 0.1 * lv
            if s % log_every == 0 or s == steps - 1:
                curve.append({"step": s, "loss": round(lv, 5), "loss_ema": round(ema, 5),
                              **{k: round(v, 5) for k, v in logs.items()}})
            if bar is not None:
                bar.update(task, advance=1, description=f"training {kind} loss {ema:.3f}")
    finally:
        if bar is not None:
            bar.stop()
    model.eval()
    return curve


def _sidecar(model, kind: str, tgt: Target, prompts: list[Prompt],
             warm_info: dict[str, Any] | None, curve: list[dict[str, float]], secs: float, *,
             gamma: int, steps: int, batch_size: int, lr: float, seed: int, split_seed: int,
             max_new_tokens: int, train_positions: int) -> dict[str, Any]:
    """``drafter.json``: what was trained, on which prompts, how long, the loss curve."""
    by_ds = Counter(p.dataset for p in prompts)
    sidecar = {
        "target": tgt.name,
        "target_source": tgt.source,
        "gamma": gamma,
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "seed": seed,
        "objective": ("{}*CE + {}*TV + {}*BCE(conf), positions weighted exp(-(k-1)/gamma)"
                      .format(*model.cfg.loss_weights) if kind == "dspark" else "CE on target greedy tokens, positions weighted exp(-(k-1)/gamma)"),
        "init": "block from the target's last decoder layer; embedding + LM head shared, frozen",
        "train_prompts": {
            "split": "train",
            "split_seed": split_seed,
            "train_fraction": TRAIN_FRACTION,
            "rule": "sha256(f'{seed}|{dataset}|{index}|{turn0}')[:8]/2^64 < train_fraction",
            "datasets": dict(sorted(by_ds.items())),
            "keys": [p.key for p in prompts],
        },
        "max_new_tokens": max_new_tokens,
        "train_positions": train_positions,
        "train_seconds": round(secs, 1),
        "device": str(tgt.device),
        "trainable_params": num_params(model),
        "loss_curve": curve,
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "torch_threads": torch.get_num_threads(),
    }
    if warm_info is not None:  # the budget spent before this run, so the total stays stated
        sidecar["warm_start"] = {k: warm_info.get(k) for k in
                                 ("sha256", "steps", "train_seconds", "objective", "lr",
                                  "train_positions", "config", "warm_start")}
        sidecar["warm_start"]["train_prompts"] = {
            k: v for k, v in warm_info.get("train_prompts", {}).items() if k != "keys"}
        sidecar["warm_start"]["same_prompts"] = (
            warm_info.get("train_prompts", {}).get("keys") == [p.key for p in prompts])
        sidecar["total_steps"] = steps + int(warm_info.get("total_steps", warm_info.get("steps", 0)))
        sidecar["total_train_seconds"] = round(secs + float(warm_info.get(
            "total_train_seconds", warm_info.get("train_seconds", 0.0)) or 0.0), 1)
    return sidecar


def train_all(
    kinds: tuple[str, ...] = LEARNED_KINDS,
    target: str | Path | Target = "smollm2",
    steps: int = 300,
    out_root: str | Path | None = None,
    device: str = "cpu",
    **kw: Any,
) -> dict[str, dict[str, Any]]:
    """Train every learned drafter on one shared generation cache."""
    per_domain = kw.pop("per_domain", 32)
    split_seed = kw.pop("split_seed", SPLIT_SEED)
    prompt_dir = kw.pop("prompt_dir", PROMPT_DIR)
    max_new_tokens = kw.pop("max_new_tokens", 128)
    # the seed and the prompt files before the target loads and generates (minutes):
    # default_rng(-1) or a bad prompt line would otherwise fail only after that
    check_seed(kw.get("seed", 0))
    check_steps(steps)
    prompts = training_prompts(per_domain, split_seed, prompt_dir)
    tgt = target if isinstance(target, Target) else load_target(target, device=device)
    store = training_data(tgt, prompts, max_new_tokens, progress=kw.get("progress", True))
    root = Path(out_root) if out_root is not None else SHIPPED_DIR
    return {
        k: train_drafter(k, tgt, prompts, steps=steps, out_dir=root / k, store=store,
                         split_seed=split_seed, max_new_tokens=max_new_tokens, **kw)
        for k in kinds
    }
