"""50 JSON Schemas of varied shape, each with one instance that validates against it.

Shared by benchmarks/grammar.py (compile time, mask time, coverage of the grammar engines) and
the structured-output tests. Shapes: flat and nested objects, arrays (bounded, of objects),
enums and consts, string formats (date, date-time, email, uuid, uri), patterns and lengths,
numeric ranges, optional and nullable fields, anyOf/oneOf/allOf, $defs/$ref, a recursive tree,
additionalProperties maps.
"""

from __future__ import annotations

from typing import Any

Case = tuple[str, dict[str, Any], Any]  # (name, schema, instance)


def _obj(props: dict[str, Any], required: list[str] | None = None, **kw: Any) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": props}
    schema["required"] = list(props) if required is None else required
    schema.update(kw)
    return schema


S = {"type": "string"}
I = {"type": "integer"}  # noqa: E741
N = {"type": "number"}
B = {"type": "boolean"}

HAND: list[Case] = [
    ("string", S, "hello"),
    ("integer", I, 42),
    ("boolean", B, True),
    ("flat-3", _obj({"name": S, "age": I, "ok": B}), {"name": "Ada", "age": 36, "ok": True}),
    ("optional", _obj({"a": S, "b": I}, ["a"]), {"a": "x"}),
    ("nullable", _obj({"v": {"type": ["string", "null"]}}), {"v": None}),
    ("enum", _obj({"color": {"enum": ["red", "green", "blue"]}}), {"color": "green"}),
    ("const", _obj({"kind": {"const": "point"}, "x": N}), {"kind": "point", "x": 1.5}),
    ("int-range", _obj({"n": {"type": "integer", "minimum": 1, "maximum": 10}}), {"n": 7}),
    ("num-range", _obj({"p": {"type": "number", "minimum": 0, "maximum": 1}}), {"p": 0.25}),
    (
        "str-len",
        _obj({"code": {"type": "string", "minLength": 3, "maxLength": 5}}),
        {"code": "abcd"},
    ),
    ("pattern", _obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}), {"zip": "12345"}),
    ("date", _obj({"d": {"type": "string", "format": "date"}}), {"d": "2024-05-01"}),
    (
        "date-time",
        _obj({"t": {"type": "string", "format": "date-time"}}),
        {"t": "2024-05-01T12:30:00Z"},
    ),
    ("email", _obj({"e": {"type": "string", "format": "email"}}), {"e": "ada@example.com"}),
    (
        "uuid",
        _obj({"id": {"type": "string", "format": "uuid"}}),
        {"id": "123e4567-e89b-12d3-a456-426614174000"},
    ),
    ("uri", _obj({"u": {"type": "string", "format": "uri"}}), {"u": "https://example.com/a"}),
    ("array-int", {"type": "array", "items": I}, [1, 2, 3]),
    (
        "array-bounded",
        _obj({"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}}),
        {"tags": ["a", "b"]},
    ),
    (
        "array-objects",
        _obj({"items": {"type": "array", "items": _obj({"sku": S, "qty": I})}}),
        {"items": [{"sku": "A1", "qty": 2}, {"sku": "B2", "qty": 1}]},
    ),
    (
        "nested-2",
        _obj({"user": _obj({"name": S, "address": _obj({"city": S, "zip": S})})}),
        {"user": {"name": "Bo", "address": {"city": "Oslo", "zip": "0150"}}},
    ),
    (
        "nested-4",
        _obj({"a": _obj({"b": _obj({"c": _obj({"d": I})})})}),
        {"a": {"b": {"c": {"d": 1}}}},
    ),
    ("anyOf", _obj({"v": {"anyOf": [S, I]}}), {"v": 3}),
    (
        "oneOf-objects",
        {
            "oneOf": [
                _obj({"type": {"const": "cat"}, "lives": I}),
                _obj({"type": {"const": "dog"}, "good": B}),
            ]
        },
        {"type": "dog", "good": True},
    ),
    (
        "allOf",
        {"allOf": [_obj({"a": S}), _obj({"b": I})]},
        {"a": "x", "b": 2},
    ),
    (
        "defs-ref",
        {
            "$defs": {"pt": _obj({"x": N, "y": N})},
            **_obj({"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}}),
        },
        {"from": {"x": 0, "y": 0}, "to": {"x": 1.5, "y": -2}},
    ),
    (
        "recursive-tree",
        {
            "$defs": {
                "node": _obj(
                    {"v": I, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                )
            },
            "$ref": "#/$defs/node",
        },
        {"v": 1, "kids": [{"v": 2, "kids": []}, {"v": 3, "kids": [{"v": 4, "kids": []}]}]},
    ),
    (
        "map",
        {"type": "object", "additionalProperties": I},
        {"apples": 3, "pears": 5},
    ),
    (
        "closed-object",
        _obj({"a": S}, additionalProperties=False),
        {"a": "only"},
    ),
    (
        "array-enum",
        {"type": "array", "items": {"enum": ["low", "mid", "high"]}},
        ["low", "high"],
    ),
    (
        "tool-call",
        _obj(
            {
                "name": {"const": "get_weather"},
                "arguments": _obj({"city": S, "unit": {"enum": ["c", "f"]}}, ["city"]),
            }
        ),
        {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}},
    ),
    (
        "matrix",
        {"type": "array", "items": {"type": "array", "items": N}},
        [[1, 2], [3.5, 4]],
    ),
    (
        "invoice",
        _obj(
            {
                "number": {"type": "string", "pattern": "^INV-[0-9]{4}$"},
                "date": {"type": "string", "format": "date"},
                "lines": {
                    "type": "array",
                    "items": _obj({"desc": S, "amount": {"type": "number", "minimum": 0}}),
                },
                "paid": B,
                "note": {"type": ["string", "null"]},
            },
            ["number", "date", "lines", "paid"],
        ),
        {
            "number": "INV-0042",
            "date": "2024-01-31",
            "lines": [{"desc": "x", "amount": 9.5}],
            "paid": False,
        },
    ),
]


def _generated() -> list[Case]:
    """Wider objects of mixed field types, some optional: the shape most response_format
    schemas from pydantic models have."""
    kinds = [
        (S, "text"),
        (I, 7),
        (N, 2.5),
        (B, False),
        ({"enum": ["a", "b", "c"]}, "b"),
        ({"type": "array", "items": S}, ["x", "y"]),
        ({"type": "string", "format": "date"}, "2025-02-03"),
        (_obj({"k": S}), {"k": "v"}),
    ]
    out: list[Case] = []
    for n in range(len(HAND), 50):
        width = 2 + n % 9
        props, inst, required = {}, {}, []
        for f in range(width):
            schema, value = kinds[(n + f * 3) % len(kinds)]
            name = f"field_{f}"
            props[name] = schema
            if (n + f) % 4:  # three fields in four are required
                required.append(name)
                inst[name] = value
        out.append((f"object-{width}-{n}", _obj(props, required), inst))
    return out


CASES: list[Case] = HAND + _generated()
assert len(CASES) == 50
