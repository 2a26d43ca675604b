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
import random
from collections.abc import AsyncIterator, Callable, Mapping
from datetime import timedelta
from typing import Any

import pytest
from pymongo import AsyncMongoClient

from devtools.infra import Endpoint
from services.notifier.deliveries import (
    DeliveryDeps,
    Done,
    RetryPolicy,
    Send,
    Sender,
    deliver_webhook,
)
from services.notifier.keyring import Keyring
from services.notifier.ledger import DeliveryState, Ledger
from services.notifier.sender import ReceiverAnswer, WebhookSender, make_ssl_context
from services.notifier.ssrf import Destination, WebhookGuard
from shared.contracts import utcnow
from tests.faults.slow_link import SlowLink
from tests.integration import test_notifier_own_claims as own_claims
from tests.integration.test_notifier import RECEIVER_HOST, Receiver, TableResolver
from tests.integration.test_notifier_own_claims import _delivery
from tests.support import eventually

receiver = own_claims.receiver  # fixture
LEASE = timedelta(seconds=60)
TIMEOUT_S = 0.5  # the ledger's MONGO_TIMEOUT_S


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
async def link(mongo: Endpoint) -> AsyncIterator[SlowLink]:
    proxy = SlowLink.to_mongo(mongo.url)
    await proxy.start()
    yield proxy
    await proxy.stop()


@pytest.fixture
async def ledger(link: SlowLink, db_prefix: str) -> AsyncIterator[Ledger]:
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
        link.mongo_url, tz_aware=True, timeoutMS=int(TIMEOUT_S * 1000)
    )
    store = Ledger(client, f"{db_prefix}_notifier", retention=timedelta(hours=1))
    await store.ensure_indexes()
    yield store
    await client.close()


@pytest.fixture
async def keyring(mongo: Endpoint, db_prefix: str) -> AsyncIterator[Keyring]:
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo.url, tz_aware=True)
    yield Keyring(client, f"{db_prefix}_notifier")
    await client.close()


def _deps(ledger: Ledger, keyring: Keyring, sender: Sender) -> DeliveryDeps:
    return DeliveryDeps(
        ledger=ledger,
        keyring=keyring,
        guard=WebhookGuard(
            TableResolver({RECEIVER_HOST: ["127.0.0.1"]}),
            allowed_test_hosts=frozenset({"127.0.0.1"}),
        ),
        sender=sender,
        policy=RetryPolicy(base_s=0.01, cap_s=0.1),
        clock=utcnow,
        rng=random.Random(0),
        owner="proc-a",
        lease=LEASE,
    )


@pytest.mark.parametrize("fault", ["cut", "answer lost"])
@pytest.mark.parametrize(
    ("status", "state"), [(200, DeliveryState.DELIVERED), (503, DeliveryState.RETRYING)]
)
async def test_an_outcome_the_database_did_not_take_at_first_is_recorded_and_not_resent(
    fault: str,
    status: int,
    state: DeliveryState,
    ledger: Ledger,
    keyring: Keyring,
    link: SlowLink,
    receiver: tuple[Receiver, Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    endpoint, ca_file = receiver
    real = WebhookSender(
        ssl_context=make_ssl_context(ca_file),
        connect_timeout_s=5,
        timeout_s=10,
        max_response_bytes=4096,
    )
    delivery = _delivery(endpoint).model_copy(update={"url": endpoint.endpoint(status)})

    def failed_writes() -> list[logging.LogRecord]:
        return [
            record
            for record in caplog.records
            if delivery.delivery_id in record.getMessage() and "failed" in record.getMessage()
        ]

    sender = FaultAfterPost(real, link, fault, failed_writes)
    await ledger.register(delivery, now=utcnow())

    decision = await deliver_webhook(delivery, deps=_deps(ledger, keyring, sender))

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
