"""Prompts of token ids, new in every round: what a side-by-side benchmark sends so that no
server answers a round from its prefix cache (llama-server's slots and ZeroLayer's prefix store
both reuse a prompt they have seen), and so that a prompt's length is the length stated, in
tokens, whatever the server's tokenizer.

A run's prompts are a JSONL file for ``zerolayer bench --input`` (``{"prompt": [ids],
"max_tokens": n}`` a line, sent as token ids over OpenAI completions). The ids are drawn from a
set of plain tokens (no control token; in the scale files, nothing a merge would change; in a
real file, the tokens its vocabulary types as normal: ``normal_tokens``) by a generator seeded
from the run's names — the model, the round, the stream count — so a rerun sends the same
prompts, every round and stream count gets new ones, and the servers measured in one round get
the same ones.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np


def seed_for(*names: str | int) -> int:
    """A seed made from ``names`` (stable across processes, unlike ``hash``)."""
    return zlib.crc32("\x1f".join(map(str, names)).encode())


def token_prompts(count: int, length: int, ids: np.ndarray, seed: int) -> list[list[int]]:
    """``count`` prompts of ``length`` ids each, drawn uniformly from ``ids``."""
    if not len(ids):
        raise ValueError("no token ids to draw prompts from")
    rng = np.random.default_rng(seed)
    return np.asarray(ids)[rng.integers(0, len(ids), (count, length))].tolist()


def normal_tokens(path: Path) -> np.ndarray:
    """The ids a GGUF file's vocabulary types as normal text (``tokenizer.ggml.token_type``
    1): no control, byte, unknown or unused token."""
    import gguf

    field = gguf.GGUFReader(str(path)).fields["tokenizer.ggml.token_type"]
    types = np.asarray([field.parts[i][0] for i in field.data])
    return np.flatnonzero(types == 1)


def write_prompts(
    path: Path,
    *,
    count: int,
    length: int,
    max_tokens: int,
    ids: np.ndarray,
    seed: int,
) -> Path:
    """The JSONL file ``zerolayer bench --input`` reads: ``count`` fresh prompts."""
    lines = [
        json.dumps({"prompt": prompt, "max_tokens": max_tokens})
        for prompt in token_prompts(count, length, ids, seed)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path
