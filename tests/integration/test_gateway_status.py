"""Gateway and status in-process against the real broker and database (no scorer)."""

from __future__ import annotations

import asyncio
import gzip
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime, timedelta

import httpx
import pytest
from pymongo import AsyncMongoClient

from services.gateway.app import create_app as create_gateway
from services.gateway.cache import ResultCache, cache_key, scoring_model
from services.gateway.keys import generate_key
from services.gateway.settings import GatewaySettings
from shared.bus import publish_event
from shared.contracts import (
    DEFAULT_TENANT,
    HEURISTIC_PROMPT_VERSION,
    Phase,
    ScoreResult,
    TaskCompleted,
    TaskStarted,
    event_sequence,
    new_id,
    utcnow,
)
from shared.http import MAX_ERRORS_SHOWN
from shared.runtime import make_broker
from tests.integration.in_process import gateway_and_status
from tests.support import eventually, queued_commands, running

MAX_TEXT = 200
GZIPPED_JSON = {"content-type": "application/json", "content-encoding": "gzip"}
API_KEY = generate_key().token  # registered for the default tenant by BOOTSTRAP_API_KEY
INTERNAL_KEY = "test-internal-key"


class MovableClock:
    def __init__(self) -> None:
        self.offset = timedelta()

    def __call__(self) -> datetime:
        return utcnow() + self.offset


@dataclass
class Stack:
    api: httpx.AsyncClient
    amqp_url: str
    mongo: AsyncMongoClient[dict[str, object]]
    db_prefix: str
    clock: MovableClock

    @property
    def submissions(self) -> object:
        return self.mongo[f"{self.db_prefix}_gateway"]["submissions"]


@pytest.fixture(scope="module")
async def stack(amqp_url: str, mongo: object, db_prefix: str) -> AsyncIterator[Stack]:
    mongo_url = mongo.url  # type: ignore[attr-defined]
    env = {
        "RABBITMQ_URL": amqp_url,
        "MONGO_URL": mongo_url,
        "MONGO_DB_PREFIX": db_prefix,
        "INTERNAL_API_KEY": INTERNAL_KEY,  # the gateway's reads of the status service carry it
        "MAX_TEXT_CHARS": str(MAX_TEXT),  # the gateway's (the status service reads neither)
        "BOOTSTRAP_API_KEY": API_KEY,
        "LLM_MODEL": "judge-a",
        "LLM_ALLOWED_MODELS": "judge-b, judge-c",
    }
    clock = MovableClock()
    async with gateway_and_status(env, api_key=API_KEY, clock=clock) as services:
        client: AsyncMongoClient[dict[str, object]] = AsyncMongoClient(mongo_url, tz_aware=True)
        yield Stack(services.api, amqp_url, client, db_prefix, clock)
        await client.close()


async def _submission_count(stack: Stack) -> int:
    collection = stack.mongo[f"{stack.db_prefix}_gateway"]["submissions"]
    return await collection.count_documents({})


