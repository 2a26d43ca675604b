"""A copy of a command the scorer sends again carries the deliveries its consumers lost.

A quorum queue counts how often the consumer holding a message died or lost its connection
(`x-delivery-count`), and the scorer gives the message up at the queue's delivery limit: a
message that kills its consumer stops. A copy the scorer acks and sends again starts that
count at zero. A redelivery that found MongoDB away was sent again that way, its count lost: a
message that kills its consumer looped for ever whenever a database error fell on one of its
redeliveries (a not-due redelivery, sent down the ladder again, too). Now every copy of the
same attempt carries the count (`EARLIER_DELIVERIES_HEADER`), the limit is checked on it and
the copy's own count together, and a retry's next attempt, a new command, starts afresh.

The consumers that die are played on the real broker (a consumer that takes the command and
closes its connection holding it); the scorer runs in process on the real broker, its
database behind a link cut for the outage (`database_link`), against the fake model. The
commands it sends are read from a queue of the test's own bound where they go.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import aio_pika
from pymongo import AsyncMongoClient

from devtools.fake_llm import FakeLLM
from services.scorer.attempts import Attempts
from services.scorer.consumer import (
    UNSTARTED_RESETS,
    UNSTARTED_RESETS_HEADER,
    BrokerActions,
    subscribe_scorer,
)
from services.scorer.scoring import ScorerDeps
from services.scorer.settings import ScorerSettings
from shared.bus import publish_command
from shared.contracts import ScoreText, TaskCompleted, TaskEvent, TaskFailed, TaskRetrying, utcnow
from shared.runtime import make_broker, start_broker
from shared.topology import (
    DELAY,
    DELIVERY_COUNT_HEADER,
    EARLIER_DELIVERIES_HEADER,
    ERROR_HEADER,
    SCORE_REQUESTS,
    TASKS,
    declare_topology,
)
from tests.faults.slow_link import SlowLink
from tests.integration import test_scorer_own_claims as own_claims
from tests.integration.test_scorer_own_claims import Deps, _calls, _command
from tests.integration.test_scorer_usage_across_retries import outcomes
from tests.support import eventually

attempts = own_claims.attempts  # fixtures
make_deps = own_claims.make_deps

LIMIT = SCORE_REQUESTS.delivery_limit
Message = aio_pika.abc.AbstractIncomingMessage


def _settings(amqp_url: str) -> ScorerSettings:
    return ScorerSettings.model_validate({"RABBITMQ_URL": amqp_url})


async def _published(
    amqp_url: str, command: ScoreText, *, headers: dict[str, Any] | None = None
) -> None:
    """`command` sent straight to the score queue (even one not yet due)."""
    broker = make_broker(_settings(amqp_url))
    async with broker:
        await broker.connect()
        await declare_topology(broker)
        now = command.not_before or utcnow()  # due as far as the sender knows
        await publish_command(broker, command, timeout=10, now=now, headers=headers)


async def _held_by_a_scorer_that_dies(amqp_url: str, command: ScoreText) -> int:
    """Take the command, then close the connection holding it (a scorer dying on it); the
    delivery count it was handed with."""
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel()
        queue = await channel.get_queue(SCORE_REQUESTS.queue.name, ensure=True)

        async def handed() -> tuple[Message] | None:
            while (message := await queue.get(no_ack=False, fail=False, timeout=5)) is not None:
                if message.correlation_id == command.task_id:
                    return (message,)
            return None

        (message,) = await eventually(handed, what=f"{command.task_id} handed to a consumer")
        return int(str(message.headers.get(DELIVERY_COUNT_HEADER, 0)))


@dataclass(frozen=True)
class Sent:
    """A command the scorer sent, with its headers."""

    command: ScoreText
    headers: dict[str, Any]


class SentCommands:
    """The score commands published (now, or down the wait ladder), as a queue bound to both
    routes receives them."""

    def __init__(self, queue: aio_pika.abc.AbstractQueue) -> None:
        self._queue = queue
        self.seen: list[Sent] = []
        self._returned: set[int] = set()  # indexes in `seen`

    async def next_of(self, task_id: str, *, attempt: int, besides: str | None = None) -> Sent:
        """The first command of the task's `attempt` (its message id not `besides`) that no
        call returned yet."""

        async def arrived() -> Sent | None:
            while (
                message := await self._queue.get(no_ack=True, fail=False, timeout=5)
            ) is not None:
                command = ScoreText.model_validate_json(message.body)
                self.seen.append(Sent(command, dict(message.headers)))
            for index, sent in enumerate(self.seen):
                ours = (sent.command.task_id, sent.command.attempt) == (task_id, attempt)
                if ours and sent.command.message_id != besides and index not in self._returned:
                    self._returned.add(index)
                    return sent
            return None

        return await eventually(arrived, timeout_s=60, what=f"attempt {attempt} of {task_id} sent")


@asynccontextmanager
async def sent_commands(amqp_url: str) -> AsyncIterator[SentCommands]:
    await _topology_declared(amqp_url)
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(exclusive=True, timeout=10)
        await queue.bind(TASKS.name, routing_key="score.requested", timeout=10)
        await queue.bind(TASKS.name, routing_key="score.resubmitted", timeout=10)
        await queue.bind(DELAY.name, routing_key="*.score.requested", timeout=10)
        yield SentCommands(queue)


async def _topology_declared(amqp_url: str) -> None:
    """The topology declared, for a queue of the test's own to bind to."""
    broker = make_broker(_settings(amqp_url))
    async with broker:
        await broker.connect()
        await declare_topology(broker)


