"""TLS for the listeners and the client: SSL contexts, SIGHUP certificate reload, peer names.

``ServerTLS`` owns the server side. The listener is created once with ``ServerTLS.context``; its
SNI callback (OpenSSL calls it on every ClientHello, with or without a server name) hands each
new handshake the most recently loaded context. ``reload()`` builds a fresh context from the
same files, so new connections get the new certificate (and client CA) while connections already
open keep the one they were made with: nothing is dropped. A failed reload keeps the old context.

What cannot change live: the protocol floor and whether client certificates are required (both are
fixed per listener when it is created); changing them needs a restart.
"""

from __future__ import annotations

import logging
import ssl
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the client library uses this module without the daemon's config models
    from gateway.config import TLSConfig

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
