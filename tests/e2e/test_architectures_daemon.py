"""A real daemon serving tiny random GGUF files of the families furthest from Llama (Gemma 3:
sliding layers, sandwich norms, +1 norms stored in the file; Phi-3: fused matrices), Q8_0 on
the block kernel: greedy ids of four concurrent requests and of one alone are transformers' ids
on the file's weights."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from benchmarks._support.daemon import Daemon
from tests.support.arch_models import VOCAB, reference_model, write_gguf
from tests.support.datadirs import share_kernels
from tests.support.smollm2 import reference_greedy
from zerolayer.client import Client

pytest.importorskip("transformers")

NEW_TOKENS = 12
EOS = 2  # the GGUF vocabulary's end of text (tests.support.gguf_files)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory, kernel_cache: Path) -> Path:
    """One data dir for the module, on the session's block kernel build."""
    return share_kernels(tmp_path_factory.mktemp("data"), kernel_cache)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["gemma3", "phi3"])
def test_daemon_serves_each_family_greedy_like_transformers(
    name: str, tmp_path: Path, data_dir: Path
) -> None:
    ref = reference_model(name, seed=11)
    path = tmp_path / f"{name}.gguf"
    ref.load_state_dict(write_gguf(ref, name, path, "Q8_0"), strict=True)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (7, 19, 4, 13)]
    env = {
        "ENGINE__BACKEND": "cpu",
        "MODEL__PATH": str(path),
        "MODEL__DATA_DIR": str(data_dir),
        "ENGINE__MAX_BATCH_SIZE": "4",
        "ENGINE__MAX_CONTEXT": "256",
        "CACHE__ENABLED": "false",
    }

    async def run(endpoint: str) -> tuple[list[list[int]], list[int]]:
        async with await Client.connect(endpoint) as c:

            async def one(ids: list[int]) -> list[int]:
                return (await (await c.generate(ids, NEW_TOKENS, text=False)).collect()).ids

            together = await asyncio.gather(*(one(p) for p in prompts))
            alone = await one(prompts[1])
            return list(together), alone

    with Daemon(env) as d:
        together, alone = asyncio.run(run(d.endpoint))
    expected = [reference_greedy(ref, p, NEW_TOKENS, eos=EOS) for p in prompts]
    assert together == expected
    assert alone == expected[1]
