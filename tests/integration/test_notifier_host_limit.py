"""One slow receiver cannot take every delivery slot of a notifier.

`WEBHOOK_CONCURRENCY` deliveries run at once per notifier. A receiver that held its requests
(answering only at the timeout, or hanging until it) used to fill them all, and every other
destination's webhooks waited behind it. Now at most `WEBHOOK_CONCURRENCY_PER_HOST` POSTs
are in flight to one destination (scheme, host, port); a delivery whose destination is at
its bound is deferred down the wait ladder, unclaimed and not counted as an attempt.

The notifier runs in-process on the real broker and database and posts to two https
receivers of the test, on two ports of 127.0.0.1: two destinations; on a vhost of its own
(`notifier_amqp_url`). The other tests run its delivery handler as a broker hands it a
message, on the real database and a real broker (`on_broker`): the commands it sent are read
from a queue bound to the delivery commands' routes, and every publish it made from the
broker's publish counter.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from pymongo import AsyncMongoClient

from devtools.infra import Endpoint, create_vhost, delete_vhost
from services.notifier.app import create_app as create_notifier
from services.notifier.consumer import send_delivery
from services.notifier.deliveries import DeliveryDeps, Sender
from services.notifier.hosts import Slots, destination_of, host_share, share_key
from services.notifier.ledger import DeliveryState, Ledger
from services.notifier.metrics import NotifierMetrics
from services.notifier.sender import ReceiverAnswer
from services.notifier.settings import NotifierSettings
from services.notifier.ssrf import Destination
from shared.contracts import DeliverWebhook, WebhookPurpose, new_id, utcnow
from shared.in_hand import InHand
from shared.runtime import make_broker
from shared.topology import DELAY, EARLIER_DELIVERIES_HEADER
from tests.integration import test_notifier_delivery_limit as delivery_limit
from tests.integration import test_notifier_own_claims as own_claims
from tests.integration.test_notifier import (
    RECEIVER_HOST,
    Receiver,
    TableResolver,
    _tls,
)
from tests.integration.test_notifier_delivery_limit import Notifier as OnBroker
from tests.integration.test_notifier_own_claims import Deps, _delivery
from tests.support import HandedDelivery, eventually, running, sample

receiver = own_claims.receiver  # fixtures
ledger = own_claims.ledger
make_deps = own_claims.make_deps
# The delivery handler on a real broker; `notifier` here is the whole notifier, running.
on_broker = delivery_limit.notifier
CONCURRENCY = 4
PER_HOST = 2
SLOW_WEBHOOKS = 6  # more than the notifier's slots: unbounded, they would take them all
FAST_WEBHOOKS = 3
Document = dict[str, Any]


@dataclass
class CountingReceiver(Receiver):
    """A `Receiver` that also counts the requests it has in hand at once (`peak`)."""

    in_flight: int = 0
    peak: int = 0
    release: asyncio.Event = field(default_factory=asyncio.Event)

    def held(self) -> str:
        """A fresh URL answering 200 once `release` is set: in flight until then."""
        url = self.endpoint(200)
        self.gates[url.rsplit("/", 1)[1]] = self.release
        return url

    async def handle(self, request: web.Request) -> web.Response:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            return await super().handle(request)
        finally:
            self.in_flight -= 1


@dataclass(frozen=True)
class Notifier:
    api: httpx.AsyncClient
    settings: NotifierSettings
    slow: CountingReceiver
    fast: Receiver
    deliveries: Any  # the notifier's `deliveries` collection

    async def publish(
        self, urls: list[str], *, tenants: tuple[str, ...] = ("acme",)
    ) -> list[DeliverWebhook]:
        """A webhook to each of `urls`, of `tenants` in turn."""
        commands = [_callback(url, tenants[index % len(tenants)]) for index, url in enumerate(urls)]
        broker = make_broker(self.settings)
        async with broker:
            await broker.connect()
            for command in commands:
                await send_delivery(broker, command, now=utcnow(), timeout=10)
        return commands

    async def all_delivered(self, commands: list[DeliverWebhook]) -> list[Document] | None:
        ids = [command.delivery_id for command in commands]
        found = await self.deliveries.find({"_id": {"$in": ids}}).to_list()
        delivered = [r for r in found if r["state"] == DeliveryState.DELIVERED.value]
        return delivered if len(delivered) == len(ids) else None

    async def metric(self, name: str, labels: dict[str, str]) -> float:
        exposition = (await self.api.get("/metrics")).text
        return sum(
            sample.value
            for family in text_string_to_metric_families(exposition)
            for sample in family.samples
            if sample.name == name and sample.labels == labels
        )


def _callback(url: str, tenant_id: str = "acme") -> DeliverWebhook:
    return DeliverWebhook(
        task_id=new_id(),
        tenant_id=tenant_id,
        delivery_id=f"msg_{uuid.uuid4().hex}",
        purpose=WebhookPurpose.CALLBACK,
        url=url,
        event_type="task.completed",
        payload={"type": "task.completed"},
    )


@contextlib.asynccontextmanager
async def _serving(receiver: Receiver, tls: Any) -> AsyncIterator[Receiver]:
    app = web.Application()
    app.router.add_post("/hooks/{name}", receiver.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls).start()
    receiver.port = runner.addresses[0][1]
    try:
        yield receiver
    finally:
        await runner.cleanup()


@pytest.fixture
def notifier_amqp_url(rabbitmq: Endpoint) -> Iterator[str]:
    """A vhost of the running notifier's own. On the module's, the handler tests
    (`on_broker`) leave copies of their deliveries, in the webhook queue and down the wait
    ladder: it would take them, and POST and decide on them beside its own test's
    webhooks."""
    vhost = f"scorebox-test-{uuid.uuid4().hex[:10]}"
    url = create_vhost(rabbitmq.url, vhost, management_url=rabbitmq.management_url)
    yield url
    delete_vhost(rabbitmq.url, vhost, management_url=rabbitmq.management_url)


@pytest.fixture
async def notifier(
    notifier_amqp_url: str,
    mongo: Any,
    db_prefix: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Notifier]:
    server_tls, ca_file = _tls(tmp_path_factory.mktemp("host-limit"))
    settings = _settings(notifier_amqp_url, mongo.url, db_prefix, ca_file)
    app = create_notifier(settings, resolver=TableResolver({RECEIVER_HOST: ["127.0.0.1"]}))
    database: AsyncMongoClient[Document] = AsyncMongoClient(mongo.url, tz_aware=True)
    slow = CountingReceiver()
    try:
        async with (
            _serving(slow, server_tls),
            _serving(Receiver(), server_tls) as fast,
            running(app) as api,
        ):
            deliveries = database[f"{db_prefix}_notifier"]["deliveries"]
            try:
                yield Notifier(api, settings, slow, fast, deliveries)
            finally:
                slow.release.set()  # let the notifier's held POSTs finish before it stops
    finally:
        await database.close()


def _settings(amqp_url: str, mongo_url: str, db_prefix: str, ca_file: Path) -> NotifierSettings:
    return NotifierSettings.model_validate(
        {
            "RABBITMQ_URL": amqp_url,
            "MONGO_URL": mongo_url,
            "MONGO_DB_PREFIX": db_prefix,
            "WEBHOOK_CONCURRENCY": str(CONCURRENCY),
            "WEBHOOK_CONCURRENCY_PER_HOST": str(PER_HOST),
            # Both receivers' webhooks are one tenant's: the bound per destination alone.
            "WEBHOOK_CONCURRENCY_PER_TENANT": str(CONCURRENCY),
            "WEBHOOK_TIMEOUT_S": "300",  # a held POST stays in flight: no attempt fails
            "WEBHOOK_ALLOWED_TEST_HOSTS": "127.0.0.1",
            "WEBHOOK_CA_FILE": str(ca_file),
        }
    )


async def test_a_slow_host_at_its_bound_leaves_the_other_hosts_their_slots(
    notifier: Notifier,
) -> None:
    slow, fast = notifier.slow, notifier.fast
    # Two tenants': one tenant holds at most its share of a destination (`host_share`).
    slow_commands = await notifier.publish(
        [slow.held() for _ in range(SLOW_WEBHOOKS)], tenants=("acme", "globex")
    )

    async def saturated() -> bool:
        return slow.in_flight >= PER_HOST

    await eventually(saturated, what="the slow host's slots all in flight")
    fast_commands = await notifier.publish([fast.endpoint(200) for _ in range(FAST_WEBHOOKS)])

    await eventually(
        lambda: notifier.all_delivered(fast_commands),
        timeout_s=20,
        what="the fast host's webhooks delivered while the slow host holds its requests",
    )
    deferred = await notifier.metric("scorebox_webhook_deferred_total", {"reason": "host_busy"})
    assert deferred > 0
    assert slow.peak == PER_HOST
    slow.release.set()
    delivered = await eventually(
        lambda: notifier.all_delivered(slow_commands), what="every slow webhook delivered"
    )

    assert slow.peak == PER_HOST
    assert [len(slow.requests(c.url)) for c in slow_commands] == [1] * SLOW_WEBHOOKS
    assert [len(fast.requests(c.url)) for c in fast_commands] == [1] * FAST_WEBHOOKS
    assert {(r["attempt"], r["last_error"]) for r in delivered} == {(1, None)}
    unavailable = {"purpose": "callback", "outcome": "unavailable"}
    assert await notifier.metric("scorebox_webhook_attempts_total", unavailable) == 0


async def test_a_tenant_holding_its_share_of_a_destination_leaves_the_rest_to_others(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any], on_broker: OnBroker
) -> None:
    """A tenant whose path on a host many tenants share hangs held every slot of that host,
    and the other tenants' webhooks to it waited for minutes (review of the notifier)."""
    deps, registry = _with_bound(make_deps("proc-a"))
    deps = replace(deps, hosts=Slots(4), host_shares=Slots(host_share(4)))
    ours = _delivery(receiver[0]).model_copy(update={"tenant_id": "tenant-a"})
    theirs = _delivery(receiver[0]).model_copy(update={"tenant_id": "tenant-b"})
    destination = destination_of(ours.url, deps.guard)
    handle = on_broker.handler(deps)

    with contextlib.ExitStack() as in_flight:
        for _ in range(host_share(4)):  # tenant-a's POSTs hanging on the shared host
            assert in_flight.enter_context(deps.hosts.taking(destination))
            key = share_key("tenant-a", destination)
            assert in_flight.enter_context(deps.host_shares.taking(key))
        mine = HandedDelivery(ours.model_dump_json().encode())
        await asyncio.wait_for(handle(mine), timeout=30)
        other = HandedDelivery(theirs.model_dump_json().encode())
        await asyncio.wait_for(handle(other), timeout=30)

    assert receiver[0].requests(ours.url) == []
    assert len(receiver[0].requests(theirs.url)) == 1
    assert (_deferred(registry, "host_share_busy"), _deferred(registry)) == (1, 0)


