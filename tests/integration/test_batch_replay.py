"""A batch whose request stopped part-way (its process died) is completed by a replay of the
request: every item ends up recorded and sent once, none is lost. On the real database."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from faststream.rabbit import RabbitBroker
from pymongo.errors import ServerSelectionTimeoutError

from devtools.infra import Endpoint
from services.gateway.batch_expiry import hold_unsent_batches
from services.gateway.batches import (
    HOLD_CHECK_AT,
    HOLD_LEAD,
    RECORDED,
    Batches,
    BatchPolicy,
    BatchState,
    BatchSubmission,
    BatchSubmitted,
    submit_batch,
)
from services.gateway.cache import ResultCache
from services.gateway.cancels import (
    BatchBeingRecorded,
    TaskBeingAccepted,
    cancel_batch,
    cancel_task,
)
from services.gateway.errors import (
    BrokerUnavailable,
    DatabaseUnavailable,
    GatewayError,
    IdempotencyConflict,
    ReplayUnfinished,
    RequestInProgress,
)
from services.gateway.limits import InFlight, LimitExceeded
from services.gateway.publisher import TaskPublisher
from services.gateway.refusals import Refusal, Refusals, write_off
from services.gateway.submissions import (
    BATCH_WRITE_CHUNK,
    BatchRow,
    Submissions,
    SubmissionState,
)
from services.gateway.submit import (
    INCOMPLETE_BATCH_HOLD,
    HeldBatches,
    incomplete_batch_held_until,
    settle_outcome,
    sweep_outbox,
)
from shared.contracts import (
    CancelTask,
    Phase,
    ScoreResult,
    ScoreText,
    ScoreWithdrawn,
    TaskCompleted,
    TaskView,
    event_sequence,
    new_id,
    utcnow,
)
from shared.topology import SCORE_REQUESTS, STATUS_PROJECTION
from tests.integration.gateway_records import (
    PUBLISH_TIMEOUT_S,
    Recorded,
    Unconfirmed,
    gateway_records,
)
from tests.integration.gateway_records import GatewayRecords as Gateway
from tests.integration.test_swept_reads import read_at
from tests.support import SWEEP_RETENTION, drain, queue_made_full, queued_commands

Document = dict[str, Any]
T0 = datetime(2030, 5, 17, 12, 0, tzinfo=UTC)
GRACE = timedelta(seconds=30)
POLICY = BatchPolicy(max_attempts=4, retention=timedelta(days=1), in_progress_for=GRACE)
TENANT = "tenant-a"
KEY = "batch-key-1"
FULL_POLICY = "scorebox-test-score-queue-full"
# The module's score queue refusing every publish for a block.
ScoreQueueFull = Callable[[], AbstractAsyncContextManager[None]]


class ProcessDied(BaseException):
    """Stands for the gateway process ending where it is raised: nothing after it runs."""


class Dying(Recorded):
    """A publisher whose process ends at the batch's publish."""

    async def send_many(self, commands: Sequence[ScoreText]) -> bool:
        raise ProcessDied


@pytest.fixture
async def gateway(
    mongo: Endpoint, db_prefix: str, task_broker: RabbitBroker
) -> AsyncIterator[Gateway]:
    async with gateway_records(mongo.url, db_prefix, task_broker) as records:
        yield records


def _request(count: int) -> BatchSubmission:
    return BatchSubmission.model_validate(
        {"rubric": "clarity", "items": [{"text": f"Essay number {i}."} for i in range(count)]}
    )


async def _submit(
    gateway: Gateway,
    request: BatchSubmission,
    broker: Recorded,
    at: datetime,
    submissions: Submissions | None = None,
    *,
    batches: Batches | None = None,
    refusals: Refusals | None = None,
    key: str | None = KEY,
    in_flight: InFlight | None = None,
) -> BatchSubmitted:
    return await submit_batch(
        request,
        tenant_id=TENANT,
        api_key_id=None,
        idempotency_key=key,
        batches=batches or gateway.batches,
        submissions=submissions or gateway.submissions,
        publisher=broker,
        policy=POLICY,
        clock=lambda: at,
        refusals=refusals or Refusals(),
        in_flight=in_flight,
    )


async def _interrupted(gateway: Gateway, request: BatchSubmission, recorded: int) -> str:
    """The records of a request whose process died after recording the batch and only its
    first `recorded` submissions; returns the batch's id."""
    with pytest.raises(ProcessDied):
        await _submit(gateway, request, Dying(gateway.broker), T0)
    batch = await gateway.raw["batches"].find_one({"idempotency_key": KEY})
    await gateway.raw["submissions"].delete_many(
        {"batch_id": batch["_id"], "command.batch_index": {"$gte": recorded}}
    )
    if recorded < len(request.items):  # it died before noting the batch recorded whole
        await gateway.raw["batches"].update_one({"_id": batch["_id"]}, {"$set": {RECORDED: False}})
    return str(batch["_id"])


async def _stored(gateway: Gateway, batch_id: str) -> dict[int, Document]:
    cursor = gateway.raw["submissions"].find({"batch_id": batch_id})
    return {document["command"]["batch_index"]: document async for document in cursor}


async def test_a_replay_records_what_the_interrupted_batch_had_not_and_all_is_sent_once(
    gateway: Gateway, amqp_url: str
) -> None:
    await queued_commands(amqp_url)  # what the module's earlier tests sent
    count = BATCH_WRITE_CHUNK + 50  # it died between two chunks of its submissions
    request = _request(count)
    batch_id = await _interrupted(gateway, request, recorded=BATCH_WRITE_CHUNK)
    swept_before = Recorded(gateway.broker)  # a sweep during the grace period sent one of them
    first = (await _stored(gateway, batch_id))[0]
    await swept_before.send(ScoreText.model_validate(first["command"]))
    await gateway.submissions.mark_accepted(first["_id"])

    replay = await _submit(
        gateway, request, Recorded(gateway.broker), T0 + GRACE + timedelta(seconds=1)
    )

    assert not replay.created
    assert replay.record.batch_id == batch_id
    stored = await _stored(gateway, batch_id)
    members = [member.task_id for member in replay.record.members]
    assert sorted(stored) == list(range(count))
    assert [stored[index]["_id"] for index in range(count)] == members
    assert stored[0]["state"] == SubmissionState.ACCEPTED  # what was there is left as it is
    for index in range(1, count):
        command = ScoreText.model_validate(stored[index]["command"])
        assert stored[index]["state"] == SubmissionState.ACCEPTING
        assert stored[index]["created_at"] == T0
        assert (command.text, command.rubric, command.batch_index) == (
            f"Essay number {index}.",
            "clarity",
            index,
        )
    batch = await gateway.raw["batches"].find_one({"_id": batch_id})
    assert batch["state"] == BatchState.ACCEPTED

    sweep = Recorded(gateway.broker)
    while await sweep_outbox(
        submissions=gateway.submissions,
        publisher=sweep,
        clock=lambda: T0 + GRACE + timedelta(seconds=2),
        grace=GRACE,
        refusals=Refusals(),
        retention=SWEEP_RETENTION,
        batches=gateway.batches,
    ):
        pass
    assert sorted(swept_before.sent + sweep.sent) == sorted(members)  # each sent exactly once
    # And each reached the scorer's queue once, the replay's request sending none of them.
    assert sorted(command.task_id for command in await queued_commands(amqp_url)) == sorted(members)


async def _swept_at(
    gateway: Gateway, at: datetime, *, held: HeldBatches | None = None
) -> list[str]:
    sweep = Recorded(gateway.broker)
    while await sweep_outbox(
        submissions=gateway.submissions,
        publisher=sweep,
        clock=lambda: at,
        grace=GRACE,
        refusals=Refusals(),
        retention=SWEEP_RETENTION,
        batches=gateway.batches,
        held=held,
    ):
        pass
    return sweep.sent


