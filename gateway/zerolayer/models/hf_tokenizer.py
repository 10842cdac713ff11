"""Checkpoint tokenizers: tokenizer.json through the ``tokenizers`` library, chat templates
through jinja2.

``HFTokenizer`` reads what a Hugging Face checkpoint directory ships next to its weights:
tokenizer.json (required), tokenizer_config.json (BOS/EOS tokens, add_bos_token, chat_template,
and ``eog_token_ids`` in a directory converted from a GGUF),
chat_template.jinja, generation_config.json and config.json (fallback token ids).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer as _RustTokenizer

from zerolayer.models.templates import template_supports_tools
from zerolayer.tokenizer import TemplateRefused, Tokenizer

if TYPE_CHECKING:
    from jinja2 import Template

_GIL_HELD_CHARS = 16 * 1024  # up to this many characters, ``encode`` (no thread hop) is cheaper


class TokenizerLoadError(Exception):
    """The tokenizer files are missing or invalid; the message names the file."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise TokenizerLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerLoadError(f"{path} must hold a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _raise_exception(message: str) -> None:
    # Chat templates call raise_exception() to reject conversations they cannot render.
    raise TemplateRefused(f"the chat template refused the conversation: {message}")


def _byte_map() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is written as in a piece."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


_BYTE_OF = _byte_map()


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_template(source: str) -> Template:
    # Templates come with the checkpoint; render them sandboxed, with the options transformers
    # uses, so whitespace matches what the model was trained on.
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class HFTokenizer(Tokenizer):
    """A tokenizer.json tokenizer with the checkpoint's special tokens and chat template.

    Without a chat template, chats render in the same plain format as ``ByteTokenizer``:
    ``<|system|>\\n{system}\\n<|user|>\\n{content}\\n...<|assistant|>\\n``.
    """

    def __init__(self, directory: str | Path) -> None:
        directory = Path(directory)
        tok_file = directory / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerLoadError(f"{directory}: tokenizer.json is missing")
        self.json_path = tok_file
        try:
            self._tok = _RustTokenizer.from_file(str(tok_file))
        except Exception as exc:  # the Rust library raises a bare Exception
            raise TokenizerLoadError(f"cannot load {tok_file}: {exc}") from exc

        tok_cfg = _read_json(directory / "tokenizer_config.json")
        gen_cfg = _read_json(directory / "generation_config.json")
        model_cfg = _read_json(directory / "config.json")

        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token = _token_content(tok_cfg.get("bos_token"))
        self.eos_token = _token_content(tok_cfg.get("eos_token"))
        self.bos_token_id = self._special_id(self.bos_token, gen_cfg, model_cfg, "bos_token_id")

        # generation_config's eos list wins (Llama 3 instruct ends turns with <|eot_id|> too);
        # the first of it is the one WELCOME reports.
        eos_ids = _as_id_list(gen_cfg.get("eos_token_id"))
        token_eos = self._token_id(self.eos_token)
        if token_eos is not None and token_eos not in eos_ids:
            eos_ids.append(token_eos)
        # eog_token_ids: what gguf_tokenizer writes for a converted GGUF (llama.cpp's end-of-
        # generation tokens, e.g. Gemma's <end_of_turn> beside <eos>).
        for extra in _as_id_list(model_cfg.get("eos_token_id")) + _as_id_list(
            tok_cfg.get("eog_token_ids")
        ):
            if extra not in eos_ids:
                eos_ids.append(extra)
        self.eos_token_id = eos_ids[0] if eos_ids else -1
        self.eos_token_ids = frozenset(eos_ids)
        if self.bos_token is None and self.bos_token_id >= 0:
            self.bos_token = self._tok.id_to_token(self.bos_token_id)
        if self.eos_token is None and self.eos_token_id >= 0:
            self.eos_token = self._tok.id_to_token(self.eos_token_id)

        add_bos = tok_cfg.get("add_bos_token")
        if add_bos is None:
            # No explicit flag: follow tokenizer.json's post-processor (Llama 3 adds BOS there).
            probe = self._tok.encode("a", add_special_tokens=True).ids
            add_bos = bool(probe) and probe[0] == self.bos_token_id
        self.add_bos = bool(add_bos) and self.bos_token_id >= 0

        self.chat_template_source = self._find_template(directory, tok_cfg)
        self._template = (
            _compile_template(self.chat_template_source) if self.chat_template_source else None
        )
        self.renders_tools = template_supports_tools(self.chat_template_source)
        self._byte_level: bool | None = None  # the decoder is byte-level BPE (read at first use)

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def _special_id(
        self, token: str | None, gen_cfg: dict[str, Any], model_cfg: dict[str, Any], key: str
    ) -> int:
        found = self._token_id(token)
        if found is not None:
            return found
        for cfg in (gen_cfg, model_cfg):
            ids = _as_id_list(cfg.get(key))
            if ids:
                return ids[0]
        return -1

    @staticmethod
    def _find_template(directory: Path, tok_cfg: dict[str, Any]) -> str | None:
        jinja_file = directory / "chat_template.jinja"
        if jinja_file.is_file():
            return jinja_file.read_text(encoding="utf-8")
        template = tok_cfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return template if isinstance(template, str) else None

    def encode(self, text: str) -> list[int]:
        # Special-token strings in the text (e.g. "<|begin_of_text|>" from a rendered template)
        # are split out by the library's added-token matching and keep their ids.
        if len(text) <= _GIL_HELD_CHARS:
            return self._tok.encode(text, add_special_tokens=False).ids
        # The library's ``encode`` holds the GIL throughout (2.2 s for 2.6 MB on this machine,
        # the event loop stopped with it, even from the offload pool); ``encode_batch`` releases
        # it while the Rust side works, so a large text tokenized on
        # zerolayer.request_path.offload's threads leaves the loop running.
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """A token's bytes from its piece: byte-level BPE pieces through GPT-2's byte map,
        SentencePiece pieces with their ``▁`` spaces and ``<0xNN>`` byte-fallback tokens;
        special tokens as their text."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level is None:
            decoder = json.loads(self._tok.to_str()).get("decoder") or {}
            kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", [])]
            self._byte_level = "ByteLevel" in kinds
        if self._byte_level and all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes((int(piece[3:5], 16),))
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode("utf-8")

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        system: str | None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        if self._template is None:
            parts = [f"<|system|>\n{system}\n"] if system else []
            parts += [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
            if messages:
                parts.append("<|assistant|>\n")
            return "".join(parts)
        full = [{"role": "system", "content": system}] if system else []
        full += messages
        extra = {"tools": tools} if tools else {}
        return self._template.render(
            messages=full,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            # A chat with no messages yet is a system-prompt prefix: no assistant turn opens.
            add_generation_prompt=bool(messages),
            **extra,
        )
