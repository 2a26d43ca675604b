"""Request rate per key across replicas, slow bodies and chunked bodies, on the real broker and
database. The gateway's clock is frozen one second into a rate window, so windows roll over
only when a test moves the clock."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from pymongo import AsyncMongoClient

from devtools.infra import Endpoint
from services.gateway.admission import AdaptiveLimit
from services.gateway.app import create_app as create_gateway
from services.gateway.limits import LimitExceeded, RateLimiter, fixed_window, rate_counter_id
from services.gateway.settings import GatewaySettings
from services.status.app import create_app as create_status
from services.status.settings import StatusSettings
from shared.contracts import utcnow
from tests.support import CommandCounter, running, scratch_collection

ADMIN_KEY = "test-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
RATE = 5
MAX_BODY = 10_000
BODY_TIMEOUT_S = 0.5

Json = dict[str, Any]


class FrozenClock:
    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@dataclass
class Stack:
    api: httpx.AsyncClient
    status_app: FastAPI
    settings: GatewaySettings
    clock: FrozenClock
    mongo: AsyncMongoClient[Json]
    db_prefix: str
    admission: AdaptiveLimit

    async def auth(self, tenant_id: str | None = None) -> dict[str, str]:
        tenant_id = tenant_id or f"t-{uuid.uuid4().hex[:8]}"
        response = await self.api.post(
            "/admin/v1/keys", json={"tenant_id": tenant_id}, headers=ADMIN
        )
        assert response.status_code == 201, response.text
        return {"Authorization": f"Bearer {response.json()['key']}"}

    async def stored(self, query: Json | None = None) -> int:
        collection = self.mongo[f"{self.db_prefix}_gateway"]["submissions"]
        return await collection.count_documents(query or {})


@pytest.fixture(scope="module")
async def stack(amqp_url: str, mongo: Any, db_prefix: str) -> AsyncIterator[Stack]:
    env = {
        "RABBITMQ_URL": amqp_url,
        "MONGO_URL": mongo.url,
        "MONGO_DB_PREFIX": db_prefix,
        "ADMIN_API_KEY": ADMIN_KEY,
        "RATE_LIMIT_PER_MIN": str(RATE),
        "MAX_BODY_BYTES": str(MAX_BODY),
        "REQUEST_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S),
    }
    # A day ahead, so no TTL monitor removes the test's counters while it runs.
    clock = FrozenClock(fixed_window(utcnow() + timedelta(days=1), 60).start)
    clock.advance(1)
    settings = GatewaySettings.model_validate(env)
    status = create_status(StatusSettings.model_validate(env), clock=clock)
    gateway = create_gateway(settings, status_http=_status_http(status), clock=clock)
    async with running(status), running(gateway) as api:
        client: AsyncMongoClient[Json] = AsyncMongoClient(mongo.url, tz_aware=True)
        admission = gateway.state.submission_admission
        assert isinstance(admission, AdaptiveLimit)
        yield Stack(api, status, settings, clock, client, db_prefix, admission)
        await client.close()


def _status_http(status: FastAPI) -> httpx.AsyncClient:
    """A client of the in-process status app (each gateway closes its own)."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=status), base_url="http://status")


def _assert_problem(response: httpx.Response, status: int) -> Json:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body: Json = response.json()
    assert body["status"] == status
    assert body["detail"]
    return body


def _unknown() -> str:
    return f"/v1/scores/{uuid.uuid4().hex}"


# --------------------------------------------------------------------------- request rate


