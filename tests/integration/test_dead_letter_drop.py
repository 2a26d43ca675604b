"""The gateway's dead-letter admin routes on the real broker: one letter (every copy of it)
leaves the DLQ by `DELETE /admin/v1/dead-letters/{id}` while the others stay as they were,
and a walk cut short by its byte budget (`walk_bytes`, as in
`test_dead_letter_walk_budget.py`) is reported as such by a drop and by a replay: an id it did
not reach is never "not found".

The routes run in-process over a `DeadLetterQueue` of the test's walk budget (the gateway as
it is served, for a drop of an empty id that must not reach the purge); letters are
published straight into the DLQ, each dead-lettered a second after the one before."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import aio_pika
import httpx
import pytest
from aio_pika.abc import AbstractIncomingMessage
from fastapi import FastAPI
from faststream.rabbit import RabbitBroker
from pydantic import SecretStr
from pymongo import AsyncMongoClient

from devtools.infra import Endpoint
from services.gateway.admin_api import admin_routes
from services.gateway.app import create_app as create_gateway
from services.gateway.deadletters import DeadLetterQueue
from services.gateway.publisher import TaskPublisher
from services.gateway.settings import GatewaySettings
from services.gateway.submissions import Submissions
from shared.contracts import ScoreText, new_id, utcnow
from shared.dead_letters import MAX_WALK_BYTES, REPLAY_BUDGET_S
from shared.http import PROBLEM_JSON, install_problem_handlers
from shared.query_parameters import only_known_query_parameters
from shared.topology import DLX, ERROR_HEADER, SCORE_REQUESTS, declare_topology
from tests.support import drain, running

DLQ = SCORE_REQUESTS.dead_letter_routing_key
LETTERS = "/admin/v1/dead-letters"
ADMIN_KEY = "test-admin-key"
TIMEOUT_S = 5.0
FIRST_DEATH = datetime(2030, 1, 1, tzinfo=UTC)

Json = dict[str, Any]


@pytest.fixture(scope="module")
async def broker(amqp_url: str) -> AsyncIterator[RabbitBroker]:
    broker = RabbitBroker(amqp_url)
    await broker.connect()
    await declare_topology(broker)
    yield broker
    await broker.stop()


@pytest.fixture(scope="module")
async def submissions(mongo: Endpoint, db_prefix: str) -> AsyncIterator[Submissions]:
    client: AsyncMongoClient[Json] = AsyncMongoClient(mongo.url, tz_aware=True)
    yield Submissions(client, f"{db_prefix}_gateway")
    await client.close()


@pytest.fixture
async def dlq(amqp_url: str, broker: RabbitBroker) -> str:
    """The score requests' DLQ, emptied for the test; the vhost's URL."""
    await _drain(amqp_url)
    return amqp_url


async def _drain(amqp_url: str) -> list[AbstractIncomingMessage]:
    """Every letter of the DLQ, taken off it in the queue's order."""
    return await drain(amqp_url, DLQ)


def _commands(count: int, *, task_id: str | None = None) -> list[ScoreText]:
    """`count` score requests of one size (of one task when `task_id` is given)."""
    return [
        ScoreText(task_id=task_id or new_id(), text="A letter " + "x" * 500) for _ in range(count)
    ]


async def _dead_letter(amqp_url: str, commands: list[ScoreText]) -> None:
    """Publish `commands` into the DLQ as the scorer dead-letters them, in order, each a
    second after the one before (a command given twice is two copies of one letter)."""
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        dlx = await channel.get_exchange(DLX.name, ensure=False)
        for n, command in enumerate(commands):
            message = aio_pika.Message(
                command.model_dump_json().encode(),
                message_id=command.message_id,
                timestamp=FIRST_DEATH + timedelta(seconds=n),
                headers={ERROR_HEADER: "a test letter"},
            )
            await dlx.publish(message, routing_key=DLQ, timeout=10)


def _body_bytes() -> int:
    return len(_commands(1)[0].model_dump_json().encode())


