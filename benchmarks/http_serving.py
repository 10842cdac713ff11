"""HTTP front end cost: server CPU per streamed token over the OpenAI API, side by side with
(a) the same load over frames, (b) FastAPI + uvicorn streaming the same chunks with a pydantic
model per chunk (how vLLM's front end streams) and no model work, (c) a no-logic uvloop server
writing the same SSE bytes, one write per token per connection (the floor for one stream per
connection).

Load: ROUNDS rounds of STREAMS concurrent streaming chat requests x TOKENS tokens, one request
per keep-alive connection (each connection sends its next request when its stream ends), client
in its own process. zerolayer runs `zerolayer serve` with the synthetic backend (no model, step
time 0) and its default configuration (metrics, rate-limit hook, response cache); requests use
each API's default temperature (1.0), so the cache never records. Server CPU = CPU time of
the server process's threads (/proc/PID/task/*/schedstat) across the load, engine thread included.

    python benchmarks/http_serving.py [--streams 64] [--tokens 256] [--rounds 10] [--write]

Prints the table; ``--write`` also updates benchmarks/results/http.json and docs/benchmarks.md.

Needs the `bench` extra (FastAPI, uvicorn): `pip install -e '.[bench]'` (`make bench` does).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._report import (  # noqa: E402
    cpu_seconds,
    machine,
    machine_line,
    parser,
    per_token,
    publish,
    table,
)

MODEL = "synthetic"  # the synthetic backend's model name; the baselines answer with it too
TOKEN_MARK = b'"delta":{"content":'  # one per content chunk in every server's output
END_MARK = b"data: [DONE]\n\n\r\n0\r\n\r\n"


# ------------------------------------------------------------------ the SSE bytes all servers send

CHUNK_ID = "chatcmpl-bench"
CREATED = 1_700_000_000


def chunk_head() -> bytes:
    return (
        f'data: {{"id":"{CHUNK_ID}","object":"chat.completion.chunk","created":{CREATED},'
        f'"model":"{MODEL}","choices":'
    ).encode()


def floor_events(letter: bytes = b"a") -> tuple[bytes, bytes, bytes]:
    """(first event, one token's event, closing events), as zerolayer writes them."""
    head = chunk_head()
    first = head + (
        b'[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
        b'"finish_reason":null}]}\n\n'
    )
    token = head + b'[{"index":0,"delta":{"content":"%s"},"logprobs":null,' % letter
    token += b'"finish_reason":null}]}\n\n'
    return first, token, head


def closing_events(n: int) -> bytes:
    head = chunk_head()
    usage = b'{"prompt_tokens":8,"completion_tokens":%d,"total_tokens":%d}' % (n, n + 8)
    return (
        head
        + b'[{"index":0,"delta":{},"logprobs":null,"finish_reason":"length"}]}\n\n'
        + head
        + b'[],"usage":'
        + usage
        + b"}\n\ndata: [DONE]\n\n"
    )


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


RESPONSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)


# ----------------------------------------------------------------------- (c) the floor server


class FloorProtocol(asyncio.Protocol):
    """Reads a request (headers + Content-Length body, no parsing beyond that), then writes one
    chunk per token on each loop turn: no validation, JSON, hooks, engine or accounting."""

    active: set[FloorProtocol] = set()
    ticking = False

    def __init__(self) -> None:
        self.buf = b""
        self.left = 0
        self.sent = 0
        self.first, self.token, _ = floor_events()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buf[:end].lower()
        i = head.find(b"content-length:")
        length = int(head[i + 15 :].split(b"\r\n", 1)[0]) if i >= 0 else 0
        if len(self.buf) < end + 4 + length:
            return
        body = self.buf[end + 4 : end + 4 + length]
        self.buf = self.buf[end + 4 + length :]
        self.left = json.loads(body)["max_tokens"]
        self.sent = 0
        self.transport.write(RESPONSE_HEAD + chunk(self.first))
        FloorProtocol.active.add(self)
        if not FloorProtocol.ticking:
            FloorProtocol.ticking = True
            asyncio.get_running_loop().call_soon(FloorProtocol.tick)

    @staticmethod
    def tick() -> None:
        for conn in list(FloorProtocol.active):
            conn.left -= 1
            conn.sent += 1
            data = chunk(conn.token)
            if not conn.left:
                data += chunk(closing_events(conn.sent)) + b"0\r\n\r\n"
                FloorProtocol.active.discard(conn)
            conn.transport.write(data)
        if FloorProtocol.active:
            asyncio.get_running_loop().call_soon(FloorProtocol.tick)
        else:
            FloorProtocol.ticking = False


def run_floor_server() -> None:
    import uvloop

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(FloorProtocol, "127.0.0.1", 0)
        print(server.sockets[0].getsockname()[1], flush=True)
        await asyncio.Event().wait()

    uvloop.run(main())


# ------------------------------------------------------------------- (b) FastAPI + uvicorn