async def _states(gateway: Gateway, task_ids: list[str]) -> list[str]:
    found = gateway.raw["submissions"].find({"_id": {"$in": task_ids}}, projection={"state": 1})
    return [document["state"] async for document in found]


async def test_a_batch_its_request_left_incomplete_is_held_for_a_replay_then_refused_whole(
    gateway: Gateway,
) -> None:
    """Its request died before it recorded every item: it published nothing and answered
    nothing. The sweep sent the recorded items all the same, and the rest never ran (a
    walkthrough: 200 of 1,000 scored, 800 read `queued`, then `expired`)."""
    request = _request(5)
    batch_id = await _interrupted(gateway, request, recorded=2)

    # While a replay may complete it: neither sent nor refused.
    assert await _swept_at(gateway, T0 + GRACE + timedelta(seconds=2)) == []
    recorded = [document["_id"] for document in (await _stored(gateway, batch_id)).values()]
    assert await _states(gateway, recorded) == [SubmissionState.ACCEPTING] * 2
    assert (await gateway.raw["batches"].find_one({"_id": batch_id}))["state"] == "accepting"

    # Then refused whole, its key freed: a replay records the batch anew.
    later = T0 + INCOMPLETE_BATCH_HOLD + timedelta(seconds=1)
    assert await _swept_at(gateway, later) == []
    assert await _states(gateway, recorded) == [SubmissionState.ABANDONED] * 2
    assert (await gateway.raw["batches"].find_one({"_id": batch_id}))["state"] == "abandoned"
    replay = await _submit(gateway, request, Recorded(gateway.broker), later)
    assert replay.created
    assert replay.record.batch_id != batch_id


class DiesRecordingItems(Submissions):
    """Submissions whose process ends at the batch's first chunk of items: the batch's record
    is in, none of its items (`batch_id` notes which batch)."""

    batch_id: str | None = None

    async def insert_batch(self, commands: list[BatchRow], *_: Any, **__: Any) -> None:
        self.batch_id = commands[0][0].batch_id
        raise ProcessDied


async def _expiry_look(gateway: Gateway, at: datetime) -> None:
    await hold_unsent_batches(
        batches=gateway.batches,
        submissions=gateway.submissions,
        now=at,
        retention=POLICY.retention,
        in_progress_for=GRACE,
    )


async def test_a_batch_its_request_left_without_any_item_is_refused_whole_after_the_hold(
    gateway: Gateway,
) -> None:
    """The sweep finds an incomplete batch by its recorded items: one whose request died
    before the first of them landed was never refused. It was listed, its items read
    `expired` as if scored, and a cancel was told to wait for a refusal due long before,
    for a day (a review). Its expiry look now comes at the end of its hold."""
    request = _request(3)
    with pytest.raises(ProcessDied):
        await _submit(
            gateway,
            request,
            Recorded(gateway.broker),
            T0,
            DiesRecordingItems(gateway.raw.client, gateway.name),
        )
    batch = await gateway.raw["batches"].find_one({"idempotency_key": KEY})
    held_until = T0 + INCOMPLETE_BATCH_HOLD

    await _expiry_look(gateway, held_until - timedelta(seconds=1))  # a replay may come yet
    assert (await gateway.raw["batches"].find_one({"_id": batch["_id"]}))["state"] == "accepting"

    await _expiry_look(gateway, held_until + timedelta(seconds=1))
    refused = await gateway.raw["batches"].find_one({"_id": batch["_id"]})
    assert refused["state"] == "abandoned"
    assert "idempotency_key" not in refused
    replay = await _submit(
        gateway, request, Recorded(gateway.broker), held_until + timedelta(seconds=2)
    )
    assert replay.created  # its key free: the batch recorded anew, and sent
    assert replay.record.batch_id != batch["_id"]


async def test_a_batch_its_request_recorded_whole_is_not_looked_at_before_its_expiry(
    gateway: Gateway,
) -> None:
    submitted = await _submit(gateway, _request(2), Recorded(gateway.broker), T0)
    stored = await gateway.raw["batches"].find_one({"_id": submitted.record.batch_id})
    assert stored[HOLD_CHECK_AT] == T0 + POLICY.retention - HOLD_LEAD

    await _expiry_look(gateway, T0 + INCOMPLETE_BATCH_HOLD + timedelta(seconds=1))
    stored = await gateway.raw["batches"].find_one({"_id": submitted.record.batch_id})
    assert (stored["state"], stored[HOLD_CHECK_AT]) == (
        "accepted",
        T0 + POLICY.retention - HOLD_LEAD,
    )


async def test_a_batch_its_request_recorded_whole_before_dying_is_sent_by_the_sweep(
    gateway: Gateway,
) -> None:
    """Recorded whole, it may have been published (and answered): the sweep sends it."""
    request = _request(3)
    batch_id = await _interrupted(gateway, request, recorded=3)
    members = sorted(document["_id"] for document in (await _stored(gateway, batch_id)).values())

    assert sorted(await _swept_at(gateway, T0 + GRACE + timedelta(seconds=2))) == members


class RecordedSlowly(Submissions):
    """A request recording its batch so slowly that `meanwhile` runs between its first item
    and the rest (on another replica, say, or its client's replay)."""

    def __init__(self, gateway: Gateway, meanwhile: Callable[[], Awaitable[None]]) -> None:
        super().__init__(gateway.raw.client, gateway.name)
        self._meanwhile = meanwhile

    async def insert_batch(
        self,
        commands: list[BatchRow],
        *,
        retention: timedelta,
        counted: bool = False,
    ) -> None:
        await super().insert_batch(commands[:1], retention=retention, counted=counted)
        await self._meanwhile()
        await super().insert_batch(commands[1:], retention=retention, counted=counted)


async def test_a_request_whose_batch_the_sweep_refused_as_interrupted_keeps_nothing(
    gateway: Gateway,
) -> None:
    """The sweep's refusal and the request's note that it recorded every item are one
    conditional write each: whichever comes second fails, and the request answers 503."""
    swept: list[str] = []

    async def sweep_past_the_hold() -> None:
        swept.extend(await _swept_at(gateway, T0 + INCOMPLETE_BATCH_HOLD * 2))

    broker = Recorded(gateway.broker)
    slow = RecordedSlowly(gateway, sweep_past_the_hold)

    with pytest.raises(DatabaseUnavailable, match="refused; nothing was kept"):
        await _submit(gateway, _request(3), broker, T0, submissions=slow)

    assert broker.sent == []
    assert swept == []
    states = [d["state"] async for d in gateway.raw["submissions"].find({}, {"state": 1})]
    assert states == [SubmissionState.ABANDONED] * 3
    assert await _swept_at(gateway, T0 + INCOMPLETE_BATCH_HOLD * 3) == []


async def test_a_slow_request_whose_batch_a_replay_accepted_answers_it_and_counts_nothing(
    gateway: Gateway,
) -> None:
    """It took the replay's acceptance for the sweep's refusal and tombstoned every item of
    a batch answered 200 (a review); then, going on to count and send it, it took a slot for
    each item though the replay's carry no in-flight mark, and those were never released
    (its review). Now it answers the batch as the replay did, and the sweep sends it."""
    request = _request(3)
    replays: list[BatchSubmitted] = []

    async def replayed_past_the_grace() -> None:
        later = T0 + GRACE + timedelta(seconds=1)
        replays.append(await _submit(gateway, request, Recorded(gateway.broker), later))

    broker = Recorded(gateway.broker)
    in_flight = InFlight(gateway.raw.client, gateway.name, max_per_tenant=100)
    slow = RecordedSlowly(gateway, replayed_past_the_grace)

    answer = await _submit(gateway, request, broker, T0, slow, in_flight=in_flight)

    [replay] = replays
    assert not replay.created
    assert not answer.created
    assert answer.record.batch_id == replay.record.batch_id
    members = [member.task_id for member in answer.record.members]
    assert broker.sent == []
    assert sorted(await _swept_at(gateway, T0 + GRACE + timedelta(seconds=3))) == sorted(members)
    await _scored(gateway, members, in_flight)
    assert await in_flight.count(TENANT) == 0


