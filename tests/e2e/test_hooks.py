"""Hooks end to end: auth with a keys file, SIGHUP reload, two replicas sharing one Redis limit,
the response cache. Real daemon processes (synthetic backend) and a real redis-server."""

from __future__ import annotations

import time

from benchmarks._support.daemon import Daemon
from tests.support import rawclient as rc
from zerolayer.hooks.keys import add_key, revoke_key

UNAUTHENTICATED, RATE_LIMITED = 4, 5


def hello(d: Daemon, key: str | bytes | None) -> rc.RawConnection:
    conn = rc.RawConnection(d.host, d.port)
    if key is not None:
        conn.send(rc.hello(key.encode() if isinstance(key, str) else key))
    return conn


def expect_unauthenticated(conn: rc.RawConnection) -> None:
    ftype, _, stream, payload = conn.read_frame()
    assert (ftype, stream) == (rc.ERROR, 0)
    assert rc.parse_error(payload)[0] == UNAUTHENTICATED
    assert conn.closed()


def test_auth_refuses_without_valid_key_and_reloads_on_sighup(tmp_path):
    keys = tmp_path / "keys.toml"
    alice = add_key(keys, "alice")
    bob = add_key(keys, "bob")
    with Daemon({"AUTH__ENABLED": "true", "AUTH__KEYS_FILE": str(keys)}) as d:
        # No HELLO: the first REQUEST is refused and the connection closed.
        conn = hello(d, None)
        conn.send(rc.request(1, b"x", 3))
        expect_unauthenticated(conn)
        # A PING first is no better: HELLO must be the first frame.
        conn = hello(d, None)
        conn.send(rc.frame(rc.PING, 0, b"hi"))
        expect_unauthenticated(conn)
        # Wrong key, empty key.
        for bad in (b"zl_wrong", b""):
            conn = hello(d, bad)
            expect_unauthenticated(conn)
        # A valid key: WELCOME, then requests work.
        bob_conn = hello(d, bob)
        assert bob_conn.read_frame()[0] == rc.WELCOME
        bob_conn.send(rc.request(1, b"x", 3))
        assert rc.collect(bob_conn, {1})[1]["done"]["completion_tokens"] == 3
        # Revoke alice, add carol, reload with SIGHUP: no connection is dropped.
        revoke_key(keys, "alice")
        carol = add_key(keys, "carol")
        d.proc.send_signal(1)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            conn = hello(d, carol)
            if conn.read_frame()[0] == rc.WELCOME:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("carol's key was not picked up by SIGHUP")
        conn.send(rc.request(1, b"c", 2))
        assert rc.collect(conn, {1})[1]["done"] is not None
        expect_unauthenticated(hello(d, alice))
        bob_conn.send(rc.request(2, b"still", 3))
        assert rc.collect(bob_conn, {2})[2]["done"]["completion_tokens"] == 3


def test_two_replicas_on_one_redis_hold_one_limit(tmp_path, redis_url):  # noqa: F811
    keys = tmp_path / "keys.toml"
    key = add_key(keys, "tenant", rpm=5)
    env = {
        "AUTH__ENABLED": "true",
        "AUTH__KEYS_FILE": str(keys),
        "RATELIMIT__STORE": "redis",
        "RATELIMIT__REDIS_URL": redis_url,
        "CACHE__ENABLED": "false",
    }
    with Daemon(env) as a, Daemon(env) as b:
        conns = []
        for d in (a, b):
            c = hello(d, key)
            assert c.read_frame()[0] == rc.WELCOME
            conns.append(c)
        outcomes = []
        for i in range(10):
            c = conns[i % 2]
            c.send(rc.request(1, b"r%d" % i, 2))
            outcomes.append(rc.collect(c, {1})[1])
        allowed = [o for o in outcomes if o["done"]]
        refused = [o for o in outcomes if o["error"]]
        assert len(allowed) == 5, "one limit across both replicas, not one each"
        assert all(o["error"][0] == RATE_LIMITED and o["error"][1] > 0 for o in refused)


def test_response_cache_replays_deterministic_requests_only():
    with Daemon({"ENGINE__SYNTHETIC_STEP_MS": "1"}) as d:
        conn = rc.RawConnection(d.host, d.port)
        conn.send(rc.request(1, b"cache me", 20, text_deltas=True))
        first = rc.collect(conn, {1})[1]
        assert first["done"]["cache"] & 1 == 0
        conn.send(rc.request(1, b"cache me", 20, text_deltas=True))
        second = rc.collect(conn, {1})[1]
        assert second["done"]["cache"] & 1 == 1
        assert second["ids"] == first["ids"] and second["text"] == first["text"]
        assert second["done"]["completion_tokens"] == 20
        assert second["done"]["finish_reason"] == first["done"]["finish_reason"]
        # Without text deltas the replay carries ids only.
        conn.send(rc.request(1, b"cache me", 20))
        third = rc.collect(conn, {1})[1]
        assert third["done"]["cache"] & 1 and third["ids"] == first["ids"]
        assert third["text"] == b""
        # Stored from a stream without text, replayed with text: decoded from the ids.
        conn.send(rc.request(1, b"ids first", 16))
        plain = rc.collect(conn, {1})[1]
        conn.send(rc.request(1, b"ids first", 16, text_deltas=True))
        replay = rc.collect(conn, {1})[1]
        assert replay["done"]["cache"] & 1 and replay["ids"] == plain["ids"]
        assert replay["text"] == bytes(plain["ids"])  # byte tokenizer: one byte per id
        # Sampled without a seed: never from the cache.
        for _ in range(2):
            conn.send(rc.request(1, b"hot", 10, temperature=0.9))
            assert rc.collect(conn, {1})[1]["done"]["cache"] & 1 == 0
        # Seeded: cached per seed.
        conn.send(rc.request(1, b"hot", 10, temperature=0.9, seed=7))
        rc.collect(conn, {1})
        conn.send(rc.request(1, b"hot", 10, temperature=0.9, seed=7))
        assert rc.collect(conn, {1})[1]["done"]["cache"] & 1
        # A cancelled stream is never stored.
        conn.send(rc.request(2, b"cancel me", 1500))
        assert conn.read_frame()[0] == rc.TOKEN
        conn.send(rc.frame(rc.CANCEL, 2))
        rc.collect(conn, {2})
        conn.send(rc.request(2, b"cancel me", 1500))
        res = rc.collect(conn, {2})[2]
        assert res["done"]["cache"] & 1 == 0, "a cancelled stream must not be cached"
        assert res["done"]["completion_tokens"] == 1500
        conn.close()


def test_daemon_refuses_to_start_with_a_broken_hook_module(tmp_path):
    import subprocess
    import sys

    from benchmarks._support.daemon import ROOT

    bad = tmp_path / "broken_hook.py"
    bad.write_text("import not_a_module_anywhere\n")
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("ZEROLAYER_")}
    env.update(
        ZEROLAYER_ENGINE__BACKEND="synthetic",
        ZEROLAYER_SERVER__PORT="0",
        ZEROLAYER_METRICS__PORT="0",
        ZEROLAYER_HTTP__PORT="0",
        ZEROLAYER_HOOKS__MODULES=f'["{bad}"]',
    )
    proc = subprocess.run(
        [sys.executable, "-m", "zerolayer.cli.main", "serve"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "cannot start" in proc.stderr and "broken_hook" in proc.stderr
    assert "listening" not in proc.stderr
