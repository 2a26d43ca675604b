"""The re-score consumer when its dependencies fail, on the real broker and database: an
unconfirmed command goes down the wait ladder and resumes its claim (same generation), and
past it goes on waiting, never to the DLQ; a database outage is waited out, an unreadable
body rejected.

The consumer's `on_message` is called directly with a stand-in delivery; the commands go
through the gateway's own publisher on the broker, everything else is real too. The broker
refuses them as it does in production: taking them without a confirm (`stalled_broker`, a
confirm lost; the command may reach the score queue all the same), or with a negative
confirm, the score queue full (a policy of this module's vhost). What the scorer was sent is
read from its queue."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import aio_pika
import pytest
from faststream.rabbit import RabbitBroker
from pymongo import AsyncMongoClient
from pymongo.errors import AutoReconnect

from devtools.infra import Endpoint
from services.gateway.cache import ResultCache
from services.gateway.errors import DatabaseUnavailable
from services.gateway.publisher import TaskPublisher
from services.gateway.rescore import RescoreRequests
from services.gateway.settings import GatewaySettings
from services.gateway.submissions import (
    RESCORE_ORPHANED_AFTER,
    RescoreAnswer,
    RescoreClaim,
    RescoreRefused,
    Submissions,
)
from shared.contracts import RescoreTask, ScoreResult, ScoreText, TaskCompleted, new_id, utcnow
from shared.runtime import make_broker
from shared.topology import RESCORE_REQUESTS, RESCORES_WAIT, SCORE_REQUESTS, declare_topology
from tests.integration.gateway_records import PUBLISH_TIMEOUT_S, UNCONFIRMED_AFTER_S
from tests.support import (
    HandedDelivery,
    accepted_submission,
    drain,
    eventually,
    queue_made_full,
    rescore_request,
    watching_completions,
)

Mongo = AsyncMongoClient[dict[str, Any]]

FULL_POLICY = "scorebox-test-score-queue-full"


def _unconfirming(stalled_broker: RabbitBroker) -> TaskPublisher:
    """The gateway's publisher on a broker that takes commands without confirming them."""
    return TaskPublisher(stalled_broker, clock=utcnow, timeout_s=UNCONFIRMED_AFTER_S)


class OutageOnce(Submissions):
    """The database refuses the first claim."""

    outages = 1

    async def claim_rescore(self, *args: Any, **kwargs: Any) -> RescoreClaim | RescoreRefused:
        if self.outages > 0:
            self.outages -= 1
            raise DatabaseUnavailable("no primary")
        return await super().claim_rescore(*args, **kwargs)


class AnswerLostOnce(Submissions):
    """The first claim reaches the database, but its answer is lost."""

    losses = 1

    async def claim_rescore(self, *args: Any, **kwargs: Any) -> RescoreClaim | RescoreRefused:
        claimed = await super().claim_rescore(*args, **kwargs)
        if self.losses > 0:
            self.losses -= 1
            raise DatabaseUnavailable("timed out waiting for the answer")
        return claimed


class GoneAfterTheClaim:
    """A submissions collection whose database goes away the moment a re-score claim's write
    lands: its answer is lost, and so is every write after it."""

    def __init__(self, collection: Any) -> None:
        self._collection = collection
        self.gone = False

    def __getattr__(self, name: str) -> Any:
        if self.gone:
            raise AutoReconnect("connection closed")
        return getattr(self._collection, name)

    async def find_one_and_update(self, *args: Any, **kwargs: Any) -> Any:
        if self.gone:
            raise AutoReconnect("connection closed")
        await self._collection.find_one_and_update(*args, **kwargs)
        self.gone = True
        raise AutoReconnect("connection closed before the answer")


class DatabaseGoneAfterTheClaim(Submissions):
    """The first re-score claim lands, and the database is gone before anything else."""

    def __init__(self, client: Mongo, database: str) -> None:
        super().__init__(client, database)
        self._collection = GoneAfterTheClaim(self._collection)  # type: ignore[assignment]


