"""docs/configuration.md documents every configuration key the daemon accepts."""

from __future__ import annotations

from pydantic import BaseModel

from benchmarks._support.daemon import ROOT
from zerolayer.config.settings import Settings


def keys(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str]]:
    out = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += [(name, key) for _, key in keys(ann, name + ".")]
        else:
            out.append((prefix.rstrip("."), name))
    return out


def test_every_key_is_documented():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    sections = {}
    current = None
    for line in doc.splitlines():
        if line.startswith("## "):
            current = line.split("`")[1].strip("[]") if "`" in line else None
            sections[current] = []
        elif current and line.startswith("| `"):
            sections[current].append(line.split("`")[1])
    missing = [
        f"{section}.{key}" if section else key
        for section, key in keys(Settings)
        if section and key not in sections.get(section, [])
    ]
    assert not missing, f"undocumented keys: {missing}"
    top_level = [key for section, key in keys(Settings) if not section]
    for key in top_level:
        assert f"[[{key}]]" in doc or f"[{key}]" in doc, key
