"""`GET /v1/usage` in-process — gateway and scheduler — on the real broker and database:
`task.completed` events are metered by the scheduler, rolled up by hand, and each tenant
reads only its own days through the gateway; bad dates are 422, a missing scheduler 503.

Both services read one frozen clock, so the default period is known and no job fires."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from pymongo import AsyncMongoClient

from services.gateway.app import create_app as create_gateway
from services.gateway.keys import generate_key
from services.gateway.scheduler_client import SchedulerClient, SchedulerUnavailable
from services.gateway.settings import GatewaySettings
from services.scheduler.app import create_app as create_scheduler
from services.scheduler.config import parse_config
from services.scheduler.settings import SchedulerSettings
from shared.contracts import (
    DEFAULT_TENANT,
    ScoreResult,
    TaskCompleted,
    TaskError,
    TaskEvent,
    TaskFailed,
    Usage,
)
from shared.http import PROBLEM_BASE, PROBLEM_JSON
from shared.runtime import make_broker
from tests.support import closed_port, eventually, publish_together, running

ADMIN_KEY = "test-admin-key"
INTERNAL_KEY = "test-internal-key"
API_KEY = generate_key().token  # registered for the default tenant by BOOTSTRAP_API_KEY
NOW = datetime(2030, 1, 10, 10, 31, 30, tzinfo=UTC)  # far from the rollup's fire time (:05)

Mongo = AsyncMongoClient[dict[str, Any]]


def _clock() -> datetime:
    return NOW


@dataclass
class Stack:
    gateway: httpx.AsyncClient
    scheduler: httpx.AsyncClient
    other_tenant: str
    other_key: str
    env: dict[str, str]

    async def usage(self, key: str = API_KEY, **params: str) -> httpx.Response:
        return await self.gateway.get(
            "/v1/usage", params=params, headers={"Authorization": f"Bearer {key}"}
        )


def _completed(task_id: str, tenant: str, day: str, prompt: int, completion: int) -> TaskCompleted:
    at = datetime.fromisoformat(f"{day}T12:00:00+00:00")
    return TaskCompleted(
        task_id=task_id,
        tenant_id=tenant,
        sequence=190,
        attempt=1,
        submitted_at=at,
        occurred_at=at,
        result=ScoreResult(
            score=5,
            comment="ok",
            model="priced",
            usage=Usage(prompt_tokens=prompt, completion_tokens=completion),
        ),
        has_callback=False,  # as the scorer marks it: batched with the others
    )


def _failed(task_id: str, day: str, usage: Usage) -> TaskFailed:
    """A task whose answers stayed unusable (its tokens billed), or that got none (`usage`
    zero: nothing to meter)."""
    at = datetime.fromisoformat(f"{day}T12:00:00+00:00")
    return TaskFailed(
        task_id=task_id,
        tenant_id=DEFAULT_TENANT,
        sequence=190,
        attempt=1,
        submitted_at=at,
        occurred_at=at,
        error=TaskError(code="unusable_output", message="still unusable", retryable=False),
        dead_lettered=False,
        usage=usage,
        model="priced" if usage.total_tokens else None,
    )


async def _publish(amqp_url: str, events: Sequence[TaskEvent]) -> None:
    """Together, as the scorer's batching publisher sends outcomes: the completions in one
    message (checked), each failure alone."""
    broker = make_broker(SchedulerSettings.model_validate({"RABBITMQ_URL": amqp_url}))
    async with broker:
        await broker.connect()
        batched = await publish_together(broker, events)
        assert batched == sum(isinstance(event, TaskCompleted) for event in events)


async def _roll_up(scheduler: httpx.AsyncClient) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    accepted = await scheduler.post("/admin/v1/cron/jobs/usage-rollup/run", headers=admin)
    assert accepted.status_code == 202, accepted.text
    run_url = accepted.json()["status_url"]

    async def succeeded() -> bool:
        state: str | None = (await scheduler.get(run_url, headers=admin)).json().get("state")
        return state == "succeeded"

    await eventually(succeeded, what="the usage rollup succeeded")


async def _metered(mongo: Mongo, database: str, count: int) -> None:
    async def stored() -> bool:
        return await mongo[database]["usage_records"].count_documents({}) == count

    await eventually(stored, what=f"{count} usage records stored")


async def _other_key(gateway: httpx.AsyncClient, tenant: str) -> str:
    created = await gateway.post(
        "/admin/v1/keys",
        json={"tenant_id": tenant, "name": "usage test"},
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
    )
    assert created.status_code == 201, created.text
    key: str = created.json()["key"]
    return key


@pytest.fixture(scope="module")
async def stack(amqp_url: str, mongo: Any, db_prefix: str) -> AsyncIterator[Stack]:
    env = {
        "RABBITMQ_URL": amqp_url,
        "MONGO_URL": mongo.url,
        "MONGO_DB_PREFIX": db_prefix,
        "ADMIN_API_KEY": ADMIN_KEY,
        "BOOTSTRAP_API_KEY": API_KEY,
        "RATE_LIMIT_PER_MIN": "0",
        "SCHEDULER_TICK_S": "0.05",
        # The gateway reads usage with the internal key (tests/integration/test_internal_auth.py
        # shows the scheduler refusing a call without it).
        "INTERNAL_API_KEY": INTERNAL_KEY,
    }
    config = parse_config(
        {
            "jobs": {"usage-rollup": {"cron": "5 * * * *"}},
            "prices": {"priced": {"prompt_per_1k": 0.001, "completion_per_1k": 0.002}},
        },
        {},
    )
    other = f"other-{uuid.uuid4().hex[:6]}"
    events = [
        _completed("a1", DEFAULT_TENANT, "2030-01-02", 1000, 100),
        _completed("a2", DEFAULT_TENANT, "2030-01-02", 2000, 200),
        _completed("a3", DEFAULT_TENANT, "2030-01-08", 300, 30),
        _completed("b1", other, "2030-01-02", 10, 1),
        _failed("f1", "2030-01-08", Usage(prompt_tokens=400, completion_tokens=40)),
        _failed("f2", "2030-01-08", Usage()),
    ]
    scheduler = create_scheduler(SchedulerSettings.model_validate(env), config=config, clock=_clock)
    mongo_client: Mongo = AsyncMongoClient(mongo.url, tz_aware=True)
    async with running(scheduler) as scheduler_api:
        gateway = create_gateway(
            GatewaySettings.model_validate(env), scheduler_http=scheduler_api, clock=_clock
        )
        async with running(gateway) as gateway_api:
            await _publish(amqp_url, events)
            await _metered(mongo_client, f"{db_prefix}_scheduler", len(events) - 1)  # not f2
            await _roll_up(scheduler_api)
            key = await _other_key(gateway_api, other)
            yield Stack(gateway_api, scheduler_api, other, key, env)
    await mongo_client.close()


async def test_each_tenant_reads_only_its_own_usage(stack: Stack) -> None:
    response = await stack.usage(**{"from": "2030-01-01", "to": "2030-01-31"})
    assert response.status_code == 200, response.text
    mine = response.json()
    assert (mine["tenant_id"], mine["from"], mine["to"]) == (
        DEFAULT_TENANT,
        "2030-01-01",
        "2030-01-31",
    )
    # 2030-01-08: a completion, and a failure whose unusable answers used tokens.
    assert [(day["date"], day["requests"]) for day in mine["days"]] == [
        ("2030-01-02", 2),
        ("2030-01-08", 2),
    ]
    assert mine["totals"] == {
        "requests": 4,
        "prompt_tokens": 3700,
        "completion_tokens": 370,
        "total_tokens": 4070,
        "cost": pytest.approx(0.00444),
        "unpriced_requests": 0,
    }

    theirs = (
        await stack.usage(stack.other_key, **{"from": "2030-01-01", "to": "2030-01-31"})
    ).json()
    assert theirs["tenant_id"] == stack.other_tenant
    assert theirs["totals"]["requests"] == 1
    assert theirs["totals"]["total_tokens"] == 11


async def test_the_period_defaults_to_the_30_days_up_to_today(stack: Stack) -> None:
    everything = (await stack.usage()).json()
    assert (everything["from"], everything["to"]) == ("2029-12-11", "2030-01-10")
    assert everything["totals"]["requests"] == 4

    until = (await stack.usage(to="2030-01-05")).json()
    assert (until["from"], until["to"]) == ("2029-12-06", "2030-01-05")
    assert until["totals"]["requests"] == 2

    since = (await stack.usage(**{"from": "2030-01-05"})).json()
    assert (since["from"], since["to"]) == ("2030-01-05", "2030-01-10")
    assert since["totals"]["requests"] == 2


@pytest.mark.parametrize(
    ("params", "detail"),
    [
        ({"from": "soon", "to": "2030-01-10"}, "`from` must be a date as YYYY-MM-DD"),
        ({"from": "2030-01-10", "to": "2030-01-01"}, "query.to: must not be before `from`"),
        ({"from": "2029-01-01", "to": "2030-06-01"}, "at most 366 days"),
        ({"to": "tomorrow"}, "`to` must be a date as YYYY-MM-DD"),
        ({"to": "0001-01-02"}, "`to` is too early"),
        # ISO 8601's other forms, which `date.fromisoformat` takes: were answered 200.
        ({"from": "2030-W01-1", "to": "2030-W02-1"}, "`to` must be a date as YYYY-MM-DD"),
        ({"from": "20300101", "to": "2030-01-31"}, "`from` must be a date as YYYY-MM-DD"),
        ({"from": "2030-01-01", "to": "2030-01-3\u0661"}, "`to` must be a date as YYYY-MM-DD"),
    ],
)
async def test_bad_dates_are_422_with_the_reason(
    stack: Stack, params: dict[str, str], detail: str
) -> None:
    response = await stack.usage(**params)
    assert response.status_code == 422, response.text
    assert response.headers["content-type"].startswith(PROBLEM_JSON)
    problem = response.json()
    assert detail in problem["detail"]
    # Named as every 422 names its fields (those the scheduler refused had no `errors`).
    assert problem["errors"]
    assert all(error["field"] in ("query.from", "query.to") for error in problem["errors"])


@pytest.mark.parametrize(
    ("params", "detail"),
    [
        ({"from": "2030-01-11"}, "query.from: must not be after today (2030-01-10)"),
        ({"from": "2028-01-01"}, "query.from: a usage query spans at most 366 days"),
    ],
    ids=["future-from", "from-too-early"],
)
async def test_a_range_refused_without_to_names_from(
    stack: Stack, params: dict[str, str], detail: str
) -> None:
    """`to` defaults to today: the refusal named `query.to`, which the client had not sent
    (found in a walkthrough)."""
    response = await stack.usage(**params)
    assert response.status_code == 422, response.text
    problem = response.json()
    assert detail in problem["detail"]
    assert "query.to" not in problem["detail"]
    assert [error["field"] for error in problem["errors"]] == ["query.from"]


async def test_a_period_without_usage_costs_zero(stack: Stack) -> None:
    """Its cost was null, which reads as unknown (as for requests without a price)."""
    response = await stack.usage(**{"from": "2030-01-03", "to": "2030-01-07"})
    assert response.status_code == 200, response.text
    report = response.json()
    assert report["days"] == []
    assert report["totals"]["requests"] == 0
    assert report["totals"]["cost"] == 0


async def test_both_dates_malformed_are_named_in_one_422(stack: Stack) -> None:
    response = await stack.usage(**{"from": "2030-W01-1", "to": "20300131"})
    assert response.status_code == 422, response.text
    problem = response.json()
    assert [error["field"] for error in problem["errors"]] == ["query.from", "query.to"]
    assert "`from`" in problem["detail"]
    assert "`to`" in problem["detail"]


async def test_a_malformed_date_too_long_for_a_url_is_422_not_500(stack: Stack) -> None:
    """Sent on unchecked, 30,000 `(` made the scheduler's URL too long for httpx (its
    `InvalidURL` is no `HTTPError`): a 500. The refusal quotes only the start of it."""
    response = await stack.gateway.get(
        "/v1/usage?from=" + "(" * 30_000 + "&to=2030-01-01",
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert response.status_code == 422, response.text
    assert response.headers["content-type"].startswith(PROBLEM_JSON)
    problem = response.json()
    assert problem["type"].endswith("/invalid-fields")
    assert [error["field"] for error in problem["errors"]] == ["query.from"]
    assert "30,000 characters" in problem["detail"]
    assert len(problem["detail"]) < 200


@pytest.mark.parametrize(
    "query",
    [
        "form=2030-01-01",  # misspelt: was ignored, the default period answered
        "from=2030-01-01&from=2030-01-05",  # twice: the last was taken
        "from=2030-01-01&tenant_id=someone-else",
    ],
)
async def test_other_or_repeated_query_parameters_are_422(stack: Stack, query: str) -> None:
    response = await stack.gateway.get(
        f"/v1/usage?{query}", headers={"Authorization": f"Bearer {API_KEY}"}
    )
    assert response.status_code == 422, response.text
    assert response.headers["content-type"].startswith(PROBLEM_JSON)
    assert response.json()["errors"][0]["field"].startswith("query.")


async def test_a_url_the_scheduler_client_cannot_build_is_the_scheduler_unavailable() -> None:
    """A defence behind the gateway's own checks: httpx's `InvalidURL` is no `HTTPError`."""
    sent: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200)

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as http:
        client = SchedulerClient(http, base_url="http://scheduler")
        with pytest.raises(SchedulerUnavailable):
            await client.usage("acme", first_day="(" * 30_000, last_day="2030-01-01")
    assert sent == []


async def test_usage_needs_an_api_key(stack: Stack) -> None:
    response = await stack.gateway.get("/v1/usage")
    assert response.status_code == 401


async def test_usage_is_documented(stack: Stack) -> None:
    operation = (await stack.gateway.get("/openapi.json")).json()["paths"]["/v1/usage"]["get"]
    assert operation["summary"]
    assert {parameter["name"] for parameter in operation["parameters"]} >= {"from", "to"}
    example = operation["responses"]["200"]["content"]["application/json"]["example"]
    assert example["totals"]["requests"] == example["days"][0]["requests"]


async def test_an_unreachable_scheduler_is_503_with_retry_after(stack: Stack) -> None:
    env = {**stack.env, "SCHEDULER_URL": f"http://127.0.0.1:{closed_port()}"}
    gateway = create_gateway(GatewaySettings.model_validate(env))
    async with running(gateway) as api:
        response = await api.get("/v1/usage", headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 503, response.text
    assert response.headers["content-type"].startswith(PROBLEM_JSON)
    assert int(response.headers["retry-after"]) > 0


async def test_a_scheduler_whose_database_refuses_for_good_is_500_without_retry_after(
    stack: Stack,
) -> None:
    """It was a 503 "retry shortly" with Retry-After, retried for ever (a review)."""
    refused = {"type": f"{PROBLEM_BASE}database-refused", "status": 500, "detail": "for good"}

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(500, json=refused, headers={"content-type": PROBLEM_JSON})

    async with httpx.AsyncClient(
        transport=httpx.MockTransport(answer), base_url="http://scheduler"
    ) as http:
        gateway = create_gateway(GatewaySettings.model_validate(stack.env), scheduler_http=http)
        async with running(gateway) as api:
            response = await api.get("/v1/usage", headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 500, response.text
    assert response.json()["type"].endswith("/database-refused")
    assert "retry-after" not in response.headers
