"""Connection limits against a real daemon with auth: the HELLO deadline and connections per
principal (the in-process limits are in tests/unit/test_server_limits.py)."""

from __future__ import annotations

import time

from benchmarks._support.daemon import Daemon
from tests.support import rawclient as rc
from zerolayer.hooks.keys import add_key

UNAUTHENTICATED, OVERLOADED = 4, 6


def test_hello_deadline_and_connections_per_principal(tmp_path) -> None:
    keys = tmp_path / "keys.toml"
    alice, bob = add_key(keys, "alice"), add_key(keys, "bob")
    env = {
        "AUTH__ENABLED": "true",
        "AUTH__KEYS_FILE": str(keys),
        "SERVER__HELLO_TIMEOUT_S": "0.5",
        "SERVER__MAX_CONNECTIONS_PER_PRINCIPAL": "2",
    }
    with Daemon(env) as d:
        silent = rc.RawConnection(d.host, d.port, timeout=20)  # connects, never says HELLO
        held = []
        for _ in range(2):
            conn = rc.RawConnection(d.host, d.port)
            conn.send(rc.hello(alice.encode()))
            assert conn.read_frame()[0] == rc.WELCOME
            held.append(conn)
        third = rc.RawConnection(d.host, d.port)
        third.send(rc.hello(alice.encode()))
        ftype, _, stream, payload = third.read_frame()
        assert (ftype, stream) == (rc.ERROR, 0)
        code, retry_ms, message = rc.parse_error(payload)
        assert code == OVERLOADED and retry_ms > 0 and "alice" in message
        assert third.closed()
        other = rc.RawConnection(d.host, d.port)  # another principal is not affected
        other.send(rc.hello(bob.encode()))
        assert other.read_frame()[0] == rc.WELCOME
        held[0].close()  # a freed place can be taken again (once the server saw the close)
        for _ in range(50):
            again = rc.RawConnection(d.host, d.port)
            again.send(rc.hello(alice.encode()))
            if again.read_frame()[0] == rc.WELCOME:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("alice's freed connection place was never given back")
        # The silent connection is closed after its HELLO deadline (the sweeper runs each second).
        ftype, _, stream, payload = silent.read_frame()
        assert (ftype, stream) == (rc.ERROR, 0)
        assert rc.parse_error(payload)[0] == UNAUTHENTICATED
        assert silent.closed()
