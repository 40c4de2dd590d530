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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import torch

from dspark_sim.errors import InputError, check_positive_int
from dspark_sim.io import check_writable, write_json_atomic
from dspark_sim.traces import capture_v2, schema_v2
from dspark_sim.traces.drafters import (
    LEARNED_KINDS,
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
    check_device,
    check_target_spec,
    generate_cached,
    load_prompts,
    load_target,
    select_prompts,
)

DATA_DIR = Path(__file__).resolve().parent / "data"
SHIPPED_DRAFTERS = DATA_DIR / "drafters"
MANIFEST = "manifest.json"
# Greedy tokens per prompt (capture, and validate's requests): a generous cap, 4x the
# SmolLM2 target's whole context, so a typo fails at once instead of decoding for days
MAX_NEW_TOKENS = 32_768


def heldout_prompts(per_domain: int = 20, split_seed: int = SPLIT_SEED,
                    prompt_dir: str | Path = PROMPT_DIR) -> list[Prompt]:
    return select_prompts(load_prompts(prompt_dir), "heldout", per_domain, seed=split_seed)


def _kernels():
    """(verify_greedy, tv_acceptance, backend name, layout builder) from
    dspark_sim.kernels, or Nones (the torch refs then take the bare cu_seqlens)."""
    try:
        from dspark_sim.kernels import Blocks, tv_acceptance, verify_greedy
        from dspark_sim.kernels._backend import resolve_backend

        return verify_greedy, tv_acceptance, resolve_backend, Blocks.from_cu_seqlens
    except (ImportError, AttributeError):
        return None, None, None, None


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
    verify_greedy, tv_acceptance, resolve, layout_of = _kernels()
    N, g = draft_tokens.shape
    dev = draft_tokens.device
    lengths = valid.to(torch.int64)
    keep = torch.arange(g, device=dev)[None] < lengths[:, None]
    cu = torch.zeros(N + 1, dtype=torch.int64, device=dev)
    cu[1:] = lengths.cumsum(0)
    layout = cu if layout_of is None else layout_of(cu)  # checked once, read by both kernels
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
        acc = verify_greedy(flat, onehot, layout).accepted_len
        backend = resolve("auto", onehot)
    else:
        acc = _verify_greedy_ref(flat, onehot, cu)
        backend = "torch-reference (dspark_sim.kernels unavailable)"
    del onehot
    d_probs = draft_probs_fn(keep)
    if flat.numel():
        tv_flat = (tv_acceptance(d_probs.contiguous(), t_probs, layout) if tv_acceptance is not None
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
               target_rows: TargetRows | None = None, v2: bool = False) -> dict[str, Any]:
    """accept_len / conf / tv_accept for every recorded position of every sequence, and
    with ``v2`` the schema-v2 columns (:mod:`dspark_sim.traces.capture_v2`) as ``"v2"``."""
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
    v2_parts: list[dict[str, np.ndarray]] = []
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
                            with_future=v2)  # future: the true tokens, for teacher forcing
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
        if v2:
            chain = torch.where(torch.arange(gamma, device=dev)[None] < valid[:, None], toks, -1)
            v2_parts.append(capture_v2.rows_for_batch(
                drafter, None if isinstance(drafter, Lookup) else b,
                None if isinstance(drafter, Lookup) else d, store, a, valid, chain, shared,
                target_rows, target_rows or (lambda i: target_probs(store, i, shared)), gamma))
    return {"accept_len": m_all, "conf": conf_all, "tv_accept": tv_all, "per_seq": per_seq,
            "backend": backend, "v2": capture_v2.merge(v2_parts) if v2 else None}


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


# -- cheap checks: every argument, before any model is loaded --------------------------
def resolve_drafter_spec(spec: str | Path) -> str | Path:
    """``"lookup"`` and ``"deepspec:<dir>"`` as given; a shipped kind (``mtp1``,
    ``parallel``, ``dspark``) -> its checkpoint folder under ``traces/data/drafters``;
    anything else is a checkpoint path."""
    s = str(spec)
    if s == "lookup" or s.startswith("deepspec:"):
        return s
    p = Path(s)
    if not p.exists() and (SHIPPED_DRAFTERS / s).is_dir():
        return SHIPPED_DRAFTERS / s
    return p


def _block_too_short(kind: str, trained_gamma: int, gamma_max: int) -> str | None:
    """Why a drafter cannot record ``gamma_max`` positions, or None. MTP-1 drafts
    recursively (any gamma); a block drafter has exactly its trained number of slots."""
    if kind == "mtp1" or trained_gamma >= gamma_max:
        return None
    return f"was trained for gamma {trained_gamma} < gamma_max {gamma_max}"


