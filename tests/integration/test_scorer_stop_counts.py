"""A scorer that stops adds no delivery to the count that stops poison messages.

The score queue's delivery limit counts the consumers that died holding a message. A stop is
no such death, but two of its paths returned the delivery when the channel closed, one count
higher: a redelivery waiting for a model slot (left unacknowledged), and a delivery at the
limit waiting for another worker's claim to be decided (still waiting when the grace period
ended). Through a rolling deploy of a few replicas a healthy task reached the limit and was
failed as poison; a copy at the limit by RabbitMQ's own count was dead-lettered by the queue
with no give-up recorded and no `task.failed`. Both are now sent again as a fresh copy
carrying the count unchanged (`x-scorebox-earlier-deliveries`), then acked; a copy the broker
does not confirm leaves the delivery unacknowledged, to come back: never lost.

The handler runs in process on the real database and carries its decisions out on the real
broker; the copies it sends again are read back from the broker, and a broker that takes them
without confirming them is `stalled_broker`.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import timedelta
from typing import Any, override

from faststream.rabbit import RabbitBroker

from services.scorer.attempts import Attempts
from services.scorer.consumer import BrokerActions, subscribe_scorer
from services.scorer.decisions import Finish
from services.scorer.scoring import ScorerDeps, score_text
from shared.consumers import Delivery
from shared.contracts import ScoreText, TaskEvent, utcnow
from shared.topology import DELIVERY_COUNT_HEADER, EARLIER_DELIVERIES_HEADER, SCORE_REQUESTS
from tests.integration import test_scorer_own_claims as own_claims
from tests.integration.gateway_records import UNCONFIRMED_AFTER_S
from tests.integration.test_scorer_own_claims import (
    Copy,
    _calls,
    _command,
    watching_commands,
)
from tests.support import HandedDelivery, HandlerOnly, eventually

attempts = own_claims.attempts  # fixtures
make_deps = own_claims.make_deps
Deps = own_claims.Deps

LIMIT = SCORE_REQUESTS.delivery_limit
# Another worker's claim, live when the delivery at the limit arrives: long enough for the
# handler's first look on a loaded machine; the code before the fix waited it out.
OTHER_LEASE = timedelta(seconds=15)
HANG_GUARD_S = 60


class Published(BrokerActions):
    """The scorer's broker actions on `broker`, remembering the dead letters and events they
    published (the broker confirmed each); the copies sent again are read from the broker
    (`watching_commands`)."""

    def __init__(self, broker: RabbitBroker, *, timeout_s: float = 10) -> None:
        super().__init__(broker=broker, timeout_s=timeout_s, clock=utcnow)
        self.dead_letters: list[str] = []
        self.events: list[TaskEvent] = []

    @override
    async def dead_letter(self, message: Delivery, error: str) -> bool:
        lettered = await super().dead_letter(message, error)
        self.dead_letters.append(error)
        return lettered

    @override
    async def _event(self, event: TaskEvent) -> None:
        await super()._event(event)
        self.events.append(event)


def _stopping(deps: ScorerDeps, actions: Published) -> HandlerOnly:
    """The scorer's handler, its model slots closed (the scorer is stopping)."""
    broker = HandlerOnly()
    subscribe_scorer(broker, deps, actions, crash_limit=3)  # type: ignore[arg-type]
    deps.model_slots.close()
    return broker


def _redelivery(command: ScoreText, *, count: int, carried: int = 0) -> HandedDelivery:
    headers: dict[str, Any] = {DELIVERY_COUNT_HEADER: count}
    if carried:
        headers[EARLIER_DELIVERIES_HEADER] = carried
    return HandedDelivery(command.model_dump_json().encode(), headers=headers, redelivered=True)


