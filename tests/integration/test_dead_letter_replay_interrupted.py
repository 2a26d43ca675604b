"""A DLQ replay that the broker fails part-way, and one whose budget leaves a letter of a task
it handled another letter of, on the real broker and database.

A replay failing after it had sent letters answered 503 ("try again shortly; nothing was
kept" is what a 503 means here): the letters it had replayed had left the DLQ, and the retry
the 503 asked for reported them `not_found`. It now answers 200 with what it did and why it
stopped (`interrupted`), the letters it did not reach left and named `not_reached`; failing
before it did anything, it is still a 503 that changed nothing. And a letter the budget left
was reported as handled when another letter of its task was, though that one was of another
generation (a re-score's letter beside the one it superseded): the report said nothing was
left while the later generation's letter stayed in the DLQ.

The admin routes run in-process over the real broker (`test_dead_letter_drop.py`'s app, its
publisher wrapped)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from aio_pika.abc import AbstractIncomingMessage
from fastapi import FastAPI
from faststream.rabbit import RabbitBroker
from pymongo.errors import OperationFailure

from services.gateway.deadletters import DeadLetterQueue
from services.gateway.errors import BrokerUnavailable, DatabaseUnavailable
from services.gateway.publisher import TaskPublisher
from services.gateway.submissions import Submissions
from shared.contracts import ScoreText, utcnow
from shared.dead_letters import DeadLetterWalker
from tests.integration import test_dead_letter_drop as gateway_dlq
from tests.integration.test_dead_letter_drop import (
    LETTERS,
    TIMEOUT_S,
    _admin,
    _admin_app,
    _commands,
    _dead_letter,
    _drain,
)
from tests.integration.test_dead_letter_superseded import _rescored, _sent_to_the_scorer
from tests.support import accepted_submission, queued_commands

pytestmark = pytest.mark.integration

broker = gateway_dlq.broker  # fixtures
submissions = gateway_dlq.submissions
dlq = gateway_dlq.dlq

BUDGET_S = 1.0


class FailsAfter(TaskPublisher):
    """`succeeding` resubmits confirmed, then every one failing as `failure` makes it."""

    def __init__(
        self, broker: RabbitBroker, *, succeeding: int, failure: Callable[[], Exception]
    ) -> None:
        super().__init__(broker, clock=utcnow, timeout_s=TIMEOUT_S)
        self.left = succeeding
        self.failure = failure

    async def resubmit(self, command: ScoreText) -> None:
        if self.left == 0:
            raise self.failure()
        self.left -= 1
        await super().resubmit(command)


def broker_fails_after(broker: RabbitBroker, succeeding: int) -> FailsAfter:
    """The broker confirming `succeeding` resubmits, then refusing every one."""
    return FailsAfter(
        broker,
        succeeding=succeeding,
        failure=lambda: BrokerUnavailable("the broker did not confirm the publish"),
    )


def refused_after(broker: RabbitBroker, succeeding: int) -> FailsAfter:
    """The database refusing for good (a missing privilege) after `succeeding` resubmits."""

    def refusal() -> Exception:
        error = DatabaseUnavailable("replay_generation refused")
        error.__cause__ = OperationFailure("not authorized on gateway", code=13)
        return error

    return FailsAfter(broker, succeeding=succeeding, failure=refusal)


class SlowBroker(TaskPublisher):
    """Each resubmit confirmed, then held past the replay's budget (`BUDGET_S`)."""

    async def resubmit(self, command: ScoreText) -> None:
        await super().resubmit(command)
        await asyncio.sleep(BUDGET_S)  # a slow confirm, not a synchronisation


def _app(broker: RabbitBroker, submissions: Submissions, publisher: TaskPublisher) -> FastAPI:
    return _admin_app(broker, submissions, replay_budget_s=BUDGET_S, publisher=publisher)


async def _dead_lettered(dlq: str, count: int) -> list[str]:
    """`count` letters in the DLQ, oldest first: their task ids."""
    commands = _commands(count)
    await _dead_letter(dlq, commands)
    return [command.task_id for command in commands]


