"""Creating an API key when the key store's answer is lost, on the real database: an insert
that timed out may have landed, leaving an active key whose token nobody was shown, while the
503 said that nothing was changed. The attempt's key is now revoked before the answer (and an
insert landing later fails on its id); when that fails too, the answer names the key.

The key store's collection is wrapped at the seam to lose answers; the database is real."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from pydantic import SecretStr
from pymongo import AsyncMongoClient
from pymongo.errors import DuplicateKeyError, NetworkTimeout

from services.gateway.keys import ApiKeys
from services.gateway.keys_api import key_admin_routes
from shared.contracts import new_id
from shared.http import install_problem_handlers
from tests.support import running

Mongo = AsyncMongoClient[dict[str, Any]]
NOW = datetime(2030, 1, 1, tzinfo=UTC)
ADMIN = {"Authorization": "Bearer admin-key"}


class LostAnswers:
    """The key collection, whose insert times out: after landing (`lands`) or before it,
    keeping the document (`late`) for the test to land afterwards. With `then_gone`, every
    later write fails as well."""

    def __init__(self, collection: Any, *, lands: bool, then_gone: bool = False) -> None:
        self._collection = collection
        self.lands = lands
        self.then_gone = then_gone
        self.late: list[dict[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._collection, name)

    async def insert_one(self, document: dict[str, Any]) -> None:
        if self.lands:
            await self._collection.insert_one(document)
        else:
            self.late.append(dict(document))
        raise NetworkTimeout("timed out waiting for the answer")

    async def update_one(self, *args: Any, **kwargs: Any) -> Any:
        if self.then_gone:
            raise NetworkTimeout("timed out")
        return await self._collection.update_one(*args, **kwargs)


class KeysLosingAnswers(ApiKeys):
    def __init__(self, client: Mongo, database: str, seam: LostAnswers) -> None:
        super().__init__(client, database)
        self.seam = seam
        self._collection = seam  # type: ignore[assignment]


@pytest.fixture
async def store(mongo: Any, db_prefix: str) -> AsyncIterator[tuple[Mongo, str]]:
    """The gateway's database (shared by the session: each test has a tenant of its own)."""
    client: Mongo = AsyncMongoClient(mongo.url, tz_aware=True)
    yield client, f"{db_prefix}_gateway"
    await client.close()


def _app(keys: ApiKeys) -> FastAPI:
    app = FastAPI()
    install_problem_handlers(app)
    app.include_router(
        key_admin_routes(
            keys,
            SecretStr("admin-key"),
            clock=lambda: NOW,
            forget=lambda _: None,
            remember=lambda _: None,
        )
    )
    return app


async def _create(keys: ApiKeys, tenant_id: str) -> httpx.Response:
    async with running(_app(keys)) as client:
        return await client.post(
            "/admin/v1/keys", json={"tenant_id": tenant_id, "name": "ci"}, headers=ADMIN
        )


async def test_a_key_whose_insert_landed_unanswered_is_revoked_before_the_503(
    store: tuple[Mongo, str],
) -> None:
    tenant = new_id()
    keys = KeysLosingAnswers(*store, LostAnswers(store[0][store[1]]["api_keys"], lands=True))

    answer = await _create(keys, tenant)

    assert answer.status_code == 503
    problem = answer.json()
    assert "no key was issued" in problem["detail"]
    [stored] = await ApiKeys(*store).find_all(tenant_id=tenant)
    assert stored.key_id == problem["key_id"]
    assert (stored.active, stored.revoked_at) == (False, NOW)


async def test_an_insert_landing_after_the_503_fails_on_the_revoked_key(
    store: tuple[Mongo, str],
) -> None:
    tenant = new_id()
    seam = LostAnswers(store[0][store[1]]["api_keys"], lands=False)

    answer = await _create(KeysLosingAnswers(*store, seam), tenant)

    assert answer.status_code == 503
    [late] = seam.late
    with pytest.raises(DuplicateKeyError):
        await store[0][store[1]]["api_keys"].insert_one(late)
    [stored] = await ApiKeys(*store).find_all(tenant_id=tenant)
    assert (stored.key_id, stored.active, stored.name) == (late["_id"], False, "ci")


async def test_a_key_that_could_not_be_revoked_either_is_named_for_the_admin(
    store: tuple[Mongo, str],
) -> None:
    tenant = new_id()
    seam = LostAnswers(store[0][store[1]]["api_keys"], lands=True, then_gone=True)

    answer = await _create(KeysLosingAnswers(*store, seam), tenant)

    assert answer.status_code == 503
    problem = answer.json()
    [stored] = await ApiKeys(*store).find_all(tenant_id=tenant)
    assert stored.active
    assert problem["key_id"] == stored.key_id
    assert "may have been created" in problem["detail"]
    assert f"DELETE /admin/v1/keys/{stored.key_id}" in problem["detail"]


async def test_a_key_store_out_of_reach_changed_nothing_and_says_so() -> None:
    """No server selected, the insert never left: the 503 told the admin a key might have
    been created and to revoke it (found in review)."""
    client: Mongo = AsyncMongoClient(
        "mongodb://127.0.0.1:1/?directConnection=true", serverSelectionTimeoutMS=200
    )
    try:
        answer = await _create(ApiKeys(client, "gateway"), new_id())
    finally:
        await client.close()

    assert answer.status_code == 503
    assert "nothing was changed" in answer.json()["detail"]
    assert "key_id" not in answer.json()
