"""Issues #25's and #40's attacks, each beside a canary: how much each one hurts a client it
must not hurt, and whether the daemon gets its descriptors and memory back.

For every attack, in turn: the canary alone (``--quiet-s``), then the attack from other loopback
addresses (127.0.0.2 ...) with the canary asking throughout (``--attack-s``), then the
attackers leave and the daemon settles. Per attack: the canary's time to first token on both
doors, p50 and p99, alone and under attack, and its failures; the daemon's descriptors and RSS
before the attack and after the attackers left; the attack's HTTP answers by status where they
are the point. The canary (benchmarks/_canary.py) streams from 127.0.0.1 on the HTTP door (OpenAI
chat) and the frame door (zerolayer.client.connection).

The attacks, by daemon (``TARGETS``, one daemon after another), each with the test of
``make test`` that checks its fix by order and counts:

- synthetic backend, 2 ms steps — issue #25's: a lone surrogate in a JSON key (1), a header
  line growing without end (2), prompts far over the context (3), slowloris heads and bodies
  held open (4), one client flooding the engine queue (5), idle connections that sent HELLO (6)
  (tests/e2e/test_hostile.py); and #40's: one address holding every slot from 8 connections
  and four requests with n=8 from one address (item 2; tests/unit/test_row_shares.py: the
  second key admitted before the first key's 33rd row, n=8 heads not starving a newcomer), a
  whole-vocabulary logit_bias from 8 clients (item 3; tests/unit/test_sampling_batched.py);
- SmolLM2 on the cpu backend — #40's 64 streams with top_logprobs 20 (item 3;
  tests/e2e/test_client_v2.py: 20 descending alternatives for every token at 64 streams;
  benchmarks/logprobs_cost.py measures their cost against plain streams) and the grammars that
  stalled the step (item 1: four clients sending benchmarks/hostile_grammars.py's schemas in a
  loop, all 400 expected, no 500; tests/unit/test_lifecycle.py, tests/e2e/test_http_agents.py);
- synthetic backend with auth on, the canary holding a key — #40's bogus credential beside a
  valid one, and two valid keys of different principals (item 4: all 401 expected;
  tests/e2e/test_http.py, tests/e2e/test_tls.py for HELLO);
- then, no canary: #40 item 5, a daemon killed (SIGKILL) while its first start writes a cache
  directory, and the temporary directories left once the next start listens (0 expected;
  tests/unit/test_cachedir.py).

``--only TEXT`` runs the attacks whose name contains TEXT (a daemon with none is not started:
``--only "#40 7"`` runs the grammars alone; ``--write`` then writes a section of its own,
``hostile-<TEXT>``); ``--tree DIR`` runs daemons of another source tree
(a baseline checkout) instead of this one.

Bounded: each attack stops at the end of its window; loopback only.

    python benchmarks/hostile.py [--quiet-s 4] [--attack-s 8] [--rounds 2] [--only TEXT]
                                 [--tree DIR] [--write]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path

import uvloop

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._canary import DOORS, in_own_process  # noqa: E402
from benchmarks._report import machine, machine_line, parser, publish, table  # noqa: E402
from benchmarks._support.daemon import ROOT, Daemon, die_with_parent  # noqa: E402
from benchmarks.hostile_grammars import LATE, REFUSED, request_fields  # noqa: E402
from zerolayer.frames import protocol as p  # noqa: E402
from zerolayer.hooks.keys import add_key  # noqa: E402

ATTACKERS = [f"127.0.0.{i}" for i in range(2, 10)]
Attack = Callable[[Daemon, Callable[[], bool]], Awaitable[int]]
SYNTHETIC_VOCAB = 32000  # engine.synthetic_vocab_size's default


def fds(d: Daemon) -> int:
    return len(os.listdir(f"/proc/{d.proc.pid}/fd"))


def post(path: bytes, body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nhost: a\r\ncontent-type: application/json\r\n%s"
        b"content-length: %d\r\n\r\n%s" % (path, extra, len(body), body)
    )


Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def connect(d: Daemon, port: int, source: str) -> Conn | None:
    try:
        return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    except OSError:
        return None


async def answered(reader: asyncio.StreamReader, hang_s: float = 10.0) -> bool:
    with contextlib.suppress(OSError, asyncio.TimeoutError, TimeoutError):
        return bool(await asyncio.wait_for(reader.read(12), hang_s))
    return False


async def http_clients(
    d: Daemon,
    clients: int,
    go_on: Callable[[], bool],
    one: Callable[[int, Conn], Awaitable[None]],
    source: str = "",
) -> int:
    """``clients`` attackers on the HTTP door, each on its own address (all on ``source`` when
    given: one principal), each doing ``one(n, connection)`` on a fresh connection after
    another while ``go_on()``; returns how many."""
    sent = 0

    async def client(k: int) -> None:
        nonlocal sent
        while go_on():
            conn = await connect(d, d.http_port, source or ATTACKERS[k])
            if conn is None:
                continue
            sent += 1
            with contextlib.suppress(OSError):
                await one(sent, conn)
            conn[1].close()

    await asyncio.gather(*(client(k) for k in range(clients)))
    return sent


async def surrogate_keys(d: Daemon, go_on: Callable[[], bool]) -> int:
    """Item 1: bodies with a lone surrogate as a JSON key, on all three APIs, 8 at a time."""
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":4,"\\ud800":1}'
    paths = (b"/v1/chat/completions", b"/v1/messages", b"/v1/completions")

    async def one(n: int, conn: Conn) -> None:
        conn[1].write(post(paths[n % 3], body, b"connection: close\r\n"))
        await answered(conn[0])

    return await http_clients(d, 8, go_on, one)


async def endless_header(d: Daemon, go_on: Callable[[], bool]) -> int:
    """Item 2: 4 connections each sending one header line, 64 KiB at a time, until refused."""

    async def one(n: int, conn: Conn) -> None:
        writer = conn[1]
        writer.write(b"GET / HTTP/1.1\r\nx-long: ")
        while go_on() and not writer.is_closing():
            writer.write(b"a" * 65536)
            await writer.drain()

    return await http_clients(d, 4, go_on, one)


async def huge_prompts(d: Daemon, go_on: Callable[[], bool]) -> int:
    """Item 3: 4 MB bodies (over the body limit), 1 MB messages (over the text bound) and 20 KB
    ones (tokenized off the loop, then over the context), on both APIs and the frame door, 4
    clients looping."""
    chat = {"model": "m", "max_tokens": 4}
    bodies = [
        json.dumps({**chat, "messages": [{"role": "user", "content": c * n}]}).encode()
        for c, n in (("a", 4_000_000), ("a", 1_000_000), ("b", 20_000))
    ]
    sent = 0

    async def one(n: int, conn: Conn) -> None:
        path = b"/v1/messages" if n % 2 else b"/v1/chat/completions"
        conn[1].write(post(path, bodies[n % 3], b"connection: close\r\n"))
        await answered(conn[0], 30)

    async def frames() -> None:
        nonlocal sent
        conn = await connect(d, d.port, ATTACKERS[3])
        if conn is None:
            return
        reader, writer = conn
        writer.write(p.encode_hello())
        sid = 1
        while go_on():
            big = {"messages": [{"role": "user", "content": "c" * 20_000}], "max_tokens": 4}
            writer.write(p.encode_json_request(sid, big))
            sid += 2
            sent += 1
            await asyncio.sleep(0.02)
            with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
                await asyncio.wait_for(reader.read(65536), 0.01)
        writer.close()

    _, http_sent = await asyncio.gather(frames(), http_clients(d, 3, go_on, one))
    return sent + http_sent


async def slowloris(d: Daemon, go_on: Callable[[], bool]) -> int:
    """Item 4: from 8 addresses, connections that send a head byte by byte, and bodies of
    just under 4 MiB held open, as many as the daemon lets in."""
    held: list[asyncio.StreamWriter] = []
    big = 4 * 1_048_576 - 1024
    k = 0
    while go_on() and len(held) < 3000:
        conn = await connect(d, d.http_port, ATTACKERS[k % len(ATTACKERS)])
        k += 1
        if conn is None:
            await asyncio.sleep(0.01)
            continue
        _, writer = conn
        if k % 10 == 0:  # a body declared, a part sent, the rest never
            writer.write(post(b"/v1/chat/completions", b"")[:-4] + b"%d\r\n\r\n{" % big)
            writer.write(b"x" * 65536)
        else:
            writer.write(b"P")
        held.append(writer)
        if k % 50 == 0:
            await asyncio.sleep(0)
    while go_on():  # trickle: one byte per connection a second keeps the heads open
        for writer in held:
            if not writer.is_closing():
                writer.write(b"O")
        await asyncio.sleep(1.0)
    for writer in held:
        writer.close()
    return len(held)


async def queue_flood(d: Daemon, go_on: Callable[[], bool]) -> int:
    """Item 5: one client, 5 frame connections of 256 long streams each."""
    writers, sent = [], 0
    for c in range(5):
        conn = await connect(d, d.port, ATTACKERS[0])
        if conn is None:
            continue
        reader, writer = conn
        writer.write(p.encode_hello())
        for i in range(256):
            writer.write(p.encode_request(2 * i + 1, f"flood {c} {i}", 100_000, cache=False))
            sent += 1
        writers.append((reader, writer))
    while go_on():  # read what comes, so the daemon is not blocked by a slow consumer
        for reader, _ in writers:
            with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
                await asyncio.wait_for(reader.read(1 << 20), 0.01)
        await asyncio.sleep(0.05)
    for _, writer in writers:
        writer.close()
    return sent


async def idle_hellos(d: Daemon, go_on: Callable[[], bool]) -> int:
    """Item 6: 1,100 connections from one address that send HELLO and go idle."""
    writers = []
    for _ in range(1100):
        if not go_on():
            break
        conn = await connect(d, d.port, ATTACKERS[1])
        if conn is None:
            continue
        writers.append(conn[1])
        conn[1].write(p.encode_hello())
    while go_on():
        await asyncio.sleep(0.2)
    for writer in writers:
        writer.close()
    return len(writers)


async def keep_streams(
    d: Daemon, go_on: Callable[[], bool], source: str, request: Callable[[int, int], bytes]
) -> int:
    """From ``source``, 8 frame connections each keeping 8 streams in flight: stream ``s`` of
    connection ``c`` sends ``request(c, s)`` again as soon as it ends. Returns the REQUESTs."""
    sent = 0

    async def connection(c: int) -> None:
        nonlocal sent
        conn = await connect(d, d.port, source)
        if conn is None:
            return
        reader, writer = conn
        writer.write(p.encode_hello())
        welcome = p.HEADER.unpack(await reader.readexactly(12))
        await reader.readexactly(welcome[0])
        for i in range(8):
            writer.write(request(c, 2 * i + 1))
            sent += 1
        while go_on():
            try:
                head = await asyncio.wait_for(reader.readexactly(12), 0.5)
            except (asyncio.TimeoutError, TimeoutError):
                continue
            except (asyncio.IncompleteReadError, OSError):
                return
            length, ftype, _, _, stream = p.HEADER.unpack(head)
            await reader.readexactly(length)
            if ftype in (p.FrameType.DONE, p.FrameType.ERROR) and stream:
                writer.write(request(c, stream))
                sent += 1
        writer.close()

    await asyncio.gather(*(connection(c) for c in range(8)))
    return sent


async def slot_hog(d: Daemon, go_on: Callable[[], bool]) -> int:
    """Issue #40 item 2: one address on 8 frame connections keeps 8 streams of 300 tokens in
    flight on each (64: every slot and more queued), each replaced as soon as it ends."""
    return await keep_streams(
        d, go_on, ATTACKERS[2],
        lambda c, s: p.encode_request(s, f"hog {c} {s}", 300, cache=False),
    )  # fmt: skip


async def n8_requests(d: Daemon, go_on: Callable[[], bool]) -> int:
    """Issue #40 item 2: four clients of one address, each asking for n=8 choices of 300
    tokens over and over (32 rows: every slot, had n not counted as n rows)."""
    body = json.dumps(
        {"messages": [{"role": "user", "content": "n"}], "max_tokens": 300, "n": 8}
    ).encode()

    async def one(n: int, conn: Conn) -> None:
        reader, writer = conn
        writer.write(post(b"/v1/chat/completions", body, b"connection: close\r\n"))
        await answered(reader, 60.0)
        while await asyncio.wait_for(reader.read(1 << 16), 60.0):
            pass

    return await http_clients(d, 4, go_on, one, ATTACKERS[4])


async def logprobs_streams(d: Daemon, go_on: Callable[[], bool]) -> int:
    """Issue #40 item 3: one address keeps 64 streams of 64 tokens with top_logprobs 20 in
    flight (8 frame connections; benchmarks/logprobs_cost.py measures their own cost)."""
    return await keep_streams(
        d, go_on, ATTACKERS[5],
        lambda c, s: p.encode_request(
            s, [5 + (c * 8 + s) % 50, 6, 7], 64, logprobs=True, top_logprobs=20, cache=False
        ),
    )  # fmt: skip


async def whole_vocabulary_bias(d: Daemon, go_on: Callable[[], bool]) -> int:
    """Issue #40 item 3: 8 clients ask with a logit_bias on every id of the vocabulary."""
    bias = {str(i): (i % 7) - 3 for i in range(SYNTHETIC_VOCAB)}
    body = json.dumps(
        {"messages": [{"role": "user", "content": "b"}], "max_tokens": 20, "logit_bias": bias}
    ).encode()
    request = post(b"/v1/chat/completions", body)

    async def one(n: int, conn: Conn) -> None:
        reader, writer = conn
        writer.write(request)
        await answered(reader, 30.0)
        while await asyncio.wait_for(reader.read(1 << 16), 30.0):
            pass

    return await http_clients(d, 8, go_on, one)


