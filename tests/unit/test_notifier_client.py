"""The gateway's client of the notifier's tenant API: an answer it cannot read is the
notifier being unavailable, with a change perhaps made, never a 500; and a 404 means "no
failure alert registered" only when it is the notifier's own answer saying so."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import cast

import httpx
import pytest
from aiohttp import web
from fastapi import Depends, FastAPI
from pymongo.errors import OperationFailure

from services.gateway.auth import Caller
from services.gateway.settings import GatewaySettings
from services.gateway.webhooks_api import (
    NO_FAILURE_ALERT_TYPE,
    NotifierClient,
    NotifierUnavailable,
    make_notifier_http,
    webhook_routes,
)
from services.notifier.api import NO_FAILURE_ALERT, tenant_routes
from services.notifier.keyring import Keyring
from services.notifier.registry import FailureAlerts
from services.notifier.ssrf import WebhookGuard
from shared.contracts import utcnow
from shared.http import PROBLEM_BASE, PROBLEM_JSON, install_problem_handlers
from tests.support import serving

PAGES = {
    "a proxy's page": httpx.Response(200, text="<html>Bad gateway</html>"),
    "another schema": httpx.Response(200, json={"signing_secret": "whsec_x"}),
    "a list": httpx.Response(200, json=["https://example.com/hook"]),
}


def client_answering(answer: httpx.Response) -> NotifierClient:
    transport = httpx.MockTransport(lambda request: answer)
    return NotifierClient(httpx.AsyncClient(transport=transport), base_url="http://notifier")


@pytest.mark.parametrize("answer", PAGES.values(), ids=PAGES.keys())
@pytest.mark.parametrize("call", ["signing_secret", "rotate_signing_secret", "failure_alert"])
async def test_an_unreadable_answer_is_the_notifier_unavailable_with_a_change_perhaps_made(
    answer: httpx.Response, call: str
) -> None:
    notifier = client_answering(answer)
    method: Callable[[str], Awaitable[object]] = getattr(notifier, call)
    with pytest.raises(NotifierUnavailable) as raised:
        await method("acme")
    assert raised.value.maybe_applied


async def test_the_notifier_is_reached_directly_whatever_proxy_the_environment_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The gateway asked the notifier, an internal service, through the egress proxy of its
    environment (HTTP_PROXY), which cannot reach it."""
    app = web.Application()
    app.router.add_get("/internal/v1/tenants/acme/webhook-secret", _secret)
    async with serving(app) as base_url:
        monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # nothing listens: refused
        monkeypatch.setenv("ALL_PROXY", "http://127.0.0.1:9")
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        settings = GatewaySettings.model_validate({"NOTIFIER_URL": base_url})
        async with make_notifier_http(settings) as http:
            secret = await NotifierClient(http, base_url=base_url).signing_secret("acme")
    assert secret.secret == "whsec_direct"


async def _secret(request: web.Request) -> web.Response:
    return web.json_response({"secret": "whsec_direct", "created_at": "2030-01-01T00:00:00Z"})


class NoAlerts:
    async def url_of(self, tenant_id: str) -> str | None:
        return None


def _notifier_without_alerts() -> FastAPI:
    """The notifier's tenant routes, no tenant having registered a failure alert."""
    app = FastAPI()
    install_problem_handlers(app)
    app.include_router(
        tenant_routes(
            keyring=cast(Keyring, None),  # not reached by these reads
            alerts=cast(FailureAlerts, NoAlerts()),
            guard=cast(WebhookGuard, None),
            clock=utcnow,
            rotation_grace=timedelta(hours=1),
            internal_key=None,
        )
    )
    return app


def client_of(app: FastAPI, base_url: str) -> NotifierClient:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
    return NotifierClient(http, base_url=base_url)


async def test_the_notifiers_no_alert_answer_reads_as_none_registered() -> None:
    app = _notifier_without_alerts()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as http:
        raw = await http.get("http://notifier/internal/v1/tenants/acme/failure-alert")
    assert (raw.status_code, raw.json()["type"]) == (404, NO_FAILURE_ALERT_TYPE)
    assert await client_of(app, "http://notifier").failure_alert("acme") is None


async def test_an_earlier_notifiers_no_alert_answer_reads_as_none_registered() -> None:
    """A notifier of an earlier build answers the generic not-found type (a gateway upgraded
    first still reads it)."""
    earlier = httpx.Response(
        404,
        json={
            "type": "https://scorebox.dev/problems/not-found",
            "title": "Not Found",
            "status": 404,
            "detail": "No failure-alert URL is registered.",
        },
        headers={"content-type": PROBLEM_JSON},
    )
    assert await client_answering(earlier).failure_alert("acme") is None


