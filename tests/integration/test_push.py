"""Push instead of polling: Server-Sent Events and long-polls, with the gateway served by a real
HTTP server (in-process ASGI transports buffer whole responses, which a stream never ends),
the status service and the scorer in-process, the fake model scripting each task."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from devtools.fake_llm import FakeLLMConfig, start_fake_llm
from services.gateway.app import create_app as create_gateway
from services.gateway.keys import generate_key
from services.gateway.settings import GatewaySettings
from services.scorer.app import create_app as create_scorer
from services.scorer.model.settings import ModelSettings
from services.scorer.settings import ScorerSettings
from services.status.app import create_app as create_status
from services.status.settings import StatusSettings
from shared.bus import publish_event
from shared.contracts import (
    Phase,
    ScoreResult,
    TaskAccepted,
    TaskCompleted,
    TaskStarted,
    event_sequence,
    new_id,
    utcnow,
)
from shared.runtime import Server, make_broker, stopping_hooks
from tests.support import eventually, running, stack_env

ADMIN_KEY = "test-admin-key"
MAX_WAITERS_PER_TENANT = 2


@dataclass
class Sse:
    """One Server-Sent Event as a client sees it."""

    id: int | None
    data: dict[str, Any]


@dataclass
class Push:
    api: httpx.AsyncClient  # the gateway over real HTTP, with the default tenant's key
    other: dict[str, str]  # headers of another tenant's key
    limited: dict[str, str]  # headers of a tenant used only by the waiter-limit test
    amqp_url: str
    env: dict[str, str]
    status: FastAPI  # the status service, running

    async def submit(self, text: str, **extra: Any) -> str:
        response = await self.api.post("/v1/scores", json={"text": text, **extra})
        assert response.status_code == 202, response.text
        task_id: str = response.json()["task_id"]
        return task_id

    async def events(
        self, task_id: str, *, last_event_id: int | None = None
    ) -> tuple[list[Sse], list[str]]:
        """Read a whole stream: its events, and its other lines (retry hint, heartbeats)."""
        headers = {} if last_event_id is None else {"Last-Event-ID": str(last_event_id)}
        async with self.api.stream(
            "GET", f"/v1/scores/{task_id}/events", headers=headers, timeout=60
        ) as response:
            assert response.status_code == 200, await response.aread()
            assert response.headers["content-type"].startswith("text/event-stream")
            return await read_events(response.aiter_lines())


async def read_events(lines: AsyncIterator[str]) -> tuple[list[Sse], list[str]]:
    events: list[Sse] = []
    other: list[str] = []
    current: dict[str, str] = {}
    async for line in lines:
        if not line:
            if "data" in current:
                event_id = current.get("id")
                events.append(Sse(int(event_id) if event_id else None, json.loads(current["data"])))
            current = {}
        elif line.startswith(("id:", "data:")):
            field, _, value = line.partition(":")
            current[field] = value.strip()
        else:
            other.append(line)
    return events, other


@asynccontextmanager
async def serving(app: FastAPI) -> AsyncIterator[str]:
    """Serve `app` (lifespan included) on a free local port; yields its base URL."""
    async with served(app) as (base_url, _):
        yield base_url


@asynccontextmanager
async def served(app: FastAPI) -> AsyncIterator[tuple[str, Server]]:
    """Serve `app` as the services do (`shared.runtime.Server`, its stopping hooks); yields
    its base URL and the server, stopped at the end unless the test stopped it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        lifespan="on",
        log_level="warning",
        ws="none",
        timeout_graceful_shutdown=2,
    )
    server = Server(config, stopping_hooks(app))
    task = asyncio.create_task(server.serve(sockets=[sock]))

    async def started() -> bool:
        if task.done():
            task.result()  # start-up failed: raise it here
        return server.started

    try:
        await eventually(started, what="gateway serving")
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        await task
        sock.close()


async def _key(admin: httpx.AsyncClient, tenant_id: str) -> dict[str, str]:
    response = await admin.post(
        "/admin/v1/keys",
        json={"tenant_id": tenant_id, "name": "test"},
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
    )
    assert response.status_code == 201, response.text
    return {"Authorization": f"Bearer {response.json()['key']}"}


