"""model.data_dir layouts for tests: a fresh data dir whose ``kernels`` directory is the
session's one GGUF block kernel build (the ``kernel_cache`` fixture), so a daemon started on it
loads that library, as a second start on one data dir does, instead of compiling the kernel
again (half a minute of the 2-core machine each time)."""

from __future__ import annotations

from pathlib import Path


def share_kernels(data_dir: Path, kernel_cache: Path) -> Path:
    """``data_dir``, with ``data_dir/kernels`` linked to ``kernel_cache``."""
    (data_dir / "kernels").symlink_to(kernel_cache, target_is_directory=True)
    return data_dir
