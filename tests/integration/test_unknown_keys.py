"""The budget of unknown API keys per client address, and the replica's for all addresses
together, through the gateway on the real broker and database: past either, a made-up key
is a 429 problem; keys in use go on working."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from pymongo import AsyncMongoClient

from services.gateway.keys import ApiKeys, generate_key
from shared.contracts import utcnow
from tests.integration.in_process import gateway_and_status

ADMIN = {"Authorization": "Bearer test-admin-key"}
BUDGET = 3


@dataclass
class Gateway:
    app: FastAPI
    admin: httpx.AsyncClient
    keys: ApiKeys  # the key store itself, as another replica creates keys in it

    def client_at(self, address: str) -> httpx.AsyncClient:
        """A client whose requests come from `address`."""
        transport = httpx.ASGITransport(app=self.app, client=(address, 40000))
        return httpx.AsyncClient(transport=transport, base_url="http://scorebox.test", timeout=10)

    async def new_token(self) -> str:
        tenant = f"budget-{uuid.uuid4().hex[:8]}"
        created = await self.admin.post("/admin/v1/keys", json={"tenant_id": tenant}, headers=ADMIN)
        assert created.status_code == 201, created.text
        token: str = created.json()["key"]
        return token


@asynccontextmanager
async def _gateway(
    amqp_url: str, mongo: Any, db_prefix: str, **budgets: int
) -> AsyncIterator[Gateway]:
    env = {
        "RABBITMQ_URL": amqp_url,
        "MONGO_URL": mongo.url,
        "MONGO_DB_PREFIX": db_prefix,
        "ADMIN_API_KEY": "test-admin-key",
        "UNKNOWN_KEYS_PER_MIN_PER_ADDRESS": str(BUDGET),
        "API_KEY_CACHE_TTL_S": "0",  # every request reads its key: nothing hides in a cache
        **{name: str(value) for name, value in budgets.items()},
    }
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo.url, tz_aware=True)
    try:
        async with gateway_and_status(env) as services:
            yield Gateway(services.gateway, services.api, ApiKeys(client, f"{db_prefix}_gateway"))
    finally:
        await client.close()


@pytest.fixture(scope="module")
async def gateway(amqp_url: str, mongo: Any, db_prefix: str) -> AsyncIterator[Gateway]:
    async with _gateway(amqp_url, mongo, db_prefix) as gateway:
        yield gateway


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def _poll_unknown_task(client: httpx.AsyncClient, token: str) -> httpx.Response:
    return await client.get(f"/v1/scores/{uuid.uuid4().hex}", headers=_bearer(token))


async def test_an_address_past_its_budget_gets_a_429_and_keys_in_use_still_work(
    gateway: Gateway,
) -> None:
    in_use = await gateway.new_token()
    async with (
        gateway.client_at("203.0.113.7") as flooder,
        gateway.client_at("198.51.100.9") as other,
    ):
        assert (await _poll_unknown_task(flooder, in_use)).status_code == 404  # seen to exist
        for _ in range(BUDGET):
            answer = await _poll_unknown_task(flooder, generate_key().token)
            assert answer.status_code == 401, answer.text

        refused = await _poll_unknown_task(flooder, generate_key().token)
        assert refused.status_code == 429, refused.text
        assert refused.headers["content-type"].startswith("application/problem+json")
        assert int(refused.headers["retry-after"]) >= 1
        problem = refused.json()
        assert problem["type"].endswith("too-many-unknown-keys")
        assert problem["limit"] == "unknown_keys"
        assert problem["maximum"] == BUDGET

        # Keys in use, or created through this replica, work from the same address; a key
        # another replica created, which this one never read, waits for the refill.
        assert (await _poll_unknown_task(flooder, in_use)).status_code == 404
        created_here = await gateway.new_token()
        assert (await _poll_unknown_task(flooder, created_here)).status_code == 404
        _, never_seen = await gateway.keys.create(tenant_id="budget-other", name="", now=utcnow())
        assert (await _poll_unknown_task(flooder, never_seen)).status_code == 429
        # Another address is counted on its own.
        assert (await _poll_unknown_task(other, generate_key().token)).status_code == 401
        assert (await _poll_unknown_task(other, never_seen)).status_code == 404


async def test_a_submission_past_the_budget_is_refused_too(gateway: Gateway) -> None:
    async with gateway.client_at("192.0.2.33") as flooder:
        for _ in range(BUDGET):
            await _poll_unknown_task(flooder, generate_key().token)
        refused = await flooder.post(
            "/v1/scores", json={"text": "never kept"}, headers=_bearer(generate_key().token)
        )
    assert refused.status_code == 429, refused.text
    assert refused.json()["limit"] == "unknown_keys"


async def test_addresses_each_within_their_budget_meet_the_replicas_ceiling(
    amqp_url: str, mongo: Any, db_prefix: str
) -> None:
    """Many addresses, each within its own budget (an IPv6 /48 holds 65,536 /64s), had the
    replica read MongoDB without a ceiling."""
    ceiling = BUDGET + 1
    async with _gateway(
        amqp_url, mongo, db_prefix, UNKNOWN_KEYS_PER_MIN_PER_REPLICA=ceiling
    ) as gateway:
        in_use = await gateway.new_token()
        async with (
            gateway.client_at("2001:db8:1:1::1") as first,
            gateway.client_at("2001:db8:1:2::1") as second,
            gateway.client_at("2001:db8:1:3::1") as third,
        ):
            for client, lookups in ((first, BUDGET), (second, ceiling - BUDGET)):
                for _ in range(lookups):
                    answer = await _poll_unknown_task(client, generate_key().token)
                    assert answer.status_code == 401, answer.text

            refused = await _poll_unknown_task(third, generate_key().token)
            assert refused.status_code == 429, refused.text
            assert refused.headers["content-type"].startswith("application/problem+json")
            assert int(refused.headers["retry-after"]) >= 1
            problem = refused.json()
            assert (problem["limit"], problem["maximum"]) == ("unknown_keys", ceiling)
            assert "this gateway's clients" in problem["detail"]
            # Keys seen to exist still work from every address.
            assert (await _poll_unknown_task(third, in_use)).status_code == 404
