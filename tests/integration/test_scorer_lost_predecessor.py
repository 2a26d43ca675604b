"""The fresh copy sent at the delivery limit is not dropped for its own lost predecessor.

A delivery waiting for a model slot holds its attempt in this process. When the connection
drops, its handler is cancelled but its decision waits on, and starts nothing once it gets
the slot (its delivery was lost). The broker hands the message back; at the delivery limit,
never claimed, it is sent again as a fresh copy with its count cleared and acked. That copy,
not a redelivery, found the attempt held here and was dropped as a duplicate: then the lost
decision gave up its turn, and no copy of the command was left anywhere (found in review).
The copy now waits for the holder, as a redelivery does, and scores the task.

The scorer's handler runs in process on the real database and the fake model over HTTP; its
broker actions are carried out on the real broker, and the copies it sends again are read
back from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, override

import aio_pika
import pytest
from faststream.rabbit import RabbitBroker

from devtools.fake_llm import FakeLLM
from services.scorer.consumer import REPLACES_LOST_HEADER, subscribe_scorer
from services.scorer.decisions import Finish
from services.scorer.scoring import ScorerDeps
from services.scorer.slots import ModelSlots
from shared.contracts import ScoreText, TaskCompleted, new_id
from shared.in_hand import InHand
from shared.topology import EARLIER_DELIVERIES_HEADER, SCORE_REQUESTS
from tests.integration.scorer_parts import attempts_store, fake_model, scorer_deps
from tests.integration.test_scorer_own_claims import (
    CarriedOut,
    Commands,
    completion_seen,
    watching_commands,
)
from tests.support import HandedDelivery, HandlerOnly, eventually, watching_completions

Watched = list[aio_pika.abc.AbstractIncomingMessage]

pytestmark = pytest.mark.integration


class LookedUp(InHand[tuple[str, int, int]]):
    """Counts the deliveries that looked whether their attempt is held here."""

    def __init__(self) -> None:
        super().__init__()
        self.looks = 0

    @override
    @contextlib.contextmanager
    def holding(self, key: tuple[str, int, int]) -> Iterator[bool]:
        self.looks += 1
        with super().holding(key) as only_here:
            yield only_here


async def _sent_again(commands: Commands) -> HandedDelivery:
    """The one copy of a command sent again, as the broker hands it out: its body and the
    headers it carried through the broker."""
    [copy] = await commands.taken()
    return HandedDelivery(copy.command.model_dump_json().encode(), headers=copy.headers)


@pytest.mark.parametrize("through_a_stopping_scorer", [False, True], ids=["direct", "sent-on"])
async def test_the_copy_sent_at_the_limit_waits_for_its_lost_predecessor_and_scores(
    fake_llm: FakeLLM,
    mongo: Any,
    db_prefix: str,
    amqp_url: str,
    task_broker: RabbitBroker,
    through_a_stopping_scorer: bool,
) -> None:
    """`sent-on`: the copy first reaches a scorer that is stopping, which sends it on; that
    copy lost the marker (and carries no count) and was dropped here (found in review)."""
    marker = f"o{uuid.uuid4().hex[:12]}"
    command = ScoreText(task_id=new_id(), text=f"An essay lost in prefetch. [[id:{marker}]]")
    body = command.model_dump_json().encode()
    limit = SCORE_REQUESTS.delivery_limit
    in_hand = LookedUp()
    async with (
        attempts_store(mongo.url, db_prefix) as attempts,
        fake_model(fake_llm) as model,
        watching_commands(amqp_url) as commands,
        watching_completions(amqp_url) as completions,
    ):
        deps, handler, actions = _scorer_with_one_slot(attempts, model, in_hand, task_broker)

        async with deps.model_slots.held():  # the only slot, busy with another task's call
            waiting = HandedDelivery.redelivery(body, count=limit - 1)
            await _lost_waiting_for_the_slot(handler, deps, waiting)
            at_limit = HandedDelivery.redelivery(body, count=limit)
            await asyncio.wait_for(handler.handler(at_limit), timeout=30)
            fresh = await _sent_again(commands)  # sent again afresh, then acked
            if through_a_stopping_scorer:
                fresh = await _sent_on_at_a_stop(fresh, commands, attempts, model, task_broker)
            copy = asyncio.create_task(handler.handler(fresh))
            await eventually(lambda: _looked(in_hand, 2), what="the copy finding it held")
        # The slot free: the lost decision gives up its turn, and the copy takes the attempt.
        await asyncio.wait_for(copy, timeout=60)
        await _scored_once(actions, fake_llm, marker, completions, command.task_id)

    assert fresh.headers[REPLACES_LOST_HEADER] is True
    assert at_limit.settled == ["ack"]
    assert fresh.settled == ["ack"]


async def _sent_on_at_a_stop(
    copy: HandedDelivery, commands: Commands, attempts: Any, model: Any, broker: RabbitBroker
) -> HandedDelivery:
    """The copy as another scorer, stopping (its model slots closed), sends it on."""
    stopping = scorer_deps(
        attempts=attempts,
        model=model,
        lease=timedelta(seconds=60),
        owner="scorer-b",
        model_slots=ModelSlots(1),
    )
    stopping.model_slots.close()
    handler = HandlerOnly()
    subscribe_scorer(handler, stopping, CarriedOut(broker), crash_limit=3)  # type: ignore[arg-type]
    await asyncio.wait_for(handler.handler(copy), timeout=30)
    return await _sent_again(commands)


def _scorer_with_one_slot(
    attempts: Any, model: Any, in_hand: LookedUp, broker: RabbitBroker
) -> tuple[ScorerDeps, HandlerOnly, CarriedOut]:
    """A scorer's handler with one model slot, its broker actions on `broker`."""
    deps = scorer_deps(
        attempts=attempts,
        model=model,
        lease=timedelta(seconds=60),
        owner="scorer-a",
        model_slots=ModelSlots(1),
        started_after=timedelta(seconds=30),
        in_hand=in_hand,
    )
    handler, actions = HandlerOnly(), CarriedOut(broker)
    subscribe_scorer(handler, deps, actions, crash_limit=3)  # type: ignore[arg-type]
    return deps, handler, actions