def _assert_problem(response: httpx.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body: dict[str, object] = response.json()
    assert body["status"] == status
    assert isinstance(body["detail"], str)
    assert body["detail"]
    return body


def _nested(levels: int) -> dict[str, object]:
    value: dict[str, object] = {}
    for _ in range(levels):
        value = {"a": value}
    return value


BAD_INPUTS = [
    pytest.param(
        {"content": b'{"text": "hi"}', "headers": {"content-type": "text/plain"}},
        415,
        id="wrong-content-type",
    ),
    pytest.param(
        {"content": b'{"text": "hi"', "headers": {"content-type": "application/json"}},
        400,
        id="not-json",
    ),
    # A declared coding was ignored: a gzip body was "not valid UTF-8" (400), a plain one
    # mislabelled gzip accepted.
    pytest.param(
        {"content": gzip.compress(b'{"text": "hi"}'), "headers": GZIPPED_JSON},
        415,
        id="gzip-encoded",
    ),
    pytest.param(
        {"content": b'{"text": "hi"}', "headers": GZIPPED_JSON}, 415, id="mislabelled-gzip"
    ),
    pytest.param(
        {
            "content": b'{"text": "hi"}',
            "headers": {"content-type": "application/json", "content-encoding": "identity, br"},
        },
        415,
        id="brotli-after-identity",
    ),
    pytest.param(
        {
            "content": '{"text": "hi"}'.encode("utf-16"),
            "headers": {"content-type": "application/json; charset=UTF-16"},
        },
        415,
        id="utf-16-charset",
    ),
    pytest.param(
        {
            "content": b'{"text": "hi"}',
            "headers": {"content-type": 'application/json; charset="latin-1"'},
        },
        415,
        id="latin-1-charset",
    ),
    pytest.param({"json": {"text": "x" * (MAX_TEXT + 1)}}, 413, id="text-too-long"),
    pytest.param(
        {
            "content": b"{" + b" " * 2_000_000 + b"}",
            "headers": {"content-type": "application/json"},
        },
        413,
        id="body-too-large",
    ),
    pytest.param({"json": {"text": ""}}, 422, id="empty-text"),
    pytest.param({"json": {"text": " \n\t "}}, 422, id="blank-text"),
    # Nothing left once the scorer normalises them (control characters are dropped): were
    # accepted, then failed by the scorer.
    pytest.param({"json": {"text": "\u0001"}}, 422, id="control-character-text"),
    pytest.param({"json": {"text": "\u0000\u0080 \t"}}, 422, id="controls-and-blanks-text"),
    # Invisible format characters alone (category Cf) say nothing: were accepted and scored.
    pytest.param({"json": {"text": "\u200b\u2060\ufeff"}}, 422, id="format-characters-text"),
    # A variation selector, a Hangul filler, a blank Braille cell, accents alone (a walkthrough).
    pytest.param({"json": {"text": "\ufe0f\u3164\u2800\u0301"}}, 422, id="invisible-text"),
    pytest.param({"json": {"text": "hi", "colour": "red"}}, 422, id="unknown-field"),
    pytest.param({"json": {"text": 42}}, 422, id="wrong-type"),
    pytest.param({"json": ["hi"]}, 422, id="not-an-object"),
    pytest.param(
        {"json": {"text": "hi", "metadata": {"$where": "1"}}}, 422, id="operator-in-metadata"
    ),
    pytest.param({"json": {"text": "hi", "metadata": {"a.b": 1}}}, 422, id="dot-in-metadata"),
    # JSON integers have no bound; BSON's stop at 64 bits, signed (the JSON parser turns
    # integers beyond 64 bits, unsigned, into floats, refused as well).
    pytest.param(
        {"json": {"text": "hi", "metadata": {"n": 2**63}}}, 422, id="integer-beyond-int64"
    ),
    pytest.param(
        {"json": {"text": "hi", "metadata": {"n": [2**64 - 1]}}}, 422, id="uint64-in-metadata"
    ),
    # Past 64 bits unsigned, the JSON parser reads a float (1.1805916207174113e+21): it got
    # past the integer check, was accepted and kept as a float, not the client's value.
    pytest.param({"json": {"text": "hi", "metadata": {"n": 2**70 + 1}}}, 422, id="beyond-uint64"),
    pytest.param(
        {"json": {"text": "hi", "metadata": {"n": [{"m": -(2**70)}]}}},
        422,
        id="beyond-int64-negative-nested",
    ),
    pytest.param({"json": {"text": "hi", "metadata": _nested(40)}}, 422, id="metadata-too-deep"),
    pytest.param(
        {"json": {"text": "hi", "metadata": _nested(400)}}, 422, id="metadata-far-too-deep"
    ),
    pytest.param({"json": {"text": "hi", "delay_seconds": -1}}, 422, id="negative-delay"),
    # A field of the wrong JSON type was coerced: `true` was a one-second delay, "30" thirty
    # seconds, "no" and 0 turned the cache off, a number was read as a Unix time.
    pytest.param({"json": {"text": "hi", "delay_seconds": True}}, 422, id="boolean-delay"),
    pytest.param({"json": {"text": "hi", "delay_seconds": "30"}}, 422, id="string-delay"),
    pytest.param({"json": {"text": "hi", "delay_seconds": 30.0}}, 422, id="float-delay"),
    pytest.param({"json": {"text": "hi", "use_cache": "no"}}, 422, id="string-use-cache"),
    pytest.param({"json": {"text": "hi", "use_cache": 0}}, 422, id="number-use-cache"),
    pytest.param({"json": {"text": "hi", "not_before": 30}}, 422, id="number-time"),
    # Valid with their offsets, out of range in UTC (BSON could not encode them: was a 500).
    pytest.param(
        {"json": {"text": "hi", "not_before": "0001-01-01T00:00:00+01:00"}},
        422,
        id="not-before-before-year-1-in-utc",
    ),
    pytest.param(
        {"json": {"text": "hi", "not_before": "9999-12-31T23:00:00-05:00"}},
        422,
        id="not-before-after-year-9999-in-utc",
    ),
    pytest.param(
        {"json": {"text": "hi", "not_before": "2999-01-01T00:00:00Z"}},
        422,
        id="not-before-beyond-the-longest-delay",
    ),
]


@pytest.mark.parametrize(("request_args", "status"), BAD_INPUTS)
async def test_bad_input_is_a_problem_and_changes_nothing(
    stack: Stack, request_args: dict[str, object], status: int
) -> None:
    before = await _submission_count(stack)
    response = await stack.api.post("/v1/scores", **request_args)  # type: ignore[arg-type]
    _assert_problem(response, status)
    assert await _submission_count(stack) == before


async def test_a_metadata_key_refused_is_named_once_with_where_it_is(stack: Stack) -> None:
    """The field was named twice ("metadata: metadata: key ..."), found in a walkthrough."""
    top = {"text": "hi", "metadata": {"$x": 1}}
    problem = _assert_problem(await stack.api.post("/v1/scores", json=top), 422)
    assert "metadata: key '$x' may not start with '$'" in str(problem["detail"])
    nested = {"text": "hi", "metadata": {"a": [{"b.c": 1}]}}
    problem = _assert_problem(await stack.api.post("/v1/scores", json=nested), 422)
    assert "metadata: at a[0]: key 'b.c' may not" in str(problem["detail"])
    assert "metadata: metadata" not in str(problem["detail"])
    nul = {"text": "hi", "metadata": {"a\u0000b": 1}}
    problem = _assert_problem(await stack.api.post("/v1/scores", json=nul), 422)
    assert "or a NUL character" in str(problem["detail"])  # it said only '$' and '.'


async def test_a_body_of_many_unknown_fields_names_a_few(stack: Stack) -> None:
    """A megabyte of unknown keys was 100,000 errors, each described in the answer."""
    before = await _submission_count(stack)
    body = {"text": "hi", **{f"k{key}": 0 for key in range(1_000)}}
    problem = _assert_problem(await stack.api.post("/v1/scores", json=body), 422)
    errors = problem["errors"]
    assert isinstance(errors, list)
    assert len(errors) == MAX_ERRORS_SHOWN
    assert errors[0] == {"field": "k0", "message": "Extra inputs are not permitted"}
    assert "more unknown fields, not listed" in str(problem["detail"])
    assert await _submission_count(stack) == before
    few = {"text": " ", "colour": "red"}
    problem = _assert_problem(await stack.api.post("/v1/scores", json=few), 422)
    errors = problem["errors"]
    assert isinstance(errors, list)
    assert {each["field"] for each in errors} == {"text", "colour"}


async def test_an_integer_past_64_bits_in_metadata_is_refused(stack: Stack) -> None:
    body = {"text": "hi", "metadata": {"n": 2**63}}
    problem = _assert_problem(await stack.api.post("/v1/scores", json=body), 422)
    assert "metadata: at n: integers must fit in 64 bits" in str(problem["detail"])
    assert "send a larger one as a string" in str(problem["detail"])


@pytest.mark.parametrize(
    "number", ["1180591620717411303425", "-1180591620717411303424", "1.5e20", "-1e300"]
)
async def test_a_number_the_parser_reads_as_a_float_past_64_bits_is_refused_as_such(
    stack: Stack, number: str
) -> None:
    """Past 64 bits unsigned, the JSON parser reads a float: 2**70 + 1 got past the integer
    check and was kept as 1.1805916207174113e+21, the client's value silently changed. A
    float literal that large, which cannot be told from it, was refused with words for an
    integer ("integers must fit in 64 bits", about 1.5e20; found in a walkthrough)."""
    body = b'{"text": "hi", "metadata": {"n": ' + number.encode() + b"}}"
    response = await stack.api.post(
        "/v1/scores", content=body, headers={"Content-Type": "application/json"}
    )
    detail = str(_assert_problem(response, 422)["detail"])
    assert "metadata: at n: numbers of magnitude 2^63 or more must be sent as strings" in detail
    assert "integers must fit" not in detail


async def test_numbers_within_64_bits_and_fractions_in_metadata_are_kept_as_sent(
    stack: Stack,
) -> None:
    await queued_commands(stack.amqp_url)
    metadata = {"largest": 2**63 - 1, "smallest": -(2**63), "ratio": 0.5, "near": 9.2e18}
    response = await stack.api.post(
        "/v1/scores", json={"text": "Numbers kept.", "metadata": metadata, "use_cache": False}
    )
    assert response.status_code == 202, response.text
    commands = await queued_commands(stack.amqp_url)
    assert [command.metadata for command in commands] == [metadata]


@pytest.mark.parametrize(
    "text", ["\u0001", "\u0000\u0080 \t", "\u0085\u2028\u00a0\u009f", "\u200b \u2060\ufeff"]
)
async def test_a_text_of_only_blanks_and_control_characters_is_a_422_naming_the_field(
    stack: Stack, text: str
) -> None:
    before = await _submission_count(stack)
    problem = _assert_problem(await stack.api.post("/v1/scores", json={"text": text}), 422)
    assert str(problem["type"]).endswith("/invalid-fields")
    errors = problem["errors"]
    assert isinstance(errors, list)
    assert [error["field"] for error in errors] == ["text"]
    message = errors[0]["message"]
    assert "other than whitespace, control characters and invisible characters" in message
    assert str(problem["detail"]).startswith("text: ")
    assert await _submission_count(stack) == before
    assert await queued_commands(stack.amqp_url) == []


async def test_a_text_with_content_among_control_characters_is_accepted_as_sent(
    stack: Stack,
) -> None:
    await queued_commands(stack.amqp_url)
    text = "\u0000\u0001 A text\u0080 to score.\u0007 \t"
    response = await stack.api.post("/v1/scores", json={"text": text, "use_cache": False})
    assert response.status_code == 202, response.text
    commands = await queued_commands(stack.amqp_url)
    assert [c.text for c in commands] == [text]  # the scorer normalises, not the gateway


@pytest.mark.parametrize(
    "text",
    [
        "\U0001f469\u200d\U0001f4bb",  # an emoji bound by a zero-width joiner
        "Zero\u200bwidth\u200cnon\u200djoiners\u00ad in words.",
    ],
)
async def test_a_text_with_format_characters_among_its_content_is_accepted_as_sent(
    stack: Stack, text: str
) -> None:
    await queued_commands(stack.amqp_url)
    response = await stack.api.post("/v1/scores", json={"text": text, "use_cache": False})
    assert response.status_code == 202, response.text
    commands = await queued_commands(stack.amqp_url)
    assert [c.text for c in commands] == [text]


@pytest.mark.parametrize(
    ("headers"),
    [
        {"content-type": "application/json; charset=UTF-8", "content-encoding": "identity"},
        {"content-type": 'application/json;charset="utf-8"'},
        {"content-type": "application/json; charset=utf8"},  # what some clients send
        {"content-type": "application/json; charset=us-ascii"},  # a subset of UTF-8
    ],
)
async def test_utf_8_and_no_coding_said_out_loud_are_accepted(
    stack: Stack, headers: dict[str, str]
) -> None:
    await queued_commands(stack.amqp_url)
    body = b'{"text": "Declared as it is.", "use_cache": false}'
    response = await stack.api.post("/v1/scores", content=body, headers=headers)
    assert response.status_code == 202, response.text
    assert len(await queued_commands(stack.amqp_url)) == 1


async def test_a_415_for_a_content_coding_names_it_and_what_is_accepted(stack: Stack) -> None:
    response = await stack.api.post(
        "/v1/scores", content=gzip.compress(b'{"text": "hi"}'), headers=GZIPPED_JSON
    )
    problem = _assert_problem(response, 415)
    assert "'gzip' is not supported" in str(problem["detail"])
    assert response.headers["accept-encoding"] == "identity"


async def test_bad_idempotency_key_is_400(stack: Stack) -> None:
    response = await stack.api.post(
        "/v1/scores", json={"text": "hi"}, headers={"Idempotency-Key": "has space"}
    )
    _assert_problem(response, 400)


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/scores", {"text": "hi"}), ("/v1/batches", {"items": [{"text": "hi"}]})],
    ids=["score", "batch"],
)
async def test_two_idempotency_keys_are_400_and_keep_nothing(
    stack: Stack, path: str, body: dict[str, object]
) -> None:
    """Sent twice, the first key was taken and the second ignored: a retry carrying only the
    second was a new task, scored again (found in review)."""
    await queued_commands(stack.amqp_url)
    keys = [("Idempotency-Key", uuid.uuid4().hex), ("Idempotency-Key", uuid.uuid4().hex)]
    response = await stack.api.post(path, json=body, headers=keys)
    _assert_problem(response, 400)
    assert await queued_commands(stack.amqp_url) == []


