"""The GGUF block kernel (kernels/qmatmul.cpp): it multiplies by exactly the gguf package's
dequantized weights (rounded to bfloat16 for bfloat16 inputs), sums within float32 rounding of a
dense matmul, computes each row alone (batch-independent), and a model uses it for forwards of a
few tokens only; without a compiler the model keeps its dense weights."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils import cpp_extension

from benchmarks._support import kquants
from tests.support.gguf_files import write_gguf
from zerolayer.config.settings import ModelConfig
from zerolayer.kernels import qmatmul
from zerolayer.kernels.qmatmul import QStack, QWeight
from zerolayer.models.decoder import Decoder, KVCache
from zerolayer.models.gguf_blocks import BLOCKS_FILE, read_blocks
from zerolayer.models.gguf_import import ensure_converted
from zerolayer.models.loader import load_model, weight_files

KINDS = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
K_KINDS = ["Q4_K", "Q5_K", "Q6_K"]  # super-blocks of 256 weights
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def threads() -> Iterator[None]:
    """Every core, as a daemon has by default: the kernel splits a product's output rows across
    threads (64 at least a thread), which one thread (the suite's, tests/conftest.py) never
    does."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, os.cpu_count() or 1))
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", autouse=True)
def kernel(kernel_cache: Path) -> None:
    """The session's build (tests/conftest.py), here required to succeed."""
    reason = qmatmul.build(kernel_cache)
    assert reason is None, reason
    # The loaded build is the one the session's daemons are linked to (share_kernels).
    directory, library = qmatmul.build_files(kernel_cache, qmatmul.build_key(qmatmul.build_flags()))
    assert qmatmul.loaded_build() == directory and (directory / library).is_file()
    # The instruction set the build is for (a test below runs these on the other builds).
    arch = qmatmul.build_flags()[2:]
    assert arch[: len(arch) - ("-mavx512bf16" in arch)] == qmatmul.ARCH_FLAGS.get(
        torch.backends.cpu.get_cpu_capability(), []
    )


def quantized(kind: str, rows: int, cols: int, seed: int = 0) -> tuple[QWeight, torch.Tensor]:
    """Random weights quantized by the gguf package: the blocks, and the package's own float32
    dequantization of them (what the converter writes as the dense weights)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)) * 0.05 + rng.uniform(-0.02, 0.02, (rows, 1))
    qtype = gguf.GGMLQuantizationType[kind]
    if kind in K_KINDS:  # the gguf package does not quantize K types
        raw = kquants.quantize(w.astype(np.float32), kind)
    else:
        raw = gguf.quants.quantize(w.astype(np.float32), qtype)
    dense = gguf.quants.dequantize(raw, qtype).reshape(rows, cols)
    return QWeight(torch.from_numpy(raw.copy()), kind), torch.from_numpy(dense.copy())


def through_kernel(w: QWeight, dtype: torch.dtype) -> torch.Tensor:
    """[N, K] float32: the weights qmatmul multiplies by, read back by multiplying identity rows
    (each output is one weight times 1 plus zeros: exact)."""
    eye = torch.eye(w.in_features, dtype=dtype)
    rows = qmatmul.KERNEL_ROWS
    parts = [w(eye[i : i + rows]) for i in range(0, w.in_features, rows)]
    return torch.cat(parts).t().float()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_weights_are_the_gguf_packages_values_bit_for_bit(kind, dtype) -> None:
    # 37 rows: not a multiple of the 4 or 2 rows the kernel takes at once; 3 blocks a row
    # (K types: 2 super-blocks).
    w, dense = quantized(kind, 37, 512 if kind in K_KINDS else 96)
    expected = dense.to(dtype).float()  # the dense model's weights in this dtype
    assert torch.equal(through_kernel(w, dtype), expected)
    assert torch.equal(w.dense(dtype), expected)  # the portable dequantization agrees


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_products_match_a_dense_matmul_up_to_summation_order(kind, dtype) -> None:
    cols = 768 if kind in K_KINDS else 160
    w, dense = quantized(kind, 45, cols, seed=1)
    weight = dense.to(dtype)
    torch.manual_seed(2)
    for rows in range(1, 17):
        x = torch.randn(rows, cols).to(dtype)
        out = w(x)
        assert out.shape == (rows, 45) and out.dtype == dtype
        exact = x.double() @ weight.double().t()
        # float32 sums in any order are within K * 2^-24 * sum |x w| of the exact sum; the
        # bfloat16 output is then rounded once more (2^-8 relative).
        slack = cols * 2.0**-24 * (x.double().abs() @ weight.double().abs().t())
        if dtype == torch.bfloat16:
            slack = slack + exact.abs() * 2.0**-8
        assert bool(((out.double() - exact).abs() <= slack + 1e-30).all()), rows
        dense_out = F.linear(x, weight).double()
        assert bool(((out.double() - dense_out).abs() <= 2 * slack + 1e-30).all()), rows


@pytest.mark.parametrize("kind", K_KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_k_quant_random_blocks_are_the_gguf_packages_values_bit_for_bit(kind, dtype) -> None:
    # Random bytes: every quant, 6-bit scale/min and high-bit pattern, scales of both signs.
    raw = kquants.random_blocks(kind, 7, 3, seed=11)
    qtype = gguf.GGMLQuantizationType[kind]
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(7, 768).copy())
    w = QWeight(torch.from_numpy(raw.copy()), kind)
    assert w.in_features == 768 and w.out_features == 7
    assert torch.equal(through_kernel(w, dtype), expected.to(dtype).float())
    assert torch.equal(w.dense(dtype), expected.to(dtype).float())


# Real shapes (Qwen2.5-1.5B: hidden 1536, MLP 8960) and odd row counts.
@pytest.mark.parametrize(("kind", "n", "k"), [("Q4_K", 1536, 1536), ("Q6_K", 1536, 8960)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_k_quant_real_shaped_matrices_match_dense_torch(kind, n, k, dtype) -> None:
    w, dense = quantized(kind, n, k, seed=7)
    assert torch.equal(w.dense(dtype), dense.to(dtype).float())
    weight = dense.to(dtype)
    torch.manual_seed(8)
    for rows in (1, 7, 32):
        x = torch.randn(rows, k).to(dtype)
        out = w(x)
        exact = x.double() @ weight.double().t()
        slack = k * 2.0**-24 * (x.double().abs() @ weight.double().abs().t())
        if dtype == torch.bfloat16:
            slack = slack + exact.abs() * 2.0**-8
        assert bool(((out.double() - exact).abs() <= slack + 1e-30).all()), rows


def test_k_quant_rows_must_be_whole_super_blocks() -> None:
    with pytest.raises(ValueError, match="whole Q6_K blocks"):
        QWeight(torch.zeros(2, 209, dtype=torch.uint8), "Q6_K")
    w = QWeight(torch.zeros(2, 144, dtype=torch.uint8), "Q4_K")
    assert w.in_features == 256
    with pytest.raises(RuntimeError, match="do not hold K"):
        torch.ops.zerolayer.qmatmul(torch.zeros(1, 288), w.blocks, qmatmul.KINDS["Q4_K"])


def test_reference_quantizer_fits_the_weights() -> None:
    # The test support's K quantizer (gguf cannot quantize K types): read back by gguf, the
    # weights are near the originals, closer with more bits.
    rng = np.random.default_rng(9)
    w = (rng.standard_normal((16, 512)) * 0.05).astype(np.float32)
    errors = []
    for kind in K_KINDS:
        raw = kquants.quantize(w, kind)
        back = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(w.shape)
        errors.append(float(np.sqrt(((back - w) ** 2).mean() / (w**2).mean())))
    assert errors[0] < 0.1 and errors[0] > errors[1] > errors[2], errors


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_row_is_computed_alone(dtype) -> None:
    # The same row gives the same bits alone and among 15 others: batch-independent.
    w, _ = quantized("Q4_1", 70, 128, seed=3)
    torch.manual_seed(4)
    x = torch.randn(16, 128).to(dtype)
    together = w(x.view(2, 8, 128)).view(16, 70)
    for i in range(16):
        assert torch.equal(w(x[i : i + 1])[0], together[i])


def test_stacking_needs_one_kind_and_bad_shapes_are_refused() -> None:
    a, _ = quantized("Q4_1", 20, 64)
    b, _ = quantized("Q4_1", 12, 64, seed=5)
    c, _ = quantized("Q8_0", 12, 64)
    both = QWeight.stack([a, b])
    assert both is not None and both.out_features == 32
    x = torch.randn(3, 64)
    assert torch.equal(both(x), torch.cat((a(x), b(x)), dim=-1))
    assert isinstance(QWeight.stack([a, c]), QStack)  # kinds differ: parts kept apart
    with pytest.raises(ValueError, match="one input size"):
        QWeight.stack([a, quantized("Q4_1", 12, 96)[0]])
    with pytest.raises(ValueError, match="whole Q8_0 blocks"):
        QWeight(torch.zeros(4, 35, dtype=torch.uint8), "Q8_0")
    with pytest.raises(ValueError, match="unknown block type"):
        QWeight(torch.zeros(4, 34, dtype=torch.uint8), "Q5_0")
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        a(torch.randn(1, 64, dtype=torch.float64))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 11])
def test_mixed_kind_stack_is_the_separate_products_bit_for_bit(dtype, rows) -> None:
    """A Q4_K_M layer's q/k/v: Q4_K, Q4_K and Q6_K parts in one call (and 32-weight kinds
    beside them), each part computed exactly as alone: the same outputs, bit for bit."""
    parts = [quantized("Q4_K", 96, 512, 1)[0], quantized("Q4_K", 40, 512, 2)[0]]
    parts += [quantized("Q6_K", 40, 512, 3)[0], quantized("Q8_0", 7, 512, 4)[0]]
    parts += [quantized("Q5_K", 3, 512, 5)[0]]
    stack = QWeight.stack(parts)
    assert isinstance(stack, QStack) and stack.out_features == 186 and stack.in_features == 512
    x = torch.randn(rows, 512).to(dtype)
    alone = torch.cat([p(x) for p in parts], dim=-1)
    assert torch.equal(stack(x), alone)
    assert torch.equal(stack(x.view(1, rows, 512))[0], alone)


def q8_reference(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The activations' 8-bit blocks by numpy: d = max|x| / 127, q = rint(x * 127 / max|x|)
    in float32 (ties to even), sums of 16 quants."""
    rows, cols = x.shape
    blocks = x.reshape(rows, cols // block, block)
    amax = np.abs(blocks).max(axis=-1)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), np.float32(0))
    q = np.rint(blocks * inv[..., None].astype(np.float32)).astype(np.int8).reshape(rows, cols)
    bsum = q.reshape(rows, cols // 16, 16).astype(np.int16).sum(axis=-1, dtype=np.int16)
    return (amax / np.float32(127)).astype(np.float32), q, bsum


@pytest.mark.parametrize("block", [32, 256])
def test_int8_activations_are_numpys_rounding_bit_for_bit(block) -> None:
    rng = np.random.default_rng(21)
    x = (rng.standard_normal((5, 1024)) * rng.uniform(0.01, 30, (5, 1))).astype(np.float32)
    x[1, :block] = 0.0  # an all-zero block: d = 0, quants 0
    x[2, 7] = 1e4  # one large value crushes the rest of its block
    x[3] = np.round(x[3] * 4) / 4  # ties at .5 of the quantization step do occur
    d, q, bsum = torch.ops.zerolayer.quantize_q8(torch.from_numpy(x), block)
    rd, rq, rs = q8_reference(x, block)
    assert np.array_equal(d.numpy(), rd) and np.array_equal(q.numpy(), rq)
    assert np.array_equal(bsum.numpy(), rs)
    assert int(np.abs(q.numpy()).max()) == 127 and not q.numpy()[1, :block].any()


def int8_reference(x: torch.Tensor, dense: torch.Tensor, kind: str) -> torch.Tensor:
    """x's 8-bit blocks (as numpy rounds them) times the gguf package's weights, in float64."""
    block = qmatmul.BLOCK_WEIGHTS[kind] if kind in K_KINDS else 32
    d, q, _ = q8_reference(x.float().numpy(), block)
    y = q.astype(np.float64).reshape(len(q), -1, block) * d[..., None].astype(np.float64)
    return torch.from_numpy(y.reshape(len(q), -1)) @ dense.double().t()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_products_are_the_quantized_activations_times_the_weights(kind, dtype) -> None:
    # The integer algebra of every kind (scales, mins, offsets, high bits) against float64:
    # the only inexactness left is the weights' own float32 rounding and the float32 sums.
    cols = 768 if kind in K_KINDS else 160
    w, dense = quantized(kind, 45, cols, seed=1)
    w8 = w.with_int8(True)
    torch.manual_seed(2)
    # Up to the dtype's MAX_ROWS: more rows go through dequantized tiles (test_gguf_file.py).
    for rows in (r for r in (1, 2, 8, 9, 17) if r <= qmatmul.MAX_ROWS[dtype]):
        x = torch.randn(rows, cols).to(dtype)
        out = w8(x)
        assert out.shape == (rows, 45) and out.dtype == dtype
        exact = int8_reference(x, dense, kind)
        slack = cols * 2.0**-22 * (x.double().abs() @ dense.double().abs().t())
        if dtype == torch.bfloat16:
            slack = slack + exact.abs() * 2.0**-8
        assert bool(((out.double() - exact).abs() <= slack + 1e-30).all()), rows
        # And near the float path: the activations' rounding is the whole difference.
        error = (out.double() - w(x).double()).norm() / w(x).double().norm()
        assert float(error) < 0.02, float(error)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q4_1"])
def test_int8_rows_are_computed_alone(kind) -> None:
    # Each row is quantized on its own: the same bits alone and among 10 others.
    w, _ = quantized(kind, 70, 512, seed=3)
    w8 = w.with_int8(True)
    torch.manual_seed(4)
    x = torch.randn(11, 512)
    together = w8(x)
    for i in range(11):
        assert torch.equal(w8(x[i : i + 1])[0], together[i])


def test_int8_mixed_kind_stack_is_the_separate_products_bit_for_bit() -> None:
    parts = [quantized("Q4_K", 96, 512, 1)[0], quantized("Q6_K", 40, 512, 3)[0]]
    parts += [quantized("Q8_0", 7, 512, 4)[0], quantized("Q5_K", 3, 512, 5)[0]]
    stack = QWeight.stack(parts).with_int8(True)
    assert isinstance(stack, QStack) and all(p.int8 for p in stack.parts)
    x = torch.randn(5, 512)
    assert torch.equal(stack(x), torch.cat([p.with_int8(True)(x) for p in parts], dim=-1))
    with pytest.raises(ValueError, match="one kind of activations"):
        QWeight.stack([parts[0], parts[0].with_int8(True)])


@pytest.mark.parametrize(
    ("kernel", "parity", "capability", "int8"),
    [("auto", True, "AVX2", False), ("auto", False, "AVX2", False)]
    + [("auto", False, "AVX512", False), ("auto", False, "DEFAULT", False)]
    + [("int8", True, "AVX512", True), ("float", False, "AVX2", False)],
)
def test_the_kernel_setting_picks_the_activations(kernel, parity, capability, int8) -> None:
    # auto: the float products everywhere for now (qmatmul.INT8_BY_DEFAULT), never 8-bit in the
    # parity mode; "int8" asks for them
    assert qmatmul.uses_int8(kernel, parity, capability) is int8


OTHER_BUILDS = ["avx2", "default"]
# The paged decode attention's tests (its source is built into the same library): every test's
# name there says "paged".
ATTENTION = str(Path(__file__).with_name("test_attention.py"))
SAME_TESTS = "bit_for_bit or summation_order or computed_alone or real_shaped or int8 or paged"


@pytest.fixture(scope="module")
def other_builds(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """The builds this machine does not load: the AVX2 code (on an AVX-512 machine) and the
    plain C++ path (no instruction-set flags, as for a CPU torch detects neither on, such as
    aarch64). One kernel library per process, so the kernel tests above and the paged
    attention's (test_attention.py) run again in a child process per build that torch tells it
    has that CPU; the children build and run at once."""
    this = torch.backends.cpu.get_cpu_capability().lower()
    children = {
        capability: subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, ATTENTION]
            + ["-k", SAME_TESTS]
            + ["--basetemp", str(tmp_path_factory.mktemp(capability))]
            # The child's first test waits for its build (two sources: minutes on a loaded
            # 2-core machine, past the suite's 120 s a test); this test bounds the child.
            + ["--timeout", "540"],
            env={**os.environ, "ATEN_CPU_CAPABILITY": capability},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for capability in OTHER_BUILDS
        if capability != this
    }
    yield children
    for child in children.values():
        child.kill()
        child.communicate()


@pytest.mark.timeout(600)  # a build, then the kernel's tests and the paged attention's
@pytest.mark.parametrize("capability", OTHER_BUILDS)
def test_other_builds_pass_the_same_tests(capability: str, other_builds: dict) -> None:
    if capability not in other_builds:
        pytest.skip(f"the {capability} build is this process's (the tests above)")
    output, _ = other_builds[capability].communicate(timeout=580)
    assert other_builds[capability].returncode == 0, output[-6000:]
    assert "\n132 passed" in output, output[-500:]


def test_build_without_a_compiler_says_why(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(qmatmul, "_loaded", None)  # as in a fresh process
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert qmatmul.build(tmp_path) == "no C++ compiler ('/nonexistent/c++' is not on PATH)"
    assert not any(tmp_path.iterdir())


def test_a_built_kernel_is_loaded_without_compiler_or_build_lock(
    monkeypatch, tmp_path: Path
) -> None:
    """A later start loads the library the first one built, with no compiler, and a lock file
    that a killed build left (cpp_extension waits for it to go away) cannot stall it."""
    key = qmatmul.build_key(qmatmul.build_flags())
    built, name = qmatmul.build_files(tmp_path, key)
    built.mkdir()
    library = built / name
    library.write_bytes(b"")  # never opened: load_library is replaced below
    (built / "lock").touch()
    loaded: list[str] = []

    def must_not_build(**kwargs: object) -> None:
        raise AssertionError("built again")

    monkeypatch.setattr(qmatmul, "_loaded", None)  # as in a fresh process
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setattr(cpp_extension, "load", must_not_build)
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)  # the ops are loaded already
    assert qmatmul.build(tmp_path) is None
    assert loaded == [str(library)]


@pytest.fixture(scope="module", params=["Q4_1", "Q4_0"])
def converted(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny GGUF (matrices in the given type, token embedding Q8_0) and its conversion."""
    base = tmp_path_factory.mktemp(request.param)
    path = base / f"tiny-{request.param}.gguf"
    write_gguf(path, matrix_type=request.param)
    return path, ensure_converted(path, str(base))


def test_converted_blocks_are_the_dense_weights(converted) -> None:
    from safetensors.numpy import load_file

    _, directory = converted
    dense = load_file(str(directory / "model.safetensors"))  # the gguf package's dequantization
    blocks = read_blocks(directory)
    assert weight_files(directory) == [directory / "model.safetensors"]  # blocks are not weights
    assert set(blocks) == {k for k, v in dense.items() if v.ndim == 2}  # every matrix is kept
    assert blocks["model.embed_tokens.weight"].kind == "Q8_0"
    for name, w in blocks.items():  # q/k rows un-permuted like the dense ones
        assert torch.equal(through_kernel(w, torch.float32), torch.from_numpy(dense[name])), name


def greedy(model: Decoder, prompt: list[int], steps: int, rows: int = 1) -> tuple[list[int], list]:
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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_uses_the_blocks_for_a_few_rows_only(converted, dtype) -> None:
    _, directory = converted  # the converted checkpoint: dense weights, blocks for few rows
    # The float path: the dense weights exactly (8-bit activations: test_kl.py).
    cfg = ModelConfig(
        path=str(directory), data_dir=str(directory.parent.parent), dtype=dtype, kernel="float"
    )
    fused = load_model(cfg, 64).model
    dense = load_model(cfg.model_copy(update={"quantized_decode": False}), 64).model
    most = qmatmul.MAX_ROWS[fused.rope_cos.dtype]
    assert fused.blocks_max_rows == most and fused.head_blocks is not None
    assert fused.layers[0].self_attn.qkv_blocks is not None
    assert dense.blocks_max_rows == 0 and dense.head_blocks is None
    assert dense.layers[0].mlp.gate_up_blocks is None
    prompt = [5, 70, 80, 90, 100, 7]
    ids_f, logits_f = greedy(fused, prompt, 6)
    ids_d, logits_d = greedy(dense, prompt, 6)
    # Same weights, sums in another order: logits within rounding, the same greedy ids here.
    scale = 1e-4 if dtype == "float32" else 0.05
    for a, b in zip(logits_f, logits_d, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=scale * float(b.abs().max()))
    assert ids_f == ids_d
    # Above MAX_ROWS rows the dense weights run: bit-identical to the model without blocks.
    rows = most + 1
    _, wide_f = greedy(fused, prompt, 3, rows)
    _, wide_d = greedy(dense, prompt, 3, rows)
    assert all(torch.equal(a, b) for a, b in zip(wide_f, wide_d, strict=True))


def test_a_checkpoint_without_blocks_stays_dense(converted, tmp_path: Path) -> None:
    _, directory = converted
    plain = tmp_path / "plain"
    plain.mkdir()
    for file in directory.iterdir():
        if file.name != BLOCKS_FILE:
            (plain / file.name).write_bytes(file.read_bytes())
    loaded = load_model(ModelConfig(path=str(plain), data_dir=str(tmp_path)), 64)
    assert loaded.model.blocks_max_rows == 0 and loaded.model.head_blocks is None
    assert not (tmp_path / "kernels").exists()  # nothing to build for


def test_blocks_of_the_wrong_shape_are_refused(converted) -> None:
    _, directory = converted
    model = load_model(ModelConfig(path=str(directory), quantized_decode=False), 64).model
    weights = {k.removeprefix("model."): v for k, v in read_blocks(directory).items()}
    up = weights["layers.0.mlp.up_proj.weight"]
    weights["layers.0.mlp.gate_proj.weight"] = QWeight(up.blocks[:16].contiguous(), up.kind)
    with pytest.raises(ValueError, match="gate_proj"):
        model.use_blocks(weights)


def test_the_environments_own_tools_are_found_without_an_activated_environment(tmp_path: Path):
    # A daemon started by its full path (systemd) has only the system PATH; the ninja that pip
    # installed beside the virtualenv's Python must still be found.
    python = tmp_path / "venv" / "bin" / "python"
    bin_dir = str(python.parent)
    got = qmatmul.with_environment_tools("/usr/bin:/bin", str(python))
    assert got.split(os.pathsep) == [bin_dir, "/usr/bin", "/bin"]
    assert qmatmul.with_environment_tools(got, str(python)) == got  # already there: unchanged