@pytest.fixture(scope="module")
async def push(amqp_url: str, mongo: Any, db_prefix: str) -> AsyncIterator[Push]:
    llm = await start_fake_llm(FakeLLMConfig())
    key = generate_key().token
    env = stack_env(
        amqp_url=amqp_url,
        mongo_url=mongo.url,
        db_prefix=db_prefix,
        llm_url=llm.url,
        api_key=key,
        admin_key=ADMIN_KEY,
        SSE_HEARTBEAT_S="0.2",
        LIVE_MAX_WAITERS_PER_TENANT=str(MAX_WAITERS_PER_TENANT),
        SCORER_STARTED_AFTER_S="0",  # every attempt announces `processing`
    )
    scorer = create_scorer(ScorerSettings.model_validate(env), ModelSettings.model_validate(env))
    status = create_status(StatusSettings.model_validate(env))
    async with running(status) as status_client, running(scorer):
        gateway = create_gateway(GatewaySettings.model_validate(env), status_http=status_client)
        async with (
            serving(gateway) as base_url,
            httpx.AsyncClient(
                # Above the longest long-poll (`wait=30`), which the server answers at its end.
                base_url=base_url,
                timeout=45,
                headers={"Authorization": f"Bearer {key}"},
            ) as api,
        ):
            other = await _key(api, f"other-{uuid.uuid4().hex[:8]}")
            limited = await _key(api, f"limited-{uuid.uuid4().hex[:8]}")
            yield Push(api, other, limited, amqp_url, env, status)
    await llm.stop()


def _marker() -> str:
    return f"p{uuid.uuid4().hex[:12]}"


def _statuses(events: list[Sse]) -> list[str]:
    return [event.data["status"] for event in events]


async def test_stream_follows_a_task_to_its_end_with_increasing_ids(push: Push) -> None:
    task_id = await push.submit(f"Busy model [[id:{_marker()}]] [[fake:429x1:retry=1]]")
    events, other = await push.events(task_id)
    assert _statuses(events) == ["queued", "processing", "retrying", "processing", "completed"]
    ids = [event.id for event in events]
    assert all(isinstance(i, int) for i in ids)
    numbered = [i for i in ids if i is not None]  # all of them, as just asserted
    assert numbered == sorted(numbered)
    assert len(set(ids)) == len(ids)
    assert all(event.data["task_id"] == task_id for event in events)
    assert all(event.data["sequence"] == event.id for event in events)
    retrying = events[2].data
    assert retrying["error"]["code"] == "model_rate_limited"
    assert retrying["next_attempt_at"]
    completed = events[-1].data
    assert 0 <= completed["result"]["score"] <= 10
    assert completed["attempt"] == 2
    assert other[0].startswith("retry:")

    view = (await push.api.get(f"/v1/scores/{task_id}")).json()
    assert view["status"] == "completed"
    assert view["sequence"] == events[-1].id


async def test_reconnecting_with_last_event_id_gets_only_what_was_missed(push: Push) -> None:
    task_id = await push.submit(f"Resume me [[id:{_marker()}]]")
    everything, _ = await push.events(task_id)
    assert _statuses(everything) == ["queued", "processing", "completed"]

    rest, _ = await push.events(task_id, last_event_id=everything[0].id)
    assert [event.id for event in rest] == [event.id for event in everything[1:]]
    assert _statuses(rest) == ["processing", "completed"]

    # Seen it all, and the task is finished: 204 tells an EventSource to stop reconnecting.
    done = await push.api.get(
        f"/v1/scores/{task_id}/events", headers={"Last-Event-ID": str(everything[-1].id)}
    )
    assert done.status_code == 204


async def test_a_polyfill_reconnecting_with_last_event_id_in_the_url_resumes(push: Push) -> None:
    """Browsers' EventSource cannot send `Authorization`; the polyfills that can send it give
    the last id as `?lastEventId=` on a reconnection, and stop for good on anything but 200:
    refused as a parameter the route did not take (422), every such stream died at its
    first reconnection (found in review)."""
    task_id = await push.submit(f"Resume me by URL [[id:{_marker()}]]")
    everything, _ = await push.events(task_id)

    path = f"/v1/scores/{task_id}/events?lastEventId={everything[0].id}"
    async with push.api.stream("GET", path, timeout=60) as response:
        assert response.status_code == 200, await response.aread()
        rest, _ = await read_events(response.aiter_lines())
    assert [event.id for event in rest] == [event.id for event in everything[1:]]

    done = await push.api.get(f"/v1/scores/{task_id}/events?lastEventId={everything[-1].id}")
    assert done.status_code == 204
    # The header wins over the URL's.
    both = await push.api.get(
        f"/v1/scores/{task_id}/events?lastEventId=0",
        headers={"Last-Event-ID": str(everything[-1].id)},
    )
    assert both.status_code == 204


