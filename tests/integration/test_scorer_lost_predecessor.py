"""The fresh copy sent at the delivery limit is not dropped for its own lost predecessor.

A delivery waiting for a model slot holds its attempt in this process. When the connection
drops, its handler is cancelled but its decision waits on, and starts nothing once it gets
the slot (its delivery was lost). The broker hands the message back; at the delivery limit,
never claimed, it is sent again as a fresh copy with its count cleared and acked. That copy,
not a redelivery, found the attempt held here and was dropped as a duplicate: then the lost
decision gave up its turn, and no copy of the command was left anywhere (found in review).
The copy now waits for the holder, as a redelivery does, and scores the task.

The scorer's handler runs in process on the real database and the fake model over HTTP; its
broker actions are recorded instead of published.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, override

import pytest

from devtools.fake_llm import FakeLLM
from services.scorer.consumer import REPLACES_LOST_HEADER, BrokerActions, subscribe_scorer
from services.scorer.decisions import Decision, Finish
from services.scorer.scoring import ScorerDeps
from services.scorer.slots import ModelSlots
from shared.consumers import Delivery
from shared.contracts import ScoreText, TaskCompleted, new_id, utcnow
from shared.in_hand import InHand
from shared.topology import EARLIER_DELIVERIES_HEADER, SCORE_REQUESTS
from tests.integration.scorer_parts import attempts_store, fake_model, scorer_deps
from tests.support import HandedDelivery, HandlerOnly, eventually

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


class Recorded(BrokerActions):
    def __init__(self) -> None:
        super().__init__(broker=None, timeout_s=10, clock=utcnow)  # type: ignore[arg-type]
        self.decisions: list[Decision] = []
        self.resent: list[tuple[ScoreText, dict[str, Any]]] = []

    @override
    async def carry_out(self, decision: Decision, message: Delivery) -> None:
        self.decisions.append(decision)

    @override
    async def resend(self, command: ScoreText, *, headers: dict[str, Any]) -> None:
        self.resent.append((command, headers))


@pytest.mark.parametrize("through_a_stopping_scorer", [False, True], ids=["direct", "sent-on"])
async def test_the_copy_sent_at_the_limit_waits_for_its_lost_predecessor_and_scores(
    fake_llm: FakeLLM, mongo: Any, db_prefix: str, through_a_stopping_scorer: bool
) -> None:
    """`sent-on`: the copy first reaches a scorer that is stopping, which sends it on; that
    copy lost the marker (and carries no count) and was dropped here (found in review)."""
    marker = f"o{uuid.uuid4().hex[:12]}"
    command = ScoreText(task_id=new_id(), text=f"An essay lost in prefetch. [[id:{marker}]]")
    body = command.model_dump_json().encode()
    limit = SCORE_REQUESTS.delivery_limit
    in_hand = LookedUp()
    async with attempts_store(mongo.url, db_prefix) as attempts, fake_model(fake_llm) as model:
        deps, handler, actions = _scorer_with_one_slot(attempts, model, in_hand)

        async with deps.model_slots.held():  # the only slot, busy with another task's call
            waiting = HandedDelivery.redelivery(body, count=limit - 1)
            await _lost_waiting_for_the_slot(handler, deps, waiting)
            at_limit = HandedDelivery.redelivery(body, count=limit)
            await asyncio.wait_for(handler.handler(at_limit), timeout=30)
            [(again, headers)] = actions.resent  # sent again afresh, then acked
            if through_a_stopping_scorer:
                again, headers = await _sent_on_at_a_stop(again, headers, attempts, model)
            fresh = HandedDelivery(again.model_dump_json().encode(), headers=headers)
            copy = asyncio.create_task(handler.handler(fresh))
            await eventually(lambda: _looked(in_hand, 2), what="the copy finding it held")
        # The slot free: the lost decision gives up its turn, and the copy takes the attempt.
        await asyncio.wait_for(copy, timeout=60)

    assert headers[REPLACES_LOST_HEADER] is True
    assert at_limit.settled == ["ack"]
    assert fresh.settled == ["ack"]
    _scored_once(actions, fake_llm, marker)


async def _sent_on_at_a_stop(
    command: ScoreText, headers: dict[str, Any], attempts: Any, model: Any
) -> tuple[ScoreText, dict[str, Any]]:
    """The copy as another scorer, stopping (its model slots closed), sends it on."""
    stopping = scorer_deps(
        attempts=attempts,
        model=model,
        lease=timedelta(seconds=60),
        owner="scorer-b",
        model_slots=ModelSlots(1),
    )
    stopping.model_slots.close()
    handler, actions = HandlerOnly(), _SendingOn()
    subscribe_scorer(handler, stopping, actions, crash_limit=3)  # type: ignore[arg-type]
    copy = HandedDelivery(command.model_dump_json().encode(), headers=headers)
    await asyncio.wait_for(handler.handler(copy), timeout=30)
    [sent_on] = actions.resent
    return sent_on


class _SendingOn(Recorded):
    """Carries a decision out as the scorer does (a `Defer` is sent again through `resend`)."""

    @override
    async def carry_out(self, decision: Decision, message: Delivery) -> None:
        await BrokerActions.carry_out(self, decision, message)


def _scorer_with_one_slot(
    attempts: Any, model: Any, in_hand: LookedUp
) -> tuple[ScorerDeps, HandlerOnly, Recorded]:
    """A scorer's handler with one model slot, its broker actions recorded."""
    deps = scorer_deps(
        attempts=attempts,
        model=model,
        lease=timedelta(seconds=60),
        owner="scorer-a",
        model_slots=ModelSlots(1),
        started_after=timedelta(seconds=30),
        in_hand=in_hand,
    )
    handler, actions = HandlerOnly(), Recorded()
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