def check_drafter_spec(spec: str | Path, gamma_max: int, option: str = "--drafters") -> None:
    """The drafter exists and can draft ``gamma_max`` tokens, judged from its files alone
    (the sidecar JSON; the weights are not read)."""
    resolved = resolve_drafter_spec(spec)
    s = str(resolved)
    if s == "lookup":
        return
    if s.startswith("deepspec:"):
        if not Path(s[len("deepspec:"):]).is_dir():
            raise InputError(option, f"{spec!r}: {s[len('deepspec:'):]} is not a folder")
        return
    p = Path(resolved)
    folder = p.parent if p.is_file() else p
    sidecar = folder / "drafter.json"
    if not sidecar.is_file() or not (folder / "drafter.safetensors").is_file():
        raise InputError(option, f"unknown drafter {str(spec)!r}: not lookup, a shipped kind "
                         f"with a checkpoint ({', '.join(LEARNED_KINDS)}), deepspec:<dir> or a "
                         "checkpoint folder (drafter.safetensors + drafter.json)")
    try:
        cfg = json.loads(sidecar.read_text())["config"]
        kind, trained = str(cfg["kind"]), cfg["gamma"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(sidecar, f"unreadable drafter sidecar ({exc.__class__.__name__})") from None
    if isinstance(trained, bool) or not isinstance(trained, int) or trained < 1:
        # int() took true as 1 and 7.9 as 7
        raise InputError(sidecar, f"config 'gamma' must be an integer >= 1, got {trained!r}")
    why = _block_too_short(kind, trained, gamma_max)
    if why is not None:
        raise InputError("--gamma-max", f"drafter {str(spec)!r} {why}")


def check_capture_args(target: Any, drafters: Sequence[str], *, gamma_max: int,
                       max_new_tokens: int, per_domain: int, batch_size: int,
                       prompts: list[Prompt] | None, prompt_dir: str | Path,
                       out: str | Path | None, device: str) -> None:
    """Everything :func:`capture` can check without loading a model, so a bad argument
    fails in a second rather than after the minutes a model takes to load."""
    if not 1 <= gamma_max <= 32:
        raise InputError("--gamma-max", f"gamma_max must be in [1, 32], got {gamma_max}")
    if max_new_tokens < 2:
        raise InputError("--max-new-tokens", f"must be >= 2, got {max_new_tokens}")
    check_positive_int("--max-new-tokens", max_new_tokens, MAX_NEW_TOKENS)
    if per_domain < 1 or batch_size < 1:
        raise InputError("--per-domain", "per_domain and batch_size must be >= 1")
    check_device(device)
    if not drafters:
        raise InputError("--drafters", "name at least one drafter")
    for spec in drafters:
        check_drafter_spec(spec, gamma_max)
    if not isinstance(target, Target):
        check_target_spec(target)
    if out is not None:
        check_writable(out, "--out")
    # the files last: the default prompt folder lies in ../shared, which a clone may lack
    if prompts is None and not Path(prompt_dir).is_dir():
        raise InputError("--prompts", f"prompt folder {prompt_dir} not found")


# -- phases ----------------------------------------------------------------------------
def _load_drafters(specs: Sequence[str], tgt: Target, gamma_max: int
                   ) -> dict[str, tuple[Any, dict[str, Any]]]:
    """``{trace name: (model, sidecar info)}``; learned MTP-1 heads draft ``gamma_max``."""
    loaded: dict[str, tuple[Any, dict[str, Any]]] = {}
    for spec in specs:
        p = resolve_drafter_spec(spec)
        model, info = load_drafter(p, tgt)
        name = info.get("kind", str(spec)) if spec in ("lookup", *LEARNED_KINDS) \
            else Path(str(p)).name
        if isinstance(model, LearnedDrafter):
            why = _block_too_short(model.kind, model.cfg.gamma, gamma_max)
            if why is not None:
                raise InputError("--gamma-max", f"drafter {spec!r} {why}")
            model.cfg.gamma = max(model.cfg.gamma, gamma_max)
        loaded[name] = (model, info)
    return loaded


def _plan_chunks(tgt: Target, prompts: list[Prompt], loaded: dict, *, gamma_max: int,
                 max_new_tokens: int, batch_size: int, max_prompt_tokens: int
                 ) -> tuple[list[list[int]], str]:
    """Chunks of prompt indices (shortest first, so batches pad little) and the hash of
    everything that decides the shards' content (a resume must match it)."""
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
        "schema": 2,  # shards carry the v2 columns: never resume onto v1 shards
        "answer_tokens": capture_v2.ANSWER_TOKENS,
    }
    return chunks, hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:16]


