"""Example custom hook: an audit log with one JSON line per finished request.

Enable it in the daemon's config (the path is relative to the working directory; a dotted module
name works too when the module is importable)::

    [hooks]
    modules = ["examples/audit_hook.py"]

    [hooks.options.audit]
    path = "/var/log/zerolayer/audit.jsonl"   # create the directory first (docs/hooks.md)

A line records who asked, for what and how it ended; never the prompt or the answer. The file is
line-buffered (each line reaches the OS as it is written) and reopened on SIGHUP, so logrotate can
move it away.
"""

from __future__ import annotations

import json
import time
from typing import Any

from zerolayer.hooks import Completion, HookConfigError, RequestContext, hook, hook_options

FINISH_NAMES = {0: "eos", 1: "max_tokens", 2: "stop", 3: "cancelled", -1: "error"}


@hook
class AuditLog:
    def __init__(self, settings: Any) -> None:
        self.path = hook_options(settings, "audit").get("path", "audit.jsonl")
        try:
            self._file = open(self.path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
        except OSError as exc:
            raise HookConfigError(
                f"hooks.options.audit.path {self.path}: {exc.strerror} (create its directory, "
                "writable by the daemon's user)"
            ) from exc

    def on_done(self, ctx: RequestContext, result: Completion) -> None:
        record = {
            "time": round(time.time(), 3),
            "principal": ctx.principal.name,
            "model": ctx.model,
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "max_tokens": ctx.max_tokens,
            "finish": FINISH_NAMES.get(result.finish_reason, str(result.finish_reason)),
            "from_cache": result.from_cache,
        }
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def reload(self) -> None:
        self._file.close()
        self._file = open(self.path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115

    def close(self) -> None:
        self._file.close()
