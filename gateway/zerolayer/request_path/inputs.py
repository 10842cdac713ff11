"""The input processor: a validated request (from any door) → what the engine runs, or a refusal.

The request's fields were range-checked by its door's parser (zerolayer.request_path.validation, the
same rules for every door); what depends on the model is checked here: token ids inside the
vocabulary, prompt + max_tokens inside the context (the engine's, or the request's own when it is
smaller; an embedding's prompt cut to it when the request asks), a registered prompt's id.
Renders the chat template (a registered prompt named by ``prompt_id`` supplies the system text; the
request's tools and the calls and results in its history through the template where it renders
them, else as text, zerolayer.models.templates) and tokenizes. Reusing KV of a prompt's beginning
is the engine's prefix store's business, not this module's: a request's ids are the same whether
or not anything is reused. Pure: no server, connection or hook is involved, so request validation
is tested on its own (tests/unit/test_inputs.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

import numpy as np

from zerolayer.codes import ErrorCode, Refusal, invalid
from zerolayer.engine.backend import ModelInfo
from zerolayer.models import templates
from zerolayer.request_path import offload
from zerolayer.request_path.prompts import CompiledPrompt, PromptRegistry
from zerolayer.request_path.request import Request
from zerolayer.sampling_params import SamplingParams
from zerolayer.tokenizer import Detokenizer, TemplateRefused, Tokenizer

_NO_STOP_IDS: frozenset[int] = frozenset()

# The cheap bound checked before any templating or tokenizing (docs/protocol.md): a prompt's text
# (with the tool definitions it renders) may have at most ``max_context * PROMPT_BYTES_PER_TOKEN``
# UTF-8 bytes. A policy, not a proof:
# a text refused by it fits the context only if its tokens average more than 16 bytes each,
# which natural text does not (a byte-level or byte-fallback token is at least one byte, and
# typical tokens cover 3-5).
PROMPT_BYTES_PER_TOKEN = 16
_MIN_BODY_BYTES = 1 << 20


def request_body_bound(max_context: int) -> int:
    """The largest HTTP request body by default (``http.max_body_bytes = 0``): twice the
    prompt-text bound (JSON escapes and keys, a response format's schema), never under 1 MiB. A body
    costs the event loop time in proportion to its size (received, copied, decoded in one C call
    that holds the GIL), so what no request can use is refused from its Content-Length."""
    return max(_MIN_BODY_BYTES, 2 * max_context * PROMPT_BYTES_PER_TOKEN)


_UMAX = np.maximum.reduce  # the ufunc itself: ndarray.max() goes through a Python wrapper


def _utf8_len(text: object, room: int) -> int:
    """``text``'s length in UTF-8 bytes, or its length in characters when that alone exceeds
    ``room`` (a character is at least one byte: such a text is not encoded)."""
    if not isinstance(text, str):
        return 0
    n = len(text)
    if n > room or text.isascii():
        return n
    return len(text.encode("utf-8", "surrogatepass"))


def _size(value: object, room: int) -> int:
    """``value``'s size in the prompt, in UTF-8 bytes: a string's own (``_utf8_len``), or the
    JSON of structured data (tool definitions, an assistant's calls), as the chat template or
    ``templates.system_prompt`` writes it into the prompt."""
    if value is None or isinstance(value, str):
        return _utf8_len(value, room)
    return _utf8_len(json.dumps(value, ensure_ascii=False), room)


def _rendered(req: Request) -> Iterator[tuple[str, Iterable[object]]]:
    """The parts of a text request that become its prompt, each with the field it comes from:
    the prompt or the messages' values, the system text, the tool definitions. The response
    format's schema is not among them: it constrains the output and is not rendered."""
    if req.messages is not None:
        yield "messages", (value for m in req.messages for value in m.values())
    else:
        yield "prompt", (req.prompt_text,)
    yield "system", (req.system,)
    yield "tools", (req.tools,)


def _outside(ids: np.ndarray, vocab: int) -> bool:
    """Whether any of the int32 ``ids`` is outside [0, vocab): read as uint32, a negative id is
    at least 2**31, so one reduction checks both ends."""
    return bool(len(ids)) and int(_UMAX(ids.view(np.uint32))) >= vocab


@dataclass(slots=True)
class Prepared:
    """A validated request: its prompt ids, and how to sample and stop."""

    prompt: np.ndarray  # int32: the whole prompt, a registered prompt's ids included
    sampling: SamplingParams
    max_tokens: int
    stop_ids: frozenset[int]
    stop_sequences: tuple[str, ...]
    detokenizer: Detokenizer | None
    # The same request gives the same answer (greedy or seeded) and the response cache can hold
    # it: one choice, no logprobs, no logits processing or constraint (the cache's key has none
    # of these fields, and a replay carries no logprobs).
    deterministic: bool
    ignore_eos: bool = False  # generate past the end-of-sequence token (HTTP extension)


def plain(req: Request) -> bool:
    """Whether ``req`` asks for none of issue #27's features (one choice, no logprobs, no logits
    processing, no constraint): only such requests may use the response cache."""
    return (
        req.n == 1
        and req.constraint is None
        and not req.sampling.processed
        and not (req.returns_prompt or req.prompt_logprobs >= 0 or req.inputs is not None)
    )


class InputProcessor:
    """Turns a validated ``Request`` into a ``Prepared``; raises Refusal."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        info: ModelInfo,
        prompts: PromptRegistry | None = None,
        max_n: int = 8,  # engine.max_n
    ) -> None:
        self.tokenizer = tokenizer
        self.info = info
        self.prompts = prompts
        self.max_n = max_n

    def prepare(self, req: Request) -> Prepared:
        self.check_text_bound(req)
        vocab = self.info.vocab_size
        compiled, system = self._registered(req) if req.prompt_id else (None, req.system)
        ids = self._prompt_ids(req, compiled, system)
        if not len(ids):
            raise invalid("the prompt is empty after tokenization", "prompt")
        if _outside(req.stop_ids, vocab):
            raise invalid(f"stop token id outside the vocabulary [0, {vocab})", "stop_ids")
        bias = req.sampling.logit_bias
        if bias and not all(0 <= t < vocab for t in bias):
            bad = next(t for t in bias if not 0 <= t < vocab)
            raise invalid(
                f"logit_bias key {bad} is outside the vocabulary [0, {vocab})", "logit_bias"
            )
        if req.n > self.max_n:
            raise invalid(f"n must be at most {self.max_n} (engine.max_n), got {req.n}", "n")
        max_context = self.info.max_context
        if req.context is not None:
            max_context = min(max_context, req.context)
        if req.truncate and req.max_tokens == 0 and len(ids) > max_context:
            ids = ids[:max_context]  # the first tokens, as Ollama's /api/embed truncates
        max_tokens = req.max_tokens
        if max_tokens is None:  # as many as fit beside the prompt (and in the KV pool)
            max_tokens = min(max_context, self.info.kv_positions or max_context) - len(ids)
        if (req.embed or req.prompt_logprobs >= 0) and not self.info.hidden_size:
            field = "input" if req.embed else "echo"
            raise invalid(f"{field}: this backend returns no prompt outputs", field)
        if max_tokens < int(not req.returns_prompt) or len(ids) + max_tokens > max_context:
            raise Refusal(
                ErrorCode.PROMPT_TOO_LONG,
                f"prompt ({len(ids)} tokens) + max_tokens ({max(max_tokens, 1)}) exceeds "
                f"{'max_context' if req.context is None else 'the request context'} "
                f"{max_context}",
            )
        pool = self.info.kv_positions  # paged KV: a sequence must fit in the whole pool
        if pool and len(ids) + max_tokens > pool:
            raise Refusal(
                ErrorCode.PROMPT_TOO_LONG,
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the KV pool's "
                f"{pool} positions (engine.kv_cache_bytes)",
                field="max_tokens",
            )
        wants_detok = req.want_text or bool(req.stop_sequences)
        return Prepared(
            prompt=np.ascontiguousarray(ids, dtype=np.int32),
            sampling=req.sampling,
            max_tokens=max_tokens,
            stop_ids=frozenset(req.stop_ids.tolist()) if len(req.stop_ids) else _NO_STOP_IDS,
            stop_sequences=req.stop_sequences,
            detokenizer=Detokenizer(self.tokenizer) if wants_detok else None,
            deterministic=req.sampling.deterministic and plain(req),
            ignore_eos=req.ignore_eos,
        )

    def prepare_inputs(self, req: Request) -> list[Prepared]:
        """Each of ``req.inputs`` prepared as the request's prompt alone; a refusal names the
        input (``input[i]``)."""
        assert req.inputs is not None
        preps = []
        for i, value in enumerate(req.inputs):
            one = replace(req, inputs=None, prompt_text=None, prompt_ids=None)
            if isinstance(value, str):
                one.prompt_text = value
            else:
                one.prompt_ids = value
            try:
                preps.append(self.prepare(one))
            except Refusal as exc:
                where = f"input[{i}]" if len(req.inputs) > 1 else "input"
                message = f"{where}: {exc.message}"
                raise Refusal(exc.code, message, exc.retry_after_ms, where, exc.reason) from None
        return preps

    def count_prompt_tokens(self, req: Request) -> int:
        """The prompt's length in tokens, as ``prepare`` would make it (chat template and
        registered prompt included), without the context or sampling checks (the cheap text bound
        does apply)."""
        return len(self.prompt_ids(req))

    def prompt_ids(self, req: Request) -> np.ndarray:
        """The prompt's ids, as ``prepare`` would feed them to the engine (``/tokenize``)."""
        self.check_text_bound(req)
        compiled, system = self._registered(req)
        return self._prompt_ids(req, compiled, system)

    def check_text_bound(self, req: Request) -> int:
        """Refuse (PROMPT_TOO_LONG, naming the field) a prompt whose text has more UTF-8 bytes
        than the context allows, before anything renders or tokenizes it; otherwise return the
        text's size in bytes (0 for token ids). The text is everything the prompt renders: the
        prompt or every message (its calls too), the system text and the tool definitions
        (``_rendered``), one sum under one bound."""
        if req.prompt_ids is not None:
            return 0
        bound = self.info.max_context * PROMPT_BYTES_PER_TOKEN
        total = 0
        for field, values in _rendered(req):
            for value in values:
                total += _size(value, bound - total)
                if total > bound:
                    raise Refusal(
                        ErrorCode.PROMPT_TOO_LONG,
                        f"{field}: the prompt text (prompt or messages, system, tools) has more "
                        f"than {bound} UTF-8 bytes (max_context {self.info.max_context} x "
                        f"{PROMPT_BYTES_PER_TOKEN})",
                        0,
                        field,
                    )
        return total

    def offloaded(self, req: Request) -> bool:
        """``check_text_bound``, then whether ``req``'s input is big enough to be templated and
        tokenized on the offload pool (zerolayer.request_path.offload) rather than inline: the one
        rule for a request, a request of k inputs (their texts together; each is bounded when
        it is prepared alone) and a token count alike."""
        if req.inputs is not None:
            room = offload.INLINE_BYTES + 1
            return sum(_size(v, room) for v in req.inputs if isinstance(v, str)) >= room
        return self.check_text_bound(req) > offload.INLINE_BYTES

    def _prompt_ids(
        self, req: Request, compiled: CompiledPrompt | None, system: str | None
    ) -> np.ndarray:
        """The full prompt ids (a registered prompt's ids first; the engine's prefix store finds
        their KV)."""
        if req.prompt_ids is not None:
            ids = req.prompt_ids
            vocab = self.info.vocab_size
            if _outside(ids, vocab):
                raise invalid(f"prompt token id outside the vocabulary [0, {vocab})", "prompt")
            if compiled is not None:
                ids = np.concatenate((compiled.ids, ids))
            return ids
        tok = self.tokenizer
        if req.messages is not None:
            text = self._render_chat(req, system)
        elif system:
            text = tok.render_system(system) + (req.prompt_text or "")
        else:
            text = req.prompt_text or ""
        return tok.encode_prompt(text)

    def _render_chat(self, req: Request, system: str | None) -> str:
        """The chat through the model's template: its own rendering of the tools and of calls
        and results in the history where it has one, else the tools as system text
        (``templates.system_prompt``) and the history as text (``templates.plain_history``).

        System messages after the first turn go to the template in place. When the template
        refuses a conversation holding system messages, they are merged into the user turns
        (``templates.merge_system``: the one rule, docs/http.md) and it renders again; a
        refusal of that, or of a conversation without system messages, is a 400 naming
        ``messages``."""
        assert req.messages is not None
        tok = self.tokenizer
        messages, tools = req.messages, req.tools
        if not tok.renders_tools:
            if tools:
                listed = templates.system_prompt(templates.tools_of_template(tools))
                system = f"{system}\n\n{listed}" if system else listed
            messages, tools = templates.plain_history(messages), None
        try:
            return tok.render_chat(messages, system, tools)
        except TemplateRefused as refused:
            if system is None and all(m["role"] != "system" for m in messages):
                raise invalid(str(refused), "messages") from None
        try:
            return tok.render_chat(templates.merge_system(messages, system), None, tools)
        except TemplateRefused as refused:
            raise invalid(str(refused), "messages") from None

    def _registered(self, req: Request) -> tuple[CompiledPrompt | None, str | None]:
        """The registered prompt the request names, and the system text to render."""
        system = req.system
        if req.prompt_id:
            compiled = self.prompts.by_id(req.prompt_id) if self.prompts is not None else None
            if compiled is None:
                raise Refusal(
                    ErrorCode.UNKNOWN_PROMPT,
                    f"no precompiled prompt {req.prompt_id}",
                    0,
                    "prompt_id",
                )
            if system is not None and system != compiled.text:
                raise invalid(
                    f"system differs from the text of prompt {req.prompt_id}; send one of them",
                    "system",
                )
            return compiled, compiled.text
        return None, system
