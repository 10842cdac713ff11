"""Keyword arguments with sampling parameters among them, for the types that hold those in one
``SamplingParams`` (Request, RequestContext): ``Request(**with_sampling(kw))``."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from zerolayer.sampling_params import SamplingParams

SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))


def with_sampling(kw: dict[str, Any]) -> dict[str, Any]:
    """``kw`` with its SamplingParams fields gathered into ``sampling`` (always set)."""
    given = {k: v for k, v in kw.items() if k in SAMPLING_FIELDS}
    out = {k: v for k, v in kw.items() if k not in SAMPLING_FIELDS}
    if given or "sampling" not in out:
        out["sampling"] = SamplingParams(**given)
    return out
