"""What a bench run sends and when: request items from a file or a random dataset, and the
open-loop arrival times.

Inputs: JSONL (one object a line: ``prompt`` — text, or a list of token ids — or ``messages``,
optional ``system`` and ``max_tokens``), ShareGPT JSON (a list of ``{"conversations": [{"from":
"human", "value": ...}, {"from": "gpt", ...}]}``; the first human turn is the prompt), or
``random``: token-id prompts for the frame protocol (exact lengths) and word prompts for HTTP
(about one token a word: HTTP servers tokenize themselves, and the report takes prompt lengths
from their usage fields).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# Short, common English words: about one token each in BPE vocabularies.
_WORD_TEXT = """the of and to in is it you that he was for on are with as his they be at one have
this from or had by word but what some we can out other were all there when up use your how said an
each she which do their time if will way about many then them write would like so these her long
make thing see him two has look more day could go come did number sound no most people my over know
water than call first who may down side been now find"""
_WORDS = tuple(_WORD_TEXT.split())


class WorkloadError(ValueError):
    """An input file or length spec that cannot be used; the message names the file and line."""


@dataclass(slots=True)
class WorkItem:
    """One request to send. Exactly one of ``prompt``, ``prompt_ids``, ``messages`` is set
    (or none, with a ``prompt_id`` naming a registered prompt)."""

    max_tokens: int
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    system: str | None = None
    prompt_id: int = 0


def parse_len(text: str) -> tuple[int, int]:
    """``MEAN`` or ``MEAN:SPREAD`` -> (mean, spread); lengths are drawn uniformly from
    [MEAN-SPREAD, MEAN+SPREAD] (at least 1)."""
    try:
        mean, _, spread = text.partition(":")
        values = int(mean), int(spread or 0)
    except ValueError:
        raise WorkloadError(f"length must be MEAN or MEAN:SPREAD, integers; got {text!r}") from None
    if values[0] < 1 or values[1] < 0:
        raise WorkloadError(f"length needs MEAN >= 1 and SPREAD >= 0, got {text!r}")
    return values


def draw_lengths(spec: tuple[int, int], n: int, rng: np.random.Generator) -> np.ndarray:
    mean, spread = spec
    if not spread:
        return np.full(n, mean, np.int64)
    return np.maximum(1, rng.integers(mean - spread, mean + spread + 1, n))


def random_items(
    n: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    rng: np.random.Generator,
    *,
    ids: bool,
    vocab_size: int = 256,
) -> list[WorkItem]:
    """``n`` random prompts; token ids below ``vocab_size`` when ``ids``, else words."""
    ins = draw_lengths(input_len, n, rng)
    outs = draw_lengths(output_len, n, rng)
    items = []
    for length, max_tokens in zip(ins.tolist(), outs.tolist(), strict=True):
        if ids:
            items.append(
                WorkItem(max_tokens, prompt_ids=rng.integers(0, vocab_size, length).tolist())
            )
        else:
            words = rng.integers(0, len(_WORDS), length).tolist()
            items.append(WorkItem(max_tokens, prompt=" ".join(_WORDS[w] for w in words)))
    return items


def load_file(
    path: str | Path, output_len: tuple[int, int] | None, rng: np.random.Generator
) -> list[WorkItem]:
    """JSONL or ShareGPT JSON (told apart by the first non-blank character: ``[`` = ShareGPT).
    ``output_len`` overrides each item's max_tokens when given."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise WorkloadError(f"--input {path}: {exc.strerror or exc}") from None
    items = _sharegpt(path, text) if text.lstrip().startswith("[") else _jsonl(path, text)
    if not items:
        raise WorkloadError(f"--input {path}: no requests in the file")
    if output_len is not None:
        for item, n in zip(items, draw_lengths(output_len, len(items), rng).tolist(), strict=True):
            item.max_tokens = n
    return items


_DEFAULT_MAX_TOKENS = 128


def _jsonl(path: Path, text: str) -> list[WorkItem]:
    items = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"--input {path}, line {lineno}"
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise WorkloadError(f"{where}: not JSON ({exc})") from None
        if not isinstance(obj, dict) or ("prompt" in obj) == ("messages" in obj):
            raise WorkloadError(f'{where}: needs exactly one of "prompt" and "messages"')
        max_tokens = obj.get("max_tokens", _DEFAULT_MAX_TOKENS)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise WorkloadError(f"{where}: max_tokens must be a positive integer")
        system = obj.get("system")
        if system is not None and not isinstance(system, str):
            raise WorkloadError(f"{where}: system must be a string")
        prompt = obj.get("prompt")
        if isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt):
            items.append(WorkItem(max_tokens, prompt_ids=prompt, system=system))
        elif "prompt" in obj:
            if not isinstance(prompt, str):
                raise WorkloadError(f"{where}: prompt must be a string or a list of token ids")
            items.append(WorkItem(max_tokens, prompt=prompt, system=system))
        else:
            messages = obj["messages"]
            if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages
            ):
                raise WorkloadError(f'{where}: messages must be a list of {{"role", "content"}}')
            items.append(WorkItem(max_tokens, messages=messages, system=system))
    return items


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _sharegpt(path: Path, text: str) -> list[WorkItem]:
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise WorkloadError(f"--input {path}: not JSON ({exc})") from None
    items = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list):
            continue
        human = [t.get("value") for t in turns if isinstance(t, dict) and t.get("from") == "human"]
        reply = [t.get("value") for t in turns if isinstance(t, dict) and t.get("from") == "gpt"]
        if not human or not isinstance(human[0], str) or not human[0]:
            continue
        # Without the server's tokenizer the reply's length in tokens is estimated from words.
        words = len(reply[0].split()) if reply and isinstance(reply[0], str) else 0
        max_tokens = max(1, math.ceil(words * 4 / 3)) if words else _DEFAULT_MAX_TOKENS
        items.append(WorkItem(max_tokens, messages=[{"role": "user", "content": human[0]}]))
    return items


def arrival_offsets(
    n: int, request_rate: float, burstiness: float, rng: np.random.Generator
) -> np.ndarray:
    """Send times (seconds from the start) of ``n`` open-loop requests: gaps drawn from a gamma
    distribution with shape ``burstiness`` and mean 1/``request_rate`` (burstiness 1 = Poisson;
    below 1 burstier, above 1 more regular). An infinite rate sends everything at once."""
    if math.isinf(request_rate):
        return np.zeros(n)
    if request_rate <= 0 or burstiness <= 0:
        raise WorkloadError("--request-rate and --burstiness must be positive")
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    return np.cumsum(gaps)
