"""Per-row token sampling over a [rows, vocab] logits batch, each row with its own parameters.

A step goes, per row (the order vLLM's sampler uses):

1. the allowed-token mask (a grammar's bitmask, ``Processing.allowed``);
2. ``min_tokens``: the row's EOS/stop ids masked (``Processing.banned``) — unless that would leave
   the row nothing the grammar allows (a finished grammar must be able to end);
3. ``logit_bias`` added (sparse per row);
4. ``repetition_penalty``, Hugging Face semantics over prompt + output tokens: a seen token's
   logit is divided by the penalty when positive, multiplied when negative;
5. ``frequency_penalty`` and ``presence_penalty``, OpenAI semantics over output tokens only:
   ``logit -= count * frequency + (count > 0) * presence``;
6. temperature, then top-k, then top-p over the renormalised top-k distribution (as Hugging Face
   generate does); greedy rows (temperature <= 0) take the argmax of the processed logits.

Logprobs (``Processing.logprobs``) are ``log_softmax(processed / T)``: after steps 1-5 and the
row's temperature (T = 1 for a greedy row), before the top-k/top-p truncation — the distribution
the row samples from, before its tail is cut. This is vLLM's ``processed_logprobs`` choice, not
its default ``raw_logprobs``; a row without penalties, bias or grammar at temperature 1 gets the
model's own log-probabilities.

Randomness: every draw is one uniform ``u`` in [0, 1) per row, turned into a token by inverse-CDF
over the row's filtered distribution (sorted by descending probability, ties by token id). A
seeded row takes ``u`` from a counter-based hash of (seed, position) alone: its own seed stream,
stateless, so its tokens never depend on which other rows share the batch, on how many tokens
other requests drew before it, or on a row-by-row retry. ``child_seed`` gives the n sequences of
one request n independent streams. Unseeded rows take ``u`` from the sampler's process RNG.

Penalties need per-slot token counts: ``TokenCounts``, owned by the ``Sampler``, started at a
row's admission (``Sampler.start_row``) and advanced by every sampled token of a penalised row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser applied to ``x + golden``, elementwise on uint64 (wrapping)."""
    z = np.asarray(x, dtype=np.uint64) + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def seeded_uniform(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """float64 [b] uniforms in [0, 1), a pure function of each row's (seed, position)."""
    seeds = np.asarray(seeds, dtype=np.uint64)
    positions = np.asarray(positions, dtype=np.int64).astype(np.uint64)
    bits = splitmix64(splitmix64(seeds) ^ positions)
    # Top 53 bits: every value is an exact float64 in [0, 1).
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def sample_with_uniforms(
    logits: torch.Tensor,  # [b, vocab]
    temperature: torch.Tensor,  # [b] float; <= 0 means greedy
    top_k: torch.Tensor,  # [b] int; 0 = off
    top_p: torch.Tensor,  # [b] float; >= 1 = off
    uniforms: torch.Tensor,  # [b] float64 in [0, 1); ignored for greedy rows
) -> torch.Tensor:
    """Token ids [b] int64. Order of filters: temperature, then top-k, then top-p over the
    renormalised top-k distribution (the order Hugging Face generate uses)."""
    out = torch.argmax(logits, dim=-1)
    rows = torch.nonzero(temperature > 0).flatten()
    if rows.numel() == 0:
        return out
    # Float64 keeps the cumulative sums stable; each row's math touches only that row.
    x = logits[rows].double() / temperature[rows].double()[:, None]
    x, order = torch.sort(x, dim=-1, descending=True, stable=True)  # [r, vocab]
    vocab = x.shape[-1]
    rank = torch.arange(vocab)[None, :]
    k = top_k[rows].long()
    k = torch.where(k > 0, k.clamp(max=vocab), torch.full_like(k, vocab))
    x = x.masked_fill(rank >= k[:, None], float("-inf"))
    probs = torch.softmax(x, dim=-1)
    # top-p keeps the smallest prefix whose mass reaches p: a token stays if the mass strictly
    # before it is below p. The first token always stays.
    before = torch.cumsum(probs, dim=-1) - probs
    keep = (before < top_p[rows].double()[:, None]) | (rank == 0)
    probs = probs.masked_fill(~keep, 0.0)
    cdf = torch.cumsum(probs, dim=-1)
    target = uniforms[rows].double() * cdf[:, -1]
    idx = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)
    # Rounding can put target at the very end; tokens with probability left are a prefix of the
    # sorted order, so clamp into that prefix.
    idx = torch.minimum(idx, (probs > 0).sum(dim=-1) - 1)
    out[rows] = order.gather(1, idx[:, None]).squeeze(1)
    return out


