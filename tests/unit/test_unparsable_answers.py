"""The gateway's clients of the scheduler and the status service (httpx over aiohttp): an
answer that is not HTTP, or not the service's, is the service unavailable (503, retry
shortly), never a raw aiohttp error (a 500). The peer is a real local TCP server."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import aiohttp
import httpx
import pytest

from services.gateway.app import make_status_http
from services.gateway.errors import StatusUnavailable, Unavailable, refused_for_good
from services.gateway.scheduler_client import (
    SchedulerClient,
    SchedulerUnavailable,
    make_scheduler_http,
)
from services.gateway.settings import GatewaySettings
from services.gateway.status_client import StatusClient
from shared.http import PROBLEM_BASE, TASK_UNKNOWN

NOT_HTTP = {
    # a proxy's or a wrong port's answer
    "a status line that is not HTTP": b"this is not HTTP at all\r\n\r\n",
    "a header over the parser's limit": b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n",
    "malformed chunks": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
}
ANSWERS = {
    **NOT_HTTP,
    "a page that is not the service's": (
        b"HTTP/1.1 200 OK\r\nContent-Length: 13\r\n\r\n<html></html>"
    ),
}

Ask = Callable[[httpx.AsyncClient, str], Awaitable[object]]


def _problem_404(problem: dict[str, object]) -> bytes:
    return _problem(404, "Not Found", problem)


def _problem(status: int, reason: str, problem: dict[str, object]) -> bytes:
    body = json.dumps(problem).encode()
    head = f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/problem+json\r\n"
    return head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body


SETTINGS = GatewaySettings.model_validate({})
INTERNAL_KEY = "an-internal-key-that-must-stay-out-of-logs"


async def _usage(http: httpx.AsyncClient, url: str) -> object:
    return await SchedulerClient(http, base_url=url).usage(
        "acme", first_day="2025-01-01", last_day="2025-01-31"
    )


async def _task(http: httpx.AsyncClient, url: str) -> object:
    return await StatusClient(http, base_url=url).find("t1", tenant_id="acme")


async def _history(http: httpx.AsyncClient, url: str) -> object:
    return await StatusClient(http, base_url=url).history("t1", tenant_id="acme", after=0)


async def _batch(http: httpx.AsyncClient, url: str) -> object:
    return await StatusClient(http, base_url=url).batch("b1", tenant_id="acme", after=-1, limit=10)


@dataclass(frozen=True)
class Call:
    make_http: Callable[[GatewaySettings], httpx.AsyncClient]  # as the gateway makes it
    ask: Ask
    unavailable: type[Unavailable]


CALLS = {
    "scheduler usage": Call(make_scheduler_http, _usage, SchedulerUnavailable),
    "status task": Call(make_status_http, _task, StatusUnavailable),
    "status history": Call(make_status_http, _history, StatusUnavailable),
    "status batch": Call(make_status_http, _batch, StatusUnavailable),
}


@pytest.fixture
async def answering(request: pytest.FixtureRequest) -> AsyncIterator[str]:
    """A local TCP server that reads a request and answers `request.param` (raw bytes)."""
    answer: bytes = request.param

    async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(reply, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("answering", ANSWERS.values(), ids=ANSWERS.keys(), indirect=True)
@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
async def test_an_unparsable_answer_is_the_service_unavailable(answering: str, call: Call) -> None:
    await _unavailable_raised(call, answering)


async def _unavailable_raised(call: Call, url: str) -> Unavailable:
    """What `call` raises asking the server at `url`: its service's `Unavailable`."""
    http = call.make_http(SETTINGS)
    try:
        with pytest.raises(call.unavailable) as raised:
            await call.ask(http, url)
    finally:
        await http.aclose()
    return raised.value


@pytest.mark.parametrize("answering", NOT_HTTP.values(), ids=NOT_HTTP.keys(), indirect=True)
@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
async def test_the_error_of_an_unparsable_answer_does_not_carry_the_internal_key(
    answering: str, call: Call
) -> None:
    """aiohttp's `ClientResponseError` repr holds the request's headers; the error's message
    (which the gateway logs) held `Authorization: Bearer <INTERNAL_API_KEY>`."""
    http = call.make_http(SETTINGS)
    http.headers["Authorization"] = f"Bearer {INTERNAL_KEY}"
    try:
        with pytest.raises(call.unavailable) as raised:
            await call.ask(http, answering)
    finally:
        await http.aclose()
    chain: BaseException | None = raised.value
    while chain is not None:
        if not isinstance(chain, aiohttp.ClientError):  # aiohttp's own is never logged by us
            assert INTERNAL_KEY not in str(chain), type(chain)
        chain = chain.__cause__


