"""zerolayer bench: metric arithmetic on scripted fake servers (frames and SSE), the report
schema, the open-loop arrival process, inputs and endpoint parsing."""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest

from tests.support.fake_servers import STYLES, FakeFrameServer, FakeSseServer, ManualClock
from zerolayer.client.bench import BenchOptions, run
from zerolayer.client.bench.cli import verdict
from zerolayer.client.bench.endpoint import EndpointError, parse_endpoint
from zerolayer.client.bench.http import SseState, build_body
from zerolayer.client.bench.report import SCHEMA, compare, load
from zerolayer.client.bench.stats import RequestRecord, aggregate, parse_slo
from zerolayer.client.bench.workload import (
    WorkItem,
    WorkloadError,
    arrival_offsets,
    load_file,
    parse_len,
)
from zerolayer.frames import protocol as p

# Two requests with known chunk times (s) and sizes. A: TTFT 100 ms, gaps 50, 100 (a chunk of
# 3: then 0, 0), 10; TPOT (300-100)/5 = 40; E2E 300. B: TTFT 20 (a chunk of 2: then 0), gap 40;
# TPOT (80-20)/2 = 30; E2E 80. All ITLs sorted: 0 0 0 10 40 50 100 (ms).
SCRIPTS = [
    ([(0.100, 1, "a"), (0.150, 1, "b"), (0.250, 3, "ccc"), (0.260, 1, "d")], 0.300),
    ([(0.020, 2, "ee"), (0.060, 1, "f")], 0.080),
]
EXPECTED = {
    "completed": 2,
    "failed": 0,
    "total_output_tokens": 9,
    "total_input_tokens": 14,
    "mean_ttft_ms": 60.0,
    "median_ttft_ms": 60.0,
    "p90_ttft_ms": 92.0,  # 20 + 0.9 * 80
    "p99_ttft_ms": 99.2,
    "max_ttft_ms": 100.0,
    "mean_itl_ms": 200 / 7,
    "median_itl_ms": 10.0,
    "p90_itl_ms": 70.0,  # rank 5.4 of 0..6: 50 + 0.4 * 50
    "p99_itl_ms": 97.0,  # rank 5.94: 50 + 0.94 * 50
    "max_itl_ms": 100.0,
    "mean_tpot_ms": 35.0,
    "median_tpot_ms": 35.0,
    "max_tpot_ms": 40.0,
    "mean_e2el_ms": 190.0,
    "max_e2el_ms": 300.0,
    "max_concurrent_requests": 1,
}


def _check(report: dict) -> None:
    for key, want in EXPECTED.items():
        assert report[key] == pytest.approx(want, abs=1e-6), key


def _bench(server_cls, protocol: str | None = None, **opts) -> tuple[dict, object]:
    async def main():
        clock = ManualClock()
        server = (
            server_cls(clock, SCRIPTS) if protocol is None else server_cls(clock, SCRIPTS, protocol)
        )
        endpoint = await server.start()
        try:
            defaults = {"concurrency": 1, "num_requests": 2}
            options = BenchOptions(endpoint=endpoint, protocol=protocol, **{**defaults, **opts})
            return await run(options, clock=clock), server
        finally:
            await server.close()

    return asyncio.run(main())


def test_frame_metrics_match_the_script():
    report, server = _bench(FakeFrameServer, input_len="5", output_len="6", slo="ttft=50ms")
    _check(report)
    assert report["finish_reasons"] == {"max_tokens": 2}
    assert report["request_goodput"] == pytest.approx(1 / 0.38)  # B only; duration 380 ms
    assert report["duration"] == pytest.approx(0.38)
    assert report["output_throughput"] == pytest.approx(9 / 0.38)
    # random dataset on frames: binary requests with 5 token ids each, max_tokens 6
    flags, payload = server.requests[0]
    assert flags == 0 and len(payload) == 32 + 5 * 4
    assert int.from_bytes(payload[:4], "little") == 6


@pytest.mark.parametrize("protocol", ["openai-chat", "openai-completions", "anthropic"])
def test_sse_metrics_match_the_script(protocol):
    report, server = _bench(FakeSseServer, protocol, input_len="5", output_len="6")
    _check(report)
    assert server.connections == 1  # GET /v1/models and both requests on one keep-alive conn
    body = server.bodies[0]
    assert body["model"] == "fake-model" and body["stream"] is True
    prompt = body["prompt"] if protocol == "openai-completions" else body["messages"][0]["content"]
    assert body["max_tokens"] == 6 and len(prompt.split()) == 5


