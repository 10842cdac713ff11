"""``zerolayer chat``: an interactive session with a running daemon over the frame protocol.

Each message goes as a JSON REQUEST with the whole conversation (``messages``, and ``system``
when set: the server applies the model's chat template) and the answer streams to the terminal.
Commands: ``/system [TEXT]`` (set, or show, the system prompt; the history stays), ``/reset``
(forget the history), ``/exit`` (or ``/quit``, Ctrl-D), ``/help``. A message that starts with
``\"\"\"`` runs to a line that ends with ``\"\"\"`` (multi-line input); a line that ends with a
backslash continues on the next. Ctrl-C while an answer streams stops it — a CANCEL goes to the
server, which frees the request's slot — and the session goes on (the partial answer stays in
the history); Ctrl-C at the prompt discards the line. A refused request (too long, rate limited)
prints the server's error and leaves the history as it was.

Input is read on the main thread (``input()``, with readline editing when available); an answer
streams on this module's own event loop, whose SIGINT handler cancels it for that time only.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Callable
from typing import Any

from gateway.client import Client, ServerError

HELP = """\
commands: /system [TEXT]  set (or show) the system prompt
          /reset          forget the conversation
          /exit           leave (also /quit, Ctrl-D)
multi-line: start with \"\"\" and end with \"\"\"; or end a line with \\ to continue it.
Ctrl-C stops an answer; Ctrl-D leaves."""
STOPPED = "[stopped]"


class ChatSession:
    """The conversation and the commands; ``write`` receives everything shown to the user."""

    def __init__(
        self,
        client: Client,
        loop: asyncio.AbstractEventLoop,
        *,
        system: str | None,
        max_tokens: int,
        temperature: float,
        write: Callable[[str], None],
        escape: Callable[[str], str] = lambda s: s,
    ) -> None:
        self.client, self.loop = client, loop
        self.system = system
        self.max_tokens, self.temperature = max_tokens, temperature
        self.history: list[dict[str, str]] = []
        self.write, self.escape = write, escape

    def command(self, line: str) -> bool:
        """Run a /command; False when the session ends."""
        name, _, rest = line.strip().partition(" ")
        if name in ("/exit", "/quit", "/bye"):
            return False
        if name == "/reset":
            self.history.clear()
            self.write("(conversation cleared)\n")
        elif name == "/system":
            if rest.strip():
                self.system = rest.strip()
                self.write("(system prompt set)\n")
            else:
                self.write(f"(system prompt: {self.system!r})\n")
        elif name == "/help":
            self.write(HELP + "\n")
        else:
            self.write(f"unknown command {name}: /help lists them\n")
        return True

    def request(self, text: str) -> dict[str, Any]:
        request: dict[str, Any] = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "messages": [*self.history, {"role": "user", "content": text}],
        }
        if self.system:
            request["system"] = self.system
        return request

    def ask(self, text: str) -> str:
        """Stream the answer to ``text``; Ctrl-C stops it. Returns the answer (as far as it got)."""
        task = self.loop.create_task(self._stream(self.request(text)))
        self.loop.add_signal_handler(signal.SIGINT, task.cancel)
        try:
            answer, stopped = self.loop.run_until_complete(task)
        except ServerError as exc:  # refused or failed: say so, keep the session and history
            self.write(f"\nerror: {exc}\n")
            return ""
        finally:
            self.loop.remove_signal_handler(signal.SIGINT)
        self.write(f" {STOPPED}\n" if stopped else "\n")
        self.history += [
            {"role": "user", "content": text},
            {"role": "assistant", "content": answer},
        ]
        return answer

    async def _stream(self, request: dict[str, Any]) -> tuple[str, bool]:
        stream = await self.client.generate_json(request)
        parts: list[str] = []
        try:
            async for event in stream:
                parts.append(event.text)
                self.write(self.escape(event.text))
        except asyncio.CancelledError:
            await stream.cancel()  # the server frees the slot at its next step
            return "".join(parts), True
        return "".join(parts), False


def read_message(read: Callable[[str], str]) -> str:
    """One message from ``read`` (``input``): a line, a \"\"\"-block, or \\-continued lines.
    Raises EOFError (Ctrl-D) and KeyboardInterrupt (Ctrl-C) as ``read`` does."""
    line = read(">>> ")
    if line.lstrip().startswith('"""'):
        body = line.lstrip()[3:]
        lines = []
        while not body.rstrip().endswith('"""'):
            lines.append(body)
            body = read("... ")
        lines.append(body.rstrip()[:-3])
        return "\n".join(lines).strip("\n")
    lines = []
    while line.endswith("\\"):
        lines.append(line[:-1])
        line = read("... ")
    lines.append(line)
    return "\n".join(lines)


def run_chat(
    client: Client,
    loop: asyncio.AbstractEventLoop,
    *,
    system: str | None,
    max_tokens: int,
    temperature: float,
    escape: Callable[[str], str],
) -> int:
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401 - line editing and history for input()

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    session = ChatSession(
        client, loop, system=system, max_tokens=max_tokens, temperature=temperature,
        write=write, escape=escape,
    )  # fmt: skip
    write(f"connected to {client.endpoint}; /help for commands, Ctrl-D to leave\n")
    while True:
        try:
            text = read_message(input)
        except EOFError:
            write("\n")
            return 0
        except KeyboardInterrupt:
            write("\n")
            continue
        if not text.strip():
            continue
        if text.startswith("/"):
            if not session.command(text):
                return 0
            continue
        session.ask(text)