class Cancels(TaskPublisher):
    """The gateway's publisher on the test's broker, remembering the task ids of the
    cancellations it sent, a batch's (`cancel_many`) or a single task's (`cancel`), once the
    broker confirmed them (the vhost's task-cancels queue takes them; no scorer reads it)."""

    def __init__(self, broker: RabbitBroker) -> None:
        super().__init__(broker, clock=utcnow, timeout_s=PUBLISH_TIMEOUT_S)
        self.cancelled: list[str] = []

    async def cancel(self, cancel: CancelTask) -> None:
        await super().cancel(cancel)
        self.cancelled.append(cancel.task_id)

    async def cancel_many(self, cancels: Sequence[CancelTask]) -> None:
        await super().cancel_many(cancels)
        self.cancelled.extend(cancel.task_id for cancel in cancels)


async def _cancel(gateway: Gateway, batch_id: str, sender: Cancels, at: datetime = T0) -> None:
    await cancel_batch(
        batch_id,
        tenant_id=TENANT,
        batches=gateway.batches,
        submissions=gateway.submissions,
        sender=sender,
        now=at,
        grace=GRACE,
    )


def _cancel_refused(
    gateway: Gateway, cancels: Cancels, refusals: list[BatchBeingRecorded]
) -> Callable[[], Awaitable[None]]:
    """A cancel of the tenant's newest batch, from a client that lists its batches, which
    must be refused (kept in `refusals`)."""

    async def cancelled_meanwhile() -> None:
        [batch] = await gateway.batches.newest(TENANT, now=T0, after=None, limit=10)
        with pytest.raises(BatchBeingRecorded) as refused:
            await _cancel(gateway, batch.batch_id, cancels)
        refusals.append(refused.value)

    return cancelled_meanwhile


async def test_a_batch_cancelled_while_its_items_are_recorded_is_refused_until_they_are(
    gateway: Gateway,
) -> None:
    """The batch is listed, and found, from its record's insert on: a cancel then sent its
    recorded items' cancellations only and answered 202, and the request went on to send
    the rest, scored (a review). Now nothing is cancelled until every item is recorded."""
    cancels = Cancels(gateway.broker)
    refusals: list[BatchBeingRecorded] = []
    cancelled_meanwhile = _cancel_refused(gateway, cancels, refusals)

    broker = Recorded(gateway.broker)
    answer = await _submit(
        gateway, _request(3), broker, T0, RecordedSlowly(gateway, cancelled_meanwhile)
    )

    assert "1 of its 3 items recorded" in str(refusals[0])
    assert cancels.cancelled == []
    await _cancel(gateway, answer.record.batch_id, cancels)
    assert sorted(cancels.cancelled) == sorted(broker.sent)
    assert len(cancels.cancelled) == 3


class CancelledBeforeSending(Recorded):
    """A broker whose first `send_many` waits for `meanwhile` (a cancel of the batch, from a
    client that lists its batches) before it takes the commands."""

    def __init__(self, broker: RabbitBroker, meanwhile: Callable[[], Awaitable[None]]) -> None:
        super().__init__(broker)
        self._meanwhile: Callable[[], Awaitable[None]] | None = meanwhile

    async def send_many(self, commands: Sequence[ScoreText]) -> bool:
        if self._meanwhile is not None:
            meanwhile, self._meanwhile = self._meanwhile, None
            await meanwhile()
        return await super().send_many(commands)


async def test_a_batch_recorded_whole_is_not_cancelled_while_its_request_sends_it(
    gateway: Gateway,
) -> None:
    """Between recording its items and sending them, a request took their in-flight slots:
    a cancel then had every item's outcome give its slot back first, and the tenant's count
    stayed three too high for good (review of batches)."""
    cancels = Cancels(gateway.broker)
    refusals: list[BatchBeingRecorded] = []
    cancelled_meanwhile = _cancel_refused(gateway, cancels, refusals)

    broker = CancelledBeforeSending(gateway.broker, cancelled_meanwhile)
    in_flight = InFlight(gateway.raw.client, gateway.name, max_per_tenant=100)
    answer = await _submit(gateway, _request(3), broker, T0, in_flight=in_flight)

    assert "is still being accepted (3 of its 3 items recorded)" in str(refusals[0])
    assert cancels.cancelled == []
    await _cancel(gateway, answer.record.batch_id, cancels)
    assert sorted(cancels.cancelled) == sorted(broker.sent)


class NoStatus:
    """A status service that knows no task (`StatusReader`)."""

    async def find(self, task_id: str, *, tenant_id: str) -> TaskView | None:
        return None


async def test_an_item_is_not_cancelled_while_its_batchs_request_sends_it(
    gateway: Gateway,
) -> None:
    """The batch's items are listed from its insert on: an item's own cancel sent between
    its record and its slot had its outcome give the slot back before the request took
    it, and the tenant's count stayed one too high for good (re-read of the batch cancel's
    fix)."""
    sender = Cancels(gateway.broker)
    refusals: list[TaskBeingAccepted] = []

    async def cancel(task_id: str) -> object:
        return await cancel_task(
            task_id,
            tenant_id=TENANT,
            submissions=gateway.submissions,
            status=NoStatus(),
            sender=sender,
            now=T0,
            grace=GRACE,
        )

    async def item_cancelled_meanwhile() -> None:
        [batch] = await gateway.batches.newest(TENANT, now=T0, after=None, limit=10)
        record = await gateway.batches.find(batch.batch_id, tenant_id=TENANT)
        assert record is not None
        with pytest.raises(TaskBeingAccepted) as refused:
            await cancel(record.members[0].task_id)
        refusals.append(refused.value)

    broker = CancelledBeforeSending(gateway.broker, item_cancelled_meanwhile)
    in_flight = InFlight(gateway.raw.client, gateway.name, max_per_tenant=100)
    answer = await _submit(gateway, _request(3), broker, T0, in_flight=in_flight)

    assert "still being accepted" in str(refusals[0])
    assert sender.cancelled == []
    first = answer.record.members[0].task_id
    assert isinstance(await cancel(first), CancelTask)
    assert sender.cancelled == [first]
    # A task of its own left `accepting` (a database blip after its 202): its id came with
    # its 202, its slot was taken before, and its cancel goes ahead (the re-read).
    single = ScoreText(task_id=new_id(), tenant_id=TENANT, text="One text.", submitted_at=T0)
    await gateway.submissions.insert(
        single, request_hash="h", idempotency_key=None, retention=timedelta(days=1), cache_key="k"
    )
    assert isinstance(await cancel(single.task_id), CancelTask)


async def _acceptance(gateway: Gateway, batch_id: str, at: datetime) -> tuple[str, object]:
    """How the batch's read says it was accepted, at `at`, the status service having heard
    of none of its items."""
    page = await read_at(gateway, batch_id, at)
    return page.acceptance, page.refused_at


