"""A batch's items not sent yet, or just sent by the outbox sweep, read as queued however old
the batch, on the real database: the status service has not heard of them, and `expired` told
their client to resubmit them (scored twice once the originals ran)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
from faststream.rabbit import RabbitBroker

from devtools.infra import Endpoint
from services.gateway.batches import (
    BatchPage,
    BatchPolicy,
    BatchSubmission,
    read_batch,
    submit_batch,
)
from services.gateway.refusals import Refusals
from services.gateway.schemas import EXPIRED
from services.gateway.submissions import SubmissionState
from shared.contracts import BatchItemProgress, BatchProgress, ScoreResult, TaskStatus
from tests.integration.gateway_records import GatewayRecords as Gateway
from tests.integration.gateway_records import Unconfirmed, gateway_records

T0 = datetime(2030, 5, 17, 12, 0, tzinfo=UTC)
WINDOW = timedelta(minutes=5)  # READ_YOUR_WRITES_WINDOW_S
TENANT = "tenant-a"


class Heard:
    """A status service that has heard of the batch's item 1 only (completed)."""

    def __init__(self, task_id: str) -> None:
        self.item = BatchItemProgress(
            task_id=task_id,
            batch_index=1,
            status=TaskStatus.COMPLETED,
            updated_at=T0,
            result=ScoreResult(score=5, comment="c", model="m"),
        )

    async def batch(
        self, batch_id: str, *, tenant_id: str, after: int, limit: int
    ) -> BatchProgress:
        items = [self.item] if after < self.item.batch_index else []
        return BatchProgress(
            batch_id=batch_id, counts={TaskStatus.COMPLETED: 1}, items=items[:limit]
        )


@pytest.fixture
async def gateway(
    mongo: Endpoint, db_prefix: str, task_broker: RabbitBroker
) -> AsyncIterator[Gateway]:
    async with gateway_records(mongo.url, db_prefix, task_broker) as records:
        yield records


async def test_items_not_sent_yet_or_just_swept_read_as_queued_however_old_their_batch(
    gateway: Gateway, stalled_broker: RabbitBroker
) -> None:
    request = BatchSubmission.model_validate(
        {"items": [{"text": f"Essay number {i}."} for i in range(6)]}
    )
    submitted = await submit_batch(
        request,
        tenant_id=TENANT,
        api_key_id=None,
        idempotency_key=None,
        batches=gateway.batches,
        submissions=gateway.submissions,
        publisher=Unconfirmed(stalled_broker),
        policy=BatchPolicy(max_attempts=4, retention=timedelta(days=1), in_progress_for=WINDOW),
        clock=lambda: T0,
        refusals=Refusals(),
    )
    batch_id = submitted.record.batch_id
    tasks = [member.task_id for member in submitted.record.members]
    read_at = T0 + timedelta(hours=1)
    # Item 0 stays `unconfirmed` (the alarm), item 1 was sent (the status service heard of
    # it), item 2 is `accepting` (its gateway died before it marked it). A sweep sent item 3
    # long ago (its result has expired since) and item 4 a second ago (the status service
    # has not read its copy yet). Item 5 is marked sent with no time, as its request or an
    # earlier build's sweep marks it: sent when submitted.
    await gateway.submissions.mark_accepted(tasks[1])
    await gateway.raw["submissions"].update_one(
        {"_id": tasks[2]}, {"$set": {"state": SubmissionState.ACCEPTING.value}}
    )
    await gateway.submissions.mark_accepted(tasks[3], sent_at=T0 + timedelta(minutes=1))
    await gateway.submissions.mark_accepted(tasks[4], sent_at=read_at - timedelta(seconds=1))
    await gateway.submissions.mark_accepted(tasks[5])

    async def read(start: int, limit: int) -> BatchPage:
        page = await read_batch(
            batch_id,
            tenant_id=TENANT,
            start=start,
            limit=limit,
            batches=gateway.batches,
            status=Heard(tasks[1]),
            submissions=gateway.submissions,
            clock=lambda: read_at,
            window=WINDOW,
            grace=timedelta(seconds=30),
        )
        assert page is not None
        return page

    whole = await read(0, 10)
    statuses = ["queued", "completed", "queued", EXPIRED, "queued", EXPIRED]
    assert [item.status for item in whole.items] == statuses
    counts = {"queued": 3, "completed": 1, EXPIRED: 2}
    assert {state: n for state, n in whole.counts.items() if n} == counts

    # The counts are the whole batch's, items 0 and 4 included, on a page without them.
    last = await read(2, 2)
    assert [item.status for item in last.items] == ["queued", EXPIRED]
    assert {state: n for state, n in last.counts.items() if n} == counts
