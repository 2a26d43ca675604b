"""Request bodies read by the handler, after the route's dependencies (its key check among
them): a body declared as a route's parameter is read and parsed by FastAPI, whatever its
size, before any dependency runs. Each reader bounds the body and answers problem+json: 415
not JSON content (a `charset` other than UTF-8 or a `Content-Encoding` included), 413 over
the limit, 400 not JSON, 422 naming each field that failed."""

from __future__ import annotations

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
    not JSON, 422 not an object."""
    _refuse_unreadable_content(request, what)
    body = await _read_body(request, limit)
    try:
        payload: Any = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        if str(error).startswith(JSON_TOO_DEEP):
            # Valid JSON, maybe: said to be invalid, a client looked for a syntax error.
            raise Problem(400, "The body's JSON nests deeper than 1,024 levels.") from error
        raise Problem(400, f"The body is not valid JSON: {error}.") from error
    if not isinstance(payload, dict):
        raise Problem(422, "The body must be a JSON object.", kind="invalid-fields")
    return payload


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