async def test_stream_of_a_waiting_task_sends_heartbeats(push: Push) -> None:
    task_id = await push.submit(f"Later [[id:{_marker()}]]", delay_seconds=600)
    async with push.api.stream("GET", f"/v1/scores/{task_id}/events") as response:
        assert response.status_code == 200
        lines = response.aiter_lines()
        seen: list[str] = []
        async for line in lines:
            seen.append(line)
            if line.startswith(":"):
                break
    assert seen[0].startswith("retry:")
    first = next(line for line in seen if line.startswith("data:"))
    assert json.loads(first.removeprefix("data:"))["status"] == "scheduled"


async def _scheduled_tasks(push: Push, headers: dict[str, str], count: int) -> list[str]:
    """Task ids of `count` submissions due in ten minutes: they wait, unfinished, meanwhile."""
    tasks = []
    for _ in range(count):
        response = await push.api.post(
            "/v1/scores",
            json={"text": f"Wait [[id:{_marker()}]]", "delay_seconds": 600},
            headers=headers,
        )
        tasks.append(response.json()["task_id"])
    return tasks


async def test_closed_streams_free_their_place_and_the_limit_answers_429(push: Push) -> None:
    headers = push.limited
    tasks = await _scheduled_tasks(push, headers, MAX_WAITERS_PER_TENANT + 1)

    async with contextlib.AsyncExitStack() as first, contextlib.AsyncExitStack() as second:
        for stack, task_id in ((first, tasks[0]), (second, tasks[1])):
            opened = await stack.enter_async_context(
                push.api.stream("GET", f"/v1/scores/{task_id}/events", headers=headers)
            )
            assert opened.status_code == 200
        refused = await push.api.get(f"/v1/scores/{tasks[2]}/events", headers=headers)
        assert refused.status_code == 429
        assert refused.headers["content-type"].startswith("application/problem+json")
        assert refused.headers["retry-after"]
        long_poll = await push.api.get(f"/v1/scores/{tasks[2]}?wait=5", headers=headers)
        assert long_poll.status_code == 429
        await first.aclose()  # the client goes away

        async def place_freed() -> httpx.Response | None:
            # The server notices the disconnect a moment later.
            response = await push.api.get(f"/v1/scores/{tasks[2]}?wait=0.01", headers=headers)
            return response if response.status_code == 200 else None

        await eventually(place_freed, what="the closed stream's place freed")


async def test_long_polls_whose_clients_gave_up_free_their_places(push: Push) -> None:
    """uvicorn does not cancel a handler whose client went away: a long-poll held its place
    for its whole wait, so a client retrying on a short timeout filled its tenant's places
    (answered 429) for up to a minute."""
    headers = await _key(push.api, f"impatient-{uuid.uuid4().hex[:8]}")
    tasks = await _scheduled_tasks(push, headers, MAX_WAITERS_PER_TENANT + 1)
    for task_id in tasks[:MAX_WAITERS_PER_TENANT]:  # every place taken, then given up
        with pytest.raises(httpx.ReadTimeout):
            await push.api.get(f"/v1/scores/{task_id}?wait=60", headers=headers, timeout=0.5)

    async def place_freed() -> httpx.Response | None:
        response = await push.api.get(f"/v1/scores/{tasks[-1]}?wait=0.01", headers=headers)
        return response if response.status_code == 200 else None

    await eventually(place_freed, timeout_s=10, what="the places of the abandoned long-polls")


