"""The internal key (`INTERNAL_API_KEY`): the guard of every service's `/internal/...` routes,
the setting that configures it, the gateway's clients that send it and the services' own
OpenAPI documents that declare it."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

import httpx
import pytest
from fastapi import APIRouter, FastAPI
from pydantic import SecretStr, ValidationError
from pydantic_settings import BaseSettings

from services.gateway.app import build_gateway
from services.gateway.app import create_app as create_gateway
from services.gateway.settings import GatewaySettings
from services.notifier.app import create_app as create_notifier
from services.notifier.settings import NotifierSettings
from services.scheduler.app import create_app as create_scheduler
from services.scheduler.config import parse_config
from services.scheduler.settings import SchedulerSettings
from services.status.app import create_app as create_status
from services.status.settings import StatusSettings
from shared.http import (
    PROBLEM_JSON,
    admin_guard,
    install_problem_handlers,
    internal_guard,
    internal_key_headers,
    warn_if_internal_routes_open,
)
from shared.settings import InternalApiSettings
from tests.support import running

INTERNAL_KEY = "internal-key-0123456789"
ADMIN_KEY = "admin-key-0123456789"
SETTINGS: list[type[InternalApiSettings]] = [
    StatusSettings,
    SchedulerSettings,
    NotifierSettings,
    GatewaySettings,
]

Json = dict[str, Any]


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def guarded_app(internal_key: str | None, admin_key: str | None = ADMIN_KEY) -> FastAPI:
    """An internal route and an admin route behind the shared guards, as a service has them."""
    app = FastAPI()
    install_problem_handlers(app)
    internal = APIRouter(
        prefix="/internal/v1",
        dependencies=[internal_guard(None if internal_key is None else SecretStr(internal_key))],
    )
    admin = APIRouter(
        prefix="/admin/v1",
        dependencies=[admin_guard(None if admin_key is None else SecretStr(admin_key))],
    )

    @internal.get("/thing")
    async def read_thing() -> dict[str, str]:
        return {"thing": "internal"}

    @admin.get("/thing")
    async def read_admin_thing() -> dict[str, str]:
        return {"thing": "admin"}

    app.include_router(internal)
    app.include_router(admin)
    return app


Headers = Mapping[str, str] | Mapping[bytes, bytes]
REALM_CHALLENGE = re.compile(r'Bearer realm="scorebox-(admin|internal)"(, error="invalid_token")?')


async def _get(app: FastAPI, path: str, headers: Headers | None = None) -> httpx.Response:
    async with running(app) as client:
        return await client.get(path, headers=headers or {})


def _assert_refused(response: httpx.Response) -> Json:
    assert response.status_code == 401, response.text
    assert response.headers["content-type"].startswith(PROBLEM_JSON)
    assert REALM_CHALLENGE.fullmatch(response.headers["www-authenticate"])
    body: Json = response.json()
    assert body["status"] == 401
    return body


async def test_the_internal_key_opens_the_internal_routes() -> None:
    response = await _get(guarded_app(INTERNAL_KEY), "/internal/v1/thing", _bearer(INTERNAL_KEY))
    assert response.status_code == 200, response.text
    assert response.json() == {"thing": "internal"}


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param({}, id="no-header"),
        pytest.param(_bearer("not-the-internal-key"), id="wrong-key"),
        pytest.param(_bearer(ADMIN_KEY), id="the-admin-key"),
        pytest.param({"Authorization": INTERNAL_KEY}, id="key-without-bearer"),
        pytest.param(_bearer(INTERNAL_KEY + "x"), id="key-with-a-suffix"),
        # Latin-1 on the wire, as a server decodes it (no 500 from the comparison).
        pytest.param({b"Authorization": "Bearer clé".encode("latin-1")}, id="not-ascii"),
    ],
)
async def test_anything_but_the_internal_key_is_refused_with_a_401_problem(
    headers: Headers,
) -> None:
    response = await _get(guarded_app(INTERNAL_KEY), "/internal/v1/thing", headers)
    body = _assert_refused(response)
    assert "INTERNAL_API_KEY" in body["detail"]
    assert body["instance"] == "/internal/v1/thing"


async def test_the_internal_guards_401_has_the_admin_guards_shape() -> None:
    app = guarded_app(INTERNAL_KEY)
    internal = _assert_refused(await _get(app, "/internal/v1/thing"))
    admin = _assert_refused(await _get(app, "/admin/v1/thing"))
    assert internal.keys() == admin.keys()
    assert (internal["type"], internal["title"]) == (admin["type"], admin["title"])


async def test_the_internal_key_does_not_open_the_admin_routes() -> None:
    app = guarded_app(INTERNAL_KEY)
    _assert_refused(await _get(app, "/admin/v1/thing", _bearer(INTERNAL_KEY)))
    admitted = await _get(app, "/admin/v1/thing", _bearer(ADMIN_KEY))
    assert admitted.json() == {"thing": "admin"}


@pytest.mark.parametrize(
    "written",
    [
        "bearer {key}",
        "BEARER {key}",
        "bEaReR {key}",
        "Bearer   {key}",
        "Bearer\t{key}",
        "Bearer \t {key}",
    ],
)
@pytest.mark.parametrize(
    ("path", "key"),
    [("/admin/v1/thing", ADMIN_KEY), ("/internal/v1/thing", INTERNAL_KEY)],
    ids=["admin", "internal"],
)
async def test_the_guards_take_the_scheme_in_any_case_and_blanks_before_the_key(
    written: str, path: str, key: str
) -> None:
    """RFC 9110 §11.1: the scheme is case-insensitive. The guards compared the header whole
    and refused what the public routes' key check took."""
    headers = {"Authorization": written.format(key=key)}
    response = await _get(guarded_app(INTERNAL_KEY), path, headers)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "written",
    [
        "Bearer",
        "Bearer ",
        "{key}",
        "Basic {key}",
        "Bearer{key}",
        "Bearer {key} {key}",
        "Bearer {key}x",
    ],
)
async def test_the_guards_still_refuse_what_is_not_the_bearer_key(written: str) -> None:
    headers = {"Authorization": written.format(key=ADMIN_KEY)}
    _assert_refused(await _get(guarded_app(INTERNAL_KEY), "/admin/v1/thing", headers))


