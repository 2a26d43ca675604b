"""Refused requests are written off, not sent: tombstones on the real database, and a submission
whose insert landed after the gateway answered 503 (its reply held back by a slow link).

The broker's refusals are real: the score queue made full (`queue_made_full`) answers the
gateway's publish with a negative confirm, and the real publisher makes of it what the
gateway answers 503 with (`BrokerUnavailable`), withdrawing the command from the status
projection, whose queue took its copy all the same."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from faststream.rabbit import RabbitBroker
from pymongo import AsyncMongoClient
from pymongo.errors import DuplicateKeyError

from devtools.infra import Endpoint
from services.gateway.batches import BatchMember, BatchRecord, BatchState
from services.gateway.cache import ResultCache
from services.gateway.errors import BrokerUnavailable, DatabaseUnavailable
from services.gateway.limits import InFlight
from services.gateway.publisher import TaskPublisher
from services.gateway.refusals import Refusal, Refusals, write_off
from services.gateway.schemas import ScoreSubmission
from services.gateway.submissions import Submissions, SubmissionState
from services.gateway.submit import SubmitPolicy, submit_score, sweep_outbox
from shared.contracts import ScoreResult, ScoreText, ScoreWithdrawn, new_id, utcnow
from shared.topology import SCORE_REQUESTS, STATUS_PROJECTION
from tests.faults.slow_link import SlowLink
from tests.integration.gateway_records import PUBLISH_TIMEOUT_S, Recorded, gateway_records
from tests.integration.gateway_records import GatewayRecords as Gateway
from tests.support import SWEEP_RETENTION, drain, eventually, queue_made_full

Document = dict[str, Any]
NOW = datetime(2030, 5, 17, 12, 0, tzinfo=UTC)
RETENTION = timedelta(days=1)
TIMEOUT_MS = 2_000  # well above a loaded stand-in's slowest reply
HELD_S = 5.0  # past TIMEOUT_MS: the gateway gives up on every reply
FULL_POLICY = "scorebox-test-score-queue-full"
# The module's score queue refusing every publish for a block.
ScoreQueueFull = Callable[[], contextlib.AbstractAsyncContextManager[None]]


class Refusing(TaskPublisher):
    """The publisher on `broker`, whose command the broker refuses (the test makes the score
    queue full around the request), and the database (reached through `link`) turning slow
    as it does; the send and the withdrawal are the publisher's own."""

    def __init__(self, broker: RabbitBroker, link: SlowLink) -> None:
        super().__init__(broker, clock=utcnow, timeout_s=PUBLISH_TIMEOUT_S)
        self.link = link

    async def send(self, command: ScoreText) -> bool:
        self.link.reply_delay_s = HELD_S
        return await super().send(command)

    async def announce_cached(self, command: ScoreText, result: ScoreResult) -> bool:
        raise AssertionError("nothing is cached here")


@pytest.fixture
async def gateway(
    mongo: Endpoint, db_prefix: str, task_broker: RabbitBroker
) -> AsyncIterator[Gateway]:
    async with gateway_records(mongo.url, db_prefix, task_broker) as records:
        yield records


@pytest.fixture
def score_queue_full(amqp_url: str, rabbitmq: Endpoint) -> ScoreQueueFull:
    """The module's score queue made full for a block: every publish to it refused with a
    negative confirm; cleared and emptied after."""
    return lambda: queue_made_full(
        amqp_url, SCORE_REQUESTS.name, policy=FULL_POLICY, management_url=rabbitmq.management_url
    )


async def _projections_copies(amqp_url: str, task_id: str) -> list[str]:
    """The routing keys of what the status projection's queue holds of `task_id`, in order
    (the queue drained: nothing consumes it here)."""
    messages = await drain(amqp_url, STATUS_PROJECTION.name)
    return [message.routing_key or "" for message in messages if message.correlation_id == task_id]


def _command(created: datetime = NOW) -> ScoreText:
    return ScoreText(task_id=new_id(), text="An essay.", submitted_at=created, occurred_at=created)


