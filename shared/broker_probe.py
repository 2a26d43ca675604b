"""A round trip to the broker on a connection, for readiness.

A connection's `connected` flag stays set while the broker link is stalled: it clears only
once the heartbeat gives up (RabbitMQ's is 60 s, and a stall may end first). `/readyz`
answered "rabbitmq: true" through a 150-second stall, every publish timing out meanwhile (a
walkthrough of `make run` through a forwarder holding the traffic). A passive declare of
`amq.direct`, which every vhost holds, is one frame each way and changes nothing.

A slow link is not a stalled one: a round trip of 0.2 s or more (three of them to open the
probe's channel) outlasted the readiness deadline, and a probe cut short at it never
passed (review). So each connection's probe runs on its own, bounded by the stall bound
(`BROKER_TIMEOUT_S`), one at a time, shared by the readiness checks meanwhile: a check waits
for it up to its own deadline, and past that reads a probe still out as answering until the
stall bound, and then as stalled.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aio_pika.abc import AbstractChannel, AbstractConnection

# Declared by RabbitMQ in every vhost; a passive declare of it never fails while it answers.
PROBED_EXCHANGE = "amq.direct"
# How long closing a probe's channel that failed may take (its link may be stalled).
CLOSE_TIMEOUT_S = 5.0


@dataclass
class _Probe:
    """One connection's probe: the round trip out (if any), when it began, and what the
    last one that ended found."""

    running: asyncio.Task[bool] | None = None
    began: float = 0.0
    answered: bool | None = None
    channel: AbstractChannel | None = None
    closing: set[asyncio.Task[None]] = field(default_factory=set)


class RoundTrips:
    """The probes of a broker's connections; `stall_s` bounds each round trip."""

    def __init__(self, *, stall_s: float) -> None:
        self._stall_s = stall_s
        self._probes: dict[int, _Probe] = {}

    async def answered(self, connections: list[AbstractConnection], timeout: float) -> bool:
        """Whether each of `connections` answers (module docstring), known within `timeout`."""
        verdicts = await asyncio.gather(
            *(self._verdict(connection, timeout) for connection in connections)
        )
        return all(verdicts)

    def stop(self) -> None:
        """Cancel the probes still out (the service stops)."""
        for probe in self._probes.values():
            if probe.running is not None:
                probe.running.cancel()

    async def _verdict(self, connection: AbstractConnection, timeout: float) -> bool:
        loop = asyncio.get_running_loop()
        probe = self._probes.setdefault(id(connection), _Probe())
        if probe.running is None or probe.running.done():
            probe.began = loop.time()
            probe.running = asyncio.create_task(self._round_trip(connection, probe))
        done, _ = await asyncio.wait({probe.running}, timeout=timeout)
        if done:
            return not probe.running.cancelled() and probe.running.result()
        # Still out: slow, not stalled, until the stall bound.
        return loop.time() - probe.began < self._stall_s and probe.answered is not False

    async def _round_trip(self, connection: AbstractConnection, probe: _Probe) -> bool:
        try:
            async with asyncio.timeout(self._stall_s):
                if probe.channel is None or probe.channel.is_closed:
                    probe.channel = await connection.channel(publisher_confirms=False)
                # On the channel beneath: a robust channel answers a passive declare it has
                # made before from its cache, without asking the broker.
                underlay = await probe.channel.get_underlay_channel()
                await underlay.exchange_declare(exchange=PROBED_EXCHANGE, passive=True)
        except Exception:  # noqa: BLE001 - readiness answers "no" on any failure
            self._give_up_channel(probe)
            probe.answered = False
            return False
        probe.answered = True
        return True

    @staticmethod
    def _give_up_channel(probe: _Probe) -> None:
        """Close the channel of a round trip that failed, in the background: its late answer
        must not meet the next probe's request (aiormq closes one whose call was cancelled)."""
        channel, probe.channel = probe.channel, None
        if channel is None:
            return
        closing = asyncio.create_task(_close_quietly(channel))
        probe.closing.add(closing)
        closing.add_done_callback(probe.closing.discard)


async def _close_quietly(channel: AbstractChannel) -> None:
    with contextlib.suppress(Exception):
        async with asyncio.timeout(CLOSE_TIMEOUT_S):
            await channel.close()
