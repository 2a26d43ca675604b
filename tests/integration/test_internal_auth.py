"""The internal routes under `INTERNAL_API_KEY`, in-process on the real broker and database:
a gateway holding the key reads a task through the status service, usage through the
scheduler and webhook settings through the notifier; every internal route of those services
refuses a request without the key (the admin key included), and a gateway without the key
answers 503 and logs why. A service left without a key says so once at start."""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from services.gateway.app import create_app as create_gateway
from services.gateway.keys import generate_key
from services.gateway.settings import GatewaySettings
from services.notifier.app import create_app as create_notifier
from services.notifier.settings import NotifierSettings
from services.scheduler.app import create_app as create_scheduler
from services.scheduler.config import SchedulerConfig, parse_config
from services.scheduler.settings import SchedulerSettings
from services.status.app import create_app as create_status
from services.status.settings import StatusSettings
from shared.bus import publish_event
from shared.contracts import Phase, ScoreResult, TaskCompleted, event_sequence, utcnow
from shared.http import PROBLEM_JSON
from shared.runtime import make_broker
from tests.support import eventually, running

INTERNAL_KEY = "internal-" + uuid.uuid4().hex
ADMIN_KEY = "admin-" + uuid.uuid4().hex
API_KEY = generate_key().token  # registered for the default tenant by BOOTSTRAP_API_KEY
SERVICES = ("status", "scheduler", "notifier")
OPEN_WARNING = "INTERNAL_API_KEY is not set"


def _config() -> SchedulerConfig:
    return parse_config({}, {})  # no job fires during the tests


@dataclass
class Services:
    """The internal services, holding the key, and a gateway holding it too."""

    apps: dict[str, FastAPI]
    gateway: httpx.AsyncClient
    env: dict[str, str]
    amqp_url: str


def _in_process(app: FastAPI) -> httpx.AsyncClient:
    """A client of an app whose lifespan runs elsewhere, with no credentials of its own."""
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://internal.test", timeout=10
    )


def _service_apps(env: dict[str, str]) -> dict[str, FastAPI]:
    return {
        "status": create_status(StatusSettings.model_validate(env)),
        "scheduler": create_scheduler(SchedulerSettings.model_validate(env), config=_config()),
        "notifier": create_notifier(NotifierSettings.model_validate(env)),
    }


def _gateway(env: dict[str, str], apps: dict[str, FastAPI]) -> FastAPI:
    """A gateway reaching the services in-process, through clients without credentials: the
    gateway's own settings decide what they send."""
    return create_gateway(
        GatewaySettings.model_validate(env),
        status_http=_in_process(apps["status"]),
        scheduler_http=_in_process(apps["scheduler"]),
        notifier_http=_in_process(apps["notifier"]),
    )


@pytest.fixture(scope="module")
async def services(amqp_url: str, mongo: Any, db_prefix: str) -> AsyncIterator[Services]:
    env = {
        "RABBITMQ_URL": amqp_url,
        "MONGO_URL": mongo.url,
        "MONGO_DB_PREFIX": db_prefix,
        "BOOTSTRAP_API_KEY": API_KEY,
        "ADMIN_API_KEY": ADMIN_KEY,
        "RATE_LIMIT_PER_MIN": "0",
        "INTERNAL_API_KEY": INTERNAL_KEY,
    }
    apps = _service_apps(env)
    async with AsyncExitStack() as started:
        for app in apps.values():
            await started.enter_async_context(running(app))
        gateway = await started.enter_async_context(running(_gateway(env, apps)))
        gateway.headers["Authorization"] = f"Bearer {API_KEY}"
        yield Services(apps, gateway, env, amqp_url)


async def _complete(amqp_url: str, task_id: str) -> None:
    """The task's outcome, as the scorer publishes it: only the status service learns it."""
    now = utcnow()
    completed = TaskCompleted(
        task_id=task_id,
        attempt=1,
        submitted_at=now,
        sequence=event_sequence(generation=0, attempt=1, phase=Phase.TERMINAL),
        result=ScoreResult(score=6.5, comment="internal", model="m"),
    )
    broker = make_broker(StatusSettings.model_validate({"RABBITMQ_URL": amqp_url}))
    async with broker:
        await broker.connect()
        await publish_event(broker, completed, timeout=10)


async def test_a_gateway_with_the_key_reads_a_task_through_the_status_service(
    services: Services,
) -> None:
    submitted = await services.gateway.post("/v1/scores", json={"text": "read me"})
    assert submitted.status_code == 202, submitted.text
    task_id = submitted.json()["task_id"]
    await _complete(services.amqp_url, task_id)

    async def completed() -> dict[str, Any] | None:
        view: dict[str, Any] = (await services.gateway.get(f"/v1/scores/{task_id}")).json()
        return view if view.get("status") == "completed" else None

    view = await eventually(completed, what="the completed task read through the status service")
    assert view["result"]["score"] == 6.5
    unknown = await services.gateway.get(f"/v1/scores/{uuid.uuid4().hex}")
    assert unknown.status_code == 404, unknown.text  # the status service's answer, not a 503


async def test_a_gateway_with_the_key_reads_usage_through_the_scheduler(
    services: Services,
) -> None:
    response = await services.gateway.get("/v1/usage")
    assert response.status_code == 200, response.text
    assert response.json()["tenant_id"] == "default"