async def test_another_tenants_task_is_404_before_streaming(push: Push) -> None:
    task_id = await push.submit(f"Mine [[id:{_marker()}]]")
    stream = await push.api.get(f"/v1/scores/{task_id}/events", headers=push.other)
    assert stream.status_code == 404
    assert stream.headers["content-type"].startswith("application/problem+json")
    poll = await push.api.get(f"/v1/scores/{task_id}?wait=1", headers=push.other)
    assert poll.status_code == 404
    unknown = await push.api.get(f"/v1/scores/{new_id()}/events")
    assert unknown.status_code == 404
    bad = await push.api.get(f"/v1/scores/{task_id}/events", headers={"Last-Event-ID": "x"})
    assert bad.status_code == 400
    # Digits of another script are no event id (`\d` took "١٢٣" for 123).
    arabic = await push.api.get(f"/v1/scores/{task_id}/events", params={"lastEventId": "١٢٣"})
    assert arabic.status_code == 400, arabic.text


async def test_a_last_event_id_ahead_of_the_task_is_refused(push: Push) -> None:
    """No event would ever pass it, the end included: the stream stayed open, holding a
    waiter's place, for `SSE_MAX_STREAM_S`."""
    submitted = await push.api.post(
        "/v1/scores", json={"text": f"Later [[id:{_marker()}]]", "delay_seconds": 600}
    )
    task_id = submitted.json()["task_id"]
    ahead = await push.api.get(
        f"/v1/scores/{task_id}/events", headers={"Last-Event-ID": "999999999999"}
    )
    assert ahead.status_code == 400
    assert ahead.headers["content-type"].startswith("application/problem+json")
    assert "ahead" in ahead.json()["detail"]


async def test_long_poll_answers_each_change_until_the_end(push: Push) -> None:
    # Retrying for 3 s: a poll lagging behind a change still sees it.
    task_id = await push.submit(f"Long-poll me [[id:{_marker()}]] [[fake:429x1:retry=3]]")
    seen = ["queued"]
    for _ in range(10):
        response = await push.api.get(
            f"/v1/scores/{task_id}", params={"wait": 30, "status": seen[-1]}
        )
        assert response.status_code == 200
        view = response.json()
        if view["status"] != seen[-1]:
            seen.append(view["status"])
        if view["status"] in ("completed", "failed"):
            break
    assert seen[-1] == "completed"
    assert "retrying" in seen
    # Finished: answered at once, whatever the wait.
    again = await push.api.get(f"/v1/scores/{task_id}", params={"wait": 30})
    assert again.json()["status"] == "completed"


async def test_long_poll_answers_the_current_view_when_nothing_happens(push: Push) -> None:
    task_id = await push.submit(f"Not yet [[id:{_marker()}]]", delay_seconds=600)

    async def projected() -> dict[str, Any] | None:
        view: dict[str, Any] = (await push.api.get(f"/v1/scores/{task_id}")).json()
        return view if view["sequence"] is not None else None

    await eventually(projected, what="the task projected")
    response = await push.api.get(f"/v1/scores/{task_id}", params={"wait": 1})
    assert response.status_code == 200
    assert response.json()["status"] == "scheduled"
    bad = await push.api.get(f"/v1/scores/{task_id}", params={"wait": 61})
    assert bad.status_code == 422
    nan = await push.api.get(f"/v1/scores/{task_id}", params={"wait": "nan"})
    assert nan.status_code == 422
    assert "finite number" in nan.text  # not "less than or equal to 60" (a walkthrough)


async def test_history_keeps_each_change_once_and_in_order(push: Push) -> None:
    """Duplicated and out-of-order deliveries: the state never moves backwards, the history
    holds each change once, sorted by sequence, late ones included."""
    task_id = new_id()
    now = utcnow()
    common = {"task_id": task_id, "submitted_at": now}
    accepted = TaskAccepted(
        **common,
        sequence=event_sequence(generation=0, attempt=0, phase=Phase.ACCEPTED),
        occurred_at=now,
    )
    started = TaskStarted(
        **common,
        attempt=1,
        sequence=event_sequence(generation=0, attempt=1, phase=Phase.STARTED),
        occurred_at=now + timedelta(seconds=1),
    )
    completed = TaskCompleted(
        **common,
        attempt=1,
        sequence=event_sequence(generation=0, attempt=1, phase=Phase.TERMINAL),
        occurred_at=now + timedelta(seconds=2),
        result=ScoreResult(score=6, comment="ok", model="m"),
    )
    broker = make_broker(GatewaySettings.model_validate({"RABBITMQ_URL": push.amqp_url}))
    async with broker:
        await broker.connect()
        for event in (started, completed, started, accepted, completed, accepted):
            await publish_event(broker, event, timeout=10)

    async def all_three() -> list[Sse] | None:
        response = await push.api.get(f"/v1/scores/{task_id}/events")
        if response.status_code != 200:
            return None
        events, _ = await read_events(_lines(response.text))
        return events if len(events) == 3 else None

    events = await eventually(all_three, what="three changes in the history")
    assert _statuses(events) == ["queued", "processing", "completed"]
    assert [event.id for event in events] == [0, started.sequence, completed.sequence]
    view = (await push.api.get(f"/v1/scores/{task_id}")).json()
    assert view["status"] == "completed"


