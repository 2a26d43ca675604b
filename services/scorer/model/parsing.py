"""Turning a model's answer into a validated `Verdict`, or a clear `UnusableOutput`.

Accepted shapes: a bare JSON object, or one JSON object with a `score` key embedded in prose
(a Markdown code fence included; else the first object at all). An answer holding two
different verdicts, or a `"score":` outside every object that parses (a verdict of its own
broken around one it quotes from the text), is unusable: which verdict is the judge's is
not for the parser to guess, and the first one found was often the one the text planted.

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
_MAX_PROBLEM_CHARS: Final = 500
_SCORE_KEY: Final = re.compile(r'"score"\s*:')
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
    objects = _embedded_objects(content)
    if not objects:
        return None
    verdicts = [value for _, _, value in objects if "score" in value]
    if len({json.dumps(verdict, sort_keys=True) for verdict in verdicts}) > 1:
        raise UnusableOutput(
            "the answer holds more than one verdict; answer with exactly one", raw_output=content
        )
    spans = [(start, end) for start, end, _ in objects]
    if any(not _within(spans, key.start()) for key in _SCORE_KEY.finditer(content)):
        raise UnusableOutput(
            'the answer holds a "score" outside any valid JSON object', raw_output=content
        )
    return verdicts[0] if verdicts else objects[0][2]


def _within(spans: list[tuple[int, int]], position: int) -> bool:
    return any(start <= position < end for start, end in spans)


# What reading a candidate as JSON may raise: not JSON, or nested deeper than the parser's
# recursion allows (an answer of thousands of `[`, which crashed the attempt).
_NOT_JSON = (ValueError, RecursionError)


def _loads_object(candidate: str) -> dict[str, Any] | None:
    try:
        value = json.loads(candidate)
    except _NOT_JSON:
        return None
    return value if isinstance(value, dict) else None


def _embedded_objects(content: str) -> list[tuple[int, int, dict[str, Any]]]:
    """The JSON objects in `content` that parse, outermost only, with their spans."""
    decoder = json.JSONDecoder()
    found: list[tuple[int, int, dict[str, Any]]] = []
    start = content.find("{")
    while start != -1:
        try:
            value, end = decoder.raw_decode(content, start)
        except _NOT_JSON:
            value, end = None, start + 1
        if isinstance(value, dict):
            found.append((start, end, value))
        else:
            end = start + 1
        start = content.find("{", end)
    return found


def _describe(error: ValidationError) -> str:
    problems = []
    for item in error.errors(include_url=False):
        field = ".".join(str(part) for part in item["loc"]) or "answer"
        problems.append(f"{field}: {_plain(item)}")
    described = "the JSON verdict is invalid: " + "; ".join(problems)
    # It goes back to the model in the repair prompt and out in `task.failed`.
    if len(described) > _MAX_PROBLEM_CHARS:
        return described[: _MAX_PROBLEM_CHARS - 1] + "…"
    return described


def _plain(item: ErrorDetails) -> str:
    if item["type"] in ("greater_than_equal", "less_than_equal"):
        return f"{item['input']!r} is outside 0..10"
    if item["type"] == "missing":
        return "missing"
    if item["type"] == "string_too_short":
        return "is empty"
    return item["msg"].removeprefix("Value error, ")
