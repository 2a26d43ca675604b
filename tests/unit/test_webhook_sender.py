"""The receiver's answer is its status line and headers; a body that breaks off cannot take
it back.

`WebhookSender.post` used to read an excerpt of every body before returning the status, so a
2xx whose body was cut short (`Content-Length: 10`, then the connection closed) or stalled
became "unreachable", and the webhook the receiver had accepted was POSTed again up to
`WEBHOOK_MAX_ATTEMPTS` times, then dead-lettered as failed. The bodies here break off or
stall before their first byte, so the old read always waited for them. The receiver is a
real TLS server on 127.0.0.1 writing raw HTTP bytes, reached through the SSRF guard the way
the notifier reaches any receiver (its name exempted for the test, as the integration tests
do).

Nor does the sender go anywhere the guard did not check: it stops at a redirect (a 3xx is
the answer) and takes no proxy from the environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import ssl
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime
from pathlib import Path

import pytest
import trustme

from services.notifier import sender as sender_module
from services.notifier.deliveries import judge_answer
from services.notifier.errors import ReceiverUnavailable, ReceiverUnreachable, UnsafeDestination
from services.notifier.sender import WebhookSender, make_ssl_context
from services.notifier.ssrf import Destination, WebhookGuard
from shared.webhook_urls import IPAddress

HOST = "receiver.scorebox.test"
NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


class Loopback:
    async def resolve(self, host: str, port: int) -> Sequence[IPAddress]:
        return [ipaddress.ip_address("127.0.0.1")] if host == HOST else []


class RawReceiver:
    """Reads each POST whole, writes `reply` as is, then closes or holds the connection open
    until the test ends."""

    def __init__(self, reply: bytes, *, hold_open: bool) -> None:
        self.reply = reply
        self.hold_open = hold_open
        self.posts = 0
        self.release = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            await reader.readexactly(length)
            self.posts += 1
            writer.write(self.reply)
            await writer.drain()
            if self.hold_open:
                await self.release.wait()
        except (OSError, asyncio.IncompleteReadError):
            pass  # the sender hung up first: what it made of the answer is what is tested
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


class Recorder:
    """A plain HTTP server that records the head of each request and answers `reply`: where
    a redirect points, or a proxy."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        self.heads: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            self.heads.append(await reader.readuntil(b"\r\n\r\n"))
            writer.write(self.reply)
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[ssl.SSLContext, Path]:
    ca = trustme.CA()
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(HOST).configure_cert(server)
    ca_file = tmp_path_factory.mktemp("sender") / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    return server, ca_file


@contextlib.asynccontextmanager
async def receiving(
    tls: tuple[ssl.SSLContext, Path],
    reply: bytes,
    *,
    hold_open: bool = False,
    path: str = "/hook",
) -> AsyncIterator[tuple[RawReceiver, Destination]]:
    receiver = RawReceiver(reply, hold_open=hold_open)
    server = await asyncio.start_server(receiver.handle, "127.0.0.1", 0, ssl=tls[0])
    port = server.sockets[0].getsockname()[1]
    guard = WebhookGuard(Loopback(), allowed_test_hosts=frozenset({"127.0.0.1"}))
    try:
        yield receiver, await guard.vet(f"https://{HOST}:{port}{path}")
    finally:
        receiver.release.set()
        server.close()
        await server.wait_closed()