def _admin_app(
    broker: RabbitBroker,
    submissions: Submissions,
    *,
    walk_bytes: int = MAX_WALK_BYTES,
    replay_budget_s: float = REPLAY_BUDGET_S,
    publisher: TaskPublisher | None = None,
) -> FastAPI:
    dead_letters = DeadLetterQueue(
        broker,
        publisher or TaskPublisher(broker, clock=utcnow, timeout_s=TIMEOUT_S),
        submissions,
        utcnow,
        timeout_s=TIMEOUT_S,
        walk_bytes=walk_bytes,
        replay_budget_s=replay_budget_s,
    )
    app = FastAPI(dependencies=[only_known_query_parameters()])  # as the services'
    install_problem_handlers(app)
    app.include_router(admin_routes(dead_letters, SecretStr(ADMIN_KEY)))
    return app


async def _listed(api: httpx.AsyncClient) -> Json:
    answer = await api.get(LETTERS)
    assert answer.status_code == 200, answer.text
    listing: Json = answer.json()
    return listing


def _problem(answer: httpx.Response, status: int) -> Json:
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"].startswith(PROBLEM_JSON)
    body: Json = answer.json()
    return body


@asynccontextmanager
async def _admin(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """A client of `app` sending the admin key."""
    async with running(app) as api:
        api.headers["Authorization"] = f"Bearer {ADMIN_KEY}"
        yield api


async def test_dropping_a_letter_leaves_the_others_as_they_were_in_order(
    dlq: str, broker: RabbitBroker, submissions: Submissions
) -> None:
    commands = _commands(4)
    await _dead_letter(dlq, commands)
    kept = [commands[0], commands[2], commands[3]]

    async with _admin(_admin_app(broker, submissions)) as api:
        answer = await api.delete(f"{LETTERS}/{commands[1].task_id}")
        assert answer.status_code == 200, answer.text
        assert answer.json() == {
            "letter_id": commands[1].task_id,
            "removed": 1,
            "truncated": False,
        }
        listing = await _listed(api)
    assert [item["task_id"] for item in listing["items"]] == [c.task_id for c in kept]

    left = await _drain(dlq)
    assert [message.message_id for message in left] == [c.message_id for c in kept]
    assert [message.body for message in left] == [c.model_dump_json().encode() for c in kept]
    assert all(message.headers[ERROR_HEADER] == "a test letter" for message in left)


async def test_dropping_a_letter_held_twice_removes_both_copies(
    dlq: str, broker: RabbitBroker, submissions: Submissions
) -> None:
    twice, other = _commands(2)
    await _dead_letter(dlq, [twice, other, twice])

    async with _admin(_admin_app(broker, submissions)) as api:
        answer = await api.delete(f"{LETTERS}/{twice.message_id}")
        assert answer.status_code == 200, answer.text
        assert (answer.json()["removed"], answer.json()["truncated"]) == (2, False)
        listing = await _listed(api)
    assert [item["task_id"] for item in listing["items"]] == [other.task_id]
    assert [message.message_id for message in await _drain(dlq)] == [other.message_id]


async def test_dropping_an_unknown_id_is_a_404_and_changes_nothing(
    dlq: str, broker: RabbitBroker, submissions: Submissions
) -> None:
    commands = _commands(3)
    await _dead_letter(dlq, commands)

    async with _admin(_admin_app(broker, submissions)) as api:
        problem = _problem(await api.delete(f"{LETTERS}/{new_id()}"), 404)
        assert problem["type"].endswith("/not-found")
        assert "nothing was removed" in problem["detail"]
        # What a walk cannot see: a letter another walk holds at that moment.
        assert "another gateway replica" in problem["detail"]
        assert "dead-letter depth probe" in problem["detail"]
        listing = await _listed(api)
    assert [item["task_id"] for item in listing["items"]] == [c.task_id for c in commands]
    assert [message.message_id for message in await _drain(dlq)] == [c.message_id for c in commands]


async def test_an_id_past_a_walk_cut_short_is_a_409_not_reached_and_changes_nothing(
    dlq: str, broker: RabbitBroker, submissions: Submissions
) -> None:
    await _dead_letter(dlq, _commands(5))
    bounded = _admin_app(broker, submissions, walk_bytes=int(2.5 * _body_bytes()))

    async with _admin(bounded) as api:
        problem = _problem(await api.delete(f"{LETTERS}/{new_id()}"), 409)
    assert problem["type"].endswith("/not-reached")
    assert problem["walked"] == 3
    assert "may lie past" in problem["detail"]
    assert len(await _drain(dlq)) == 5


async def test_a_drop_cut_short_says_copies_past_its_walk_may_be_left(
    dlq: str, broker: RabbitBroker, submissions: Submissions
) -> None:
    """Five letters of one task: the walk reaches three of them."""
    task_id = new_id()
    await _dead_letter(dlq, _commands(5, task_id=task_id))
    bounded = _admin_app(broker, submissions, walk_bytes=int(2.5 * _body_bytes()))

    async with _admin(bounded) as api:
        answer = await api.delete(f"{LETTERS}/{task_id}")
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"letter_id": task_id, "removed": 3, "truncated": True}
    assert len(await _drain(dlq)) == 2


