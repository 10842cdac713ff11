"""Built-in hook: API-key authentication against the keys file (see keys.py).

HELLO's key is hashed once and compared, in constant time, with every stored digest (no early
exit, so the time depends only on how many keys exist). Per request, the principal is re-checked
against the live table with one dict lookup: after a SIGHUP reload a revoked key stops working
and changed limits apply, on connections that are already open.

Keys given on the command line (``auth.api_keys``) are added to the file's, as ``api-key-N``.

A verified mTLS client certificate stands for the key whose ``cert_names`` list its subject CN or a
SAN (``on_certificate``); such a client needs no key in HELLO and is rate-limited as that key.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from pathlib import Path
from typing import Any

from zerolayer.hooks.keys import KeyEntry, KeysFileError, key_digest, load_keys
from zerolayer.hooks.registry import hook
from zerolayer.hooks.types import UNAUTHENTICATED, HookConfigError, HookError, Principal

log = logging.getLogger("zerolayer.hooks.auth")


def command_line_keys(auth: Any) -> list[KeyEntry]:
    """``auth.api_keys`` (``zerolayer serve --api-key``) as entries ``api-key-1``, ... with the
    default rate limits."""
    keys = getattr(auth, "api_keys", None) or ()
    return [KeyEntry(f"api-key-{i}", key_digest(k)) for i, k in enumerate(keys, 1)]


@hook
class Auth:
    """Active when ``auth.enabled``."""

    def __init__(self, settings: Any) -> None:
        auth = getattr(settings, "auth", None)
        self.enabled = bool(auth is not None and auth.enabled)
        self._entries: tuple[tuple[bytes, Principal], ...] = ()
        self._by_id: dict[str, Principal] = {}
        self._by_cert: dict[str, Principal] = {}
        if auth is None or not self.enabled:
            return
        self.path = Path(auth.keys_file)
        self._extra = command_line_keys(auth)
        try:
            entries = self._load()
        except KeysFileError as exc:
            raise HookConfigError(f"auth.keys_file: {exc}") from exc
        if not entries:
            log.warning("auth is on but %s holds no keys: every client will be refused", self.path)
        self._install(entries)

    def _load(self) -> list[KeyEntry]:
        """The keys file's entries and ``auth.api_keys``; without the file, only the latter."""
        if self._extra and not self.path.exists():
            return list(self._extra)
        return load_keys(self.path) + self._extra

    def _install(self, entries: list[KeyEntry]) -> None:
        table = tuple(
            (
                bytes.fromhex(e.sha256),
                Principal(e.name, e.rpm, e.tpm, e.sha256, e.weight, e.principal_class),
            )
            for e in entries
        )
        # One assignment each: the event loop never sees a half-built table.
        self._by_id = {p.key_id: p for _, p in table}
        self._by_cert = {
            cn: principal
            for e, (_, principal) in zip(entries, table, strict=True)
            for cn in e.cert_names
        }
        self._entries = table

    def on_hello(self, key: bytes) -> Principal | None:
        if not key:
            return None
        digest = hashlib.sha256(key).digest()
        found = None
        for stored, principal in self._entries:
            if hmac.compare_digest(digest, stored):
                found = principal
        return found

    def on_certificate(self, names: tuple[str, ...]) -> Principal | None:
        for name in names:
            principal = self._by_cert.get(name)
            if principal is not None:
                return principal
        return None

    def on_request(self, ctx: Any) -> None:
        key_id = ctx.principal.key_id
        if key_id:
            current = self._by_id.get(key_id)
            if current is None:
                raise HookError(UNAUTHENTICATED, f"API key {ctx.principal.name!r} was revoked")
            ctx.principal = current

    def reload(self) -> None:
        try:
            entries = self._load()
        except KeysFileError as exc:
            log.error("keys reload failed, keeping the %d loaded keys: %s", len(self._entries), exc)
            return
        self._install(entries)
        log.info("reloaded %d keys from %s", len(entries), self.path)