async def test_a_batch_its_request_died_in_reads_incomplete_until_it_is_refused(
    gateway: Gateway,
) -> None:
    """It read as every item `queued` until, at the end of its hold, it was refused whole
    and gone, none of them scored (a walkthrough: a gateway killed under a batch of 1,000)."""
    batch_id = await _interrupted(gateway, _request(3), recorded=1)

    assert await _acceptance(gateway, batch_id, T0 + GRACE / 2) == ("accepting", None)
    held_until = incomplete_batch_held_until(T0, grace=GRACE)
    assert await _acceptance(gateway, batch_id, T0 + GRACE * 2) == ("incomplete", held_until)
    accepted = await _submit(gateway, _request(2), Recorded(gateway.broker), T0, key="another-key")
    assert await _acceptance(gateway, accepted.record.batch_id, T0) == ("accepted", None)


async def test_a_batch_held_for_its_replay_is_not_cancelled_in_part(gateway: Gateway) -> None:
    """Its request died after recording two of five items: a cancel of those two, then the
    replay recording and sending the other three, scored them after a 202. Past the grace
    the refusal says why, and asks again no sooner than the request has run (a fixed second
    had a client ask some 600 times over the hold; a review)."""
    batch_id = await _interrupted(gateway, _request(5), recorded=2)
    cancels = Cancels(gateway.broker)
    with pytest.raises(BatchBeingRecorded, match="2 of its 5 items") as young:
        await _cancel(gateway, batch_id, cancels)
    assert young.value.retry_after_s == 1
    with pytest.raises(BatchBeingRecorded, match="left incomplete by its request") as held:
        await _cancel(gateway, batch_id, cancels, at=T0 + GRACE * 2)
    assert held.value.retry_after_s == (GRACE * 2).total_seconds()
    assert "a replay of it with its Idempotency-Key completes it" in str(held.value)
    assert cancels.cancelled == []


async def test_a_keyless_batch_left_incomplete_is_not_offered_a_replay(gateway: Gateway) -> None:
    """Nothing can complete a batch submitted without a key: the cancel's 409 offered "a
    replay of it with its Idempotency-Key" all the same (a review)."""
    dying = DiesRecordingItems(gateway.raw.client, gateway.name)
    with pytest.raises(ProcessDied):
        await _submit(gateway, _request(3), Recorded(gateway.broker), T0, dying, key=None)
    assert dying.batch_id is not None
    with pytest.raises(BatchBeingRecorded) as held:
        await _cancel(gateway, dying.batch_id, Cancels(gateway.broker), at=T0 + GRACE * 2)
    assert "left incomplete by its request (0 of its 3 items recorded)" in str(held.value)
    assert "is refused whole at 2030-05-17T12:10:00" in str(held.value)
    assert "Idempotency-Key" not in str(held.value)


@pytest.mark.parametrize("swept", [False, True], ids=["recorded-whole", "swept"])
async def test_a_batch_recorded_whole_is_cancelled_though_an_item_has_expired(
    gateway: Gateway, swept: bool
) -> None:
    """Its request died after recording every item, and the sweep sent them: the batch stays
    `accepting`, and its first items expire before its record. Counted, it read as still
    being recorded, 409 until the record expired (a review)."""
    batch_id = await _interrupted(gateway, _request(3), recorded=3)
    if swept:
        await gateway.raw["batches"].update_one(
            {"_id": batch_id}, {"$set": {"swept": True, RECORDED: False}}
        )
    stored = await _stored(gateway, batch_id)
    await gateway.raw["submissions"].delete_one({"_id": stored[0]["_id"]})
    cancels = Cancels(gateway.broker)
    await _cancel(gateway, batch_id, cancels, at=T0 + GRACE * 2)  # its request is over
    assert sorted(cancels.cancelled) == sorted(stored[i]["_id"] for i in (1, 2))


async def test_a_batch_held_for_a_replay_keeps_no_other_submission_waiting(
    gateway: Gateway, stalled_broker: RabbitBroker
) -> None:
    """Its items, the oldest unsent, filled the sweep's list (500 a pass) for the whole
    hold: a batch answered 202 but not confirmed waited ten minutes (a review)."""
    await _interrupted(gateway, _request(1000), recorded=600)
    at_once = T0 + timedelta(seconds=1)
    answered = await _submit(
        gateway, _request(3), Unconfirmed(stalled_broker), at_once, key="another"
    )
    held = HeldBatches()
    at = T0 + GRACE + timedelta(seconds=2)

    first = await _swept_at(gateway, at, held=held)  # learns which batch it holds
    second = await _swept_at(gateway, at + timedelta(seconds=10), held=held)

    assert first + second == [member.task_id for member in answered.record.members]


async def test_a_held_batch_a_replay_completed_is_sent_at_the_next_pass(
    gateway: Gateway,
) -> None:
    """Left out of the sweep's lists until its hold ended, a batch answered 200 by its
    replay waited up to ten minutes for its items to be sent (a review)."""
    request = _request(4)
    batch_id = await _interrupted(gateway, request, recorded=2)
    held = HeldBatches()
    at = T0 + GRACE + timedelta(seconds=2)
    assert await _swept_at(gateway, at, held=held) == []  # held, and remembered so

    replay = await _submit(gateway, request, Recorded(gateway.broker), at + timedelta(seconds=1))
    sent = await _swept_at(gateway, at + timedelta(seconds=10), held=held)

    assert replay.record.batch_id == batch_id
    assert sorted(sent) == sorted(member.task_id for member in replay.record.members)


async def test_a_batch_of_an_earlier_build_is_never_refused_as_interrupted(
    gateway: Gateway,
) -> None:
    """An earlier build writes no `recorded`: its request, slow past the hold during a
    rolling upgrade, would publish and answer 202 a batch refused under it (a review)."""
    batch_id = await _interrupted(gateway, _request(3), recorded=2)
    await gateway.raw["batches"].update_one({"_id": batch_id}, {"$unset": {RECORDED: ""}})

    sent = await _swept_at(gateway, T0 + INCOMPLETE_BATCH_HOLD * 2)

    assert len(sent) == 2  # its recorded items, as before
    assert (await gateway.raw["batches"].find_one({"_id": batch_id}))["state"] == "accepting"


async def test_a_second_replay_changes_nothing(gateway: Gateway) -> None:
    request = _request(3)
    batch_id = await _interrupted(gateway, request, recorded=1)
    later = T0 + GRACE + timedelta(seconds=1)
    await _submit(gateway, request, Recorded(gateway.broker), later)
    before = await _stored(gateway, batch_id)

    again = await _submit(gateway, request, Recorded(gateway.broker), later + timedelta(seconds=5))

    assert again.record.batch_id == batch_id
    assert not again.created
    assert await _stored(gateway, batch_id) == before


async def test_a_replay_within_the_grace_period_is_told_to_wait_and_records_nothing(
    gateway: Gateway,
) -> None:
    request = _request(3)
    batch_id = await _interrupted(gateway, request, recorded=1)

    with pytest.raises(RequestInProgress):
        await _submit(gateway, request, Recorded(gateway.broker), T0 + GRACE - timedelta(seconds=1))

    assert sorted(await _stored(gateway, batch_id)) == [0]
    batch = await gateway.raw["batches"].find_one({"_id": batch_id})
    assert batch["state"] == BatchState.ACCEPTING


@pytest.mark.parametrize(("ran_s", "told_s"), [(0, 1), (5, 5), (25, 5)])
async def test_a_replay_within_the_grace_period_is_told_to_wait_as_long_as_its_request_ran(
    gateway: Gateway, ran_s: int, told_s: int
) -> None:
    """Up to the grace's end: a fixed second had a client whose gateway died mid-batch ask
    sixty times before the replay could complete it (a walkthrough)."""
    request = _request(3)
    await _interrupted(gateway, request, recorded=1)

    with pytest.raises(RequestInProgress) as replay:
        await _submit(gateway, request, Recorded(gateway.broker), T0 + timedelta(seconds=ran_s))

    assert replay.value.retry_after_s == told_s


