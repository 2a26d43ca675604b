"""A copy of an attempt the scorer gave up on replays the failure; it never scores the task.

Giving up (at the queue's delivery limit, or at the crash limit) dead-lettered the message
and published `task.failed` without writing to the attempt's claim, which stayed `running`.
A later copy of the same attempt (the gateway's outbox sweep re-sending it, a retry
replayed, a publish repeated after a lost confirm) then claimed it, its lease run out or
the claim this process's own, called the model and published `task.completed` with the
failure's sequence: the projection dropped it, the client read `failed` for a task whose
result was produced and billed. Here the scorer runs on the real broker and database and
calls the fake model server over HTTP, which counts the calls of each task.
"""

from __future__ import annotations

from dataclasses import replace

from prometheus_client import CollectorRegistry

from devtools.fake_llm import FakeLLM
from services.scorer.attempts import Attempts
from services.scorer.consumer import (
    CRASHES_HEADER,
    BrokerActions,
    _at_delivery_limit,
    subscribe_scorer,
)
from services.scorer.decisions import Finish
from services.scorer.metrics import ScorerMetrics
from services.scorer.model import ModelVerdict, ScoringRequest
from services.scorer.scoring import score_text
from services.scorer.settings import ScorerSettings
from shared.contracts import TaskEvent, TaskFailed, new_id, utcnow
from shared.runtime import make_broker
from shared.topology import SCORE_REQUESTS, declare_topology
from tests.integration import test_scorer_own_claims as own_claims
from tests.integration import test_scorer_usage_across_retries as usage_across_retries
from tests.integration.test_failed_deliveries import _delete_queue
from tests.integration.test_scorer_own_claims import LEASE, Deps, _calls, _command
from tests.integration.test_scorer_usage_across_retries import Scorer, outcomes
from tests.support import HandedDelivery, HandlerOnly, sample

attempts = own_claims.attempts  # fixtures
make_deps = own_claims.make_deps
scorer = usage_across_retries.scorer

CRASH_LIMIT = 3


async def test_a_copy_of_an_attempt_given_up_at_the_delivery_limit_replays_the_failure(
    scorer: Scorer, make_deps: Deps, attempts: Attempts, amqp_url: str
) -> None:
    command, marker = _command("Its consumers died holding it, every time.")
    await attempts.claim(command, now=utcnow() - 2 * LEASE, lease=LEASE, owner="scorer-b:dead")
    limit = SCORE_REQUESTS.delivery_limit
    at_limit = HandedDelivery.redelivery(command.model_dump_json().encode(), count=limit)
    broker = make_broker(ScorerSettings.model_validate({"RABBITMQ_URL": amqp_url}))
    async with broker, outcomes(amqp_url) as published:
        await broker.connect()
        actions = BrokerActions(broker=broker, timeout_s=10, clock=utcnow)
        await _at_delivery_limit(command, at_limit, make_deps("scorer-a"), actions, limit)
        failed: TaskFailed = await published.next_of(command.task_id, TaskFailed)

        # The outbox sweep sends the command again; the running scorer takes the copy.
        await scorer.send(command.model_copy(update={"message_id": new_id()}))
        outcome: TaskEvent = await published.next_of(command.task_id, TaskEvent)

    assert failed.dead_lettered
    assert isinstance(outcome, TaskFailed)
    assert outcome.sequence == failed.sequence
    assert scorer.calls(marker) == 0


class BuggyModel:
    """A model adapter with a bug: every call crashes the scorer's handler."""

    name = "buggy"

    async def score(self, request: ScoringRequest) -> ModelVerdict:
        raise RuntimeError("a bug in the model adapter")

    async def check(self, model: str | None = None) -> None:
        return None


async def test_a_copy_of_an_attempt_given_up_at_the_crash_limit_replays_the_failure(
    scorer: Scorer, make_deps: Deps, fake_llm: FakeLLM, amqp_url: str
) -> None:
    """The crashes left the attempt claimed by this very process, which a later copy here
    takes over at once (its claim's answer may have been lost)."""
    deps = make_deps("scorer-a")
    command, marker = _command("An essay the scorer crashes on.")
    last_crash = HandedDelivery(
        command.model_dump_json().encode(), headers={CRASHES_HEADER: CRASH_LIMIT - 1}
    )
    broker = make_broker(ScorerSettings.model_validate({"RABBITMQ_URL": amqp_url}))
    async with broker, outcomes(amqp_url) as published:
        await broker.connect()
        handler = HandlerOnly()
        actions = BrokerActions(broker=broker, timeout_s=10, clock=utcnow)
        crashing = replace(deps, model=BuggyModel())
        subscribe_scorer(handler, crashing, actions, crash_limit=CRASH_LIMIT)  # type: ignore[arg-type]
        await handler.handler(last_crash)
        failed: TaskFailed = await published.next_of(command.task_id, TaskFailed)

    # The bug fixed, the same process receives a copy of the command.
    copy = command.model_copy(update={"message_id": new_id()})
    decision = await score_text(copy, deps=deps)

    assert last_crash.settled == ["ack"]
    assert failed.dead_lettered
    assert isinstance(decision, Finish)
    assert decision.event == failed
    assert decision.dead_letter_error is not None
    assert _calls(fake_llm, marker) == 0


async def test_a_give_up_whose_dead_letter_the_broker_refuses_is_not_counted_as_lettered(
    make_deps: Deps, amqp_url: str
) -> None:
    """The DLQ deleted, the copy is refused until the deadline: the delivery goes back as
    failed (RabbitMQ letters it at the delivery limit), the task still fails, and the metric
    says the letter was refused, not that it is in the DLQ to replay."""
    registry = CollectorRegistry()
    deps = replace(make_deps("scorer-a"), model=BuggyModel(), metrics=ScorerMetrics(registry))
    command, _ = _command("An essay the scorer crashes on, its DLQ gone.")
    last_crash = HandedDelivery(
        command.model_dump_json().encode(), headers={CRASHES_HEADER: CRASH_LIMIT - 1}
    )
    broker = make_broker(ScorerSettings.model_validate({"RABBITMQ_URL": amqp_url}))
    async with broker:
        await broker.connect()
        await declare_topology(broker)
        await _delete_queue(amqp_url, SCORE_REQUESTS.dead_letter_routing_key)
        try:
            async with outcomes(amqp_url) as published:
                handler = HandlerOnly()
                actions = BrokerActions(
                    broker=broker, timeout_s=10, clock=utcnow, letter_deadline_s=0.3
                )
                subscribe_scorer(handler, deps, actions, crash_limit=CRASH_LIMIT)  # type: ignore[arg-type]
                await handler.handler(last_crash)
                failed: TaskFailed = await published.next_of(command.task_id, TaskFailed)
        finally:
            await declare_topology(broker)  # the DLQ back

    counted = "scorebox_scorer_decisions_total"
    # Returned first; the handler's closing ack is then no frame (a `Delivery` settles once).
    assert last_crash.settled[0] == "reject(requeue=True)"
    assert failed.dead_lettered
    assert sample(registry, counted, decision="dead_lettered") == 0
    assert sample(registry, counted, decision="letter_refused") == 1