async def test_a_replay_the_broker_fails_part_way_reports_what_it_did_and_what_it_left(
    dlq: str, broker: RabbitBroker, submissions: Submissions
) -> None:
    ids = await _dead_lettered(dlq, 3)

    async with _admin(_app(broker, submissions, broker_fails_after(broker, 1))) as api:
        answer = await api.post(f"{LETTERS}/replay", json={"ids": ids})
    assert answer.status_code == 200, answer.text
    report = answer.json()
    assert report["replayed"] == ids[:1]
    assert sorted(report["not_reached"]) == sorted(ids[1:])
    assert report["not_found"] == []
    assert report["interrupted"] == "The message broker is unavailable; try again shortly."
    assert report["timed_out"] is False
    assert [command.task_id for command in await queued_commands(dlq)] == ids[:1]

    # Asked again, the letters left are replayed; the one replayed before is not found.
    async with _admin(
        _app(broker, submissions, TaskPublisher(broker, clock=utcnow, timeout_s=TIMEOUT_S))
    ) as api:
        again = (await api.post(f"{LETTERS}/replay", json={"ids": ids})).json()
    assert sorted(again["replayed"]) == sorted(ids[1:])
    assert (again["not_found"], again["interrupted"]) == (ids[:1], None)
    assert await _drain(dlq) == []
    await queued_commands(dlq)


async def test_a_replay_the_broker_fails_at_once_is_a_503_that_keeps_every_letter(
    dlq: str, broker: RabbitBroker, submissions: Submissions
) -> None:
    ids = await _dead_lettered(dlq, 2)

    async with _admin(_app(broker, submissions, broker_fails_after(broker, 0))) as api:
        answer = await api.post(f"{LETTERS}/replay", json={"all": True})
    assert answer.status_code == 503, answer.text
    assert "The message broker is unavailable" in answer.json()["detail"]
    left = [ScoreText.model_validate_json(letter.body) for letter in await _drain(dlq)]
    assert sorted(command.task_id for command in left) == sorted(ids)


async def test_a_letter_left_by_the_budget_is_reported_though_its_task_had_another_replayed(
    dlq: str, broker: RabbitBroker, submissions: Submissions
) -> None:
    """The re-score's letter (generation 1) is met first and replayed, the budget spent on
    it; the letter it superseded (generation 0) is left: its task is `not_reached`, not
    taken for done because the task's other letter was."""
    command = await accepted_submission(submissions)
    await _rescored(broker, submissions, command)
    [rescore] = await _sent_to_the_scorer(dlq, command.task_id)
    await _dead_letter(dlq, [rescore, command])

    async with _admin(
        _app(broker, submissions, SlowBroker(broker, clock=utcnow, timeout_s=TIMEOUT_S))
    ) as api:
        answer = await api.post(f"{LETTERS}/replay", json={"ids": [command.task_id]})
    assert answer.status_code == 200, answer.text
    report = answer.json()
    assert (report["replayed"], report["superseded"]) == ([command.task_id], [])
    assert (report["not_reached"], report["timed_out"]) == ([command.task_id], True)
    [left] = await _drain(dlq)
    assert ScoreText.model_validate_json(left.body).generation == 0
    await queued_commands(dlq)


async def test_a_refusal_for_good_part_way_says_asking_again_meets_it_too(
    dlq: str, broker: RabbitBroker, submissions: Submissions
) -> None:
    """It said the database was unavailable, to try again shortly, and logged nothing."""
    ids = await _dead_lettered(dlq, 2)

    async with _admin(_app(broker, submissions, refused_after(broker, 1))) as api:
        report = (await api.post(f"{LETTERS}/replay", json={"ids": ids})).json()

    assert report["replayed"] == ids[:1]
    assert report["not_reached"] == ids[1:]
    assert "refused an operation for good" in report["interrupted"]
    assert "try again shortly" not in report["interrupted"]
    assert len(await _drain(dlq)) == 1
    await queued_commands(dlq)


async def test_a_letter_sent_whose_ack_failed_is_reported_replayed(
    dlq: str, broker: RabbitBroker, submissions: Submissions
) -> None:
    """Its command was confirmed, then the walk's channel closed at its ack: it was
    reported `not_reached`, "not replayed yet", though the scorer had it."""
    ids = await _dead_lettered(dlq, 3)
    dead_letters = DeadLetterQueue(
        broker,
        TaskPublisher(broker, clock=utcnow, timeout_s=TIMEOUT_S),
        submissions,
        utcnow,
        timeout_s=TIMEOUT_S,
    )
    walker = dead_letters._dlq
    removes = 0

    async def channel_lost_at_the_second(message: AbstractIncomingMessage) -> None:
        nonlocal removes
        removes += 1
        if removes == 2:
            await message.channel.close()
        await DeadLetterWalker.remove(walker, message)

    walker.remove = channel_lost_at_the_second  # type: ignore[method-assign]

    report = await dead_letters.replay(ids)

    assert report.replayed == ids[:2]
    assert report.not_reached == ids[2:]
    assert report.interrupted is not None
    assert [command.task_id for command in await queued_commands(dlq)] == ids[:2]
    left = [ScoreText.model_validate_json(letter.body).task_id for letter in await _drain(dlq)]
    assert sorted(left) == sorted(ids[1:])  # the second's ack was lost: it stays