async def test_a_key_over_its_rate_gets_429_until_the_window_ends(stack: Stack) -> None:
    tenant = f"rate-{uuid.uuid4().hex[:8]}"
    key, same_tenant = await stack.auth(tenant), await stack.auth(tenant)
    for _ in range(RATE):
        assert (await stack.api.get(_unknown(), headers=key)).status_code == 404

    limited = await stack.api.get(_unknown(), headers=key)
    body = _assert_problem(limited, 429)
    assert body["limit"] == "rate"
    assert body["maximum"] == RATE
    assert limited.headers["retry-after"] == "59"  # the clock is 1 s into its window
    before = await stack.stored()
    refused = await stack.api.post("/v1/scores", json={"text": "too soon"}, headers=key)
    assert _assert_problem(refused, 429)["limit"] == "rate"
    assert await stack.stored() == before

    # The limit is per key: the tenant's other key is not held back.
    assert (await stack.api.get(_unknown(), headers=same_tenant)).status_code == 404

    stack.clock.advance(60)
    assert (await stack.api.get(_unknown(), headers=key)).status_code == 404


@contextmanager
def _every_place_taken(admission: AdaptiveLimit) -> Iterator[None]:
    """Admission control with no place free, as in an overload, until the block ends."""
    taken = 0
    while admission.try_acquire():
        taken += 1
    try:
        yield
    finally:
        for _ in range(taken):
            admission.release(took_s=None)


async def test_submissions_shed_by_admission_do_not_count_in_the_rate_window(
    stack: Stack,
) -> None:
    """A client obeying the 503's `Retry-After: 1` through an overload spent its key's minute
    on refusals, each counted before its body was read, and met 429 once the gateway took
    submissions again."""
    key = await stack.auth()
    with _every_place_taken(stack.admission):
        for _ in range(RATE + 1):
            for path, body in (("/v1/scores", {"text": "shed"}), ("/v1/batches", _BATCH)):
                shed = await stack.api.post(path, json=body, headers=key)
                assert _assert_problem(shed, 503)["limit"] == "admission"

    accepted = await stack.api.post("/v1/scores", json={"text": "taken now"}, headers=key)
    assert accepted.status_code == 202, accepted.text
    batch = await stack.api.post("/v1/batches", json=_BATCH, headers=key)
    assert batch.status_code == 202, batch.text


@pytest.mark.parametrize("path", ["/v1/scores", "/v1/batches"])
async def test_a_submission_taken_in_and_refused_for_its_body_counts(
    stack: Stack, path: str
) -> None:
    """Counted once its body is in, not once it is found valid, and counted when its body is
    refused unread: such requests fill the window as any request does, and the submission
    after them is answered 429."""
    key = await stack.auth()
    refusals = [("text/plain", 415)] * (RATE - 1) + [("application/json", 400)]
    for content_type, status in refusals:
        refused = await stack.api.post(
            path, content=b"{not json", headers={**key, "Content-Type": content_type}
        )
        _assert_problem(refused, status)
    limited = await stack.api.post(path, json=_BATCH, headers=key)
    assert _assert_problem(limited, 429)["limit"] == "rate"


async def test_a_key_seen_over_its_rate_is_refused_before_its_body_is_read(
    stack: Stack,
) -> None:
    """A submission is counted once its body is in: a key past its limit had every body
    read, up to the body limit, before its 429 (a review). Once this replica has seen the
    key's window full, the 429 comes first."""
    key = await stack.auth()
    for _ in range(RATE):
        assert (await stack.api.get(_unknown(), headers=key)).status_code == 404
    assert (await stack.api.get(_unknown(), headers=key)).status_code == 429  # seen full
    pulled = 0

    async def body() -> AsyncIterator[bytes]:
        nonlocal pulled
        for _ in range(8):
            pulled += 1
            yield b" " * 1000

    refused = await stack.api.post(
        "/v1/scores", content=body(), headers={**key, "Content-Type": "application/json"}
    )
    assert _assert_problem(refused, 429)["limit"] == "rate"
    assert pulled <= 1  # the transport's first piece at most, never the body


_BATCH = {"items": [{"text": "a batch's one text"}]}


