"""What a Hugging Face ``config.json`` must hold before a roofline sheet is derived from it.

The derivation (:func:`dspark_sim.calibration.roofline.model_sheet_from_hf_config`)
reads shapes with ``int(...)`` and divides by them, so a field that is missing, zero,
negative, a string or a boolean became a KeyError, a ZeroDivisionError or a model with
no attention, or (``"tie_word_embeddings": "false"`` is truthy) silently the wrong size.
Every field it reads is checked here first, against the same optional/required split
the derivation uses, and a bad one is refused naming the file and the key. Kept apart
from the cost model so that the formulas and their input checks change independently.
"""

from __future__ import annotations

import numbers
from typing import Any

from dspark_sim.errors import InputError

# Past any real model's dimension, and far below what float() overflows on (a JSON 1e400
# integer parses exactly, then turns the parameter count into inf).
MAX_DIMENSION = 1 << 40


def _int(where: str, cfg: dict, key: str, *, required: bool, low: int = 1) -> int | None:
    """``cfg[key]`` as an integer >= ``low``; None when absent or null and not required
    (the derivation's ``cfg.get(key) or default`` then applies; 0 stays a value here
    only where the derivation reads it as one)."""
    v = cfg.get(key)
    if v is None:
        if required:
            raise InputError(where, f"missing {key!r} (an integer >= {low})")
        return None
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise InputError(where, f"{key!r} must be an integer >= {low}, got {v!r}")
    if not low <= v <= MAX_DIMENSION:
        raise InputError(where, f"{key!r} must be an integer in [{low}, {MAX_DIMENSION:,}], "
                                f"got {v!r}")
    return int(v)


def _bool(where: str, cfg: dict, key: str) -> None:
    v = cfg.get(key)
    if v is not None and not isinstance(v, bool):
        raise InputError(where, f"{key!r} must be true or false, got {v!r}")


def check_hf_config(cfg: Any, where: str) -> None:
    """Refuse a ``config.json`` the roofline derivation cannot turn into a model sheet
    (``where``: the file, for the one-line error)."""
    if not isinstance(cfg, dict):
        raise InputError(where, f"an HF config is a JSON object, got {type(cfg).__name__}")
    h = _int(where, cfg, "hidden_size", required=True)
    layers = _int(where, cfg, "num_hidden_layers", required=True)
    _int(where, cfg, "vocab_size", required=True)
    heads = _int(where, cfg, "num_attention_heads", required=True)
    kv_heads = _int(where, cfg, "num_key_value_heads", required=False, low=0)
    if kv_heads and kv_heads > heads:
        raise InputError(where, f"'num_key_value_heads' ({kv_heads}) exceeds "
                                f"'num_attention_heads' ({heads})")
    if not _int(where, cfg, "head_dim", required=False, low=0) and h < heads:
        raise InputError(where, f"'hidden_size' ({h}) is smaller than 'num_attention_heads' "
                                f"({heads}) and no 'head_dim' is given: a head would have "
                                "no width")
    _bool(where, cfg, "tie_word_embeddings")
    _bool(where, cfg, "use_sliding_window")
    for key in ("torch_dtype", "dtype"):
        if cfg.get(key) is not None and not isinstance(cfg[key], str):
            raise InputError(where, f"{key!r} must be a string such as \"bfloat16\", "
                                    f"got {cfg[key]!r}")
    if "kv_lora_rank" in cfg:  # MLA
        _int(where, cfg, "kv_lora_rank", required=True)
        _int(where, cfg, "q_lora_rank", required=False, low=0)
        for key in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            _int(where, cfg, key, required=False)
    experts = (_int(where, cfg, "n_routed_experts", required=False, low=0)
               or _int(where, cfg, "num_experts", required=False, low=0))
    if experts:
        top_k = _int(where, cfg, "num_experts_per_tok", required=False)
        if top_k is not None and top_k > experts:
            raise InputError(where, f"'num_experts_per_tok' ({top_k}) exceeds the "
                                    f"{experts} routed experts")
        _int(where, cfg, "moe_intermediate_size", required=True)
        dense_layers = _int(where, cfg, "first_k_dense_replace", required=False, low=0)
        if dense_layers is not None and dense_layers > layers:
            raise InputError(where, f"'first_k_dense_replace' ({dense_layers}) exceeds the "
                                    f"{layers} layers")
        _int(where, cfg, "n_shared_experts", required=False, low=0)
        _int(where, cfg, "intermediate_size", required=False, low=0)
    else:
        _int(where, cfg, "intermediate_size", required=True)
    if cfg.get("use_sliding_window"):
        _int(where, cfg, "sliding_window", required=False)
    _int(where, cfg, "max_position_embeddings", required=False, low=0)