async def test_unknown_task_is_404(stack: Stack) -> None:
    _assert_problem(await stack.api.get(f"/v1/scores/{uuid.uuid4().hex}"), 404)
    _assert_problem(await stack.api.get("/v1/scores/not%20an%20id"), 404)


@pytest.mark.parametrize("route", ["/v1/scores/{}", "/v1/scores/{}/events", "/v1/batches/{}"])
async def test_a_404_names_an_id_as_sent_without_echoing_it_raw(stack: Stack, route: str) -> None:
    """The instance is the path as sent, percent-encoded, and a long id is cut in the detail:
    a NUL and a right-to-left override came back as the characters, and a 5,000-character
    id whole, twice (a walkthrough)."""
    path = route.format("%E2%80%AE%00x")
    body = _assert_problem(await stack.api.get(path), 404)
    assert body["instance"] == path

    long = _assert_problem(await stack.api.get(route.format("a" * 5_000)), 404)
    assert "(5,000 characters)" in str(long["detail"])
    assert len(str(long["detail"])) < 200
    assert "instance" not in long


@pytest.mark.parametrize(
    "query",
    [
        "wiat=30",  # misspelt: was ignored, answered at once instead of long-polled
        "wait=0&wait=30",  # twice: the last was taken
        "status=queued&status=completed",
        "wait=1&cursor=2",
    ],
)
async def test_a_read_refuses_other_or_repeated_query_parameters(stack: Stack, query: str) -> None:
    response = await stack.api.get(f"/v1/scores/{uuid.uuid4().hex}?{query}")
    problem = _assert_problem(response, 422)
    assert str(problem["type"]).endswith("/invalid-fields")
    errors = problem["errors"]
    assert isinstance(errors, list)
    assert str(errors[0]["field"]).startswith("query.")