async def _record(submissions: Submissions, command: ScoreText, key: str | None = None) -> None:
    await submissions.insert(
        command, request_hash="h", idempotency_key=key, retention=RETENTION, cache_key="c"
    )


async def test_a_tombstone_written_before_its_insert_makes_the_insert_fail(
    gateway: Gateway,
) -> None:
    command = _command()
    await gateway.submissions.abandon((command.task_id,), now=NOW)
    with pytest.raises(DuplicateKeyError):
        await gateway.raw["submissions"].insert_one({"_id": command.task_id, "state": "accepting"})
    stored = await gateway.raw["submissions"].find_one({"_id": command.task_id})
    assert stored["state"] == SubmissionState.ABANDONED
    assert stored["expires_at"] > NOW
    assert await gateway.submissions.interrupted(older_than=NOW + timedelta(days=2)) == []


async def test_a_tombstone_after_its_insert_frees_the_key_and_hides_the_task(
    gateway: Gateway,
) -> None:
    command = _command()
    await _record(gateway.submissions, command, key="k-1")
    await gateway.submissions.abandon((command.task_id,), now=NOW)
    await gateway.submissions.abandon((command.task_id,), now=NOW)  # a repeat changes nothing
    stored = await gateway.raw["submissions"].find_one({"_id": command.task_id})
    assert stored["state"] == SubmissionState.ABANDONED
    assert "command" not in stored
    assert "idempotency_key" not in stored
    assert await gateway.submissions.interrupted(older_than=NOW + timedelta(days=2)) == []
    assert await gateway.submissions.find(command.task_id, tenant_id=command.tenant_id) is None
    assert await gateway.submissions.find_by_key("k-1", tenant_id=command.tenant_id) is None
    await _record(gateway.submissions, _command(), key="k-1")  # the key is free again


async def test_a_submission_already_sent_is_not_abandoned(gateway: Gateway) -> None:
    command = _command()
    await _record(gateway.submissions, command)
    await gateway.submissions.mark_accepted(command.task_id)
    await gateway.submissions.abandon((command.task_id,), now=NOW)
    stored = await gateway.raw["submissions"].find_one({"_id": command.task_id})
    assert stored["state"] == SubmissionState.ACCEPTED
    assert stored["command"]["text"] == command.text


async def test_every_refusal_is_abandoned_though_one_was_sent_after_all(
    gateway: Gateway,
) -> None:
    sent, *refused = [_command() for _ in range(250)]  # more than one write's worth
    for command in (sent, *refused):
        await _record(gateway.submissions, command)
    await gateway.submissions.mark_accepted(sent.task_id)
    await gateway.submissions.abandon(tuple(c.task_id for c in (sent, *refused)), now=NOW)
    states = {
        document["_id"]: document["state"]
        async for document in gateway.raw["submissions"].find({}, {"state": 1})
    }
    assert states.pop(sent.task_id) == SubmissionState.ACCEPTED
    assert set(states.values()) == {SubmissionState.ABANDONED}
    assert len(states) == len(refused)


def _batch(state: str = BatchState.ACCEPTING) -> BatchRecord:
    return BatchRecord(
        batch_id=new_id(),
        tenant_id="default",
        state=state,
        request_hash="h",
        created_at=NOW,
        members=(BatchMember(new_id(), None),),
    )


async def test_a_batch_tombstone_holds_before_and_after_its_insert(gateway: Gateway) -> None:
    early, late = _batch(), _batch()
    await gateway.batches.abandon(early.batch_id, now=NOW)
    with pytest.raises(DuplicateKeyError):
        await gateway.raw["batches"].insert_one({"_id": early.batch_id, "state": "accepting"})
    await gateway.batches.insert(late, idempotency_key="b-1", retention=RETENTION)
    await gateway.batches.abandon(late.batch_id, now=NOW)
    assert await gateway.batches.find(late.batch_id, tenant_id=late.tenant_id) is None
    assert await gateway.batches.find_by_key("b-1", tenant_id=late.tenant_id) is None
    await gateway.batches.insert(_batch(), idempotency_key="b-1", retention=RETENTION)