@asynccontextmanager
async def scorer(amqp_url: str, deps: ScorerDeps) -> AsyncIterator[None]:
    """The scorer's consumer in process, on the real broker, with `deps`."""
    settings = _settings(amqp_url)
    broker = make_broker(settings, prefetch=4, name="scorer")
    actions = BrokerActions(broker=broker, timeout_s=10, clock=utcnow)
    subscribe_scorer(broker, deps, actions, crash_limit=settings.crash_limit)
    await start_broker(broker, settings)
    try:
        yield
    finally:
        await broker.stop()


@asynccontextmanager
async def attempts_through(link: SlowLink, db_prefix: str) -> AsyncIterator[Attempts]:
    """The scorer's attempts on the test database, reached through `link`; an operation
    with the link down fails within a second (a `PyMongoError`)."""
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
        link.mongo_url, tz_aware=True, serverSelectionTimeoutMS=1000, connectTimeoutMS=1000
    )
    try:
        yield Attempts(client, f"{db_prefix}_scorer", retention=timedelta(hours=1))
    finally:
        await client.close()


async def test_a_redelivery_sent_again_on_a_database_error_carries_its_delivery_count(
    make_deps: Deps,
    attempts: Attempts,  # its indexes ensured
    database_link: SlowLink,
    fake_llm: FakeLLM,
    amqp_url: str,
    db_prefix: str,
) -> None:
    """Its copy used to start at zero. Carried across every copy of the attempt (the copies
    not yet due, sent down the ladder again, too), not into the next attempt."""
    command, marker = _command("Its scorers died on it twice [[fake:503x1]].")
    async with sent_commands(amqp_url) as sent, outcomes(amqp_url) as published:
        await _published(amqp_url, command)
        counts = [await _held_by_a_scorer_that_dies(amqp_url, command) for _ in range(2)]
        assert counts == [0, 1]  # handed next with `x-delivery-count` 2
        database_link.down = True
        await database_link.cut()
        async with (
            attempts_through(database_link, db_prefix) as away,
            scorer(amqp_url, replace(make_deps("scorer-a"), attempts=away)),
        ):
            copy = await sent.next_of(command.task_id, attempt=1, besides=command.message_id)
            database_link.down = False
            retrying: TaskRetrying = await published.next_of(command.task_id, TaskRetrying)
            completed: TaskCompleted = await published.next_of(command.task_id, TaskCompleted)
            following = await sent.next_of(command.task_id, attempt=2)

    assert copy.headers.get(EARLIER_DELIVERIES_HEADER) == 2
    assert DELIVERY_COUNT_HEADER not in copy.headers  # a fresh copy
    assert copy.command.not_before is not None  # sent down the ladder
    copies = [s for s in sent.seen if s.command.message_id != command.message_id]
    first_attempt = [s for s in copies if s.command.attempt == 1]
    assert {s.headers.get(EARLIER_DELIVERIES_HEADER) for s in first_attempt} == {2}
    assert EARLIER_DELIVERIES_HEADER not in following.headers  # a new command starts afresh
    assert (retrying.attempt, completed.attempt) == (1, 2)
    assert _calls(fake_llm, marker) == 2


