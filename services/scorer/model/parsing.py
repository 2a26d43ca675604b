"""Turning a model's answer into a validated `Verdict`, or a clear `UnusableOutput`.

Accepted shapes: a bare JSON object, one inside a Markdown code fence, or the first JSON
object embedded in prose that has a `score` key (else the first object at all).

Scores must be numbers in 0..10. Out-of-range scores are errors, never clamped: a model that
answers 42 misunderstood the scale, and clamping would hide that. A score given as a string
is accepted only when unambiguous: a plain decimal ("7.5") or a mark out of ten ("7/10",
"7 / 10"). Booleans, ranges ("7-8"), words ("seven"), other scales ("3/5") and NaN are not.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import ErrorDetails

from services.scorer.errors import UnusableOutput

MAX_COMMENT_CHARS: Final = 1000
# A verdict is a few hundred characters; bounding the search keeps a runaway answer cheap.
_MAX_SEARCHED_CHARS: Final = 20_000
_FENCED: Final = re.compile(r"```[ \t]*(?:json|JSON)?[ \t]*\n?(.*?)```", re.DOTALL)
_MARK_OUT_OF_TEN: Final = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(?:/\s*10(?:\.0+)?)?\s*")


class Verdict(BaseModel):
    """The judge's answer: a score from 0 to 10 and a short justification."""

    model_config = ConfigDict(frozen=True, extra="ignore", allow_inf_nan=False)

    score: float = Field(ge=0, le=10)
    comment: str = Field(min_length=1)

    @field_validator("score", mode="before")
    @classmethod
    def _unambiguous_number(cls, value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError("must be a number, not a boolean")  # noqa: TRY004 - becomes a ValidationError
        if isinstance(value, str):
            match = _MARK_OUT_OF_TEN.fullmatch(value)
            if match is None:
                raise ValueError(f"{value!r} is not a number from 0 to 10")
            return float(match.group(1))
        return value

    @field_validator("comment", mode="before")
    @classmethod
    def _trimmed_comment(cls, value: Any) -> Any:
        if isinstance(value, str):
            trimmed = value.strip()
            if len(trimmed) > MAX_COMMENT_CHARS:
                return trimmed[: MAX_COMMENT_CHARS - 1].rstrip() + "…"
            return trimmed
        return value


def parse_verdict(content: str) -> Verdict:
    """The verdict in a model's answer; raises `UnusableOutput` saying what is wrong."""
    candidate = _find_json_object(content[:_MAX_SEARCHED_CHARS])
    if candidate is None:
        raise UnusableOutput(
            'the answer holds no JSON object like {"score": 7, "comment": "..."}',
            raw_output=content,
        )
    try:
        return Verdict.model_validate(candidate)
    except ValidationError as exc:
        raise UnusableOutput(_describe(exc), raw_output=content) from exc


def _find_json_object(content: str) -> dict[str, Any] | None:
    whole = _loads_object(content.strip())
    if whole is not None:
        return whole
    for fenced in _FENCED.finditer(content):
        inside = _loads_object(fenced.group(1).strip())
        if inside is not None:
            return inside
    return _first_embedded_object(content)


# What reading a candidate as JSON may raise: not JSON, or nested deeper than the parser's
# recursion allows (an answer of thousands of `[`, which crashed the attempt).
_NOT_JSON = (ValueError, RecursionError)


def _loads_object(candidate: str) -> dict[str, Any] | None:
    try:
        value = json.loads(candidate)
    except _NOT_JSON:
        return None
    return value if isinstance(value, dict) else None


def _first_embedded_object(content: str) -> dict[str, Any] | None:
    decoder = json.JSONDecoder()
    first: dict[str, Any] | None = None
    start = content.find("{")
    while start != -1:
        try:
            value, _ = decoder.raw_decode(content, start)
        except _NOT_JSON:
            value = None
        if isinstance(value, dict):
            if "score" in value:
                return value
            first = value if first is None else first
        start = content.find("{", start + 1)
    return first


def _describe(error: ValidationError) -> str:
    problems = []
    for item in error.errors(include_url=False):
        field = ".".join(str(part) for part in item["loc"]) or "answer"
        problems.append(f"{field}: {_plain(item)}")
    return "the JSON verdict is invalid: " + "; ".join(problems)


def _plain(item: ErrorDetails) -> str:
    if item["type"] in ("greater_than_equal", "less_than_equal"):
        return f"{item['input']!r} is outside 0..10"
    if item["type"] == "missing":
        return "missing"
    if item["type"] == "string_too_short":
        return "is empty"
    return item["msg"].removeprefix("Value error, ")