async def test_accepted_submission_is_queued_and_readable_at_once(stack: Stack) -> None:
    await queued_commands(stack.amqp_url)
    response = await stack.api.post(
        "/v1/scores", json={"text": "A text to score.", "metadata": {"ref": "a1"}}
    )
    assert response.status_code == 202, response.text
    body = response.json()
    assert body["status"] == "queued"
    assert response.headers["location"] == body["status_url"] == f"/v1/scores/{body['task_id']}"

    poll = await stack.api.get(body["status_url"])  # read-your-writes: never 404
    assert poll.status_code == 200
    assert poll.json()["status"] == "queued"

    commands = await queued_commands(stack.amqp_url)
    assert [c.task_id for c in commands] == [body["task_id"]]
    assert commands[0].text == "A text to score."
    assert commands[0].tenant_id == "default"

    async def projected() -> dict[str, object] | None:
        view = (await stack.api.get(body["status_url"])).json()
        return view if view["metadata"] == {"ref": "a1"} else None

    await eventually(projected, what="task.accepted applied by the status projection")


async def test_a_blank_rubric_is_sent_and_read_as_none(stack: Stack) -> None:
    """The scorer applies its default to a blank rubric; the task showed `"   "` for it, and
    its cache key differed from none's (a walkthrough)."""
    await queued_commands(stack.amqp_url)
    body = {"text": "A text with a blank rubric.", "rubric": " \t ", "metadata": {"ref": "b"}}
    response = await stack.api.post("/v1/scores", json=body)
    assert response.status_code == 202, response.text
    status_url = response.json()["status_url"]

    (command,) = await queued_commands(stack.amqp_url)
    assert command.rubric is None

    async def projected() -> dict[str, object] | None:
        view = (await stack.api.get(status_url)).json()
        return view if view["metadata"] == {"ref": "b"} else None

    view = await eventually(projected, what="task.accepted applied by the status projection")
    assert view["rubric"] is None


