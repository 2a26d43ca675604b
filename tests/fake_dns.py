"""A name server on the loopback interface, over UDP: it answers A queries for the names it
knows and an empty answer to their other types; for names under the test suffixes it answers
as a tenant's name server may:

- `.nx`: "no such name" (NXDOMAIN);
- `.nodata`: the name exists but has no record of the type asked, A and AAAA included
  (NOERROR with an empty answer, "NODATA": an apex with only MX or TXT records);
- `.servfail`: "server failure" (SERVFAIL);
- `.refused`: "refused" (REFUSED);

and nothing at all to any other name (a tenant's unanswering name server)."""

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
NO_ERROR = 0
SERVER_FAILURE = 2  # the response code SERVFAIL
NO_SUCH_NAME = 3  # the response code NXDOMAIN
REFUSED = 5  # the response code REFUSED
# The response code, with no record, the server answers for every name under a suffix.
EMPTY_ANSWERS = {
    ".nx": NO_SUCH_NAME,
    ".nodata": NO_ERROR,
    ".servfail": SERVER_FAILURE,
    ".refused": REFUSED,
}


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
        code = _empty_answer_code(name)
        if code is not None:
            self._send(data, question_end, RESPONSE_FLAGS | code, b"", addr)
            return
        address = self.answers.get(name.lower())
        if address is None:
            self.unanswered.append(name)
            return
        records = _a_record(address) if _query_type(data, question_end) == A_RECORD else b""
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


def _empty_answer_code(name: str) -> int | None:
    """The response code of a record-less answer for `name`; None for the other names."""
    for suffix, code in EMPTY_ANSWERS.items():
        if name.lower().endswith(suffix):
            return code
    return None


def _a_record(address: str) -> bytes:
    """One A record for the name asked (a pointer to the question's name)."""
    packed = ipaddress.IPv4Address(address).packed
    return struct.pack("!HHHIH", 0xC00C, A_RECORD, IN_CLASS, 60, 4) + packed


def _query_id(data: bytes) -> int:
    (query_id,) = struct.unpack("!H", data[:2])
    return int(query_id)


def _query_type(data: bytes, question_end: int) -> int:
    (query_type,) = struct.unpack("!H", data[question_end - 4 : question_end - 2])
    return int(query_type)


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
