"""A drop or a purge of a dead-letter queue given a cut-off (`?dead_lettered_before=`, a
listing's `listed_at`) removes only the letters known to have been dead-lettered before it, to
the whole second, on the real broker: a letter dead-lettered after the listing, one of the
cut-off's own second and one of unknown time are kept and counted; without a cut-off nothing
changed; a malformed cut-off is a 422 that removes nothing. The gateway's DLQ and the
scheduler's cron DLQ alike.

Letters carry the times the services' own dead-lettering records (an AMQP timestamp, whole
seconds; RabbitMQ's `x-death` time for the cron DLQ), set explicitly: one second apart from
`FIRST_DEATH` (`test_dead_letter_drop._dead_letter`), or around the scheduler's frozen clock.
The gateway's routes run in-process with a frozen clock too, so `listed_at` is known.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from datetime import datetime, timedelta
from typing import Any

import aio_pika
import httpx
import pytest
from fastapi import FastAPI
from faststream.rabbit import RabbitBroker
from pydantic import SecretStr

from services.gateway.admin_api import admin_routes
from services.gateway.deadletters import DeadLetterQueue
from services.gateway.publisher import TaskPublisher
from services.gateway.submissions import Submissions
from shared.contracts import RunCronJob, ScoreText, new_id, utcnow
from shared.dead_letters import CUT_OFF, dead_lettered_at
from shared.http import install_problem_handlers
from shared.query_parameters import only_known_query_parameters
from shared.topology import DLX, ERROR_HEADER
from tests.integration import test_dead_letter_drop as gateway_dlq
from tests.integration import test_scheduler
from tests.integration import test_scheduler_dead_letters as cron_dlq
from tests.integration.test_dead_letter_drop import (
    ADMIN_KEY,
    DLQ,
    FIRST_DEATH,
    LETTERS,
    TIMEOUT_S,
    _commands,
    _dead_letter,
    _drain,
    _problem,
)
from tests.integration.test_scheduler import QUIET, Env, scheduler
from tests.support import drain, running

broker = gateway_dlq.broker  # fixtures
submissions = gateway_dlq.submissions
dlq = gateway_dlq.dlq
mongo_client = test_scheduler.mongo_client
topology = test_scheduler.topology
env = test_scheduler.env

Json = dict[str, Any]
# Letters 0, 1, 2... are dead-lettered at FIRST_DEATH + that many seconds; the gateway's clock
# reads halfway through the second of letter 1.
LISTED = FIRST_DEATH + timedelta(seconds=1, microseconds=500_000)
LISTED_AT = "2030-01-01T00:00:01.500000Z"
MALFORMED = [
    "yesterday",
    "",
    "2030-01-01",
    "2030-01-01T00:00:01",  # no zone
    "2030-01-01T00:00:01 00:00",  # `+00:00` sent unencoded: the `+` arrives as a space
    "2030-01-01 00:00:01Z",
    "2030-02-30T00:00:00Z",
    "1893456000",  # Unix time
    "x" * 5_000,  # echoed whole in the detail and the field's message (a review)
]


@asynccontextmanager
async def _gateway(
    broker: RabbitBroker, submissions: Submissions, *, now: datetime = LISTED
) -> AsyncIterator[httpx.AsyncClient]:
    """The gateway's admin routes (as `test_dead_letter_drop._admin_app`) on a clock frozen at
    `now`, with a client sending the admin key."""
    dead_letters = DeadLetterQueue(
        broker,
        TaskPublisher(broker, clock=utcnow, timeout_s=TIMEOUT_S),
        submissions,
        lambda: now,
        timeout_s=TIMEOUT_S,
    )
    app = FastAPI(dependencies=[only_known_query_parameters()])  # as the services'
    install_problem_handlers(app)
    app.include_router(admin_routes(dead_letters, SecretStr(ADMIN_KEY)))
    async with running(app) as api:
        api.headers["Authorization"] = f"Bearer {ADMIN_KEY}"
        yield api


async def _undated_letter(amqp_url: str, command: ScoreText) -> None:
    """A letter of unknown time: no timestamp, no `x-death`."""
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        dlx = await channel.get_exchange(DLX.name, ensure=False)
        message = aio_pika.Message(
            command.model_dump_json().encode(),
            message_id=command.message_id,
            headers={ERROR_HEADER: "a test letter"},
        )
        await dlx.publish(message, routing_key=DLQ, timeout=10)


async def _left(amqp_url: str) -> set[str | None]:
    """The message ids of the letters left in the DLQ (taken off it)."""
    return {message.message_id for message in await _drain(amqp_url)}


def _ids(commands: list[ScoreText]) -> set[str | None]:
    return {command.message_id for command in commands}


def _assert_invalid_cut_off(answer: httpx.Response, field: str = CUT_OFF) -> None:
    problem = _problem(answer, 422)
    assert problem["type"].endswith("/invalid-fields")
    assert [error["field"] for error in problem["errors"]] == [f"query.{field}"]
    assert "nothing was removed" in problem["detail"]
    assert len(problem["detail"]) < 500, "the value is cut, not echoed whole"


async def test_a_drop_with_the_listings_cut_off_keeps_a_letter_dead_lettered_after_it(
    dlq: str, broker: RabbitBroker, submissions: Submissions
) -> None:
    """A task dead-lettered at 0 s, the listing at 1.5 s, the task's next generation
    dead-lettered at 2 s: a drop of the task given the listing's time removes the first."""
    task_id = new_id()
    earlier, later = _commands(2, task_id=task_id)
    other = _commands(1)[0]
    await _dead_letter(dlq, [earlier, other, later])

    async with _gateway(broker, submissions) as api:
        listing = (await api.get(LETTERS)).json()
        assert listing["listed_at"] == LISTED_AT
        answer = await api.delete(f"{LETTERS}/{task_id}", params={CUT_OFF: listing["listed_at"]})
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"letter_id": task_id, "removed": 1, "truncated": False, "kept": 1}
    assert await _left(dlq) == _ids([other, later])