@contextlib.asynccontextmanager
async def recording(host: str, reply: bytes) -> AsyncIterator[tuple[Recorder, str]]:
    """A `Recorder` listening on `host`, and its base URL."""
    recorder = Recorder(reply)
    server = await asyncio.start_server(recorder.handle, host, 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield recorder, f"http://{host}:{port}"
    finally:
        server.close()
        await server.wait_closed()


def _sender(tls: tuple[ssl.SSLContext, Path], *, timeout_s: float) -> WebhookSender:
    return WebhookSender(
        ssl_context=make_ssl_context(tls[1]),
        connect_timeout_s=timeout_s,
        timeout_s=timeout_s,
        max_response_bytes=64,
    )


async def _post(sender: WebhookSender, destination: Destination) -> sender_module.ReceiverAnswer:
    return await sender.post(destination, body=b'{"type": "task.completed"}', headers={})


def _reply(status: str, *, body: bytes, content_length: int, **headers: str) -> bytes:
    lines = [f"HTTP/1.1 {status}", f"Content-Length: {content_length}", "Connection: close"]
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def test_a_2xx_whose_body_breaks_off_is_delivered(tls: tuple[ssl.SSLContext, Path]) -> None:
    reply = _reply("200 OK", body=b"", content_length=10)  # none of the 10 bytes comes
    async with receiving(tls, reply) as (receiver, destination):
        answer = await _post(_sender(tls, timeout_s=10), destination)

    assert answer.status == 200
    judge_answer(answer, now=NOW)  # delivered: nothing is retried
    assert receiver.posts == 1


async def test_a_2xx_whose_body_stalls_is_delivered_at_once(
    tls: tuple[ssl.SSLContext, Path],
) -> None:
    reply = _reply("202 Accepted", body=b"", content_length=10)
    async with receiving(tls, reply, hold_open=True) as (receiver, destination):
        # The body never ends; the answer must not wait for it (nor for the total timeout:
        # the guard, well short of it, fails a sender that would).
        async with asyncio.timeout(10):
            answer = await _post(_sender(tls, timeout_s=60), destination)

    assert answer.status == 202
    judge_answer(answer, now=NOW)
    assert receiver.posts == 1


async def test_a_5xx_whose_body_breaks_off_is_that_5xx_not_unreachable(
    tls: tuple[ssl.SSLContext, Path],
) -> None:
    reply = _reply("500 Internal Server Error", body=b"", content_length=10, Retry_After="7")
    async with receiving(tls, reply) as (_, destination):
        answer = await _post(_sender(tls, timeout_s=10), destination)

    assert answer.status == 500
    assert answer.retry_after == "7"
    assert answer.excerpt == ""
    with pytest.raises(ReceiverUnavailable) as raised:
        judge_answer(answer, now=NOW)
    assert raised.value.retry_after_s == 7.0


async def test_a_refusals_stalled_body_is_waited_for_briefly_then_the_status_stands(
    tls: tuple[ssl.SSLContext, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sender_module, "EXCERPT_WAIT_S", 0.2)
    reply = _reply("503 Service Unavailable", body=b"", content_length=10)
    async with receiving(tls, reply, hold_open=True) as (_, destination):
        # Bounded by the excerpt's own wait, well inside the 30 s total timeout.
        async with asyncio.timeout(5):
            answer = await _post(_sender(tls, timeout_s=30), destination)

    assert (answer.status, answer.excerpt) == (503, "")


async def test_a_refusals_excerpt_is_kept_and_capped(tls: tuple[ssl.SSLContext, Path]) -> None:
    body = b"no such hook " + b"x" * 200
    reply = _reply("404 Not Found", body=body, content_length=len(body))
    async with receiving(tls, reply) as (_, destination):
        answer = await _post(_sender(tls, timeout_s=10), destination)

    assert answer.status == 404
    assert answer.excerpt.startswith("no such hook")
    assert len(answer.excerpt) <= 64


async def test_a_2xx_with_a_long_header_and_many_headers_is_delivered(
    tls: tuple[ssl.SSLContext, Path],
) -> None:
    """aiohttp's default limits (8,190 bytes a header, 128 headers) made such an answer
    "unreachable", and the accepted webhook was POSTed again, then dead-lettered."""
    policy = "default-src 'self'; " + "script-src https://cdn.example " * 400  # ~12 KiB
    many = {f"X_Trace_{index}": str(index) for index in range(200)}
    reply = _reply("200 OK", body=b"", content_length=0, Content_Security_Policy=policy, **many)
    async with receiving(tls, reply) as (receiver, destination):
        answer = await _post(_sender(tls, timeout_s=10), destination)

    assert answer.status == 200
    judge_answer(answer, now=NOW)
    assert receiver.posts == 1


async def test_a_header_past_the_limit_is_no_answer(tls: tuple[ssl.SSLContext, Path]) -> None:
    """The limits are raised, not removed: a receiver cannot make the notifier hold any
    amount of header."""
    huge = "x" * (sender_module.MAX_HEADER_LINE_BYTES + 1)
    reply = _reply("200 OK", body=b"", content_length=0, X_Huge=huge)
    async with receiving(tls, reply) as (_, destination):
        with pytest.raises(ReceiverUnreachable):
            await _post(_sender(tls, timeout_s=10), destination)


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 200 OK\r\nX-A: a\x00b\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n",
        b"SMTP ready\r\n\r\n",
    ],
    ids=["nul-in-a-header", "bad-content-length", "not-http"],
)
async def test_a_malformed_answer_is_reported_without_the_urls_path_or_query(
    tls: tuple[ssl.SSLContext, Path], reply: bytes
) -> None:
    """aiohttp's error for an answer it cannot parse spells the whole URL out, and the reason
    goes to the logs, the delivery ledger and the DLQ's `x-scorebox-error`: a Slack-style
    webhook's token, in its path, or one in its query, was written to all three (review)."""
    path = "/services/T0/B0/SECRET-IN-PATH?token=SECRET-IN-QUERY"
    async with receiving(tls, reply, path=path) as (_, destination):
        with pytest.raises(ReceiverUnreachable) as caught:
            await _post(_sender(tls, timeout_s=10), destination)

    assert "SECRET" not in caught.value.reason
    assert caught.value.reason.startswith(f"{HOST}: ")


