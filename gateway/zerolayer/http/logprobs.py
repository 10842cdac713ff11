"""Logprobs in the OpenAI APIs' shapes, from the engine's per-token ``Logprobs``.

The engine gives each token that asked its logprob and its ``top_logprobs`` most likely
alternatives (ids; the distribution is the one gateway/zerolayer/engine/sampling.py names).
``TokenStrings`` turns an id into the text and bytes the APIs report (made once per daemon, cached
per id, and as the JSON around a logprob: a streamed token's 20 alternatives are joined strings,
not 21 dicts through the JSON encoder); ``chat_entry`` is one item of Chat Completions'
``choices[i].logprobs.content``, ``chat_entry_json`` the same item as JSON text;
``CompletionLogprobs`` collects the legacy Completions' parallel lists (``tokens``,
``token_logprobs``, ``top_logprobs``, ``text_offset``, offsets counted in characters of the
tokens' texts from the start of the completion); with ``echo``, ``prompt`` starts them with the
prompt's tokens (the first one's logprob and alternatives null, as vLLM: nothing predicts it) and
the offsets count from the start of the prompt.
"""

from __future__ import annotations

import math
from json.encoder import encode_basestring
from typing import Any, NamedTuple

import numpy as np

from zerolayer.engine.step import Logprobs
from zerolayer.engine.types import PromptLogprobs
from zerolayer.tokenizer import Tokenizer


class TokenLogprobs(NamedTuple):
    """One generated token and the engine's logprobs for it."""

    token: int
    lp: Logprobs


class TokenStrings:
    """A token id's text (its bytes read as UTF-8, U+FFFD for a piece of a character) and its
    bytes, as the APIs report them."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._json: dict[int, tuple[str, str]] = {}

    def decode(self, ids: np.ndarray) -> str:
        """Ids as text (a prompt given as ids, echoed)."""
        return self._tok.decode(ids.tolist())

    def get(self, token_id: int) -> tuple[str, list[int]]:
        found = self._cache.get(token_id)
        if found is None:
            raw = self._tok.token_bytes(token_id)
            found = (raw.decode("utf-8", "replace"), list(raw))
            if len(self._cache) < 1 << 20:
                self._cache[token_id] = found
        return found

    def fragments(self, token_id: int) -> tuple[str, str]:
        """The JSON of ``{"token", "logprob", "bytes"}`` for this id around its logprob:
        ``'{"token":"…","logprob":'`` and ``',"bytes":[…]'`` (the object left open)."""
        found = self._json.get(token_id)
        if found is None:
            text, raw = self.get(token_id)
            found = (
                f'{{"token":{encode_basestring(text)},"logprob":',
                f',"bytes":[{",".join(map(str, raw))}]',
            )
            if len(self._json) < 1 << 20:
                self._json[token_id] = found
        return found


def _number(value: float) -> str:
    """A float as the JSON encoder writes it (NaN and the infinities as Python's json does)."""
    if math.isfinite(value):
        return repr(value)
    return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")


def _floats(values: np.ndarray) -> list[float]:
    return [float(v) for v in values.tolist()]


def chat_entry(strings: TokenStrings, item: TokenLogprobs) -> dict[str, Any]:
    """``{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}``."""
    text, raw = strings.get(item.token)
    top = []
    for tid, value in zip(item.lp.top_ids.tolist(), _floats(item.lp.top), strict=True):
        t_text, t_raw = strings.get(tid)
        top.append({"token": t_text, "logprob": value, "bytes": t_raw})
    return {"token": text, "logprob": float(item.lp.token), "bytes": raw, "top_logprobs": top}


def chat_entry_json(strings: TokenStrings, item: TokenLogprobs) -> str:
    """``chat_entry(strings, item)`` as compact JSON text, from the ids' cached fragments."""
    head, tail = strings.fragments(item.token)
    fragments = strings.fragments
    values = item.lp.top.tolist()
    # One repr for the k floats (the JSON encoder's float text, as repr is), unless one is not
    # finite (a masked token: the encoder's spelling).
    finite = bool(np.isfinite(item.lp.top).all())
    numbers = repr(values)[1:-1].split(", ") if finite and values else list(map(_number, values))
    top = ",".join(
        f"{t_head}{number}{t_tail}}}"
        for (t_head, t_tail), number in zip(
            map(fragments, item.lp.top_ids.tolist()), numbers, strict=True
        )
    )
    return f'{head}{_number(float(item.lp.token))}{tail},"top_logprobs":[{top}]}}'


class CompletionLogprobs:
    """The legacy Completions' ``logprobs`` object of one choice, growing per token; ``take``
    returns what came since the last call (a streamed chunk's part)."""

    __slots__ = ("strings", "offset", "tokens", "token_logprobs", "top_logprobs", "text_offset")

    def __init__(self, strings: TokenStrings) -> None:
        self.strings = strings
        self.offset = 0
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def prompt(self, ids: np.ndarray, scored: PromptLogprobs | None) -> None:
        """The prompt's tokens first (echo): each id after the first with its logprob and its
        alternatives, the id itself among them (vLLM's prompt logprobs include it)."""
        get = self.strings.get
        id_list = ids.tolist()
        for i, token in enumerate(id_list):
            text = get(token)[0]
            self.tokens.append(text)
            self.text_offset.append(self.offset)
            self.offset += len(text)
            if i == 0 or scored is None:
                self.token_logprobs.append(None)
                self.top_logprobs.append(None)
                continue
            value = float(scored.token[i - 1])
            self.token_logprobs.append(value)
            top = {
                get(tid)[0]: v
                for tid, v in zip(
                    scored.top_ids[i - 1].tolist(), _floats(scored.top[i - 1]), strict=True
                )
            }
            top.setdefault(text, value)
            self.top_logprobs.append(top)

    def add(self, item: TokenLogprobs) -> None:
        text, _ = self.strings.get(item.token)
        self.tokens.append(text)
        self.token_logprobs.append(float(item.lp.token))
        self.top_logprobs.append(
            {
                self.strings.get(tid)[0]: value
                for tid, value in zip(item.lp.top_ids.tolist(), _floats(item.lp.top), strict=True)
            }
        )
        self.text_offset.append(self.offset)
        self.offset += len(text)

    def body(self, start: int = 0) -> dict[str, Any]:
        return {
            "tokens": self.tokens[start:],
            "token_logprobs": self.token_logprobs[start:],
            "top_logprobs": self.top_logprobs[start:],
            "text_offset": self.text_offset[start:],
        }
