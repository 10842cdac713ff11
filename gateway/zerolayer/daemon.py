"""Start-up and shutdown of one daemon process: listeners, backend, hooks, engine thread, server.

Order: logging → bind every listener (frame port, the HTTP API port when ``http.enabled``,
metrics/health port) → health answers "503 starting: ..." → backend (loads the model, on the
engine thread) → registered prompts → hook chain → engine loop → accept frames → ready, the
"listening" line, READY=1 to systemd. Binding first means a port in use fails in a second, named
(``StartupError``), not after minutes of loading. SIGTERM/SIGINT drain (GOAWAY, finish streams in
flight up to drain_timeout_s) and exit 0; SIGHUP re-reads the keys file and the TLS certificate
files, and re-reads the config file only to warn about each changed setting (none applies
without a restart). With ``server.workers = N`` the parent starts N worker processes sharing the
port through SO_REUSEPORT and forwards signals.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import uvloop

from zerolayer.cachedir import data_root, sweep
from zerolayer.config.settings import (
    ConfigError,
    EngineConfig,
    Settings,
    changed_keys,
    describe_source,
    load_settings,
    with_values,
)
from zerolayer.engine.backend import ModelInfo
from zerolayer.engine.backends.factory import build_backend, build_prefix_store
from zerolayer.engine.compute import ComputeThread
from zerolayer.engine.engine import Engine
from zerolayer.engine.outbox import Outbox
from zerolayer.engine.step import StepOutput
from zerolayer.frames import wrong_door
from zerolayer.frames.door import Server
from zerolayer.hooks import Chain
from zerolayer.http.door import HttpApi
from zerolayer.http.routes import OpsPages
from zerolayer.http.server import HttpServer
from zerolayer.ops.health import HttpServerHandle, start_http_server
from zerolayer.ops.logging import announce, setup_logging
from zerolayer.ops.metrics import Metrics
from zerolayer.ops.neuron_monitor import start_neuron_monitor
from zerolayer.ops.notify import Notifier
from zerolayer.ops.readiness import Health, StorePing
from zerolayer.ops.sockets import make_listen_socket
from zerolayer.ops.tls import ALPN_FRAME, ALPN_HTTP, ServerTLS, server_tls
from zerolayer.request_path.inputs import InputProcessor, request_body_bound
from zerolayer.request_path.lifecycle import RequestPath
from zerolayer.request_path.prompts import PromptRegistry
from zerolayer.structured import Grammars
from zerolayer.tokenizer import Tokenizer

log = logging.getLogger("zerolayer")

ENGINE_STALE_S = 10.0  # /healthz fails when the engine thread has not looped for this long

T = TypeVar("T")


class StartupError(Exception):
    """A start-up failure the operator can fix; the message names the setting."""


def bind(what: str, setting: str, host: str, port: int, open_: Callable[[], T]) -> T:
    """Run ``open_`` (which binds ``host:port``); an OSError becomes a StartupError naming the
    listener and its setting, e.g. "the frame protocol port 127.0.0.1:7070 (server.port): Address
    already in use"."""
    try:
        return open_()
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise StartupError(f"the {what} port {host}:{port} ({setting}): {reason}") from exc


@dataclass
class Listeners:
    """Every socket the daemon listens on, bound before the model loads."""

    frame: socket.socket
    api: socket.socket | None  # the HTTP front end (docs/http.md)
    http: HttpServerHandle | None  # metrics and health

    def close(self) -> None:
        self.frame.close()
        if self.api is not None:
            self.api.close()
        if self.http is not None:
            self.http.close()


def bind_listeners(settings: Settings, metrics: Metrics, health: Health) -> Listeners:
    cfg, mcfg = settings.server, settings.metrics
    frame = bind(
        "frame protocol",
        "server.port",
        cfg.host,
        cfg.port,
        lambda: make_listen_socket(cfg.host, cfg.port, cfg.backlog, cfg.reuse_port),
    )
    api = None
    try:
        if settings.http.enabled:
            hcfg = settings.http
            api = bind(
                "HTTP API",
                "http.port",
                hcfg.host,
                hcfg.port,
                lambda: make_listen_socket(hcfg.host, hcfg.port, cfg.backlog, cfg.reuse_port),
            )
        http = None
        if mcfg.enabled:
            http = bind(
                "metrics and health HTTP",
                "metrics.port",
                mcfg.host,
                mcfg.port,
                lambda: start_http_server(mcfg.host, mcfg.port, metrics, health),
            )
    except BaseException:
        frame.close()
        if api is not None:
            api.close()
        raise
    return Listeners(frame, api, http)


