"""A service's clock against its database's, checked at start-up.

Replicas judge each other's records by their own clocks: the outbox sweep takes a submission
older than `OUTBOX_GRACE_S` for one its request left (and sends it), a keyed replay takes an
earlier request for one still running while it is young, scorers take over a claim whose
lease has run out, and the scheduler's runs and leases are dated the same way. A replica
whose clock ran 90 s behind the others' had its requests' records, still being refused
("nothing was kept"), swept and scored by another replica (a review). A service therefore
compares its wall clock with the database server's (`hello`'s `localTime`, the mid-point of
the round trip taken for its own time) and refuses to start when they differ by more than
`MAX_CLOCK_OFFSET_S`, as CockroachDB refuses a node whose clock is past its maximum offset;
a smaller offset over `WARN_CLOCK_OFFSET_S` is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from pymongo import AsyncMongoClient
from pymongo.errors import PyMongoError

from shared.contracts import utcnow

log = logging.getLogger("scorebox.clock")
# This machine's clock, not a service's injected one (tests run services on clocks of their
# own); a module attribute so that a test can set it back or ahead.
wall_clock: Callable[[], datetime] = utcnow

WARN_CLOCK_OFFSET_S = 1.0


class ClockNotTold(Exception):
    """The server's answer to `hello` carries no `localTime` (a stand-in or proxy of
    another kind): nothing to compare with."""


class ClockOffsetTooLarge(RuntimeError):
    """The service's clock is further from the database's than `MAX_CLOCK_OFFSET_S`."""


async def clock_offset_s(
    client: AsyncMongoClient[Any], *, now: Callable[[], datetime] | None = None
) -> float:
    """How far the database server's clock is ahead of this process's wall clock (`now`;
    negative: behind), to within half the round trip and the millisecond `localTime` keeps.
    The wall clock, not a service's injected one: tests run services on clocks of their own."""
    now = now or wall_clock
    before = now()
    answer = await client.admin.command("hello")
    after = now()
    server = answer.get("localTime")
    if not isinstance(server, datetime):
        raise ClockNotTold(f"the server's `hello` gave no localTime: {server!r}")
    if server.tzinfo is None:
        server = server.replace(tzinfo=UTC)
    return (server - (before + (after - before) / 2)).total_seconds()


def check_clock_offset(offset_s: float, *, max_offset_s: float, service: str) -> None:
    """`ClockOffsetTooLarge` past `max_offset_s` (0: not checked), a warning past
    `WARN_CLOCK_OFFSET_S`."""
    if max_offset_s <= 0:
        return
    if abs(offset_s) > max_offset_s:
        raise ClockOffsetTooLarge(
            f"{service}'s clock is {_words(offset_s)} the database server's, more than "
            f"MAX_CLOCK_OFFSET_S ({max_offset_s:g} s): replicas judge each other's records by "
            "their clocks (the outbox sweep, claims' leases, rate windows), so it does not "
            "start; synchronise the machines' clocks (NTP)"
        )
    if abs(offset_s) > WARN_CLOCK_OFFSET_S:
        log.warning(
            "%s's clock is %s the database server's (MAX_CLOCK_OFFSET_S: %g s)",
            service,
            _words(offset_s),
            max_offset_s,
        )


async def check_clock(client: AsyncMongoClient[Any], *, max_offset_s: float, service: str) -> None:
    """Measure the offset and check it (`check_clock_offset`); logged as an error first when
    it stops the service, for the operator reading the service's log."""
    if max_offset_s <= 0:
        return
    try:
        offset_s = await clock_offset_s(client)
    except (PyMongoError, ClockNotTold) as error:  # it just answered the start-up's writes
        log.warning("%s: its clock not checked against the database's: %r", service, error)
        return
    try:
        check_clock_offset(offset_s, max_offset_s=max_offset_s, service=service)
    except ClockOffsetTooLarge as refused:
        log.error("%s", refused)  # noqa: TRY400 - the reason, not a traceback of ours
        raise


def _words(offset_s: float) -> str:
    """The offset from this clock's side: the server ahead means this clock is behind."""
    return f"{abs(offset_s):.1f} s {'behind' if offset_s > 0 else 'ahead of'}"
