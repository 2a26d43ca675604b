"""A DLQ replay of a letter that a later generation superseded, on the real broker and
database: a task dead-lettered at generation 0 and re-scored since (generation 1 handed out)
was scored once more by the replay of its old letter, as generation 2: one model call that
nobody asked for. Such a letter is now removed unsent and reported `superseded`. Two copies of
one letter still replay as one generation, neither taken for superseded by the other's replay.

The gateway's admin routes run in-process as in `test_dead_letter_drop.py`, the re-score
through the gateway's own consumer; what reached the scorer is read off the score queue."""

from __future__ import annotations

from datetime import datetime

import pytest
from faststream.rabbit import RabbitBroker
from pymongo import AsyncMongoClient

from devtools.infra import Endpoint
from services.gateway.publisher import TaskPublisher
from services.gateway.rescore import RescoreRequests
from services.gateway.submissions import RESCORE_ORPHANED_AFTER, ReplayRefused, Submissions
from shared.contracts import ScoreText, utcnow
from tests.integration import test_dead_letter_drop as gateway_dlq
from tests.integration.test_dead_letter_drop import (
    LETTERS,
    TIMEOUT_S,
    Json,
    _admin,
    _admin_app,
    _dead_letter,
    _drain,
)
from tests.support import HandedDelivery, accepted_submission, queued_commands, rescore_request

pytestmark = pytest.mark.integration

broker = gateway_dlq.broker  # fixtures
submissions = gateway_dlq.submissions
dlq = gateway_dlq.dlq


async def _sent_to_the_scorer(amqp_url: str, task_id: str) -> list[ScoreText]:
    """The commands of `task_id` in the score queue (every command taken off it)."""
    return [command for command in await queued_commands(amqp_url) if command.task_id == task_id]


async def _claimed_unsent(
    submissions: Submissions, command: ScoreText, *, at: datetime | None = None
) -> int | None:
    """A re-score of the task under rubric v2 claimed (`at`, else now), its command not sent:
    its generation."""
    claim = await submissions.claim_rescore(
        command.task_id,
        tenant_id=command.tenant_id,
        rubric_version="v2",
        request_id="r-1",
        now=at or utcnow(),
    )
    return getattr(claim, "generation", None)


async def _rescored(broker: RabbitBroker, submissions: Submissions, command: ScoreText) -> None:
    """The task re-scored under a new rubric version, as the fan-out's request is handled."""
    consumer = RescoreRequests(
        submissions=submissions,
        publisher=TaskPublisher(broker, clock=utcnow, timeout_s=TIMEOUT_S),
        broker=broker,
        clock=utcnow,
        timeout_s=TIMEOUT_S,
    )
    delivery = HandedDelivery(rescore_request(command).model_dump_json().encode())
    await consumer.on_message(delivery)
    assert delivery.settled == ["ack"]


async def _stored(mongo: Endpoint, db_prefix: str, task_id: str) -> Json:
    client: AsyncMongoClient[Json] = AsyncMongoClient(mongo.url, tz_aware=True)
    try:
        stored = await client[f"{db_prefix}_gateway"]["submissions"].find_one({"_id": task_id})
    finally:
        await client.close()
    assert stored is not None
    return stored


async def _given_up_by_an_earlier_build(mongo: Endpoint, db_prefix: str, task_id: str) -> None:
    """The re-score claim's request given up to its DLQ, as builds before session 54 did."""
    client: AsyncMongoClient[Json] = AsyncMongoClient(mongo.url, tz_aware=True)
    try:
        marked = await client[f"{db_prefix}_gateway"]["submissions"].update_one(
            {"_id": task_id, "rescore.request_id": "r-1"}, {"$set": {"rescore.given_up": True}}
        )
    finally:
        await client.close()
    assert marked.modified_count == 1


async def _replay_all(broker: RabbitBroker, submissions: Submissions) -> Json:
    async with _admin(_admin_app(broker, submissions)) as api:
        answer = await api.post(f"{LETTERS}/replay", json={"all": True})
    assert answer.status_code == 200, answer.text
    report: Json = answer.json()
    return report


async def test_a_letter_a_rescore_superseded_is_removed_unsent_and_reported(
    dlq: str, broker: RabbitBroker, submissions: Submissions, mongo: Endpoint, db_prefix: str
) -> None:
    command = await accepted_submission(submissions)
    await _dead_letter(dlq, [command])
    await _rescored(broker, submissions, command)
    [rescore] = await _sent_to_the_scorer(dlq, command.task_id)
    assert rescore.generation == 1

    report = await _replay_all(broker, submissions)

    assert (report["replayed"], report["superseded"]) == ([], [command.task_id])
    assert await _sent_to_the_scorer(dlq, command.task_id) == []
    stored = await _stored(mongo, db_prefix, command.task_id)
    assert (stored["generation"], stored.get("replays")) == (1, None)
    assert await _drain(dlq) == []


async def test_the_rescores_own_letter_is_replayed_beside_the_superseded_one(
    dlq: str, broker: RabbitBroker, submissions: Submissions
) -> None:
    """Generation 1 dead-lettered too: its letter is the latest generation's, replayed as 2,
    in whichever order the walk meets the two letters."""
    command = await accepted_submission(submissions)
    await _rescored(broker, submissions, command)
    [rescore] = await _sent_to_the_scorer(dlq, command.task_id)
    await _dead_letter(dlq, [command, rescore])

    report = await _replay_all(broker, submissions)

    assert (report["replayed"], report["superseded"]) == ([command.task_id], [command.task_id])
    [replayed] = await _sent_to_the_scorer(dlq, command.task_id)
    assert replayed.generation == 2
    assert await _drain(dlq) == []


