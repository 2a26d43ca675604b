"""The metrics key (`METRICS_API_KEY`) on every service's `GET /metrics`: the setting every
service reads, the guard of the internal services' `/metrics` (open, with a warning, while the
key is unset), the gateway's (unchanged: disabled without a key), and the OpenAPI documents
that declare it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from pydantic import SecretStr, ValidationError
from pydantic_settings import BaseSettings

from services.gateway.app import create_app as create_gateway
from services.gateway.settings import GatewaySettings
from services.notifier.app import create_app as create_notifier
from services.notifier.settings import NotifierSettings
from services.scheduler.app import create_app as create_scheduler
from services.scheduler.config import parse_config
from services.scheduler.settings import SchedulerSettings
from services.scorer.app import create_app as create_scorer
from services.scorer.model.settings import ModelSettings
from services.scorer.settings import ScorerSettings
from services.status.app import create_app as create_status
from services.status.settings import StatusSettings
from shared.http import PROBLEM_JSON
from shared.settings import MetricsApiSettings

METRICS_KEY = "metrics-key-0123456789"
ADMIN_KEY = "admin-key-0123456789"
INTERNAL_KEY = "internal-key-0123456789"
OPEN_WARNING = "METRICS_API_KEY is not set"
GATEWAY_HINT = "Send 'Authorization: Bearer <METRICS_API_KEY>' (or the admin key)."

Json = dict[str, Any]
ServiceApp = Callable[[dict[str, str]], FastAPI]


def _status(env: dict[str, str]) -> FastAPI:
    return create_status(StatusSettings.model_validate(env))


def _scorer(env: dict[str, str]) -> FastAPI:
    return create_scorer(ScorerSettings.model_validate(env), ModelSettings.model_validate(env))


def _scheduler(env: dict[str, str]) -> FastAPI:
    return create_scheduler(SchedulerSettings.model_validate(env), config=parse_config({}, {}))


def _notifier(env: dict[str, str]) -> FastAPI:
    return create_notifier(NotifierSettings.model_validate(env))


def _gateway(env: dict[str, str]) -> FastAPI:
    return create_gateway(GatewaySettings.model_validate(env))


# The services other than the gateway, by the name their warning gives them, and whether they
# hold ADMIN_API_KEY (the scheduler's admin API), which then opens their `/metrics` too.
INTERNAL_SERVICES = [
    pytest.param(_status, "status service", False, id="status"),
    pytest.param(_scorer, "scorer", False, id="scorer"),
    pytest.param(_scheduler, "scheduler", True, id="scheduler"),
    pytest.param(_notifier, "notifier", True, id="notifier"),
]
EVERY_SETTINGS: list[type[MetricsApiSettings]] = [
    StatusSettings,
    ScorerSettings,
    SchedulerSettings,
    NotifierSettings,
    GatewaySettings,
]
KEYED = {"METRICS_API_KEY": METRICS_KEY, "ADMIN_API_KEY": ADMIN_KEY}


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _scrape(app: FastAPI, headers: dict[str, str] | None = None) -> httpx.Response:
    """`GET /metrics` of an app built but not started: the exposition needs no broker."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://metrics.test") as client:
        return await client.get("/metrics", headers=headers or {})


def _refused(response: httpx.Response) -> Json:
    assert response.status_code == 401, response.text
    assert response.headers["content-type"].startswith(PROBLEM_JSON)
    assert response.headers["www-authenticate"].startswith('Bearer realm="scorebox-metrics"')
    body: Json = response.json()
    assert (body["status"], body["title"], body["instance"]) == (401, "Unauthorized", "/metrics")
    return body


def _exposition(response: httpx.Response) -> None:
    assert response.status_code == 200, response.text
    assert "# TYPE scorebox_deliveries_total counter" in response.text


@pytest.mark.parametrize(("make_app", "service", "holds_admin"), INTERNAL_SERVICES)
async def test_a_services_metrics_with_a_key_refuse_no_key_and_a_wrong_one(
    make_app: ServiceApp, service: str, holds_admin: bool
) -> None:
    app = make_app(KEYED)
    for headers in ({}, _bearer("not-the-metrics-key"), {"Authorization": METRICS_KEY}):
        body = _refused(await _scrape(app, headers))
        assert "METRICS_API_KEY" in body["detail"]
        # The gateway's words, but for the admin key where the service holds none.
        expected = GATEWAY_HINT if holds_admin else GATEWAY_HINT.replace(" (or the admin key)", "")
        assert body["detail"] == expected, service


