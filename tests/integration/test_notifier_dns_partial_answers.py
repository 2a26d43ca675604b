"""A receiver's address DNS gave at once is used when the AAAA query, or one UDP datagram,
goes unanswered (found in review).

`CaresResolver` gave c-ares one try of the whole `WEBHOOK_DNS_TIMEOUT_S` inside an outer
timeout of the same length. `getaddrinfo` asks A and AAAA together and waits for both; with
the AAAA query never answered (a name server or middlebox dropping AAAA), c-ares returns the
A address at its own timeout, which the outer one, started first, always beat: every attempt
was "no DNS answer", and the webhook was retried, then failed and dead-lettered, never POSTed.
One lost datagram failed the lookup too (no second try). Against the test's name servers on
127.0.0.1 (`tests/fake_dns.py`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from services.notifier.ssrf import CaresResolver, WebhookGuard
from tests.fake_dns import FakeNameServer, _query_type, _question

AAAA = 28
A = 1
PUBLIC = "93.184.216.34"


class DropsAAAA(FakeNameServer):
    """Answers A at once; never answers AAAA."""

    def datagram_received(self, data: bytes, addr: tuple[str | object, int]) -> None:
        name, end = _question(data)
        if _query_type(data, end) == AAAA:
            self.unanswered.append(name)
            return
        super().datagram_received(data, addr)


class LosesFirstA(FakeNameServer):
    """The first A query is lost on the way (one UDP datagram); everything else answered."""

    lost = False

    def datagram_received(self, data: bytes, addr: tuple[str | object, int]) -> None:
        _, end = _question(data)
        if _query_type(data, end) == A and not self.lost:
            self.lost = True
            return
        super().datagram_received(data, addr)


@asynccontextmanager
async def _server(kind: type[FakeNameServer]) -> AsyncIterator[str]:
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(
        lambda: kind({"hooks.example.test": PUBLIC}),
        local_addr=("127.0.0.1", 0),
        family=socket.AF_INET,
    )
    try:
        host, port = transport.get_extra_info("sockname")[:2]
        yield f"{host}:{port}"
    finally:
        transport.close()


@pytest.mark.parametrize(
    "name_server", [DropsAAAA, LosesFirstA], ids=["aaaa-unanswered", "one-datagram-lost"]
)
async def test_the_a_answer_is_used_though_a_query_went_unanswered(
    name_server: type[FakeNameServer],
) -> None:
    async with _server(name_server) as address:
        resolver = CaresResolver(timeout_s=2.0, nameservers=[address])
        try:
            destination = await WebhookGuard(resolver).vet("https://hooks.example.test/hook")
        finally:
            await resolver.close()
    assert destination.addresses == (ipaddress.ip_address(PUBLIC),)