def required_stores(settings: Settings) -> list[StorePing]:
    """A PING per store requests cannot do without: the Redis rate-limit store (it fails
    closed). The Redis response cache is not required: its errors count as misses."""
    rl = settings.ratelimit
    if not (rl.enabled and rl.store == "redis"):
        return []
    from zerolayer.hooks.redis_scripts import sync_client

    client = sync_client(rl.redis_url)
    return [StorePing(f"ratelimit.redis_url {rl.redis_url}", client.ping)]


def _wrong_door(
    first: bytes, *, max_frame_bytes: int, http_port: int | None, metrics_port: int | None
) -> bytes | None:
    reply = wrong_door.answer(
        first, max_frame_bytes=max_frame_bytes, http_port=http_port, metrics_port=metrics_port
    )
    if reply is not None:
        # TLS has no room for a sentence: the operator reads it here.
        log.info(
            "frame port: a %s client knocked; answered in kind and closed (the frame port "
            "speaks the binary frame protocol)",
            wrong_door.sniff(first),
        )
    return reply


def _on_sighup(
    chain: Chain, tls: list[ServerTLS], running: list[Settings], config_path: str | None
) -> None:
    """Re-read the keys file, the certificates and the config file; apply what can change live
    (the log level here; the hooks apply theirs, e.g. the rate-limit defaults) and name every
    other change as needing a restart. ``running[0]`` is what is in effect."""
    chain.reload()
    for listener_tls in tls:
        listener_tls.reload()  # the same files, re-read: new connections get the new certificate
    try:
        current = load_settings(config_path)
    except ConfigError as exc:
        log.error("SIGHUP: the configuration no longer loads, keeping the running one: %s", exc)
        return
    changes = changed_keys(running[0], current)
    applied = chain.apply_settings(current) & changes.keys()
    if "logging.level" in changes:
        logging.getLogger().setLevel(current.logging.level.upper())
        applied.add("logging.level")
    for key, change in changes.items():
        if key in applied:
            log.warning("SIGHUP: %s applied", change)
        else:
            log.warning(
                "SIGHUP: %s changed but is read only at start-up; restart to apply it", change
            )
    running[0] = with_values(running[0], current, applied)


async def _serve(settings: Settings, config_path: str | None = None) -> None:
    loop = asyncio.get_running_loop()
    metrics = Metrics()
    health = Health()
    health.starting("binding ports")
    listeners = bind_listeners(settings, metrics, health)
    try:
        # Certificates load before the model, so a bad file fails the start at once (named).
        tls = server_tls(settings.tls, [ALPN_FRAME])
        api_tls = server_tls(settings.tls, [ALPN_HTTP]) if listeners.api is not None else None
        await _start_and_serve(
            settings, config_path, loop, metrics, health, listeners, tls, api_tls
        )
    finally:
        listeners.close()


class StepSink:
    """The engine's ``deliver``, on the engine thread after every step: sets the occupancy
    gauges (exact then: admissions and endings are in; set only when they change, since a
    Gauge.set takes a lock and a steady decode step changes nothing), then hands the step to
    the outbox."""

    def __init__(self, outbox: Outbox, metrics: Metrics, slots: int) -> None:
        self.outbox = outbox
        self.metrics = metrics
        self.slots = slots
        self.engine: Engine | None = None  # set once the engine is built
        self._shown = (-1, -1, -1)
        self._classes_shown = -1
        self._kv_shown = (-1.0, 0, 0)  # pages used, preemptions, admission waits

    def __call__(self, step: StepOutput) -> None:
        engine = self.engine
        assert engine is not None
        now = (engine.running, engine.waiting, engine.slots_used)
        if now != self._shown:
            self._shown = now
            self.metrics.set_queue(*now, self.slots)
        if engine.class_version != self._classes_shown:
            self._classes_shown = engine.class_version
            self.metrics.set_classes(engine.class_rows, engine.class_preempted)
        kv = (engine.kv_pages_used, engine.kv_preemptions, engine.kv_admission_waits)
        if kv != self._kv_shown:
            shown, self._kv_shown = self._kv_shown, kv
            self.metrics.kv_pages(kv[0], kv[1] - shown[1], kv[2] - shown[2])
        self.outbox.put(step)


@dataclass
class Parts:
    """What one daemon runs, built by ``_build`` before anything is served."""

    compute: ComputeThread
    info: ModelInfo
    prompts: PromptRegistry
    chain: Chain
    outbox: Outbox
    engine: Engine
    path: RequestPath
    server: Server
    api_server: HttpServer | None
    stores: list[StorePing]


