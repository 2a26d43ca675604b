"""What a client reads when its body is refused: the validator's own words (pydantic put
"Value error, " ahead of them), and a body nested too deep said to be that, not invalid
JSON (both found in a walkthrough). A small app of the shared body readers, over HTTP."""

from __future__ import annotations

import tracemalloc
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from pydantic import BaseModel, field_validator

from shared.bodies import read_json_object, read_model
from shared.http import install_problem_handlers

JSON_TYPE = {"Content-Type": "application/json"}


class Even(BaseModel):
    number: int

    @field_validator("number")
    @classmethod
    def _even(cls, number: int) -> int:
        if number % 2:
            raise ValueError("the number must be even")
        return number


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    app = FastAPI()
    install_problem_handlers(app)

    @app.post("/even")
    async def even(request: Request) -> dict[str, int]:
        body = await read_model(request, Even, what="number", limit=1 << 20)
        return {"number": body.number}

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        yield http


async def test_a_validators_refusal_reads_in_its_own_words(client: httpx.AsyncClient) -> None:
    response = await client.post("/even", json={"number": 3})

    assert response.status_code == 422
    problem = response.json()
    assert problem["detail"] == "number: the number must be even"
    assert problem["errors"] == [{"field": "number", "message": "the number must be even"}]


async def test_a_body_nested_too_deep_is_said_to_be_so(client: httpx.AsyncClient) -> None:
    deep = b"[" * 2000 + b"]" * 2000
    headers = {"Content-Type": "application/json"}

    response = await client.post("/even", content=deep, headers=headers)

    assert response.status_code == 400
    assert response.json()["detail"] == "The body's JSON nests deeper than 1,024 levels."


@pytest.mark.parametrize("declared", [b"\xb2", b"\xb9\xb2"])  # `²`, `¹²` as a server decodes them
async def test_a_content_length_of_other_digits_than_ascii_is_no_server_error(
    client: httpx.AsyncClient, declared: bytes
) -> None:
    """`str.isdigit` takes `²`, which `int` refuses: a ValueError, a 500. Not a number, the
    declared length is left aside and the body read within its limit, as for any other."""
    headers = [(b"content-type", b"application/json"), (b"content-length", declared)]

    response = await client.post("/even", content=b'{"number": 2}', headers=headers)

    assert response.status_code == 200, response.text
    assert response.json() == {"number": 2}


@pytest.mark.parametrize(
    ("headers", "named"),
    [
        ({"Content-Type": "application/json", "Content-Encoding": "gzip"}, "'gzip'"),
        ({"Content-Type": "application/json", "Content-Encoding": "Deflate"}, "'deflate'"),
        ({"Content-Type": "application/merge-patch+json; charset=utf-16"}, "'utf-16'"),
        ({"Content-Type": "application/json; Charset=ISO-8859-1"}, "'iso-8859-1'"),
    ],
)
async def test_a_body_encoded_or_not_utf_8_is_a_415_naming_why(
    client: httpx.AsyncClient, headers: dict[str, str], named: str
) -> None:
    """Every service's JSON routes read bodies here: one declared encoded, or in a charset
    other than UTF-8, was read as plain UTF-8 JSON."""
    response = await client.post("/even", content=b'{"number": 2}', headers=headers)

    assert response.status_code == 415, response.text
    assert response.headers["content-type"] == "application/problem+json"
    assert named in response.json()["detail"]


@dataclass
class Objects:
    """A route reading any JSON object, and the bodies it took."""

    http: httpx.AsyncClient
    taken: list[dict[str, Any]]

    async def post(self, body: bytes) -> httpx.Response:
        return await self.http.post("/object", content=body, headers=JSON_TYPE)


@pytest.fixture
async def objects() -> AsyncIterator[Objects]:
    app = FastAPI()
    install_problem_handlers(app)
    taken: list[dict[str, Any]] = []

    @app.post("/object")
    async def read(request: Request) -> dict[str, Any]:
        taken.append(await read_json_object(request, what="object", limit=1 << 20))
        return taken[-1]

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        yield Objects(http, taken)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b'{"text": "a", "text": "b"}', "text"),
        (b'{"text": "a", "rubric": "r", "text": "a"}', "text"),  # the same value twice too
        (b'{"text": "a", "metadata": {"source": 1, "source": 2}}', "metadata.source"),
        (b'{"items": [{"text": "a"}, {"text": "b", "text": "c"}]}', "items.1.text"),
        (b'{"\\u0074ext": "a", "text": "b"}', "text"),  # one of them escaped
        (b'{"": 1, "": 2}', '""'),
    ],
)
async def test_a_key_given_twice_in_an_object_is_a_422_naming_it(
    objects: Objects, body: bytes, field: str
) -> None:
    """orjson keeps the last of two values of a key without a word (`{"text": "a", "text":
    "b"}` scored "b"), where a parser keeping the first reads another request."""
    response = await objects.post(body)

    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == "application/problem+json"
    problem = response.json()
    message = "is given more than once in its object; give each key once"
    assert problem["type"].endswith("/invalid-fields")
    assert problem["detail"] == f"{field}: {message}."
    assert problem["errors"] == [{"field": field, "message": message}]
    assert objects.taken == []