@contextlib.contextmanager
def _all_slots_taken(slots: Slots, key: str) -> Iterator[None]:
    """Every slot of `key` (a destination, a tenant) held, as by POSTs of this process in
    flight."""
    with contextlib.ExitStack() as stack:
        for _ in range(slots.bound):
            assert stack.enter_context(slots.taking(key))
        yield


def _with_bound(deps: DeliveryDeps) -> tuple[DeliveryDeps, CollectorRegistry]:
    """`deps` with PER_HOST slots per destination and per tenant, and the registry of its
    metrics."""
    registry = CollectorRegistry()
    bounded = replace(
        deps, hosts=Slots(PER_HOST), tenants=Slots(PER_HOST), metrics=NotifierMetrics(registry)
    )
    return bounded, registry


def _deferred(registry: CollectorRegistry, reason: str = "host_busy") -> float:
    return sample(registry, "scorebox_webhook_deferred_total", reason=reason)


async def test_a_delivery_to_a_busy_destination_is_sent_again_later_unclaimed_and_unsent(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any], on_broker: OnBroker
) -> None:
    deps, registry = _with_bound(make_deps("proc-a"))
    delivery = _delivery(receiver[0])
    handle = on_broker.handler(deps)
    message = HandedDelivery(delivery.model_dump_json().encode())

    with _all_slots_taken(deps.hosts, destination_of(delivery.url, deps.guard)):
        await asyncio.wait_for(handle(message), timeout=30)

    assert message.settled == ["ack"]
    assert receiver[0].requests(delivery.url) == []
    assert await ledger.find(delivery.delivery_id) is None  # never claimed
    [sent] = await on_broker.sent()
    assert (sent.exchange, sent.routing_key) == (DELAY.name, "1s.webhook.deliver")
    again = DeliverWebhook.model_validate_json(sent.body)
    assert again.not_before is not None
    assert again.message_id != delivery.message_id
    assert again.deferrals == 1
    unchanged = {"not_before": None, "message_id": delivery.message_id, "deferrals": 0}
    assert again.model_copy(update=unchanged) == delivery  # the same attempt
    assert _deferred(registry) == 1


