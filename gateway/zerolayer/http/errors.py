"""HTTP errors of every API: the one table from our error codes to statuses, and the bodies.

Every refusal the HTTP door sends goes through here. ``STATUS`` maps the protocol's ErrorCode
(the same codes the frame port sends) to an HTTP status: ``http_error`` turns a
``zerolayer.codes.Refusal`` (from validation, the input processor, a hook or the request path)
into its HTTP form through it. ``_KINDS`` gives each status its error type in each API's own
shape: OpenAI ``{"error": {"message", "type", "param", "code"}}``, Anthropic
``{"type": "error", "error": {"type", "message"}}``, Ollama ``{"error": "<message>"}`` (and the
same object as an NDJSON line mid-stream). Anthropic answers "overloaded" with its own
529 where OpenAI uses 503. ``HttpError`` is the answer the HTTP shell writes; errors that only
HTTP has (unknown path, method, body size, content type, timeouts, an unknown model) are raised
as ``HttpError`` with their status directly.
"""

from __future__ import annotations

from zerolayer.codes import ANTHROPIC as ANTHROPIC  # re-exported: the API labels
from zerolayer.codes import OLLAMA as OLLAMA
from zerolayer.codes import OPENAI as OPENAI
from zerolayer.codes import ErrorCode, Refusal
from zerolayer.http.json_body import dumps
from zerolayer.ops.escape import client_text
from zerolayer.request_path.validation import JsonObject

# ErrorCode → HTTP status: the one table. Codes that only the frame port can produce (framing,
# streams per connection) still get a status so that no code is ever unmapped.
STATUS: dict[int, int] = {
    ErrorCode.MALFORMED_FRAME: 400,
    ErrorCode.FRAME_TOO_LARGE: 413,
    ErrorCode.UNSUPPORTED_VERSION: 400,
    ErrorCode.UNAUTHENTICATED: 401,
    ErrorCode.RATE_LIMITED: 429,
    ErrorCode.OVERLOADED: 503,
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.PROMPT_TOO_LONG: 400,
    ErrorCode.UNKNOWN_PROMPT: 400,
    ErrorCode.STREAM_IN_USE: 400,
    ErrorCode.TOO_MANY_STREAMS: 429,
    ErrorCode.IDLE_TIMEOUT: 408,
    ErrorCode.SHUTTING_DOWN: 503,
    ErrorCode.SLOW_CONSUMER: 503,
    ErrorCode.INTERNAL: 500,
}

# status → (OpenAI error type, Anthropic error type, Anthropic's status when it differs)
_KINDS: dict[int, tuple[str, str, int]] = {
    400: ("invalid_request_error", "invalid_request_error", 400),
    401: ("authentication_error", "authentication_error", 401),
    403: ("permission_error", "permission_error", 403),
    404: ("not_found_error", "not_found_error", 404),
    405: ("invalid_request_error", "invalid_request_error", 405),
    408: ("timeout_error", "timeout_error", 408),
    413: ("invalid_request_error", "request_too_large", 413),
    415: ("invalid_request_error", "invalid_request_error", 415),
    431: ("invalid_request_error", "invalid_request_error", 431),
    429: ("rate_limit_error", "rate_limit_error", 429),
    500: ("server_error", "api_error", 500),
    503: ("server_error", "overloaded_error", 529),
}

REASONS: dict[int, bytes] = {
    200: b"OK",
    204: b"No Content",
    400: b"Bad Request",
    401: b"Unauthorized",
    403: b"Forbidden",
    404: b"Not Found",
    405: b"Method Not Allowed",
    408: b"Request Timeout",
    413: b"Payload Too Large",
    415: b"Unsupported Media Type",
    431: b"Request Header Fields Too Large",
    429: b"Too Many Requests",
    500: b"Internal Server Error",
    503: b"Service Unavailable",
    529: b"Overloaded",
}


# HTTP-only errors → the protocol code they count as in the request error metrics.
_STATUS_CODE: dict[int, ErrorCode] = {
    400: ErrorCode.INVALID_REQUEST,
    401: ErrorCode.UNAUTHENTICATED,
    403: ErrorCode.INVALID_REQUEST,
    404: ErrorCode.INVALID_REQUEST,
    405: ErrorCode.INVALID_REQUEST,
    408: ErrorCode.IDLE_TIMEOUT,
    413: ErrorCode.FRAME_TOO_LARGE,
    415: ErrorCode.INVALID_REQUEST,
    429: ErrorCode.RATE_LIMITED,
    431: ErrorCode.FRAME_TOO_LARGE,
    500: ErrorCode.INTERNAL,
    503: ErrorCode.OVERLOADED,
}


class HttpError(Exception):
    """The HTTP answer to a refused request, before its response started: the wire form of a
    ``Refusal`` (``http_error``), or an error only HTTP has (raised with its status).

    ``param`` names the offending request field (OpenAI's ``param``); ``code`` is OpenAI's
    machine-readable ``code`` (defaults to the ErrorCode's lower-case name when one is given).
    ``close`` asks for the connection to be closed after the answer (the request could not be
    read to its end). ``error`` is the protocol code it counts as in metrics.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_ms: int = 0,
        close: bool = False,
        allow: str = "",
        error: ErrorCode | None = None,
    ) -> None:
        super().__init__(message)
        self.error = error if error is not None else _STATUS_CODE.get(status, ErrorCode.INTERNAL)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_ms = retry_after_ms
        self.close = close
        self.allow = allow  # the Allow header of a 405

    @classmethod
    def from_code(
        cls, code: int, message: str, retry_after_ms: int = 0, param: str | None = None
    ) -> HttpError:
        """The HTTP form of an ERROR the request path ends a stream with."""
        return http_error(Refusal(code, message, retry_after_ms, param))


def http_error(refusal: Refusal) -> HttpError:
    """The HTTP form of a refusal, through the one table ``STATUS``: ``param`` is the field
    it names, OpenAI's ``code`` its reason."""
    return HttpError(
        STATUS.get(refusal.code, 500),
        refusal.message,
        param=refusal.field,
        code=refusal.reason,
        retry_after_ms=refusal.retry_after_ms,
        error=refusal.code,
    )


def status_for(api: str, status: int) -> int:
    """The status this API uses (Anthropic's overloaded is 529)."""
    kind = _KINDS.get(status)
    return kind[2] if (kind is not None and api == ANTHROPIC) else status


def error_body(api: str, err: HttpError) -> bytes:
    """The JSON error object of ``api`` for ``err``."""
    kind = _KINDS.get(err.status, _KINDS[500])
    message = client_text(err.message)  # it may quote what the client sent
    if api == ANTHROPIC:
        obj: JsonObject = {"type": "error", "error": {"type": kind[1], "message": message}}
    elif api == OLLAMA:
        obj = {"error": message}
    else:
        param = None if err.param is None else client_text(err.param)
        obj = {
            "error": {
                "message": message,
                "type": kind[0],
                "param": param,
                "code": err.code,
            }
        }
    return dumps(obj)


def stream_error_event(api: str, err: HttpError) -> bytes:
    """The in-stream error event of ``api``: sent when the stream had already started."""
    body = error_body(api, err)
    if api == ANTHROPIC:
        return b"event: error\ndata: " + body + b"\n\n"
    if api == OLLAMA:
        return body + b"\n"  # one NDJSON line
    return b"data: " + body + b"\n\n"
