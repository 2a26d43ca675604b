"""A delivery at the score queue's delivery limit is never held while another replica's claim
lasts: it is handed back as a copy carrying its count, due when that claim's lease ends.

It used to be held, unacknowledged, until the claim was decided or its lease ended (90 s by
default). Its consumer's connection dropped meanwhile: RabbitMQ counted the return as one
more delivery and dead-lettered the message by its own count (no reason, no give-up, no
`task.failed`); the other replica's decision then landed in the attempts store and no
delivery was left to carry it out. The task stayed `running`, its tenant's slot held (found
in review). Here on the real broker, the connection dropped through a proxy, and the
database; the other replica scores with the fake model.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

import aio_pika
import httpx
import pytest
from pymongo import AsyncMongoClient

from devtools.fake_llm import FakeLLM
from services.scorer.app import create_app, stop_grace_s
from services.scorer.attempts import Attempts, Claimed
from services.scorer.decisions import Finish
from services.scorer.scoring import score_text
from services.scorer.settings import ScorerSettings
from shared.bus import publish_command
from shared.consumers import ScoreboxBroker
from shared.contracts import ScoreText, TaskCompleted, TaskFailed, new_id, utcnow
from shared.runtime import make_broker
from shared.topology import SCORE_REQUESTS, declare_topology
from tests.faults.slow_link import SlowLink
from tests.integration.in_process import scorer_over
from tests.integration.scorer_parts import fake_model, scorer_deps
from tests.integration.test_scorer_usage_across_retries import outcomes
from tests.support import eventually, metric_sum, running

pytestmark = pytest.mark.integration

# The other replica's claim: live when the scorer first looks (it starts meanwhile), short
# enough for the copy handed back to come back within the test.
OTHER_LEASE = timedelta(seconds=20)


async def test_a_delivery_at_the_limit_is_handed_back_and_the_other_decision_published(
    fake_llm: FakeLLM, mongo: Any, db_prefix: str, amqp_url: str, broker_link: SlowLink
) -> None:
    setup = scorer_over(
        fake_llm,
        amqp_url=broker_link.url_through(amqp_url),
        mongo_url=mongo.url,
        db_prefix=db_prefix,
    )
    settings = setup.settings
    marker = f"h{uuid.uuid4().hex[:12]}"
    command = ScoreText(task_id=new_id(), text=f"At its limit, scored elsewhere. [[id:{marker}]]")
    await _published(settings.model_copy(update={"rabbitmq_url": amqp_url}), command)
    await _returned_unsettled(amqp_url, times=SCORE_REQUESTS.delivery_limit)

    async with _attempts(mongo.url, settings) as attempts, outcomes(amqp_url) as published:
        claim = await attempts.claim(command, now=utcnow(), lease=OTHER_LEASE, owner="scorer-b")
        assert isinstance(claim, Claimed)  # the other replica's model call is under way
        broker = make_broker(
            settings,
            prefetch=settings.deliveries_in_hand,
            name="scorer",
            graceful_timeout_s=stop_grace_s(settings, setup.model_settings),
        )
        async with running(create_app(settings, setup.model_settings, broker=broker)) as http:
            await eventually(
                lambda: _handed_back(http, broker),
                what="the delivery at the limit handed back, not held",
            )
            await broker_link.cut()  # the consumers' connection drops
            broker_link.down = False
            decided = await _decided_by_the_other_replica(command, attempts, fake_llm)
            completed = await published.next_of(command.task_id, TaskCompleted)
        letters = await _dead_letters(amqp_url)

    assert isinstance(decided, Finish)
    assert completed == decided.event
    assert published.of(command.task_id, TaskFailed) == []
    assert letters == 0
    assert int(fake_llm.stats()["by_id"][marker]) == 1  # the other replica's call alone


async def _published(settings: ScorerSettings, command: ScoreText) -> None:
    publisher = make_broker(settings)
    async with publisher:
        await publisher.connect()
        await declare_topology(publisher)
        await publish_command(publisher, command, now=utcnow(), timeout=10)


async def _returned_unsettled(amqp_url: str, *, times: int) -> None:
    """Take the head of the score queue and drop the connection holding it, `times` times:
    each return is counted, as for a consumer that died holding it."""
    for _ in range(times):
        connection = await aio_pika.connect(amqp_url, timeout=10)
        async with connection:
            channel = await connection.channel()
            queue = await channel.get_queue(SCORE_REQUESTS.name, ensure=False)

            async def taken(queue: aio_pika.abc.AbstractQueue = queue) -> object:
                return await queue.get(no_ack=False, fail=False, timeout=5)

            await eventually(taken, what="the command back in the score queue")


@asynccontextmanager
async def _attempts(mongo_url: str, settings: ScorerSettings) -> AsyncIterator[Attempts]:
    """The scorer's attempts store, as another replica writes to it."""
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo_url, tz_aware=True)
    try:
        store = Attempts(client, settings.database_name("scorer"), retention=timedelta(hours=1))
        await store.ensure_indexes()
        yield store
    finally:
        await client.close()


async def _handed_back(http: httpx.AsyncClient, broker: ScoreboxBroker) -> bool:
    """Whether the scorer sent the delivery again and settled it (its handler is done)."""
    exposition = (await http.get("/metrics")).text
    resent = metric_sum(exposition, "scorebox_scorer_decisions_total", decision="resent")
    return resent >= 1 and broker.in_handlers(SCORE_REQUESTS.name) == 0


async def _decided_by_the_other_replica(
    command: ScoreText, attempts: Attempts, fake_llm: FakeLLM
) -> object:
    """The other replica's model call ends and its decision is recorded under its claim."""
    async with fake_model(fake_llm) as model:
        deps = scorer_deps(attempts=attempts, model=model, owner="scorer-b", lease=OTHER_LEASE)
        return await score_text(command, deps=deps)


async def _dead_letters(amqp_url: str) -> int:
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel()
        dlq = await channel.declare_queue(SCORE_REQUESTS.dead_letter_routing_key, passive=True)
        return int(dlq.declaration_result.message_count or 0)