def child_seed(seed: int, index: int) -> int:
    """The seed of sequence ``index`` of an n > 1 request seeded with ``seed``: index 0 keeps
    ``seed`` (so n = 1 is unchanged), the others get independent streams."""
    if index == 0:
        return seed
    mixed = splitmix64(np.array([seed ^ (index * 0x9E3779B97F4A7C15 & (2**64 - 1))], np.uint64))
    return int(mixed[0])


@dataclass(slots=True)
class SparseRows:
    """(row, token id, value) triples over one batch: rows' logit_bias, or ids to mask."""

    rows: np.ndarray  # int64 [n]: row index in the batch
    ids: np.ndarray  # int64 [n]
    values: np.ndarray  # float32 [n]; unused for a mask

    @classmethod
    def from_rows(cls, per_row: Sequence[Mapping[int, float] | Sequence[int] | None]) -> SparseRows:
        """From one mapping (id -> value) or id sequence (value 0) per row; None = nothing."""
        rows: list[int] = []
        ids: list[int] = []
        values: list[float] = []
        for r, entry in enumerate(per_row):
            if not entry:
                continue
            items = entry.items() if isinstance(entry, Mapping) else ((i, 0.0) for i in entry)
            for token, value in items:
                rows.append(r)
                ids.append(int(token))
                values.append(float(value))
        return cls(np.array(rows, np.int64), np.array(ids, np.int64), np.array(values, np.float32))

    def __len__(self) -> int:
        return int(self.rows.shape[0])


@dataclass(slots=True)
class Processing:
    """The per-row logits processing of one batch: arrays of length b, None = off for every row.

    ``slots`` (the rows' slots in the sampler's ``TokenCounts``) is required when any penalty is
    set. ``allowed`` is a grammar bitmask, int32 [b, ceil(vocab / 32)], bit ``i`` of word ``j``
    allowing token ``32 j + i`` (the layout xgrammar and llguidance fill); ``constrained`` says
    which rows it applies to (other rows' words are ignored). ``logprobs`` is the number of
    alternatives a row wants (0..20), -1 for none.
    """

    slots: np.ndarray | None = None  # int [b]
    presence: np.ndarray | None = None  # float32 [b]; 0 = off
    frequency: np.ndarray | None = None  # float32 [b]; 0 = off
    repetition: np.ndarray | None = None  # float32 [b]; 1 = off
    bias: SparseRows | None = None
    banned: SparseRows | None = None
    allowed: torch.Tensor | None = None  # int32 [b, words]
    constrained: np.ndarray | None = None  # bool [b]
    logprobs: np.ndarray | None = None  # int32 [b]

    def penalised(self) -> np.ndarray | None:
        """bool [b]: rows with any penalty on, or None when there is none in the batch."""
        on = None
        for arr, off in ((self.presence, 0.0), (self.frequency, 0.0), (self.repetition, 1.0)):
            if arr is not None:
                row_on = np.asarray(arr) != off
                on = row_on if on is None else on | row_on
        return on if on is not None and on.any() else None


@dataclass(slots=True)
class Sampled:
    """What one batch sampled: ids, and for rows that asked, the sampled token's logprob and the
    top alternatives (``top_ids``/``top_logprobs`` have as many columns as the batch's largest
    request; a row uses its own first k)."""

    ids: np.ndarray  # int32 [b]
    logprob: np.ndarray | None = None  # float32 [b]; nan for rows that did not ask
    top_ids: np.ndarray | None = None  # int32 [b, k]
    top_logprobs: np.ndarray | None = None  # float32 [b, k]