@pytest.mark.parametrize(("make_app", "service", "holds_admin"), INTERNAL_SERVICES)
async def test_a_services_metrics_with_a_key_admit_it_and_the_admin_key_where_held(
    make_app: ServiceApp, service: str, holds_admin: bool
) -> None:
    app = make_app(KEYED)
    _exposition(await _scrape(app, _bearer(METRICS_KEY)))
    admin = await _scrape(app, _bearer(ADMIN_KEY))
    if holds_admin:
        _exposition(admin)
    else:
        _refused(admin)


@pytest.mark.parametrize(("make_app", "service", "holds_admin"), INTERNAL_SERVICES)
@pytest.mark.parametrize("unset", [{}, {"METRICS_API_KEY": ""}], ids=["unset", "empty"])
async def test_a_services_metrics_without_a_key_stay_open(
    make_app: ServiceApp, service: str, holds_admin: bool, unset: dict[str, str]
) -> None:
    """As before the key existed: a scraper sending nothing, or anything, is answered."""
    app = make_app({"ADMIN_API_KEY": ADMIN_KEY, **unset})
    _exposition(await _scrape(app))
    _exposition(await _scrape(app, _bearer("anything")))


@pytest.mark.parametrize(("make_app", "service", "holds_admin"), INTERNAL_SERVICES)
@pytest.mark.parametrize(("env", "warnings"), [({}, 1), (KEYED, 0)], ids=["open", "keyed"])
def test_a_service_whose_metrics_are_open_warns_once_at_start(
    caplog: pytest.LogCaptureFixture,
    make_app: ServiceApp,
    service: str,
    holds_admin: bool,
    env: dict[str, str],
    warnings: int,
) -> None:
    with caplog.at_level(logging.WARNING, logger="scorebox.http"):
        make_app(env)
    said = [r.getMessage() for r in caplog.records if OPEN_WARNING in r.getMessage()]
    assert len(said) == warnings, said
    assert all(f"the {service}'s /metrics answers anyone" in message for message in said)