async def test_without_an_internal_key_the_admin_routes_stay_shut_to_it() -> None:
    """Unset, the internal routes open; the admin routes still need the admin key."""
    app = guarded_app(None)
    _assert_refused(await _get(app, "/admin/v1/thing", _bearer(INTERNAL_KEY)))
    _assert_refused(await _get(app, "/admin/v1/thing"))


@pytest.mark.parametrize("internal_key", [None, ""], ids=["unset", "empty"])
@pytest.mark.parametrize(
    "headers", [{}, _bearer("anything"), _bearer(ADMIN_KEY)], ids=["none", "any", "admin"]
)
async def test_without_an_internal_key_the_internal_routes_are_open(
    internal_key: str | None, headers: dict[str, str]
) -> None:
    response = await _get(guarded_app(internal_key), "/internal/v1/thing", headers)
    assert response.status_code == 200, response.text
    assert response.json() == {"thing": "internal"}


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda settings: settings.__name__)
def test_every_service_of_the_internal_api_reads_the_key(settings: type[BaseSettings]) -> None:
    read = settings.model_validate({"INTERNAL_API_KEY": f"  {INTERNAL_KEY}\n"})
    assert isinstance(read, InternalApiSettings)
    assert read.internal_api_key == SecretStr(INTERNAL_KEY)  # a secret file's newline dropped
    assert INTERNAL_KEY not in repr(read)
    unset = settings.model_validate({})
    assert isinstance(unset, InternalApiSettings)
    assert unset.internal_api_key is None


