"""Replay the HTTP fuzz corpus (tests/fixtures/http-fuzz-corpus, benchmarks/fuzz_http.py) against
a real daemon from an attacker address: each input gets one HTTP answer that is not a 500 (or a
close, for bytes that are not HTTP) and no descriptor is left open behind it."""

from __future__ import annotations

import os
import socket
import time

import pytest

from benchmarks._support import fuzzhttp as fh
from benchmarks._support.daemon import Daemon
from tests.support.rawhttp import RawHttp

CORPUS = fh.corpus()


@pytest.fixture(scope="module")
def daemon():
    with Daemon({"HTTP__HEADER_TIMEOUT_S": "2", "HTTP__BODY_TIMEOUT_S": "2"}) as d:
        yield d


def test_the_corpus_is_there():
    assert len(CORPUS) >= 10


@pytest.mark.parametrize(("name", "data"), CORPUS, ids=[n for n, _ in CORPUS])
def test_corpus_input_is_answered_once_and_leaks_nothing(daemon, name, data):
    before = len(os.listdir(f"/proc/{daemon.proc.pid}/fd"))
    s = socket.create_connection(("127.0.0.1", daemon.http_port), source_address=("127.0.0.2", 0))
    s.settimeout(10)
    s.sendall(data)
    got = b""
    while chunk := s.recv(65536):  # answered, then closed (at the latest by the idle timeout)
        got += chunk
    s.close()
    assert got.count(b"HTTP/1.1 ") <= 1
    if got:
        assert not got.startswith(b"HTTP/1.1 500"), got[:300]
        assert got.startswith(b"HTTP/1.1 ")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if len(os.listdir(f"/proc/{daemon.proc.pid}/fd")) <= before:
            break
        time.sleep(0.05)
    assert len(os.listdir(f"/proc/{daemon.proc.pid}/fd")) <= before
    c = RawHttp("127.0.0.1", daemon.http_port)  # the canary's address is still served
    c.request("GET", "/v1/models")
    assert c.response().status == 200
    c.sock.close()