STATUS_CALLS = {name: call for name, call in CALLS.items() if name.startswith("status ")}
NOT_THE_STATUS_SERVICES_404 = {
    "a proxy's page": b"HTTP/1.1 404 Not Found\r\nContent-Length: 13\r\n\r\n<html></html>",
    "a route that is not there (a wrong path in STATUS_URL)": _problem_404(
        {"type": PROBLEM_BASE + "not-found", "status": 404, "detail": "Not Found"}
    ),
}
THE_STATUS_SERVICES_404 = {
    "task unknown": _problem_404(
        {"type": PROBLEM_BASE + TASK_UNKNOWN, "status": 404, "detail": "No task 't1' is known"}
    ),
    "task unknown, from an earlier build": _problem_404(
        {"type": PROBLEM_BASE + "not-found", "status": 404, "detail": "No task 't1' is known"}
    ),
}


@pytest.mark.parametrize(
    "answering",
    NOT_THE_STATUS_SERVICES_404.values(),
    ids=NOT_THE_STATUS_SERVICES_404.keys(),
    indirect=True,
)
@pytest.mark.parametrize("call", STATUS_CALLS.values(), ids=STATUS_CALLS.keys())
async def test_a_404_that_is_not_the_status_services_own_is_the_service_unavailable(
    answering: str, call: Call
) -> None:
    """Any 404 read as "task unknown": a proxy's page during a redeploy made the gateway
    answer 404 for every task past its read-your-writes window, and clients that take 404
    for lost submit again (found in review)."""
    await test_an_unparsable_answer_is_the_service_unavailable(answering, call)


@pytest.mark.parametrize(
    "answering", THE_STATUS_SERVICES_404.values(), ids=THE_STATUS_SERVICES_404.keys(), indirect=True
)
@pytest.mark.parametrize("ask", [_task, _history])
async def test_the_status_services_own_404_is_a_task_unknown(answering: str, ask: Ask) -> None:
    http = make_status_http(SETTINGS)
    try:
        assert await ask(http, answering) is None
    finally:
        await http.aclose()


REFUSED_FOR_GOOD = _problem(
    500,
    "Internal Server Error",
    {"type": PROBLEM_BASE + "database-refused", "status": 500, "detail": "refused for good"},
)
ERRED = _problem(
    500,
    "Internal Server Error",
    {"type": PROBLEM_BASE + "internal-server-error", "status": 500, "detail": "a bug"},
)


@pytest.mark.parametrize("answering", [REFUSED_FOR_GOOD], ids=["database-refused"], indirect=True)
@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
async def test_a_service_whose_database_refuses_for_good_is_passed_on_as_such(
    answering: str, call: Call
) -> None:
    """Taken for the service away, a 503 with Retry-After: clients that obey it retried for
    ever what the database refuses every time (a missing privilege; a review)."""
    assert refused_for_good(await _unavailable_raised(call, answering))


@pytest.mark.parametrize("answering", [ERRED], ids=["internal-server-error"], indirect=True)
@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
async def test_any_other_500_of_a_service_is_it_unavailable(answering: str, call: Call) -> None:
    assert not refused_for_good(await _unavailable_raised(call, answering))


TRICKLED = {
    # each byte well within the read timeout, the whole never
    "headers a byte at a time": (b"HTTP/1.1 200 OK\r\nX-Slow: ", b"a"),
    "a body a byte at a time": (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n",
        b" ",
    ),
}
QUICK = GatewaySettings.model_validate({"STATUS_TIMEOUT_S": "0.5", "SCHEDULER_TIMEOUT_S": "0.5"})


@pytest.fixture
async def trickling(request: pytest.FixtureRequest) -> AsyncIterator[str]:
    """A local TCP server that answers `request.param`'s head, then its filler byte every
    50 ms for as long as the client stays."""
    head, filler = request.param

    async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(head)
        with contextlib.suppress(ConnectionError):
            while not reader.at_eof():
                await writer.drain()
                writer.write(filler)
                await asyncio.sleep(0.05)  # the fault: a peer that never finishes
        writer.close()

    server = await asyncio.start_server(reply, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("trickling", TRICKLED.values(), ids=TRICKLED.keys(), indirect=True)
@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
async def test_an_answer_that_never_ends_is_the_service_unavailable(
    trickling: str, call: Call
) -> None:
    """httpx's timeouts reach aiohttp as a connect and a read timeout, each bounding one
    wait: an answer sent a byte at a time held the request for as long as it went on (the
    client's own deadline only keeps this test from hanging)."""
    http = call.make_http(QUICK)
    try:
        async with asyncio.timeout(60):
            with pytest.raises(call.unavailable) as raised:
                await call.ask(http, trickling)
    finally:
        await http.aclose()
    assert "ReadTimeout" in repr(raised.value.__cause__)
