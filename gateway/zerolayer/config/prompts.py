"""The ``[[prompts]]`` tables of the config: one registered system prompt each (docs/prompts.md).

Their validation against the model and the registry that compiles them are the request path's
(``zerolayer.request_path.prompts``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

U32_MAX = 2**32 - 1


class PromptEntry(BaseModel):
    """One ``[[prompts]]`` table of the config."""

    model_config = ConfigDict(extra="forbid")

    id: int = Field(ge=1, le=U32_MAX)
    name: str = Field(min_length=1)
    text: str | None = None
    file: str | None = None  # relative to the config file's directory, or absolute

    @model_validator(mode="after")
    def _one_source(self) -> PromptEntry:
        if (self.text is None) == (self.file is None):
            raise ValueError("give exactly one of text and file")
        return self

    @property
    def label(self) -> str:
        return f'{self.id} "{self.name}"'


def resolve_prompt_files(data: dict[str, Any], base_dir: str | Path) -> None:
    """Make relative ``file`` paths of raw ``[[prompts]]`` tables absolute against
    ``base_dir`` (the config file's directory), in place. For load_settings."""
    prompts = data.get("prompts")
    if not isinstance(prompts, list):
        return
    for table in prompts:
        if isinstance(table, dict) and isinstance(table.get("file"), str):
            path = Path(table["file"])
            if not path.is_absolute():
                table["file"] = str(Path(base_dir) / path)