async def test_a_purge_with_a_cut_off_keeps_later_same_second_and_undated_letters(
    dlq: str, broker: RabbitBroker, submissions: Submissions
) -> None:
    """Letters at 0, 1, 2 and 3 s and one of unknown time; the cut-off at 2.5 s: the letters
    of 0 and 1 s are purged, that of 2 s (the cut-off's second), 3 s and the undated one kept."""
    commands = _commands(4)
    undated = _commands(1)[0]
    await _dead_letter(dlq, commands)
    await _undated_letter(dlq, undated)

    listed = FIRST_DEATH + timedelta(seconds=2, microseconds=500_000)
    async with _gateway(broker, submissions, now=listed) as api:
        listing = (await api.get(LETTERS)).json()
        assert listing["listed_at"] == "2030-01-01T00:00:02.500000Z"
        answer = await api.delete(LETTERS, params={CUT_OFF: listing["listed_at"]})
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"purged": 2, "kept": 3, "truncated": False}
    assert await _left(dlq) == _ids([*commands[2:], undated])


@pytest.mark.parametrize(
    "cut_off",
    [
        "2030-01-01T00:00:01Z",
        "2030-01-01T00:00:01.000001Z",
        "2030-01-01T00:00:01.999999Z",
        "2030-01-01t00:00:01.5z",
        "2030-01-01T00:00:01.5+00:00",
        "2030-01-01T01:00:01.5+01:00",
        "2029-12-31T23:00:01.5-01:00",
    ],
)
async def test_a_letter_of_the_cut_offs_own_second_is_kept(
    dlq: str, broker: RabbitBroker, submissions: Submissions, cut_off: str
) -> None:
    """Recorded to the whole second, the letter of second 1 may have been dead-lettered after
    any cut-off within that second: kept, whatever the cut-off's fraction or zone."""
    task_id = new_id()
    earlier, same_second = _commands(2, task_id=task_id)
    await _dead_letter(dlq, [earlier, same_second])

    async with _gateway(broker, submissions) as api:
        dropped = await api.delete(f"{LETTERS}/{task_id}", params={CUT_OFF: cut_off})
    assert dropped.status_code == 200, dropped.text
    assert (dropped.json()["removed"], dropped.json()["kept"]) == (1, 1)
    assert await _left(dlq) == _ids([same_second])


