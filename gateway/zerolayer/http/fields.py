"""What only the HTTP APIs ask of a request body: fields refused unless given their no-op value
(among them the ones routers add to every request they forward), the ``model`` field, and the
tool and grammar modules' errors as refusals.

Reading and validating fields is zerolayer.request_path.validation's, shared with the frame door;
this module holds the rules that have no frame equivalent.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from zerolayer.codes import invalid
from zerolayer.http.errors import HttpError
from zerolayer.http.tools import ToolError
from zerolayer.request_path.validation import JsonObject
from zerolayer.structured import GrammarError


@contextmanager
def field_errors() -> Iterator[None]:
    """zerolayer.http.tools' and zerolayer.structured's errors (each naming its field) as the
    request's refusal, a 400 with that field."""
    try:
        yield
    except (ToolError, GrammarError) as exc:
        raise invalid(str(exc), exc.field) from None


def refuse_unless(obj: JsonObject, key: str, ok: bool, why: str) -> None:
    """A field that would change the result in a way we do not support."""
    if key in obj and not ok:
        raise invalid(f"{key}: {why}", key, "unsupported_parameter")


# vllm-router and sglang-router forward an OpenAI request with these SGLang extensions added at
# these values, which are what this server does anyway (stop strings trimmed, special tokens not
# shown, no reasoning to separate, no hidden states): accepted at exactly these values.
ROUTER_DEFAULTS: dict[str, bool] = {
    "no_stop_trim": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
    "include_reasoning": True,
}


def refuse_router_fields(obj: JsonObject) -> None:
    """The fields of ``ROUTER_DEFAULTS`` at another value (or not a bool) are refused."""
    for key, default in ROUTER_DEFAULTS.items():
        refuse_unless(
            obj, key, obj.get(key) is default, f"only {str(default).lower()} is supported"
        )


def check_model(obj: JsonObject, served: str) -> str:
    """The ``model`` field must name the served model (absent = the served model). A wrong
    model is HTTP's own 404 (frames name no model)."""
    model = obj.get("model", served)
    if not isinstance(model, str):
        raise invalid("model must be a string", "model")
    if model != served:
        raise HttpError(
            404,
            f"the model {model!r} does not exist; this server serves {served!r}",
            param="model",
            code="model_not_found",
        )
    return model