OTHER_404S = {
    "a proxy's page": httpx.Response(404, text="<html>404 Not Found</html>"),
    "a bare JSON 404": httpx.Response(404, json={"detail": "Not Found"}),
    "another service's unknown route": httpx.Response(
        404,
        json={
            "type": "https://scorebox.dev/problems/not-found",
            "title": "Not Found",
            "status": 404,
            "detail": "Not Found",
        },
        headers={"content-type": PROBLEM_JSON},
    ),
    "the right type, not problem+json": httpx.Response(
        404, json={"type": "https://scorebox.dev/problems/no-failure-alert"}
    ),
}


@pytest.mark.parametrize("answer", OTHER_404S.values(), ids=OTHER_404S.keys())
async def test_any_other_404_is_the_notifier_unavailable_not_no_alert(
    answer: httpx.Response,
) -> None:
    """Every 404 read as "no failure alert registered": a wrong NOTIFIER_URL or a proxy's path
    prefix showed every tenant's alert as missing."""
    with pytest.raises(NotifierUnavailable):
        await client_answering(answer).failure_alert("acme")


async def test_the_notifier_reached_under_a_wrong_path_prefix_is_unavailable() -> None:
    notifier = client_of(_notifier_without_alerts(), "http://notifier/wrong-prefix")
    with pytest.raises(NotifierUnavailable):
        await notifier.failure_alert("acme")


def test_the_gateway_knows_the_notifiers_no_alert_type() -> None:
    assert NO_FAILURE_ALERT_TYPE == PROBLEM_BASE + NO_FAILURE_ALERT


# --- The notifier's database refusing for good ---------------------------------------------

NOT_AUTHORIZED = OperationFailure("not authorized on scorebox_notifier", code=13)


class RefusingKeyring:
    async def current(self, tenant_id: str, *, now: datetime) -> None:
        raise NOT_AUTHORIZED

    async def rotate(self, tenant_id: str, *, now: datetime, grace: timedelta) -> None:
        raise NOT_AUTHORIZED


class RefusingAlerts:
    async def url_of(self, tenant_id: str) -> str | None:
        raise NOT_AUTHORIZED

    async def register(self, tenant_id: str, url: str, *, now: datetime) -> None:
        raise NOT_AUTHORIZED

    async def remove(self, tenant_id: str) -> bool:
        raise NOT_AUTHORIZED


class PassingGuard:
    def check(self, url: str) -> tuple[str, int]:
        return ("example.com", 443)


def _refusing_notifier() -> NotifierClient:
    """The notifier's real tenant routes over stores its database refuses (a missing
    privilege): each answers its 500 `database-refused`."""
    app = FastAPI()
    install_problem_handlers(app)
    app.include_router(
        tenant_routes(
            keyring=cast(Keyring, RefusingKeyring()),
            alerts=cast(FailureAlerts, RefusingAlerts()),
            guard=cast(WebhookGuard, PassingGuard()),
            clock=utcnow,
            rotation_grace=timedelta(hours=1),
            internal_key=None,
        )
    )
    return client_of(app, "http://notifier")


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/v1/webhooks/secret", None),
        ("POST", "/v1/webhooks/secret/rotate", None),
        ("GET", "/v1/webhooks/failure-alert", None),
        ("PUT", "/v1/webhooks/failure-alert", {"url": "https://example.com/hook"}),
        ("DELETE", "/v1/webhooks/failure-alert", None),
    ],
)
async def test_the_notifiers_refusal_for_good_is_passed_on_as_a_500_without_retry_after(
    method: str, path: str, body: dict[str, str] | None
) -> None:
    """It was a 503 "retry shortly", or for a change 503 `change-unconfirmed` ("it may have
    been made"), though the database refused it and will again (a review)."""
    gateway = FastAPI()
    install_problem_handlers(gateway)
    gateway.include_router(webhook_routes(_refusing_notifier(), Depends(lambda: Caller("acme"))))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=gateway), base_url="http://gateway"
    ) as client:
        answer = await client.request(method, path, json=body)
    assert answer.status_code == 500, answer.text
    assert answer.json()["type"] == PROBLEM_BASE + "database-refused"
    assert "retry-after" not in answer.headers


async def _trickled_secret(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    response.content_length = 1_000_000
    await response.prepare(request)
    while True:  # each byte within the read timeout, the whole never
        await response.write(b" ")
        await asyncio.sleep(0.05)  # the fault: a peer that never finishes


async def test_an_answer_that_never_ends_is_the_notifier_unavailable() -> None:
    """The client's timeout bounds each read: an answer sent a byte at a time held the
    request for as long as it went on (the deadline here only keeps the test from hanging)."""
    app = web.Application()
    app.router.add_get("/internal/v1/tenants/acme/webhook-secret", _trickled_secret)
    async with serving(app) as base_url:
        settings = GatewaySettings.model_validate(
            {"NOTIFIER_URL": base_url, "NOTIFIER_TIMEOUT_S": "0.5"}
        )
        async with make_notifier_http(settings) as http, asyncio.timeout(60):
            with pytest.raises(NotifierUnavailable) as raised:
                await NotifierClient(http, base_url=base_url).signing_secret("acme")
    assert raised.value.maybe_applied
    assert "in time" in str(raised.value)
