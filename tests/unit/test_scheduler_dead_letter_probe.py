"""Housekeeping's look at a DLQ's head is bounded on the way back too, and ages the head
from its dead-lettering.

The head is read with `basic.get` and returned with `nack(requeue=True)`; every other broker
call of the scheduler's bus has its timeout, the `nack` had none, and on a stalled channel it
held the housekeeping run (and every dead-letter report after it) for as long as the stall
lasted. Here the broker is in memory and its `nack` never completes (or, for the age, at once).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest
from faststream.rabbit import RabbitBroker, RabbitQueue

from services.scheduler.messaging import SchedulerBus
from shared.topology import CRON_JOBS, ERROR_HEADER

NOW = datetime(2025, 1, 1, 10, tzinfo=UTC)
BROKER_TIMEOUT_S = 0.01
# Only keeps a failing test from waiting for ever; far beyond the bound under test.
GUARD_S = 30.0


@dataclass
class StalledHead:
    """A dead letter read at the DLQ's head, on a channel that takes no `nack` any more."""

    headers: dict[str, Any] = field(default_factory=dict)
    timestamp: datetime | None = NOW - timedelta(minutes=1)
    nacks: int = 0

    async def nack(self, requeue: bool = True) -> None:
        self.nacks += 1
        await asyncio.Event().wait()  # never returns


@dataclass
class Declared:
    message_count: int


class DeadLetterQueue:
    def __init__(self, head: StalledHead, depth: int) -> None:
        self._head = head
        self._depth = depth

    async def declare(self, timeout: float | None = None) -> Declared:
        return Declared(self._depth)

    async def get(self, *, no_ack: bool, fail: bool, timeout: float) -> StalledHead:
        return self._head


class Channel:
    """The probe's own channel: its head is read there, and it is closed after the look."""

    def __init__(self, queue: DeadLetterQueue) -> None:
        self._queue = queue
        self.asked: list[str] = []
        self.closed = False

    async def get_queue(self, name: str, *, ensure: bool) -> DeadLetterQueue:
        self.asked.append(name)
        return self._queue

    async def close(self) -> None:
        self.closed = True


class Connection:
    def __init__(self, channel: Channel) -> None:
        self._channel = channel

    async def ready(self) -> None:
        return None

    def channel(self, *, publisher_confirms: bool) -> Awaitable[Channel]:
        async def opened() -> Channel:
            return self._channel

        return opened()


class Broker:
    def __init__(self, queue: DeadLetterQueue) -> None:
        self._queue = queue
        self.asked: list[str] = []
        self.channel = Channel(queue)

    async def declare_queue(self, queue: RabbitQueue) -> DeadLetterQueue:
        self.asked.append(queue.name)
        return self._queue

    async def connect(self) -> Connection:
        return Connection(self.channel)


async def test_a_head_that_cannot_be_returned_leaves_the_reading_standing() -> None:
    head = StalledHead()
    broker = Broker(DeadLetterQueue(head, depth=3))
    bus = SchedulerBus(cast(RabbitBroker, broker), timeout_s=BROKER_TIMEOUT_S, clock=lambda: NOW)

    async with asyncio.timeout(GUARD_S) as guard:
        depth, age_s = await bus.dead_letter_depth(CRON_JOBS)

    assert not guard.expired()
    assert (depth, age_s) == (3, 60.0)
    assert head.nacks == 1
    # Depth and head both read on the look's own channel, none on the publishing connection.
    assert (broker.asked, broker.channel.asked) == ([], [CRON_JOBS.dead_letter_routing_key])
    assert broker.channel.closed  # the broker takes the head back, were it still held


@dataclass
class ReturnedHead(StalledHead):
    """A dead letter read at the DLQ's head, returned at once."""

    async def nack(self, requeue: bool = True) -> None:
        self.nacks += 1


WAITED = NOW - timedelta(minutes=9)  # a retry left the 10 m wait queue then
DEAD = NOW - timedelta(minutes=4)  # dead-lettered then


@pytest.mark.parametrize(
    ("headers", "timestamp"),
    [
        # Ours: a retried run given up 5 minutes into its job, the ladder's `x-death` kept.
        (
            {
                "x-death": [{"queue": "scorebox.wait.10m", "reason": "expired", "time": WAITED}],
                ERROR_HEADER: "cron job 'rollup' failed 3 times",
            },
            DEAD,
        ),
        # RabbitMQ's (its delivery limit): `x-death` is its dead-lettering, the timestamp
        # its publish.
        (
            {"x-death": [{"queue": CRON_JOBS.name, "reason": "delivery_limit", "time": DEAD}]},
            NOW - timedelta(hours=1),
        ),
    ],
    ids=["ours", "rabbitmq's"],
)
async def test_the_head_is_aged_from_its_dead_lettering(
    headers: dict[str, Any], timestamp: datetime
) -> None:
    """Our own letter (`x-scorebox-error`) keeps the headers of the delivery it copies, a
    retry's wait-ladder `x-death` among them: read first, that aged it from its last wait
    (found in review). It is aged as the DLQ listings date it (`dead_lettered_at`)."""
    head = ReturnedHead(headers=headers, timestamp=timestamp)
    broker = Broker(DeadLetterQueue(head, depth=1))
    bus = SchedulerBus(cast(RabbitBroker, broker), timeout_s=BROKER_TIMEOUT_S, clock=lambda: NOW)

    async with asyncio.timeout(GUARD_S):
        depth, age_s = await bus.dead_letter_depth(CRON_JOBS)

    assert (depth, age_s) == (1, (NOW - DEAD).total_seconds())
    assert head.nacks == 1
