"""The neuron backend against a fake of the transformers-neuronx continuous-batching API.

The fake (installed into sys.modules per test) checks every call against the contract of
transformers-neuronx's ``NeuronModelBase`` with ``continuous_batching`` set: int64 tensors,
``input_ids`` / ``cache_ids`` [n, L] and ``start_ids`` [n] sequence ids; context encoding when
L > 1 and the first cache id is 0; token generation (L == 1) zero-filling the rows a call leaves
out, as the library does. It keeps a per-slot cache of the tokens written at each position and
returns logits that are a pure function of a slot's cache up to the row's position, so a wrong
position, slot or a corrupted cache changes the sampled tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from zerolayer.config.settings import EngineConfig, ModelConfig
from zerolayer.engine.backends.neuron import (
    NeuronBackend,
    NeuronBackendError,
    create_neuron_backend,
)
from zerolayer.engine.engine import NO_TOKEN, Engine, Sequence
from zerolayer.engine.types import DecodeBatch, PrefillChunk
from zerolayer.sampling_params import SamplingParams, sampling_rows

VOCAB = 64
REPO = Path(__file__).resolve().parents[2]


def expected_next(seq: list[int]) -> int:
    """The greedy token the fake model predicts after ``seq``."""
    digest = hashlib.blake2b(np.asarray(seq, np.int64).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (VOCAB - 3) + 3  # never BOS/EOS/UNK (0, 1, 2)


def fake_logits(seq: list[int]) -> torch.Tensor:
    digest = hashlib.blake2b(np.asarray(seq, np.int64).tobytes(), digest_size=8).digest()
    rng = np.random.default_rng(int.from_bytes(digest, "little"))
    row = rng.standard_normal(VOCAB).astype(np.float32)
    row[expected_next(seq)] += 20.0
    return torch.from_numpy(row)


# --------------------------------------------------------------------------- the fake library


class Recorder:
    def __init__(self) -> None:
        self.models: list[FakeSampling] = []


class FakeSampling:
    """Stands in for transformers_neuronx.llama.model.LlamaForSampling."""

    recorder: Recorder

    def __init__(self, path: str, kwargs: dict[str, Any]) -> None:
        self.path = path
        self.kwargs = kwargs
        self.calls: list[dict[str, Any]] = []
        self.loaded_from: str | None = None
        self.compiled = False
        self.on_neuron = False
        batch = kwargs["batch_size"]
        self.batch = batch
        self.n_positions = max(kwargs["n_positions"])
        self.cache = np.full((batch, self.n_positions), -1, np.int64)

    @classmethod
    def from_pretrained(cls, path: str, **kwargs: Any) -> FakeSampling:
        expected = {
            "batch_size",
            "n_positions",
            "context_length_estimate",
            "tp_degree",
            "amp",
            "neuron_config",
        }
        assert set(kwargs) == expected, sorted(kwargs)
        assert (Path(path) / "config.json").is_file()
        assert isinstance(kwargs["batch_size"], int)
        assert isinstance(kwargs["n_positions"], list) and kwargs["n_positions"]
        assert isinstance(kwargs["context_length_estimate"], list)
        assert kwargs["amp"] in {"f32", "bf16", "f16"}
        cb = kwargs["neuron_config"].continuous_batching
        assert cb.batch_size_for_shared_caches == kwargs["batch_size"]
        model = cls(path, kwargs)
        cls.recorder.models.append(model)
        return model

    def load(self, directory: str) -> None:
        assert not self.on_neuron, "load() must come before to_neuron()"
        self.loaded_from = directory

    def _artifact_name(self) -> str:
        fields = {k: v for k, v in self.kwargs.items() if k != "neuron_config"}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:20]

    def to_neuron(self) -> None:
        if self.loaded_from is not None:
            neff = Path(self.loaded_from) / f"{self._artifact_name()}.neff"
            if not neff.is_file():
                raise FileNotFoundError("Could not find a matching NEFF for your HLO")
        else:
            self.compiled = True
        self.on_neuron = True

    def save(self, directory: str) -> None:
        assert self.on_neuron
        (Path(directory) / f"{self._artifact_name()}.neff").write_bytes(b"neff")

    def __call__(
        self, input_ids: torch.Tensor, cache_ids: torch.Tensor, start_ids: torch.Tensor
    ) -> torch.Tensor:
        assert self.on_neuron, "called before to_neuron()"
        for t in (input_ids, cache_ids, start_ids):
            assert isinstance(t, torch.Tensor) and t.dtype == torch.int64, t
        assert input_ids.dim() == 2 and cache_ids.shape == input_ids.shape
        n, length = input_ids.shape
        assert start_ids.shape == (n,)
        seq_ids = start_ids.tolist()
        assert len(set(seq_ids)) == n and all(0 <= s < self.batch for s in seq_ids)
        self.calls.append(
            {
                "input_ids": input_ids.clone(),
                "cache_ids": cache_ids.clone(),
                "start_ids": start_ids.clone(),
            }
        )
        if length > 1:
            # Context encoding: detected by the first cache id being 0, one sequence at a time.
            assert cache_ids.flatten()[0].item() == 0
            assert length <= max(self.kwargs["context_length_estimate"])
            rows = []
            for r, slot in enumerate(seq_ids):
                positions = cache_ids[r].tolist()
                real = max(positions) + 1
                assert positions[:real] == list(range(real))
                self.cache[slot, :real] = input_ids[r, :real].numpy()
                rows.append(fake_logits(self.cache[slot, :real].tolist()))
            return torch.stack(rows)
        # Token generation: the library scatters the given rows into the full batch and runs
        # every row, zero-filling tokens and cache ids of rows the caller left out.
        full_ids = torch.zeros(self.batch, dtype=torch.int64)
        full_pos = torch.zeros(self.batch, dtype=torch.int64)
        full_ids[start_ids] = input_ids[:, 0]
        full_pos[start_ids] = cache_ids[:, 0]
        out = []
        for slot in range(self.batch):
            p = int(full_pos[slot])
            assert 0 <= p < self.n_positions
            self.cache[slot, p] = int(full_ids[slot])
            out.append(fake_logits(self.cache[slot, : p + 1].tolist()))
        return torch.stack(out)[start_ids]


class FakeMistral(FakeSampling):
    pass


class FakeQwen2(FakeSampling):
    pass


class ContinuousBatchingConfig:
    def __init__(self, **kwargs: Any) -> None:
        self.max_num_seqs = kwargs.pop("max_num_seqs", None) or kwargs.pop(
            "batch_size_for_shared_caches"
        )
        assert not kwargs, kwargs

    @property
    def batch_size_for_shared_caches(self) -> int:
        return self.max_num_seqs


class NeuronConfig:
    def __init__(self, *, continuous_batching: ContinuousBatchingConfig | None = None) -> None:
        self.continuous_batching = continuous_batching


@pytest.fixture
def fake_tnx(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    recorder = Recorder()
    FakeSampling.recorder = recorder
    package = types.ModuleType("transformers_neuronx")
    package.__version__ = "0.0-fake"  # type: ignore[attr-defined]
    config = types.ModuleType("transformers_neuronx.config")
    config.NeuronConfig = NeuronConfig  # type: ignore[attr-defined]
    config.ContinuousBatchingConfig = ContinuousBatchingConfig  # type: ignore[attr-defined]
    llama = types.ModuleType("transformers_neuronx.llama.model")
    llama.LlamaForSampling = FakeSampling  # type: ignore[attr-defined]
    mistral = types.ModuleType("transformers_neuronx.mistral.model")
    mistral.MistralForSampling = FakeMistral  # type: ignore[attr-defined]
    qwen2 = types.ModuleType("transformers_neuronx.qwen2.model")
    qwen2.Qwen2ForSampling = FakeQwen2  # type: ignore[attr-defined]
    for name, module in {
        "transformers_neuronx": package,
        "transformers_neuronx.config": config,
        "transformers_neuronx.llama": types.ModuleType("transformers_neuronx.llama"),
        "transformers_neuronx.llama.model": llama,
        "transformers_neuronx.mistral": types.ModuleType("transformers_neuronx.mistral"),
        "transformers_neuronx.mistral.model": mistral,
        "transformers_neuronx.qwen2": types.ModuleType("transformers_neuronx.qwen2"),
        "transformers_neuronx.qwen2.model": qwen2,
    }.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setenv("NEURON_RT_NUM_CORES", "2")
    return recorder


# --------------------------------------------------------------------------- checkpoint


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models, pre_tokenizers

    ckpt = tmp_path / "tiny-llama"
    ckpt.mkdir()
    words = ["<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 3)]
    tok = RustTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(ckpt / "tokenizer.json"))
    (ckpt / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True})
    )
    (ckpt / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": VOCAB,
                "max_position_embeddings": 128,
                "bos_token_id": 0,
                "eos_token_id": 1,
            }
        )
    )
    return ckpt


class NeuronEngineConfig(EngineConfig):
    """EngineConfig with the proposed neuron keys, as a config section would add them."""

    neuron_tp_degree: int = 2
    neuron_amp: str = ""
    neuron_context_buckets: list[int] = []
    neuron_token_buckets: list[int] = []
    neuron_compiled_dir: str = ""


def make(
    checkpoint: Path, slots: int = 4, max_context: int = 64, **engine: Any
) -> tuple[NeuronBackend, Any]:
    model_cfg = ModelConfig(path=str(checkpoint), dtype="bfloat16")
    engine_cfg = NeuronEngineConfig(
        backend="neuron", max_batch_size=slots, max_context=max_context, **engine
    )
    return create_neuron_backend(model_cfg, engine_cfg)


def greedy() -> SamplingParams:
    return SamplingParams()


def chunk(slot: int, tokens: list[int], start: int = 0, last: bool = True) -> PrefillChunk:
    return PrefillChunk(slot, np.asarray(tokens, np.int32), start, last, greedy())


def decode_batch(rows: list[tuple[int, int, int]], **sampling: Any) -> DecodeBatch:
    b = len(rows)
    return DecodeBatch(
        slots=np.array([r[0] for r in rows], np.int32),
        tokens=np.array([r[1] for r in rows], np.int32),
        positions=np.array([r[2] for r in rows], np.int32),
        sampling=sampling_rows([SamplingParams(**sampling)] * b),
    )


# --------------------------------------------------------------------------- import and errors


def test_module_imports_without_neuron_packages() -> None:
    code = (
        "import sys, zerolayer.engine.backends.neuron\n"
        "heavy = ('transformers_neuronx', 'torch_neuronx', 'torch')\n"
        "bad = [m for m in heavy if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_missing_package_names_the_neuron_extra(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "transformers_neuronx", None)  # import raises ImportError
    with pytest.raises(NeuronBackendError) as err:
        make(checkpoint)
    message = str(err.value)
    assert "transformers-neuronx" in message
    assert "`neuron` extra" in message and "Neuron pip repository" in message


def test_empty_model_path_is_a_clear_error(fake_tnx: Recorder) -> None:
    with pytest.raises(NeuronBackendError, match="model.path is required"):
        create_neuron_backend(ModelConfig(path=""), EngineConfig(backend="neuron"))
    assert fake_tnx.models == []


def test_bad_checkpoints_are_clear_errors(fake_tnx: Recorder, tmp_path: Path) -> None:
    with pytest.raises(NeuronBackendError, match="is not a directory"):
        make(tmp_path / "missing")
    with pytest.raises(NeuronBackendError, match="no config.json"):
        make(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(NeuronBackendError, match="not supported by the neuron backend"):
        make(tmp_path)
    # Not a list of names: an unhashable entry once escaped as a bare TypeError.
    for architectures in ([["LlamaForCausalLM"]], 7, "LlamaForCausalLM"):
        (tmp_path / "config.json").write_text(json.dumps({"architectures": architectures}))
        with pytest.raises(NeuronBackendError, match="architectures must be a list"):
            make(tmp_path)


def test_bad_neuron_settings_are_clear_errors(fake_tnx: Recorder, checkpoint: Path) -> None:
    with pytest.raises(NeuronBackendError, match="neuron_amp"):
        make(checkpoint, neuron_amp="f64")
    with pytest.raises(NeuronBackendError, match="neuron_context_buckets"):
        make(checkpoint, neuron_context_buckets=[16, 1000])
    assert fake_tnx.models == []


# --------------------------------------------------------------------------- construction


def test_compiles_with_continuous_batching_settings(fake_tnx: Recorder, checkpoint: Path) -> None:
    backend, tokenizer = make(
        checkpoint,
        slots=3,
        max_context=64,
        neuron_tp_degree=8,
        neuron_context_buckets=[32, 16],
    )
    (model,) = fake_tnx.models
    assert model.path == str(checkpoint)
    assert model.kwargs["batch_size"] == 3
    assert model.kwargs["tp_degree"] == 8
    assert model.kwargs["amp"] == "bf16"  # from model.dtype
    assert model.kwargs["context_length_estimate"] == [16, 32, 64]
    assert model.kwargs["n_positions"] == [64]
    assert model.compiled and model.loaded_from is None
    assert backend.num_slots == 3
    assert backend.info.max_context == 64
    assert backend.info.vocab_size == VOCAB
    assert backend.info.eos_token_id == 1 == tokenizer.eos_token_id
    assert backend.info.name == "tiny-llama"
    assert tokenizer.encode("w0 w1") == [3, 4]


def test_max_context_is_capped_by_the_model(fake_tnx: Recorder, checkpoint: Path) -> None:
    backend, _ = make(checkpoint, max_context=512)
    assert backend.info.max_context == 128
    assert fake_tnx.models[0].kwargs["n_positions"] == [128]


@pytest.mark.parametrize(
    ("architecture", "sampling"),
    [("MistralForCausalLM", FakeMistral), ("Qwen2ForCausalLM", FakeQwen2)],
)
def test_each_family_uses_its_sampling_class(
    fake_tnx: Recorder, checkpoint: Path, architecture: str, sampling: type
) -> None:
    cfg = json.loads((checkpoint / "config.json").read_text())
    cfg["architectures"] = [architecture]
    (checkpoint / "config.json").write_text(json.dumps(cfg))
    make(checkpoint)
    assert type(fake_tnx.models[0]) is sampling


@pytest.mark.parametrize(
    "architecture", ["Qwen3ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM"]
)
def test_families_without_a_neuronx_class_are_refused_clearly(
    fake_tnx: Recorder, checkpoint: Path, architecture: str
) -> None:
    cfg = json.loads((checkpoint / "config.json").read_text())
    cfg["architectures"] = [architecture]
    (checkpoint / "config.json").write_text(json.dumps(cfg))
    message = f"{architecture} is served by the cpu backend only: transformers-neuronx has no"
    with pytest.raises(NeuronBackendError, match=message) as info:
        make(checkpoint)
    assert "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM" in str(info.value)
    assert not fake_tnx.models  # refused before anything was built


def test_every_family_is_either_served_or_refused_by_name() -> None:
    from zerolayer.engine.backends.neuron import CPU_ONLY_ARCHITECTURES, SUPPORTED_ARCHITECTURES
    from zerolayer.models.architectures import ARCHITECTURES

    named = {a.hf_class for a in ARCHITECTURES.values()}
    assert named == set(SUPPORTED_ARCHITECTURES) | set(CPU_ONLY_ARCHITECTURES)
    assert not set(SUPPORTED_ARCHITECTURES) & set(CPU_ONLY_ARCHITECTURES)


def test_runtime_cores_default_to_tp_degree(
    fake_tnx: Recorder, checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NEURON_RT_NUM_CORES")
    monkeypatch.delenv("NEURON_RT_VISIBLE_CORES", raising=False)
    make(checkpoint, neuron_tp_degree=4)
    assert os.environ["NEURON_RT_NUM_CORES"] == "4"
    monkeypatch.setenv("NEURON_RT_NUM_CORES", "24")
    make(checkpoint, neuron_tp_degree=4)
    assert os.environ["NEURON_RT_NUM_CORES"] == "24"  # an operator's choice wins


def test_compiled_artifacts_are_saved_then_loaded(
    fake_tnx: Recorder, checkpoint: Path, tmp_path: Path
) -> None:
    root = tmp_path / "neffs"
    make(checkpoint, neuron_compiled_dir=str(root))
    first = fake_tnx.models[-1]
    assert first.compiled
    (subdir,) = list(root.iterdir())
    assert any(subdir.iterdir())

    backend, _ = make(checkpoint, neuron_compiled_dir=str(root))
    second = fake_tnx.models[-1]
    assert second.loaded_from == str(subdir) and not second.compiled
    assert backend.prefill([chunk(0, [5, 6, 7])])[0] == expected_next([5, 6, 7])

    # Other settings compile into their own subdirectory instead of loading the wrong NEFFs.
    make(checkpoint, slots=2, neuron_compiled_dir=str(root))
    assert fake_tnx.models[-1].compiled
    assert len(list(root.iterdir())) == 2


def test_stale_artifacts_fall_back_to_compiling(
    fake_tnx: Recorder, checkpoint: Path, tmp_path: Path
) -> None:
    root = tmp_path / "neffs"
    make(checkpoint, neuron_compiled_dir=str(root))
    (subdir,) = list(root.iterdir())
    for f in subdir.iterdir():
        f.rename(subdir / "other-graph.neff")
    make(checkpoint, neuron_compiled_dir=str(root))
    failed, rebuilt = fake_tnx.models[-2:]
    assert failed.loaded_from == str(subdir) and not failed.on_neuron
    assert rebuilt.compiled and rebuilt.loaded_from is None
    assert len(list(subdir.iterdir())) == 2  # saved again


# --------------------------------------------------------------------------- prefill and decode


def test_prefill_of_several_slots_encodes_each_prompt(fake_tnx: Recorder, checkpoint: Path) -> None:
    backend, _ = make(checkpoint)
    model = fake_tnx.models[0]
    prompts = {0: [5, 6, 7], 2: [9, 10], 3: [11, 12, 13, 14]}
    out = backend.prefill([chunk(s, p) for s, p in prompts.items()])
    assert out.dtype == np.int32
    assert out.tolist() == [expected_next(p) for p in prompts.values()]
    assert len(model.calls) == 3
    for call, (slot, prompt) in zip(model.calls, prompts.items(), strict=True):
        n = len(prompt)
        assert call["input_ids"].tolist() == [prompt]
        assert call["cache_ids"].tolist() == [list(range(n))]
        assert call["start_ids"].tolist() == [slot]


def test_decode_runs_one_full_batch_call_over_a_subset(
    fake_tnx: Recorder, checkpoint: Path
) -> None:
    backend, _ = make(checkpoint)
    model = fake_tnx.models[0]
    seqs = {0: [5, 6, 7], 1: [8, 9], 3: [20, 21, 22, 23]}
    firsts = backend.prefill([chunk(s, p) for s, p in seqs.items()])
    for seq, first in zip(seqs.values(), firsts.tolist(), strict=True):
        seq.append(first)
    model.calls.clear()

    # Slot 1 sits this step out; slot 2 is free.
    rows = [(3, seqs[3][-1], len(seqs[3]) - 1), (0, seqs[0][-1], len(seqs[0]) - 1)]
    out = backend.decode(decode_batch(rows))
    assert out.dtype == np.int32
    assert out.tolist() == [expected_next(seqs[3]), expected_next(seqs[0])]
    (call,) = model.calls
    assert call["start_ids"].tolist() == [0, 1, 2, 3]
    assert call["input_ids"][:, 0].tolist() == [seqs[0][-1], 0, 0, seqs[3][-1]]
    # Slot 1's filler row points at its first unused position, slot 2's at 0.
    assert call["cache_ids"][:, 0].tolist() == [3, 2, 0, 4]

    # Slot 1 resumes: its cache was not damaged by the step it skipped.
    seqs[0].append(int(out[1]))
    seqs[3].append(int(out[0]))
    rows = [(s, seqs[s][-1], len(seqs[s]) - 1) for s in (0, 1, 3)]
    out = backend.decode(decode_batch(rows))
    assert out.tolist() == [expected_next(seqs[s]) for s in (0, 1, 3)]


def test_slot_prefilled_in_the_same_step_is_not_corrupted(
    fake_tnx: Recorder, checkpoint: Path
) -> None:
    # The engine prefills slot 1 and then decodes only slot 0 in the same step.
    backend, _ = make(checkpoint)
    a, b = [5, 6], [30, 31, 32]
    a.append(int(backend.prefill([chunk(0, a)])[0]))
    b.append(int(backend.prefill([chunk(1, b)])[0]))
    a.append(int(backend.decode(decode_batch([(0, a[-1], len(a) - 1)]))[0]))
    out = backend.decode(decode_batch([(1, b[-1], len(b) - 1), (0, a[-1], len(a) - 1)]))
    assert out.tolist() == [expected_next(b), expected_next(a)]


def test_chunked_prompt_is_buffered_and_encoded_once(fake_tnx: Recorder, checkpoint: Path) -> None:
    backend, _ = make(checkpoint)
    model = fake_tnx.models[0]
    prompt = list(range(3, 13))
    out = backend.prefill([chunk(2, prompt[:4], 0, last=False)])
    assert out.tolist() == [-1] and model.calls == []
    out = backend.prefill([chunk(2, prompt[4:8], 4, last=False), chunk(0, [40, 41])])
    assert out.tolist() == [-1, expected_next([40, 41])]
    assert len(model.calls) == 1
    out = backend.prefill([chunk(2, prompt[8:], 8, last=True)])
    assert out.tolist() == [expected_next(prompt)]
    assert model.calls[-1]["input_ids"].tolist() == [prompt]
    assert model.calls[-1]["start_ids"].tolist() == [2]


def test_out_of_order_chunk_is_rejected(fake_tnx: Recorder, checkpoint: Path) -> None:
    backend, _ = make(checkpoint)
    backend.prefill([chunk(1, [3, 4], 0, last=False)])
    with pytest.raises(ValueError, match="chunk starts at 5"):
        backend.prefill([chunk(1, [5], 5)])


def test_prompt_longer_than_max_context_is_rejected(fake_tnx: Recorder, checkpoint: Path) -> None:
    backend, _ = make(checkpoint, max_context=16)
    with pytest.raises(ValueError, match="exceeds max_context 16"):
        backend.prefill([chunk(0, list(range(3, 20)))])
    assert fake_tnx.models[0].calls == []


def test_one_token_prompt_goes_through_token_generation(
    fake_tnx: Recorder, checkpoint: Path
) -> None:
    backend, _ = make(checkpoint)
    model = fake_tnx.models[0]
    live = [5, 6, 7]
    live.append(int(backend.prefill([chunk(0, live)])[0]))
    model.calls.clear()
    out = backend.prefill([chunk(2, [9])])
    assert out.tolist() == [expected_next([9])]
    (call,) = model.calls
    assert call["input_ids"].shape == (4, 1)
    assert call["cache_ids"][:, 0].tolist() == [3, 0, 0, 0]
    # Slot 0 (live, not in that call) decodes on unharmed; slot 2 continues from position 1.
    seq2 = [9, int(out[0])]
    out = backend.decode(decode_batch([(0, live[-1], 3), (2, seq2[-1], 1)]))
    assert out.tolist() == [expected_next(live), expected_next(seq2)]


def test_free_then_reuse_slot(fake_tnx: Recorder, checkpoint: Path) -> None:
    backend, _ = make(checkpoint)
    old = [5, 6, 7, 8, 9, 10]
    old.append(int(backend.prefill([chunk(1, old)])[0]))
    backend.decode(decode_batch([(1, old[-1], len(old) - 1)]))
    backend.free(1)
    new = [11, 12]
    new.append(int(backend.prefill([chunk(1, new)])[0]))
    assert new[-1] == expected_next([11, 12])
    assert backend.decode(decode_batch([(1, new[-1], 2)])).tolist() == [expected_next(new)]
    # A freed slot's buffered chunks are dropped too.
    backend.prefill([chunk(3, [3, 4], 0, last=False)])
    backend.free(3)
    with pytest.raises(ValueError, match="chunk starts at 2"):
        backend.prefill([chunk(3, [5], 2)])


def test_seeded_sampling_does_not_depend_on_the_batch(fake_tnx: Recorder, checkpoint: Path) -> None:
    backend, _ = make(checkpoint)
    prompt = [5, 6, 7]
    for slot in (0, 1, 2):
        backend.prefill([chunk(slot, prompt)])
    hot = {"temperature": 5.0, "seed": 1234}
    together = backend.decode(decode_batch([(s, 9, 3) for s in (0, 1, 2)], **hot))
    assert len(set(together.tolist())) == 1
    for slot in (0, 1, 2):
        backend.free(slot)
        backend.prefill([chunk(slot, prompt)])
    alone = backend.decode(decode_batch([(1, 9, 3)], **hot))
    assert alone.tolist() == together[:1].tolist()
    draws = {
        int(backend.decode(decode_batch([(1, 9, 3)], temperature=5.0, seed=s))[0])
        for s in range(40)
    }
    assert len(draws) > 1  # temperature sampling really draws


def test_decode_rejects_positions_outside_the_cache(fake_tnx: Recorder, checkpoint: Path) -> None:
    backend, _ = make(checkpoint, max_context=16)
    with pytest.raises(ValueError, match="outside the cache"):
        backend.decode(decode_batch([(0, 5, 16)]))
    with pytest.raises(ValueError, match="twice"):
        backend.decode(decode_batch([(0, 5, 1), (0, 6, 2)]))


def test_engine_drives_the_backend_end_to_end(fake_tnx: Recorder, checkpoint: Path) -> None:
    backend, tokenizer = make(checkpoint, slots=2)
    outputs: list[Any] = []
    engine = Engine(
        backend,
        tokenizer,
        lambda step: outputs.extend(step.outputs()),
        max_queue=8,
        max_step_tokens=8,
        prefill_chunk=3,  # smaller than the prompts: exercises chunk buffering
        on_step=None,
    )
    prompts = [[3, 5, 6, 7, 8], [4, 9, 10, 11, 12, 13, 14], [5, 20, 21, 22]]
    for i, p in enumerate(prompts):
        engine.submit(Sequence(i, np.asarray(p, np.int32), 5, SamplingParams()))
    for _ in range(60):
        outputs.extend(engine.step().outputs())
        if engine.running == 0 and engine.waiting == 0:
            break
    got: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for owner, token, _text, _finish in outputs:
        if token != NO_TOKEN:
            got[owner].append(token)
    for i, p in enumerate(prompts):
        seq = list(p)
        for _ in range(5):
            seq.append(expected_next(seq))
        assert got[i] == seq[len(p) :], i
