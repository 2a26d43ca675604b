"""Gateway routes whose database fails: an outage is a 503 to retry shortly, a refusal for good
(a failed validation, a missing privilege) a 500 without Retry-After, which recurs on every
retry."""

from __future__ import annotations

from typing import cast

from fastapi import FastAPI
from pymongo.errors import AutoReconnect, OperationFailure, PyMongoError

from services.gateway.api import _unavailable
from services.gateway.auth import Authenticator, Caller, caller_dependency
from services.gateway.errors import DatabaseUnavailable
from services.gateway.limits import RateLimiter
from shared.http import install_problem_handlers
from tests.support import running

TOKEN = {"Authorization": "Bearer sbx_0123456789abcdef_secret"}


class FailingAuthenticator:
    def __init__(self, cause: PyMongoError) -> None:
        self.cause = cause

    async def authenticate(self, token: str) -> Caller | None:
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
