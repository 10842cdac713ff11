"""The API keys file and the ``zerolayer keys`` command (add, list, revoke).

The file is TOML and holds, per key, only its SHA-256 digest with a name, optional limits and a
creation time; the key itself is printed once by ``keys add`` and never stored::

    [[keys]]
    name = "alice"
    sha256 = "9f86d081884c7d65..."
    rpm = 60
    tpm = 100000
    created = "2026-05-09T07:35:25Z"
    cert_names = ["alice.clients.example"]  # optional: mTLS client certificates that stand for it
    weight = 3          # optional (1..1000, default 1): its part in the share of the engine's rows
    class = "premium"   # optional (default "default"): the label its rows have in the metrics

Writes are atomic (temp file + rename, mode 0600), so a daemon reloading on SIGHUP never reads a
half-written file.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import secrets
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

KEY_PREFIX = "zl_"
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")
_FIELDS = {"name", "sha256", "rpm", "tpm", "created", "cert_names", "weight", "class"}
MAX_WEIGHT = 1000
_CERT_NAME_RE = re.compile(r"[\x21-\x7e]{1,255}")  # printable ASCII, no spaces or quotes


class KeysFileError(Exception):
    """The keys file is missing or invalid; the message names the file and the entry."""


@dataclass(frozen=True, slots=True)
class KeyEntry:
    name: str
    sha256: str  # hex digest of the key's UTF-8 bytes
    rpm: int | None = None
    tpm: int | None = None
    created: str = ""
    # Subject CNs / SANs of verified client certificates that authenticate as this key (mTLS).
    cert_names: tuple[str, ...] = ()
    # Its part in the share of the engine's rows (zerolayer.engine.admission), and the class its
    # rows are counted under in the metrics (a label: never the key's own name).
    weight: int = 1
    principal_class: str = "default"


def _weight(value: object, what: str) -> int:
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_WEIGHT:
        raise KeysFileError(f"{what} must be an integer in 1..{MAX_WEIGHT}, got {value!r}")
    return value


def _class(value: object, what: str) -> str:
    if value is None:
        return "default"
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
        raise KeysFileError(f"{what} must be 1-64 letters, digits, '_', '.', '-', got {value!r}")
    return value


def new_key() -> str:
    """A fresh key: a recognisable prefix and 256 random bits, URL-safe."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_digest(key: str | bytes) -> str:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).hexdigest()