@dataclass
class Env:
    amqp_url: str
    broker: RabbitBroker
    mongo: Mongo
    database: str

    def submissions(self, kind: type[Submissions] = Submissions) -> Submissions:
        return kind(self.mongo, self.database)

    def publisher(self) -> TaskPublisher:
        """The gateway's publisher on the broker, which confirms."""
        return TaskPublisher(self.broker, clock=utcnow, timeout_s=PUBLISH_TIMEOUT_S)

    def consumer(
        self, publisher: TaskPublisher, submissions: Submissions, cache: ResultCache | None = None
    ) -> RescoreRequests:
        return RescoreRequests(
            submissions=submissions,
            publisher=publisher,
            broker=self.broker,
            clock=utcnow,
            timeout_s=10,
            cache=cache,
        )

    async def take(self, queue_name: str) -> list[aio_pika.abc.AbstractIncomingMessage]:
        return await drain(self.amqp_url, queue_name)

    async def sent(self, task_id: str) -> list[ScoreText]:
        """The commands of `task_id` in the score queue, what the scorer was sent (drained,
        with every other test's): each routed as a resubmission, to the scorer alone."""
        commands = []
        for message in await self.take(SCORE_REQUESTS.name):
            command = ScoreText.model_validate_json(message.body)
            if command.task_id == task_id:
                assert message.routing_key == ScoreText.resubmission_routing_key
                commands.append(command)
        return commands

    async def sent_unconfirmed(self, task_id: str) -> ScoreText:
        """The command of `task_id` a stalled broker took without confirming it, waited for
        in the score queue (where it lands all the same) and drained, so that what the test
        reads next is only what is sent after it."""

        async def queued() -> list[ScoreText] | None:
            return await self.sent(task_id) or None

        [command] = await eventually(queued, what="the unconfirmed command in the score queue")
        return command

    async def retry_of(self, task_id: str) -> bytes:
        """The request of `task_id` back from the 5 s wait queue (other tests' drained)."""

        async def came_back() -> list[bytes] | None:
            bodies = [
                message.body
                for message in await self.take(RESCORE_REQUESTS.name)
                if RescoreTask.model_validate_json(message.body).task_id == task_id
            ]
            return bodies or None

        [body] = await eventually(came_back, what="the request back from the 5 s wait queue")
        return body


@pytest.fixture(scope="module")
async def env(amqp_url: str, mongo: Any, db_prefix: str) -> AsyncIterator[Env]:
    broker = make_broker(GatewaySettings.model_validate({"RABBITMQ_URL": amqp_url}))
    client: Mongo = AsyncMongoClient(mongo.url, tz_aware=True)
    async with broker:
        await broker.connect()
        await declare_topology(broker)
        yield Env(amqp_url, broker, client, f"{db_prefix}_gateway")
    await client.close()


async def test_an_unconfirmed_rescore_is_retried_later_and_resumes_its_generation(
    env: Env, stalled_broker: RabbitBroker
) -> None:
    command = await accepted_submission(env.submissions())
    request = rescore_request(command)

    delivery = HandedDelivery(request.model_dump_json().encode())
    await env.consumer(_unconfirming(stalled_broker), env.submissions()).on_message(delivery)

    assert delivery.settled == ["ack"]
    stored = await env.mongo[env.database]["submissions"].find_one({"_id": command.task_id})
    assert stored is not None
    assert (stored["generation"], stored["rescore"]["sent"]) == (1, False)
    # Unconfirmed, it may be queued all the same: the retry must send the same generation,
    # which the scorer claims once.
    assert (await env.sent_unconfirmed(command.task_id)).generation == 1

    retry = await env.retry_of(command.task_id)
    again = RescoreTask.model_validate_json(retry)
    assert (again.message_id, again.attempt) == (request.message_id, 2)

    consumer = env.consumer(env.publisher(), env.submissions())
    await consumer.on_message(HandedDelivery(retry))
    [sent] = await env.sent(command.task_id)
    assert (sent.task_id, sent.generation, sent.attempt, sent.text) == (
        command.task_id,
        1,
        1,
        "An essay.",
    )
    assert sent.message_id != command.message_id
    stored = await env.mongo[env.database]["submissions"].find_one({"_id": command.task_id})
    assert stored is not None
    assert (stored["generation"], stored["rescore"]["sent"]) == (1, True)
    # Noted as tried again: a DLQ replay keeps the task's letters while it is (an hour quiet,
    # the claim is taken for orphaned).
    assert stored["rescore"]["tried_at"] >= stored["rescore"]["requested_at"]

    # The original request delivered once more: a duplicate, nothing sent.
    await consumer.on_message(HandedDelivery(request.model_dump_json().encode(), redelivered=True))
    assert await env.sent(command.task_id) == []


