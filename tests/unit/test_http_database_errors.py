"""A database error no route handled (the status service's, the scheduler's and the notifier's
reads): an outage is a 503 to retry shortly, a refusal for good a 500 `database-refused`
without Retry-After. A transient `OperationFailure` (a primary stepping down) was answered
500 "unexpected"."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from pymongo.errors import AutoReconnect, OperationFailure, PyMongoError

from shared.http import install_problem_handlers
from tests.support import running

CASES = {
    "connection reset": (AutoReconnect("connection reset"), 503, "database-unavailable"),
    "primary stepped down": (
        OperationFailure("interrupted due to repl state change", code=11602),
        503,
        "database-unavailable",
    ),
    "missing privilege": (
        OperationFailure("not authorized on status to execute find", code=13),
        500,
        "database-refused",
    ),
}


@pytest.mark.parametrize(("error", "status", "kind"), CASES.values(), ids=CASES.keys())
async def test_a_database_error_is_answered_by_what_a_retry_would_meet(
    error: PyMongoError, status: int, kind: str
) -> None:
    app = FastAPI()
    install_problem_handlers(app)

    @app.get("/internal/v1/thing")
    async def read() -> None:
        raise error

    async with running(app) as client:
        answer = await client.get("/internal/v1/thing")
    assert answer.status_code == status, answer.text
    assert answer.json()["type"].endswith(f"/{kind}")
    assert ("retry-after" in answer.headers) == (status == 503)
