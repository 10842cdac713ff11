"""Ollama's API on the HTTP port (paths under ``/api/``): its bodies read into the OpenAI
parsers' fields (one validation, one request path), its answers written in Ollama's shapes.

``/api/chat`` and ``/api/generate`` are translated field by field into an OpenAI chat (or,
``raw: true``, completion) body and parsed by zerolayer.http.openai, so every check, every
sampling rule and the tool path (zerolayer.http.tools: definitions, the template, the calls
parsed from the answer) are the OpenAI door's; ``OllamaReply`` writes the answer: NDJSON lines
(``stream`` defaults to true) or one object, a tool call as ``message.tool_calls`` with its
arguments as an object (streamed: one line per call, once its arguments are complete). The
history's calls and ``role: "tool"`` results are read into OpenAI's (a result without
``tool_call_id`` answers the earlier call of its ``tool_name``); ``logprobs`` come back in each
line, in the shape of OpenAI's chat logprobs, which is Ollama's. ``options`` map onto our
sampling fields (``OPTIONS``); ``num_ctx`` is the request's own context (at most the engine's);
those with no effect here are ignored (``IGNORED``), the samplers we do not have are refused
unless set to their no-op value (``NO_OP``), any other key is a 400 naming ``options.<key>``.
A request with no messages (chat) or no prompt (generate) is Ollama's load request: answered at
once, ``done_reason: "load"`` (the one model is always loaded; ``keep_alive`` is accepted and
changes nothing).

``/api/embed`` (``input`` a string or a list) and the older ``/api/embeddings`` (``prompt``)
are requests of k inputs, as ``/v1/embeddings`` (zerolayer.http.embeddings): the same engine
path, vectors and charging; ``truncate`` (true by default, as Ollama) cuts an input longer than
the context to its first tokens.

``/api/version``, ``/api/tags``, ``/api/ps`` and ``/api/show`` describe the one served model
in Ollama's shapes (``OLLAMA_API_VERSION`` is the Ollama release whose shapes these are:
clients gate features on it). ``model`` is the served name, with or without Ollama's
``:latest`` tag (listed with it); another name is 404 ``{"error": "model '<x>' not found"}``.
Facts we do not have (file size, quantization, family) are empty or 0, never made up. Model
management (``/api/pull``, ``push``, ``create``, ``copy``, ``delete``) is refused (403) saying
why, but for a pull of the served model, which is there already: ``{"status": "success"}``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from zerolayer.codes import FINISH_NAMES, OLLAMA, Refusal
from zerolayer.http import openai
from zerolayer.http.embeddings import MAX_INPUTS, EmbeddingsReply
from zerolayer.http.errors import HttpError, http_error
from zerolayer.http.json_body import dumps
from zerolayer.http.logprobs import TokenLogprobs, TokenStrings, chat_entry
from zerolayer.http.reply import Ending, Reply
from zerolayer.http.tools import ArgumentsDelta, CallEnd, CallStart, Content
from zerolayer.request_path.request import Request
from zerolayer.request_path.validation import get_text, validate

OLLAMA_API_VERSION = "0.12.0"
TAG = ":latest"
_FAR_FUTURE = "2318-01-01T00:00:00Z"  # /api/ps: a model that is never unloaded


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


class OllamaModel:
    """The served model as Ollama's listings describe it (bodies built once). ``embeds``: the
    backend returns prompt outputs (``/api/embed`` is served)."""

    def __init__(
        self, name: str, max_context: int, zerolayer_version: str, embeds: bool = True
    ) -> None:
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
        capabilities = ["completion", "tools", *(["embedding"] if embeds else [])]
        self.show_body = dumps(
            {
                "modelfile": f"# served by zerolayer\nFROM {name}\n",
                "parameters": "",
                "template": "",
                "details": entry["details"],
                "model_info": {"general.name": name, "general.context_length": max_context},
                "capabilities": capabilities,
                "modified_at": started,
            }
        )

    def check(self, body: bytes, known: frozenset[str] | None = None) -> dict[str, Any]:
        """Refuse a request body that does not name the served model (``model``, or the old
        ``name``): 400 when it is missing or not a string, 404 when it is another model; with
        ``known``, a field outside it is a 400 naming it. ``keep_alive`` is checked here."""
        obj = _object(body)
        model = obj.get("model", obj.get("name"))
        if not isinstance(model, str) or not model:
            raise HttpError(400, "model: a model name (string) is required", param="model")
        if model.removesuffix(TAG) != self.name:
            raise HttpError(404, f"model '{model}' not found", param="model")
        if known is not None:
            for key in obj:
                if key not in known:
                    raise HttpError(400, f"{key}: not a field of this endpoint", param=key)
        keep_alive = obj.get("keep_alive")
        if keep_alive is not None and (
            isinstance(keep_alive, bool) or not isinstance(keep_alive, (int, float, str))
        ):
            raise HttpError(
                400, 'keep_alive: a duration ("5m") or a number of seconds', param="keep_alive"
            )
        return obj

    def show(self, body: bytes) -> bytes:
        self.check(body)
        return self.show_body

    def manage(self, body: bytes, path: str) -> bytes:
        """``/api/pull``, ``push``, ``create``, ``copy``, ``delete``: refused (403) saying why;
        a pull of the served model succeeds (it is there already)."""
        if path.rstrip("/") == "/api/pull":
            obj = _object(body)
            model = obj.get("model", obj.get("name"))
            if isinstance(model, str) and model.removesuffix(TAG) == self.name:
                return dumps({"status": "success"})
        raise HttpError(
            403,
            f"{path}: this server serves one model, '{self.name}', chosen when it started "
            "(model.path); models are not pulled, pushed, created, copied or deleted over the API",
        )


def _object(body: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(body) if body else {}
    except ValueError:
        raise HttpError(400, "the body is not JSON") from None
    if not isinstance(obj, dict):
        raise HttpError(400, "the body must be a JSON object")
    return obj


# options → our field (Ollama's num_predict -1/-2, "until the context is full", is our default;
# its seed -1 is a random seed, ours when absent)
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
# (mirostat_tau / mirostat_eta act only with mirostat on, which is refused)
IGNORED = frozenset(
    [
        "num_keep",
        "num_batch",
        "num_gpu",
        "main_gpu",
        "low_vram",
        "f16_kv",
        "numa",
        "num_thread",
        "use_mmap",
        "use_mlock",
        "vocab_only",
        "embedding_only",
        "logits_all",
        "repeat_last_n",
        "penalize_newline",
        "draft_num_predict",
        "mirostat_tau",
        "mirostat_eta",
    ]
)
# samplers we do not have: accepted at their no-op value only
NO_OP = {"typical_p": 1, "tfs_z": 1, "mirostat": 0}
NUM_CTX = "num_ctx"  # the request's own context (Request.context), at most the engine's
# top-level fields refused by name when set (no way to serve them)
_REFUSED = ("images", "suffix", "template", "context", "width", "height", "steps")
_COMMON_KEYS = ("model", "name", "format", "options", "stream", "keep_alive", "think", "logprobs",
                "top_logprobs", *_REFUSED)  # fmt: skip
CHAT_KEYS = frozenset(("messages", "tools", *_COMMON_KEYS))
GENERATE_KEYS = frozenset(("prompt", "system", "raw", *_COMMON_KEYS))
EMBED_KEYS = frozenset(
    ("model", "name", "input", "truncate", "options", "keep_alive", "dimensions")
)
EMBEDDINGS_KEYS = frozenset(("model", "name", "prompt", "options", "keep_alive"))


def _options(obj: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
    """The OpenAI body fields of ``options`` (module docstring), and ``num_ctx``."""
    options = obj.get("options")
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise HttpError(400, "options must be an object", param="options")
    fields: dict[str, Any] = dict(DEFAULTS)
    context = None
    for key, value in options.items():
        if value is None:
            continue
        if key in OPTIONS:
            if key == "num_predict" and isinstance(value, int) and value < 0:
                continue  # -1 / -2: as long as the context allows
            if key == "seed" and value == -1:
                continue  # Ollama's random seed
            fields[OPTIONS[key]] = value
        elif key == NUM_CTX:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise HttpError(400, "options.num_ctx: a number of tokens", param="options.num_ctx")
            context = value or None  # 0: the default
        elif key in NO_OP:
            if value != NO_OP[key]:
                raise HttpError(
                    400,
                    f"options.{key}: not supported here (only {NO_OP[key]}, its no-op value)",
                    param=f"options.{key}",
                )
        elif key not in IGNORED:
            raise HttpError(400, f"options.{key}: unknown option", param=f"options.{key}")
    return fields, context


def _sampling(obj: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
    """The OpenAI body fields of ``options`` and ``format``, and ``num_ctx``."""
    fields, context = _options(obj)
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
    logprobs = obj.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise HttpError(400, "logprobs: true or false", param="logprobs")
    if logprobs:  # top_logprobs applies only then, as Ollama reads it
        fields["logprobs"] = True
        fields["top_logprobs"] = obj.get("top_logprobs", 0)
    return fields, context


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


def _parsed(
    parse: Callable[[bytes, str, TokenStrings | None], Reply],
    fields: dict[str, Any],
    served: str,
    strings: TokenStrings | None,
) -> Reply:
    """The OpenAI parser's Request for ``fields``; its refusals name Ollama's fields."""
    try:
        return parse(dumps(fields), served, strings)
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


_MESSAGE_KEYS = frozenset(
    ("role", "content", "images", "thinking", "tool_calls", "tool_name", "tool_call_id")
)


def _call_history(calls: Any, i: int) -> list[Any]:
    """An assistant message's Ollama ``tool_calls`` (``{"id"?, "function": {"index"?, "name",
    "arguments": {...}}}``) as OpenAI's, ids made up where Ollama gave none; the OpenAI parser
    checks the rest."""
    if not isinstance(calls, list):
        return calls  # type: ignore[no-any-return]  # refused by the parser, naming it
    out: list[Any] = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            out.append(call)  # refused by the parser, naming it
            continue
        function = {k: v for k, v in fn.items() if k != "index"}  # index: its place
        out.append({"id": call.get("id") or f"call_{i}_{j}", "type": "function",
                    "function": function})  # fmt: skip
    return out


def _messages(value: Any) -> list[Any]:
    """Ollama's chat messages as OpenAI's (roles lower-cased, as Ollama reads them): an
    assistant's ``tool_calls`` with ids, a ``tool`` result's ``tool_name`` as its ``name`` and
    its ``tool_call_id`` (when absent: the earliest unanswered call of the last assistant turn
    with that name, else the earliest unanswered one)."""
    if not isinstance(value, list):
        raise HttpError(400, "messages: a list of messages is required", param="messages")
    out: list[Any] = []
    unanswered: list[tuple[str, str]] = []  # (id, name) of the last assistant turn's calls
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            out.append(m)  # refused by the parser, naming it
            continue
        where = f"messages[{i}]"
        for key in m:
            if key not in _MESSAGE_KEYS:
                raise HttpError(400, f"{where}.{key}: not a message field", param=f"{where}.{key}")
        for name in ("images", "thinking"):
            if m.get(name):
                raise HttpError(
                    400, f"{where}.{name}: not supported on this server", param=f"{where}.{name}"
                )
        role = m.get("role")
        role = role.lower() if isinstance(role, str) else role
        message: dict[str, Any] = {"role": role, "content": m.get("content") or ""}
        if m.get("tool_calls"):
            message["tool_calls"] = calls = _call_history(m["tool_calls"], i)
            unanswered = [
                (c["id"], c["function"].get("name"))
                for c in calls
                if isinstance(c, dict) and isinstance(c.get("function"), dict)
            ]
        if role == "tool":
            tool_name = m.get("tool_name")
            call_id = m.get("tool_call_id")
            if call_id is None:
                match = [c for c in unanswered if c[1] == tool_name] or unanswered
                call_id = match[0][0] if match else f"call_{i}"
            unanswered = [c for c in unanswered if c[0] != call_id]
            message["tool_call_id"] = call_id
            if tool_name is not None:
                message["name"] = tool_name
        out.append(message)
    return out


def _load(model: OllamaModel, key: str) -> bytes:
    """Ollama's answer to a load request (nothing to generate): one object."""
    empty: object = {"role": "assistant", "content": ""} if key == "message" else ""
    return dumps({"model": model.name, "created_at": _now(), key: empty, "done": True,
                  "done_reason": "load"})  # fmt: skip