async def _claimed(
    submissions: Submissions, command: ScoreText, request: RescoreTask
) -> RescoreClaim:
    """The re-score claim `request` takes, as the consumer takes it."""
    claim = await submissions.claim_rescore(
        command.task_id,
        tenant_id=command.tenant_id,
        rubric_version=request.rubric_version,
        request_id=request.message_id,
        now=utcnow(),
    )
    assert isinstance(claim, RescoreClaim)
    return claim


async def test_a_first_delivery_never_resumes_a_claim_being_sent(env: Env) -> None:
    command = await accepted_submission(env.submissions())
    request = rescore_request(command)
    submissions = env.submissions()
    claim = await _claimed(submissions, command, request)
    consumer = env.consumer(env.publisher(), submissions)

    await consumer.on_message(HandedDelivery(request.model_dump_json().encode()))
    assert await env.sent(command.task_id) == []
    await consumer.on_message(HandedDelivery(request.model_dump_json().encode(), redelivered=True))
    assert [sent.generation for sent in await env.sent(command.task_id)] == [claim.generation]


async def test_a_retried_request_naming_its_generation_resumes_only_its_own_claim(
    env: Env,
) -> None:
    """The fan-out's requests name the generation they found completed (their message id
    with it): a retry resumes the claim that request took, unsent; another request for the
    same version (a late one of an earlier run) does not."""
    command = await accepted_submission(env.submissions())
    submissions = env.submissions()

    async def claim(request_id: str) -> RescoreClaim | RescoreRefused:
        return await submissions.claim_rescore(
            command.task_id,
            tenant_id=command.tenant_id,
            rubric_version="v2",
            request_id=request_id,
            now=utcnow(),
            may_resume=True,
            generation=0,
        )

    first = await claim("request-a")
    assert isinstance(first, RescoreClaim)
    again = await claim("request-a")
    assert isinstance(again, RescoreClaim)
    assert (again.generation, again.resumed) == (first.generation, True)
    assert await claim("request-b") is RescoreRefused.ALREADY_REQUESTED


def fan_out_request(command: ScoreText, *, version: str, attempt: int = 1) -> RescoreTask:
    """A fan-out's request naming the generation it found completed (the first)."""
    request = RescoreTask.for_task(
        task_id=command.task_id,
        tenant_id=command.tenant_id,
        rubric_version=version,
        previous_rubric_version=None,
        model=None,
        run_id=new_id(),
        generation=0,
    )
    return request.model_copy(update={"attempt": attempt})


async def _given_up_by_an_earlier_build(
    env: Env, stalled_broker: RabbitBroker, request: RescoreTask
) -> None:
    """The request's claim taken, its command not confirmed, and the request given up to the
    DLQ as builds before session 54 did (`rescore.given_up`)."""
    await env.consumer(_unconfirming(stalled_broker), env.submissions()).on_message(
        HandedDelivery(request.model_dump_json().encode())
    )
    await env.sent_unconfirmed(request.task_id)
    marked = await env.mongo[env.database]["submissions"].update_one(
        {"_id": request.task_id, "rescore.request_id": request.message_id},
        {"$set": {"rescore.given_up": True, "rescore.given_up_at": utcnow()}},
    )
    assert marked.modified_count == 1


