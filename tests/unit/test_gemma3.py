"""The real second model, Gemma 3 270M (``make install-gemma``; skipped when it is not installed):
the converted file's config says what llama.cpp's does, and greedy ids through the engine (four
prompts at once, float32) are transformers' ids on the same GGUF file. Not part of `make test`'s
default install (about 240 MB of packages): run `make install-gemma` first to include them, as
CI (`.ci/run`) does.

The converted tokenizer is ZeroLayer's own (zerolayer.models.gguf_tokenizer); the prompts are
encoded by transformers' tokenizer of the same file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.engine_run import run_engine
from tests.support.smollm2 import SLOW_TIMEOUT_S
from zerolayer.config.settings import ModelConfig
from zerolayer.engine.backends.cpu import CpuBackend
from zerolayer.engine.engine import Sequence
from zerolayer.models import bundled
from zerolayer.models.loader import LoadedModel, ModelLoadError, load_model
from zerolayer.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "The three primary colors are",
]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def reference(gemma3_file: Path, gemma3_transformers_tokenizer):  # noqa: ANN001, ANN201
    """transformers' float32 model and tokenizer of the file (tests/conftest.py)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gemma3_file.parent), gguf_file=gemma3_file.name, dtype=torch.float32
    ).eval()
    return model, gemma3_transformers_tokenizer


@pytest.fixture(scope="module")
def loaded(gemma3_file: Path, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The engine's model of the file, tokenizer included (zerolayer.models.gguf_tokenizer)."""
    cfg = ModelConfig(path="@gemma3-270m", data_dir=str(tmp_path_factory.mktemp("gemma")))
    return load_model(cfg, 512, "float32")


@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_converted_config_is_gemma3_as_llama_cpp_runs_it(loaded: LoadedModel) -> None:
    cfg = loaded.config
    assert cfg.model_type == "gemma3_text" and cfg.hidden_act == "gelu_pytorch_tanh"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim) == (18, 640, 256)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 1)
    assert cfg.sliding_window == 512 and cfg.rope_theta == 1e6 and cfg.rope_local_theta == 1e4
    assert [i for i in range(18) if not cfg.is_sliding(i)] == [5, 11, 17]
    assert cfg.tie_word_embeddings and cfg.attention_scale == 256**-0.5
    # The file stores Gemma's norms as 1 + w; the converted weight is w again (as transformers
    # converts it), so the decoder's 1 + w is the file's value.
    norm = loaded.model.layers[0].input_layernorm.weight.detach()
    assert float(norm.min()) > -1.0 and abs(float(norm.mean())) < float((norm + 1).mean())


@pytest.mark.timeout(SLOW_TIMEOUT_S)
@torch.inference_mode()
def test_greedy_ids_match_transformers_on_the_same_gguf(loaded: LoadedModel, reference) -> None:
    model, tok = reference
    prompts = [tok(text)["input_ids"] for text in PROMPTS]
    assert all(p[0] == tok.bos_token_id for p in prompts)
    backend = CpuBackend(loaded, num_slots=4, max_context=512)
    seqs = [
        Sequence(i, np.array(p, np.int32), NEW_TOKENS, SamplingParams(), ignore_eos=True)
        for i, p in enumerate(prompts)
    ]
    got = run_engine(backend, loaded.tokenizer, seqs)
    for i, p in enumerate(prompts):
        expected = model.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.int64),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(p) :].tolist()
        assert got[i][:-1] == expected, PROMPTS[i]


def test_a_missing_package_names_the_make_target(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    def missing(name: str) -> None:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(bundled.metadata, "distribution", missing)
    with pytest.raises(bundled.BundledModelError, match="make install-gemma"):
        bundled.gemma3_gguf()
    with pytest.raises(ModelLoadError, match="'@gemma3-270m' needs the opt-in"):
        load_model(ModelConfig(path="@gemma3-270m"), 64)
