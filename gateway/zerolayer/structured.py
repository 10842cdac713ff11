"""Structured output: a request's constraint compiled into a grammar, and per-row matchers.

The grammar engine is llguidance (chosen in docs/benchmarks.md, "Grammar engines"): it reads a
checkpoint's tokenizer.json as it is, and depends on nothing else. A ``Constraint`` is what a
request asks for — OpenAI ``response_format`` ``json_object`` / ``json_schema`` (``strict``), and
vLLM's ``structured_outputs`` ``regex`` / ``choice`` — in canonical text, so equal constraints
share one compiled grammar. ``Grammars`` compiles off the event loop and off the engine thread
(one worker thread), and caches by constraint; a constraint it cannot compile is a
``GrammarError`` naming the field and why, and the cache remembers it too.

No grammar work runs on the engine thread unbounded (issue #40). Compiling is everything that
can blow up: the size cap (``max_bytes``, checked before anything is parsed), llguidance's
matcher built under ``LIMITS`` (the lexer, the Earley rows, the items per step), its first mask,
and a probe of ``PROBE_STEPS`` tokens on a copy — a grammar that fails within them (unbounded
recursion, a lexer that blows up) is refused here, as a 400, before any token is streamed. A
row's matcher is a ``deep_copy`` of the compiled one (its lexer state warmed by the probe). A
grammar that fails only later, along some paths, fails that row alone under the same limits
(``RowMatcher.error``; zerolayer.engine.finish.GRAMMAR_LIMIT), never the step. A
``RowMatcher`` is one sequence's state: fill its row of the batch's bitmask, accept a sampled
token, tell when it is finished. A row's next mask is computed on a ``MaskWorker`` thread while
the engine thread delivers and schedules; the engine waits for it at most its budget
(``engine.grammar_mask_budget_ms``) and parks a row whose mask is late (zerolayer.engine.rows).

Budget steering (issue #39): when a row's tokens left (``max_tokens`` or the context) are about
to run out inside its grammar, its masks steer it to a short valid completion, so that JSON it
returns always parses and validates (its finish stays MAX_TOKENS). A row's ``fill`` gets the
tokens it has left; it keeps ``need``, the length of a close path walked greedily on a copy of its
matcher (the matcher's own masks at each step, so ``required``, ``minLength``, ``pattern`` are
kept: the cheapest closer or value start each time, ``_Scan.priority``). With ``Steering.jump``
bounding how much one token can lengthen that path (the schema's largest instance, every
property present: ``budget_bounds``) and ``margin`` how much a content token can: far from the
end nothing changes; within ``jump + margin`` tokens of ``need`` the row may write content (tokens
with no brace, bracket, quote, comma, colon or backslash) or take the path's next token, nothing
that opens structure; within ``margin`` it follows the path, which ends the row
(``RowMatcher.budget_closed``). The walk runs on the mask threads, never the engine's: far from
the end only every so many tokens, near it at every step. A regex or a choice gets the walk and
the close without the content window (best effort), and a ``pattern`` string's content is bounded
only by a wider margin (best effort too). A budget below the shortest instance cannot be steered:
that row ends cut, as without steering.

How a JSON Schema is read (as xgrammar's strict mode, vLLM's default): an object schema that says
nothing of ``additionalProperties`` allows only the properties it lists (write
``"additionalProperties": true`` to allow others; members of an ``allOf`` stay open), and JSON
is written with fixed separators (``", "`` and ``": "``) and no other whitespace. Without both,
a small model given a schema goes on inventing keys or emitting newlines until ``max_tokens``
cuts its JSON short.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

Kind = Literal["json_object", "json_schema", "regex", "choice"]
# Defaults of engine.grammar_timeout_s, engine.grammar_max_bytes, engine.grammar_cache
# (zerolayer.config.settings; docs/configuration.md says why these values).
COMPILE_TIMEOUT_S = 2.0
MAX_BYTES = 65536
CACHE_SIZE = 128
# llguidance's limits for every matcher, tighter than its defaults (measured in issue #40's
# plan: every schema of benchmarks/json_schemas.py compiles and walks under them, in ≤ 2 ms;
# the attacks fail fast under them instead of taking seconds per mask). Keyword
# arguments of llguidance.LLParserLimits.
LIMITS: dict[str, Any] = {
    "initial_lexer_fuel": 200_000,
    "step_lexer_fuel": 50_000,
    "step_max_items": 10_000,
    "max_items_in_row": 2_000,
    "max_lexer_states": 10_000,
    "verbose_errors": False,
}
MASK_BUDGET_S = 0.005  # default of engine.grammar_mask_budget_ms (docs/configuration.md)
PROBE_STEPS = 2  # tokens a compile walks on a copy (the lowest allowed each time)
MAX_WAITING = 8  # compiles waiting for the worker; beyond, a request is refused OVERLOADED
# llguidance's JSON options for every schema: no free whitespace, fixed separators.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# The bound an integer (number) schema gets on a side it leaves open: a literal of at most 19
# digits, inside int64, so a client's parser never meets a number it cannot hold, and a model
# cannot spend its budget on digits (issue #39). llguidance reads bounds as doubles: 2**63 - 1
# fails to compile, the largest double below 2**63 compiles. A number's fraction digits stay
# unbounded (JSON Schema cannot bound them).
INT_BOUND = 2**63 - 1024
NUMBER_BOUND = 9.2e18

# JSON Schema keywords whose value is a schema, a map of schemas, or a list of schemas.
_SUBSCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else",
              "propertyNames", "unevaluatedItems", "additionalProperties")  # fmt: skip
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")  # allOf: see closed
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed(schema: Any, close: bool = True) -> Any:
    """``schema`` with every object schema that lists ``properties`` and says nothing of other
    keys closed to them (``additionalProperties: false``), and every ``integer`` / ``number``
    schema without a bound given one (``INT_BOUND``, ``NUMBER_BOUND``); a copy, the argument is
    not changed. The members of an ``allOf`` are not closed themselves (each adds properties to
    the others'; closed, no instance could satisfy two of them), their subschemas are."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed(sub, close=False) for sub in out["allOf"]]
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(sub) for sub in out[key]]
    if close and isinstance(out.get("properties"), dict) and not any(k in out for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    kinds = out.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if "integer" in kinds or "number" in kinds:
        bound = INT_BOUND if "number" not in kinds else NUMBER_BOUND
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -bound
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = bound
    return out


# Budget steering: bytes that open or close structure in JSON (a "content" token has none), the
# least margin, and the longest close path walked (a longer one is not steered: best effort).
_STRUCTURAL = re.compile(rb'[{}\[\]",:\\]')
STEER_MARGIN = 4
WALK_MAX = 1024
VISITS = 20_000  # subschemas ``budget_bounds`` visits at most
_DIGITS = frozenset(b"0123456789")
_PRINTABLE = range(0x20, 0x7F)


def budget_bounds(constraint: Constraint) -> tuple[int, int]:
    """(jump, margin) of a constraint (the module docstring): jump bounds the close path's
    growth by one token, margin its growth by one content token, in bytes, which bound tokens
    (every token is at least one byte)."""
    if constraint.kind in ("regex", "choice"):
        return 16, STEER_MARGIN
    schema = closed(json.loads(constraint.text))
    # [the margin's part: the longest enum / const string, a pattern's allowance; subschemas
    # visited, bounded (a recursive schema branches: past VISITS the bound is WALK_MAX)]
    extra = [0, 0]
    jump = _instance_bound(schema, schema, 0, extra)
    return max(16, min(jump, WALK_MAX)), STEER_MARGIN + extra[0]


def _instance_bound(s: Any, root: Any, depth: int, extra: list[int]) -> int:
    """Bytes of ``s``'s instance with every property present, each value the longest of its
    cheapest forms (an upper bound of what the close path writes for it)."""
    extra[1] += 1
    if extra[1] > VISITS:
        return WALK_MAX
    if not isinstance(s, dict) or depth > 12:
        return 64 if depth > 12 else 8  # true / false schemas, deep recursion: best effort
    if isinstance(s.get("$ref"), str):
        target: Any = root
        for part in s["$ref"].lstrip("#/").split("/"):
            target = target.get(part) if isinstance(target, dict) and part else target
        return _instance_bound(target, root, depth + 1, extra)
    values = [s["const"]] if "const" in s else s.get("enum")
    if isinstance(values, list) and values:
        texts = [json.dumps(v, separators=(", ", ": ")) for v in values]
        extra[0] = max(extra[0], max(len(t.encode()) for t in texts))
        return max(len(t.encode()) for t in texts)
    bound = 0
    for key in ("anyOf", "oneOf"):
        if isinstance(s.get(key), list):
            bound = max([bound] + [_instance_bound(b, root, depth + 1, extra) for b in s[key]])
    if isinstance(s.get("allOf"), list):
        bound = max(bound, sum(_instance_bound(b, root, depth + 1, extra) for b in s["allOf"]))
    kinds = s.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds] if kinds else []
    if not kinds and not bound:
        kinds = ["object"] if "properties" in s else ["any"]
    for kind in kinds:
        bound = max(bound, _type_bound(kind, s, root, depth, extra))
    return bound


