"""Issue #25's attacks against one daemon, each beside a canary: how much each one hurts a
client it must not hurt, and whether the daemon gets its descriptors and memory back.

For every attack, in turn: the canary alone (``--quiet-s``), then the attack from other loopback
addresses (127.0.0.2 ...) with the canary asking throughout (``--attack-s``), then the
attackers leave and the daemon settles. Per attack: the canary's time to first token on both
doors, p50 and p99, alone and under attack, and its failures; the daemon's descriptors and RSS
before the attack and after the attackers left. The canary (benchmarks/_canary.py) streams from
127.0.0.1 on the HTTP door (OpenAI chat) and the frame door (zerolayer.client.connection).

Attacks (the items of issue #25): a lone surrogate in a JSON key (1), a header line growing
without end (2), prompts far over the context (3), slowloris heads and bodies held open (4),
one client flooding the engine queue (5), idle connections that sent HELLO (6) — on the
synthetic backend; and issue #40's: one address holding every slot from 8 connections (#40 2),
a whole-vocabulary logit_bias from 8 clients (#40 3), and the grammars that stalled the step
(#40 7: four clients sending benchmarks/hostile_grammars.py's schemas in a loop, each answer's
status counted: all 400 expected, no 500) on the default model (SmolLM2, cpu), in a second
daemon. ``--only TEXT`` runs the attacks whose name contains TEXT; ``--tree DIR`` runs a
daemon of another source tree (a baseline checkout) instead of this one.

Bounded: each attack stops at the end of its window; loopback only.

    python benchmarks/hostile.py [--quiet-s 4] [--attack-s 8] [--rounds 2] [--grammars-only]
                                 [--write]
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._canary import DOORS, in_own_process  # noqa: E402
from benchmarks._report import machine, machine_line, parser, publish, table  # noqa: E402
from benchmarks._support.daemon import Daemon  # noqa: E402
from benchmarks.hostile_grammars import LATE, REFUSED, request_fields  # noqa: E402
from zerolayer.frames import protocol as p  # noqa: E402

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
    d: Daemon, clients: int, go_on: Callable[[], bool], one: Callable[[int, Conn], Awaitable[None]]
) -> int:
    """``clients`` attackers on the HTTP door, each on its own address, each doing ``one(n,
    connection)`` on a fresh connection after another while ``go_on()``; returns how many."""
    sent = 0

    async def client(k: int) -> None:
        nonlocal sent
        while go_on():
            conn = await connect(d, d.http_port, ATTACKERS[k])
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


async def slot_hog(d: Daemon, go_on: Callable[[], bool]) -> int:
    """Issue #40 item 2: one address on 8 frame connections keeps 8 streams of 300 tokens in
    flight on each (64: every slot and more queued), each replaced as soon as it ends."""
    sent = 0

    async def connection(c: int) -> None:
        nonlocal sent
        conn = await connect(d, d.port, ATTACKERS[2])
        if conn is None:
            return
        reader, writer = conn
        writer.write(p.encode_hello())
        welcome = p.HEADER.unpack(await reader.readexactly(12))
        await reader.readexactly(welcome[0])
        for i in range(8):
            writer.write(p.encode_request(i + 1, f"hog {c} {i}", 300, cache=False))
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
                writer.write(p.encode_request(stream, f"hog {c} {stream}", 300, cache=False))
                sent += 1
        writer.close()

    await asyncio.gather(*(connection(c) for c in range(8)))
    return sent


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


GRAMMAR_ANSWERS: collections.Counter[str] = collections.Counter()  # HTTP status: count


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
        head = b""
        with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
            head = await asyncio.wait_for(reader.read(12), 60)
        GRAMMAR_ANSWERS[head[9:12].decode(errors="replace") or "no answer"] += 1

    return await http_clients(d, 4, go_on, one)


GRAMMAR_ATTACKS: list[tuple[str, Attack]] = [
    ("#40 7 schemas that stalled the step", stalling_grammars),
]

ATTACKS: list[tuple[str, Attack]] = [
    ("1 lone surrogate in a JSON key", surrogate_keys),
    ("2 a header line without end", endless_header),
    ("3 prompts over the context", huge_prompts),
    ("4 slowloris heads and held bodies", slowloris),
    ("5 one client floods the engine queue", queue_flood),
    ("6 idle connections after HELLO", idle_hellos),
    ("#40 2 one address holds every slot (8 connections)", slot_hog),
    ("#40 3 whole-vocabulary logit_bias from 8 clients", whole_vocabulary_bias),
]


async def run_attack(d: Daemon, attack: Attack, quiet_s: float, attack_s: float) -> dict:
    quiet = await in_own_process(d.http_port, d.endpoint, quiet_s)
    fd0, rss0 = fds(d), d.rss_mb()
    end = time.monotonic() + attack_s

    def go_on() -> bool:
        return time.monotonic() < end

    t0 = time.monotonic()
    sent, under = await asyncio.gather(
        attack(d, go_on), in_own_process(d.http_port, d.endpoint, attack_s)
    )
    attack_elapsed = time.monotonic() - t0
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
    }


def main() -> None:
    ap = parser(__doc__.split("\n")[0])
    ap.add_argument("--quiet-s", type=float, default=4.0)
    ap.add_argument("--attack-s", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", default="", help="run the attacks whose name contains this")
    ap.add_argument("--tree", default="", help="a source tree to run instead of this one")
    ap.add_argument("--grammars-only", action="store_true", help="only #40 7, on SmolLM2")
    args = ap.parse_args()
    attacks = [(name, attack) for name, attack in ATTACKS if args.only in name]
    tree = {"raw_env": {"PYTHONPATH": f"{args.tree}/gateway"}, "root": Path(args.tree)}
    env = {
        "ENGINE__BACKEND": "synthetic",
        "ENGINE__SYNTHETIC_STEP_MS": "2",
        "ENGINE__MAX_QUEUE": "1024",
        "HTTP__HEADER_TIMEOUT_S": "10",
    }
    results: dict[str, dict] = {}
    import uvloop

    rss_by_round: list[float] = []
    alive, tracebacks = True, 0
    if not args.grammars_only:
        with Daemon(env, **(tree if args.tree else {})) as d:  # type: ignore[arg-type]
            rss_by_round.append(round(d.rss_mb(), 1))
            for _ in range(args.rounds):  # a later round shows whether memory keeps growing
                for name, attack in attacks:
                    results[name] = uvloop.run(run_attack(d, attack, args.quiet_s, args.attack_s))
                    print(name, json.dumps(results[name]), file=sys.stderr)
                rss_by_round.append(round(d.rss_mb(), 1))
            alive = d.proc.poll() is None
            tracebacks = d.log.count("Traceback")
    grammar_attacks = [(name, attack) for name, attack in GRAMMAR_ATTACKS if args.only in name]
    with Daemon({"ENGINE__BACKEND": "cpu", "MODEL__PATH": "@smollm2"}) as d:  # the real model
        for name, attack in grammar_attacks:
            GRAMMAR_ANSWERS.clear()
            results[name] = uvloop.run(run_attack(d, attack, args.quiet_s, args.attack_s))
            results[name]["answers"] = dict(GRAMMAR_ANSWERS)
            print(name, json.dumps(results[name]), file=sys.stderr)
        alive = alive and d.proc.poll() is None
        tracebacks += d.log.count("Traceback")
    out = {"machine": machine(), "args": {"quiet_s": args.quiet_s, "attack_s": args.attack_s},
           "attacks": results, "rss_mb_by_round": rss_by_round, "alive": alive,
           "tracebacks": tracebacks}  # fmt: skip
    rows: list[list[object]] = []
    for name, r in results.items():
        for door in DOORS:
            q, a = r["canary_alone"][door], r["canary_attacked"][door]
            ratio = (
                f"{a['p50_ms'] / q['p50_ms']:.1f}x"
                if a["p50_ms"] is not None and q["p50_ms"]
                else "-"
            )
            rows.append([
                name if door == "http" else "", door,
                f"{q['p50_ms']} / {q['p99_ms']}", f"{a['p50_ms']} / {a['p99_ms']}", ratio,
                f"{a['failed']} of {a['n'] + a['failed']}",
                f"{r['fds_before']} → {r['fds_after']}" if door == "http" else "",
                f"{r['rss_before_mb']} → {r['rss_after_mb']}" if door == "http" else "",
            ])  # fmt: skip
    answers = {n: r["answers"] for n, r in results.items() if "answers" in r}
    md = (
        f"### Hostile clients beside a canary\n\n{machine_line(out['machine'])}; synthetic "
        f"backend (2 ms steps; #40's grammars on SmolLM2, cpu, the answers' statuses: "
        f"{answers}); each attack {args.attack_s:g} s from 127.0.0.2-9 after "
        f"{args.quiet_s:g} s of the canary alone; the canary on 127.0.0.1, in a process of "
        "its own, streams 4 tokens on each door in turn, a fresh connection each time. TTFT in "
        "ms (p50 / p99); descriptors "
        f"and RSS (MiB) before the attack and after its clients left. Daemon alive at the end: "
        f"{alive}; tracebacks in its log: {tracebacks}. The attacks ran {args.rounds} times "
        f"over (the table shows the last round); RSS at the start and after each round: "
        f"{' → '.join(map(str, rss_by_round))} MiB.\n\n"
        + table(
            [
                "attack (#25 item)",
                "door",
                "canary alone",
                "under attack",
                "p50 ratio",
                "canary failed",
                "descriptors",
                "RSS",
            ],
            rows,
        )  # fmt: skip
    )
    publish(args, "hostile", out, md)


if __name__ == "__main__":
    main()
