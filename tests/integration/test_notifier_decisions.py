"""A webhook attempt's outcome is recorded while its lease holds, whatever the database does.

The POST has been made when the outcome is written: an outcome lost to a database that is
away, or that applied the write but whose answer never came, used to send the attempt's
message again, and the redelivery POSTed again (at once in the same process, which takes
its own lease over), or, for a retry whose write landed, dropped the next attempt as "claim
lost". `deliver_webhook` runs here on the real database (MongoDB or the stand-in), reached
through `SlowLink`, which the receiver's answer cuts or slows until the notifier has failed
a write, and posts to an https receiver of the test.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from pymongo import AsyncMongoClient

from services.notifier.deliveries import (
    Done,
    Send,
    Sender,
    deliver_webhook,
)
from services.notifier.ledger import DeliveryState, Ledger
from services.notifier.sender import ReceiverAnswer
from services.notifier.ssrf import Destination
from shared.contracts import utcnow
from tests.faults.slow_link import SlowLink
from tests.integration import test_notifier_own_claims as own_claims
from tests.integration.test_notifier import Receiver
from tests.integration.test_notifier_own_claims import Deps, _delivery
from tests.support import eventually

receiver = own_claims.receiver  # fixtures
make_deps = own_claims.make_deps
LEASE = timedelta(seconds=60)
TIMEOUT_S = 2.0  # the ledger's MONGO_TIMEOUT_S: well above a loaded stand-in's slowest reply


class FaultAfterPost:
    """The real sender; once the receiver has answered, the database link fails (`fault`)
    until a write of the outcome has failed, then it heals."""

    def __init__(
        self,
        sender: Sender,
        link: SlowLink,
        fault: str,
        failures: Callable[[], list[logging.LogRecord]],
    ) -> None:
        self._sender = sender
        self._link = link
        self._fault = fault
        self._failures = failures
        self.healed: asyncio.Task[None] | None = None

    async def post(
        self, destination: Destination, *, body: bytes, headers: Mapping[str, str]
    ) -> ReceiverAnswer:
        answer = await self._sender.post(destination, body=body, headers=headers)
        if self._fault == "cut":
            await self._link.cut()
        else:
            self._link.reply_delay_s = 3 * TIMEOUT_S
        self.healed = asyncio.create_task(self._heal_after_a_failed_write())
        return answer

    async def _heal_after_a_failed_write(self) -> None:
        async def failed() -> bool:
            return bool(self._failures())

        await eventually(failed, what="a write of the outcome failed")
        self._link.down = False
        self._link.reply_delay_s = 0


@pytest.fixture
async def ledger(database_link: SlowLink, db_prefix: str) -> AsyncIterator[Ledger]:
    """The ledger `make_deps` takes, reaching the database through the link."""
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
        database_link.mongo_url, tz_aware=True, timeoutMS=int(TIMEOUT_S * 1000)
    )
    store = Ledger(client, f"{db_prefix}_notifier", retention=timedelta(hours=1))
    await store.ensure_indexes()
    yield store
    await client.close()


@pytest.mark.parametrize("fault", ["cut", "answer lost"])
@pytest.mark.parametrize(
    ("status", "state"), [(200, DeliveryState.DELIVERED), (503, DeliveryState.RETRYING)]
)
async def test_an_outcome_the_database_did_not_take_at_first_is_recorded_and_not_resent(
    fault: str,
    status: int,
    state: DeliveryState,
    ledger: Ledger,
    make_deps: Deps,
    database_link: SlowLink,
    receiver: tuple[Receiver, Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    endpoint = receiver[0]
    deps = make_deps("proc-a")
    delivery = _delivery(endpoint).model_copy(update={"url": endpoint.endpoint(status)})

    def failed_writes() -> list[logging.LogRecord]:
        return [
            record
            for record in caplog.records
            if delivery.delivery_id in record.getMessage() and "failed" in record.getMessage()
        ]

    sender = FaultAfterPost(deps.sender, database_link, fault, failed_writes)
    await ledger.register(delivery, now=utcnow())

    decision = await deliver_webhook(delivery, deps=replace(deps, sender=sender))

    assert sender.healed is not None
    assert sender.healed.done()
    if status == 200:
        assert decision == Done("delivered (200)")
    else:
        assert isinstance(decision, Send), decision
        assert decision.command.attempt == delivery.attempt + 1
    record = await ledger.find(delivery.delivery_id)
    assert record is not None
    assert record.state is state
    assert len(endpoint.requests(delivery.url)) == 1
