"""A scorer process dies with `kill -9` while it holds tasks.

A claim's lease is LLM_TIMEOUT_S * 2 + LEASE_MARGIN_S (11 s here): a model call that was in
flight when its process died may be made once more after that, never more.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Iterable
from typing import Any

import pytest
from pymongo import AsyncMongoClient

from shared.topology import ERROR_HEADER, SCORE_REQUESTS
from tests.faults.harness import (
    BoxParts,
    Figures,
    Outcome,
    Scorebox,
    dead_letters,
    essay,
    new_marker,
    running_scorebox,
)
from tests.support import eventually

TASKS = 40
CONCURRENCY = 8
LLM_TIMEOUT_S = 5  # above the slowed model's latency, with room for a loaded machine
LEASE_MARGIN_S = 1
LEASE_S = LLM_TIMEOUT_S * 2 + LEASE_MARGIN_S
LATENCY_MS = 1500
WAIT_S = 120.0


@pytest.fixture(scope="module")
async def box(box_parts: BoxParts) -> AsyncIterator[Scorebox]:
    env = {
        "SCORER_CONCURRENCY": str(CONCURRENCY),
        "LLM_TIMEOUT_S": str(LLM_TIMEOUT_S),
        "LEASE_MARGIN_S": str(LEASE_MARGIN_S),
    }
    async with running_scorebox(box_parts, env=env) as running:
        yield running


def _unanswered(stats: dict[str, Any]) -> int:
    """Calls that ended without an answer (their client went away)."""
    answered: int = sum(stats["status_counts"].values())
    return int(stats["calls"]) - answered - int(stats["in_flight"])


async def _claims_left_running(box: Scorebox, task_ids: Iterable[str]) -> set[str]:
    """Tasks whose claim the killed scorer left `running`: their result was never recorded,
    so their model call is made again once the lease expires."""
    config = box.stack.config
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(config.mongo_url, timeoutMS=10_000)
    try:
        attempts = client[f"{config.db_prefix}_scorer"]["attempts"]
        running = attempts.find({"_id": {"$in": list(task_ids)}, "state": "running"}, {"_id": 1})
        return {str(document["_id"]) async for document in running}
    finally:
        await client.close()


def _called_at_least(marker: str, times: int, stats: dict[str, Any]) -> bool:
    """Stats predicate: the fake LLM was called for `marker` at least `times` times."""
    return bool(stats["by_id"].get(marker, 0) >= times)


async def test_killed_scorer_tasks_are_redelivered_and_scored_once(
    box: Scorebox, figures: Figures, labels: tuple[str, str]
) -> None:
    box.answers.clear()
    box.llm.config.latency_ms = LATENCY_MS
    try:
        markers = [new_marker() for _ in range(TASKS)]
        task_ids = {await box.submit(essay(m)): m for m in markers}
        before = box.llm.stats()
        async with asyncio.timeout(WAIT_S):
            await box.llm.wait_for_stats(lambda s: s["in_flight"] >= CONCURRENCY // 2)

        await box.kill("scorer")
        async with asyncio.timeout(WAIT_S):  # the killed calls' connections are gone
            after_kill = await box.llm.wait_for_stats(lambda s: s["in_flight"] == 0)
        killed_in_flight = _unanswered(after_kill) - _unanswered(before)
        touched = {m for m in markers if after_kill["by_id"].get(m, 0) > 0}
        left_running = await _claims_left_running(box, task_ids)
        recovered_in = await box.restart("scorer")

        views = await box.finish(task_ids)
    finally:
        box.llm.config.latency_ms = 0

    # Model calls beyond one per attempt (a timeout's retry is an attempt, not a duplicate).
    attempts = {m: views[t]["attempts"] for t, m in task_ids.items()}
    extra = {m: box.calls(m) - attempts[m] for m in markers}
    repeated = {m: n for m, n in extra.items() if n > 0}
    statuses = [v["status"] for v in views.values()]
    figures.record(
        Outcome(
            name="scorer killed (kill -9) holding tasks",
            accepted=len(task_ids),
            completed=statuses.count("completed"),
            failed=statuses.count("failed"),
            duplicate_model_calls=sum(repeated.values()),
            http_5xx_seen=box.http_5xx(),
            time_to_recover_s=round(recovered_in, 2),
            broker=labels[0],
            database=labels[1],
            notes=f"{killed_in_flight} model calls in flight at the kill, "
            f"{len(left_running)} tasks' results unrecorded (claims left running: the only "
            f"ones called again); claim lease {LEASE_S} s; time to recover = restart until ready",
        )
    )
    assert killed_in_flight >= 1, "the kill hit no model call in flight"
    assert statuses == ["completed"] * TASKS, views
    # Not started before the kill: one call per attempt; in flight at the kill: one more.
    assert all(extra[m] == 0 for m in markers if m not in touched), extra
    assert all(0 <= extra[m] <= 1 for m in touched), extra
    # Repeated: only tasks whose result the kill kept from being recorded. That is more than
    # the calls cut off at the kill when an answer arrived just before it.
    task_of = {m: t for t, m in task_ids.items()}
    assert {task_of[m] for m in repeated} <= left_running, (repeated, left_running)
    assert box.http_5xx() == {"500": 0, "503": 0}


CRASH_LOOP_OTHERS = 4
LIMIT = SCORE_REQUESTS.delivery_limit


async def _first(*waits: Awaitable[object]) -> int:
    """Index of the first of `waits` to finish; the others are cancelled."""
    tasks = [asyncio.ensure_future(wait) for wait in waits]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()  # raise what it raised
        return next(i for i, task in enumerate(tasks) if task in done)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.slow
async def test_message_that_kills_the_scorer_every_time_stops_at_the_delivery_limit(
    box: Scorebox, figures: Figures, labels: tuple[str, str]
) -> None:
    """No production hook crashes the scorer on a message, so the test plays the crash: each
    time the poison task's model call starts (it hangs), the scorer process is killed."""
    box.answers.clear()
    # Tasks scored before the poison arrives, so none of them is in flight at a kill (a call in
    # flight at a kill is legitimately made again once its lease expires: not what this tests).
    before = {
        await box.submit(essay(m)): m for m in (new_marker() for _ in range(CRASH_LOOP_OTHERS))
    }
    await box.finish(list(before))
    poison = new_marker()
    poison_task = await box.submit(essay(poison, "[[fake:hang]]"))

    async def poison_failed() -> bool:
        view = await box.view(poison_task)
        return view is not None and view["status"] == "failed"

    kills = 0
    while True:
        deliveries = kills + 1
        called = box.llm.wait_for_stats(functools.partial(_called_at_least, poison, deliveries))
        async with asyncio.timeout(WAIT_S):
            first = await _first(called, eventually(poison_failed, timeout_s=WAIT_S))
        if first == 1:
            break
        await box.kill("scorer")
        kills += 1
        await box.restart("scorer")
        assert kills <= LIMIT, f"the poison message is looping: {kills} kills\n{box.logs()}"

    # The scorer that survived the loop scores new work normally.
    after = {
        await box.submit(essay(m)): m for m in (new_marker() for _ in range(CRASH_LOOP_OTHERS))
    }
    others = {**before, **after}
    views = await box.finish([poison_task, *others])
    poisoned = views[poison_task]
    assert poisoned["error"]["dead_lettered"] is True, poisoned
    assert f"delivery limit {LIMIT}" in poisoned["error"]["message"], poisoned
    assert kills == LIMIT
    assert box.calls(poison) == LIMIT  # one (crashed) model call per delivery, none after
    dead = [d for d in await dead_letters(box.amqp_url) if poison_task.encode() in d.body]
    assert len(dead) == 1
    assert f"delivery limit {LIMIT}" in str(dead[0].headers[ERROR_HEADER])
    assert [views[t]["status"] for t in others] == ["completed"] * len(others)
    assert all(box.calls(m) == 1 for m in others.values())
    assert await box.ready("scorer") == 200
    statuses = [v["status"] for v in views.values()]
    figures.record(
        Outcome(
            name="message that kills the scorer every time",
            accepted=len(views),
            completed=statuses.count("completed"),
            failed=statuses.count("failed"),
            duplicate_model_calls=box.calls(poison) - 1,
            http_5xx_seen=box.http_5xx(),
            time_to_recover_s=None,
            broker=labels[0],
            database=labels[1],
            notes=f"scorer killed {kills} times on the poison (each model call hung); "
            f"dead-lettered and failed at the delivery limit ({LIMIT}); repeated calls = "
            "the crashed deliveries",
        )
    )