ANSWERS: collections.Counter[str] = collections.Counter()  # the attack's HTTP statuses: count


async def count_answer(reader: asyncio.StreamReader, hang_s: float = 60.0) -> None:
    """Counts the status of the answer on ``reader`` (or "no answer") in ``ANSWERS``."""
    head = b""
    with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
        head = await asyncio.wait_for(reader.read(12), hang_s)
    ANSWERS[head[9:12].decode(errors="replace") or "no answer"] += 1


async def stalling_grammars(d: Daemon, go_on: Callable[[], bool]) -> int:
    """#40 item 7: four clients send the schemas that stalled the engine's step (and the regex
    that fails late), one after another; each answer's status is counted."""
    with urllib.request.urlopen(d.http_url + "/v1/models", timeout=30) as r:  # noqa: S310
        model = json.load(r)["data"][0]["id"]  # the HTTP door answers 404 to another name
    bodies = [
        json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 8, **request_fields(kind, spec)}).encode()
        for kind, spec, _ in [*REFUSED.values(), *LATE.values()]
    ]  # fmt: skip

    async def one(n: int, conn: Conn) -> None:
        reader, writer = conn
        writer.write(post(b"/v1/chat/completions", bodies[n % len(bodies)]))
        await writer.drain()
        await count_answer(reader)

    return await http_clients(d, 4, go_on, one)


