"""Turning a model's answer into a validated `Verdict`, or a clear `UnusableOutput`.

Accepted shapes: a bare JSON object, or one JSON object with a `score` key embedded in prose
(a Markdown code fence included; else the first object at all). An answer holding two
different verdicts, or a score key outside every object that parses (a verdict of its own
broken around one it quotes from the text, or not strict JSON: `{'score': 2}`, `score: 2`,
`Score = 2`), or one object naming `score` twice (`{"score": 2, "score": 9}`), is unusable:
which verdict is the judge's is not for the parser to guess, and the first one found was
often the one the text planted. A key that only labels an object
(`Score: {"score": 7, ...}`) is not one. Only the first `_MAX_SEARCHED_CHARS` are searched,
so an answer with a score key past them (a long deliberation that quoted the planted verdict
first) is unusable too.
Verdicts are counted at any depth (one the model wraps, `{"verdict": {...}}`, counts beside
one it quotes), except inside a verdict, where an object with a `score` is part of it. A
verdict found only inside a wrapper is not unwrapped: the wrapper fails validation.

Scores must be numbers in 0..10. Out-of-range scores are errors, never clamped: a model that
answers 42 misunderstood the scale, and clamping would hide that. A score given as a string
is accepted only when unambiguous: a plain decimal ("7.5") or a mark out of ten ("7/10",
"7 / 10"). Booleans, ranges ("7-8"), words ("seven"), other scales ("3/5") and NaN are not.
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Iterator
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import ErrorDetails

from services.scorer.errors import UnusableOutput

MAX_COMMENT_CHARS: Final = 1000
# A verdict is a few hundred characters; bounding the search keeps a runaway answer cheap.
_MAX_SEARCHED_CHARS: Final = 20_000
# What the search may read of candidates that fail to parse, in all: each failed candidate is
# read up to where it breaks, so many unclosed objects (`[{"a":` repeated) made the search
# quadratic in the answer's length, all of it on the scorer's event loop.
_MAX_BROKEN_CHARS_READ: Final = 4 * _MAX_SEARCHED_CHARS
_MAX_PROBLEM_CHARS: Final = 500
# Any score key, strict JSON or not: `"score":`, `'score':`, `“score”:`, `score:`, `Score =`,
# escaped (`\"score\":`), in Markdown (`**Score**:`, a table's `| Score | 2`, not its
# header), with a parenthesis (`Score (out of 10):`), or emphasised with a mark right after
# it (`**Score** 2/10`), but a whole word: not `scores:`, `underscore:`, nor prose such as
# `a score 9/10 would need`. Every repetition is bounded: unbounded, a long
# run of `*` would be quadratic to scan.
_QUOTES = "\\\\\"'`*_\u201c\u201d\u2018\u2019\u00ab\u00bb"
_SCORE_KEY: Final = re.compile(
    rf"""(?<!\w)[{_QUOTES}]{{0,3}}score(?:"""
    rf"""[{_QUOTES}]{{0,3}}\s*(?:\([^()\n]{{0,40}}\)\s*)?(?:[:=]|\|\s*\d)"""
    rf"""|[{_QUOTES}]{{1,3}}\s*\d)""",
    re.IGNORECASE,
)
# What may come between a key and the object it labels: the emphasis closing after the
# colon (`**Score:**`), blank space, a code fence's opening or an inline code's backtick.
_BEFORE_LABELLED: Final = re.compile(r"[*_]{0,3}\s*(?:```[ \t]*\w*\s*|`)?")
# A verdict's key in any case, or one ending in it as a word (`final_score`, `overall score`).
_VERDICT_KEY: Final = re.compile(r"(?:.{0,40}[^a-z0-9])?score")
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
    _refuse_a_score_beyond_the_search(content)
    try:
        candidate = _find_json_object(content[:_MAX_SEARCHED_CHARS])
    except _ScoreNamedTwice:
        raise UnusableOutput(
            'the answer names "score" twice in one object; answer with exactly one',
            raw_output=content,
        ) from None
    if candidate is None:
        raise UnusableOutput(
            'the answer holds no JSON object like {"score": 7, "comment": "..."}',
            raw_output=content,
        )
    try:
        return Verdict.model_validate(candidate)
    except ValidationError as exc:
        raise UnusableOutput(_describe(exc), raw_output=content) from exc


def _refuse_a_score_beyond_the_search(content: str) -> None:
    """The judge's verdict may follow a long deliberation that quoted the planted one early:
    searching only the start of the answer, the parser found the planted one alone."""
    if len(content) <= _MAX_SEARCHED_CHARS:
        return
    # One linear scan, from the start: a key the window's edge cuts in two is whole only here.
    if any(key.end() > _MAX_SEARCHED_CHARS for key in _SCORE_KEY.finditer(content)):
        raise UnusableOutput(
            f'the answer holds a "score" beyond its first {_MAX_SEARCHED_CHARS:,} characters, '
            "all that is read; answer with exactly one JSON object",
            raw_output=content,
        )


def _find_json_object(content: str) -> dict[str, Any] | None:
    whole = _loads_object(content.strip())
    if whole is not None:
        _refuse_more_than_one_verdict([whole], content)
        return whole
    embedded = _embedded_objects(content)
    if not embedded:
        return None
    objects = [value for _, _, value in embedded]
    _refuse_more_than_one_verdict(objects, content)
    spans = [(start, end) for start, end, _ in embedded]
    if any(_stray(key, spans, content) for key in _SCORE_KEY.finditer(content)):
        raise UnusableOutput(
            'the answer holds a "score" outside any valid JSON object', raw_output=content
        )
    # A verdict found only inside a wrapper is not unwrapped: the wrapper fails validation,
    # and the repair asks the model for the plain object.
    return next((value for value in objects if "score" in value), objects[0])


def _refuse_more_than_one_verdict(objects: list[dict[str, Any]], content: str) -> None:
    distinct = {
        json.dumps(verdict, sort_keys=True) for value in objects for verdict in _verdicts_in(value)
    }
    if len(distinct) > 1:
        raise UnusableOutput(
            "the answer holds more than one verdict; answer with exactly one", raw_output=content
        )


def _verdicts_in(value: object) -> Iterator[dict[str, Any]]:
    """The objects with a `score` key in `value` at any depth, but not those inside one: an
    object nested in a verdict is part of it (a verdict quoted as a wrapper's field is not)."""
    # A loop, not recursion: a parsed answer can be nested thousands of levels deep.
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            if _is_a_verdict(item):
                yield item
            else:
                pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)


