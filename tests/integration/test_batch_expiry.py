"""A batch's record outlives its unsent items (`services/gateway/batch_expiry.py`).

It expired `IDEMPOTENCY_TTL_S` after its creation whatever its items' state: after a broker
outage longer than that, the batch read 404 while its items were still to be scored, and its
idempotency key was free, so a replay of the request had every item scored twice.

The sweep's clock is passed in; the records are written with expiries ahead of the wall
clock, so the stand-in's TTL index (which removes an expired document at its next operation)
removes none of them during a test. The checks read the field values, so they hold against
MongoDB without waiting for its TTL monitor."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from faststream.rabbit import RabbitBroker

from devtools.infra import Endpoint
from services.gateway import batch_expiry
from services.gateway.batch_expiry import hold_unsent_batches
from services.gateway.batches import (
    HOLD_CHECK_AT,
    HOLD_LEAD,
    BatchMember,
    BatchRecord,
    BatchState,
    usual_hold_check,
)
from services.gateway.submit import INCOMPLETE_BATCH_HOLD
from shared.contracts import ScoreText, new_id, utcnow
from tests.integration.gateway_records import GatewayRecords as Gateway
from tests.integration.gateway_records import gateway_records

pytestmark = pytest.mark.integration

Document = dict[str, Any]
RETENTION = timedelta(days=1)  # IDEMPOTENCY_TTL_S's default
GRACE = timedelta(seconds=30)  # an OUTBOX_GRACE_S: how long a request may still run


@pytest.fixture
async def gateway(
    mongo: Endpoint, db_prefix: str, task_broker: RabbitBroker
) -> AsyncIterator[Gateway]:
    async with gateway_records(mongo.url, db_prefix, task_broker) as records:
        yield records


def _now() -> datetime:
    """The time now, to the millisecond a BSON date keeps."""
    now = utcnow()
    return now.replace(microsecond=now.microsecond // 1000 * 1000)


async def _batch(
    gateway: Gateway,
    *,
    created_at: datetime,
    items: int,
    retention: timedelta = RETENTION,
    key: str | None = None,
) -> tuple[str, list[str]]:
    """A batch recorded `created_at` with `items` submissions, all still `accepting`."""
    batch_id = new_id()
    commands = [
        ScoreText(
            task_id=new_id(),
            text=f"Item {index}, accepted during a broker outage.",
            submitted_at=created_at,
            occurred_at=created_at,
            batch_id=batch_id,
            batch_index=index,
        )
        for index in range(items)
    ]
    record = BatchRecord(
        batch_id=batch_id,
        tenant_id="default",
        state=BatchState.ACCEPTING,
        request_hash="h",
        created_at=created_at,
        members=tuple(BatchMember(command.task_id, None) for command in commands),
    )
    await gateway.batches.insert(record, idempotency_key=key, retention=retention)
    if commands:  # its request recorded every item, and noted so
        await gateway.submissions.insert_batch(
            [(command, "h", "c", "m") for command in commands], retention=retention
        )
        await gateway.batches.mark_recorded(
            batch_id, look_at=usual_hold_check(created_at, retention)
        )
    return batch_id, [command.task_id for command in commands]


async def _stored(gateway: Gateway, batch_id: str) -> Document:
    found: Document | None = await gateway.raw["batches"].find_one({"_id": batch_id})
    assert found is not None, "the batch record is gone"
    return found


async def _hold(
    gateway: Gateway, now: datetime, *, retention: timedelta = RETENTION, grace: timedelta = GRACE
) -> int:
    return await hold_unsent_batches(
        batches=gateway.batches,
        submissions=gateway.submissions,
        now=now,
        retention=retention,
        in_progress_for=grace,
    )


async def test_a_batch_with_an_unsent_item_outlives_its_retention_until_the_item_is_sent(
    gateway: Gateway,
) -> None:
    now = _now()
    created = now - RETENTION + timedelta(minutes=30)  # expires in half an hour
    batch_id, (sent, unsent) = await _batch(gateway, created_at=created, items=2, key="k")
    await gateway.submissions.mark_batch_accepted(batch_id, [sent])
    await gateway.submissions.mark_batch_unconfirmed(batch_id)  # the other was never confirmed
    await gateway.batches.mark_accepted(batch_id)
    assert (await _stored(gateway, batch_id))["expires_at"] == created + RETENTION

    assert await _hold(gateway, now) == 1
    held = await _stored(gateway, batch_id)
    assert held["expires_at"] == now + RETENTION
    assert held[HOLD_CHECK_AT] == now + RETENTION - HOLD_LEAD

    # The outage goes on: a day later the item is still unsent, and the batch is held again.
    later = now + RETENTION - timedelta(minutes=30)
    assert await _hold(gateway, later) == 1
    assert (await _stored(gateway, batch_id))["expires_at"] == later + RETENTION
    replayed = await gateway.batches.find_by_key("k", tenant_id="default")
    assert replayed is not None  # a replay of the request still finds it: not scored twice
    assert replayed.batch_id == batch_id

    # Sent at last: the batch is settled, and expires a retention after its last hold.
    await gateway.submissions.mark_accepted(unsent)
    last = later + RETENTION - timedelta(minutes=30)
    assert await _hold(gateway, last) == 0
    settled = await _stored(gateway, batch_id)
    assert HOLD_CHECK_AT not in settled
    assert settled["expires_at"] == later + RETENTION
    assert await _hold(gateway, last + RETENTION) == 0  # never looked at again
    assert (await _stored(gateway, batch_id))["expires_at"] == later + RETENTION


async def test_a_batch_whose_items_are_all_sent_expires_as_recorded(gateway: Gateway) -> None:
    now = _now()
    created = now - RETENTION + timedelta(minutes=30)
    batch_id, task_ids = await _batch(gateway, created_at=created, items=3)
    await gateway.submissions.mark_batch_accepted(batch_id, task_ids)
    await gateway.batches.mark_accepted(batch_id)
    young_id, _ = await _batch(gateway, created_at=now, items=1)  # not due for a look yet

    assert await _hold(gateway, now) == 0
    settled = await _stored(gateway, batch_id)
    assert HOLD_CHECK_AT not in settled
    assert settled["expires_at"] == created + RETENTION
    young = await _stored(gateway, young_id)
    assert young[HOLD_CHECK_AT] == now + RETENTION - HOLD_LEAD
    assert young["expires_at"] == now + RETENTION


async def test_an_accepting_batch_is_held_only_while_its_request_may_still_run(
    gateway: Gateway,
) -> None:
    """A batch whose request is still recording it has no unsent item yet; one whose request
    died before recording any has none ever: held to the end of its wait for a replay, then
    refused, not held for good. With a retention this short its usual look comes within
    that wait; passed on, it was settled and never refused (a review)."""
    now = _now()
    retention = timedelta(minutes=2)  # a look is due after half of it (`hold_lead`)
    created = now - timedelta(seconds=90)
    batch_id, _ = await _batch(gateway, created_at=created, items=0, retention=retention)
    assert (await _stored(gateway, batch_id))[HOLD_CHECK_AT] == created + retention / 2

    assert await _hold(gateway, now, retention=retention, grace=timedelta(minutes=5)) == 1
    held_until = created + INCOMPLETE_BATCH_HOLD
    stored = await _stored(gateway, batch_id)
    assert stored[HOLD_CHECK_AT] == held_until
    assert stored["expires_at"] == held_until + retention / 2

    gone = now + timedelta(minutes=10)  # its request has long stopped, its wait is over
    assert await _hold(gateway, gone, retention=retention, grace=GRACE) == 0
    refused = await _stored(gateway, batch_id)
    assert refused["state"] == BatchState.ABANDONED
    assert HOLD_CHECK_AT not in refused


async def test_a_written_off_batch_is_never_held(gateway: Gateway) -> None:
    now = _now()
    batch_id, task_ids = await _batch(
        gateway, created_at=now - RETENTION + timedelta(minutes=30), items=1
    )
    assert await gateway.batches.abandon(batch_id, now=now)
    await gateway.submissions.abandon(tuple(task_ids), now=now)

    assert await _hold(gateway, now) == 0
    assert HOLD_CHECK_AT not in await _stored(gateway, batch_id)


async def test_a_pass_looks_at_every_due_batch_chunk_by_chunk(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(batch_expiry, "HOLD_CHECK_CHUNK", 3)
    now = _now()
    created = now - RETENTION + timedelta(minutes=30)
    unsent = [(await _batch(gateway, created_at=created, items=1))[0] for _ in range(5)]
    sent = []
    for _ in range(3):
        batch_id, task_ids = await _batch(gateway, created_at=created, items=1)
        await gateway.submissions.mark_batch_accepted(batch_id, task_ids)
        sent.append(batch_id)

    assert await _hold(gateway, now) == 5
    for batch_id in unsent:
        assert (await _stored(gateway, batch_id))["expires_at"] == now + RETENTION
    for batch_id in sent:
        assert HOLD_CHECK_AT not in await _stored(gateway, batch_id)