async def test_a_delivery_put_off_again_and_again_waits_longer_each_time(
    make_deps: Deps, receiver: tuple[Receiver, Any], on_broker: OnBroker
) -> None:
    """Put off a second apart for ever, a backlog of thousands for a receiver that hangs
    went through the broker thousands of times a second."""
    deps, _ = _with_bound(make_deps("proc-a"))
    delivery = _delivery(receiver[0]).model_copy(update={"deferrals": 5})
    handle = on_broker.handler(deps)
    message = HandedDelivery(delivery.model_dump_json().encode())

    with _all_slots_taken(deps.hosts, destination_of(delivery.url, deps.guard)):
        before = datetime.now(UTC)
        await asyncio.wait_for(handle(message), timeout=30)

    [sent] = await on_broker.sent()
    again = DeliverWebhook.model_validate_json(sent.body)
    assert again.deferrals == 6
    assert again.not_before is not None
    assert again.not_before - before >= timedelta(seconds=32)  # 1 s doubled five times
    assert sent.routing_key != "1s.webhook.deliver"
    assert receiver[0].requests(delivery.url) == []


async def test_a_redelivery_to_a_busy_destination_goes_down_the_ladder_its_count_carried(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any], on_broker: OnBroker
) -> None:
    """Held until a slot freed, it kept its consumer slot and polled while new deliveries
    took the freed slots first, and could outwait the broker's consumer timeout. It is acked,
    and its copy carries the deliveries counted so far, so the delivery limit still stops a
    message that keeps killing its consumers."""
    deps, registry = _with_bound(make_deps("proc-a"))
    delivery = _delivery(receiver[0])
    handle = on_broker.handler(deps)
    message = HandedDelivery.redelivery(delivery.model_dump_json().encode(), count=2)

    with _all_slots_taken(deps.hosts, destination_of(delivery.url, deps.guard)):
        await asyncio.wait_for(handle(message), timeout=30)

    assert message.settled == ["ack"]
    assert receiver[0].requests(delivery.url) == []
    assert await ledger.find(delivery.delivery_id) is None  # never claimed
    [sent] = await on_broker.sent()
    assert (sent.exchange, sent.routing_key) == (DELAY.name, "1s.webhook.deliver")
    assert sent.headers[EARLIER_DELIVERIES_HEADER] == 2
    again = DeliverWebhook.model_validate_json(sent.body)
    assert (again.attempt, again.deferrals) == (delivery.attempt, 1)
    assert _deferred(registry) == 1


