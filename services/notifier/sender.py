"""POSTing one webhook to the addresses the SSRF guard checked, and to nothing else.

Each request gets a connector of its own whose resolver answers only the checked addresses
for the URL's host (the name is still used for `Host`, SNI and certificate checks), so what
was checked is what is connected to. No proxy from the environment, no redirects, no
decompression, explicit connect and total timeouts, and at most `max_response_bytes` of the
answer are read. The status line and headers are the answer: a 2xx body is not read, and a
refusal's body only best effort for its excerpt, so a body that breaks off or stalls never
turns an answer the receiver gave into "unreachable" (and a 2xx into another POST).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

from services.notifier.errors import ReceiverUnreachable, UnsafeDestination
from services.notifier.ssrf import Destination

USER_AGENT = "Scorebox-Webhooks/1"
# How long a refusal's body may take to give its excerpt; the status is known already.
EXCERPT_WAIT_S = 2.0
# The receiver's header block as aiohttp may parse it. Its defaults (lines and fields of
# 8,190 bytes, 128 headers) made a 2xx carrying one long header (a content security policy,
# a large cookie) "unreachable": the webhook was POSTed again up to WEBHOOK_MAX_ATTEMPTS
# times, then dead-lettered as failed. Still bounded: each delivery in flight holds at most
# a few MiB of a hostile receiver's headers.
MAX_HEADER_LINE_BYTES = 16_384
MAX_HEADERS = 256


@dataclass(frozen=True)
class ReceiverAnswer:
    status: int
    retry_after: str | None = None
    excerpt: str = ""


class PinnedResolver(AbstractResolver):
    """Answers the checked addresses for the destination's host, and fails for any other."""

    def __init__(self, destination: Destination) -> None:
        self._destination = destination

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        if host.rstrip(".") != self._destination.host.rstrip("."):
            raise OSError(f"{host} is not the checked destination {self._destination.host}")
        return [
            ResolveResult(
                hostname=host,
                host=str(address),
                port=port,
                family=socket.AF_INET6 if address.version == 6 else socket.AF_INET,
                proto=socket.IPPROTO_TCP,
                flags=socket.AI_NUMERICHOST,
            )
            for address in self._destination.addresses
        ]

    async def close(self) -> None:
        return None


def make_ssl_context(ca_file: Path | None) -> ssl.SSLContext:
    """Certificate and host name checks on; `ca_file` replaces the system trust store."""
    return ssl.create_default_context(cafile=str(ca_file) if ca_file else None)


class WebhookSender:
    def __init__(
        self,
        *,
        ssl_context: ssl.SSLContext,
        connect_timeout_s: float,
        timeout_s: float,
        max_response_bytes: int,
    ) -> None:
        self._ssl = ssl_context
        self._timeout = aiohttp.ClientTimeout(
            total=timeout_s, connect=connect_timeout_s, sock_connect=connect_timeout_s
        )
        self._timeout_s = timeout_s
        self._max_response_bytes = max_response_bytes

    async def post(
        self, destination: Destination, *, body: bytes, headers: Mapping[str, str]
    ) -> ReceiverAnswer:
        """Send the webhook; raises `ReceiverUnreachable` when no answer came back."""
        connector = aiohttp.TCPConnector(
            resolver=PinnedResolver(destination),
            ssl=self._ssl,
            use_dns_cache=False,
            force_close=True,
            limit=1,
        )
        request_headers = {
            "Content-Type": "application/json",
            "User-Agent": USER_AGENT,
            "Accept-Encoding": "identity",
            **headers,
        }
        deadline = asyncio.get_running_loop().time() + self._timeout_s
        answer: ReceiverAnswer | None = None
        try:
            async with (
                aiohttp.ClientSession(
                    connector=connector,
                    timeout=self._timeout,
                    trust_env=False,
                    auto_decompress=False,
                    max_line_size=MAX_HEADER_LINE_BYTES,
                    max_field_size=MAX_HEADER_LINE_BYTES,
                    max_headers=MAX_HEADERS,
                ) as session,
                session.post(
                    destination.url, data=body, headers=request_headers, allow_redirects=False
                ) as response,
            ):
                # The status line and headers are the answer; the body cannot take it back.
                answer = ReceiverAnswer(
                    status=response.status, retry_after=response.headers.get("Retry-After")
                )
                if not 200 <= response.status < 300:
                    excerpt = await self._excerpt(response, deadline=deadline)
                    answer = replace(answer, excerpt=excerpt)
        except aiohttp.InvalidURL as error:
            # The URL's doing, every attempt alike: the gateway's check refuses such URLs,
            # and one that passed it anyway retried for nothing, then went to the DLQ.
            why = f": {error.description}" if error.description else ""
            raise UnsafeDestination(f"the URL cannot be sent{why}") from error
        except (TimeoutError, aiohttp.ClientError, OSError) as error:
            if answer is not None:
                return answer  # only closing the connection failed
            if isinstance(error, TimeoutError):
                raise ReceiverUnreachable(f"no answer from {destination.host} in time") from error
            raise ReceiverUnreachable(f"{destination.host}: {_without_url(error)}") from error
        return answer

    async def _excerpt(self, response: aiohttp.ClientResponse, *, deadline: float) -> str:
        """At most `max_response_bytes` of a refusal's body, best effort: a body that breaks
        off or stalls (EXCERPT_WAIT_S at most, and never past the total timeout) leaves the
        excerpt empty, and the status stands."""
        wait_s = min(EXCERPT_WAIT_S, deadline - asyncio.get_running_loop().time())
        try:
            async with asyncio.timeout(max(wait_s, 0.0)):
                excerpt = await response.content.read(self._max_response_bytes)
        except (TimeoutError, aiohttp.ClientError, OSError):
            return ""
        return excerpt.decode(errors="replace")


def _without_url(error: BaseException) -> str:
    """What went wrong, for the logs, the ledger and the DLQ, without the callback URL: an
    aiohttp error about the answer (a malformed header, status line or chunk) spells the
    whole URL out, and a tenant's webhook token often lives in its path or query."""
    if isinstance(error, aiohttp.ClientResponseError):
        return f"malformed answer: {error.message}"
    return f"{type(error).__name__}: {error}"