def parse_chat(
    body: bytes, model: OllamaModel, strings: TokenStrings | None = None
) -> OllamaReply | bytes:
    """``POST /api/chat`` → the request of the OpenAI chat parser, answered in Ollama's shape
    (no messages: the load request's answer)."""
    obj = model.check(body, CHAT_KEYS)
    messages = obj.get("messages")
    if not messages and isinstance(messages, (list, type(None))):
        return _load(model, "message")
    sampling, context = _sampling(obj)
    fields = {"model": model.name, "messages": _messages(messages), **sampling}
    tools = obj.get("tools")
    if tools or (tools is not None and not isinstance(tools, list)):
        fields["tools"] = tools
    parsed = _parsed(openai.parse_chat, fields, model.name, strings)
    parsed.req.context = context
    return OllamaReply(parsed, _streamed(obj), model.name, "message")


def parse_generate(
    body: bytes, model: OllamaModel, strings: TokenStrings | None = None
) -> OllamaReply | bytes:
    """``POST /api/generate``: ``prompt`` (and ``system``) as a chat through the model's chat
    template, or with ``raw: true`` the prompt text as it is (no prompt: the load request's
    answer)."""
    obj = model.check(body, GENERATE_KEYS)
    prompt, system = obj.get("prompt"), obj.get("system")
    if prompt is None or prompt == "":
        return _load(model, "response")
    if not isinstance(prompt, str):
        raise HttpError(400, "prompt: a string is required", param="prompt")
    if system is not None and not isinstance(system, str):
        raise HttpError(400, "system: a string", param="system")
    sampling, context = _sampling(obj)
    fields: dict[str, Any] = {"model": model.name, **sampling}
    if obj.get("raw"):
        fields["prompt"] = (system or "") + prompt
        if fields.pop("logprobs", False):  # the Completions form: how many alternatives
            fields["logprobs"] = fields.pop("top_logprobs")
        parsed = _parsed(openai.parse_completion, fields, model.name, strings)
    else:
        system_turn = [{"role": "system", "content": system}] if system else []
        fields["messages"] = [*system_turn, {"role": "user", "content": prompt}]
        parsed = _parsed(openai.parse_chat, fields, model.name, strings)
    parsed.req.context = context
    return OllamaReply(parsed, _streamed(obj), model.name, "response")


