"""Structured output: a request's constraint compiled into a grammar, and per-row matchers.

The grammar engine is llguidance (chosen in docs/benchmarks.md, "Grammar engines"): it reads a
checkpoint's tokenizer.json as it is, and depends on nothing else. A ``Constraint`` is what a
request asks for — OpenAI ``response_format`` ``json_object`` / ``json_schema`` (``strict``), and
vLLM's ``structured_outputs`` ``regex`` / ``choice`` — in canonical text, so equal constraints
share one compiled grammar. ``Grammars`` compiles off the event loop and off the engine thread
(one worker thread), bounded in time, and caches by constraint; a constraint it cannot compile
is a ``GrammarError`` naming the field and why. A ``RowMatcher`` is one sequence's state: fill
its row of the batch's bitmask, accept a sampled token, tell when it is finished.

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
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

Kind = Literal["json_object", "json_schema", "regex", "choice"]
COMPILE_TIMEOUT_S = 10.0
CACHE_SIZE = 256
# llguidance's JSON options for every schema: no free whitespace, fixed separators.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# JSON Schema keywords whose value is a schema, a map of schemas, or a list of schemas.
_SUBSCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else",
              "propertyNames", "unevaluatedItems", "additionalProperties")  # fmt: skip
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")  # allOf: see closed
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed(schema: Any, close: bool = True) -> Any:
    """``schema`` with every object schema that lists ``properties`` and says nothing of other
    keys closed to them (``additionalProperties: false``); a copy, the argument is not changed.
    The members of an ``allOf`` are not closed themselves (each adds properties to the others';
    closed, no instance could satisfy two of them), their subschemas are."""
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


class Grammar:
    """A compiled constraint: makes matchers for the rows that use it."""

    def __init__(self, constraint: Constraint, compiled: str, tokenizer: Any) -> None:
        self.constraint = constraint
        self._compiled = compiled
        self._tokenizer = tokenizer

    def matcher(self) -> RowMatcher:
        import llguidance

        return RowMatcher(llguidance.LLMatcher(self._tokenizer, self._compiled))


class RowMatcher:
    """One sequence's place in its grammar."""

    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 [rows, words]).
        (llguidance.numpy, not llguidance.torch: importing the latter imports torch._dynamo, 8 s
        measured here, on the engine thread at the first constrained step.)"""
        import llguidance.numpy as ln

        ln.fill_next_token_bitmask(self._m, bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False when the grammar does not allow it."""
        return bool(self._m.consume_token(token)) and not self._m.is_error()

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing but ending."""
        return bool(self._m.is_stopped())

    @property
    def accepting(self) -> bool:
        """What was generated so far is a complete match (EOS would be allowed)."""
        return bool(self._m.is_accepting())


class Grammars:
    """Compiles constraints for one tokenizer on its own worker thread, LRU-cached by text.
    ``eos_id`` is the end token a complete match allows (the model's EOS; the engine's rows
    allow the tokenizer's other end-of-generation ids wherever it is allowed)."""

    def __init__(
        self,
        tokenizer_json: str | Path,
        eos_id: int,
        vocab_size: int,
        timeout_s: float = COMPILE_TIMEOUT_S,
        cache_size: int = CACHE_SIZE,
    ) -> None:
        import llguidance

        self._llg = llguidance
        text = Path(tokenizer_json).read_text()
        self.tokenizer = llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos_id)
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.timeout_s = timeout_s
        self._cache: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def bitmask(self, rows: int) -> np.ndarray:
        """A zeroed int32 [rows, words] mask for ``RowMatcher.fill``."""
        return np.zeros((rows, self.words), np.int32)

    def cached(self, constraint: Constraint) -> Grammar | None:
        with self._lock:
            grammar = self._cache.get((constraint.kind, constraint.text))
            if grammar is not None:
                self._cache.move_to_end((constraint.kind, constraint.text))
            return grammar

    def compile_now(self, constraint: Constraint) -> Grammar:
        """Compile on the calling thread (the worker, or a test); cached."""
        grammar = self.cached(constraint)
        if grammar is not None:
            return grammar
        llg = self._llg
        if constraint.kind in ("regex", "choice"):
            compiled = llg.LLMatcher.grammar_from_regex(constraint.text)
        else:
            schema = closed(json.loads(constraint.text))
            compiled = llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        ok, error = _validate(llg, compiled, self.tokenizer)
        if not ok:
            raise GrammarError(constraint.field, error)
        grammar = Grammar(constraint, compiled, self.tokenizer)
        with self._lock:
            self._cache[(constraint.kind, constraint.text)] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def compile_sync(self, constraint: Constraint) -> Grammar:
        """Compile on the worker thread, waiting at most ``timeout_s``."""
        grammar = self.cached(constraint)
        if grammar is not None:
            return grammar
        future = self._pool.submit(self.compile_now, constraint)
        try:
            return future.result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise GrammarError(
                constraint.field, f"the grammar did not compile within {self.timeout_s:g} s"
            ) from None

    async def compile(self, constraint: Constraint) -> Grammar:
        """Compile off the event loop on the worker thread, bounded by ``timeout_s``."""
        grammar = self.cached(constraint)
        if grammar is not None:
            return grammar
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, self.compile_now, constraint)
        try:
            return await asyncio.wait_for(future, self.timeout_s)
        except asyncio.TimeoutError:
            raise GrammarError(
                constraint.field, f"the grammar did not compile within {self.timeout_s:g} s"
            ) from None


def _validate(llg: Any, compiled: str, tokenizer: Any) -> tuple[bool, str]:
    """(usable, why not): llguidance's own check of a grammar against the tokenizer."""
    try:
        result = llg.LLMatcher.validate_grammar_with_warnings(compiled, tokenizer)
    except Exception as exc:  # malformed input raises from the Rust side
        return False, str(exc)
    failed, messages = result  # (is it an error, the messages)
    return not failed, "; ".join(messages) if failed else ""
