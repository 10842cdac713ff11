"""What one engine step hands out: ``StepOutput``, the only thing the engine delivers.

A step's rows are the decoding rows in slot order, the rows whose prompt finished its prefill
in this step included (``joined``: they produced their first token). Per row: the owner, the
token id it produced (``NO_TOKEN`` when the token ended its row unproduced: EOS, a stop id, a
cancel, a failure; zerolayer.engine.finish), how many tokens it has produced so far, and, for
rows that detokenize, its text delta. Besides the rows: the sequences that ended in this step and
why, each with its final token count (a sequence may end without a row: cancelled, refused at
admission, failed). Rows that asked for
logprobs have their ``Logprobs`` (gateway/zerolayer/engine/sampling.py says of which distribution).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from zerolayer.codes import FinishReason
from zerolayer.engine.finish import NOT_FINISHED

NO_TOKEN = -1
FINISH_ERROR = FinishReason.ERROR  # a sequence ended in an engine failure (the door: INTERNAL)
_NO_IDS = np.empty(0, np.int32)
_NO_IDS.flags.writeable = False


class Finished(NamedTuple):
    """A sequence that ended: its owner, how (a FinishReason), when it got its slot
    (perf_counter; 0 when it never did), how many tokens it produced and which (read-only;
    None when it never had a slot)."""

    owner: object
    finish: int
    t_admit: float
    n_tokens: int
    ids: np.ndarray | None


class Logprobs(NamedTuple):
    """One row's logprobs for the token it produced this step: the token's own, and the
    ``top_logprobs`` most likely alternatives (ids and logprobs, descending; empty arrays when
    the row asked for none)."""

    token: float
    top_ids: np.ndarray  # int32 [k]
    top: np.ndarray  # float32 [k]


class Output(NamedTuple):
    """One row's step as a record (``StepOutput.outputs``: for tests and tools)."""

    owner: object
    token: int
    text: str
    finish: int


@dataclass(slots=True)
class StepOutput:
    """One step's result (see the module docstring). ``owners`` is the same list object for
    consecutive steps whose rows are the same, so a consumer may keep per-row work keyed on
    it. The arrays are read-only."""

    owners: list[object] = field(default_factory=list)
    tokens: np.ndarray = field(default_factory=lambda: _NO_IDS)  # int32 [rows]
    counts: np.ndarray = field(default_factory=lambda: _NO_IDS)  # int32 [rows]
    joined: list[int] = field(default_factory=list)  # rows that produced their first token
    text: dict[int, str] = field(default_factory=dict)  # row → text delta (detokenizing rows)
    quiet: list[int] = field(default_factory=list)  # rows that produced no token
    logprobs: dict[int, Logprobs] = field(default_factory=dict)  # row → (rows that asked)
    finished: list[Finished] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.owners or self.finished)

    def outputs(self) -> list[Output]:
        """Each row's step (its finish when it ended), then endings without a row."""
        finish = {id(f.owner): f.finish for f in self.finished}
        out = [
            Output(owner, token, self.text.get(i, ""), finish.pop(id(owner), NOT_FINISHED))
            for i, (owner, token) in enumerate(zip(self.owners, self.tokens.tolist(), strict=True))
        ]
        out += [
            Output(f.owner, NO_TOKEN, "", f.finish) for f in self.finished if id(f.owner) in finish
        ]
        return out
