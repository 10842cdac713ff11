"""OpenMP's wait policy: the daemon sets passive waits only when the user chose none, and early
enough that libgomp reads it (OMP_DISPLAY_ENV=verbose prints what it read: its spin count is 0
for passive waits, 300,000 when nothing was set)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from zerolayer.ops import openmp

ROOT = Path(__file__).resolve().parents[2]


def test_passive_waits_are_set_when_the_user_chose_nothing() -> None:
    env = {"PATH": "/usr/bin"}
    assert openmp.set_defaults(env) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert env == {"PATH": "/usr/bin", "OMP_WAIT_POLICY": "PASSIVE"}


@pytest.mark.parametrize(
    "chosen", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": ""}, {"GOMP_SPINCOUNT": "10000"}]
)
def test_a_users_choice_is_kept_whole(chosen: dict[str, str]) -> None:
    env = dict(chosen)
    assert openmp.set_defaults(env) == {}
    assert env == chosen  # nothing added: GOMP_SPINCOUNT alone is a choice of how to wait


def serve_displaying_openmp(argv: list[str], **env: str) -> str:
    """What libgomp read at its start in ``python argv... serve`` of a model that does not exist
    (the daemon imports torch, then stops at the model): its spin count before a thread
    sleeps."""
    clean = {
        k: v for k, v in os.environ.items() if not k.startswith(("ZEROLAYER_", "OMP_", "GOMP_"))
    }
    proc = subprocess.run(
        [sys.executable, *argv, "serve", "/nonexistent/model.gguf", "--port", "0"]
        + ["--http-port", "0", "--metrics-port", "0"],
        cwd=ROOT,
        env={**clean, "OMP_DISPLAY_ENV": "verbose", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and "does not exist" in proc.stderr, proc.stderr[-2000:]
    found = re.findall(r"GOMP_SPINCOUNT = '(\d+)'", proc.stdout + proc.stderr)
    assert len(found) == 1, proc.stdout + proc.stderr
    return found[0]


@pytest.mark.parametrize("argv", [["-m", "zerolayer"], ["-m", "zerolayer.cli.main"]])
def test_serve_sets_passive_waits_before_libgomp_starts(argv: list[str]) -> None:
    # The console script calls zerolayer.cli.main:main, as both of these do.
    assert serve_displaying_openmp(argv) == "0"


def test_serve_keeps_the_users_wait_policy() -> None:
    assert serve_displaying_openmp(["-m", "zerolayer"], OMP_WAIT_POLICY="active") == "30000000000"
    assert serve_displaying_openmp(["-m", "zerolayer"], GOMP_SPINCOUNT="10000") == "10000"