async def test_a_replay_by_ids_cut_short_reports_the_ids_it_did_not_reach(
    dlq: str, broker: RabbitBroker, submissions: Submissions
) -> None:
    """Its walk reaches three of five letters: the two others and an id no letter carries
    are not reached, none of them "not found" (it was: an operator was told a letter past
    the walk did not exist)."""
    commands = _commands(5)
    await _dead_letter(dlq, commands)
    asked = [command.task_id for command in commands]
    unknown = new_id()
    bounded = _admin_app(broker, submissions, walk_bytes=int(2.5 * _body_bytes()))

    async with _admin(bounded) as api:
        answer = await api.post(f"{LETTERS}/replay", json={"ids": [*asked, unknown]})
    assert answer.status_code == 200, answer.text
    report = answer.json()
    assert (report["truncated"], report["not_found"]) == (True, [])
    assert len(report["replayed"]) == 3
    assert sorted(report["not_reached"]) == sorted(
        [key for key in asked if key not in report["replayed"]] + [unknown]
    )
    assert len(await _drain(dlq)) == 2

    async with _admin(_admin_app(broker, submissions)) as api:
        whole = (await api.post(f"{LETTERS}/replay", json={"ids": [unknown]})).json()
    assert (whole["truncated"], whole["not_found"], whole["not_reached"]) == (
        False,
        [unknown],
        [],
    )


async def test_a_replay_of_all_cut_short_says_so(
    dlq: str, broker: RabbitBroker, submissions: Submissions
) -> None:
    await _dead_letter(dlq, _commands(5))
    bounded = _admin_app(broker, submissions, walk_bytes=int(2.5 * _body_bytes()))

    async with _admin(bounded) as api:
        first = (await api.post(f"{LETTERS}/replay", json={"all": True})).json()
        rest = (await api.post(f"{LETTERS}/replay", json={"all": True})).json()
    assert (len(first["replayed"]), first["truncated"]) == (3, True)
    assert (len(rest["replayed"]), rest["truncated"]) == (2, False)
    assert first["not_found"] == first["not_reached"] == rest["not_reached"] == []
    assert await _drain(dlq) == []