KEYS: list[str] = []  # the auth daemon's keys: the canary's, then another principal's
BOGUS_KEY = "zl_" + "x" * 43  # a key's shape, in no keys file


async def bogus_credentials(d: Daemon, go_on: Callable[[], bool]) -> int:
    """Issue #40 item 4: four clients send a bogus bearer token beside a valid x-api-key, a valid
    bearer beside a bogus x-api-key, and two valid keys of different principals; each answer's
    status is counted (all 401 expected: none served)."""
    valid, other = KEYS
    pairs = [(BOGUS_KEY, valid), (valid, BOGUS_KEY), (valid, other)]
    body = json.dumps({"messages": [{"role": "user", "content": "k"}], "max_tokens": 4}).encode()

    async def one(n: int, conn: Conn) -> None:
        bearer, api_key = pairs[n % len(pairs)]
        extra = b"authorization: Bearer %s\r\nx-api-key: %s\r\nconnection: close\r\n" % (
            bearer.encode(), api_key.encode(),
        )  # fmt: skip
        conn[1].write(post(b"/v1/chat/completions", body, extra))
        await count_answer(conn[0])

    return await http_clients(d, 4, go_on, one)


# The daemons the attacks run against (one after another), each with its attacks:
# (name, config overrides, attacks, auth on with two keys, the canary holding the first).
SYNTHETIC = {"ENGINE__BACKEND": "synthetic", "ENGINE__SYNTHETIC_STEP_MS": "2",
             "ENGINE__MAX_QUEUE": "1024", "HTTP__HEADER_TIMEOUT_S": "10"}  # fmt: skip
