"""What a router in front of replicas needs from a daemon (docs/operations.md, "Replicas behind a
router"), against a real daemon (synthetic backend) through the official openai SDK: /health
and /v1/models on the API port, a chat request with the fields vllm-router adds streamed, and
the prefix-cache counters the benchmark reads on the API port's /metrics moving when a
conversation's next turn resends its history."""

from __future__ import annotations

import openai

from benchmarks._support.daemon import Daemon
from benchmarks._support.metrics import probe, scrape, value

# The fields vllm-router 0.1.17 adds to a forwarded chat request (tests/unit/test_router_fields.py)
ROUTER_FIELDS = {
    "logprobs": False, "no_stop_trim": False, "ignore_eos": False,
    "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
    "stream_reasoning": True, "return_hidden_states": False, "include_reasoning": True,
}  # fmt: skip
HITS, QUERIES = "zerolayer_prefix_cache_hits_total", "zerolayer_prefix_cache_queries_total"


def test_health_models_routed_chat_and_prefix_counters_on_the_api_port():
    with Daemon() as d:
        assert probe(d.http_url + "/health") == (200, "ok\n")
        client = openai.OpenAI(base_url=d.http_url + "/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["synthetic"]
        history = [{"role": "user", "content": "notes: " + "river stone garden " * 40}]
        before = scrape(d.http_url)
        for turn in range(2):
            stream = client.chat.completions.create(
                model="synthetic", messages=history, max_tokens=6, stream=True,
                extra_body=ROUTER_FIELDS, extra_headers={"cache-control": "no-cache"},
            )  # fmt: skip
            answer = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            assert len(answer) == 6  # the synthetic model: one character a token, no EOS
            history += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "and?"},
            ]
            if turn == 0:
                first = scrape(d.http_url)
        after = scrape(d.http_url)
        first_queries = value(first, QUERIES) - value(before, QUERIES)
        assert first_queries > 100  # the first prompt's tokens were looked up ...
        assert value(first, HITS) - value(before, HITS) < 32  # ... and few found (template only)
        # the second turn starts with the first turn's prompt: its blocks come from the store
        assert value(after, HITS) - value(first, HITS) >= first_queries - 32