def _is_a_verdict(value: dict[Any, Any]) -> bool:
    """An object keyed `score` in any case, or by a key ending in it as a word beside a
    comment: a judge's own `{"Score": 2}` or `{"final_score": 2, "comment": ...}` beside
    the planted `{"score": 10}` is a second verdict (it fails validation, and the repair
    asks for the plain object), not an object to pass over. A breakdown without a comment
    (`{"clarity_score": 8, "depth_score": 6}`) is not one."""
    keys = [key.strip().lower() for key in value if isinstance(key, str)]
    if "score" in keys:
        return True
    return "comment" in keys and any(_VERDICT_KEY.fullmatch(key) for key in keys)


def _stray(key: re.Match[str], spans: list[tuple[int, int]], content: str) -> bool:
    """Whether `key` is outside every object that parses and labels none (`Score: {...}`)."""
    if _within(spans, key.start()):
        return False
    labelled = _BEFORE_LABELLED.match(content, key.end())
    # No `{` lies between the key and `labelled`: an object there is one starting at it.
    return labelled is None or not _within(spans, labelled.end())


def _within(spans: list[tuple[int, int]], position: int) -> bool:
    # Spans come in order and never overlap: only the last one starting at or before
    # `position` can hold it (a scan of every span made a long answer quadratic).
    index = bisect.bisect_right(spans, position, key=lambda span: span[0]) - 1
    return index >= 0 and position < spans[index][1]


class _ScoreNamedTwice(Exception):
    """An object whose `score` key comes twice (repeated, or in two cases)."""


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's members as a dict, refusing two `score` keys: json keeps the last of a
    repeated key, and `{"score": 2, "score": 9}` or `{"Score": 3, "score": 8}` read as 9
    and 8, two verdicts in one (review)."""
    if sum(key.strip().lower() == "score" for key, _ in pairs) > 1:
        raise _ScoreNamedTwice
    return dict(pairs)


# What reading a candidate as JSON may raise: not JSON, or nested deeper than the parser's
# recursion allows (an answer of thousands of `[`, which crashed the attempt).
_NOT_JSON = (ValueError, RecursionError)


def _loads_object(candidate: str) -> dict[str, Any] | None:
    try:
        value = json.loads(candidate, object_pairs_hook=_pairs)
    except _NOT_JSON:
        return None
    return value if isinstance(value, dict) else None


def _embedded_objects(content: str) -> list[tuple[int, int, dict[str, Any]]]:
    """The JSON objects in `content` that parse, outermost only, with their spans."""
    decoder = json.JSONDecoder(object_pairs_hook=_pairs)
    found: list[tuple[int, int, dict[str, Any]]] = []
    broken_chars_read = 0
    start = content.find("{")
    while start != -1:
        try:
            value, end = decoder.raw_decode(content, start)
        except _NOT_JSON as error:
            broken_chars_read += _read_before_failing(error, content) - start
            if broken_chars_read > _MAX_BROKEN_CHARS_READ:
                raise UnusableOutput(
                    "the answer holds too much broken JSON; answer with exactly one JSON object",
                    raw_output=content,
                ) from error
            value, end = None, start + 1
        if isinstance(value, dict):
            found.append((start, end, value))
        else:
            end = start + 1
        start = content.find("{", end)
    return found


def _read_before_failing(error: Exception, content: str) -> int:
    """Where the decoder stopped: a syntax error's position, else (nesting too deep) the end."""
    return error.pos if isinstance(error, json.JSONDecodeError) else len(content)


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
