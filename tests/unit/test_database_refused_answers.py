"""Gateway routes whose database fails: an outage is a 503 to retry shortly, a refusal for good
(a failed validation, a missing privilege) a 500 without Retry-After, which recurs on every
retry."""

from __future__ import annotations

from typing import cast

from fastapi import FastAPI
from pydantic import SecretStr
from pymongo import AsyncMongoClient
from pymongo.errors import AutoReconnect, OperationFailure, PyMongoError

from services.gateway.admin_api import admin_routes
from services.gateway.api import _unavailable
from services.gateway.auth import Authenticator, Caller, caller_dependency
from services.gateway.deadletters import DeadLetterQueue
from services.gateway.errors import DatabaseUnavailable, refused_for_good
from services.gateway.keys import ApiKeys
from services.gateway.keys_api import key_admin_routes
from services.gateway.limits import RateLimiter
from shared.contracts import utcnow
from shared.http import install_problem_handlers
from tests.support import running

TOKEN = {"Authorization": "Bearer sbx_0123456789abcdef_secret"}
ADMIN_KEY = "admin-key"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_KEY}"}


class FailingAuthenticator:
    def __init__(self, cause: PyMongoError) -> None:
        self.cause = cause

    async def authenticate(self, token: str, *, address: str | None = None) -> Caller | None:
        raise DatabaseUnavailable(str(self.cause)) from self.cause


def app_failing_with(cause: PyMongoError) -> FastAPI:
    app = FastAPI()
    install_problem_handlers(app)
    caller = caller_dependency(
        cast(Authenticator, FailingAuthenticator(cause)), cast(RateLimiter, None)
    )

    @app.get("/v1/scores/{task_id}")
    async def read(task_id: str, who: Caller = caller) -> str:
        return task_id

    return app


async def test_a_key_store_refusing_for_good_is_a_500_without_retry_after() -> None:
    refused = OperationFailure("not authorized on scorebox to execute find", code=13)
    async with running(app_failing_with(refused)) as client:
        answer = await client.get("/v1/scores/abc", headers=TOKEN)
    assert answer.status_code == 500
    assert answer.json()["type"].endswith("/database-refused")
    assert "retry-after" not in answer.headers


async def test_a_key_store_away_is_a_503_with_retry_after() -> None:
    async with running(app_failing_with(AutoReconnect("connection reset"))) as client:
        answer = await client.get("/v1/scores/abc", headers=TOKEN)
    assert answer.status_code == 503
    assert answer.headers["retry-after"] == "5"


class KnownCaller:
    async def authenticate(self, token: str, *, address: str | None = None) -> Caller | None:
        return Caller(tenant_id="acme", key_id="k1")


class RateCounterAway:
    async def hit(self, key_id: str) -> None:
        raise DatabaseUnavailable("connection reset") from AutoReconnect("connection reset")


async def test_a_rate_counter_away_is_a_503_that_names_it() -> None:
    """It was answered "the key store is unavailable", which sent operators to the key
    store (found in review)."""
    app = FastAPI()
    install_problem_handlers(app)
    caller = caller_dependency(
        cast(Authenticator, KnownCaller()), cast(RateLimiter, RateCounterAway())
    )

    @app.get("/v1/scores/{task_id}")
    async def read(task_id: str, who: Caller = caller) -> str:
        return task_id

    async with running(app) as client:
        answer = await client.get("/v1/scores/abc", headers=TOKEN)
    assert answer.status_code == 503
    assert "rate counter" in answer.json()["detail"]


def _failed(cause: PyMongoError) -> DatabaseUnavailable:
    """As the stores raise it: the PyMongo error as its cause."""
    error = DatabaseUnavailable(str(cause))
    error.__cause__ = cause
    return error


def test_the_task_routes_answer_a_refusal_for_good_with_a_500_and_an_outage_with_a_503() -> None:
    """The answer the submit, read, batch and event routes give a failed store."""
    refused = _unavailable(_failed(OperationFailure("document failed validation", code=121)))
    away = _unavailable(_failed(AutoReconnect("connection reset")))
    assert (refused.status, refused.kind, refused.headers) == (500, "database-refused", {})
    assert (away.status, away.headers) == (503, {"Retry-After": "5"})


class RefusingKeyStore:
    """The key collection of a database that refuses the gateway's writes for good (its user
    lost the privilege)."""

    async def insert_one(self, document: object) -> None:
        raise OperationFailure("not authorized on gateway to execute insert", code=13)

    async def update_one(self, *args: object, **kwargs: object) -> None:
        raise OperationFailure("not authorized on gateway to execute update", code=13)

    async def find_one(self, *args: object, **kwargs: object) -> None:
        raise OperationFailure("not authorized on gateway to execute find", code=13)


def keys_app() -> FastAPI:
    client = cast("AsyncMongoClient[dict[str, object]]", {"db": {"api_keys": RefusingKeyStore()}})
    app = FastAPI()
    install_problem_handlers(app)
    routes = key_admin_routes(
        ApiKeys(client, "db"),
        SecretStr(ADMIN_KEY),
        clock=utcnow,
        forget=lambda key_id: None,
        remember=lambda key_id: None,
    )
    app.include_router(routes)
    return app


async def test_a_key_creation_the_database_refuses_for_good_is_a_500() -> None:
    """A refused insert was answered as the store not answering, 503 "retry", for ever."""
    async with running(keys_app()) as client:
        answer = await client.post(
            "/admin/v1/keys", json={"tenant_id": "acme"}, headers=ADMIN_HEADERS
        )
    assert answer.status_code == 500, answer.text
    assert answer.json()["type"].endswith("/database-refused")


async def test_a_key_revocation_the_database_refuses_for_good_is_a_500() -> None:
    async with running(keys_app()) as client:
        answer = await client.delete("/admin/v1/keys/0123456789abcdef", headers=ADMIN_HEADERS)
    assert answer.status_code == 500, answer.text
    assert answer.json()["type"].endswith("/database-refused")


def test_a_refusal_wrapped_twice_is_judged_by_the_database_error_at_the_end() -> None:
    """A key creation's `KeyNotIssued` is raised from the store's `DatabaseUnavailable`."""
    inner = _failed(OperationFailure("document failed validation", code=121))
    outer = DatabaseUnavailable(str(inner))
    outer.__cause__ = inner
    assert refused_for_good(outer)
    away = DatabaseUnavailable("x")
    away.__cause__ = _failed(AutoReconnect("connection reset"))
    assert not refused_for_good(away)


class ReplayRefused:
    """A dead-letter queue whose replay meets a write the database refuses for good."""

    async def replay(self, ids: object) -> None:
        raise _failed(OperationFailure("document failed validation", code=121))


async def test_a_dead_letter_replay_the_database_refuses_for_good_is_a_500() -> None:
    app = FastAPI()
    install_problem_handlers(app)
    app.include_router(admin_routes(cast(DeadLetterQueue, ReplayRefused()), SecretStr(ADMIN_KEY)))
    async with running(app) as client:
        answer = await client.post(
            "/admin/v1/dead-letters/replay", json={"all": True}, headers=ADMIN_HEADERS
        )
    assert answer.status_code == 500, answer.text
    assert "retry-after" not in answer.headers