async def test_replicas_share_one_rate(stack: Stack) -> None:
    other = create_gateway(
        stack.settings, status_http=_status_http(stack.status_app), clock=stack.clock
    )
    async with running(other) as second:
        key = await stack.auth()
        replicas = [stack.api, second, stack.api, second, stack.api]
        for api in replicas:
            assert (await api.get(_unknown(), headers=key)).status_code == 404
        for api in (second, stack.api):
            assert _assert_problem(await api.get(_unknown(), headers=key), 429)["limit"] == "rate"


async def test_concurrent_requests_count_exactly_and_refused_ones_do_not_count(
    stack: Stack,
) -> None:
    """The repository itself: requests racing to open a window (grouped into one round trip)
    let exactly the limit through, and refused requests leave the counter at the limit."""
    limiter = RateLimiter(
        stack.mongo, f"{stack.db_prefix}_gateway", per_minute=RATE, clock=stack.clock
    )
    key_id = uuid.uuid4().hex[:16]

    outcomes = await asyncio.gather(
        *(limiter.hit(key_id) for _ in range(RATE * 4)), return_exceptions=True
    )

    assert outcomes.count(None) == RATE
    assert all(isinstance(o, LimitExceeded) for o in outcomes if o is not None), outcomes
    counters = stack.mongo[f"{stack.db_prefix}_gateway"]["rate_windows"]
    counter_id = rate_counter_id(key_id, fixed_window(stack.clock(), 60))
    assert (await counters.find_one({"_id": counter_id}) or {}).get("count") == RATE


async def test_a_full_window_refuses_from_memory_until_it_ends(mongo: Endpoint) -> None:
    """Once a key's window refused a request, the key's further requests in it are refused
    without a write (each used to cost two colliding upserts), with the right `Retry-After`;
    its next window counts again."""
    writes = CommandCounter("update")
    clock = FrozenClock(datetime(2026, 1, 1, 12, 0, 10, tzinfo=UTC))
    async with scratch_collection(mongo.url, writes, prefix="rate") as collection:
        limiter = RateLimiter(
            collection.database.client, collection.database.name, per_minute=RATE, clock=clock
        )
        key_id = uuid.uuid4().hex[:16]
        for _ in range(RATE):
            await limiter.hit(key_id)
        with pytest.raises(LimitExceeded):
            await limiter.hit(key_id)  # finds the window full
        found_full = writes.statements

        clock.advance(20)
        for _ in range(100):
            with pytest.raises(LimitExceeded) as refused:
                await limiter.hit(key_id)
        assert writes.statements == found_full
        assert refused.value.retry_after_s == 30

        clock.advance(30)
        await limiter.hit(key_id)
        assert writes.statements == found_full + 1


async def test_refused_keys_do_not_reach_the_rate_counters(stack: Stack) -> None:
    counters = stack.mongo[f"{stack.db_prefix}_gateway"]["rate_windows"]
    before = await counters.count_documents({})
    for _ in range(RATE + 2):
        response = await stack.api.get(_unknown(), headers={"Authorization": "Bearer nope"})
        assert response.status_code == 401
    assert await counters.count_documents({}) == before


# --------------------------------------------------------------------------- request bodies


async def test_a_body_that_stops_arriving_is_408_and_keeps_nothing(stack: Stack) -> None:
    key = await stack.auth()
    never = asyncio.Event()

    async def stalled() -> AsyncIterator[bytes]:
        yield b'{"text": "a client that stops sending'
        await never.wait()

    before = await stack.stored()
    async with asyncio.timeout(30):
        response = await stack.api.post(
            "/v1/scores",
            content=stalled(),
            headers={**key, "Content-Type": "application/json"},
        )
    assert _assert_problem(response, 408)["type"].endswith("/request-timeout")
    assert response.headers["connection"] == "close"
    assert await stack.stored() == before