async def test_a_command_whose_carried_and_own_deliveries_reach_the_limit_is_given_up(
    make_deps: Deps, fake_llm: FakeLLM, amqp_url: str
) -> None:
    """Sent again with LIMIT - 1 deliveries carried, its scorer died on the copy once (and
    it was sent again with its count cleared as often as an attempt never claimed is):
    given up without calling the model, dead-lettered with the total in its reason, the
    task failed. It used to be scored: its count had started again at zero."""
    command, marker = _command("Its scorers died on it at every copy.")
    spent = {EARLIER_DELIVERIES_HEADER: LIMIT - 1, UNSTARTED_RESETS_HEADER: UNSTARTED_RESETS}
    await _published(amqp_url, command, headers=spent)
    assert await _held_by_a_scorer_that_dies(amqp_url, command) == 0
    async with outcomes(amqp_url) as published, scorer(amqp_url, make_deps("scorer-a")):
        outcome: TaskEvent = await published.next_of(command.task_id, TaskEvent)

    assert isinstance(outcome, TaskFailed)
    assert outcome.dead_lettered
    [letter] = await _dead_letters_of(amqp_url, command)
    assert f"holding it {LIMIT} times ({LIMIT - 1} of them" in outcome.error.message
    assert str(letter.headers[ERROR_HEADER]) == outcome.error.message
    assert letter.headers[EARLIER_DELIVERIES_HEADER] == LIMIT
    assert _calls(fake_llm, marker) == 0


async def test_a_command_never_claimed_at_the_limit_is_sent_again_afresh_and_scored(
    make_deps: Deps, fake_llm: FakeLLM, amqp_url: str
) -> None:
    """Its deliveries were lost before any scorer claimed it (waiting in a prefetch while
    connections dropped): sent again with its count cleared, it is scored once. It used to
    be given up, a task no scorer had touched failed."""
    command, marker = _command("It waited in prefetches through dropped connections.")
    async with sent_commands(amqp_url) as sent, outcomes(amqp_url) as published:
        await _published(amqp_url, command, headers={EARLIER_DELIVERIES_HEADER: LIMIT - 1})
        assert await _held_by_a_scorer_that_dies(amqp_url, command) == 0
        async with scorer(amqp_url, make_deps("scorer-a")):
            copy = await sent.next_of(command.task_id, attempt=1, besides=command.message_id)
            outcome: TaskEvent = await published.next_of(command.task_id, TaskEvent)

    assert isinstance(outcome, TaskCompleted)  # a give-up publishes its failure first
    assert EARLIER_DELIVERIES_HEADER not in copy.headers
    assert copy.headers[UNSTARTED_RESETS_HEADER] == 1
    assert _calls(fake_llm, marker) == 1


async def test_a_redelivery_not_yet_due_sent_down_the_ladder_carries_its_delivery_count(
    make_deps: Deps, amqp_url: str
) -> None:
    """A `Defer` carried out on a redelivery (not due, or claimed elsewhere) acks it and
    sends a copy: its count started again at zero."""
    command, _ = _command("Due in an hour, its scorer died on it once.")
    command = command.model_copy(update={"not_before": utcnow() + timedelta(hours=1)})
    async with sent_commands(amqp_url) as sent:
        await _published(amqp_url, command)
        assert await _held_by_a_scorer_that_dies(amqp_url, command) == 0
        async with scorer(amqp_url, make_deps("scorer-a")):
            first = await sent.next_of(command.task_id, attempt=1)
            copy = await sent.next_of(command.task_id, attempt=1)

    assert EARLIER_DELIVERIES_HEADER not in first.headers  # as published
    assert copy.command.not_before == command.not_before
    assert copy.headers.get(EARLIER_DELIVERIES_HEADER) == 1
    assert DELIVERY_COUNT_HEADER not in copy.headers


async def _dead_letters_of(amqp_url: str, command: ScoreText) -> list[Message]:
    """The command's dead letters, taken off the score queue's DLQ (others left there)."""
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel()
        dlq = await channel.get_queue(SCORE_REQUESTS.dead_letter_routing_key, ensure=True)

        async def found() -> list[Message] | None:
            ours = []
            while (message := await dlq.get(no_ack=False, fail=False, timeout=5)) is not None:
                if message.correlation_id == command.task_id:
                    await message.ack()
                    ours.append(message)
            return ours or None

        return await eventually(found, what=f"{command.task_id} in the DLQ")
