"""The replies of echo (/v1/completions) and /v1/embeddings, from prompt outputs given by hand
as the door gives them (``ChoiceOut.prompt_ids`` / ``prompt_logprobs`` / ``pooled``), checked
against the openai SDK's own types; no daemon (tests/e2e/test_http_embeddings.py runs them)."""

from __future__ import annotations

import base64
import json

import numpy as np
import openai.types as ot

from tests.unit.test_http_api import MODEL, STRINGS, comp, lp, streamed, whole
from zerolayer.engine.types import PromptLogprobs
from zerolayer.frames.protocol import FinishReason
from zerolayer.http.embeddings import parse_embeddings
from zerolayer.http.reply import Ending

PROMPT = np.frombuffer(b"cat", np.uint8).astype(np.int32)  # the byte tokenizer: one per byte
SCORED = PromptLogprobs(  # "a" after "c", "t" after "ca"; one alternative each
    np.array([-2.0, -0.5], np.float32),
    np.array([[ord("o")], [ord("t")]], np.int32),
    np.array([[-1.0], [-0.5]], np.float32),
)


def give(r, choices: int = 1) -> None:  # noqa: ANN001
    for c in r.choices[:choices]:
        c.prompt_ids, c.prompt_logprobs = PROMPT, SCORED


def test_echo_with_logprobs_starts_with_the_prompt_first_null_offsets_going_on():
    r = comp(prompt="cat", echo=True, logprobs=1, max_tokens=2)
    give(r)
    body = whole(r, [(0, "s", lp(ord("s"), [ord("s")]))], [Ending(FinishReason.MAX_TOKENS, 3, 1)])
    # The SDK's types say numbers where the first entries are null (as vLLM's): the SDK builds
    # its objects without validating, as ``construct`` does.
    c = ot.Completion.construct(**json.loads(body)).choices[0]
    assert c.text == "cats" and c.finish_reason == "length"
    assert c.logprobs.tokens == ["c", "a", "t", "s"]
    assert c.logprobs.token_logprobs == [None, -2.0, -0.5, -0.5]
    assert c.logprobs.top_logprobs == [None, {"o": -1.0, "a": -2.0}, {"t": -0.5}, {"s": -1.0}]
    assert c.logprobs.text_offset == [0, 1, 2, 3]


def test_echo_without_a_completion_and_without_logprobs():
    r = comp(prompt=[99, 97, 116], echo=True, max_tokens=0)  # ids: decoded for the text
    give(r)
    done = ot.Completion.model_validate_json(whole(r, [], [Ending(FinishReason.MAX_TOKENS, 3, 0)]))
    assert done.choices[0].text == "cat" and done.choices[0].logprobs is None


def test_streamed_echo_gives_each_choice_the_prompt_first():
    r = comp(prompt="cat", echo=True, n=2, max_tokens=1, stream=True)
    give(r, 1)  # the door gives the stream that starts the answer its choice's outputs
    ending = Ending(FinishReason.MAX_TOKENS, 3, 1)
    events = streamed(r, [(0, "s", None), (1, "!", None)], [ending, ending])
    chunks = [json.loads(d) for _, d in events[:-1]]
    texts: dict[int, str] = {0: "", 1: ""}
    firsts: dict[int, str] = {}
    for ch in chunks:
        for c in ch["choices"]:
            firsts.setdefault(c["index"], c["text"])
            texts[c["index"]] += c["text"]
    assert firsts == {0: "cat", 1: "cat"} and texts == {0: "cats", 1: "cat!"}


def test_embeddings_body_in_float_and_base64():
    vector = np.array([0.6, 0.8], np.float32)
    bodies = []
    for fmt in ("float", "base64"):
        body = json.dumps({"model": MODEL, "input": ["a", [1, 2]], "encoding_format": fmt})
        r = parse_embeddings(body.encode(), MODEL, 2)
        assert r.req.inputs is not None and len(r.req.inputs) == 2 and r.req.max_tokens == 0
        for i, n in enumerate((2, 2)):
            r.choices[i].pooled = vector
            r.finish(i, Ending(FinishReason.MAX_TOKENS, n, 0))
        bodies.append(json.loads(r.body()))
    flt, b64 = bodies
    assert flt["usage"] == {"prompt_tokens": 4, "total_tokens": 4}
    assert [d["index"] for d in flt["data"]] == [0, 1]
    assert flt["data"][0]["embedding"] == vector.tolist()
    raw = base64.b64decode(b64["data"][1]["embedding"])
    assert np.frombuffer(raw, "<f4").tolist() == vector.tolist()
    assert STRINGS is not None
