"""Start-up and shutdown of one daemon process: backend, engine thread, server, signals.

Order: build the backend (loads the model), start the engine thread, bind the port, then report
ready. SIGTERM/SIGINT drain (GOAWAY, finish streams in flight up to drain_timeout_s) and exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

import uvloop

from gateway.config import Settings
from gateway.engine.engine import Engine
from gateway.engine.factory import build_backend
from gateway.server import Server

log = logging.getLogger("zerolayer")


async def _serve(settings: Settings) -> None:
    backend, tokenizer = build_backend(settings)
    loop = asyncio.get_running_loop()
    server_ref: list[Server] = []
    engine = Engine(
        backend,
        tokenizer,
        lambda outputs: server_ref[0].deliver_threadsafe(outputs),
        max_queue=settings.engine.max_queue,
        max_step_tokens=settings.engine.max_step_tokens,
        prefill_chunk=settings.engine.prefill_chunk,
    )
    server = Server(settings, engine, tokenizer)
    server_ref.append(server)
    engine.start()
    await server.start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    info = backend.info
    # One machine-readable line: tests and scripts wait for it to learn the bound port.
    print(
        f"zerolayer: listening frame={settings.server.host}:{server.port} "
        f"model={info.name} backend={settings.engine.backend}",
        file=sys.stderr,
        flush=True,
    )
    await stop.wait()
    log.info("signal received, draining")
    await server.drain()
    engine.stop()
    log.info("stopped")


def run(settings: Settings) -> int:
    logging.basicConfig(
        level=settings.logging.level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    uvloop.run(_serve(settings))
    return 0