async def test_a_batch_tombstone_is_never_marked_accepted(gateway: Gateway) -> None:
    """A replay completing an interrupted batch marks it accepted last; had the batch been
    written off meanwhile, that mark must not bring back a record without its members."""
    record = _batch()
    await gateway.batches.insert(record, idempotency_key="b-2", retention=RETENTION)
    await gateway.batches.abandon(record.batch_id, now=NOW)
    await gateway.batches.mark_accepted(record.batch_id)
    stored = await gateway.raw["batches"].find_one({"_id": record.batch_id})
    assert stored["state"] == BatchState.ABANDONED
    assert await gateway.batches.find(record.batch_id, tenant_id=record.tenant_id) is None


async def test_an_accepted_batch_is_not_abandoned(gateway: Gateway) -> None:
    record = _batch()
    await gateway.batches.insert(record, idempotency_key=None, retention=RETENTION)
    await gateway.batches.mark_accepted(record.batch_id)
    await gateway.batches.abandon(record.batch_id, now=NOW)
    assert await gateway.batches.find(record.batch_id, tenant_id=record.tenant_id) is not None


async def test_the_sweep_does_not_send_a_refusal_until_it_is_written_off(
    gateway: Gateway,
) -> None:
    kept, refused = _command(), _command()
    for command in (kept, refused):
        await _record(gateway.submissions, command)
    refusals = Refusals()
    refusals.note(Refusal(refused.tenant_id, (refused.task_id,)))
    publisher = Recorded(gateway.broker)

    async def sweep() -> int:
        return await sweep_outbox(
            submissions=gateway.submissions,
            publisher=publisher,
            clock=lambda: NOW + timedelta(minutes=1),
            grace=timedelta(seconds=30),
            refusals=refusals,
            retention=SWEEP_RETENTION,
            batches=gateway.batches,
        )

    assert await sweep() == 1
    assert publisher.sent == [kept.task_id]
    written = await write_off(
        refusals, submissions=gateway.submissions, batches=gateway.batches, in_flight=None, now=NOW
    )
    assert written == 1
    assert refusals.pending() == []
    assert await sweep() == 0
    assert publisher.sent == [kept.task_id]


@contextlib.asynccontextmanager
async def _slow_client(mongo: Endpoint) -> AsyncIterator[tuple[SlowLink, Any]]:
    """A client through a slow link, connected while the link is still quick."""
    link = SlowLink.to_mongo(mongo.url)
    await link.start()
    client: AsyncMongoClient[Document] = AsyncMongoClient(
        link.mongo_url, tz_aware=True, socketTimeoutMS=TIMEOUT_MS, connectTimeoutMS=TIMEOUT_MS
    )
    try:
        await client.admin.command("ping")
        yield link, client
    finally:
        await client.close()
        await link.stop()


async def _written_off(refusals: Refusals, gateway: Gateway, in_flight: InFlight | None) -> None:
    async def done() -> bool:
        try:
            await write_off(
                refusals,
                submissions=gateway.submissions,
                batches=gateway.batches,
                in_flight=in_flight,
                now=NOW,
            )
        except DatabaseUnavailable:
            return False
        return True

    await eventually(done, timeout_s=30, what="the refusals written off")


async def test_the_sweep_announces_an_unmarked_cache_hit_again_and_never_scores_it(
    gateway: Gateway,
) -> None:
    """A cache hit answered 200 whose `accepted` mark was lost was sent as a command: the
    model scored it, and its poll and callback showed another score than the client had."""
    hit, plain = _command(), _command()
    await gateway.submissions.insert(
        hit,
        request_hash="h",
        idempotency_key=None,
        retention=RETENTION,
        cache_key="c",
        cached_result=ScoreResult(score=7, comment="Cached.", model="m"),
    )
    await _record(gateway.submissions, plain)
    publisher = Recorded(gateway.broker)

    swept = await _swept(gateway, publisher, at=NOW + timedelta(minutes=1))

    assert swept == 2
    assert (publisher.sent, publisher.announced) == ([plain.task_id], [hit.task_id])


