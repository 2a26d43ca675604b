"""A batch's cancellation heard by a scorer cancels its items as they arrive, before any claim
or model call (`services/scorer/batch_cancels.py`), without waiting for each item's own
`score.cancel`: none is sent here, so each item cancelled is the announcement's doing.

One scorer runs in process on the real broker and database against the fake model (two, one
after the other, where a scorer is started again)."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace
from typing import Any

import httpx
import pytest
from faststream.rabbit import RabbitBroker
from pymongo import AsyncMongoClient

from devtools.fake_llm import FakeLLM
from services.scorer.attempts import PUBLISHED
from services.scorer.batch_cancels import CancelledBatches
from services.scorer.decisions import Finish
from services.scorer.scoring import score_text
from services.scorer.slots import ModelSlots
from services.scorer.throttle import ModelThrottle, Turn
from shared.bus import publish_batch_cancelling, publish_cancel, publish_command
from shared.contracts import (
    CANCELLED_CODE,
    BatchCancelling,
    CancelTask,
    ScoreText,
    TaskCompleted,
    TaskFailed,
    new_id,
    utcnow,
)
from shared.runtime import make_broker
from shared.topology import declare_topology
from tests.integration import test_scorer_own_claims as own_claims
from tests.integration.in_process import scorer_over
from tests.integration.test_scorer_own_claims import Deps
from tests.integration.test_scorer_usage_across_retries import outcomes
from tests.support import eventually, metric_sum, running

pytestmark = pytest.mark.integration

attempts = own_claims.attempts  # fixtures
make_deps = own_claims.make_deps


def _item(batch_id: str, index: int, *, generation: int = 0) -> tuple[ScoreText, str]:
    marker = f"b{uuid.uuid4().hex[:12]}"
    command = ScoreText(
        task_id=new_id(),
        text=f"Item {index} of a batch cancelled [[id:{marker}]]",
        batch_id=batch_id,
        batch_index=index,
        generation=generation,
    )
    return command, marker


async def _noted_published(setup: Any, mongo: Any, task_id: str) -> None:
    """Wait for the cancel's consumer to note its cancellation published (after the event)."""
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo.url, tz_aware=True)
    attempts = client[setup.settings.database_name("scorer")]["attempts"]

    async def noted() -> bool:
        held = await attempts.find_one({"_id": task_id}) or {}
        return bool(held.get("decision", {}).get(PUBLISHED))

    try:
        await eventually(noted, what="the cancellation noted as published")
    finally:
        await client.close()


async def _heard(
    publisher: RabbitBroker, scorer: httpx.AsyncClient, announcement: BatchCancelling
) -> None:
    """Announce the batch's cancellation and wait until the scorer holds it."""
    await publish_batch_cancelling(publisher, announcement, timeout=10)

    async def heard() -> bool:
        return await _metric(scorer, "scorebox_scorer_batch_cancels_heard_total") == 1

    await eventually(heard, what="the scorer heard the batch's cancellation")


async def _drops(scorer: httpx.AsyncClient) -> float:
    answer = await scorer.get("/metrics")
    return metric_sum(answer.text, "scorebox_scorer_decisions_total", decision="drop")


async def _metric(scorer: httpx.AsyncClient, name: str) -> float:
    answer = await scorer.get("/metrics")
    assert answer.status_code == 200, answer.text
    return metric_sum(answer.text, name)


async def test_the_items_a_batch_cancellation_names_are_cancelled_on_arrival_the_rest_scored(
    fake_llm: FakeLLM, amqp_url: str, mongo: Any, db_prefix: str
) -> None:
    batch_id = new_id()
    named = [_item(batch_id, index) for index in range(3)]
    # Named at generation 0, sent at 1 (a DLQ replay since): not what was cancelled.
    replayed = _item(batch_id, 3, generation=1)
    elsewhere = _item(new_id(), 0)  # another batch's item
    announcement = BatchCancelling(
        task_id=new_id(),
        batch_id=batch_id,
        requested_at=utcnow(),
        generations={command.task_id: 0 for command, _ in [*named, replayed]},
    )
    everything = [*named, replayed, elsewhere]
    setup = scorer_over(fake_llm, amqp_url=amqp_url, mongo_url=mongo.url, db_prefix=db_prefix)

    async with running(setup.app()) as scorer, outcomes(amqp_url) as seen:
        publisher = make_broker(setup.settings)
        async with publisher:
            await publisher.connect()
            await declare_topology(publisher)
            await _heard(publisher, scorer, announcement)
            for command, _ in everything:
                await publish_command(publisher, command, now=utcnow(), timeout=10)

        ended = await seen.first_of_each({command.task_id for command, _ in everything})
        cancelled_here = await _metric(scorer, "scorebox_scorer_cancelled_at_delivery_total")

    for command, _ in named:
        failed = ended[command.task_id]
        assert isinstance(failed, TaskFailed), failed
        assert failed.error.code == CANCELLED_CODE
        assert (failed.generation, failed.attempt) == (0, 1)
    for command, _ in (replayed, elsewhere):
        assert isinstance(ended[command.task_id], TaskCompleted), ended[command.task_id]

    assert cancelled_here == len(named)
    calls = fake_llm.stats()["by_id"]
    assert [calls.get(marker, 0) for _, marker in named] == [0, 0, 0]
    assert [calls.get(marker, 0) for _, marker in (replayed, elsewhere)] == [1, 1]