async def test_the_gateways_metrics_are_still_disabled_without_a_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The one service facing the internet: never open, and so nothing to warn of."""
    with caplog.at_level(logging.WARNING, logger="scorebox.http"):
        app = _gateway({})
    disabled = await _scrape(app)
    assert disabled.status_code == 403, disabled.text
    assert disabled.json()["detail"] == (
        "Metrics are disabled: set METRICS_API_KEY (or ADMIN_API_KEY)."
    )
    assert not [r for r in caplog.records if OPEN_WARNING in r.getMessage()]


async def test_the_gateways_metrics_take_the_metrics_key_or_the_admin_key() -> None:
    app = _gateway(KEYED)
    assert _refused(await _scrape(app))["detail"] == GATEWAY_HINT
    _refused(await _scrape(app, _bearer("not-the-metrics-key")))
    _exposition(await _scrape(app, _bearer(METRICS_KEY)))
    _exposition(await _scrape(app, _bearer(ADMIN_KEY)))


GUARDED_DOCUMENTS = [
    pytest.param(_status, "", id="status"),
    pytest.param(_scorer, "", id="scorer"),
    pytest.param(_scheduler, " (or the admin key)", id="scheduler"),
    pytest.param(_notifier, " (or the admin key)", id="notifier"),
    pytest.param(_gateway, " (or the admin key)", id="gateway"),
]


@pytest.mark.parametrize(("make_app", "admin_too"), GUARDED_DOCUMENTS)
def test_a_guarded_metrics_route_declares_the_metrics_key(
    make_app: ServiceApp, admin_too: str
) -> None:
    document = make_app(KEYED).openapi()
    scheme = document["components"]["securitySchemes"]["MetricsKey"]
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")
    assert scheme["description"] == f"`Authorization: Bearer <METRICS_API_KEY>`{admin_too}."
    operation = document["paths"]["/metrics"]["get"]
    assert operation["security"] == [{"MetricsKey": []}]
    assert PROBLEM_JSON in operation["responses"]["401"]["content"]
    assert "text/plain" in operation["responses"]["200"]["content"]
    parameters = {p["name"].lower() for p in operation.get("parameters", [])}
    assert "authorization" not in parameters


def test_the_gateways_metrics_document_their_disabled_answer() -> None:
    operation = _gateway({}).openapi()["paths"]["/metrics"]["get"]
    assert PROBLEM_JSON in operation["responses"]["403"]["content"]
    assert "METRICS_API_KEY" in operation["responses"]["403"]["description"]


@pytest.mark.parametrize(("make_app", "service", "holds_admin"), INTERNAL_SERVICES)
def test_open_metrics_stay_out_of_the_document(
    make_app: ServiceApp, service: str, holds_admin: bool
) -> None:
    document = make_app({"ADMIN_API_KEY": ADMIN_KEY}).openapi()
    assert "/metrics" not in document["paths"]
    assert "MetricsKey" not in document.get("components", {}).get("securitySchemes", {})


@pytest.mark.parametrize("settings", EVERY_SETTINGS, ids=lambda settings: settings.__name__)
def test_every_service_reads_the_metrics_key(settings: type[BaseSettings]) -> None:
    read = settings.model_validate({"METRICS_API_KEY": f"  {METRICS_KEY}\n"})
    assert isinstance(read, MetricsApiSettings)
    assert read.metrics_api_key == SecretStr(METRICS_KEY)  # a secret file's newline dropped
    assert METRICS_KEY not in repr(read)
    for unset in ({}, {"METRICS_API_KEY": ""}, {"METRICS_API_KEY": "  "}):
        empty = settings.model_validate(unset)
        assert isinstance(empty, MetricsApiSettings)
        assert empty.metrics_api_key is None


@pytest.mark.parametrize("settings", EVERY_SETTINGS, ids=lambda settings: settings.__name__)
@pytest.mark.parametrize(
    "value", ["two words", "line\nbreak", "clé-métriques"], ids=["space", "newline", "not-ascii"]
)
def test_a_metrics_key_no_header_can_carry_is_refused_at_start(
    settings: type[BaseSettings], value: str
) -> None:
    with pytest.raises(ValidationError, match="METRICS_API_KEY") as refused:
        settings.model_validate({"METRICS_API_KEY": value})
    assert value not in str(refused.value)


@pytest.mark.parametrize(
    "settings",
    [StatusSettings, SchedulerSettings, NotifierSettings, GatewaySettings],
    ids=lambda settings: settings.__name__,
)
def test_every_service_refuses_an_internal_key_equal_to_the_metrics_key(
    settings: type[BaseSettings],
) -> None:
    """Every one of them holds both now: the scraper's key would open the internal routes."""
    with pytest.raises(ValidationError, match="must differ from METRICS_API_KEY"):
        settings.model_validate({"INTERNAL_API_KEY": INTERNAL_KEY, "METRICS_API_KEY": INTERNAL_KEY})
    apart = settings.model_validate({"INTERNAL_API_KEY": INTERNAL_KEY, **KEYED})
    assert isinstance(apart, MetricsApiSettings)


ADMIN_SETTINGS = [GatewaySettings, SchedulerSettings, NotifierSettings]


@pytest.mark.parametrize("settings", ADMIN_SETTINGS, ids=lambda settings: settings.__name__)
def test_every_admin_service_refuses_a_metrics_key_equal_to_the_admin_key(
    settings: type[BaseSettings],
) -> None:
    """The metrics key exists so that the scraper need not hold the admin key: one value for
    both handed it the admin API (found in review)."""
    with pytest.raises(ValidationError, match="METRICS_API_KEY must differ from ADMIN_API_KEY"):
        settings.model_validate({"ADMIN_API_KEY": ADMIN_KEY, "METRICS_API_KEY": ADMIN_KEY})
    with pytest.raises(ValidationError, match="METRICS_API_KEY must differ from ADMIN_API_KEY"):
        settings.model_validate({"ADMIN_API_KEY": f"{ADMIN_KEY}\n", "METRICS_API_KEY": ADMIN_KEY})
    settings.model_validate(KEYED)


@pytest.mark.parametrize("settings", ADMIN_SETTINGS, ids=lambda settings: settings.__name__)
@pytest.mark.parametrize(
    "value", ["two words", "line\nbreak", "clé-admin"], ids=["space", "newline", "not-ascii"]
)
def test_an_admin_key_no_header_can_carry_is_refused_at_start(
    settings: type[BaseSettings], value: str
) -> None:
    with pytest.raises(ValidationError, match="ADMIN_API_KEY") as refused:
        settings.model_validate({"ADMIN_API_KEY": value})
    assert value not in str(refused.value)
    blank = settings.model_validate({"ADMIN_API_KEY": "  "})
    assert getattr(blank, "admin_api_key", "missing") is None