TARGETS: list[tuple[str, dict[str, str], list[tuple[str, Attack]], bool]] = [
    ("synthetic, 2 ms steps", SYNTHETIC, [
        ("1 lone surrogate in a JSON key", surrogate_keys),
        ("2 a header line without end", endless_header),
        ("3 prompts over the context", huge_prompts),
        ("4 slowloris heads and held bodies", slowloris),
        ("5 one client floods the engine queue", queue_flood),
        ("6 idle connections after HELLO", idle_hellos),
        ("#40 2 one address holds every slot (8 connections)", slot_hog),
        ("#40 2 four requests with n=8 from one address", n8_requests),
        ("#40 3 whole-vocabulary logit_bias from 8 clients", whole_vocabulary_bias),
    ], False),
    ("SmolLM2, cpu", {"ENGINE__BACKEND": "cpu", "MODEL__PATH": "@smollm2"}, [
        ("#40 3 64 streams with top_logprobs 20 (8 connections)", logprobs_streams),
        ("#40 7 schemas that stalled the step", stalling_grammars),
    ], False),
    ("synthetic, auth on", SYNTHETIC, [
        ("#40 4 a bogus credential beside a valid one", bogus_credentials),
    ], True),
]  # fmt: skip
KILLED_START = "#40 5 kill -9 during the first start's conversion"


