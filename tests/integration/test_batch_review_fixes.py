"""Three batch gaps a review found around the outbox sweep, on the real database.

- A batch whose last items the sweep sent just before its look was settled there and expired
  about an hour after the send (`Batches.outlive_sends`).
- A replay completing an interrupted batch did not keep its own process's sweep off the items
  it recorded (`_complete_interrupted`, `Refusals.holding`).
- A process dying between deleting a refused batch's record and its items left the items to
  the sweep, which sent them (`sweep_outbox` writes off the items of refused batches).

The sweep's clock is passed in; records the TTL index could remove are written with expiries
ahead of the wall clock (`test_batch_expiry.py`), and the checks read field values."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import datetime, timedelta

import pytest
from faststream.rabbit import RabbitBroker

from devtools.infra import Endpoint
from services.gateway.batch_expiry import hold_unsent_batches
from services.gateway.batches import (
    HOLD_CHECK_AT,
    HOLD_LEAD,
    Batches,
    BatchPolicy,
    BatchState,
    BatchSubmission,
    BatchSubmitted,
    submit_batch,
)
from services.gateway.errors import BrokerUnavailable, DatabaseUnavailable
from services.gateway.refusals import Refusal, Refusals
from services.gateway.submissions import BatchRow, Submissions, SubmissionState
from services.gateway.submit import CHUNK_ALLOWANCE, SWEEP_RECHECK_CHUNK, sweep_outbox
from shared.contracts import ScoreResult, ScoreText
from shared.runtime import make_broker
from shared.settings import ServiceSettings
from shared.topology import TASKS
from tests.faults.slow_link import SlowLink
from tests.integration import test_batch_replay as batch_replay
from tests.integration.gateway_records import GatewayRecords as Gateway
from tests.integration.gateway_records import Recorded, gateway_records
from tests.integration.test_batch_expiry import RETENTION, _batch, _now
from tests.integration.test_batch_replay import (
    GRACE,
    T0,
    TENANT,
    Dying,
    ProcessDied,
    RefusingBatches,
    ScoreQueueFull,
    _interrupted,
    _request,
    _submit,
    _write_off,
)
from tests.support import eventually, queued_commands

pytestmark = pytest.mark.integration
score_queue_full = batch_replay.score_queue_full  # a fixture

SWEPT_AT = T0 + GRACE + timedelta(seconds=2)


@pytest.fixture
async def gateway(
    mongo: Endpoint, db_prefix: str, task_broker: RabbitBroker
) -> AsyncIterator[Gateway]:
    async with gateway_records(mongo.url, db_prefix, task_broker) as records:
        yield records


async def _swept(gateway: Gateway, refusals: Refusals, at: datetime = SWEPT_AT) -> list[str]:
    """What this replica's sweep passes send, as the gateway runs them (its batches given)."""
    sweep = Recorded(gateway.broker)
    while await sweep_outbox(
        submissions=gateway.submissions,
        publisher=sweep,
        clock=lambda: at,
        grace=GRACE,
        refusals=refusals,
        retention=RETENTION,
        batches=gateway.batches,
    ):
        pass
    return sweep.sent


async def _states(gateway: Gateway, task_ids: Sequence[str]) -> set[str]:
    cursor = gateway.raw["submissions"].find({"_id": {"$in": list(task_ids)}})
    return {document["state"] async for document in cursor}


class CountedBatches(Batches):
    """Counts the sweep's writes to batch records."""

    writes = 0

    async def outlive_sends(
        self, batch_ids: Sequence[str], *, sent_at: datetime, retention: timedelta
    ) -> None:
        self.writes += 1
        await super().outlive_sends(batch_ids, sent_at=sent_at, retention=retention)


