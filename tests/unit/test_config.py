"""Configuration: file + environment precedence, key names, errors that name the key."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from benchmarks._support.daemon import ROOT
from zerolayer.config.settings import (
    SMOLLM2_MODEL,
    ConfigError,
    Settings,
    describe_source,
    load_settings,
)

DEFAULT_CONFIG = ROOT / "configs" / "default.toml"


@pytest.fixture
def clean_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith("ZEROLAYER_"):
            monkeypatch.delenv(key)


def test_the_default_file_is_the_built_in_defaults(clean_env):
    # Without --config the daemon reads no file: configs/default.toml only restates the built-in
    # defaults, and this keeps the two from drifting apart (a key changed in one fails here).
    assert load_settings(DEFAULT_CONFIG) == Settings() == load_settings()
    s = load_settings()
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
        ("[engine]\nmax_n = 129\n", "engine.max_n"),  # OpenAI's limit on n: 128
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
        [sys.executable, "-m", "zerolayer.cli.main", "serve", "--config", str(cfg)],
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


@pytest.mark.parametrize(
    ("name", "section"),
    [
        ("ZEROLAYER_QUIC__PORT", "quic"),  # a section this build does not have
        ("ZEROLAYER_SERVRE__PORT", "servre"),  # a typo in a real one
        ("ZEROLAYER_SERVER_PORT", "server_port"),  # one underscore where two were meant
    ],
)
def test_an_unknown_section_in_the_environment_is_an_error(monkeypatch, name, section):
    # Regression: pydantic-settings skips variables that match no field, so these were ignored.
    monkeypatch.setenv(name, "7071")
    with pytest.raises(ConfigError) as exc:
        load_settings(DEFAULT_CONFIG)
    assert str(exc.value).startswith(
        f"environment variable {name}: no configuration section or key {section!r} (known: "
    )


def test_variables_that_are_not_settings_are_allowed(monkeypatch):
    monkeypatch.setenv("ZEROLAYER_DEBUG", "1")
    assert load_settings(DEFAULT_CONFIG).server.port == 7070


def test_without_a_file_no_file_is_read_from_anywhere(clean_env, monkeypatch, tmp_path):
    # An installed wheel has no configs/ beside it: a bare `serve` runs on the built-in
    # defaults, from any directory, and a configs/default.toml that happens to be in the working
    # directory changes nothing (only --config names a file).
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "default.toml").write_text("[server]\nport = 7171\n")
    monkeypatch.chdir(tmp_path)
    assert load_settings() == Settings()
    assert load_settings().server.port == 7070
    monkeypatch.setenv("ZEROLAYER_SERVER__PORT", "7072")  # the environment still applies
    assert load_settings().server.port == 7072
    assert describe_source(None) == (
        "built-in defaults (no --config given), ZEROLAYER_* variables and flags over them"
    )
    assert describe_source("configs/default.toml") == (
        f"{tmp_path / 'configs' / 'default.toml'}, ZEROLAYER_* variables and flags over it"
    )


def test_changed_keys_names_each_difference(tmp_path):
    from zerolayer.config.settings import changed_keys

    old = load_settings(DEFAULT_CONFIG)
    cfg = tmp_path / "c.toml"
    cfg.write_text("[ratelimit]\ndefault_rpm = 120\n[server]\nport = 7071\n")
    assert changed_keys(old, load_settings(cfg)) == {
        "ratelimit.default_rpm": "ratelimit.default_rpm: None -> 120",
        "server.port": "server.port: 7070 -> 7071",
    }
    assert changed_keys(old, old) == {}