async def test_a_replay_with_another_body_is_a_conflict_even_while_the_first_runs(
    gateway: Gateway,
) -> None:
    """Told "still being accepted, retry shortly", a client misusing its key retried for as
    long as the first request ran, and only then learned of the conflict (found in review)."""
    batch_id = await _interrupted(gateway, _request(3), recorded=1)

    with pytest.raises(IdempotencyConflict):
        await _submit(
            gateway, _request(4), Recorded(gateway.broker), T0 + GRACE - timedelta(seconds=1)
        )

    assert sorted(await _stored(gateway, batch_id)) == [0]


async def _sent_by_sweeps(gateway: Gateway, refusals: Refusals) -> list[str]:
    sweep = Recorded(gateway.broker)
    while await sweep_outbox(
        submissions=gateway.submissions,
        publisher=sweep,
        clock=lambda: T0 + GRACE + timedelta(seconds=2),
        grace=GRACE,
        refusals=refusals,
        retention=SWEEP_RETENTION,
        batches=gateway.batches,
    ):
        pass
    return sweep.sent


async def _projections_copies(amqp_url: str, task_ids: Sequence[str]) -> dict[str, list[str]]:
    """The routing keys of what the status projection's queue holds of each of `task_ids`, in
    order (the queue drained: nothing consumes it here)."""
    copies: dict[str, list[str]] = {task_id: [] for task_id in task_ids}
    for message in await drain(amqp_url, STATUS_PROJECTION.name):
        if message.correlation_id in copies:
            copies[message.correlation_id].append(message.routing_key or "")
    return copies


async def _refused(gateway: Gateway, request: BatchSubmission) -> tuple[str, Refusals]:
    """A batch refused part-way (503) whose write-off has not run yet (the database was away
    for longer than the grace period): its records and its pending refusal."""
    batch_id = await _interrupted(gateway, request, recorded=1)
    batch = await gateway.raw["batches"].find_one({"_id": batch_id})
    refusals = Refusals()
    task_ids = tuple(member["task_id"] for member in batch["members"])
    refusals.note(Refusal(TENANT, task_ids, batch_id=batch_id))
    return batch_id, refusals


async def _write_off(gateway: Gateway, refusals: Refusals) -> None:
    await write_off(
        refusals,
        submissions=gateway.submissions,
        batches=gateway.batches,
        in_flight=None,
        now=T0 + GRACE + timedelta(seconds=2),
    )


async def test_a_refused_batch_a_replay_accepted_before_its_write_off_is_sent(
    gateway: Gateway,
) -> None:
    """The replay answered 200: its items must be scored, not turned into tombstones by the
    write-off that comes after it."""
    request = _request(3)
    batch_id, refusals = await _refused(gateway, request)
    replay = await _submit(
        gateway, request, Recorded(gateway.broker), T0 + GRACE + timedelta(seconds=1)
    )

    await _write_off(gateway, refusals)

    members = sorted(member.task_id for member in replay.record.members)
    assert sorted(await _sent_by_sweeps(gateway, refusals)) == members
    batch = await gateway.raw["batches"].find_one({"_id": batch_id})
    assert batch["state"] == BatchState.ACCEPTED


class WrittenOffMeanwhile(Submissions):
    """The replay's records land as the batch's write-off runs (on another replica, say)."""

    def __init__(self, gateway: Gateway, refusals: Refusals) -> None:
        super().__init__(gateway.raw.client, gateway.name)
        self._meanwhile = (gateway, refusals)

    async def insert_batch(
        self,
        commands: list[BatchRow],
        *,
        retention: timedelta,
        counted: bool = False,
    ) -> None:
        await super().insert_batch(commands, retention=retention, counted=counted)
        await _write_off(*self._meanwhile)


async def test_a_replay_of_a_batch_written_off_meanwhile_is_refused(gateway: Gateway) -> None:
    request = _request(3)
    batch_id, refusals = await _refused(gateway, request)

    with pytest.raises(DatabaseUnavailable):
        await _submit(
            gateway,
            request,
            Recorded(gateway.broker),
            T0 + GRACE + timedelta(seconds=1),
            submissions=WrittenOffMeanwhile(gateway, refusals),
        )

    assert await _sent_by_sweeps(gateway, refusals) == []
    batch = await gateway.raw["batches"].find_one({"_id": batch_id})
    assert batch["state"] == BatchState.ABANDONED


async def test_a_replay_of_a_batch_whose_insert_timed_out_and_was_written_off_keeps_nothing(
    gateway: Gateway,
) -> None:
    """The refusal of a batch whose insert timed out names no submissions (none were
    written). A replay after the grace period recorded them all, found the batch written
    off, and answered 503, leaving them to the outbox sweep, which sent every one."""
    request = _request(3)
    batch_id = await _interrupted(gateway, request, recorded=0)
    refusals = Refusals()
    refusals.note(Refusal(TENANT, (), batch_id=batch_id))

    with pytest.raises(DatabaseUnavailable):
        await _submit(
            gateway,
            request,
            Recorded(gateway.broker),
            T0 + GRACE + timedelta(seconds=1),
            submissions=WrittenOffMeanwhile(gateway, refusals),
        )

    assert await _sent_by_sweeps(gateway, refusals) == []


class AcceptanceLost(Batches):
    """Marking a batch accepted fails (the database away)."""

    async def mark_accepted(self, batch_id: str) -> bool:
        raise DatabaseUnavailable("timed out")


async def test_a_replay_that_cannot_mark_its_batch_accepted_leaves_it_to_the_sweep(
    gateway: Gateway,
) -> None:
    """The batch is its first request's, which may have sent it (the process died after the
    publish): the replay answers "retry with the same key" and leaves it `accepting`, and the
    sweep sends every item, those the replay recorded too. Its write-off made the batch a
    tombstone, so a batch possibly sent read 404 and the next replay created it again."""
    request = _request(3)
    batch_id = await _interrupted(gateway, request, recorded=1)
    refusals = Refusals()

    with pytest.raises(RequestInProgress):
        await _submit(
            gateway,
            request,
            Recorded(gateway.broker),
            T0 + GRACE + timedelta(seconds=1),
            batches=AcceptanceLost(gateway.raw.client, gateway.name),
            refusals=refusals,
        )
    await _write_off(gateway, refusals)

    batch = await gateway.raw["batches"].find_one({"_id": batch_id})
    assert batch["state"] == BatchState.ACCEPTING
    members = sorted(member["task_id"] for member in batch["members"])
    assert sorted(await _sent_by_sweeps(gateway, refusals)) == members  # each once
    later = await _submit(
        gateway, request, Recorded(gateway.broker), T0 + GRACE + timedelta(seconds=3)
    )
    assert (later.created, later.record.batch_id) == (False, batch_id)


async def test_a_replay_failing_after_its_batch_was_written_off_leaves_its_records_to_the_write_off(
    gateway: Gateway,
) -> None:
    """The batch's own refusal (its insert timed out: it names no items) is written off while
    the replay records the items, and the replay then fails on the database: what it recorded
    is written off too, not sent, though the replay left the batch alone."""
    request = _request(3)
    batch_id = await _interrupted(gateway, request, recorded=0)
    meanwhile = Refusals()
    meanwhile.note(Refusal(TENANT, (), batch_id=batch_id))
    refusals = Refusals()

    with pytest.raises(RequestInProgress):
        await _submit(
            gateway,
            request,
            Recorded(gateway.broker),
            T0 + GRACE + timedelta(seconds=1),
            submissions=WrittenOffMeanwhile(gateway, meanwhile),
            batches=AcceptanceLost(gateway.raw.client, gateway.name),
            refusals=refusals,
        )
    assert await _sent_by_sweeps(gateway, refusals) == []  # held here until written off
    await _write_off(gateway, refusals)

    assert await _sent_by_sweeps(gateway, refusals) == []
    states = await gateway.raw["submissions"].distinct("state", {"batch_id": batch_id})
    assert states == [SubmissionState.ABANDONED]


