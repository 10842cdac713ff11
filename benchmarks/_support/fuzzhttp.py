"""HTTP fuzz inputs shared by benchmarks/fuzz_http.py and the corpus replay test: seed requests
and their mutations (heads, bodies, JSON: lone surrogates, deep nesting, huge numbers, wrong
types). A corpus file (tests/fixtures/http-fuzz-corpus/*.http) is one request's raw bytes."""

from __future__ import annotations

import json
import random
from pathlib import Path

CORPUS = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "http-fuzz-corpus"
PATHS = (b"/v1/chat/completions", b"/v1/messages", b"/v1/completions", b"/v1/messages/count_tokens")
MSGS = [{"role": "user", "content": "hi"}]
SEEDS: list[dict] = [
    {"model": "synthetic", "messages": MSGS, "max_tokens": 3},
    {"model": "synthetic", "prompt": "hi", "max_tokens": 3},
    {"model": "synthetic", "messages": MSGS, "max_tokens": 3, "stream": True},
]
_JSON_VALUES: list[object] = [
    None, True, -1, 0, 2**63, 10**400, 1e308, "x", "\ud800", [], {}, [[[[]]]], "\x00",
]  # fmt: skip


def request(path: bytes, body: bytes, head: bytes = b"") -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nhost: f\r\ncontent-type: application/json\r\n%s"
        b"content-length: %d\r\n\r\n%s" % (path, head, len(body), body)
    )


def _json_body(rng: random.Random) -> bytes:
    obj = dict(rng.choice(SEEDS))
    kind = rng.randrange(6)
    if kind == 0:  # a wrong type or odd value for a known field
        obj[rng.choice([*obj, "temperature", "top_p", "stop", "n"])] = rng.choice(_JSON_VALUES)
    elif kind == 1:  # an unknown key, sometimes a lone surrogate
        obj[rng.choice(["\ud800", "\udfff x", "zz", "\x00"])] = 1
    elif kind == 2:  # deep nesting
        depth = rng.choice([10, 1000, 100000])
        return b'{"messages":' + b"[" * depth + b"]" * depth + b',"max_tokens":2}'
    elif kind == 3:  # huge number as text
        return b'{"messages":[{"role":"user","content":"a"}],"max_tokens":1' + b"0" * 5000 + b"}"
    elif kind == 4:
        obj["messages"] = [
            {"role": rng.choice(["user", "x", 5]), "content": rng.choice(_JSON_VALUES)}
        ]
    raw = json.dumps(obj).encode()
    if kind == 5 and raw:  # byte flips
        b = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        raw = bytes(b)
    return raw


def _head(rng: random.Random, data: bytes) -> bytes:
    kind = rng.randrange(5)
    if kind == 0:  # a header line broken
        return data.replace(b"content-type:", rng.choice([b"content type:", b"\x00:", b": "]), 1)
    if kind == 1:  # content-length lies
        return data.replace(b"content-length: ", b"content-length: 9", 1)
    if kind == 2:  # request line mutated
        return rng.choice([b"GET", b"P\xffST", b"POST /" * 3]) + data[4:]
    if kind == 3:  # an upgrade
        return data.replace(
            b"host: f\r\n", b"host: f\r\nupgrade: h2c\r\nconnection: upgrade\r\n", 1
        )
    return data.replace(
        b"host: f\r\n", b"host: f\r\nx-pad: " + b"a" * rng.choice([10, 70000]) + b"\r\n"
    )


def mutated(rng: random.Random) -> bytes:
    """One request's bytes: a JSON mutation, a head mutation, or both."""
    data = request(rng.choice(PATHS), _json_body(rng))
    if rng.random() < 0.3:
        data = _head(rng, data)
    return data


def corpus() -> list[tuple[str, bytes]]:
    return [(p.name, p.read_bytes()) for p in sorted(CORPUS.glob("*.http"))]
