"""A webhook's lease whose answer was lost is the notifier's own to take over at once.

When the database answers slowly, a delivery's claim can reach it after the notifier gave up
on the answer; the notifier sends the delivery again later, and that delivery found the
attempt `sending` under a lease of this very process, which sends nothing of it. It used to
wait for the lease (`WEBHOOK_DNS_TIMEOUT_S` + `WEBHOOK_TIMEOUT_S` + 30 s) before sending.
`deliver_webhook` runs here on the real database and posts to an https receiver of the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from email.utils import format_datetime
from typing import Any

import pytest
from pymongo import AsyncMongoClient
from standardwebhooks import Webhook

from services.notifier.consumer import subscribe_deliveries
from services.notifier.deliveries import (
    DeliveryDeps,
    Done,
    RetryPolicy,
    Send,
    Sender,
    deliver_webhook,
)
from services.notifier.keyring import Keyring
from services.notifier.ledger import Claim, DeliveryState, Ledger
from services.notifier.registry import FailureAlerts
from services.notifier.sender import ReceiverAnswer, WebhookSender, make_ssl_context
from services.notifier.ssrf import Destination, WebhookGuard
from shared.contracts import DeliverWebhook, WebhookPurpose, new_id, utcnow
from shared.webhook_urls import IPAddress
from tests.integration.test_notifier import (
    RECEIVER_HOST,
    Receiver,
    TableResolver,
    _start_receiver,
    _tls,
)
from tests.support import HandedDelivery, HandlerOnly, eventually

LEASE = timedelta(seconds=60)
Deps = Callable[[str], DeliveryDeps]


@pytest.fixture(scope="module")
async def receiver(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[tuple[Receiver, Any]]:
    server_tls, ca_file = _tls(tmp_path_factory.mktemp("own-claims"))
    started, runner = await _start_receiver(server_tls)
    yield started, ca_file
    await runner.cleanup()


@pytest.fixture
async def ledger(mongo: Any, db_prefix: str) -> AsyncIterator[Ledger]:
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo.url, tz_aware=True)
    store = Ledger(client, f"{db_prefix}_notifier", retention=timedelta(hours=1))
    await store.ensure_indexes()
    yield store
    await client.close()


@pytest.fixture
async def make_deps(
    receiver: tuple[Receiver, Any], ledger: Ledger, mongo: Any, db_prefix: str
) -> AsyncIterator[Deps]:
    _, ca_file = receiver
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo.url, tz_aware=True)
    keyring = Keyring(client, f"{db_prefix}_notifier")
    alerts = FailureAlerts(client, f"{db_prefix}_notifier")
    guard = WebhookGuard(
        TableResolver({RECEIVER_HOST: ["127.0.0.1"]}), allowed_test_hosts=frozenset({"127.0.0.1"})
    )
    sender = WebhookSender(
        ssl_context=make_ssl_context(ca_file),
        connect_timeout_s=5,
        timeout_s=10,
        max_response_bytes=4096,
    )

    def deps(owner: str) -> DeliveryDeps:
        return DeliveryDeps(
            ledger=ledger,
            keyring=keyring,
            alerts=alerts,
            guard=guard,
            sender=sender,
            policy=RetryPolicy(base_s=0.01, cap_s=0.1),
            clock=utcnow,
            rng=random.Random(0),
            owner=owner,
            lease=LEASE,
        )

    yield deps
    await client.close()


def _delivery(receiver: Receiver) -> DeliverWebhook:
    return DeliverWebhook(
        task_id=new_id(),
        delivery_id=f"msg_{uuid.uuid4().hex}",
        purpose=WebhookPurpose.CALLBACK,
        url=receiver.endpoint(200),
        event_type="task.completed",
        payload={"type": "task.completed"},
    )


async def test_a_lease_of_ours_whose_answer_was_lost_is_taken_over_at_once(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any]
) -> None:
    delivery = _delivery(receiver[0])
    await ledger.register(delivery, now=utcnow())
    await ledger.claim(delivery, process="proc-a", owner="proc-a/lost", now=utcnow(), lease=LEASE)

    decision = await deliver_webhook(delivery, deps=make_deps("proc-a"))

    assert decision == Done("delivered (200)")
    assert len(receiver[0].requests(delivery.url)) == 1


async def test_another_processs_lease_still_holds(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any]
) -> None:
    delivery = _delivery(receiver[0])
    await ledger.register(delivery, now=utcnow())
    await ledger.claim(delivery, process="proc-b", owner="proc-b/1", now=utcnow(), lease=LEASE)

    decision = await deliver_webhook(delivery, deps=make_deps("proc-a"))

    assert isinstance(decision, Send)
    assert decision.reason == "claimed by another consumer"
    assert receiver[0].requests(delivery.url) == []


async def test_a_lease_held_by_a_copy_in_this_process_is_not_taken_over(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any]
) -> None:
    delivery = _delivery(receiver[0])
    await ledger.register(delivery, now=utcnow())
    await ledger.claim(delivery, process="proc-a", owner="proc-a/1", now=utcnow(), lease=LEASE)
    deps = make_deps("proc-a")

    with deps.in_hand.holding((delivery.delivery_id, delivery.attempt)):  # that copy sends it
        decision = await deliver_webhook(delivery, deps=deps)

    assert decision == Done("another copy in this process is working on this attempt")
    assert receiver[0].requests(delivery.url) == []


class FirstClaimHeldBack(Ledger):
    """The ledger, with its first claim held back until `release` is set."""

    def __init__(self, client: AsyncMongoClient[dict[str, Any]], database: str) -> None:
        super().__init__(client, database, retention=timedelta(hours=1))
        self.holding_back = asyncio.Event()
        self.release = asyncio.Event()

    async def claim(
        self,
        delivery: DeliverWebhook,
        *,
        process: str,
        owner: str,
        now: datetime,
        lease: timedelta,
        reclaim_own: bool = False,
    ) -> Claim:
        if not self.holding_back.is_set():
            self.holding_back.set()
            await self.release.wait()
        return await super().claim(
            delivery, process=process, owner=owner, now=now, lease=lease, reclaim_own=reclaim_own
        )


async def test_a_copy_arriving_while_the_first_one_claims_leaves_the_attempt_to_it(
    make_deps: Deps,
    ledger: Ledger,
    receiver: tuple[Receiver, Any],
    mongo: Any,
    db_prefix: str,
) -> None:
    """Two copies of one delivery in one process, the second while the first one's claim is
    on its way. The second's claim used to land first, and the first one's then took it over
    as a stale lease of this process: two POSTs (a CI run of the duplicate-event test)."""
    delivery = _delivery(receiver[0])
    delivery = delivery.model_copy(update={"url": receiver[0].endpoint(200, latency_s=2)})
    await ledger.register(delivery, now=utcnow())
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo.url, tz_aware=True)
    held_back = FirstClaimHeldBack(client, f"{db_prefix}_notifier")
    deps = replace(make_deps("proc-a"), ledger=held_back)
    try:
        first = asyncio.create_task(deliver_webhook(delivery, deps=deps))
        await asyncio.wait_for(held_back.holding_back.wait(), timeout=10)
        copy = delivery.model_copy(update={"message_id": new_id()})
        second = asyncio.create_task(deliver_webhook(copy, deps=deps))

        async def second_done_or_sending() -> bool:
            record = await ledger.find(delivery.delivery_id)
            return second.done() or (record is not None and record.state is DeliveryState.SENDING)

        await eventually(second_done_or_sending, what="the second copy's turn")
        held_back.release.set()
        decisions = await asyncio.wait_for(asyncio.gather(first, second), timeout=30)
    finally:
        await client.close()

    assert decisions[0] == Done("delivered (200)")
    assert decisions[1] == Done("another copy in this process is working on this attempt")
    assert len(receiver[0].requests(delivery.url)) == 1


async def test_a_redelivery_waits_out_another_processs_lease_then_delivers(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any]
) -> None:
    """The message came back unsettled (its handler crashed, or its consumer died) while
    the other process's lease holds: it is held until the lease ends, not re-sent as a fresh
    copy, whose delivery count would start again (a handler crashing on it every time then
    looped between replicas instead of reaching the queue's delivery limit)."""
    delivery = _delivery(receiver[0])
    await ledger.register(delivery, now=utcnow())
    short = timedelta(seconds=1)
    await ledger.claim(delivery, process="proc-b", owner="proc-b/1", now=utcnow(), lease=short)

    decision = await deliver_webhook(delivery, deps=make_deps("proc-a"), redelivered=True)

    assert decision == Done("delivered (200)")
    assert len(receiver[0].requests(delivery.url)) == 1


class HeldSender:
    """The real sender, each POST held back (after the receiver has it) until `release`."""

    def __init__(self, sender: Sender) -> None:
        self._sender = sender
        self.posting = asyncio.Event()
        self.release = asyncio.Event()

    async def post(
        self, destination: Destination, *, body: bytes, headers: Mapping[str, str]
    ) -> ReceiverAnswer:
        answer = await self._sender.post(destination, body=body, headers=headers)
        self.posting.set()
        await self.release.wait()
        return answer


async def test_a_redelivery_after_the_connection_dropped_mid_post_posts_nothing_again(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any]
) -> None:
    """The connection dropping cancels the handler mid-POST. The attempt was cancelled with
    it, its lease left behind under this process, which the redelivery (to this process)
    took over at once and POSTed again. Now the attempt is shielded and completes; the
    redelivery waits for it, finds it delivered, and sends nothing."""
    delivery = _delivery(receiver[0])
    deps = make_deps("proc-a")
    held = HeldSender(deps.sender)
    broker = HandlerOnly()
    subscribe_deliveries(broker, replace(deps, sender=held), timeout_s=10)  # type: ignore[arg-type]

    first = asyncio.create_task(broker.handler(HandedDelivery(delivery.model_dump_json().encode())))
    await asyncio.wait_for(held.posting.wait(), timeout=10)
    first.cancel()  # as aiormq cancels a closed channel's consumers
    with contextlib.suppress(asyncio.CancelledError):
        await first
    redelivery = HandedDelivery.redelivery(delivery.model_dump_json().encode())
    redelivered = asyncio.create_task(broker.handler(redelivery))
    held.release.set()  # the first POST answers
    await asyncio.wait_for(redelivered, timeout=30)

    async def delivered() -> bool:
        record = await ledger.find(delivery.delivery_id)
        return record is not None and record.state is DeliveryState.DELIVERED

    await eventually(delivered, what="the first attempt recorded as delivered")
    assert redelivery.settled == ["ack"]
    assert len(receiver[0].requests(delivery.url)) == 1


