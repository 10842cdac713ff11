"""Start-up and shutdown of one daemon process: backend, hooks, engine thread, server, operations.

Order: logging → backend (loads the model, on the engine thread) → registered prompts → hook
chain → engine loop → bind the port → metrics/health HTTP → READY=1 to systemd. SIGTERM/SIGINT
drain (GOAWAY, finish streams in flight up to drain_timeout_s) and exit 0; SIGHUP re-reads the
keys file. With ``server.workers = N`` the parent starts N worker processes sharing the port
through SO_REUSEPORT and forwards signals.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time

import uvloop

from gateway.config import Settings
from gateway.engine.compute import ComputeThread
from gateway.engine.engine import Engine
from gateway.engine.factory import build_backend, build_prefix_store
from gateway.engine.outbox import Outbox
from gateway.hooks import Chain
from gateway.inputs import InputProcessor
from gateway.lifecycle import RequestPath
from gateway.ops.health import start_http_server
from gateway.ops.logging import setup_logging
from gateway.ops.metrics import Metrics
from gateway.ops.neuron_monitor import start_neuron_monitor
from gateway.ops.notify import Notifier
from gateway.ops.sockets import make_listen_socket
from gateway.prompts import PromptRegistry
from gateway.server import Server

log = logging.getLogger("zerolayer")

ENGINE_STALE_S = 10.0  # /healthz fails when the engine thread has not looped for this long


async def _serve(settings: Settings) -> None:
    loop = asyncio.get_running_loop()
    metrics = Metrics()
    # Every torch call of the process runs on this one thread: loading, prompt prefill, then the
    # engine loop (see gateway.engine.compute for why one thread).
    compute = ComputeThread()
    backend, tokenizer = compute.call(build_backend, settings)
    # Validate, tokenize and prefill every registered prompt once, in slot 0, before the engine
    # loop owns the backend; its KV is pinned in the prefix store. An invalid prompt stops
    # start-up, named (PromptConfigError).
    prompts = PromptRegistry.build(
        settings.prompts,
        tokenizer,
        max_prefix_tokens=settings.engine.max_prefix_tokens,
        budget_bytes=settings.engine.prefix_budget_bytes,
    )
    store = build_prefix_store(settings, backend, metrics, registered=len(prompts))
    compute.call(
        lambda: prompts.compile(
            store, chunk=settings.engine.prefill_chunk, backend_name=settings.engine.backend
        )
    )
    chain = Chain.build(settings)
    outbox = Outbox()  # engine thread → event loop
    engine = Engine(
        backend,
        tokenizer,
        outbox.put,
        max_queue=settings.engine.max_queue,
        max_step_tokens=settings.engine.max_step_tokens,
        prefill_chunk=settings.engine.prefill_chunk,
        on_step=metrics.engine_step,
        prefix_store=store,
    )
    inputs = InputProcessor(tokenizer, backend.info, prompts)
    path = RequestPath(engine, inputs, chain, metrics)
    outbox.attach(loop, path.outputs.deliver)
    server = Server(settings.server, path, backend.info, metrics)

    def engine_alive() -> bool:
        return engine.alive and time.monotonic() - engine.last_beat < ENGINE_STALE_S

    engine.start(compute)
    cfg = settings.server
    sock = make_listen_socket(cfg.host, cfg.port, cfg.backlog, cfg.reuse_port)
    await server.start(sock)
    http = None
    if settings.metrics.enabled:
        http = start_http_server(
            settings.metrics.host,
            settings.metrics.port,
            metrics,
            engine_alive,
            lambda: engine_alive() and not server.draining,
            prompts=prompts.describe,
        )
    monitor = start_neuron_monitor(
        settings.metrics.neuron_monitor,
        metrics.registry,
        settings.metrics.neuron_monitor_path,
        settings.metrics.neuron_monitor_config or None,
    )
    notifier = Notifier(alive=engine_alive)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, chain.reload)
    info = backend.info
    # One machine-readable line: tests and scripts wait for it to learn the bound ports. One
    # write() with its newline, so lines of workers sharing the stream never interleave.
    line = (
        f"zerolayer: listening frame={cfg.host}:{server.port} "
        f"metrics={http.host + ':' + str(http.port) if http else 'off'} "
        f"model={info.name} backend={settings.engine.backend} hooks={','.join(chain.names)}\n"
    )
    os.write(sys.stderr.fileno(), line.encode())
    notifier.ready(f"serving {info.name} on {cfg.host}:{server.port}")
    notifier.start_watchdog()
    await stop.wait()
    log.info("signal received, draining")
    notifier.stopping("draining")
    await server.drain()
    await path.aclose()
    outbox.close()  # the engine thread must not wait for a loop that no longer delivers
    await loop.run_in_executor(None, engine.stop)  # joins the engine thread off the loop
    await chain.aclose()
    if monitor is not None:
        monitor.close()
    if http is not None:
        http.close()
    notifier.close()
    log.info("stopped")


def run(settings: Settings, config_path: str | None = None) -> int:
    setup_logging(settings.logging.level, settings.logging.json_lines, settings.logging.requests)
    if settings.server.workers > 1:
        return _run_workers(settings, config_path)
    uvloop.run(_serve(settings))
    return 0


def _run_workers(settings: Settings, config_path: str | None) -> int:
    """Start ``workers`` single-worker daemons on one port (SO_REUSEPORT); forward signals."""
    if settings.server.port == 0:
        log.error("server.workers > 1 needs a fixed server.port (0 would give each its own)")
        return 2
    cmd = [sys.executable, "-m", "gateway.cli", "serve"]
    if config_path:
        cmd += ["--config", config_path]
    procs = []
    for i in range(settings.server.workers):
        env = dict(os.environ)
        env["ZEROLAYER_SERVER__WORKERS"] = "1"
        env["ZEROLAYER_SERVER__REUSE_PORT"] = "true"
        if settings.metrics.port:  # each worker exposes its own metrics on port + index
            env["ZEROLAYER_METRICS__PORT"] = str(settings.metrics.port + i)
        procs.append(subprocess.Popen(cmd, env=env))

    def forward(signum: int, _frame: object) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    # A worker that dies on its own (failed start, crash) takes the others down with it, so the
    # service manager sees the failure and restarts the whole set instead of running short.
    while all(proc.poll() is None for proc in procs):
        time.sleep(0.2)
    failed = [proc for proc in procs if proc.returncode not in (None, 0)]
    if failed:
        log.error(
            "worker %d exited with status %d; stopping the others",
            failed[0].pid,
            failed[0].returncode,
        )
        forward(signal.SIGTERM, None)
    codes = [proc.wait() for proc in procs]
    return max(codes, default=0)