async def test_a_drop_whose_letters_are_all_at_or_after_the_cut_off_removes_nothing(
    dlq: str, broker: RabbitBroker, submissions: Submissions
) -> None:
    """The letter exists, so not a 404: a 200 that removed none and kept both."""
    task_id = new_id()
    commands = _commands(2, task_id=task_id)
    await _dead_letter(dlq, commands)

    async with _gateway(broker, submissions) as api:
        answer = await api.delete(
            f"{LETTERS}/{task_id}", params={CUT_OFF: "2030-01-01T00:00:00.999Z"}
        )
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"letter_id": task_id, "removed": 0, "truncated": False, "kept": 2}
    assert await _left(dlq) == _ids(commands)


async def test_without_a_cut_off_a_drop_and_a_purge_remove_every_letter_as_before(
    dlq: str, broker: RabbitBroker, submissions: Submissions
) -> None:
    task_id = new_id()
    earlier, later = _commands(2, task_id=task_id)
    others = _commands(2)
    await _dead_letter(dlq, [earlier, others[0], later, others[1]])

    async with _gateway(broker, submissions) as api:
        dropped = await api.delete(f"{LETTERS}/{task_id}")
        assert dropped.status_code == 200, dropped.text
        assert dropped.json() == {"letter_id": task_id, "removed": 2, "truncated": False}
        purged = await api.delete(LETTERS)
    assert purged.status_code == 200, purged.text
    assert purged.json() == {"purged": 2}
    assert await _drain(dlq) == []


@pytest.mark.parametrize("value", MALFORMED)
async def test_a_malformed_cut_off_is_a_422_and_removes_nothing(
    dlq: str, broker: RabbitBroker, submissions: Submissions, value: str
) -> None:
    task_id = new_id()
    commands = _commands(2, task_id=task_id)
    await _dead_letter(dlq, commands)

    async with _gateway(broker, submissions) as api:
        _assert_invalid_cut_off(await api.delete(f"{LETTERS}/{task_id}", params={CUT_OFF: value}))
        _assert_invalid_cut_off(await api.delete(LETTERS, params={CUT_OFF: value}))
    assert await _left(dlq) == _ids(commands)


@pytest.mark.parametrize(
    "query",
    [
        {"dead_letterd_before": LISTED_AT},  # misspelt: ignored, it would purge every letter
        [(CUT_OFF, LISTED_AT), (CUT_OFF, "2030-01-01T00:00:09Z")],
    ],
    ids=["misspelt", "twice"],
)
async def test_a_purge_with_another_or_a_repeated_parameter_is_a_422_and_removes_nothing(
    dlq: str, broker: RabbitBroker, submissions: Submissions, query: Any
) -> None:
    commands = _commands(3)
    await _dead_letter(dlq, commands)

    field = "dead_letterd_before" if isinstance(query, dict) else CUT_OFF
    async with _gateway(broker, submissions) as api:
        _assert_invalid_cut_off(await api.delete(LETTERS, params=query), field)
        _assert_invalid_cut_off(
            await api.delete(f"{LETTERS}/{commands[0].task_id}", params=query), field
        )
    assert await _left(dlq) == _ids(commands)


# The cron DLQ: the scheduler in-process (`test_scheduler.scheduler`), its clock frozen at QUIET.
CRON_LETTERS = cron_dlq.LETTERS
CRON_DLQ = cron_dlq.DLQ
SECOND = timedelta(seconds=1)


async def _cron_run_at(env: Env, at: datetime, run: RunCronJob | None = None) -> RunCronJob:
    """A run dead-lettered by RabbitMQ at `at` (a new one unless given)."""
    run = run or cron_dlq._dead_run()
    await cron_dlq._dead_lettered_by_rabbitmq(env, run, at=at)
    return run


async def _cron_run_ids_and_times(env: Env) -> list[tuple[str | None, datetime | None]]:
    """The (run id, time dead-lettered) of each letter taken off the cron DLQ, oldest first."""
    letters = await drain(env.amqp_url, CRON_DLQ)
    left = [
        (RunCronJob.model_validate_json(letter.body).run_id, dead_lettered_at(letter, QUIET))
        for letter in letters
    ]
    return sorted(left, key=lambda pair: pair[1] or QUIET)