def _open_manifest(work: Path, plan_hash: str, resume: bool) -> dict[str, Any]:
    """The shard manifest: the one on disk when resuming the same plan, else a fresh one
    (and a fresh work folder)."""
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
    return manifest


def records_frame(rows: dict[str, Any], request_ids: Sequence[int], domains: Sequence[str],
                  gamma_max: int, correct: np.ndarray | None = None) -> pl.DataFrame:
    """:func:`draft_rows` output as trace records: sequence ``i`` becomes request
    ``request_ids[i]`` of domain ``domains[i]`` with ``rows["per_seq"][i]`` positions. The
    schema-v2 columns ride along (``rows["v2"]`` and the per-request ``correct``)."""
    n = rows["per_seq"]
    v2 = rows.get("v2")
    if correct is not None:
        v2 = schema_v2.with_correct(v2, correct)
    return pl.DataFrame({
        "request_id": np.repeat(np.asarray(request_ids), n).astype(np.int32),
        "domain": np.repeat(np.asarray(domains), n).astype(str),
        "position": np.concatenate([np.arange(k) for k in n]).astype(np.int32),
        "accept_len": rows["accept_len"].astype(np.int8),
        "conf": pl.Series("conf", rows["conf"], dtype=pl.Array(pl.Float32, gamma_max)),
        "tv_accept": pl.Series("tv_accept", rows["tv_accept"],
                               dtype=pl.Array(pl.Float32, gamma_max)),
        **schema_v2.to_columns(v2, np.asarray(n), gamma_max),
    })


def _capture_chunk(ci: int, chunk: list[int], prompts: list[Prompt], tgt: Target,
                   shared: Shared, loaded: dict, work: Path, *, gamma_max: int,
                   max_new_tokens: int, max_prompt_tokens: int) -> dict[str, Any]:
    """Decode one chunk, record every drafter on it, write one shard per drafter; returns
    the chunk's manifest entry."""
    cp = [prompts[i] for i in chunk]
    layers = tgt.feature_layers(3) + [tgt.num_layers]
    recs = generate_cached(tgt, cp, max_new_tokens + gamma_max, layers,
                           batch_size=len(cp), max_prompt_tokens=max_prompt_tokens)
    store = SequenceStore.from_records(recs)
    trows = TargetRows(store, shared)
    correct = capture_v2.correctness_labels(tgt, cp, max_prompt_tokens)
    backend = ""
    for name, (model, _info) in loaded.items():
        rows = draft_rows(model, store, shared, gamma_max, max_new_tokens, target_rows=trows,
                          v2=True)
        backend = rows["backend"] or backend
        meta = TraceMeta(drafter=name, target=tgt.name, gamma_max=gamma_max, source="captured")
        frame = records_frame(rows, chunk, [r["domain"] for r in recs], gamma_max, correct)
        write_trace(trace_from_frame(frame, meta, "<capture>"), work / f"{name}-{ci:04d}.parquet")
    return {"prompts": [p.key for p in cp], "backend": backend,
            "greedy_agree": float(np.mean([float(r.get("greedy_agree", 1.0)) for r in recs]))}


def _run_chunks(chunks: list[list[int]], manifest: dict[str, Any], mpath: Path, run_one,
                label: str, progress: bool, fail_after: int | None) -> None:
    """Run the chunks the manifest does not list yet, recording each as it finishes."""
    bar = None
    if progress:
        from dspark_sim.io import progress_bar

        bar = progress_bar(transient=False)  # the label holds the target's name: no markup
        bar.start()
        task = bar.add_task(label, total=len(chunks))
        bar.update(task, completed=len(manifest["done"]))
    try:
        for ci, chunk in enumerate(chunks):
            if str(ci) in manifest["done"]:
                continue
            if fail_after is not None and len(manifest["done"]) >= fail_after:
                raise RuntimeError(f"capture stopped after {fail_after} chunk(s) (test hook)")
            manifest["done"][str(ci)] = run_one(ci, chunk)
            write_json_atomic(mpath, manifest)
            if bar is not None:
                bar.update(task, advance=1)
    finally:
        if bar is not None:
            bar.stop()