def test_http_errors_count_by_status_and_keep_the_connection():
    async def main():
        clock = ManualClock()
        server = FakeSseServer(clock, SCRIPTS, "openai-completions", refuse=429)
        endpoint = await server.start()
        try:
            opts = BenchOptions(
                endpoint=endpoint,
                protocol="openai-completions",
                model="m",
                num_requests=3,
                input_len="4",
                output_len="6",
            )
            return await run(opts, clock=clock), server
        finally:
            await server.close()

    report, server = asyncio.run(main())
    assert report["completed"] == 2 and report["failed"] == 1
    assert report["errors_by_kind"] == {"http_429": 1} and report["errors"][0] == "http_429"
    assert report["ttfts"][0] is None and report["output_lens"] == [0, 6, 3]
    assert server.connections == 1  # the refused request's connection was reused
    assert all(isinstance(b["prompt"], str) for b in server.bodies)


def test_usage_spread_over_chunks_by_text_length():
    rec = RequestRecord()
    state = SseState("anthropic", rec)
    for t, text in ((1.0, "ab"), (2.0, "abcdef"), (3.0, "")):
        payload = {"type": "content_block_delta", "delta": {"text": text}}
        state.on_event(t, "content_block_delta", json.dumps(payload))
    state.on_event(4.0, "", json.dumps({"type": "message_delta", "usage": {"output_tokens": 6}}))
    state.settle()
    assert rec.chunk_k == [2, 4]  # 4 extra tokens over 2 + 6 characters: 1 and 3
    assert rec.itls() == [0.0, 1.0, 0.0, 0.0, 0.0]


def test_report_schema_is_plain_json_with_vllm_names(tmp_path):
    report, _ = _bench(FakeFrameServer, input_len="3", output_len="6", detailed=True)
    text = json.dumps(report, allow_nan=False)
    assert report["schema"] == SCHEMA
    for key in (
        "completed",
        "failed",
        "warmup_requests",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "mean_ttft_ms",
        "median_tpot_ms",
        "p99_itl_ms",
        "p90_e2el_ms",
        "std_ttft_ms",
        "input_lens",
        "output_lens",
        "ttfts",
        "itls",
        "errors",
        "errors_by_kind",
        "client_cpu_us_per_token",
        "tokens_per_s_timeline",
        "server_metrics",
        "max_concurrency",
        "request_rate",
        "burstiness",
    ):
        assert key in report, key
    assert report["request_rate"] == "inf" and report["output_lens"] == [6, 3]
    assert report["itls"][1] == pytest.approx([0.0, 0.04])
    path = tmp_path / "a.json"
    path.write_text(text)
    again = load(path)
    table = compare(again, {**again, "mean_ttft_ms": 120.0}, "a", "b")
    assert "mean_ttft_ms" in table and "2.00x" in table


def test_plots_are_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    from zerolayer.client.bench.plot import plot

    report, _ = _bench(FakeFrameServer, input_len="3", output_len="6", detailed=True)
    paths = plot(report, tmp_path / "run")
    sweep = {"schema": SCHEMA, "sweep": [report, {**report, "max_concurrency": 2}]}
    paths += plot(sweep, tmp_path / "sweep")
    assert {p.name for p in paths} == {"ttft.png", "itl.png", "throughput.png", "sweep.png"}
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_errors_are_counted_by_kind_and_excluded_from_latency():
    ok = RequestRecord(t_send=0.0, t_end=0.2, chunk_t=[0.1], chunk_k=[1])
    bad = RequestRecord(t_send=0.0, t_end=0.01, error="OVERLOADED")
    worse = RequestRecord(t_send=0.0, t_end=0.01, error="OVERLOADED")
    agg = aggregate([ok, bad, worse], 1.0)
    assert agg["completed"] == 1 and agg["failed"] == 2
    assert agg["errors_by_kind"] == {"OVERLOADED": 2}
    assert agg["mean_ttft_ms"] == pytest.approx(100.0) and agg["mean_itl_ms"] is None


