"""A submission not sent yet never expires: an accepted task waiting for the outbox sweep (a
broker alarm longer than `IDEMPOTENCY_TTL_S`, a gateway that died between insert and publish)
was deleted by the TTL index and never published. It takes its expiry, `IDEMPOTENCY_TTL_S`
after it was due, once sent; a tombstone `TOMBSTONE_TTL` after its write-off.

The labelled stand-in (mongoeco) implements TTL indexes, and removes an expired document at
its next operation rather than within a minute as MongoDB's monitor does: a record past its
`expires_at` is gone at once here. The checks below read the field values as well, so they
hold against MongoDB without waiting for its monitor."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from faststream.rabbit import RabbitBroker

from devtools.infra import Endpoint
from services.gateway.refusals import Refusals
from services.gateway.submissions import (
    EXPIRY_ONCE_SENT,
    LEGACY_UNSENT_HOLD,
    TOMBSTONE_TTL,
    RescoreClaim,
    Submissions,
    SubmissionState,
    recently_due,
)
from services.gateway.submit import read_score, sweep_outbox
from shared.contracts import ScoreText, TaskView, new_id, utcnow
from tests.integration.gateway_records import GatewayRecords as Gateway
from tests.integration.gateway_records import Recorded, Unconfirmed, gateway_records
from tests.support import SWEEP_RETENTION

pytestmark = pytest.mark.integration

Document = dict[str, Any]
RETENTION = timedelta(days=1)  # IDEMPOTENCY_TTL_S's default
# Past its retention: under the earlier expiry, its record was removed before it was sent.
OUTAGE = timedelta(days=3)
SLACK = timedelta(minutes=5)  # the test's own run time, between `utcnow()` and a write


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


class NoProjection:
    """A status service that never heard of the task (its announcement is not sent yet)."""

    async def find(self, task_id: str, *, tenant_id: str) -> TaskView | None:
        return None


def _command(submitted_at: datetime, *, batch_id: str | None = None, **fields: Any) -> ScoreText:
    return ScoreText(
        task_id=new_id(),
        text="Accepted during a broker outage.",
        submitted_at=submitted_at,
        occurred_at=submitted_at,
        batch_id=batch_id,
        **fields,
    )


async def _record(
    submissions: Submissions, command: ScoreText, state: SubmissionState, key: str | None = None
) -> None:
    await submissions.insert(
        command, request_hash="h", idempotency_key=key, retention=RETENTION, cache_key="c"
    )
    if state is SubmissionState.UNCONFIRMED:
        await submissions.mark_unconfirmed(command.task_id)


async def _stored(gateway: Gateway, task_id: str) -> Document | None:
    found: Document | None = await gateway.raw["submissions"].find_one({"_id": task_id})
    return found


UNSENT = [
    pytest.param(SubmissionState.ACCEPTING, id="interrupted before its publish"),
    pytest.param(SubmissionState.UNCONFIRMED, id="answered 202, confirm never came"),
]


@pytest.mark.parametrize("state", UNSENT)
async def test_an_unsent_submission_outlives_its_retention_and_is_sent_by_the_sweep(
    gateway: Gateway, state: SubmissionState
) -> None:
    now = _now()
    command = _command(now - OUTAGE)
    await _record(gateway.submissions, command, state, key="key-1")

    stored = await _stored(gateway, command.task_id)
    assert stored is not None, "deleted by the TTL index before it was sent"
    assert "expires_at" not in stored  # nothing for the TTL index to fire on
    assert stored[EXPIRY_ONCE_SENT] == command.submitted_at + RETENTION
    assert stored["state"] == state.value

    # Its idempotency key still names it, and a poll answers from the record.
    by_key = await gateway.submissions.find_by_key("key-1", tenant_id=command.tenant_id)
    assert by_key is not None
    assert by_key.state is state
    mine = await gateway.submissions.find(command.task_id, tenant_id=command.tenant_id)
    assert mine is not None
    assert recently_due(mine, now=now, window=timedelta(minutes=5))
    view = await read_score(
        command.task_id,
        tenant_id=command.tenant_id,
        status=NoProjection(),
        submissions=gateway.submissions,
        clock=utcnow,
        window=timedelta(minutes=5),
    )
    assert view is not None
    assert view.status == "queued"

    publisher = Recorded(gateway.broker)
    sent = await sweep_outbox(
        submissions=gateway.submissions,
        publisher=publisher,
        clock=utcnow,
        grace=timedelta(seconds=30),
        refusals=Refusals(),
        retention=SWEEP_RETENTION,
        batches=gateway.batches,
    )
    assert (sent, publisher.sent) == (1, [command.task_id])


async def test_a_submission_expires_its_retention_after_it_was_due_once_sent(
    gateway: Gateway,
) -> None:
    now = _now()
    due = now + timedelta(hours=2)
    command = _command(now, not_before=due)
    await _record(gateway.submissions, command, SubmissionState.UNCONFIRMED)
    stored = await _stored(gateway, command.task_id)
    assert stored is not None
    assert "expires_at" not in stored

    await gateway.submissions.mark_accepted(command.task_id)
    stored = await _stored(gateway, command.task_id)
    assert stored is not None
    assert stored["state"] == SubmissionState.ACCEPTED
    assert stored["expires_at"] == due + RETENTION
    assert EXPIRY_ONCE_SENT not in stored

    await gateway.submissions.mark_accepted(command.task_id)  # the sweep's late copy
    again = await _stored(gateway, command.task_id)
    assert again is not None
    assert again["expires_at"] == due + RETENTION

    # A re-score before the expiry claims it; the record still answers its key's replay.
    claimed = await gateway.submissions.claim_rescore(
        command.task_id, tenant_id=command.tenant_id, rubric_version="v2", request_id="r", now=now
    )
    assert isinstance(claimed, RescoreClaim)


async def test_a_batch_item_is_unsent_without_expiry_and_expires_once_sent(
    gateway: Gateway,
) -> None:
    now = _now()
    batch_id = new_id()
    old, young = _command(now - OUTAGE, batch_id=batch_id), _command(now, batch_id=batch_id)
    await gateway.submissions.insert_batch(
        [(old, "h1", "c1", "m"), (young, "h2", "c2", "m")], retention=RETENTION
    )
    assert await gateway.submissions.unsent_in_batch(batch_id, sent_since=now) == {
        old.task_id,
        young.task_id,
    }

    await gateway.submissions.mark_batch_accepted(batch_id, [young.task_id])
    await gateway.submissions.mark_batch_unconfirmed(batch_id)  # the rest: not confirmed
    sent = await _stored(gateway, young.task_id)
    assert sent is not None
    assert sent["expires_at"] == now + RETENTION
    assert EXPIRY_ONCE_SENT not in sent
    unsent = await _stored(gateway, old.task_id)
    assert unsent is not None
    assert unsent["state"] == SubmissionState.UNCONFIRMED
    assert "expires_at" not in unsent
    assert await gateway.submissions.unsent_in_batch(batch_id, sent_since=now) == {old.task_id}


async def test_a_written_off_submission_expires_as_a_tombstone(gateway: Gateway) -> None:
    now = _now()
    command = _command(now - OUTAGE)
    await _record(gateway.submissions, command, SubmissionState.ACCEPTING, key="key-2")
    unsent = await _stored(gateway, command.task_id)
    assert unsent is not None
    assert "expires_at" not in unsent

    await gateway.submissions.abandon((command.task_id,), now=now)
    stored = await _stored(gateway, command.task_id)
    assert stored is not None
    assert stored["state"] == SubmissionState.ABANDONED
    assert stored["expires_at"] == now + TOMBSTONE_TTL  # not kept for ever
    assert EXPIRY_ONCE_SENT not in stored
    assert await gateway.submissions.find_by_key("key-2", tenant_id=command.tenant_id) is None


async def test_an_old_unsent_submission_can_still_be_rescored(gateway: Gateway) -> None:
    """Its text is kept while it is unsent: it is the command the sweep will send."""
    now = _now()
    command = _command(now - OUTAGE)
    await _record(gateway.submissions, command, SubmissionState.UNCONFIRMED)
    claimed = await gateway.submissions.claim_rescore(
        command.task_id, tenant_id=command.tenant_id, rubric_version="v2", request_id="r", now=now
    )
    assert isinstance(claimed, RescoreClaim)
    assert claimed.command.task_id == command.task_id


async def test_the_sweep_holds_unsent_records_of_an_earlier_build_from_expiring(
    gateway: Gateway,
) -> None:
    """Earlier builds set `expires_at` at insert. During and after a rolling upgrade the sweep
    pushes it forward on unsent records about to expire; sent ones keep theirs."""
    now = _now()
    soon = now + timedelta(hours=1)
    legacy = {"tenant_id": "t", "request_hash": "h", "cache_key": "c", "created_at": now}
    await gateway.raw["submissions"].insert_many(
        [
            {**legacy, "_id": "unconfirmed", "state": "unconfirmed", "expires_at": soon},
            {**legacy, "_id": "accepting", "state": "accepting", "expires_at": soon},
            {**legacy, "_id": "accepted", "state": "accepted", "expires_at": soon},
            {**legacy, "_id": "far", "state": "unconfirmed", "expires_at": now + 3 * RETENTION},
        ]
    )

    await gateway.submissions.interrupted(older_than=now - timedelta(seconds=30))

    expiries = {
        document["_id"]: document["expires_at"]
        async for document in gateway.raw["submissions"].find({})
    }
    held = now + 2 * LEGACY_UNSENT_HOLD
    for unsent in ("unconfirmed", "accepting"):
        assert held <= expiries[unsent] <= held + SLACK
    assert expiries["accepted"] == soon
    assert expiries["far"] == now + 3 * RETENTION


async def test_a_submission_swept_after_its_retention_is_kept_a_retention_from_then(
    gateway: Gateway,
) -> None:
    """Sent after an outage longer than its retention, its expiry (due + retention) had
    passed when the sweep marked it: the TTL index removed it at once, so its poll answered
    404 while the projection was behind, and its Idempotency-Key was free again (a replay
    scored the text twice)."""
    now = _now()
    command = _command(now - OUTAGE)
    await _record(gateway.submissions, command, SubmissionState.UNCONFIRMED, key="key-late")

    sent = await sweep_outbox(
        submissions=gateway.submissions,
        publisher=Recorded(gateway.broker),
        clock=utcnow,
        grace=timedelta(seconds=30),
        refusals=Refusals(),
        retention=RETENTION,
        batches=gateway.batches,
    )

    assert sent == 1
    stored = await _stored(gateway, command.task_id)
    assert stored is not None, "removed by the TTL index right after it was sent"
    assert stored["expires_at"] >= now + RETENTION
    assert EXPIRY_ONCE_SENT not in stored
    by_key = await gateway.submissions.find_by_key("key-late", tenant_id=command.tenant_id)
    assert by_key is not None
    view = await read_score(
        command.task_id,
        tenant_id=command.tenant_id,
        status=NoProjection(),
        submissions=gateway.submissions,
        clock=utcnow,
        window=timedelta(minutes=5),
    )
    assert view is not None


async def test_a_delayed_submission_swept_keeps_its_later_expiry(gateway: Gateway) -> None:
    now = _now()
    due = now + timedelta(days=2)
    command = _command(now, not_before=due)
    await _record(gateway.submissions, command, SubmissionState.UNCONFIRMED)

    await gateway.submissions.mark_accepted(command.task_id, sent_at=now, retention=RETENTION)

    stored = await _stored(gateway, command.task_id)
    assert stored is not None
    assert stored["expires_at"] == due + RETENTION
    assert stored["state"] == SubmissionState.ACCEPTED
    assert EXPIRY_ONCE_SENT not in stored


async def test_a_sweep_pass_ends_at_the_first_send_the_broker_does_not_confirm(
    gateway: Gateway, stalled_broker: RabbitBroker
) -> None:
    """Under an alarm every send waits out its timeout: a pass sending on through 500 records
    took over an hour, and the batch holds after it came too late (a batch record expired
    with items unsent). The rest are sent by a later pass."""
    now = _now()
    commands = [_command(now - timedelta(hours=1)) for _ in range(3)]
    for command in commands:
        await _record(gateway.submissions, command, SubmissionState.UNCONFIRMED)
    alarm = Unconfirmed(stalled_broker)

    sent = await sweep_outbox(
        submissions=gateway.submissions,
        publisher=alarm,
        clock=utcnow,
        grace=timedelta(seconds=30),
        refusals=Refusals(),
        retention=RETENTION,
        batches=gateway.batches,
    )

    assert (sent, len(alarm.sent)) == (0, 1)
    later = Recorded(gateway.broker)
    sent = await sweep_outbox(
        submissions=gateway.submissions,
        publisher=later,
        clock=utcnow,
        grace=timedelta(seconds=30),
        refusals=Refusals(),
        retention=RETENTION,
        batches=gateway.batches,
    )
    assert {command.task_id for command in commands} <= set(later.sent)
