"""Matrix products on a GGUF file's own blocks (``qmatmul.cpp``): build, load, call.

The C++ kernel dequantizes 32 weights at a time in registers and multiplies them into float32
sums, with exactly the weights of the dense model (the gguf package's float32 values, rounded to
bfloat16 for bfloat16 models), reading 4.5-6.6 bits a weight (``BLOCK_BYTES`` * 8 /
``BLOCK_WEIGHTS``) instead of 32 or 16; only the order of the sums differs from a dense matmul.
Its time grows with the number of input rows, a dense matmul's hardly at all, so for more than
``MAX_ROWS`` input rows (per dtype) a call dequantizes the blocks a tile of rows at a time into a
dense product instead (``tiled``): prefill of long prompts, with no dense copy of the matrix.

With 8-bit activations (``int8=True``, ``kernels/q8dot.h``) each input row is quantized once
per call to int8 blocks and multiplied by the weights' quants in integers, as llama.cpp's CPU
backend does: faster, but no longer the dense model's arithmetic (benchmarks/kl.py measures the
distance). ``model.kernel`` picks the path (``uses_int8``); the float path is the parity mode.

``build`` compiles the sources (``SOURCES``: these products, and ``attention.cpp``, the paged
decode attention that ``zerolayer.kernels.attention`` calls) into one library, once per source,
torch version and instruction set, in a cache directory (``torch.utils.cpp_extension.load``:
needs a C++ compiler and ninja) and registers the ops ``torch.ops.zerolayer.qmatmul`` /
``dequantize`` / ``q8matmul_parts`` / ``quantize_q8`` / ``paged_decode_attention``; it returns
why not when it cannot.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "src" / "qmatmul.cpp"  # the top-level kernels/ directory
# The library's translation units: the block products, and the paged decode attention.
SOURCES = (SOURCE, SOURCE.parent / "attention.cpp")
# The GGUF types the kernel computes on: its kind code, a block's bytes and weights.
KINDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "Q4_K": 3, "Q5_K": 4, "Q6_K": 5}
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
BLOCK_WEIGHTS = {"Q4_0": 32, "Q4_1": 32, "Q8_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}
KERNEL_ROWS = 16  # input rows the tests feed at once (the kernel takes any number)
# Input rows up to which models use the kernel, per dtype. Whole SmolLM2 decode steps on the
# 2-core machine of docs/benchmarks.md (medians of 15 steps, in process, 1-minute load 2.7-3.2),
# block kernel vs dense: float32 53.9 vs 117.5 ms at 32 rows, 105.9 vs 175.2 at 64; bfloat16
# 27.0 vs 33.6 ms at 16 rows, 48.6 vs 45.6 at 32. These are AVX-512 figures; with the AVX2
# code float32 crossed over between 16 and 32 rows (docs/models.md), measured under load.
MAX_ROWS = {torch.float32: 64, torch.bfloat16: 16}
# Instruction sets per torch's CPU capability, each with its own code in qmatmul.cpp; the
# AVX-512 code needs F16C too (every AVX-512 CPU has it). Others get the portable C++.
ARCH_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}

_loaded: Path | None = None  # the directory of the build whose library is loaded in this process
# One ``build`` at a time in a process: a library loaded twice registers its ops twice (an error).
# Between processes, ``ensure_dir``'s lock makes one of them compile and the others load that.
_building = threading.Lock()


def loaded_build() -> Path | None:
    """The directory of the build loaded in this process (by whichever ``build`` loaded it)."""
    return _loaded


def build_flags() -> list[str]:
    # -fopenmp: at::parallel_for is inline OpenMP code; the library it links (soname
    # libgomp.so.1) is the one torch has already loaded, so it runs on torch's own thread team.
    capability = torch.backends.cpu.get_cpu_capability()
    arch = ARCH_FLAGS.get(capability, [])
    if capability == "AVX512" and torch.cpu._is_avx512_bf16_supported():
        arch = [*arch, "-mavx512bf16"]  # bfloat16 products by vdpbf16ps
    return ["-O3", "-fopenmp", *arch]


# The instruction sets (torch's CPU capability) where model.kernel "auto" takes the 8-bit
# products: none for now. On AVX2 they are faster kernel by kernel, but end to end on SmolLM2 no
# faster at 1 and 8 streams (1.1x at 32), and they change greedy answers: SmolLM2 answered the
# wheel test's "capital of France" off-topic with them, and a greedy answer came out differently
# when its prompt's prefix was reused (docs/benchmarks.md, "Defaults"). model.kernel = "int8"
# takes them. Their AVX-512 build compiles but has not run on an AVX-512 machine.
INT8_BY_DEFAULT: frozenset[str] = frozenset()


def uses_int8(kernel: str, parity: bool, capability: str | None = None) -> bool:
    """Whether products take 8-bit activations under ``model.kernel`` = ``kernel``: "int8"
    always, "float" never, "auto" unless ``parity``, the parity mode (``model.dtype`` set to
    float32: the dense model's weights, bit-exact), on the instruction sets of
    ``INT8_BY_DEFAULT`` (``capability``: this CPU's, unless given)."""
    if kernel != "auto":
        return kernel == "int8"
    capability = capability or torch.backends.cpu.get_cpu_capability()
    return not parity and capability in INT8_BY_DEFAULT


def with_environment_tools(path: str, executable: str = sys.executable) -> str:
    """``path`` (a PATH value) with the directory of this Python first when it is not on it: the
    ``ninja`` that pip installed with the cpu extra sits beside the virtualenv's Python, and a
    daemon started by its full path (systemd's ExecStart) has no activated environment."""
    here = str(Path(executable).parent)
    return path if here in path.split(os.pathsep) else os.pathsep.join([here, path])


def build_key(flags: list[str]) -> str:
    """Names a build: the sources, torch's version and the compiler flags."""
    digest = hashlib.sha256()
    for source in SOURCES:
        digest.update(source.read_bytes())
    for header in sorted(SOURCE.parent.glob("*.h")):  # the headers it includes
        digest.update(header.read_bytes())
    digest.update(f"{torch.__version__}|{' '.join(flags)}".encode())
    return digest.hexdigest()[:16]


def build_files(cache_root: Path, key: str) -> tuple[Path, str]:
    """Where build ``key`` lives under ``cache_root``: its directory and its library's name."""
    return cache_root / f"qmatmul-{key}", f"zerolayer_qmatmul_{key}.so"


def build(cache_root: Path) -> str | None:
    """Compile (or reuse) and load the kernel under ``cache_root``; None when the ops are
    ready, else the reason they are not (no compiler or no ninja for a build, a failed
    build). Processes building one key at once compile it once: the others wait, then load
    that build."""
    with _building:
        return _build(cache_root)


def _build(cache_root: Path) -> str | None:
    global _loaded
    flags = build_flags()
    key = build_key(flags)
    directory, library = build_files(cache_root, key)
    if _loaded is not None:  # this key's build, wherever it was loaded from, or another's
        same = _loaded.name == directory.name
        return None if same else f"another build ({_loaded}) is already loaded"
    from torch.utils import cpp_extension

    from zerolayer.cachedir import ensure_dir  # the project's write-once directories

    if not (directory / library).is_file():  # to be built: that takes a compiler and ninja
        os.environ["PATH"] = with_environment_tools(os.environ.get("PATH", ""))
        compiler = os.environ.get("CXX", "c++")
        if shutil.which(compiler) is None:
            return f"no C++ compiler ({compiler!r} is not on PATH)"
        if not cpp_extension.is_ninja_available():
            return "ninja is not installed (pip install ninja)"
    built = []

    def compile_into(tmp: Path) -> None:
        # A build directory of its own, renamed into place when complete: cpp_extension's lock
        # file, which a killed build leaves behind, then never stalls a later start waiting
        # for it, and concurrent starts never share a half-written directory.
        cpp_extension.load(
            name=library.removesuffix(".so"),
            sources=[str(source) for source in SOURCES],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(tmp),
            is_python_module=False,  # loads the library: its ops are registered
            verbose=False,
        )
        built.append(tmp)

    started = time.monotonic()
    try:
        ensure_dir(directory, library, compile_into)
        if not built:  # built by an earlier start or another process (this one waited for it)
            torch.ops.load_library(str(directory / library))  # type: ignore[no-untyped-call]
    except Exception as exc:  # noqa: BLE001 - any build failure means: serve without it
        first = str(exc).strip().splitlines()
        return f"the build of {directory} failed: {first[0] if first else type(exc).__name__}"
    _loaded = directory
    log.info(
        "GGUF block kernel ready in %.1f s (%s, %s)",
        time.monotonic() - started,
        torch.backends.cpu.get_cpu_capability(),
        directory,
    )
    return None


@dataclass(frozen=True)
class QWeight:
    """A weight [N, K] as GGUF blocks of one kind: ``blocks`` [N, K / weights * bytes] uint8
    (``BLOCK_WEIGHTS``, ``BLOCK_BYTES``).
    Calling it on x [..., K] (float32 or bfloat16) gives x @ w.T [..., N] in x's dtype, with x
    quantized to 8-bit blocks first when ``int8``."""

    blocks: torch.Tensor
    kind: str
    int8: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown block type {self.kind!r}")
        if self.blocks.dtype != torch.uint8 or self.blocks.dim() != 2:
            raise ValueError("blocks must be a [rows, bytes] uint8 tensor")
        if self.blocks.shape[1] % BLOCK_BYTES[self.kind]:
            raise ValueError(f"{self.blocks.shape[1]} bytes a row are not whole {self.kind} blocks")

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    @property
    def in_features(self) -> int:
        return self.blocks.shape[1] // BLOCK_BYTES[self.kind] * BLOCK_WEIGHTS[self.kind]

    @staticmethod
    def stack(parts: list[QWeight]) -> QWeight | QStack:
        """Weights of one input laid one under the other, one call for all their outputs: the
        one QWeight itself, else a QStack of them, whatever their kinds (a Q4_K_M file's Q6_K
        v_proj beside Q4_K q_proj / k_proj). The parts are never concatenated: each stays a
        view of the file's own blocks."""
        if len({p.in_features for p in parts}) != 1:
            raise ValueError("stacked weights must have one input size")
        if len({p.int8 for p in parts}) != 1:
            raise ValueError("stacked weights must take one kind of activations")
        return parts[0] if len(parts) == 1 else QStack(tuple(parts), parts[0].int8)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` [...] of the weight [..., K] in ``dtype``: an embedding looked up from
        its blocks, the same values as the dense weight's rows (gguf's float32 values, then
        cast)."""
        picked = self.blocks.index_select(0, ids.reshape(-1))
        dense: torch.Tensor = torch.ops.zerolayer.dequantize(picked, KINDS[self.kind], False)
        return dense.to(dtype).view(*ids.shape, self.in_features)

    def with_int8(self, int8: bool) -> QWeight:
        """The same weight, products with 8-bit activations or not."""
        return replace(self, int8=int8)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] > MAX_ROWS.get(x.dtype, rows.shape[0]):
            return tiled(rows, (self,)).view(*x.shape[:-1], self.out_features)
        out: torch.Tensor
        if self.int8:
            out = torch.ops.zerolayer.q8matmul_parts(rows, [self.blocks], [KINDS[self.kind]])
        else:
            out = torch.ops.zerolayer.qmatmul(rows, self.blocks, KINDS[self.kind])
        return out.view(*x.shape[:-1], self.out_features)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] float32: the weights the kernel multiplies by for inputs of ``dtype``."""
        weights: torch.Tensor = torch.ops.zerolayer.dequantize(
            self.blocks, KINDS[self.kind], dtype == torch.bfloat16
        )
        return weights


@dataclass(frozen=True)
class QStack:
    """Weights of one input, each of its own kind, laid one under the other: calling it on x
    [..., K] gives torch.cat([w(x) for w in parts], -1), computed by one kernel call that
    walks each part's rows with its own kind's loop (``zerolayer::qmatmul_parts``)."""

    parts: tuple[QWeight, ...]
    int8: bool = False  # 8-bit activations (QWeight.int8)

    def with_int8(self, int8: bool) -> QStack:
        return QStack(tuple(p.with_int8(int8) for p in self.parts), int8)

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] > MAX_ROWS.get(x.dtype, rows.shape[0]):
            return tiled(rows, self.parts).view(*x.shape[:-1], self.out_features)
        blocks = [p.blocks for p in self.parts]
        kinds = [KINDS[p.kind] for p in self.parts]
        product = (
            torch.ops.zerolayer.q8matmul_parts if self.int8 else torch.ops.zerolayer.qmatmul_parts
        )
        out: torch.Tensor = product(rows, blocks, kinds)
        return out.view(*x.shape[:-1], self.out_features)


# Weight rows dequantized at a time by ``tiled``: a float32 tile of about 2 MiB, which stays in
# the caches while the input rows stream past it.
TILE_BYTES = 2 << 20


def tiled(x: torch.Tensor, parts: tuple[QWeight, ...]) -> torch.Tensor:
    """x [M, K] @ [w_0; w_1; ...].T for many input rows: each part's blocks dequantized a tile
    of rows at a time (the weights of the dense model: gguf's float32 values, rounded to
    bfloat16 for bfloat16 inputs) and multiplied as a dense product, so no dense copy of the
    whole matrix is ever held."""
    bf16 = x.dtype == torch.bfloat16
    k = x.shape[1]
    step = max(16, TILE_BYTES // (4 * k))
    outs = []
    for part in parts:
        for start in range(0, part.out_features, step):
            tile = part.blocks.narrow(0, start, min(step, part.out_features - start))
            w = torch.ops.zerolayer.dequantize(tile, KINDS[part.kind], bf16).to(x.dtype)
            outs.append(x @ w.T)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
