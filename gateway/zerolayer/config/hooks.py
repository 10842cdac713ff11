"""Configuration sections owned by the hooks: ``[hooks]``, ``[ratelimit]``, ``[cache]``.

``[auth]`` is zerolayer.config.settings.AuthConfig. These models are imported by
zerolayer.config.settings.Settings; Chain.build also accepts a settings object that lacks them (the
defaults then apply).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class HooksConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Extra hook modules, after the built-ins: dotted module names ("mypkg.audit") or paths to a
    # .py file ("examples/audit_hook.py", relative to the working directory).
    modules: list[str] = []
    # Free-form settings for custom hooks, one table per name the hook chooses
    # (read with zerolayer.hooks.hook_options): [hooks.options.audit] path = "audit.jsonl"
    options: dict[str, dict[str, Any]] = {}


class RateLimitConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    store: Literal["memory", "redis"] = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Limits for principals whose key sets none (and for the anonymous principal); None = unlimited.
    default_rpm: int | None = Field(None, ge=1)
    default_tpm: int | None = Field(None, ge=1)


class CacheConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    store: Literal["memory", "redis"] = "memory"
    max_bytes: int = Field(64 * 1024 * 1024, ge=0)  # memory: LRU bound; both: largest entry
    ttl_s: int = Field(3600, ge=1)  # redis store only
    redis_url: str = "redis://127.0.0.1:6379/0"
    # False: each principal (API key) has its own entries. True: one principal may be served
    # another's completion, which tells it that someone sent that exact request (docs/hooks.md).
    shared_across_principals: bool = False
