"""Ollama's model facts (zerolayer.http.ollama): which request bodies name the served model."""

from __future__ import annotations

import json

import pytest

from zerolayer.http.errors import HttpError
from zerolayer.http.ollama import OllamaModel, parse_generate

MODEL = OllamaModel("tiny", 2048, "0.1.0")


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"not json", 400, None),
        (b"[1]", 400, None),
        (b"{}", 400, "model"),
        (b'{"model": 3}', 400, "model"),
        (b'{"model": "other"}', 404, "model"),
        (b'{"model": "tiny:7b"}', 404, "model"),
    ],
)
def test_a_body_not_naming_the_served_model_is_refused(body, status, param) -> None:
    with pytest.raises(HttpError) as err:
        MODEL.show(body)
    assert (err.value.status, err.value.param) == (status, param)


@pytest.mark.parametrize(
    "body", [b'{"model": "tiny"}', b'{"model": "tiny:latest"}', b'{"name": "tiny"}']
)
def test_the_served_model_with_or_without_its_tag(body) -> None:
    shown = json.loads(MODEL.show(body))
    assert shown["model_info"] == {"general.name": "tiny", "general.context_length": 2048}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"format": "yaml"}, "format"),
        ({"options": {"mirostat": 1}}, "options.mirostat"),
        ({"options": {"typo": 1}}, "options.typo"),
        ({"options": []}, "options"),
        ({"think": True}, "think"),
        ({"stream": "no"}, "stream"),
        ({"images": ["aGk="]}, "images"),
        ({"options": {"num_predict": 0}}, "options.num_predict"),  # the OpenAI rule, renamed
        ({"options": {"repeat_penalty": -1}}, "options.repeat_penalty"),
    ],
)
def test_fields_refused_by_their_ollama_names(body, param) -> None:
    request = {"model": "tiny", "prompt": "Hi", "stream": False, **body}
    with pytest.raises(HttpError) as err:
        parse_generate(json.dumps(request).encode(), MODEL)
    assert err.value.status == 400 and err.value.param == param
    assert err.value.message.startswith(param)


def test_options_map_onto_our_fields_with_ollamas_defaults() -> None:
    request = {"model": "tiny", "prompt": "Hi", "raw": True, "options": {"num_predict": -1}}
    sampling = parse_generate(json.dumps(request).encode(), MODEL).req.sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.8, 0.9, 40)
    request["options"] = {"temperature": 0, "seed": 3, "num_predict": 5, "repeat_penalty": 1.1}
    reply = parse_generate(json.dumps(request).encode(), MODEL)
    assert reply.req.sampling.temperature == 0 and reply.req.sampling.seed == 3
    assert reply.req.max_tokens == 5 and reply.req.sampling.repetition_penalty == 1.1
