"""Chaos soak with accounting (benchmarks/_support/soak.py has the clients and the checks).

Starts a real redis-server and a daemon (synthetic backend at 1 ms a step, auth with three keys,
rate limits in Redis, response cache, a 4 KiB write-buffer limit so slow readers get
SLOW_CONSUMER), runs --clients concurrent chaotic clients for --duration seconds in epochs of
--epoch seconds, checks the ledger at every epoch's end, and reports requests accounted and
resident memory growth after the first epoch (the warm-up).

    python benchmarks/soak.py --duration 120 [--clients 24] [--epoch 20] [--seed 1]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._report import machine, machine_line, parser, publish, table  # noqa: E402
from benchmarks._support.daemon import Daemon  # noqa: E402
from benchmarks._support.redis_server import RedisServer  # noqa: E402
from benchmarks._support.soak import daemon_env, run_epochs, write_keys  # noqa: E402


def main() -> None:
    ap = parser(__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--epoch", type=float, default=20.0, help="seconds between checkpoints")
    ap.add_argument("--clients", type=int, default=24)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--cache-max-bytes",
        type=int,
        default=None,
        help="response cache bound (default: the config default, 64 MiB)",
    )
    args = ap.parse_args()
    keys_file = Path(tempfile.mkdtemp(prefix="zl-soak-")) / "keys.toml"
    keys = write_keys(keys_file)
    import uvloop

    with RedisServer() as redis:
        env = daemon_env(keys_file, redis.url)
        if args.cache_max_bytes is not None:
            env["CACHE__MAX_BYTES"] = str(args.cache_max_bytes)
        with Daemon(env) as d:
            res = uvloop.run(
                run_epochs(d, redis.url, keys, args.duration, args.epoch, args.clients, args.seed)
            )
            res["daemon_exit"] = d.terminate()
    res["checks"]["daemon alive to the end, clean exit"] = res["daemon_exit"] == 0
    res["machine"] = machine()
    res["args"] = vars(args)
    growth = res["rss_last_epoch_mb"] - res["rss_first_epoch_mb"]
    print(json.dumps({k: v for k, v in res.items() if k != "machine"}, indent=1, default=str))
    rows = [
        [
            i + 1,
            e["requests"],
            e["accounted"],
            sum(e["done"].values()),
            sum(e["errors"].values()),
            e["own_disconnects"],
            f"{e['steady_bucket_tokens']:.1f} / {e['steady_charged_tokens']}",
            "none" if not e["metric_mismatches"] else json.dumps(e["metric_mismatches"]),
            e["rss_mb"],
        ]
        for i, e in enumerate(res["epochs"])
    ]
    md = (
        "## Chaos soak (`benchmarks/soak.py`)\n\n"
        f"{args.clients} chaotic clients for {args.duration:g} s in epochs of {args.epoch:g} s, "
        f"seed {args.seed}; synthetic backend at 1 ms a step, auth, rate limits in a real Redis, "
        f"response cache (max_bytes {args.cache_max_bytes or 'default 64 MiB'}). "
        "Per epoch: requests sent and accounted (one DONE, one ERROR, a "
        "connection ERROR, or the client's own disconnect), the steady key's bucket against "
        f"its requests' tokens, metric mismatches. {res['requests']:,} requests, "
        f"{res['accounted']:,} accounted; resident memory {res['rss_first_epoch_mb']} MB after "
        f"the first epoch, {res['rss_last_epoch_mb']} MB after the last ({growth:+.1f} MB).\n\n"
        + table(
            [
                "epoch",
                "requests",
                "accounted",
                "DONE",
                "ERROR frames",
                "own disconnects",
                "bucket / charged tokens",
                "metric mismatches",
                "RSS MB",
            ],
            rows,
        )
        + "\n\n"
        + table(
            ["check", "result"], [[k, "pass" if v else "FAIL"] for k, v in res["checks"].items()]
        )
        + "\n\n"
        + machine_line(res["machine"])
        + "\n"
    )
    publish(args, "soak", res, md)
    sys.exit(0 if all(res["checks"].values()) else 1)


if __name__ == "__main__":
    main()