@pytest.mark.parametrize("value", ["", "   "], ids=["empty", "blank"])
def test_an_empty_internal_key_is_no_key(value: str) -> None:
    """compose passes `${SCOREBOX_INTERNAL_KEY:-}`: empty when the operator sets none."""
    read = InternalApiSettings.model_validate({"INTERNAL_API_KEY": value})
    assert read.internal_api_key is None


@pytest.mark.parametrize(
    "value",
    ["two words", "tab\tinside", "line\nbreak", "clé-interne", "null\x00byte"],
    ids=["space", "tab", "newline", "not-ascii", "control"],
)
def test_an_internal_key_no_header_can_carry_is_refused_at_start(value: str) -> None:
    with pytest.raises(ValidationError, match="INTERNAL_API_KEY"):
        InternalApiSettings.model_validate({"INTERNAL_API_KEY": value})


@pytest.mark.parametrize(
    "settings", [GatewaySettings, SchedulerSettings], ids=["gateway", "scheduler"]
)
def test_an_internal_key_equal_to_the_admin_key_is_refused_at_start(
    settings: type[BaseSettings],
) -> None:
    """Every service holds the internal key: one value for both opened the admin API to
    anyone holding a service's settings."""
    with pytest.raises(ValidationError, match="must differ from ADMIN_API_KEY"):
        settings.model_validate({"INTERNAL_API_KEY": INTERNAL_KEY, "ADMIN_API_KEY": INTERNAL_KEY})
    apart = settings.model_validate({"INTERNAL_API_KEY": INTERNAL_KEY, "ADMIN_API_KEY": "other"})
    assert isinstance(apart, InternalApiSettings)


def test_a_refused_internal_key_is_not_printed() -> None:
    """The error of a key pasted with its scheme ('Bearer …') went whole to the service's
    log."""
    pasted = f"Bearer {INTERNAL_KEY}"
    with pytest.raises(ValidationError) as refused:
        GatewaySettings.model_validate({"INTERNAL_API_KEY": pasted})
    assert INTERNAL_KEY not in str(refused.value)


def test_the_caller_sends_the_key_only_when_it_is_configured() -> None:
    assert internal_key_headers(SecretStr(INTERNAL_KEY)) == _bearer(INTERNAL_KEY)
    assert internal_key_headers(None) == {}
    assert internal_key_headers(SecretStr("")) == {}


@pytest.mark.parametrize(
    ("key", "warnings"), [(None, 1), (SecretStr(""), 1), (SecretStr(INTERNAL_KEY), 0)]
)
def test_a_service_with_open_internal_routes_says_so(
    caplog: pytest.LogCaptureFixture, key: SecretStr | None, warnings: int
) -> None:
    with caplog.at_level(logging.WARNING):
        warn_if_internal_routes_open(key, "status service")
    said = [r for r in caplog.records if "INTERNAL_API_KEY is not set" in r.getMessage()]
    assert len(said) == warnings
    assert all("status service" in record.getMessage() for record in said)


def _transport() -> httpx.MockTransport:
    return httpx.MockTransport(lambda request: httpx.Response(200))


async def test_the_gateway_sends_the_internal_key_to_every_internal_service() -> None:
    settings = GatewaySettings.model_validate({"INTERNAL_API_KEY": INTERNAL_KEY})
    given = httpx.AsyncClient(transport=_transport())
    gateway = build_gateway(settings, scheduler_http=given)
    try:
        clients = (gateway.status_http, gateway.notifier_http, gateway.scheduler_http)
        assert gateway.scheduler_http is given  # a client passed in is given the key too
        for client in clients:
            assert client.headers["authorization"] == f"Bearer {INTERNAL_KEY}"
            assert client.timeout.read == 5.0  # the timeouts stay as they were
    finally:
        await gateway.close_clients()