class TokenCounts:
    """Per slot: each token's count in the output, and whether it appeared in prompt or output.

    Dense [slots, vocab] tensors (int32 and bool), allocated on first use; a slot's row is only
    meaningful after ``start`` for the sequence now in it.
    """

    def __init__(self, num_slots: int, vocab: int) -> None:
        self.output = torch.zeros(num_slots, vocab, dtype=torch.int32)
        self.seen = torch.zeros(num_slots, vocab, dtype=torch.bool)

    def start(self, slot: int, prompt: np.ndarray) -> None:
        """A new sequence in ``slot``: no output yet, the prompt's ids seen."""
        self.output[slot].zero_()
        self.seen[slot].zero_()
        ids = torch.from_numpy(np.asarray(prompt, dtype=np.int64))
        self.seen[slot, ids] = True

    def copy(self, src: int, dst: int) -> None:
        """``dst`` continues from ``src``'s counts (the n sequences of one prompt)."""
        self.output[dst] = self.output[src]
        self.seen[dst] = self.seen[src]

    def add(self, slots: np.ndarray, tokens: np.ndarray) -> None:
        """One sampled token per slot (distinct slots)."""
        s = torch.from_numpy(np.asarray(slots, dtype=np.int64))
        t = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
        self.output.index_put_((s, t), torch.ones_like(s, dtype=torch.int32), accumulate=True)
        self.seen[s, t] = True


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [r, vocab] from an int32 [r, words] bitmask (bit i of word j = token 32 j + i)."""
    bits = torch.arange(32, dtype=torch.int32)
    allowed = (bitmask.to(torch.int32)[:, :, None] >> bits) & 1
    return allowed.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def process_logits(
    logits: torch.Tensor, proc: Processing, counts: TokenCounts | None
) -> torch.Tensor:
    """Steps 1-5 of the module docstring: float32 [b, vocab] processed logits (a new tensor)."""
    x = logits.float().clone()
    b, vocab = x.shape
    keep = None
    if proc.allowed is not None and proc.constrained is not None and proc.constrained.any():
        keep = torch.ones(b, vocab, dtype=torch.bool)
        rows = torch.from_numpy(np.flatnonzero(proc.constrained))
        keep[rows] = unpack_bitmask(proc.allowed[rows], vocab)
    if proc.banned is not None and len(proc.banned):
        grammar = keep
        keep = torch.ones(b, vocab, dtype=torch.bool) if grammar is None else grammar.clone()
        keep[torch.from_numpy(proc.banned.rows), torch.from_numpy(proc.banned.ids)] = False
        dead = ~keep.any(dim=-1)
        if bool(dead.any()):  # the grammar allows only stop ids: let it end
            keep[dead] = True if grammar is None else grammar[dead]
    if keep is not None:
        x.masked_fill_(~keep, float("-inf"))
    if proc.bias is not None and len(proc.bias):
        x.index_put_(
            (torch.from_numpy(proc.bias.rows), torch.from_numpy(proc.bias.ids)),
            torch.from_numpy(proc.bias.values),
            accumulate=True,
        )
    if proc.penalised() is None:
        return x
    if counts is None or proc.slots is None:
        raise ValueError("penalties need the rows' slots and token counts")
    slots = torch.from_numpy(np.asarray(proc.slots, dtype=np.int64))
    if proc.repetition is not None:
        p = torch.from_numpy(np.asarray(proc.repetition, dtype=np.float32))[:, None]
        seen = counts.seen[slots] & (p != 1.0)
        x = torch.where(seen, torch.where(x > 0, x / p, x * p), x)
    if proc.frequency is not None or proc.presence is not None:
        c = counts.output[slots].float()
        if proc.frequency is not None:
            x -= torch.from_numpy(np.asarray(proc.frequency, dtype=np.float32))[:, None] * c
        if proc.presence is not None:
            pres = torch.from_numpy(np.asarray(proc.presence, dtype=np.float32))[:, None]
            x -= pres * (c > 0).float()
    return x


def gather_logprobs(
    processed: torch.Tensor, temperature: np.ndarray, ids: np.ndarray, want: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(logprob [b], top_ids [b, k], top_logprobs [b, k]) of ``log_softmax(processed / T)`` for
    the rows with ``want >= 0`` (others: nan / -1); k is the largest ``want``."""
    b = processed.shape[0]
    k = int(max(0, want.max()))
    logprob = np.full(b, np.nan, np.float32)
    top_ids = np.full((b, k), -1, np.int32)
    top_lp = np.full((b, k), np.nan, np.float32)
    rows = np.flatnonzero(want >= 0)
    t = np.asarray(temperature, dtype=np.float32)[rows]
    t = torch.from_numpy(np.where(t > 0, t, 1.0).astype(np.float32))[:, None]
    lp = torch.log_softmax(processed[torch.from_numpy(rows)] / t, dim=-1)
    chosen = torch.from_numpy(np.asarray(ids, dtype=np.int64)[rows])[:, None]
    logprob[rows] = lp.gather(1, chosen).squeeze(1).numpy()
    if k:
        values, idx = torch.topk(lp, k, dim=-1)  # sorted, descending
        top_ids[rows] = idx.numpy().astype(np.int32)
        top_lp[rows] = values.numpy()
    return logprob, top_ids, top_lp


