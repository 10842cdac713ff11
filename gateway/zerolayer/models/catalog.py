"""What can be served here (``zerolayer models``): the named models, GGUF files that installed
Python packages ship, and the converted caches under ``model.data_dir``, with their sizes.

One row per model: ``@builtin`` once (its newest weights directory, if made), and a converted
cache folded into the row of the GGUF file it was converted from. A cache whose source is not
listed here (another checkout's or another environment's package, a file given by path) is
listed only when asked for ``everything``.

Only metadata and directory listings are read: nothing is loaded, converted or downloaded.
"""

from __future__ import annotations

import contextlib
import json
from importlib import metadata
from pathlib import Path
from typing import NamedTuple

from zerolayer.cachedir import data_root
from zerolayer.config.settings import BUILTIN_MODEL, SMOLLM2_MODEL


class ModelRow(NamedTuple):
    name: str  # what to pass as MODEL / model.path
    kind: str  # named | installed | converted | builtin
    size_bytes: int | None  # None: not on disk (yet)
    where: str  # the file or directory, or why it is missing
    cache: str = ""  # the converted checkpoint directory serving this row's GGUF, if made


def _tree_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _named(root: Path) -> list[ModelRow]:
    from zerolayer.models.bundled import SMOLLM2_DISTRIBUTION, BundledModelError, smollm2_gguf

    try:
        gguf = smollm2_gguf()
        rows = [ModelRow(SMOLLM2_MODEL, "named", gguf.stat().st_size, str(gguf))]
    except BundledModelError:
        rows = [ModelRow(SMOLLM2_MODEL, "named", None, f"{SMOLLM2_DISTRIBUTION} not installed")]
    made = [d for d in root.glob("builtin-*") if d.is_dir()]
    if made:  # one row: the newest weights (older ones are earlier versions' shapes)
        newest = max(made, key=lambda d: d.stat().st_mtime)
        rows.append(ModelRow(BUILTIN_MODEL, "builtin", _tree_size(newest), str(newest)))
    else:
        rows.append(ModelRow(BUILTIN_MODEL, "named", None, "random weights, made on first use"))
    return rows


def _installed(skip: set[str]) -> list[ModelRow]:
    """.gguf files listed in installed distributions' RECORDs."""
    rows = []
    for dist in metadata.distributions():
        for file in dist.files or ():
            if file.name.endswith(".gguf"):
                path = Path(str(file.locate()))
                if path.is_file() and str(path) not in skip:
                    name = f"{dist.metadata['Name']} {dist.version}"
                    rows.append(ModelRow(str(path), "installed", path.stat().st_size, name))
    return rows


def _converted(root: Path) -> list[ModelRow]:
    """Checkpoint directories converted from GGUF files (``where``: the source file)."""
    rows = []
    for d in sorted((root / "gguf").glob("*")) if (root / "gguf").is_dir() else ():
        if (d / "model.safetensors").is_file():
            source = ""
            with contextlib.suppress(OSError, ValueError, AttributeError):
                source = json.loads((d / "source.json").read_text()).get("gguf", "")
            rows.append(ModelRow(str(d), "converted", _tree_size(d), source or "from a GGUF"))
    return rows


def list_models(data_dir: str = "", everything: bool = False) -> list[ModelRow]:
    """The servable models, one row each; ``everything``: with the caches of unlisted sources."""
    root = data_root(data_dir)
    named = _named(root)
    rows = named + _installed({r.where for r in named})
    by_source = {r.where: i for i, r in enumerate(rows)}
    for cache in _converted(root):
        i = by_source.get(cache.where)
        if i is not None:
            rows[i] = rows[i]._replace(cache=cache.name)
        elif everything:
            rows.append(cache)
    return rows
