"""The 8-bit-activation products stay within llama.cpp's own distance for the same block types
(issue #38): KL divergence and top-1 agreement to the float path over a fixed short text, on
the real default model and on Gemma 3 270M (Q4_K_M: Q4_K and Q6_K blocks) when installed.
benchmarks/kl.py measures the same over the whole text for docs/benchmarks.md."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.kl import LLAMA_CPP, TEXT, token_stats
from tests.support.datadirs import share_kernels
from tests.support.smollm2 import SLOW_TIMEOUT_S, data_dir_of
from zerolayer.config.settings import SMOLLM2_MODEL, ModelConfig
from zerolayer.models.loader import load_model

BOUND = LLAMA_CPP["Q4_K_M"]  # the bound: llama.cpp's Q4_K_M against FP16


def within_bound(stats: dict) -> None:
    assert stats["kld_mean"] <= BOUND["kld"], stats
    assert stats["same_top_pct"] >= BOUND["same_top"], stats
    assert stats["kld_mean"] > 0.0, stats  # the paths do differ: the int8 one ran


@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_smollm2_int8_activations_stay_within_llama_cpps_distance(smollm2_dir: Path) -> None:
    cfg = ModelConfig(path=SMOLLM2_MODEL, data_dir=data_dir_of(smollm2_dir), kernel="float")
    loaded = load_model(cfg, 128)
    stats = token_stats(loaded, TEXT.read_text(), chunk=128, chunks=2)
    assert stats["tokens"] == 254
    within_bound(stats)
    # The model is left on the float path it was loaded with.
    assert loaded.model.head_blocks is not None and not loaded.model.head_blocks.int8


@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_gemma3_int8_activations_stay_within_llama_cpps_distance(
    gemma3_file: Path, tmp_path_factory: pytest.TempPathFactory, kernel_cache: Path
) -> None:
    data_dir = share_kernels(tmp_path_factory.mktemp("gemma"), kernel_cache)
    loaded = load_model(ModelConfig(path="@gemma3-270m", data_dir=str(data_dir)), 64)
    stats = token_stats(loaded, TEXT.read_text(), chunk=64, chunks=2)
    assert stats["tokens"] == 126
    within_bound(stats)