class SlowDns(TableResolver):
    """The test's DNS, each answer taking `delay` of the test's clock."""

    def __init__(self, clock: SteppedClock, delay: timedelta) -> None:
        super().__init__({RECEIVER_HOST: ["127.0.0.1"]})
        self._clock, self._delay = clock, delay

    async def resolve(self, host: str, port: int) -> Sequence[IPAddress]:
        self._clock.now += self._delay
        return await super().resolve(host, port)


@dataclass
class SteppedClock:
    now: datetime

    def __call__(self) -> datetime:
        return self.now


async def test_a_webhook_is_signed_with_the_time_it_is_sent_not_claimed(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any]
) -> None:
    """It carried the claim's time: a DNS answer minutes late (or a slow claim, or keyring
    read) made it older than a receiver's tolerance, which refuses it for good."""
    endpoint = receiver[0]
    delivery = _delivery(endpoint)
    await ledger.register(delivery, now=utcnow())
    clock = SteppedClock(utcnow())
    claimed_at = clock.now
    guard = WebhookGuard(
        SlowDns(clock, timedelta(minutes=6)), allowed_test_hosts=frozenset({"127.0.0.1"})
    )
    deps = replace(
        make_deps("proc-a"), clock=clock, host_clock=clock, guard=guard, lease=timedelta(hours=1)
    )

    assert await deliver_webhook(delivery, deps=deps) == Done("delivered (200)")

    [received] = endpoint.requests(delivery.url)
    sent_at = int(received.headers["webhook-timestamp"])
    assert sent_at == int((claimed_at + timedelta(minutes=6)).timestamp())


