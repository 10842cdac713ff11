"""The CPU backend in a running daemon: slots freed by disconnect and CANCEL; torch on one
thread."""

from __future__ import annotations

import time

import pytest

from benchmarks._support.daemon import Daemon
from tests.support import rawclient as rc
from zerolayer.config.settings import BUILTIN_MODEL

THREAD_WARNING = "torch ops are slower with two OpenMP teams"


@pytest.fixture(scope="module")
def cpu(tmp_path_factory):
    """(unused, unused, data_dir): the built-in model is generated into data_dir on start."""
    return None, None, str(tmp_path_factory.mktemp("builtin"))


def _running(d: Daemon) -> float:
    from benchmarks._support.metrics import scrape, value

    return value(scrape(d.metrics_url), "zerolayer_num_requests_running")


def _wait_for(pred, timeout=15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return False


def test_disconnect_and_cancel_free_slots_in_the_daemon(cpu):
    _, _, data_dir = cpu
    env = {
        "ENGINE__BACKEND": "cpu",
        "MODEL__PATH": BUILTIN_MODEL,
        "MODEL__DATA_DIR": data_dir,
        "ENGINE__MAX_BATCH_SIZE": "4",
        "ENGINE__MAX_CONTEXT": "1024",
    }
    with Daemon(env) as d:
        conn = rc.RawConnection(d.host, d.port)
        conn.send(rc.request(1, b"a long one", 1000))
        conn.send(rc.request(2, b"another long one", 1000))
        assert conn.read_frame()[0] == rc.TOKEN
        assert _wait_for(lambda: _running(d) == 2)
        conn.close()  # disconnect mid-stream
        assert _wait_for(lambda: _running(d) == 0), "slots not freed after disconnect"
        conn = rc.RawConnection(d.host, d.port)
        conn.send(rc.request(1, b"cancel this", 1000))
        assert conn.read_frame()[0] == rc.TOKEN
        assert _wait_for(lambda: _running(d) == 1)
        conn.send(rc.frame(rc.CANCEL, 1))
        res = rc.collect(conn, {1})[1]
        assert res["done"]["finish_reason"] == 3
        assert _wait_for(lambda: _running(d) == 0), "slot not freed after CANCEL"
        conn.close()


def test_daemon_loads_and_runs_the_model_on_one_thread(cpu, tmp_path):
    # Start-up loads the model and prefills a registered prompt; then requests run. If any of
    # these ran on another thread than the engine loop, the backend would log the warning.
    config = tmp_path / "prompts.toml"
    config.write_text('[[prompts]]\nid = 1\nname = "p"\ntext = "You are terse."\n')
    env = {
        "ENGINE__BACKEND": "cpu",
        "MODEL__PATH": BUILTIN_MODEL,
        "MODEL__DATA_DIR": cpu[2],
        "ENGINE__MAX_BATCH_SIZE": "2",
    }
    with Daemon(env, config=str(config)) as d:
        conn = rc.RawConnection(d.host, d.port)
        conn.send(rc.request(1, b"hello", 4))
        conn.send(rc.request(3, b"again", 4, prompt_id=1))
        results = rc.collect(conn, {1, 3})
        conn.close()
        assert all(r["done"] is not None for r in results.values())
        assert results[3]["done"]["cache"] & 2  # the registered prompt's KV was reused
        d.terminate()
    assert THREAD_WARNING not in d.log
