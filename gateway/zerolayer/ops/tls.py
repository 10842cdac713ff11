"""TLS for the listeners and the client: SSL contexts, SIGHUP certificate reload, peer names.

``ServerTLS`` owns the server side. The listener is created once with ``ServerTLS.context``; its
SNI callback (OpenSSL calls it on every ClientHello, with or without a server name) hands each
new handshake the most recently loaded context. ``reload()`` builds a fresh context from the
same files, so new connections get the new certificate (and client CA) while connections already
open keep the one they were made with: nothing is dropped. A failed reload keeps the old context.

``TlsListener`` is how a TLS port accepts: each connection is accepted here and its handshake
completed (``loop.connect_accepted_socket``) before the door's protocol exists, so a refused
handshake (no or an untrusted client certificate, a TLS version below the floor, plain bytes on
a TLS port) is logged with the peer and OpenSSL's reason, rate-limited per reason. A listener
made by ``create_server(ssl=...)`` drops those connections without a line.

What cannot change live: the protocol floor and whether client certificates are required (both are
fixed per listener when it is created); changing them needs a restart.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from zerolayer.ops.escape import client_text
from zerolayer.ops.logging import LogThrottle

if TYPE_CHECKING:  # the client library uses this module without the daemon's config models
    from zerolayer.config.settings import TLSConfig

log = logging.getLogger("zerolayer.tls")

ALPN_FRAME = "zerolayer/1"  # the frame port
ALPN_HTTP = "http/1.1"  # the HTTP port

_VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}


class TLSConfigError(Exception):
    """A certificate, key or CA file cannot be loaded; the message names the file."""


def _load(cfg: TLSConfig, alpn: list[str]) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = _VERSIONS[cfg.min_version]
    ctx.set_alpn_protocols(alpn)
    try:
        ctx.load_cert_chain(cfg.cert_file, cfg.key_file or None)
    except (OSError, ssl.SSLError) as exc:
        raise TLSConfigError(
            f"tls.cert_file {cfg.cert_file!r} / tls.key_file {cfg.key_file!r}: {exc}"
        ) from exc
    if cfg.client_ca_file:
        try:
            ctx.load_verify_locations(cafile=cfg.client_ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise TLSConfigError(f"tls.client_ca_file {cfg.client_ca_file!r}: {exc}") from exc
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


class ServerTLS:
    """The server-side context of one listener, reloadable (see the module docstring)."""

    def __init__(self, cfg: TLSConfig, alpn: list[str]) -> None:
        self.cfg = cfg
        self.alpn = list(alpn)
        self.current = _load(cfg, self.alpn)
        # The listener's context: the first one loaded, which also hands handshakes on.
        self.context = self.current
        self.context.sni_callback = self._pick
        self.reloads = 0

    def _pick(self, sslobj: Any, _server_name: str | None, _ctx: ssl.SSLContext) -> None:
        if self.current is not self.context:
            sslobj.context = self.current

    def reload(self) -> bool:
        """Re-read the certificate, key and client CA files; returns whether it worked."""
        try:
            fresh = _load(self.cfg, self.alpn)
        except TLSConfigError as exc:
            log.error("TLS reload failed, keeping the loaded certificate: %s", exc)
            return False
        self.current = fresh
        self.reloads += 1
        log.info("reloaded TLS certificate from %s", self.cfg.cert_file)
        return True


_refusals = LogThrottle()  # one line a minute per reason: a client can fail handshakes at will
HANDSHAKE_TIMEOUT_S = 10.0  # a TLS handshake not done by then ends the connection
_ACCEPT_PAUSE_S = 0.1  # after a failed accept (out of descriptors), before the next


class TlsListener:
    """A listening socket whose connections each complete their TLS handshake before
    ``factory``'s protocol gets them (see the module docstring). Has what the doors use of
    an ``asyncio.Server``: ``sockets`` and ``close``."""

    def __init__(
        self,
        sock: socket.socket,
        factory: Callable[[], asyncio.BaseProtocol],
        ctx: ssl.SSLContext,
        door: str,
    ) -> None:
        sock.setblocking(False)
        self.sockets = [sock]
        self._factory = factory
        self._ctx = ctx
        self._door = door  # "frame" or "HTTP": named in the log lines
        self._handshakes: set[asyncio.Task[None]] = set()
        self._accepting = asyncio.get_running_loop().create_task(self._accept(sock))

    async def _accept(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, peer = await loop.sock_accept(sock)
            except OSError as exc:  # EMFILE, ENFILE: out of descriptors; the next may work
                _refusals.warning(
                    log, f"accept:{exc.errno}", "accepting on the %s port failed: %s",
                    self._door, exc,
                )  # fmt: skip
                await asyncio.sleep(_ACCEPT_PAUSE_S)
                continue
            who = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
            task = loop.create_task(self._handshake(loop, conn, who))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    async def _handshake(
        self, loop: asyncio.AbstractEventLoop, conn: socket.socket, who: str
    ) -> None:
        try:
            await loop.connect_accepted_socket(
                self._factory, conn, ssl=self._ctx, ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S
            )
        except (OSError, asyncio.TimeoutError) as exc:  # ssl.SSLError is an OSError
            self._refused(who, exc)
            conn.close()

    def _refused(self, who: str, exc: BaseException) -> None:
        reason = getattr(exc, "reason", None) or type(exc).__name__
        _refusals.warning(
            log, f"handshake:{reason}", "TLS handshake refused on the %s port from %s: %s",
            self._door, who, client_text(str(exc) or reason),
        )  # fmt: skip

    def close(self) -> None:
        """Stop accepting (handshakes under way are abandoned)."""
        self._accepting.cancel()
        for task in list(self._handshakes):
            task.cancel()
        for sock in self.sockets:
            sock.close()


def server_tls(cfg: TLSConfig, alpn: list[str]) -> ServerTLS | None:
    """The listener's TLS, or None when ``tls.cert_file`` is empty (plain TCP)."""
    return ServerTLS(cfg, alpn) if cfg.cert_file else None


def peer_names(transport: Any) -> tuple[str, ...]:
    """The verified client certificate's subject CN and DNS/URI/email SANs; () without one.

    ``peercert`` is only filled for a certificate the handshake verified against the client CA.
    """
    cert = transport.get_extra_info("peercert") if transport is not None else None
    if not cert:
        return ()
    names: list[str] = []
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                names.append(value)
    for kind, value in cert.get("subjectAltName", ()):
        if kind in ("DNS", "URI", "email"):
            names.append(value)
    return tuple(dict.fromkeys(names))


def client_context(
    ca_file: str | None = None,
    cert_file: str | None = None,
    key_file: str | None = None,
    alpn: list[str] | None = None,
) -> ssl.SSLContext:
    """A client context: verifies the server against ``ca_file`` (else the system store) and its
    hostname, presents ``cert_file``/``key_file`` when given (mutual TLS), offers ``alpn``."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert_file:
        ctx.load_cert_chain(cert_file, key_file or None)
    ctx.set_alpn_protocols(alpn if alpn is not None else [ALPN_FRAME])
    return ctx
