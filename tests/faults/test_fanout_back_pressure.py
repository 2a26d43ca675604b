"""A full re-score queue is back-pressure to the scheduler's fan-out, not a failure.

The queue is made full with a policy in this module's vhost (nothing consumes it here). The
fan-out's page publish names the refusal `DownstreamFull`, which its run waits out instead of
counting it as a failed attempt (`services/scheduler/runs.py`, tested in
`tests/unit/test_scheduler_dispatch.py`): counted, a big fan-out was given up within a minute
of the queue filling.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta

import aiormq
import pytest
from aio_pika.abc import AbstractIncomingMessage
from faststream.rabbit import RabbitQueue

from devtools.infra import clear_queue_policy, set_queue_policy
from services.scheduler.errors import DownstreamFull
from services.scheduler.messaging import SchedulerBus
from services.scheduler.settings import SchedulerSettings
from shared.bus import publish_command
from shared.consumers import ScoreboxBroker
from shared.contracts import RescoreTask, ScoreText, new_id, utcnow
from shared.runtime import make_broker
from shared.topology import (
    RESCORE_REQUESTS,
    RESCORES_WAIT,
    SCORE_REQUESTS,
    WAIT_TIERS,
    declare_topology,
    wait_queue,
)
from tests.faults.harness import rabbitmqctl_available
from tests.support import eventually, queue_made_full, rescore_request

POLICY = "scorebox-test-rescore-queue-full"
TTL_POLICY = "scorebox-test-rescores-wait-short"
RESEND_AFTER_S = 1.0  # ten times the wait the policy leaves
[TEN_MINUTES] = [tier for tier in WAIT_TIERS if tier[0] == "10m"]
TIMEOUT_S = 30.0


async def test_a_full_rescore_queue_refuses_a_page_as_downstream_full(amqp_url: str) -> None:
    if not rabbitmqctl_available(amqp_url):
        pytest.skip("needs rabbitmqctl for a broker on this machine")
    broker = make_broker(SchedulerSettings.model_validate({"RABBITMQ_URL": amqp_url}))
    page = [rescore_request(ScoreText(task_id=new_id(), text="Again.")) for _ in range(3)]
    async with broker:
        await broker.connect()
        await declare_topology(broker)
        bus = SchedulerBus(broker, timeout_s=TIMEOUT_S, clock=utcnow)
        async with queue_made_full(
            amqp_url, RESCORE_REQUESTS.name, policy=POLICY, timeout_s=TIMEOUT_S
        ):
            with pytest.raises(DownstreamFull):
                await bus.publish_rescore_page(page)
        await bus.publish_rescore_page(page)  # room again


async def test_a_backlog_for_the_scorers_holds_the_next_page_back(amqp_url: str) -> None:
    """Behind a slow scorer the score queue fills, not the re-score queue (the gateway drains
    that one at its own pace): the fan-out waits for the requests already waiting, score and
    re-score ones together, to fall under `FANOUT_MAX_BACKLOG`."""
    async with _backlog_of_six(amqp_url) as (broker, bus):
        for _ in range(3):  # waiting for a scorer that does not come
            await publish_command(
                broker, ScoreText(task_id=new_id(), text="Slow."), now=utcnow(), timeout=10
            )

        await bus.publish_rescore_page(_page(2))  # 3 + 2 waiting: room
        with pytest.raises(DownstreamFull, match="5 score and re-score requests wait"):
            await bus.publish_rescore_page(_page(2))  # 5 + 2 > 6

        await purge(broker, SCORE_REQUESTS.name)  # the scorers caught up
        await bus.publish_rescore_page(_page(2))
        assert await waiting(broker, RESCORE_REQUESTS.name) == 4


async def test_requests_sent_after_the_others_count_against_the_backlog(amqp_url: str) -> None:
    """The requests of tasks the cache answered wait 10 minutes before they reach the
    gateway, and each then waits for a scorer unless the cache answers it: uncounted, a
    large run put any number of them there (the re-read of that change)."""
    async with _backlog_of_six(amqp_url) as (broker, bus):
        await bus.publish_rescore_page(_page(4, answered_from_cache=True))
        assert await waiting(broker, RESCORES_WAIT) == 4
        assert await waiting(broker, RESCORE_REQUESTS.name) == 0
        with pytest.raises(DownstreamFull, match="4 score and re-score requests wait"):
            await bus.publish_rescore_page(_page(3))  # 4 + 3 > 6


async def test_other_delayed_work_does_not_hold_the_fan_out_back(amqp_url: str) -> None:
    """Those requests wait in a queue of their own: in the ladder's 10-minute tier they were
    counted with its other delayed work, and webhook retries of a receiver down for long, or
    submissions scheduled far ahead, held the fan-out back (the second re-read)."""
    async with _backlog_of_six(amqp_url) as (broker, bus):
        ten_minutes_ahead = utcnow() + timedelta(minutes=15)
        for _ in range(6):  # a client's submissions scheduled for later
            scheduled = ScoreText(task_id=new_id(), text="Later.", not_before=ten_minutes_ahead)
            assert not await publish_command(
                broker, scheduled, now=utcnow(), timeout=10
            )  # on the ladder

        await bus.publish_rescore_page(_page(3, answered_from_cache=True))
        await bus.publish_rescore_page(_page(3))

        assert await waiting(broker, RESCORES_WAIT) == 3
        assert await waiting(broker, RESCORE_REQUESTS.name) == 3
        assert await waiting(broker, wait_queue(*TEN_MINUTES).name) == 6


async def test_a_request_sent_after_the_others_reaches_the_gateway_at_its_wait_s_end(
    amqp_url: str,
) -> None:
    """Out of its wait queue, a request goes through `scorebox.due` to the re-score queue,
    as one out of a ladder's tier does. A policy makes the wait 100 ms (the lower of policy
    and argument applies); a policy applies a moment after it is set, so requests are sent
    again until one arrives, the wait queue emptied before each: a message keeps the expiry
    it was queued with, and only the head of a queue expires."""
    if not rabbitmqctl_available(amqp_url):
        pytest.skip("needs rabbitmqctl for a broker on this machine")
    async with _backlog_of_six(amqp_url) as (broker, bus):
        await asyncio.to_thread(
            set_queue_policy, amqp_url, TTL_POLICY, RESCORES_WAIT, {"message-ttl": 100}
        )
        try:
            sent_at = [-RESEND_AFTER_S]

            async def arrived() -> bool:
                if await waiting(broker, RESCORE_REQUESTS.name) > 0:
                    return True
                if time.monotonic() - sent_at[0] >= RESEND_AFTER_S:  # sent before the policy?
                    await purge(broker, RESCORES_WAIT)
                    await bus.publish_rescore_page(_page(1, answered_from_cache=True))
                    sent_at[0] = time.monotonic()
                return False

            await eventually(arrived, timeout_s=TIMEOUT_S, what="a request out of its wait")
        finally:
            await asyncio.to_thread(clear_queue_policy, amqp_url, TTL_POLICY)
        [message] = await _take(broker, RESCORE_REQUESTS.name, 1)
        assert RescoreTask.model_validate_json(message.body).answered_from_cache
        await purge(broker, RESCORE_REQUESTS.name)


async def test_a_counted_queue_an_operator_deleted_closes_no_channel_publishes_go_through(
    amqp_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backlog's look at a queue an operator deleted is refused by the broker closing its
    channel: made on the channel every publish goes through, it closed that one (and the
    `Close-Ok` aiormq may drop, `shared.topology`, could then close the whole publishing
    connection). It goes on a channel of its own, and the page fails as refused."""
    closed_by_the_broker: list[aiormq.Channel] = []
    on_close_frame = aiormq.Channel._on_close_frame

    async def seen(channel: aiormq.Channel, frame: aiormq.spec.Channel.Close) -> None:
        closed_by_the_broker.append(channel)
        await on_close_frame(channel, frame)

    monkeypatch.setattr(aiormq.Channel, "_on_close_frame", seen)
    async with _backlog_of_six(amqp_url) as (broker, bus):
        default_channel = await broker.config.channel_manager.get_channel()
        publishing = await default_channel.get_underlay_channel()
        async with aiormq.connect(amqp_url) as operator:
            await (await operator.channel()).queue_delete(RESCORES_WAIT)
        closed_by_the_broker.clear()  # the topology's own probes
        try:
            with pytest.raises(aiormq.exceptions.ChannelNotFoundEntity):
                await bus.publish_rescore_page(_page(1))
        finally:
            refused = list(closed_by_the_broker)
            await _declared_again(amqp_url)
        assert refused, "the look was not refused"
        assert publishing not in refused
        await bus.publish_rescore_page(_page(1))


