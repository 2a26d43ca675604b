"""An `EventSource` stops for good on any answer but 200 or 204. Refused for now — by the
authentication in front of the events route (the key's request rate, the gateway's database
away under the key store or the rate counter) — it gets a stream holding only `retry:`, as it
does when the route itself turns it away; a new stream on a queued task no longer needs the
gateway's database (found in review).

Gateway and status service in-process, on the real broker and database; the gateway reaches
its database through a link of the test's own (`database_link`), which the tests cut."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from services.gateway.app import create_app as create_gateway
from services.gateway.keys import generate_key
from services.gateway.settings import GatewaySettings
from services.status.app import create_app as create_status
from services.status.settings import StatusSettings
from tests.faults.slow_link import SlowLink
from tests.integration.in_process import GatewayAndStatus, gateway_and_status
from tests.support import eventually, running, stack_env

EVENTSOURCE_RECONNECTING = {"Accept": "text/event-stream", "Last-Event-ID": "0"}
EVENTSOURCE_FIRST = {"Accept": "text/event-stream"}


def _env(amqp_url: str, mongo_url: str, db_prefix: str, key: str, **extra: str) -> dict[str, str]:
    base = stack_env(
        amqp_url=amqp_url,
        mongo_url=mongo_url,
        db_prefix=db_prefix,
        llm_url="http://127.0.0.1:9",  # no scorer: nothing calls it
        api_key=key,
    )
    return base | extra


async def _submit(api: httpx.AsyncClient, text: str) -> str:
    accepted = await api.post("/v1/scores", json={"text": text})
    assert accepted.status_code == 202, accepted.text
    task_id: str = accepted.json()["task_id"]
    return task_id


def _told_to_retry(answer: httpx.Response) -> bool:
    """A 200 stream holding only a comment and `retry:`: no event."""
    return (
        answer.status_code == 200
        and answer.headers["content-type"].startswith("text/event-stream")
        and re.search(r"^retry: \d+$", answer.text, re.MULTILINE) is not None
        and "data:" not in answer.text
    )


async def test_a_rate_limited_eventsource_reconnection_is_told_to_retry(
    amqp_url: str, mongo: Any, db_prefix: str
) -> None:
    """The key's request rate, checked before the route, answered a 429 problem: the
    `EventSource` stopped for good. Now a stream holding only `retry:`, no sooner than the
    rate window frees; a plain client still gets the 429, and a bad key the 401."""
    key = generate_key().token
    env = _env(amqp_url, mongo.url, db_prefix + "rl", key, RATE_LIMIT_PER_MIN="1")
    async with gateway_and_status(env, api_key=key) as services:
        task_id = await _submit(services.api, "Queues decouple slow work.")  # the minute's one
        path = f"/v1/scores/{task_id}/events"
        reconnection = await services.api.get(path, headers=EVENTSOURCE_RECONNECTING)
        plain = await services.api.get(path)
        bad_key = await services.api.get(
            path,
            headers={**EVENTSOURCE_RECONNECTING, "Authorization": f"Bearer {generate_key().token}"},
        )
    assert _told_to_retry(reconnection), (reconnection.status_code, reconnection.text)
    retry_ms = int(re.findall(r"^retry: (\d+)$", reconnection.text, re.MULTILINE)[0])
    assert retry_ms >= int(reconnection.headers["retry-after"]) * 1000  # the window's end
    assert plain.status_code == 429
    assert plain.headers["content-type"] == "application/problem+json"
    assert bad_key.status_code == 401
    assert bad_key.headers["content-type"] == "application/problem+json"


@pytest.mark.parametrize(
    "settings",
    [
        {"RATE_LIMIT_PER_MIN": "600", "API_KEY_CACHE_TTL_S": "60"},  # the rate counter
        {"RATE_LIMIT_PER_MIN": "0", "API_KEY_CACHE_TTL_S": "0"},  # the key store
    ],
    ids=["rate-counter", "key-store"],
)
async def test_an_eventsource_reconnecting_while_the_gateway_database_is_away_is_told_to_retry(
    amqp_url: str,
    mongo: Any,
    db_prefix: str,
    database_link: SlowLink,
    settings: dict[str, str],
) -> None:
    """The authentication needs the gateway's database (the key read, or the request
    counted): away, it answered a 503 problem, and an `EventSource` stopped for good. A
    plain client still gets the 503."""
    key = generate_key().token
    prefix = db_prefix + "au" + settings["RATE_LIMIT_PER_MIN"]
    status_env = _env(amqp_url, mongo.url, prefix, key)
    gateway_env = _env(
        amqp_url,
        database_link.url_through(mongo.url),
        prefix,
        key,
        MONGO_TIMEOUT_S="1",
        **settings,
    )
    async with _gateway_on_its_own_link(status_env, gateway_env, key) as services:
        task_id = await _submit(services.api, "Another text.")
        await database_link.cut()
        path = f"/v1/scores/{task_id}/events"
        reconnection = await services.api.get(path, headers=EVENTSOURCE_RECONNECTING)
        plain = await services.api.get(path)
    assert _told_to_retry(reconnection), (reconnection.status_code, reconnection.text)
    assert plain.status_code == 503, plain.text
    assert plain.headers["content-type"] == "application/problem+json"


async def test_a_new_stream_on_a_queued_task_needs_no_gateway_database(
    amqp_url: str, mongo: Any, db_prefix: str, database_link: SlowLink
) -> None:
    """The status service holds the task (queued, sequence 0) and the gateway's database is
    away: a poll answered 200 from the status service, while a new stream read the
    submission and was refused (503 for a plain client, a `retry:`-only stream for the whole
    outage for an `EventSource`). Both now stream the acceptance, as the poll shows it."""
    key = generate_key().token
    prefix = db_prefix + "db"
    status_env = _env(amqp_url, mongo.url, prefix, key)
    gateway_env = _env(
        amqp_url,
        database_link.url_through(mongo.url),
        prefix,
        key,
        API_KEY_CACHE_TTL_S="60",  # the key stays known: authentication needs no read
        RATE_LIMIT_PER_MIN="0",
        MONGO_TIMEOUT_S="1",
        SSE_MAX_STREAM_S="1",  # the stream ends, and the in-process client gets its body
    )
    async with _gateway_on_its_own_link(status_env, gateway_env, key) as services:
        task_id = await _submit(services.api, "A text to score.")

        async def projected() -> bool:
            view = await services.status.get(
                f"/internal/v1/tasks/{task_id}", params={"tenant_id": "default"}
            )
            return view.status_code == 200 and view.json().get("sequence") == 0

        await eventually(projected, what="the status service holding the task")
        await database_link.cut()  # the gateway's database goes away; the status service's stays
        path = f"/v1/scores/{task_id}/events"
        poll = await services.api.get(f"/v1/scores/{task_id}")
        plain = await services.api.get(path)
        first = await services.api.get(path, headers=EVENTSOURCE_FIRST)
    assert poll.status_code == 200, poll.text
    assert poll.json()["status"] == "queued"
    for stream in (plain, first):
        assert stream.status_code == 200, stream.text
        assert stream.headers["content-type"].startswith("text/event-stream")
        assert "id: 0" in stream.text.splitlines(), stream.text
        assert '"status":"queued"' in stream.text, stream.text


@asynccontextmanager
async def _gateway_on_its_own_link(
    status_env: dict[str, str], gateway_env: dict[str, str], key: str
) -> AsyncIterator[GatewayAndStatus]:
    """The status service on the database directly, the gateway reading it on `gateway_env`
    (its database through the test's link), `key` its clients' bearer token."""
    async with running(create_status(StatusSettings.model_validate(status_env))) as status:
        gateway = create_gateway(GatewaySettings.model_validate(gateway_env), status_http=status)
        async with running(gateway) as api:
            api.headers["Authorization"] = f"Bearer {key}"
            yield GatewayAndStatus(api, status, gateway)
