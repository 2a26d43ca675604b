"""A scorer stopped while a model call is in flight (a deploy, a scale-down) lets the call
finish and records its decision before it lets go of the model client and the database.

It waited `BROKER_TIMEOUT_S` for its deliveries in hand, less than a model call may take
(`LLM_TIMEOUT_S`), then closed the model client under the call still running: the attempt was
recorded as a retry of an unavailable model (a task failed for good on its last attempt), or
not recorded at all, and the task scored again after its lease. In process, on the real
broker and database, with the fake model answering after 1.5 s."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from pymongo import AsyncMongoClient

from devtools.fake_llm import FakeLLM, FakeLLMConfig, start_fake_llm
from services.scorer.app import stop_grace_s
from services.scorer.settings import ScorerSettings
from shared.bus import publish_command
from shared.contracts import ScoreText, new_id, utcnow
from shared.runtime import make_broker
from tests.faults.slow_link import SlowLink
from tests.integration.in_process import scorer_over
from tests.support import running


async def test_a_model_call_in_flight_at_stop_finishes_and_is_recorded(
    amqp_url: str, mongo: Any, db_prefix: str
) -> None:
    llm = await start_fake_llm(FakeLLMConfig(latency_ms=1500))
    setup = scorer_over(
        llm,
        amqp_url=amqp_url,
        mongo_url=mongo.url,
        db_prefix=db_prefix,
        llm_timeout_s=5,
        BROKER_TIMEOUT_S="0.5",
    )
    settings = setup.settings
    marker = f"s{uuid.uuid4().hex[:12]}"
    command = ScoreText(task_id=new_id(), text=f"Stopped mid-call [[id:{marker}]].")
    scorer = setup.app()
    async with running(scorer):
        await _published_and_called(settings, command, llm, marker)
    # Stopped: the call was in flight.
    attempt = await _attempt_after(llm, mongo.url, settings, command)
    assert attempt["state"] == "decided", attempt
    assert attempt["decision"]["kind"] == "finish", attempt["decision"]
    assert attempt["decision"]["event"]["routing_key"] == "task.completed"


async def test_a_call_whose_delivery_was_lost_finishes_and_is_recorded_at_stop(
    amqp_url: str, mongo: Any, db_prefix: str, broker_link: SlowLink
) -> None:
    """The consumers' connection dropped mid-call: the handler is cancelled, its decision goes
    on (shielded) in no handler. A stop before the redelivery came back found no delivery in
    hand, closed the model client under the call, and recorded a retry of an unavailable
    model: the call billed, and made again (found in review)."""
    llm = await start_fake_llm(FakeLLMConfig(latency_ms=3000))
    setup = scorer_over(
        llm,
        amqp_url=broker_link.url_through(amqp_url),
        mongo_url=mongo.url,
        db_prefix=db_prefix,
        llm_timeout_s=10,
        BROKER_TIMEOUT_S="1",
    )
    settings = setup.settings
    marker = f"s{uuid.uuid4().hex[:12]}"
    command = ScoreText(task_id=new_id(), text=f"Lost, then stopped [[id:{marker}]].")
    direct = settings.model_copy(update={"rabbitmq_url": amqp_url})  # not through the link
    async with running(setup.app()):
        await _published_and_called(direct, command, llm, marker)
        await broker_link.cut()  # the handler is cancelled; the call goes on
    attempt = await _attempt_after(llm, mongo.url, settings, command)
    assert attempt["state"] == "decided", attempt
    assert attempt["decision"]["event"]["routing_key"] == "task.completed", attempt["decision"]
    assert llm.stats()["by_id"][marker] == 1


async def test_a_decision_held_up_by_the_database_shares_the_grace_with_the_broker(
    amqp_url: str,
    mongo: Any,
    db_prefix: str,
    database_link: SlowLink,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The database gone while a decision is recorded: the scorer waits for the decision up
    to the grace period, then stops the broker. The broker's stop counted a whole grace
    again for the delivery still in hand, so the stop took twice the grace, past what compose
    and `make run` give a scorer before SIGKILL (found in review)."""
    llm = await start_fake_llm(FakeLLMConfig(latency_ms=3000))
    setup = scorer_over(
        llm,
        amqp_url=amqp_url,
        mongo_url=database_link.url_through(mongo.url),
        db_prefix=db_prefix,
        llm_timeout_s=5,
        BROKER_TIMEOUT_S="0.5",
        MONGO_TIMEOUT_S="1",
        LEASE_MARGIN_S="30",  # the decision's retries last past the grace
    )
    grace_s = stop_grace_s(setup.settings, setup.model_settings)
    marker = f"s{uuid.uuid4().hex[:12]}"
    command = ScoreText(task_id=new_id(), text=f"Database gone, then stopped [[id:{marker}]].")
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(None) as guard:
            async with running(setup.app()):
                await _published_and_called(setup.settings, command, llm, marker)
                await database_link.cut()
                # A hang guard on the stop alone, between one grace and two.
                guard.reschedule(loop.time() + grace_s + 5)
    finally:
        await llm.stop()
    assert any("past the grace" in record.getMessage() for record in caplog.records)


async def _published_and_called(
    settings: ScorerSettings, command: ScoreText, llm: FakeLLM, marker: str
) -> None:
    """`command` published (with `settings`' broker URL), then its model call under way.
    The publisher is the test's, with a timeout of its own: with the scorer's 0.5 s, its
    connection timed out on a loaded CI host."""
    publisher = make_broker(settings.model_copy(update={"broker_timeout_s": 10.0}))
    async with publisher:
        await publisher.connect()
        await publish_command(publisher, command, now=utcnow(), timeout=10)
    await llm.wait_for_stats(lambda stats: stats["by_id"].get(marker, 0) >= 1)


async def _attempt_after(
    llm: FakeLLM, mongo_url: str, settings: ScorerSettings, command: ScoreText
) -> dict[str, Any]:
    """The attempt document the stopped scorer left for `command`; the fake model stopped."""
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo_url)
    try:
        attempt = await client[settings.database_name("scorer")]["attempts"].find_one(
            {"_id": command.task_id}
        )
    finally:
        await client.close()
        await llm.stop()
    assert attempt is not None
    return attempt