async def test_a_key_repeated_in_another_object_is_no_repetition(
    objects: Objects,
) -> None:
    body = b'{"text": "a", "metadata": {"text": "a"}, "items": [{"text": 1}, {"text": 2}]}'

    response = await objects.post(body)

    assert response.status_code == 200, response.text
    assert response.json()["metadata"] == {"text": "a"}
    assert len(objects.taken) == 1


async def test_a_repetition_nested_as_deep_as_a_body_may_is_named_not_a_server_error(
    objects: Objects,
) -> None:
    """The refusal finds the key's path without recursion: 1,000 levels are within orjson's
    limit, and past Python's. It names the last levels only: the whole path, 2,000
    characters, was given twice in the 422."""
    body = b'{"a": ' * 1000 + b'{"x": 1, "x": 2}' + b"}" * 1000

    response = await objects.post(body)

    assert response.status_code == 422, response.text
    field = "…." + "a." * 98 + "x"
    assert response.json()["errors"][0]["field"] == field
    assert response.json()["detail"].startswith(f"{field}: ")
    assert len(field) <= 200


async def test_a_path_of_long_keys_is_cut_at_a_key(objects: Objects) -> None:
    """A key is quoted to its first 100 characters, a path to its last keys within 200."""
    body = b'{"%s": {"%s": {"x": 1, "x": 2}}}' % (b"k" * 300, b"j" * 150)

    response = await objects.post(body)

    assert response.status_code == 422, response.text
    assert response.json()["errors"][0]["field"] == "…." + "j" * 100 + ".x"


def _deep_and_wide(depth: int, keys: int) -> bytes:
    """An object `depth` levels deep holding `keys` keys at the bottom, then one holding a
    key twice, at the top."""
    wide = b",".join(b'"k%d":0' % index for index in range(keys))
    body = b'{"a":' * depth + b"{" + wide + b"}" + b"}" * depth
    return body[:-1] + b',"b":{"x":1,"x":2}}'


async def test_a_repetition_after_a_deep_and_wide_object_is_found_in_little_memory(
    objects: Objects,
) -> None:
    """Finding the key's path copied the path down to every member of every object: for a
    body of 1 MiB (a submission's limit) 1,000 levels deep with 95,000 keys at the bottom, a
    path of 1,000 labels for each key, 800 MB held, seconds of the event loop's time. The
    walk holds a label for each open container now: the peak is the body's two readings,
    some 30 times its size (Python's objects for its keys)."""
    body = _deep_and_wide(1000, 95_000)
    assert len(body) <= 1 << 20

    tracemalloc.start()
    try:
        response = await objects.post(body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert response.status_code == 422, response.text
    assert response.json()["errors"] == [
        {"field": "b.x", "message": "is given more than once in its object; give each key once"}
    ]
    assert peak < 100 * len(body), f"{peak:,} bytes held at the peak"
    assert objects.taken == []


@pytest.mark.parametrize(
    ("body", "at"),
    [
        (b'{"text": "caf\xe9"}', 13),  # Latin-1, sent as UTF-8
        (b"\xff", 0),
        (b'{"text": "\xe2\x82"}', 10),  # cut short: two bytes of a three-byte character
        (b'{"text": "\xed\xa0\x80"}', 10),  # a surrogate, which UTF-8 never encodes
    ],
)
async def test_a_body_not_utf_8_is_said_to_be_so_and_where(
    objects: Objects, body: bytes, at: int
) -> None:
    """It was orjson's words, Python's: "str is not valid UTF-8: surrogates not allowed:
    line 1 column 1 (char 0)", whatever the byte's place."""
    response = await objects.post(body)

    assert response.status_code == 400, response.text
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["detail"] == (
        f"The body is not valid UTF-8 (at byte {at}, counting from 0); send the object "
        "encoded as UTF-8."
    )
    assert objects.taken == []


@pytest.mark.parametrize("body", [b"[]", b'"text"', b"3", b"null"])
async def test_a_body_not_an_object_names_the_body_as_the_other_422s_name_fields(
    client: httpx.AsyncClient, body: bytes
) -> None:
    """Every other 422 lists its fields in `errors`; this one had none (a walkthrough)."""
    response = await client.post("/even", content=body, headers=JSON_TYPE)

    assert response.status_code == 422
    problem = response.json()
    assert problem["detail"] == "The body must be a JSON object."
    assert problem["errors"] == [{"field": "body", "message": "must be a JSON object"}]
