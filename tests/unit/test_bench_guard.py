"""The guard's py-spy split (benchmarks/guard.py): which sampled stacks count as running, and
the area each is charged to."""

from __future__ import annotations

import pytest

from benchmarks.guard import spy_split

RUN = (
    "<module> (gateway/zerolayer/cli/main.py:1);run (uvloop/__init__.py:92);"
    "Runner.run (asyncio/runners.py:118)"
)
RAW = "\n".join(
    [
        # the engine thread asleep in its step, then waiting for the GIL (unnamed libc frames)
        "_bootstrap (threading.py:995);"
        "_pause_decode (gateway/zerolayer/engine/backends/synthetic.py:159);"
        "time_sleep (libpython3.11.so.1.0);pthread_cond_timedwait (libc.so.6);"
        "0x7f57534a3f16 (libc.so.6) 7",
        "_bootstrap (threading.py:995);wait (threading.py:331);"
        "PyThread_acquire_lock_timed (libpython3.11.so.1.0);0x7f5 (libc.so.6);0x7f6 (libc.so.6) 5",
        f"{RUN};epoll_pwait (libc.so.6) 9",
        # running: a frame written to its socket, a row's tokens hashed by numpy, the loop's C
        f"{RUN};Connection.flush (gateway/zerolayer/frames/door.py:503);"
        "UVStream__try_write (loop.c:1);write (libc.so.6) 3",
        "_bootstrap (threading.py:995);"
        "_decode (gateway/zerolayer/engine/backends/synthetic.py:200);"
        "sum (numpy/_core/fromnumeric.py:2313);PyArray_Sum (_multiarray_umath.so) 1",
        f"{RUN};run.<locals>.wrapper (uvloop/__init__.py:48);"
        "_serve (gateway/zerolayer/daemon.py:199);"
        "uv__io_poll_check (core.c:1089) 4",
    ]
)


def test_waits_are_left_out_and_running_stacks_charged_to_their_area():
    got = spy_split(RAW)
    assert (got["samples"], got["waiting_samples"]) == (8, 21)
    assert got["areas"] == pytest.approx(
        {
            "event loop (uvloop's C code)": 4 / 8,
            "frame door": 3 / 8,
            "numpy from synthetic backend": 1 / 8,
        }
    )
    assert got["modules"]["gateway/zerolayer/frames/door.py"] == pytest.approx(3 / 8)


def test_no_running_sample_is_an_error():
    with pytest.raises(SystemExit):
        spy_split(RAW.splitlines()[0])