def run_fastapi_server() -> None:
    import socket

    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse
    from pydantic import BaseModel

    class Message(BaseModel):
        role: str
        content: str

    class StreamOptions(BaseModel):
        include_usage: bool = False

    class ChatRequest(BaseModel):
        model: str
        messages: list[Message]
        max_tokens: int
        stream: bool = False
        stream_options: StreamOptions | None = None

    class Delta(BaseModel):
        role: str | None = None
        content: str | None = None

    class Choice(BaseModel):
        index: int
        delta: Delta
        logprobs: None = None
        finish_reason: str | None = None

    class Usage(BaseModel):
        prompt_tokens: int
        completion_tokens: int
        total_tokens: int

    class Chunk(BaseModel):
        id: str
        object: str = "chat.completion.chunk"
        created: int
        model: str
        choices: list[Choice]
        usage: Usage | None = None

    app = FastAPI()

    async def chat(req: ChatRequest) -> StreamingResponse:
        async def events():
            def event(choices: list[Choice], usage: Usage | None = None) -> str:
                c = Chunk(id=CHUNK_ID, created=CREATED, model=MODEL, choices=choices, usage=usage)
                return f"data: {c.model_dump_json(exclude_none=True)}\n\n"

            yield event([Choice(index=0, delta=Delta(role="assistant", content=""))])
            for _ in range(req.max_tokens):
                await asyncio.sleep(0)  # as a server awaiting its engine's next output
                yield event([Choice(index=0, delta=Delta(content="a"))])
            yield event([Choice(index=0, delta=Delta(), finish_reason="length")])
            n = req.max_tokens
            yield event([], Usage(prompt_tokens=8, completion_tokens=n, total_tokens=n + 8))
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    # This file's annotations are strings (PEP 563); FastAPI must see the local model class.
    chat.__annotations__["req"] = ChatRequest
    app.post("/v1/chat/completions")(chat)

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    print(sock.getsockname()[1], flush=True)
    config = uvicorn.Config(app, loop="uvloop", http="httptools", log_level="warning")
    uvicorn.Server(config).run(sockets=[sock])


# ---------------------------------------------------------------------------- load clients


def http_request(max_tokens: int, nonce: str) -> bytes:
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"bench {nonce}"}],
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )


async def http_stream(reader, writer, request: bytes) -> int:
    """Send one request and read its streamed response; returns the content chunks seen."""
    writer.write(request)
    tokens = 0
    tail = b""
    keep = max(len(TOKEN_MARK), len(END_MARK))
    while True:
        data = await reader.read(1 << 20)
        if not data:
            raise SystemExit("server closed the connection")
        window = tail + data
        tokens += window.count(TOKEN_MARK) - tail.count(TOKEN_MARK)
        if window.endswith(END_MARK):
            return tokens
        tail = window[-keep:]


async def frame_stream(reader, writer, request: bytes) -> int:
    """Send one REQUEST and read its stream with the protocol's own decoder."""
    from zerolayer.frames import protocol as p

    writer.write(request)
    decoder = p.FrameDecoder("client", 1 << 20)
    tokens = 0
    while True:
        data = await reader.read(1 << 20)
        if not data:
            raise SystemExit("server closed the connection")
        decoder.feed(data)
        while (frame := decoder.next_frame()) is not None:
            ftype, _, _, payload = frame
            if ftype == p.FrameType.TOKEN:
                tokens += p.TOKEN_HEAD.unpack_from(payload)[0]
            elif ftype == p.FrameType.DONE:
                return tokens
            elif ftype == p.FrameType.ERROR:
                raise SystemExit(f"server answered ERROR {p.parse_error(payload)}")


def run_client(mode: str, port: int, streams: int, tokens: int, rounds: int) -> None:
    import uvloop

    from zerolayer.frames import protocol as p

    async def one_connection(i: int) -> int:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        total = 0
        for r in range(rounds):
            nonce = f"{time.time_ns()} {r} {i}"  # unique prompts: no response-cache hits
            if mode == "frames":
                request = p.encode_json_request(
                    1,
                    {
                        "max_tokens": tokens,
                        "messages": [{"role": "user", "content": f"bench {nonce}"}],
                        "temperature": 1.0,
                    },
                )
                total += await frame_stream(reader, writer, request)
            else:
                total += await http_stream(reader, writer, http_request(tokens, nonce))
        writer.close()
        return total

    async def main() -> None:
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one_connection(i) for i in range(streams)))
        print(json.dumps({"tokens": sum(counts), "seconds": time.perf_counter() - t0}))

    uvloop.run(main())


