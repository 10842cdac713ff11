"""Tool calls: definitions in, the model's text out as calls, for both HTTP APIs.

- ``Tool`` / ``tools_from_openai`` / ``tools_from_anthropic``: definitions checked, each error a
  ``ToolError`` naming the field (a tool whose parameters are not a JSON Schema object, a
  duplicate name, a tool_choice naming no tool).
- ``parse``: a finished output into content and calls, for Hermes-style
  ``<tool_call>{json}</tool_call>`` (Qwen), Llama 3 JSON (``<|python_tag|>`` optional,
  ``"parameters"``), and a generic JSON form (one call or a list, ``"arguments"``).
- ``CallStream``: the same incrementally, as events — content text, a call's start (index, id,
  name), its arguments text in pieces (the raw JSON of the arguments, so the pieces join to a
  valid document, as OpenAI's ``function.arguments`` deltas and Anthropic's
  ``input_json_delta`` carry them), its end.
- ``JsonCallStream``: the generic JSON form streamed the same way; ``OutputCalls``, one answer's
  parser as the HTTP replies use it (forced: the JSON form; auto: the model's own forms).
- ``forced_schema``: ``tool_choice`` ``required`` or a named function as a JSON Schema for the
  grammar engine (gateway/zerolayer/structured.py), so even a model without tool training returns a
  valid call in the generic form.
How tools and calls are written into a prompt is the chat template's side
(``zerolayer.models.templates``).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from zerolayer.models import templates
from zerolayer.models.templates import HERMES_CLOSE, HERMES_OPEN, Tool
from zerolayer.structured import Constraint

if TYPE_CHECKING:
    from zerolayer.request_path.request import Request

JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}
PYTHON_TAG = "<|python_tag|>"
# The most calls one answer returns (issue #39): a forced list's grammar allows no more
# (``maxItems``), and an answer in the model's own form has the later ones dropped. A call
# repeating an earlier one (same name, same arguments' text) ends the list too: a small model
# otherwise repeats its call until max_tokens.
MAX_CALLS = 16


class ToolError(ValueError):
    def __init__(self, field_name: str, why: str) -> None:
        super().__init__(f"{field_name}: {why}")
        self.field = field_name
        self.why = why


def new_call_id(prefix: str = "call_") -> str:
    """A tool call's id: OpenAI's ``call_…``, Anthropic's ``toolu_…``."""
    return prefix + secrets.token_hex(12)


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=new_call_id)


_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # lists of subschemas
_SCHEMA_ONE = ("items", "not", "additionalProperties", "contains", "if", "then", "else")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> subschema


def _check_schema(schema: Any, where: str, depth: int = 0) -> dict[str, Any]:
    """``schema`` is a JSON Schema in the shapes tools use (types, properties, items, required,
    enum, the combinators), checked all the way down; the error names the first bad place."""
    if depth > 32:
        raise ToolError(where, "nested too deeply (at most 32 levels)")
    if not isinstance(schema, dict):
        raise ToolError(where, "must be a JSON Schema object")
    if "type" in schema:
        kind = schema["type"]
        kinds = kind if isinstance(kind, list) else [kind]
        if not kinds or not all(isinstance(k, str) and k in JSON_TYPES for k in kinds):
            raise ToolError(f"{where}.type", f"not a JSON Schema type: {kind!r}")
    for key in _SCHEMA_MAPS:
        if key in schema:
            sub = schema[key]
            if not isinstance(sub, dict):
                raise ToolError(f"{where}.{key}", "must be an object")
            for name, value in sub.items():
                _check_schema(value, f"{where}.{key}.{name}", depth + 1)
    for key in _SCHEMA_LISTS:
        if key in schema:
            sub = schema[key]
            if not isinstance(sub, list) or not sub:
                raise ToolError(f"{where}.{key}", "must be a non-empty list of schemas")
            for i, value in enumerate(sub):
                _check_schema(value, f"{where}.{key}[{i}]", depth + 1)
    for key in _SCHEMA_ONE:
        if key in schema and not isinstance(schema[key], bool):  # true/false are schemas too
            _check_schema(schema[key], f"{where}.{key}", depth + 1)
    if "required" in schema and not (
        isinstance(schema["required"], list) and all(isinstance(r, str) for r in schema["required"])
    ):
        raise ToolError(f"{where}.required", "must be a list of property names")
    if "enum" in schema and not (isinstance(schema["enum"], list) and schema["enum"]):
        raise ToolError(f"{where}.enum", "must be a non-empty list")
    return schema


