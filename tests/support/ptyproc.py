"""A command run in a pseudo-terminal (the stdlib's pty.fork: the pty is the child's controlling
terminal, so a Ctrl-C byte becomes SIGINT as it does for a user): send keys, wait for output."""

from __future__ import annotations

import os
import pty
import select
import signal
import time


class PtyProcess:
    def __init__(self, argv: list[str], cwd: str, env: dict[str, str]) -> None:
        pid, fd = pty.fork()
        if pid == 0:  # the child: exec at once
            os.chdir(cwd)
            os.execvpe(argv[0], argv, env)
        self.pid, self.fd = pid, fd
        self.output = b""  # everything read so far
        self._seen = 0  # offset up to which expect() has matched
        self.status: int | None = None

    def send(self, data: bytes | str) -> None:
        os.write(self.fd, data.encode() if isinstance(data, str) else data)

    def expect(self, needle: str, timeout: float = 60.0) -> str:
        """Read until ``needle`` appears after the last match; return the text before it."""
        want = needle.encode()
        deadline = time.monotonic() + timeout
        while True:
            at = self.output.find(want, self._seen)
            if at >= 0:
                before = self.output[self._seen : at]
                self._seen = at + len(want)
                return before.decode("utf-8", "replace")
            left = deadline - time.monotonic()
            if left <= 0 or not self._read(left):
                tail = self.output[self._seen :].decode("utf-8", "replace")
                raise AssertionError(f"no {needle!r} in the output; after the last match: {tail!r}")

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], min(timeout, 1.0))
        if not ready:
            return True  # nothing yet: keep waiting until the deadline
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            return False
        self.output += data
        return bool(data)

    def wait(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._read(0.05)
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
                return self.status
        self.kill()
        raise AssertionError("the process did not exit")

    def rest(self, timeout: float = 5.0) -> bytes:
        """After wait(): read what the child wrote before closing the terminal; all output."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._read(0.1):
            pass
        return self.output

    def kill(self) -> None:
        if self.status is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
            self.status = -9
        os.close(self.fd)
