"""A dead-letter walk holds at most its byte budget of letter bodies, on the real broker.

A walk held up to 10,000 letters whatever their size, and a score request carries its text
(up to 50,000 characters): one list, show or replay held up to about 2 GB in the gateway.
A walk now stops once the bodies it holds reach the budget (`MAX_WALK_BYTES`, lowered here)
and says that letters are left (`truncated`); what it held goes back to the queue. Bytes and
letters are counted, nothing is timed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import pytest
from fastapi import FastAPI
from faststream.rabbit import RabbitBroker
from pydantic import SecretStr
from pymongo import AsyncMongoClient

from devtools.infra import Endpoint
from services.gateway.admin_api import admin_routes
from services.gateway.deadletters import DeadLetterQueue
from services.gateway.publisher import TaskPublisher
from services.gateway.submissions import Submissions
from shared.contracts import ScoreText, new_id, utcnow
from shared.dead_letters import MAX_WALK_BYTES, DeadLetterWalker, WalkBusy
from shared.http import install_problem_handlers
from shared.topology import CRON_JOBS, SCORE_REQUESTS, WorkQueue, declare_topology
from tests.support import running

LETTERS = 5
TEXT_CHARS = 10_000
TIMEOUT_S = 5.0
ADMIN_KEY = "test-admin-key"


def _letter_body() -> bytes:
    command = ScoreText(task_id=new_id(), tenant_id="acme", text="x" * TEXT_CHARS)
    return command.model_dump_json().encode()


async def _dead_letter(amqp_url: str, work_queue: WorkQueue, bodies: list[bytes]) -> None:
    async with await aio_pika.connect(amqp_url) as connection:
        channel = await connection.channel()
        for body in bodies:
            await channel.default_exchange.publish(
                aio_pika.Message(body, message_id=new_id()),
                routing_key=work_queue.dead_letter_routing_key,
                timeout=TIMEOUT_S,
            )


@pytest.fixture(scope="module")
async def broker(amqp_url: str) -> AsyncIterator[RabbitBroker]:
    """The module's broker (a vhost of its own), the score requests' DLQ holding `LETTERS`
    letters of `TEXT_CHARS` characters each, and as many in the cron jobs' DLQ."""
    broker = RabbitBroker(amqp_url)
    await broker.connect()
    await declare_topology(broker)
    await _dead_letter(amqp_url, SCORE_REQUESTS, [_letter_body() for _ in range(LETTERS)])
    await _dead_letter(amqp_url, CRON_JOBS, [_letter_body() for _ in range(LETTERS)])
    yield broker
    await broker.stop()


@pytest.fixture
async def submissions(mongo: Endpoint, db_prefix: str) -> AsyncIterator[Submissions]:
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo.url, tz_aware=True)
    yield Submissions(client, f"{db_prefix}_gateway")
    await client.close()


def _dead_letters(
    broker: RabbitBroker, submissions: Submissions, *, walk_bytes: int
) -> DeadLetterQueue:
    return DeadLetterQueue(
        broker,
        TaskPublisher(broker, clock=utcnow, timeout_s=TIMEOUT_S),
        submissions,
        utcnow,
        timeout_s=TIMEOUT_S,
        walk_bytes=walk_bytes,
    )


async def test_a_walk_stops_at_its_byte_budget_and_gives_every_letter_back(
    broker: RabbitBroker,
) -> None:
    body_bytes = len(_letter_body())
    budget = int(2.5 * body_bytes)
    walker = DeadLetterWalker(broker, CRON_JOBS, timeout_s=TIMEOUT_S, max_bytes=budget)

    async with walker.walk() as held:
        assert (len(held), held.truncated) == (3, True)
        assert held.bytes_held == 3 * body_bytes < budget + body_bytes

    everything = DeadLetterWalker(broker, CRON_JOBS, timeout_s=TIMEOUT_S)
    async with everything.walk() as held:
        assert (len(held), held.truncated) == (LETTERS, False)


async def test_a_listing_past_the_byte_budget_says_letters_are_left(
    broker: RabbitBroker, submissions: Submissions
) -> None:
    budget = 2 * len(_letter_body())

    bounded = await _dead_letters(broker, submissions, walk_bytes=budget).letters()
    whole = await _dead_letters(broker, submissions, walk_bytes=MAX_WALK_BYTES).letters()

    assert (len(bounded.letters), bounded.truncated) == (2, True)
    assert (len(whole.letters), whole.truncated) == (LETTERS, False)