async def test_at_stop_a_redelivery_waiting_for_a_slot_is_sent_again_its_count_unchanged(
    make_deps: Deps, fake_llm: Any, amqp_url: str, task_broker: RabbitBroker
) -> None:
    """It was left unacknowledged and came back one count higher with every stop."""
    deps, actions = make_deps("scorer-a"), Published(task_broker)
    handler = _stopping(deps, actions)
    command, marker = _command("Redelivered twice, then its scorer stopped.")
    delivery = _redelivery(command, count=1, carried=1)

    async with watching_commands(amqp_url) as commands, asyncio.timeout(HANG_GUARD_S):
        await handler.handler(delivery)
        [copy] = await commands.taken()
    assert copy.headers[EARLIER_DELIVERIES_HEADER] == 2  # as delivered: 1 carried + 1 its own
    assert DELIVERY_COUNT_HEADER not in copy.headers
    assert (copy.command.task_id, copy.command.attempt) == (command.task_id, command.attempt)
    assert copy.command.message_id != command.message_id
    assert copy.command.not_before == command.not_before  # sent again now
    assert delivery.settled == ["ack"]
    assert _calls(fake_llm, marker) == 0


async def test_at_stop_with_the_broker_away_a_redelivery_is_left_to_come_back(
    make_deps: Deps, amqp_url: str, stalled_broker: RabbitBroker
) -> None:
    """Its copy never confirmed, it is never acked: the closing channel returns it (counted,
    but not lost). The broker takes each copy without confirming it (a confirm lost):
    tried again for as long as the handler runs (`keep_publishing`)."""
    deps = make_deps("scorer-a")
    handler = _stopping(deps, Published(stalled_broker, timeout_s=UNCONFIRMED_AFTER_S))
    command, _ = _command("Redelivered, its scorer stopping with the broker away.")
    delivery = _redelivery(command, count=1)

    async with watching_commands(amqp_url) as commands:
        handling = asyncio.create_task(handler.handler(delivery))
        taken: list[Copy] = []  # each unconfirmed copy reaches the queues all the same

        async def tried_again() -> bool:
            taken.extend(await commands.taken())
            return len(taken) > 1

        await eventually(tried_again, what="the copy tried again")
        handling.cancel()  # as the closing channel cancels its consumers' handlers
        with contextlib.suppress(asyncio.CancelledError):
            await handling

    assert delivery.settled == []


async def test_at_stop_a_delivery_at_the_limit_waiting_for_a_claim_is_sent_again(
    make_deps: Deps, attempts: Attempts, amqp_url: str, task_broker: RabbitBroker
) -> None:
    """It waited for the other worker's claim through the stop's grace period and went back
    when the channel closed: dead-lettered by RabbitMQ's own limit, no give-up recorded, no
    `task.failed`. Here the claim's lease ends during the wait, as a stop's grace period
    would: the code before the fix then gave the message up, though the scorer stopping had
    decided nothing about it."""
    command, _ = _command("At its delivery limit, another worker's claim live.")
    await attempts.claim(command, now=utcnow(), lease=OTHER_LEASE, owner="scorer-b:1:live")
    deps, actions = make_deps("scorer-a"), Published(task_broker)
    handler = _stopping(deps, actions)
    delivery = _redelivery(command, count=LIMIT)

    async with watching_commands(amqp_url) as commands, asyncio.timeout(HANG_GUARD_S):
        await handler.handler(delivery)
        [copy] = await commands.taken()

    assert (actions.dead_letters, actions.events) == ([], [])
    assert copy.headers[EARLIER_DELIVERIES_HEADER] == LIMIT
    assert DELIVERY_COUNT_HEADER not in copy.headers
    assert (copy.command.task_id, copy.command.attempt) == (command.task_id, command.attempt)
    assert copy.command.message_id != command.message_id
    assert delivery.settled == ["ack"]


async def test_at_stop_a_delivery_at_the_limit_with_a_recorded_decision_carries_it_out(
    make_deps: Deps, attempts: Attempts, amqp_url: str, task_broker: RabbitBroker
) -> None:
    """Nothing to wait for: the stop changes nothing (the decision is carried out, no copy)."""
    command, _ = _command("At its delivery limit, scored before.")
    scorer = make_deps("scorer-b")
    decided = await score_text(command, deps=scorer)
    deps, actions = make_deps("scorer-a"), Published(task_broker)
    handler = _stopping(deps, actions)
    delivery = _redelivery(command, count=LIMIT)

    async with watching_commands(amqp_url) as commands, asyncio.timeout(HANG_GUARD_S):
        await handler.handler(delivery)
        assert await commands.taken() == []

    assert isinstance(decided, Finish)
    assert actions.events == [decided.event]
    assert delivery.settled == ["ack"]
