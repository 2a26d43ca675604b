"""Refusals waiting to be written off: what they hold, their bound, and the order of a write-off
(its writes are checked on the real database in `tests/integration/test_refusals.py`)."""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from datetime import UTC, datetime

import pytest
from pymongo.errors import AutoReconnect, NetworkTimeout, ServerSelectionTimeoutError

from services.gateway.errors import DatabaseUnavailable
from services.gateway.refusals import (
    TOMBSTONE_CHUNK,
    Refusal,
    Refusals,
    may_have_been_written,
    write_off,
)

NOW = datetime(2030, 5, 17, 12, 0, tzinfo=UTC)


class Database:
    """Records the write-off's writes in order; fails every write once `down` is set."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, object]] = []
        self.down = False
        self.fails_once: set[tuple[str, object]] = set()  # these writes fail, once each

    def _write(self, what: str, subject: object) -> None:
        if self.down:
            raise DatabaseUnavailable("down")
        if (what, subject) in self.fails_once:
            self.fails_once.remove((what, subject))
            raise DatabaseUnavailable("timed out")
        self.writes.append((what, subject))

    async def release(self, tenant_id: str, task_id: str) -> None:
        self._write("release", task_id)


class SubmissionTombstones:
    def __init__(self, database: Database, kept: frozenset[str] = frozenset()) -> None:
        self.database = database
        self.kept = kept  # sent after all: no tombstone for them
        self.in_flight = self.most_in_flight = 0  # tombstones queued at once

    async def abandon(self, task_ids: tuple[str, ...], *, now: datetime) -> set[str]:
        self.in_flight += len(task_ids)
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0)  # a round trip: the others queued meanwhile are seen
            self.database._write("abandon", task_ids)
        finally:
            self.in_flight -= len(task_ids)
        return set(self.kept & set(task_ids))

    async def uncount(self, task_ids: Collection[str]) -> None:
        self.database._write("uncount", tuple(sorted(task_ids)))


class BatchTombstones:
    def __init__(self, database: Database, accepted: frozenset[str] = frozenset()) -> None:
        self.database = database
        self.accepted = accepted

    async def abandon(self, batch_id: str, *, now: datetime) -> bool:
        self.database._write("abandon batch", batch_id)
        return batch_id not in self.accepted

    async def refused(self, batch_id: str) -> bool:
        return ("abandon batch", batch_id) in self.database.writes and batch_id not in self.accepted


async def _write_off(
    refusals: Refusals, database: Database, accepted: frozenset[str] = frozenset()
) -> int:
    return await write_off(
        refusals,
        submissions=SubmissionTombstones(database),
        batches=BatchTombstones(database, accepted),
        in_flight=database,
        now=NOW,
    )


def test_a_task_is_held_until_every_refusal_naming_it_is_written_off() -> None:
    refusals = Refusals()
    first, second = Refusal("a", ("t1", "t2")), Refusal("a", ("t2",), batch_id="b")
    refusals.note(first)
    refusals.note(second)
    refusals.written_off(first)
    assert not refusals.holds("t1")
    assert refusals.holds("t2")
    refusals.written_off(second)
    assert not refusals.holds("t2")
    assert refusals.pending() == []


def test_beyond_the_bound_the_oldest_refusals_are_dropped() -> None:
    refusals = Refusals(max_pending_tasks=3)
    refusals.note(Refusal("a", ("t1", "t2")))
    refusals.note(Refusal("a", ("t3",)))
    refusals.note(Refusal("a", ("t4",)))
    assert [r.task_ids for r in refusals.pending()] == [("t3",), ("t4",)]
    assert not refusals.holds("t1")
    assert refusals.holds("t4")


def test_the_bound_counts_refusals_not_requests_running() -> None:
    """A running request's task ids are held too (the sweep keeps off them), and counted
    towards the bound they pushed refusals out far below it: left to the outbox, which sent
    what was answered 503 (found in review)."""
    refusals = Refusals(max_pending_tasks=10)
    with refusals.holding(tuple(f"running-{i}" for i in range(10))):
        refusals.note(Refusal("a", ("t1",)))
        refusals.note(Refusal("a", ("t2",)))
        assert [r.task_ids for r in refusals.pending()] == [("t1",), ("t2",)]
        assert refusals.holds("t1")
    for _ in range(8):
        refusals.note(Refusal("a", ("t3",)))
    refusals.note(Refusal("a", ("t4",)))  # the eleventh task id: the oldest goes
    assert refusals.pending()[0].task_ids == ("t2",)
    assert not refusals.holds("t1")


def test_a_single_refusal_over_the_bound_is_kept() -> None:
    refusals = Refusals(max_pending_tasks=1)
    refusals.note(Refusal("a", ("t1", "t2")))
    assert refusals.holds("t2")


async def test_slots_are_released_first_then_batches_then_submissions_in_one_write() -> None:
    refusals, database = Refusals(), Database()
    refusals.note(Refusal("a", ("t1", "t2"), counted=True, batch_id="b"))
    refusals.note(Refusal("a", ("t3",)))
    refusals.note(Refusal("a", (), batch_id="c"))
    assert await _write_off(refusals, database) == 3
    assert database.writes == [
        ("release", "t1"),
        ("release", "t2"),
        ("abandon batch", "b"),
        ("abandon batch", "c"),
        ("abandon", ("t1", "t2", "t3")),
    ]
    assert refusals.pending() == []


async def test_the_submissions_of_a_batch_accepted_after_all_are_not_written_off() -> None:
    """A replay of the batch's request completed and accepted it before the write-off: its
    submissions are to be sent, not turned into tombstones."""
    refusals, database = Refusals(), Database()
    refusals.note(Refusal("a", ("t1", "t2"), counted=True, batch_id="b"))
    refusals.note(Refusal("a", ("t3",)))
    assert await _write_off(refusals, database, accepted=frozenset({"b"})) == 2
    assert [subject for what, subject in database.writes if what == "abandon"] == [("t3",)]
    # Its slots were released: its items' outcomes must not release them again (their
    # in-flight marks go, found in review; t3's tombstone keeps none).
    uncounted = [subject for what, subject in database.writes if what == "uncount"]
    assert uncounted == [("t1", "t2")]
    assert refusals.pending() == []


async def test_a_refused_submission_kept_after_all_loses_its_in_flight_mark() -> None:
    """Its tombstone refused (a replay left it to the sweep): its slot released, its outcome
    must not release it again; a tombstone keeps no mark to remove."""
    refusals, database = Refusals(), Database()
    refusals.note(Refusal("a", ("t1",), counted=True))
    refusals.note(Refusal("a", ("t2",)))
    await write_off(
        refusals,
        submissions=SubmissionTombstones(database, kept=frozenset({"t1"})),
        batches=BatchTombstones(database),
        in_flight=database,
        now=NOW,
    )
    assert database.writes[-1] == ("uncount", ("t1",))


async def test_a_replays_refusal_follows_its_batch_and_never_refuses_it() -> None:
    """A replay the database failed does not own its batch (its first request may have been
    answered 202): its items are written off only if the batch's own refusal wrote the batch
    off, in the same pass whatever order they were noted in; otherwise they are let go."""
    refusals, database = Refusals(), Database()
    refusals.note(Refusal("a", ("t1",), batch_id="b", owns_batch=False))
    refusals.note(Refusal("a", ("t2",), batch_id="c", owns_batch=False))
    refusals.note(Refusal("a", (), batch_id="b"))  # b's own request refused it
    assert await _write_off(refusals, database) == 3
    assert database.writes == [("abandon batch", "b"), ("abandon", ("t1",))]
    assert not refusals.holds("t2")
    assert refusals.pending() == []


def _abandoned(database: Database) -> list[tuple[str, ...]]:
    return [subject for what, subject in database.writes if what == "abandon"]  # type: ignore[misc]


async def test_a_backlog_is_written_off_a_round_trips_worth_at_a_time() -> None:
    """All at once, every tombstone of a backlog went into the group writer together, and
    those still queued at the deadline failed the whole pass, for ever."""
    refusals, database = Refusals(), Database()
    for index in range(1_200):
        refusals.note(Refusal("a", (f"t{index}",)))
    refusals.note(Refusal("a", tuple(f"b{index}" for index in range(1_200)), batch_id="b"))

    tombstones = SubmissionTombstones(database)
    written = await write_off(
        refusals,
        submissions=tombstones,
        batches=BatchTombstones(database),
        in_flight=database,
        now=NOW,
    )

    assert written == 1_201
    assert tombstones.most_in_flight == TOMBSTONE_CHUNK  # a round trip's worth at a time
    chunks = _abandoned(database)
    tombstoned = [task for chunk in chunks for task in chunk]
    assert sorted(tombstoned) == sorted(
        [f"t{i}" for i in range(1_200)] + [f"b{i}" for i in range(1_200)]
    )


async def test_the_groups_settled_before_a_failure_stay_written_off() -> None:
    refusals, database = Refusals(), Database()
    for index in range(1_200):
        refusals.note(Refusal("a", (f"t{index}",)))
    second = tuple(f"t{index}" for index in range(TOMBSTONE_CHUNK, 2 * TOMBSTONE_CHUNK))
    database.fails_once.add(("abandon", second))

    with pytest.raises(DatabaseUnavailable):
        await _write_off(refusals, database)
    assert not refusals.holds("t0")
    assert refusals.holds(second[0])
    assert len(refusals.pending()) == 1_200 - TOMBSTONE_CHUNK

    assert await _write_off(refusals, database) == 1_200 - TOMBSTONE_CHUNK
    assert refusals.pending() == []


async def test_a_write_off_the_database_refuses_stays_for_the_next() -> None:
    refusals, database = Refusals(), Database()
    refusals.note(Refusal("a", ("t1",)))
    database.down = True
    with pytest.raises(DatabaseUnavailable):
        await _write_off(refusals, database)
    assert refusals.holds("t1")
    database.down = False
    assert await _write_off(refusals, database) == 1
    assert not refusals.holds("t1")


@pytest.mark.parametrize(
    "failing",
    [("release", "t2"), ("abandon", ("t1", "t2", "t3"))],
    ids=["a release", "the tombstones"],
)
async def test_a_slot_released_by_a_pass_that_failed_is_not_released_again(
    failing: tuple[str, object],
) -> None:
    """A release is idempotent only while the tenant's counter remembers the task among its
    latest releases: every pass used to release every slot again."""
    refusals, database = Refusals(), Database()
    refusals.note(Refusal("a", ("t1", "t2", "t3"), counted=True))
    database.fails_once.add(failing)
    with pytest.raises(DatabaseUnavailable):
        await _write_off(refusals, database)

    assert await _write_off(refusals, database) == 1
    released = [subject for what, subject in database.writes if what == "release"]
    assert sorted(map(str, released)) == ["t1", "t2", "t3"]  # each once, whichever pass
    assert refusals.pending() == []


def test_only_a_write_never_sent_needs_no_writing_off() -> None:
    def failed(cause: Exception) -> DatabaseUnavailable:
        error = DatabaseUnavailable(str(cause))
        error.__cause__ = cause  # as `raise ... from cause` sets it
        return error

    assert not may_have_been_written(failed(ServerSelectionTimeoutError("no server")))
    assert may_have_been_written(failed(NetworkTimeout("reply late")))
    assert may_have_been_written(failed(AutoReconnect("connection lost")))
