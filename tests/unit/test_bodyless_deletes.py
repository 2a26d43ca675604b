"""The DELETE routes of every service, and the notifier's internal rotation, refuse a request
body as the other routes that take none do (`shared.bodies.refuse_a_body`): ignored, a body
(a malformed one included) went unnoticed while the request removed what it named. Each
route over stores that record what they were asked to do: a refused request asks nothing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest
from fastapi import Depends, FastAPI, Request
from pydantic import SecretStr

from services.gateway.admin_api import admin_routes
from services.gateway.auth import Caller
from services.gateway.deadletters import DeadLetterQueue
from services.gateway.keys import ApiKey, ApiKeys
from services.gateway.keys_api import key_admin_routes
from services.gateway.webhooks_api import NotifierClient, webhook_routes
from services.notifier.api import tenant_routes
from services.notifier.keyring import Keyring, TenantSecret
from services.notifier.registry import FailureAlerts
from services.notifier.ssrf import WebhookGuard
from services.scheduler.api import cron_dead_letter_routes
from services.scheduler.dead_letters import CronDeadLetters
from shared.dead_letters import CutOff, Dropped
from shared.http import Problem, install_problem_handlers
from tests.support import running

NOW = datetime(2030, 1, 1, tzinfo=UTC)
KEY = "the-key"
WITH_KEY = {"Authorization": f"Bearer {KEY}"}


class Recorder:
    """Every store of these routes at once: each call is recorded, none fails."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def drop(self, letter_id: str, *, cut_off: CutOff | None = None) -> Dropped:
        self.calls.append(f"drop {letter_id}")
        return Dropped(removed=1, walked=1, truncated=False)

    async def purge(self) -> int:
        self.calls.append("purge")
        return 1

    async def purge_before(self, cut_off: CutOff) -> Dropped:
        self.calls.append("purge_before")
        return Dropped(removed=1, walked=1, truncated=False)

    async def revoke(self, key_id: str, *, now: datetime) -> ApiKey | None:
        self.calls.append(f"revoke {key_id}")
        return None

    async def remove_failure_alert(self, tenant_id: str) -> None:
        self.calls.append(f"remove_failure_alert {tenant_id}")

    async def remove(self, tenant_id: str) -> None:
        self.calls.append(f"remove {tenant_id}")

    async def rotate(self, tenant_id: str, *, now: datetime, grace: timedelta) -> TenantSecret:
        self.calls.append(f"rotate {tenant_id}")
        return TenantSecret(secret="whsec_new", created_at=NOW)


def _app(recorder: Recorder, include: Callable[[FastAPI, Recorder], None]) -> FastAPI:
    app = FastAPI()
    install_problem_handlers(app)
    include(app, recorder)
    return app


def _gateway_dead_letters(app: FastAPI, recorder: Recorder) -> None:
    app.include_router(admin_routes(cast(DeadLetterQueue, recorder), SecretStr(KEY)))


def _gateway_keys(app: FastAPI, recorder: Recorder) -> None:
    app.include_router(
        key_admin_routes(
            cast(ApiKeys, recorder),
            SecretStr(KEY),
            clock=lambda: NOW,
            forget=lambda _: None,
            remember=lambda _: None,
        )
    )


async def _tenant_key(request: Request) -> Caller:
    """The gateway's key check, as far as these routes need it: 401 without the key."""
    if request.headers.get("authorization") != f"Bearer {KEY}":
        raise Problem(401, "Send your API key.")
    return Caller(tenant_id="acme")


def _gateway_webhooks(app: FastAPI, recorder: Recorder) -> None:
    app.include_router(webhook_routes(cast(NotifierClient, recorder), Depends(_tenant_key)))


def _scheduler_dead_letters(app: FastAPI, recorder: Recorder) -> None:
    app.include_router(
        cron_dead_letter_routes(
            dead_letters=cast(CronDeadLetters, recorder), admin_key=SecretStr(KEY)
        )
    )


def _notifier(app: FastAPI, recorder: Recorder) -> None:
    app.include_router(
        tenant_routes(
            keyring=cast(Keyring, recorder),
            alerts=cast(FailureAlerts, recorder),
            guard=cast(WebhookGuard, None),  # not reached: nothing is registered
            clock=lambda: NOW,
            rotation_grace=timedelta(hours=1),
            internal_key=SecretStr(KEY),
        )
    )


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    include: Callable[[FastAPI, Recorder], None]
    outcome: str


ROUTES = {
    "gateway: drop a dead letter": Route(
        "DELETE", "/admin/v1/dead-letters/0123456789abcdef", _gateway_dead_letters, "removed"
    ),
    "gateway: purge the dead letters": Route(
        "DELETE", "/admin/v1/dead-letters", _gateway_dead_letters, "removed"
    ),
    "gateway: revoke a key": Route(
        "DELETE", "/admin/v1/keys/0123456789abcdef", _gateway_keys, "revoked"
    ),
    "gateway: remove the failure alert": Route(
        "DELETE", "/v1/webhooks/failure-alert", _gateway_webhooks, "removed"
    ),
    "scheduler: drop a cron dead letter": Route(
        "DELETE", "/admin/v1/cron/dead-letters/run-1", _scheduler_dead_letters, "removed"
    ),
    "scheduler: purge the cron dead letters": Route(
        "DELETE", "/admin/v1/cron/dead-letters", _scheduler_dead_letters, "removed"
    ),
    "notifier: remove a failure alert": Route(
        "DELETE", "/internal/v1/tenants/acme/failure-alert", _notifier, "removed"
    ),
    "notifier: rotate the signing secret": Route(
        "POST", "/internal/v1/tenants/acme/webhook-secret/rotate", _notifier, "changed"
    ),
}
JSON_TYPE = {"Content-Type": "application/json"}


@pytest.mark.parametrize("route", ROUTES.values(), ids=ROUTES.keys())
@pytest.mark.parametrize("body", [b"{bad", b'{"cut_off": "2030-01-01T00:00:00Z"}'])
async def test_a_body_is_refused_and_nothing_is_done(route: Route, body: bytes) -> None:
    recorder = Recorder()
    async with running(_app(recorder, route.include)) as client:
        refused = await client.request(
            route.method, route.path, content=body, headers={**JSON_TYPE, **WITH_KEY}
        )
        keyless = await client.request(route.method, route.path, content=body, headers=JSON_TYPE)

    assert refused.status_code == 422, refused.text
    assert refused.headers["content-type"] == "application/problem+json"
    problem: dict[str, Any] = refused.json()
    assert problem["detail"] == (
        f"body: this route takes no request body; send none; nothing was {route.outcome}."
    )
    assert problem["errors"] == [
        {"field": "body", "message": "this route takes no request body; send none"}
    ]
    assert keyless.status_code == 401, keyless.text  # the key is checked first
    assert recorder.calls == []


@pytest.mark.parametrize("route", ROUTES.values(), ids=ROUTES.keys())
@pytest.mark.parametrize("body", [b"", b"{}", b"null", b" {} \n"])
async def test_what_clients_send_for_no_body_is_taken_as_none(route: Route, body: bytes) -> None:
    recorder = Recorder()
    async with running(_app(recorder, route.include)) as client:
        answer = await client.request(
            route.method, route.path, content=body, headers={**JSON_TYPE, **WITH_KEY}
        )

    assert answer.status_code != 422, answer.text
    assert len(recorder.calls) == 1, answer.text