async def test_a_batch_swept_just_before_its_look_lives_a_retention_from_the_send(
    gateway: Gateway,
) -> None:
    """Answered 202 during a broker alarm that ended 22h50m later: the sweep sent every item
    then, and the batch's look ten minutes after found nothing unsent and settled it, so it
    expired 70 minutes after the send (404 reads, a free key: a replay scored every item
    twice) while its items were kept a retention from the send."""
    now = _now()
    created = now - timedelta(hours=22, minutes=50)
    count = 2 * SWEEP_RECHECK_CHUNK + 20  # three chunks of one batch
    batch_id, _ = await _batch(gateway, created_at=created, items=count, key="k1")
    await gateway.submissions.mark_batch_unconfirmed(batch_id)
    await gateway.batches.mark_accepted(batch_id)
    batches = CountedBatches(gateway.raw.client, gateway.name)

    sent = await sweep_outbox(
        submissions=gateway.submissions,
        publisher=Recorded(gateway.broker),
        clock=lambda: now,
        grace=GRACE,
        refusals=Refusals(),
        retention=RETENTION,
        batches=batches,
    )

    assert sent == count
    assert batches.writes == 3  # one per chunk sent, not one per item
    held = await hold_unsent_batches(
        batches=gateway.batches,
        submissions=gateway.submissions,
        now=now + timedelta(minutes=10),  # the look it had (its expiry less the lead)
        retention=RETENTION,
        in_progress_for=GRACE,
    )
    assert held == 0
    batch = await gateway.raw["batches"].find_one({"_id": batch_id})
    assert batch["expires_at"] == now + CHUNK_ALLOWANCE + RETENTION
    assert batch[HOLD_CHECK_AT] == now + CHUNK_ALLOWANCE + RETENTION - HOLD_LEAD
    items = [document async for document in gateway.raw["submissions"].find({})]
    assert len(items) == count
    assert max(document["expires_at"] for document in items) <= batch["expires_at"]

    # Its look, when it comes, finds nothing unsent: settled, its expiry kept.
    await hold_unsent_batches(
        batches=gateway.batches,
        submissions=gateway.submissions,
        now=now + CHUNK_ALLOWANCE + RETENTION - HOLD_LEAD,
        retention=RETENTION,
        in_progress_for=GRACE,
    )
    settled = await gateway.raw["batches"].find_one({"_id": batch_id})
    assert HOLD_CHECK_AT not in settled
    assert settled["expires_at"] == now + CHUNK_ALLOWANCE + RETENTION


class SweptThenWrittenOff(Submissions):
    """As the replay records the batch's items, this replica's outbox sweep runs, and then
    the batch's own refusal (its insert timed out, and landed) is written off."""

    def __init__(self, gateway: Gateway, refusals: Refusals, meanwhile: Refusals) -> None:
        super().__init__(gateway.raw.client, gateway.name)
        self._gateway, self._refusals, self._meanwhile = gateway, refusals, meanwhile
        self.swept: list[str] = []

    async def insert_batch(
        self,
        commands: list[BatchRow],
        *,
        retention: timedelta,
        counted: bool = False,
    ) -> None:
        await super().insert_batch(commands, retention=retention, counted=counted)
        self.swept += await _swept(self._gateway, self._refusals)
        await _write_off(self._gateway, self._meanwhile)


async def test_a_replay_completing_a_batch_keeps_its_own_sweep_off_the_items(
    gateway: Gateway,
) -> None:
    """The replay's items, dated as the batch, were due for the sweep at once: a pass between
    the replay's insert and its mark sent them, and the replay, finding the batch written
    off, answered 503 "nothing was kept"."""
    request = _request(3)
    batch_id = await _interrupted(gateway, request, recorded=0)
    meanwhile = Refusals()
    meanwhile.note(Refusal(TENANT, (), batch_id=batch_id))
    refusals = Refusals()
    submissions = SweptThenWrittenOff(gateway, refusals, meanwhile)

    with pytest.raises(DatabaseUnavailable):
        await _submit(
            gateway,
            request,
            Recorded(gateway.broker),
            T0 + GRACE + timedelta(seconds=1),
            submissions,
            refusals=refusals,
        )

    assert submissions.swept == []
    assert await _swept(gateway, refusals) == []
    recorded = [document["_id"] async for document in gateway.raw["submissions"].find({})]
    assert len(recorded) == 3  # the replay's, written off with their batch
    assert await _states(gateway, recorded) == {SubmissionState.ABANDONED}