async def test_an_item_cancelled_or_completed_already_is_carried_out_as_it_was_and_not_counted(
    fake_llm: FakeLLM, amqp_url: str, mongo: Any, db_prefix: str
) -> None:
    """Named by the announcement, an item whose own cancel recorded and published its
    cancellation first is dropped without counting a cancellation at delivery, and one that
    completed before is carried out completed again, never failed: the announcement decides
    nothing `Attempts.cancel` would not."""
    batch_id = new_id()
    (cancelled, _), (completed, marker) = _item(batch_id, 0), _item(batch_id, 1)
    announcement = BatchCancelling(
        task_id=new_id(),
        batch_id=batch_id,
        requested_at=utcnow(),
        generations={cancelled.task_id: 0, completed.task_id: 0},
    )
    setup = scorer_over(fake_llm, amqp_url=amqp_url, mongo_url=mongo.url, db_prefix=db_prefix)

    async with running(setup.app()) as scorer, outcomes(amqp_url) as seen:
        publisher = make_broker(setup.settings)
        async with publisher:
            await publisher.connect()
            await declare_topology(publisher)
            await publish_command(publisher, completed, now=utcnow(), timeout=10)
            await seen.next_of(completed.task_id, TaskCompleted)
            await publish_cancel(publisher, _own_cancel(cancelled), timeout=10)
            await seen.next_of(cancelled.task_id, TaskFailed)
            await _noted_published(setup, mongo, cancelled.task_id)
            await _heard(publisher, scorer, announcement)
            drops = await _drops(scorer)
            again = completed.model_copy(update={"message_id": new_id()})  # a stray copy
            for command in (cancelled, again):
                await publish_command(publisher, command, now=utcnow(), timeout=10)
            recompleted = await seen.next_of(completed.task_id, TaskCompleted)

            async def dropped() -> bool:  # published by its own cancel's consumer already
                return await _drops(scorer) > drops

            await eventually(dropped, what="the cancelled item's delivery dropped")
            await seen.read_for(cancelled.task_id)
        cancelled_here = await _metric(scorer, "scorebox_scorer_cancelled_at_delivery_total")

    assert [type(event) for event in seen.of(cancelled.task_id)] == [TaskFailed]
    # The same completion carried out again, and no failure of it.
    first, second = seen.of(completed.task_id)
    assert (first.sequence, second.sequence) == (recompleted.sequence,) * 2
    assert isinstance(first, TaskCompleted)
    assert cancelled_here == 0
    assert fake_llm.stats()["by_id"].get(marker, 0) == 1


