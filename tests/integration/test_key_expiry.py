"""An API key may be made to expire (`expires_in_days`): past it, the key opens nothing (401,
as a revoked key) and the listing shows when. The gateway and
the status service in-process against the real broker and database, on a clock the test
moves."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from typing import Any

import httpx
import pytest

from services.gateway.keys import generate_key
from shared.contracts import utcnow
from tests.integration.in_process import gateway_and_status
from tests.support import RFC3339_UTC

ADMIN = {"Authorization": "Bearer key-expiry-admin-key"}
SOME_TASK = "0" * 32


class MovableClock:
    def __init__(self) -> None:
        self.offset = timedelta()

    def __call__(self) -> datetime:
        return utcnow() + self.offset


@pytest.fixture(scope="module")
def clock() -> MovableClock:
    return MovableClock()


@pytest.fixture(scope="module")
async def api(
    amqp_url: str, mongo: Any, db_prefix: str, clock: MovableClock
) -> AsyncIterator[httpx.AsyncClient]:
    env = {
        "RABBITMQ_URL": amqp_url,
        "MONGO_URL": mongo.url,
        "MONGO_DB_PREFIX": db_prefix,
        "ADMIN_API_KEY": "key-expiry-admin-key",
        "BOOTSTRAP_API_KEY": generate_key().token,
    }
    async with gateway_and_status(env, clock=clock) as services:
        yield services.api


async def _key(api: httpx.AsyncClient, **wanted: Any) -> dict[str, Any]:
    body = {"tenant_id": f"expiry-{uuid.uuid4().hex[:8]}", **wanted}
    created = await api.post("/admin/v1/keys", json=body, headers=ADMIN)
    assert created.status_code == 201, created.text
    key: dict[str, Any] = created.json()
    return key


async def test_a_key_opens_requests_until_it_expires(
    api: httpx.AsyncClient, clock: MovableClock
) -> None:
    expiring, lasting = await _key(api, expires_in_days=1), await _key(api)
    assert RFC3339_UTC.fullmatch(expiring["created_at"])  # not `+00:00` (`isoformat()`)
    assert RFC3339_UTC.fullmatch(expiring["expires_at"])
    created_at = datetime.fromisoformat(expiring["created_at"])
    assert datetime.fromisoformat(expiring["expires_at"]) == created_at + timedelta(days=1)
    assert lasting["expires_at"] is None

    def read(key: dict[str, Any]) -> Any:
        headers = {"Authorization": f"Bearer {key['key']}"}
        return api.get(f"/v1/scores/{SOME_TASK}", headers=headers)

    assert (await read(expiring)).status_code == 404  # let in; no such task
    clock.offset = timedelta(days=1, seconds=1)
    try:
        refused = await read(expiring)
        assert refused.status_code == 401, refused.text
        assert (await read(lasting)).status_code == 404
    finally:
        clock.offset = timedelta()
    listed = await api.get(
        "/admin/v1/keys", params={"tenant_id": expiring["tenant_id"]}, headers=ADMIN
    )
    (item,) = listed.json()["items"]
    # As created, to the database's precision.
    assert (item["created_at"], item["expires_at"]) == (
        expiring["created_at"],
        expiring["expires_at"],
    )


@pytest.mark.parametrize("days", [0, -1, 3651, 1.5, "seven", "30", 30.0, True])
async def test_an_expiry_out_of_bounds_is_refused_and_creates_nothing(
    api: httpx.AsyncClient, days: Any
) -> None:
    tenant = f"expiry-{uuid.uuid4().hex[:8]}"
    body = {"tenant_id": tenant, "expires_in_days": days}
    refused = await api.post("/admin/v1/keys", json=body, headers=ADMIN)
    assert refused.status_code == 422, refused.text
    listed = await api.get("/admin/v1/keys", params={"tenant_id": tenant}, headers=ADMIN)
    assert listed.json()["count"] == 0