def _of(s: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    value = s.get(key)
    return value if isinstance(value, kind) else default


def _type_bound(kind: str, s: dict[str, Any], root: Any, depth: int, extra: list[int]) -> int:
    if kind == "object":
        props: dict[str, Any] = _of(s, "properties", dict, {})
        size = 2 + sum(
            len(json.dumps(k).encode()) + 4 + _instance_bound(v, root, depth + 1, extra)
            for k, v in props.items()
        )
        return size + (0 if s.get("additionalProperties") is False else 32)
    if kind == "array":
        items = s.get("items")
        prefix: list[Any] = _of(s, "prefixItems", list, [])
        item = _instance_bound(items, root, depth + 1, extra) if isinstance(items, dict) else 32
        count: int = _of(s, "minItems", int, 0)
        return (
            2
            + sum(_instance_bound(p, root, depth + 1, extra) + 2 for p in prefix)
            + (max(count, 1) * (item + 2))
        )
    if kind == "string":
        least: int = _of(s, "minLength", int, 0)
        if "pattern" in s or "format" in s:
            extra[0] = max(extra[0], 16)
            return 2 + 4 * least + 32
        return 2 + 4 * least
    if kind in ("integer", "number"):  # 0, else a bound's digits
        low, high = s.get("minimum", -1), s.get("maximum", 1)
        numeric = isinstance(low, int | float) and isinstance(high, int | float)
        return 2 if numeric and low <= 0 <= high else 24
    if kind in ("boolean", "null"):
        return 5
    return 32  # any value


class GrammarError(ValueError):
    """A constraint that cannot be used: ``field`` names the request field, the message why."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field}: {why}")
        self.field = field
        self.why = why


@dataclass(frozen=True, slots=True)
class Constraint:
    """One request's constraint; ``text`` is canonical (a schema in compact JSON, its key order
    kept: property order is the order the grammar generates them in)."""

    kind: Kind
    text: str
    field: str  # the request field it came from, for errors

    @classmethod
    def json_object(cls, field: str = "response_format") -> Constraint:
        return cls("json_object", '{"type":"object"}', field)

    @classmethod
    def json_schema(
        cls, schema: Any, field: str = "response_format.json_schema.schema"
    ) -> Constraint:
        if not isinstance(schema, dict):
            raise GrammarError(field, "a JSON Schema must be an object")
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), field)

    @classmethod
    def regex(cls, pattern: Any, field: str = "structured_outputs.regex") -> Constraint:
        if not isinstance(pattern, str) or not pattern:
            raise GrammarError(field, "must be a non-empty string")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise GrammarError(field, f"not a regular expression: {exc}") from None
        return cls("regex", pattern, field)

    @classmethod
    def choice(cls, options: Any, field: str = "structured_outputs.choice") -> Constraint:
        if (
            not isinstance(options, list)
            or not options
            or not all(isinstance(o, str) and o for o in options)
        ):
            raise GrammarError(field, "must be a non-empty list of non-empty strings")
        return cls("choice", "|".join(re.escape(o) for o in options), field)


def from_response_format(value: Any) -> Constraint | None:
    """OpenAI ``response_format``: None for ``text`` (or absent), else its constraint."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise GrammarError("response_format", "must be an object")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_object()
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise GrammarError("response_format.json_schema", "must be an object")
        if "schema" not in spec:  # OpenAI allows it absent: any JSON object
            return Constraint.json_object("response_format.json_schema")
        return Constraint.json_schema(spec["schema"])
    raise GrammarError("response_format.type", "must be text, json_object or json_schema")