@pytest.mark.parametrize("counted", [False, True], ids=["not counted", "counted in flight"])
async def test_a_refusal_the_database_cannot_undo_at_once_is_written_off_later(
    mongo: Endpoint,
    gateway: Gateway,
    amqp_url: str,
    score_queue_full: ScoreQueueFull,
    counted: bool,
) -> None:
    async with _slow_client(mongo) as (link, client):
        refusals = Refusals()
        in_flight = InFlight(client, gateway.name, max_per_tenant=10 if counted else 0)
        async with score_queue_full():
            with pytest.raises(BrokerUnavailable):
                await submit_score(
                    ScoreSubmission(text="Refused by the broker.", use_cache=False),
                    tenant_id="default",
                    idempotency_key=None,
                    submissions=Submissions(client, gateway.name),
                    publisher=Refusing(gateway.broker, link),
                    cache=ResultCache(client, gateway.name, timedelta(hours=1)),
                    policy=SubmitPolicy(max_attempts=3, retention=RETENTION),
                    clock=lambda: NOW,
                    refusals=refusals,
                    in_flight=in_flight,
                )
        [refusal] = refusals.pending()
        assert refusal.counted is counted
        [task_id] = refusal.task_ids
        # The projection's copy of the refused command, then the withdrawal that undoes it.
        copies = await _projections_copies(amqp_url, task_id)
        assert copies == [ScoreText.routing_key, ScoreWithdrawn.routing_key]
        link.reply_delay_s = 0
        counter = InFlight(gateway.raw.client, gateway.name, max_per_tenant=10)
        await _written_off(refusals, gateway, counter)
        stored = await gateway.raw["submissions"].find_one({"_id": task_id})
        assert stored["state"] == SubmissionState.ABANDONED
        assert await counter.count("default") == 0


async def test_a_submission_recorded_after_its_503_is_written_off_not_scored(
    mongo: Endpoint, gateway: Gateway
) -> None:
    async with _slow_client(mongo) as (link, client):
        submissions, refusals = Submissions(client, gateway.name), Refusals()
        publisher = Recorded(gateway.broker)
        link.reply_delay_s = HELD_S
        with pytest.raises(DatabaseUnavailable):
            await submit_score(
                ScoreSubmission(text="Recorded too late.", use_cache=False),
                tenant_id="default",
                idempotency_key="late-1",
                submissions=submissions,
                publisher=publisher,
                cache=ResultCache(client, gateway.name, timedelta(hours=1)),
                policy=SubmitPolicy(max_attempts=3, retention=RETENTION),
                clock=lambda: NOW,
                refusals=refusals,
            )
        [refusal] = refusals.pending()
        [task_id] = refusal.task_ids

        async def recorded() -> Document | None:
            found: Document | None = await gateway.raw["submissions"].find_one({"_id": task_id})
            return found

        landed = await eventually(recorded, timeout_s=30, what="the insert applied late")
        assert landed["state"] == SubmissionState.ACCEPTING  # what the outbox would send
        link.reply_delay_s = 0
        await _written_off(refusals, gateway, None)
        await sweep_outbox(
            submissions=submissions,
            publisher=publisher,
            clock=lambda: NOW + timedelta(hours=1),
            grace=timedelta(seconds=30),
            refusals=refusals,
            retention=SWEEP_RETENTION,
            batches=gateway.batches,
        )
        assert publisher.sent == []
        stored = await gateway.raw["submissions"].find_one({"_id": task_id})
        assert stored["state"] == SubmissionState.ABANDONED
        assert await gateway.submissions.find_by_key("late-1", tenant_id="default") is None