async def test_a_webhook_is_signed_with_this_hosts_time_not_the_databases(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any]
) -> None:
    """The service's clock follows the database server's; a receiver checks the timestamp
    against real time: with the database's clock six minutes ahead, every webhook was refused
    for good (a 4xx) as too new (the notifier's re-read)."""
    endpoint = receiver[0]
    delivery = _delivery(endpoint)
    databases_clock = SteppedClock(utcnow() + timedelta(minutes=6))
    await ledger.register(delivery, now=databases_clock())
    deps = replace(make_deps("proc-a"), clock=databases_clock, lease=timedelta(hours=1))

    before = int(utcnow().timestamp())
    assert await deliver_webhook(delivery, deps=deps) == Done("delivered (200)")
    after = int(utcnow().timestamp())

    [received] = endpoint.requests(delivery.url)
    assert before <= int(received.headers["webhook-timestamp"]) <= after


async def test_a_receivers_retry_after_date_is_read_against_this_hosts_time(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any]
) -> None:
    """A receiver's `Retry-After` date is real time, as its clock tells it: read against the
    database's clock twenty minutes ahead, a date ten minutes on was already past, and the
    next attempt came after the back-off, not when the receiver asked."""
    endpoint = receiver[0]
    retry_at = utcnow() + timedelta(minutes=10)
    url = endpoint.endpoint((503, {"Retry-After": format_datetime(retry_at, usegmt=True)}))
    delivery = _delivery(endpoint).model_copy(update={"url": url})
    databases_clock = SteppedClock(utcnow() + timedelta(minutes=20))
    await ledger.register(delivery, now=databases_clock())
    deps = replace(
        make_deps("proc-a"),
        clock=databases_clock,
        lease=timedelta(hours=1),
        policy=RetryPolicy(base_s=0.01, cap_s=3600),
    )

    decided = await deliver_webhook(delivery, deps=deps)

    assert isinstance(decided, Send)
    assert decided.command.not_before is not None
    waits = decided.command.not_before - databases_clock()
    assert waits >= timedelta(minutes=9), waits


