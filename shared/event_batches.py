"""Several events of one kind in one message: how a batch goes on the wire and comes apart.

A batch carries events that route alike (one routing key, the same routing headers), so it
reaches exactly the queues each of them would have reached alone. Its body is the JSON array
of the events' bodies, byte for byte as each would have been sent alone, and the header
`x-scorebox-batch` lists, per event, `[length, message_id, task_id, tenant_id]`: a consumer
cuts the body into the events' own bodies without parsing it (`split_batch`), and each part
reaches its handler as a delivery of its own (`shared.consumers`). A consumer that predates
batches reads the array as one unreadable event and dead-letters it: nothing is lost, and
the letter moved back after the upgrade is split as any batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

BATCH_HEADER: Final = "x-scorebox-batch"
# The headers of one event that differ between the events of a batch.
_PART_HEADERS: Final = ("x-tenant-id",)


class UnreadableBatch(ValueError):
    """A batch whose header does not describe its body."""


@dataclass(frozen=True, slots=True)
class Part:
    """One event of a batch, as it would have been delivered alone."""

    body: bytes
    message_id: str
    correlation_id: str
    headers: dict[str, Any]


@dataclass(frozen=True, slots=True)
class OneEvent:
    """An event ready for the wire: its body and its identifiers."""

    body: bytes
    message_id: str
    task_id: str
    tenant_id: str


def is_batch(headers: Mapping[str, Any] | None) -> bool:
    return headers is not None and BATCH_HEADER in headers


def encode_batch(events: Sequence[OneEvent]) -> tuple[bytes, list[list[Any]]]:
    """The batch's body and its `x-scorebox-batch` header."""
    body = b"[" + b",".join(event.body for event in events) + b"]"
    parts = [[len(e.body), e.message_id, e.task_id, e.tenant_id] for e in events]
    return body, parts


def split_batch(body: bytes, headers: Mapping[str, Any]) -> list[Part]:
    """The events of a batch delivery, each with the batch's headers as its own (less the
    batch's description, plus its own tenant); raises `UnreadableBatch`."""
    described = headers.get(BATCH_HEADER)
    if not isinstance(described, list) or not described:
        raise UnreadableBatch(f"{BATCH_HEADER} is not a list of parts: {described!r}")
    shared = {key: value for key, value in headers.items() if key != BATCH_HEADER}
    if body[:1] != b"[":
        raise UnreadableBatch("the body is not a JSON array")
    parts: list[Part] = []
    start = 1
    for index, entry in enumerate(described):
        length, message_id, task_id, tenant_id = _entry(entry)
        end = start + length
        closing = b"]" if index == len(described) - 1 else b","
        if not _object_between(body, start, end) or body[end : end + 1] != closing:
            raise UnreadableBatch(f"part {index} does not lie where its length says")
        parts.append(
            Part(
                body=body[start:end],
                message_id=message_id,
                correlation_id=task_id,
                headers={**shared, _PART_HEADERS[0]: tenant_id},
            )
        )
        start = end + 1  # past the comma, or the closing bracket
    if start != len(body):
        raise UnreadableBatch("the body goes on past its parts")
    return parts


def _object_between(body: bytes, start: int, end: int) -> bool:
    """Whether `body[start:end]` starts and ends as a JSON object does (every event is one):
    a length that is wrong is caught here rather than cutting an event in two."""
    return body[start : start + 1] == b"{" and body[end - 1 : end] == b"}"


def _entry(entry: Any) -> tuple[int, str, str, str]:
    if not isinstance(entry, list) or len(entry) != 4:
        raise UnreadableBatch(f"a part is not [length, message_id, task_id, tenant_id]: {entry!r}")
    length, message_id, task_id, tenant_id = entry
    if type(length) is not int or length < len(b"{}"):
        raise UnreadableBatch(f"a part's length is not an object's: {length!r}")
    if not all(isinstance(each, str) for each in (message_id, task_id, tenant_id)):
        raise UnreadableBatch(f"a part's identifiers are not strings: {entry!r}")
    return length, message_id, task_id, tenant_id