async def test_a_walk_with_a_deadline_takes_its_turn_and_its_letters_only_until_then(
    broker: RabbitBroker,
) -> None:
    """A replay's budget did not bound its walk: its wait for another walk's turn and the
    taking of every letter came on top of it, so a second replay on a replica answered past
    the CLI's timeout. A walk given a deadline waits for its turn only until then
    (`WalkBusy`), and takes no letter past it but the first."""
    loop = asyncio.get_running_loop()
    walker = DeadLetterWalker(broker, CRON_JOBS, timeout_s=TIMEOUT_S)

    async with walker.walk(deadline=loop.time()) as held:
        assert (len(held), held.truncated, held.timed_out) == (1, False, True)
        with pytest.raises(WalkBusy):
            async with walker.walk(deadline=loop.time() + 0.1):
                pass

    async with walker.walk() as held:  # every letter given back; the turn free again
        assert (len(held), held.truncated, held.timed_out) == (LETTERS, False, False)


async def test_a_walk_without_a_deadline_takes_letters_only_for_its_budget(
    broker: RabbitBroker,
) -> None:
    """A listing, a show or a drop took every letter, one round trip each: over a slow
    link it outlasted the CLI's 30 s, which gave up while the drop went on and was
    applied (a walkthrough). Every walk now stops at the walker's budget, letters left."""
    walker = DeadLetterWalker(broker, CRON_JOBS, timeout_s=TIMEOUT_S, budget_s=0.0)

    async with walker.walk() as held:
        assert (len(held), held.timed_out, held.stopped_short) == (1, True, True)

    dropped = await walker.drop(lambda _: False)
    assert (dropped.walked, dropped.truncated) == (1, True)
    async with DeadLetterWalker(broker, CRON_JOBS, timeout_s=TIMEOUT_S).walk() as held:
        assert (len(held), held.stopped_short) == (LETTERS, False)  # every letter kept


async def test_a_walk_without_a_deadline_waits_for_its_turn_only_for_its_budget(
    broker: RabbitBroker,
) -> None:
    """A listing, a show or a drop waited for its turn without end: behind a replay it
    outlasted the CLI's 30 s, and the drop was applied after the CLI gave up (the re-read
    of that change). It waits its budget, then answers 503 `dead-letters-busy`."""
    loop = asyncio.get_running_loop()
    holder = DeadLetterWalker(broker, CRON_JOBS, timeout_s=TIMEOUT_S)
    walker = DeadLetterWalker(broker, CRON_JOBS, timeout_s=TIMEOUT_S, budget_s=0.1)
    walker._walking = holder._walking  # one replica's walker: one turn at a time

    async with holder.walk(deadline=loop.time() + 60):
        with pytest.raises(WalkBusy) as busy:
            async with asyncio.timeout(30), walker.walk():  # the timeout: no hang if broken
                pass
    assert (busy.value.status, busy.value.kind) == (503, "dead-letters-busy")
    assert busy.value.headers == {"Retry-After": "5"}


async def test_a_replay_that_cannot_take_its_turn_in_time_is_a_503(
    broker: RabbitBroker, submissions: Submissions
) -> None:
    dead_letters = _dead_letters(broker, submissions, walk_bytes=MAX_WALK_BYTES)
    dead_letters._replay_budget_s = 0.1
    app = FastAPI()
    install_problem_handlers(app)
    app.include_router(admin_routes(dead_letters, SecretStr(ADMIN_KEY)))

    async with dead_letters._dlq.walk(), running(app) as api:  # a look holds every letter
        api.headers["Authorization"] = f"Bearer {ADMIN_KEY}"
        answer = await api.post("/admin/v1/dead-letters/replay", json={"all": True})

    assert answer.status_code == 503, answer.text
    assert answer.headers["Retry-After"] == "5"
    assert answer.json()["type"].endswith("/dead-letters-busy")
    async with dead_letters._dlq.walk() as held:
        assert len(held) == LETTERS  # nothing replayed