class OllamaReply(Reply):
    """Ollama's answer: NDJSON lines, each ``{"model", "created_at", <text>, "done": false}``,
    then one with ``"done": true``, ``done_reason`` and the token counts; not streamed, that
    last object with the whole text. ``key`` is ``message`` (chat) or ``response`` (generate).
    A chat with tools: each call in ``message.tool_calls`` (``{"id", "function": {"index",
    "name", "arguments": {...}}}``), streamed as a line of its own once its arguments are
    complete (Ollama's arguments are an object), the same calls as not streamed. With
    ``logprobs``: each token's ``{"token", "logprob", "bytes", "top_logprobs"}`` in the
    ``logprobs`` list of the line that carries its text (a token whose bytes end mid-character:
    a line with empty text), not streamed all of them in the last object."""

    __slots__ = ("key", "_open", "_sent")

    api = OLLAMA
    stream_type = b"application/x-ndjson"

    def __init__(self, parsed: Reply, stream: bool, model: str, key: str) -> None:
        super().__init__(parsed.req, stream, model, parsed.tools, parsed.strings)
        self.key = key
        self._open: dict[int, list[str]] = {}  # streamed calls: index → [id, name, arguments]
        self._sent = 0  # calls streamed

    def _line(
        self, text: str, calls: list[dict[str, object]] | None = None, **more: object
    ) -> dict[str, object]:
        if self.key != "message":
            return {"model": self.model, "created_at": _now(), self.key: text, **more}
        message: dict[str, object] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = calls
        return {"model": self.model, "created_at": _now(), self.key: message, **more}

    def _write(
        self,
        out: bytearray,
        text: str,
        calls: list[dict[str, object]] | None = None,
        logprobs: list[dict[str, Any]] | None = None,
    ) -> None:
        more: dict[str, object] = {"done": False}
        if logprobs:
            more["logprobs"] = logprobs
        out += dumps(self._line(text, calls, **more)) + b"\n"

    def token(self, out: bytearray, choice: int, text: str) -> None:
        out += dumps(self._line(text, done=False)) + b"\n"

    def delta(self, out: bytearray, choice: int, text: str, lp: TokenLogprobs | None) -> None:
        c = self.choices[choice]
        logprobs = None
        if lp is not None:
            assert self.strings is not None
            logprobs = [chat_entry(self.strings, lp)]
        if c.calls is None:
            if text or logprobs:
                self._write(out, text, None, logprobs)
            return
        c.parts.append(text)  # the whole answer decides the calls the stream did not send
        for e in c.calls.feed(text):
            if isinstance(e, Content):
                if e.text:
                    self._write(out, e.text, None, logprobs)
                    logprobs = None
            elif isinstance(e, CallStart):
                self._open[e.index] = [e.id, e.name, ""]
            elif isinstance(e, ArgumentsDelta):
                self._open[e.index][2] += e.text
            elif isinstance(e, CallEnd):
                call = _call(self._sent, *self._open.pop(e.index))
                if call is not None:
                    self._write(out, "", [call], logprobs)
                    logprobs = None
                    self._sent += 1
        if logprobs:  # a token whose text the parser holds (or has none yet)
            self._write(out, "", None, logprobs)

    def _done(self, text: str, calls: list[dict[str, object]] | None = None) -> dict[str, object]:
        ending = self.total()
        return self._line(
            text,
            calls,
            done=True,
            done_reason=FINISH_NAMES[OLLAMA][ending.finish],
            prompt_eval_count=ending.prompt_tokens,
            eval_count=ending.completion_tokens,
            **_durations(ending),
        )

    def end(self, out: bytearray, choice: int) -> None:
        """The text the parser held back, then the calls the whole answer has beyond those
        streamed (an answer held to its end, as JSON; not a call the end cut: the same calls
        as not streamed), then the last line."""
        c = self.choices[choice]
        if c.calls is not None:
            for e in c.calls.close():
                if isinstance(e, Content) and e.text:
                    self.token(out, choice, e.text)
            _, found = c.calls.result(c.text)
            for i, t in enumerate(found[self._sent :], self._sent):
                call = _call(i, t.id, t.name, t.arguments)
                if call is not None:
                    out += dumps(self._line("", [call], done=False)) + b"\n"
        out += dumps(self._done("")) + b"\n"

    def named(self, err: HttpError) -> HttpError:
        return ollama_named(err)  # the request path's refusals name OpenAI's fields

    def body(self) -> bytes:
        c = self.choices[0]
        more: dict[str, object] = {}
        if self.req.sampling.logprobs:
            assert self.strings is not None
            more["logprobs"] = [chat_entry(self.strings, lp) for lp in c.logprobs]
        if c.calls is None:
            return dumps({**self._done(c.text), **more})
        content, found = c.calls.result(c.text)
        calls = [_call(i, t.id, t.name, t.arguments) for i, t in enumerate(found)]
        return dumps({**self._done(content, [call for call in calls if call]), **more})


