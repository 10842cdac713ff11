"""An in-process frame server (request path, engine never started, fake transports) for tests
that drive connections byte by byte and step the engine themselves."""

from __future__ import annotations

from zerolayer.config.settings import Settings
from zerolayer.engine.backends.factory import build_backend
from zerolayer.engine.engine import Engine
from zerolayer.frames.door import Connection, Server
from zerolayer.hooks import Chain, Completion
from zerolayer.ops.metrics import Metrics
from zerolayer.request_path.inputs import InputProcessor
from zerolayer.request_path.lifecycle import RequestPath


class FakeTransport:
    """What Connection uses of an asyncio transport; keeps what was written."""

    def __init__(self, peer: str = "127.0.0.1") -> None:
        self.peer = peer
        self.data = bytearray()
        self.writes = 0
        self.closed = False

    def get_extra_info(self, name: str, default: object = None) -> object:
        return (self.peer, 50000) if name == "peername" else default

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def write(self, data: bytes) -> None:
        self.data += data
        self.writes += 1

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


def make_server(**server: object) -> tuple[Server, list[Completion]]:
    settings = Settings(
        server=server,
        engine={
            "backend": "synthetic",
            "max_batch_size": 8,
            "max_context": 96,
            "synthetic_vocab_size": 300,
        },
    )
    backend, tokenizer = build_backend(settings)
    chain = Chain.build(settings)
    completions: list[Completion] = []
    on_done = chain.on_done

    def record(ctx, completion: Completion) -> None:
        completions.append(completion)
        on_done(ctx, completion)

    chain.on_done = record  # type: ignore[method-assign]
    engine = Engine(
        backend,
        tokenizer,
        lambda step: None,  # never started: the test steps it
        max_queue=64,
        max_step_tokens=64,
        prefill_chunk=16,
    )
    metrics = Metrics()
    path = RequestPath(engine, InputProcessor(tokenizer, backend.info), chain, metrics)
    return Server(settings.server, path, backend.info, metrics), completions


def connect(server: Server, peer: str = "127.0.0.1") -> tuple[Connection, FakeTransport]:
    conn = Connection(server)
    transport = FakeTransport(peer)
    conn.connection_made(transport)  # type: ignore[arg-type]
    return conn, transport


def send(conn: Connection, data: bytes) -> None:
    """Deliver ``data`` as the event loop would: into get_buffer() pieces, buffer_updated each."""
    view = memoryview(data)
    while len(view) and not conn.closing:
        buf = conn.get_buffer(len(view))
        n = min(len(buf), len(view))
        buf[:n] = view[:n]
        conn.buffer_updated(n)
        view = view[n:]