class DiesInDiscard(Submissions):
    """The process ends right after the refused batch's record was deleted."""

    async def discard_batch(self, batch_id: str) -> None:
        raise ProcessDied


async def test_items_left_by_a_process_dead_inside_a_discard_are_written_off_not_sent(
    gateway: Gateway, amqp_url: str, score_queue_full: ScoreQueueFull
) -> None:
    """Its batch record gone (the key free), the items stayed `accepting` and the sweep sent
    them; the client, answered nothing, retried with its key and created the batch anew:
    every text scored twice."""
    await queued_commands(amqp_url)  # what the module's earlier tests sent
    request = _request(3)
    with pytest.raises(ProcessDied):
        await _submit(
            gateway,
            request,
            RefusingBatches(gateway.broker, score_queue_full),
            T0,
            DiesInDiscard(gateway.raw.client, gateway.name),
        )
    assert await gateway.raw["batches"].count_documents({}) == 0
    orphans = [document["_id"] async for document in gateway.raw["submissions"].find({})]
    assert len(orphans) == 3

    retried = Recorded(gateway.broker)
    retry = await _submit(gateway, request, retried, T0 + GRACE + timedelta(seconds=1))
    swept = await _swept(gateway, Refusals())

    assert retry.created  # the key was free: the batch is created again, its items sent
    assert swept == []
    assert len(set(retried.sent)) == 3
    assert await _states(gateway, orphans) == {SubmissionState.ABANDONED}
    assert await _swept(gateway, Refusals(), SWEPT_AT + timedelta(minutes=5)) == []
    # Each text reached the scorer once: the retry's commands, none of the orphans'.
    queued = await queued_commands(amqp_url)
    assert sorted(command.task_id for command in queued) == sorted(retried.sent)
    assert sorted(command.text for command in queued) == sorted(i.text for i in request.items)


async def _drop_batch(gateway: Gateway, batch_id: str) -> None:
    await gateway.raw["batches"].delete_one({"_id": batch_id})


async def _abandon_batch(gateway: Gateway, batch_id: str) -> None:
    assert await gateway.batches.abandon(batch_id, now=_now())


async def _keep_batch(gateway: Gateway, batch_id: str) -> None:
    await gateway.batches.mark_accepted(batch_id)


