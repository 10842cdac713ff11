"""The door-neutral request: what every door (frames, OpenAI, Anthropic) parses its wire into.

A ``Request`` carries the fields as the client gave them, in the units the engine uses, its
sampling parameters as one ``SamplingParams`` (zerolayer.sampling_params); each door fills it
from its own wire format and zerolayer.request_path.validation checks its values, the same
rules for every door, before the request path sees it. Nothing here knows a wire format.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zerolayer.sampling_params import SamplingParams
from zerolayer.structured import Constraint

NO_STOP_IDS = np.empty(0, np.int32)  # the stop ids of a request without any (shared: read-only)
NO_STOP_IDS.flags.writeable = False


@dataclass(slots=True)
class Request:
    """A parsed request. Prompt ids are copied out of any receive buffer."""

    # None = as many as fit in the context beside the prompt (an API request that did not give
    # max_tokens); the input processor turns it into a number.
    max_tokens: int | None
    sampling: SamplingParams = SamplingParams()  # frozen: a door replaces it whole
    prompt_id: int = 0  # a registered prompt, 0 = none
    stop_ids: np.ndarray = field(default_factory=lambda: NO_STOP_IDS)  # int32
    prompt_ids: np.ndarray | None = None  # int32, when the prompt came as ids
    prompt_text: str | None = None  # raw text prompt
    # chat, in the chat-template convention gateway/zerolayer/http/tools.py describes (assistant
    # tool_calls, role "tool" results, a message's name beside role and content)
    messages: list[dict[str, Any]] | None = None
    system: str | None = None
    stop_sequences: tuple[str, ...] = ()
    ignore_eos: bool = False  # a stop rule: generate past EOS (vLLM's extension)
    want_text: bool = False  # the door wants text deltas
    use_cache: bool = True  # False: the response cache is neither read nor written (#29)
    n: int = 1  # choices generated from one prompt, [1, engine.max_n]: one prefill, n streams
    constraint: Constraint | None = None  # structured output (zerolayer.structured)
    # Tool definitions for the chat template (zerolayer.models.templates.template_tools' form); None
    # = none.
    tools: list[dict[str, Any]] | None = None
    # Prompt outputs (the engine's ``Sequence.pool`` / ``score``): an embedding of the prompt,
    # the logprob of each prompt id after the first with this many alternatives (-1 = none),
    # and whether the door returns the prompt with the answer (echo). A request with any of them
    # may have max_tokens 0: it ends after its prefill (``returns_prompt``).
    embed: bool = False
    prompt_logprobs: int = -1
    echo: bool = False
    # k inputs of one request (an embeddings batch: text or ids each), run as k sequences that
    # the hooks see as one request (zerolayer.request_path.lifecycle); None = the prompt fields.
    inputs: list[str | np.ndarray] | None = None
    # The request's own context, at most the engine's (Ollama's options.num_ctx): prompt and
    # generated tokens stay within it; None = the engine's max_context.
    context: int | None = None
    # A prompt longer than the context is cut to its first tokens instead of refused (Ollama's
    # /api/embed ``truncate``; only for a request that generates nothing, an embedding).
    truncate: bool = False

    @property
    def returns_prompt(self) -> bool:
        """Whether the answer is about the prompt itself, so that max_tokens may be 0."""
        return self.embed or self.echo