async def test_a_stalled_body_is_408_on_framework_parsed_routes_too(stack: Stack) -> None:
    never = asyncio.Event()

    async def stalled() -> AsyncIterator[bytes]:
        yield b'{"tenant_id": "slow'
        await never.wait()

    async with asyncio.timeout(30):
        response = await stack.api.post(
            "/admin/v1/keys",
            content=stalled(),
            headers={**ADMIN, "Content-Type": "application/json"},
        )
    assert _assert_problem(response, 408)["type"].endswith("/request-timeout")


def _chunks(pulled: list[int], count: int, size: int = 1_000) -> AsyncIterator[bytes]:
    async def body() -> AsyncIterator[bytes]:
        yield b'{"text": "'
        for _ in range(count):
            pulled.append(size)
            yield b"x" * size
        yield b'"}'

    return body()


async def test_a_chunked_body_over_the_limit_is_413_before_it_is_read_whole(
    stack: Stack,
) -> None:
    key = await stack.auth()
    pulled: list[int] = []
    before = await stack.stored()
    response = await stack.api.post(
        "/v1/scores",
        content=_chunks(pulled, count=1_000),
        headers={**key, "Content-Type": "application/json"},
    )
    assert "content-length" not in response.request.headers
    assert response.request.headers["transfer-encoding"] == "chunked"
    body = _assert_problem(response, 413)
    assert str(MAX_BODY) in body["detail"]
    assert sum(pulled) <= MAX_BODY + 1_000  # it stopped reading at the limit
    assert await stack.stored() == before


async def test_a_chunked_body_within_the_limit_is_accepted(stack: Stack) -> None:
    key = await stack.auth()
    response = await stack.api.post(
        "/v1/scores",
        content=_chunks([], count=5, size=10),
        headers={**key, "Content-Type": "application/json"},
    )
    assert response.status_code == 202, response.text


# --------------------------------------------------------------------------- dates


async def test_a_not_before_is_bounded_by_the_gateways_clock(stack: Stack) -> None:
    """At most 7 days ahead of the clock the gateway makes it due by (here a day ahead of
    this machine's): judged by this machine's, a date the gateway takes for 6 days 23 hours
    ahead was refused (the gateway's re-read)."""
    key = await stack.auth()
    within = stack.clock() + timedelta(days=7) - timedelta(hours=1)
    beyond = stack.clock() + timedelta(days=7) + timedelta(hours=1)

    taken = await stack.api.post(
        "/v1/scores", json={"text": "Next week.", "not_before": within.isoformat()}, headers=key
    )
    assert taken.status_code == 202, taken.text
    before = await stack.stored()
    refused = await stack.api.post(
        "/v1/scores", json={"text": "Too late.", "not_before": beyond.isoformat()}, headers=key
    )
    body = _assert_problem(refused, 422)
    assert "7 days" in body["detail"]
    assert await stack.stored() == before


async def test_a_replica_minutes_behind_counts_in_the_window_the_others_filled(
    mongo: Endpoint,
) -> None:
    """MongoDB's TTL monitor removes counters by the server's clock. They outlived their
    window by a minute only, so a replica two minutes behind the server counted in windows
    already removed, each restarting at zero: twice the limit per minute with two replicas.
    Here a TTL pass by the server's clock (the first replica's) runs before each request."""
    server = FrozenClock(datetime(2026, 1, 1, 12, 0, 10, tzinfo=UTC))
    behind = FrozenClock(server() - timedelta(minutes=5))
    async with scratch_collection(mongo.url, CommandCounter("update"), prefix="rate") as scratch:
        database = scratch.database
        limiters = [
            RateLimiter(database.client, database.name, per_minute=1, clock=clock)
            for clock in (behind, server)
        ]
        key_id = uuid.uuid4().hex[:16]
        await limiters[1].hit(key_id)  # the window the replica behind reaches in five minutes
        server.advance(5 * 60)
        behind.advance(5 * 60)
        # The TTL monitor's pass.
        await database["rate_windows"].delete_many({"expires_at": {"$lte": server()}})

        with pytest.raises(LimitExceeded):
            await limiters[0].hit(key_id)
