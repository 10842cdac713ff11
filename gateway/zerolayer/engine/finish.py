"""The finish rules: whether and why a running row ends, decided in one place (``decide``).

A step notes which rules fired for each row, as bits of one number per row (``Rows.fired``, by
slot), each where its facts are: the engine notes a cancel; the rows (``Rows.advance``) note an
end-of-sequence id, a stop id and the last allowed token, and the grammar's completion or refusal
as the token is taken in; the text (``Sequence.text``) notes a stop string, or a failure. Then,
once per step (``Engine._update``), ``decide`` turns them into the step's endings: a row ends when
any rule fired, with the finish of the highest of them in ``PRECEDENCE``, and its sampled token
is produced (counted, delivered, its text written) unless one of the ``UNPRODUCED`` rules fired.
Nothing else chooses a running row's finish, and no finish is changed after it.

Precedence, highest first (tests/unit/test_finish.py pins the combinations a step can meet):

- CANCEL: the request path has already ended the stream (a CANCEL, a disconnect, a slow consumer,
  the drain deadline, a refusal or failure on the path: each reaches the engine as
  ``Engine.cancel``), so nothing the token says matters. It is noted in the update of the step
  the cancel arrived in (a prompt still prefilling gets no further chunk), so a row cancelled
  while the backend runs produces nothing more.
- STOP_STRING: a stop string is only ever found in text the row produced, this token's or text
  held back from earlier tokens (a partial match, or bytes of an unfinished UTF-8 character,
  flushed when the row ends), so the row ended there, at or before this token: before the rules
  about the token as a whole. With the last allowed token or a completed grammar it is STOP, as
  in vLLM (its output processor makes a stop string found in the text STOP whatever the engine
  core said) and llama.cpp (a stop word clears has_next_token before the limit is checked).
- FAILED (ERROR): the token could not be taken in (the grammar refused it: a bug, the mask allows
  only what the grammar accepts; or its text failed); it outranks the token's own rules.
- GRAMMAR_LIMIT (GRAMMAR_FAILED, engine-internal): the row's grammar exceeded its limits
  (zerolayer.structured.LIMITS) filling its mask or taking the token in, so the token is not
  taken in. It is the client's grammar, not the daemon, that failed: the request path answers
  INVALID_REQUEST naming the constraint's field (never INTERNAL), and only that row ends. Below
  FAILED, a failure of ours; above the token's own rules, which the grammar no longer judges.
- EOS, then STOP_ID: the token ends the row and is not produced, also when it is the last allowed
  token (vLLM's check_stop: EOS, then stop ids, then the length; llama.cpp checks EOS last, over
  the limit). A token that is both EOS and a stop id is EOS.
- GRAMMAR (STOP): the row's grammar is complete with this token, which is produced, also when it is
  the last allowed one. vLLM and llama.cpp have no such rule: a complete grammar there allows only
  EOS, which ends the row at the next token ("stop" on the OpenAI wire either way).
- LENGTH (MAX_TOKENS): the row's last allowed token (max_tokens, or the context); or the token
  that completes a grammar the row was steered to close as its tokens ran out
  (zerolayer.structured, budget steering: ``RowMatcher.budget_closed``), produced, which may
  come before the last allowed one: the reply is cut by its budget, its JSON complete.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from zerolayer.codes import FinishReason

NOT_FINISHED = -2  # a finish value: the row goes on (StepOutput.outputs' records)
# A finish value, engine-internal like NOT_FINISHED: the row's grammar exceeded its limits
# (the request path answers INVALID_REQUEST naming the constraint's field; never on the wire).
GRAMMAR_FAILED = -3

# The rules, as bits of a row's ``Rows.fired`` (uint8).
STOP_STRING = 1  # one of the row's stop sequences is in its text
FAILED = 2  # the token could not be taken in: the grammar refused it, or its text failed
EOS = 4  # an end-of-sequence id, unless the row ignores EOS
STOP_ID = 8  # one of the row's stop ids
GRAMMAR = 16  # the row's grammar is complete with this token
LENGTH = 32  # the row's last allowed token (max_tokens, or the context), or its steered close
CANCEL = 64  # Engine.cancel: the request path ended the stream
GRAMMAR_LIMIT = 128  # the row's grammar exceeded its limits (its mask or taking the token in)

# Each rule's finish, highest precedence first (the module docstring says why).
PRECEDENCE: tuple[tuple[int, int], ...] = (
    (CANCEL, FinishReason.CANCELLED),
    (STOP_STRING, FinishReason.STOP),
    (FAILED, FinishReason.ERROR),
    (GRAMMAR_LIMIT, GRAMMAR_FAILED),
    (EOS, FinishReason.EOS),
    (STOP_ID, FinishReason.STOP),
    (GRAMMAR, FinishReason.STOP),
    (LENGTH, FinishReason.MAX_TOKENS),
)

# Rules whose token is not produced: it is not counted, not delivered (NO_TOKEN), has no text,
# and the row's grammar does not take it in.
UNPRODUCED = CANCEL | FAILED | GRAMMAR_LIMIT | EOS | STOP_ID

# The finish of every set of rules: the highest rule's (index 0, no rule, is never read).
_FINISH: tuple[int, ...] = tuple(
    next((finish for rule, finish in PRECEDENCE if rules & rule), FinishReason.ERROR)
    for rules in range(1 << len(PRECEDENCE))
)


class Endings(NamedTuple):
    """The rows a step ends: their slots (ascending) and each one's finish (same order); and
    ``quiet``, the step's rows (positions in its decode rows) whose sampled token is not
    produced."""

    slots: list[int]
    finishes: list[int]  # a FinishReason, or GRAMMAR_FAILED
    quiet: list[int]


_NONE = Endings([], [], [])  # the endings of a step that ends no row (read-only: never changed)


def decide(fired: np.ndarray, decoded: slice | np.ndarray | None) -> Endings:
    """The step's endings, from the rules that fired for each row (``fired``: uint8 by slot,
    0 for a row that goes on); ``decoded`` indexes the slots that sampled a token in this step,
    in the step's row order (None: none did)."""
    if not np.count_nonzero(fired):  # the usual step: no ufunc reduction set up
        return _NONE
    slots = np.flatnonzero(fired)
    quiet = [] if decoded is None else np.flatnonzero(fired[decoded] & UNPRODUCED).tolist()
    return Endings(slots.tolist(), [_FINISH[r] for r in fired[slots].tolist()], quiet)
