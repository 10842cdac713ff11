"""The ``@hook`` decorator and the registry it fills at import time.

Registrations are kept per defining module (``fn.__module__``), so Chain.build can import a module
named in the config and collect exactly what it registered, even when it was imported earlier.
Nothing here runs per request.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

# Stage name -> number of positional arguments the chain passes.
STAGES: dict[str, int] = {
    "on_hello": 1,
    "on_certificate": 1,
    "on_request": 1,
    "on_refused": 2,
    "on_done": 2,
}

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Registration:
    """One ``@hook`` use: a function bound to a stage, or a class providing stage methods."""

    target: Any  # function or class
    stage: str | None  # None for a class
    records: bool  # on_done needs token_ids/text in Completion (functions only)


_REGISTRY: dict[str, list[Registration]] = {}


def hook(stage: str | type | None = None, *, records: bool = False) -> Any:
    """Register a hook.

    ``@hook("on_request")`` on a function registers it for that stage (``on_hello``,
    ``on_request``, ``on_refused`` or ``on_done``). ``@hook`` (or ``@hook()``) on a class
    registers it as a hook provider: Chain.build constructs it once as ``cls(settings)`` and binds
    whichever of ``on_hello``, ``on_request``, ``on_refused``, ``on_done``, ``reload``, ``close``
    it defines; an instance with ``enabled = False`` is left out; ``records = True`` on the
    instance asks the server to record streams. ``records=True`` does the same for a function.
    """
    if inspect.isclass(stage):
        return _register_class(stage)
    if stage is None:
        return _register_class
    if stage not in STAGES:
        raise ValueError(f"unknown hook stage {stage!r}; expected one of {', '.join(STAGES)}")

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(fn) or inspect.isclass(fn):
            raise TypeError(f'@hook("{stage}") applies to a function; use bare @hook on a class')
        _REGISTRY.setdefault(fn.__module__, []).append(Registration(fn, stage, records))
        return fn

    return register


def _register_class(cls: type[T]) -> type[T]:
    if not any(hasattr(cls, s) for s in STAGES):
        raise TypeError(f"hook class {cls.__qualname__} defines none of {', '.join(STAGES)}")
    _REGISTRY.setdefault(cls.__module__, []).append(Registration(cls, None, False))
    return cls


def registrations(module_name: str) -> list[Registration]:
    """What ``module_name`` registered, in registration order."""
    return list(_REGISTRY.get(module_name, ()))


def forget(module_name: str) -> None:
    """Drop a module's registrations (before re-executing it from a file path)."""
    _REGISTRY.pop(module_name, None)


def hook_options(settings: Any, name: str) -> dict[str, Any]:
    """The ``[hooks.options.<name>]`` table for a custom hook, {} when absent."""
    hooks = getattr(settings, "hooks", None)
    options = getattr(hooks, "options", None) or {}
    return dict(options.get(name, {}))
