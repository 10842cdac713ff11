"""A tiny transformers Llama checkpoint with a word-level tokenizer and a chat template, made at
test time."""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 300


SPECIAL = ["<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> "
    "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def write_checkpoint(directory: Path) -> None:
    import torch
    import transformers
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models, pre_tokenizers

    torch.manual_seed(7)
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=1,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # wider weights than the default: decisive greedy choices
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    model.save_pretrained(directory, safe_serialization=True)
    vocab = {t: i for i, t in enumerate(SPECIAL)}
    words = ["you", "are", "a", "terse", "assistant", "answer", "in", "one", "short"]
    words += ["sentence", "what", "is", "haiku"]
    vocab.update({w: len(SPECIAL) + i for i, w in enumerate(words)})
    vocab.update({f"w{i}": i for i in range(len(vocab), VOCAB)})
    tok = RustTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIAL[:2] + SPECIAL[3:])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "add_bos_token": True,
                "chat_template": TEMPLATE,
            }
        )
    )


def checkpoint_backend(directory: Path, num_slots: int = 2, max_context: int = 256):  # noqa: ANN201
    """(CpuBackend, tokenizer) on a checkpoint written into ``directory`` by write_checkpoint."""
    from zerolayer.engine.backends.cpu import CpuBackend
    from zerolayer.models.loader import load_checkpoint

    write_checkpoint(directory)
    loaded = load_checkpoint(directory, max_context=max_context)
    return CpuBackend(loaded, num_slots=num_slots, max_context=max_context), loaded.tokenizer
