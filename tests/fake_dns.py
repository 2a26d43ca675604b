"""A name server on the loopback interface, over UDP: it answers A queries for the names it
knows, an empty answer to their other types, "no such name" to names under `.nx`, and nothing
at all to any other name (a tenant's unanswering name server)."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import struct
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

A_RECORD = 1
IN_CLASS = 1
RESPONSE_FLAGS = 0x8180  # a response, recursion desired and available, no error
NO_SUCH_NAME = 3  # the response code NXDOMAIN


@dataclass
class FakeNameServer(asyncio.DatagramProtocol):
    answers: Mapping[str, str]  # name → IPv4 address
    unanswered: list[str] = field(default_factory=list)  # names asked and left unanswered
    transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.DatagramTransport)
        self.transport = transport

    def datagram_received(self, data: bytes, addr: tuple[str | object, int]) -> None:
        name, question_end = _question(data)
        address = self.answers.get(name.lower())
        if name.endswith(".nx"):
            self._send(data, question_end, RESPONSE_FLAGS | NO_SUCH_NAME, b"", addr)
            return
        if address is None:
            self.unanswered.append(name)
            return
        (query_type,) = struct.unpack("!H", data[question_end - 4 : question_end - 2])
        records = b""
        if query_type == A_RECORD:
            packed = ipaddress.IPv4Address(address).packed
            records = struct.pack("!HHHIH", 0xC00C, A_RECORD, IN_CLASS, 60, 4) + packed
        self._send(data, question_end, RESPONSE_FLAGS, records, addr)

    def _send(
        self,
        query: bytes,
        question_end: int,
        flags: int,
        records: bytes,
        addr: tuple[str | object, int],
    ) -> None:
        header = struct.pack("!HHHHHH", _query_id(query), flags, 1, int(bool(records)), 0, 0)
        assert self.transport is not None
        self.transport.sendto(header + query[12:question_end] + records, addr)


def _query_id(data: bytes) -> int:
    (query_id,) = struct.unpack("!H", data[:2])
    return int(query_id)


def _question(data: bytes) -> tuple[str, int]:
    """The name asked, and where the question (name, type, class) ends."""
    labels, position = [], 12
    while data[position]:
        length = data[position]
        labels.append(data[position + 1 : position + 1 + length].decode())
        position += 1 + length
    return ".".join(labels), position + 1 + 4


@asynccontextmanager
async def fake_name_server(answers: Mapping[str, str]) -> AsyncIterator[tuple[FakeNameServer, str]]:
    """The server and its `host:port`."""
    loop = asyncio.get_running_loop()
    transport, server = await loop.create_datagram_endpoint(
        lambda: FakeNameServer(answers), local_addr=("127.0.0.1", 0), family=socket.AF_INET
    )
    try:
        host, port = transport.get_extra_info("sockname")[:2]
        yield server, f"{host}:{port}"
    finally:
        transport.close()