class RotatingDns(TableResolver):
    """The receiver's address, answered once the tenant has rotated its signing secret."""

    def __init__(self, keyring: Keyring, tenant_id: str) -> None:
        super().__init__({RECEIVER_HOST: ["127.0.0.1"]})
        self._keyring, self._tenant_id = keyring, tenant_id
        self.rotated: list[str] = []

    async def resolve(self, host: str, port: int) -> Sequence[IPAddress]:
        rotated = await self._keyring.rotate(self._tenant_id, now=utcnow(), grace=timedelta(1))
        self.rotated.append(rotated.secret)
        return await super().resolve(host, port)


async def test_a_secret_rotated_during_the_dns_check_signs_the_webhook(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any]
) -> None:
    """The secrets were read before the DNS check: a receiver that took the new secret from
    the rotation's answer refused the old one's signature for good (a 4xx; review)."""
    endpoint = receiver[0]
    delivery = _delivery(endpoint)
    await ledger.register(delivery, now=utcnow())
    deps = make_deps("proc-a")
    await deps.keyring.in_force(delivery.tenant_id, now=utcnow())  # the secret before
    dns = RotatingDns(deps.keyring, delivery.tenant_id)
    guard = WebhookGuard(dns, allowed_test_hosts=frozenset({"127.0.0.1"}))

    assert await deliver_webhook(delivery, deps=replace(deps, guard=guard)) == Done(
        "delivered (200)"
    )

    [received] = endpoint.requests(delivery.url)
    Webhook(dns.rotated[-1]).verify(received.body, received.headers)


async def test_a_slow_dns_check_leaving_the_request_its_time_still_posts(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any]
) -> None:
    """The lease left is compared with the request's time once the DNS check is done: with
    the check's time counted again, a resolver taking most of the lease had every try put
    off for good (the re-read of that change)."""
    endpoint = receiver[0]
    delivery = _delivery(endpoint)
    await ledger.register(delivery, now=utcnow())
    clock = SteppedClock(utcnow())
    guard = WebhookGuard(
        SlowDns(clock, timedelta(seconds=47)), allowed_test_hosts=frozenset({"127.0.0.1"})
    )
    # 13 s left after the check: more than a request's 10, less than the check's 5 and 10.
    deps = replace(make_deps("proc-a"), clock=clock, guard=guard, lease=timedelta(seconds=60))

    assert await deliver_webhook(delivery, deps=deps) == Done("delivered (200)")
    assert len(endpoint.requests(delivery.url)) == 1
