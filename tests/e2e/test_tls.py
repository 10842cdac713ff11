"""TLS 1.3 and mutual TLS on the frame port, end to end: certificates made at test
time (benchmarks/_support/certs.py), a real daemon (synthetic backend), the client library and
the CLI."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from benchmarks._support.certs import CA, serial_of
from benchmarks._support.daemon import ROOT, Daemon
from tests.support import rawclient as rc
from zerolayer.client import Client, EndpointError, RateLimitedError, UnauthenticatedError
from zerolayer.hooks.keys import add_key
from zerolayer.ops.tls import ALPN_FRAME, client_context


class PKI:
    """A server CA with a server certificate for 127.0.0.1/localhost, a client CA with two clients,
    and the bad ones: expired, wrong CA, wrong host."""

    def __init__(self, d: Path) -> None:
        self.dir = d
        self.server_ca = CA(d, "server-ca")
        self.client_ca = CA(d, "client-ca")
        self.other_ca = CA(d, "other-ca")
        self.server = self.server_ca.issue("server", "zerolayer", hosts=("127.0.0.1", "localhost"))
        self.server_expired = self.server_ca.issue(
            "server-expired", "zerolayer", hosts=("127.0.0.1",), expired=True
        )
        self.server_other_host = self.server_ca.issue(
            "server-other", "zerolayer", hosts=("other.example",)
        )
        self.alice = self.client_ca.issue("alice", "alice", client=True)
        self.bob = self.client_ca.issue(
            "bob", "bob-device", dns_names=("bob.clients.example",), client=True
        )
        self.alice_expired = self.client_ca.issue("alice-old", "alice", client=True, expired=True)
        self.mallory = self.other_ca.issue("mallory", "alice", client=True)

    def env(self, server=None, client_ca: bool = True, **extra: str) -> dict[str, str]:
        server = server or self.server
        env = {"TLS__CERT_FILE": str(server.cert), "TLS__KEY_FILE": str(server.key)}
        if client_ca:
            env["TLS__CLIENT_CA_FILE"] = str(self.client_ca.path)
        env.update(extra)
        return env

    def client(self, who=None, ca: CA | None = None, **kw) -> ssl.SSLContext:
        ca = ca or self.server_ca
        return client_context(str(ca.path), who and str(who.cert), who and str(who.key), **kw)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> PKI:
    return PKI(tmp_path_factory.mktemp("pki"))


def tls_endpoint(d: Daemon) -> str:
    return f"tls://{d.host}:{d.port}"


async def _generate(d: Daemon, ctx: ssl.SSLContext, n: int = 5, **kw) -> tuple[int, Client]:
    client = await Client.connect(tls_endpoint(d), ssl=ctx, **kw)
    try:
        stream = await client.generate("hi", n, text=False)
        return (await stream.collect()).completion_tokens, client
    finally:
        await client.close()


def run(coro):
    return asyncio.run(coro)


async def _refused(d: Daemon, ctx: ssl.SSLContext) -> str:
    """Connect, send PING, and say how the server refused (handshake or alert before any frame).
    Fails the test when a frame comes back."""
    try:
        reader, writer = await asyncio.open_connection(
            d.host, d.port, ssl=ctx, server_hostname="127.0.0.1"
        )
    except (ssl.SSLError, ConnectionResetError) as exc:
        return f"handshake: {exc!r}"
    try:
        writer.write(bytes.fromhex("000000000400000000000000"))  # PING, empty
        await writer.drain()
        data = await asyncio.wait_for(reader.read(64), 10)
    except (ssl.SSLError, ConnectionResetError) as exc:
        return f"alert: {exc!r}"
    finally:
        writer.close()
    assert data == b"", f"the server answered a frame: {data!r}"
    return "closed"


def test_tls13_mutual_tls_alpn_and_plain_metrics(pki):
    with Daemon(pki.env()) as d:
        assert d.extra["tls"] == "on"

        async def main() -> None:
            client = await Client.connect(tls_endpoint(d), ssl=pki.client(pki.alice))
            sslobj = client._writer.get_extra_info("ssl_object")
            assert sslobj.version() == "TLSv1.3"
            assert sslobj.selected_alpn_protocol() == ALPN_FRAME
            result = await (await client.generate("hi", 7, text=False)).collect()
            assert result.completion_tokens == 7
            await client.close()

        run(main())
        # The metrics port stays plain HTTP.
        with urllib.request.urlopen(d.metrics_url + "/metrics", timeout=10) as resp:
            assert b"zerolayer_" in resp.read()
        # Plain TCP to the TLS port gets no frame back: the server closes it.
        conn = rc.RawConnection(d.host, d.port)
        conn.send(rc.frame(rc.PING, 0, b"x"))
        with contextlib.suppress(ConnectionResetError):
            assert conn.read_frame() is None


def test_bad_certificates_are_refused(pki):
    with Daemon(pki.env()) as d:
        # No client certificate, an expired one, one from another CA: refused by the server.
        for who in (None, pki.alice_expired, pki.mallory):
            how = run(_refused(d, pki.client(who)))
            assert how.startswith(("handshake", "alert", "closed")), how
        # TLS 1.2 is refused by default.
        ctx12 = pki.client(pki.alice)
        ctx12.maximum_version = ssl.TLSVersion.TLSv1_2
        assert run(_refused(d, ctx12)).startswith("handshake")
        # Each refusal is in the log with the peer and OpenSSL's reason (#25 item 8: it was a
        # bare EOF), one line per reason a minute however many clients fail.
        refusals = d.lines_with("TLS handshake refused", at_least=3)
        assert any("PEER_DID_NOT_RETURN_A_CERTIFICATE" in line for line in refusals), refusals
        assert any("UNSUPPORTED_PROTOCOL" in line for line in refusals), refusals
        assert all("on the frame port from 127.0.0.1" in line for line in refusals), refusals
        for _ in range(3):  # the same refusal again: held back, not another line each ...
            run(_refused(d, pki.client(None)))
        with socket.create_connection((d.host, d.port)) as plain:  # ... a new reason is logged
            plain.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")  # plain bytes on a TLS port
            assert plain.recv(100) == b""
        assert d.lines_with("HTTP_REQUEST"), d.lines_with("TLS handshake refused")
        no_cert = d.lines_with("PEER_DID_NOT_RETURN_A_CERTIFICATE")
        assert len(no_cert) == 1, no_cert  # written before the later line: all are in
        # The client refuses a server it cannot verify: wrong CA, wrong hostname.
        with pytest.raises(EndpointError, match="TLS handshake") as err:
            run(_generate(d, pki.client(pki.alice, ca=pki.other_ca)))
        assert isinstance(err.value.__cause__, ssl.SSLCertVerificationError)
        with pytest.raises(EndpointError, match="match|mismatch") as err:
            run(_generate(d, pki.client(pki.alice), server_hostname="other.example"))
        assert isinstance(err.value.__cause__, ssl.SSLCertVerificationError)
        # And still serves a good client afterwards.
        assert run(_generate(d, pki.client(pki.alice)))[0] == 5

    for server, why in ((pki.server_expired, "expired"), (pki.server_other_host, "match")):
        with (
            Daemon(pki.env(server, client_ca=False)) as d,
            pytest.raises(EndpointError, match=why) as err,
        ):
            run(_generate(d, pki.client()))
        assert isinstance(err.value.__cause__, ssl.SSLCertVerificationError)


def test_tls12_allowed_when_configured(pki):
    with Daemon(pki.env(client_ca=False, TLS__MIN_VERSION="1.2")) as d:
        ctx = pki.client()
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
        assert run(_generate(d, ctx))[0] == 5


def test_client_certificate_stands_for_an_api_key(pki, tmp_path):
    keys = tmp_path / "keys.toml"
    add_key(keys, "alice", rpm=2, cert_names=("alice",))
    key_bob = add_key(keys, "bob", cert_names=("bob.clients.example",))  # matched by its SAN
    key_carol = add_key(keys, "carol")
    with Daemon(pki.env(AUTH__ENABLED="true", AUTH__KEYS_FILE=str(keys))) as d:

        async def main() -> None:
            # alice: no HELLO at all, then HELLO without a key: both authenticated by the cert.
            alice = await Client.connect(tls_endpoint(d), ssl=pki.client(pki.alice))
            assert (await (await alice.generate("a", 3)).collect()).completion_tokens == 3
            await alice.close()
            alice = await Client.connect(tls_endpoint(d), b"", ssl=pki.client(pki.alice))
            assert (await (await alice.generate("a", 3)).collect()).completion_tokens == 3
            # Her third request this minute is over her key's rpm = 2.
            with pytest.raises(RateLimitedError):
                await (await alice.generate("a", 3)).collect()
            await alice.close()
            # bob is limited separately (his SAN maps to his own key, no rpm).
            bob = await Client.connect(tls_endpoint(d), ssl=pki.client(pki.bob))
            for _ in range(3):
                assert (await (await bob.generate("b", 2)).collect()).completion_tokens == 2
            await bob.close()
            # Issue #40 item 4: a key in HELLO must be the certificate's own key; another key,
            # or an invalid one, is refused rather than silently chosen over the certificate.
            for other in (key_carol, "zl_" + "x" * 43):
                with pytest.raises(UnauthenticatedError):
                    await Client.connect(tls_endpoint(d), other, ssl=pki.client(pki.alice))
            bob = await Client.connect(tls_endpoint(d), key_bob, ssl=pki.client(pki.bob))
            for _ in range(3):
                assert (await (await bob.generate("b", 2)).collect()).completion_tokens == 2
            await bob.close()

        run(main())

    # A verified certificate that maps to no key is not authenticated.
    unmapped = pki.client_ca.issue("dave", "dave", client=True)
    with Daemon(pki.env(AUTH__ENABLED="true", AUTH__KEYS_FILE=str(keys))) as d:

        async def refused() -> None:
            dave = await Client.connect(tls_endpoint(d), ssl=pki.client(unmapped))
            with pytest.raises(UnauthenticatedError):
                await (await dave.generate("d", 2)).collect()
            await dave.close()

        run(refused())


def test_sighup_serves_new_certificate_while_old_connection_streams(pki, tmp_path):
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    shutil.copy(pki.server.cert, cert)
    shutil.copy(pki.server.key, key)
    env = {
        "TLS__CERT_FILE": str(cert),
        "TLS__KEY_FILE": str(key),
        "TLS__CLIENT_CA_FILE": str(pki.client_ca.path),
        "ENGINE__SYNTHETIC_STEP_MS": "5",
    }
    old_serial = serial_of(pki.server.cert.read_bytes())
    renewed = pki.server_ca.issue("server-renewed", "zerolayer", hosts=("127.0.0.1",))
    new_serial = serial_of(renewed.cert.read_bytes())

    async def peer_serial(d: Daemon) -> int:
        client = await Client.connect(tls_endpoint(d), ssl=pki.client(pki.alice))
        der = client._writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        await client.close()
        return serial_of(der)

    with Daemon(env) as d:

        async def main() -> None:
            old = await Client.connect(tls_endpoint(d), ssl=pki.client(pki.alice))
            stream = await old.generate("long", 600, text=False)  # ~3 s at 5 ms a step
            got = 0
            async for event in stream:
                got += len(event.ids)
                if got >= 20:
                    break
            assert await peer_serial(d) == old_serial
            shutil.copy(renewed.cert, cert)
            shutil.copy(renewed.key, key)
            d.proc.send_signal(1)
            deadline = time.monotonic() + 10
            while await peer_serial(d) != new_serial:
                assert time.monotonic() < deadline, "SIGHUP did not load the new certificate"
                await asyncio.sleep(0.1)
            async for event in stream:
                got += len(event.ids)
            assert stream.result is not None and stream.result.completion_tokens == 600
            assert got == 600
            await old.close()

        run(main())


def test_generate_cli_over_mutual_tls(pki):
    with Daemon(pki.env()) as d:
        base = [
            sys.executable,
            "-m",
            "zerolayer.cli.main",
            "generate",
            "hello",
            "--max-tokens",
            "4",
        ]
        tls = ["--endpoint", tls_endpoint(d), "--tls-ca", str(pki.server_ca.path)]
        mine = ["--tls-cert", str(pki.alice.cert), "--tls-key", str(pki.alice.key)]
        ok = subprocess.run(
            base + tls + mine + ["-v"], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        assert ok.returncode == 0, ok.stderr
        assert "completion_tokens=4" in ok.stderr
        no_cert = subprocess.run(base + tls, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert no_cert.returncode == 1
        assert "zerolayer:" in no_cert.stderr


def test_the_http_api_port_speaks_tls_too(pki: PKI) -> None:
    """With [tls] set, the HTTP port is TLS only as well: the openai SDK over https with the
    server CA gets its answer, with ALPN http/1.1; a plain-HTTP client gets no answer; a client
    without a certificate is refused when a client CA is set."""
    import httpx2 as httpx  # the openai SDK's HTTP client package
    import openai

    with Daemon(pki.env(client_ca=False, **{"ENGINE__SYNTHETIC_STEP_MS": "1"})) as d:
        assert d.extra.get("tls") == "on"
        ctx = pki.client()
        ctx.set_alpn_protocols(["http/1.1"])
        client = openai.OpenAI(
            base_url=f"https://127.0.0.1:{d.http_port}/v1",
            api_key="unused",
            http_client=httpx.Client(verify=ctx),
            max_retries=0,
        )
        reply = client.chat.completions.create(
            model="synthetic", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert reply.usage.completion_tokens == 4
        plain = openai.OpenAI(
            base_url=f"http://127.0.0.1:{d.http_port}/v1", api_key="unused", max_retries=0,
            timeout=10,
        )  # fmt: skip
        with pytest.raises(openai.APIConnectionError):
            plain.models.list()
    with Daemon(pki.env(client_ca=True)) as d:  # mutual TLS: a client certificate is required
        anonymous = httpx.Client(verify=pki.client())
        with pytest.raises(httpx.HTTPError):
            anonymous.get(f"https://127.0.0.1:{d.http_port}/v1/models", timeout=10)
        refused = d.lines_with("TLS handshake refused on the HTTP port from 127.0.0.1")
        assert any("PEER_DID_NOT_RETURN_A_CERTIFICATE" in line for line in refused), refused
        with_cert = httpx.Client(verify=pki.client(pki.alice))
        assert (
            with_cert.get(f"https://127.0.0.1:{d.http_port}/v1/models", timeout=10).status_code
            == 200
        )


def test_bench_over_tls_frames_and_https(pki: PKI, tmp_path: Path) -> None:
    """zerolayer bench reaches both TLS listeners with the CA and a client certificate."""
    import json as json_module

    with Daemon(pki.env(**{"ENGINE__SYNTHETIC_STEP_MS": "1"})) as d:
        tls_opts = ["--tls-ca", str(pki.server_ca.path), "--tls-cert", str(pki.alice.cert),
                    "--tls-key", str(pki.alice.key)]  # fmt: skip
        for endpoint, extra in (
            (f"tls://127.0.0.1:{d.port}", []),
            (f"https://127.0.0.1:{d.http_port}", ["--protocol", "openai-chat"]),
        ):
            out = tmp_path / "r.json"
            proc = subprocess.run(
                [sys.executable, "-m", "zerolayer.cli.main", "bench", "--endpoint", endpoint,
                 "--num-requests", "6", "--concurrency", "3", "--input-len", "8",
                 "--output-len", "5", "--output", str(out), *tls_opts, *extra],
                cwd=ROOT, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert proc.returncode == 0, proc.stderr
            report = json_module.loads(out.read_text())
            assert (report["completed"], report["failed"]) == (6, 0), endpoint
