"""API keys: the keys file, the `keys` CLI, HELLO authentication, revocation and SIGHUP reload."""

from __future__ import annotations

import argparse
import os
import stat
from types import SimpleNamespace

import numpy as np
import pytest

from zerolayer.config.hooks import CacheConfig, RateLimitConfig
from zerolayer.config.settings import AuthConfig
from zerolayer.hooks import (
    UNAUTHENTICATED,
    Chain,
    HookConfigError,
    HookError,
    Principal,
    RequestContext,
)
from zerolayer.hooks.keys import (
    KEY_PREFIX,
    KeysFileError,
    add_key,
    add_keys_subparser,
    key_digest,
    load_keys,
    revoke_key,
)
from zerolayer.sampling_params import SamplingParams


def cli(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="zerolayer")
    add_keys_subparser(parser.add_subparsers(dest="command"))
    return parser.parse_args(list(argv))


def run(*argv: str) -> int:
    args = cli(*argv)
    return args.func(args)


def auth_chain(keys_file, **ratelimit) -> Chain:
    return Chain.build(
        SimpleNamespace(
            auth=AuthConfig(enabled=True, keys_file=str(keys_file)),
            ratelimit=RateLimitConfig(**ratelimit),
            cache=CacheConfig(enabled=False),
        )
    )


def make_ctx(principal: Principal, max_tokens: int = 8) -> RequestContext:
    return RequestContext(
        principal, "m", np.arange(4, dtype=np.int32), 0, max_tokens, SamplingParams(), (), (),
        False, {},
    )  # fmt: skip


def test_cli_add_list_revoke_round_trip(tmp_path, capsys):
    keys_file = tmp_path / "keys.toml"
    assert (
        run("keys", "add", "alice", "--rpm", "60", "--tpm", "1000", "--keys-file", str(keys_file))
        == 0
    )
    out, err = capsys.readouterr()
    key = out.strip()
    assert key.startswith(KEY_PREFIX) and len(key) > 40 and "shown only this once" in err
    assert run("keys", "add", "bob", "--keys-file", str(keys_file)) == 0
    bob_key = capsys.readouterr().out.strip()
    assert bob_key != key

    text = keys_file.read_text()
    assert key not in text and bob_key not in text  # only digests are stored
    assert key_digest(key) in text
    assert stat.S_IMODE(os.stat(keys_file).st_mode) == 0o600
    entries = load_keys(keys_file)
    assert [(e.name, e.rpm, e.tpm) for e in entries] == [("alice", 60, 1000), ("bob", None, None)]
    assert entries[0].created.endswith("Z")

    assert run("keys", "list", "--keys-file", str(keys_file)) == 0
    listing = capsys.readouterr().out
    assert "alice" in listing and "bob" in listing and key_digest(key)[:12] in listing
    assert key not in listing and key_digest(key) not in listing  # a prefix, never the digest

    assert run("keys", "add", "alice", "--keys-file", str(keys_file)) == 1
    assert "already exists" in capsys.readouterr().err
    assert run("keys", "revoke", "alice", "--keys-file", str(keys_file)) == 0
    assert [e.name for e in load_keys(keys_file)] == ["bob"]
    assert run("keys", "revoke", "alice", "--keys-file", str(keys_file)) == 1
    assert "no key named 'alice'" in capsys.readouterr().err


def test_cli_rejects_bad_input(tmp_path, capsys):
    keys_file = tmp_path / "keys.toml"
    assert run("keys", "add", "has space", "--keys-file", str(keys_file)) == 1
    assert "invalid key name" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli("keys", "add", "x", "--rpm", "0")
    assert run("keys", "list", "--keys-file", str(keys_file)) == 1
    assert "not found" in capsys.readouterr().err