@pytest.fixture
def score_queue_full(amqp_url: str, rabbitmq: Endpoint) -> ScoreQueueFull:
    """The module's score queue made full for a block: every publish to it refused with a
    negative confirm; cleared and emptied after."""
    return lambda: queue_made_full(
        amqp_url, SCORE_REQUESTS.name, policy=FULL_POLICY, management_url=rabbitmq.management_url
    )


class RefusingBatches(Recorded):
    """The publisher on `broker`, whose batch's commands the broker refuses: the score queue
    is full (`full`) for the batch's publish, each command refused with a negative confirm.
    For that publish alone, not around the request: the other replicas' sweeps and replays
    these tests run while the refused request is undone (in a slot's release, in the
    withdrawal) publish to the same queue, and must be taken, as they were. The withdrawal
    is the real one."""

    def __init__(self, broker: RabbitBroker, full: ScoreQueueFull) -> None:
        super().__init__(broker)
        self._full = full

    async def send_many(self, commands: Sequence[ScoreText]) -> bool:
        async with self._full():
            return await super().send_many(commands)

    async def withdraw(self, commands: Sequence[ScoreText]) -> None:
        # `Recorded` expects no withdrawal; a refused batch's request makes one: the real
        # publisher's `score.withdrawn`, to the status projection's queue.
        await TaskPublisher.withdraw(self, commands)

    async def announce_cached(self, command: ScoreText, result: ScoreResult) -> bool:
        raise AssertionError("nothing is cached here")


async def _refused_by_the_broker(
    gateway: Gateway, refusals: Refusals, in_flight: InFlight, publisher: RefusingBatches
) -> None:
    """A batch of 3, counted in flight, whose commands the broker refuses (503)."""
    with pytest.raises(BrokerUnavailable):
        await _submitted(gateway, refusals, in_flight, publisher)


async def _submitted(
    gateway: Gateway, refusals: Refusals, in_flight: InFlight, publisher: Recorded
) -> None:
    """A batch of 3, counted in flight, submitted at T0 without a key."""
    await submit_batch(
        _request(3),
        tenant_id=TENANT,
        api_key_id=None,
        idempotency_key=None,
        batches=gateway.batches,
        submissions=gateway.submissions,
        publisher=publisher,
        policy=POLICY,
        clock=lambda: T0,
        refusals=refusals,
        in_flight=in_flight,
    )


class SecondReleaseFails(InFlight):
    """Counts the releases of each task; the second release made fails, once."""

    def __init__(self, gateway: Gateway) -> None:
        super().__init__(gateway.raw.client, gateway.name, max_per_tenant=100)
        self.released: list[str] = []
        self._to_fail = 2

    async def release(self, tenant_id: str, task_id: str) -> None:
        self._to_fail -= 1
        if self._to_fail == 0:
            raise DatabaseUnavailable("timed out")
        await super().release(tenant_id, task_id)
        self.released.append(task_id)


async def test_a_refused_batch_whose_slots_were_partly_released_releases_the_rest_once(
    gateway: Gateway, score_queue_full: ScoreQueueFull
) -> None:
    """The write-off used to release every slot of the batch again, the ones released
    before the failure too (more than the counter remembers for a large batch). Only the
    one that failed is tried again: each task's slot is taken back once, the other task's
    kept."""
    in_flight = SecondReleaseFails(gateway)
    await in_flight.acquire(TENANT, 1)  # another task's, still in flight
    refusals = Refusals()
    await _refused_by_the_broker(
        gateway, refusals, in_flight, RefusingBatches(gateway.broker, score_queue_full)
    )
    [refusal] = refusals.pending()
    assert refusal.released.count == 2  # all but the one that failed

    await write_off(
        refusals,
        submissions=gateway.submissions,
        batches=gateway.batches,
        in_flight=in_flight,
        now=T0,
    )

    assert set(in_flight.released) == set(refusal.task_ids)
    assert await in_flight.count(TENANT) == 1  # the three released once each
    assert refusals.pending() == []


class SweepDuringRelease(InFlight):
    """The outbox sweep runs while a refused batch's slots are being released, one by one
    (1,000 of them took longer than the outbox grace period)."""

    def __init__(self, gateway: Gateway, refusals: Refusals) -> None:
        super().__init__(gateway.raw.client, gateway.name, max_per_tenant=100)
        self._meanwhile = (gateway, refusals)
        self.swept: list[str] | None = None

    async def release(self, tenant_id: str, task_id: str) -> None:
        if self.swept is None:
            # Set before the sweep: the releases of a chunk run together, and each ran a
            # sweep of its own, the last to end overwriting what the others sent (a flake).
            self.swept = []
            self.swept += await _sent_by_sweeps(*self._meanwhile)
        await super().release(tenant_id, task_id)


async def test_a_refused_batch_is_not_sent_by_a_sweep_while_its_slots_are_released(
    gateway: Gateway, score_queue_full: ScoreQueueFull
) -> None:
    refusals = Refusals()
    in_flight = SweepDuringRelease(gateway, refusals)
    await _refused_by_the_broker(
        gateway, refusals, in_flight, RefusingBatches(gateway.broker, score_queue_full)
    )

    assert in_flight.swept == []
    assert await _sent_by_sweeps(gateway, refusals) == []
    assert await in_flight.count(TENANT) == 0


async def test_a_refused_batch_another_replica_sends_meanwhile_is_kept_and_uncounted(
    gateway: Gateway, score_queue_full: ScoreQueueFull
) -> None:
    """The refusal outlasted the grace, and another replica's sweep (which holds nothing of
    it) sent the items: the refusal keeps the batch rather than deleting the record of items
    being scored (a replay with the key would have scored them twice), and removes their
    in-flight marks, since it released their slots and each outcome would release it again
    (found in review)."""
    refusals = Refusals()
    in_flight = SweepDuringRelease(gateway, Refusals())  # another replica's: holds nothing
    await _refused_by_the_broker(
        gateway, refusals, in_flight, RefusingBatches(gateway.broker, score_queue_full)
    )

    assert in_flight.swept is not None
    assert len(in_flight.swept) == 3
    [batch] = await gateway.raw["batches"].find({}).to_list()
    assert batch["state"] == "accepting"
    items = await gateway.raw["submissions"].find({"batch_id": batch["_id"]}).to_list()
    assert sorted(item["state"] for item in items) == ["accepted"] * 3
    assert not any(item.get("in_flight") for item in items)
    assert await in_flight.count(TENANT) == 0


class FullWhileSwept(InFlight):
    """The tenant's slots full (429), while another replica's sweep sends the batch."""

    def __init__(self, gateway: Gateway) -> None:
        super().__init__(gateway.raw.client, gateway.name, max_per_tenant=100)
        self.gateway = gateway
        self.swept: list[str] = []

    async def acquire(self, tenant_id: str, tasks: int) -> None:
        self.swept = await _sent_by_sweeps(self.gateway, Refusals())
        raise LimitExceeded("in_flight", "full", maximum=100, retry_after_s=1)