def _tool(name: Any, description: Any, params: Any, where: str, pfield: str) -> Tool:
    if not isinstance(name, str) or not name or len(name) > 64:
        raise ToolError(f"{where}.name", "must be a string of 1 to 64 characters")
    if description is not None and not isinstance(description, str):
        raise ToolError(f"{where}.description", "must be a string")
    params = {"type": "object", "properties": {}} if params is None else params
    schema = _check_schema(params, f"{where}.{pfield}")
    if schema.get("type", "object") != "object":
        raise ToolError(f"{where}.{pfield}.type", "a tool's parameters must be an object schema")
    return Tool(name, description or "", schema)


def _unique(tools: list[Tool], where: str) -> list[Tool]:
    seen: set[str] = set()
    for i, t in enumerate(tools):
        if t.name in seen:
            raise ToolError(f"{where}[{i}].name", f"duplicate tool name {t.name!r}")
        seen.add(t.name)
    return tools


def tools_from_openai(value: Any) -> list[Tool]:
    """OpenAI ``tools``: [{"type": "function", "function": {name, description, parameters}}]."""
    if not isinstance(value, list):
        raise ToolError("tools", "must be a list")
    out = []
    for i, entry in enumerate(value):
        if not isinstance(entry, dict) or entry.get("type") != "function":
            raise ToolError(f"tools[{i}].type", "must be 'function'")
        fn = entry.get("function")
        if not isinstance(fn, dict):
            raise ToolError(f"tools[{i}].function", "must be an object")
        where = f"tools[{i}].function"
        out.append(
            _tool(fn.get("name"), fn.get("description"), fn.get("parameters"), where, "parameters")
        )
    return _unique(out, "tools")


def tools_from_anthropic(value: Any) -> list[Tool]:
    """Anthropic ``tools``: [{name, description, input_schema}]."""
    if not isinstance(value, list):
        raise ToolError("tools", "must be a list")
    out = []
    for i, entry in enumerate(value):
        if not isinstance(entry, dict):
            raise ToolError(f"tools[{i}]", "must be an object")
        if "input_schema" not in entry:
            raise ToolError(f"tools[{i}].input_schema", "is required")
        out.append(
            _tool(
                entry.get("name"),
                entry.get("description"),
                entry["input_schema"],
                f"tools[{i}]",
                "input_schema",
            )
        )
    return _unique(out, "tools")


@dataclass(frozen=True, slots=True)
class Choice:
    """What the request lets the model do: ``mode`` none / auto / required; ``name`` forces one."""

    mode: str
    name: str | None = None


def choice_from_openai(value: Any, tools: list[Tool]) -> Choice:
    if value is None:
        return Choice("auto" if tools else "none")
    if value in ("none", "auto", "required"):
        if value == "required" and not tools:
            raise ToolError("tool_choice", "'required' needs tools")
        return Choice(value)
    if isinstance(value, dict) and value.get("type") == "function":
        name = (value.get("function") or {}).get("name")
        return Choice("required", _named(name, tools, "tool_choice.function.name"))
    raise ToolError("tool_choice", "must be none, auto, required or a named function")


def choice_from_anthropic(value: Any, tools: list[Tool]) -> Choice:
    if value is None:
        return Choice("auto" if tools else "none")
    kind = value.get("type") if isinstance(value, dict) else None
    if kind in ("auto", "none"):
        return Choice(kind)
    if kind == "any":
        if not tools:
            raise ToolError("tool_choice", "'any' needs tools")
        return Choice("required")
    if kind == "tool":
        return Choice("required", _named(value.get("name"), tools, "tool_choice.name"))
    raise ToolError("tool_choice.type", "must be auto, any, tool or none")


