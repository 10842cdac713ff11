"""``zerolayer chat``: an interactive session with a running daemon, over the frame protocol or
any OpenAI-compatible HTTP endpoint.

Each message goes with the whole conversation: over frames (``tcp://``, ``tls://``) as a JSON
REQUEST with ``messages`` and ``system``; over HTTP (``http://``, ``https://``) as a streamed
``POST /v1/chat/completions`` with the system prompt as the first message, to the model the
endpoint's ``GET /v1/models`` lists first. Either way the server applies the model's chat
template and the answer streams to the terminal. Commands: ``/system [TEXT]`` (set, or show, the
system prompt; the history stays), ``/reset`` (forget the history), ``/exit`` (or ``/quit``,
Ctrl-D), ``/help``. A message that starts with ``\"\"\"`` runs to a line that ends with
``\"\"\"`` (multi-line input); a line that ends with a backslash continues on the next. Ctrl-C
while an answer streams stops it — over frames a CANCEL goes to the server, over HTTP the
stream's connection is closed (our daemon cancels a request whose client went away); either
frees the request's slot — and the session goes on (the partial answer stays in the history);
Ctrl-C at the prompt discards the line. A refused request (too long, rate limited) prints the
server's error and leaves the history as it was.

Input is read on the main thread (``input()``, with readline editing when available); an answer
streams on this module's own event loop, whose SIGINT handler cancels it for that time only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import ssl
import sys
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, Protocol

from zerolayer.client.bench.endpoint import Endpoint, parse_endpoint
from zerolayer.client.bench.http import StreamEnded, error_message, read_body, read_head
from zerolayer.client.connection import Client, ServerError

HELP = """\
commands: /system [TEXT]  set (or show) the system prompt
          /reset          forget the conversation
          /exit           leave (also /quit, Ctrl-D)
multi-line: start with \"\"\" and end with \"\"\"; or end a line with \\ to continue it.
Ctrl-C stops an answer; Ctrl-D leaves."""
STOPPED = "[stopped]"


class ChatError(Exception):
    """An answer the server refused or broke off (an HTTP error status, an error event)."""


class Answers(Protocol):
    """Where the answers come from: ``answer`` streams the text of one reply; cancelling the
    task that iterates it stops the answer on the server."""

    endpoint: str

    def answer(self, request: dict[str, Any]) -> AsyncIterator[str]: ...

    async def close(self) -> None: ...


class FrameAnswers:
    """Answers over the frame protocol: one JSON REQUEST each on the client's connection."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.endpoint = client.endpoint

    async def answer(self, request: dict[str, Any]) -> AsyncIterator[str]:
        stream = await self.client.generate_json(request)
        try:
            async for event in stream:
                yield event.text
        except asyncio.CancelledError:
            await stream.cancel()  # the server frees the slot at its next step
            raise

    async def close(self) -> None:
        await self.client.close()