def _grammars(tokenizer: Tokenizer, info: ModelInfo, ecfg: EngineConfig) -> Grammars | None:
    """Structured output's compiler for the model's tokenizer.json (None when it has none, or
    llguidance is missing: constrained requests are then refused naming the field)."""
    if tokenizer.json_path is None:
        return None
    try:
        return Grammars(
            tokenizer.json_path,
            tokenizer.eos_token_id,
            info.vocab_size,
            timeout_s=ecfg.grammar_timeout_s,
            cache_size=ecfg.grammar_cache,
            max_bytes=ecfg.grammar_max_bytes,
        )
    except ImportError:
        log.warning("llguidance is not importable: structured output is refused")
        return None


def _build(settings: Settings, metrics: Metrics, health: Health, listeners: Listeners) -> Parts:
    """Load the model, compile the registered prompts, build hooks, engine, path and doors."""
    health.starting("loading model")
    # What an interrupted write of a cache directory left (a kill -9 mid-conversion or build):
    # removed before anything is written, a concurrent start's directory being written kept.
    cache = data_root(settings.model.data_dir)
    swept = sweep(cache)
    if swept:
        log.info("removed %d unfinished cache director%s under %s", swept,
                 "y" if swept == 1 else "ies", cache)  # fmt: skip
    if settings.engine.backend != "synthetic":  # a model's daemon (the import brings torch)
        from zerolayer.models.gguf_import import remove_served

        for old in remove_served(settings.model.data_dir):  # earlier versions' float32 models
            log.info("removed %s, a conversion no daemon reads any more", old)
    # Every torch call of the process runs on this one thread: loading, prompt prefill, then the
    # engine loop (see zerolayer.engine.compute for why one thread).
    compute = ComputeThread()
    backend, tokenizer = compute.call(build_backend, settings)
    # Validate, tokenize and prefill every registered prompt once, in slot 0, before the engine
    # loop owns the backend; its KV is pinned in the prefix store. An invalid prompt stops
    # start-up, named (PromptConfigError).
    health.starting("compiling prompts")
    ecfg = settings.engine
    prompts = PromptRegistry.build(
        settings.prompts,
        tokenizer,
        max_prefix_tokens=ecfg.max_prefix_tokens,
        budget_bytes=ecfg.prefix_budget_bytes,
    )
    store = build_prefix_store(settings, backend, metrics, registered=len(prompts))
    compute.call(
        lambda: prompts.compile(store, chunk=ecfg.prefill_chunk, backend_name=ecfg.backend)
    )
    health.starting("starting hooks")
    chain = Chain.build(settings)
    outbox = Outbox()  # engine thread → event loop
    sink = StepSink(outbox, metrics, backend.num_slots)
    engine = Engine(
        backend,
        tokenizer,
        sink,
        max_queue=ecfg.max_queue,
        max_step_tokens=ecfg.max_step_tokens,
        prefill_chunk=ecfg.prefill_chunk,
        on_step=metrics.engine_step,
        prefix_store=store,
        row_share=ecfg.row_share,
        mask_budget_s=ecfg.grammar_mask_budget_ms / 1000,
    )
    sink.engine = engine
    # n choices hold n slots at once: at most the slots there are.
    inputs = InputProcessor(tokenizer, backend.info, prompts, min(ecfg.max_n, backend.num_slots))
    path = RequestPath(
        engine, inputs, chain, metrics, grammars=_grammars(tokenizer, backend.info, ecfg)
    )
    server = Server(settings.server, path, backend.info, metrics)
    api_server = None  # the HTTP front end: another door onto the same request path
    if listeners.api is not None:
        api_server = HttpServer(
            settings.http,
            HttpApi(
                path, backend.info, OpsPages(health, metrics, settings.http.cors_origins)
            ).connection,
            settings.server.write_buffer_limit_bytes,
            metrics,
            request_body_bound(backend.info.max_context),
        )
        api_server.socket_options = settings.server
    server.wrong_door = functools.partial(
        _wrong_door,
        max_frame_bytes=settings.server.max_frame_bytes,
        http_port=listeners.api.getsockname()[1] if listeners.api is not None else None,
        metrics_port=listeners.http.port if listeners.http else None,
    )
    stores = required_stores(settings)
    return Parts(
        compute, backend.info, prompts, chain, outbox, engine, path, server, api_server, stores
    )


def _watch(parts: Parts, health: Health) -> Callable[[], bool]:
    """Liveness and readiness checks; returns the engine's liveness test."""
    engine = parts.engine

    def engine_alive() -> bool:
        return engine.alive and time.monotonic() - engine.last_beat < ENGINE_STALE_S

    health.add_liveness(lambda: None if engine_alive() else "engine not stepping")
    health.add_readiness(lambda: "draining" if parts.path.draining else None)
    for store in parts.stores:
        health.add_readiness(store.check)
        store.start()
    return engine_alive