class Sampler:
    """Samples a batch of rows; owns the RNG for unseeded rows and the penalties' token counts."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = np.random.default_rng(seed)
        self.counts: TokenCounts | None = None

    def start_row(self, slot: int, prompt: np.ndarray, num_slots: int, vocab: int) -> None:
        """A penalised sequence enters ``slot`` with ``prompt``: its counts start there."""
        if self.counts is None:
            self.counts = TokenCounts(num_slots, vocab)
        self.counts.start(slot, prompt)

    def copy_row(self, src: int, dst: int) -> None:
        """``dst`` (another of the n sequences of ``src``'s prompt) starts from ``src``'s counts."""
        if self.counts is not None:
            self.counts.copy(src, dst)

    def sample(
        self,
        logits: torch.Tensor,  # [b, vocab]
        temperature: np.ndarray,  # float32 [b]
        top_k: np.ndarray,  # int32 [b]
        top_p: np.ndarray,  # float32 [b]
        seeds: np.ndarray,  # uint64 [b]
        seeded: np.ndarray,  # bool [b]
        positions: np.ndarray,  # int [b]: position of the token being sampled
    ) -> np.ndarray:
        """Sampled token ids, int32 [b], without any processing."""
        return self.sample_processed(
            logits, temperature, top_k, top_p, seeds, seeded, positions, None
        ).ids

    def sample_processed(
        self,
        logits: torch.Tensor,  # [b, vocab]
        temperature: np.ndarray,  # float32 [b]
        top_k: np.ndarray,  # int32 [b]
        top_p: np.ndarray,  # float32 [b]
        seeds: np.ndarray,  # uint64 [b]
        seeded: np.ndarray,  # bool [b]
        positions: np.ndarray,  # int [b]
        proc: Processing | None,
    ) -> Sampled:
        """The module docstring's steps; penalised rows' counts advance by their sampled token."""
        if proc is not None:
            logits = process_logits(logits, proc, self.counts)
        seeded = np.asarray(seeded, dtype=bool)
        uniforms = self._rng.random(len(seeded))
        if seeded.any():
            uniforms[seeded] = seeded_uniform(
                np.asarray(seeds)[seeded], np.asarray(positions)[seeded]
            )
        ids = sample_with_uniforms(
            logits,
            torch.from_numpy(np.asarray(temperature, dtype=np.float32)),
            torch.from_numpy(np.asarray(top_k, dtype=np.int64)),
            torch.from_numpy(np.asarray(top_p, dtype=np.float32)),
            torch.from_numpy(uniforms),
        )
        out = Sampled(ids.numpy().astype(np.int32))
        if proc is None:
            return out
        penalised = proc.penalised()
        if penalised is not None and self.counts is not None and proc.slots is not None:
            self.counts.add(np.asarray(proc.slots)[penalised], out.ids[penalised])
        if proc.logprobs is not None and (np.asarray(proc.logprobs) >= 0).any():
            out.logprob, out.top_ids, out.top_logprobs = gather_logprobs(
                logits, temperature, out.ids, np.asarray(proc.logprobs)
            )
        return out