class GrammarBusy(Exception):
    """The compile worker has ``MAX_WAITING`` compiles waiting: the request is refused
    OVERLOADED (retry), not queued without bound."""


@dataclass(frozen=True, slots=True)
class Steering:
    """What budget steering needs of a grammar and its tokenizer (the module docstring)."""

    tokenizer: Any  # the llguidance.LLTokenizer
    byte: np.ndarray  # int32 [256]: the token of each single byte, -1 for none
    content: np.ndarray  # int32 [words]: the tokens without structural bytes (JSON only)
    eos: np.ndarray  # int32 [words]: the end token
    jump: int
    margin: int
    json: bool


class Grammar:
    """A compiled constraint: its probed matcher, copied for each row that uses it."""

    def __init__(
        self, constraint: Constraint, template: Any, steering: Steering | None = None
    ) -> None:
        self.constraint = constraint
        self._template = template  # an llguidance.LLMatcher at the grammar's start, never advanced
        self._steering = steering

    def matcher(self) -> RowMatcher:
        return RowMatcher(self._template.deep_copy(), self._steering)


class _Scan:
    """Where JSON text is: in a string (after an escape) or not, and its last byte."""

    __slots__ = ("escaped", "in_string", "last")

    def __init__(self) -> None:
        self.in_string = self.escaped = False
        self.last = 0

    def copy(self) -> _Scan:
        other = _Scan()
        other.in_string, other.escaped, other.last = self.in_string, self.escaped, self.last
        return other

    def feed(self, data: bytes) -> None:
        for c in data:
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == 0x5C:
                    self.escaped = True
                elif c == 0x22:
                    self.in_string = False
            elif c == 0x22:
                self.in_string = True
            self.last = c

    def priority(self) -> bytes:
        """The bytes a close path prefers here, cheapest first: in a string its end; else the
        open container's end, a separator after a number (digits would lengthen it), then the
        shortest value starts."""
        if self.in_string:
            return b'"0a'
        return b"}]" + (b"," if self.last in _DIGITS else b"") + b'0"nft-[{,:'


