"""POSTing one webhook to the addresses the SSRF guard checked, and to nothing else.

Each request gets a connector of its own whose resolver answers only the checked addresses
for the URL's host (the name is still used for `Host`, SNI and certificate checks), so what
was checked is what is connected to. No proxy from the environment, no redirects, no
decompression, explicit connect and total timeouts, and at most `max_response_bytes` of the
answer are read.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

from services.notifier.errors import ReceiverUnreachable
from services.notifier.ssrf import Destination

USER_AGENT = "Scorebox-Webhooks/1"


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
        try:
            async with (
                aiohttp.ClientSession(
                    connector=connector,
                    timeout=self._timeout,
                    trust_env=False,
                    auto_decompress=False,
                ) as session,
                session.post(
                    destination.url, data=body, headers=request_headers, allow_redirects=False
                ) as response,
            ):
                excerpt = await response.content.read(self._max_response_bytes)
                return ReceiverAnswer(
                    status=response.status,
                    retry_after=response.headers.get("Retry-After"),
                    excerpt=excerpt.decode(errors="replace"),
                )
        except TimeoutError as error:
            raise ReceiverUnreachable(f"no answer from {destination.host} in time") from error
        except (aiohttp.ClientError, OSError) as error:
            raise ReceiverUnreachable(
                f"{destination.host}: {type(error).__name__}: {error}"
            ) from error
