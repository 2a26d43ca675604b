"""`shared.coalescing`: an operation's deadline counts its wait in the queue.

The round trips here are the test's own (`_send` waits until the test lets it finish), so the
test decides when an earlier round trip ends; what `_send` sees of the time limit is read from
pymongo's operation-timeout context, which every pymongo call inside it obeys.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from pymongo import AsyncMongoClient, _csot
from pymongo.errors import AutoReconnect, InvalidOperation, NetworkTimeout

from services.gateway.errors import DatabaseUnavailable
from services.gateway.refusals import may_have_been_written
from shared.coalescing import (
    PROBE_PAUSE_S,
    Coalescer,
    Queued,
    QueuedPastDeadline,
    ServerWatch,
    TimedOutInFlight,
    settle,
)
from shared.database_errors import transient_database_error
from shared.group_reads import GroupReader
from shared.group_writes import GroupWriter, _failures_by_index
from shared.log_context import CorrelationFilter, correlated
from tests.support import eventually


class HeldRoundTrips(Coalescer[str, str]):
    """Each round trip records its operations and the time left to it, then waits for
    `release` before answering every operation with its own name."""

    def __init__(self, *, deadline_s: float | None) -> None:
        super().__init__(max_batch=100, deadline_s=deadline_s)
        self.sent: list[tuple[list[str], float | None]] = []
        self.release = asyncio.Event()

    async def _send(self, batch: list[Queued[str, str]]) -> None:
        limit = _csot.remaining() if _csot.get_timeout() is not None else None
        self.sent.append(([queued.op for queued in batch], limit))
        await self.release.wait()
        for queued in batch:
            settle(queued, queued.op)


async def _past(moment: float) -> None:
    loop = asyncio.get_running_loop()
    await eventually(lambda: _later_than(loop, moment), timeout_s=10, what="the deadline")


async def _later_than(loop: asyncio.AbstractEventLoop, moment: float) -> bool:
    return loop.time() > moment


async def test_an_operation_that_waited_past_its_deadline_is_not_sent() -> None:
    """Answered at its deadline, while still queued: it was answered only once the flusher
    reached it, after a round trip that may outlast its own limit (PyMongo's server
    selection waits in steps of half a second; found in review)."""
    coalescer = HeldRoundTrips(deadline_s=0.2)
    first = asyncio.create_task(coalescer.submit("first"))
    await eventually(lambda: _started(coalescer, 1), what="the first round trip")
    second = asyncio.create_task(coalescer.submit("second"))

    with pytest.raises(QueuedPastDeadline):
        await asyncio.wait_for(second, timeout=10)  # the first round trip still held
    with pytest.raises(TimedOutInFlight):
        await asyncio.wait_for(first, timeout=10)  # it outlasted its limit and the grace
    coalescer.release.set()
    await eventually(lambda: _idle(coalescer), what="the flusher done")
    assert [ops for ops, _ in coalescer.sent] == [["first"]]  # never sent


async def test_a_round_trip_gets_what_is_left_of_its_latest_deadline() -> None:
    coalescer = HeldRoundTrips(deadline_s=10.0)
    loop = asyncio.get_running_loop()
    first = asyncio.create_task(coalescer.submit("first"))
    await eventually(lambda: _started(coalescer, 1), what="the first round trip")
    queued_at = loop.time()
    second = asyncio.create_task(coalescer.submit("second"))
    await _past(queued_at + 1.0)

    coalescer.release.set()
    await eventually(lambda: _started(coalescer, 2), what="the second round trip")

    assert [await first, await second] == ["first", "second"]
    (_, first_limit), (ops, second_limit) = coalescer.sent
    assert ops == ["second"]
    assert first_limit is not None
    assert 0 < first_limit <= 10.0
    assert second_limit is not None
    assert 0 < second_limit < 9.0  # its second in the queue counted


class SendsThrough(Coalescer[str, str]):
    """Sends each of its operations through `inner`, as the gateway's counters send theirs
    through a `GroupWriter`."""

    def __init__(self, inner: Coalescer[str, str], *, deadline_s: float) -> None:
        super().__init__(max_batch=100, deadline_s=deadline_s)
        self.inner = inner

    async def _send(self, batch: list[Queued[str, str]]) -> None:
        for queued in batch:
            settle(queued, await self.inner.submit(queued.op))


async def test_a_round_trip_sent_through_another_coalescer_keeps_to_its_own_limit() -> None:
    """Each submission to the inner coalescer counted a deadline afresh: a member that had
    waited in the outer queue was answered up to that wait past its own deadline, or more
    than one inner round trip later (found in review of the gateway's counters)."""
    inner = HeldRoundTrips(deadline_s=10.0)
    outer = SendsThrough(inner, deadline_s=10.0)
    loop = asyncio.get_running_loop()
    first = asyncio.create_task(outer.submit("first"))
    await eventually(lambda: _started(inner, 1), what="the first round trip")
    queued_at = loop.time()
    second = asyncio.create_task(outer.submit("second"))
    await _past(queued_at + 1.0)

    inner.release.set()
    await eventually(lambda: _started(inner, 2), what="the second round trip")

    assert [await first, await second] == ["first", "second"]
    (ops, second_limit) = inner.sent[1]
    assert ops == ["second"]
    assert second_limit is not None
    assert 0 < second_limit < 9.0  # its second in the outer queue counted


class AwayServer:
    """A `ServerWatch` whose server is away until `come_back`: its probe command waits."""

    def __init__(self) -> None:
        self.back = asyncio.Event()
        self.probes = 0

    def known(self) -> bool:
        return self.back.is_set()

    async def answered(self) -> object:
        self.probes += 1
        await self.back.wait()
        return {"ok": 1}

    def come_back(self) -> None:
        self.back.set()


class WatchedRoundTrips(HeldRoundTrips):
    def __init__(self, server: AwayServer, *, deadline_s: float) -> None:
        super().__init__(deadline_s=deadline_s)
        self._server = ServerWatch(known=server.known, answered=server.answered)
        self.release.set()


async def test_while_no_server_is_known_nothing_is_sent_and_each_fails_by_its_own_deadline() -> (
    None
):
    """Handed to the driver with no server known, a batch went on waiting in server selection:
    members told "never sent" by their deadlines were sent when the database came back
    (found in review). Bounded by the earliest deadline instead, `later` failed with `soon`,
    a second before its own deadline and before the server came back (found in review)."""
    server = AwayServer()
    coalescer = WatchedRoundTrips(server, deadline_s=2.0)
    loop = asyncio.get_running_loop()
    began = loop.time()
    first = asyncio.create_task(coalescer.submit("first"))
    await eventually(lambda: _probing(server, 1), what="the first probe")
    await _past(began + 0.5)
    soon = asyncio.create_task(coalescer.submit("soon"))  # queued behind the first's probe
    await _past(began + 1.5)
    later = asyncio.create_task(coalescer.submit("later"))  # and with `soon`, a second after

    with pytest.raises(QueuedPastDeadline):
        await first
    await eventually(lambda: _probing(server, 2), what="the probe of `soon` and `later`")
    with pytest.raises(QueuedPastDeadline):
        await soon  # failed by its own deadline, `later` still waiting with it
    assert not later.done()
    server.come_back()

    assert await later == "later"
    assert [ops for ops, _ in coalescer.sent] == [["later"]]  # nothing else ever sent


class RefusingServer(AwayServer):
    """Its probe command fails at once, with `error`."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    async def answered(self) -> object:
        self.probes += 1
        raise self.error


async def test_a_probe_failing_at_once_is_paced_and_its_batch_never_sent() -> None:
    """A probe that failed without waiting for a server was tried again at once, tens of
    thousands of times a second, until the batch's deadline (found in review)."""
    server = RefusingServer(AutoReconnect("connection refused"))
    coalescer = WatchedRoundTrips(server, deadline_s=1.0)

    with pytest.raises(QueuedPastDeadline):
        await asyncio.wait_for(coalescer.submit("only"), timeout=10)

    assert 1 <= server.probes <= 1.0 / PROBE_PAUSE_S + 1
    assert coalescer.sent == []


async def test_a_closed_client_fails_the_batch_at_once() -> None:
    server = RefusingServer(InvalidOperation("Cannot use MongoClient after close"))
    coalescer = WatchedRoundTrips(server, deadline_s=10.0)

    with pytest.raises(InvalidOperation):
        await asyncio.wait_for(coalescer.submit("only"), timeout=5)

    assert (server.probes, coalescer.sent) == (1, [])


async def _probing(server: AwayServer, probes: int) -> bool:
    return server.probes >= probes


class SlowDatabase(Coalescer[str, str]):
    """Every round trip takes `reply_s`, and fails as PyMongo's does when the time limit it
    was sent with is shorter."""

    def __init__(self, *, deadline_s: float, reply_s: float) -> None:
        super().__init__(max_batch=100, deadline_s=deadline_s)
        self.reply_s = reply_s

    async def _send(self, batch: list[Queued[str, str]]) -> None:
        limit = _csot.remaining()
        assert limit is not None
        if limit < self.reply_s:
            await asyncio.sleep(max(limit, 0))
            raise NetworkTimeout("timed out")
        await asyncio.sleep(self.reply_s)
        for queued in batch:
            settle(queued, queued.op)


async def test_a_database_slower_than_half_the_timeout_still_answers_most_writes() -> None:
    """Bounded by its oldest member's remainder (that member waited through the round trip
    before), nearly every round trip failed whole once replies took more than half the
    timeout, though each write alone would have been answered in time (found in review)."""
    # Arrivals paced in real time (the driver's deadline is real time): at this scale a busy
    # machine's delays of tens of milliseconds move no write across its deadline.
    coalescer = SlowDatabase(deadline_s=5.0, reply_s=3.0)
    submissions = []
    for index in range(30):
        submissions.append(asyncio.create_task(coalescer.submit(f"w{index}")))
        await asyncio.sleep(0.2)
    outcomes = await asyncio.gather(*submissions, return_exceptions=True)
    answered = [outcome for outcome in outcomes if isinstance(outcome, str)]
    timed_out = [outcome for outcome in outcomes if isinstance(outcome, TimedOutInFlight)]
    assert len(answered) + len(timed_out) == len(outcomes), outcomes
    # Bounded by the oldest member, 1 or 2 of the 30 were answered; now about two thirds.
    assert len(answered) >= len(outcomes) // 3, outcomes


async def test_without_a_deadline_nothing_is_bounded_here() -> None:
    coalescer = HeldRoundTrips(deadline_s=None)
    coalescer.release.set()
    assert await coalescer.submit("only") == "only"
    assert coalescer.sent == [(["only"], None)]


@pytest.mark.parametrize("timeout_ms", [1500, None])
async def test_group_writes_and_reads_take_the_clients_operation_timeout(
    timeout_ms: int | None,
) -> None:
    options: dict[str, Any] = {} if timeout_ms is None else {"timeoutMS": timeout_ms}
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
        "mongodb://127.0.0.1:9/?directConnection=true", connect=False, **options
    )
    collection = client["scorebox_unit"]["anything"]
    expected = None if timeout_ms is None else timeout_ms / 1000
    assert GroupWriter(collection).deadline_s == expected
    assert GroupReader(collection).deadline_s == expected
    await client.close()