def _scored_once(actions: Recorded, fake_llm: FakeLLM, marker: str) -> None:
    [decision] = actions.decisions
    assert isinstance(decision, Finish)
    assert isinstance(decision.event, TaskCompleted)
    assert int(fake_llm.stats()["by_id"].get(marker, 0)) == 1


async def _held(deps: ScorerDeps, count: int) -> bool:
    return len(deps.in_hand) == count


async def _looked(in_hand: LookedUp, times: int) -> bool:
    return in_hand.looks >= times


async def test_a_copy_carrying_a_lost_delivery_waits_for_its_predecessor_and_scores(
    fake_llm: FakeLLM, mongo: Any, db_prefix: str
) -> None:
    """The delivery lost here came back to another scorer, which sent it again as a copy
    carrying that lost delivery (its database away, or stopping). Arriving here while the
    lost decision still held the attempt, the copy was taken for a fresh one and dropped,
    and then the lost decision gave up its turn: the task stayed `queued` for good."""
    marker = f"c{uuid.uuid4().hex[:12]}"
    command = ScoreText(task_id=new_id(), text=f"An essay sent again. [[id:{marker}]]")
    body = command.model_dump_json().encode()
    in_hand = LookedUp()
    async with attempts_store(mongo.url, db_prefix) as attempts, fake_model(fake_llm) as model:
        deps, handler, actions = _scorer_with_one_slot(attempts, model, in_hand)

        async with deps.model_slots.held():  # the only slot, busy with another task's call
            await _lost_waiting_for_the_slot(handler, deps, HandedDelivery(body))
            fresh = HandedDelivery(body, headers={EARLIER_DELIVERIES_HEADER: 1})
            copy = asyncio.create_task(handler.handler(fresh))
            await eventually(lambda: _looked(in_hand, 2), what="the copy finding it held")
        await asyncio.wait_for(copy, timeout=60)

    assert fresh.settled == ["ack"]
    _scored_once(actions, fake_llm, marker)
