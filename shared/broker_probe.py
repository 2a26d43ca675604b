"""A round trip to the broker on a connection, for readiness.

A connection's `connected` flag stays set while the broker link is stalled: it clears only
once the heartbeat gives up (RabbitMQ's is 60 s, and a stall may end first). `/readyz`
answered "rabbitmq: true" through a 150-second stall, every publish timing out meanwhile (a
walkthrough of `make run` through a forwarder holding the traffic). A passive declare of
`amq.direct`, which every vhost holds, is one frame each way and changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aio_pika.abc import AbstractChannel, AbstractConnection

# Declared by RabbitMQ in every vhost; a passive declare of it never fails while it answers.
PROBED_EXCHANGE = "amq.direct"


# How long closing a probe's channel that failed may take (its link may be stalled).
CLOSE_TIMEOUT_S = 5.0


class RoundTrips:
    """One channel per connection kept for the probe, opened at its first use. A probe that
    fails gives its channel up (closed in the background): its late answer must not meet
    the next probe's request."""

    def __init__(self) -> None:
        self._channels: dict[int, AbstractChannel] = {}
        self._opening = asyncio.Lock()
        self._closing: set[asyncio.Task[None]] = set()

    async def answered(self, connections: list[AbstractConnection], timeout: float) -> bool:
        """Whether the broker answers a round trip on each of `connections` within
        `timeout` in all."""
        try:
            async with asyncio.timeout(timeout):
                for connection in connections:
                    await self._round_trip(connection)
        except Exception:  # noqa: BLE001 - readiness answers "no" on any failure
            return False
        return True

    async def _round_trip(self, connection: AbstractConnection) -> None:
        channel = await self._channel(connection)
        try:
            # On the channel beneath: a robust channel answers a passive declare it has
            # made before from its cache, without asking the broker.
            underlay = await channel.get_underlay_channel()
            await underlay.exchange_declare(exchange=PROBED_EXCHANGE, passive=True)
        except BaseException:
            self._give_up(connection, channel)
            raise

    async def _channel(self, connection: AbstractConnection) -> AbstractChannel:
        async with self._opening:
            channel = self._channels.get(id(connection))
            if channel is None or channel.is_closed:
                channel = await connection.channel(publisher_confirms=False)
                self._channels[id(connection)] = channel
            return channel

    def _give_up(self, connection: AbstractConnection, channel: AbstractChannel) -> None:
        if self._channels.get(id(connection)) is channel:
            del self._channels[id(connection)]
        closing = asyncio.create_task(_close_quietly(channel))
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)


async def _close_quietly(channel: AbstractChannel) -> None:
    with contextlib.suppress(Exception):
        async with asyncio.timeout(CLOSE_TIMEOUT_S):
            await channel.close()