def _named(name: Any, tools: list[Tool], where: str) -> str:
    if not any(t.name == name for t in tools):
        raise ToolError(where, f"names no tool defined in tools: {name!r}")
    return str(name)


def forced_schema(
    tools: list[Tool], choice: Choice, parallel: bool = True
) -> dict[str, Any] | None:
    """The JSON Schema an output must match under ``choice`` (None when not forced): one call
    ``{"name": ..., "arguments": {...}}``, or with ``parallel`` a list of one or more."""
    if choice.mode != "required":
        return None
    chosen = [t for t in tools if choice.name is None or t.name == choice.name]
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": t.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in chosen
    ]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if parallel and choice.name is None:
        return {"type": "array", "items": one, "minItems": 1, "maxItems": MAX_CALLS}
    return one


def _as_call(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args))


def _json_calls(text: str) -> list[ToolCall] | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    items = obj if isinstance(obj, list) else [obj]
    calls = [call for call in map(_as_call, items) if call is not None]
    return calls if calls and len(calls) == len(items) else None


def _defines(names: frozenset[str] | None, name: str) -> bool:
    """The one rule on a parsed call's name: with tools given (``names``), a call naming none
    of them is no call, and its text stays content (streamed or not)."""
    return names is None or name in names


def _names(tools: list[Tool] | None) -> frozenset[str] | None:
    return frozenset(t.name for t in tools) if tools else None


def _known(found: list[ToolCall] | None, names: frozenset[str] | None) -> list[ToolCall] | None:
    """``found`` when every call in it names a defined tool, else None (no call)."""
    if found is None or not all(_defines(names, c.name) for c in found):
        return None
    return found