def temporaries(root: Path, depth: int = 3) -> int:
    """Directories under ``root`` (``depth`` levels down) named as zerolayer.cachedir's writers
    name a directory being written: a dot, the target's name, a dash and mkdtemp's suffix."""
    found = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            if entry.is_dir(follow_symlinks=False):
                if entry.name.startswith("."):
                    found += 1
                elif depth > 1:
                    found += temporaries(Path(entry.path), depth - 1)
    return found


def killed_first_start(limit_s: float = 600.0) -> dict:
    """#40 5: a daemon of the default model on a fresh data directory, killed (SIGKILL) as soon
    as a cache directory is being written (its first conversion, or its kernel build); then a
    second daemon on the same directory. The temporary directories the kill left, and those
    still there once the second one listens (0: swept at start)."""
    with tempfile.TemporaryDirectory() as data:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROLAYER_")}
        env |= {"ZEROLAYER_SERVER__PORT": "0", "ZEROLAYER_HTTP__PORT": "0",
                "ZEROLAYER_METRICS__PORT": "0", "ZEROLAYER_ENGINE__BACKEND": "cpu",
                "ZEROLAYER_MODEL__PATH": "@smollm2", "ZEROLAYER_MODEL__DATA_DIR": data}  # fmt: skip
        first = subprocess.Popen(
            [sys.executable, "-m", "zerolayer.cli.main", "serve"], env=env, cwd=ROOT,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent,
        )  # fmt: skip
        deadline = time.monotonic() + limit_s
        while first.poll() is None and not temporaries(Path(data)):
            if time.monotonic() > deadline:
                break
            time.sleep(0.005)
        first.kill()
        first.wait()
        left = temporaries(Path(data))
        with Daemon({"ENGINE__BACKEND": "cpu", "MODEL__PATH": "@smollm2", "MODEL__DATA_DIR": data}):
            after = temporaries(Path(data))
    return {"temporaries_after_kill": left, "temporaries_after_restart": after}