async def _delivered_elsewhere(ledger: Ledger, delivery: DeliverWebhook) -> DeliverWebhook:
    """`delivery` recorded delivered by another process, as if its consumer died before
    acking."""
    now = datetime.now(UTC)
    await ledger.register(delivery, now=now)
    claim = await ledger.claim(
        delivery, process="proc-b", owner="proc-b/1", now=now, lease=timedelta(seconds=60)
    )
    assert claim.won
    await ledger.mark_delivered(delivery, now=now, status=200)
    return delivery


async def test_a_redelivery_put_off_carries_out_what_its_attempt_decided(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any], on_broker: OnBroker
) -> None:
    """Its consumer died after the POST was recorded delivered, before the ack: nothing is
    sent again, busy destination or not, and nothing counted deferred (it was counted before
    its recorded decision was checked, though nothing was put off)."""
    deps, registry = _with_bound(make_deps("proc-a"))
    delivery = await _delivered_elsewhere(ledger, _delivery(receiver[0]))
    handle = on_broker.handler(deps)
    message = HandedDelivery.redelivery(delivery.model_dump_json().encode())

    with _all_slots_taken(deps.hosts, destination_of(delivery.url, deps.guard)):
        await asyncio.wait_for(handle(message), timeout=30)

    assert message.settled == ["ack"]
    assert on_broker.published() == {}
    assert await on_broker.letters(delivery) == []
    assert receiver[0].requests(delivery.url) == []
    assert _deferred(registry) == 0