@pytest.mark.parametrize(
    ("route", "body", "field"),
    [
        ("/v1/scores", {"text": "hi", "model": "../../etc"}, "model"),
        ("/v1/batches", {"model": "judge-z", "items": [{"text": "hi"}]}, "model"),
        ("/v1/batches", {"items": [{"text": "a"}, {"text": "b", "model": "x"}]}, "items[1].model"),
    ],
    ids=["single", "batch", "item"],
)
async def test_a_model_not_offered_is_a_422_naming_it_and_keeps_nothing(
    stack: Stack, route: str, body: dict[str, object], field: str
) -> None:
    """With `LLM_ALLOWED_MODELS` set, any other name was accepted, then failed at the
    provider, or scored by the offline scorer and billed as unpriced (a walkthrough)."""
    await queued_commands(stack.amqp_url)
    before = await _submission_count(stack)

    problem = _assert_problem(await stack.api.post(route, json=body), 422)

    errors = problem["errors"]
    assert isinstance(errors, list)
    assert [error["field"] for error in errors] == [field]
    assert "choose one of judge-a, judge-b, judge-c" in errors[0]["message"]
    assert await _submission_count(stack) == before
    assert await queued_commands(stack.amqp_url) == []


@pytest.mark.parametrize("model", ["judge-a", " judge-c "])
async def test_a_model_offered_is_accepted(stack: Stack, model: str) -> None:
    await queued_commands(stack.amqp_url)
    response = await stack.api.post("/v1/scores", json={"text": "Offered.", "model": model})
    assert response.status_code == 202, response.text
    (command,) = await queued_commands(stack.amqp_url)
    assert command.model == model.strip()