async def run_attack(
    d: Daemon, attack: Attack, quiet_s: float, attack_s: float, key: str = ""
) -> dict:
    quiet = await in_own_process(d.http_port, d.endpoint, quiet_s, key=key)
    fd0, rss0 = fds(d), d.rss_mb()
    end = time.monotonic() + attack_s

    def go_on() -> bool:
        return time.monotonic() < end

    t0 = time.monotonic()
    ANSWERS.clear()
    sent, under = await asyncio.gather(
        attack(d, go_on), in_own_process(d.http_port, d.endpoint, attack_s, key=key)
    )
    attack_elapsed = time.monotonic() - t0
    answers = dict(ANSWERS)
    deadline = time.monotonic() + 20  # the attackers left: descriptors come back
    while fds(d) > fd0 + 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    await asyncio.sleep(1.0)
    return {
        "attack_requests_or_connections": sent,
        "attack_s": round(attack_elapsed, 1),
        "canary_alone": quiet,
        "canary_attacked": under,
        "fds_before": fd0,
        "fds_after": fds(d),
        "rss_before_mb": round(rss0, 1),
        "rss_after_mb": round(d.rss_mb(), 1),
        **({"answers": answers} if answers else {}),
    }


def run_target(
    env: dict[str, str], attacks: list[tuple[str, Attack]], auth: bool, args: argparse.Namespace
) -> tuple[dict[str, dict], list[float], bool, int]:
    """One daemon, its attacks ``args.rounds`` times over (a later round shows whether memory
    keeps growing): each attack's result (the last round's), RSS at the start and after each
    round, whether it was alive at the end, the tracebacks in its log."""
    tree = {"raw_env": {"PYTHONPATH": f"{args.tree}/gateway"}, "root": Path(args.tree)}
    results: dict[str, dict] = {}
    with contextlib.ExitStack() as stack:
        if auth:  # two principals' keys; the canary holds the first
            keys = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "keys.toml"
            KEYS[:] = [add_key(keys, "canary"), add_key(keys, "other")]
            env = env | {"AUTH__ENABLED": "true", "AUTH__KEYS_FILE": str(keys)}
        d = stack.enter_context(Daemon(env, **(tree if args.tree else {})))  # type: ignore[arg-type]
        rss = [round(d.rss_mb(), 1)]
        for _ in range(args.rounds):
            for name, attack in attacks:
                key = KEYS[0] if auth else ""
                run = run_attack(d, attack, args.quiet_s, args.attack_s, key)
                results[name] = uvloop.run(run)
                print(name, json.dumps(results[name]), file=sys.stderr)
            rss.append(round(d.rss_mb(), 1))
        log = d.log
        if "Traceback" in log:  # the first one, to say what failed
            print(log[log.index("Traceback") :][:4000], file=sys.stderr)
        return results, rss, d.proc.poll() is None, log.count("Traceback")


