"""Chaos soak with accounting: many clients doing random things to one daemon, then a ledger check.

The daemon runs with auth (a keys file), rate limits on a real Redis, and the response cache. The
soak runs in epochs. In an epoch, client tasks repeat random actions: normal requests, cancels at
random points (right after the REQUEST, while the Redis hooks may still run, or mid-stream),
disconnects mid-frame and mid-stream, slow readers, oversized and malformed frames, malformed
payloads, repeated greedy prompts (response cache), bursts over an rpm limit. At the end of an
epoch every client stops starting actions and finishes what it has in flight; then the checkpoint:

- every request is accounted for: exactly one DONE or one ERROR, or the client's own disconnect;
- no engine slot is held: zerolayer_num_requests_running, _waiting and kv_slots_used_ratio are 0;
- rate-limit reservations are returned: the ``steady`` key's token bucket in Redis holds exactly
  what its requests used. The bucket is primed far ahead at the start of the epoch (so it never
  drains and GCRA adds costs linearly): its theoretical arrival time must have moved by
  sum(prompt + completion tokens of its requests) * 60 s / tpm, to within a token;
- the metrics' counters moved exactly as the clients counted (DONE by finish reason, ERROR by
  code, prompt and completion tokens, rate-limited requests);
- resident memory is sampled per epoch (growth after the first epoch is reported).

Used by benchmarks/soak.py (``--duration S``) and tests/e2e/test_soak.py (a few seconds).
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import struct
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks._support import fuzzframes as ff
from benchmarks._support.daemon import Daemon
from benchmarks._support.metrics import scrape
from zerolayer.hooks.keys import add_key

FINISH = {0: "eos", 1: "max_tokens", 2: "stop", 3: "cancelled"}
CODE_NAMES = {
    1: "MALFORMED_FRAME",
    2: "FRAME_TOO_LARGE",
    5: "RATE_LIMITED",
    6: "OVERLOADED",
    7: "INVALID_REQUEST",
    8: "PROMPT_TOO_LONG",
    9: "UNKNOWN_PROMPT",
    11: "TOO_MANY_STREAMS",
    12: "IDLE_TIMEOUT",
    14: "SLOW_CONSUMER",
    15: "INTERNAL",
}
# Stream errors after which the request had run: its tokens so far were charged.
RAN_CODES = (14, 15, 13)
STEADY_TPM = 600_000  # 1 token = 100 us of the bucket
PRIME_AHEAD_US = 45_000_000  # the steady bucket starts 45 s ahead: it never drains in an epoch
VOCAB = 32000


@dataclass
class Ledger:
    """What the clients saw in one epoch."""

    requests: int = 0
    done: Counter = field(default_factory=Counter)  # finish reason -> count
    errors: Counter = field(default_factory=Counter)  # code name -> count (stream and conn)
    stream_errors: int = 0  # ERROR frames on a request's stream
    own_disconnects: int = 0  # requests given up by the client's own disconnect
    conn_ended: int = 0  # requests ended by a connection ERROR (stream 0)
    prompt_tokens: int = 0  # from DONE frames
    completion_tokens: int = 0
    steady_charge: int = 0  # tokens the steady key's bucket must hold
    unaccounted: list[str] = field(default_factory=list)
    double_ends: int = 0
    actions: Counter = field(default_factory=Counter)
    cache_hits: int = 0


class Conn:
    """A raw asyncio connection speaking frames: tracks its streams' ends in the ledger."""

    def __init__(self, soak: Soak, key: str, steady: bool) -> None:
        self.soak = soak
        self.key = key
        self.steady = steady
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.buf = b""
        self.next_id = 1
        self.open: dict[int, dict[str, Any]] = {}  # stream -> {prompt_len, tokens}
        self.closed = False

    async def connect(self, rcvbuf: int | None = None) -> None:
        d = self.soak.d
        if rcvbuf:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, (d.host, d.port))
            self.reader, self.writer = await asyncio.open_connection(sock=sock, limit=rcvbuf)
        else:
            self.reader, self.writer = await asyncio.open_connection(d.host, d.port)
        self.write(ff.frame(ff.HELLO, 0, struct.pack("<HH", 1, len(self.key)) + self.key.encode()))
        ftype, _, _ = await self.read_frame()
        if ftype != ff.WELCOME:
            raise AssertionError(f"no WELCOME for {self.key!r}: frame type {ftype}")

    def write(self, data: bytes) -> None:
        assert self.writer is not None
        self.writer.write(data)

    def request(self, prompt: list[int], max_tokens: int, **kw: Any) -> int:
        sid = self.next_id
        self.next_id += 1
        opts = 2 if kw.get("text") else 0
        payload = ff.REQ.pack(max_tokens, kw.get("temperature", 0.0), 1.0, 0, 0, 0, 0, opts)
        payload += struct.pack(f"<{len(prompt)}i", *prompt)
        self.write(ff.frame(ff.REQUEST, sid, payload))
        self.open[sid] = {"prompt_len": len(prompt), "tokens": 0}
        self.soak.ledger.requests += 1
        return sid

    def raw_request(self, frame_for: Any) -> int:
        """A REQUEST built by ``frame_for(stream)`` (mutated payloads: prompt length unknown, so
        only for the chaotic key, whose bucket is not checked)."""
        sid = self.next_id
        self.next_id += 1
        self.write(frame_for(sid))
        self.open[sid] = {"prompt_len": 0, "tokens": 0}
        self.soak.ledger.requests += 1
        return sid

    async def read_frame(self) -> tuple[int, int, bytes]:
        assert self.reader is not None
        while True:
            if len(self.buf) >= 12:
                length, ftype, _, _, sid = ff.HDR.unpack_from(self.buf)
                if len(self.buf) >= 12 + length:
                    payload = self.buf[12 : 12 + length]
                    self.buf = self.buf[12 + length :]
                    return ftype, sid, payload
            chunk = await self.reader.read(1 << 16)
            if not chunk:
                return 0, 0, b""
            self.buf += chunk

    async def pump(self, until_ended: set[int], tokens: int = 0) -> bool:
        """Read frames; stop when the streams in ``until_ended`` have all ended, or earlier when
        ``tokens`` (> 0) more TOKEN ids arrived. Returns False when the server closed."""
        got = 0
        led = self.soak.ledger
        while True:
            if not (until_ended & set(self.open)):
                return True
            if tokens and got >= tokens:
                return True
            ftype, sid, payload = await self.read_frame()
            if ftype == 0:
                self.closed = True
                for s in self.open:  # no stream-0 ERROR seen: these were lost
                    led.unaccounted.append(f"{self.key} stream {s}: connection closed silently")
                self.open.clear()
                return False
            if ftype == ff.TOKEN:
                n = struct.unpack_from("<H", payload)[0]
                got += n
                if sid in self.open:
                    self.open[sid]["tokens"] += n
            elif ftype == ff.DONE:
                reason, cache, _, pt, ct, queue_us = struct.unpack_from("<BBHIII", payload)
                st = self.open.pop(sid, None)
                if st is None:
                    led.double_ends += 1
                    continue
                led.done[FINISH[reason]] += 1
                led.prompt_tokens += pt
                led.completion_tokens += ct
                led.cache_hits += cache & 1
                if ct != st["tokens"]:
                    led.unaccounted.append(
                        f"stream {sid}: DONE says {ct} tokens, got {st['tokens']}"
                    )
                if self.steady:
                    # The charging policy (docs/hooks.md): a request cancelled before its prefill
                    # started (in the hooks or the queue: never admitted, queue_us 0) pays
                    # nothing for its prompt; DONE still reports the prompt's length.
                    unstarted = reason == 3 and ct == 0 and queue_us == 0 and not cache & 1
                    led.steady_charge += ct + (0 if unstarted else pt)
            elif ftype == ff.ERROR:
                code = struct.unpack_from("<H", payload)[0]
                led.errors[CODE_NAMES.get(code, str(code))] += 1
                if sid == 0:
                    led.conn_ended += len(self.open)
                    self.open.clear()
                    continue
                st = self.open.pop(sid, None)
                if st is None:
                    led.double_ends += 1
                    continue
                led.stream_errors += 1
                if self.steady and code in RAN_CODES:
                    led.steady_charge += st["prompt_len"] + st["tokens"]

    def disconnect(self) -> None:
        """The client goes away: its open requests are its own disconnects."""
        self.soak.ledger.own_disconnects += len(self.open)
        self.open.clear()
        if self.writer is not None:
            self.writer.close()
        self.closed = True

    async def close(self) -> None:
        """Finish: every open request must end first."""
        if not self.closed and self.open:
            try:
                await asyncio.wait_for(self.pump(set(self.open)), self.soak.hang_s)
            except asyncio.TimeoutError:
                for s in self.open:
                    self.soak.ledger.unaccounted.append(f"{self.key} stream {s}: no end (hang)")
                self.open.clear()
        if self.writer is not None:
            self.writer.close()