def load(mode: str, port: int, pid: int, args) -> dict:

    cpu0 = cpu_seconds(pid)
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--client",
            mode,
            str(port),
            "--streams",
            str(args.streams),
            "--tokens",
            str(args.tokens),
            "--rounds",
            str(args.rounds),
        ],
        capture_output=True,
        text=True,
    )
    cpu = cpu_seconds(pid) - cpu0
    if out.returncode:
        raise SystemExit(f"{mode} client failed:\n{out.stderr}")
    res = json.loads(out.stdout)
    expected = args.streams * args.tokens * args.rounds
    if res["tokens"] != expected:
        raise SystemExit(f"{mode}: expected {expected} tokens, got {res['tokens']}")
    return {"cpu_s": cpu, "wall_s": res["seconds"], "tokens": res["tokens"]}


def measure(mode: str, port: int, pid: int, args) -> dict:
    load(mode, port, pid, args)  # warm-up
    return per_token([load(mode, port, pid, args) for _ in range(args.runs)])


def baseline(flag: str, mode: str, args) -> dict:
    proc = subprocess.Popen([sys.executable, __file__, flag], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        return measure(mode, port, proc.pid, args)
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    ap = parser(__doc__.split("\n", 1)[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=10, help="requests per connection per run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--client", nargs=2, metavar=("MODE", "PORT"), help=argparse.SUPPRESS)
    ap.add_argument("--floor-server", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--fastapi-server", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.floor_server:
        return run_floor_server()
    if args.fastapi_server:
        return run_fastapi_server()
    if args.client:
        return run_client(
            args.client[0], int(args.client[1]), args.streams, args.tokens, args.rounds
        )

    from benchmarks._support.daemon import Daemon

    results: dict = {
        "machine": machine(),
        "streams": args.streams,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "runs": args.runs,
    }
    results["floor"] = baseline("--floor-server", "http", args)
    results["fastapi"] = baseline("--fastapi-server", "http", args)
    env = {
        "ENGINE__BACKEND": "synthetic",
        "ENGINE__MAX_BATCH_SIZE": str(args.streams),
        "ENGINE__MAX_CONTEXT": str(max(2048, args.tokens + 64)),
        "HTTP__ENABLED": "true",
    }
    with Daemon(env) as d:
        results["zerolayer_http"] = measure("http", d.http_port, d.proc.pid, args)
        results["zerolayer_frames"] = measure("frames", d.port, d.proc.pid, args)
        d.terminate()
    floor = results["floor"]["cpu_us_per_token"]
    fastapi = results["fastapi"]["cpu_us_per_token"]
    http = results["zerolayer_http"]["cpu_us_per_token"]
    results["http_vs_floor"] = http / floor
    results["http_vs_fastapi"] = http / fastapi
    labels = (
        ("(c) floor: no-logic uvloop server, same SSE bytes", "floor"),
        ("(b) FastAPI + uvicorn, pydantic chunk per token, no model", "fastapi"),
        ("zerolayer HTTP (OpenAI chat, synthetic backend)", "zerolayer_http"),
        ("(a) zerolayer frames, same load (JSON chat, text deltas)", "zerolayer_frames"),
    )
    rows = [
        [
            label,
            f"{results[key]['cpu_us_per_token']:.2f}",
            f"{results[key]['cpu_us_per_token'] / floor:.2f}x",
            f"{results[key]['cpu_us_per_token'] / fastapi:.2f}x",
            f"{results[key]['tokens_per_s']:,.0f}",
        ]
        for label, key in labels
    ]
    md = (
        "## HTTP front end: server CPU per streamed token\n\n"
        f"`python benchmarks/http_serving.py` — {args.rounds} rounds of {args.streams} concurrent "
        f"streaming chat requests x {args.tokens} tokens, one request at a time per keep-alive "
        f"connection ({args.streams} connections), client in its own process, median of "
        f"{args.runs} runs after a warm-up. Server CPU = CPU time of the server process's "
        "threads during the load. zerolayer: default configuration, synthetic backend (no "
        "model, so no dtype; the event loop and the engine thread, both counted), unpaced "
        "(step time 0); requests use the API's default temperature 1.0, so the response "
        "cache records nothing. Every server streams the same chunk for each token: one "
        "content delta of one character.\n\n"
        + table(["server", "CPU µs / token", "vs floor (c)", "vs FastAPI (b)", "tokens / s"], rows)
        + f"\n\nAims: ≤ 1/3 of (b) — measured {results['http_vs_fastapi']:.2f}; ≤ 1.5x (c) — "
        f"measured {results['http_vs_floor']:.2f}x. The floor writes one chunk per token per "
        "connection on each loop turn; zerolayer writes once per connection per engine "
        "delivery, which can carry several tokens when the engine runs ahead of the loop. "
        "The front end parses HTTP with httptools (llhttp, C) in its own asyncio.Protocol on "
        "the daemon's uvloop loop; uvicorn in (b) runs on the same parser and loop, so the gap "
        "to (b) is the framework and the per-chunk pydantic model, not the parser. A "
        "pure-Python parser (h11) was not measured. "
        "Shared 2-core VM (other jobs ran): compare the rows of one run.\n\n"
        + machine_line(results["machine"])
    )
    print(md)
    publish(args, "http", results, md)


if __name__ == "__main__":
    main()