async def test_idempotency_key_returns_the_same_task_or_409(stack: Stack) -> None:
    key = uuid.uuid4().hex
    first = await stack.api.post(
        "/v1/scores", json={"text": "same"}, headers={"Idempotency-Key": key}
    )
    again = await stack.api.post(
        "/v1/scores", json={"text": "same"}, headers={"Idempotency-Key": key}
    )
    other = await stack.api.post(
        "/v1/scores", json={"text": "other"}, headers={"Idempotency-Key": key}
    )
    assert first.status_code == 202
    assert again.status_code == 200
    assert again.json()["task_id"] == first.json()["task_id"]
    _assert_problem(other, 409)


async def test_concurrent_duplicates_create_one_task(stack: Stack) -> None:
    await queued_commands(stack.amqp_url)
    key = uuid.uuid4().hex
    responses = await asyncio.gather(
        *(
            stack.api.post("/v1/scores", json={"text": "race"}, headers={"Idempotency-Key": key})
            for _ in range(8)
        )
    )
    assert {r.status_code for r in responses} <= {200, 202, 409}
    assert [r.status_code for r in responses].count(202) == 1
    ids = {r.json()["task_id"] for r in responses if r.status_code in (200, 202)}
    assert len(ids) == 1
    assert [c.task_id for c in await queued_commands(stack.amqp_url)] == list(ids)