async def test_a_gateway_with_the_key_reads_webhook_settings_through_the_notifier(
    services: Services,
) -> None:
    response = await services.gateway.get("/v1/webhooks/secret")
    assert response.status_code == 200, response.text
    assert response.json()["secret"].startswith("whsec_")


def _internal_calls() -> list[tuple[str, str, str]]:
    """(service, method, path) of every internal route each service documents, its path
    parameters filled in: a route added without the guard is found here."""
    apps = _service_apps({"INTERNAL_API_KEY": INTERNAL_KEY})
    return [
        (service, method.upper(), re.sub(r"\{[^}]+\}", "default", path))
        for service, app in apps.items()
        for path, operations in app.openapi()["paths"].items()
        if path.startswith("/internal/")
        for method in sorted(operations)
    ]


INTERNAL_CALLS = _internal_calls()
REFUSED = {
    "no-key": {},
    "wrong-key": {"Authorization": "Bearer not-the-internal-key"},
    "admin-key": {"Authorization": f"Bearer {ADMIN_KEY}"},
    "api-key": {"Authorization": f"Bearer {API_KEY}"},
}


def test_every_service_serves_internal_routes() -> None:
    assert {service for service, _, _ in INTERNAL_CALLS} == set(SERVICES)
    assert len(INTERNAL_CALLS) == 9


@pytest.mark.parametrize("headers", REFUSED.values(), ids=REFUSED.keys())
@pytest.mark.parametrize(
    ("service", "method", "path"), INTERNAL_CALLS, ids=[" ".join(c) for c in INTERNAL_CALLS]
)
async def test_every_internal_route_refuses_a_call_without_the_internal_key(
    services: Services, service: str, method: str, path: str, headers: dict[str, str]
) -> None:
    async with _in_process(services.apps[service]) as bare:
        response = await bare.request(method, path, headers=headers)
    assert response.status_code == 401, response.text
    assert response.headers["content-type"].startswith(PROBLEM_JSON)
    assert response.headers["www-authenticate"].startswith('Bearer realm="scorebox-internal"')
    assert "INTERNAL_API_KEY" in response.json()["detail"]


@pytest.mark.parametrize(
    ("service", "method", "path"), INTERNAL_CALLS, ids=[" ".join(c) for c in INTERNAL_CALLS]
)
async def test_every_internal_route_refuses_the_internal_key_sent_twice(
    services: Services, service: str, method: str, path: str
) -> None:
    """Of two `Authorization` headers the first was taken (found in a walkthrough): the
    internal key and then any other was admitted. The admin and metrics guards read the
    header alike (`shared.http.BearerScheme`; `tests/unit/test_repeated_headers.py`)."""
    headers = [("Authorization", f"Bearer {INTERNAL_KEY}"), ("Authorization", "Bearer other")]
    async with _in_process(services.apps[service]) as bare:
        response = await bare.request(method, path, headers=headers)
    assert response.status_code == 400, response.text
    assert response.headers["content-type"].startswith(PROBLEM_JSON)
    assert "Authorization was sent more than once" in response.json()["detail"]


@pytest.mark.parametrize(
    ("service", "path"),
    [
        ("status", "/internal/v1/tasks/unknown?tenant_id=default"),
        ("scheduler", "/internal/v1/usage?tenant_id=default&from=2030-01-01&to=2030-01-31"),
        ("notifier", "/internal/v1/tenants/default/failure-alert"),
    ],
)
async def test_the_same_call_with_the_internal_key_is_answered(
    services: Services, service: str, path: str
) -> None:
    headers = {"Authorization": f"Bearer {INTERNAL_KEY}"}
    async with _in_process(services.apps[service]) as bare:
        with_key = await bare.get(path, headers=headers)
        without = await bare.get(path)
    assert with_key.status_code in (200, 404), with_key.text  # the route's own answer
    assert without.status_code == 401, without.text


async def test_a_gateway_without_the_key_is_refused_and_says_why(
    services: Services, caplog: pytest.LogCaptureFixture
) -> None:
    keyless = {name: value for name, value in services.env.items() if name != "INTERNAL_API_KEY"}
    with caplog.at_level(logging.ERROR, logger="scorebox.http"):
        async with running(_gateway(keyless, services.apps)) as gateway:
            gateway.headers["Authorization"] = f"Bearer {API_KEY}"
            task = await gateway.get(f"/v1/scores/{uuid.uuid4().hex}")
            usage = await gateway.get("/v1/usage")
            secret = await gateway.get("/v1/webhooks/secret")
    for response in (task, usage, secret):
        assert response.status_code == 503, response.text
        assert response.headers["content-type"].startswith(PROBLEM_JSON)
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    for service in ("status service", "scheduler", "notifier"):
        assert any(message.startswith(f"the {service} refused") for message in refused), refused


@pytest.mark.parametrize(("key", "warnings"), [("", 1), (INTERNAL_KEY, 0)], ids=["open", "keyed"])
async def test_a_service_whose_internal_routes_are_open_warns_once_at_start(
    services: Services, caplog: pytest.LogCaptureFixture, key: str, warnings: int
) -> None:
    env = {**services.env, "INTERNAL_API_KEY": key}
    with caplog.at_level(logging.WARNING, logger="scorebox.http"):
        for service, app in _service_apps(env).items():
            caplog.clear()
            async with running(app):
                pass
            said = [r for r in caplog.records if OPEN_WARNING in r.getMessage()]
            assert len(said) == warnings, (service, [r.getMessage() for r in said])
