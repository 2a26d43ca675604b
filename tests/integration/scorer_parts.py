"""The parts `score_text` runs on in the scorer's integration tests: the model over the fake
model server's HTTP, the attempts store on the test database, and `ScorerDeps` with test
defaults (each test names what it sets apart)."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

from pymongo import AsyncMongoClient

from devtools.fake_llm import FakeLLM
from services.scorer.attempts import Attempts
from services.scorer.model import ScoreModel, build_model
from services.scorer.model.http_client import make_http_client
from services.scorer.model.settings import ModelSettings
from services.scorer.scoring import RetryPolicy, ScorerDeps
from services.scorer.slots import ModelSlots
from shared.contracts import TaskEvent, utcnow


@asynccontextmanager
async def fake_model(fake_llm: FakeLLM, *, timeout_s: float = 5) -> AsyncIterator[ScoreModel]:
    settings = ModelSettings.model_validate(
        {
            "LLM_PROVIDER": "openai",
            "LLM_BASE_URL": fake_llm.url,
            "LLM_API_KEY": "test-key",
            "LLM_MODEL": "fake-judge-1",
            "LLM_TIMEOUT_S": str(timeout_s),
        }
    )
    http = make_http_client(settings, concurrency=4)
    try:
        yield build_model(settings, http)
    finally:
        await http.aclose()


@asynccontextmanager
async def attempts_store(mongo_url: str, db_prefix: str) -> AsyncIterator[Attempts]:
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo_url, tz_aware=True)
    try:
        store = Attempts(client, f"{db_prefix}_scorer", retention=timedelta(hours=1))
        await store.ensure_indexes()
        yield store
    finally:
        await client.close()


async def announce_nothing(_: TaskEvent) -> None:
    return None


def scorer_deps(*, attempts: Attempts, model: ScoreModel, **overrides: Any) -> ScorerDeps:
    fields: dict[str, Any] = {
        "attempts": attempts,
        "model": model,
        "announce": announce_nothing,
        "clock": utcnow,
        "lease": timedelta(seconds=30),
        "retry_policy": RetryPolicy(base_s=1, cap_s=2),
        "rng": random.Random(0),
        "owner": "test",
        "model_slots": ModelSlots(4),
    }
    return ScorerDeps(**(fields | overrides))
