"""MongoDB turns slow: every reply is held back past the services' timeout, then it recovers.

The services reach the database through `SlowLink`, a TCP proxy of this test's own, so the
server still applies each write it receives while its reply arrives too late. The slow
submissions skip the result cache, so their first statement is their insert: a submission
answered 503 is recorded after all, and must be written off by the gateway, never sent by the
outbox sweep (`services/gateway/refusals.py`). Every 202 must end in a result, no request may
fail with 500, and, the slowness being shorter than a claim's lease, no model call may be
repeated: the scorer keeps trying to record a decision while its claim holds.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pymongo import AsyncMongoClient

from devtools.infra import Endpoint
from shared.http import PROBLEM_JSON
from tests.faults.harness import (
    BoxParts,
    Figures,
    Outcome,
    Scorebox,
    essay,
    new_marker,
    repeated_calls,
    running_scorebox,
)
from tests.faults.slow_link import SlowLink
from tests.support import eventually

MONGO_TIMEOUT_S = 1
LLM_TIMEOUT_S = 30
REPLY_DELAY_S = 2.5  # past MONGO_TIMEOUT_S: every database call of the services times out
SLOW_SUBMISSIONS = 8
IN_FLIGHT = 4
MODEL_LATENCY_MS = 1500
OUTBOX_GRACE_S = 2
WAIT_S = 120.0

Document = dict[str, Any]


@pytest.fixture(scope="module")
async def box(box_parts: BoxParts, link: SlowLink) -> AsyncIterator[Scorebox]:
    env = {
        # A claim's lease (twice this, plus a margin) outlasts the slowness: the scorer keeps
        # trying to record a decision while its claim holds, so no model call is repeated.
        "LLM_TIMEOUT_S": str(LLM_TIMEOUT_S),
        "MONGO_TIMEOUT_S": str(MONGO_TIMEOUT_S),
        "OUTBOX_GRACE_S": str(OUTBOX_GRACE_S),
        "OUTBOX_INTERVAL_S": "1",
    }
    async with running_scorebox(box_parts, mongo_url=link.mongo_url, env=env) as running:
        yield running


async def test_slow_database_answers_503_and_loses_nothing(
    box: Scorebox,
    link: SlowLink,
    mongo: Endpoint,
    db_prefix: str,
    figures: Figures,
    labels: tuple[str, str],
) -> None:
    box.answers.clear()
    before = [new_marker() for _ in range(3)]
    accepted = {await box.submit(essay(m)): m for m in before}
    await box.finish(accepted)

    # Tasks being scored when it turns slow: their decisions are written late.
    calls = box.calls_in_flight(IN_FLIGHT, latency_ms=MODEL_LATENCY_MS, timeout_s=WAIT_S)
    async with calls as (in_flight, calls_in_flight):
        link.reply_delay_s = REPLY_DELAY_S
        try:
            slow = [new_marker() for _ in range(SLOW_SUBMISSIONS)]
            answered = {m: await _answer(box, m) for m in slow}
        finally:
            link.reply_delay_s = 0
    accepted |= in_flight
    lifted_at = time.monotonic()
    refused = [m for m, (task_id, _) in answered.items() if task_id is None]
    accepted |= {task_id: m for m, (task_id, _) in answered.items() if task_id is not None}
    slowest_answer_s = max(seconds for _, seconds in answered.values())

    after = [new_marker() for _ in range(3)]
    first = await eventually(
        functools.partial(_accepted, box, after[0]),
        timeout_s=WAIT_S,
        what="a 202 once MongoDB answers in time again",
    )
    time_to_recover = time.monotonic() - lifted_at
    accepted[first] = after[0]
    accepted |= {await box.submit(essay(m)): m for m in after[1:]}
    await box.all_ready(timeout_s=WAIT_S)

    views = await box.finish(accepted)
    # A refused submission whose record reached the database all the same is written off:
    # once none is left unsent, none of them may have been sent (and kept its text).
    gateway_db = f"{db_prefix}_gateway"
    await eventually(
        functools.partial(_outbox_empty, mongo.url, gateway_db), timeout_s=WAIT_S, what="outbox"
    )
    scored_anyway = await _tasks_of(mongo.url, gateway_db, refused)
    written_off = await _abandoned(mongo.url, gateway_db)
    extra = box.calls_beyond_attempts(accepted, views)
    statuses = [views[t]["status"] for t in accepted]
    figures.record(
        Outcome(
            name="MongoDB slow (replies held past the timeout)",
            accepted=len(accepted),
            completed=statuses.count("completed"),
            failed=statuses.count("failed"),
            duplicate_model_calls=repeated_calls(extra),
            http_5xx_seen=box.http_5xx(),
            time_to_recover_s=round(time_to_recover, 2),
            broker=labels[0],
            database=labels[1],
            notes=f"every reply held {REPLY_DELAY_S} s by a TCP proxy (MONGO_TIMEOUT_S="
            f"{MONGO_TIMEOUT_S}) while {IN_FLIGHT} tasks were being scored ({calls_in_flight} "
            f"model calls in flight, model slowed to {MODEL_LATENCY_MS} ms) and during "
            f"{SLOW_SUBMISSIONS} submissions: "
            f"{SLOW_SUBMISSIONS - len(refused)} answered 202, {len(refused)} 503 problem+json, "
            f"the slowest answer in {slowest_answer_s:.1f} s; {written_off} of the 503s were "
            "recorded after the gateway gave up on them and written off once the database "
            f"answered in time again; {len(scored_anyway)} of them sent by the outbox sweep",
        )
    )
    assert refused, "the slow database refused nothing: the fault did not bite"
    assert written_off, "no refused submission was recorded late: the insert was not held"
    assert scored_anyway == {}, scored_anyway
    assert [box.calls(marker) for marker in refused] == [0] * len(refused)
    assert statuses == ["completed"] * len(accepted), views
    # Decisions the slowness kept from being written were written once it passed, within
    # their claims' leases: no task was called again.
    assert all(n == 0 for n in extra.values()), extra
    assert box.answers[500] == 0, box.answers


async def _answer(box: Scorebox, marker: str) -> tuple[str | None, float]:
    """Submit during the slowness: the task id of a 202 or None for a 503, and how long the
    answer took."""
    started = time.monotonic()
    response = await box.post(essay(marker), use_cache=False)
    seconds = time.monotonic() - started
    if response.status_code == 202:
        task_id: str = response.json()["task_id"]
        return task_id, seconds
    assert response.status_code == 503, response.text
    assert response.headers["content-type"].startswith(PROBLEM_JSON), response.headers
    assert response.headers.get("retry-after"), response.headers
    return None, seconds


async def _accepted(box: Scorebox, marker: str) -> str | None:
    task_id, _ = await _answer(box, marker)
    return task_id


@contextlib.asynccontextmanager
async def _submissions(url: str, database: str) -> AsyncIterator[Any]:
    client: AsyncMongoClient[Document] = AsyncMongoClient(url, timeoutMS=10_000)
    try:
        yield client[database]["submissions"]
    finally:
        await client.close()


async def _outbox_empty(url: str, database: str) -> bool:
    async with _submissions(url, database) as submissions:
        unsent = {"state": {"$in": ["accepting", "unconfirmed"]}}
        left: int = await submissions.count_documents(unsent)
        return left == 0


async def _abandoned(url: str, database: str) -> int:
    async with _submissions(url, database) as submissions:
        count: int = await submissions.count_documents({"state": "abandoned"})
        return count


async def _tasks_of(url: str, database: str, markers: list[str]) -> dict[str, str]:
    """The tasks recorded for submissions that were answered 503: task id → marker."""
    found: dict[str, str] = {}
    async with _submissions(url, database) as submissions:
        for marker in markers:
            async for document in submissions.find({"command.text": {"$regex": marker}}):
                found[str(document["_id"])] = marker
    return found
