"""A webhook its receiver accepted is recorded delivered however long the database is away.

After a 2xx, the notifier repeated `mark_delivered` only while its claim's lease held; past
it, the error reached the consumer, which sent the same attempt again as a copy, and the copy,
claiming the lapsed lease once the database was back, POSTed a webhook the notifier knew had
been delivered. The write is now repeated until it lands, the delivery held meanwhile.
`deliver_webhook` runs on the real database, reached through a link the test cuts once the
receiver has answered, and posts to an https receiver of the test."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from pymongo import AsyncMongoClient

from services.notifier.deliveries import Done, Sender, deliver_webhook
from services.notifier.ledger import DeliveryState, Ledger
from services.notifier.sender import ReceiverAnswer
from services.notifier.ssrf import Destination
from shared.contracts import utcnow
from tests.faults.slow_link import SlowLink
from tests.integration import test_notifier_own_claims as own_claims
from tests.integration.test_notifier import Receiver
from tests.integration.test_notifier_own_claims import Deps, _delivery
from tests.support import eventually

pytestmark = pytest.mark.integration

receiver = own_claims.receiver  # fixtures
make_deps = own_claims.make_deps
LEASE = timedelta(seconds=3)


class CutAfterPost:
    """The real sender; once the receiver has answered, the database link goes down."""

    def __init__(self, sender: Sender, link: SlowLink) -> None:
        self._sender = sender
        self._link = link

    async def post(
        self, destination: Destination, *, body: bytes, headers: Mapping[str, str]
    ) -> ReceiverAnswer:
        answer = await self._sender.post(destination, body=body, headers=headers)
        await self._link.cut()
        return answer


@pytest.fixture
async def ledger(database_link: SlowLink, db_prefix: str) -> AsyncIterator[Ledger]:
    """The ledger over the link the test cuts (a second's server selection, so each try
    fails fast while it is cut)."""
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
        database_link.mongo_url, tz_aware=True, timeoutMS=1000
    )
    store = Ledger(client, f"{db_prefix}_notifier", retention=timedelta(hours=1))
    await store.ensure_indexes()
    yield store
    await client.close()


async def test_a_2xx_is_recorded_delivered_after_an_outage_longer_than_the_lease(
    ledger: Ledger,
    make_deps: Deps,
    database_link: SlowLink,
    receiver: tuple[Receiver, Any],
) -> None:
    endpoint = receiver[0]
    delivery = _delivery(endpoint)
    await ledger.register(delivery, now=utcnow())
    deps = replace(make_deps("proc-a"), ledger=ledger, lease=LEASE, post_time=timedelta(seconds=1))
    cutting = replace(deps, sender=CutAfterPost(deps.sender, database_link))

    trying = asyncio.create_task(deliver_webhook(delivery, deps=cutting))

    async def posted() -> bool:
        return len(endpoint.requests(delivery.url)) == 1

    await eventually(posted, what="the receiver answered")
    lease_over = utcnow() + LEASE

    async def outage_outlived_the_lease() -> bool:
        return trying.done() or utcnow() > lease_over

    await eventually(outage_outlived_the_lease, what="the lease ran out in the outage")
    database_link.down = False

    assert await trying == Done("delivered (200)")
    record = await ledger.find(delivery.delivery_id)
    assert record is not None
    assert record.state is DeliveryState.DELIVERED
    assert len(endpoint.requests(delivery.url)) == 1
