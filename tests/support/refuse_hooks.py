"""A synchronous hook for tests: refuses every request with an error code outside the
protocol's (a custom hook's mistake the server must contain)."""

from __future__ import annotations

from typing import Any

from zerolayer.hooks import HookError, hook


@hook("on_request")
def refuse(ctx: Any) -> None:
    raise HookError(99, "custom refusal")
