"""Consuming: plain async handlers on aio-pika consumers, on a connection of their own.

Every service consumes through `consume(broker, queue)`. Consumers use a robust aio-pika
connection separate from the one FastStream publishes on: RabbitMQ blocks a connection that
publishes while a memory or disk alarm lasts (and slows one that publishes faster than its
queues take), and a blocked connection is not read at all, so acknowledgements sent on it
would wait too (RabbitMQ's "Flow Control" guide advises a connection for publishing and
another for consuming). On its own connection a consumer goes on settling what it has
handled. aio-pika restores the connection's channels, their prefetch, the queues and the
consumers after a reconnection. A replica's exclusive queues are consumed on a third
connection (`ScoreboxBroker.start` says why).

Each queue is declared on the consuming channel as FastStream's declarer would declare it
(an exclusive queue belongs to the connection that declared it, so it must be this one), on
a shared channel with the broker's default prefetch, or on one of its own when the consumer
asks for another prefetch or its queue is exclusive. Each delivery reaches its handler as a
`Delivery` without FastStream's per-delivery pipeline (message parsing, context scopes,
logging and acknowledgement middlewares), measured in docs/architecture.md ("Performance").

A batch of events (`shared.event_batches`: completions that finished together) reaches the
handler as one delivery per event (`BatchPart`), and is settled once every part is, as the
strictest part asks (`_settle_batch`); at most the prefetch of parts are handled at once.
A part's settlement that must not be repeated when the batch comes back (a copy to its DLQ)
waits for the other parts (`Delivery.settle_last`).

A delivery's `routing_key` is the key its message was published with, also when it is a
letter moved back to its queue (`original_routing_key`).

Settling is the handler's: it acks, nacks or rejects (settling twice is a no-op). Acks are
sent at the end of the loop pass that asked for them, as few frames as is exact
(`shared.acks`); nacks and rejects go at once. A delivery whose handler raised before
settling it goes back to its queue counted (`requeue_failed`, a `basic.reject`: counted
towards a quorum queue's delivery limit on every RabbitMQ version) after a pause that
doubles with its deliveries (`failed_pause_s`), so a message that fails every time reaches
its DLQ within seconds. Left unsettled, as before, it came back only when its channel
closed: at RabbitMQ's consumer timeout (30 minutes), which from 4.3 on returns it without
counting, so it came back every half hour for ever, holding a prefetch slot each time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast, override

import aio_pika
from faststream.rabbit import RabbitBroker, RabbitQueue

from shared.acks import ChannelAcks
from shared.backoff import capped_exponential_s
from shared.broker_probe import RoundTrips
from shared.event_batches import Part, UnreadableBatch, is_batch, split_batch
from shared.log_context import correlated
from shared.metrics import Metrics
from shared.reconnection_gates import ReconnectionGates
from shared.side_by_side import all_through
from shared.topology import (
    ROUTING_KEY_HEADER,
    Binding,
    counted_headers,
    deliveries_lost,
    x_deaths,
)

if TYPE_CHECKING:
    from types import TracebackType

    import aiormq.abc
    from aio_pika.abc import (
        AbstractChannel,
        AbstractConnection,
        AbstractIncomingMessage,
        AbstractQueue,
        AbstractRobustConnection,
    )

log = logging.getLogger("scorebox.consumers")
# The pause before a delivery whose handler raised goes back to its queue: doubled with each
# of its deliveries, capped (0.5, 1, 2, 4, 5 s: a queue's limit of 5 is met in 12.5 s).
FAILED_PAUSE_BASE_S = 0.5
FAILED_PAUSE_CAP_S = 5.0
# How long a stop waits for a consumer to be cancelled on a channel being restored.
CANCEL_ON_CLOSED_S = 0.1


class Delivery:
    """One delivery as a handler sees it: what it carries, and how to settle it."""

    __slots__ = ("_acks", "_headers", "_raw", "settlement")

    def __init__(
        self,
        raw: AbstractIncomingMessage,
        acks: ChannelAcks,
        *,
        headers: dict[str, Any] | None = None,
    ) -> None:
        """`headers`: what the handler reads as the delivery's, `raw`'s when None (as
        `topology.counted_headers` leaves them)."""
        self._raw = raw
        self._acks = acks
        self._headers = _counted_headers(raw) if headers is None else headers
        # How the handler settled it: "ack", "nack", "reject" or "requeue"; None while not.
        self.settlement: str | None = None

    @property
    def body(self) -> bytes:
        return self._raw.body

    @property
    def headers(self) -> dict[str, Any]:
        return self._headers

    @property
    def routing_key(self) -> str:
        """The key the message was published with. A letter moved back to its queue (by a
        shovel, or the management UI's "move messages") comes through the default exchange
        under the queue's name: its key is the one it had (`original_routing_key`). Through
        any other exchange, the key it came under is its own: a letter published again to
        its exchange came under its event's key, while its headers name the one it had
        before (on the wait ladder, say)."""
        delivered_under = self._raw.routing_key or ""
        if self._raw.exchange:
            return delivered_under
        return original_routing_key(self.headers) or delivered_under

    @property
    def redelivered(self) -> bool:
        return bool(self._raw.redelivered)

    @property
    def message_id(self) -> str | None:
        return self._raw.message_id

    @property
    def correlation_id(self) -> str | None:
        return self._raw.correlation_id

    async def ack(self) -> None:
        """Acknowledge at the end of this loop pass, with the channel's other acks."""
        if self._settle("ack"):
            self._acks.ack(self._tag)

    async def nack(self, *, requeue: bool = True) -> None:
        if self._settle("requeue" if requeue else "nack"):
            await self._raw.nack(requeue=requeue)
            self._acks.settled(self._tag)

    async def reject(self, *, requeue: bool = False) -> None:
        if self._settle("requeue" if requeue else "reject"):
            await self._raw.reject(requeue=requeue)
            self._acks.settled(self._tag)

    async def settle_last(self, settle: Callable[[], Awaitable[None]]) -> None:
        """Settle this delivery with `settle` (a copy to its DLQ, then an ack): at once, but
        for a part of a batch only once its siblings are settled (`BatchPart`)."""
        await settle()

    async def requeue_failed(self) -> None:
        """Return a delivery whose handling failed to its queue, counted as a failed delivery:
        `basic.reject` with requeue. RabbitMQ 4.3 and later count a reject towards a quorum
        queue's delivery limit but not a `basic.nack` (3.x counts both), so a message that
        fails every time is dead-lettered at the limit instead of coming back for ever."""
        await self.reject(requeue=True)

    @property
    def _tag(self) -> int:
        return cast("int", self._raw.delivery_tag)

    def _settle(self, how: str) -> bool:
        """Mark this delivery settled; False when it already was."""
        if self.settlement is not None:
            return False
        self.settlement = how
        return True

    @property
    def settles_last(self) -> bool:
        """Whether a settlement waits for the batch's other parts (`BatchPart.settle_last`)."""
        return False


def original_routing_key(headers: dict[str, Any]) -> str | None:
    """The key a dead letter's message was published with: the one a letter of ours names
    (`ROUTING_KEY_HEADER`), else that of RabbitMQ's latest dead-lettering of it (`x-death`);
    None for a message that is neither."""
    if ROUTING_KEY_HEADER in headers:
        return str(headers[ROUTING_KEY_HEADER])
    return _key_when_dead_lettered(headers)


def _key_when_dead_lettered(headers: dict[str, Any]) -> str | None:
    """The routing key of the latest `x-death` (latest first) of a message published to an
    exchange: a copy moved back through the default exchange, dead-lettered again, records
    the queue's name as its key."""
    for death in x_deaths(headers):
        keys = death.get("routing-keys")
        if death.get("exchange") and isinstance(keys, list | tuple) and keys:
            return str(keys[0])
    return None


def _counted_headers(raw: AbstractIncomingMessage) -> dict[str, Any]:
    headers = cast("dict[str, Any]", raw.headers)
    return counted_headers(headers, redelivered=bool(raw.redelivered))


class BatchPart(Delivery):
    """One event of a batch delivery, as a delivery of its own: its body, identifiers and
    headers are the event's; settling it only records how (`_settle_batch` settles the
    batch once every part is).

    A settlement kept for last (`settle_last`) runs once every other part is settled, and
    not at all when the batch comes back (`_comes_back`): the part comes back with it, and
    is handled again. Run at once, a part's copy to its DLQ was made again at every
    redelivery that a sibling returned as failed brought about (found in review)."""

    __slots__ = ("_last", "_part")

    def __init__(self, raw: AbstractIncomingMessage, acks: ChannelAcks, part: Part) -> None:
        super().__init__(raw, acks, headers=part.headers)
        self._part = part
        self._last: Callable[[], Awaitable[None]] | None = None

    @property
    @override
    def body(self) -> bytes:
        return self._part.body

    @property
    @override
    def message_id(self) -> str | None:
        return self._part.message_id

    @property
    @override
    def correlation_id(self) -> str | None:
        return self._part.correlation_id

    @override
    async def ack(self) -> None:
        self._settle("ack")

    @override
    async def nack(self, *, requeue: bool = True) -> None:
        self._settle("requeue" if requeue else "nack")

    @override
    async def reject(self, *, requeue: bool = False) -> None:
        self._settle("requeue" if requeue else "reject")

    @override
    async def settle_last(self, settle: Callable[[], Awaitable[None]]) -> None:
        self._last = settle

    @property
    @override
    def settles_last(self) -> bool:
        return self._last is not None

    def take_last(self) -> Callable[[], Awaitable[None]]:
        """The settlement kept for last, to run now (kept no more)."""
        settle, self._last = self._last, None
        assert settle is not None
        return settle

    def goes_back(self) -> None:
        """The batch comes back: the settlement kept for last is left to its redelivery."""
        self._last = None
        self._settle("requeue")


def _comes_back(batch: Delivery, parts: list[BatchPart]) -> bool:
    """Whether `_settle_batch` will leave the batch for redelivery or return it: not acked
    already (`ack_first`), and a part unsettled or returned as failed."""
    if batch.settlement is not None:
        return False
    return any(
        part.settlement == "requeue" or (part.settlement is None and not part.settles_last)
        for part in parts
    )


def failed_pause_s(headers: dict[str, Any]) -> float:
    """How long a delivery whose handler raised waits before it goes back to its queue."""
    try:
        lost = deliveries_lost(headers)
    except (TypeError, ValueError):  # counts a publisher set by hand
        return FAILED_PAUSE_CAP_S
    return capped_exponential_s(lost + 1, base_s=FAILED_PAUSE_BASE_S, cap_s=FAILED_PAUSE_CAP_S)


async def _settle_batch(batch: Delivery, parts: list[BatchPart]) -> None:
    """Settle a batch as the strictest of its parts asks. A part left unsettled (its handler
    kept it for the broker to redeliver) leaves the batch so; a part returned
    as failed returns the whole batch, counted (`requeue_failed`), and one dead-lettered
    dead-letters it whole: every consumer of events takes a repeat of an event it has
    handled as a no-op, so the parts already handled come back harmlessly, and none is
    lost. Otherwise (every part acked, including those a handler copied to its DLQ
    itself) the batch is acked. A part whose settlement was kept for last and not run (the
    batch comes back) counts as returned (`BatchPart.goes_back`)."""
    settled = {part.settlement for part in parts}
    if None in settled:
        return
    if "requeue" in settled:
        await batch.requeue_failed()
    elif settled & {"reject", "nack"}:
        await batch.reject(requeue=False)
    else:
        await batch.ack()


Handler = Callable[[Delivery], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class _Subscription:
    queue: RabbitQueue
    handler: Handler
    prefetch: int | None  # None: the shared consuming channel, with the broker's prefetch
    ack_first: bool
    label: str  # the queue's name in metrics
    bindings: tuple[Binding, ...] = ()  # made at start, on the queue's consuming connection
    # Awaited before this consumer starts, once the others have (see `consume`).
    starts_after: Callable[[], Awaitable[object]] | None = None


class _AcksByChannel:
    """One `ChannelAcks` per channel deliveries arrive on (a reconnection brings new ones)."""

    def __init__(self) -> None:
        self._by_channel: dict[aiormq.abc.AbstractChannel, ChannelAcks] = {}

    def of(self, channel: aiormq.abc.AbstractChannel) -> ChannelAcks:
        acks = self._by_channel.get(channel)
        if acks is None:
            self._forget_closed()
            acks = self._by_channel[channel] = ChannelAcks(channel)
        return acks

    def _forget_closed(self) -> None:
        for channel in [each for each in self._by_channel if each.is_closed]:
            del self._by_channel[channel]

    async def drain(self) -> None:
        for acks in list(self._by_channel.values()):
            await acks.drain()


class _Consuming:
    """The running consumers of one subscription, and the deliveries they are handling."""

    def __init__(
        self,
        subscription: _Subscription,
        acks: _AcksByChannel,
        metrics: Metrics,
        *,
        prefetch: int | None,
        opened: asyncio.Event | None = None,
    ) -> None:
        self.subscription = subscription
        # Shut while what it starts after runs again after a reconnection (`ReconnectionGates`).
        self._opened = opened
        self._acks = acks
        # Parts of batches handled at once: at most the prefetch (a prefetch of batches
        # alone would let prefetch x batch size events in at once). Single deliveries are
        # bounded by the prefetch itself, not by this.
        self._part_slots = asyncio.Semaphore(prefetch) if prefetch else None
        queue = subscription.label
        self._timed = metrics.handling_seconds.labels(queue)
        self._settled = {
            how: metrics.deliveries.labels(queue, how)
            for how in ("ack", "nack", "reject", "requeue", "unsettled", "failed")
        }
        self.queue: AbstractQueue | None = None
        self.tag: str | None = None
        self.handling = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.cancelled = False

    async def on_delivery(self, raw: AbstractIncomingMessage) -> None:
        self.handling += 1
        self.idle.clear()
        try:
            if self._opened is not None and not self._opened.is_set():
                await self._opened.wait()
            acks = self._acks.of(raw.channel)
            if is_batch(raw.headers):
                await self._handle_batch(raw, acks)
            else:
                delivery = Delivery(raw, acks)
                if await self._handle(delivery):
                    await self._return_failed(delivery)
        finally:
            self.handling -= 1
            if self.handling == 0:
                self.idle.set()

    async def _handle(self, delivery: Delivery) -> bool:
        """Run the handler on one delivery; True when it raised."""
        started = time.perf_counter()
        failed = False
        # Around the failure's log line too: its traceback is the line most worth tracing.
        with correlated(delivery.correlation_id):
            try:
                if self.subscription.ack_first:
                    await delivery.ack()
                await self.subscription.handler(delivery)
            except Exception:
                failed = True
                log.exception(
                    "%s: handling message %s failed; it goes back to its queue, counted",
                    self.subscription.queue.name,
                    delivery.message_id,
                )
            finally:
                self._record(delivery, failed=failed, seconds=time.perf_counter() - started)
        return failed

    async def _handle_batch(self, raw: AbstractIncomingMessage, acks: ChannelAcks) -> None:
        """Each event of a batch (`shared.event_batches`) reaches the handler as a delivery
        of its own, all of them at once; the batch is settled once every part is
        (`_settle_batch`)."""
        batch = Delivery(raw, acks)
        try:
            parts = [
                BatchPart(raw, acks, part) for part in split_batch(raw.body, _counted_headers(raw))
            ]
        except UnreadableBatch as error:
            log.warning(
                "%s: dead-lettering an unreadable batch %s: %s",
                self.subscription.queue.name,
                raw.message_id,
                error,
            )
            await batch.reject(requeue=False)
            self._record(batch, failed=False, seconds=0.0)
            return
        if self.subscription.ack_first:
            await batch.ack()
        raised = await asyncio.gather(*(self._handle_part(part) for part in parts))
        raised_last = await self._settle_kept_parts(batch, parts, raised)
        if any(raised) or raised_last:
            await self._return_failed(batch)
        else:
            await _settle_batch(batch, parts)

    async def _return_failed(self, delivery: Delivery) -> None:
        """Send a delivery whose handling raised back to its queue, counted, after its pause
        (`failed_pause_s`); not one its handler settled before raising. A channel closed
        meanwhile has returned it already."""
        if delivery.settlement is not None:
            return
        if not self.cancelled:  # a stop waits for the deliveries in hand: not for this pause
            await asyncio.sleep(failed_pause_s(delivery.headers))
        try:
            await delivery.requeue_failed()
        except Exception as error:  # noqa: BLE001 - its channel's close returned it, counted
            log.warning(
                "%s: message %s not returned: %r",
                self.subscription.queue.name,
                delivery.message_id,
                error,
            )

    async def _handle_part(self, part: BatchPart) -> bool:
        if self._part_slots is None:
            return await self._handle(part)
        async with self._part_slots:
            return await self._handle(part)

    async def _settle_kept_parts(
        self, batch: Delivery, parts: list[BatchPart], raised: list[bool]
    ) -> bool:
        """Run the parts' settlements kept for last (`BatchPart.settle_last`), or, when the
        batch comes back, send those parts back with it; True when one of them raised."""
        # A part whose handler raised is counted failed already, and its batch comes back.
        kept = [p for p, failed in zip(parts, raised, strict=True) if p.settles_last and not failed]
        if any(raised) or _comes_back(batch, parts):
            for part in kept:
                part.goes_back()
                self._count(part, failed=False)
            return False
        return any(await asyncio.gather(*(self._settle_last(part) for part in kept)))

    async def _settle_last(self, part: BatchPart) -> bool:
        """Run a part's settlement kept for last; True when it raised (logged)."""
        settle = part.take_last()
        failed = False
        with correlated(part.correlation_id):
            try:
                await settle()
            except Exception:
                failed = True
                log.exception(
                    "%s: settling message %s failed; its batch goes back to its queue, counted",
                    self.subscription.queue.name,
                    part.message_id,
                )
        self._count(part, failed=failed)
        return failed

    def _record(self, delivery: Delivery, *, failed: bool, seconds: float) -> None:
        if failed or not delivery.settles_last:  # else counted once settled
            self._count(delivery, failed=failed)
        self._timed.observe(seconds)

    def _count(self, delivery: Delivery, *, failed: bool) -> None:
        self._settled["failed" if failed else (delivery.settlement or "unsettled")].inc()


# How often the own queues' connection tries again after a loss (the others: every second).
OWN_QUEUES_RECONNECT_S = 5.0


class ScoreboxBroker(RabbitBroker):
    """A FastStream broker that publishes on its connection and consumes (`consume`) on a
    second one, without FastStream's pipeline; a replica's exclusive queues, if any, on a
    third.

    `start()` connects them and then starts the consumers; `stop()` cancels them
    (`stop_consuming`), lets the deliveries in hand finish (up to the graceful timeout), then
    closes the connections.
    """

    def __init__(
        self,
        url: str,
        *,
        graceful_timeout: float,
        timeout: float,
        prefetch: int | None = None,
        name: str = "scorebox",
        metrics: Metrics | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(url, graceful_timeout=graceful_timeout, timeout=timeout, **kwargs)
        # Deliveries handled and publishes (`shared.bus`) are counted here.
        self.metrics = metrics or Metrics()
        self._url = url
        self._timeout = timeout
        self._graceful_timeout = graceful_timeout
        self._prefetch = prefetch
        self._name = name
        self._subscriptions: list[_Subscription] = []
        self._consuming: list[_Consuming] = []
        self._consumer_connection: AbstractRobustConnection | None = None
        # The exclusive queues' (one replica's own), when there are any; see `start`.
        self._own_queues_connection: AbstractRobustConnection | None = None
        self._shared_channel: AbstractChannel | None = None
        self._acks = _AcksByChannel()
        self._gates = ReconnectionGates()
        self._own_queues_restored: list[Callable[[], object]] = []
        self._round_trips = RoundTrips(stall_s=timeout)
        # Set once the stop begins (`stop_consuming`): a handler waiting on something to
        # try again later hands its delivery on rather than begin new work the stop would
        # cut short.
        self.stopping = False

    def add_consumer(self, subscription: _Subscription) -> None:
        self._subscriptions.append(subscription)

    def when_own_queues_restored(self, callback: Callable[[], object]) -> None:
        """Call `callback` each time the own queues' connection is back, its queues and
        bindings restored: what they carried while it was down is lost."""
        self._own_queues_restored.append(callback)

    def _own_queues_back(self, *_callback_args: object) -> None:
        for callback in self._own_queues_restored:
            callback()

    @property
    def consumer_connection(self) -> AbstractRobustConnection | None:
        """The connection deliveries come in on (None before `start()`, or when nothing
        consumes): it never publishes, so a broker alarm never blocks it."""
        return self._consumer_connection

    @property
    def own_queues_connection(self) -> AbstractRobustConnection | None:
        """The connection a replica's exclusive queues are consumed on (None before
        `start()`, or when it has none)."""
        return self._own_queues_connection

    def consumed_queue(self, name: str) -> AbstractQueue | None:
        """The queue a consumer of this broker consumes, as declared on the connection that
        consumes it (None before `start()`, or when nothing consumes it)."""
        consuming = self._consuming_of(name)
        return None if consuming is None else consuming.queue

    def in_handlers(self, name: str) -> int | None:
        """The deliveries of the queue `name` in this broker's handlers now (None before
        `start()`, or when nothing consumes it)."""
        consuming = self._consuming_of(name)
        return None if consuming is None else consuming.handling

    def _consuming_of(self, name: str) -> _Consuming | None:
        return next((c for c in self._consuming if c.queue and c.queue.name == name), None)

    @override
    async def start(self) -> None:
        await super().start()
        connected = self.metrics.broker_connected
        connected.labels("publishers").set_function(lambda: _is_up(self._connection))
        if not self._subscriptions:
            return
        self._consumer_connection = await self._open_consuming_connection(f"{self._name} consumers")
        connected.labels("consumers").set_function(lambda: _is_up(self._consumer_connection))
        # The exclusive queues have a connection of their own. After a reconnection the
        # broker may not yet have dropped the lost connection (a partition, until its
        # heartbeat expires), which still holds them: declaring them again is refused, and
        # aio-pika closes the whole connection at each attempt to restore it, returning the
        # deliveries in hand of every other consumer on it each time.
        # It retries less often: until the broker lets go, each attempt is refused.
        if any(each.queue.exclusive for each in self._subscriptions):
            self._own_queues_connection = await self._open_consuming_connection(
                f"{self._name} own queues", reconnect_interval_s=OWN_QUEUES_RECONNECT_S
            )
            connected.labels("own queues").set_function(lambda: _is_up(self._own_queues_connection))
            self._own_queues_connection.reconnect_callbacks.add(self._own_queues_back)
        # Those that wait for something (`starts_after`) start last, in their order; the
        # others side by side: one after another, each consumer's channel, prefetch,
        # declaration, bindings and consume added their round trips to the start.
        waiting = [each for each in self._subscriptions if each.starts_after is not None]
        at_once = self._without(waiting)
        if any(each.prefetch is None and not each.queue.exclusive for each in at_once):
            await self._channel_for(None)  # the shared channel, opened once for them all
        await all_through(self._start_consuming(each) for each in at_once)
        for subscription in waiting:
            assert subscription.starts_after is not None
            await subscription.starts_after()
            await self._start_consuming(subscription)
        if self._consumer_connection is not None:
            self._gates.watch(self._consumer_connection, consuming=True)
        if self._own_queues_connection is not None:
            self._gates.watch(self._own_queues_connection, consuming=False)

    async def _start_consuming(self, subscription: _Subscription) -> None:
        """Start the consumer of `subscription`: its channel, its queue declared (or
        passively, when the topology declares it) and bound, its `basic.consume`; counted
        among the broker's consumers once consuming, for a stop to drain it even when
        another consumer's start failed."""
        consuming = _Consuming(
            subscription,
            self._acks,
            self.metrics,
            prefetch=subscription.prefetch or self._prefetch,
            opened=self._gate_of(subscription),
        )
        queue = subscription.queue
        channel = await self._channel_for(subscription.prefetch, own=queue.exclusive)
        consuming.queue = await channel.declare_queue(
            name=queue.name,
            durable=queue.durable,
            exclusive=queue.exclusive,
            passive=not queue.declare,
            auto_delete=queue.auto_delete,
            arguments=queue.arguments,
            timeout=queue.timeout or self._timeout,
        )
        for binding in subscription.bindings:
            # Through the robust queue, which binds again after a reconnection.
            await consuming.queue.bind(
                binding.exchange.name,
                routing_key=binding.routing_key,
                arguments=dict(binding.arguments) if binding.arguments else None,
                timeout=self._timeout,
            )
        consuming.tag = await consuming.queue.consume(
            consuming.on_delivery, no_ack=False, timeout=self._timeout
        )
        self._consuming.append(consuming)

    def _gate_of(self, subscription: _Subscription) -> asyncio.Event | None:
        if subscription.starts_after is None:
            return None
        return self._gates.gate(subscription.queue.name, subscription.starts_after)

    def _without(self, waiting: list[_Subscription]) -> list[_Subscription]:
        return [each for each in self._subscriptions if each not in waiting]

    async def _open_consuming_connection(
        self, name: str, *, reconnect_interval_s: float = 1.0
    ) -> AbstractRobustConnection:
        return await aio_pika.connect_robust(
            self._url,
            timeout=self._timeout,
            reconnect_interval=reconnect_interval_s,
            client_properties={"connection_name": name},
        )

    async def _channel_for(self, prefetch: int | None, *, own: bool = False) -> AbstractChannel:
        """A consuming channel with `prefetch`: the broker's, shared, when None; on the own
        queues' connection when `own` (an exclusive queue's).

        Opening it and its `basic.qos` are bounded by the broker timeout each, as the
        connection, the declaration and the `basic.consume` are: unbounded, a broker that
        stopped answering held the service's start until the heartbeat gave up."""
        connection = self._own_queues_connection if own else self._consumer_connection
        assert connection is not None
        shared = prefetch is None and not own
        if shared and self._shared_channel is not None:
            return self._shared_channel
        async with asyncio.timeout(self._timeout):  # aio-pika's open takes no timeout
            channel = await connection.channel(publisher_confirms=False)
        await channel.set_qos(
            prefetch_count=(prefetch or self._prefetch) or 0, timeout=self._timeout
        )
        if shared:
            self._shared_channel = channel
        return channel

    @override
    async def ping(self, timeout: float | None) -> bool:
        """Both connections up and answering a round trip (the consuming one only when
        something consumes). Not the own
        queues' one: what they carry (live events, a peer's rate-limit pause) is help, not
        the service's work, and it may stay refused until the broker drops a lost
        connection; it logs its attempts meanwhile."""
        began = time.monotonic()
        if not await super().ping(timeout) or self._connection is None:
            return False
        connections: list[AbstractConnection] = [self._connection]
        if self._subscriptions:
            connection = self._consumer_connection
            if connection is None or not connection.connected.is_set():
                return False
            connections.append(connection)
        # Each connection answering a round trip, not only flagged up (`shared.broker_probe`).
        left_s = (timeout or self._timeout) - (time.monotonic() - began)
        return await self._round_trips.answered(connections, max(left_s, 0.0))

    @override
    async def stop(
        self,
        exc_type: type[BaseException] | None = None,
        exc_val: BaseException | None = None,
        exc_tb: TracebackType | None = None,
        *,
        begun_at: float | None = None,
    ) -> None:
        """Bounded as a whole: the deliveries in hand and the consumers' cancellation share
        the graceful timeout, then the acks and the closes get one broker round trip's
        bound each (`_step_s`). Each step bounded on its own, a stalled broker made a stop
        last five graceful timeouts, past any orchestrator's grace period (then SIGKILL).

        `begun_at` (event-loop time): when the service's stop began, for a service that
        waited for work of its own first (`stop_consuming`, then its own wait): the graceful
        timeout counts from then, so the two waits share it instead of taking one each."""
        loop = asyncio.get_running_loop()
        deadline = (loop.time() if begun_at is None else begun_at) + self._graceful_timeout
        self._round_trips.stop()
        await self.stop_consuming()
        consuming, self._consuming = self._consuming, []
        await _wait_idle(consuming, timeout=_until(deadline))
        try:
            await asyncio.wait_for(self._acks.drain(), max(_until(deadline), self._step_s))
        except TimeoutError:
            log.warning("acks not written in time; the broker redelivers them")
        consuming_connections = {
            "the consuming connection": self._consumer_connection,
            "the own queues' connection": self._own_queues_connection,
        }
        self._consumer_connection = self._own_queues_connection = None
        self._shared_channel = None
        # Each close waits for the broker's CloseOk, up to the heartbeat (60 s) when the broker
        # stalls: together, and bounded.
        closing = [
            self._bounded(super().stop(exc_type, exc_val, exc_tb), "the publishing connection")
        ]
        for what, connection in consuming_connections.items():
            if connection is not None:
                closing.append(self._bounded(connection.close(), what))
        await asyncio.gather(*closing)

    @property
    def _step_s(self) -> float:
        """The bound of one broker round trip during a stop."""
        return min(self._timeout, self._graceful_timeout)

    async def stop_consuming(self) -> None:
        """Cancel every consumer: no delivery arrives any more, and those in hand go on
        (`stop()` does this first; a service calls it earlier to settle what it holds in a
        way of its own before `stop()` waits for it)."""
        self.stopping = True
        self._gates.stop()
        pending = [each for each in self._consuming if not each.cancelled]
        for each in pending:
            each.cancelled = True
        # Together, and within the stop's own bound: one after another, each waiting up to
        # the broker timeout for a stalled broker's CancelOk, they outlasted the grace period
        # an orchestrator gives a stop (then SIGKILL).
        await asyncio.gather(*(_cancel(each, timeout=self._step_s) for each in pending))

    async def _bounded(self, closing: Awaitable[object], what: str) -> None:
        try:
            await asyncio.wait_for(closing, self._step_s)
        except TimeoutError:
            log.warning("%s not closed within %.1fs; leaving it", what, self._step_s)


def _is_up(connection: AbstractRobustConnection | None) -> float:
    return float(connection is not None and connection.connected.is_set())


def _until(deadline: float) -> float:
    return max(0.0, deadline - asyncio.get_running_loop().time())


async def _wait_idle(consuming: list[_Consuming], *, timeout: float) -> None:
    """Wait, up to `timeout`, for the deliveries in hand to be handled."""
    idle = [asyncio.ensure_future(each.idle.wait()) for each in consuming]
    if not idle:
        return
    _, pending = await asyncio.wait(idle, timeout=timeout)
    for waiting in pending:
        waiting.cancel()


async def _cancel(consuming: _Consuming, *, timeout: float) -> None:
    """Cancel the consumer on the broker; on a closed channel (a reconnection under way),
    only make the robust queue forget it, so that the reconnection does not restore it."""
    queue, tag = consuming.queue, consuming.tag
    if queue is None or tag is None:
        return
    if queue.channel.is_closed:
        # RobustQueue.cancel forgets the consumer before it waits for the channel.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(queue.cancel(tag, nowait=True), CANCEL_ON_CLOSED_S)
        return
    # Bounded here, never by aiormq: an RPC it times out or cancels closes its channel
    # (`Channel.Close` 504), and every delivery in hand on it went back to its queue, counted,
    # though the stop was to let them finish (a broker slow to answer was enough: the cancels
    # of a shared channel wait for each other). One still unanswered is left to run; the
    # connection's close ends it.
    cancelling = asyncio.ensure_future(queue.cancel(tag))
    done, _ = await asyncio.wait({cancelling}, timeout=timeout)
    if not done:
        log.warning(
            "%s: the broker has not confirmed the consumer's cancel within %.1f s; the stop "
            "goes on",
            queue.name,
            timeout,
        )
        _UNANSWERED_CANCELS.add(cancelling)
        cancelling.add_done_callback(_forget_cancel)
    elif (error := cancelling.exception()) is not None:
        log.warning("%s: cancelling the consumer failed: %r", queue.name, error)


# Cancels left running by a stop (`_cancel`), held until they end.
_UNANSWERED_CANCELS: set[asyncio.Future[Any]] = set()


def _forget_cancel(cancelling: asyncio.Future[Any]) -> None:
    _UNANSWERED_CANCELS.discard(cancelling)
    if not cancelling.cancelled():
        cancelling.exception()  # retrieved: the channel's close fails it, as expected


def consume(
    broker: ScoreboxBroker,
    queue: RabbitQueue,
    *,
    prefetch: int | None = None,
    ack_first: bool = False,
    metric_label: str | None = None,
    bindings: tuple[Binding, ...] = (),
    starts_after: Callable[[], Awaitable[object]] | None = None,
) -> Callable[[Handler], Handler]:
    """Subscribe `handler(delivery)`, a plain async function, to `queue` once `broker` starts.

    `prefetch` gives the consumer a channel of its own with that prefetch; without it, it
    shares one consuming channel with the broker's prefetch. `ack_first` acks each delivery
    before its handler runs (for notifications that may be lost). `metric_label` names the
    queue in metrics where its name is one of a kind (a replica's own queue: a series per
    process started would pile up). `bindings` are made once the queue is declared, for a
    queue of one replica that the topology cannot declare (exclusive to this connection); the
    topology's own queues are bound by `declare_topology`. `starts_after` is awaited before
    this consumer starts, once the others have: the scorer's work waits for the cancels
    already queued to be handled (`services/scorer/cancels.py`); and again after each
    reconnection, its deliveries held meanwhile (`shared.reconnection_gates`).
    """

    def register(handler: Handler) -> Handler:
        label = metric_label or queue.name
        broker.add_consumer(
            _Subscription(queue, handler, prefetch, ack_first, label, bindings, starts_after)
        )
        return handler

    return register
