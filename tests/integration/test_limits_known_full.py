"""A tenant refused for its in-flight limit has its counter read before its next submissions
are recorded: the refusal writes nothing (review of admission). Before, each 429 wrote the
submission (a batch: its record and every item) and deleted it again."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from faststream.rabbit import RabbitBroker

from devtools.infra import Endpoint
from services.gateway.batches import BatchItem, BatchPolicy, BatchSubmission, submit_batch
from services.gateway.cache import ResultCache
from services.gateway.limits import InFlight, LimitExceeded
from services.gateway.refusals import Refusals
from services.gateway.schemas import ScoreSubmission
from services.gateway.submissions import BatchRow, Submissions
from services.gateway.submit import SubmitPolicy, Submitted, submit_score
from shared.contracts import ScoreText
from tests.integration.gateway_records import GatewayRecords, Recorded, gateway_records

pytestmark = pytest.mark.integration

NOW = datetime(2030, 5, 17, 12, 0, tzinfo=UTC)
RETENTION = timedelta(days=1)
TENANT = "tenant-a"


class CountedSubmissions(Submissions):
    """The gateway's submissions, counting the records written."""

    inserted = 0

    async def insert(self, command: ScoreText, **kwargs: Any) -> None:
        self.inserted += 1
        await super().insert(command, **kwargs)

    async def insert_batch(self, commands: list[BatchRow], **kwargs: Any) -> None:
        self.inserted += len(commands)
        await super().insert_batch(commands, **kwargs)


@pytest.fixture
async def gateway(
    mongo: Endpoint, db_prefix: str, task_broker: RabbitBroker
) -> AsyncIterator[GatewayRecords]:
    async with gateway_records(mongo.url, db_prefix, task_broker) as records:
        yield records


async def _submit(
    gateway: GatewayRecords,
    submissions: Submissions,
    in_flight: InFlight,
    *,
    key: str | None = None,
    text: str | None = None,
) -> Submitted:
    return await submit_score(
        ScoreSubmission(text=text or f"A text {uuid.uuid4().hex}", use_cache=False),
        tenant_id=TENANT,
        idempotency_key=key,
        submissions=submissions,
        publisher=Recorded(gateway.broker),
        cache=ResultCache(gateway.raw.client, gateway.name, timedelta(hours=1)),
        policy=SubmitPolicy(max_attempts=3, retention=RETENTION),
        clock=lambda: NOW,
        refusals=Refusals(),
        in_flight=in_flight,
    )


async def test_a_tenant_refused_lately_is_refused_again_before_anything_is_written(
    gateway: GatewayRecords,
) -> None:
    submissions = CountedSubmissions(gateway.raw.client, gateway.name)
    in_flight = InFlight(gateway.raw.client, gateway.name, max_per_tenant=1)
    first = await _submit(gateway, submissions, in_flight, key="first", text="The first text.")
    with pytest.raises(LimitExceeded):
        await _submit(gateway, submissions, in_flight)  # written, then refused and removed
    written = submissions.inserted

    with pytest.raises(LimitExceeded):
        await _submit(gateway, submissions, in_flight)
    with pytest.raises(LimitExceeded):
        await submit_batch(
            BatchSubmission(items=[BatchItem(text="An item.")]),
            tenant_id=TENANT,
            api_key_id=None,
            idempotency_key=None,
            batches=gateway.batches,
            submissions=submissions,
            publisher=Recorded(gateway.broker),
            policy=BatchPolicy(max_attempts=3, retention=RETENTION, in_progress_for=RETENTION),
            clock=lambda: NOW,
            refusals=Refusals(),
            in_flight=in_flight,
        )
    assert submissions.inserted == written
    assert await gateway.raw["batches"].count_documents({}) == 0
    # A replay of an accepted request is answered as it was.
    again = await _submit(gateway, submissions, in_flight, key="first", text="The first text.")
    assert (again.task_id, again.created) == (first.task_id, False)

    await in_flight.release(TENANT, first.task_id)  # its outcome came
    assert (await _submit(gateway, submissions, in_flight)).created
