"""Ollama's API on the HTTP port (paths under ``/api/``): the answers that need no engine.

``/api/version``, ``/api/tags``, ``/api/ps`` and ``/api/show`` describe the one served model
in Ollama's shapes (``OLLAMA_API_VERSION`` is the Ollama release whose shapes these are:
clients gate features on it). ``model`` is the served name, with or without Ollama's
``:latest`` tag (listed with it); another name is 404 ``{"error": "model '<x>' not found"}``.
Facts we do not have (file size, quantization, family) are empty or 0, never made up.
``/api/embed`` and ``/api/embeddings`` answer 501 in Ollama's error shape until the engine
has embeddings; ``/api/chat`` and ``/api/generate`` are not served yet (the door's 404).
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone

from zerolayer.http.errors import HttpError
from zerolayer.http.reply import dumps

OLLAMA_API_VERSION = "0.12.0"
TAG = ":latest"
_FAR_FUTURE = "2318-01-01T00:00:00Z"  # /api/ps: a model that is never unloaded


class OllamaModel:
    """The served model as Ollama's listings describe it (bodies built once)."""

    def __init__(self, name: str, max_context: int, zerolayer_version: str) -> None:
        self.name = name
        started = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        entry = {
            "name": name + TAG,
            "model": name + TAG,
            "modified_at": started,
            "size": 0,  # unknown: the weights may be made, converted or mapped
            "digest": hashlib.sha256(name.encode()).hexdigest(),
            "details": {
                "parent_model": "",
                "format": "",
                "family": "",
                "families": [],
                "parameter_size": "",
                "quantization_level": "",
            },
        }
        self.version_body = dumps({"version": OLLAMA_API_VERSION, "zerolayer": zerolayer_version})
        self.tags_body = dumps({"models": [entry]})
        self.ps_body = dumps({"models": [{**entry, "expires_at": _FAR_FUTURE, "size_vram": 0}]})
        self.show_body = dumps(
            {
                "modelfile": f"# served by zerolayer\nFROM {name}\n",
                "parameters": "",
                "template": "",
                "details": entry["details"],
                "model_info": {"general.name": name, "general.context_length": max_context},
                "capabilities": ["completion"],
                "modified_at": started,
            }
        )

    def check(self, body: bytes) -> None:
        """Refuse a request body that does not name the served model (``model``, or the old
        ``name``): 400 when it is missing or not a string, 404 when it is another model."""
        try:
            obj = json.loads(body)
        except ValueError:
            raise HttpError(400, "the body is not JSON") from None
        if not isinstance(obj, dict):
            raise HttpError(400, "the body must be a JSON object")
        model = obj.get("model", obj.get("name"))
        if not isinstance(model, str) or not model:
            raise HttpError(400, "model: a model name (string) is required", param="model")
        if model.removesuffix(TAG) != self.name:
            raise HttpError(404, f"model '{model}' not found", param="model")

    def show(self, body: bytes) -> bytes:
        self.check(body)
        return self.show_body


def not_available(endpoint: str) -> HttpError:
    """``/api/embed`` and ``/api/embeddings`` before the engine has embeddings."""
    return HttpError(501, f"{endpoint} is not available yet: this server has no embeddings")
