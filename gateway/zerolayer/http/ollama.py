"""Ollama's API on the HTTP port (paths under ``/api/``): its bodies read into the OpenAI
parsers' fields (one validation, one request path), its answers written as NDJSON.

``/api/chat`` and ``/api/generate`` are translated field by field into an OpenAI chat (or,
``raw: true``, completion) body and parsed by zerolayer.http.openai, so every check and every
sampling rule is the OpenAI door's; ``OllamaReply`` writes the answer: NDJSON lines
(``stream`` defaults to true) or one object. ``options`` map onto our sampling fields
(``OPTIONS``); those with no effect here are ignored (``IGNORED``), the samplers we do not
have are refused unless set to their no-op value (``NO_OP``), any other key is a 400 naming
``options.<key>``.

``/api/version``, ``/api/tags``, ``/api/ps`` and ``/api/show`` describe the one served model
in Ollama's shapes (``OLLAMA_API_VERSION`` is the Ollama release whose shapes these are:
clients gate features on it). ``model`` is the served name, with or without Ollama's
``:latest`` tag (listed with it); another name is 404 ``{"error": "model '<x>' not found"}``.
Facts we do not have (file size, quantization, family) are empty or 0, never made up.
``/api/embed`` and ``/api/embeddings`` answer 501 in Ollama's error shape until the engine
has embeddings.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from zerolayer.codes import FINISH_NAMES, OLLAMA, Refusal
from zerolayer.http import openai
from zerolayer.http.errors import HttpError, http_error
from zerolayer.http.json_body import dumps
from zerolayer.http.logprobs import TokenLogprobs
from zerolayer.http.reply import Reply

OLLAMA_API_VERSION = "0.12.0"
TAG = ":latest"
_FAR_FUTURE = "2318-01-01T00:00:00Z"  # /api/ps: a model that is never unloaded


class OllamaModel:
    """The served model as Ollama's listings describe it (bodies built once)."""

    def __init__(self, name: str, max_context: int, zerolayer_version: str) -> None:
        self.name = name
        started = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        entry = {
            "name": name + TAG,
            "model": name + TAG,
            "modified_at": started,
            "size": 0,  # unknown: the weights may be made, converted or mapped
            "digest": hashlib.sha256(name.encode()).hexdigest(),
            "details": {
                "parent_model": "",
                "format": "",
                "family": "",
                "families": [],
                "parameter_size": "",
                "quantization_level": "",
            },
        }
        self.version_body = dumps({"version": OLLAMA_API_VERSION, "zerolayer": zerolayer_version})
        self.tags_body = dumps({"models": [entry]})
        self.ps_body = dumps({"models": [{**entry, "expires_at": _FAR_FUTURE, "size_vram": 0}]})
        self.show_body = dumps(
            {
                "modelfile": f"# served by zerolayer\nFROM {name}\n",
                "parameters": "",
                "template": "",
                "details": entry["details"],
                "model_info": {"general.name": name, "general.context_length": max_context},
                "capabilities": ["completion"],
                "modified_at": started,
            }
        )

    def check(self, body: bytes) -> dict[str, Any]:
        """Refuse a request body that does not name the served model (``model``, or the old
        ``name``): 400 when it is missing or not a string, 404 when it is another model."""
        try:
            obj = json.loads(body)
        except ValueError:
            raise HttpError(400, "the body is not JSON") from None
        if not isinstance(obj, dict):
            raise HttpError(400, "the body must be a JSON object")
        model = obj.get("model", obj.get("name"))
        if not isinstance(model, str) or not model:
            raise HttpError(400, "model: a model name (string) is required", param="model")
        if model.removesuffix(TAG) != self.name:
            raise HttpError(404, f"model '{model}' not found", param="model")
        return obj

    def show(self, body: bytes) -> bytes:
        self.check(body)
        return self.show_body


