"""API keys on the real broker and database: who may call what, and what a key may see.

Gateway and status in-process (no scorer). Every test makes keys of its own tenants, so tests
never see each other's tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from pymongo import AsyncMongoClient

from services.gateway.keys import ApiKeys, KeyConflict, bootstrap_key, generate_key, parse_key
from services.notifier.app import create_app as create_notifier
from services.notifier.settings import NotifierSettings
from services.scheduler.app import create_app as create_scheduler
from services.scheduler.config import parse_config
from services.scheduler.settings import SchedulerSettings
from shared.contracts import utcnow
from tests.integration.in_process import gateway_and_status
from tests.support import eventually, queued_commands, running

ADMIN_KEY = "test-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
INTERNAL_KEY = "test-internal-key"
INTERNAL = {"Authorization": f"Bearer {INTERNAL_KEY}"}
OPEN_PATHS = {"/healthz", "/readyz", "/docs", "/docs/oauth2-redirect", "/openapi.json", "/redoc"}
SOME_ID = "0123456789abcdef0123456789abcdef"

Json = dict[str, Any]


@dataclass
class Stack:
    app: FastAPI
    api: httpx.AsyncClient
    amqp_url: str
    mongo: AsyncMongoClient[Json]
    db_prefix: str

    @property
    def gateway_db(self) -> Any:
        return self.mongo[f"{self.db_prefix}_gateway"]

    async def new_key(self, tenant_id: str, name: str = "") -> Json:
        response = await self.api.post(
            "/admin/v1/keys", json={"tenant_id": tenant_id, "name": name}, headers=ADMIN
        )
        assert response.status_code == 201, response.text
        created: Json = response.json()
        return created

    async def auth(self, tenant_id: str) -> dict[str, str]:
        """The headers of a fresh key of `tenant_id`."""
        created = await self.new_key(tenant_id)
        return {"Authorization": f"Bearer {created['key']}"}


@pytest.fixture(scope="module")
def env(amqp_url: str, mongo: Any, db_prefix: str) -> dict[str, str]:
    return {
        "RABBITMQ_URL": amqp_url,
        "MONGO_URL": mongo.url,
        "MONGO_DB_PREFIX": db_prefix,
        "ADMIN_API_KEY": ADMIN_KEY,
    }


@pytest.fixture(scope="module")
async def stack(
    env: dict[str, str], amqp_url: str, mongo: Any, db_prefix: str
) -> AsyncIterator[Stack]:
    async with gateway_and_status(env) as services:
        client: AsyncMongoClient[Json] = AsyncMongoClient(mongo.url, tz_aware=True)
        yield Stack(services.gateway, services.api, amqp_url, client, db_prefix)
        await client.close()


def _tenant(label: str) -> str:
    return f"{label}-{uuid.uuid4().hex[:8]}"


def _assert_problem(response: httpx.Response, status: int) -> Json:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body: Json = response.json()
    assert body["status"] == status
    assert body["detail"]
    return body


def _assert_unauthorized(response: httpx.Response) -> None:
    _assert_problem(response, 401)
    assert response.headers["www-authenticate"].startswith("Bearer")


def _without(body: Json, task_id: str) -> Json:
    """A problem body with the id it names blanked out, to compare two 404s."""
    return {k: v.replace(task_id, "<id>") if isinstance(v, str) else v for k, v in body.items()}


async def _assert_like_unknown(
    api: httpx.AsyncClient, path: str, foreign_id: str, headers: dict[str, str]
) -> None:
    """`path` with another tenant's id answers exactly as with an id nobody has."""
    unknown_id = uuid.uuid4().hex
    async with asyncio.timeout(15):
        foreign = await api.get(path.format(id=foreign_id), headers=headers)
        unknown = await api.get(path.format(id=unknown_id), headers=headers)
    assert foreign.status_code == unknown.status_code == 404, (foreign.text, unknown.text)
    assert _without(foreign.json(), foreign_id) == _without(unknown.json(), unknown_id)
    assert foreign.headers["content-type"] == unknown.headers["content-type"]