async def test_a_claim_an_earlier_build_gave_up_is_taken_by_the_next_request(
    env: Env, stalled_broker: RabbitBroker
) -> None:
    """The request's claim stayed taken and unsent: every later fan-out's request found the
    task's completed generation no longer the latest and was dropped as a duplicate, until
    the letter was replayed. The next request takes the same generation, and the replayed
    letter then finds it sent."""
    command = await accepted_submission(env.submissions())
    given_up = fan_out_request(command, version=f"v{new_id()[:6]}", attempt=5)
    await _given_up_by_an_earlier_build(env, stalled_broker, given_up)

    consumer = env.consumer(env.publisher(), env.submissions())
    next_run = fan_out_request(command, version=f"v{new_id()[:6]}")
    await consumer.on_message(HandedDelivery(next_run.model_dump_json().encode()))
    assert [(sent.generation, sent.task_id) for sent in await env.sent(command.task_id)] == [
        (1, command.task_id)
    ]

    replayed = HandedDelivery(given_up.model_dump_json().encode(), redelivered=True)
    await consumer.on_message(replayed)
    assert replayed.settled == ["ack"]
    assert await env.sent(command.task_id) == []


async def test_a_replayed_letter_takes_its_given_up_claims_generation_again(
    env: Env, stalled_broker: RabbitBroker
) -> None:
    command = await accepted_submission(env.submissions())
    given_up = fan_out_request(command, version=f"v{new_id()[:6]}", attempt=5)
    await _given_up_by_an_earlier_build(env, stalled_broker, given_up)

    replayed = given_up.model_dump_json().encode()
    await env.consumer(env.publisher(), env.submissions()).on_message(HandedDelivery(replayed))

    assert [sent.generation for sent in await env.sent(command.task_id)] == [1]


async def test_a_request_the_full_score_queue_refuses_past_its_ladder_is_never_given_up(
    env: Env, rabbitmq: Endpoint
) -> None:
    """Its command refused with a negative confirm (an earlier review)."""

    async def refused(delivery: HandedDelivery) -> None:
        await _handled_with_the_score_queue_full(env, rabbitmq, delivery)

    await _never_given_up_past_its_ladder(env, refused)


@pytest.mark.parametrize(("attempt", "waits_in"), [(3, "scorebox.wait.2m"), (4, RESCORES_WAIT)])
async def test_the_ladder_s_10_minute_steps_wait_where_the_fan_out_counts_them(
    env: Env, rabbitmq: Endpoint, attempt: int, waits_in: str
) -> None:
    """The ladder's last step, and each past it, waits in the re-score requests' own queue,
    which the scheduler's fan-out counts against its backlog bound: they come back as
    re-score requests. The earlier steps wait on the ladder."""
    await env.take(waits_in)
    command = await accepted_submission(env.submissions())
    delivery = HandedDelivery(rescore_request(command, attempt=attempt).model_dump_json().encode())

    await _handled_with_the_score_queue_full(env, rabbitmq, delivery)

    assert delivery.settled == ["ack"]
    [waiting] = await env.take(waits_in)
    assert RescoreTask.model_validate_json(waiting.body).attempt == attempt + 1


async def _handled_with_the_score_queue_full(
    env: Env, rabbitmq: Endpoint, delivery: HandedDelivery
) -> None:
    """The gateway's consumer handles `delivery` while the score queue refuses every command."""
    async with queue_made_full(
        env.amqp_url,
        SCORE_REQUESTS.name,
        policy=FULL_POLICY,
        management_url=rabbitmq.management_url,
    ):
        await env.consumer(env.publisher(), env.submissions()).on_message(delivery)


async def test_a_request_unconfirmed_past_its_ladder_is_never_given_up(
    env: Env, stalled_broker: RabbitBroker
) -> None:
    """Its command taken without a confirm (a review in session 54)."""

    async def unconfirmed(delivery: HandedDelivery) -> None:
        await env.consumer(_unconfirming(stalled_broker), env.submissions()).on_message(delivery)
        await env.sent_unconfirmed(RescoreTask.model_validate_json(delivery.body).task_id)

    await _never_given_up_past_its_ladder(env, unconfirmed)


