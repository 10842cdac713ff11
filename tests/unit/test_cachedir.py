"""Write-once cache directories (zerolayer.cachedir): what an interrupted write left is swept at
start, a directory being written by a live process is kept (issue #40 item 5)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
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