async def test_a_scorer_started_again_knows_the_batches_cancelled_before_and_cancels_their_items(
    fake_llm: FakeLLM, amqp_url: str, mongo: Any, db_prefix: str
) -> None:
    """The announcement goes to each running replica's own queue once: a scorer stopped
    right after hearing it, and started again, never heard it, and the items' deliveries
    raced their own cancels (found in a walkthrough: 92 of 1,000 items scored). It is
    stored in the scorer's database as heard, and read at start, before any delivery."""
    batch_id = new_id()
    named = [_item(batch_id, index) for index in range(3)]
    elsewhere = _item(new_id(), 0)  # another batch's item
    announcement = BatchCancelling(
        task_id=new_id(),
        batch_id=batch_id,
        requested_at=utcnow(),
        generations={command.task_id: 0 for command, _ in named},
    )
    everything = [*named, elsewhere]
    setup = scorer_over(fake_llm, amqp_url=amqp_url, mongo_url=mongo.url, db_prefix=db_prefix)
    publisher = make_broker(setup.settings)
    async with publisher:
        await publisher.connect()
        await declare_topology(publisher)
        async with running(setup.app()) as before:
            await _heard(publisher, before, announcement)
        # The items wait in their queue for the scorer started again (a new replica: a
        # queue of its own for announcements, with nothing in it).
        for command, _ in everything:
            await publish_command(publisher, command, now=utcnow(), timeout=10)
        async with outcomes(amqp_url) as seen, running(setup.app()) as again:
            ended = await seen.first_of_each({command.task_id for command, _ in everything})
            heard_again = await _metric(again, "scorebox_scorer_batch_cancels_heard_total")
            cancelled_here = await _metric(again, "scorebox_scorer_cancelled_at_delivery_total")

    for command, _ in named:
        failed = ended[command.task_id]
        assert isinstance(failed, TaskFailed), failed
        assert failed.error.code == CANCELLED_CODE
    assert isinstance(ended[elsewhere[0].task_id], TaskCompleted), ended[elsewhere[0].task_id]
    assert (heard_again, cancelled_here) == (0, len(named))
    calls = fake_llm.stats()["by_id"]
    assert [calls.get(marker, 0) for _, marker in named] == [0, 0, 0]
    assert calls.get(elsewhere[1], 0) == 1


def _own_cancel(command: ScoreText) -> CancelTask:
    return CancelTask(
        task_id=command.task_id,
        tenant_id=command.tenant_id,
        generation=command.generation,
        submitted_at=command.submitted_at,
    )


async def test_an_item_waiting_for_a_model_slot_when_its_batch_is_cancelled_is_not_called(
    fake_llm: FakeLLM, make_deps: Deps
) -> None:
    """In hand before the announcement was heard, it passed the check on arrival and waited
    behind the calls under way (the prefetch is twice the slots); given a slot, it was
    claimed and scored (found in a walkthrough: 16 items of a 1,000-item batch)."""
    batch_id = new_id()
    command, marker = _item(batch_id, 0)
    slots = ModelSlots(1)
    cancelled = CancelledBatches(clock=utcnow)
    deps = replace(make_deps("scorer-a"), model_slots=slots, cancelled_batches=cancelled)

    async with slots.held():  # a call under way holds the one slot
        scoring = asyncio.create_task(score_text(command, deps=deps))

        async def waiting_for_the_slot() -> bool:
            # asyncio.Semaphore keeps its waiters there; nothing public tells them.
            return bool(slots._free._waiters)

        await eventually(waiting_for_the_slot, what="the item waited for a model slot")
        _hear_cancelled(cancelled, batch_id, command)
    await _cancelled_uncalled(scoring, fake_llm, marker)


async def test_an_item_waiting_out_a_rate_limit_pause_when_its_batch_is_cancelled_is_not_called(
    fake_llm: FakeLLM, make_deps: Deps
) -> None:
    """Holding its slot, it waits for its turn while the provider's 429 pause lasts (up to a
    minute): a cancellation heard then was not looked at again (found in review)."""
    batch_id = new_id()
    command, marker = _item(batch_id, 0)
    cancelled = CancelledBatches(clock=utcnow)
    throttle = ModelThrottle(base_s=1.0)
    deps = replace(
        make_deps("scorer-a"),
        model_slots=ModelSlots(1),
        cancelled_batches=cancelled,
        throttle=throttle,
    )
    throttle.rate_limited(Turn(), retry_after_s=2)  # the provider said 429 just now
    scoring = asyncio.create_task(score_text(command, deps=deps))

    async def waiting_its_turn() -> bool:
        return throttle.waiting == 1

    await eventually(waiting_its_turn, what="the item waited out the pause in its slot")
    _hear_cancelled(cancelled, batch_id, command)
    await _cancelled_uncalled(scoring, fake_llm, marker)


def _hear_cancelled(cancelled: CancelledBatches, batch_id: str, command: ScoreText) -> None:
    """The scorer hears that the batch of `command` was cancelled."""
    cancelled.hear(
        BatchCancelling(
            task_id=new_id(),
            batch_id=batch_id,
            requested_at=utcnow(),
            generations={command.task_id: command.generation},
        )
    )


async def _cancelled_uncalled(
    scoring: asyncio.Task[object], fake_llm: FakeLLM, marker: str
) -> None:
    """The item's decision is its cancellation, and the model was never called for it."""
    decision = await asyncio.wait_for(scoring, 30)
    assert isinstance(decision, Finish), decision
    assert isinstance(decision.event, TaskFailed)
    assert decision.event.error.code == CANCELLED_CODE
    assert fake_llm.stats()["by_id"].get(marker, 0) == 0
