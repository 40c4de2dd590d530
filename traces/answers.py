"""Answer keys and exact-match scoring of the target's own continuations.

The per-request correctness label of schema v2 (``req_correct``): does the target's
greedy continuation reach the right final answer? Shipped key: GSM8K
(``traces/data/answers/gsm8k.json``: the final numbers of the GSM8K test set in the line
order of the shared prompt file, with source and licence). Prompts of other datasets get
``-1`` (no key).

Scoring (GSM8K exact match, the usual convention): the prediction is the content of the
last ``\\boxed{...}`` in the text (the prompts ask for it), else the last number in the
text; both sides lose ``$``, ``,`` and surrounding spaces and compare as numbers.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

ANSWER_DIR = Path(__file__).resolve().parent / "data" / "answers"
_NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


@cache
def answer_key(dataset: str) -> tuple[str, ...] | None:
    """Final answers by prompt index (line number), or None if no key ships."""
    f = ANSWER_DIR / f"{dataset}.json"
    if not f.is_file():
        return None
    return tuple(json.loads(f.read_text())["answers"])


def _boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (balanced braces), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None  # unclosed: the continuation was cut off inside the box


def _number(s: str) -> float | None:
    m = _NUM.findall(s.replace("$", ""))
    if not m:
        return None
    try:
        return float(m[-1].replace(",", ""))
    except ValueError:
        return None


def extract_answer(text: str) -> float | None:
    """The predicted final number: last ``\\boxed{}`` if any, else the last number."""
    box = _boxed(text)
    return _number(box if box is not None else text)


def is_correct(text: str, answer: str) -> bool:
    pred, gold = extract_answer(text), _number(answer)
    return pred is not None and gold is not None and abs(pred - gold) < 1e-6


def correctness(dataset: str, index: int, text: str) -> int:
    """1 / 0 against the shipped key, -1 when the dataset has no key."""
    key = answer_key(dataset)
    if key is None or not 0 <= index < len(key):
        return -1
    return int(is_correct(text, key[index]))
