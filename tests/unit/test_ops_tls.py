"""TLS settings, server and client contexts, peer names, and client certificates standing for
API keys (the keys file's cert_names). Certificates are made at test time; no daemon."""

from __future__ import annotations

import ssl
from types import SimpleNamespace

import pytest

from benchmarks._support.certs import CA
from zerolayer.config.hooks import CacheConfig, RateLimitConfig
from zerolayer.config.settings import AuthConfig, ConfigError, TLSConfig, load_settings
from zerolayer.hooks import Chain
from zerolayer.hooks.keys import KeysFileError, add_key, load_keys, revoke_key
from zerolayer.ops.tls import ALPN_FRAME, ALPN_HTTP, TLSConfigError, peer_names, server_tls


def test_tls_section_defaults_env_and_validation(tmp_path, monkeypatch):
    cfg = load_settings().tls
    assert (cfg.cert_file, cfg.key_file, cfg.client_ca_file, cfg.min_version) == ("", "", "", "1.3")
    assert server_tls(cfg, [ALPN_FRAME]) is None  # plain TCP
    monkeypatch.setenv("ZEROLAYER_TLS__CERT_FILE", "/etc/zl/cert.pem")
    monkeypatch.setenv("ZEROLAYER_TLS__MIN_VERSION", "1.2")
    cfg = load_settings().tls
    assert (cfg.cert_file, cfg.min_version) == ("/etc/zl/cert.pem", "1.2")
    monkeypatch.delenv("ZEROLAYER_TLS__CERT_FILE")
    monkeypatch.setenv("ZEROLAYER_TLS__CLIENT_CA_FILE", "/etc/zl/ca.pem")
    with pytest.raises(ConfigError, match="need tls.cert_file"):
        load_settings()
    monkeypatch.setenv("ZEROLAYER_TLS__MIN_VERSION", "1.1")
    with pytest.raises(ConfigError, match="tls.min_version"):
        load_settings()


def test_server_context_and_reload(tmp_path):
    ca = CA(tmp_path, "ca")
    leaf = ca.issue("server", "zerolayer", hosts=("127.0.0.1",))
    cfg = TLSConfig(cert_file=str(leaf.cert), key_file=str(leaf.key), client_ca_file=str(ca.path))
    tls = server_tls(cfg, [ALPN_HTTP])
    assert tls is not None
    assert tls.context.minimum_version == ssl.TLSVersion.TLSv1_3
    assert tls.context.verify_mode == ssl.CERT_REQUIRED
    assert tls.reload() and tls.current is not tls.context and tls.reloads == 1
    # A broken file on reload keeps the loaded context.
    leaf.cert.write_text("not a certificate")
    before = tls.current
    assert not tls.reload() and tls.current is before
    with pytest.raises(TLSConfigError, match="tls.cert_file"):
        server_tls(cfg, [ALPN_FRAME])
    missing_ca = TLSConfig(cert_file=str(leaf.cert), client_ca_file=str(tmp_path / "nope.pem"))
    with pytest.raises(TLSConfigError):
        server_tls(missing_ca, [ALPN_FRAME])


class _Transport:
    def __init__(self, cert):
        self.cert = cert

    def get_extra_info(self, name):
        return self.cert if name == "peercert" else None


def test_peer_names_from_subject_and_sans():
    cert = {
        "subject": ((("organizationName", "acme"),), (("commonName", "alice"),)),
        "subjectAltName": (("DNS", "alice.example"), ("IP Address", "10.0.0.1"), ("DNS", "alice")),
    }
    assert peer_names(_Transport(cert)) == ("alice", "alice.example")
    assert peer_names(_Transport(None)) == ()
    assert peer_names(_Transport({})) == ()


def test_cert_names_in_the_keys_file_and_on_certificate(tmp_path):
    keys = tmp_path / "keys.toml"
    add_key(keys, "alice", rpm=5, cert_names=("alice", "alice.clients.example"))
    add_key(keys, "bob")
    assert load_keys(keys)[0].cert_names == ("alice", "alice.clients.example")
    revoke_key(keys, "bob")  # a rewrite keeps cert_names
    assert load_keys(keys)[0].cert_names == ("alice", "alice.clients.example")
    chain = Chain.build(
        SimpleNamespace(
            auth=AuthConfig(enabled=True, keys_file=str(keys)),
            ratelimit=RateLimitConfig(),
            cache=CacheConfig(enabled=False),
        )
    )
    principal = chain.on_certificate(("nobody", "alice.clients.example"))
    assert principal is not None and (principal.name, principal.rpm) == ("alice", 5)
    assert chain.on_certificate(("bob",)) is None
    assert chain.on_certificate(()) is None
    with pytest.raises(KeysFileError, match="already belongs"):
        add_key(keys, "carol", cert_names=("alice",))
    with pytest.raises(KeysFileError, match="cert"):
        add_key(keys, "dave", cert_names=('bad"name',))
