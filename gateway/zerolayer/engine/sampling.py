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
6. temperature; then min-p, which drops the tokens whose probability (after the temperature) is
   below ``min_p`` times the top token's (as vLLM, llama.cpp and Ollama do); then top-k, then
   top-p over the renormalised distribution that is left (as Hugging Face generate does); greedy
   rows (temperature <= 0) take the argmax of the processed logits.

Logprobs (``Processing.logprobs``) are ``log_softmax(processed / T)``: after steps 1-5 and the
row's temperature (T = 1 for a greedy row), before the min-p/top-k/top-p truncation — the
distribution the row samples from, before its tail is cut. This is vLLM's ``processed_logprobs``
choice, not its default ``raw_logprobs``; a row without penalties, bias or grammar at
temperature 1 gets the model's own log-probabilities.

Randomness: every draw is one uniform ``u`` in [0, 1) per row, turned into a token by inverse-CDF
over the row's filtered distribution (sorted by descending probability, ties by token id). A
seeded row takes ``u`` from a counter-based hash of (seed, position) alone: its own seed stream,
stateless, so its tokens never depend on which other rows share the batch, on how many tokens
other requests drew before it, or on a row-by-row retry. ``child_seed`` gives the n sequences of
one request n independent streams (defined in ``zerolayer.kernels.splitmix``, where the request
path, which imports no torch, takes it from). Unseeded rows take ``u`` from the sampler's process
RNG.

Penalties need each row's token counts: ``Processing.counts`` (a token's count in the row's
output) and ``Processing.seen`` (in its prompt or output), given with the batch. The sampler keeps
no per-row state: the engine's rows (``zerolayer.engine.rows``) own the counts, advanced where a
row's sampled token is taken in, so one place knows what a row produced.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from zerolayer.kernels.splitmix import child_seed as child_seed  # named with the seed streams
from zerolayer.kernels.splitmix import splitmix64
from zerolayer.sampling_params import SamplingParams, sampling_rows