def not_available(endpoint: str) -> HttpError:
    """``/api/embed`` and ``/api/embeddings``: Ollama's shapes of embeddings are not written yet
    (the engine's embeddings are served at ``/v1/embeddings``)."""
    return HttpError(
        501, f"{endpoint} is not available yet: the same embeddings are at POST /v1/embeddings"
    )


# options → our field (Ollama's num_predict -1/-2, "until the context is full", is our default)
OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "num_predict": "max_tokens",
    "stop": "stop",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
# Ollama's own defaults where they differ from ours (its sampler runs unless told otherwise)
DEFAULTS = {"temperature": 0.8, "top_p": 0.9, "top_k": 40}
# load-time settings and switches with no effect on this server: accepted and ignored
IGNORED = frozenset(
    [
        "num_ctx",
        "num_keep",
        "num_batch",
        "num_gpu",
        "main_gpu",
        "low_vram",
        "numa",
        "num_thread",
        "use_mmap",
        "use_mlock",
        "vocab_only",
        "embedding_only",
        "logits_all",
        "repeat_last_n",
        "penalize_newline",
    ]
)
# samplers we do not have: accepted at their no-op value only
NO_OP = {"typical_p": 1, "tfs_z": 1, "mirostat": 0}
# top-level fields of /api/chat and /api/generate refused by name (no way to serve them yet)
_REFUSED = ("images", "suffix", "template", "context", "tools", "logprobs", "top_logprobs")


