"""Request bodies read by the handler, after the route's dependencies (its key check among
them): a body declared as a route's parameter is read and parsed by FastAPI, whatever its
size, before any dependency runs. Each reader bounds the body and answers problem+json: 415
not JSON content (a `charset` other than UTF-8 or a `Content-Encoding` included), 413 over
the limit, 400 not JSON, 422 naming each field that failed (a key given twice in one object
among them)."""

from __future__ import annotations

import functools
import itertools
import json
import re
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from typing import Any

import orjson
from fastapi import Request
from pydantic import BaseModel, ValidationError

from shared.http import MAX_ERRORS_SHOWN, Problem, described_errors, one_header

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
    """The `charset` parameter of a media type, lower-cased and unquoted; None without one.
    Given twice, a 400: the first was taken (`charset=utf-8; charset=latin-1` was read as
    UTF-8), where another reader may take the last (found in a walkthrough)."""
    charsets = [
        value.strip().strip('"').lower()
        for name, _, value in (
            parameter.partition("=") for parameter in content_type.split(";")[1:]
        )
        if name.strip().lower() == "charset"
    ]
    if len(charsets) > 1:
        raise Problem(400, "Content-Type gives its charset more than once: give one.")
    return charsets[0] if charsets else None


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
    mislabelled gzip accepted). 400 for a `Content-Type` sent twice, or a `charset` given
    twice in it: of two, the first was taken without a word."""
    content_type = one_header(request, "Content-Type") or ""
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
    body = await _read_at_most(request, limit)
    if body is None:
        declared = request.headers.get("content-length")
        if declared is not None and _DECIMAL.fullmatch(declared) and int(declared) > limit:
            raise Problem(413, f"The body is {declared} bytes; the limit is {limit} bytes.")
        raise Problem(413, f"The body exceeds the limit of {limit} bytes.")
    return body


async def _read_at_most(request: Request, limit: int) -> bytes | None:
    """The body, or None once it is declared or found longer than `limit` (the rest unread)."""
    declared = request.headers.get("content-length")
    if declared is not None and _DECIMAL.fullmatch(declared) and int(declared) > limit:
        return None
    body = bytearray()
    async for chunk in request.stream():
        if len(body) + len(chunk) > limit:
            return None
        body += chunk
    return bytes(body)


async def read_json_object(
    request: Request,
    *,
    what: str,
    limit: int,
    arrived: Callable[[], Awaitable[None]] | None = None,
) -> dict[str, Any]:
    """The body as a JSON object: 415 not UTF-8 JSON content or encoded, 413 over `limit`, 400
    not UTF-8 or not JSON, 422 not an object or giving a key twice in one object. `arrived` is
    awaited once the body is in, before it is read as JSON (a submission's rate count)."""
    _refuse_unreadable_content(request, what)
    body = await _read_body(request, limit)
    if arrived is not None:
        await arrived()
    try:
        payload: Any = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        if str(error).startswith(JSON_TOO_DEEP):
            # Valid JSON, maybe: said to be invalid, a client looked for a syntax error.
            raise Problem(400, "The body's JSON nests deeper than 1,024 levels.") from error
        _refuse_invalid_utf_8(body, what)
        raise Problem(400, f"The body is not valid JSON: {error}.") from error
    if not isinstance(payload, dict):
        raise _field_problem("body", "must be a JSON object", "The body must be a JSON object.")
    _refuse_repeated_keys(body, payload)
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


def _refuse_repeated_keys(body: bytes, payload: dict[str, Any]) -> None:
    """422 naming a key given more than once in one object of `body`, which orjson read as
    `payload`: orjson, as most parsers, keeps the last without a word (`{"text": "a", "text":
    "b"}` scored "b"), and another parser keeping the first reads another request.

    Told without reading the body again. In valid JSON, which orjson found the body to be, a
    `:` outside string literals is a name separator, one per member of an object: the body's
    members are its colons once its string literals are taken out (`_members`). orjson's
    objects hold each key once, its last value: their keys, summed (`_keys`), are the members
    less one for each repetition. So the two differ exactly when an object gives a key twice,
    spelt alike or not (`"\\u0074ext"` is `"text"`, to orjson as to any reader). The body's
    colons are at least its members: as many as the keys, they settle it without a look at
    its strings. A refusal alone reads the body again, to name the key (`_repeated_key_path`).
    """
    keys = _keys(payload)
    if body.count(b":") == keys or _members(body) == keys:
        return
    field = _repeated_key_path(body) or "body"
    raise _field_problem(field, "is given more than once in its object; give each key once")


# A JSON string literal once its escaped quotes are taken out (`_members`): its quotes and
# all between, matched at C's speed: the unrolled form reading escapes as it goes
# (`"[^"\\]*(?:\\.[^"\\]*)*"`) took 4 times as long over texts, longer than `json`'s reading.
_STRING_LITERAL = re.compile(rb'"[^"]*"')


def _members(body: bytes) -> int:
    """How many members the objects of `body`, valid JSON, give between them: its colons
    outside string literals. The escapes `\\\\` and `\\"` are taken out first, leaving only
    the quotes that delimit strings: a run of backslashes (in a string alone) is escaped
    backslashes from its start, and a last one escaping what follows, as `bytes.replace`
    takes them. (A byte of a character outside ASCII is never `"`, `\\` or `:`.)"""
    if b"\\" in body:
        body = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    return _STRING_LITERAL.sub(b"", body).count(b":")


def _keys(payload: dict[str, Any]) -> int:
    """How many keys the objects of `payload` (orjson's reading) hold between them. A walk
    without recursion (the body may nest 1,024 levels, past Python's limit) holding only the
    containers that hold something."""
    keys = len(payload)
    stack: list[Iterable[Any]] = [payload.values()]
    while stack:
        for child in stack.pop():
            kind = type(child)
            if kind is dict:
                if child:
                    keys += len(child)
                    stack.append(child.values())
            elif kind is list and child:
                stack.append(child)
    return keys


# How much of a repeated key a refusal quotes: a key may be as long as the body.
_QUOTED_KEY_CHARS = 100
# How much of its path: the last labels, after "…" for those left out. 1,000 levels deep, a
# path of 2,000 characters was given twice in the 422.
_QUOTED_PATH_CHARS = 200
_LEFT_OUT = "…"

# An object as `json` reads it with `object_pairs_hook=tuple`: its members, each key as given.
type _Members = tuple[tuple[str, Any], ...]


def _repeated_key_path(body: bytes) -> str | None:
    """The first repeated key of `body`, in the body's order, as the 422s name a field
    (`metadata.source`, `items.0.text`); None where none is. `json` reads each object as its
    members (a tuple, at C's speed: a hook in Python took seconds for a body of 16 MiB), and
    the walk goes down one path at a time, without recursion (the body may nest 1,024 levels,
    past Python's limit): it holds the open containers' places, each with its label, and puts
    a path together for the key found alone (a copy of each path for each child held 800 MB
    for a body of 1 MiB)."""
    top: _Members = json.loads(body, object_pairs_hook=tuple)
    repeated = _repeated_key(top)
    if repeated is not None:
        return _path([], repeated)
    labels: list[str | int] = []  # the place, in its parent, of each container entered
    places: list[Iterator[tuple[str | int, Any]]] = [iter(top)]
    while places:
        for label, child in places[-1]:
            kind = type(child)
            if kind is tuple and child:
                repeated = _repeated_key(child)
                if repeated is not None:
                    return _path([*labels, label], repeated)
                places.append(iter(child))
            elif kind is list and child:
                places.append(enumerate(child))
            else:
                continue
            labels.append(label)
            break
        else:
            places.pop()
            if labels:
                labels.pop()
    return None


def _repeated_key(members: _Members) -> str | None:
    """The first key of an object given a second time; None where each is given once."""
    if len(dict(members)) == len(members):
        return None
    seen: set[str] = set()
    for key, _ in members:
        if key in seen:
            return key
        seen.add(key)
    return None  # pragma: no cover (a dict of fewer keys than members gave one twice)


def _path(labels: list[str | int], key: str) -> str:
    """The path of `key`, under the containers at `labels`: the last labels, as many as
    `_QUOTED_PATH_CHARS` allows."""
    names = [_name(key)]
    length = len(names[0])
    for label in reversed(labels):
        name = _name(label)
        length += 1 + len(name)
        if length > _QUOTED_PATH_CHARS - len(_LEFT_OUT) - 1:
            names.append(_LEFT_OUT)
            break
        names.append(name)
    return ".".join(reversed(names))


def _name(label: str | int) -> str:
    """A key as a path names it (cut, and `""` for the empty key), or an index."""
    if isinstance(label, int):
        return str(label)
    return label[:_QUOTED_KEY_CHARS] or '""'


async def read_model[M: BaseModel](request: Request, model: type[M], *, what: str, limit: int) -> M:
    """`read_json_object`, then the model's checks (422 naming each field)."""
    payload = await read_json_object(request, what=what, limit=limit)
    refuse_many_unknown_fields(unknown_fields(payload, model), dotted_field)
    try:
        return model.model_validate(payload)
    except ValidationError as error:
        raise invalid_fields(error) from error


def dotted_field(location: Location) -> str:
    return ".".join(map(str, location))


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """The `openapi_extra` of a route that reads `model` with `read_model`."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": model.model_json_schema()}},
        }
    }


def invalid_fields(error: ValidationError) -> Problem:
    """422 naming each field a body failed on (`MAX_ERRORS_SHOWN` at most)."""
    detail, errors = described_errors(
        error.errors(include_url=False), lambda e: dotted_field(tuple(e["loc"])) or "body"
    )
    return Problem(422, detail, kind="invalid-fields", errors=errors)


# Where in a body an error is, as pydantic locates it.
type Location = tuple[str | int, ...]

# What pydantic says of a key a model does not know (`extra="forbid"`).
UNKNOWN_FIELD = "Extra inputs are not permitted"


def unknown_fields(
    payload: Mapping[str, Any], model: type[BaseModel], at: Location = ()
) -> Iterator[Location]:
    """Where `payload` has a key `model` refuses (`extra="forbid"`), as pydantic locates it
    under `at`."""
    if model.model_config.get("extra") != "forbid":
        return iter(())
    known = _field_names(model)
    return ((*at, key) for key in payload if key not in known)


def refuse_many_unknown_fields(
    unknown: Iterable[Location],
    field_of: Callable[[Location], str],
    extensions: Callable[[list[Location]], dict[str, Any]] = lambda _: {},
) -> None:
    """422 naming the first `MAX_ERRORS_SHOWN` of `unknown` when there are more, before the
    model's checks: pydantic makes an error of each unknown key, and a body of a few MiB
    holds a million (see `MAX_ERRORS_SHOWN`). Fewer go to the model's checks, which name
    them with the body's other errors. `extensions`: the problem's, from those named."""
    first = list(itertools.islice(unknown, MAX_ERRORS_SHOWN + 1))
    if len(first) <= MAX_ERRORS_SHOWN:
        return
    named = first[:MAX_ERRORS_SHOWN]
    errors = [{"loc": location, "msg": UNKNOWN_FIELD} for location in named]
    detail, described = described_errors(errors, lambda error: field_of(error["loc"]))
    detail += f"; and more unknown fields, not listed (at most {MAX_ERRORS_SHOWN} are)"
    raise Problem(422, detail, kind="invalid-fields", errors=described, **extensions(named))


@functools.cache
def _field_names(model: type[BaseModel]) -> frozenset[str]:
    names: set[str] = set()
    for name, field in model.model_fields.items():
        names.add(name)
        names.update(
            alias for alias in (field.alias, field.validation_alias) if isinstance(alias, str)
        )
    return frozenset(names)


# A body a route that takes none accepts all the same: what some clients send for "none".
EMPTY_BODIES = frozenset({b"", b"{}", b"null"})
# How much of a body such a route reads: any longer is a body, whatever it holds (spaces
# around one of `EMPTY_BODIES` among them). The whole body was read, 300 MiB of it by a
# tenant's key to remove its failure alert (the gateway's memory 116 -> 424 MB), to be
# refused.
NO_BODY_READ = 64


async def refuse_a_body(request: Request, *, outcome: str) -> None:
    """A 422 for a request body sent to a route that takes none, `outcome` (such as "nothing
    was done") ending its detail. Ignored, a body meant for another route, or a malformed one,
    went unnoticed while the request changed something (`{bad` fired a cron run, found in a
    walkthrough). Called by each such route's handler, so after its key check: an app-wide
    check ran before it, and answered a client without a key 422 rather than 401. A body
    declared, or found, longer than `NO_BODY_READ` is refused at once, the rest unread."""
    head = await _read_at_most(request, NO_BODY_READ)
    if head is None or head.strip() not in EMPTY_BODIES:
        message = "this route takes no request body; send none"
        raise _field_problem("body", message, f"body: {message}; {outcome}.")


def _field_problem(field: str, message: str, detail: str | None = None) -> Problem:
    """A 422 naming one field, as `invalid_fields` names each of a model's."""
    return Problem(
        422,
        detail or f"{field}: {message}.",
        kind="invalid-fields",
        errors=[{"field": field, "message": message}],
    )
