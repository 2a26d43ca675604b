"""`shared.acks.ChannelAcks.drain`: it returns once the acks asked for are written, even when
it starts while a finished send has not yet been forgotten (its done-callback still queued).

That window is reached deterministically with eager tasks: a send whose channel never
suspends finishes inside `create_task`, and a callback queued before it then runs drain
ahead of the send's done-callback. Before the fix drain spun there for ever, on a loop it
never yielded (`gather` of finished tasks completes without suspending); the test's own
timeout turns such a hang into a failure.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from shared.acks import ChannelAcks


class Channel:
    """An aiormq channel as `ChannelAcks` uses it: acks written at once."""

    number = 1

    def __init__(self) -> None:
        self.acked: list[tuple[int, bool]] = []

    async def basic_ack(self, tag: int, *, multiple: bool = False, wait: bool = True) -> None:
        self.acked.append((tag, multiple))


@pytest.fixture
async def eager_tasks() -> AsyncIterator[None]:
    loop = asyncio.get_running_loop()
    loop.set_task_factory(asyncio.eager_task_factory)
    yield
    loop.set_task_factory(None)


@pytest.mark.timeout(20)
@pytest.mark.usefixtures("eager_tasks")
async def test_drain_right_after_a_send_finished_returns() -> None:
    loop = asyncio.get_running_loop()
    channel = Channel()
    acks = ChannelAcks(channel)  # type: ignore[arg-type]
    started: asyncio.Future[asyncio.Task[None]] = loop.create_future()
    acks.ack(1)  # queues the flush, which sends and finishes at once (eager)
    loop.call_soon(lambda: started.set_result(asyncio.ensure_future(acks.drain())))
    drain = await started
    await asyncio.wait_for(drain, timeout=5)
    assert channel.acked == [(1, False)]


async def test_drain_writes_what_was_asked_and_waits_for_it() -> None:
    channel = Channel()
    acks = ChannelAcks(channel)  # type: ignore[arg-type]
    for tag in (1, 2, 3):
        acks.ack(tag)
    await acks.drain()
    assert channel.acked == [(3, True)]