async def _never_given_up_past_its_ladder(
    env: Env, handled_unsent: Callable[[HandedDelivery], Awaitable[None]]
) -> None:
    """Past its ladder, a re-score not sent goes on waiting (every 10 min): dead-lettered, it
    was lost for good, its task marked requested for the version in the catalogue and never
    asked for again; nothing replays that DLQ. Its claim stays unsent, for the retry.
    `handled_unsent` hands the request to the consumer while the broker refuses its command."""
    await env.take(RESCORE_REQUESTS.dead_letter_routing_key)
    await env.take(RESCORES_WAIT)
    command = await accepted_submission(env.submissions())
    request = rescore_request(command, attempt=5)
    delivery = HandedDelivery(request.model_dump_json().encode())

    await handled_unsent(delivery)

    assert delivery.settled == ["ack"]
    assert await env.take(RESCORE_REQUESTS.dead_letter_routing_key) == []
    [waiting] = await env.take(RESCORES_WAIT)
    again = RescoreTask.model_validate_json(waiting.body)
    assert (again.task_id, again.attempt) == (command.task_id, 6)
    await env.consumer(env.publisher(), env.submissions()).on_message(HandedDelivery(waiting.body))
    assert [sent.generation for sent in await env.sent(command.task_id)] == [1]


async def test_a_database_outage_is_waited_out(env: Env) -> None:
    command = await accepted_submission(env.submissions())
    delivery = HandedDelivery(rescore_request(command).model_dump_json().encode())

    await env.consumer(env.publisher(), env.submissions(OutageOnce)).on_message(delivery)

    assert delivery.settled == ["ack"]
    assert [sent.generation for sent in await env.sent(command.task_id)] == [1]


async def test_a_claim_taken_after_an_outage_is_stamped_when_it_is_taken(
    env: Env, stalled_broker: RabbitBroker
) -> None:
    """The time was read as the request arrived: a claim taken after an outage of hours was
    stamped hours old, taken for orphaned at once, and a DLQ replay ran beside it (the
    re-read). Each try reads the clock again."""
    command = await accepted_submission(env.submissions())
    arrived = utcnow() - timedelta(hours=3)
    readings = iter([arrived, *[utcnow()] * 10])
    consumer = RescoreRequests(
        submissions=env.submissions(OutageOnce),
        publisher=_unconfirming(stalled_broker),
        broker=env.broker,
        clock=lambda: next(readings),
        timeout_s=10,
    )

    await consumer.on_message(HandedDelivery(rescore_request(command).model_dump_json().encode()))
    await env.sent_unconfirmed(command.task_id)

    stored = await env.mongo[env.database]["submissions"].find_one({"_id": command.task_id})
    assert stored is not None
    assert stored["rescore"]["requested_at"] > arrived + timedelta(hours=2)


async def test_an_unreadable_request_is_rejected_without_requeue(env: Env) -> None:
    await env.take(SCORE_REQUESTS.name)
    delivery = HandedDelivery(b"{not json")
    await env.consumer(env.publisher(), env.submissions()).on_message(delivery)
    assert delivery.settled == ["reject(requeue=False)"]
    assert await env.take(SCORE_REQUESTS.name) == []


async def test_a_submission_past_its_retention_is_not_rescored(env: Env) -> None:
    """The TTL monitor removes it about once a minute, later under load; until then its
    text is still readable, but no longer ours to send to the model."""
    command = await accepted_submission(env.submissions())
    request = rescore_request(command)
    submissions = env.submissions()

    claim = await submissions.claim_rescore(
        command.task_id,
        tenant_id=command.tenant_id,
        rubric_version=request.rubric_version,
        request_id=request.message_id,
        now=utcnow() + timedelta(hours=2),  # retention: one hour
    )

    assert claim is RescoreRefused.TEXT_NOT_KEPT


async def test_a_claim_whose_answer_was_lost_is_resumed_by_the_next_try(env: Env) -> None:
    """The next try found the request's own claim unsent and dropped it as a duplicate's:
    the re-score was never sent, and nothing would send it."""
    command = await accepted_submission(env.submissions())
    delivery = HandedDelivery(rescore_request(command).model_dump_json().encode())

    await env.consumer(env.publisher(), env.submissions(AnswerLostOnce)).on_message(delivery)

    assert delivery.settled == ["ack"]
    assert [sent.generation for sent in await env.sent(command.task_id)] == [1]