async def _public_routes(api: httpx.AsyncClient) -> list[tuple[str, str]]:
    """Every (method, path) the API documents, but health, docs, admin routes and the
    scraper's `/metrics` (the metrics or the admin key: `tests/unit/test_auth_metrics.py`)."""
    paths: dict[str, Json] = (await api.get("/openapi.json")).json()["paths"]
    return [
        (method.upper(), path)
        for path, operations in paths.items()
        if path not in OPEN_PATHS and path != "/metrics" and not path.startswith("/admin/")
        for method in operations
    ]


def _fill(path: str) -> str:
    while "{" in path:
        start, end = path.index("{"), path.index("}")
        path = path[:start] + SOME_ID + path[end + 1 :]
    return path


# --------------------------------------------------------------------------- who may call


async def test_health_and_docs_need_no_key(stack: Stack) -> None:
    for path in ("/healthz", "/readyz", "/docs", "/openapi.json"):
        response = await stack.api.get(path)
        assert response.status_code == 200, (path, response.text)
    schemes = (await stack.api.get("/openapi.json")).json()["components"]["securitySchemes"]
    assert any(s.get("scheme") == "bearer" for s in schemes.values())


async def test_every_other_route_needs_a_valid_key(stack: Stack) -> None:
    routes = await _public_routes(stack.api)
    assert ("POST", "/v1/scores") in routes
    assert ("GET", "/v1/scores/{task_id}") in routes
    revoked = await stack.new_key(_tenant("revoked"))
    await stack.api.delete(f"/admin/v1/keys/{revoked['key_id']}", headers=ADMIN)
    known = parse_key(revoked["key"])
    assert known is not None
    bad_credentials: list[dict[str, str]] = [
        {},
        {"Authorization": "Bearer"},
        {"Authorization": f"Basic {generate_key().token}"},
        {"Authorization": "Bearer not-a-key"},
        {"Authorization": f"Bearer {generate_key().token}"},  # well formed, unknown
        {"Authorization": f"Bearer sbx_{known.key_id}_{generate_key().secret}"},  # wrong secret
        {"Authorization": f"Bearer {revoked['key']}"},
        {"Authorization": f"Bearer {ADMIN_KEY}"},  # the admin key is no API key
        {"Authorization": 'Bearer {"$ne": null}'},
    ]
    for method, path in routes:
        for headers in bad_credentials:
            async with asyncio.timeout(15):
                response = await stack.api.request(
                    method, _fill(path), headers=headers, json={"text": "hi"}
                )
            assert response.status_code == 401, (method, path, headers, response.text)
            _assert_unauthorized(response)


async def test_a_valid_key_is_accepted_and_its_use_recorded(stack: Stack) -> None:
    tenant = _tenant("user")
    created = await stack.new_key(tenant, name="ci")
    headers = {"Authorization": f"Bearer {created['key']}"}
    submitted = await stack.api.post("/v1/scores", json={"text": "Hello."}, headers=headers)
    assert submitted.status_code == 202, submitted.text
    poll = await stack.api.get(submitted.json()["status_url"], headers=headers)
    assert poll.status_code == 200

    listing = await stack.api.get("/admin/v1/keys", params={"tenant_id": tenant}, headers=ADMIN)
    [item] = listing.json()["items"]
    assert item["key_id"] == created["key_id"]
    assert item["name"] == "ci"
    assert item["last_used_at"] is not None