async def test_a_replay_out_of_time_answers_with_the_rest_left_and_says_so(
    dlq: str, broker: RabbitBroker, submissions: Submissions
) -> None:
    """A replay went on letter after letter in one request (a few milliseconds each: about a
    minute for 10,000), past a client's timeout (the CLI's 30 s), which then reported a
    failure of what went on to be done. It answers once its budget is spent (none here: its
    walk takes one letter, the least, and it replays it), the rest left: `timed_out`, not
    `truncated` (which says the walk met its size bound, and was said of a time cut too),
    and the other ids `not_reached`, the unknown one among them (the walk did not reach the
    queue's end)."""
    commands = _commands(5)
    await _dead_letter(dlq, commands)
    asked = [command.task_id for command in commands]
    unknown = new_id()
    hurried = _admin_app(broker, submissions, replay_budget_s=0)

    async with _admin(hurried) as api:
        by_ids = (await api.post(f"{LETTERS}/replay", json={"ids": [*asked, unknown]})).json()
        every = (await api.post(f"{LETTERS}/replay", json={"all": True})).json()
    assert len(by_ids["replayed"]) == 1
    assert (by_ids["timed_out"], by_ids["truncated"], by_ids["not_found"]) == (True, False, [])
    assert sorted(by_ids["not_reached"]) == sorted(
        [*(set(asked) - set(by_ids["replayed"])), unknown]
    )
    assert (len(every["replayed"]), every["timed_out"], every["truncated"]) == (1, True, False)
    assert len(await _drain(dlq)) == 3


@pytest.mark.parametrize("path", [f"{LETTERS}/", f"{LETTERS}//"], ids=["slash", "slashes"])
async def test_a_drop_with_an_empty_id_never_reaches_the_purge(
    dlq: str, mongo: Endpoint, db_prefix: str, path: str
) -> None:
    """`DELETE /admin/v1/dead-letters/` (a script's drop of an empty id) was redirected
    (307) to `DELETE /admin/v1/dead-letters`, the purge, and a client following redirects
    keeps the method and the key: the whole DLQ was purged. The gateway as it is served
    answers it itself now, and nothing is removed."""
    commands = _commands(2)
    await _dead_letter(dlq, commands)
    settings = GatewaySettings.model_validate(
        {
            "RABBITMQ_URL": dlq,
            "MONGO_URL": mongo.url,
            "MONGO_DB_PREFIX": db_prefix,
            "ADMIN_API_KEY": ADMIN_KEY,
        }
    )

    # Asserted once the gateway has stopped: its lifespan does not stop it on an error.
    async with _admin(create_gateway(settings)) as api:
        answer = await api.delete(path, follow_redirects=True)
        listed = await api.get(LETTERS)
    assert answer.status_code in (404, 405), answer.text
    assert answer.history == []
    assert [item["task_id"] for item in listed.json()["items"]] == [c.task_id for c in commands]
    assert [message.message_id for message in await _drain(dlq)] == [c.message_id for c in commands]


async def test_a_letter_is_shown_whole_but_its_callback_urls_query(
    dlq: str, broker: RabbitBroker, submissions: Submissions
) -> None:
    """The admin routes show a callback URL without its query, which often carries the
    tenant's token (as the notifier's webhook letters are shown); replayed, the letter is
    sent as it was."""
    command = ScoreText(
        task_id=new_id(), text="A letter.", callback_url="https://hooks.example/in?token=secret"
    )
    await _dead_letter(dlq, [command])

    async with _admin(_admin_app(broker, submissions)) as api:
        shown = await api.get(f"{LETTERS}/{command.task_id}")

    assert shown.status_code == 200, shown.text
    assert shown.json()["body"]["callback_url"] == "https://hooks.example/in"
    assert shown.json()["body"]["text"] == "A letter."
    assert "secret" not in shown.text
    [left] = await _drain(dlq)
    assert left.body == command.model_dump_json().encode()


async def test_a_get_of_the_replay_route_is_a_405_not_a_letter_looked_for(
    dlq: str, broker: RabbitBroker, submissions: Submissions
) -> None:
    """`GET .../dead-letters/replay` fits the show route's id too; it is the replay's path,
    which takes POST alone, and says so rather than walking the queue for a letter named
    `replay` to answer 404."""
    async with _admin(_admin_app(broker, submissions)) as api:
        answer = await api.get(f"{LETTERS}/replay")

    problem = _problem(answer, 405)
    assert answer.headers["allow"] == "POST"
    assert "it takes POST" in problem["detail"]