async def test_a_resumed_rescore_keeps_its_generation_when_a_replay_took_the_next(
    env: Env, stalled_broker: RabbitBroker
) -> None:
    """A DLQ replay taking a generation while the re-score waited for room: the re-score's
    retry used to resume as the replay's generation (which the scorer took for the replay's
    attempt: the re-score never ran)."""
    command = await accepted_submission(env.submissions())
    request = rescore_request(command)
    refused = HandedDelivery(request.model_dump_json().encode())
    await env.consumer(_unconfirming(stalled_broker), env.submissions()).on_message(refused)
    await env.sent_unconfirmed(command.task_id)

    # A letter of the claim's generation (its command reached the broker after all): one of
    # generation 0 is superseded by the claim, and sends nothing.
    replayed_as = await env.submissions().replay_generation(command.task_id, of=1)
    assert replayed_as == 2
    assert await env.submissions().replay_generation(command.task_id, of=1) == 2  # a copy

    retry = await env.retry_of(command.task_id)
    await env.consumer(env.publisher(), env.submissions()).on_message(HandedDelivery(retry))
    assert [sent.generation for sent in await env.sent(command.task_id)] == [1]


async def test_a_claim_cut_short_keeps_its_generation_when_a_replay_took_the_next(
    env: Env,
) -> None:
    """The claim was two writes: the generation, then `rescore.generation`. With only the
    first landed, a DLQ replay taking the next generation meanwhile made the resumed claim
    run as the replay's generation, which the scorer dropped as a duplicate of the replay's
    attempt: a re-score reported accepted never ran. Now the claim is one write."""
    command = await accepted_submission(env.submissions())
    request = rescore_request(command)
    cut_short = env.submissions(DatabaseGoneAfterTheClaim)
    with pytest.raises(DatabaseUnavailable):
        await cut_short.claim_rescore(
            command.task_id,
            tenant_id=command.tenant_id,
            rubric_version=request.rubric_version,
            request_id=request.message_id,
            now=utcnow(),
        )

    # A letter of the claim's generation (one of generation 0 is superseded by the claim).
    assert await env.submissions().replay_generation(command.task_id, of=1) == 2

    redelivered = HandedDelivery(request.model_dump_json().encode(), redelivered=True)
    await env.consumer(env.publisher(), env.submissions()).on_message(redelivered)
    assert redelivered.settled == ["ack"]
    assert [sent.generation for sent in await env.sent(command.task_id)] == [1]


async def test_two_copies_of_a_letter_replayed_at_once_take_one_generation(env: Env) -> None:
    """Two gateway replicas replaying the two copies of one letter each took a generation and
    the first naming won: both ran as 1 while the submission stored 2, a generation that
    never runs, and a cancel (which targets the stored one) stopped the running call's
    outcome from being recorded."""
    command = await accepted_submission(env.submissions())

    first, second = await asyncio.gather(
        env.submissions().replay_generation(command.task_id, of=0),
        env.submissions().replay_generation(command.task_id, of=0),
    )

    stored = await env.submissions().find(command.task_id, tenant_id=command.tenant_id)
    assert stored is not None
    assert first == second == stored.generation == 1


async def test_a_request_naming_no_generation_notes_the_claim_it_resumes_as_tried(
    env: Env, stalled_broker: RabbitBroker
) -> None:
    """A scheduler of an earlier build names no generation: its requests resume each other's
    claim. The try was noted under the request's own id, which matched nothing, and the
    claim, tried all along, was taken for orphaned after an hour (the re-read)."""
    command = await accepted_submission(env.submissions())
    first = rescore_request(command)
    await env.consumer(_unconfirming(stalled_broker), env.submissions()).on_message(
        HandedDelivery(first.model_dump_json().encode())
    )
    await env.sent_unconfirmed(command.task_id)
    other = rescore_request(command, attempt=2).model_copy(
        update={"rubric_version": first.rubric_version}
    )
    assert other.message_id != first.message_id
    assert other.generation is None
    await env.consumer(_unconfirming(stalled_broker), env.submissions()).on_message(
        HandedDelivery(other.model_dump_json().encode())
    )
    await env.sent_unconfirmed(command.task_id)

    stored = await env.mongo[env.database]["submissions"].find_one({"_id": command.task_id})
    assert stored is not None
    assert stored["rescore"]["request_id"] == first.message_id
    assert stored["rescore"]["tried_at"] >= stored["rescore"]["requested_at"]


