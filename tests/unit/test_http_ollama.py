"""Ollama's model facts (zerolayer.http.ollama): which request bodies name the served model."""

from __future__ import annotations

import json

import pytest

from zerolayer.http.errors import HttpError
from zerolayer.http.ollama import OllamaModel

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