def test_keys_file_validation(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text('[[keys]]\nname = "a"\nsha256 = "abc"\n')
    with pytest.raises(KeysFileError, match="sha256 must be 64"):
        load_keys(path)
    digest = "a" * 64
    path.write_text(f'[[keys]]\nname = "a"\nsha256 = "{digest}"\nrpm = -1\n')
    with pytest.raises(KeysFileError, match="rpm must be a positive integer"):
        load_keys(path)
    path.write_text(f'[[keys]]\nname = "a"\nsha256 = "{digest}"\nrole = "admin"\n')
    with pytest.raises(KeysFileError, match="unknown fields"):
        load_keys(path)
    path.write_text(
        f'[[keys]]\nname = "a"\nsha256 = "{digest}"\n[[keys]]\nname = "a"\nsha256 = "{"b" * 64}"\n'
    )
    with pytest.raises(KeysFileError, match="duplicate name"):
        load_keys(path)


def test_good_wrong_and_missing_keys(tmp_path):
    keys_file = tmp_path / "keys.toml"
    key = add_key(keys_file, "alice", rpm=10, tpm=500)
    chain = auth_chain(keys_file)
    assert chain.auth_required
    principal = chain.on_hello(key.encode())
    assert (principal.name, principal.rpm, principal.tpm) == ("alice", 10, 500)
    assert principal.key_id == key_digest(key)
    for bad, message in (
        (key[:-1].encode(), "invalid"),
        (b"zl_" + b"x" * 43, "invalid"),
        (b"", "missing"),
    ):
        with pytest.raises(HookError) as err:
            chain.on_hello(bad)
        assert err.value.code == UNAUTHENTICATED and message in err.value.message


def test_missing_keys_file_stops_the_start(tmp_path):
    with pytest.raises(HookConfigError, match="auth.keys_file.*not found.*keys add"):
        auth_chain(tmp_path / "nope.toml")


def test_reload_adds_new_keys_and_drops_revoked_ones(tmp_path, caplog):
    keys_file = tmp_path / "keys.toml"
    alice = add_key(keys_file, "alice", tpm=1000)
    chain = auth_chain(keys_file)
    alice_p = chain.on_hello(alice.encode())  # an open connection keeps this principal

    bob = add_key(keys_file, "bob")
    with pytest.raises(HookError):
        chain.on_hello(bob.encode())  # not before the reload
    revoke_key(keys_file, "alice")
    chain.reload()
    assert chain.on_hello(bob.encode()).name == "bob"
    with pytest.raises(HookError) as err:
        chain.on_hello(alice.encode())
    assert err.value.code == UNAUTHENTICATED
    # The connection opened before the revocation can no longer make requests.
    with pytest.raises(HookError) as err:
        chain.on_request(make_ctx(alice_p))
    assert err.value.code == UNAUTHENTICATED and "revoked" in err.value.message

    # A broken file keeps the keys already loaded.
    keys_file.write_text("this is [not toml")
    chain.reload()
    assert "keeping the 1 loaded keys" in caplog.text
    assert chain.on_hello(bob.encode()).name == "bob"


def test_reload_applies_new_limits_to_open_connections(tmp_path):
    keys_file = tmp_path / "keys.toml"
    key = add_key(keys_file, "alice", tpm=10_000)
    chain = auth_chain(keys_file)
    principal = chain.on_hello(key.encode())
    digest = key_digest(key)
    keys_file.write_text(f'[[keys]]\nname = "alice"\nsha256 = "{digest}"\ntpm = 20\n')
    chain.reload()
    ctx = make_ctx(principal, max_tokens=8)  # 4 + 8 = 12 tokens of the new 20
    assert chain.on_request(ctx) is None and ctx.principal.tpm == 20
    with pytest.raises(HookError) as err:
        chain.on_request(make_ctx(principal, max_tokens=8))
    assert err.value.code == 5  # RATE_LIMITED under the new limit


def test_auth_off_ignores_keys():
    chain = Chain.build(SimpleNamespace(auth=AuthConfig(enabled=False)))
    assert not chain.auth_required
    assert chain.on_hello(b"anything") is chain.anonymous()
    assert chain.anonymous().name == "anonymous"


def test_weight_and_class_from_the_keys_file_reach_the_principal(tmp_path, capsys):
    """Issue #40 item 2: weighted shares of the rows per key, a class for the metrics."""
    keys_file = tmp_path / "keys.toml"
    args = ("keys", "add", "gold", "--keys-file", str(keys_file), "--weight", "3")
    assert run(*args, "--class", "premium") == 0
    key = capsys.readouterr().out.strip()
    plain = add_key(keys_file, "plain")
    assert [(e.weight, e.principal_class) for e in load_keys(keys_file)] == [
        (3, "premium"),
        (1, "default"),
    ]
    chain = auth_chain(keys_file)
    gold = chain.on_hello(key.encode())
    assert (gold.weight, gold.principal_class) == (3, "premium")
    assert chain.on_hello(plain.encode()).principal_class == "default"
    digest = "a" * 64
    for field, message in (("weight = 0", "weight must be"), ('class = "a b"', "class must be")):
        keys_file.write_text(f'[[keys]]\nname = "a"\nsha256 = "{digest}"\n{field}\n')
        with pytest.raises(KeysFileError, match=message):
            load_keys(keys_file)


def test_every_credential_is_checked_and_must_name_one_key(tmp_path):
    """Issue #40 item 4, in the chain both doors call."""
    keys_file = tmp_path / "keys.toml"
    a, b = add_key(keys_file, "a"), add_key(keys_file, "b")
    chain = auth_chain(keys_file)
    assert chain.on_credentials([a.encode(), a.encode()]).name == "a"
    refused = 0
    for presented in (
        [a.encode(), b"zl_bogus"],
        [b"zl_bogus", a.encode()],
        [a.encode(), b.encode()],
    ):
        with pytest.raises(HookError) as err:
            chain.on_credentials(presented)
        assert err.value.code == UNAUTHENTICATED
        refused += 1
    with pytest.raises(HookError):  # a HELLO key that is not the certificate's key
        chain.on_credentials([b.encode()], chain.on_hello(a.encode()))
    assert refused == 3
    off = Chain.build(
        SimpleNamespace(
            auth=AuthConfig(enabled=False),
            ratelimit=RateLimitConfig(),
            cache=CacheConfig(enabled=False),
        )
    )
    assert off.on_credentials([b"x", b"y"]).name == "anonymous"  # auth off: nothing is checked