async def test_a_wrong_secret_does_not_record_the_keys_use(stack: Stack) -> None:
    """A real key id with a wrong secret was refused but set the key's `last_used_at`: the
    read that found the key wrote it, before the secret was compared."""
    tenant = _tenant("wrong-secret")
    created = await stack.new_key(tenant)
    wrong = f"sbx_{created['key_id']}_{generate_key().secret}"
    path = f"/v1/scores/{SOME_ID}"
    _assert_unauthorized(await stack.api.get(path, headers={"Authorization": f"Bearer {wrong}"}))
    assert (await _key_listed(stack, tenant))["last_used_at"] is None

    # The key's read is cached now: the first request with its secret records the use.
    right = {"Authorization": f"Bearer {created['key']}"}
    assert (await stack.api.get(path, headers=right)).status_code == 404
    assert (await _key_listed(stack, tenant))["last_used_at"] is not None


async def _key_listed(stack: Stack, tenant: str) -> Json:
    listing = await stack.api.get("/admin/v1/keys", params={"tenant_id": tenant}, headers=ADMIN)
    items: list[Json] = listing.json()["items"]
    [item] = items
    return item


# --------------------------------------------------------------------------- admin routes


async def test_keys_are_created_listed_and_revoked(stack: Stack) -> None:
    tenant = _tenant("admin")
    first = await stack.new_key(tenant, name="one")
    second = await stack.new_key(tenant, name="two")
    other = await stack.new_key(_tenant("other"))
    for created in (first, second):
        issued = parse_key(created["key"])
        assert issued is not None
        assert issued.key_id == created["key_id"]
        assert created["tenant_id"] == tenant
        assert created["revoked_at"] is None

    listing = await stack.api.get("/admin/v1/keys", params={"tenant_id": tenant}, headers=ADMIN)
    assert listing.status_code == 200
    body = listing.json()
    assert body["count"] == 2
    assert [item["key_id"] for item in body["items"]] == [first["key_id"], second["key_id"]]
    everyone = (await stack.api.get("/admin/v1/keys", headers=ADMIN)).json()
    assert {first["key_id"], other["key_id"]} <= {item["key_id"] for item in everyone["items"]}
    for response in (listing.text, str(everyone)):
        for created in (first, second, other):
            issued = parse_key(created["key"])
            assert issued is not None
            assert issued.secret not in response
            assert hashlib.sha256(issued.secret.encode()).hexdigest() not in response
    assert all(set(item) >= {"key_id", "tenant_id", "name"} for item in body["items"])
    assert not any({"key", "secret", "secret_sha256"} & set(item) for item in body["items"])

    headers = {"Authorization": f"Bearer {first['key']}"}
    assert (await stack.api.get(f"/v1/scores/{SOME_ID}", headers=headers)).status_code == 404
    revoked = await stack.api.delete(f"/admin/v1/keys/{first['key_id']}", headers=ADMIN)
    assert revoked.status_code == 200
    assert revoked.json()["revoked_at"] is not None
    # Revoked on this replica: refused at once, not only after the cache TTL.
    _assert_unauthorized(await stack.api.get(f"/v1/scores/{SOME_ID}", headers=headers))
    again = await stack.api.delete(f"/admin/v1/keys/{first['key_id']}", headers=ADMIN)
    assert again.json()["revoked_at"] == revoked.json()["revoked_at"]
    # The tenant's other key still works.
    still = {"Authorization": f"Bearer {second['key']}"}
    assert (await stack.api.get(f"/v1/scores/{SOME_ID}", headers=still)).status_code == 404


async def test_only_hashes_are_stored(stack: Stack) -> None:
    created = await stack.new_key(_tenant("stored"), name="db")
    issued = parse_key(created["key"])
    assert issued is not None
    document = await stack.gateway_db["api_keys"].find_one({"_id": issued.key_id})
    assert document is not None
    assert document["secret_sha256"] == hashlib.sha256(issued.secret.encode()).hexdigest()
    assert issued.secret not in str(document)
    assert set(document) == {
        "_id",
        "tenant_id",
        "name",
        "secret_sha256",
        "created_at",
        "revoked_at",
        "last_used_at",
        "expires_at",
    }


