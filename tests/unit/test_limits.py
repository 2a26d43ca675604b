"""Limit arithmetic on an injected clock, the 429 problem, and the slow-body middleware."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from starlette.types import Message, Receive, Scope, Send

from services.gateway.limits import (
    BodyTimeout,
    FullWindows,
    LimitExceeded,
    RequestBodyTimeout,
    Window,
    fixed_window,
    limit_problem,
    rate_counter_id,
    retry_after_s,
)
from shared.http import PROBLEM_JSON

T0 = datetime(2030, 5, 17, 12, 0, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("now", "start"),
    [
        (T0, T0),
        (T0 + timedelta(seconds=0.001), T0),
        (T0 + timedelta(seconds=30.5), T0),
        (T0 + timedelta(seconds=59.999), T0),
        (T0 + timedelta(seconds=60), T0 + timedelta(seconds=60)),
        (T0 - timedelta(seconds=1), T0 - timedelta(seconds=60)),
    ],
)
def test_fixed_minute_windows(now: datetime, start: datetime) -> None:
    window = fixed_window(now, 60)
    assert window == Window(start=start, end=start + timedelta(seconds=60))
    assert window.start <= now < window.end


def test_windows_of_other_sizes_align_on_their_multiples() -> None:
    window = fixed_window(T0 + timedelta(seconds=17), 10)
    assert window.start == T0 + timedelta(seconds=10)
    assert window.end == T0 + timedelta(seconds=20)


@pytest.mark.parametrize(
    ("remaining", "expected"),
    [(59.0, 59), (58.2, 59), (0.4, 1), (0.0, 1), (-3.0, 1), (60.0, 60)],
)
def test_retry_after_is_whole_seconds_and_at_least_one(remaining: float, expected: int) -> None:
    assert retry_after_s(T0, T0 + timedelta(seconds=remaining)) == expected


def test_a_counter_per_key_and_window() -> None:
    first = fixed_window(T0, 60)
    second = fixed_window(T0 + timedelta(seconds=60), 60)
    assert rate_counter_id("k1", first) == f"k1:{int(T0.timestamp())}"
    assert rate_counter_id("k1", first) != rate_counter_id("k1", second)
    assert rate_counter_id("k1", first) != rate_counter_id("k2", first)


def test_a_window_found_full_is_remembered_until_the_next_one_starts() -> None:
    first = fixed_window(T0, 60)
    second = fixed_window(T0 + timedelta(seconds=60), 60)
    full = FullWindows()
    full.mark_full("k1", first)
    assert full.is_full("k1", first)
    assert not full.is_full("k2", first)
    assert not full.is_full("k1", second)

    full.mark_full("k2", second)  # the first window's keys are dropped
    full.mark_full("k3", first)  # a late refusal of a past window is not kept
    assert not full.is_full("k1", first)
    assert not full.is_full("k3", first)
    assert full.is_full("k2", second)


@pytest.mark.parametrize(
    ("limit", "kind"),
    [
        ("rate", "rate-limited"),
        ("in_flight", "too-many-tasks-in-flight"),
        ("unknown_keys", "too-many-unknown-keys"),
    ],
)
def test_an_exceeded_limit_is_a_429_problem_that_names_the_limit(limit: Any, kind: str) -> None:
    problem = limit_problem(LimitExceeded(limit, "too many", maximum=7, retry_after_s=42))
    assert problem.status == 429
    assert problem.kind == kind
    assert problem.headers == {"Retry-After": "42"}
    assert problem.extensions == {"limit": limit, "maximum": 7}


# --------------------------------------------------------------------------- slow bodies


class Recorder:
    def __init__(self) -> None:
        self.messages: list[Message] = []

    async def __call__(self, message: Message) -> None:
        self.messages.append(message)

    @property
    def status(self) -> int:
        return int(self.messages[0]["status"])

    @property
    def headers(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.messages[0]["headers"]}

    @property
    def body(self) -> dict[str, Any]:
        parsed: dict[str, Any] = json.loads(b"".join(m.get("body", b"") for m in self.messages[1:]))
        return parsed


HTTP_SCOPE: Scope = {"type": "http", "method": "POST", "path": "/x", "headers": []}


def _receive_from(messages: list[Message], then: asyncio.Event) -> Receive:
    """A client that sends `messages`, then waits for `then` before saying it disconnected."""
    pending = list(messages)

    async def receive() -> Message:
        if pending:
            return pending.pop(0)
        await then.wait()
        return {"type": "http.disconnect"}

    return receive


async def _reading_app(scope: Scope, receive: Receive, send: Send) -> None:
    """Reads the whole body, then answers 200 with its length."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body", False):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": str(len(body)).encode()})


async def test_a_body_that_stops_arriving_is_answered_408() -> None:
    never = asyncio.Event()
    receive = _receive_from(
        [{"type": "http.request", "body": b'{"text": "', "more_body": True}], never
    )
    sent = Recorder()
    await RequestBodyTimeout(_reading_app, timeout_s=0.05)(HTTP_SCOPE, receive, sent)
    assert sent.status == 408
    assert sent.headers["content-type"] == PROBLEM_JSON
    assert sent.headers["connection"] == "close"
    assert sent.body["status"] == 408
    assert sent.body["type"].endswith("/request-timeout")
    assert "0.05 s" in sent.body["detail"]


async def test_a_body_that_arrives_in_time_passes_untouched() -> None:
    chunks: list[Message] = [
        {"type": "http.request", "body": b"ab", "more_body": True},
        {"type": "http.request", "body": b"cde", "more_body": False},
    ]
    sent = Recorder()
    app = RequestBodyTimeout(_reading_app, timeout_s=5)
    await app(HTTP_SCOPE, _receive_from(chunks, asyncio.Event()), sent)
    assert sent.status == 200
    assert sent.messages[1]["body"] == b"5"


async def test_after_the_body_receive_is_no_longer_bounded() -> None:
    """A streaming response waits on `receive()` for the disconnect, far past the bound."""
    disconnected = asyncio.Event()
    receive = _receive_from(
        [{"type": "http.request", "body": b"", "more_body": False}], disconnected
    )
    seen: list[Message] = []

    async def streaming_app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(await receive())  # the (empty) body
        asyncio.get_running_loop().call_later(0.2, disconnected.set)  # a client 4x the bound
        seen.append(await receive())
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    sent = Recorder()
    await RequestBodyTimeout(streaming_app, timeout_s=0.05)(HTTP_SCOPE, receive, sent)
    assert [m["type"] for m in seen] == ["http.request", "http.disconnect"]
    assert sent.status == 204


async def test_a_timeout_after_the_response_started_is_not_answered_twice() -> None:
    never = asyncio.Event()
    receive = _receive_from([{"type": "http.request", "body": b"x", "more_body": True}], never)

    async def early_answer(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await receive()
        await receive()

    sent = Recorder()
    with pytest.raises(BodyTimeout):
        await RequestBodyTimeout(early_answer, timeout_s=0.05)(HTTP_SCOPE, receive, sent)
    assert [m["type"] for m in sent.messages] == ["http.response.start"]


async def test_other_scopes_pass_through() -> None:
    seen: list[str] = []

    async def lifespan_app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(scope["type"])

    async def no_receive() -> Message:
        raise AssertionError("not called")

    async def no_send(message: Message) -> None:
        raise AssertionError("not called")

    await RequestBodyTimeout(lifespan_app, timeout_s=0.05)(
        {"type": "lifespan"}, no_receive, no_send
    )
    assert seen == ["lifespan"]
