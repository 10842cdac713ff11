"""What only the HTTP APIs ask of a request body: fields refused unless given their no-op value,
the ``model`` field, and the tool and grammar modules' errors as refusals.

Reading and validating fields is gateway.validation's, shared with the frame door; this module
holds the rules that have no frame equivalent.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from gateway.codes import invalid
from gateway.http.errors import HttpError
from gateway.structured import GrammarError
from gateway.tools import ToolError
from gateway.validation import JsonObject


@contextmanager
def field_errors() -> Iterator[None]:
    """gateway.tools' and gateway.structured's errors (each naming its field) as the request's
    refusal, a 400 with that field."""
    try:
        yield
    except (ToolError, GrammarError) as exc:
        raise invalid(str(exc), exc.field) from None


def refuse_unless(obj: JsonObject, key: str, ok: bool, why: str) -> None:
    """A field that would change the result in a way we do not support."""
    if key in obj and not ok:
        raise invalid(f"{key}: {why}", key, "unsupported_parameter")


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