async def test_admin_key_routes_need_the_admin_key(stack: Stack) -> None:
    api_key = await stack.auth(_tenant("notadmin"))
    for headers in ({}, api_key, {"Authorization": "Bearer wrong"}):
        _assert_unauthorized(
            await stack.api.post("/admin/v1/keys", json={"tenant_id": "x"}, headers=headers)
        )
        _assert_unauthorized(await stack.api.get("/admin/v1/keys", headers=headers))
        _assert_unauthorized(await stack.api.delete(f"/admin/v1/keys/{'0' * 16}", headers=headers))


@pytest.mark.parametrize("written", ["bearer {key}", "BEARER  {key}", "Bearer\t{key}"])
async def test_every_key_is_taken_with_its_scheme_in_any_case_and_blanks_before_it(
    stack: Stack, written: str
) -> None:
    """RFC 9110 §11.1: the scheme is case-insensitive. The admin guard compared the header
    whole: `bearer <admin key>` was a 401 where the public routes took `bearer <API key>`."""
    admin = {"Authorization": written.format(key=ADMIN_KEY)}
    assert (await stack.api.get("/admin/v1/keys", headers=admin)).status_code == 200
    created = await stack.new_key(_tenant("scheme"))
    public = {"Authorization": written.format(key=created["key"])}
    assert (await stack.api.get(f"/v1/scores/{SOME_ID}", headers=public)).status_code == 404


@pytest.mark.parametrize(
    "query",
    [
        "tenant=acme",  # misspelt: every tenant's keys were listed
        "tenant_id=acme&tenant_id=other",  # twice: the last was taken
        "tenant_id=acme&limit=5",
    ],
)
async def test_a_key_listing_refuses_other_or_repeated_query_parameters(
    stack: Stack, query: str
) -> None:
    await stack.new_key(_tenant("listed"))  # a key some listing would show
    problem = _assert_problem(await stack.api.get(f"/admin/v1/keys?{query}", headers=ADMIN), 422)
    assert problem["type"].endswith("/invalid-fields")
    assert "items" not in problem
    [error] = problem["errors"]
    assert error["field"] in ("query.tenant", "query.tenant_id", "query.limit")


# (service, method, path, the key that opens the route)
GUARDED_BODIES = {
    "gateway-keys": ("gateway", "POST", "/admin/v1/keys", ADMIN),
    "gateway-replay": ("gateway", "POST", "/admin/v1/dead-letters/replay", ADMIN),
    "scheduler-replay": ("scheduler", "POST", "/admin/v1/cron/dead-letters/replay", ADMIN),
    "notifier-alert": ("notifier", "PUT", "/internal/v1/tenants/acme/failure-alert", INTERNAL),
    "notifier-replay": ("notifier", "POST", "/admin/v1/webhooks/dead-letters/replay", ADMIN),
}


@contextlib.asynccontextmanager
async def _client_of(
    service: str, stack: Stack, env: dict[str, str]
) -> AsyncIterator[httpx.AsyncClient]:
    """The stack's gateway, or the scheduler or the notifier running on its broker and database,
    holding the internal key."""
    if service == "gateway":
        yield stack.api
        return
    keyed = {**env, "INTERNAL_API_KEY": INTERNAL_KEY}
    app = (
        create_scheduler(SchedulerSettings.model_validate(keyed), config=parse_config({}, {}))
        if service == "scheduler"
        else create_notifier(NotifierSettings.model_validate(keyed))
    )
    async with running(app) as client:
        yield client