async def _lost_waiting_for_the_slot(
    handler: HandlerOnly, deps: ScorerDeps, delivery: HandedDelivery
) -> None:
    """`delivery` handed in while the only slot is busy, then lost: the connection dropped
    and its handler was cancelled, its decision left waiting for the slot."""
    predecessor = asyncio.create_task(handler.handler(delivery))
    await eventually(lambda: _held(deps, 1), what="the delivery waiting for the slot")
    predecessor.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await predecessor


async def _scored_once(
    actions: CarriedOut, fake_llm: FakeLLM, marker: str, completions: Watched, task_id: str
) -> None:
    [decision] = actions.decisions
    assert isinstance(decision, Finish)
    assert isinstance(decision.event, TaskCompleted)
    assert int(fake_llm.stats()["by_id"].get(marker, 0)) == 1
    await eventually(
        lambda: completion_seen(completions, task_id), what="the task.completed published"
    )


async def _held(deps: ScorerDeps, count: int) -> bool:
    return len(deps.in_hand) == count


async def _looked(in_hand: LookedUp, times: int) -> bool:
    return in_hand.looks >= times


async def test_a_copy_carrying_a_lost_delivery_waits_for_its_predecessor_and_scores(
    fake_llm: FakeLLM, mongo: Any, db_prefix: str, amqp_url: str, task_broker: RabbitBroker
) -> None:
    """The delivery lost here came back to another scorer, which sent it again as a copy
    carrying that lost delivery (its database away, or stopping). Arriving here while the
    lost decision still held the attempt, the copy was taken for a fresh one and dropped,
    and then the lost decision gave up its turn: the task stayed `queued` for good."""
    marker = f"c{uuid.uuid4().hex[:12]}"
    command = ScoreText(task_id=new_id(), text=f"An essay sent again. [[id:{marker}]]")
    body = command.model_dump_json().encode()
    in_hand = LookedUp()
    async with (
        attempts_store(mongo.url, db_prefix) as attempts,
        fake_model(fake_llm) as model,
        watching_completions(amqp_url) as completions,
    ):
        deps, handler, actions = _scorer_with_one_slot(attempts, model, in_hand, task_broker)

        async with deps.model_slots.held():  # the only slot, busy with another task's call
            await _lost_waiting_for_the_slot(handler, deps, HandedDelivery(body))
            fresh = HandedDelivery(body, headers={EARLIER_DELIVERIES_HEADER: 1})
            copy = asyncio.create_task(handler.handler(fresh))
            await eventually(lambda: _looked(in_hand, 2), what="the copy finding it held")
        await asyncio.wait_for(copy, timeout=60)
        await _scored_once(actions, fake_llm, marker, completions, command.task_id)

    assert fresh.settled == ["ack"]