async def test_projection_never_moves_backwards_and_expires(stack: Stack) -> None:
    submitted = await stack.api.post("/v1/scores", json={"text": "projected"})
    task_id = submitted.json()["task_id"]
    now = utcnow()
    common = {"task_id": task_id, "attempt": 1, "submitted_at": now}
    completed = TaskCompleted(
        **common,
        sequence=event_sequence(generation=0, attempt=1, phase=Phase.TERMINAL),
        result=ScoreResult(score=7.5, comment="fine", model="m"),
    )
    started = TaskStarted(
        **common, sequence=event_sequence(generation=0, attempt=1, phase=Phase.STARTED)
    )
    broker = make_broker(GatewaySettings.model_validate({"RABBITMQ_URL": stack.amqp_url}))
    async with broker:
        await broker.connect()
        for event in (completed, started, completed, started):  # out of order, duplicated
            await publish_event(broker, event, timeout=10)

    async def completed_view() -> dict[str, object] | None:
        view = (await stack.api.get(f"/v1/scores/{task_id}")).json()
        return view if view["status"] == "completed" else None

    view = await eventually(completed_view, what="completed")
    assert view["result"]["score"] == 7.5  # type: ignore[index]
    assert view["attempts"] == 1
    # A later started event (the duplicates above) must not have moved it back.
    assert (await stack.api.get(f"/v1/scores/{task_id}")).json()["status"] == "completed"

    stack.clock.offset = timedelta(hours=2)  # past FINISHED_TASK_TTL_S (1 h)
    try:
        response = await stack.api.get(f"/v1/scores/{task_id}")
    finally:
        stack.clock.offset = timedelta()
    # Expired: 404 like an unknown task, never `queued` again from the gateway's own record.
    _assert_problem(response, 404)


async def test_a_repeated_key_whose_task_expired_reads_expired_not_queued(stack: Stack) -> None:
    """The key is kept for a day, a finished task's status for an hour: its repeat answered
    200 `queued`, and its status URL 404."""
    key = uuid.uuid4().hex
    body = {"text": "Expired by the repeat."}
    submitted = await stack.api.post("/v1/scores", json=body, headers={"Idempotency-Key": key})
    task_id = submitted.json()["task_id"]
    now = utcnow()
    completed = TaskCompleted(
        task_id=task_id,
        attempt=1,
        submitted_at=now,
        sequence=event_sequence(generation=0, attempt=1, phase=Phase.TERMINAL),
        result=ScoreResult(score=7.5, comment="fine", model="m"),
    )
    broker = make_broker(GatewaySettings.model_validate({"RABBITMQ_URL": stack.amqp_url}))
    async with broker:
        await broker.connect()
        await publish_event(broker, completed, timeout=10)

    async def finished() -> bool:
        view = (await stack.api.get(f"/v1/scores/{task_id}")).json()
        return bool(view["status"] == "completed")

    await eventually(finished, what="completed")
    stack.clock.offset = timedelta(hours=2)  # past FINISHED_TASK_TTL_S (1 h)
    try:
        again = await stack.api.post("/v1/scores", json=body, headers={"Idempotency-Key": key})
    finally:
        stack.clock.offset = timedelta()
    assert again.status_code == 200, again.text
    assert (again.json()["task_id"], again.json()["status"]) == (task_id, "expired")


class Unreachable(httpx.AsyncBaseTransport):
    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)


REPLAYED: dict[str, dict[str, object]] = {
    "queued": {"text": "kept"},
    "scheduled": {"text": "kept for later", "delay_seconds": 3600},
    "completed": {"text": "kept in the result cache"},
}


