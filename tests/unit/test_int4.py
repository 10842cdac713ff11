"""4-bit weights: GGUF blocks packed for torch's int4 CPU kernel reproduce the file's values
within the bound bfloat16 scales allow, the kernel computes with exactly those values, and a
bfloat16 model uses them for forwards of a few tokens only (dense weights otherwise, and always
when the setting is off, in float32, or for a checkpoint without blocks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.numpy import load_file

from gateway.config import ModelConfig
from gateway.models.gguf_blocks import BLOCKS_FILE, read_blocks
from gateway.models.gguf_import import ensure_converted
from gateway.models.loader import load_model, weight_files
from kernels import int4
from kernels.llama import KVCache, Llama
from tests.support.gguf_files import write_gguf


def effective(g: int4.Groups) -> torch.Tensor:
    """[N, K] float32: the weight the kernel computes with, (q - 8) * s + z with s and z
    rounded to bfloat16, the halves of an 8-bit weight added."""
    scale = g.scale.to(torch.bfloat16).float().repeat_interleave(int4.GROUP, dim=1)
    zero = g.zero.to(torch.bfloat16).float().repeat_interleave(int4.GROUP, dim=1)
    w = (g.q - 8) * scale + zero
    return w if g.repeats == 1 else w[:, : g.in_features] + w[:, g.in_features :]


def bound(g: int4.Groups) -> torch.Tensor:
    err = g.max_rounding_error()
    return err if g.repeats == 1 else err[:, : g.in_features] + err[:, g.in_features :]


@pytest.fixture(scope="module", params=["Q4_1", "Q4_0"])
def converted(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny GGUF (matrices in the given type, token embedding Q8_0) and its conversion."""
    base = tmp_path_factory.mktemp(request.param)
    path = base / f"tiny-{request.param}.gguf"
    write_gguf(path, matrix_type=request.param)
    return path, ensure_converted(path, str(base))


def test_blocks_reproduce_the_files_values_within_the_bound(converted) -> None:
    _, directory = converted
    dense = load_file(str(directory / "model.safetensors"))  # the gguf package's dequantization
    blocks = read_blocks(directory)
    assert weight_files(directory) == [directory / "model.safetensors"]  # blocks are not weights
    assert set(blocks) == {k for k, v in dense.items() if v.ndim == 2}  # every matrix is kept
    assert blocks["model.embed_tokens.weight"].repeats == 2  # Q8_0: two 4-bit halves
    for name, g in blocks.items():
        ref = torch.from_numpy(dense[name])
        # Unrounded scales and zeros give the file's values up to float32 rounding...
        exact = (g.q - 8) * g.scale.repeat_interleave(int4.GROUP, 1)
        exact = exact + g.zero.repeat_interleave(int4.GROUP, 1)
        if g.repeats == 2:
            exact = exact[:, : g.in_features] + exact[:, g.in_features :]
        torch.testing.assert_close(exact, ref, rtol=0, atol=1e-6 * float(ref.abs().max()))
        # ...and the bfloat16 ones stay within the bound the module states.
        err = (effective(g) - ref).abs()
        assert bool((err <= bound(g) + 1e-6).all()), name
        # The packed weight, read back through the kernel, is exactly those values (rounded
        # to bfloat16 by the kernel's output).
        assert torch.equal(g.pack().dense(), effective(g).to(torch.bfloat16)), name


def test_kernel_matmul_sums_in_float32_with_the_effective_weights() -> None:
    torch.manual_seed(0)
    q = torch.randint(0, 16, (64, 128))
    d, m = torch.rand(64, 4) * 0.05, -torch.rand(64, 4) * 0.4
    g = int4.Groups.affine(q, d, m)
    x = torch.randn(3, 5, 128).to(torch.bfloat16)
    out = g.pack()(x)
    assert out.shape == (3, 5, 64) and out.dtype == torch.bfloat16
    ref = x.float() @ effective(g).t()
    torch.testing.assert_close(out.float(), ref, rtol=2**-7, atol=1e-3)


def test_signed8_halves_add_up_to_d_times_q() -> None:
    q = torch.arange(-128, 128, dtype=torch.int8).reshape(16, 16).repeat(1, 2)  # [16, 32]
    d = torch.full((16, 1), 0.5)  # a power of two: no rounding anywhere
    g = int4.Groups.signed8(q, d)
    assert g.repeats == 2 and g.in_features == 32 and bool((g.q >= 0).all() & (g.q <= 15).all())
    assert torch.equal(effective(g), q.float() * 0.5)
    assert torch.equal(g.pack().dense().float(), q.float() * 0.5)