async def _lines(text: str) -> AsyncIterator[str]:
    for line in text.split("\n"):
        yield line


async def test_a_stream_ends_once_its_key_is_revoked(push: Push) -> None:
    """Revocation takes effect within API_KEY_CACHE_TTL_S (at once on the replica that
    revoked): an open stream, authenticated once when it opened, went on for up to
    SSE_MAX_STREAM_S. It asks again at every heartbeat."""
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    created = await push.api.post(
        "/admin/v1/keys", json={"tenant_id": f"revoked-{uuid.uuid4().hex[:8]}"}, headers=admin
    )
    assert created.status_code == 201, created.text
    headers = {"Authorization": f"Bearer {created.json()['key']}"}
    submitted = await push.api.post(
        "/v1/scores",
        json={"text": f"Later [[id:{_marker()}]]", "delay_seconds": 600},
        headers=headers,
    )
    assert submitted.status_code == 202, submitted.text
    task_id = submitted.json()["task_id"]
    async with push.api.stream("GET", f"/v1/scores/{task_id}/events", headers=headers) as stream:
        assert stream.status_code == 200
        lines = stream.aiter_lines()
        async for line in lines:
            if line.startswith(":"):  # streaming: now revoke its key
                break
        revoked = await push.api.delete(f"/admin/v1/keys/{created.json()['key_id']}", headers=admin)
        assert revoked.status_code in (200, 204), revoked.text
        async with asyncio.timeout(60):  # a hang guard only: it ends at the next heartbeat
            rest = [line async for line in lines]
    assert not [line for line in rest if line.startswith("data:")]


class StatusSwitch(httpx.AsyncBaseTransport):
    """The status service in-process, which a test can make unreachable."""

    def __init__(self, app: FastAPI) -> None:
        self._inner = httpx.ASGITransport(app=app)
        self.down = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("the status service is away", request=request)
        return await self._inner.handle_async_request(request)


async def test_a_stream_shows_the_end_it_hears_of_while_the_status_service_is_away(
    push: Push,
) -> None:
    """The stream ended without the terminal event it had just received, and the client's
    reconnection was answered 503, which makes an EventSource give up for good."""
    submitted = await push.api.post(
        "/v1/scores", json={"text": f"Later [[id:{_marker()}]]", "delay_seconds": 600}
    )
    assert submitted.status_code == 202, submitted.text
    task_id = submitted.json()["task_id"]
    switch = StatusSwitch(push.status)
    gateway = create_gateway(
        GatewaySettings.model_validate(push.env),
        status_http=httpx.AsyncClient(transport=switch, base_url="http://status.test", timeout=5),
    )
    completed = TaskCompleted(
        task_id=task_id,
        submitted_at=utcnow(),
        attempt=1,
        sequence=event_sequence(generation=0, attempt=1, phase=Phase.TERMINAL),
        result=ScoreResult(score=6, comment="ok", model="m"),
    )
    async with (
        serving(gateway) as base_url,
        httpx.AsyncClient(base_url=base_url, headers=push.api.headers, timeout=30) as api,
        api.stream("GET", f"/v1/scores/{task_id}/events") as stream,
    ):
        assert stream.status_code == 200
        lines = stream.aiter_lines()
        async for line in lines:
            if line.startswith(":"):  # streaming, its first state sent
                break
        switch.down = True
        broker = make_broker(GatewaySettings.model_validate({"RABBITMQ_URL": push.amqp_url}))
        async with broker:
            await broker.connect()
            await publish_event(broker, completed, timeout=10)
        async with asyncio.timeout(60):  # a hang guard only: it ends with the terminal event
            events, _ = await read_events(lines)
    assert _statuses(events) == ["completed"]
    # Heard live, not recorded by the status service: no id, so that a reconnection resumes
    # from the last recorded change (with this id, one was refused as ahead of the task).
    assert events[0].id is None
    assert events[0].data["sequence"] == completed.sequence
    assert events[0].data["result"]["score"] == 6


