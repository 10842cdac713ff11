"""A busy core while a benchmark measures: one child process spinning on one CPU, as another
program on a shared machine would take it (issue 38: on a 2-core machine a spinning neighbour
collapsed the default's throughput 8x). It stops when the block ends, and by itself after
``limit_s`` whatever happens to the benchmark.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

# The child: pinned to the CPU, then a busy loop that ends by itself.
_SPIN = (
    "import os, sys, time\n"
    "os.sched_setaffinity(0, {int(sys.argv[1])})\n"
    "end = time.monotonic() + float(sys.argv[2])\n"
    "while time.monotonic() < end:\n"
    "    pass\n"
)


@contextlib.contextmanager
def busy_core(cpu: int = 1, limit_s: float = 3600.0) -> Iterator[int]:
    """A process spinning on ``cpu`` for the time of the block; yields its pid."""
    if cpu not in os.sched_getaffinity(0):
        raise SystemExit(f"--busy-core: CPU {cpu} is not one this process may run on")
    proc = subprocess.Popen([sys.executable, "-c", _SPIN, str(cpu), str(limit_s)])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()
