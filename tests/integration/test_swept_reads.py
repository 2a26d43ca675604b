"""Tasks the outbox sweep has just sent read as queued while the status service has not heard
of them, however old they are, on the real database: after a broker alarm longer than the
read-your-writes window, the status service reads its copies behind the alarm's backlog, and
`expired` (a batch item) or 404 (a single task) told the client to resubmit them (scored
twice). Found by review."""

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
from services.gateway.schemas import EXPIRED, ScoreSubmission
from services.gateway.submit import SubmitPolicy, read_score, submit_score, sweep_outbox
from shared.contracts import BatchProgress, TaskView
from tests.integration.gateway_records import GatewayRecords as Gateway
from tests.integration.gateway_records import Recorded, Unconfirmed, gateway_records
from tests.support import SWEEP_RETENTION

T0 = datetime(2030, 5, 17, 12, 0, tzinfo=UTC)
WINDOW = timedelta(minutes=5)  # READ_YOUR_WRITES_WINDOW_S
ALARM = timedelta(hours=1)  # longer than the window
GRACE = timedelta(seconds=30)
TENANT = "tenant-a"


class NotHeardYet:
    """A status service that has applied none of the copies (they wait behind a backlog)."""

    async def batch(
        self, batch_id: str, *, tenant_id: str, after: int, limit: int
    ) -> BatchProgress:
        return BatchProgress(batch_id=batch_id)

    async def find(self, task_id: str, *, tenant_id: str) -> TaskView | None:
        return None


class SweptWhileAnswering(NotHeardYet):
    """Has not heard of the batch when it answers; the sweep sends it meanwhile."""

    def __init__(self, gateway: Gateway, at: datetime) -> None:
        self.gateway, self.at = gateway, at

    async def batch(
        self, batch_id: str, *, tenant_id: str, after: int, limit: int
    ) -> BatchProgress:
        answer = await super().batch(batch_id, tenant_id=tenant_id, after=after, limit=limit)
        assert await _sweep(self.gateway, self.at) > 0
        return answer


class NoCache:
    async def find(self, **_: object) -> None:
        return None


@pytest.fixture
async def gateway(
    mongo: Endpoint, db_prefix: str, task_broker: RabbitBroker
) -> AsyncIterator[Gateway]:
    async with gateway_records(mongo.url, db_prefix, task_broker) as records:
        yield records


async def _sweep(gateway: Gateway, at: datetime) -> int:
    return await sweep_outbox(
        submissions=gateway.submissions,
        publisher=Recorded(gateway.broker),
        clock=lambda: at,
        grace=GRACE,
        refusals=Refusals(),
        retention=SWEEP_RETENTION,
        batches=gateway.batches,
    )


async def _unconfirmed_batch(gateway: Gateway, stalled: RabbitBroker, items: int) -> str:
    """A batch answered 202 during a broker alarm: its items `unconfirmed`."""
    submitted = await submit_batch(
        BatchSubmission.model_validate(
            {"items": [{"text": f"Essay number {i}."} for i in range(items)]}
        ),
        tenant_id=TENANT,
        api_key_id=None,
        idempotency_key=None,
        batches=gateway.batches,
        submissions=gateway.submissions,
        publisher=Unconfirmed(stalled),
        policy=BatchPolicy(max_attempts=4, retention=timedelta(days=1), in_progress_for=WINDOW),
        clock=lambda: T0,
        refusals=Refusals(),
    )
    return submitted.record.batch_id


async def read_at(
    gateway: Gateway, batch_id: str, at: datetime, status: NotHeardYet | None = None
) -> BatchPage:
    """The batch's read at `at`; by default the status service has heard of no item."""
    page = await read_batch(
        batch_id,
        tenant_id=TENANT,
        start=0,
        limit=10,
        batches=gateway.batches,
        status=status or NotHeardYet(),
        submissions=gateway.submissions,
        clock=lambda: at,
        window=WINDOW,
        grace=timedelta(seconds=30),
    )
    assert page is not None
    return page


def _nonzero(page: BatchPage) -> dict[str, int]:
    return {state: n for state, n in page.counts.items() if n}


async def test_batch_items_the_sweep_just_sent_read_queued_until_the_window_ends(
    gateway: Gateway, stalled_broker: RabbitBroker
) -> None:
    batch_id = await _unconfirmed_batch(gateway, stalled_broker, items=4)
    alarm_over = T0 + ALARM
    assert await _sweep(gateway, alarm_over) == 4

    just_sent = await read_at(gateway, batch_id, alarm_over + timedelta(seconds=1))
    assert [item.status for item in just_sent.items] == ["queued"] * 4
    assert _nonzero(just_sent) == {"queued": 4}

    # Still unheard of a window after they were sent: expired, as a young batch's would be.
    later = await read_at(gateway, batch_id, alarm_over + WINDOW + timedelta(seconds=1))
    assert [item.status for item in later.items] == [EXPIRED] * 4
    assert _nonzero(later) == {EXPIRED: 4}


async def test_batch_items_the_sweep_sends_while_the_status_service_answers_read_queued(
    gateway: Gateway, stalled_broker: RabbitBroker
) -> None:
    """No backlog: the sweep sends and marks the items between the status service's answer
    and the read of the batch's submissions."""
    batch_id = await _unconfirmed_batch(gateway, stalled_broker, items=3)
    at = T0 + ALARM

    page = await read_at(gateway, batch_id, at, status=SweptWhileAnswering(gateway, at))

    assert [item.status for item in page.items] == ["queued"] * 3
    assert _nonzero(page) == {"queued": 3}


async def test_a_single_task_the_sweep_just_sent_reads_queued_until_the_window_ends(
    gateway: Gateway, stalled_broker: RabbitBroker
) -> None:
    submitted = await submit_score(
        ScoreSubmission.model_validate({"text": "An essay.", "use_cache": False}),
        tenant_id=TENANT,
        idempotency_key=None,
        submissions=gateway.submissions,
        publisher=Unconfirmed(stalled_broker),
        cache=NoCache(),  # type: ignore[arg-type]
        policy=SubmitPolicy(max_attempts=4, retention=timedelta(days=1)),
        clock=lambda: T0,
        refusals=Refusals(),
    )
    alarm_over = T0 + ALARM
    assert await _sweep(gateway, alarm_over) == 1

    async def read(at: datetime) -> TaskView | None:
        return await read_score(
            submitted.task_id,
            tenant_id=TENANT,
            status=NotHeardYet(),
            submissions=gateway.submissions,
            clock=lambda: at,
            window=WINDOW,
        )

    view = await read(alarm_over + timedelta(seconds=1))
    assert view is not None, "404 for a task sent a second ago"
    assert view.status == "queued"
    assert await read(alarm_over + WINDOW + timedelta(seconds=1)) is None
