"""Consuming: plain async handlers on aio-pika consumers, on the FastStream broker's connection.

Every service consumes through `consume(broker, queue)`. The queue is declared through the
broker, on the channel FastStream would give it (the broker's default channel, or one of
its own when the consumer asks for another prefetch), and consumed with aio-pika directly:
each delivery reaches its handler as a `Delivery` without FastStream's per-delivery pipeline
(message parsing, context scopes, logging and acknowledgement middlewares), measured in
docs/architecture.md ("Performance"). What FastStream still does: the robust connection
(aio-pika restores the channels, their prefetch and the consumers after a reconnection),
declaring, publishing.

Settling is the handler's: it acks, nacks or rejects (settling twice is a no-op). A handler
that raises leaves its delivery unsettled; the broker redelivers it when the channel closes
(a restart, a reconnection), which counts towards a quorum queue's delivery limit on RabbitMQ
3.x and 4.x alike. It is never requeued at once: that would spin on a message that fails
every time, and RabbitMQ 4.x does not count a requeue.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast, override

from faststream.rabbit import RabbitBroker, RabbitQueue
from faststream.rabbit.schemas import Channel

if TYPE_CHECKING:
    from types import TracebackType

    from aio_pika.abc import AbstractIncomingMessage, AbstractQueue

log = logging.getLogger("scorebox.consumers")


class Delivery:
    """One delivery as a handler sees it: what it carries, and how to settle it."""

    __slots__ = ("_raw",)

    def __init__(self, raw: AbstractIncomingMessage) -> None:
        self._raw = raw

    @property
    def body(self) -> bytes:
        return self._raw.body

    @property
    def headers(self) -> dict[str, Any]:
        return cast("dict[str, Any]", self._raw.headers)

    @property
    def routing_key(self) -> str:
        return self._raw.routing_key or ""

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
        if not self._raw.processed:
            await self._raw.ack()

    async def nack(self, *, requeue: bool = True) -> None:
        if not self._raw.processed:
            await self._raw.nack(requeue=requeue)

    async def reject(self, *, requeue: bool = False) -> None:
        if not self._raw.processed:
            await self._raw.reject(requeue=requeue)


Handler = Callable[[Delivery], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class _Subscription:
    queue: RabbitQueue
    handler: Handler
    channel: Channel | None  # None: the broker's default channel (and its prefetch)
    ack_first: bool


class _Consuming:
    """The running consumers of one subscription, and the deliveries they are handling."""

    def __init__(self, subscription: _Subscription) -> None:
        self.subscription = subscription
        self.queue: AbstractQueue | None = None
        self.tag: str | None = None
        self.handling = 0
        self.idle = asyncio.Event()
        self.idle.set()

    async def on_delivery(self, raw: AbstractIncomingMessage) -> None:
        delivery = Delivery(raw)
        self.handling += 1
        self.idle.clear()
        try:
            if self.subscription.ack_first:
                await delivery.ack()
            await self.subscription.handler(delivery)
        except Exception:
            log.exception(
                "%s: handling message %s failed; it stays unacknowledged until the channel "
                "closes, then the broker redelivers it",
                self.subscription.queue.name,
                raw.message_id,
            )
        finally:
            self.handling -= 1
            if self.handling == 0:
                self.idle.set()


class ScoreboxBroker(RabbitBroker):
    """A FastStream broker whose consumers (`consume`) run without FastStream's pipeline.

    `start()` connects and then starts them; `stop()` cancels them, lets the deliveries in
    hand finish (up to the graceful timeout), then closes the connection.
    """

    def __init__(self, *args: Any, graceful_timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, graceful_timeout=graceful_timeout, **kwargs)
        self._graceful_timeout = graceful_timeout
        self._subscriptions: list[_Subscription] = []
        self._consuming: list[_Consuming] = []

    def add_consumer(self, subscription: _Subscription) -> None:
        self._subscriptions.append(subscription)

    @override
    async def start(self) -> None:
        await super().start()
        for subscription in self._subscriptions:
            consuming = _Consuming(subscription)
            declarer = self.config.declarer
            consuming.queue = await declarer.declare_queue(
                subscription.queue, channel=subscription.channel
            )
            consuming.tag = await consuming.queue.consume(consuming.on_delivery, no_ack=False)
            self._consuming.append(consuming)

    @override
    async def stop(
        self,
        exc_type: type[BaseException] | None = None,
        exc_val: BaseException | None = None,
        exc_tb: TracebackType | None = None,
    ) -> None:
        consuming, self._consuming = self._consuming, []
        for each in consuming:
            await _cancel(each, timeout=self._graceful_timeout)
        idle = [asyncio.ensure_future(each.idle.wait()) for each in consuming]
        if idle:
            _, pending = await asyncio.wait(idle, timeout=self._graceful_timeout)
            for waiting in pending:
                waiting.cancel()
        await super().stop(exc_type, exc_val, exc_tb)


async def _cancel(consuming: _Consuming, *, timeout: float) -> None:
    queue, tag = consuming.queue, consuming.tag
    if queue is None or tag is None or queue.channel.is_closed:
        return
    try:
        await queue.cancel(tag, timeout=timeout)
    except Exception as error:  # noqa: BLE001 - the channel closes right after anyway
        log.warning("%s: cancelling the consumer failed: %r", queue.name, error)


def consume(
    broker: ScoreboxBroker,
    queue: RabbitQueue,
    *,
    prefetch: int | None = None,
    ack_first: bool = False,
) -> Callable[[Handler], Handler]:
    """Subscribe `handler(delivery)`, a plain async function, to `queue` once `broker` starts.

    `prefetch` gives the consumer a channel of its own with that prefetch; without it, it
    shares the broker's default channel. `ack_first` acks each delivery before its handler
    runs (for notifications that may be lost).
    """

    def register(handler: Handler) -> Handler:
        channel = None if prefetch is None else Channel(prefetch_count=prefetch)
        broker.add_consumer(_Subscription(queue, handler, channel, ack_first))
        return handler

    return register
