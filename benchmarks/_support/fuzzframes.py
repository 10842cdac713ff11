"""Frames for fuzzing a live daemon: valid requests, mutated ones, random blobs; the corpus files.

Used by benchmarks/fuzz.py (the campaign), benchmarks/soak.py and the corpus replay tests. Frames
are built from docs/protocol.md with struct (like tests/support/rawclient.py), so a mutation can
break any field, including those our own encoder would refuse to write. Every generator takes a
``random.Random`` so a campaign is reproducible from its seed.

Corpus files (tests/fixtures/fuzz-corpus/*.hex): ``#`` comment lines saying what the input is and
why it is kept, then the bytes written on one fresh connection, as hex (whitespace ignored).
"""

from __future__ import annotations

import json
import random
import struct
from collections.abc import Callable
from pathlib import Path

from zerolayer.frames import requests

HDR = struct.Struct("<IBBHI")
REQ = struct.Struct("<IffIQIHH")
REQUEST, TOKEN, DONE, PING, PONG, ERROR, CANCEL, HELLO, WELCOME, GOAWAY = range(1, 11)
INTERNAL = 15
CORPUS = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "fuzz-corpus"

U32_EDGES = (0, 1, 2, 0x7F, 0x80, 0xFF, 0x7FFF, 0x8000, 0xFFFF, 2**31 - 1, 2**31, 2**32 - 1)
# Byte offsets of the u32/f32 fields of a binary REQUEST's fixed part (docs/protocol.md).
REQ_WORDS = (0, 4, 8, 12, 16, 20, 24, 28)


def frame(
    ftype: int, stream: int, payload: bytes = b"", flags: int = 0, reserved: int = 0
) -> bytes:
    return HDR.pack(len(payload), ftype, flags, reserved, stream) + payload


def split_frames(buf: bytes) -> tuple[list[tuple[int, int, bytes]], bytes]:
    """The complete frames at the start of ``buf`` as (type, stream, payload), and the rest."""
    frames, pos = [], 0
    while len(buf) - pos >= HDR.size:
        length, ftype, _, _, sid = HDR.unpack_from(buf, pos)
        if len(buf) - pos < HDR.size + length:
            break
        frames.append((ftype, sid, buf[pos + HDR.size : pos + HDR.size + length]))
        pos += HDR.size + length
    return frames, buf[pos:]


def request_payload(
    rng: random.Random, vocab: int, max_tokens: tuple[int, int] = (1, 8)
) -> tuple[bytes, int]:
    """A valid binary REQUEST payload with small max_tokens; returns (payload, max_tokens)."""
    n = rng.randint(*max_tokens)
    as_text = rng.random() < 0.5
    options = (1 if as_text else 0) | (2 if rng.random() < 0.5 else 0)
    seed = 0
    if rng.random() < 0.3:
        options |= 4
        seed = rng.getrandbits(64)
    temperature = rng.choice((0.0, 0.0, 0.7, 1.0, 1.5))
    top_p = rng.choice((1.0, 0.9, 0.5))
    top_k = rng.choice((0, 0, 1, 40, vocab))
    stops = [rng.randrange(vocab) for _ in range(rng.choice((0, 0, 1, 3)))]
    if as_text:
        body = rng.choice((b"hello", b"fuzz", "\u00e9t\u00e9 \u2603".encode(), b"x" * 40))
    else:
        k = rng.randint(1, 16)
        body = struct.pack(f"<{k}i", *(rng.randrange(vocab) for _ in range(k)))
    fixed = REQ.pack(n, temperature, top_p, top_k, seed, 0, len(stops), options)
    return fixed + struct.pack(f"<{len(stops)}i", *stops) + body, n


def json_payload(rng: random.Random, max_tokens: tuple[int, int] = (1, 8)) -> tuple[dict, int]:
    n = rng.randint(*max_tokens)
    obj: dict = {"max_tokens": n}
    if rng.random() < 0.5:
        obj["messages"] = [{"role": "user", "content": rng.choice(("hi", "fuzz me", "\u2603"))}]
    else:
        obj["prompt"] = rng.choice(("abc", "once upon", "\u00e9"))
    if rng.random() < 0.3:
        obj["temperature"] = rng.choice((0.0, 0.5, 1.0))
    if rng.random() < 0.2:
        obj["stop_sequences"] = ["\n"]
    if rng.random() < 0.2:
        obj["system"] = "be brief"
    return obj, n