@pytest.mark.parametrize("burstiness", [1.0, 4.0, 0.5])
def test_open_loop_arrivals_are_gamma_with_the_asked_rate(burstiness):
    gaps = np.diff(arrival_offsets(20000, 50.0, burstiness, np.random.default_rng(7)), prepend=0)
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.03)
    # gamma(shape k): coefficient of variation 1/sqrt(k); Poisson (k = 1) has CV 1
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)
    again = arrival_offsets(20000, 50.0, burstiness, np.random.default_rng(7))
    assert np.array_equal(np.diff(again, prepend=0), gaps)  # the seed fixes the schedule


def test_open_loop_counts_per_window_are_poisson():
    offsets = arrival_offsets(30000, 100.0, 1.0, np.random.default_rng(3))
    counts = np.histogram(offsets, bins=np.arange(0, offsets[-1] - 1, 0.1))[0]
    assert counts.mean() == pytest.approx(10.0, rel=0.03)
    assert counts.var() == pytest.approx(counts.mean(), rel=0.1)  # Poisson: variance = mean
    assert not arrival_offsets(5, math.inf, 1.0, np.random.default_rng(0)).any()


def test_endpoints():
    assert parse_endpoint("tcp://127.0.0.1:7070").protocol == "frames"
    e = parse_endpoint("http://localhost:8000/v1", "openai-completions")
    assert (e.host, e.port, e.path) == ("localhost", 8000, "/v1/completions")
    assert parse_endpoint("https://h:443", "anthropic").tls
    with pytest.raises(EndpointError, match="needs --protocol"):
        parse_endpoint("http://h:1")
    assert parse_endpoint("tls://h:1").tls and parse_endpoint("tls://h:1").protocol == "frames"
    with pytest.raises(EndpointError, match="speaks frames"):
        parse_endpoint("tcp://h:1", "openai-chat")
    with pytest.raises(EndpointError, match="must be tcp"):
        parse_endpoint("ftp://h:1")


def test_inputs(tmp_path):
    assert parse_len("128") == (128, 0) and parse_len("64:16") == (64, 16)
    with pytest.raises(WorkloadError):
        parse_len("x:1")
    assert parse_slo("ttft=0.5s,tpot=50ms") == {"ttft": 500.0, "tpot": 50.0}
    with pytest.raises(ValueError, match="--slo"):
        parse_slo("speed=1")
    rng = np.random.default_rng(0)
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text(
        '{"prompt": "hi", "max_tokens": 5}\n\n'
        '{"messages": [{"role": "user", "content": "yo"}], "system": "be brief"}\n'
    )
    items = load_file(jsonl, None, rng)
    assert (items[0].prompt, items[0].max_tokens) == ("hi", 5)
    assert items[1].messages[0]["content"] == "yo" and items[1].system == "be brief"
    assert items[1].max_tokens == 128
    jsonl.write_text('{"prompt": "hi"}\n{"prompt": 3}\n')
    with pytest.raises(WorkloadError, match="line 2: prompt must be a string"):
        load_file(jsonl, None, rng)
    jsonl.write_text('{"prompt": [5, 7, 9], "max_tokens": 2}\n{"prompt": [5, -1]}\n')
    with pytest.raises(WorkloadError, match="line 2: prompt must be a string or a list"):
        load_file(jsonl, None, rng)
    jsonl.write_text('{"prompt": [5, 7, 9], "max_tokens": 2}\n')
    (item,) = load_file(jsonl, None, rng)
    assert (item.prompt_ids, item.prompt, item.max_tokens) == ([5, 7, 9], None, 2)
    share = tmp_path / "sg.json"
    conv = [{"from": "human", "value": "Q?"}, {"from": "gpt", "value": "one two three"}]
    share.write_text(json.dumps([{"conversations": conv}, {"conversations": []}]))
    items = load_file(share, None, rng)
    assert len(items) == 1 and items[0].messages == [{"role": "user", "content": "Q?"}]
    assert items[0].max_tokens == 4  # 3 words x 4/3
    assert load_file(share, (9, 0), rng)[0].max_tokens == 9