class RowMatcher:
    """One sequence's place in its grammar, and its budget steering (the module docstring)."""

    def __init__(self, matcher: Any, steering: Steering | None = None) -> None:
        self._m = matcher
        self._steer = steering
        self._scan = _Scan()
        self._unscanned: list[int] = []  # accepted, not yet fed to the scan (the mask thread does)
        self._plan: list[int] | None = None  # the close path from the state of the last walk
        self._since = 0  # tokens accepted since that walk
        self._cursor = -1  # >= 0: closing, the index of the path's next token

    def fill(self, bitmask: np.ndarray, row: int, left: int = 0) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 [rows, words]); ``left``:
        the tokens the row may still produce, this one included (0: unknown, no steering).
        (llguidance.numpy, not llguidance.torch: importing the latter imports torch._dynamo, 8 s
        measured here, on the engine thread at the first constrained step.)"""
        import llguidance.numpy as ln

        ln.fill_next_token_bitmask(self._m, bitmask, row)
        st = self._steer
        if st is None or left <= 0 or self._m.is_error():
            return
        words = bitmask[row]
        if self._cursor >= 0:
            assert self._plan is not None
            _only(words, self._plan[self._cursor] if self._plan else -1, st.eos)
            return
        window = st.jump + st.margin + 1
        plan = self._plan
        if plan is None or left <= len(plan) + st.jump * self._since + window:
            if self._unscanned:
                self._scan.feed(st.tokenizer.decode_bytes(self._unscanned))
                self._unscanned = []
            plan = self._plan = self._walk()
            self._since = 0
            if plan is None or len(plan) > left:  # no path within the budget: not steered
                self._steer = None
                return
        if left <= len(plan) + st.margin:
            self._cursor = 0
            _only(words, plan[0] if plan else -1, st.eos)
        elif st.json and plan and left <= len(plan) + window:
            allowed = st.content | st.eos
            allowed.view(np.uint32)[plan[0] >> 5] |= np.uint32(1 << (plan[0] & 31))
            words &= allowed

    def _walk(self, limit: int = WALK_MAX) -> list[int] | None:
        """The close path from here, on a copy: forced tokens as they come, else the token of
        the first byte of ``_Scan.priority`` the grammar allows, else its lowest printable byte
        allowed; then as the tokenizer would write those bytes, when shorter and allowed. None
        when it is longer than ``limit`` tokens or fails."""
        st = self._steer
        assert st is not None
        tok, byte = st.tokenizer, st.byte
        c = self._m.deep_copy()
        scan = self._scan.copy()
        out: list[int] = []
        while not c.is_accepting():
            if len(out) >= limit:
                return None
            ff = c.compute_ff_tokens()
            if ff:
                c.consume_tokens(ff)
                picked = list(ff)
            else:
                bits = np.frombuffer(c.compute_bitmask(), np.uint32)
                picked = [_pick(bits, byte, scan.priority() if st.json else b"")]
                if picked[0] < 0:
                    return None
                c.consume_token(picked[0])
            if c.is_error():
                return None
            out += picked
            scan.feed(tok.decode_bytes(picked))
        if len(out) > 1:
            ids = tok.tokenize_bytes(tok.decode_bytes(out))
            if len(ids) < len(out):
                c = self._m.deep_copy()
                if (
                    c.validate_tokens(ids) == len(ids)
                    and c.consume_tokens(ids)
                    and c.is_accepting()
                    and not c.is_error()
                ):
                    out = list(ids)
        return out if len(out) <= limit else None

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False when the grammar does not allow it, or its limits
        were exceeded (then ``error`` says why)."""
        ok = bool(self._m.consume_token(token)) and not self._m.is_error()
        if ok and self._steer is not None:
            self._unscanned.append(token)
            self._since += 1
            if self._cursor >= 0:
                self._cursor += 1
        return ok

    @property
    def budget_closed(self) -> bool:
        """The row followed its close path to its end: the grammar is complete because its
        tokens ran out (its finish is MAX_TOKENS)."""
        plan = self._plan
        return self._cursor > 0 and plan is not None and self._cursor >= len(plan)

    @property
    def error(self) -> str:
        """Why the matcher failed (its limits exceeded, mostly), "" when it has not."""
        return _first_line(self._m.get_error()) if self._m.is_error() else ""

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing but ending."""
        return bool(self._m.is_stopped())

    @property
    def accepting(self) -> bool:
        """What was generated so far is a complete match (EOS would be allowed)."""
        return bool(self._m.is_accepting())


class MaskWorker:
    """Computes constrained rows' next masks off the engine thread, on up to one thread per row
    (a row has one mask computing at a time; threads are made as masks overlap, so a row whose
    mask is slow holds one thread and never delays another row's mask; llguidance computes
    without the GIL, 0.01-2 ms per mask on SmolLM2's vocabulary):
    ``submit(matcher, left)`` returns a future of the row's mask words (int32 [words]) for its
    next token, ``left`` tokens allowed from it on (that one included); a matcher that raises
    fails its future, never the worker. Not niced, unlike the compile worker: a row's mask is on
    its row's path to its next token."""

    def __init__(self, words: int, rows: int) -> None:
        self.words = words
        self._pool = concurrent.futures.ThreadPoolExecutor(rows, thread_name_prefix="mask")

    def submit(self, matcher: RowMatcher, left: int) -> concurrent.futures.Future[np.ndarray]:
        return self._pool.submit(self._mask, matcher, left)

    def _mask(self, matcher: RowMatcher, left: int) -> np.ndarray:
        row = np.zeros((1, self.words), np.int32)
        matcher.fill(row, 0, left)
        words: np.ndarray = row[0]
        return words

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Grammars:
    """Compiles constraints for one tokenizer on its own worker thread, LRU-cached by text
    (failures too: a repeated hostile constraint costs a lookup). ``eos_id`` is the end token a
    complete match allows (the model's EOS; the engine's rows allow the tokenizer's other
    end-of-generation ids wherever it is allowed)."""

    def __init__(
        self,
        tokenizer_json: str | Path,
        eos_id: int,
        vocab_size: int,
        timeout_s: float = COMPILE_TIMEOUT_S,
        cache_size: int = CACHE_SIZE,
        max_bytes: int = MAX_BYTES,
    ) -> None:
        import llguidance

        self._llg = llguidance
        text = Path(tokenizer_json).read_text()
        self.tokenizer = llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos_id)
        self.limits = llguidance.LLParserLimits(**LIMITS)
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self.max_bytes = max_bytes
        self._cache: OrderedDict[tuple[str, str], Grammar | GrammarError] = OrderedDict()
        self._lock = threading.Lock()
        self._waiting = 0  # compiles submitted to the worker and not finished
        self._tables = self._steering_tables(eos_id)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="grammar", initializer=_lower_priority
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _steering_tables(self, eos_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Budget steering's tables for this tokenizer (``Steering``; 0.1 s for SmolLM2's
        49,152 tokens): each byte's single-byte token, the content tokens, the end token."""
        tok = self.tokenizer
        byte = np.full(256, -1, np.int32)
        content = np.zeros(self.words * 32, np.bool_)
        for i in range(min(self.vocab_size, tok.vocab_size)):
            if tok.is_special_token(i):
                continue
            data = tok.decode_bytes([i])
            if len(data) == 1 and byte[data[0]] < 0:
                byte[data[0]] = i
            content[i] = bool(data) and _STRUCTURAL.search(data) is None
        eos = np.zeros(self.words * 32, np.bool_)
        eos[eos_id] = True
        packed = [np.packbits(a, bitorder="little").view(np.int32) for a in (content, eos)]
        return byte, packed[0], packed[1]

    def _steering(self, constraint: Constraint) -> Steering:
        jump, margin = budget_bounds(constraint)
        byte, content, eos = self._tables
        json_kind = constraint.kind in ("json_object", "json_schema")
        return Steering(self.tokenizer, byte, content, eos, jump, margin, json_kind)

    def bitmask(self, rows: int) -> np.ndarray:
        """A zeroed int32 [rows, words] mask for ``RowMatcher.fill``."""
        return np.zeros((rows, self.words), np.int32)

    def cached(self, constraint: Constraint) -> Grammar | None:
        """The compiled grammar when cached; raises its ``GrammarError`` when its compile
        failed; None when it was never compiled (or fell out of the cache)."""
        key = (constraint.kind, constraint.text)
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
        if isinstance(entry, GrammarError):
            # the same text from another field is refused naming that field
            raise GrammarError(constraint.field, entry.why)
        return entry

    def _keep(self, constraint: Constraint, entry: Grammar | GrammarError) -> None:
        with self._lock:
            self._cache[(constraint.kind, constraint.text)] = entry
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

    def compile_now(self, constraint: Constraint) -> Grammar:
        """Compile on the calling thread (the worker, or a test); cached, failures too."""
        grammar = self.cached(constraint)
        if grammar is not None:
            return grammar
        try:
            grammar = Grammar(constraint, self._build(constraint), self._steering(constraint))
        except GrammarError as exc:
            self._keep(constraint, exc)
            raise
        self._keep(constraint, grammar)
        return grammar

    def _build(self, constraint: Constraint) -> Any:
        """The probed matcher at the grammar's start, or a GrammarError naming the field."""
        size = len(constraint.text.encode())
        if size > self.max_bytes:
            raise GrammarError(
                constraint.field,
                f"is {size:,} bytes; at most {self.max_bytes:,} (engine.grammar_max_bytes)",
            )
        llg = self._llg
        try:
            if constraint.kind in ("regex", "choice"):
                compiled = llg.LLMatcher.grammar_from_regex(constraint.text)
            else:
                schema = closed(json.loads(constraint.text))
                compiled = llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            matcher = llg.LLMatcher(self.tokenizer, compiled, log_level=0, limits=self.limits)
        except Exception as exc:  # malformed input raises from the Rust side
            raise GrammarError(constraint.field, _first_line(str(exc))) from None
        if matcher.is_error():
            raise GrammarError(constraint.field, _too_complex(matcher))
        self._probe(constraint, matcher)
        return matcher

    def _probe(self, constraint: Constraint, matcher: Any) -> None:
        """Fill the matcher's first mask (warming the lexer state its copies share), then walk
        ``PROBE_STEPS`` tokens on a copy, the lowest allowed one each time."""
        import llguidance.numpy as ln

        mask = self.bitmask(1)
        ln.fill_next_token_bitmask(matcher, mask, 0)
        if matcher.is_error():
            raise GrammarError(constraint.field, _too_complex(matcher))
        walker = matcher.deep_copy()
        for _ in range(PROBE_STEPS):
            allowed = np.flatnonzero(
                np.unpackbits(mask.view(np.uint8), bitorder="little")[: self.vocab_size]
            )
            if not len(allowed) or walker.is_stopped():
                return
            walker.consume_token(int(allowed[0]))
            if not walker.is_error():
                ln.fill_next_token_bitmask(walker, mask, 0)
            if walker.is_error():
                raise GrammarError(constraint.field, _too_complex(walker))

    def _submit(self, constraint: Constraint) -> concurrent.futures.Future[Grammar]:
        """The compile, on the worker; GrammarBusy when ``MAX_WAITING`` are already waiting.
        A compile whose caller stopped waiting runs on and fills the cache."""
        with self._lock:
            if self._waiting >= MAX_WAITING:
                raise GrammarBusy
            self._waiting += 1
        future = self._pool.submit(self.compile_now, constraint)
        future.add_done_callback(self._done)
        return future

    def _done(self, _: concurrent.futures.Future[Grammar]) -> None:
        with self._lock:
            self._waiting -= 1

    def _timed_out(self, constraint: Constraint) -> GrammarError:
        return GrammarError(
            constraint.field,
            f"the grammar did not compile within {self.timeout_s:g} s (engine.grammar_timeout_s)",
        )

    def compile_sync(self, constraint: Constraint) -> Grammar:
        """Compile on the worker thread, waiting at most ``timeout_s``."""
        grammar = self.cached(constraint)
        if grammar is not None:
            return grammar
        try:
            return self._submit(constraint).result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise self._timed_out(constraint) from None

    async def compile(self, constraint: Constraint) -> Grammar:
        """Compile off the event loop on the worker thread, bounded by ``timeout_s``."""
        grammar = self.cached(constraint)
        if grammar is not None:
            return grammar
        future = asyncio.wrap_future(self._submit(constraint))
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except asyncio.TimeoutError:
            # the compile goes on (it is cached when it ends); its outcome is read here, so a
            # late GrammarError is not logged as an exception nobody retrieved
            future.add_done_callback(_retrieved)
            raise self._timed_out(constraint) from None