EDGE_JSON = (
    None,
    True,
    -1,
    0,
    2**31,
    2**32,
    2**64,
    -(2**63),
    1e308,
    float("nan"),
    float("inf"),
    "",
    "x" * 1000,
    "\ud800",
    [],
    {},
    [1, 2],
    {"a": 1},
    "\u0000",
)
# The JSON REQUEST's keys as the protocol defines them, sorted (a frozenset's order changes
# with the hash seed; a campaign must not), plus one it does not know.
JSON_KEYS = (*sorted(requests.JSON_KEYS), "bogus")


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    """One random byte-level mutation: flip, set, insert, delete, truncate, duplicate."""
    b = bytearray(data)
    op = rng.randrange(6)
    if op == 0 and b:
        i = rng.randrange(len(b))
        b[i] ^= 1 << rng.randrange(8)
    elif op == 1 and b:
        b[rng.randrange(len(b))] = rng.choice((0, 0xFF, 0x7F, 0x80, 0x22, 0x5C, 0x7B))
    elif op == 2:
        i = rng.randint(0, len(b))
        b[i:i] = rng.randbytes(rng.randint(1, 8))
    elif op == 3 and b:
        i = rng.randrange(len(b))
        del b[i : i + rng.randint(1, 8)]
    elif op == 4:
        del b[rng.randint(0, len(b)) :]
    else:
        i = rng.randint(0, len(b))
        b[i:i] = b[i : i + rng.randint(1, 16)]
    return bytes(b)


def mutated_request(rng: random.Random, stream: int, vocab: int) -> bytes:
    """A REQUEST whose header is right but whose payload is broken: a stream error, at most."""
    if rng.random() < 0.35:
        obj, _ = json_payload(rng)
        if rng.random() < 0.6:
            obj[rng.choice(JSON_KEYS)] = rng.choice(EDGE_JSON)
            try:
                body = json.dumps(obj).encode("utf-8", "surrogatepass")
            except ValueError:
                body = b'{"max_tokens": 1, "prompt": "\\ud800"}'
        else:
            body = mutate_bytes(rng, json.dumps(obj).encode())
        return frame(REQUEST, stream, body, flags=1)
    payload, _ = request_payload(rng, vocab)
    b = bytearray(payload)
    r = rng.random()
    if r < 0.5:  # a fixed-part word set to an edge value
        struct.pack_into("<I", b, rng.choice(REQ_WORDS), rng.choice(U32_EDGES))
    elif r < 0.6:  # n_stop or options
        struct.pack_into("<H", b, rng.choice((28, 30)), rng.choice((0, 1, 7, 8, 0xFFFF)))
    elif r < 0.7:  # a float field set to nan / inf / negative / huge
        struct.pack_into("<f", b, rng.choice((4, 8)), rng.choice((-1.0, 1e30, float("nan"))))
    else:
        b = bytearray(mutate_bytes(rng, bytes(b)))
    return frame(REQUEST, stream, bytes(b))


def bad_header(rng: random.Random, max_frame: int) -> bytes:
    """A frame the server must answer with a connection error (or wait on, for a short one)."""
    kind = rng.randrange(7)
    if kind == 0:
        return frame(rng.choice((0, 2, 3, 5, 6, 9, 10, 11, 0xFF)), rng.getrandbits(32), b"x")
    if kind == 1:
        return frame(REQUEST, 1, b"", flags=rng.choice((2, 0x80, 0xFF)))
    if kind == 2:
        return frame(PING, 0, b"", reserved=rng.randint(1, 0xFFFF))
    if kind == 3:
        return frame(rng.choice((REQUEST, CANCEL)), 0, b"")
    if kind == 4:
        return frame(PING, rng.randint(1, 9), b"")
    if kind == 5:
        return frame(PING, 0, b"p" * rng.randint(65, 200))
    return HDR.pack(rng.choice((max_frame + 1, 2**32 - 1)), REQUEST, 0, 0, 1)


def valid_request(rng: random.Random, stream: int, vocab: int) -> tuple[bytes, int]:
    if rng.random() < 0.3:
        obj, n = json_payload(rng)
        return frame(REQUEST, stream, json.dumps(obj).encode(), flags=1), n
    payload, n = request_payload(rng, vocab)
    return frame(REQUEST, stream, payload), n


Gen = Callable[[random.Random], bytes]


def read_corpus(path: Path) -> tuple[str, bytes]:
    """(comment, bytes) of one corpus file."""
    comment, hexes = [], []
    for line in path.read_text().splitlines():
        (comment if line.startswith("#") else hexes).append(line.lstrip("# ").rstrip())
    return "\n".join(comment), bytes.fromhex("".join("".join(hexes).split()))


def write_corpus(path: Path, comment: str, data: bytes) -> None:
    lines = [f"# {line}" for line in comment.splitlines()]
    lines += [data[i : i + 32].hex() for i in range(0, len(data), 32)]
    path.write_text("\n".join(lines) + "\n")


def corpus_files() -> list[Path]:
    return sorted(CORPUS.glob("*.hex"))