@pytest.mark.parametrize("recorded", REPLAYED.keys())
async def test_a_replayed_key_is_answered_from_the_record_while_the_status_service_is_away(
    stack: Stack, amqp_url: str, mongo: object, db_prefix: str, recorded: str
) -> None:
    """It was a 503 "nothing was kept" for a task being scored: a client resubmitting without
    the key had its text scored twice. Then every such replay read `queued`, a task answered
    from the result cache (without its result) and a delayed one too (found in review)."""
    env = {
        "RABBITMQ_URL": amqp_url,
        "MONGO_URL": mongo.url,  # type: ignore[attr-defined]
        "MONGO_DB_PREFIX": db_prefix,
        "BOOTSTRAP_API_KEY": API_KEY,
    }
    settings = GatewaySettings.model_validate(env)
    body = REPLAYED[recorded]
    if recorded == "completed":
        await _cached(stack, settings, str(body["text"]), RESULT_KEPT)
    key = uuid.uuid4().hex
    first = await stack.api.post("/v1/scores", json=body, headers={"Idempotency-Key": key})
    assert first.json()["status"] == recorded, first.text  # as first answered
    away = httpx.AsyncClient(transport=Unreachable(), base_url="http://status.test")
    gateway = create_gateway(settings, status_http=away)
    async with running(gateway) as api:
        api.headers["Authorization"] = f"Bearer {API_KEY}"
        again = await api.post("/v1/scores", json=body, headers={"Idempotency-Key": key})
    assert again.status_code == 200, again.text
    assert again.json()["task_id"] == first.json()["task_id"]
    assert again.json()["status"] == recorded
    if recorded == "completed":
        assert again.json()["result"]["score"] == RESULT_KEPT.score


async def test_a_replayed_key_of_a_cached_answer_reads_the_task_as_it_is_now(
    stack: Stack, amqp_url: str, mongo: object, db_prefix: str
) -> None:
    """Answered from the result cache at first, then re-scored: the replay answered the old
    cached result while polls showed the new one (found in review)."""
    settings = GatewaySettings.model_validate(
        {"MONGO_URL": mongo.url, "MONGO_DB_PREFIX": db_prefix}  # type: ignore[attr-defined]
    )
    body = {"text": "kept in the cache, then scored again"}
    await _cached(stack, settings, body["text"], RESULT_KEPT)
    key = uuid.uuid4().hex
    first = await stack.api.post("/v1/scores", json=body, headers={"Idempotency-Key": key})
    assert first.json()["result"]["score"] == RESULT_KEPT.score, first.text
    task_id = first.json()["task_id"]
    rescored = TaskCompleted(
        task_id=task_id,
        generation=1,
        attempt=1,
        submitted_at=utcnow(),
        sequence=event_sequence(generation=1, attempt=1, phase=Phase.TERMINAL),
        result=ScoreResult(score=9.0, comment="again", model="m"),
    )
    broker = make_broker(GatewaySettings.model_validate({"RABBITMQ_URL": amqp_url}))
    async with broker:
        await broker.connect()
        await publish_event(broker, rescored, timeout=10)

    async def polled_score() -> float | None:
        view = (await stack.api.get(f"/v1/scores/{task_id}")).json()
        score = (view.get("result") or {}).get("score")
        return float(score) if score == 9.0 else None

    await eventually(polled_score, what="the new score in polls")
    again = await stack.api.post("/v1/scores", json=body, headers={"Idempotency-Key": key})
    assert again.status_code == 200, again.text
    assert again.json()["result"]["score"] == 9.0


# As the scorer of the gateway's LLM_PROVIDER (the heuristic, unset) makes it: cached.
RESULT_KEPT = ScoreResult(
    score=6.5, comment="kept", model="m", prompt_version=HEURISTIC_PROMPT_VERSION
)


async def _cached(stack: Stack, settings: GatewaySettings, text: str, result: ScoreResult) -> None:
    """`result` in the gateway's result cache for `text` as the default tenant submits it."""
    model = scoring_model(None, settings.default_model)
    cache = ResultCache(
        stack.mongo,
        settings.database_name("gateway"),
        timedelta(hours=1),
        prompt_versions=settings.cached_prompt_versions,
    )
    key = cache_key(text, None, model)
    await cache.remember(
        tenant_id=DEFAULT_TENANT, key=key, result=result, task_id=new_id(), now=utcnow()
    )
