"""Write-once cache directories (zerolayer.cachedir): what an interrupted write left is swept at
start, a directory being written by a live process is kept (issue #40 item 5); two processes
writing one directory at once write it once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from zerolayer.cachedir import ensure_dir, sweep


def _temporaries(root: Path) -> list[Path]:
    return [p for p in root.rglob(".*") if p.is_dir()]


def test_a_writer_killed_mid_write_leaves_a_directory_the_next_start_sweeps(tmp_path):
    """A child writes a cache directory and is killed (SIGKILL) in the middle; the sweep
    removes what it left, and a second live writer's directory, locked, is kept."""
    script = textwrap.dedent(
        """
        import sys, time
        from pathlib import Path
        from zerolayer.cachedir import ensure_dir

        def write(tmp: Path) -> None:
            (tmp / "half").write_bytes(b"x" * 1000)
            print("writing", flush=True)
            time.sleep(60)

        ensure_dir(Path(sys.argv[1]), "done", write)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cache = tmp_path / "gguf"
    children = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(cache / name)], stdout=subprocess.PIPE, env=env
        )
        for name in ("killed", "alive")
    ]
    try:
        for child in children:
            assert child.stdout is not None and child.stdout.readline() == b"writing\n"
        os.kill(children[0].pid, signal.SIGKILL)
        children[0].wait()
        assert len(_temporaries(tmp_path)) == 2
        assert sweep(tmp_path) == 1  # the killed writer's, one level down
        left = _temporaries(tmp_path)
        assert len(left) == 1 and left[0].name.startswith(".alive-")
    finally:
        for child in children:
            if child.poll() is None:
                os.kill(child.pid, signal.SIGKILL)
            child.wait()
    assert sweep(tmp_path) == 1  # its writer gone too
    assert _temporaries(tmp_path) == []


def test_sweep_keeps_finished_directories_and_other_files(tmp_path):
    done = ensure_dir(tmp_path / "builtin-abc", "model", lambda t: (t / "model").write_text("m"))
    (tmp_path / ".keys-abcdefgh").write_text("a file, not a directory")
    (tmp_path / ".left-abc12345").mkdir()  # an older version's leftover: no lock, swept
    (tmp_path / "notes").mkdir()
    assert sweep(tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [".keys-abcdefgh", "builtin-abc", "notes"]
    assert (done / "model").read_text() == "m"
    assert sweep(tmp_path / "missing") == 0


def _waits_for_a_lock(pid: int) -> bool:
    """Whether process ``pid`` is blocked on a file lock (a "->" line of /proc/locks)."""
    with open("/proc/locks") as fh:
        return any(f"-> FLOCK  ADVISORY  WRITE {pid} " in line for line in fh)


def test_two_processes_writing_one_directory_at_once_write_it_once(tmp_path):
    """The kernel build's race (two daemons compiling one key at once): the first process
    writes, held at a gate; the second, started while it writes, waits, then finds the
    directory written and returns it without writing."""
    script = textwrap.dedent(
        """
        import sys, time
        from pathlib import Path
        from zerolayer.cachedir import ensure_dir

        target, gate, log = (Path(arg) for arg in sys.argv[1:4])
        name = sys.argv[4]

        def write(tmp: Path) -> None:
            with open(log, "a") as fh:
                fh.write(f"{name} writes\\n")
            print("writing", flush=True)
            while not gate.exists():
                time.sleep(0.01)
            (tmp / "done").write_text(name)

        print(ensure_dir(target, "done", write), flush=True)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    target, gate, log = tmp_path / "kernels" / "qmatmul-k", tmp_path / "gate", tmp_path / "log"

    def start(name: str) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-c", script, str(target), str(gate), str(log), name]
        return subprocess.Popen(argv, stdout=subprocess.PIPE, env=env)

    first = start("first")
    second = None
    try:
        assert first.stdout is not None and first.stdout.readline() == b"writing\n"
        second = start("second")
        # On until the second one waits for the first's lock, or (without one) writes too.
        deadline = time.monotonic() + 60  # a guard against a hang, not a measure
        while not _waits_for_a_lock(second.pid) and "second" not in log.read_text():
            assert second.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        gate.touch()
        outs = [child.communicate(timeout=60)[0] for child in (first, second)]
    finally:
        for child in (first, second):
            if child is not None and child.poll() is None:
                child.kill()
                child.wait()
    assert log.read_text() == "first writes\n"  # one write, the second process waited
    assert outs == [f"{target}\n".encode()] * 2
    assert (target / "done").read_text() == "first"
    assert _temporaries(tmp_path) == []