def _final_meta(name: str, info: dict[str, Any], tgt: Target, prompts: list[Prompt],
                domains: tuple[str, ...], manifest: dict[str, Any], date: str, *, gamma_max: int,
                max_new_tokens: int, max_prompt_tokens: int, per_domain: int,
                split_seed: int) -> TraceMeta:
    backends = {v.get("backend", "") for v in manifest["done"].values()} - {""}
    agree_all = [v.get("greedy_agree", 1.0) for v in manifest["done"].values()]
    return TraceMeta(
        drafter=name,
        target=tgt.name,
        gamma_max=gamma_max,
        source="captured",
        temperature=0.0,
        domains=domains,
        generator={
            "tool": "dspark_sim.traces.capture",
            "max_new_tokens": max_new_tokens,
            "prompts": {"split": "heldout", "split_seed": split_seed,
                        "train_fraction": TRAIN_FRACTION, "per_domain": per_domain,
                        "datasets": dict(sorted(Counter(p.dataset for p in prompts).items())),
                        "keys": [p.key for p in prompts]},
            "max_prompt_tokens": max_prompt_tokens,
            "chat_template": True,
        },
        extra={
            "drafter_checkpoint": _rel(info.get("path", "")),
            "drafter_checkpoint_sha256": info.get("sha256", ""),
            # the whole budget, warm-start chain included (a warm start's own "steps" is its last leg)
            "drafter_train_steps": info.get("total_steps", info.get("steps")),
            "target_source": tgt.source,
            "device": _device_desc(tgt),
            "kernel_backend": ",".join(sorted(backends)) or "none",
            "greedy_replay_agreement": float(np.mean(agree_all)) if agree_all else 1.0,
            "date": date,
            "torch": torch.__version__,
        },
    )


def _merge_shards(name: str, work: Path, num_chunks: int) -> pl.DataFrame:
    """One drafter's shards as one frame; request ids = the prompt's index (stable across
    resumes)."""
    parts = [read_trace(work / f"{name}-{ci:04d}.parquet") for ci in range(num_chunks)]
    merged = concat_traces(parts)
    rid = np.concatenate([p.req_ids for p in parts]).astype(np.int32)
    return merged.to_polars().with_columns(
        pl.Series("request_id", np.repeat(rid, merged.req_lengths).astype(np.int32)))


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
    check_capture_args(target, drafters, gamma_max=gamma_max, max_new_tokens=max_new_tokens,
                       per_domain=per_domain, batch_size=batch_size, prompts=prompts,
                       prompt_dir=prompt_dir, out=out, device=device)
    if prompts is None:  # read before the model loads: a bad file is refused in a second
        prompts = heldout_prompts(per_domain, split_seed, prompt_dir)
    if not prompts:
        raise InputError("--prompts", "no prompts to capture")
    tgt = target if isinstance(target, Target) else load_target(target, device=device)
    shared = Shared.of(tgt)
    if shared.head_weight.dtype != torch.float32:  # drafters run in fp32
        shared = Shared(shared.embed_weight.float(), shared.head_weight.float())
    loaded = _load_drafters(drafters, tgt, gamma_max)
    slug = _slug(tgt, target_slug)
    out_dir = Path(out) if out is not None else DATA_DIR
    work = out_dir / f".capture-{slug}"
    chunks, plan_hash = _plan_chunks(tgt, prompts, loaded, gamma_max=gamma_max,
                                     max_new_tokens=max_new_tokens, batch_size=batch_size,
                                     max_prompt_tokens=max_prompt_tokens)
    manifest = _open_manifest(work, plan_hash, resume)

    def run_one(ci: int, chunk: list[int]) -> dict[str, Any]:
        return _capture_chunk(ci, chunk, prompts, tgt, shared, loaded, work,
                              gamma_max=gamma_max, max_new_tokens=max_new_tokens,
                              max_prompt_tokens=max_prompt_tokens)

    _run_chunks(chunks, manifest, work / MANIFEST, run_one, f"capture {slug}", progress,
                _fail_after_chunks)

    date = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    written: dict[str, Path] = {}
    for name, (_model, info) in loaded.items():
        df = _merge_shards(name, work, len(chunks))
        domains = tuple(sorted(set(df["domain"].to_list())))
        meta = _final_meta(name, info, tgt, prompts, domains, manifest, date, gamma_max=gamma_max,
                           max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens,
                           per_domain=per_domain, split_seed=split_seed)
        path = out_dir / f"captured-{slug}-{name}.parquet"
        write_trace(trace_from_frame(df, meta, f"captured-{slug}-{name}"), path)
        written[name] = path
    shutil.rmtree(work, ignore_errors=True)
    return written
