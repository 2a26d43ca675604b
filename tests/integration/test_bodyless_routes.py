"""The DELETE routes of every service, and the notifier's internal rotation, refuse a request
body as the other routes that take none do (`shared.bodies.refuse_a_body`): ignored, a body
(a malformed one included) went unnoticed while the request removed what it named. On the
real broker and database: a refused request (401 first without the key, then 422 naming the
body) leaves the dead letter in its DLQ, the key valid, the failure alert registered and the
signing secret as it was; what clients send for "no body" is taken as none, and the route
removes (or rotates) what it names.

The services run in-process once for the module, each holding its keys, the gateway reaching
the notifier and the scheduler in-process (`test_internal_auth.services`). Each test puts its
own letter, key, alert or tenant in place first, and reads it back through the services."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.integration import test_internal_auth, test_scheduler
from tests.integration.test_dead_letter_drop import _commands, _dead_letter
from tests.integration.test_internal_auth import (
    ADMIN_KEY,
    API_KEY,
    INTERNAL_KEY,
    Services,
    _in_process,
)
from tests.integration.test_scheduler import Env, Mongo
from tests.integration.test_scheduler_dead_letters import _dead_letter as _cron_dead_letter
from tests.integration.test_scheduler_dead_letters import _dead_run

services = test_internal_auth.services  # fixtures
mongo_client = test_scheduler.mongo_client

Json = dict[str, Any]
JSON_TYPE = {"Content-Type": "application/json"}
GATEWAY_LETTERS = "/admin/v1/dead-letters"
CRON_LETTERS = "/admin/v1/cron/dead-letters"
REFUSED_BODIES = {
    "malformed": b"{bad",
    "cut-off": b'{"cut_off": "2030-01-01T00:00:00Z"}',
    "spaced-long": b"{}" + b" " * 100,  # past the 64 bytes read: a body, whatever it holds
}
NO_BODIES = {"empty": b"", "empty-object": b"{}", "null": b"null", "spaced": b" {} \n"}


@dataclass
class Parts:
    """A client of each service (the gateway's sends the API key unless told otherwise), and
    what puts a cron dead letter on the real broker."""

    clients: dict[str, httpx.AsyncClient]
    amqp_url: str
    cron: Env


@pytest.fixture(scope="module")
async def parts(services: Services, mongo_client: Mongo) -> AsyncIterator[Parts]:
    env = services.env
    cron = Env(services.amqp_url, env["MONGO_URL"], env["MONGO_DB_PREFIX"], mongo_client)
    async with (
        _in_process(services.apps["scheduler"]) as scheduler,
        _in_process(services.apps["notifier"]) as notifier,
    ):
        clients = {"gateway": services.gateway, "scheduler": scheduler, "notifier": notifier}
        yield Parts(clients, services.amqp_url, cron)


async def _call(
    client: httpx.AsyncClient, method: str, path: str, *, key: str | None, body: bytes = b""
) -> httpx.Response:
    """A request with `key` as its bearer token, or with no Authorization header at all."""
    request = client.build_request(method, path, content=body, headers=JSON_TYPE)
    if key is None:
        request.headers.pop("Authorization", None)
    else:
        request.headers["Authorization"] = f"Bearer {key}"
    return await client.send(request)


def _read(answer: httpx.Response, *statuses: int) -> Json:
    assert answer.status_code in statuses, answer.text
    body: Json = answer.json() if answer.content else {}
    return body


@dataclass(frozen=True)
class Target:
    """What a route acts on, in place on the real store: the request's path; whether it is as
    it was put (`untouched`), and whether the route did its work on it (`done`)."""

    path: str
    untouched: Callable[[], Awaitable[bool]]
    done: Callable[[], Awaitable[bool]]


async def _listed(client: httpx.AsyncClient, path: str, field: str, wanted: str) -> bool:
    """Whether a DLQ's listing (a walk of the real queue, consuming nothing) shows `wanted`."""
    listing = _read(await _call(client, "GET", path, key=ADMIN_KEY), 200)
    return wanted in {item[field] for item in listing["items"]}


async def _gateway_letter(parts: Parts, *, by_id: bool) -> Target:
    (command,) = _commands(1)
    await _dead_letter(parts.amqp_url, [command])
    gateway = parts.clients["gateway"]

    async def listed() -> bool:
        return await _listed(gateway, GATEWAY_LETTERS, "task_id", command.task_id)

    async def gone() -> bool:
        return not await listed()

    path = f"{GATEWAY_LETTERS}/{command.task_id}" if by_id else GATEWAY_LETTERS
    return Target(path, listed, gone)


async def _cron_letter(parts: Parts, *, by_id: bool) -> Target:
    run = _dead_run()
    await _cron_dead_letter(parts.cron, run)
    scheduler = parts.clients["scheduler"]

    async def listed() -> bool:
        return await _listed(scheduler, CRON_LETTERS, "run_id", run.run_id)

    async def gone() -> bool:
        return not await listed()

    path = f"{CRON_LETTERS}/{run.run_id}" if by_id else CRON_LETTERS
    return Target(path, listed, gone)


async def _gateway_drop(parts: Parts) -> Target:
    return await _gateway_letter(parts, by_id=True)


async def _gateway_purge(parts: Parts) -> Target:
    return await _gateway_letter(parts, by_id=False)


async def _cron_drop(parts: Parts) -> Target:
    return await _cron_letter(parts, by_id=True)


async def _cron_purge(parts: Parts) -> Target:
    return await _cron_letter(parts, by_id=False)


async def _api_key(parts: Parts) -> Target:
    """A key of a tenant of its own, created through the admin API; it is valid while the
    gateway admits a call made with it."""
    gateway = parts.clients["gateway"]
    tenant_id = f"bodyless-{uuid.uuid4().hex[:8]}"
    created = _read(
        await _call(
            gateway,
            "POST",
            "/admin/v1/keys",
            key=ADMIN_KEY,
            body=f'{{"tenant_id": "{tenant_id}"}}'.encode(),
        ),
        201,
    )

    async def admitted() -> int:
        return (await _call(gateway, "GET", "/v1/usage", key=created["key"])).status_code

    async def valid() -> bool:
        return await admitted() == 200

    async def revoked() -> bool:
        return await admitted() == 401

    return Target(f"/admin/v1/keys/{created['key_id']}", valid, revoked)


def _alert_url() -> str:
    return f"https://hooks.example.com/alerts/{uuid.uuid4().hex[:12]}"


async def _failure_alert(client: httpx.AsyncClient, path: str, key: str) -> Target:
    """A failure alert registered at `path` (through the gateway, or the notifier's own API),
    read back there."""
    url = _alert_url()
    body = f'{{"url": "{url}"}}'.encode()
    assert _read(await _call(client, "PUT", path, key=key, body=body), 200) == {"url": url}

    async def registered() -> bool:
        answer = await _call(client, "GET", path, key=key)
        return answer.status_code == 200 and answer.json() == {"url": url}

    async def removed() -> bool:
        return (await _call(client, "GET", path, key=key)).status_code == 404

    return Target(path, registered, removed)


async def _gateway_failure_alert(parts: Parts) -> Target:
    """The alert of the API key's tenant, through the gateway and the real notifier."""
    return await _failure_alert(parts.clients["gateway"], "/v1/webhooks/failure-alert", API_KEY)


def _tenant_path() -> str:
    return f"/internal/v1/tenants/bodyless-{uuid.uuid4().hex[:8]}"


async def _notifier_failure_alert(parts: Parts) -> Target:
    path = f"{_tenant_path()}/failure-alert"
    return await _failure_alert(parts.clients["notifier"], path, INTERNAL_KEY)


async def _signing_secret(parts: Parts) -> Target:
    """A tenant's signing secret, created at its first read."""
    notifier = parts.clients["notifier"]
    secret_path = f"{_tenant_path()}/webhook-secret"

    async def current() -> Json:
        return _read(await _call(notifier, "GET", secret_path, key=INTERNAL_KEY), 200)

    first = await current()

    async def unchanged() -> bool:
        return await current() == first

    async def rotated() -> bool:
        now = await current()
        return now["secret"] != first["secret"] and now["previous_valid_until"] is not None

    return Target(f"{secret_path}/rotate", unchanged, rotated)


@dataclass(frozen=True)
class Route:
    method: str
    service: str
    key: str
    outcome: str  # how its refusal's detail ends: "nothing was <outcome>"
    target: Callable[[Parts], Awaitable[Target]]


ROUTES = {
    "gateway: drop a dead letter": Route("DELETE", "gateway", ADMIN_KEY, "removed", _gateway_drop),
    "gateway: purge the dead letters": Route(
        "DELETE", "gateway", ADMIN_KEY, "removed", _gateway_purge
    ),
    "gateway: revoke a key": Route("DELETE", "gateway", ADMIN_KEY, "revoked", _api_key),
    "gateway: remove the failure alert": Route(
        "DELETE", "gateway", API_KEY, "removed", _gateway_failure_alert
    ),
    "scheduler: drop a cron dead letter": Route(
        "DELETE", "scheduler", ADMIN_KEY, "removed", _cron_drop
    ),
    "scheduler: purge the cron dead letters": Route(
        "DELETE", "scheduler", ADMIN_KEY, "removed", _cron_purge
    ),
    "notifier: remove a failure alert": Route(
        "DELETE", "notifier", INTERNAL_KEY, "removed", _notifier_failure_alert
    ),
    "notifier: rotate the signing secret": Route(
        "POST", "notifier", INTERNAL_KEY, "changed", _signing_secret
    ),
}


@pytest.mark.parametrize("route", ROUTES.values(), ids=ROUTES.keys())
@pytest.mark.parametrize("body", REFUSED_BODIES.values(), ids=REFUSED_BODIES.keys())
async def test_a_body_is_refused_after_the_key_check_and_nothing_is_done(
    parts: Parts, route: Route, body: bytes
) -> None:
    target = await route.target(parts)
    assert await target.untouched(), "the route's target is in place"
    client = parts.clients[route.service]

    keyless = await _call(client, route.method, target.path, key=None, body=body)
    refused = await _call(client, route.method, target.path, key=route.key, body=body)

    assert keyless.status_code == 401, keyless.text  # the key is checked first
    assert refused.status_code == 422, refused.text
    assert refused.headers["content-type"] == "application/problem+json"
    problem: Json = refused.json()
    assert problem["detail"] == (
        f"body: this route takes no request body; send none; nothing was {route.outcome}."
    )
    assert problem["errors"] == [
        {"field": "body", "message": "this route takes no request body; send none"}
    ]
    assert await target.untouched(), "a refused request changed the store"


@pytest.mark.parametrize("route", ROUTES.values(), ids=ROUTES.keys())
@pytest.mark.parametrize("body", NO_BODIES.values(), ids=NO_BODIES.keys())
async def test_what_clients_send_for_no_body_is_taken_as_none(
    parts: Parts, route: Route, body: bytes
) -> None:
    target = await route.target(parts)
    client = parts.clients[route.service]

    answer = await _call(client, route.method, target.path, key=route.key, body=body)

    assert answer.status_code in (200, 204), answer.text
    assert await target.done(), answer.text


PIECE = 64 * 1024  # the streamed body's pieces


@dataclass
class Streamed:
    """A body of `pieces` pieces of `PIECE` bytes (a JSON object's start, then its string),
    counting the bytes the server pulled."""

    pieces: int
    pulled: int = 0

    @property
    def size(self) -> int:
        return self.pieces * PIECE

    async def __aiter__(self) -> AsyncIterator[bytes]:
        start = b'{"pad": "'
        for index in range(self.pieces):
            piece = start + b"x" * (PIECE - len(start)) if index == 0 else b"x" * PIECE
            self.pulled += len(piece)
            yield piece


@pytest.mark.parametrize("route", ROUTES.values(), ids=ROUTES.keys())
@pytest.mark.parametrize("declared", [True, False], ids=["declared", "chunked"])
async def test_a_large_body_is_refused_unread_and_nothing_is_done(
    parts: Parts, route: Route, declared: bool
) -> None:
    """The whole body was read to be refused: 300 MiB sent with a tenant's key to remove its
    failure alert took the gateway's memory from 116 to 424 MB. Its declared length, or its
    first piece past 64 bytes, refuses it now."""
    target = await route.target(parts)
    client = parts.clients[route.service]
    body = Streamed(pieces=64)  # 4 MiB
    headers = {**JSON_TYPE, "Authorization": f"Bearer {route.key}"}
    if declared:
        headers["Content-Length"] = str(body.size)

    refused = await client.request(route.method, target.path, content=body, headers=headers)

    assert refused.status_code == 422, refused.text
    assert refused.json()["detail"] == (
        f"body: this route takes no request body; send none; nothing was {route.outcome}."
    )
    read_at_most = 0 if declared else PIECE  # the piece that went past 64 bytes
    assert body.pulled <= read_at_most, f"{body.pulled:,} bytes of {body.size:,} read"
    assert await target.untouched(), "a refused request changed the store"
