"""The OpenAI Responses API (``POST /v1/responses``) and system messages anywhere in the
conversation, with the official clients (openai, anthropic, openai-agents, pydantic-ai) against
a daemon serving the default model, SmolLM2-135M-Instruct (its ChatML template renders a
system message in any place). Outputs are short (small ``max_output_tokens``, ``maxLength`` in
schemas) to keep the suite quick."""

from __future__ import annotations

from pathlib import Path

import anthropic
import openai
import pytest

from benchmarks._support.daemon import Daemon
from tests.support.smollm2 import SLOW_TIMEOUT_S, data_dir_of

MODEL = "SmolLM2-135M-Instruct"

pytestmark = pytest.mark.timeout(SLOW_TIMEOUT_S)


@pytest.fixture(scope="module")
def daemon(smollm2_dir: Path):
    env = {
        "ENGINE__BACKEND": "cpu",
        "MODEL__DATA_DIR": data_dir_of(smollm2_dir),
        "ENGINE__MAX_BATCH_SIZE": "4",
        "ENGINE__MAX_CONTEXT": "1024",
        "CACHE__ENABLED": "false",
    }
    with Daemon(env) as d:
        yield d


def oai(d: Daemon, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.http_url + "/v1", api_key="none", max_retries=0, **kw)


def ant(d: Daemon, **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=d.http_url, api_key="none", max_retries=0, **kw)


LATE_SYSTEM = [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "Another one?"},
]


def test_a_system_message_after_the_first_turn_is_answered_on_both_apis(daemon) -> None:
    c = oai(daemon)
    late = c.chat.completions.create(model=MODEL, messages=LATE_SYSTEM, max_tokens=8, seed=1)
    assert late.choices[0].finish_reason in ("stop", "length")
    # the system text is in the prompt: more prompt tokens than without it
    without = [m for m in LATE_SYSTEM if m["role"] != "system"]
    plain = c.chat.completions.create(model=MODEL, messages=without, max_tokens=1)
    assert late.usage.prompt_tokens > plain.usage.prompt_tokens
    a = ant(daemon).messages.create(
        model=MODEL,
        max_tokens=8,
        system="Be kind.",
        messages=[
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "Another one?"},
        ],
    )
    assert a.stop_reason in ("end_turn", "max_tokens") and a.usage.input_tokens > 0