@pytest.mark.parametrize(
    ("service", "method", "path", "key"), GUARDED_BODIES.values(), ids=GUARDED_BODIES.keys()
)
async def test_a_guarded_body_is_not_read_before_the_key_is_checked(
    stack: Stack,
    env: dict[str, str],
    service: str,
    method: str,
    path: str,
    key: dict[str, str],
) -> None:
    """A body declared as the route's parameter was read and parsed, whatever its size, before
    the router's key check: anyone could make the service hold hundreds of MB (seen: 200 MB of
    spaces, answered 422, not 401)."""
    sent: list[int] = []

    async def endless_spaces() -> AsyncIterator[bytes]:
        for _ in range(64):  # 4 MiB, past every guarded body's limit
            sent.append(1)
            yield b" " * 65_536

    as_json = {"Content-Type": "application/json"}
    async with _client_of(service, stack, env) as api:
        anonymous = await api.request(method, path, content=endless_spaces(), headers=as_json)
        _assert_unauthorized(anonymous)
        assert len(sent) < 64

        sent.clear()
        keyed = {**key, **as_json}
        too_big = await api.request(method, path, content=endless_spaces(), headers=keyed)
    _assert_problem(too_big, 413)
    assert len(sent) < 64


async def test_a_key_with_other_than_ascii_is_refused_not_a_500(stack: Stack) -> None:
    headers = {b"Authorization": "Bearer caf\xe9".encode("latin-1")}
    _assert_unauthorized(await stack.api.get("/admin/v1/keys", headers=headers))
    _assert_unauthorized(await stack.api.get(f"/v1/scores/{'0' * 32}", headers=headers))


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"tenant_id": ""},
        {"tenant_id": "$where"},
        {"tenant_id": "a.b"},
        {"tenant_id": "acme\n"},
        {"tenant_id": "x" * 65},
        {"tenant_id": {"$ne": None}},
        {"tenant_id": ["acme"]},
        {"tenant_id": "acme", "name": "n" * 201},
        {"tenant_id": "acme", "role": "admin"},
    ],
)
async def test_invalid_key_requests_are_422_and_create_nothing(stack: Stack, body: Json) -> None:
    before = await stack.gateway_db["api_keys"].count_documents({})
    _assert_problem(await stack.api.post("/admin/v1/keys", json=body, headers=ADMIN), 422)
    assert await stack.gateway_db["api_keys"].count_documents({}) == before


async def test_admin_queries_validate_ids(stack: Stack) -> None:
    for tenant_id in ("$ne", "a.b", '{"$gt": ""}'):
        response = await stack.api.get(
            "/admin/v1/keys", params={"tenant_id": tenant_id}, headers=ADMIN
        )
        _assert_problem(response, 422)
    for key_id in ("%24ne", "a.b", "0" * 15, "0" * 17, "0" * 16):
        _assert_problem(await stack.api.delete(f"/admin/v1/keys/{key_id}", headers=ADMIN), 404)


async def test_a_bootstrap_key_is_registered_once_and_never_silently_replaced(
    stack: Stack,
) -> None:
    keys = ApiKeys(stack.mongo, f"{stack.db_prefix}_gateway")
    token = generate_key().token
    issued = parse_key(token)
    assert issued is not None
    first = await bootstrap_key(keys, token, tenant_id="default", now=utcnow())
    stored = await keys.find(issued.key_id)
    again = await bootstrap_key(keys, token, tenant_id="default", now=utcnow())
    assert again == stored == await keys.find(issued.key_id)  # the first one, unchanged
    assert (first.key_id, first.tenant_id, first.active) == (issued.key_id, "default", True)
    assert await stack.gateway_db["api_keys"].count_documents({"_id": issued.key_id}) == 1

    same_id_other_secret = f"sbx_{issued.key_id}_{generate_key().secret}"
    with pytest.raises(KeyConflict):
        await bootstrap_key(keys, same_id_other_secret, tenant_id="default", now=utcnow())
    with pytest.raises(KeyConflict):
        await bootstrap_key(keys, token, tenant_id="someone-else", now=utcnow())
    with pytest.raises(ValueError, match=r"services\.gateway\.keys new"):
        await bootstrap_key(keys, "dev-secret", tenant_id="default", now=utcnow())

    await keys.revoke(issued.key_id, now=utcnow())
    after = await bootstrap_key(keys, token, tenant_id="default", now=utcnow())
    assert after.revoked_at is not None  # a restart does not undo a revocation

    headers = {"Authorization": f"Bearer {token}"}
    _assert_unauthorized(await stack.api.get(f"/v1/scores/{SOME_ID}", headers=headers))


