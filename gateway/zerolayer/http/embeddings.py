"""POST /v1/embeddings: the request's inputs → one Request of k inputs, and the list answer.

An embedding is the served model's own: the last layer's states after the final norm (what the
LM head reads), averaged over the input's tokens and L2-normalised (docs/http.md says why). Each
input runs as its own engine sequence through the one request path (auth, rate limits, budgets,
metrics); the engine batches them with everything else. ``encoding_format`` ``base64`` is the
vector's little-endian float32 bytes (what the openai SDK asks for by default, and decodes).
"""

from __future__ import annotations

import base64

import numpy as np

from zerolayer.codes import invalid
from zerolayer.http.errors import OPENAI
from zerolayer.http.fields import check_model
from zerolayer.http.json_body import dumps
from zerolayer.http.logprobs import TokenLogprobs
from zerolayer.http.reply import ChoiceOut, Reply
from zerolayer.request_path.request import Request
from zerolayer.request_path.validation import (
    JsonObject,
    check_keys,
    get_text,
    get_token_ids,
    load_object,
    validate,
)

EMBEDDINGS_KEYS = frozenset(("input", "model", "encoding_format", "dimensions", "user"))
MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request
_FORMATS = ("float", "base64")


def _inputs(obj: JsonObject) -> list[str | np.ndarray]:
    """``input``: a string, a list of strings, a list of token ids, or a list of such lists."""
    value = obj.get("input")
    if isinstance(value, str):
        return [get_text(value, "input", allow_empty=False)]
    if not isinstance(value, list) or not value:
        raise invalid("input must be a non-empty string or list", "input")
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [get_token_ids(value, "input")]
    if len(value) > MAX_INPUTS:
        raise invalid(f"input may hold at most {MAX_INPUTS} inputs, got {len(value)}", "input")
    out: list[str | np.ndarray] = []
    for i, one in enumerate(value):
        where = f"input[{i}]"
        if isinstance(one, str):
            out.append(get_text(one, where, allow_empty=False))
        else:
            out.append(get_token_ids(one, where))
    return out


def parse_embeddings(body: bytes, served: str, hidden_size: int) -> EmbeddingsReply:
    """POST /v1/embeddings → a Request of k inputs (max_tokens 0: the prompts only)."""
    obj = load_object(body)
    check_keys(obj, EMBEDDINGS_KEYS)
    model = check_model(obj, served)
    inputs = _inputs(obj)
    fmt = obj.get("encoding_format", "float")
    if fmt not in _FORMATS:
        raise invalid(
            f"encoding_format must be 'float' or 'base64', got {fmt!r}", "encoding_format"
        )
    dimensions = obj.get("dimensions")
    if dimensions is not None and dimensions != hidden_size:
        raise invalid(
            f"dimensions: this model's embeddings have {hidden_size} dimensions and are not "
            f"shortened; leave dimensions out (or give {hidden_size})",
            "dimensions",
        )
    req = Request(max_tokens=0, embed=True, inputs=inputs)
    return EmbeddingsReply(validate(req), model, fmt == "base64")


class EmbeddingsReply(Reply):
    """The list of embeddings, one per input (a choice each), once every input ended."""

    __slots__ = ("b64",)

    api = OPENAI

    def __init__(self, req: Request, model: str, b64: bool) -> None:
        super().__init__(req, False, model)
        assert req.inputs is not None
        k = len(req.inputs)
        self.choices = [ChoiceOut(i, None) for i in range(k)]
        self.left = k
        self.b64 = b64

    def _vector(self, pooled: np.ndarray) -> str | list[float]:
        if self.b64:
            return base64.b64encode(pooled.astype("<f4").tobytes()).decode()
        vector: list[float] = pooled.tolist()
        return vector

    def body(self) -> bytes:
        data = []
        tokens = 0
        for choice in self.choices:
            ending = choice.ending
            assert ending is not None
            tokens += ending.prompt_tokens
            # None only for an input the drain deadline cut off before its prefill completed.
            vector = None if choice.pooled is None else self._vector(choice.pooled)
            data.append({"object": "embedding", "index": choice.index, "embedding": vector})
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return dumps({"object": "list", "data": data, "model": self.model, "usage": usage})

    # Never streamed, and no text: nothing is written per token.
    def token(self, out: bytearray, choice: int, text: str) -> None:
        pass

    def delta(self, out: bytearray, choice: int, text: str, lp: TokenLogprobs | None) -> None:
        pass

    def end(self, out: bytearray, choice: int) -> None:
        pass