async def test_a_gateway_without_an_internal_key_sends_none() -> None:
    gateway = build_gateway(GatewaySettings.model_validate({}))
    try:
        for client in (gateway.status_http, gateway.notifier_http, gateway.scheduler_http):
            assert "authorization" not in client.headers
    finally:
        await gateway.close_clients()


ServiceApp = Callable[[dict[str, str]], FastAPI]


def _status(env: dict[str, str]) -> FastAPI:
    return create_status(StatusSettings.model_validate(env))


def _scheduler(env: dict[str, str]) -> FastAPI:
    return create_scheduler(SchedulerSettings.model_validate(env), config=parse_config({}, {}))


def _notifier(env: dict[str, str]) -> FastAPI:
    return create_notifier(NotifierSettings.model_validate(env))


SERVICE_APPS = [
    pytest.param(_status, 3, id="status"),
    pytest.param(_scheduler, 1, id="scheduler"),
    pytest.param(_notifier, 5, id="notifier"),
]


def _operations(document: Json, prefix: str) -> list[tuple[str, Json]]:
    return [
        (f"{method.upper()} {path}", operation)
        for path, methods in document["paths"].items()
        if path.startswith(prefix)
        for method, operation in methods.items()
    ]


@pytest.mark.parametrize(("make_app", "count"), SERVICE_APPS)
def test_a_services_document_declares_the_internal_key_on_its_internal_routes(
    make_app: ServiceApp, count: int
) -> None:
    document = make_app({"INTERNAL_API_KEY": INTERNAL_KEY, "ADMIN_API_KEY": ADMIN_KEY}).openapi()
    scheme = document["components"]["securitySchemes"]["InternalKey"]
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")
    assert "INTERNAL_API_KEY" in scheme["description"]
    internal = _operations(document, "/internal/")
    assert len(internal) == count
    for name, operation in internal:
        assert operation.get("security") == [{"InternalKey": []}], name
        assert PROBLEM_JSON in operation["responses"]["401"]["content"], name
        parameters = {p["name"].lower() for p in operation.get("parameters", [])}
        assert "authorization" not in parameters, f"{name} lists the key as a parameter"
    admin = _operations(document, "/admin/")
    assert bool(admin) is (make_app is not _status)  # the status service has none
    for name, operation in admin:
        assert operation.get("security") == [{"AdminKey": []}], name


@pytest.mark.parametrize(("make_app", "count"), SERVICE_APPS)
def test_open_internal_routes_declare_no_key(make_app: ServiceApp, count: int) -> None:
    document = make_app({}).openapi()
    internal = _operations(document, "/internal/")
    assert len(internal) == count
    assert all("security" not in operation for _, operation in internal)
    assert "InternalKey" not in document.get("components", {}).get("securitySchemes", {})


def test_the_gateways_public_document_has_no_internal_route_or_key() -> None:
    settings = {"INTERNAL_API_KEY": INTERNAL_KEY, "ADMIN_API_KEY": ADMIN_KEY}
    document = create_gateway(GatewaySettings.model_validate(settings)).openapi()
    assert _operations(document, "/internal") == []
    assert "InternalKey" not in document["components"]["securitySchemes"]


@pytest.mark.parametrize(
    ("path", "realm"),
    [("/admin/v1/thing", "scorebox-admin"), ("/internal/v1/thing", "scorebox-internal")],
)
async def test_a_refusal_names_the_realm_of_the_key_due_and_whether_a_token_was_sent(
    path: str, realm: str
) -> None:
    """A tenant's API key is challenged for realm "scorebox": an operator's route names its
    own, so a client sending the wrong kind of key is told which is due (RFC 6750)."""
    app = guarded_app(INTERNAL_KEY)

    without = await _get(app, path)
    sent = await _get(app, path, _bearer("sbx_a_tenants_key"))

    assert without.headers["www-authenticate"] == f'Bearer realm="{realm}"'
    assert sent.headers["www-authenticate"] == f'Bearer realm="{realm}", error="invalid_token"'