def _durations(ending: Ending) -> dict[str, int]:
    """Ollama's durations (nanoseconds) from the request path's timings: ``total_duration``
    from the request's arrival to its end, ``prompt_eval_duration`` from its admission to its
    first token (the prompt's prefill), ``eval_duration`` from there to the end (no prompt or
    eval duration without a token: an embedding)."""
    if ending.timings is None:
        return {}
    queue_s, ttft_s, total_s = ending.timings
    durations = {"total_duration": round(total_s * 1e9)}
    if ttft_s:
        durations["prompt_eval_duration"] = round(max(0.0, ttft_s - queue_s) * 1e9)
        durations["eval_duration"] = round(max(0.0, total_s - ttft_s) * 1e9)
    return durations


def _call(index: int, call_id: str, name: str, arguments: str) -> dict[str, object] | None:
    """A tool call in Ollama's shape; None when its arguments are not a JSON object."""
    try:
        args = json.loads(arguments)
    except ValueError:
        return None
    if not isinstance(args, dict):
        return None
    return {"id": call_id, "function": {"index": index, "name": name, "arguments": args}}


def _embed_inputs(value: Any) -> list[str | Any]:
    """``/api/embed``'s ``input``: a string or a list of strings (none empty)."""
    if isinstance(value, str):
        return [get_text(value, "input")]
    if not isinstance(value, list):
        raise HttpError(400, "input: a string or a list of strings", param="input")
    if len(value) > MAX_INPUTS:
        raise HttpError(400, f"input: at most {MAX_INPUTS} inputs, got {len(value)}", param="input")
    return [get_text(one, f"input[{i}]", allow_empty=False) for i, one in enumerate(value)]