async def test_an_eventsource_reconnecting_while_the_status_service_is_away_is_told_to_retry(
    push: Push,
) -> None:
    """A reconnection during an outage of the status service was answered 503, on which an
    EventSource stops for good: it gets a stream holding only `retry:`, and once the status
    service is back the same reconnection replays what it missed."""
    submitted = await push.api.post(
        "/v1/scores", json={"text": f"Later [[id:{_marker()}]]", "delay_seconds": 600}
    )
    assert submitted.status_code == 202, submitted.text
    task_id = submitted.json()["task_id"]
    switch = StatusSwitch(push.status)
    gateway = create_gateway(
        GatewaySettings.model_validate(push.env),
        status_http=httpx.AsyncClient(transport=switch, base_url="http://status.test", timeout=5),
    )
    reconnection = {"Accept": "text/event-stream", "Last-Event-ID": "0"}
    async with (
        serving(gateway) as base_url,
        httpx.AsyncClient(base_url=base_url, headers=push.api.headers, timeout=30) as api,
    ):
        switch.down = True
        during = await api.get(f"/v1/scores/{task_id}/events", headers=reconnection)
        plain = await api.get(f"/v1/scores/{task_id}/events")
        switch.down = False
        async with api.stream(
            "GET", f"/v1/scores/{task_id}/events", headers={"Accept": "text/event-stream"}
        ) as stream:
            async with asyncio.timeout(60):  # a hang guard only: the replay comes first
                first = await anext(
                    line async for line in stream.aiter_lines() if line.startswith("data:")
                )
    assert during.status_code == 200
    assert during.headers["content-type"].startswith("text/event-stream")
    assert re.search(r"^retry: \d+$", during.text, re.MULTILINE), during.text
    assert "data:" not in during.text
    assert plain.status_code == 503
    assert plain.headers["content-type"] == "application/problem+json"
    assert "nothing was kept" not in plain.json()["detail"]
    assert json.loads(first.removeprefix("data:"))["task_id"] == task_id


async def test_a_stopping_gateway_answers_its_long_polls_and_ends_its_streams(push: Push) -> None:
    """Asked to stop, the gateway left its waiters waiting until the HTTP server's drain ran
    out and cut them off: a long-poll got a plain-text 500, a stream a truncated body."""
    headers = await _key(push.api, f"stopping-{uuid.uuid4().hex[:8]}")
    first, other = await _scheduled_tasks(push, headers, 2)
    gateway = create_gateway(
        GatewaySettings.model_validate(push.env),
        status_http=httpx.AsyncClient(
            transport=StatusSwitch(push.status), base_url="http://status.test", timeout=5
        ),
    )
    async with (
        served(gateway) as (base_url, server),
        httpx.AsyncClient(base_url=base_url, headers=headers, timeout=60) as api,
        api.stream("GET", f"/v1/scores/{first}/events") as stream,
    ):
        lines = stream.aiter_lines()
        async for line in lines:
            if line.startswith("data:"):  # streaming, its first state sent
                break
        long_poll = asyncio.create_task(api.get(f"/v1/scores/{first}?wait=30"))

        async def both_waiting() -> bool:  # the tenant's two places taken
            nonlocal long_poll
            if long_poll.done() and long_poll.result().status_code == 429:
                # This probe took the place first: ask again.
                long_poll = asyncio.create_task(api.get(f"/v1/scores/{first}?wait=30"))
            answer = await api.get(f"/v1/scores/{other}?wait=0.01")
            return answer.status_code == 429

        await eventually(both_waiting, what="the long-poll waiting beside the stream")
        server.should_exit = True  # what SIGTERM does
        async with asyncio.timeout(60):  # a hang guard only
            answer = await long_poll
            rest = [line async for line in lines]
    assert answer.status_code == 200, answer.text
    assert answer.json()["status"] == "scheduled"
    assert not any(line.startswith("data:") for line in rest)  # ended, nothing more to say