async def _declared_again(amqp_url: str) -> None:
    """The topology declared by a broker of its own (one that declared it already keeps the
    queues it declared as they were, and declares none of them again)."""
    broker = make_broker(SchedulerSettings.model_validate({"RABBITMQ_URL": amqp_url}))
    async with broker:
        await broker.connect()
        await declare_topology(broker)


@asynccontextmanager
async def _backlog_of_six(amqp_url: str) -> AsyncIterator[tuple[ScoreboxBroker, SchedulerBus]]:
    """The scheduler's bus with `FANOUT_MAX_BACKLOG` 6, the queues it counts empty; the wait
    queues emptied afterwards too (their messages would reach the work queues)."""
    counted = (SCORE_REQUESTS.name, RESCORE_REQUESTS.name, RESCORES_WAIT)
    broker = make_broker(SchedulerSettings.model_validate({"RABBITMQ_URL": amqp_url}))
    async with broker:
        await broker.connect()
        await declare_topology(broker)
        await purge(broker, *counted)
        try:
            yield broker, SchedulerBus(broker, timeout_s=TIMEOUT_S, clock=utcnow, max_backlog=6)
        finally:
            await purge(broker, RESCORES_WAIT, wait_queue(*TEN_MINUTES).name)


def _page(size: int, *, answered_from_cache: bool = False) -> list[RescoreTask]:
    return [
        rescore_request(ScoreText(task_id=new_id(), text="Again.")).model_copy(
            update={"answered_from_cache": answered_from_cache}
        )
        for _ in range(size)
    ]


async def waiting(broker: ScoreboxBroker, name: str) -> int:
    queue = await broker.declare_queue(RabbitQueue(name, declare=False))
    return int((await queue.declare(timeout=TIMEOUT_S)).message_count or 0)


async def purge(broker: ScoreboxBroker, *names: str) -> None:
    for name in names:
        queue = await broker.declare_queue(RabbitQueue(name, declare=False))
        await queue.purge(timeout=TIMEOUT_S)


async def _take(broker: ScoreboxBroker, name: str, count: int) -> list[AbstractIncomingMessage]:
    queue = await broker.declare_queue(RabbitQueue(name, declare=False))
    taken: list[AbstractIncomingMessage] = []
    for _ in range(count):
        message = await queue.get(fail=True, timeout=TIMEOUT_S)
        await message.ack()
        taken.append(message)
    return taken
