"""`services.gateway.cache.ResultCache` against MongoDB (or the labelled stand-in): entries
answer until they expire, whether or not the TTL monitor has removed them yet."""

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
async def cache(mongo: Endpoint) -> AsyncIterator[ResultCache]:
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
        mongo.url, tz_aware=True, serverSelectionTimeoutMS=10_000
    )
    name = f"result_cache_{uuid.uuid4().hex[:8]}"
    try:
        yield ResultCache(client, name, TTL)
    finally:
        await client.drop_database(name)
        await client.close()


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