async def test_a_batch_refused_429_and_kept_releases_no_slot_at_its_outcomes(
    gateway: Gateway,
) -> None:
    """No slot was taken, yet its items were marked in flight at their insert: kept (sent
    by another replica's sweep), each outcome released a slot never taken (found in
    review)."""
    in_flight = FullWhileSwept(gateway)
    with pytest.raises(LimitExceeded):
        await _submitted(gateway, Refusals(), in_flight, Recorded(gateway.broker))

    assert len(in_flight.swept) == 3
    items = await gateway.raw["submissions"].find({}).to_list()
    assert [item["state"] for item in items] == ["accepted"] * 3
    assert not any(item.get("in_flight") for item in items)


class SweepDuringWithdrawal(RefusingBatches):
    """The outbox sweep runs while the refused commands are withdrawn (a confirmed publish,
    up to `BROKER_TIMEOUT_S`); the tasks withdrawn are remembered."""

    def __init__(self, gateway: Gateway, refusals: Refusals, full: ScoreQueueFull) -> None:
        super().__init__(gateway.broker, full)
        self._meanwhile = (gateway, refusals)
        self.swept: list[str] = []
        self.withdrawn: list[str] = []

    async def withdraw(self, commands: Sequence[ScoreText]) -> None:
        self.swept += await _sent_by_sweeps(*self._meanwhile)
        self.withdrawn += [command.task_id for command in commands]
        await super().withdraw(commands)


async def test_a_refused_batch_is_not_sent_by_a_sweep_while_its_commands_are_withdrawn(
    gateway: Gateway, amqp_url: str, score_queue_full: ScoreQueueFull
) -> None:
    refusals = Refusals()
    publisher = SweepDuringWithdrawal(gateway, refusals, score_queue_full)
    in_flight = InFlight(gateway.raw.client, gateway.name, max_per_tenant=100)
    await _refused_by_the_broker(gateway, refusals, in_flight, publisher)

    assert publisher.swept == []
    assert await _sent_by_sweeps(gateway, refusals) == []
    # The projection took its copy of each refused command, and then its withdrawal.
    assert len(publisher.withdrawn) == 3
    copies = await _projections_copies(amqp_url, publisher.withdrawn)
    assert copies == {
        task_id: [ScoreText.routing_key, ScoreWithdrawn.routing_key]
        for task_id in publisher.withdrawn
    }


class WithdrawnWhenLetGo(RefusingBatches):
    """A broker that takes none of a batch's commands; withdrawing them waits for `go`."""

    def __init__(self, broker: RabbitBroker, full: ScoreQueueFull) -> None:
        super().__init__(broker, full)
        self.reached, self.go = asyncio.Event(), asyncio.Event()

    async def withdraw(self, commands: Sequence[ScoreText]) -> None:
        self.reached.set()
        await self.go.wait()
        await super().withdraw(commands)


class RefusalFinishesMeanwhile(Recorded):
    """A sweep's publisher: sending `first` takes as long as the refused batch's request
    needs to finish (its withdrawal let go)."""

    def __init__(
        self,
        broker: RabbitBroker,
        first: str,
        refusing: WithdrawnWhenLetGo,
        refused: asyncio.Task[Any],
    ) -> None:
        super().__init__(broker)
        self._first, self._refusing, self._refused = first, refusing, refused

    async def send(self, command: ScoreText) -> bool:
        if command.task_id == self._first:
            self._refusing.go.set()
            await asyncio.wait_for(asyncio.wait({self._refused}), timeout=120)  # a hang guard
        return await super().send(command)


@pytest.mark.parametrize("chunk", [None, 1], ids=["one chunk", "a chunk per record"])
async def test_a_refused_batch_is_not_sent_by_a_sweep_pass_started_before_it_was_discarded(
    gateway: Gateway,
    score_queue_full: ScoreQueueFull,
    monkeypatch: pytest.MonkeyPatch,
    chunk: int | None,
) -> None:
    """The pass read its list (an older interrupted submission, then the batch's items) while
    the batch's refusal was undone; by the time it reached the items, the refusal had deleted
    the batch and its items, answered 503 and let go of them, and the pass sent them from
    its list all the same: scored, though the client was told nothing was kept."""
    if chunk is not None:
        monkeypatch.setattr("services.gateway.submit.SWEEP_RECHECK_CHUNK", chunk)
    older = ScoreText(
        task_id="older-task", text="Interrupted earlier.", submitted_at=T0 - timedelta(minutes=1)
    )
    await gateway.submissions.insert(
        older, request_hash="h", idempotency_key=None, retention=POLICY.retention, cache_key="c"
    )
    broker, refusals = WithdrawnWhenLetGo(gateway.broker, score_queue_full), Refusals()
    refused = asyncio.create_task(
        _submit(gateway, _request(3), broker, T0, refusals=refusals), name="refused batch"
    )
    # A hang guard: the refusal sets a queue policy and fills the queue first.
    await asyncio.wait_for(broker.reached.wait(), timeout=120)
    publisher = RefusalFinishesMeanwhile(gateway.broker, older.task_id, broker, refused)

    swept = await sweep_outbox(
        submissions=gateway.submissions,
        publisher=publisher,
        clock=lambda: T0 + GRACE + timedelta(seconds=2),
        grace=GRACE,
        refusals=refusals,
        retention=SWEEP_RETENTION,
        batches=gateway.batches,
    )

    with pytest.raises(BrokerUnavailable):
        await refused
    assert (swept, publisher.sent) == (1, [older.task_id])
    assert await gateway.raw["batches"].count_documents({}) == 0
    assert await _sent_by_sweeps(gateway, refusals) == []
    assert refusals.pending() == []


class ReplayDuringRelease(InFlight):
    """A replay of a refused batch's request (on another replica, after the grace period)
    completes and accepts the batch while this replica releases the batch's slots, one by one
    (1,000 of them outlasted the outbox grace period)."""

    def __init__(self, gateway: Gateway, request: BatchSubmission) -> None:
        super().__init__(gateway.raw.client, gateway.name, max_per_tenant=100)
        self._meanwhile = (gateway, request)
        self.replay: BatchSubmitted | None = None

    async def release(self, tenant_id: str, task_id: str) -> None:
        if self.replay is None:
            gateway, request = self._meanwhile
            later = T0 + GRACE + timedelta(seconds=1)
            self.replay = await _submit(gateway, request, Recorded(gateway.broker), later)
        await super().release(tenant_id, task_id)


async def test_a_refused_batch_a_replay_accepted_while_its_slots_were_released_keeps_its_items(
    gateway: Gateway, score_queue_full: ScoreQueueFull
) -> None:
    """The replay answered 200: the batch's items must be sent. The refused request's discard
    deleted the batch's `accepting` submissions before it tried the batch, which it left (it
    was accepted): a batch answered 200 whose items were never scored."""
    request = _request(3)
    refusals = Refusals()
    in_flight = ReplayDuringRelease(gateway, request)

    with pytest.raises(BrokerUnavailable):
        await submit_batch(
            request,
            tenant_id=TENANT,
            api_key_id=None,
            idempotency_key=KEY,
            batches=gateway.batches,
            submissions=gateway.submissions,
            publisher=RefusingBatches(gateway.broker, score_queue_full),
            policy=POLICY,
            clock=lambda: T0,
            refusals=refusals,
            in_flight=in_flight,
        )

    assert in_flight.replay is not None
    assert not in_flight.replay.created
    batch_id = in_flight.replay.record.batch_id
    batch = await gateway.raw["batches"].find_one({"_id": batch_id})
    assert batch["state"] == BatchState.ACCEPTED
    assert refusals.pending() == []
    members = sorted(member.task_id for member in in_flight.replay.record.members)
    assert sorted(await _sent_by_sweeps(gateway, refusals)) == members