def seeded_uniform(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """float64 [b] uniforms in [0, 1), a pure function of each row's (seed, position)."""
    seeds = np.asarray(seeds, dtype=np.uint64)
    positions = np.asarray(positions, dtype=np.int64).astype(np.uint64)
    bits = splitmix64(splitmix64(seeds) ^ positions)
    # Top 53 bits: every value is an exact float64 in [0, 1).
    out: np.ndarray = (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
    return out


def sample_with_uniforms(
    logits: torch.Tensor,  # [b, vocab]
    temperature: torch.Tensor,  # [b] float; <= 0 means greedy
    top_k: torch.Tensor,  # [b] int; 0 = off
    top_p: torch.Tensor,  # [b] float; >= 1 = off
    min_p: torch.Tensor,  # [b] float; 0 = off
    uniforms: torch.Tensor,  # [b] float64 in [0, 1); ignored for greedy rows
) -> torch.Tensor:
    """Token ids [b] int64. Order of filters: temperature, min-p, top-k, then top-p over the
    renormalised distribution left (the module docstring's step 6)."""
    out = torch.argmax(logits, dim=-1)
    rows = torch.nonzero(temperature > 0).flatten()
    if rows.numel() == 0:
        return out
    # Float64 keeps the cumulative sums stable; each row's math touches only that row.
    x = logits[rows].double() / temperature[rows].double()[:, None]
    x, order = torch.sort(x, dim=-1, descending=True, stable=True)  # [r, vocab]
    vocab = x.shape[-1]
    rank = torch.arange(vocab)[None, :]
    p_min = min_p[rows].double()
    if bool((p_min > 0).any()):
        # min-p keeps a token when p_i >= min_p * p_top, i.e. x_i - x_top >= log(min_p) on the
        # tempered logits (log 0 = -inf keeps every token; the top token always stays).
        x = x.masked_fill(x - x[:, :1] < torch.log(p_min)[:, None], float("-inf"))
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

    @classmethod
    def from_arrays(cls, per_row: Sequence[tuple[np.ndarray, np.ndarray] | None]) -> SparseRows:
        """From one (ids int64, values float32) pair per row, None = nothing: array operations
        only (a row's pairs are made once, when it is admitted), whatever the entries."""
        present = [(r, pair) for r, pair in enumerate(per_row) if pair is not None]
        if not present:
            return cls(np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.float32))
        lengths = np.array([len(pair[0]) for _, pair in present], np.int64)
        rows = np.repeat(np.array([r for r, _ in present], np.int64), lengths)
        ids = np.concatenate([pair[0] for _, pair in present])
        values = np.concatenate([pair[1] for _, pair in present])
        return cls(rows, ids.astype(np.int64, copy=False), values.astype(np.float32, copy=False))

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def select(self, row: int) -> SparseRows:
        """Row ``row``'s entries, as the only row of a batch of one."""
        keep = self.rows == row
        return SparseRows(np.zeros(int(keep.sum()), np.int64), self.ids[keep], self.values[keep])


@dataclass(slots=True)
class Processing:
    """The per-row logits processing of one batch: arrays of length b, None = off for every row.

    ``counts`` and ``seen`` (int32 / bool [b, vocab]: each token's count in the row's output, and
    whether it is in its prompt or output) are required when any penalty is set. ``allowed`` is a
    grammar bitmask, int32 [b, ceil(vocab / 32)], bit ``i`` of word ``j``
    allowing token ``32 j + i`` (the layout xgrammar and llguidance fill); ``constrained`` says
    which rows it applies to (other rows' words are ignored). ``logprobs`` is the number of
    alternatives a row wants (0..20), -1 for none. ``sampled`` is the sampler's result for this
    batch (``Sampler.sample`` writes it), where the caller reads the logprobs.
    """

    counts: np.ndarray | None = None  # int32 [b, vocab]
    seen: np.ndarray | None = None  # bool [b, vocab]
    presence: np.ndarray | None = None  # float32 [b]; 0 = off
    frequency: np.ndarray | None = None  # float32 [b]; 0 = off
    repetition: np.ndarray | None = None  # float32 [b]; 1 = off
    bias: SparseRows | None = None
    banned: SparseRows | None = None
    allowed: torch.Tensor | np.ndarray | None = None  # int32 [b, words]
    constrained: np.ndarray | None = None  # bool [b]
    logprobs: np.ndarray | None = None  # int32 [b]
    sampled: Sampled | None = None

    def select(self, row: int) -> Processing:
        """Row ``row`` alone, as a batch of one (a failed batch retried row by row)."""
        one = slice(row, row + 1)

        def cut(arr: np.ndarray | None) -> np.ndarray | None:
            return None if arr is None else np.asarray(arr)[one]

        return Processing(
            counts=cut(self.counts), seen=cut(self.seen), presence=cut(self.presence),
            frequency=cut(self.frequency), repetition=cut(self.repetition),
            bias=None if self.bias is None else self.bias.select(row),
            banned=None if self.banned is None else self.banned.select(row),
            allowed=None if self.allowed is None else self.allowed[one],
            constrained=cut(self.constrained), logprobs=cut(self.logprobs),
        )  # fmt: skip

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


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [r, vocab] from an int32 [r, words] bitmask (bit i of word j = token 32 j + i)."""
    bits = torch.arange(32, dtype=torch.int32)
    allowed = (bitmask.to(torch.int32)[:, :, None] >> bits) & 1
    return allowed.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def process_logits(logits: torch.Tensor, proc: Processing) -> torch.Tensor:
    """Steps 1-5 of the module docstring: float32 [b, vocab] processed logits. ``logits`` is
    never written: it is copied once before the first change, and returned as it is (float32)
    when nothing changes it (rows that only want logprobs)."""
    x = logits.float()
    if x is logits and _changes_logits(proc):
        x = x.clone()
    b, vocab = x.shape
    keep = None
    if proc.allowed is not None and proc.constrained is not None and proc.constrained.any():
        keep = torch.ones(b, vocab, dtype=torch.bool)
        rows = torch.from_numpy(np.flatnonzero(proc.constrained))
        keep[rows] = unpack_bitmask(torch.as_tensor(proc.allowed)[rows], vocab)
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
    if proc.counts is None or proc.seen is None:
        raise ValueError("penalties need the rows' token counts")
    if proc.repetition is not None:
        p = torch.from_numpy(np.asarray(proc.repetition, dtype=np.float32))[:, None]
        seen = torch.from_numpy(proc.seen) & (p != 1.0)
        x = torch.where(seen, torch.where(x > 0, x / p, x * p), x)
    if proc.frequency is not None or proc.presence is not None:
        c = torch.from_numpy(proc.counts).float()
        if proc.frequency is not None:
            x -= torch.from_numpy(np.asarray(proc.frequency, dtype=np.float32))[:, None] * c
        if proc.presence is not None:
            pres = torch.from_numpy(np.asarray(proc.presence, dtype=np.float32))[:, None]
            x -= pres * (c > 0).float()
    return x


def _changes_logits(proc: Processing) -> bool:
    """Whether steps 1-5 change anything for this batch."""
    return (
        (proc.allowed is not None and proc.constrained is not None and bool(proc.constrained.any()))
        or (proc.banned is not None and len(proc.banned) > 0)
        or (proc.bias is not None and len(proc.bias) > 0)
        or proc.penalised() is not None
    )


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
    temps = np.asarray(temperature, dtype=np.float32)[rows]
    # The whole batch at once: one log_softmax (torch's fused kernel: on CPU cheaper than a
    # logsumexp, which runs max, subtract, exp, sum and log as passes of their own), one top-k
    # and one gather over the rows that asked; no copy of the rows when all of them did.
    x = processed if len(rows) == processed.shape[0] else processed[torch.from_numpy(rows)]
    t = np.where(temps > 0, temps, 1.0).astype(np.float32)  # greedy rows: T = 1
    if bool((t != 1.0).any()):  # a [rows, vocab] division only when a row is tempered
        x = x / torch.from_numpy(t)[:, None]
    lp = torch.log_softmax(x, dim=-1)
    chosen = torch.from_numpy(np.asarray(ids, dtype=np.int64)[rows])[:, None]
    logprob[rows] = lp.gather(1, chosen).squeeze(1).numpy()
    if k:
        values, idx = torch.topk(lp, k, dim=-1)  # sorted, descending
        top_ids[rows] = idx.numpy().astype(np.int32)
        top_lp[rows] = values.numpy()
    return logprob, top_ids, top_lp


class Sampler:
    """Samples a batch of rows; owns the RNG for unseeded rows (and no per-row state)."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = np.random.default_rng(seed)

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,  # [b, vocab]
        params: np.ndarray,  # SAMPLING_ROW [b]: each row's sampling parameters
        positions: np.ndarray,  # int [b]: position of the token being sampled
        proc: Processing | None = None,
    ) -> Sampled:
        """The module docstring's steps; the result is also ``proc.sampled``."""
        if proc is not None:
            logits = process_logits(logits, proc)
        # Each column as an array of its own (astype copies: a column of the records is strided).
        seeded = params["seeded"]
        uniforms = self._rng.random(len(seeded))
        if seeded.any():
            uniforms[seeded] = seeded_uniform(params["seed"][seeded], np.asarray(positions)[seeded])
        temperature = params["temperature"].astype(np.float32)
        ids = sample_with_uniforms(
            logits,
            torch.from_numpy(temperature),
            torch.from_numpy(params["top_k"].astype(np.int64)),
            torch.from_numpy(params["top_p"].astype(np.float32)),
            torch.from_numpy(params["min_p"].astype(np.float32)),
            torch.from_numpy(uniforms),
        )
        out = Sampled(ids.numpy().astype(np.int32))
        if proc is None:
            return out
        if proc.logprobs is not None and (np.asarray(proc.logprobs) >= 0).any():
            out.logprob, out.top_ids, out.top_logprobs = gather_logprobs(
                logits, temperature, out.ids, np.asarray(proc.logprobs)
            )
        proc.sampled = out
        return out

    def sample_prompts(
        self,
        logits: torch.Tensor,
        sampling: Sequence[SamplingParams],
        positions: np.ndarray,
        processing: Sequence[Processing | None],
    ) -> np.ndarray:
        """Token ids int32 [r] for r prompts from the logits [r, vocab] at their final positions
        (``positions``: where each sampled token sits). Each prompt brings its own parameters and
        processing (a batch of one): the plain rows are sampled together, each processed row
        alone (its result in its ``Processing.sampled``). Seeded rows draw the same as in any
        batch."""
        params = sampling_rows(sampling)
        ids = np.empty(len(sampling), np.int32)
        plain = [i for i, proc in enumerate(processing) if proc is None]
        if plain:
            ids[plain] = self.sample(logits[plain], params[plain], positions[plain]).ids
        for i, proc in enumerate(processing):
            if proc is not None:
                one = slice(i, i + 1)
                ids[i] = self.sample(logits[one], params[one], positions[one], proc).ids[0]
        return ids
