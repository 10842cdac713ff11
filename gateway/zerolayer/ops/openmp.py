"""How the daemon's OpenMP threads wait: passive waits unless the user chose a wait policy.

torch runs its CPU kernels (and ours, ``kernels/qmatmul.cpp``) on GNU OpenMP's thread team. By
default a libgomp thread that reaches a barrier spins for a while (about 300,000 iterations)
before it sleeps. On a machine where other processes want the cores, the spinning threads of
one parallel region keep a core from the thread they wait for: on the shared 2-core machine of
docs/benchmarks.md ("Defaults", load 9-10), SmolLM2 on 2 threads served 8 streams at 1.3
output tokens/s with libgomp's default waits and at 28 with passive ones (1 thread: 27). With
``OMP_WAIT_POLICY=PASSIVE`` a waiting thread sleeps at once.

libgomp reads these variables once, when it is loaded (with torch, at its first import), so
``set_defaults`` runs before anything imports torch: in ``zerolayer serve`` (the console script
and ``python -m zerolayer`` both go through ``zerolayer.cli.main``). A user who set either
variable keeps their choice, both of them: GOMP_SPINCOUNT overrides the policy's spin count.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

__all__ = ["DEFAULTS", "USER_CHOICES", "describe", "set_defaults"]

# What the daemon sets when the user set none of USER_CHOICES.
DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}
# The variables by which a user chooses how libgomp waits (any one of them set: no default).
USER_CHOICES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")

_set: dict[str, str] = {}  # what set_defaults put into os.environ in this process
_late = False  # torch (hence libgomp) was already loaded when set_defaults ran


def set_defaults(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Put ``DEFAULTS`` into ``environ`` (``os.environ``) when none of ``USER_CHOICES`` is in
    it; returns what it set (empty when the user chose)."""
    global _late
    target = os.environ if environ is None else environ
    if any(name in target for name in USER_CHOICES):
        return {}
    target.update(DEFAULTS)
    if environ is None:
        _set.update(DEFAULTS)
        _late = "torch" in sys.modules
    return dict(DEFAULTS)


def describe() -> str:
    """One phrase for the start-up log: the wait settings in effect and whose they are."""
    chosen = ", ".join(f"{n}={os.environ[n]}" for n in USER_CHOICES if n in os.environ)
    if not chosen:
        return "OpenMP waits: libgomp's default (spin, then sleep)"
    if not _set:
        return f"OpenMP waits: {chosen} (set before the daemon started)"
    if _late:
        return f"OpenMP waits: {chosen} set after torch was loaded, so not in effect"
    return f"OpenMP waits: {chosen} (the daemon's default)"