def _retrieved(future: asyncio.Future[Grammar]) -> None:
    """Read a finished future's outcome (nobody else will)."""
    if not future.cancelled():
        future.exception()


def _pick(bits: np.ndarray, byte: np.ndarray, priority: bytes) -> int:
    """The close path's next token where nothing is forced (``_walk``); -1 when none."""

    def allowed(t: int) -> bool:
        return t >= 0 and bool(bits[t >> 5] >> (t & 31) & 1)

    for b in priority:
        if allowed(int(byte[b])):
            return int(byte[b])
    for b in _PRINTABLE:
        if allowed(int(byte[b])):
            return int(byte[b])
    ids = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little"))
    return int(ids[0]) if len(ids) else -1


def _only(words: np.ndarray, token: int, eos: np.ndarray) -> None:
    """Restrict a row's mask to ``token`` (-1: to the end token, where it allows it)."""
    if token < 0:
        words &= eos
        return
    words[:] = 0
    words.view(np.uint32)[token >> 5] = np.uint32(1 << (token & 31))


def _first_line(text: str) -> str:
    return text.strip().split("\n", 1)[0][:200]


def _too_complex(matcher: Any) -> str:
    return f"too complex for structured output: {_first_line(matcher.get_error())}"


def _lower_priority() -> None:
    """The compile worker runs at nice 10 (Linux; best effort), so on a busy host the engine
    thread wins the core."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