async def test_two_copies_of_a_letter_replay_as_one_generation_neither_superseded(
    dlq: str, broker: RabbitBroker, submissions: Submissions, mongo: Endpoint, db_prefix: str
) -> None:
    """The first copy's replay raises the submission's generation above the letter's: the
    second copy must find that generation its own letter's, not a later one's."""
    command = await accepted_submission(submissions)
    await _dead_letter(dlq, [command, command])

    report = await _replay_all(broker, submissions)

    assert (report["replayed"], report["superseded"]) == ([command.task_id] * 2, [])
    sent = await _sent_to_the_scorer(dlq, command.task_id)
    assert [copy.generation for copy in sent] == [1, 1]
    assert (await _stored(mongo, db_prefix, command.task_id))["generation"] == 1


async def test_a_copy_replayed_after_a_rescore_keeps_its_letters_generation(
    submissions: Submissions,
) -> None:
    """A generation above the letter's handed out by a replay of this very letter does not
    supersede it, even once a re-score took the next (the copies must run as one attempt);
    a letter whose submission is gone still replays as the next generation."""
    command = await accepted_submission(submissions)
    assert await submissions.replay_generation(command.task_id, of=0) == 1
    assert await _claimed_unsent(submissions, command) == 2
    await submissions.finish_rescore(command.task_id, rubric_version="v2", now=utcnow())

    assert await submissions.replay_generation(command.task_id, of=0) == 1
    assert await submissions.replay_generation(command.task_id, of=1) is ReplayRefused.SUPERSEDED
    assert await submissions.replay_generation(command.task_id, of=2) == 3
    assert await submissions.replay_generation("no-such-task", of=0) is None


async def test_a_rescore_claim_never_sent_supersedes_nothing(
    dlq: str, broker: RabbitBroker, submissions: Submissions, mongo: Endpoint, db_prefix: str
) -> None:
    """A re-score whose request an earlier build gave up to its DLQ keeps its claim unsent:
    counted as a later generation, it superseded the letter, which was removed, and the task
    was never scored again (found in review). The replay runs above the claim's generation."""
    command = await accepted_submission(submissions)
    await _dead_letter(dlq, [command])
    assert await _claimed_unsent(submissions, command) == 1
    await _given_up_by_an_earlier_build(mongo, db_prefix, command.task_id)

    report = await _replay_all(broker, submissions)

    assert (report["replayed"], report["superseded"]) == ([command.task_id], [])
    [replayed] = await _sent_to_the_scorer(dlq, command.task_id)
    assert replayed.generation == 2
    assert await _drain(dlq) == []


async def test_a_letter_is_kept_while_a_rescore_of_its_task_is_being_sent(
    dlq: str, broker: RabbitBroker, submissions: Submissions
) -> None:
    """A re-score's claim taken and not yet sent (its publish in flight): replayed above it,
    the letter's generation was scored beside the claim's, the task twice (review). The
    letter is kept and reported; once the claim is sent, it is superseded."""
    command = await accepted_submission(submissions)
    await _dead_letter(dlq, [command])
    assert await _claimed_unsent(submissions, command) == 1

    report = await _replay_all(broker, submissions)

    assert (report["replayed"], report["superseded"]) == ([], [])
    assert report["skipped_being_rescored"] == [command.task_id]
    assert await _sent_to_the_scorer(dlq, command.task_id) == []

    await submissions.finish_rescore(command.task_id, rubric_version="v2", now=utcnow())
    report = await _replay_all(broker, submissions)

    assert (report["superseded"], report["skipped_being_rescored"]) == ([command.task_id], [])
    assert await _sent_to_the_scorer(dlq, command.task_id) == []
    assert await _drain(dlq) == []


@pytest.mark.parametrize("tried_again", [False, True], ids=["quiet", "tried-again"])
async def test_a_claim_its_request_left_for_an_hour_keeps_no_letter(
    dlq: str, broker: RabbitBroker, submissions: Submissions, tried_again: bool
) -> None:
    """A claim whose request was dead-lettered (a crash, the database refusing it) is never
    sent: kept for it, the task's letter was kept for ever, each replay answered "replay
    them again shortly" (the re-read). Its request quiet past `RESCORE_ORPHANED_AFTER`, the
    replay runs above it; one still trying (a retry every 10 min at most) keeps it."""
    command = await accepted_submission(submissions)
    await _dead_letter(dlq, [command])
    claimed_at = utcnow() - RESCORE_ORPHANED_AFTER * 2
    assert await _claimed_unsent(submissions, command, at=claimed_at) == 1
    if tried_again:
        await submissions.note_rescore_tried(command.task_id, request_id="r-1", now=utcnow())

    report = await _replay_all(broker, submissions)

    if tried_again:
        assert (report["replayed"], report["skipped_being_rescored"]) == ([], [command.task_id])
        assert await _sent_to_the_scorer(dlq, command.task_id) == []
    else:
        assert (report["replayed"], report["skipped_being_rescored"]) == ([command.task_id], [])
        [replayed] = await _sent_to_the_scorer(dlq, command.task_id)
        assert replayed.generation == 2
