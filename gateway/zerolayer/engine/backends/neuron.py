"""The neuron backend: transformers-neuronx continuous batching on Inferentia2 / Trainium.

Owns the mapping of the Backend interface onto a compiled transformers-neuronx sampling model
(``LlamaForSampling``, ``MistralForSampling`` or ``Qwen2ForSampling``, per
``SUPPORTED_ARCHITECTURES``; the other families ``zerolayer.models.architectures`` knows are refused
with a message saying so) built with ``NeuronConfig(continuous_batching=ContinuousBatchingConfig(
batch_size_for_shared_caches=N))``, N = ``engine.max_batch_size``:

* slot i is the library's sequence id i (passed as ``start_ids``) in its shared KV cache of N rows;
* prefill is one context-encoding call per prompt: ``input_ids`` and ``cache_ids`` [1, L] with
  cache_ids 0..L-1, ``start_ids`` [slot]. The library recognises context encoding by a first
  cache id of 0, so a prompt cannot be encoded from the middle: chunks are buffered here and the
  whole prompt is encoded when its last chunk arrives;
* decode is one token-generation call over all N rows (``input_ids`` / ``cache_ids`` [N, 1],
  ``start_ids`` 0..N-1); rows not in the step get a harmless filler (see ``_token_step``);
* logits come back to the host, where the engine's one sampler takes them (``LogitsBackend``,
  zerolayer.engine.sampling), so seeded requests give the same tokens as on the cpu backend.

transformers_neuronx is imported only inside ``create_neuron_backend`` (and torch only when a
backend is built), so this module imports on any machine. The API used is the one of Neuron SDK
2.18 to 2.26; see docs/neuron.md.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from zerolayer.config.settings import EngineConfig, ModelConfig
from zerolayer.engine.backend import LogitsBackend, ModelInfo
from zerolayer.engine.types import DecodeBatch, PrefillChunk
from zerolayer.tokenizer import Tokenizer

log = logging.getLogger("zerolayer.neuron")

INSTALL_HINT = (
    "the neuron backend needs transformers-neuronx, torch-neuronx and neuronx-cc, which are not "
    "importable here; on an inf2/trn1 host install the `neuron` extra from AWS's Neuron pip "
    "repository: pip install --extra-index-url https://pip.repos.neuron.amazonaws.com "
    "'zerolayer[neuron]'"
)

# Hugging Face architecture -> (transformers_neuronx module, sampling class): the families of
# zerolayer.models.architectures that transformers-neuronx has a continuous-batching sampling class
# for (each takes config, n_positions, batch_size, amp, tp_degree, context_length_estimate and
# neuron_config through NeuronModelBase.from_pretrained).
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("transformers_neuronx.llama.model", "LlamaForSampling"),
    "MistralForCausalLM": ("transformers_neuronx.mistral.model", "MistralForSampling"),
    "Qwen2ForCausalLM": ("transformers_neuronx.qwen2.model", "Qwen2ForSampling"),
}
# Families the cpu backend serves that transformers-neuronx has no class for (its GemmaForSampling
# is Gemma 1: no QK-norm, no norms after attention and MLP, no sliding layers).
CPU_ONLY_ARCHITECTURES = ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM")

# model.dtype "auto" is the CPU's choice (zerolayer.models.loader.auto_dtype); on Neuron it
# keeps f32, as before "auto" existed
AMP_BY_DTYPE = {"auto": "f32", "float32": "f32", "bfloat16": "bf16", "float16": "f16"}
AMP_VALUES = frozenset(AMP_BY_DTYPE.values())


class NeuronBackendError(Exception):
    """The neuron backend cannot start: missing packages, bad checkpoint or bad configuration."""


def _load_tokenizer(checkpoint: Path) -> Tokenizer:
    """The checkpoint's own tokenizer. zerolayer.models owns checkpoint tokenizers; this is the one
    place the neuron backend depends on it."""
    from zerolayer.models.hf_tokenizer import HFTokenizer

    return HFTokenizer(checkpoint)


# --------------------------------------------------------------------------- configuration


def _buckets(value: Any, max_context: int, key: str) -> tuple[int, ...]:
    """Sorted, unique bucket sizes ending at max_context (the largest bucket bounds a prompt)."""
    sizes = {int(v) for v in (value or ())}
    bad = sorted(v for v in sizes if not 1 <= v <= max_context)
    if bad:
        raise NeuronBackendError(f"engine.{key}: {bad} outside 1..max_context ({max_context})")
    sizes.add(max_context)
    return tuple(sorted(sizes))


@dataclass(frozen=True, slots=True)
class NeuronSettings:
    """Compile-time settings of the Neuron model. Read from ``engine.neuron_*`` when those keys
    exist (see docs/neuron.md), with defaults otherwise."""

    tp_degree: int
    amp: str  # "f32", "bf16" or "f16"
    context_buckets: tuple[int, ...]  # context_length_estimate: prompt lengths compiled for
    token_buckets: tuple[int, ...]  # n_positions: cache lengths compiled for token generation
    compiled_dir: str  # "" = do not save/load compiled artifacts

    @classmethod
    def from_config(
        cls, model_cfg: ModelConfig, engine_cfg: EngineConfig, max_context: int
    ) -> NeuronSettings:
        tp_degree = int(getattr(engine_cfg, "neuron_tp_degree", 2))
        if tp_degree < 1:
            raise NeuronBackendError(f"engine.neuron_tp_degree must be >= 1, got {tp_degree}")
        amp = str(getattr(engine_cfg, "neuron_amp", "") or AMP_BY_DTYPE[model_cfg.dtype])
        if amp not in AMP_VALUES:
            raise NeuronBackendError(
                f"engine.neuron_amp must be one of {sorted(AMP_VALUES)}, got {amp!r}"
            )
        return cls(
            tp_degree=tp_degree,
            amp=amp,
            context_buckets=_buckets(
                getattr(engine_cfg, "neuron_context_buckets", ()),
                max_context,
                "neuron_context_buckets",
            ),
            token_buckets=_buckets(
                getattr(engine_cfg, "neuron_token_buckets", ()), max_context, "neuron_token_buckets"
            ),
            compiled_dir=str(getattr(engine_cfg, "neuron_compiled_dir", "") or ""),
        )


def _read_checkpoint(path: str) -> tuple[Path, dict[str, Any]]:
    if not path or path.startswith("@"):  # empty, or a named model (those are for the CPU)
        raise NeuronBackendError(
            'model.path is required for engine.backend = "neuron": set it to a Hugging Face '
            "checkpoint directory (config.json, safetensors weights, tokenizer.json)"
            + (f"; {path} is served by the cpu backend only" if path else "")
        )
    checkpoint = Path(path).expanduser()
    if not checkpoint.is_dir():
        raise NeuronBackendError(f"model.path {checkpoint} is not a directory")
    config_file = checkpoint / "config.json"
    try:
        with open(config_file, encoding="utf-8") as fh:
            config = json.load(fh)
    except FileNotFoundError as exc:
        raise NeuronBackendError(f"model.path {checkpoint} has no config.json") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise NeuronBackendError(f"cannot read {config_file}: {exc}") from exc
    if not isinstance(config, dict):
        raise NeuronBackendError(f"{config_file} must hold a JSON object")
    return checkpoint, config


def _architecture(config: dict[str, Any], checkpoint: Path) -> str:
    raw = config.get("architectures") or []
    if not isinstance(raw, list) or not all(isinstance(name, str) for name in raw):
        raise NeuronBackendError(
            f"{checkpoint}/config.json: architectures must be a list of class names, not {raw!r}"
        )
    names: list[str] = raw
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    cpu_only = [name for name in names if name in CPU_ONLY_ARCHITECTURES]
    if cpu_only:
        raise NeuronBackendError(
            f"{checkpoint}: {cpu_only[0]} is served by the cpu backend only: transformers-neuronx "
            f"has no sampling class for it; the neuron backend serves "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    raise NeuronBackendError(
        f"{checkpoint}: architectures {names} are not supported by the neuron backend; "
        f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
    )


def _import_neuronx(module_name: str, class_name: str) -> tuple[Any, Any, str]:
    """(sampling model class, transformers_neuronx.config module, package version)."""
    try:
        package = importlib.import_module("transformers_neuronx")
        config_module = importlib.import_module("transformers_neuronx.config")
        model_module = importlib.import_module(module_name)
    except ImportError as exc:
        raise NeuronBackendError(f"{INSTALL_HINT} (import failed: {exc})") from exc
    return (
        getattr(model_module, class_name),
        config_module,
        str(getattr(package, "__version__", "")),
    )


def _artifact_dir(root: str, fields: dict[str, Any]) -> Path:
    """A subdirectory per compile configuration, so changing batch size, buckets, tp degree, amp,
    the model's shape or the library version never loads NEFFs built for something else."""
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    return Path(root).expanduser() / digest