# --------------------------------------------------------------------------- what a key sees


async def test_a_key_sees_only_its_own_tenants_tasks(stack: Stack) -> None:
    """Tenant A's key against tenant B's task on every route that takes a task or batch."""
    tenant_a, tenant_b = _tenant("a"), _tenant("b")
    key_a = await stack.new_key(tenant_a)
    key_b = await stack.new_key(tenant_b)
    a = {"Authorization": f"Bearer {key_a['key']}"}
    b = {"Authorization": f"Bearer {key_b['key']}"}
    idempotency = uuid.uuid4().hex
    body = {"text": "Tenant B's private text.", "metadata": {"owner": "b"}}

    submitted = await stack.api.post(
        "/v1/scores", json=body, headers={**b, "Idempotency-Key": idempotency}
    )
    assert submitted.status_code == 202, submitted.text
    task_b = submitted.json()["task_id"]

    task_routes = [
        "/v1/scores/{id}?wait=1",
        *(
            path.replace("{task_id}", "{id}")
            for method, path in await _public_routes(stack.api)
            if method == "GET" and "{task_id}" in path
        ),
    ]
    assert {"/v1/scores/{id}", "/v1/scores/{id}/events"} <= set(task_routes)

    # Before the status service has heard of it (the gateway's own record answers B) ...
    for path in task_routes:
        await _assert_like_unknown(stack.api, path, task_b, a)

    async def projected() -> Json | None:
        view: Json = (await stack.api.get(f"/v1/scores/{task_b}", headers=b)).json()
        return view if view.get("metadata") == {"owner": "b"} else None

    await eventually(projected, what="B's task in the status projection")
    # ... and after: either way A learns nothing, not even that the id exists.
    for path in task_routes:
        await _assert_like_unknown(stack.api, path, task_b, a)

    # The same Idempotency-Key and body from A is A's own, new task: no oracle there either.
    replay = await stack.api.post(
        "/v1/scores", json=body, headers={**a, "Idempotency-Key": idempotency}
    )
    assert replay.status_code == 202, replay.text
    task_a = replay.json()["task_id"]
    assert task_a != task_b
    again_b = await stack.api.post(
        "/v1/scores", json=body, headers={**b, "Idempotency-Key": idempotency}
    )
    assert again_b.status_code == 200
    assert again_b.json()["task_id"] == task_b
    for path in task_routes:
        await _assert_like_unknown(stack.api, path, task_a, b)

    # Batches: the batch, its tasks, and its Idempotency-Key.
    batch_key = uuid.uuid4().hex
    batch_body = {"items": [{"text": "One of B's."}, {"text": "Another of B's."}]}
    batch = await stack.api.post(
        "/v1/batches", json=batch_body, headers={**b, "Idempotency-Key": batch_key}
    )
    assert batch.status_code == 202, batch.text
    batch_b = batch.json()["batch_id"]
    assert (await stack.api.get(f"/v1/batches/{batch_b}", headers=b)).status_code == 200
    await _assert_like_unknown(stack.api, "/v1/batches/{id}", batch_b, a)
    for item in batch.json()["items"]:
        await _assert_like_unknown(stack.api, "/v1/scores/{id}", item["task_id"], a)
    batch_a = await stack.api.post(
        "/v1/batches", json=batch_body, headers={**a, "Idempotency-Key": batch_key}
    )
    assert batch_a.status_code == 202, batch_a.text
    assert batch_a.json()["batch_id"] != batch_b

    # The commands carry the tenant and the key that submitted them (usage per key).
    commands = {command.task_id: command for command in await queued_commands(stack.amqp_url)}
    assert commands[task_b].tenant_id == tenant_b
    assert commands[task_b].api_key_id == key_b["key_id"]
    assert commands[task_a].tenant_id == tenant_a
    assert commands[task_a].api_key_id == key_a["key_id"]