class _CrashingOnce:
    """A sender whose first POST hangs until `crash` is set, then fails with a bug (no
    transient error); the later ones go to `inner`."""

    def __init__(self, inner: Sender) -> None:
        self.inner = inner
        self.posting = asyncio.Event()
        self.crash = asyncio.Event()
        self.calls = 0

    async def post(
        self, destination: Destination, *, body: bytes, headers: Mapping[str, str]
    ) -> ReceiverAnswer:
        self.calls += 1
        if self.calls > 1:
            return await self.inner.post(destination, body=body, headers=headers)
        self.posting.set()
        await self.crash.wait()
        raise RuntimeError("a bug in the POST")


class _WatchedInHand(InHand[tuple[str, int]]):
    """`InHand` that tells when a delivery found its attempt held by another here."""

    def __init__(self) -> None:
        super().__init__()
        self.refused = asyncio.Event()

    @contextlib.contextmanager
    def holding(self, key: tuple[str, int]) -> Iterator[bool]:
        with super().holding(key) as only_here:
            if not only_here:
                self.refused.set()
            yield only_here


async def test_the_copy_of_a_put_off_redelivery_waits_for_its_attempt_held_here(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any], on_broker: OnBroker
) -> None:
    """A handler cancelled mid-POST (its connection lost) leaves its try running, shielded,
    holding the attempt; the broker hands the message to another process, which finds the
    destination busy and puts it off as a copy. Taken for a fresh copy where that try still
    ran, the copy was dropped, and when the try then crashed nothing was left to see the
    attempt through: the webhook was never sent (found in review). The copy counts as a
    redelivery (it carries the lost delivery): it waits for the try, then sends."""
    delivery = _delivery(receiver[0])
    body = delivery.model_dump_json().encode()
    first_process = make_deps("proc-a")
    sender = _CrashingOnce(first_process.sender)
    in_hand = _WatchedInHand()
    first_process = replace(first_process, sender=sender, in_hand=in_hand)
    handle_here = on_broker.handler(first_process)
    first = asyncio.ensure_future(handle_here(HandedDelivery(body)))
    await asyncio.wait_for(sender.posting.wait(), timeout=30)
    first.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await first

    elsewhere, _ = _with_bound(make_deps("proc-b"))
    # The other process: its own slots and attempts in hand (its publishes share the first
    # one's connection, which sends nothing here).
    handle_elsewhere = on_broker.handler(elsewhere)
    with _all_slots_taken(elsewhere.hosts, destination_of(delivery.url, elsewhere.guard)):
        await asyncio.wait_for(handle_elsewhere(HandedDelivery.redelivery(body)), timeout=30)
    [put_off] = await on_broker.sent()
    # The copy as the wait ladder hands it back once due, to the first process.
    due = DeliverWebhook.model_validate_json(put_off.body)
    copy = HandedDelivery(
        due.model_copy(update={"not_before": None}).model_dump_json().encode(),
        headers=dict(put_off.headers or {}),
    )
    handling = asyncio.ensure_future(handle_here(copy))
    await asyncio.wait_for(in_hand.refused.wait(), timeout=30)
    sender.crash.set()
    await asyncio.wait_for(handling, timeout=30)

    assert copy.settled == ["ack"]
    assert len(receiver[0].requests(delivery.url)) == 1
    record = await ledger.find(delivery.delivery_id)
    assert record is not None
    assert (record.state, record.attempt) == (DeliveryState.DELIVERED, 1)