def parse_embed(body: bytes, model: OllamaModel, hidden_size: int) -> OllamaEmbedReply | bytes:
    """``POST /api/embed`` → a Request of k inputs (no input: ``embeddings: []`` at once)."""
    obj = model.check(body, EMBED_KEYS)
    _, context = _options(obj)  # checked; only num_ctx acts on an embedding
    value = obj.get("input")
    if value is None or value == "" or value == []:
        return dumps({"model": model.name, "embeddings": []})
    inputs = _embed_inputs(value)
    truncate = obj.get("truncate", True)
    if not isinstance(truncate, bool):
        raise HttpError(400, "truncate: true or false", param="truncate")
    dimensions = obj.get("dimensions")
    if dimensions is not None and dimensions != hidden_size:
        raise HttpError(
            400,
            f"dimensions: this model's embeddings have {hidden_size} dimensions and are not "
            f"shortened; leave dimensions out (or give {hidden_size})",
            param="dimensions",
        )
    req = Request(max_tokens=0, embed=True, inputs=inputs, context=context, truncate=truncate)
    return OllamaEmbedReply(validate(req), model.name, legacy=False)


def parse_embeddings(body: bytes, model: OllamaModel) -> OllamaEmbedReply | bytes:
    """``POST /api/embeddings`` (Ollama's older form): one ``prompt`` → ``{"embedding"}``; an
    empty prompt's is empty, as Ollama answers it. Not truncated (a prompt longer than the
    context is a 400 naming ``prompt``)."""
    obj = model.check(body, EMBEDDINGS_KEYS)
    _, context = _options(obj)
    prompt = obj.get("prompt")
    if prompt is None or prompt == "":
        return dumps({"embedding": []})
    req = Request(max_tokens=0, embed=True, inputs=[get_text(prompt, "prompt")], context=context)
    return OllamaEmbedReply(validate(req), model.name, legacy=True)


