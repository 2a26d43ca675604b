"""`shared.http.install_problem_handlers`: errors become problem+json, and a client that hung
up before its request was read is not reported as a server error."""

from __future__ import annotations

import logging

import httpx
import pytest
from fastapi import FastAPI
from pymongo.errors import DuplicateKeyError, NetworkTimeout, ServerSelectionTimeoutError
from starlette.requests import ClientDisconnect

from shared.http import install_problem_handlers

# Only this logger's records: the capture also holds other tests' lingering background logs.
HTTP_LOG = "scorebox.http"


def app_raising(error: Exception) -> FastAPI:
    app = FastAPI()
    install_problem_handlers(app)

    @app.post("/x")
    async def fail() -> None:
        raise error

    return app


async def post(app: FastAPI) -> httpx.Response:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.post("/x")


async def test_a_client_that_hung_up_is_not_a_server_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO):
        response = await post(app_raising(ClientDisconnect()))

    assert response.status_code == 400
    assert response.headers["content-type"] == "application/problem+json"
    assert not [r for r in caplog.records if r.name == HTTP_LOG and r.levelno >= logging.ERROR]


async def test_an_unexpected_error_is_a_logged_500(caplog: pytest.LogCaptureFixture) -> None:
    response = await post(app_raising(RuntimeError("boom")))

    assert response.status_code == 500
    assert response.headers["content-type"] == "application/problem+json"
    assert any(r.name == HTTP_LOG and r.levelno >= logging.ERROR for r in caplog.records)


@pytest.mark.parametrize(
    "error", [ServerSelectionTimeoutError("no primary"), NetworkTimeout("timed out")]
)
async def test_a_database_that_does_not_answer_is_a_503_not_a_server_error(
    error: Exception, caplog: pytest.LogCaptureFixture
) -> None:
    """The scheduler's, the status service's and the notifier's routes answered 500."""
    response = await post(app_raising(error))

    assert response.status_code == 503
    assert response.headers["content-type"] == "application/problem+json"
    assert response.headers["retry-after"] == "5"
    assert "may have taken effect" in response.json()["detail"]  # a POST
    assert not [r for r in caplog.records if r.name == HTTP_LOG and r.levelno >= logging.ERROR]


async def test_a_database_error_of_ours_is_still_a_500() -> None:
    response = await post(app_raising(DuplicateKeyError("E11000 duplicate key")))

    assert response.status_code == 500


def test_the_openapi_document_shows_the_422_the_service_sends() -> None:
    """It showed FastAPI's own `HTTPValidationError` (`application/json`, `detail: [{loc,
    msg, type}]`), which no route answers: clients generated from it misread every 422."""
    app = FastAPI()
    install_problem_handlers(app)

    @app.get("/items/{item_id}")
    async def item(item_id: int) -> dict[str, int]:
        return {"id": item_id}

    unprocessable = app.openapi()["paths"]["/items/{item_id}"]["get"]["responses"]["422"]
    assert list(unprocessable["content"]) == ["application/problem+json"]
    assert "HTTPValidationError" not in app.openapi()["components"]["schemas"]


def test_every_operation_documents_the_422_and_the_500_every_route_may_answer() -> None:
    """A route with no parameter documented neither, though it answers 422 for a query
    parameter it does not take (`shared.query_parameters`), and any route may answer 500
    (an error of ours, or `database-refused`); a route's own 500 is kept."""
    app = FastAPI()
    install_problem_handlers(app)
    own = {"description": "A write refused.", "content": {"application/problem+json": {}}}

    @app.get("/healthz")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/items", responses={500: own})
    async def create() -> dict[str, str]:
        return {}

    paths = app.openapi()["paths"]
    plain = paths["/healthz"]["get"]["responses"]
    assert list(plain["422"]["content"]) == ["application/problem+json"]
    assert "database-refused" in plain["500"]["description"]
    assert paths["/items"]["post"]["responses"]["500"]["description"] == "A write refused."