async def _open_doors(
    parts: Parts,
    loop: asyncio.AbstractEventLoop,
    listeners: Listeners,
    tls: ServerTLS | None,
    api_tls: ServerTLS | None,
) -> None:
    """Start the engine loop and its delivery, then accept on every door."""
    parts.outbox.attach(loop, parts.path.deliver)
    parts.engine.start(parts.compute)
    await parts.server.start(listeners.frame, ssl=tls.context if tls else None)
    if parts.api_server is not None:
        await parts.api_server.start(listeners.api, ssl=api_tls.context if api_tls else None)
    if listeners.http is not None:
        listeners.http.prompts = parts.prompts.describe


def _announce(settings: Settings, parts: Parts, listeners: Listeners, tls: object) -> None:
    """One machine-readable line, whatever the log level: tests and scripts wait for it to learn
    the bound ports (plain: "zerolayer: listening frame=H:P metrics=H:P ...", or JSON)."""
    http, api_server = listeners.http, parts.api_server
    announce(
        "zerolayer",
        "listening",
        frame=f"{settings.server.host}:{parts.server.port}",
        http=f"{settings.http.host}:{api_server.port}" if api_server else "off",
        metrics=f"{http.host}:{http.port}" if http else "off",
        model=parts.info.name,
        backend=settings.engine.backend,
        hooks=",".join(parts.chain.names),
        tls="on" if tls else "off",
    )


async def _shutdown(parts: Parts, settings: Settings, loop: asyncio.AbstractEventLoop) -> None:
    """Drain every door (the request path refuses new requests first), then stop the hooks'
    tasks, the outbox, the engine thread and the stores."""
    parts.path.start_draining()
    drains = [parts.server.drain()]
    if parts.api_server is not None:
        drains.append(parts.api_server.drain(settings.server.drain_timeout_s))
    await asyncio.gather(*drains)
    await parts.path.aclose()
    parts.outbox.close()  # the engine thread must not wait for a loop that no longer delivers
    await loop.run_in_executor(None, parts.engine.stop)  # joins the engine thread off the loop
    await parts.chain.aclose()
    for store in parts.stores:
        store.close()


async def _start_and_serve(
    settings: Settings,
    config_path: str | None,
    loop: asyncio.AbstractEventLoop,
    metrics: Metrics,
    health: Health,
    listeners: Listeners,
    tls: ServerTLS | None,
    api_tls: ServerTLS | None = None,
) -> None:
    parts = _build(settings, metrics, health, listeners)
    engine_alive = _watch(parts, health)
    await _open_doors(parts, loop, listeners, tls, api_tls)
    mcfg = settings.metrics
    monitor = start_neuron_monitor(
        mcfg.neuron_monitor,
        metrics.registry,
        mcfg.neuron_monitor_path,
        mcfg.neuron_monitor_config or None,
    )
    notifier = Notifier(alive=engine_alive)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    reloadable = [t for t in (tls, api_tls) if t is not None]
    loop.add_signal_handler(
        signal.SIGHUP, _on_sighup, parts.chain, reloadable, [settings], config_path
    )
    health.serving()
    _announce(settings, parts, listeners, tls)
    # Everything built so far lives as long as the process: keep the cyclic garbage collector
    # from scanning it again and again while tokens stream.
    gc.collect()
    gc.freeze()
    notifier.ready(f"serving {parts.info.name} on {settings.server.host}:{parts.server.port}")
    notifier.start_watchdog()
    await stop.wait()
    log.info("signal received, draining")
    notifier.stopping("draining")
    await _shutdown(parts, settings, loop)
    if monitor is not None:
        monitor.close()
    notifier.close()
    log.info("stopped")


def _raise_fd_limit(max_connections: int) -> None:
    """Raise the soft open-file limit to the hard one (each connection is a descriptor)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    if max_connections + 64 > soft:
        log.warning(
            "server.max_connections is %d but the open-file limit is %d: connections beyond "
            "it will fail (raise LimitNOFILE / ulimit -n)",
            max_connections,
            soft,
        )


def run(settings: Settings, config_path: str | None = None) -> int:
    setup_logging(settings.logging.level, settings.logging.json_lines, settings.logging.requests)
    _raise_fd_limit(settings.server.max_connections)
    if settings.server.workers > 1:
        return _run_workers(settings, config_path)
    log.info("configuration: %s", describe_source(config_path))
    uvloop.run(_serve(settings, config_path))
    return 0


def _run_workers(settings: Settings, config_path: str | None) -> int:
    """Start ``workers`` single-worker daemons on one port (SO_REUSEPORT); forward signals."""
    if settings.server.port == 0:
        log.error("server.workers > 1 needs a fixed server.port (0 would give each its own)")
        return 2
    cmd = [sys.executable, "-m", "zerolayer.cli.main", "serve"]
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