class HttpAnswers:
    """Answers from an OpenAI-compatible ``/v1/chat/completions``, streamed as SSE, one
    connection per answer: closing it is how an answer is stopped."""

    def __init__(self, endpoint: Endpoint, api_key: str, model: str, tls: ssl.SSLContext | None):
        self._target, self._key, self.model, self._ssl = endpoint, api_key, model, tls
        self.endpoint = str(endpoint)

    @classmethod
    async def connect(
        cls, url: str, api_key: str = "", *, timeout: float, tls: ssl.SSLContext | None = None
    ) -> HttpAnswers:
        """Ask ``GET /v1/models`` for the model to talk to (the first one listed)."""
        endpoint = parse_endpoint(url, "openai-chat")
        if endpoint.tls and tls is None:
            tls = ssl.create_default_context()
        chat = cls(endpoint, api_key, "", tls)
        models_path = endpoint.path.removesuffix("/chat/completions") + "/models"
        try:
            status, body = await asyncio.wait_for(chat._call("GET", models_path, b""), timeout)
        except (OSError, asyncio.TimeoutError, StreamEnded) as exc:
            raise ChatError(f"cannot reach {endpoint}: {exc or type(exc).__name__}") from None
        if status != 200:
            raise ChatError(f"GET {models_path} answered {status}: {error_message(body)}")
        try:
            chat.model = json.loads(body)["data"][0]["id"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise ChatError(f"GET {models_path} listed no model") from None
        return chat

    def _head(self, method: str, path: str, body: bytes) -> bytes:
        e = self._target
        lines = [f"{method} {path} HTTP/1.1", f"Host: {e.host}:{e.port}", "Connection: close"]
        if body:
            lines += ["Content-Type: application/json", f"Content-Length: {len(body)}",
                      "Accept: text/event-stream"]  # fmt: skip
        if self._key:
            lines.append(f"Authorization: Bearer {self._key}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body

    async def _open(
        self, head: bytes
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, int, dict[str, str]]:
        reader, writer = await asyncio.open_connection(
            self._target.host, self._target.port, ssl=self._ssl, limit=1 << 20
        )
        writer.write(head)
        status, headers = await read_head(reader)
        return reader, writer, status, headers

    async def _call(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        reader, writer, status, headers = await self._open(self._head(method, path, body))
        try:
            return status, b"".join([piece async for piece in read_body(reader, headers)])
        finally:
            writer.close()

    def body(self, request: dict[str, Any]) -> bytes:
        """The chat request of ``ChatSession.request`` as an OpenAI body."""
        system = request.get("system")
        messages = ([{"role": "system", "content": system}] if system else []) + request["messages"]
        return json.dumps(
            {"model": self.model, "messages": messages, "stream": True,
             "max_tokens": request["max_tokens"], "temperature": request["temperature"]}
        ).encode()  # fmt: skip

    async def answer(self, request: dict[str, Any]) -> AsyncIterator[str]:
        try:
            head = self._head("POST", self._target.path, self.body(request))
            reader, writer, status, headers = await self._open(head)
        except (OSError, asyncio.IncompleteReadError, StreamEnded) as exc:
            raise ChatError(f"cannot reach {self._target}: {exc or type(exc).__name__}") from None
        try:
            if status != 200:
                body = b"".join([piece async for piece in read_body(reader, headers)])
                raise ChatError(f"HTTP {status}: {error_message(body)}")
            # aclosing: an answer left early (Ctrl-C, [DONE]) closes both readers now, not in
            # finaliser tasks the closing loop would report as destroyed while pending.
            closing = contextlib.aclosing
            async with (
                closing(read_body(reader, headers)) as pieces,
                closing(_sse_data(pieces)) as events,
            ):
                async for data in events:
                    if data == "[DONE]":
                        return
                    obj = json.loads(data)
                    if "error" in obj:
                        raise ChatError(error_message(data.encode()))
                    for choice in obj.get("choices") or ():
                        text = (choice.get("delta") or {}).get("content")
                        if text:
                            yield text
        except (OSError, asyncio.IncompleteReadError, StreamEnded, ValueError) as exc:
            raise ChatError(f"the answer broke off: {exc or type(exc).__name__}") from None
        finally:
            writer.close()  # on Ctrl-C too: the server sees its client gone and stops

    async def close(self) -> None:
        pass


async def _sse_data(pieces: AsyncIterator[bytes]) -> AsyncGenerator[str, None]:
    """The ``data`` of each SSE event in a body's pieces."""
    pending = b""
    data: list[str] = []
    async for piece in pieces:
        pending += piece
        *lines, pending = pending.split(b"\n")
        for raw in lines:
            line = raw.rstrip(b"\r").decode("utf-8", "replace")
            if not line and data:
                yield "\n".join(data)
                data = []
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))


async def connect(
    endpoint: str, api_key: str, *, timeout: float, tls: ssl.SSLContext | None
) -> Answers:
    """Answers from ``endpoint``: ``http(s)://`` an OpenAI-compatible API, else frames."""
    if endpoint.startswith(("http://", "https://")):
        return await HttpAnswers.connect(endpoint, api_key, timeout=timeout, tls=tls)
    return FrameAnswers(await Client.connect(endpoint, api_key, timeout=timeout, ssl=tls))


class ChatSession:
    """The conversation and the commands; ``write`` receives everything shown to the user."""

    def __init__(
        self,
        client: Answers,
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
        except (ServerError, ChatError) as exc:  # refused or failed: say so, keep the history
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
        parts: list[str] = []
        try:
            async for text in self.client.answer(request):
                parts.append(text)
                self.write(self.escape(text))
        except asyncio.CancelledError:  # Ctrl-C: the answer's own cleanup stopped it
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
    client: Answers,
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
