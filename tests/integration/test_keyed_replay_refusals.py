"""A submission refused with 503 says "nothing was kept"; a replay of an Idempotency-Key
whose first request was accepted is told that request goes on instead: "nothing was kept"
told a client whose first request had been accepted that it was lost, and one resubmitting
without the key had its text scored twice (a review). Real broker; the database reached
through a proxy that cuts it."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import httpx
import pytest

from devtools.infra import Endpoint
from services.gateway.keys import generate_key
from tests.faults.slow_link import SlowLink
from tests.integration.in_process import gateway_and_status
from tests.support import queued_commands

pytestmark = pytest.mark.integration

API_KEY = generate_key().token
KEYED = (
    "nothing of this request was kept, and a request accepted earlier under its "
    "Idempotency-Key is unaffected. Retry shortly with the same Idempotency-Key."
)


@pytest.fixture
async def api(
    amqp_url: str, mongo: Endpoint, database_link: SlowLink, db_prefix: str
) -> AsyncIterator[httpx.AsyncClient]:
    env = {
        "RABBITMQ_URL": amqp_url,
        "MONGO_URL": database_link.url_through(mongo.url),
        "MONGO_DB_PREFIX": db_prefix,
        "MONGO_TIMEOUT_S": "1",
        "BOOTSTRAP_API_KEY": API_KEY,
        "RATE_LIMIT_PER_MIN": "0",
    }
    async with gateway_and_status(env, api_key=API_KEY) as services:
        yield services.api
    database_link.down = False


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/scores", {"text": "An essay.", "use_cache": False}),
        ("/v1/batches", {"items": [{"text": "An essay."}]}),
    ],
)
async def test_a_replay_refused_with_the_database_away_is_told_its_first_request_goes_on(
    api: httpx.AsyncClient,
    database_link: SlowLink,
    amqp_url: str,
    route: str,
    body: dict[str, object],
) -> None:
    key = {"Idempotency-Key": f"replay-{uuid.uuid4().hex}"}
    first = await api.post(route, json=body, headers=key)
    assert first.status_code == 202, first.text

    await database_link.cut()  # the caller's key stays cached: the replay reaches the route
    replay = await api.post(route, json=body, headers=key)
    unkeyed = await api.post(route, json=body)

    assert replay.status_code == 503, replay.text
    assert replay.json()["detail"].endswith(KEYED), replay.json()
    assert unkeyed.status_code == 503, unkeyed.text
    assert unkeyed.json()["detail"].endswith("; nothing was kept. Retry shortly.")
    assert len(await queued_commands(amqp_url)) == 1  # the first request's one command
