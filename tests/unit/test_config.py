"""Configuration: file + environment precedence, key names, errors that name the key."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gateway.config import DEFAULT_CONFIG, SMOLLM2_MODEL, ConfigError, load_settings
from tests.support.daemon import ROOT


def test_default_file_gives_documented_defaults(monkeypatch):
    for key in list(__import__("os").environ):
        if key.startswith("ZEROLAYER_"):
            monkeypatch.delenv(key)
    s = load_settings(DEFAULT_CONFIG)
    assert (s.server.host, s.server.port, s.server.idle_timeout_s) == ("127.0.0.1", 7070, 15)
    assert s.server.max_frame_bytes == 1048576
    assert s.server.max_streams_per_connection == 256
    assert s.server.drain_timeout_s == 30
    assert s.engine.backend == "cpu" and s.engine.synthetic_step_ms == 0
    assert s.model.path == SMOLLM2_MODEL and s.auth.enabled is False
    assert (s.metrics.host, s.metrics.port) == ("127.0.0.1", 9464)


def test_environment_overrides_file(tmp_path, monkeypatch):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[server]\nport = 8000\nhost = "0.0.0.0"\n[engine]\nbackend = "synthetic"\n')
    monkeypatch.setenv("ZEROLAYER_SERVER__PORT", "7071")
    s = load_settings(cfg)
    assert s.server.port == 7071  # env wins
    assert s.server.host == "0.0.0.0"  # file value kept beside it
    assert s.engine.backend == "synthetic"


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ("[server]\nport = 70000\n", "server.port"),
        ('[engine]\nbackend = "gpu"\n', "engine.backend"),
        ("[server]\nprot = 1\n", "server.prot"),
        ("[nonsense]\nx = 1\n", "nonsense"),
        ("[engine]\nmax_batch_size = 0\n", "engine.max_batch_size"),
    ],
)
def test_invalid_config_names_the_key(tmp_path, toml, key):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(toml)
    with pytest.raises(ConfigError) as exc:
        load_settings(cfg)
    assert key in str(exc.value)


def test_invalid_env_names_the_key(monkeypatch):
    monkeypatch.setenv("ZEROLAYER_SERVER__IDLE_TIMEOUT_S", "-1")
    with pytest.raises(ConfigError, match="server.idle_timeout_s"):
        load_settings(DEFAULT_CONFIG)


def test_serve_refuses_bad_config_with_exit_2(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[server]\nport = -5\n")
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "server.port" in proc.stderr


def test_missing_and_unparsable_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_settings(tmp_path / "nope.toml")
    bad = tmp_path / "x.toml"
    bad.write_text("[server\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(bad)