def test_token_id_prompts_go_to_openai_completions_only():
    item = WorkItem(4, prompt_ids=[5, 7, 9])
    body = build_body("openai-completions", item, "m", ignore_eos=True)
    assert body["prompt"] == [5, 7, 9] and body["max_tokens"] == 4
    for protocol in ("openai-chat", "anthropic"):
        with pytest.raises(ValueError, match="not " + protocol):
            build_body(protocol, item, "m", ignore_eos=False)
    assert build_body("openai-completions", WorkItem(4, prompt="hi"), "m", False)["prompt"] == "hi"


def test_open_loop_run_sends_every_request_within_the_cap():
    report, server = _bench(FakeFrameServer, request_rate=1000.0, input_len="5", output_len="6")
    assert report["completed"] == 2 and server.served == 2
    assert report["request_rate"] == 1000.0 and report["max_concurrent_requests"] == 1
    _check(report)  # concurrency 1 caps the open loop: the scripted times hold as before


@pytest.mark.parametrize("style", STYLES)
def test_sse_servers_that_end_streams_their_own_way(style):
    """vLLM-like, llama.cpp-like (closes after each stream), transformers-serve-like (no [DONE])
    and a body left open after the finish_reason: every request succeeds, the metrics match."""

    async def main():
        clock = ManualClock()
        server = FakeSseServer(clock, SCRIPTS, "openai-chat", style=style)
        endpoint = await server.start()
        try:
            opts = BenchOptions(
                endpoint=endpoint,
                protocol="openai-chat",
                concurrency=1,
                num_requests=4,
                input_len="5",
                output_len="6",
            )
            return await run(opts, clock=clock), server
        finally:
            await server.close()

    report, server = asyncio.run(main())
    assert report["completed"] == 4 and report["failed"] == 0, report["first_errors"]
    assert report["total_output_tokens"] == 18 and report["max_e2el_ms"] == pytest.approx(300)
    assert report["finish_reasons"] == {"length": 4}
    kept = style in ("vllm", "transformers")  # stale-keepalive: as llamacpp, found out later
    # kept: GET /v1/models and the 4 requests on one connection; else each request after the
    # first (which reused the GET's) on a new one, as the last one was closed
    assert server.connections == (1 if kept else 4)
    # the bench bypasses the response cache unless asked not to
    assert all(h.get("cache-control") == "no-cache" for h in server.headers)


def test_failures_are_reported_with_the_servers_message():
    async def main():
        clock = ManualClock()
        server = FakeSseServer(clock, SCRIPTS, "openai-completions", refuse=429)
        endpoint = await server.start()
        try:
            opts = BenchOptions(endpoint=endpoint, protocol="openai-completions", model="m",
                                num_requests=2, input_len="4", output_len="6")  # fmt: skip
            return await run(opts, clock=clock)
        finally:
            await server.close()

    report = asyncio.run(main())
    assert report["first_errors"] == ["http_429: slow down"]
    status, lines = verdict(report, 0.0)
    assert status == 1 and "http_429: slow down" in "\n".join(lines)
    assert verdict(report, 0.5)[0] == 0  # 1 of 2 failed: allowed by --max-failure-rate 0.5
    assert verdict(report, 0.49)[0] == 1


def test_a_closed_port_fails_every_request_and_the_run():
    opts = BenchOptions(endpoint="http://127.0.0.1:9", protocol="openai-chat", model="m",
                        num_requests=3, progress=False)  # fmt: skip
    report = asyncio.run(run(opts))
    assert report["failed"] == 3 and report["errors_by_kind"] == {"connect_error": 3}
    assert report["first_errors"] and report["first_errors"][0].startswith("connect_error: ")
    assert verdict(report, 0.0)[0] == 1


def test_cache_hits_are_warned_about():
    report = {"completed": 4, "failed": 0, "response_cache_hits": 3, "interrupted": False}
    status, lines = verdict(report, 0.0)
    assert status == 0 and "3 of 4 answers came from the server's response cache" in lines[0]


def test_frame_requests_bypass_the_response_cache_unless_asked():
    for use_cache, want in ((False, p.OPT_NO_CACHE), (True, 0)):
        _, server = _bench(FakeFrameServer, input_len="5", output_len="6", use_cache=use_cache)
        for _, payload in server.requests:
            options = int.from_bytes(payload[30:32], "little")
            assert options & p.OPT_NO_CACHE == want