# How the batch of an `accepting` item stands, its age, and whether the sweep sends the item.
BatchChange = Callable[[Gateway, str], Awaitable[None]]
CASES: dict[str, tuple[BatchChange, timedelta, bool]] = {
    "a tombstone (its write-off pending elsewhere)": (_abandon_batch, timedelta(minutes=5), False),
    "gone while young (discarded)": (_drop_batch, timedelta(minutes=5), False),
    "gone after its retention (expired)": (_drop_batch, RETENTION + timedelta(hours=1), True),
    "kept": (_keep_batch, timedelta(minutes=5), True),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_the_sweep_writes_off_the_unsent_items_of_refused_batches(
    gateway: Gateway, case: str
) -> None:
    """An item whose batch was refused is written off; one whose batch record may have
    expired (older than a record's retention: an earlier build's, never held) was answered
    202 and may be counted in flight, and is sent as before."""
    change, age, sent = CASES[case]
    now = _now()
    batch_id, task_ids = await _batch(gateway, created_at=now - age, items=2)
    await change(gateway, batch_id)

    swept = await _swept(gateway, Refusals(), now)

    assert sorted(swept) == (sorted(task_ids) if sent else [])
    expected = SubmissionState.ACCEPTED if sent else SubmissionState.ABANDONED
    assert await _states(gateway, task_ids) == {expected}
    if not sent:
        stored = await gateway.raw["batches"].find_one({"_id": batch_id})
        assert stored is None or stored["state"] == BatchState.ABANDONED


async def test_a_batch_expired_under_a_shorter_retention_is_sent_not_written_off(
    gateway: Gateway,
) -> None:
    """Whether a missing record may have expired went by the retention now in force: raised
    since (a deploy), the items of an accepted batch whose record had expired unheld were
    written off, tasks answered 202 never scored. The items' own expiry, set at their insert
    with their record's retention, is what tells."""
    now = _now()
    batch_id, task_ids = await _batch(
        gateway, created_at=now - timedelta(hours=2), items=2, retention=timedelta(hours=1)
    )
    await _drop_batch(gateway, batch_id)  # the TTL index's doing, an hour ago
    assert timedelta(hours=2) < RETENTION  # the sweep runs under a longer one now

    swept = await _swept(gateway, Refusals(), now)

    assert sorted(swept) == sorted(task_ids)
    assert await _states(gateway, task_ids) == {SubmissionState.ACCEPTED}


@pytest.fixture
async def linked_broker(
    amqp_url: str, broker_link: SlowLink, task_broker: RabbitBroker
) -> AsyncIterator[RabbitBroker]:
    """A broker on the module's vhost (its topology declared by `task_broker`), as the
    gateway connects, reached through `broker_link`: cutting the link resets its
    connection."""
    settings = ServiceSettings.model_validate({"RABBITMQ_URL": broker_link.url_through(amqp_url)})
    broker = make_broker(settings, graceful_timeout_s=1.0)
    await broker.connect()
    try:
        yield broker
    finally:
        await broker_link.cut()  # a cut connection just closes (see `stalled_broker`)
        await broker.stop()


async def _channel_closed(broker: RabbitBroker) -> bool:
    """Whether the broker's publishing channel is known to be closed (its connection lost):
    a publish on it is then refused before anything is written."""
    exchange = await broker.declare_exchange(TASKS)  # declared already: no round trip
    return exchange.channel.is_closed


class FailingAfter(Recorded):
    """The publisher on `broker` (reached through `link`), whose first `confirmed` commands
    it sends and the broker confirms; then the connection is reset (`link` cut) and the next
    send finds it gone, once the publisher has seen it close: a reset it has not seen yet
    makes that send unconfirmed instead (it may have been written), which the sweep reports
    without an error, and this test is about the error."""

    def __init__(self, broker: RabbitBroker, link: SlowLink, confirmed: int) -> None:
        super().__init__(broker)
        self.broker, self.link, self.confirmed = broker, link, confirmed

    async def send(self, command: ScoreText) -> bool:
        if len(self.sent) == self.confirmed and not self.link.down:
            await self.link.cut()
            await eventually(lambda: _channel_closed(self.broker), what="the reset seen")
        return await super().send(command)

    async def announce_cached(self, command: ScoreText, result: ScoreResult) -> bool:
        raise AssertionError("nothing is cached here")


async def test_commands_sent_before_a_broker_error_are_marked_sent(
    gateway: Gateway, linked_broker: RabbitBroker, broker_link: SlowLink
) -> None:
    """The marks of a chunk waited for its last send: an error on the third lost the marks
    of the two sent, and the next pass sent them again."""
    now = _now()
    await _batch(gateway, created_at=now - timedelta(minutes=5), items=3)
    broker = FailingAfter(linked_broker, broker_link, confirmed=2)

    with pytest.raises(BrokerUnavailable):
        await sweep_outbox(
            submissions=gateway.submissions,
            publisher=broker,
            clock=lambda: now,
            grace=GRACE,
            refusals=Refusals(),
            retention=RETENTION,
            batches=gateway.batches,
        )

    marked = await gateway.raw["submissions"].count_documents(
        {"_id": {"$in": broker.sent}, "state": SubmissionState.ACCEPTED.value}
    )
    assert marked == len(broker.sent) == 2


async def test_the_sweeps_mark_leaves_a_record_written_off_since_as_it_is(
    gateway: Gateway,
) -> None:
    """A refusal writing the record off between the sweep's send and its mark: the mark,
    by `_id` alone, turned the tombstone back into `accepted`."""
    now = _now()
    _, [task_id] = await _batch(gateway, created_at=now - timedelta(minutes=5), items=1)
    await gateway.submissions.abandon((task_id,), now=now)

    await gateway.submissions.mark_accepted(task_id, sent_at=now, retention=RETENTION)

    assert await _states(gateway, [task_id]) == {SubmissionState.ABANDONED}


async def test_a_replays_items_never_outlive_their_batch_record(gateway: Gateway) -> None:
    """A replay recorded the items its interrupted request had not with the retention now in
    force: raised since, they outlived the record, and once it had expired unheld the sweep
    took its absence for a discard and wrote the items off (tasks answered 202, never
    scored). They now expire with the record at the latest."""
    request = _request(4)
    key = f"replay-{T0.timestamp()}-{id(request)}"
    short = BatchPolicy(max_attempts=4, retention=timedelta(hours=1), in_progress_for=GRACE)
    with pytest.raises(ProcessDied):
        await _submit_as(gateway, request, Dying(gateway.broker), T0, short, key)
    batch = await gateway.raw["batches"].find_one({"idempotency_key": key})
    assert batch is not None
    await gateway.raw["submissions"].delete_many(
        {"batch_id": batch["_id"], "command.batch_index": {"$gte": 2}}
    )
    longer = BatchPolicy(max_attempts=4, retention=timedelta(days=7), in_progress_for=GRACE)

    await _submit_as(gateway, request, Recorded(gateway.broker), T0 + GRACE * 2, longer, key)

    cursor = gateway.raw["submissions"].find({"batch_id": batch["_id"]})
    expiries = [
        document.get("expires_once_sent") or document["expires_at"] async for document in cursor
    ]
    assert len(expiries) == 4
    assert max(expiries) <= batch["expires_at"]


async def test_a_chunk_slower_than_its_allowance_extends_its_batch_from_each_later_send(
    gateway: Gateway,
) -> None:
    """The batches of a chunk are extended before its sends: a send later than the allowance
    (a slow broker) extends its own batch again, so the batch never expires before an item
    (each kept a retention from its own send)."""
    start = _now()
    batch_id, task_ids = await _batch(gateway, created_at=start - timedelta(hours=1), items=3)
    ticks = iter(start + CHUNK_ALLOWANCE * step for step in range(100))

    await sweep_outbox(
        submissions=gateway.submissions,
        publisher=Recorded(gateway.broker),
        clock=lambda: next(ticks),
        grace=GRACE,
        refusals=Refusals(),
        retention=RETENTION,
        batches=gateway.batches,
    )

    batch = await gateway.raw["batches"].find_one({"_id": batch_id})
    cursor = gateway.raw["submissions"].find({"_id": {"$in": task_ids}})
    item_expiries = [document["expires_at"] async for document in cursor]
    assert batch is not None
    assert len(item_expiries) == 3
    assert batch["expires_at"] >= max(item_expiries)


async def _submit_as(
    gateway: Gateway,
    request: BatchSubmission,
    broker: Recorded,
    at: datetime,
    policy: BatchPolicy,
    key: str,
) -> BatchSubmitted:
    return await submit_batch(
        request,
        tenant_id=TENANT,
        api_key_id=None,
        idempotency_key=key,
        batches=gateway.batches,
        submissions=gateway.submissions,
        publisher=broker,
        policy=policy,
        clock=lambda: at,
        refusals=Refusals(),
    )