async def test_a_submission_never_sent_to_the_database_needs_no_writing_off(
    task_broker: RabbitBroker,
) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # a port nothing listens on
    port = closed.getsockname()[1]
    client: AsyncMongoClient[Document] = AsyncMongoClient(
        f"mongodb://127.0.0.1:{port}/?directConnection=true", timeoutMS=TIMEOUT_MS
    )
    refusals = Refusals()
    try:
        with pytest.raises(DatabaseUnavailable):
            await submit_score(
                ScoreSubmission(text="The database is down.", use_cache=False),
                tenant_id="default",
                idempotency_key=None,
                submissions=Submissions(client, "down_gateway"),
                publisher=Recorded(task_broker),
                cache=ResultCache(client, "down_gateway", timedelta(hours=1)),
                policy=SubmitPolicy(max_attempts=3, retention=RETENTION),
                clock=lambda: NOW,
                refusals=refusals,
            )
        assert refusals.pending() == []
    finally:
        await client.close()
        closed.close()


@dataclass
class Pause:
    """A step that waits until `go` is set (a broker or a database that slow)."""

    reached: asyncio.Event = field(default_factory=asyncio.Event)
    go: asyncio.Event = field(default_factory=asyncio.Event)

    async def __call__(self) -> None:
        self.reached.set()
        await self.go.wait()


def _submitted_refused(
    gateway: Gateway,
    publisher: RefusingBroker,
    refusals: Refusals,
    *,
    in_flight: SlowRelease | None = None,
) -> asyncio.Task[Any]:
    """A submission whose command the (full) score queue refuses, running as a task."""
    return asyncio.create_task(
        submit_score(
            ScoreSubmission(text="Refused by the broker.", use_cache=False),
            tenant_id="default",
            idempotency_key=None,
            submissions=gateway.submissions,
            publisher=publisher,
            cache=ResultCache(gateway.raw.client, gateway.name, timedelta(hours=1)),
            policy=SubmitPolicy(max_attempts=3, retention=RETENTION),
            clock=lambda: NOW,
            refusals=refusals,
            in_flight=in_flight,
        )
    )


class RefusingBroker(TaskPublisher):
    """The publisher on `broker`, whose command the broker refuses (the test makes the score
    queue full until the refusal is being undone); withdrawing it takes `withdrawal` before
    the publisher's own withdrawal is sent."""

    def __init__(self, broker: RabbitBroker, *, withdrawal: Pause | None = None) -> None:
        super().__init__(broker, clock=utcnow, timeout_s=PUBLISH_TIMEOUT_S)
        self.withdrawal = withdrawal

    async def withdraw(self, commands: Sequence[ScoreText]) -> None:
        if self.withdrawal is not None:
            await self.withdrawal()
        await super().withdraw(commands)

    async def announce_cached(self, command: ScoreText, result: ScoreResult) -> bool:
        raise AssertionError("nothing is cached here")


@dataclass
class SlowRelease:
    """An in-flight gate whose release takes `release_step`."""

    release_step: Pause | None = None
    enabled: bool = True

    async def acquire(self, tenant_id: str, tasks: int) -> None:
        return None

    async def refuse_if_full(self, tenant_id: str, tasks: int) -> None:
        return None

    async def release(self, tenant_id: str, task_id: str) -> None:
        if self.release_step is not None:
            await self.release_step()