def _sampling(obj: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI body fields of ``options`` and ``format`` (module docstring)."""
    options = obj.get("options")
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise HttpError(400, "options must be an object", param="options")
    fields: dict[str, Any] = dict(DEFAULTS)
    for key, value in options.items():
        if key in OPTIONS:
            if key == "num_predict" and isinstance(value, int) and value < 0:
                continue  # -1 / -2: as long as the context allows
            fields[OPTIONS[key]] = value
        elif key in NO_OP:
            if value != NO_OP[key]:
                raise HttpError(
                    400,
                    f"options.{key}: not supported here (only {NO_OP[key]}, its no-op value)",
                    param=f"options.{key}",
                )
        elif key not in IGNORED:
            raise HttpError(400, f"options.{key}: unknown option", param=f"options.{key}")
    fmt = obj.get("format")
    if fmt == "json":
        fields["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        fields["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "format", "schema": fmt},
        }
    elif fmt not in (None, ""):
        raise HttpError(400, 'format: "json" or a JSON schema (object)', param="format")
    if obj.get("think") not in (None, False):
        raise HttpError(400, "think: only false (this server does not think aloud)", param="think")
    for name in _REFUSED:
        if obj.get(name):
            raise HttpError(400, f"{name}: not supported on this server", param=name)
    return fields


# our field → the Ollama field a refusal names (the inverse of OPTIONS, and format)
_OLLAMA_NAMES = {
    "response_format.json_schema.schema": "format",
    "response_format": "format",
    **{ours: f"options.{theirs}" for theirs, ours in OPTIONS.items()},
}


def ollama_named(err: HttpError) -> HttpError:
    """``err`` naming Ollama's field where it names ours (``response_format`` → ``format``,
    ``max_tokens`` → ``options.num_predict``, ...)."""
    param = err.param or ""
    for ours, theirs in _OLLAMA_NAMES.items():
        if param == ours or param.startswith(ours + "."):
            named = theirs + param[len(ours) :]
            message = err.message.replace(param, named, 1)
            return HttpError(err.status, message, param=named, error=err.error)
    return err


def _parsed(parse: Callable[[bytes, str], Reply], fields: dict[str, Any], served: str) -> Reply:
    """The OpenAI parser's Request for ``fields``; its refusals name Ollama's fields."""
    try:
        return parse(dumps(fields), served)
    except HttpError as err:
        raise ollama_named(err) from None
    except Refusal as refusal:  # a field's value checked while parsing
        raise ollama_named(http_error(refusal)) from None


def _streamed(obj: dict[str, Any]) -> bool:
    """``stream``: true when absent (Ollama's default)."""
    stream = obj.get("stream", True)
    if not isinstance(stream, bool):
        raise HttpError(400, "stream: true or false", param="stream")
    return stream


def parse_chat(body: bytes, model: OllamaModel) -> OllamaReply:
    """``POST /api/chat`` → the request of the OpenAI chat parser, answered in Ollama's shape."""
    obj = model.check(body)
    messages = obj.get("messages")
    if not isinstance(messages, list):
        raise HttpError(400, "messages: a list of messages is required", param="messages")
    for i, message in enumerate(messages):
        if isinstance(message, dict):
            for name in ("images", "tool_calls"):
                if message.get(name):
                    raise HttpError(
                        400, f"messages[{i}].{name}: not supported on this server",
                        param=f"messages[{i}].{name}",
                    )  # fmt: skip
    fields = {"model": model.name, "messages": messages, **_sampling(obj)}
    parsed = _parsed(openai.parse_chat, fields, model.name)
    return OllamaReply(parsed, _streamed(obj), model.name, "message")


def parse_generate(body: bytes, model: OllamaModel) -> OllamaReply:
    """``POST /api/generate``: ``prompt`` (and ``system``) as a chat through the model's chat
    template, or with ``raw: true`` the prompt text as it is."""
    obj = model.check(body)
    prompt, system = obj.get("prompt"), obj.get("system")
    if not isinstance(prompt, str):
        raise HttpError(400, "prompt: a string is required", param="prompt")
    if system is not None and not isinstance(system, str):
        raise HttpError(400, "system: a string", param="system")
    fields: dict[str, Any] = {"model": model.name, **_sampling(obj)}
    if obj.get("raw"):
        fields["prompt"] = (system or "") + prompt
        parsed = _parsed(openai.parse_completion, fields, model.name)
    else:
        system_turn = [{"role": "system", "content": system}] if system else []
        fields["messages"] = [*system_turn, {"role": "user", "content": prompt}]
        parsed = _parsed(openai.parse_chat, fields, model.name)
    return OllamaReply(parsed, _streamed(obj), model.name, "response")


class OllamaReply(Reply):
    """Ollama's answer: NDJSON lines, each ``{"model", "created_at", <text>, "done": false}``,
    then one with ``"done": true``, ``done_reason`` and the token counts; not streamed, that
    last object with the whole text. ``key`` is ``message`` (chat) or ``response`` (generate)."""

    __slots__ = ("key",)

    api = OLLAMA
    stream_type = b"application/x-ndjson"

    def __init__(self, parsed: Reply, stream: bool, model: str, key: str) -> None:
        super().__init__(parsed.req, stream, model)
        self.key = key

    def _text(self, text: str) -> object:
        return {"role": "assistant", "content": text} if self.key == "message" else text

    def _line(self, text: str, **more: object) -> dict[str, object]:
        created = datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
        return {"model": self.model, "created_at": created, self.key: self._text(text), **more}

    def token(self, out: bytearray, choice: int, text: str) -> None:
        out += dumps(self._line(text, done=False)) + b"\n"

    def delta(self, out: bytearray, choice: int, text: str, lp: TokenLogprobs | None) -> None:
        if text:
            self.token(out, choice, text)

    def _done(self, text: str) -> dict[str, object]:
        ending = self.total()
        return self._line(
            text,
            done=True,
            done_reason=FINISH_NAMES[OLLAMA][ending.finish],
            prompt_eval_count=ending.prompt_tokens,
            eval_count=ending.completion_tokens,
        )

    def end(self, out: bytearray, choice: int) -> None:
        out += dumps(self._done("")) + b"\n"

    def named(self, err: HttpError) -> HttpError:
        return ollama_named(err)  # the request path's refusals name OpenAI's fields

    def body(self) -> bytes:
        return dumps(self._done(self.choices[0].text))