def _compile_or_load(make_model: Callable[[], Any], artifacts: Path | None) -> Any:
    """``to_neuron()`` the model, loading compiled artifacts from ``artifacts`` when present and
    saving them there after a compile."""
    if artifacts is not None and artifacts.is_dir() and any(artifacts.iterdir()):
        model = make_model()
        model.load(str(artifacts))
        try:
            log.info("loading compiled Neuron artifacts from %s", artifacts)
            model.to_neuron()
            return model
        except FileNotFoundError as exc:
            # The library raises this when no saved NEFF matches a graph's hash (e.g. a different
            # compiler release). Weights were already consumed, so start from a fresh model.
            log.warning(
                "compiled artifacts in %s do not match (%s); compiling again", artifacts, exc
            )
    model = make_model()
    log.info("compiling the model for Neuron (first start with these settings can take long)")
    model.to_neuron()
    if artifacts is not None:
        artifacts.mkdir(parents=True, exist_ok=True)
        model.save(str(artifacts))
        log.info("saved compiled Neuron artifacts to %s", artifacts)
    return model


def create_neuron_backend(
    model_cfg: ModelConfig, engine_cfg: EngineConfig
) -> tuple[NeuronBackend, Tokenizer]:
    """Load the checkpoint at ``model.path``, compile (or load) it for NeuronCores and return the
    backend and the checkpoint's tokenizer. Raises NeuronBackendError with an operator-facing
    message for a missing package, checkpoint or bad setting."""
    checkpoint, config = _read_checkpoint(model_cfg.path)
    architecture = _architecture(config, checkpoint)
    max_context = engine_cfg.max_context
    model_max = config.get("max_position_embeddings")
    if isinstance(model_max, int) and 0 < model_max < max_context:
        log.warning(
            "engine.max_context %d exceeds the model's max_position_embeddings %d; using %d",
            max_context,
            model_max,
            model_max,
        )
        max_context = model_max
    settings = NeuronSettings.from_config(model_cfg, engine_cfg, max_context)
    num_slots = engine_cfg.max_batch_size
    if engine_cfg.prefill_chunk < max_context:
        log.info(
            "engine.prefill_chunk %d < max_context %d: prompt chunks are buffered and encoded "
            "whole on the last one; set prefill_chunk >= max_context on neuron",
            engine_cfg.prefill_chunk,
            max_context,
        )

    tokenizer = _load_tokenizer(checkpoint)
    model_cls, config_module, version = _import_neuronx(*SUPPORTED_ARCHITECTURES[architecture])

    if "NEURON_RT_NUM_CORES" not in os.environ and "NEURON_RT_VISIBLE_CORES" not in os.environ:
        # Without either, the Neuron runtime claims every NeuronCore on the host; take only the
        # cores tensor parallelism uses so other daemons can share the instance.
        os.environ["NEURON_RT_NUM_CORES"] = str(settings.tp_degree)

    def make_model() -> Any:
        neuron_config = config_module.NeuronConfig(
            continuous_batching=config_module.ContinuousBatchingConfig(
                batch_size_for_shared_caches=num_slots
            )
        )
        return model_cls.from_pretrained(
            str(checkpoint),
            batch_size=num_slots,
            n_positions=list(settings.token_buckets),
            context_length_estimate=list(settings.context_buckets),
            tp_degree=settings.tp_degree,
            amp=settings.amp,
            neuron_config=neuron_config,
        )

    artifacts = None
    if settings.compiled_dir:
        artifacts = _artifact_dir(
            settings.compiled_dir,
            {
                "architecture": architecture,
                "config": config,
                "slots": num_slots,
                "settings": [
                    settings.tp_degree,
                    settings.amp,
                    settings.context_buckets,
                    settings.token_buckets,
                ],
                "transformers_neuronx": version,
            },
        )
    model = _compile_or_load(make_model, artifacts)

    vocab_size = int(config.get("vocab_size") or tokenizer.vocab_size)
    info = ModelInfo(
        name=model_cfg.name or checkpoint.resolve().name,
        vocab_size=vocab_size,
        eos_token_id=tokenizer.eos_token_id,
        max_context=max_context,
    )
    return NeuronBackend(model, info, num_slots), tokenizer