async def test_the_slots_are_per_destination_and_given_back(
    make_deps: Deps, receiver: tuple[Receiver, Any], on_broker: OnBroker
) -> None:
    """A busy destination leaves another port of the same host its own slots."""
    deps, registry = _with_bound(make_deps("proc-a"))
    delivery = _delivery(receiver[0])
    destination = destination_of(delivery.url, deps.guard)
    elsewhere = destination.rsplit(":", 1)[0] + f":{receiver[0].port + 1}"
    handle = on_broker.handler(deps)

    with _all_slots_taken(deps.hosts, elsewhere):
        message = HandedDelivery(delivery.model_dump_json().encode())
        await asyncio.wait_for(handle(message), timeout=30)

    assert message.settled == ["ack"]
    assert len(receiver[0].requests(delivery.url)) == 1
    assert deps.hosts.in_flight(destination) == 0
    assert _deferred(registry) == 0


async def test_a_delivery_of_a_busy_tenant_is_sent_again_later_unclaimed_and_unsent(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any], on_broker: OnBroker
) -> None:
    """Its destination has slots free: the tenant's bound puts it off all the same."""
    deps, registry = _with_bound(make_deps("proc-a"))
    delivery = _delivery(receiver[0])
    handle = on_broker.handler(deps)
    message = HandedDelivery(delivery.model_dump_json().encode())

    with _all_slots_taken(deps.tenants, delivery.tenant_id):
        await asyncio.wait_for(handle(message), timeout=30)
        assert deps.hosts.in_flight(destination_of(delivery.url, deps.guard)) == 0

    assert message.settled == ["ack"]
    assert receiver[0].requests(delivery.url) == []
    assert await ledger.find(delivery.delivery_id) is None  # never claimed
    [sent] = await on_broker.sent()
    again = DeliverWebhook.model_validate_json(sent.body)
    assert (again.attempt, again.deferrals) == (1, 1)
    assert (_deferred(registry, "tenant_busy"), _deferred(registry)) == (1, 0)


async def test_another_tenants_delivery_keeps_its_slots(
    make_deps: Deps, receiver: tuple[Receiver, Any], on_broker: OnBroker
) -> None:
    deps, registry = _with_bound(make_deps("proc-a"))
    delivery = _delivery(receiver[0]).model_copy(update={"tenant_id": "tenant-b"})
    handle = on_broker.handler(deps)

    with _all_slots_taken(deps.tenants, "tenant-a"):
        message = HandedDelivery(delivery.model_dump_json().encode())
        await asyncio.wait_for(handle(message), timeout=30)

    assert message.settled == ["ack"]
    assert len(receiver[0].requests(delivery.url)) == 1
    assert deps.tenants.in_flight("tenant-b") == 0
    assert _deferred(registry, "tenant_busy") == 0