# --------------------------------------------------------------------------- injection


@pytest.mark.parametrize(
    "body",
    [
        {"text": {"$gt": ""}},
        {"text": ["$where"]},
        {"text": "t", "rubric": {"$ne": None}},
        {"text": "t", "model": ["$where"]},
        {"text": "t", "metadata": {"$where": "1"}},
        {"text": "t", "metadata": {"a.b": 1}},
        {"text": "t", "metadata": {"deep": {"$set": {"tenant_id": "x"}}}},
        {"text": "t", "metadata": {"list": [{"ok": 1}, {"b.c": 1}]}},
        {"text": "t", "metadata": "$where"},
        {"text": "t", "tenant_id": "someone-else"},
        {"text": "t", "_id": "chosen"},
    ],
)
async def test_operator_shaped_submissions_are_422(stack: Stack, body: Json) -> None:
    headers = await stack.auth(_tenant("inject"))
    before = await stack.gateway_db["submissions"].count_documents({})
    _assert_problem(await stack.api.post("/v1/scores", json=body, headers=headers), 422)
    batch = {"items": [{"text": "fine"}, body]}
    _assert_problem(await stack.api.post("/v1/batches", json=batch, headers=headers), 422)
    assert await stack.gateway_db["submissions"].count_documents({}) == before


@pytest.mark.parametrize(
    "task_id",
    ["%24ne", "a.b", "%7B%22%24ne%22%3A1%7D", "abc%0A", ".%2A", "x" * 65, "%24where"],
)
async def test_operator_shaped_ids_are_404(stack: Stack, task_id: str) -> None:
    headers = await stack.auth(_tenant("ids"))
    _assert_problem(await stack.api.get(f"/v1/scores/{task_id}", headers=headers), 404)
    _assert_problem(await stack.api.get(f"/v1/batches/{task_id}", headers=headers), 404)
    _assert_problem(await stack.api.get(f"/v1/scores/{task_id}/events", headers=headers), 404)


async def test_an_operator_shaped_idempotency_key_is_only_a_string(stack: Stack) -> None:
    headers = await stack.auth(_tenant("idem"))
    for key in ("$ne", "{$gt:''}"):
        first = await stack.api.post(
            "/v1/scores", json={"text": key}, headers={**headers, "Idempotency-Key": key}
        )
        again = await stack.api.post(
            "/v1/scores", json={"text": key}, headers={**headers, "Idempotency-Key": key}
        )
        assert first.status_code == 202, first.text
        assert again.status_code == 200
        assert again.json()["task_id"] == first.json()["task_id"]


async def test_authorization_sent_twice_is_a_400_on_every_guarded_route(stack: Stack) -> None:
    """Two tenants' keys in one request: the first was taken, and an intermediary taking the
    last would have read the request as the other tenant's (found in a walkthrough)."""
    first = await stack.auth(_tenant("first"))
    second = await stack.auth(_tenant("second"))
    routes = await _public_routes(stack.api)
    assert ("POST", "/v1/scores") in routes
    for method, path in routes:
        headers = [
            ("Authorization", first["Authorization"]),
            ("Authorization", second["Authorization"]),
        ]
        async with asyncio.timeout(15):
            response = await stack.api.request(
                method, _fill(path), headers=headers, json={"text": "hi"}
            )
        problem = _assert_problem(response, 400)
        assert "Authorization was sent more than once" in problem["detail"], (method, path)
    admin_twice = [("Authorization", f"Bearer {ADMIN_KEY}")] * 2
    problem = _assert_problem(await stack.api.get("/admin/v1/keys", headers=admin_twice), 400)
    assert "Authorization was sent more than once" in problem["detail"]
    # Sent once, each key is taken as before.
    assert (await stack.api.get(f"/v1/scores/{SOME_ID}", headers=first)).status_code == 404
