"""A batch's items not sent yet read as queued however old the batch, on the real database:
the status service has not heard of them, and `expired` told their client to resubmit them
(scored twice once the outbox sweep sent the originals)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime, timedelta

import pytest

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
from shared.contracts import BatchItemProgress, BatchProgress, ScoreResult, ScoreText, TaskStatus
from tests.integration.gateway_records import GatewayRecords as Gateway
from tests.integration.gateway_records import Recorded, gateway_records

T0 = datetime(2030, 5, 17, 12, 0, tzinfo=UTC)
WINDOW = timedelta(minutes=5)  # READ_YOUR_WRITES_WINDOW_S
TENANT = "tenant-a"


class Unconfirmed(Recorded):
    """A broker that takes the commands without confirming them (a memory alarm)."""

    async def send_many(self, commands: Sequence[ScoreText]) -> bool:
        await super().send_many(commands)
        return False


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
async def gateway(mongo: Endpoint, db_prefix: str) -> AsyncIterator[Gateway]:
    async with gateway_records(mongo.url, db_prefix) as records:
        yield records


async def test_items_not_sent_yet_read_as_queued_however_old_their_batch(
    gateway: Gateway,
) -> None:
    request = BatchSubmission.model_validate(
        {"items": [{"text": f"Essay number {i}."} for i in range(4)]}
    )
    submitted = await submit_batch(
        request,
        tenant_id=TENANT,
        api_key_id=None,
        idempotency_key=None,
        batches=gateway.batches,
        submissions=gateway.submissions,
        publisher=Unconfirmed(),
        policy=BatchPolicy(max_attempts=4, retention=timedelta(days=1), in_progress_for=WINDOW),
        clock=lambda: T0,
        refusals=Refusals(),
    )
    batch_id = submitted.record.batch_id
    tasks = [member.task_id for member in submitted.record.members]
    # Item 0 stays `unconfirmed` (the alarm), item 2 `accepting` (its gateway died before it
    # marked it), item 3 was sent by a sweep and its result has expired since.
    await gateway.raw["submissions"].update_one(
        {"_id": tasks[2]}, {"$set": {"state": SubmissionState.ACCEPTING.value}}
    )
    await gateway.submissions.mark_accepted(tasks[3])

    async def read(start: int, limit: int) -> BatchPage:
        page = await read_batch(
            batch_id,
            tenant_id=TENANT,
            start=start,
            limit=limit,
            batches=gateway.batches,
            status=Heard(tasks[1]),
            submissions=gateway.submissions,
            clock=lambda: T0 + timedelta(hours=1),
            window=WINDOW,
        )
        assert page is not None
        return page

    whole = await read(0, 10)
    assert [item.status for item in whole.items] == ["queued", "completed", "queued", EXPIRED]
    counts = {"queued": 2, "completed": 1, EXPIRED: 1}
    assert {state: n for state, n in whole.counts.items() if n} == counts

    # The counts are the whole batch's, item 0 included, on a page without it.
    last = await read(2, 2)
    assert [item.status for item in last.items] == ["queued", EXPIRED]
    assert {state: n for state, n in last.counts.items() if n} == counts
