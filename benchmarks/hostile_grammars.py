"""Issue #40's hostile grammars, defined once: what benchmarks/hostile.py sends beside its
canary and what tests/unit/test_structured.py and tests/e2e/test_hostile.py check is refused.

Each entry is (kind, spec, the request field): ``kind`` "json_schema" (``spec`` a JSON Schema, sent
as ``response_format``) or "regex" (``spec`` a pattern, sent as ``structured_outputs.regex``).
``REFUSED`` are refused at compile time (a 400 naming the field: too large, or too complex under
zerolayer.structured.LIMITS); ``LATE`` compiles and may fail only after some tokens, that row
alone (a 400 or an SSE error naming the field, never a 500).
"""

from __future__ import annotations

from typing import Any

SCHEMA_FIELD = "response_format.json_schema.schema"
REGEX_FIELD = "structured_outputs.regex"


def _pattern(n: int) -> dict[str, Any]:
    pattern = "^" + "(a|b)?" * n + "$"
    return {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}},
            "required": ["s"]}  # fmt: skip


def _properties(n: int, required: bool) -> dict[str, Any]:
    props = {f"p{i}": {"type": "string"} for i in range(n)}
    schema: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        schema["required"] = list(props)
    return schema


RECURSIVE_OBJECT = {
    "$defs": {
        "n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}
    },
    "$ref": "#/$defs/n",
}
RECURSIVE_ARRAY = {
    "$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}, "minItems": 1}},
    "$ref": "#/$defs/n",
}

REFUSED: dict[str, tuple[str, Any, str]] = {
    "pattern x20000 (issue)": ("json_schema", _pattern(20_000), SCHEMA_FIELD),
    "pattern x2000": ("json_schema", _pattern(2_000), SCHEMA_FIELD),
    "recursive $ref object": ("json_schema", RECURSIVE_OBJECT, SCHEMA_FIELD),
    "recursive $ref array": ("json_schema", RECURSIVE_ARRAY, SCHEMA_FIELD),
    "10k optional properties (issue)": ("json_schema", _properties(10_000, False), SCHEMA_FIELD),
    "10k required properties (issue)": ("json_schema", _properties(10_000, True), SCHEMA_FIELD),
}
LATE: dict[str, tuple[str, Any, str]] = {
    "nested regex (issue)": ("regex", "([a-z]{0,200}[0-9]{0,200}){0,200}", REGEX_FIELD),
}


def request_fields(kind: str, spec: Any) -> dict[str, Any]:
    """The OpenAI chat fields that carry one of these grammars."""
    if kind == "regex":
        return {"structured_outputs": {"regex": spec}}
    return {
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": spec}}
    }
