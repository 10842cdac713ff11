"""A short chaos soak (benchmarks/_support/soak.py; benchmarks/soak.py runs it for longer): a
few seconds of chaotic clients against a daemon with auth, rate limits in a real Redis and the
response cache, then every request accounted for, no slot held, the rate-limit bucket exactly what
the requests used, and the metrics equal to the clients' counts."""

from __future__ import annotations

import asyncio

from benchmarks._support.daemon import Daemon
from benchmarks._support.soak import daemon_env, run_epochs, write_keys


def test_short_chaos_soak_accounts_for_everything(tmp_path, redis_url):
    keys_file = tmp_path / "keys.toml"
    keys = write_keys(keys_file)
    with Daemon(daemon_env(keys_file, redis_url)) as d:
        res = asyncio.run(
            run_epochs(d, redis_url, keys, 3.0, 1.5, 8, seed=7, log=lambda _: None, min_epochs=2)
        )
        assert d.terminate() == 0
    epochs = res["epochs"]
    assert len(epochs) >= 2
    for e in epochs:  # the soak did what it claims: requests ran, were refused, were cancelled
        assert e["requests"] > 0 and sum(e["done"].values()) > 0
    assert sum(e["errors"].get("RATE_LIMITED", 0) for e in epochs) > 0
    assert sum(e["done"].get("cancelled", 0) for e in epochs) > 0
    assert sum(e["own_disconnects"] for e in epochs) > 0
    # ... and the daemon counted streams whose client went away (as cancelled, from its log).
    assert sum(e["abandoned"] for e in epochs) > 0
    failed = {k: v for k, v in res["checks"].items() if not v}
    assert not failed, (failed, epochs)
