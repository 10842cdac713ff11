"""JSON bodies on the HTTP door's wire: compact UTF-8, one encoder for every API's answers and
errors."""

from __future__ import annotations

import json


def dumps(obj: object) -> bytes:
    """Compact UTF-8 JSON (responses are not per token: the stdlib encoder is enough)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