def _limit(value: object, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise KeysFileError(f"{what} must be a positive integer, got {value!r}")
    return value


def _cert_names(value: object, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(
        isinstance(v, str) and _CERT_NAME_RE.fullmatch(v) and '"' not in v and "\\" not in v
        for v in value
    ):
        raise KeysFileError(f"{what} must be a list of certificate names (printable ASCII)")
    return tuple(value)


def load_keys(path: str | Path) -> list[KeyEntry]:
    """Read and validate the keys file. Raises KeysFileError naming the problem."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError as exc:
        raise KeysFileError(
            f"keys file {path} not found (create a key with `zerolayer keys add NAME`)"
        ) from exc
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise KeysFileError(f"keys file {path} cannot be read: {exc}") from exc
    extra = set(data) - {"keys"}
    if extra:
        raise KeysFileError(f"keys file {path}: unknown top-level keys {sorted(extra)}")
    raw = data.get("keys", [])
    if not isinstance(raw, list):
        raise KeysFileError(f"keys file {path}: `keys` must be an array of tables ([[keys]])")
    entries: list[KeyEntry] = []
    names: set[str] = set()
    digests: set[str] = set()
    cert_owner: dict[str, str] = {}
    for i, item in enumerate(raw):
        where = f"keys file {path}, entry {i + 1}"
        if not isinstance(item, dict):
            raise KeysFileError(f"{where}: not a table")
        unknown = set(item) - _FIELDS
        if unknown:
            raise KeysFileError(f"{where}: unknown fields {sorted(unknown)}")
        name, digest = item.get("name"), item.get("sha256")
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            raise KeysFileError(f"{where}: invalid name {name!r}")
        where = f"keys file {path}, key {name!r}"
        if not isinstance(digest, str) or not _DIGEST_RE.fullmatch(digest):
            raise KeysFileError(f"{where}: sha256 must be 64 lowercase hex digits")
        if name in names:
            raise KeysFileError(f"{where}: duplicate name")
        if digest in digests:
            raise KeysFileError(f"{where}: duplicate sha256")
        names.add(name)
        digests.add(digest)
        certs = _cert_names(item.get("cert_names"), f"{where}: cert_names")
        for cn in certs:
            if cn in cert_owner:
                raise KeysFileError(
                    f"{where}: cert name {cn!r} already belongs to {cert_owner[cn]!r}"
                )
            cert_owner[cn] = name
        created = item.get("created", "")
        if isinstance(created, datetime):
            created = created.isoformat()
        entries.append(
            KeyEntry(
                name,
                digest,
                _limit(item.get("rpm"), f"{where}: rpm"),
                _limit(item.get("tpm"), f"{where}: tpm"),
                str(created),
                certs,
                _weight(item.get("weight"), f"{where}: weight"),
                _class(item.get("class"), f"{where}: class"),
            )
        )
    return entries


def save_keys(path: str | Path, entries: list[KeyEntry]) -> None:
    """Write the file atomically with mode 0600. Names and digests are validated on the way in,
    so every value written is a plain TOML string or integer."""
    path = Path(path)
    lines = ["# ZeroLayer API keys, managed by `zerolayer keys`. Only SHA-256 digests are stored."]
    for e in entries:
        if not NAME_RE.fullmatch(e.name) or not _DIGEST_RE.fullmatch(e.sha256):
            raise KeysFileError(f"refusing to write invalid entry {e.name!r}")
        lines += ["", "[[keys]]", f'name = "{e.name}"', f'sha256 = "{e.sha256}"']
        if e.rpm is not None:
            lines.append(f"rpm = {int(e.rpm)}")
        if e.tpm is not None:
            lines.append(f"tpm = {int(e.tpm)}")
        if e.created:
            lines.append(f'created = "{e.created}"')
        if e.cert_names:
            _cert_names(list(e.cert_names), f"key {e.name!r}: cert_names")
            lines.append("cert_names = [" + ", ".join(f'"{c}"' for c in e.cert_names) + "]")
        if e.weight != 1:
            lines.append(f"weight = {_weight(e.weight, f'key {e.name!r}: weight')}")
        if e.principal_class != "default":
            lines.append(f'class = "{_class(e.principal_class, f"key {e.name!r}: class")}"')
    text = "\n".join(lines) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".keys-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def add_key(
    path: str | Path,
    name: str,
    rpm: int | None = None,
    tpm: int | None = None,
    cert_names: tuple[str, ...] = (),
    weight: int = 1,
    principal_class: str = "default",
) -> str:
    """Create a key named ``name`` in the file (created if missing); returns the key itself."""
    if not NAME_RE.fullmatch(name):
        raise KeysFileError(
            f"invalid key name {name!r}: 1-64 characters of letters, digits, '_', '.', '-'"
        )
    _limit(rpm, "rpm")
    _limit(tpm, "tpm")
    _cert_names(list(cert_names), "cert names")
    _weight(weight, "weight")
    _class(principal_class, "class")
    entries = load_keys(path) if Path(path).exists() else []
    if any(e.name == name for e in entries):
        raise KeysFileError(f"a key named {name!r} already exists in {path}; revoke it first")
    for e in entries:
        taken = set(e.cert_names) & set(cert_names)
        if taken:
            raise KeysFileError(f"cert name {sorted(taken)[0]!r} already belongs to {e.name!r}")
    key = new_key()
    created = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    entries.append(
        KeyEntry(
            name, key_digest(key), rpm, tpm, created, tuple(cert_names), weight, principal_class
        )
    )
    save_keys(path, entries)
    return key


def revoke_key(path: str | Path, name: str) -> None:
    entries = load_keys(path)
    kept = [e for e in entries if e.name != name]
    if len(kept) == len(entries):
        raise KeysFileError(f"no key named {name!r} in {path}")
    save_keys(path, kept)


# ---- CLI ---------------------------------------------------------------------------------------


def _keys_path(args: argparse.Namespace) -> str:
    if args.keys_file:
        return str(args.keys_file)
    from zerolayer.config.settings import load_settings

    return load_settings(getattr(args, "config", None)).auth.keys_file


def _run(args: argparse.Namespace, action: Callable[[str], int]) -> int:
    try:
        return action(_keys_path(args))
    except KeysFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # ConfigError from load_settings, OSError from the file system
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _cmd_add(args: argparse.Namespace) -> int:
    def action(path: str) -> int:
        key = add_key(
            path, args.name, args.rpm, args.tpm, tuple(args.cert_name), args.weight, args.klass
        )
        print(key)
        print(
            f"added key {args.name!r} to {path}; it is shown only this once. "
            "Send SIGHUP to a running daemon to load it.",
            file=sys.stderr,
        )
        return 0

    return _run(args, action)


def _cmd_list(args: argparse.Namespace) -> int:
    def action(path: str) -> int:
        entries = load_keys(path)
        print(f"{'NAME':<24} {'SHA256':<14} {'RPM':>8} {'TPM':>10}  {'CREATED':<20}  CERT NAMES")
        for e in entries:
            rpm = "-" if e.rpm is None else str(e.rpm)
            tpm = "-" if e.tpm is None else str(e.tpm)
            certs = ",".join(e.cert_names) or "-"
            print(
                f"{e.name:<24} {e.sha256[:12] + '..':<14} {rpm:>8} {tpm:>10}  "
                f"{e.created:<20}  {certs}"
            )
        return 0

    return _run(args, action)


def _cmd_revoke(args: argparse.Namespace) -> int:
    def action(path: str) -> int:
        revoke_key(path, args.name)
        print(
            f"revoked key {args.name!r} in {path}. Send SIGHUP to a running daemon to apply it.",
            file=sys.stderr,
        )
        return 0

    return _run(args, action)


def positive_int(text: str) -> int:
    """argparse type for counts and limits (shared with the zerolayer command)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_keys_subparser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``keys add|list|revoke`` to the CLI; each handler is ``args.func(args) -> exit code``."""
    keys = subparsers.add_parser("keys", help="manage API keys (auth.keys_file)")
    sub = keys.add_subparsers(dest="keys_command", metavar="{add,list,revoke}", required=True)

    def with_file(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument(
            "--keys-file", default=None, help="keys file (default: auth.keys_file of the config)"
        )
        p.add_argument("--config", default=None, help="daemon config whose auth.keys_file to use")
        return p

    add = with_file(sub.add_parser("add", help="create a key, print it once, store its digest"))
    add.add_argument("name", help="the key's name (unique)")
    add.add_argument("--rpm", type=positive_int, default=None, help="requests per minute")
    add.add_argument("--tpm", type=positive_int, default=None, help="tokens per minute")
    add.add_argument(
        "--cert-name",
        action="append",
        default=[],
        help="a client certificate subject CN or SAN that authenticates as this key (mTLS); repeat",
    )
    add.add_argument(
        "--weight",
        type=positive_int,
        default=1,
        help=f"its part in the share of the engine's rows (1..{MAX_WEIGHT}, default 1)",
    )
    add.add_argument(
        "--class",
        dest="klass",
        default="default",
        help="the label its rows are counted under in the metrics (default: default)",
    )
    add.set_defaults(func=_cmd_add)

    lst = with_file(sub.add_parser("list", help="list keys (names, digest prefixes, limits)"))
    lst.set_defaults(func=_cmd_list)

    rev = with_file(sub.add_parser("revoke", help="remove a key"))
    rev.add_argument("name", help="the name of the key to remove")
    rev.set_defaults(func=_cmd_revoke)