async def test_a_claim_its_request_left_for_an_hour_is_taken_by_the_next_request(
    env: Env,
) -> None:
    """Its request dead-lettered (a crash, the database's refusal), the claim was never sent,
    and every later request found the task's completed generation no longer the latest: as
    for a claim given up, the next request takes the same generation again."""
    command = await accepted_submission(env.submissions())
    orphaned = await env.submissions().claim_rescore(
        command.task_id,
        tenant_id=command.tenant_id,
        rubric_version=f"v{new_id()[:6]}",
        request_id=new_id(),
        now=utcnow() - RESCORE_ORPHANED_AFTER * 2,
        generation=0,
    )
    assert isinstance(orphaned, RescoreClaim)

    next_run = fan_out_request(command, version=f"v{new_id()[:6]}")
    await env.consumer(env.publisher(), env.submissions()).on_message(
        HandedDelivery(next_run.model_dump_json().encode())
    )

    assert [(sent.generation, sent.task_id) for sent in await env.sent(command.task_id)] == [
        (orphaned.generation, command.task_id)
    ]


async def test_a_resumed_claim_repeats_its_answer_from_the_cache(
    env: Env, stalled_broker: RabbitBroker
) -> None:
    """A claim answered from the result cache whose events were not confirmed is answered
    from the cache again at its retry, though the entry is gone by then: decided again, it
    was sent to the scorer too, its generation both answered and scored."""
    command = await accepted_submission(env.submissions())  # cache key "k"
    request = rescore_request(command).model_copy(update={"answered_from_cache": True})
    cache = ResultCache(env.mongo, env.database, timedelta(hours=1))
    result = ScoreResult(
        score=6.5,
        comment="Scored under the new rubric.",
        model="m",
        prompt_version=request.rubric_version,
    )
    await cache.remember(tenant_id="acme", key="k", result=result, task_id="other", now=utcnow())
    await env.take(SCORE_REQUESTS.name)

    first = HandedDelivery(request.model_dump_json().encode())
    await env.consumer(_unconfirming(stalled_broker), env.submissions(), cache).on_message(first)
    assert first.settled == ["ack"]  # down the wait ladder, to be tried again
    await env.mongo[env.database]["result_cache"].delete_many({})  # expired meanwhile
    async with watching_completions(env.amqp_url) as completions:
        retry = HandedDelivery(request.model_copy(update={"attempt": 2}).model_dump_json().encode())
        await env.consumer(env.publisher(), env.submissions(), cache).on_message(retry)

        async def completed() -> TaskCompleted | None:
            mine = [m for m in completions if m.correlation_id == command.task_id]
            return TaskCompleted.model_validate_json(mine[0].body) if mine else None

        answered = await eventually(completed, what="the cached answer announced again")

    assert retry.settled == ["ack"]
    assert (answered.generation, answered.result.cached) == (1, True)
    assert answered.result.score == result.score
    assert await env.take(SCORE_REQUESTS.name) == []  # never sent to the scorer
    stored = await env.mongo[env.database]["submissions"].find_one({"_id": command.task_id})
    assert stored is not None
    assert stored["rescore"]["sent"] is True


async def test_the_first_answer_recorded_on_a_claim_stands(env: Env) -> None:
    """Two tries of one claim decided apart (the cache's entry gone, or come, between them)
    record the first one's answer, and each is told it."""
    submissions = env.submissions()
    command = await accepted_submission(submissions)
    request = rescore_request(command)
    claim = await _claimed(submissions, command, request)
    cached = RescoreAnswer(
        cached=ScoreResult(score=6.5, comment="From the cache.", model="m", cached=True)
    )

    first = await submissions.answer_rescore(
        command.task_id, generation=claim.generation, answer=cached
    )
    second = await submissions.answer_rescore(
        command.task_id, generation=claim.generation, answer=RescoreAnswer()
    )

    assert first == second == cached
    other_generation = await submissions.answer_rescore(
        command.task_id, generation=claim.generation + 1, answer=RescoreAnswer()
    )
    assert other_generation == RescoreAnswer()  # not this claim's: nothing recorded