def test_an_operation_not_sent_counts_as_never_written() -> None:
    """The gateway need not write off a refusal whose insert never left (`refusals`)."""
    error = DatabaseUnavailable("queued too long")
    error.__cause__ = QueuedPastDeadline("waited past its deadline")
    assert not may_have_been_written(error)


async def _idle(coalescer: Coalescer[str, str]) -> bool:
    flusher = coalescer._flusher  # whether it has anything left to send
    return flusher is None or flusher.done()


async def _started(coalescer: HeldRoundTrips, round_trips: int) -> bool:
    return len(coalescer.sent) >= round_trips


class SeesItsContext(Coalescer[str, str]):
    """Answers each operation with the correlation id its round trip runs under."""

    def __init__(self) -> None:
        super().__init__(max_batch=100, deadline_s=None)

    async def _send(self, batch: list[Queued[str, str]]) -> None:
        record = logging.LogRecord("scorebox.test", logging.INFO, __file__, 1, "sent", (), None)
        CorrelationFilter().filter(record)
        for queued in batch:
            settle(queued, str(getattr(record, "correlation_id", None)))


async def test_a_round_trip_runs_in_a_context_of_its_own() -> None:
    """It ran in the first caller's: its log lines carried that one delivery's correlation
    id though it served every caller queued meanwhile."""
    coalescer = SeesItsContext()
    with correlated("task-1"):
        seen = await coalescer.submit("first")
    assert seen == "None"


def test_a_replication_timeout_in_a_grouped_write_is_a_passing_outage_not_a_refusal() -> None:
    """pymongo raises a write concern's `wtimeout` as `WTimeoutError` (`timeout` true); built
    as a plain `WriteConcernError`, a submission behind it was answered 500 "refused for
    good" instead of 503 "retry shortly"."""
    timed_out = {"code": 64, "errmsg": "waiting for replication timed out"}
    details = {
        "writeErrors": [],
        "writeConcernErrors": [{**timed_out, "errInfo": {"wtimeout": True}}],
    }
    refused = {"writeErrors": [], "writeConcernErrors": [{"code": 100, "errmsg": "unsatisfiable"}]}

    assert transient_database_error(_failures_by_index(details, size=1)[0])
    assert not transient_database_error(_failures_by_index(refused, size=1)[0])
