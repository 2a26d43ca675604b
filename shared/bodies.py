"""Request bodies read by the handler, after the route's dependencies (its key check among
them): a body declared as a route's parameter is read and parsed by FastAPI, whatever its
size, before any dependency runs. Each reader bounds the body and answers problem+json: 415
not JSON content (a `charset` other than UTF-8 or a `Content-Encoding` included), 413 over
the limit, 400 not JSON, 422 naming each field that failed (a key given twice in one object
among them)."""

from __future__ import annotations

import json
import re
from typing import Any

import orjson
from fastapi import Request
from pydantic import BaseModel, ValidationError

from shared.http import Problem, validation_message

# orjson's error for nesting past its limit of 1,024 levels.
JSON_TOO_DEEP = "depth limit exceeded"


# `str.isdigit` takes `²` and other digits `int` refuses (a ValueError: a 500).
_DECIMAL = re.compile(r"[0-9]+")


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


# UTF-8 under the names clients send it by, and ASCII, a subset of it.
UTF_8_CHARSETS = frozenset({"utf-8", "utf8", "us-ascii", "ascii"})


def _charset(content_type: str) -> str | None:
    """The `charset` parameter of a media type, lower-cased and unquoted; None without one."""
    for parameter in content_type.split(";")[1:]:
        name, _, value = parameter.partition("=")
        if name.strip().lower() == "charset":
            return value.strip().strip('"').lower()
    return None


def _content_codings(request: Request) -> list[str]:
    """The codings of every `Content-Encoding` header, but `identity` (no coding)."""
    codings = (
        coding.strip().lower()
        for header in request.headers.getlist("content-encoding")
        for coding in header.split(",")
    )
    return [coding for coding in codings if coding and coding != "identity"]


def _refuse_unreadable_content(request: Request, what: str) -> None:
    """415 for a body this reader would misread: not JSON, not UTF-8 (JSON's only encoding,
    RFC 8259 §8.1), or under a content coding (a gzip body was "not valid UTF-8", a plain one
    mislabelled gzip accepted)."""
    content_type = request.headers.get("content-type", "")
    if not _is_json(content_type):
        raise Problem(415, f"Send the {what} as JSON with 'Content-Type: application/json'.")
    charset = _charset(content_type)
    if charset is not None and charset not in UTF_8_CHARSETS:
        raise Problem(
            415, f"The {what} must be UTF-8 JSON, not charset={charset[:40]!r}; send it as UTF-8."
        )
    codings = _content_codings(request)
    if codings:
        raise Problem(
            415,
            f"Content-Encoding {', '.join(codings)[:100]!r} is not supported; send the {what} "
            "unencoded.",
            headers={"Accept-Encoding": "identity"},
        )


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and _DECIMAL.fullmatch(declared) and int(declared) > limit:
        raise Problem(413, f"The body is {declared} bytes; the limit is {limit} bytes.")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise Problem(413, f"The body exceeds the limit of {limit} bytes.")
    return bytes(body)


async def read_json_object(request: Request, *, what: str, limit: int) -> dict[str, Any]:
    """The body as a JSON object: 415 not UTF-8 JSON content or encoded, 413 over `limit`, 400
    not UTF-8 or not JSON, 422 not an object or giving a key twice in one object."""
    _refuse_unreadable_content(request, what)
    body = await _read_body(request, limit)
    try:
        payload: Any = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        if str(error).startswith(JSON_TOO_DEEP):
            # Valid JSON, maybe: said to be invalid, a client looked for a syntax error.
            raise Problem(400, "The body's JSON nests deeper than 1,024 levels.") from error
        _refuse_invalid_utf_8(body, what)
        raise Problem(400, f"The body is not valid JSON: {error}.") from error
    if not isinstance(payload, dict):
        raise Problem(422, "The body must be a JSON object.", kind="invalid-fields")
    _refuse_repeated_keys(body)
    return payload


def _refuse_invalid_utf_8(body: bytes, what: str) -> None:
    """400 for a body that is not UTF-8, saying so and where: orjson's words were Python's
    ("str is not valid UTF-8: surrogates not allowed: line 1 column 1 (char 0)", whatever
    the byte's place). Decoded only once orjson refused the body: no cost to a good one."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise Problem(
            400,
            f"The body is not valid UTF-8 (at byte {error.start:,}, counting from 0); send "
            f"the {what} encoded as UTF-8.",
        ) from None


class _RepeatedKey(Exception):
    """A key given twice in one object of a body (`_refuse_repeated_keys`)."""


def _each_key_once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """`json.loads`'s `object_pairs_hook`: an object whose keys are all different."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise _RepeatedKey
    return obj