@pytest.mark.parametrize("slow", ["withdrawal", "release"])
async def test_the_sweep_keeps_off_a_refusal_while_it_is_undone(
    gateway: Gateway, score_queue_full: ScoreQueueFull, slow: str
) -> None:
    """A refusal undone more slowly than the grace period (the command's withdrawal, a
    confirmed publish; the slot's release and the record's deletion, database round trips)
    was sent by the sweep meanwhile: scored, though its client was told nothing was kept.
    The score queue takes publishes again by the time the sweep runs: one it made of the
    refused command would be taken, as it was."""
    pause, publisher, refusals = Pause(), Recorded(gateway.broker), Refusals()
    broker = RefusingBroker(gateway.broker, withdrawal=pause if slow == "withdrawal" else None)
    gate = SlowRelease(release_step=pause if slow == "release" else None)
    async with score_queue_full():
        refused = _submitted_refused(gateway, broker, refusals, in_flight=gate)
        await asyncio.wait_for(pause.reached.wait(), timeout=10)

    swept = await sweep_outbox(
        submissions=gateway.submissions,
        publisher=publisher,
        clock=lambda: NOW + timedelta(minutes=1),
        grace=timedelta(seconds=30),
        refusals=refusals,
        retention=SWEEP_RETENTION,
        batches=gateway.batches,
    )

    pause.go.set()
    with pytest.raises(BrokerUnavailable):
        await refused
    assert (swept, publisher.sent) == (0, [])
    assert await gateway.submissions.interrupted(older_than=NOW + timedelta(days=2)) == []
    assert refusals.pending() == []


class FinishingMeanwhile(Recorded):
    """A sweep's publisher on `broker`: sending `first` takes as long as `refused` needs to
    finish (its pause let go)."""

    def __init__(
        self, broker: RabbitBroker, *, first: str, pause: Pause, refused: asyncio.Task[Any]
    ) -> None:
        super().__init__(broker)
        self.first, self.pause, self.refused = first, pause, refused

    async def send(self, command: ScoreText) -> bool:
        if command.task_id == self.first:
            self.pause.go.set()
            await asyncio.wait_for(asyncio.wait({self.refused}), timeout=10)
        return await super().send(command)


@pytest.mark.parametrize("chunk", [None, 1], ids=["one chunk", "a chunk per record"])
async def test_a_sweep_pass_started_during_a_refusal_does_not_send_it_once_it_is_done(
    gateway: Gateway,
    score_queue_full: ScoreQueueFull,
    monkeypatch: pytest.MonkeyPatch,
    chunk: int | None,
) -> None:
    """The pass read its list (an older interrupted submission, then the refused one) while
    the refusal was undone; by the time it reached the refused one, the refusal had deleted
    it, answered 503 and let go of it, and the pass sent it from its list all the same:
    scored, though its client was told nothing was kept. With a chunk per record, the
    refused one is no longer held when its chunk comes: only reading it again keeps it."""
    if chunk is not None:
        monkeypatch.setattr("services.gateway.submit.SWEEP_RECHECK_CHUNK", chunk)
    older = _command(NOW - timedelta(minutes=1))
    await _record(gateway.submissions, older)
    pause, refusals = Pause(), Refusals()
    async with score_queue_full():  # until the refusal is being undone: `older` is sent
        refused = _submitted_refused(
            gateway, RefusingBroker(gateway.broker, withdrawal=pause), refusals
        )
        await asyncio.wait_for(pause.reached.wait(), timeout=10)
    publisher = FinishingMeanwhile(
        gateway.broker, first=older.task_id, pause=pause, refused=refused
    )

    swept = await sweep_outbox(
        submissions=gateway.submissions,
        publisher=publisher,
        clock=lambda: NOW + timedelta(minutes=1),
        grace=timedelta(seconds=30),
        refusals=refusals,
        retention=SWEEP_RETENTION,
        batches=gateway.batches,
    )

    with pytest.raises(BrokerUnavailable):
        await refused
    assert (swept, publisher.sent) == (1, [older.task_id])
    assert await gateway.submissions.interrupted(older_than=NOW + timedelta(days=2)) == []
    assert await gateway.raw["submissions"].count_documents({}) == 1  # the older one, sent
    assert refusals.pending() == []


