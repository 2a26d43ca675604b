"""The admin key routes where the key store fails or holds more than one listing shows."""

from __future__ import annotations

from datetime import UTC, datetime

from fastapi import FastAPI
from pydantic import SecretStr
from pymongo.errors import AutoReconnect, OperationFailure, PyMongoError

from services.gateway.errors import DatabaseUnavailable
from services.gateway.keys import ApiKey, ApiKeys
from services.gateway.keys_api import MAX_LISTED, key_admin_routes
from shared.http import install_problem_handlers
from shared.query_parameters import only_known_query_parameters
from tests.support import running

NOW = datetime(2030, 1, 1, tzinfo=UTC)
ADMIN = {"Authorization": "Bearer admin-key"}
KEY_ID = "0123456789abcdef"


class StubKeys(ApiKeys):
    """A key store holding `count` keys whose revocation times out (perhaps applied)."""

    def __init__(self, count: int = 0) -> None:  # no database behind it
        self.count = count

    async def find_all(self, *, tenant_id: str | None = None, limit: int = 10_000) -> list[ApiKey]:
        return [
            ApiKey(f"{i:016x}", "acme", "", "0" * 64, NOW) for i in range(min(self.count, limit))
        ]

    async def revoke(self, key_id: str, *, now: datetime) -> ApiKey | None:
        raise DatabaseUnavailable("timed out")


def app_with(keys: StubKeys, forgotten: list[str]) -> FastAPI:
    app = FastAPI(dependencies=[only_known_query_parameters()])  # as the services'
    install_problem_handlers(app)
    routes = key_admin_routes(
        keys,
        SecretStr("admin-key"),
        clock=lambda: NOW,
        forget=forgotten.append,
        remember=lambda _: None,
    )
    app.include_router(routes)
    return app


async def test_a_revocation_the_store_may_have_applied_drops_the_key_from_the_cache() -> None:
    """The replica kept the key cached, in use for `API_KEY_CACHE_TTL_S`, though the database
    may have revoked it, and answered that nothing was changed."""
    forgotten: list[str] = []
    async with running(app_with(StubKeys(), forgotten)) as client:
        answer = await client.delete(f"/admin/v1/keys/{KEY_ID}", headers=ADMIN)
    assert answer.status_code == 503
    assert "may or may not be revoked" in answer.json()["detail"]
    assert forgotten == [KEY_ID]


async def test_an_unknown_key_id_is_cut_in_the_404() -> None:
    """A 5,000-character id came back whole in the detail (a review)."""
    async with running(app_with(StubKeys(), [])) as client:
        answer = await client.delete(f"/admin/v1/keys/{'k' * 5_000}", headers=ADMIN)
    assert answer.status_code == 404
    assert "(5,000 characters)" in answer.json()["detail"]
    assert len(answer.json()["detail"]) < 200


async def test_a_listing_past_its_limit_says_it_is_truncated() -> None:
    async with running(app_with(StubKeys(MAX_LISTED + 5), [])) as client:
        over = (await client.get("/admin/v1/keys", headers=ADMIN)).json()
    async with running(app_with(StubKeys(3), [])) as client:
        under = (await client.get("/admin/v1/keys", headers=ADMIN)).json()
    assert (over["count"], over["truncated"]) == (MAX_LISTED, True)
    assert (under["count"], under["truncated"]) == (3, False)


class ListingFails(StubKeys):
    """A key store whose listing fails with `cause`: an outage, or a refusal for good."""

    def __init__(self, cause: PyMongoError) -> None:
        super().__init__()
        self.cause = cause

    async def find_all(self, *, tenant_id: str | None = None, limit: int = 10_000) -> list[ApiKey]:
        raise DatabaseUnavailable(str(self.cause)) from self.cause


async def test_an_operation_the_database_refuses_for_good_is_a_500_without_retry_after() -> None:
    """A missing privilege recurs on every retry: a 503 with Retry-After told the client to
    retry shortly, for ever."""
    refused = OperationFailure("not authorized on scorebox to execute find", code=13)
    async with running(app_with(ListingFails(refused), [])) as client:
        answer = await client.get("/admin/v1/keys", headers=ADMIN)
    assert answer.status_code == 500
    assert answer.json()["type"].endswith("/database-refused")
    assert "retry-after" not in answer.headers


async def test_a_database_away_is_still_a_503_with_retry_after() -> None:
    async with running(app_with(ListingFails(AutoReconnect("connection reset")), [])) as client:
        answer = await client.get("/admin/v1/keys", headers=ADMIN)
    assert answer.status_code == 503
    assert answer.headers["retry-after"] == "5"


async def test_a_key_may_not_take_the_bootstrap_keys_name() -> None:
    """A new BOOTSTRAP_API_KEY revokes the default tenant's keys of that name registered
    before it: an admin's key named so would have been revoked with them (a review)."""
    async with running(app_with(StubKeys(), [])) as client:
        answer = await client.post(
            "/admin/v1/keys", json={"tenant_id": "default", "name": " Bootstrap"}, headers=ADMIN
        )
    assert answer.status_code == 422, answer.text
    assert "BOOTSTRAP_API_KEY" in answer.text
