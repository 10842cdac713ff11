"""Metrics: each hot-path call moves exactly the series it names, by the amount given."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from zerolayer.ops.metrics import APIS, ERROR_CODES, FINISH_REASONS, FRAME_TYPES, Metrics


@pytest.fixture
def m() -> Metrics:
    return Metrics()


def v(m: Metrics, name: str, **labels: str) -> float:
    value = m.registry.get_sample_value(name, labels)
    assert value is not None, f"{name}{labels} not exported"
    return value


def test_private_registry(m: Metrics) -> None:
    assert m.registry is not REGISTRY
    assert REGISTRY.get_sample_value("zerolayer_prompt_tokens_total") is None
    # Two instances do not collide (a global registry would raise on duplicate names).
    Metrics()


def test_request_finished(m: Metrics) -> None:
    m.request_finished("eos", 12, 30, queue_s=0.002, ttft_s=0.05, e2e_s=1.5)
    m.request_finished("max_tokens", 8, 16, queue_s=0.5, ttft_s=None, e2e_s=3.0)
    m.request_finished("eos", 3, 4, queue_s=0.0, ttft_s=0.05, e2e_s=0.5, api="openai")
    assert v(m, "zerolayer_request_success_total", finished_reason="eos", api="frames") == 1
    assert v(m, "zerolayer_request_success_total", finished_reason="max_tokens", api="frames") == 1
    assert v(m, "zerolayer_request_success_total", finished_reason="stop", api="frames") == 0
    assert v(m, "zerolayer_request_success_total", finished_reason="eos", api="openai") == 1
    assert v(m, "zerolayer_request_success_total", finished_reason="eos", api="anthropic") == 0
    assert v(m, "zerolayer_prompt_tokens_total", api="frames") == 20
    assert v(m, "zerolayer_generation_tokens_total", api="frames") == 46
    assert v(m, "zerolayer_prompt_tokens_total", api="openai") == 3
    assert v(m, "zerolayer_generation_tokens_total", api="openai") == 4
    assert v(m, "zerolayer_request_queue_time_seconds_count") == 3
    assert v(m, "zerolayer_request_queue_time_seconds_sum") == pytest.approx(0.502)
    # No first token, no TTFT observation.
    assert v(m, "zerolayer_time_to_first_token_seconds_count") == 2
    assert v(m, "zerolayer_time_to_first_token_seconds_sum") == pytest.approx(0.1)
    assert v(m, "zerolayer_time_to_first_token_seconds_bucket", le="0.06") == 2
    assert v(m, "zerolayer_time_to_first_token_seconds_bucket", le="0.04") == 0
    assert v(m, "zerolayer_e2e_request_latency_seconds_count") == 3
    assert v(m, "zerolayer_e2e_request_latency_seconds_sum") == pytest.approx(5.0)


def test_buckets_reach_minutes(m: Metrics) -> None:
    m.request_finished("eos", 1, 1, queue_s=200.0, ttft_s=300.0, e2e_s=900.0)
    assert v(m, "zerolayer_time_to_first_token_seconds_bucket", le="320.0") == 1
    assert v(m, "zerolayer_e2e_request_latency_seconds_bucket", le="960.0") == 1
    assert v(m, "zerolayer_request_queue_time_seconds_bucket", le="320.0") == 1


def test_errors_every_code(m: Metrics) -> None:
    for code in ERROR_CODES:
        for api in APIS:
            assert v(m, "zerolayer_request_errors_total", code=code, api=api) == 0
    m.request_error("OVERLOADED")
    m.request_error("OVERLOADED")
    m.request_error("INTERNAL")
    m.request_error("RATE_LIMITED", "anthropic")
    assert v(m, "zerolayer_request_errors_total", code="OVERLOADED", api="frames") == 2
    assert v(m, "zerolayer_request_errors_total", code="INTERNAL", api="frames") == 1
    assert v(m, "zerolayer_request_errors_total", code="RATE_LIMITED", api="frames") == 0
    assert v(m, "zerolayer_request_errors_total", code="RATE_LIMITED", api="anthropic") == 1


def test_inter_token_batched(m: Metrics) -> None:
    m.inter_token(0.02)
    m.inter_token(0.09, n=3)  # three tokens in one delivery: 0.03 each
    assert v(m, "zerolayer_inter_token_latency_seconds_count") == 4
    assert v(m, "zerolayer_inter_token_latency_seconds_sum") == pytest.approx(0.11)
    assert v(m, "zerolayer_inter_token_latency_seconds_bucket", le="0.03") == 4
    assert v(m, "zerolayer_inter_token_latency_seconds_bucket", le="0.015") == 0


def test_engine_step_and_queue(m: Metrics) -> None:
    m.engine_step("prefill", 0.25, 2)
    m.engine_step("decode", 0.01, 32)
    m.engine_step("decode", 0.02, 30)
    assert v(m, "zerolayer_backend_busy_seconds_total", phase="prefill") == pytest.approx(0.25)
    assert v(m, "zerolayer_backend_busy_seconds_total", phase="decode") == pytest.approx(0.03)
    assert v(m, "zerolayer_batch_size_count") == 3
    assert v(m, "zerolayer_batch_size_sum") == 64
    assert v(m, "zerolayer_batch_size_bucket", le="2.0") == 1  # le: a value on a bound counts
    assert v(m, "zerolayer_batch_size_bucket", le="1.0") == 0
    assert v(m, "zerolayer_batch_size_bucket", le="32.0") == 3
    assert v(m, "zerolayer_batch_size_bucket", le="+Inf") == 3
    assert v(m, "zerolayer_backend_busy_seconds_created", phase="decode") > 0
    m.set_queue(running=6, waiting=3, slots_used=6, slots_total=8)
    assert v(m, "zerolayer_num_requests_running") == 6
    assert v(m, "zerolayer_num_requests_waiting") == 3
    assert v(m, "zerolayer_kv_slots_used_ratio") == 0.75
    m.set_queue(running=0, waiting=0, slots_used=0, slots_total=0)
    assert v(m, "zerolayer_kv_slots_used_ratio") == 0
    m.kv_pages(0.5, 2, 3)
    m.kv_pages(0.25, 1, 0)
    assert v(m, "zerolayer_kv_pages_used_ratio") == 0.25
    assert v(m, "zerolayer_kv_preemptions_total") == 3
    assert v(m, "zerolayer_kv_admission_waits_total") == 3


def test_caches_and_limits(m: Metrics) -> None:
    m.prefix_lookup(100, 96)
    m.prefix_lookup(40, 0)
    m.prefix_lookup(20, 16)
    m.prefix_bytes(pinned=4096, cached=8192)
    m.response_cache_hit()
    m.rate_limited()
    m.rate_limited()
    assert v(m, "zerolayer_prefix_cache_queries_total") == 160  # tokens, as vLLM counts
    assert v(m, "zerolayer_prefix_cache_hits_total") == 112
    assert v(m, "zerolayer_prefix_cache_bytes", kind="pinned") == 4096
    assert v(m, "zerolayer_prefix_cache_bytes", kind="cached") == 8192
    assert v(m, "zerolayer_response_cache_hits_total") == 1
    assert v(m, "zerolayer_rate_limited_total") == 2


def test_connections_frames_bytes(m: Metrics) -> None:
    m.connection_opened()
    m.connection_opened()
    m.connection_closed()
    assert v(m, "zerolayer_connections") == 1
    m.frames("in", "REQUEST", 4)
    m.frames("out", "TOKEN", 100)
    m.frames("out", "TOKEN")
    m.frames_out_done.inc(4)  # the pre-resolved child a caller may hold directly
    m.bytes("in", 512)
    m.bytes_out.inc(2048)
    assert v(m, "zerolayer_frames_total", direction="in", type="REQUEST") == 4
    assert v(m, "zerolayer_frames_total", direction="out", type="TOKEN") == 101
    assert v(m, "zerolayer_frames_total", direction="out", type="DONE") == 4
    assert v(m, "zerolayer_frames_total", direction="in", type="TOKEN") == 0
    assert v(m, "zerolayer_bytes_total", direction="in") == 512
    assert v(m, "zerolayer_bytes_total", direction="out") == 2048
    with pytest.raises(KeyError):
        m.frames("sideways", "TOKEN")


def test_render_lists_every_family(m: Metrics) -> None:
    names = {f.name for f in text_string_to_metric_families(m.render().decode())}
    expected = {
        "zerolayer_time_to_first_token_seconds",
        "zerolayer_inter_token_latency_seconds",
        "zerolayer_e2e_request_latency_seconds",
        "zerolayer_request_queue_time_seconds",
        "zerolayer_num_requests_running",
        "zerolayer_num_requests_waiting",
        "zerolayer_prompt_tokens",
        "zerolayer_generation_tokens",
        "zerolayer_request_success",
        "zerolayer_request_errors",
        "zerolayer_backend_busy_seconds",
        "zerolayer_batch_size",
        "zerolayer_kv_slots_used_ratio",
        "zerolayer_prefix_cache_queries",
        "zerolayer_prefix_cache_hits",
        "zerolayer_prefix_cache_bytes",
        "zerolayer_response_cache_hits",
        "zerolayer_rate_limited",
        "zerolayer_connections",
        "zerolayer_frames",
        "zerolayer_bytes",
    }
    assert expected <= names
    # Every frame type is pre-resolved, so a dashboard sees zeros rather than gaps.
    text = m.render().decode()
    for t in FRAME_TYPES:
        assert f'zerolayer_frames_total{{direction="out",type="{t}"}} 0.0' in text


def test_label_values_are_the_documented_wire_names() -> None:
    """The label tables are derived from zerolayer.codes; these are the names dashboards and
    docs/metrics.md use, and the wire values DONE carries for them."""
    from zerolayer.codes import DONE_REASONS

    assert FINISH_REASONS == ("eos", "max_tokens", "stop", "cancelled")
    assert [int(r) for r in DONE_REASONS] == [0, 1, 2, 3]
    assert ERROR_CODES[0] == "MALFORMED_FRAME" and ERROR_CODES[-1] == "INTERNAL"
    assert len(ERROR_CODES) == 15 and FRAME_TYPES[0] == "REQUEST" and len(FRAME_TYPES) == 11


def test_enum_and_name_aliases(m: Metrics) -> None:
    from zerolayer.frames.protocol import ErrorCode, FinishReason, FrameType

    m.request_finished(FinishReason.STOP, 1, 1, 0.0, 0.0, 0.0)
    m.request_finished("STOP", 1, 1, 0.0, 0.0, 0.0)
    m.request_finished("stop", 1, 1, 0.0, 0.0, 0.0)
    assert v(m, "zerolayer_request_success_total", finished_reason="stop", api="frames") == 3
    m.request_error(ErrorCode.SLOW_CONSUMER)
    m.request_error("SLOW_CONSUMER")
    assert v(m, "zerolayer_request_errors_total", code="SLOW_CONSUMER", api="frames") == 2
    m.frames("out", FrameType.GOAWAY, 2)
    m.frames("out", "GOAWAY")
    assert v(m, "zerolayer_frames_total", direction="out", type="GOAWAY") == 3


def test_inter_token_many_equals_repeated_observe() -> None:
    a, b = Metrics(), Metrics()
    for seconds, n in ((0.5, 7), (0.0001, 3), (120.0, 2), (0.03, 1)):
        a.inter_token(seconds, n)
        for _ in range(n):
            b.itl.observe(seconds / n)
    text_a = a.render().decode()
    text_b = b.render().decode()

    def series(text: str) -> list[str]:
        return [
            ln
            for ln in text.splitlines()
            if ln.startswith("zerolayer_inter_token") and "_created" not in ln
        ]

    assert series(text_a) and series(text_a) == series(text_b)


def test_a_label_outside_the_tables_is_exported_not_raised(m: Metrics) -> None:
    m.request_finished("not_a_reason", 1, 1, 0.0, 0.0, 0.0)
    m.request_finished("not_a_reason", 1, 1, 0.0, 0.0, 0.0)
    m.request_error(999, api="openai")
    odd = {"finished_reason": "not_a_reason", "api": "frames"}
    assert v(m, "zerolayer_request_success_total", **odd) == 2
    assert v(m, "zerolayer_request_errors_total", code="999", api="openai") == 1