@pytest.mark.parametrize("counted", [True, False], ids=["slot-released", "slot-never-taken"])
async def test_a_refused_submission_a_replay_left_to_the_sweep_releases_no_slot_at_its_outcome(
    gateway: Gateway, counted: bool
) -> None:
    """Its refusal waits to be written off on one replica (its slot's release failed; or its
    insert timed out and landed, no slot taken) when a replay on another, past the grace,
    leaves it to the sweep: the tombstone is refused, the task is scored, and its outcome
    released a slot that was released already, or never taken (found in review)."""
    in_flight = InFlight(gateway.raw.client, gateway.name, max_per_tenant=1_000)
    created = datetime.now(UTC) - timedelta(seconds=120)
    command = ScoreText(task_id=new_id(), tenant_id="a", text="An essay.", submitted_at=created)
    await gateway.submissions.insert(
        command,
        request_hash="h",
        idempotency_key=f"k-{new_id()}",
        retention=timedelta(days=1),
        cache_key="c",
        counted=True,
    )
    if counted:
        await in_flight.acquire("a", 1)  # its slot
    await in_flight.acquire("a", 1)  # another task's, still in flight
    refusals = Refusals()
    refusals.note(Refusal("a", (command.task_id,), counted=counted))
    assert await gateway.submissions.leave_to_the_sweep(command.task_id)

    await write_off(
        refusals,
        submissions=gateway.submissions,
        batches=gateway.batches,
        in_flight=in_flight,
        now=datetime.now(UTC),
    )

    kept = await gateway.raw["submissions"].find_one({"_id": command.task_id})
    assert kept["state"] == "unconfirmed"
    assert "in_flight" not in kept  # its outcome releases nothing
    assert await in_flight.count("a") == 1


class RefusedWhileSending(Recorded):
    """A sweep's publisher on `broker`: while it sends the first command, this replica notes
    a refusal of `refused` (its request refusing it meanwhile)."""

    def __init__(self, broker: RabbitBroker, refusals: Refusals, refused: ScoreText) -> None:
        super().__init__(broker)
        self.refusals, self.refused = refusals, refused

    async def send(self, command: ScoreText) -> bool:
        if not self.sent:
            self.refusals.note(Refusal(self.refused.tenant_id, (self.refused.task_id,)))
        return await super().send(command)


async def test_a_submission_refused_while_its_chunk_is_being_sent_is_not_sent(
    gateway: Gateway,
) -> None:
    """The pass reads a chunk again before sending it; a refusal noted after that read,
    while an earlier record of the chunk was being sent, is checked before each send.
    Without that check (a mutant that survived the suite) the refused one was sent and
    scored, though its client was told nothing was kept."""
    first, refused = _command(NOW - timedelta(minutes=2)), _command(NOW - timedelta(minutes=1))
    await _record(gateway.submissions, first)
    await _record(gateway.submissions, refused)
    refusals = Refusals()
    publisher = RefusedWhileSending(gateway.broker, refusals, refused)

    await _swept(gateway, publisher, at=NOW + timedelta(minutes=1), refusals=refusals)

    assert publisher.sent == [first.task_id]


async def test_a_submission_younger_than_the_grace_is_left_to_its_request(
    gateway: Gateway,
) -> None:
    """Its request may still run on another replica, and may yet refuse it: the sweep sends
    only what has waited past `OUTBOX_GRACE_S`. A sweep that ignored the age (a mutant that
    survived the suite) sent it at once."""
    young = _command(NOW)
    await _record(gateway.submissions, young)
    publisher = Recorded(gateway.broker)

    swept = await _swept(gateway, publisher, at=NOW + timedelta(seconds=1))

    assert (swept, publisher.sent) == (0, [])
    assert [
        command.task_id
        for command in await gateway.submissions.interrupted(older_than=NOW + timedelta(days=2))
    ] == [young.task_id]


async def _swept(
    gateway: Gateway, publisher: Recorded, *, at: datetime, refusals: Refusals | None = None
) -> int:
    """One pass of the outbox sweep at `at`, with a grace of 30 s."""
    return await sweep_outbox(
        submissions=gateway.submissions,
        publisher=publisher,
        clock=lambda: at,
        grace=timedelta(seconds=30),
        refusals=Refusals() if refusals is None else refusals,
        retention=SWEEP_RETENTION,
        batches=gateway.batches,
    )
