"""`services.gateway.cache.ResultCache` against MongoDB (or the labelled stand-in): entries
answer until they expire, whether or not the TTL monitor has removed them yet, and with a
rubric version configured only results scored under it answer."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pymongo import AsyncMongoClient

from devtools.infra import Endpoint
from services.gateway.cache import ResultCache
from shared.contracts import ScoreResult

pytestmark = pytest.mark.integration

NOW = datetime(2030, 1, 1, tzinfo=UTC)
TTL = timedelta(hours=1)
RESULT = ScoreResult(score=7.5, comment="fine", model="m")


@pytest.fixture
async def database(mongo: Endpoint) -> AsyncIterator[tuple[AsyncMongoClient[dict[str, Any]], str]]:
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
        mongo.url, tz_aware=True, serverSelectionTimeoutMS=10_000
    )
    name = f"result_cache_{uuid.uuid4().hex[:8]}"
    try:
        yield client, name
    finally:
        await client.drop_database(name)
        await client.close()


@pytest.fixture
def cache(database: tuple[AsyncMongoClient[dict[str, Any]], str]) -> ResultCache:
    return ResultCache(*database, TTL)


async def test_an_entry_answers_until_it_expires(cache: ResultCache) -> None:
    await cache.remember(tenant_id="t", key="k", result=RESULT, task_id="task", now=NOW)

    assert await cache.find(tenant_id="t", key="k", now=NOW + TTL - timedelta(seconds=1)) == RESULT
    assert await cache.find(tenant_id="t", key="k", now=NOW + TTL) is None
    assert await cache.find(tenant_id="other", key="k", now=NOW) is None


async def test_concurrent_lookups_each_get_their_own_entry(cache: ResultCache) -> None:
    results = [RESULT.model_copy(update={"score": float(i)}) for i in range(5)]
    for i, result in enumerate(results):
        await cache.remember(tenant_id="t", key=f"k{i}", result=result, task_id=f"{i}", now=NOW)

    found = await asyncio.gather(
        *(cache.find(tenant_id="t", key=f"k{i}", now=NOW) for i in range(6))
    )

    assert found == [*results, None]


async def test_with_a_rubric_version_only_its_results_answer(
    database: tuple[AsyncMongoClient[dict[str, Any]], str],
) -> None:
    earlier = RESULT.model_copy(update={"prompt_version": "rubric-1"})
    current = RESULT.model_copy(update={"score": 3.0, "prompt_version": "rubric-2"})
    unversioned = ResultCache(*database, TTL)  # as a gateway without RUBRIC_VERSION keeps it
    versioned = ResultCache(*database, TTL, prompt_versions={"rubric-2"})
    await unversioned.remember(tenant_id="t", key="old", result=earlier, task_id="1", now=NOW)

    assert await versioned.find(tenant_id="t", key="old", now=NOW) is None

    await versioned.remember(tenant_id="t", key="late", result=earlier, task_id="2", now=NOW)
    await versioned.remember(tenant_id="t", key="new", result=current, task_id="3", now=NOW)

    assert await unversioned.find(tenant_id="t", key="late", now=NOW) is None  # not kept
    assert await versioned.find(tenant_id="t", key="new", now=NOW) == current
