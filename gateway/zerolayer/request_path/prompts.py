"""Precompiled system prompts: their configuration schema, validation and the registry.

A prompt registered in the config (``[[prompts]]``) is validated and tokenized as the model's
chat-template system part at start-up, then prefilled once into slot 0 of the backend before the
engine thread starts, and its KV is pinned in the engine's prefix store (never evicted). Reuse is
then the store's one mechanism, the same as for any prefix it has seen: a request whose ids
start with the prompt's ids (by ``prompt_id``, by the same ``system`` text, or by sending the
same ids) has that KV copied into its slot instead of prefilled again.

The KV pinned is every prompt token but the last, as full blocks plus a partial tail block (so a
prompt is reused up to its last token, not only to its last block boundary): a request always
prefills at least one token itself, and a request of just the prompt then still reuses it all
but that token.

Validation is shared by start-up (``PromptRegistry.build``) and ``zerolayer compile-check``
(zerolayer.cli.compile_check).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ValidationError

from zerolayer.config.prompts import PromptEntry
from zerolayer.engine.prefix_store import PrefixStore
from zerolayer.engine.types import PrefillChunk
from zerolayer.sampling_params import SamplingParams
from zerolayer.tokenizer import Tokenizer

__all__ = [
    "DEFAULT_MAX_PREFIX_TOKENS",
    "DEFAULT_PREFIX_BUDGET_BYTES",
    "MAX_PROMPT_CHARS",
    "CompiledPrompt",
    "PromptConfigError",
    "PromptRegistry",
    "dynamic_variable",
    "system_ids",
    "text_problems",
]

log = logging.getLogger("zerolayer.prompts")

MAX_PROMPT_CHARS = 4096
DEFAULT_MAX_PREFIX_TOKENS = 1024
DEFAULT_PREFIX_BUDGET_BYTES = 256 * 1024 * 1024
U32_MAX = 2**32 - 1

# Template syntax that would make a "static" prompt change per request. Alternatives are tried
# left to right at each position, so "{{user}}" is reported whole, not as "{user}".
_DYNAMIC = re.compile(
    r"\{\{[^{}]*\}\}"  # {{user}}, {{ user.name }}   (jinja, mustache, handlebars)
    r"|\{%.*?%\}"  # {% if x %}                      (jinja statements)
    r"|\$\{[^{}]*\}"  # ${DATE}                      (shell, JS template literals)
    r"|\{[A-Za-z_][\w.]*\}"  # {date}, {current_date}, {user.name}   (str.format, f-strings)
    r"|\{\d+\}"  # {0}                               (positional str.format)
)


class PromptConfigError(Exception):
    """A registered prompt is invalid or cannot be compiled; the message names it."""


# --------------------------------------------------------------------------- validation


def dynamic_variable(text: str) -> str | None:
    """The first template variable in ``text`` (as written), or None."""
    m = _DYNAMIC.search(text)
    return m.group(0) if m else None


def decode_utf8(data: bytes) -> tuple[str | None, str | None]:
    """(text, None) for valid UTF-8, else (None, the problem)."""
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError as exc:
        return None, f"invalid UTF-8 at byte {exc.start}: {exc.reason}"


def text_problems(text: str) -> list[str]:
    """Everything wrong with ``text`` as a compiled prompt that does not need a tokenizer."""
    if not text.strip():
        return ["empty prompt"]
    problems = []
    if len(text) > MAX_PROMPT_CHARS:
        problems.append(f"prompt is {len(text)} characters; the limit is {MAX_PROMPT_CHARS}")
    var = dynamic_variable(text)
    if var is not None:
        problems.append(f"dynamic variable {var} not allowed in compiled prompt")
    return problems


def system_ids(tokenizer: Tokenizer, text: str) -> np.ndarray:
    """The prompt's ids: the chat template's system part, with BOS when the model uses one."""
    ids = tokenizer.encode_prompt(tokenizer.render_system(text))
    return np.ascontiguousarray(ids, dtype=np.int32)


def token_problems(n_tokens: int, max_prefix_tokens: int) -> list[str]:
    if n_tokens > max_prefix_tokens:
        return [
            f"prompt is {n_tokens} tokens; the prefix budget is {max_prefix_tokens} tokens "
            "(engine.max_prefix_tokens)"
        ]
    if n_tokens < 2:
        # The KV kept is every token but the last; with one token there is nothing to reuse.
        return [f"the chat template renders this prompt to {n_tokens} token(s); nothing to compile"]
    return []


@dataclass(slots=True)
class _Checked:
    """A validated (or rejected) entry: the outcome compile-check prints per prompt."""

    entry: PromptEntry
    text: str
    ids: np.ndarray | None
    problems: list[str]


def _entry_text(entry: PromptEntry, base_dir: Path) -> tuple[str, list[str]]:
    if entry.text is not None:
        return entry.text, []
    path = Path(entry.file or "")
    if not path.is_absolute():
        path = base_dir / path
    try:
        data = path.read_bytes()
    except OSError as exc:
        return "", [f"cannot read file {path}: {exc.strerror or exc}"]
    text, problem = decode_utf8(data)
    return _file_text(text or ""), ([f"{path}: {problem}"] if problem else [])


def _file_text(text: str) -> str:
    # Editors end files with a line break nobody means as part of the prompt (as $(cat f)).
    return text.rstrip("\r\n")


def check_entries(
    entries: Iterable[PromptEntry],
    tokenizer: Tokenizer,
    *,
    base_dir: Path,
    max_prefix_tokens: int,
) -> list[_Checked]:
    """Validate every entry (text, tokens, unique id, name and text); never raises."""
    out: list[_Checked] = []
    seen_id: dict[int, str] = {}
    seen_name: dict[str, str] = {}
    seen_text: dict[str, str] = {}
    for entry in entries:
        text, problems = _entry_text(entry, base_dir)
        if not problems:
            problems = text_problems(text)
        ids = None
        if not problems:
            ids = system_ids(tokenizer, text)
            problems = token_problems(len(ids), max_prefix_tokens)
        if entry.id in seen_id:
            problems.append(f"id {entry.id} is also used by prompt {seen_id[entry.id]}")
        if entry.name in seen_name:
            problems.append(f'name "{entry.name}" is also used by prompt {seen_name[entry.name]}')
        if text and text in seen_text:
            # Two registrations of one text are a mistake in the config.
            problems.append(f"same text as prompt {seen_text[text]}")
        seen_id.setdefault(entry.id, entry.label)
        seen_name.setdefault(entry.name, entry.label)
        if text:
            seen_text.setdefault(text, entry.label)
        out.append(_Checked(entry, text, ids, problems))
    return out


# --------------------------------------------------------------------------- the registry


@dataclass(slots=True)
class CompiledPrompt:
    """A registered prompt; ``kv_bytes`` (its pinned KV) is set by compile()."""

    id: int
    name: str
    text: str
    ids: np.ndarray  # int32, the full system part (read-only)
    kv_bytes: int = 0

    @property
    def pinned_tokens(self) -> int:
        """Positions whose KV is pinned: every token but the last."""
        return len(self.ids) - 1


def extends(ids: np.ndarray, prefix: np.ndarray) -> bool:
    """Whether ``ids`` start with ``prefix``, token for token."""
    n = len(prefix)
    return len(ids) >= n and bool(np.array_equal(ids[:n], prefix))


class PromptRegistry:
    """The registered prompts, looked up by id."""

    def __init__(
        self, prompts: Sequence[CompiledPrompt], budget_bytes: int = DEFAULT_PREFIX_BUDGET_BYTES
    ) -> None:
        self.budget_bytes = budget_bytes
        self._by_id = {c.id: c for c in prompts}
        self.compiled = not prompts  # an empty registry needs no compile step

    @classmethod
    def build(
        cls,
        entries: Iterable[PromptEntry | dict[str, Any]],
        tokenizer: Tokenizer,
        *,
        base_dir: str | Path = ".",
        max_prefix_tokens: int = DEFAULT_MAX_PREFIX_TOKENS,
        budget_bytes: int = DEFAULT_PREFIX_BUDGET_BYTES,
    ) -> PromptRegistry:
        """Validate and tokenize ``entries``; raises PromptConfigError naming every bad one."""
        parsed: list[PromptEntry] = []
        errors: list[str] = []
        for i, raw in enumerate(entries):
            if isinstance(raw, PromptEntry):
                parsed.append(raw)
                continue
            try:
                parsed.append(PromptEntry.model_validate(raw))
            except ValidationError as exc:
                errors.append(f"prompts[{i}]: {_pydantic_reasons(exc)}")
        checked = check_entries(
            parsed, tokenizer, base_dir=Path(base_dir), max_prefix_tokens=max_prefix_tokens
        )
        for c in checked:
            errors += [f"prompt {c.entry.label}: {p}" for p in c.problems]
        if errors:
            raise PromptConfigError("invalid precompiled prompt:\n  " + "\n  ".join(errors))
        prompts = []
        for c in checked:
            assert c.ids is not None
            c.ids.setflags(write=False)
            prompts.append(CompiledPrompt(c.entry.id, c.entry.name, c.text, c.ids))
            _warn_if_chat_splits(tokenizer, prompts[-1])
        return cls(prompts, budget_bytes)

    def __len__(self) -> int:
        return len(self._by_id)

    @property
    def total_kv_bytes(self) -> int:
        return sum(c.kv_bytes for c in self._by_id.values())

    def compile(
        self, store: PrefixStore | None, *, chunk: int = 256, backend_name: str = ""
    ) -> list[dict[str, Any]]:
        """Prefill every prompt once into slot 0 and pin its KV in ``store``.

        Call before the engine thread starts (slot 0 is borrowed). ``chunk`` should be the
        engine's prefill_chunk: the prompt is then chunked exactly as an inline prompt is, so the
        pinned KV is computed with the same shapes. ``store`` is None when the backend cannot
        save KV. Returns one fact dict per prompt (as logged).
        """
        if not self._by_id:
            self.compiled = True
            return []
        if store is None:
            name = backend_name or "this"
            raise PromptConfigError(f"precompiled prompts are not supported by the {name} backend")
        if chunk < 1:
            raise ValueError("chunk must be >= 1")
        backend = store.backend
        max_context = backend.info.max_context
        pinned = store.pinned_bytes
        facts = []
        for c in self._by_id.values():
            label = f'{c.id} "{c.name}"'
            if len(c.ids) >= max_context:
                raise PromptConfigError(
                    f"prompt {label}: {len(c.ids)} tokens leave no room in the context of "
                    f"{max_context} (engine.max_context)"
                )
            body = c.ids[:-1]
            pages = backend.kv_pages  # a paged backend: slot 0's pages, reserved here
            for start in range(0, len(body), chunk):
                piece = body[start : start + chunk]
                if pages is not None and pages.prepare_write(0, start, start + len(piece)) is None:
                    raise PromptConfigError(
                        f"prompt {label}: its KV does not fit in the KV pages left "
                        "(engine.kv_cache_bytes)"
                    )
                backend.prefill([PrefillChunk(0, piece, start, False, SamplingParams())])
            c.kv_bytes, _ = store.pin(body, 0)
            if pages is not None:
                pages.release(0)  # the pinned entries hold their pages
            backend.free(0)
            total = store.pinned_bytes - pinned
            if total > self.budget_bytes:
                raise PromptConfigError(
                    f"prompt {label}: its KV needs {c.kv_bytes} bytes, {total} bytes with the "
                    f"prompts before it, over the prefix budget of {self.budget_bytes} bytes "
                    "(engine.prefix_budget_bytes)"
                )
            fact = {"id": c.id, "name": c.name, "tokens": len(c.ids), "kv_bytes": c.kv_bytes}
            facts.append(fact)
            log.info("precompiled prompt %s: %d tokens, %d KV bytes", label, len(c.ids), c.kv_bytes)
        log.info(
            "precompiled %d prompts: %d of %d prefix budget bytes",
            len(facts),
            store.pinned_bytes - pinned,
            self.budget_bytes,
        )
        self.compiled = True
        return facts

    def by_id(self, prompt_id: int) -> CompiledPrompt | None:
        return self._by_id.get(prompt_id)

    def describe(self) -> list[dict[str, Any]]:
        """For GET /prompts: id, name, tokens and KV bytes of each prompt, by id."""
        return [
            {"id": c.id, "name": c.name, "tokens": len(c.ids), "kv_bytes": c.kv_bytes}
            for c in sorted(self._by_id.values(), key=lambda c: c.id)
        ]


def _pydantic_reasons(exc: ValidationError) -> str:
    parts = []
    for e in exc.errors():
        key = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        parts.append(f"{key}: {msg}" if key else msg)
    return "; ".join(parts)


def _warn_if_chat_splits(tokenizer: Tokenizer, c: CompiledPrompt) -> None:
    # A chat template or tokenizer that does not extend the system part token for token makes
    # every JSON chat request with this prompt miss its pinned KV: say so at start-up.
    try:
        chat = tokenizer.encode_prompt(
            tokenizer.render_chat([{"role": "user", "content": "Hello"}], c.text)
        )
    except Exception:  # a template may refuse a probe conversation; the request will tell
        return
    if not extends(chat, c.ids[: c.pinned_tokens]):
        log.warning(
            'prompt %d "%s": the chat template does not extend its system part token for token; '
            "JSON chat requests naming it will not reuse its precompiled KV",
            c.id,
            c.name,
        )