def test_rows_are_padded_for_the_kernel_and_stacking_needs_one_kind() -> None:
    torch.manual_seed(1)
    g = int4.Groups.affine(torch.randint(0, 16, (21, 64)), torch.rand(21, 2), -torch.rand(21, 2))
    packed = g.pack()  # 21 rows: the kernel takes multiples of 16, the padding is cut off
    assert packed.dense().shape == (21, 64)
    assert torch.equal(packed.dense(), effective(g).to(torch.bfloat16))
    odd = int4.Groups.affine(
        torch.zeros(16, 40, dtype=torch.int32), torch.ones(16, 2), torch.ones(16, 2)
    )
    assert not odd.packable
    with pytest.raises(ValueError, match="cannot pack"):
        odd.pack()
    eight = int4.Groups.signed8(torch.zeros(21, 64, dtype=torch.int8), torch.ones(21, 2))
    with pytest.raises(ValueError, match="4-bit and 8-bit"):
        int4.Groups.stack([g, eight])


def greedy(model: Llama, prompt: list[int], steps: int, rows: int = 1) -> tuple[list[int], list]:
    """Greedy ids of ``prompt`` decoded in ``rows`` slots at once (all the same prompt), and the
    logits of every decode step of the first row."""
    cache = KVCache.allocate(model.cfg, rows, 64, model.rope_cos.dtype)
    ids, logits = [], []
    with torch.inference_mode():
        out = model.prefill_batch(
            [torch.tensor(prompt)] * rows, [0] * rows, list(range(rows)), cache
        )
        for i in range(steps):
            token = int(out[0].argmax())
            ids.append(token)
            positions = torch.full((rows,), len(prompt) + i)
            out = model.decode(torch.full((rows,), token), positions, torch.arange(rows), cache)
            logits.append(out[0].clone())
    return ids, logits


def test_bfloat16_model_uses_the_blocks_for_a_few_rows_only(converted, tmp_path: Path) -> None:
    path, directory = converted
    data_dir = str(directory.parent.parent)
    cfg = ModelConfig(path=str(path), data_dir=data_dir, dtype="bfloat16")
    quantized = load_model(cfg, 64).model
    dense = load_model(cfg.model_copy(update={"quantized_decode": False}), 64).model
    assert quantized.int4_max_rows == int4.MAX_ROWS and quantized.head_int4 is not None
    assert quantized.layers[0].self_attn.qkv_int4 is not None
    assert dense.int4_max_rows == 0 and dense.head_int4 is None
    assert dense.layers[0].self_attn.qkv_int4 is None
    prompt = [5, 70, 80, 90, 100, 7]
    ids_q, logits_q = greedy(quantized, prompt, 6)
    ids_d, logits_d = greedy(dense, prompt, 6)
    # The 4-bit path differs from dense bfloat16 only by how the weights are rounded.
    for a, b in zip(logits_q, logits_d, strict=True):
        assert not torch.equal(a, b)
        torch.testing.assert_close(a, b, rtol=0, atol=0.05 * float(b.abs().max()))
    # Above MAX_ROWS rows the dense weights run: bit-identical to the model without blocks.
    rows = int4.MAX_ROWS + 1
    _, wide_q = greedy(quantized, prompt, 3, rows)
    _, wide_d = greedy(dense, prompt, 3, rows)
    assert all(torch.equal(a, b) for a, b in zip(wide_q, wide_d, strict=True))
    # float32 never uses them.
    f32 = load_model(cfg.model_copy(update={"dtype": "float32"}), 64).model
    assert f32.int4_max_rows == 0 and f32.layers[0].mlp.gate_up_int4 is None


def test_a_checkpoint_without_blocks_stays_dense(converted, tmp_path: Path) -> None:
    _, directory = converted
    plain = tmp_path / "plain"
    plain.mkdir()
    for file in directory.iterdir():
        if file.name != BLOCKS_FILE:
            (plain / file.name).write_bytes(file.read_bytes())
    loaded = load_model(ModelConfig(path=str(plain), dtype="bfloat16"), 64)
    assert loaded.model.int4_max_rows == 0 and loaded.model.head_int4 is None


def test_blocks_of_the_wrong_shape_are_refused(converted) -> None:
    _, directory = converted
    model = load_model(ModelConfig(path=str(directory), dtype="bfloat16"), 64).model
    groups = {k.removeprefix("model."): v for k, v in read_blocks(directory).items()}
    wrong = groups["layers.0.mlp.up_proj.weight"]
    groups["layers.0.mlp.gate_proj.weight"] = int4.Groups(
        wrong.q[:16], wrong.scale[:16], wrong.zero[:16]
    )
    with pytest.raises(ValueError, match="gate_proj"):
        model.use_int4(groups)
