"""Reading the JSON body of an API request: typed field getters that refuse with a 400 naming
the field, shared by the OpenAI and Anthropic translations.

Conventions both APIs follow here: a field whose value is ``null`` counts as absent (clients
such as LangChain send explicit nulls); a field we do not know is refused, never ignored, unless
it is listed as not changing the result (``user``, ``metadata``, ...); numbers are checked for
type and range before anything is built.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable

from gateway.http.errors import HttpError, invalid

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1


def load_object(body: bytes) -> dict:
    """The request body as a JSON object with null fields dropped."""
    try:
        obj = json.loads(body)
    except UnicodeDecodeError as exc:
        raise invalid(f"request body is not valid UTF-8: {exc.reason}") from None
    except ValueError as exc:
        raise invalid(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise invalid("request body is not valid JSON: nested too deeply") from None
    if not isinstance(obj, dict):
        raise invalid("request body must be a JSON object")
    return present(obj)


def present(obj: dict) -> dict:
    """``obj`` without its null fields."""
    return {k: v for k, v in obj.items() if v is not None}


def check_keys(obj: dict, known: Iterable[str], where: str = "") -> None:
    """Refuse the first field of ``obj`` that is not in ``known``, by name."""
    for key in obj:
        if key not in known:
            name = f"{where}.{key}" if where else key
            raise invalid(f"unsupported field: {name}", name)


def get_int(obj: dict, key: str, default: int, lo: int, hi: int, name: str = "") -> int:
    value = obj.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        name = name or key
        raise invalid(f"{name} must be an integer in [{lo}, {hi}]", name)
    return value


def get_float(obj: dict, key: str, default: float, lo: float, hi: float) -> float:
    value = obj.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(f"{key} must be a number", key)
    try:
        value = float(value)
    except OverflowError:
        raise invalid(f"{key} is out of range", key) from None
    if not math.isfinite(value) or not lo <= value <= hi:
        raise invalid(f"{key} must be a number in [{lo:g}, {hi:g}]", key)
    return value


def get_bool(obj: dict, key: str, default: bool = False) -> bool:
    value = obj.get(key, default)
    if not isinstance(value, bool):
        raise invalid(f"{key} must be true or false", key)
    return value


def get_text(value: object, name: str, allow_empty: bool = True) -> str:
    """A JSON string that is also valid UTF-8 (JSON admits lone surrogates, UTF-8 does not)."""
    if not isinstance(value, str) or not (allow_empty or value):
        raise invalid(f"{name} must be a {'' if allow_empty else 'non-empty '}string", name)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(f"{name} is not valid UTF-8 (lone surrogate)", name) from None
    return value


def get_text_parts(value: object, name: str, type_key: str = "type") -> str:
    """Content given as a string or as a list of text parts ``{"type": "text", "text": ...}``
    (both APIs' form); parts are joined with a newline. Any other part type is refused."""
    if isinstance(value, str):
        return get_text(value, name)
    if not isinstance(value, list):
        raise invalid(f"{name} must be a string or a list of text parts", name)
    texts = []
    for i, part in enumerate(value):
        where = f"{name}[{i}]"
        part = get_object(part, where)
        kind = part.get(type_key)
        if kind != "text":
            raise invalid(f"{where}: content of type {kind!r} is not supported (text only)", where)
        check_keys(part, (type_key, "text", "cache_control"), where)
        texts.append(get_text(part.get("text"), f"{where}.text"))
    return "\n".join(texts)


def get_object(value: object, name: str) -> dict:
    """A JSON object (its null fields dropped)."""
    if not isinstance(value, dict):
        raise invalid(f"{name} must be an object", name)
    return present(value)


def get_messages(obj: dict, roles: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """``messages``: a non-empty list of ``{"role", "content"}`` with a role in ``roles`` and
    the content a string or text parts; (role, text, where) for each, ``where`` naming it."""
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        m = get_object(m, where)
        role = m.get("role")
        if role not in roles:
            raise invalid(f"{where}.role must be {', '.join(roles)}; got {role!r}", f"{where}.role")
        check_keys(m, ("role", "content"), where)
        if "content" not in m:
            raise invalid(f"{where}.content is required", f"{where}.content")
        out.append((role, get_text_parts(m["content"], f"{where}.content"), where))
    return out


def get_stops(obj: dict, key: str, max_count: int = 64) -> tuple[str, ...]:
    """Stop strings: one string or a list of non-empty strings."""
    value = obj.get(key, ())
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or len(value) > max_count:
        raise invalid(f"{key} must be a string or a list of at most {max_count} strings", key)
    return tuple(get_text(s, key, allow_empty=False) for s in value)


def refuse_unless(obj: dict, key: str, ok: bool, why: str) -> None:
    """A field that would change the result in a way we do not support."""
    if key in obj and not ok:
        raise HttpError(400, f"{key}: {why}", param=key, code="unsupported_parameter")


def check_model(obj: dict, served: str) -> str:
    """The ``model`` field must name the served model (absent = the served model)."""
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
