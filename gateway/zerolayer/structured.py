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


class Grammar:
    """A compiled constraint: its probed matcher, copied for each row that uses it."""

    def __init__(self, constraint: Constraint, template: Any) -> None:
        self.constraint = constraint
        self._template = template  # an llguidance.LLMatcher at the grammar's start, never advanced

    def matcher(self) -> RowMatcher:
        return RowMatcher(self._template.deep_copy())


class RowMatcher:
    """One sequence's place in its grammar."""

    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def fill(self, bitmask: np.ndarray, row: int, left: int = 0) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 [rows, words]); ``left``:
        the tokens the row may still produce, this one included (0: unknown).
        (llguidance.numpy, not llguidance.torch: importing the latter imports torch._dynamo, 8 s
        measured here, on the engine thread at the first constrained step.)"""
        import llguidance.numpy as ln

        ln.fill_next_token_bitmask(self._m, bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False when the grammar does not allow it, or its limits
        were exceeded (then ``error`` says why)."""
        return bool(self._m.consume_token(token)) and not self._m.is_error()

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
        self._pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="grammar", initializer=_lower_priority
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

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
            grammar = Grammar(constraint, self._build(constraint))
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
            raise self._timed_out(constraint) from None


def _first_line(text: str) -> str:
    return text.strip().split("\n", 1)[0][:200]


def _too_complex(matcher: Any) -> str:
    return f"too complex for structured output: {_first_line(matcher.get_error())}"


def _lower_priority() -> None:
    """The compile worker runs at nice 10 (Linux; best effort), so on a busy host the engine
    thread wins the core."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
