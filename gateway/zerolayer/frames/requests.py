"""A REQUEST frame's payload, binary or JSON, as the door-neutral ``Request`` (docs/protocol.md):
the frame door's field mapping. Raises ``Refusal`` (that stream alone ends in ERROR), by the same
rules as every door (``zerolayer.request_path.validation``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from zerolayer.codes import invalid
from zerolayer.frames.protocol import (
    BIAS_ENTRY,
    FLAG_JSON,
    KNOWN_OPTIONS,
    OPT_LOGPROBS,
    OPT_NO_CACHE,
    OPT_PROCESSING,
    OPT_SEED,
    OPT_TEXT_DELTAS,
    OPT_TEXT_PROMPT,
    REQUEST_FIXED,
    REQUEST_PROCESSING,
    TOP_LOGPROBS_MASK,
    TOP_LOGPROBS_SHIFT,
)
from zerolayer.request_path.request import NO_STOP_IDS, Request
from zerolayer.request_path.validation import (
    check_keys,
    get_bool,
    get_int,
    get_messages,
    get_stops,
    get_text,
    load_object,
    read_common,
    validate,
)
from zerolayer.sampling_params import SamplingParams


def parse_request(flags: int, payload: memoryview) -> Request:
    """Parse and validate a REQUEST payload (binary or JSON). Raises ``Refusal`` (the stream
    ends in ERROR; the connection goes on): zerolayer.request_path.validation's rules, the same as
    HTTP's."""
    if flags & FLAG_JSON:
        return validate(_parse_json_request(payload))
    if len(payload) < REQUEST_FIXED.size:
        raise invalid(f"binary REQUEST needs at least 32 bytes, got {len(payload)}")
    max_tokens, temperature, top_p, top_k, seed, prompt_id, n_stop, options = (
        REQUEST_FIXED.unpack_from(payload, 0)
    )
    if options & ~KNOWN_OPTIONS:
        raise invalid(f"unknown option bits 0x{options:04x}", "options")
    prompt_at = REQUEST_FIXED.size + 4 * n_stop
    if prompt_at > len(payload):
        raise invalid(f"n_stop {n_stop} does not fit in the payload", "n_stop")
    processing: dict[str, Any] = {}
    if options & OPT_PROCESSING:
        processing, prompt_at = _parse_processing(payload, prompt_at)
    stop_ids = (
        np.frombuffer(payload, dtype="<i4", count=n_stop, offset=REQUEST_FIXED.size).astype(
            np.int32  # a copy: the payload view is reused
        )
        if n_stop
        else NO_STOP_IDS
    )
    sampling = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed if options & OPT_SEED else None,
        logprobs=bool(options & OPT_LOGPROBS),
        top_logprobs=(options & TOP_LOGPROBS_MASK) >> TOP_LOGPROBS_SHIFT,
        **processing,
    )
    req = Request(
        max_tokens=max_tokens,
        sampling=sampling,
        prompt_id=prompt_id,
        stop_ids=stop_ids,
        want_text=bool(options & OPT_TEXT_DELTAS),
        use_cache=not options & OPT_NO_CACHE,
    )
    validate(req)
    rest = payload[prompt_at:]
    if options & OPT_TEXT_PROMPT:
        try:
            req.prompt_text = str(rest, "utf-8")
        except UnicodeDecodeError as exc:
            raise invalid(f"prompt is not valid UTF-8: {exc.reason}", "prompt") from None
    else:
        if len(rest) % 4:
            raise invalid("token-id prompt length is not a multiple of 4", "prompt")
        req.prompt_ids = np.frombuffer(rest, dtype="<i4").astype(np.int32)
    if not len(rest) and not prompt_id:
        raise invalid("empty prompt without a prompt_id", "prompt")
    return req


def _parse_processing(payload: memoryview, at: int) -> tuple[dict[str, Any], int]:
    """The processing block at ``at`` (option bit 5): its fields (``SamplingParams``' names), and
    where the prompt starts."""
    end = at + REQUEST_PROCESSING.size
    if end > len(payload):
        raise invalid("the processing block (option bit 5) does not fit", "options")
    presence, frequency, repetition, min_tokens, n_bias, _ = REQUEST_PROCESSING.unpack_from(
        payload, at
    )
    bias_end = end + BIAS_ENTRY.itemsize * n_bias
    if bias_end > len(payload):
        raise invalid(f"n_bias {n_bias} does not fit in the payload", "logit_bias")
    entries = np.frombuffer(payload, BIAS_ENTRY, n_bias, end)
    bias = dict(zip(entries["id"].tolist(), entries["value"].tolist(), strict=True)) or None
    if bias is not None and len(bias) != n_bias:
        raise invalid("logit_bias names a token id twice", "logit_bias")
    fields = {
        "presence_penalty": presence,
        "frequency_penalty": frequency,
        "repetition_penalty": repetition,
        "min_tokens": min_tokens,
        "logit_bias": bias,
    }
    return fields, bias_end


# The keys of a JSON REQUEST (docs/protocol.md); the shared ones are read by
# zerolayer.request_path.validation.read_common, as on the HTTP door.
JSON_KEYS = frozenset(
    {
        "max_tokens",
        "messages",
        "prompt",
        "system",
        "prompt_id",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop_sequences",
        "cache",
        # version 2
        "logprobs",
        "top_logprobs",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "min_tokens",
        "n",
        "min_p",  # JSON only: the binary layout has no field for it (docs/protocol.md)
    }
)


def _parse_json_request(payload: memoryview) -> Request:
    obj = load_object(payload, "JSON request")
    check_keys(obj, JSON_KEYS)
    if "max_tokens" not in obj:
        raise invalid("max_tokens is required", "max_tokens")
    if ("messages" in obj) == ("prompt" in obj):
        raise invalid("exactly one of messages and prompt is required", "messages")
    req = Request(max_tokens=get_int(obj, "max_tokens", 0), want_text=True)
    read_common(obj, req, temperature=0.0)  # the frame protocol's default: greedy
    req.stop_sequences = get_stops(obj, "stop_sequences", allow_string=False)
    req.use_cache = get_bool(obj, "cache", True)
    if "system" in obj:
        req.system = get_text(obj["system"], "system") or None
    if "prompt" in obj:
        req.prompt_text = get_text(obj["prompt"], "prompt")
        if not req.prompt_text and not req.prompt_id and not req.system:
            raise invalid("empty prompt without a prompt_id", "prompt")
    else:
        req.messages = [
            {"role": role, "content": text}
            for role, text, _ in get_messages(obj, ("user", "assistant"))
        ]
    return req
