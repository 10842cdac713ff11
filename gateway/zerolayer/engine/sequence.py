"""One generation request as the engine sees it, and its text: detokenizing and stop sequences.

The counters of a running sequence (tokens produced, position, last token) are not here: they
live in the engine's rows (zerolayer.engine.rows), by slot. What is here is what only one
sequence can do for itself: turn its tokens into UTF-8-safe text deltas, hold back text that
may start a stop sequence, and find one (whether that ends the row, and why, is decided with the
other finish rules: zerolayer.engine.finish); and gather its prompt outputs chunk by chunk (an
embedding: ``pooled``; prompt logprobs: ``prompt_logprobs``), which the engine thread writes
before the step that completes the prompt is handed out, and the door reads after it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from zerolayer.engine.types import PrefillChunk, PromptLogprobs
from zerolayer.sampling_params import SamplingParams
from zerolayer.tokenizer import Detokenizer

if TYPE_CHECKING:
    from zerolayer.structured import Grammar


class Sequence:
    """One generation request. ``owner`` is opaque (the request path's stream)."""

    __slots__ = ("owner", "prompt", "max_tokens", "sampling", "stop_ids", "stop_sequences",
                 "detok", "reused", "slot", "prefilled", "held", "cancelled", "t_admit",
                 "ignore_eos", "fair_key", "weight", "principal_class", "matched_stop", "_max_stop",
                 "grammar", "grammar_error", "choices", "parent", "pool", "score", "pooled",
                 "prompt_logprobs", "_scored", "recompute", "waited")  # fmt: skip

    def __init__(
        self,
        owner: object,
        prompt: np.ndarray,
        max_tokens: int,
        sampling: SamplingParams,
        stop_ids: frozenset[int] = frozenset(),
        stop_sequences: tuple[str, ...] = (),
        detokenizer: Detokenizer | None = None,
        ignore_eos: bool = False,
        fair_key: object = None,
        grammar: Grammar | None = None,
        weight: int = 1,
        principal_class: str = "default",
        pool: bool = False,
        score: int = -1,
    ) -> None:
        self.owner = owner
        self.prompt = prompt  # int32 [n]: the whole prompt
        self.max_tokens = max_tokens
        self.sampling = sampling
        self.stop_ids = stop_ids
        self.stop_sequences = stop_sequences
        self.detok = detokenizer  # None = no text wanted and no stop sequences
        self.reused = 0  # leading prompt positions whose KV came from the prefix store
        self.slot = -1
        self.prefilled = 0  # prompt ids in the cache so far (the reused ones included)
        self.held = ""  # text withheld because it may start a stop sequence
        self.cancelled = False
        self.t_admit = 0.0
        self.ignore_eos = ignore_eos  # generate past EOS (vLLM's extension, HTTP only)
        self.fair_key = fair_key  # sequences sharing a key share one turn at admission
        self.weight = weight  # the fair_key's weight in the share of the rows (admission.py)
        self.principal_class = principal_class  # the metrics' label for its principal
        self.matched_stop: str | None = None  # the stop sequence that ended it (finish STOP)
        self._max_stop = max(map(len, stop_sequences)) if stop_sequences else 0
        self.grammar = grammar  # structured output: the row's matcher is made at admission
        self.grammar_error = ""  # why its grammar exceeded its limits (finish GRAMMAR_FAILED)
        # n > 1: the first choice carries the others (``choices``), which start from its prompt's
        # KV once it is prefilled; each of those has ``parent`` set (zerolayer.engine.engine).
        self.choices: list[Sequence] = []
        self.parent: Sequence | None = None
        # Prompt outputs (they need every prompt position computed: no prefix store KV).
        self.pool = pool  # the embedding: ``pooled``, float32 [hidden], unit length
        self.score = score  # >= 0: ``prompt_logprobs`` with this many alternatives each
        self.pooled: np.ndarray | None = None
        self.prompt_logprobs: PromptLogprobs | None = None  # of prompt[1:]
        self._scored: list[PromptLogprobs] = []
        # Preempted after its prompt (zerolayer.engine.engine): the ids whose KV it prefills
        # again (prompt + produced but the last), sampling nothing; None otherwise.
        self.recompute: np.ndarray | None = None
        self.waited = False  # it waited for KV pages at admission (counted once)

    @property
    def kv_ids(self) -> np.ndarray:
        """The ids its prefill writes: the prompt, or what a preempted row recomputes."""
        return self.prompt if self.recompute is None else self.recompute

    def restart_prompt(self) -> None:
        """Preempted before its prompt completed: the prompt prefills again from the start,
        its prompt outputs gathered again."""
        self.prefilled = 0
        self.pooled = None
        self._scored = []

    @property
    def prompt_outputs(self) -> bool:
        return self.pool or self.score >= 0

    def take_prompt_outputs(self, chunk: PrefillChunk) -> None:
        """Add a prefilled chunk's outputs; on the prompt's last chunk, the embedding is the
        states' sum L2-normalised (the mean's direction: the mean and the sum differ by a
        factor the normalising removes) and the chunks' logprobs are joined."""
        if chunk.pooled is not None:
            self.pooled = chunk.pooled if self.pooled is None else self.pooled + chunk.pooled
        if chunk.scored is not None:
            self._scored.append(chunk.scored)
        if chunk.last:
            if self.pooled is not None:
                norm = float(np.linalg.norm(self.pooled))
                self.pooled = self.pooled / norm if norm > 0 else self.pooled
            if self._scored:
                self.prompt_logprobs = PromptLogprobs.join(self._scored)
                self._scored = []

    def text(self, token: int | None, last: bool) -> tuple[str, bool]:
        """The text delta of ``token`` (None: the step's token is not produced, so it has no
        text), and whether a stop sequence was found (the delta then ends before it). ``last``:
        the row ends in this step whatever its text says, so the text held back comes out (the
        detokenizer's unfinished bytes and a partial stop sequence), scanned for a stop sequence
        as well."""
        assert self.detok is not None
        text = ""
        if token is not None:
            text = self.detok.push(token)
            if self.stop_sequences:
                text, hit = self._scan_stops(text)
                if hit:
                    return text, True
        if last:
            return self._flush(text)
        return text, False

    def _flush(self, text: str) -> tuple[str, bool]:
        """The row ends: ``text`` and whatever the detokenizer and the stop scan held, and
        whether a stop sequence is in it."""
        assert self.detok is not None
        rest = self.detok.flush()
        hit = False
        if self.stop_sequences:
            rest, hit = self._scan_stops(rest)
            text += rest + ("" if hit else self.held)
        else:
            text += rest
        self.held = ""
        return text, hit

    def _scan_stops(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop sequence matched). Text that could be the
        start of a stop sequence is held back until the next token decides."""
        candidate = self.held + text
        cut = -1
        for stop in self.stop_sequences:
            i = candidate.find(stop)
            if i != -1 and (cut == -1 or i < cut):
                cut = i
                self.matched_stop = stop  # the earliest match; at a tie, the first listed
        if cut != -1:
            self.held = ""
            return candidate[:cut], True
        keep = 0
        for k in range(min(len(candidate), self._max_stop - 1), 0, -1):
            tail = candidate[-k:]
            if any(stop.startswith(tail) for stop in self.stop_sequences):
                keep = k
                break
        self.held = candidate[len(candidate) - keep :] if keep else ""
        return candidate[: len(candidate) - keep], False
