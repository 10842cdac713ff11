"""Cache directories: where they live (``data_root``) and writing one once (``ensure_dir``):
the built-in model, converted GGUF files, the built GGUF block kernel.

A directory is written into a temporary sibling and renamed into place, so a crash or a
concurrent daemon never leaves a half-written directory behind; ``marker`` (a file the writer
creates last or at all) tells a complete directory.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def data_root(data_dir: str = "") -> Path:
    """``model.data_dir``, or ``~/.cache/zerolayer`` when it is empty."""
    return Path(data_dir).expanduser() if data_dir else Path.home() / ".cache" / "zerolayer"


def ensure_dir(target: Path, marker: str, write: Callable[[Path], None]) -> Path:
    """``target``, after ``write(tmp)`` filled a temporary sibling that is renamed to it; a
    ``target`` already holding ``marker`` is returned as it is."""
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is readable like any download
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / marker).is_file():
                raise  # not a lost race with another process: a real error
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
