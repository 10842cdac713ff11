"""Where a bench run sends its load: parsing ``--endpoint`` into a target address and protocol.

``tcp://H:P`` speaks the frame protocol; ``http://H:P[/prefix]`` and ``https://`` speak one of the
HTTP APIs chosen by ``--protocol``. ``tls://H:P`` is frames over TLS and ``https://`` the APIs
over TLS: the runner builds the client context from ``--tls-ca`` / ``--tls-cert`` / ``--tls-key``.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlparse

FRAME_SCHEMES = ("tcp", "tls")
HTTP_SCHEMES = ("http", "https")
HTTP_PROTOCOLS = ("openai-chat", "openai-completions", "anthropic")
DEFAULT_PATHS = {
    "openai-chat": "/v1/chat/completions",
    "openai-completions": "/v1/completions",
    "anthropic": "/v1/messages",
}


class EndpointError(ValueError):
    """An endpoint or protocol a bench run cannot use; the message names what was expected."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    scheme: str  # tcp | tls | http | https
    host: str
    port: int
    protocol: str  # "frames" or one of HTTP_PROTOCOLS
    path: str = ""  # HTTP: the request path (prefix + the protocol's default path)

    @property
    def is_http(self) -> bool:
        return self.scheme in HTTP_SCHEMES

    @property
    def tls(self) -> bool:
        return self.scheme in ("tls", "https")

    def __str__(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}{self.path}"


def parse_endpoint(text: str, protocol: str | None = None) -> Endpoint:
    """``text`` as an Endpoint; ``protocol`` is required for http(s) and refused for frames."""
    url = urlparse(text if "://" in text else f"tcp://{text}")
    scheme = url.scheme.lower()
    if scheme not in FRAME_SCHEMES + HTTP_SCHEMES:
        raise EndpointError(
            f"--endpoint must be tcp://HOST:PORT, tls://HOST:PORT or http(s)://HOST:PORT, "
            f"got {text!r}"
        )
    try:
        port = url.port
    except ValueError:
        port = None
    default_port = {"http": 80, "https": 443}.get(scheme)
    port = port or default_port
    if not url.hostname or not port:
        raise EndpointError(f"--endpoint {text!r} needs a host and a port")
    if scheme in FRAME_SCHEMES:
        if protocol not in (None, "frames"):
            raise EndpointError(
                f"--protocol {protocol} is for http:// endpoints; {scheme}:// speaks frames"
            )
        return Endpoint(scheme, url.hostname, port, "frames")
    if protocol not in HTTP_PROTOCOLS:
        raise EndpointError(
            f"an http endpoint needs --protocol {' | '.join(HTTP_PROTOCOLS)}, got {protocol!r}"
        )
    prefix = url.path.rstrip("/")
    if prefix.endswith("/v1"):  # base URLs are often given as http://host:port/v1
        prefix = prefix[:-3]
    return Endpoint(scheme, url.hostname, port, protocol, prefix + DEFAULT_PATHS[protocol])