# --------------------------------------------------------------------------- the backend


class NeuronBackend(LogitsBackend):
    """Drives a compiled transformers-neuronx model whose continuous-batching KV cache has
    ``num_slots`` rows of ``info.max_context`` positions. ``model`` is called as
    ``model(input_ids, cache_ids=..., start_ids=...)`` and returns float logits [rows, vocab]."""

    recomputes = False  # a prompt is encoded whole, with its last chunk: no KV without sampling

    def __init__(self, model: Any, info: ModelInfo, num_slots: int) -> None:
        import torch

        super().__init__()
        self._torch = torch
        self._model = model
        self.info = info
        self.num_slots = num_slots
        # Cache positions holding this slot's sequence; 0 = free or prompt not yet encoded.
        self._length = np.zeros(num_slots, np.int64)
        # Prompt chunks waiting for their last chunk, and how many tokens they hold.
        self._pending: list[list[np.ndarray]] = [[] for _ in range(num_slots)]
        self._pending_len = np.zeros(num_slots, np.int64)
        # Token-generation inputs for every slot, allocated once and refilled each step.
        self._tg_ids = torch.zeros((num_slots, 1), dtype=torch.int64)
        self._tg_pos = torch.zeros((num_slots, 1), dtype=torch.int64)
        self._tg_seq = torch.arange(num_slots, dtype=torch.int64)

    # ------------------------------------------------------------------ Backend

    def prefill_logits(self, chunks: list[PrefillChunk]) -> Any:
        done: dict[int, Any] = {}  # chunk index -> logits [vocab] of its prompt's last token
        single: dict[int, tuple[int, int]] = {}  # slot -> (token, position 0)
        single_rows: list[tuple[int, int]] = []  # (chunk index, slot)
        for i, chunk in enumerate(chunks):
            prompt = self._take_prompt(chunk)
            if prompt is None:
                continue
            if len(prompt) == 1:
                # A one-token input is token generation to the library, not context encoding.
                single[chunk.slot] = (int(prompt[0]), 0)
                single_rows.append((i, chunk.slot))
            else:
                done[i] = self._context_encode(chunk.slot, prompt)
        if single:
            logits = self._token_step(single)
            for i, slot in single_rows:
                self._length[slot] = 1
                done[i] = logits[slot]
        if not done:
            return None
        return self._torch.stack([done[i] for i in sorted(done)])  # in the chunks' order

    def decode_logits(self, batch: DecodeBatch) -> Any:
        limit = self.info.max_context
        rows: dict[int, tuple[int, int]] = {}
        for slot, token, pos in zip(
            batch.slots.tolist(), batch.tokens.tolist(), batch.positions.tolist(), strict=True
        ):
            if slot in rows:
                raise ValueError(f"slot {slot} appears twice in one decode batch")
            if not 0 <= pos < limit:
                raise ValueError(f"slot {slot}: position {pos} outside the cache (0..{limit - 1})")
            rows[slot] = (token, pos)
        logits = self._token_step(rows)
        for slot, (_, pos) in rows.items():
            self._length[slot] = pos + 1
        return logits.index_select(0, self._torch.from_numpy(batch.slots.astype(np.int64)))

    def free(self, slot: int) -> None:
        # The cache row is simply overwritten by the slot's next context encoding.
        self._length[slot] = 0
        self._pending[slot].clear()
        self._pending_len[slot] = 0

    def close(self) -> None:
        self._model = None

    # ------------------------------------------------------------------ internals

    def _take_prompt(self, chunk: PrefillChunk) -> np.ndarray | None:
        """Buffer ``chunk``; return the whole prompt (int64) when the chunk is its last."""
        slot = chunk.slot
        if chunk.start == 0:
            self._pending[slot].clear()
            self._length[slot] = 0
        elif chunk.start != self._pending_len[slot]:
            raise ValueError(
                f"slot {slot}: chunk starts at {chunk.start} but {self._pending_len[slot]} "
                "prompt tokens are buffered (the neuron backend encodes prompts from position 0)"
            )
        end = chunk.start + len(chunk.tokens)
        if end > self.info.max_context:
            raise ValueError(
                f"slot {slot}: prompt of {end} tokens exceeds max_context {self.info.max_context}"
            )
        self._pending[slot].append(chunk.tokens)
        self._pending_len[slot] = end
        if not chunk.last:
            return None
        prompt = np.concatenate(self._pending[slot]).astype(np.int64)
        self._pending[slot].clear()
        self._pending_len[slot] = 0
        if prompt.size == 0:
            raise ValueError(f"slot {slot}: empty prompt")
        return prompt

    def _context_encode(self, slot: int, prompt: np.ndarray) -> Any:
        """Encode a whole prompt (length >= 2) into ``slot``; logits [vocab] of its last token."""
        torch = self._torch
        n = int(prompt.shape[0])
        input_ids = torch.from_numpy(prompt).reshape(1, n)
        cache_ids = torch.arange(n, dtype=torch.int64).reshape(1, n)
        start_ids = torch.tensor([slot], dtype=torch.int64)
        with torch.inference_mode():
            logits = self._model(input_ids, cache_ids=cache_ids, start_ids=start_ids)
        self._length[slot] = n
        return self._check_logits(logits, 1)[0]

    def _token_step(self, rows: dict[int, tuple[int, int]]) -> Any:
        """One token-generation call over every slot; ``rows`` maps slot -> (token, position).
        Returns logits [num_slots, vocab], row i for slot i.

        The compiled graph runs the whole continuous batch and writes each row's K/V at that
        row's cache id, so rows outside ``rows`` are written too (the library would zero-fill
        them, writing position 0 of sequences that are still live). Each such row instead points
        at its slot's first unused position: whatever lands there is overwritten by the slot's
        next real token before anything attends to it. Free slots point at 0, which their next
        context encoding overwrites.
        """
        torch = self._torch
        ids, pos = self._tg_ids, self._tg_pos
        ids.zero_()
        filler = np.minimum(self._length, self.info.max_context - 1)
        pos[:, 0] = torch.from_numpy(filler)
        for slot, (token, position) in rows.items():
            ids[slot, 0] = token
            pos[slot, 0] = position
        with torch.inference_mode():
            logits = self._model(ids, cache_ids=pos, start_ids=self._tg_seq)
        return self._check_logits(logits, self.num_slots)

    def _check_logits(self, logits: Any, rows: int) -> Any:
        if getattr(logits, "ndim", 0) != 2 or logits.shape[0] != rows:
            raise RuntimeError(
                f"transformers-neuronx returned {tuple(getattr(logits, 'shape', ()))}, expected "
                f"logits [{rows}, vocab] (on-device generation must stay off for this backend)"
            )
        return logits.float()