def _cron_scheduler(env: Env) -> AbstractAsyncContextManager[tuple[httpx.AsyncClient, Any]]:
    return scheduler(env, cron_dlq.CONFIG, handlers={cron_dlq.JOB: cron_dlq.Probe()})


async def test_a_cron_drop_with_the_listings_cut_off_keeps_a_letter_dead_lettered_after_it(
    env: Env,
) -> None:
    await drain(env.amqp_url, CRON_DLQ)
    run = await _cron_run_at(env, QUIET - SECOND)
    other = await _cron_run_at(env, QUIET - 2 * SECOND)
    async with _cron_scheduler(env) as (api, _):
        listing = await cron_dlq._listed(api)
        assert listing["listed_at"] == "2030-01-01T10:31:30.000000Z"
        await _cron_run_at(env, QUIET + SECOND, run)  # dead-lettered again after the listing
        answer = await api.delete(
            f"{CRON_LETTERS}/{run.run_id}", params={CUT_OFF: listing["listed_at"]}
        )
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"run_id": run.run_id, "removed": 1, "truncated": False, "kept": 1}
    left = await _cron_run_ids_and_times(env)
    assert left == [(other.run_id, QUIET - 2 * SECOND), (run.run_id, QUIET + SECOND)]


async def test_a_cron_purge_with_a_cut_off_keeps_later_and_same_second_letters(
    env: Env,
) -> None:
    await drain(env.amqp_url, CRON_DLQ)
    before = await _cron_run_at(env, QUIET - SECOND)
    same_second = await _cron_run_at(env, QUIET)
    after = await _cron_run_at(env, QUIET + SECOND)
    env.clock.now = QUIET + SECOND / 2  # the listing halfway through the second of `same_second`
    async with _cron_scheduler(env) as (api, _):
        listing = await cron_dlq._listed(api)
        assert listing["listed_at"] == "2030-01-01T10:31:30.500000Z"
        assert {item["run_id"] for item in listing["items"]} == {
            before.run_id,
            same_second.run_id,
            after.run_id,
        }
        answer = await api.delete(CRON_LETTERS, params={CUT_OFF: listing["listed_at"]})
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"purged": 1, "kept": 2, "truncated": False}
    assert await _cron_run_ids_and_times(env) == [
        (same_second.run_id, QUIET),
        (after.run_id, QUIET + SECOND),
    ]


async def test_a_malformed_cron_cut_off_is_a_422_and_removes_nothing(env: Env) -> None:
    await drain(env.amqp_url, CRON_DLQ)
    run = await _cron_run_at(env, QUIET - SECOND)
    async with _cron_scheduler(env) as (api, _):
        for value in MALFORMED:
            _assert_invalid_cut_off(
                await api.delete(f"{CRON_LETTERS}/{run.run_id}", params={CUT_OFF: value})
            )
            _assert_invalid_cut_off(await api.delete(CRON_LETTERS, params={CUT_OFF: value}))
        assert cron_dlq._run_ids(await cron_dlq._listed(api)) == [run.run_id]
    assert await _cron_run_ids_and_times(env) == [(run.run_id, QUIET - SECOND)]


async def test_a_long_letter_or_run_id_is_cut_in_the_404(
    env: Env, broker: RabbitBroker, submissions: Submissions
) -> None:
    """A 5,000-character id came back whole in the detail (a review)."""
    async with _gateway(broker, submissions) as api:
        answers = [
            await api.get(f"{LETTERS}/{'m' * 5_000}"),
            await api.delete(f"{LETTERS}/{'m' * 5_000}"),
        ]
    async with _cron_scheduler(env) as (cron_api, _):
        answers.append(await cron_api.delete(f"{CRON_LETTERS}/{'r' * 5_000}"))
    for answer in answers:
        problem = _problem(answer, 404)
        assert "(5,000 characters)" in problem["detail"]
        assert len(problem["detail"]) < 500