def parse(text: str, tools: list[Tool] | None = None) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a finished output; text that is no call stays content. With
    ``tools``, a call naming no defined tool is left as content: a Hermes ``<tool_call>``
    block as its own text (the other blocks stay calls, as ``CallStream`` streams them), a JSON
    answer as the whole text."""
    names = _names(tools)
    calls: list[ToolCall] = []
    content: list[str] = []
    rest = text
    if HERMES_OPEN in rest:
        while HERMES_OPEN in rest:
            before, _, after = rest.partition(HERMES_OPEN)
            body, closed, rest = after.partition(HERMES_CLOSE)
            found = _known(_json_calls(body.strip()), names)
            content.append(before)
            if found is None:
                content.append(HERMES_OPEN + body + (HERMES_CLOSE if closed else ""))
            else:
                calls += found
        content.append(rest)
    else:
        stripped = rest.strip()
        if stripped.startswith(PYTHON_TAG):
            stripped = stripped[len(PYTHON_TAG) :].strip()
        found = _json_calls(stripped) if stripped[:1] in ("{", "[") else None
        found = _known(found, names)
        if found is None:
            content.append(rest)
        else:
            calls = found
    return "".join(content).strip() if calls else "".join(content), calls


# -- streaming ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Content:
    text: str


@dataclass(slots=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(slots=True)
class ArgumentsDelta:
    index: int
    text: str


@dataclass(slots=True)
class CallEnd:
    index: int


Event = Content | CallStart | ArgumentsDelta | CallEnd


class _Call:
    """One call's body as it grows: its start once its name is read, then its arguments' text
    in pieces (a JSON scanner finds where the value ends), its end with the body's. A name
    outside ``names`` (the defined tools; None: any) makes it no call (``foreign``): it never
    starts, and its stream sends its text as content."""

    __slots__ = ("index", "id", "started", "sent", "names", "foreign")

    def __init__(self, index: int, id_prefix: str, names: frozenset[str] | None = None) -> None:
        self.index = index
        self.id = new_call_id(id_prefix)
        self.started = False
        self.sent = 0  # how much of the arguments value went out
        self.names = names
        self.foreign = False

    def scan(self, body: str, final: bool) -> list[Event]:
        events: list[Event] = []
        if self.foreign:
            return events
        if not self.started:
            name = _string_value(body, "name")
            if name is None:
                return events
            if not _defines(self.names, name):
                self.foreign = True
                return events
            events.append(CallStart(self.index, self.id, name))
            self.started = True
        span = _value_span(body, "arguments") or _value_span(body, "parameters")
        if span is not None:
            start, stop, complete = span
            if stop - start > self.sent:
                events.append(ArgumentsDelta(self.index, body[start + self.sent : stop]))
                self.sent = stop - start
            if complete and final:
                events.append(CallEnd(self.index))
        elif final:
            events.append(ArgumentsDelta(self.index, "{}"))
            events.append(CallEnd(self.index))
        return events


class CallStream:
    """Hermes-style calls out of a growing text, as events (``feed`` each delta, then ``close``).

    Outside a call, text passes through as ``Content`` except a tail that could begin
    ``<tool_call>``. Inside one, the body is scanned: once ``"name"`` is read a ``CallStart``
    goes out, and the value of ``"arguments"`` streams as ``ArgumentsDelta`` pieces as its
    characters arrive (a JSON scanner finds where the value ends). A block that is no call —
    it names no tool of ``tools`` (when given), or has no name by its end — is held to its end
    and goes out as content, tags included, as ``parse`` leaves it; call indices count calls
    only.
    """

    def __init__(self, id_prefix: str = "call_", tools: list[Tool] | None = None) -> None:
        self._id_prefix = id_prefix
        self._names = _names(tools)
        self._pending = ""  # outside: text held back; inside: the call body so far
        self._call: _Call | None = None  # inside a call
        self._calls = 0  # calls started so far: the next call's index

    def feed(self, delta: str) -> list[Event]:
        events: list[Event] = []
        self._pending += delta
        while True:
            if self._call is None:
                at = self._pending.find(HERMES_OPEN)
                if at < 0:
                    keep = _partial_suffix(self._pending, HERMES_OPEN)
                    cut = len(self._pending) - keep
                    if cut:
                        events.append(Content(self._pending[:cut]))
                    self._pending = self._pending[cut:]
                    return events
                if at:
                    events.append(Content(self._pending[:at]))
                self._pending = self._pending[at + len(HERMES_OPEN) :]
                self._call = _Call(self._calls, self._id_prefix, self._names)
                continue
            end = self._pending.find(HERMES_CLOSE)
            body = self._pending if end < 0 else self._pending[:end]
            events += self._call.scan(body, final=end >= 0)
            if end < 0:
                return events
            events += self._ended(HERMES_OPEN + body + HERMES_CLOSE)
            self._pending = self._pending[end + len(HERMES_CLOSE) :]

    def close(self) -> list[Event]:
        """The end of the output: held text goes out; an unclosed call ends as it is."""
        events: list[Event] = []
        if self._call is not None:
            events += self._call.scan(self._pending, final=True)
            events += self._ended(HERMES_OPEN + self._pending)
        elif self._pending:
            events.append(Content(self._pending))
        self._pending = ""
        return events

    def _ended(self, text: str) -> list[Event]:
        """The current block ended (its whole ``text``): counted when it was a call, else its
        text is content."""
        call, self._call = self._call, None
        assert call is not None
        if call.started:
            self._calls += 1
            return []
        return [Content(text)]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _key_end(body: str, key: str) -> int | None:
    """Index just past ``"key":`` and following spaces, or None."""
    at = body.find(f'"{key}"')
    if at < 0:
        return None
    i = at + len(key) + 2
    while i < len(body) and body[i] in " \t\n\r":
        i += 1
    if i >= len(body) or body[i] != ":":
        return None
    i += 1
    while i < len(body) and body[i] in " \t\n\r":
        i += 1
    return i


def _string_value(body: str, key: str) -> str | None:
    """The complete string value of ``key`` once it has arrived."""
    i = _key_end(body, key)
    if i is None or i >= len(body) or body[i] != '"':
        return None
    try:
        value, _ = json.JSONDecoder().raw_decode(body, i)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _value_span(body: str, key: str) -> tuple[int, int, bool] | None:
    """(start, stop, complete) of ``key``'s value so far: a JSON scanner over strings and
    nesting, stopping where the value ends (complete) or where the text does."""
    start = _key_end(body, key)
    if start is None or start >= len(body):
        return None
    depth, in_str, esc = 0, False, False
    for i in range(start, len(body)):
        c = body[i]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
                if depth == 0:
                    return start, i + 1, True
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return start, i + 1, True
            if depth < 0:
                return start, i, True
        elif depth == 0 and c in ",":
            return start, i, True
    return start, len(body), False


class JsonCallStream:
    """The generic JSON form as events, as it grows: one call object ``{"name": ..., "arguments":
    {...}}`` or a list of them (what ``forced_schema`` makes the grammar produce). Each object's
    name starts a call, its arguments stream as they come; text outside the objects (list
    punctuation, spaces) is not content."""

    def __init__(self, id_prefix: str = "call_") -> None:
        self._id_prefix = id_prefix
        self._text = ""
        self._pos = 0  # scanned up to here
        self._depth = 0
        self._in_str = self._esc = False
        self._call_depth = 0  # the depth inside a call object: 1 for a root object, 2 in a list
        self._start = -1  # where the current call object began, -1 outside one
        self._call: _Call | None = None
        self._index = -1

    def feed(self, delta: str) -> list[Event]:
        events: list[Event] = []
        self._text += delta
        text = self._text
        for i in range(self._pos, len(text)):
            c = text[i]
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == '"':
                    self._in_str = False
                continue
            if c == '"':
                self._in_str = True
            elif c in "[{":
                if not self._call_depth:  # the first bracket says which form this is
                    self._call_depth = 1 if c == "{" else 2
                self._depth += 1
                if c == "{" and self._depth == self._call_depth:
                    self._start = i
                    self._index += 1
                    self._call = _Call(self._index, self._id_prefix)
            elif c in "]}":
                if c == "}" and self._depth == self._call_depth and self._call is not None:
                    events += self._call.scan(text[self._start + 1 : i], final=True)
                    self._call = None
                self._depth -= 1
        self._pos = len(text)
        if self._call is not None:
            events += self._call.scan(text[self._start + 1 :], final=False)
        return events

    def close(self) -> list[Event]:
        """The end of the output: a call cut short ends as it is."""
        events: list[Event] = []
        if self._call is not None:
            events += self._call.scan(self._text[self._start + 1 :], final=True)
            self._call = None
        return events


@dataclass(frozen=True, slots=True)
class ToolUse:
    """A request's tool settings as its reply needs them: the definitions, the choice, and
    whether several calls may come at once."""

    tools: list[Tool]
    choice: Choice
    parallel: bool = True

    def output(self, id_prefix: str = "call_") -> OutputCalls | None:
        """A parser for one answer; None when no call is parsed (``none``)."""
        if self.choice.mode == "none":
            return None
        forced = self.choice.mode == "required"
        return OutputCalls(self.tools, forced, self.parallel, id_prefix)

    def schema(self) -> dict[str, Any] | None:
        """What the grammar must force, when the choice forces a call."""
        return forced_schema(self.tools, self.choice, self.parallel)

    def apply(self, req: Request) -> None:
        """The one rule from the choice to the request, for both doors: unless ``none``, the
        definitions go to the chat template; a forced choice becomes the request's constraint,
        which cannot be combined with another one (a ``ToolError`` naming that one's field)."""
        if self.choice.mode == "none":
            return
        req.tools = templates.template_tools(self.tools)
        schema = self.schema()
        if schema is None:
            return
        if req.constraint is not None:
            raise ToolError(req.constraint.field, "cannot be combined with a forced tool_choice")
        req.constraint = Constraint.json_schema(schema, "tools")


class OutputCalls:
    """One answer's text as content and tool calls, streamed as events (``feed``, ``close``)
    or at once (``result``).

    ``forced`` (``tool_choice`` required or a named function): the grammar's generic JSON form,
    streamed by ``JsonCallStream``. Otherwise (``auto``) the model's own forms: Hermes tags
    stream as they come (``CallStream``); an answer that opens with JSON or ``<|python_tag|>``
    (Llama 3, the generic form) is held to its end and parsed then, as content when it is no
    call (cut short, forced or not: the calls whose objects closed). Without ``parallel``,
    calls after the first are dropped. Either way the list ends at a call repeating an earlier
    one, and after ``MAX_CALLS``: streamed, a call whose arguments so far are the start of an
    earlier call's with the same name is held until it differs (then sent) or ends equal (then
    dropped, with everything after it)."""

    def __init__(
        self, tools: list[Tool], forced: bool, parallel: bool = True, id_prefix: str = "call_"
    ) -> None:
        self.tools = tools
        self.forced = forced
        self.parallel = parallel
        self.id_prefix = id_prefix
        self.calls = 0  # calls started so far (the answer's finish is tool_calls when any)
        self._stream: CallStream | JsonCallStream | None = (
            JsonCallStream(id_prefix) if forced else None
        )
        self._held = ""  # auto: the opening text, until it says which form it is
        self._ended = False  # the list ended (a repeated call, MAX_CALLS): later calls dropped
        self._complete: list[tuple[str, str]] = []  # (name, arguments' text) of calls sent whole
        self._open: dict[int, _OpenCall] = {}  # calls started and not ended, by index

    def feed(self, delta: str) -> list[Event]:
        if self._stream is None:
            self._held += delta
            head = self._held.lstrip()
            if not head or PYTHON_TAG.startswith(head):
                return []  # not yet known
            if head[0] in "{[" or head.startswith(PYTHON_TAG):
                return []  # held to the end: parsed whole by close
            self._stream = CallStream(self.id_prefix, self.tools)
            delta, self._held = self._held, ""
        return self._count(self._stream.feed(delta))

    def close(self) -> list[Event]:
        if self._stream is not None:
            return self._count(self._stream.close())
        content, calls = self.result(self._held)
        events: list[Event] = [Content(content)] if content else []
        for i, call in enumerate(calls):
            events += [CallStart(i, call.id, call.name), ArgumentsDelta(i, call.arguments)]
            events.append(CallEnd(i))
        self.calls = len(calls)
        return events

    def result(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole answer."""
        content, calls = parse(text, self.tools)
        if not calls and (self.forced or _json_form(text)):
            # cut short (max_tokens): the calls whose objects closed are calls, forced or in
            # the model's own JSON form (auto), which then names defined tools only
            calls = _known(closed_calls(_json_form(text) or text), _names(self.tools)) or []
            content = "" if calls else content
        if not self.parallel:
            calls = calls[:1]
        calls = bounded(calls)
        for call in calls:
            call.id = new_call_id(self.id_prefix)
        return content, calls

    def _count(self, events: list[Event]) -> list[Event]:
        if not self.parallel:
            events = [e for e in events if isinstance(e, Content) or e.index == 0]
        events = self._bound(events)
        self.calls += sum(isinstance(e, CallStart) for e in events)
        return events

    def _bound(self, events: list[Event]) -> list[Event]:
        """``events`` without the calls after the list ended (see the class)."""
        out: list[Event] = []
        for e in events:
            if isinstance(e, Content):
                out.append(e)
            elif self._ended or e.index >= MAX_CALLS:
                self._ended = True
            elif isinstance(e, CallStart):
                held = any(name == e.name for name, _ in self._complete)
                self._open[e.index] = _OpenCall(e.name, "", [e] if held else None)
                if not held:
                    out.append(e)
            else:
                call = self._open.get(e.index)
                if call is None:
                    continue
                if isinstance(e, ArgumentsDelta):
                    call.arguments += e.text
                if call.held is None:
                    out.append(e)
                    if isinstance(e, CallEnd):
                        self._close(e.index)
                elif isinstance(e, CallEnd):
                    if (call.name, call.arguments) in self._complete:  # a repeat: the list ends
                        self._ended = True
                        self._open.clear()
                    else:
                        out += call.held
                        out.append(e)
                        self._close(e.index)
                else:
                    call.held.append(e)
                    if not any(name == call.name and args.startswith(call.arguments)
                               for name, args in self._complete):  # fmt: skip
                        out += call.held
                        call.held = None
        return out

    def _close(self, index: int) -> None:
        call = self._open.pop(index)
        self._complete.append((call.name, call.arguments))


@dataclass(slots=True)
class _OpenCall:
    """A streamed call not yet ended: its name, its arguments' text so far, and its events
    while held (None once sent: it differs from every earlier call)."""

    name: str
    arguments: str
    held: list[Event] | None


def _json_form(text: str) -> str:
    """``text`` without its spaces and Llama 3's ``<|python_tag|>`` when it opens with JSON
    (the model's own JSON form of calls), else empty."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :].lstrip()
    return body if body[:1] in ("{", "[") else ""


def closed_calls(text: str) -> list[ToolCall]:
    """The calls of the generic JSON form (``forced_schema``) whose objects closed in ``text``,
    an output cut short: a call cut inside is no call."""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    calls: list[ToolCall] = []
    for e in JsonCallStream().feed(text):  # no close(): it would end the cut call as it is
        if isinstance(e, CallStart):
            names[e.index], arguments[e.index] = e.name, ""
        elif isinstance(e, ArgumentsDelta):
            arguments[e.index] += e.text
        elif isinstance(e, CallEnd):
            call = _as_call({"name": names[e.index], "arguments": arguments[e.index]})
            if call is not None:
                calls.append(call)
    return calls


def bounded(calls: list[ToolCall]) -> list[ToolCall]:
    """``calls`` up to the first one repeating an earlier one (name and arguments), at most
    ``MAX_CALLS``."""
    seen: set[tuple[str, str]] = set()
    for i, call in enumerate(calls[:MAX_CALLS]):
        if (call.name, call.arguments) in seen:
            return calls[:i]
        seen.add((call.name, call.arguments))
    return calls[:MAX_CALLS]


# -- the Responses API's forms (POST /v1/responses) -----------------------------------------


def tools_from_responses(value: Any) -> list[Tool]:
    """Responses ``tools``: [{"type": "function", name, description, parameters, strict}] (the
    function's fields at the top level); hosted tools (web search, file search, ...) are a
    ``ToolError`` naming ``tools[i].type``."""
    if not isinstance(value, list):
        raise ToolError("tools", "must be a list")
    out = []
    for i, entry in enumerate(value):
        if not isinstance(entry, dict):
            raise ToolError(f"tools[{i}]", "must be an object")
        if entry.get("type") != "function":
            raise ToolError(f"tools[{i}].type", "only function tools are supported")
        params = entry.get("parameters")
        out.append(
            _tool(entry.get("name"), entry.get("description"), params, f"tools[{i}]", "parameters")
        )
    return _unique(out, "tools")


def choice_from_responses(value: Any, tools: list[Tool]) -> Choice:
    """Responses ``tool_choice``: none, auto, required or ``{"type": "function", "name"}``;
    ``allowed_tools`` and hosted tools are a ``ToolError`` naming ``tool_choice.type``."""
    if value is None or value in ("none", "auto", "required"):
        return choice_from_openai(value, tools)
    if isinstance(value, dict) and value.get("type") == "function":
        return Choice("required", _named(value.get("name"), tools, "tool_choice.name"))
    if isinstance(value, dict):
        raise ToolError("tool_choice.type", "only none, auto, required or a function")
    raise ToolError("tool_choice", "must be none, auto, required or a named function")