@pytest.mark.parametrize(("status", "reason"), [(302, "Found"), (307, "Temporary Redirect")])
async def test_a_redirect_is_the_answer_and_is_not_followed(
    tls: tuple[ssl.SSLContext, Path], status: int, reason: str
) -> None:
    """Nothing failed when `allow_redirects=False` was dropped: the webhook then went on to
    the `Location`, an address the SSRF guard never checked (an IP literal is connected to
    without the pinned resolver), here a second server on 127.0.0.2 standing for an internal
    one."""
    ok = _reply("200 OK", body=b"", content_length=0)
    async with recording("127.0.0.2", ok) as (internal, internal_url):
        location = f"{internal_url}/latest/meta-data/"
        reply = _reply(f"{status} {reason}", body=b"", content_length=0, Location=location)
        async with receiving(tls, reply) as (receiver, destination):
            answer = await _post(_sender(tls, timeout_s=10), destination)

    assert internal.heads == []
    assert answer.status == status
    assert receiver.posts == 1


async def test_the_environments_proxy_is_not_used(
    tls: tuple[ssl.SSLContext, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing failed when `trust_env=False` was dropped: the webhook then went through the
    proxy HTTPS_PROXY named, which connects wherever it likes, not to the checked addresses.
    """
    refusal = _reply("502 Bad Gateway", body=b"", content_length=0)
    async with recording("127.0.0.1", refusal) as (proxy, proxy_url):
        for name in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY"):
            monkeypatch.setenv(name, proxy_url)
            monkeypatch.setenv(name.lower(), proxy_url)  # the lower-case ones win
        for name in ("NO_PROXY", "no_proxy"):
            monkeypatch.delenv(name, raising=False)
        ok = _reply("200 OK", body=b"", content_length=0)
        async with receiving(tls, ok) as (receiver, destination):
            answer = await _post(_sender(tls, timeout_s=10), destination)

    assert proxy.heads == []
    assert (answer.status, receiver.posts) == (200, 1)


async def test_a_url_the_http_client_cannot_send_gives_the_delivery_up(
    tls: tuple[ssl.SSLContext, Path],
) -> None:
    """No answer would ever come: retried as one, it ended in the operators' DLQ (review)."""
    address = ipaddress.ip_address("2606:4700::1")
    url = "https://[2606:4700::1]x/hook?token=SECRET"
    destination = Destination(url, "2606:4700::1", 443, (address,))
    with pytest.raises(UnsafeDestination, match="cannot be sent") as caught:
        await _post(_sender(tls, timeout_s=5), destination)
    assert "SECRET" not in caught.value.reason
