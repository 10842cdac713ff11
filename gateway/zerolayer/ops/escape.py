"""Client strings on their way out: into a reply, an error frame or a log line.

A client may send anything JSON admits, including lone surrogates (``"\\ud800"``) that no UTF-8
encoder accepts, and control characters that would forge log lines. ``client_text`` is the one
rule: such characters become backslash escapes, everything else is kept as sent.
"""

from __future__ import annotations

import re

__all__ = ["client_text"]

# Lone surrogates, C0 controls except tab, DEL and C1 controls.
_UNSAFE = re.compile(r"[\ud800-\udfff\x00-\x08\x0a-\x1f\x7f-\x9f]")


def _escape(m: re.Match[str]) -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def client_text(text: str) -> str:
    """``text`` with lone surrogates and control characters (not tab) as backslash escapes:
    always encodable as UTF-8 and always one line."""
    return _UNSAFE.sub(_escape, text)