class NeverSent(Submissions):
    """Recording a batch's submissions fails before the write is sent (no server selected)."""

    async def insert_batch(
        self,
        commands: list[BatchRow],
        *,
        retention: timedelta,
        counted: bool = False,
    ) -> None:
        raise DatabaseUnavailable("no server") from ServerSelectionTimeoutError("no server")


async def test_a_replay_whose_insert_was_never_sent_keeps_no_sweep_off_its_batch(
    gateway: Gateway,
) -> None:
    """Nothing the replay could have recorded may land later, so it notes no refusal: one kept
    this replica's sweep off the batch's items until a write-off found there was nothing to
    write off."""
    request = _request(3)
    batch_id = await _interrupted(gateway, request, recorded=3)
    refusals = Refusals()

    with pytest.raises(ReplayUnfinished):
        await _submit(
            gateway,
            request,
            Recorded(gateway.broker),
            T0 + GRACE + timedelta(seconds=1),
            NeverSent(gateway.raw.client, gateway.name),
            refusals=refusals,
        )

    assert refusals.pending() == []
    batch = await gateway.raw["batches"].find_one({"_id": batch_id})
    assert batch["state"] == BatchState.ACCEPTING
    members = sorted(member["task_id"] for member in batch["members"])
    assert sorted(await _sent_by_sweeps(gateway, refusals)) == members


class AbandonFailsOnce(WrittenOffMeanwhile):
    """The replay's records land as the batch is written off, and forgetting them fails."""

    failures = 1

    async def abandon(self, task_ids: tuple[str, ...], *, now: datetime) -> set[str]:
        if self.failures:
            self.failures -= 1
            raise DatabaseUnavailable("timed out")
        return await super().abandon(task_ids, now=now)


async def test_a_replay_that_cannot_forget_its_records_leaves_them_to_the_write_off(
    gateway: Gateway,
) -> None:
    request = _request(3)
    batch_id = await _interrupted(gateway, request, recorded=0)
    meanwhile = Refusals()
    meanwhile.note(Refusal(TENANT, (), batch_id=batch_id))
    refusals = Refusals()

    with pytest.raises(DatabaseUnavailable):
        await _submit(
            gateway,
            request,
            Recorded(gateway.broker),
            T0 + GRACE + timedelta(seconds=1),
            submissions=AbandonFailsOnce(gateway, meanwhile),
            refusals=refusals,
        )
    assert await _sent_by_sweeps(gateway, refusals) == []  # held here until written off
    await _write_off(gateway, refusals)

    assert await _sent_by_sweeps(gateway, refusals) == []


class MarksLost(Submissions):
    """Marking a batch's submissions accepted fails (the database away)."""

    async def mark_batch_accepted(self, batch_id: str, task_ids: list[str]) -> None:
        raise DatabaseUnavailable("timed out")


class RecordsFail(Submissions):
    """Recording a batch's submissions fails (the database away)."""

    async def insert_batch(
        self,
        commands: list[BatchRow],
        *,
        retention: timedelta,
        counted: bool = False,
    ) -> None:
        raise DatabaseUnavailable("timed out")


class LookupFails(Batches):
    """Finding a batch by its idempotency key fails (the database away)."""

    async def find_by_key(self, idempotency_key: str, *, tenant_id: str) -> None:
        raise DatabaseUnavailable("timed out")


# Where a replay of the request fails on the database: its repositories.
REPLAY_FAILURES: dict[str, tuple[type[Batches], type[Submissions]]] = {
    "reading its batch": (LookupFails, Submissions),
    "recording its items": (Batches, RecordsFail),
    "marking its batch accepted": (AcceptanceLost, Submissions),
}


async def _accepted_without_marks(
    gateway: Gateway, request: BatchSubmission, in_flight: InFlight
) -> BatchSubmitted:
    """The batch, counted in flight, sent and answered 202, whose acceptance marks (its
    submissions' and its own) the database did not take: it is left `accepting`."""
    broker = Recorded(gateway.broker)
    accepted = await submit_batch(
        request,
        tenant_id=TENANT,
        api_key_id=None,
        idempotency_key=KEY,
        batches=AcceptanceLost(gateway.raw.client, gateway.name),
        submissions=MarksLost(gateway.raw.client, gateway.name),
        publisher=broker,
        policy=POLICY,
        clock=lambda: T0,
        refusals=Refusals(),
        in_flight=in_flight,
    )
    assert accepted.created
    assert sorted(broker.sent) == sorted(member.task_id for member in accepted.record.members)
    return accepted


async def _scored(gateway: Gateway, task_ids: Sequence[str], in_flight: InFlight) -> None:
    """The outcomes of `task_ids` reach the gateway (each releases its slot if it holds one)."""
    cache = ResultCache(gateway.raw.client, gateway.name, timedelta(hours=1))
    for task_id in task_ids:
        completed = TaskCompleted(
            task_id=task_id,
            tenant_id=TENANT,
            attempt=1,
            submitted_at=T0,
            sequence=event_sequence(generation=0, attempt=1, phase=Phase.TERMINAL),
            result=ScoreResult(score=6, comment="ok", model="m"),
        )
        await settle_outcome(
            completed,
            submissions=gateway.submissions,
            in_flight=in_flight,
            cache=cache,
            now=T0 + GRACE + timedelta(seconds=4),
        )


@pytest.mark.parametrize("failing_step", list(REPLAY_FAILURES))
async def test_a_batch_answered_202_is_kept_when_a_replay_fails_on_the_database_too(
    gateway: Gateway, failing_step: str
) -> None:
    """Its commands were sent, but its marks were not written, so it stayed `accepting`. A
    replay after the grace period that failed on the database too noted a refusal, and its
    write-off turned the batch and its items into tombstones: the batch read 404, a later
    replay created it again (every item scored twice), and the items' slots were never
    released (the tombstones dropped their in-flight marks). The replay only found the
    batch: it is its first request's, which was answered 202."""
    request = _request(3)
    in_flight = InFlight(gateway.raw.client, gateway.name, max_per_tenant=100)
    accepted = await _accepted_without_marks(gateway, request, in_flight)
    batch_id = accepted.record.batch_id
    members = [member.task_id for member in accepted.record.members]
    refusals = Refusals()
    batches, submissions = REPLAY_FAILURES[failing_step]

    with pytest.raises(GatewayError) as replay:
        await _submit(
            gateway,
            request,
            Recorded(gateway.broker),
            T0 + GRACE + timedelta(seconds=1),
            submissions(gateway.raw.client, gateway.name),
            batches=batches(gateway.raw.client, gateway.name),
            refusals=refusals,
        )
    await write_off(
        refusals,
        submissions=gateway.submissions,
        batches=gateway.batches,
        in_flight=in_flight,
        now=T0 + GRACE + timedelta(seconds=2),
    )
    assert await gateway.batches.find(batch_id, tenant_id=TENANT) is not None  # not a 404
    # Sent again, as any batch left `accepting` is: the scorer claims each task once.
    assert sorted(await _sent_by_sweeps(gateway, refusals)) == sorted(members)
    later = await _submit(
        gateway, request, Recorded(gateway.broker), T0 + GRACE + timedelta(seconds=3)
    )

    assert (later.created, later.record.batch_id) == (False, batch_id)  # not created again
    batch = await gateway.raw["batches"].find_one({"_id": batch_id})
    assert batch["state"] == BatchState.ACCEPTED
    await _scored(gateway, members, in_flight)
    assert await in_flight.count(TENANT) == 0
    # Told to retry with the same key: its batch was kept (a 503 says nothing was).
    assert isinstance(replay.value, RequestInProgress)
    assert replay.value.args == (KEY,)  # the key to retry with, whichever step failed
