"""Firings of cron jobs, in the scheduler's own database: the claims that make each fire
time run once, whatever the number of scheduler replicas.

    {_id: run_id, job, scheduled_for, manual, state, fired_at, claimed_by, claimed_at,
     dispatched_at, started_at, finished_at, attempts, missed, result, error,
     next_attempt_at, replay_of, active_job, heartbeat_at, step, hold, letter_owed}

A fire time is claimed by inserting its document under a unique index on
`(job, scheduled_for)`: the replica whose insert succeeds owns the firing, every other one
gets `DuplicateKeyError` and moves on. A manual run is a firing of its own whose
`scheduled_for` is the trigger time (`manual: true`); it never moves the schedule. A replay
of a dead-lettered run is such a manual firing, naming the dead run in `replay_of` (set
when it is claimed, so a run is never linked after the fact).

    claimed --published--> dispatched --consumer--> running --> succeeded | failed
       ^  (republished when       \\                  |  ^
       |   still claimed after     `-------------->  retrying
       |   SCHEDULER_REDISPATCH_S)
    skipped: a missed fire time under the `skip` policy (terminal, never published)

A run of a job that forbids overlapping runs (`concurrency = "forbid"`, the default) holds
its job's lease from its claim until it ends: `active_job` names the job, under a unique
index of the documents that have one, so no two replicas can start two runs of the job at
once (the insert of the second fails). Every end of a run (`finish`, `supersede`,
`abandon`) removes it. `heartbeat_at` is the run's last sign of life (its claim, re-claim,
publish, each delivery's start, each retry recorded); a run silent for longer than
`SCHEDULER_RUN_STALE_S` is taken for dead and `abandon`ed, so a run whose message was lost
cannot hold its job for ever (`services.scheduler.overlap`).

One delivery at a time runs a run, and a run's step is never lost. A publish confirmed too
late is sent again (the dispatcher's re-publish of a claim, `keep_publishing` of a next slice
or retry), so several copies of one message may reach the queue, and each ran the job. Each
message carries the run's `step` (0 at the claim, one more at each next slice or retry); a
delivery runs only once it takes the run's `hold` (`begin` with a `Hold`): its step is not
behind the firing's, and no other handling holds the run (none, its lease lapsed, or the
holder handed this very step on). A copy finding the run held waits (`Held`: sent again
down the wait ladder), and one whose step the run has passed (or was handed on past), or
whose run ended, is dropped. The holder renews its lease until it has handed the run on
(`renew`), publishes the next step and then names it (`hand_on`), and lets go when it hands
its delivery back (`release`). A holder that died is taken over once its lease lapses, by
its own redelivery or any copy: a redelivery does not take a live hold, for its consumer
may only have lost its connection while its job runs on. A message without a step (sent by
an earlier build) is fenced by the hold alone.

A run given up owes its dead letter until the broker confirmed it: the write that records it
`failed` sets `letter_owed` (`finish(..., letter_owed=True)`; its reason is `error`), and the
delivery that wrote the letter clears it (`letter_written`). A write whose answer was lost
leaves the run failed with no delivery in hand to dead-letter, and a letter the broker
refused returns its delivery as failed: any later delivery of the run, on any replica,
finding the run failed with its letter owed is dead-lettered with the recorded reason rather
than dropped (`Firing.owes_letter`). A firing of an earlier build has no flag: owed nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, Protocol

from pymongo import ASCENDING, DESCENDING, AsyncMongoClient, ReturnDocument
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import DuplicateKeyError

from services.scheduler.errors import SchedulerError
from shared.contracts import new_id, to_millis
from shared.indexes import string_key

Document = dict[str, Any]


class FiringState(StrEnum):
    CLAIMED = "claimed"
    DISPATCHED = "dispatched"
    RUNNING = "running"
    RETRYING = "retrying"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    SKIPPED = "skipped"

    @property
    def is_final(self) -> bool:
        return self in FINAL_STATES


FINAL_STATES = frozenset({FiringState.SUCCEEDED, FiringState.FAILED, FiringState.SKIPPED})
_FINAL = [state.value for state in FINAL_STATES]
# The unique index that lets one run of a job hold its lease at a time.
ACTIVE_RUN_INDEX = "one_active_run_per_job"
# Removes a run's hold on its job's lease, in every update that ends the run.
_RELEASE = {"$unset": {"active_job": ""}}


class LeaseTaken(SchedulerError):
    """Another run of the job holds its lease: its runs must not overlap."""

    def __init__(self, job: str) -> None:
        super().__init__(f"a run of cron job {job!r} is in progress")
        self.job = job


def _collided_on_lease(error: DuplicateKeyError) -> bool:
    """Whether an insert collided on the lease index (rather than on its fire time or on
    the dead run it replays)."""
    key_pattern = (error.details or {}).get("keyPattern") or {}
    return "active_job" in key_pattern or ACTIVE_RUN_INDEX in str(error)


@dataclass(frozen=True)
class Firing:
    run_id: str
    job: str
    scheduled_for: datetime
    fired_at: datetime
    manual: bool
    state: FiringState
    attempts: int = 0
    missed: int = 0
    finished_at: datetime | None = None
    next_attempt_at: datetime | None = None
    result: dict[str, Any] | None = None
    error: str | None = None
    replay_of: str | None = None  # the dead-lettered run this one replays
    heartbeat_at: datetime | None = None  # the run's last sign of life
    step: int = 0  # the step of the delivery that last took the run's hold
    hold: Document | None = None  # {by, message_id, until, next}: who holds the run
    letter_owed: bool = False  # given up, its dead letter not yet confirmed

    @classmethod
    def from_document(cls, document: Document) -> Firing:
        return cls(
            run_id=document["_id"],
            job=document["job"],
            scheduled_for=document["scheduled_for"],
            fired_at=document["fired_at"],
            manual=document.get("manual", False),
            state=FiringState(document["state"]),
            attempts=document.get("attempts", 0),
            missed=document.get("missed", 0),
            finished_at=document.get("finished_at"),
            next_attempt_at=document.get("next_attempt_at"),
            result=document.get("result"),
            error=document.get("error"),
            replay_of=document.get("replay_of"),
            heartbeat_at=document.get("heartbeat_at"),
            step=document.get("step", 0),
            hold=document.get("hold"),
            letter_owed=document.get("letter_owed", False),
        )

    def passed(self, step: int | None) -> bool:
        """Whether the run has passed `step` (or its holder handed it on past it): a copy of
        that step is stale. None (an earlier build's message) is never stale."""
        if step is None:
            return False
        handed_on = (self.hold or {}).get("next")
        return self.step > step or (handed_on is not None and handed_on > step)

    @property
    def owes_letter(self) -> bool:
        """Whether the run was given up and its dead letter is not known to be written."""
        return self.state is FiringState.FAILED and self.letter_owed

    def held_until(self, now: datetime) -> datetime | None:
        """When the live hold on the run ends unless renewed; None when nobody holds it."""
        until = (self.hold or {}).get("until")
        return until if until is not None and until >= now else None


@dataclass(frozen=True)
class Hold:
    """A delivery's bid to run its run (`Firings.begin`): one holder at a time, until `until`
    unless renewed. `step`: the step its message carries out (None: an earlier build's
    message)."""

    handling: str
    message_id: str
    step: int | None
    until: datetime


@dataclass(frozen=True)
class Held:
    """Another handling holds the run until `until`: the delivery is to wait, not to run.
    `next_step`: the delivery carries the step after the holder's, most likely published a
    moment before its holder names it (`hand_on`): worth looking at again at once."""

    until: datetime
    next_step: bool = False


def _holdable(hold: Hold, now: datetime) -> Document:
    """The firings `hold` may take: its step not behind theirs, and nobody else's live hold.
    A lapsed hold whose holder handed the run on is the next step's: its message was
    published, and a copy of the step handed on would run that step again."""
    lapsed: Document = {"hold.until": {"$lt": to_millis(now)}}
    if hold.step is None:
        return {"$or": [{"hold": None}, lapsed]}
    free = [{"hold": None}, {"hold.next": hold.step}, lapsed | {"hold.next": None}]
    not_behind = [{"step": {"$lte": hold.step}}, {"step": {"$exists": False}}]
    return {"$and": [{"$or": not_behind}, {"$or": free}]}


def _held_by(hold: Hold) -> Document:
    return {
        "by": hold.handling,
        "message_id": hold.message_id,
        "until": to_millis(hold.until),
        "next": None,
    }


class FiringStore(Protocol):
    """What the dispatcher, the run consumer and the routes need from the firings."""

    async def last_scheduled(self, job: str, *, not_after: datetime) -> datetime | None: ...

    async def claim(
        self,
        job: str,
        scheduled_for: datetime,
        *,
        now: datetime,
        owner: str,
        manual: bool = False,
        missed: int = 0,
        replay_of: str | None = None,
        exclusive: bool = False,
    ) -> Firing | None: ...

    async def record_skipped(
        self,
        job: str,
        scheduled_for: datetime,
        *,
        now: datetime,
        owner: str,
        missed: int,
        reason: str | None = None,
    ) -> bool: ...

    async def active_run(self, job: str) -> Firing | None: ...

    async def abandon(
        self, run_id: str, *, silent_since: datetime, now: datetime, reason: str
    ) -> bool: ...

    async def mark_dispatched(self, run_id: str, *, now: datetime) -> None: ...

    async def stale_claims(self, *, claimed_before: datetime, limit: int) -> list[Firing]: ...

    async def reclaim(self, firing: Firing, *, claimed_before: datetime, now: datetime) -> bool: ...

    async def supersede(self, run_id: str, *, now: datetime, reason: str) -> bool: ...

    async def begin(
        self, run_id: str, *, attempt: int, now: datetime, hold: Hold | None = None
    ) -> Firing | Held | None: ...

    async def renew(
        self, run_id: str, *, handling: str, until: datetime, now: datetime
    ) -> bool: ...

    async def hand_on(self, run_id: str, *, handling: str, step: int, now: datetime) -> bool: ...

    async def release(self, run_id: str, *, handling: str) -> None: ...

    async def retrying(
        self, run_id: str, *, error: str, next_attempt_at: datetime, now: datetime
    ) -> None: ...

    async def finish(
        self,
        run_id: str,
        *,
        state: FiringState,
        now: datetime,
        result: dict[str, Any] | None = None,
        error: str | None = None,
        letter_owed: bool = False,
    ) -> bool: ...

    async def letter_written(self, run_id: str) -> None: ...

    async def find(self, run_id: str) -> Firing | None: ...

    async def latest(self, job: str) -> Firing | None: ...

    async def replayed_as(self, run_id: str) -> Firing | None: ...

    async def forget_unpublished(self, run_id: str) -> bool: ...


class Firings(FiringStore):
    """The firings collection of the scheduler's database."""

    def __init__(self, client: AsyncMongoClient[Document], database: str) -> None:
        self._collection: AsyncCollection[Document] = client[database]["firings"]

    async def ensure_indexes(self) -> None:
        await self._collection.create_index(
            [("job", ASCENDING), ("scheduled_for", ASCENDING)], unique=True
        )
        await self._collection.create_index([("state", ASCENDING), ("claimed_at", ASCENDING)])
        await self._collection.create_index([("job", ASCENDING), ("fired_at", DESCENDING)])
        # Unique: two replicas replaying copies of one dead run at once start one run.
        await self._collection.create_index(
            [("replay_of", ASCENDING)],
            partialFilterExpression={"replay_of": {"$type": "string"}},
            name="replays",
            unique=True,
        )
        # Unique: two replicas (or the clock and an operator) never start two runs of a job
        # that forbids overlapping ones.
        await self._collection.create_index(
            [("active_job", ASCENDING)],
            partialFilterExpression={"active_job": {"$type": "string"}},
            name=ACTIVE_RUN_INDEX,
            unique=True,
        )

    async def last_scheduled(self, job: str, *, not_after: datetime) -> datetime | None:
        """The job's latest scheduled fire time up to `not_after` (now). A later one exists
        only when a replica's clock ran ahead (an NTP step, a resumed VM); taking it as the
        schedule's position would stop the job on every replica until real time caught up."""
        document = await self._collection.find_one(
            {"job": job, "manual": False, "scheduled_for": {"$lte": to_millis(not_after)}},
            projection={"scheduled_for": True},
            sort=[("scheduled_for", DESCENDING)],
        )
        return None if document is None else document["scheduled_for"]

    def _new(
        self,
        job: str,
        scheduled_for: datetime,
        *,
        state: FiringState,
        now: datetime,
        owner: str,
        manual: bool,
        missed: int,
        replay_of: str | None = None,
    ) -> Document:
        document: Document = {
            "_id": new_id(),
            "job": job,
            "scheduled_for": to_millis(scheduled_for),
            "manual": manual,
            "state": state.value,
            "fired_at": to_millis(now),
            "claimed_by": owner,
            "claimed_at": to_millis(now),
            "heartbeat_at": to_millis(now),
            "attempts": 0,
            "missed": missed,
        }
        if replay_of is not None:
            document["replay_of"] = replay_of
        return document

    async def claim(
        self,
        job: str,
        scheduled_for: datetime,
        *,
        now: datetime,
        owner: str,
        manual: bool = False,
        missed: int = 0,
        replay_of: str | None = None,
        exclusive: bool = False,
    ) -> Firing | None:
        """Claim a fire time; None when another replica (or an earlier tick) holds it.
        `exclusive`: the run takes its job's lease too, and `LeaseTaken` is raised when
        another run of the job holds it."""
        document = self._new(
            job,
            scheduled_for,
            state=FiringState.CLAIMED,
            now=now,
            owner=owner,
            manual=manual,
            missed=missed,
            replay_of=replay_of,
        )
        if exclusive:
            document["active_job"] = job
        try:
            await self._collection.insert_one(document)
        except DuplicateKeyError as error:
            if exclusive and _collided_on_lease(error):
                raise LeaseTaken(job) from error
            return None
        return Firing.from_document(document)

    async def record_skipped(
        self,
        job: str,
        scheduled_for: datetime,
        *,
        now: datetime,
        owner: str,
        missed: int,
        reason: str | None = None,
    ) -> bool:
        """Record a fire time as skipped (`reason`, shown as the run's error, says why);
        False when another replica recorded or claimed it first."""
        document = self._new(
            job,
            scheduled_for,
            state=FiringState.SKIPPED,
            now=now,
            owner=owner,
            manual=False,
            missed=missed,
        )
        document["finished_at"] = document["fired_at"]
        document["error"] = reason
        try:
            await self._collection.insert_one(document)
        except DuplicateKeyError:
            return False
        return True

    async def mark_dispatched(self, run_id: str, *, now: datetime) -> None:
        # Only a firing still `claimed`: the consumer may already have started it.
        await self._collection.update_one(
            {"_id": run_id, "state": FiringState.CLAIMED.value},
            {
                "$set": {
                    "state": FiringState.DISPATCHED.value,
                    "dispatched_at": to_millis(now),
                    "heartbeat_at": to_millis(now),
                }
            },
        )

    async def stale_claims(self, *, claimed_before: datetime, limit: int) -> list[Firing]:
        cursor = self._collection.find(
            {"state": FiringState.CLAIMED.value, "claimed_at": {"$lt": to_millis(claimed_before)}}
        ).limit(limit)
        return [Firing.from_document(document) async for document in cursor]

    async def reclaim(self, firing: Firing, *, claimed_before: datetime, now: datetime) -> bool:
        """Take over a stale claim (one replica wins); the winner publishes it again."""
        result = await self._collection.update_one(
            {
                "_id": firing.run_id,
                "state": FiringState.CLAIMED.value,
                "claimed_at": {"$lt": to_millis(claimed_before)},
            },
            {"$set": {"claimed_at": to_millis(now), "heartbeat_at": to_millis(now)}},
        )
        return result.modified_count == 1

    async def supersede(self, run_id: str, *, now: datetime, reason: str) -> bool:
        """Record a firing still `claimed` as skipped (a later one runs in its place); False
        when it has left that state (it was published after all and has started)."""
        result = await self._collection.update_one(
            {"_id": run_id, "state": FiringState.CLAIMED.value},
            {
                "$set": {
                    "state": FiringState.SKIPPED.value,
                    "finished_at": to_millis(now),
                    "error": reason,
                },
                **_RELEASE,
            },
        )
        return result.modified_count == 1

    async def begin(
        self, run_id: str, *, attempt: int, now: datetime, hold: Hold | None = None
    ) -> Firing | Held | None:
        """Mark a run started; None when it is unknown or already finished. With `hold`, only
        once the delivery takes the run's hold (`_holdable`): None too when the run has passed
        its step (a stale copy), `Held` while another handling holds the run."""
        condition: Document = {"_id": run_id, "state": {"$nin": _FINAL}}
        changes: Document = {
            "state": FiringState.RUNNING.value,
            "started_at": to_millis(now),
            "heartbeat_at": to_millis(now),
            "next_attempt_at": None,
        }
        if hold is not None:
            condition |= _holdable(hold, now)
            changes["hold"] = _held_by(hold)
            if hold.step is not None:
                changes["step"] = hold.step
        document = await self._collection.find_one_and_update(
            condition,
            {"$set": changes, "$max": {"attempts": attempt}},
            return_document=ReturnDocument.AFTER,
        )
        if document is not None:
            return Firing.from_document(document)
        return None if hold is None else await self._not_taken(run_id, hold)

    async def _not_taken(self, run_id: str, hold: Hold) -> Held | None:
        """Why `hold` was not taken: None when the run ended or passed its step, else `Held`
        (another handling's hold, perhaps lapsed a moment ago)."""
        document = await self._collection.find_one({"_id": run_id})
        if document is None or document["state"] in _FINAL:
            return None
        firing = Firing.from_document(document)
        if firing.passed(hold.step):
            return None
        until = (firing.hold or {}).get("until") or to_millis(hold.until)
        return Held(until=until, next_step=hold.step == firing.step + 1)

    async def renew(self, run_id: str, *, handling: str, until: datetime, now: datetime) -> bool:
        """Extend the hold of `handling` to `until`; False when it holds the run no more."""
        result = await self._collection.update_one(
            {"_id": run_id, "hold.by": handling},
            {"$set": {"hold.until": to_millis(until), "heartbeat_at": to_millis(now)}},
        )
        return result.matched_count == 1  # a renewal to the same time modifies nothing

    async def hand_on(self, run_id: str, *, handling: str, step: int, now: datetime) -> bool:
        """Name the step `handling` hands the run on to, its message published: that message
        takes the hold at once, and copies of the steps before it are stale. False when
        `handling` holds the run no more (its hold lapsed and another took it: that one
        carries the run on) or the run has ended."""
        result = await self._collection.update_one(
            {"_id": run_id, "hold.by": handling, "state": {"$nin": _FINAL}},
            {"$set": {"hold.next": step, "heartbeat_at": to_millis(now)}},
        )
        return result.matched_count == 1  # a repeat (its answer lost) modifies nothing

    async def release(self, run_id: str, *, handling: str) -> None:
        """Let go of the hold of `handling` (a delivery handed back): its copy takes it."""
        await self._collection.update_one(
            {"_id": run_id, "hold.by": handling}, {"$set": {"hold": None}}
        )

    async def retrying(
        self, run_id: str, *, error: str, next_attempt_at: datetime, now: datetime
    ) -> None:
        """Record a failed attempt with another to come, unless the run has finished (a
        duplicate delivery of it failed after another succeeded: the run stays succeeded)."""
        await self._collection.update_one(
            {"_id": run_id, "state": {"$nin": _FINAL}},
            {
                "$set": {
                    "state": FiringState.RETRYING.value,
                    "error": error,
                    "next_attempt_at": to_millis(next_attempt_at),
                    "updated_at": to_millis(now),
                    "heartbeat_at": to_millis(now),
                }
            },
        )

    async def finish(
        self,
        run_id: str,
        *,
        state: FiringState,
        now: datetime,
        result: dict[str, Any] | None = None,
        error: str | None = None,
        letter_owed: bool = False,
    ) -> bool:
        """Record the run's end, unless it has ended already (the first end stands); False
        when it had. `letter_owed`: a give-up, whose dead letter is owed until written
        (`letter_written`), recorded in the same write."""
        changes: Document = {
            "state": state.value,
            "finished_at": to_millis(now),
            "result": result,
            "error": error,
            "next_attempt_at": None,
        }
        if letter_owed:
            changes["letter_owed"] = True
        result_of = await self._collection.update_one(
            {"_id": run_id, "state": {"$nin": _FINAL}}, {"$set": changes, **_RELEASE}
        )
        return result_of.modified_count == 1

    async def letter_written(self, run_id: str) -> None:
        """Record the dead letter of a run given up as written (the broker confirmed it)."""
        await self._collection.update_one(
            {"_id": run_id, "letter_owed": True}, {"$unset": {"letter_owed": ""}}
        )

    async def active_run(self, job: str) -> Firing | None:
        """The run that holds `job`'s lease, if any."""
        document = await self._collection.find_one({"active_job": string_key(job)})
        return None if document is None else Firing.from_document(document)

    async def abandon(
        self, run_id: str, *, silent_since: datetime, now: datetime, reason: str
    ) -> bool:
        """Record a run that holds its job's lease and has shown no sign of life since
        `silent_since` as failed (`reason`), releasing the lease; False when it has ended
        or stirred meanwhile. A later delivery of it is then dropped (`begin`)."""
        result = await self._collection.update_one(
            {
                "_id": run_id,
                "active_job": {"$type": "string"},
                "state": {"$nin": _FINAL},
                "heartbeat_at": {"$lt": to_millis(silent_since)},
            },
            {"$set": _failed(now, reason), **_RELEASE},
        )
        return result.modified_count == 1

    async def abandon_silent(
        self, *, silent_since: datetime, now: datetime, reason: str, scheduled: Collection[str]
    ) -> int:
        """Record as failed (`reason`) every run that has shown no sign of life since
        `silent_since` and that no next run of its job will take over; how many. A run that
        holds no lease (its job allows overlapping runs) is never taken over, as a leased
        one is by its job's next run (`abandon`), so one whose message was lost stayed
        `running` for good, kept by the firings' cleanup, which deletes final ones only
        (found in review). Neither is a leased one of a job no longer `scheduled` (removed
        from the configuration, or disabled), which also held its job's lease for good
        (review of the scheduler). Claimed ones are the dispatcher's, which publishes them
        again. A later delivery of one is then dropped (`begin`)."""
        result = await self._collection.update_many(
            {
                "$or": [
                    {"active_job": {"$not": {"$type": "string"}}},
                    {"job": {"$nin": list(scheduled)}},
                ],
                "state": {"$nin": [*_FINAL, FiringState.CLAIMED.value]},
                "heartbeat_at": {"$lt": to_millis(silent_since)},
            },
            {"$set": _failed(now, reason), **_RELEASE},
        )
        return int(result.modified_count)

    async def find(self, run_id: str) -> Firing | None:
        document = await self._collection.find_one({"_id": run_id})
        return None if document is None else Firing.from_document(document)

    async def latest(self, job: str) -> Firing | None:
        document = await self._collection.find_one(
            {"job": job}, sort=[("fired_at", DESCENDING), ("scheduled_for", DESCENDING)]
        )
        return None if document is None else Firing.from_document(document)

    async def replayed_as(self, run_id: str) -> Firing | None:
        """The latest firing that replays the dead-lettered run `run_id`, if any."""
        document = await self._collection.find_one(
            {"replay_of": string_key(run_id)}, sort=[("fired_at", DESCENDING)]
        )
        return None if document is None else Firing.from_document(document)

    async def forget_unpublished(self, run_id: str) -> bool:
        """Withdraw a firing whose publish failed; False when it has left `claimed` (its
        message reached the queue after all and a consumer has started it)."""
        result = await self._collection.delete_one(
            {"_id": run_id, "state": FiringState.CLAIMED.value}
        )
        return result.deleted_count == 1

    async def delete_finished_before(self, cutoff: datetime, *, keep: Sequence[str]) -> int:
        """Delete final firings older than `cutoff`, except the run ids in `keep` and runs
        given up whose dead letter is still owed (deleted, the delivery that is to write it
        found no run and was dropped: the give-up left no letter)."""
        result = await self._collection.delete_many(
            {
                "state": {"$in": [state.value for state in FINAL_STATES]},
                "scheduled_for": {"$lt": to_millis(cutoff)},
                "_id": {"$nin": list(keep)},
                "letter_owed": {"$ne": True},
            }
        )
        return result.deleted_count

    async def last_scheduled_ids(self, jobs: Sequence[str], *, not_after: datetime) -> list[str]:
        """Run ids of each job's latest scheduled firing up to `not_after` (the schedule's
        cursor, as `last_scheduled` reads it)."""
        ids = []
        for job in jobs:
            document = await self._collection.find_one(
                {"job": job, "manual": False, "scheduled_for": {"$lte": to_millis(not_after)}},
                projection={"_id": True},
                sort=[("scheduled_for", DESCENDING)],
            )
            if document is not None:
                ids.append(document["_id"])
        return ids


def _failed(now: datetime, reason: str) -> dict[str, Any]:
    """The fields of a run recorded failed at `now` for `reason`."""
    return {
        "state": FiringState.FAILED.value,
        "finished_at": to_millis(now),
        "error": reason,
        "next_attempt_at": None,
    }
