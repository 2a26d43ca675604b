"""Every route refuses a query parameter it does not take, or one given twice, with a 422
naming it (`shared.query_parameters`), read from the app's OpenAPI document: the README said
so of every route, and the event stream, the submissions, the cancels, the webhook routes,
the dead-letter listing, the scheduler's and the health routes took any (found in a
walkthrough). The apps run without their lifespan: the refusal comes before anything is
read or written."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
import pytest
from fastapi import FastAPI

from services.gateway.app import create_app as create_gateway
from services.gateway.settings import GatewaySettings
from services.status.app import create_app as create_status
from services.status.settings import StatusSettings
from shared.query_parameters import document_before_serving

TASK = "0" * 32


def _gateway() -> FastAPI:
    return create_gateway(GatewaySettings.model_validate({"ADMIN_API_KEY": "admin-key"}))


def _status() -> FastAPI:
    return create_status(StatusSettings.model_validate({}))


async def _answer(app: FastAPI, method: str, url: str) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://service") as client:
        return await client.request(method, url, json={} if method == "POST" else None)


@pytest.mark.parametrize(
    ("make_app", "method", "url", "named", "outcome"),
    [
        (_gateway, "GET", "/healthz?verbose=1", "verbose", "(it takes none)."),
        (_gateway, "GET", f"/v1/scores/{TASK}/events?since=3", "since", "."),
        (_gateway, "POST", "/v1/scores?priority=high", "priority", "; nothing was done."),
        (_gateway, "POST", f"/v1/scores/{TASK}/cancel?force=1", "force", "; nothing was done."),
        (_gateway, "GET", "/admin/v1/dead-letters?limit=5", "limit", "."),
        (_gateway, "DELETE", "/admin/v1/dead-letters?before=x", "before", "nothing was removed."),
        (_gateway, "GET", f"/v1/scores/{TASK}?wait=1&wait=2", "wait", "must be given once."),
        (_status, "GET", f"/internal/v1/tasks/{TASK}?tenant_id=a&tenant=b", "tenant", "."),
    ],
    ids=["health", "events", "submit", "cancel", "letters", "purge", "twice", "internal"],
)
async def test_a_query_parameter_the_route_does_not_take_is_a_422_naming_it(
    make_app: Callable[[], FastAPI], method: str, url: str, named: str, outcome: str
) -> None:
    answer = await _answer(make_app(), method, url)

    assert answer.status_code == 422, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    problem = answer.json()
    assert [error["field"] for error in problem["errors"]] == [f"query.{named}"]
    assert problem["detail"].endswith(outcome), problem["detail"]


async def test_the_parameters_a_route_takes_pass() -> None:
    # Past the check, the read asks for a key: 401, not 422.
    read = await _answer(_gateway(), "GET", f"/v1/scores/{TASK}?wait=0&status=queued")
    assert read.status_code == 401, read.text
    documents = await _answer(_gateway(), "GET", "/openapi.json?x=1")  # not in the document
    assert documents.status_code == 200


async def test_the_document_is_built_before_the_first_request() -> None:
    """Built at the first request, it held that request's event loop for about 60 ms."""
    started: list[bool] = []

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        started.append(app.openapi_schema is not None)
        yield

    app = FastAPI(lifespan=document_before_serving(lifespan))
    async with app.router.lifespan_context(app):
        assert app.openapi_schema is not None
    assert started == [True]


@pytest.mark.parametrize(
    "url",
    [
        f"/internal/v1/batches/{TASK}?tenant_id=a&after=9223372036854775808",
        f"/internal/v1/tasks/{TASK}/history?tenant_id=a&after=9223372036854775808",
    ],
    ids=["batch", "history"],
)
async def test_a_cursor_beyond_int64_is_a_422_naming_it(url: str) -> None:
    """A cursor no BSON integer holds failed the read with a 500 (a review's find)."""
    answer = await _answer(_status(), "GET", url)

    assert answer.status_code == 422, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    assert "after" in answer.text