def _refuse_repeated_keys(body: bytes) -> None:
    """422 naming a key given more than once in one object of `body` (which orjson read as
    JSON): orjson, as most parsers, keeps the last without a word (`{"text": "a", "text":
    "b"}` scored "b"), and another parser keeping the first reads another request. Read a
    second time by `json`, whose hook sees each object's pairs: about 5 us for a submission
    of 300 characters (orjson's reading, 0.5 us), once per request."""
    try:
        json.loads(body, object_pairs_hook=_each_key_once)
    except _RepeatedKey:
        marked = json.loads(body, object_pairs_hook=_MarkedObject.of)
        field = _repeated_key_path(marked) or "body"
        message = "is given more than once in its object; give each key once"
        raise Problem(
            422,
            f"{field}: {message}.",
            kind="invalid-fields",
            errors=[{"field": field, "message": message}],
        ) from None


class _MarkedObject(dict[str, Any]):
    """An object read with its first repeated key, if any (the refusal's second reading)."""

    repeated: str | None = None

    @classmethod
    def of(cls, pairs: list[tuple[str, Any]]) -> _MarkedObject:
        obj = cls()
        for key, value in pairs:
            if key in obj and obj.repeated is None:
                obj.repeated = key
            obj[key] = value
        return obj


# How much of a repeated key a refusal quotes: a key may be as long as the body.
_QUOTED_KEY_CHARS = 100


def _key_name(key: str) -> str:
    return key[:_QUOTED_KEY_CHARS] or '""'


def _repeated_key_path(value: Any) -> str | None:
    """The first repeated key of `value`, read with `_MarkedObject`, as the 422s name a field
    (`metadata.source`, `items.0.text`); None where none is. A walk without recursion: the
    body may nest 1,024 levels deep, past Python's recursion limit."""
    stack: list[tuple[tuple[str, ...], Any]] = [((), value)]
    while stack:
        path, each = stack.pop()
        if isinstance(each, _MarkedObject):
            if each.repeated is not None:
                return ".".join((*path, _key_name(each.repeated)))
            children = [((*path, _key_name(key)), child) for key, child in each.items()]
        elif isinstance(each, list):
            children = [((*path, str(index)), child) for index, child in enumerate(each)]
        else:
            continue
        stack.extend(reversed(children))  # in the body's order
    return None


async def read_model[M: BaseModel](request: Request, model: type[M], *, what: str, limit: int) -> M:
    """`read_json_object`, then the model's checks (422 naming each field)."""
    payload = await read_json_object(request, what=what, limit=limit)
    try:
        return model.model_validate(payload)
    except ValidationError as error:
        raise invalid_fields(error) from error


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """The `openapi_extra` of a route that reads `model` with `read_model`."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": model.model_json_schema()}},
        }
    }


def invalid_fields(error: ValidationError) -> Problem:
    """422 naming each field a body failed on."""
    errors = [
        {"field": ".".join(map(str, e["loc"])) or "body", "message": validation_message(e)}
        for e in error.errors(include_url=False)
    ]
    detail = "; ".join(f"{e['field']}: {e['message']}" for e in errors)
    return Problem(422, detail, kind="invalid-fields", errors=errors)


# A body a route that takes none accepts all the same: what some clients send for "none".
EMPTY_BODIES = frozenset({b"", b"{}", b"null"})


async def refuse_a_body(request: Request, *, outcome: str) -> None:
    """A 422 for a request body sent to a route that takes none, `outcome` (such as "nothing
    was done") ending its detail. Ignored, a body meant for another route, or a malformed one,
    went unnoticed while the request changed something (`{bad` fired a cron run, found in a
    walkthrough). Called by each such route's handler, so after its key check: an app-wide
    check ran before it, and answered a client without a key 422 rather than 401."""
    body = (await request.body()).strip()
    if body in EMPTY_BODIES:
        return
    message = "this route takes no request body; send none"
    raise Problem(
        422,
        f"body: {message}; {outcome}.",
        kind="invalid-fields",
        errors=[{"field": "body", "message": message}],
    )