def _prompt(rng: random.Random, n: int | None = None) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(n or rng.randint(1, 24))]


class Soak:
    def __init__(self, d: Daemon, redis_url: str, seed: int, hang_s: float = 30.0) -> None:
        self.d = d
        self.redis_url = redis_url
        self.rng = random.Random(seed)
        self.hang_s = hang_s
        self.keys: dict[str, str] = {}
        self.ledger = Ledger()
        self.stopping = False

    # ---- actions: each opens its own connection(s) and closes them ----------------------

    async def normal(self, rng: random.Random) -> None:
        c = Conn(self, self.keys["steady"], steady=True)
        await c.connect()
        sids = {c.request(_prompt(rng), rng.randint(1, 64)) for _ in range(rng.randint(1, 8))}
        await c.pump(sids)
        await c.close()

    async def cached(self, rng: random.Random) -> None:
        c = Conn(self, self.keys["steady"], steady=True)
        await c.connect()
        prompt = [7, 7, rng.randrange(4)]  # a few greedy prompts, asked again and again
        await c.pump({c.request(prompt, 16)})
        await c.close()

    async def cancel(self, rng: random.Random) -> None:
        c = Conn(self, self.keys["steady"], steady=True)
        await c.connect()
        sid = c.request(_prompt(rng), rng.randint(100, 1500))
        if rng.random() < 0.5:
            await c.pump({sid}, tokens=rng.randint(1, 60))
        c.write(ff.frame(ff.CANCEL, sid))  # else at once: the hooks may still be running
        await c.pump({sid})
        await c.close()

    async def slow_reader(self, rng: random.Random) -> None:
        c = Conn(self, self.keys["steady"], steady=True)
        await c.connect(rcvbuf=4096)
        sids = {c.request(_prompt(rng), 1900, text=True) for _ in range(rng.randint(6, 12))}
        await asyncio.sleep(rng.uniform(1.0, 3.0))  # not reading: the server's buffer fills
        await c.pump(sids)
        await c.close()

    async def bad_payload(self, rng: random.Random) -> None:
        c = Conn(self, self.keys["chaotic"], steady=False)
        await c.connect()
        sids = {
            c.raw_request(lambda s: ff.mutated_request(rng, s, VOCAB))
            for _ in range(rng.randint(1, 6))
        }
        sids.add(c.raw_request(lambda s: ff.valid_request(rng, s, VOCAB)[0]))
        await c.pump(sids)
        await c.close()

    async def disconnect_mid_stream(self, rng: random.Random) -> None:
        c = Conn(self, self.keys["chaotic"], steady=False)
        await c.connect()
        sid = c.request(_prompt(rng), 1900)  # ~2 s at 1 ms a step: it cannot end before we go
        await c.pump({sid}, tokens=rng.randint(1, 40))
        c.disconnect()

    async def disconnect_mid_frame(self, rng: random.Random) -> None:
        c = Conn(self, self.keys["chaotic"], steady=False)
        await c.connect()
        frame, _ = ff.valid_request(rng, 1, VOCAB)
        c.write(frame[: rng.randint(1, len(frame) - 1)])
        await asyncio.sleep(rng.uniform(0, 0.2))
        c.disconnect()

    async def bad_frame(self, rng: random.Random) -> None:
        """Oversized or malformed: a connection error, read to the end."""
        c = Conn(self, self.keys["chaotic"], steady=False)
        await c.connect()
        sid = c.request(_prompt(rng), 1500)  # in flight when the connection error comes
        await c.pump({sid}, tokens=1)
        c.write(ff.bad_header(rng, 1_048_576))
        await c.pump({sid})
        if not c.closed:  # the stream-0 ERROR ended the stream; the server closes next
            ftype, _, _ = await asyncio.wait_for(c.read_frame(), self.hang_s)
            if ftype != 0:
                self.ledger.unaccounted.append(f"frame type {ftype} after a connection error")
        await c.close()

    async def burst(self, rng: random.Random) -> None:
        c = Conn(self, self.keys["burster"], steady=False)
        await c.connect()
        sids = {c.request(_prompt(rng, 4), 4) for _ in range(rng.randint(5, 15))}
        await c.pump(sids)
        await c.close()

    ACTIONS = (
        ("normal", 6),
        ("cached", 2),
        ("cancel", 4),
        ("slow_reader", 1),
        ("bad_payload", 3),
        ("disconnect_mid_stream", 2),
        ("disconnect_mid_frame", 2),
        ("bad_frame", 2),
        ("burst", 1),
    )

    async def client(self, cid: int) -> None:
        rng = random.Random(self.rng.getrandbits(64))
        names = [n for n, w in self.ACTIONS for _ in range(w)]
        while not self.stopping:
            name = rng.choice(names)
            self.ledger.actions[name] += 1
            try:
                await asyncio.wait_for(getattr(self, name)(rng), self.hang_s * 2)
            except asyncio.TimeoutError:
                self.ledger.unaccounted.append(f"action {name} hung")

    # ---- checkpoints -------------------------------------------------------------------

    async def prime(self) -> float:
        """Put the steady bucket PRIME_AHEAD_US ahead of the Redis clock; returns that TAT."""
        import redis.asyncio

        r = redis.asyncio.Redis.from_url(self.redis_url)
        sec, usec = await r.time()
        tat = sec * 1_000_000 + usec + PRIME_AHEAD_US
        await r.set("zerolayer:rl:{steady}:tpm", f"{tat:.1f}", px=PRIME_AHEAD_US // 1000 + 10_000)
        await r.aclose()
        return float(tat)

    async def bucket(self) -> float:
        import redis.asyncio

        r = redis.asyncio.Redis.from_url(self.redis_url)
        value = await r.get("zerolayer:rl:{steady}:tpm")
        await r.aclose()
        return float(value) if value is not None else 0.0


def metric_totals(samples: dict) -> dict[str, float]:
    """The counters the ledger is compared with, flattened to names (summed over the other
    labels, such as ``api``)."""
    out: dict[str, float] = {}
    for (name, labels), v in samples.items():
        lab = dict(labels)
        if name == "zerolayer_request_success_total":
            key = f"done/{lab.get('finished_reason')}"
        elif name == "zerolayer_request_errors_total":
            key = f"error/{lab.get('code')}"
        elif name in (
            "zerolayer_prompt_tokens_total",
            "zerolayer_generation_tokens_total",
            "zerolayer_rate_limited_total",
            "zerolayer_response_cache_hits_total",
        ):
            key = name
        else:
            continue
        out[key] = out.get(key, 0.0) + v
    return out


def gauges(samples: dict) -> dict[str, float]:
    names = ("zerolayer_num_requests_running", "zerolayer_num_requests_waiting")
    out = {n: v for (n, _), v in samples.items() if n in names}
    out["zerolayer_kv_slots_used_ratio"] = samples.get(("zerolayer_kv_slots_used_ratio", ()), -1)
    return out


def write_keys(path: Path) -> dict[str, str]:
    return {
        "steady": add_key(path, "steady", tpm=STEADY_TPM),
        "chaotic": add_key(path, "chaotic"),
        "burster": add_key(path, "burster", rpm=20),
    }


def daemon_env(keys_file: Path, redis_url: str) -> dict[str, str]:
    return {
        "AUTH__ENABLED": "true",
        "AUTH__KEYS_FILE": str(keys_file),
        "RATELIMIT__STORE": "redis",
        "RATELIMIT__REDIS_URL": redis_url,
        "CACHE__ENABLED": "true",
        "ENGINE__SYNTHETIC_STEP_MS": "1",
        "ENGINE__SYNTHETIC_VOCAB_SIZE": str(VOCAB),
        "SERVER__WRITE_BUFFER_LIMIT_BYTES": "4096",
        "SERVER__IDLE_TIMEOUT_S": "60",
        # The request log, as JSON lines: the streams the clients abandoned are counted from
        # its "request abandoned" lines (a client cannot know what the server generated).
        "LOGGING__JSON_LINES": "true",
        "LOGGING__REQUESTS": "true",
    }


def abandoned(lines: list[str]) -> tuple[int, int, int]:
    """(streams, prompt tokens, completion tokens) of the daemon's "request abandoned" lines."""
    n = prompt = completion = 0
    for line in lines:
        if '"request abandoned"' not in line:
            continue
        rec = json.loads(line)
        n += 1
        prompt += rec["prompt_tokens"]
        completion += rec["completion_tokens"]
    return n, prompt, completion


async def run_epochs(
    d: Daemon, redis_url: str, keys: dict[str, str], duration: float, epoch_s: float,
    clients: int, seed: int, log: Any = print, min_epochs: int = 1,
) -> dict[str, Any]:  # fmt: skip
    soak = Soak(d, redis_url, seed)
    soak.keys = keys
    epochs = []
    t_end = time.monotonic() + duration
    base = metric_totals(scrape(d.metrics_url))
    while True:
        left = t_end - time.monotonic()
        if left <= 0.5 and len(epochs) >= min_epochs:
            break
        soak.ledger = Ledger()
        soak.stopping = False
        mark = len(d.lines)
        tat0 = await soak.prime()
        tasks = [asyncio.create_task(soak.client(i)) for i in range(clients)]
        await asyncio.sleep(min(epoch_s, max(left, 0.5)))
        soak.stopping = True
        await asyncio.gather(*tasks)
        # Checkpoint: the engine idle, the ledger against the metrics and Redis.
        deadline = time.monotonic() + 15
        while True:
            samples = scrape(d.metrics_url)
            g = gauges(samples)
            if all(v == 0 for v in g.values()) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        await asyncio.sleep(0.3)  # async on_done hooks (Redis) finish after the DONE
        samples = scrape(d.metrics_url)
        now = metric_totals(samples)
        delta = {k: now.get(k, 0) - base.get(k, 0) for k in set(now) | set(base)}
        base = now
        led = soak.ledger
        gone, gone_prompt, gone_completion = abandoned(d.lines[mark:])
        expected = {f"done/{r}": n for r, n in led.done.items()}
        expected["done/cancelled"] = led.done["cancelled"] + gone
        expected.update({f"error/{c}": n for c, n in led.errors.items()})
        expected["zerolayer_prompt_tokens_total"] = led.prompt_tokens + gone_prompt
        expected["zerolayer_generation_tokens_total"] = led.completion_tokens + gone_completion
        expected["zerolayer_rate_limited_total"] = led.errors.get("RATE_LIMITED", 0)
        expected["zerolayer_response_cache_hits_total"] = led.cache_hits
        mismatches = {
            k: (delta.get(k, 0), expected.get(k, 0))
            for k in set(delta) | set(expected)
            if round(delta.get(k, 0)) != expected.get(k, 0)
        }
        moved_us = await soak.bucket() - tat0
        bucket_tokens = moved_us * STEADY_TPM / 60e6
        ended = sum(led.done.values()) + led.stream_errors
        epoch = {
            "requests": led.requests,
            "done": dict(led.done),
            "errors": dict(led.errors),
            "own_disconnects": led.own_disconnects,
            # Streams the daemon saw end with their connection gone: at most those the
            # clients gave up (their own disconnects, or a connection ERROR) can be.
            "abandoned": gone,
            "abandoned_fits": gone <= led.own_disconnects + led.conn_ended,
            "ended_by_connection_error": led.conn_ended,
            "accounted": ended + led.own_disconnects + led.conn_ended,
            "unaccounted": led.unaccounted[:20],
            "double_ends": led.double_ends,
            "gauges": g,
            "metric_mismatches": {k: list(v) for k, v in mismatches.items()},
            "steady_charged_tokens": led.steady_charge,
            "steady_bucket_tokens": round(bucket_tokens, 2),
            "rss_mb": round(d.rss_mb(), 1),
            "actions": dict(led.actions),
        }
        epochs.append(epoch)
        log(
            f"  epoch {len(epochs)}: {led.requests} requests, accounted {epoch['accounted']}, "
            f"bucket {epoch['steady_bucket_tokens']} vs {led.steady_charge} tokens, "
            f"gauges {g}, mismatches {epoch['metric_mismatches']}, rss {epoch['rss_mb']} MB"
        )
    return summarize(epochs)


def summarize(epochs: list[dict]) -> dict[str, Any]:
    checks = {
        "every request accounted for": all(
            e["accounted"] == e["requests"]
            and not e["unaccounted"]
            and not e["double_ends"]
            and e["abandoned_fits"]
            for e in epochs
        ),
        "no engine slot held": all(not any(e["gauges"].values()) for e in epochs),
        "rate-limit reservations returned": all(
            abs(e["steady_bucket_tokens"] - e["steady_charged_tokens"]) <= 1 for e in epochs
        ),
        "metrics equal the clients' counts": all(not e["metric_mismatches"] for e in epochs),
    }
    return {
        "epochs": epochs,
        "requests": sum(e["requests"] for e in epochs),
        "accounted": sum(e["accounted"] for e in epochs),
        "rss_first_epoch_mb": epochs[0]["rss_mb"],
        "rss_last_epoch_mb": epochs[-1]["rss_mb"],
        "checks": checks,
    }
