"""Capture real acceptance traces (schema v1) from drafter/target runs.

For every held-out prompt the target decodes greedily (temperature 0, so replay is exact)
``max_new_tokens + gamma_max`` tokens; one clean forward records its hidden states. Each
drafter then drafts ``gamma_max`` tokens at *every* output position at once (batched
over positions, from the recorded target states -- exactly what it would see online),
and the project's varlen kernels (:func:`dspark_sim.kernels.verify_greedy`,
:func:`dspark_sim.kernels.tv_acceptance`) verify the drafts against the target's logits:

* ``accept_len`` ``m_t``: leading draft tokens equal to the target's greedy tokens
  (capped by the tokens left before EOS);
* ``conf`` ``c_t[1..gamma]``: ``dspark``: its confidence head; ``mtp1``/``parallel``:
  the drafter's probability of its drafted token; ``lookup``: n-gram match counts;
* ``tv_accept``: ``1 - 0.5 * ||p_d - p_t||_1`` per draft position (0 past EOS / no draft).

Work is chunked (``batch_size`` prompts per chunk); each finished chunk writes one shard
per drafter atomically and then the manifest, so a killed capture restarted with
``resume=True`` neither loses nor duplicates records. The final traces are written
atomically as ``<out>/captured-<target>-<drafter>.parquet``.

Entry point (what ``dspark-sim capture`` wraps)::

    capture(target="smollm2", drafters=("mtp1", "parallel", "dspark", "lookup"),
            prompts=None, gamma_max=7, max_new_tokens=160, out=None, resume=False,
            per_domain=20, batch_size=20, device="cpu", split_seed=SPLIT_SEED,
            prompt_dir=PROMPT_DIR, target_slug=None, progress=True) -> dict[str, Path]

``drafters``: shipped kinds (``traces/data/drafters/<kind>``), checkpoint directories, or
``"lookup"``. ``prompts=None`` takes ``per_domain`` *held-out* prompts of each of
math/code/chat (never the training split). ``out=None`` writes into ``traces/data``.
``device="cuda"`` runs the target in bf16 and the Triton kernels.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import platform
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import torch

from dspark_sim.errors import InputError
from dspark_sim.io import write_json_atomic
from dspark_sim.traces.drafters import (
    LearnedDrafter,
    Lookup,
    SequenceStore,
    Shared,
    load_drafter,
)
from dspark_sim.traces.schema import (
    TraceMeta,
    concat_traces,
    read_trace,
    trace_from_frame,
    write_trace,
)
from dspark_sim.traces.targets import (
    PROMPT_DIR,
    SMOLLM2_NAME,
    SPLIT_SEED,
    TRAIN_FRACTION,
    Prompt,
    Target,
    generate_cached,
    load_prompts,
    load_target,
    select_prompts,
)

DATA_DIR = Path(__file__).resolve().parent / "data"
SHIPPED_DRAFTERS = DATA_DIR / "drafters"
MANIFEST = "manifest.json"


def heldout_prompts(per_domain: int = 20, split_seed: int = SPLIT_SEED,
                    prompt_dir: str | Path = PROMPT_DIR) -> list[Prompt]:
    return select_prompts(load_prompts(prompt_dir), "heldout", per_domain, seed=split_seed)


def _kernels():
    """(verify_greedy, tv_acceptance, backend name) from dspark_sim.kernels, or torch refs."""
    try:
        from dspark_sim.kernels import tv_acceptance, verify_greedy
        from dspark_sim.kernels._backend import resolve_backend

        return verify_greedy, tv_acceptance, resolve_backend
    except (ImportError, AttributeError):
        return None, None, None


def _verify_greedy_ref(draft: torch.Tensor, tl: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    am = tl.argmax(-1)
    out = []
    for r in range(cu.numel() - 1):
        lo, hi = int(cu[r]), int(cu[r + 1])
        m = 0
        while m < hi - lo and int(draft[lo + m]) == int(am[lo + r + m]):
            m += 1
        out.append(m)
    return torch.tensor(out)


def _tv_ref(pd: torch.Tensor, pt: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    lengths = cu[1:] - cu[:-1]
    req = torch.repeat_interleave(torch.arange(lengths.numel(), device=pd.device), lengths)
    rows = torch.arange(pd.shape[0], device=pd.device) + req
    return 1.0 - 0.5 * (pd.float() - pt[rows].float()).abs().sum(-1)


def target_probs(store: SequenceStore, idx: torch.Tensor, shared: Shared) -> torch.Tensor:
    """Target next-token distributions (temperature 1) at sequence indices ``idx``."""
    nf = store.hidden.shape[1] - 1
    dev = shared.head_weight.device
    h = store.hidden[idx.cpu(), nf].to(dev, shared.head_weight.dtype)
    return torch.softmax(shared.head(h).float(), -1)


class TargetRows:
    """Target distributions at every generated index of a store, computed once and shared
    by all drafters of a chunk."""

    def __init__(self, store: SequenceStore, shared: Shared, rows_per_pass: int = 512) -> None:
        gen = [np.arange(s + p - 1, s + n) for s, n, p in
               zip(store.starts, store.lens, store.prompt_lens, strict=True)]
        self.idx = torch.as_tensor(np.concatenate(gen), dtype=torch.long)
        self.pos = torch.full((int(store.starts[-1] + store.lens[-1]),), -1, dtype=torch.long)
        self.pos[self.idx] = torch.arange(self.idx.numel())
        V = shared.head_weight.shape[0]
        self.probs = torch.empty(self.idx.numel(), V, device=shared.head_weight.device)
        for lo in range(0, self.idx.numel(), rows_per_pass):
            self.probs[lo : lo + rows_per_pass] = target_probs(
                store, self.idx[lo : lo + rows_per_pass], shared)

    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        return self.probs[self.pos[idx.cpu()].to(self.probs.device)]


def verify_block(draft_tokens: torch.Tensor, valid: torch.Tensor, draft_probs_fn: Any,
                 store: SequenceStore, anchors: np.ndarray, shared: Shared,
                 target_rows: TargetRows | None = None) -> dict[str, Any]:
    """Verify drafted blocks at ``anchors`` against the recorded target.

    ``draft_tokens`` [N, g]; ``valid`` [N] number of usable leading tokens (<= tokens
    left before EOS); ``draft_probs_fn(rows_mask)`` -> [T, V] draft distributions of the
    kept tokens. Returns ``accept_len`` [N] int64 and ``tv`` [N, g] (0 beyond ``valid``)."""
    verify_greedy, tv_acceptance, resolve = _kernels()
    N, g = draft_tokens.shape
    dev = draft_tokens.device
    lengths = valid.to(torch.int64)
    keep = torch.arange(g, device=dev)[None] < lengths[:, None]
    cu = torch.zeros(N + 1, dtype=torch.int64, device=dev)
    cu[1:] = lengths.cumsum(0)
    # target rows: for each request r, S indices a .. a + l_r (l_r + 1 rows)
    a_t = torch.as_tensor(anchors, dtype=torch.long)
    idx = torch.cat([a_t[r] + torch.arange(int(lengths[r]) + 1) for r in range(N)])
    t_probs = target_probs(store, idx, shared) if target_rows is None else target_rows(idx)
    # Greedy verification against the target's own continuation: the target rows are the
    # one-hot greedy tokens it emitted (identical to argmax of t_logits up to ties and
    # bf16 noise, but replay must follow the recorded continuation exactly).
    seq_end = torch.as_tensor(np.searchsorted(store.starts, anchors, side="right") - 1)
    last = torch.as_tensor(store.starts + store.lens - 1)[seq_end]
    nxt_idx = torch.minimum(idx + 1, torch.repeat_interleave(last, lengths.cpu() + 1))
    V = t_probs.shape[-1]
    onehot = torch.zeros(idx.numel(), V, device=dev).scatter_(
        1, store.tokens[nxt_idx].to(dev)[:, None], 1.0)
    flat = draft_tokens[keep]
    if verify_greedy is not None:
        acc = verify_greedy(flat, onehot, cu).accepted_len
        backend = resolve("auto", onehot)
    else:
        acc = _verify_greedy_ref(flat, onehot, cu)
        backend = "torch-reference (dspark_sim.kernels unavailable)"
    del onehot
    d_probs = draft_probs_fn(keep)
    if flat.numel():
        tv_flat = (tv_acceptance(d_probs.contiguous(), t_probs, cu) if tv_acceptance is not None
                   else _tv_ref(d_probs, t_probs, cu))
    else:
        tv_flat = torch.zeros(0, device=dev)
    tv = torch.zeros(N, g, dtype=torch.float32, device=dev)
    tv[keep] = tv_flat.float()
    return {"accept_len": acc.cpu().numpy().astype(np.int64), "tv": tv.clamp(0, 1).cpu().numpy(),
            "backend": backend}


def _positions(store: SequenceStore, i: int, max_new_tokens: int) -> int:
    """Recorded output positions of sequence ``i``: each needs >= 1 known future token."""
    T = int(store.lens[i] - store.prompt_lens[i])
    return max(0, min(max_new_tokens, T - 1))


def draft_rows(drafter: Any, store: SequenceStore, shared: Shared, gamma: int,
               max_new_tokens: int, sub_batch: int = 96,
               target_rows: TargetRows | None = None) -> dict[str, Any]:
    """accept_len / conf / tv_accept for every recorded position of every sequence."""
    dev = shared.head_weight.device
    per_seq = [_positions(store, i, max_new_tokens) for i in range(len(store.lens))]
    anchors = np.concatenate([store.starts[i] + store.prompt_lens[i] + np.arange(n)
                              for i, n in enumerate(per_seq)]).astype(np.int64)
    seq_of = np.repeat(np.arange(len(per_seq)), per_seq)
    ends = store.starts[seq_of] + store.lens[seq_of] - 1  # last known S index
    left = torch.as_tensor(np.minimum(gamma, ends - anchors))  # tokens left before EOS
    m_all = np.zeros(len(anchors), np.int64)
    conf_all = np.zeros((len(anchors), gamma), np.float32)
    tv_all = np.zeros((len(anchors), gamma), np.float32)
    backend = ""
    V = shared.head_weight.shape[0]
    if isinstance(drafter, Lookup):
        toks_l, conf_l = [], []
        for i, n in enumerate(per_seq):
            s, L = int(store.starts[i]), int(store.lens[i])
            seq = store.tokens[s : s + L].tolist()
            t, c = drafter.draft_sequence(seq, int(store.prompt_lens[i]), gamma)
            toks_l.append(t[:n])
            conf_l.append(c[:n])
        all_toks = torch.as_tensor(np.concatenate(toks_l))
        conf_all[:] = np.concatenate(conf_l)
    for lo in range(0, len(anchors), sub_batch):
        sl = slice(lo, lo + sub_batch)
        a = anchors[sl]
        if isinstance(drafter, Lookup):
            toks = all_toks[sl].to(dev)
            have = (toks >= 0).to(torch.int64).cumprod(1).sum(1)
            valid = torch.minimum(left[sl].to(dev), have)
            toks = toks.clamp(min=0)

            def probs(keep, toks=toks):
                flat = toks[keep]
                return torch.zeros(flat.numel(), V, device=dev).scatter_(1, flat[:, None], 1.0)
        else:
            b = store.batch(a, drafter.cfg.window, gamma, None, seq_of=seq_of[sl], device=dev,
                            with_future=False)
            d = drafter.draft(b, shared, gamma)
            toks = d["tokens"]
            valid = left[sl].to(dev)
            conf_all[sl] = d["conf"].float().clamp(0, 1).cpu().numpy()
            logits = d["logits"]

            def probs(keep, logits=logits):
                return torch.softmax(logits[keep].float(), -1)
        res = verify_block(toks, valid, probs, store, a, shared, target_rows)
        m_all[sl] = res["accept_len"]
        tv_all[sl] = res["tv"]
        backend = res["backend"]
    return {"accept_len": m_all, "conf": conf_all, "tv_accept": tv_all, "per_seq": per_seq,
            "backend": backend}


def _rel(path: str) -> str:
    """Checkpoint paths inside the package are recorded relative to the repository."""
    try:
        return str(Path(path).resolve().relative_to(DATA_DIR.parent.parent))
    except (ValueError, OSError):
        return path


def _slug(target: Target, given: str | None) -> str:
    if given:
        return given
    return "smollm2" if target.name == SMOLLM2_NAME else target.name.lower().replace("/", "-")


def _device_desc(target: Target) -> str:
    if target.device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(target.device)}"
    return f"cpu:{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def capture(
    target: str | Path | Target = "smollm2",
    drafters: tuple[str, ...] | list[str] = ("mtp1", "parallel", "dspark", "lookup"),
    prompts: list[Prompt] | None = None,
    gamma_max: int = 7,
    max_new_tokens: int = 160,
    out: str | Path | None = None,
    resume: bool = False,
    per_domain: int = 20,
    batch_size: int = 20,
    device: str = "cpu",
    split_seed: int = SPLIT_SEED,
    prompt_dir: str | Path = PROMPT_DIR,
    target_slug: str | None = None,
    progress: bool = True,
    max_prompt_tokens: int = 192,
    _fail_after_chunks: int | None = None,
) -> dict[str, Path]:
    """Capture one trace per drafter; returns ``{drafter name: parquet path}``."""
    if gamma_max < 1 or gamma_max > 32:
        raise InputError("--gamma-max", f"gamma_max must be in [1, 32], got {gamma_max}")
    if max_new_tokens < 2:
        raise InputError("--max-new-tokens", "max_new_tokens must be >= 2")
    tgt = target if isinstance(target, Target) else load_target(target, device=device)
    if prompts is None:
        prompts = heldout_prompts(per_domain, split_seed, prompt_dir)
    if not prompts:
        raise InputError("--prompts", "no prompts to capture")
    shared = Shared.of(tgt)
    if shared.head_weight.dtype != torch.float32:  # drafters run in fp32
        shared = Shared(shared.embed_weight.float(), shared.head_weight.float())
    loaded: dict[str, tuple[Any, dict[str, Any]]] = {}
    for spec in drafters:
        p = Path(spec)
        if spec != "lookup" and not p.exists() and (SHIPPED_DRAFTERS / spec).is_dir():
            p = SHIPPED_DRAFTERS / spec
        model, info = load_drafter("lookup" if spec == "lookup" else p, tgt)
        name = info.get("kind", str(spec)) if spec in ("lookup", "mtp1", "parallel", "dspark") \
            else p.name
        if isinstance(model, LearnedDrafter) and model.cfg.gamma < gamma_max:
            if model.kind != "mtp1":  # mtp1 is recursive; block drafters have gamma slots
                raise InputError("--gamma-max", f"drafter {spec!r} was trained for gamma "
                                 f"{model.cfg.gamma} < gamma_max {gamma_max}")
            model.cfg.gamma = gamma_max
        loaded[name] = (model, info)
    slug = _slug(tgt, target_slug)
    out_dir = Path(out) if out is not None else DATA_DIR
    work = out_dir / f".capture-{slug}"
    layers = tgt.feature_layers(3) + [tgt.num_layers]
    enc_len = [len(tgt.encode_prompt(list(p.turns), max_prompt_tokens)) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: enc_len[i])  # stable: same batches
    chunks = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    plan = {
        "target": tgt.name,
        "target_source": tgt.source,
        "drafters": {k: v[1].get("sha256", "") for k, v in loaded.items()},
        "gamma_max": gamma_max,
        "max_new_tokens": max_new_tokens,
        "prompts": [prompts[i].key for i in order],
        "batch_size": batch_size,
    }
    plan_hash = hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:16]
    manifest: dict[str, Any] = {"plan_hash": plan_hash, "done": {}}
    mpath = work / MANIFEST
    if resume and mpath.is_file():
        manifest = json.loads(mpath.read_text())
        if manifest.get("plan_hash") != plan_hash:
            raise InputError(mpath, "resume: the capture plan changed (target, drafters, prompts or "
                                    "gamma); rerun without --resume to start over")
    elif work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    write_json_atomic(mpath, manifest)

    backend = ""
    agree: list[float] = []
    bar = None
    if progress:
        from rich.progress import Progress

        bar = Progress(transient=False)
        bar.start()
        task = bar.add_task(f"capture {slug}", total=len(chunks))
        bar.update(task, completed=len(manifest["done"]))
    try:
        for ci, chunk in enumerate(chunks):
            if str(ci) in manifest["done"]:
                continue
            if _fail_after_chunks is not None and len(manifest["done"]) >= _fail_after_chunks:
                raise RuntimeError(f"capture stopped after {_fail_after_chunks} chunk(s) (test hook)")
            cp = [prompts[i] for i in chunk]
            recs = generate_cached(tgt, cp, max_new_tokens + gamma_max, layers,
                                   batch_size=len(cp), max_prompt_tokens=max_prompt_tokens)
            agree.extend(float(r.get("greedy_agree", 1.0)) for r in recs)
            store = SequenceStore.from_records(recs)
            trows = TargetRows(store, shared)
            for name, (model, _info) in loaded.items():
                rows = draft_rows(model, store, shared, gamma_max, max_new_tokens,
                                  target_rows=trows)
                backend = rows["backend"] or backend
                n = rows["per_seq"]
                rid = np.repeat([chunk[j] for j in range(len(cp))], n).astype(np.int32)
                pos = np.concatenate([np.arange(k) for k in n]).astype(np.int32)
                dom = np.repeat([r["domain"] for r in recs], n)
                df = pl.DataFrame({
                    "request_id": rid,
                    "domain": dom.astype(str),
                    "position": pos,
                    "accept_len": rows["accept_len"].astype(np.int8),
                    "conf": pl.Series("conf", rows["conf"], dtype=pl.Array(pl.Float32, gamma_max)),
                    "tv_accept": pl.Series("tv_accept", rows["tv_accept"],
                                           dtype=pl.Array(pl.Float32, gamma_max)),
                })
                meta = TraceMeta(drafter=name, target=tgt.name, gamma_max=gamma_max,
                                 source="captured")
                write_trace(trace_from_frame(df, meta, "<capture>"), work / f"{name}-{ci:04d}.parquet")
            del trows
            manifest["done"][str(ci)] = {"prompts": [p.key for p in cp], "backend": backend,
                                         "greedy_agree": float(np.mean(agree[-len(cp):]))}
            write_json_atomic(mpath, manifest)
            if bar is not None:
                bar.update(task, advance=1)
    finally:
        if bar is not None:
            bar.stop()

    date = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    by_ds = Counter(p.dataset for p in prompts)
    written: dict[str, Path] = {}
    backends = {v.get("backend", "") for v in manifest["done"].values()} - {""}
    agree_all = [v.get("greedy_agree", 1.0) for v in manifest["done"].values()]
    for name, (_model, info) in loaded.items():
        parts = [read_trace(work / f"{name}-{ci:04d}.parquet") for ci in range(len(chunks))]
        merged = concat_traces(parts)
        # request ids = index of the prompt in ``prompts`` (stable across resumes)
        rid = np.concatenate([p.req_ids for p in parts]).astype(np.int32)
        df = merged.to_polars().with_columns(
            pl.Series("request_id", np.repeat(rid, merged.req_lengths).astype(np.int32))
        )
        meta = TraceMeta(
            drafter=name,
            target=tgt.name,
            gamma_max=gamma_max,
            source="captured",
            temperature=0.0,
            domains=tuple(sorted(set(merged.req_domain.tolist()))),
            generator={
                "tool": "dspark_sim.traces.capture",
                "max_new_tokens": max_new_tokens,
                "prompts": {"split": "heldout", "split_seed": split_seed,
                            "train_fraction": TRAIN_FRACTION, "per_domain": per_domain,
                            "datasets": dict(sorted(by_ds.items())),
                            "keys": [p.key for p in prompts]},
                "max_prompt_tokens": max_prompt_tokens,
                "chat_template": True,
            },
            extra={
                "drafter_checkpoint": _rel(info.get("path", "")),
                "drafter_checkpoint_sha256": info.get("sha256", ""),
                "drafter_train_steps": info.get("steps"),
                "target_source": tgt.source,
                "device": _device_desc(tgt),
                "kernel_backend": ",".join(sorted(backends)) or "none",
                "greedy_replay_agreement": float(np.mean(agree_all)) if agree_all else 1.0,
                "date": date,
                "torch": torch.__version__,
            },
        )
        trace = trace_from_frame(df, meta, f"captured-{slug}-{name}")
        path = out_dir / f"captured-{slug}-{name}.parquet"
        write_trace(trace, path)
        written[name] = path
    shutil.rmtree(work, ignore_errors=True)
    return written