def main() -> None:
    ap = parser(__doc__.split("\n")[0])
    ap.add_argument("--quiet-s", type=float, default=4.0)
    ap.add_argument("--attack-s", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", default="", help="run the attacks whose name contains this")
    ap.add_argument("--tree", default="", help="a source tree to run instead of this one")
    args = ap.parse_args()
    results: dict[str, dict] = {}
    rss_by_daemon: dict[str, list[float]] = {}
    alive, tracebacks = True, 0
    for target, env, attacks, auth in TARGETS:
        chosen = [(name, attack) for name, attack in attacks if args.only in name]
        if not chosen:  # no daemon for no attack
            continue
        got, rss, up, traces = run_target(env, chosen, auth, args)
        results |= {name: r | {"daemon": target} for name, r in got.items()}
        rss_by_daemon[target] = rss
        alive, tracebacks = alive and up, tracebacks + traces
    killed = None
    if args.only in KILLED_START and not args.tree:
        killed = killed_first_start()
        print(KILLED_START, json.dumps(killed), file=sys.stderr)
    out = {"machine": machine(), "args": {"quiet_s": args.quiet_s, "attack_s": args.attack_s},
           "attacks": results, "rss_mb_by_daemon": rss_by_daemon, "alive": alive,
           "tracebacks": tracebacks, "killed_first_start": killed}  # fmt: skip
    rows: list[list[object]] = []
    for name, r in results.items():
        for door in DOORS:
            q, a = r["canary_alone"][door], r["canary_attacked"][door]
            ratio = (
                f"{a['p50_ms'] / q['p50_ms']:.1f}x"
                if a["p50_ms"] is not None and q["p50_ms"]
                else "-"
            )
            first = door == "http"
            rows.append([
                f"{name} ({r['daemon']})" if first else "", door,
                f"{q['p50_ms']} / {q['p99_ms']}", f"{a['p50_ms']} / {a['p99_ms']}", ratio,
                f"{a['failed']} of {a['n'] + a['failed']}",
                f"{r['fds_before']} → {r['fds_after']}" if first else "",
                f"{r['rss_before_mb']} → {r['rss_after_mb']}" if first else "",
                json.dumps(r.get("answers", "")) if first and "answers" in r else "",
            ])  # fmt: skip
    rss_text = "; ".join(f"{t}: {' → '.join(map(str, x))}" for t, x in rss_by_daemon.items())
    rss_text = f"{rss_text} MiB" if rss_text else "no daemon ran an attack"
    killed_text = (
        ""
        if killed is None
        else f" {KILLED_START}: {killed['temporaries_after_kill']} temporary cache "
        f"director{'y' if killed['temporaries_after_kill'] == 1 else 'ies'} after the kill, "
        f"{killed['temporaries_after_restart']} once the next start listened."
    )
    md = (
        f"### Hostile clients beside a canary\n\n{machine_line(out['machine'])} Each attack "
        f"{args.attack_s:g} s from 127.0.0.2-9 after {args.quiet_s:g} s of the canary alone, on "
        "the daemon named beside it (synthetic backend with 2 ms steps; SmolLM2 on the cpu "
        "backend; the synthetic backend with auth on, the canary holding a key); the canary on "
        "127.0.0.1, in a process of its own, streams 4 tokens on each door in turn, a fresh "
        "connection each time. TTFT in ms (p50 / p99); descriptors and RSS (MiB) before the "
        "attack and after its clients left; the attack's HTTP answers by status where counted. "
        f"Daemons alive at the end: {alive}; tracebacks in their logs: {tracebacks}. The "
        f"attacks ran {args.rounds} times over (the table shows the last round); RSS at the "
        f"start and after each round: {rss_text}.{killed_text}\n\n"
        + table(
            [
                "attack (issue item, daemon)",
                "door",
                "canary alone",
                "under attack",
                "p50 ratio",
                "canary failed",
                "descriptors",
                "RSS",
                "answers",
            ],
            rows,
        )  # fmt: skip
    )
    # A run of some attacks (--only) has a section of its own: the whole run's figures stay.
    only = re.sub(r"[^a-z0-9]+", "-", args.only.lower()).strip("-")
    publish(args, f"hostile-{only}" if only else "hostile", out, md)


if __name__ == "__main__":
    main()