class OllamaEmbedReply(EmbeddingsReply):
    """``/api/embed``'s ``{"model", "embeddings": [[...]], "prompt_eval_count"}`` (every input's
    tokens), or with ``legacy`` ``/api/embeddings``' ``{"embedding": [...]}``, once every input
    ended: the vectors of ``/v1/embeddings``, as numbers."""

    __slots__ = ("legacy",)

    api = OLLAMA

    def __init__(self, req: Request, model: str, legacy: bool) -> None:
        super().__init__(req, model, b64=False)
        self.legacy = legacy

    def named(self, err: HttpError) -> HttpError:
        """The older form's one input is its ``prompt``."""
        if self.legacy and err.param == "input":
            message = err.message.replace("input", "prompt", 1)
            return HttpError(err.status, message, param="prompt", error=err.error)
        return err

    def body(self) -> bytes:
        vectors: list[list[float]] = []
        tokens = 0
        for choice in self.choices:
            assert choice.ending is not None
            tokens += choice.ending.prompt_tokens
            # empty only for an input the drain deadline cut off before its prefill completed
            vectors.append([] if choice.pooled is None else choice.pooled.tolist())
        if self.legacy:
            return dumps({"embedding": vectors[0]})
        body = {"model": self.model, "embeddings": vectors, "prompt_eval_count": tokens}
        return dumps({**body, **_durations(self.total())})
