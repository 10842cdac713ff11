"""Shared pytest fixtures. Helpers live in tests/support, and those benchmarks share with tests
(the daemon launcher, redis-server, certificates, fuzz inputs, the soak) in benchmarks/_support;
unit tests in tests/unit run without starting a daemon, tests/e2e start real daemon processes
(and redis-server) on loopback.

What is expensive to make and not the point of the tests using it is made once per session: the
SmolLM2 file's description (config and tokenizer), transformers' reference model on the same
file, the GGUF block kernel (one build, which the daemons' data dirs link to:
``share_kernels``), and a synthetic daemon per config that several modules share.

torch runs on one thread in the test process and, by the environment they inherit, in the
daemons and child processes it starts (unless OMP_NUM_THREADS is set already): on the shared
2-core machine a second OpenMP thread waits for a free core at every op, so a model's tiny ops
take a scheduler slice each (tests/unit/test_prefix_store.py's builtin-model test, under the
same load: 170 s on two threads, 7.6 s on one). The block kernel's own tests split their work
across threads on purpose (tests/unit/test_qmatmul.py sets them back)."""

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from benchmarks._support.daemon import Daemon
from benchmarks._support.redis_server import RedisServer

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported: see above


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One real redis-server for the test session."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session's redis-server, flushed before the test."""
    redis_server.flush()
    return redis_server.url


@pytest.fixture(scope="session")
def shared_daemon() -> Iterator[Callable[[dict[str, str]], Daemon]]:
    """``shared_daemon(env)``: one synthetic daemon per config for the session, started when a
    test module first asks for that config and shared by the modules that ask for the same one
    (tests/e2e/test_protocol.py and test_client.py): modules that need a fresh daemon, or a
    daemon's end, start their own."""
    daemons: dict[tuple[tuple[str, str], ...], Daemon] = {}

    def daemon(env: dict[str, str]) -> Daemon:
        key = tuple(sorted(env.items()))
        if key not in daemons:
            daemons[key] = Daemon(env)
        return daemons[key]

    yield daemon
    for started in daemons.values():
        started.__exit__(None, None, None)


@pytest.fixture(scope="session")
def kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The GGUF block kernel built (and loaded in this process) once per session: the
    ``kernels`` directory of a data dir, which ``share_kernels`` links the daemons' data dirs
    to, so a daemon loads this build instead of compiling its own. Where a test loaded a build
    first (into its own data dir), that build's directory is the one. A build that fails is
    not reported here: the daemons then say why, as they would without this."""
    from zerolayer.kernels import qmatmul

    directory = tmp_path_factory.mktemp("kernels")
    qmatmul.build(directory)
    loaded = qmatmul.loaded_build()
    return directory if loaded is None else loaded.parent


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory, kernel_cache: Path) -> Path:
    """SmolLM2-135M-Instruct described once per session into a fresh cache (config.json and its
    tokenizer's files, as every daemon serving the file writes them; the weights stay in the
    file): the daemon tests pass its model.data_dir, so their daemons reuse it, and the
    session's kernel build. No test reads a float32 conversion of it (6 s of CPU and 0.5 GB
    written, when this fixture made one)."""
    from tests.support.datadirs import share_kernels
    from zerolayer.models.bundled import smollm2_gguf
    from zerolayer.models.gguf_import import ensure_described

    data_dir = share_kernels(tmp_path_factory.mktemp("models"), kernel_cache)
    return ensure_described(smollm2_gguf(), str(data_dir))[0]


@pytest.fixture(scope="session")
def smollm2_reference_model():
    """transformers' model loaded once per session from the same GGUF file (minutes on a crowded
    2-core machine): read only, never trained or changed by a test."""
    from tests.support.smollm2 import reference_model

    return reference_model()


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_reference_model):
    """``reference(ids, max_new_tokens)``: transformers' greedy ids for a prompt, from the
    session's reference model; each answer computed once per session."""
    from functools import cache

    from tests.support.smollm2 import reference_greedy

    @cache
    def greedy(ids: tuple[int, ...], max_new_tokens: int) -> list[int]:
        return reference_greedy(smollm2_reference_model, list(ids), max_new_tokens)

    return lambda ids, max_new_tokens: greedy(tuple(ids), max_new_tokens)


@pytest.fixture(scope="session")
def gemma3_file() -> Path:
    """Gemma 3 270M's GGUF, the file ``model.path = "@gemma3-270m"`` names (skipped until
    `make install-gemma` has installed and reassembled it)."""
    from zerolayer.models import bundled

    try:
        return bundled.gemma3_gguf()
    except bundled.BundledModelError as exc:
        pytest.skip(f"Gemma 3 270M is opt-in: {exc}")


@pytest.fixture(scope="session")
def gemma3_transformers_tokenizer(gemma3_file: Path):
    """transformers' tokenizer of that file, read once per session (its 262,144 tokens take
    tens of seconds): read only."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        str(gemma3_file.parent), gguf_file=gemma3_file.name
    )
