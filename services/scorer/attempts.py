"""Claims on tasks, in the scorer's own database: one document per task.

    {_id: task_id, generation, attempt, state: "running" | "decided",
     lease_until, owner, claim, decision, raw_output, updated_at, spent}

`spent` ({generation, prompt_tokens, completion_tokens, model}) is what the provider billed
the retried attempts of a generation (`decisions.Spent`): written with a retry decision,
kept by the claims that follow (which clear the decision) and read by the next attempt,
whose outcome counts it in. A newer generation (a re-score, a DLQ replay) that replaces one
with no outcome (its attempt still running, or decided a retry) takes its `spent` over in
the claim's write (`generation` rewritten): that generation's next attempt is superseded and
never publishes anything metered. One that replaces an outcome (a stored finish) starts
from nothing: that outcome counted `spent` already.

A client's cancellation (`cancel`) is recorded as a decision too: a `Finish` failing the
task with `cancelled`, written over what stands when nothing has started the generation's
model call, so that the generation's next command collides with it and carries it out
instead of calling the model. A newer generation is cancelled over an older one's retry or
failure (a DLQ replay runs a failure again), not over its completion: a re-score of a
completed task is not cancelled, and the completion stands.

A claim is an atomic conditional upsert. It succeeds for a task never seen, the attempt
after a decided retry, a running attempt whose lease expired (its worker died), or, when
the caller says so, a running attempt it claimed itself and no longer works on (the claim's
write landed but its answer was lost). Anything else collides on `_id`; a newer generation
(a re-score, a DLQ replay) then claims over the older one stored with a second conditional
upsert (the one that carries `spent` over), unless that one is still running under its
lease. What still collides is classified: the same attempt running elsewhere, or an older
generation's (busy), already decided (replay the decision), or older than what is stored
(superseded).

Each claim writes a token of its own (`claim`), and a decision is recorded only under the
token of the claim it was made under (`decide`): fenced by the owner alone, a decision write
of this process that its deadline had given up, landing after a later delivery of the same
process re-claimed the attempt (`reclaim_own`), was taken for that claim's, and a copy
arriving between the two replayed an outcome the re-claim then overwrote with another (a
re-read of the scoring path).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final

from pymongo import AsyncMongoClient, UpdateOne
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import DuplicateKeyError, OperationFailure, PyMongoError

from services.scorer import decisions
from services.scorer.decisions import Finish, Retry, Spent, cancelled, is_cancellation
from shared.contracts import CancelTask, ScoreText, TaskCompleted, TaskRetrying, new_id
from shared.group_reads import GroupReader
from shared.group_writes import GroupWriter, Write
from shared.indexes import drop_retired_indexes

Document = dict[str, Any]
RETIRED_LEASE_INDEX = "lease_until_1"
# An index made again with other options: MongoDB's IndexOptionsConflict, the stand-in's
# IndexKeySpecsConflict.
INDEX_CONFLICTS = frozenset({85, 86})
log = logging.getLogger("scorebox.scorer")


@dataclass(frozen=True)
class Claimed:
    """The attempt is this worker's, under the claim `token` (what `decide` is fenced by).
    `made_the_record`: the claim inserted the task's document, so no earlier attempt,
    cancellation or note of one exists to be read."""

    token: str
    made_the_record: bool = False


@dataclass(frozen=True)
class Busy:
    until: datetime


@dataclass(frozen=True)
class Decided:
    decision: Finish | Retry
    # A cancellation whose event its consumer published (`note_cancellation_published`).
    published: bool = False


@dataclass(frozen=True)
class Superseded:
    pass


ClaimResult = Claimed | Busy | Decided | Superseded

# The owner a cancellation leaves on the attempt it decides: no scorer's (they are named
# host:pid:suffix), so a late decision of the claim it replaced is fenced out (`decide`).
CANCEL_OWNER: Final = "cancelled-by-client"
# Set in a cancellation's decision once its consumer published its event: a later delivery
# of the command (a delayed task's, when due) drops it instead of publishing it again.
PUBLISHED: Final = "published"
# Reads and conditional writes a cancellation tries while other writes keep changing the task.
CANCEL_TRIES: Final = 10
# Why a cancellation of a newer generation (a re-score) finds an older one's completion stored.
COMPLETION_STANDS: Final = "a re-score of a completed task is not cancelled: its completion stands"


@dataclass(frozen=True)
class Cancelled:
    """The cancellation stands as the generation's decision: publish its event.
    `recorded_now`: this call wrote it (False: found recorded, a repeat)."""

    decision: Finish
    recorded_now: bool = True


@dataclass(frozen=True)
class TooLate:
    """Nothing recorded: the model call has started, the generation finished, a newer one
    exists, or the generation re-scores a completed one (`COMPLETION_STANDS`)."""

    reason: str


CancelResult = Cancelled | TooLate
# A cancellation that came while an attempt of its generation was calling the model: that
# call decides, and should it end in a retry, the next attempt is cancelled at its claim.
CANCEL_REQUESTED: Final = "cancel_requested"
# The generation whose claim replaced a completion (a re-score), set by that claim: no
# cancellation of it stands, whatever state its attempts reach, nor of a newer generation
# while it has published no outcome. A generation, not a flag: a document written over it
# (a newer claim of an earlier build, a cancellation over an older generation) keeps the
# field, which then names another generation than the document's and says nothing (found
# in review).
OVER_COMPLETION: Final = "over_completion"
# Set on `spent` once a give-up the database would not record published it: a later
# generation's claim, or a cancellation of one, takes `spent` over only while unpublished.
SPENT_PUBLISHED: Final = "spent.published"


@dataclass(frozen=True)
class BeforeTheCall:
    spent: Spent | None
    cancel_requested_at: datetime | None


@dataclass(frozen=True)
class _CallUnderWay:
    """`_cancellable`: the cancel's generation is calling the model under a live lease; the
    cancellation is noted on the attempt while that state holds (`condition`)."""

    condition: Document
    attempt: int


class CancelContended(Exception):
    """The task's document changed under every one of `CANCEL_TRIES` conditional writes."""


class Attempts:
    def __init__(
        self, client: AsyncMongoClient[Document], database: str, *, retention: timedelta
    ) -> None:
        self._collection: AsyncCollection[Document] = client[database]["attempts"]
        # Claims and decisions of concurrent deliveries share round trips.
        self._writes = GroupWriter(self._collection)
        # What earlier attempts were billed, and a cancellation noted meanwhile; re-scores of a
        # fan-out read it many at once.
        self._spent_reads = GroupReader(
            self._collection, projection={"spent": True, CANCEL_REQUESTED: True}
        )
        # A batch's cancellations come many at once, each reading its task first.
        self._cancel_reads = GroupReader(self._collection)
        # The retries of the deliveries a pause of the model calls puts off, many at once.
        self._retry_reads = GroupReader(
            self._collection, projection={"generation": True, "attempt": True, "decision": True}
        )
        self._retention = retention

    async def ensure_indexes(self) -> None:
        # No query looks leases up by time (a claim finds its task by `_id`); the index only
        # cost every claim and decision.
        await drop_retired_indexes(self._collection, RETIRED_LEASE_INDEX)
        # Housekeeping of claims: decided ones and stale leases (a worker died, the message went
        # to the DLQ) leave after the retention; a later replay simply claims afresh.
        retention_s = int(self._retention.total_seconds())
        try:
            await self._collection.create_index("updated_at", expireAfterSeconds=retention_s)
        except OperationFailure as error:
            if error.code not in INDEX_CONFLICTS:
                raise
            await self._change_retention(retention_s)

    async def _change_retention(self, retention_s: int) -> None:
        """`ATTEMPTS_RETENTION_S` changed since the index was made: MongoDB refuses the same
        index with other options, and the scorer never became ready (every start failed on
        it). `collMod` changes the TTL in place; where it is not served (the stand-in), the
        index is made again."""
        log.warning("the attempts' retention changes to %d s", retention_s)
        try:
            await self._collection.database.command(
                {
                    "collMod": self._collection.name,
                    "index": {"keyPattern": {"updated_at": 1}, "expireAfterSeconds": retention_s},
                }
            )
        except OperationFailure:
            await self._collection.drop_index("updated_at_1")
            await self._collection.create_index("updated_at", expireAfterSeconds=retention_s)

    async def claim(
        self,
        command: ScoreText,
        *,
        now: datetime,
        lease: timedelta,
        owner: str,
        reclaim_own: bool = False,
    ) -> ClaimResult:
        """Claim the command's attempt; with `reclaim_own`, also when `owner` holds it already
        and none of the caller's deliveries works on it (a claim whose answer was lost)."""
        token = new_id()
        claimed = {
            "tenant_id": command.tenant_id,
            "generation": command.generation,
            "attempt": command.attempt,
            "state": "running",
            "lease_until": now + lease,
            "owner": owner,
            "claim": token,
            "updated_at": now,
        }
        claimable = _claimable_in_generation(command, now=now, owner=owner, reclaim_own=reclaim_own)
        try:
            inserted = await self._writes.update_one(
                claimable,
                {"$set": claimed, "$unset": {"decision": "", "raw_output": ""}},
                upsert=True,
            )
        except DuplicateKeyError:
            held = await self.find(command.task_id)
            if held is not None and held["generation"] < command.generation:
                return await self._replace_generation(command, claimed, token, now=now)
            return _standing(held, command)
        return Claimed(token, made_the_record=inserted)

    async def _replace_generation(
        self, command: ScoreText, claimed: Document, token: str, *, now: datetime
    ) -> ClaimResult:
        """Claim the command's attempt over an older generation, taking over its `spent` when
        it published no outcome (`_spent_taken_over`); an older claim still running under its
        lease is waited for (`Busy`), as one of the same generation is: replaced, its model
        call went on, billed and never metered, its decision refused (the scheduler's
        re-read, session 59).

        A write of its own, an update pipeline: as one, every claim (each new task's) cost
        twice as much on the stand-in."""
        older = {
            "_id": command.task_id,
            "generation": {"$lt": command.generation},
            "$or": [{"state": {"$ne": "running"}}, {"lease_until": {"$lt": now}}],
        }
        # `$literal`: in a pipeline, a string starting with `$` reads as a field.
        replaced: list[Document] = [
            {
                "$set": {
                    "spent": _spent_taken_over(command.generation),
                    OVER_COMPLETION: {"$cond": [_over_a_completion(), command.generation, None]},
                }
            },
            {"$set": {key: {"$literal": value} for key, value in claimed.items()}},
            {"$unset": ["decision", "raw_output"]},
        ]
        try:
            # Sized by its parts should a neighbour in its batch not encode: a pipeline (a
            # list) is not a document of its own.
            await self._writes.submit(
                Write(UpdateOne(older, replaced, upsert=True), (older, {"u": replaced}))
            )
        except DuplicateKeyError:
            return await self.standing(command)
        return Claimed(token)

    async def standing(self, command: ScoreText) -> ClaimResult:
        """Where the command's attempt stands, without claiming it: decided (and how), behind
        a newer attempt, or not decided yet (Busy, until its claim's lease ends)."""
        return _standing(await self.find(command.task_id), command)

    async def note_spent_published(self, command: ScoreText) -> bool:
        """Mark what the command's generation was billed as published by an outcome that is
        not recorded (a give-up the database refused to record): unmarked, a DLQ replay's
        claim took it over and the replay's outcome billed it a second time (review of
        usage). False when the mark was not written (the database refusing this too)."""
        try:
            marked = await self._collection.update_one(
                {
                    "_id": command.task_id,
                    "generation": command.generation,
                    "spent.generation": command.generation,
                },
                {"$set": {SPENT_PUBLISHED: True}},
            )
        except PyMongoError:
            log.exception("%s: its billed tokens not marked published", command.task_id)
            return False
        return marked.matched_count == 1

    async def spent_before(self, command: ScoreText) -> Spent | None:
        """What the earlier attempts of the command's generation were billed, as their retry
        decisions recorded it or its claim took it over from the generation it replaced
        (None: nothing). The first attempt of the first generation has none."""
        if command.attempt <= 1 and command.generation == 0:
            return None
        return (await self._read_before(command)).spent

    async def before_the_call(self, command: ScoreText, claim: Claimed) -> BeforeTheCall:
        """What an attempt claimed needs of the earlier ones before its model call, in one
        read: what they were billed (`spent_before`) and the time a client's cancellation
        came while one of them was calling the model (None: none came). A claim that made
        the task's record reads nothing: there is nothing before it. Any other does, the
        first attempt's too: one taking over a claim whose worker died (its lease over) read
        nothing, and a cancellation noted while the dead worker's call was under way went
        unseen; the task was scored (a walkthrough: 32 of a batch cancelled while every
        scorer was down)."""
        if claim.made_the_record:
            return BeforeTheCall(spent=None, cancel_requested_at=None)
        return await self._read_before(command)

    async def _read_before(self, command: ScoreText) -> BeforeTheCall:
        held = await self._spent_reads.find_by_id(command.task_id) or {}
        spent = Spent.loaded(held.get("spent"))
        return BeforeTheCall(
            spent=spent if spent is not None and spent.generation == command.generation else None,
            cancel_requested_at=_cancel_noted(held, command.generation),
        )

    async def decide(
        self,
        command: ScoreText,
        decision: Finish | Retry,
        *,
        now: datetime,
        raw_output: str | None,
        owner: str,
        claim: Claimed,
    ) -> bool:
        """Record the decision of the attempt `owner` holds under `claim`; False when
        another worker, or another delivery of this process, has taken it over since (our
        lease ended while the model answered or the database was slow): its decision is the
        one that stands. Writing it anyway overwrote that worker's claim, and both carried
        out their own decision, two outcomes of one attempt.

        Fenced by the owner and the claim's token in the filter; a refused filter shows as
        the upsert colliding on `_id` (a bulk write reports no match count per write).
        Writing again what already landed (an answer lost) matches: it is still ours. A
        retry's `spent` lands with it, or not at all: a refused decision's tokens are not
        carried on."""
        decided: Document = {
            "state": "decided",
            "decision": decisions.store(decision),
            "raw_output": raw_output,
            "updated_at": now,
        }
        if isinstance(decision, Retry) and decision.spent is not None:
            decided["spent"] = decision.spent.stored()
        return await self._writes.guarded_upsert(
            {
                "_id": command.task_id,
                "generation": command.generation,
                "attempt": command.attempt,
                "owner": owner,
                "claim": claim.token,
            },
            {"$set": decided, "$unset": {"lease_until": ""}},
        )

    async def cancel(self, cancel: CancelTask, *, now: datetime) -> CancelResult:
        """Decide the cancel's generation as cancelled, unless its model call has started.

        Read, then one conditional write that lands only on the state read (`_cancellable`);
        a collision (a claim or a decision landed in between) reads again. A cancellation
        found recorded already (a repeated cancel) stands: its event is published again."""
        for _ in range(CANCEL_TRIES):
            held = await self._cancel_reads.find_by_id(cancel.task_id)
            cancellable = _cancellable(held, cancel, now=now)
            if isinstance(cancellable, _CallUnderWay):
                if not await self._note_cancel_requested(cancellable, cancel):
                    continue  # decided meanwhile: read again
                return TooLate(
                    f"attempt {cancellable.attempt} is running (its model call under way); "
                    "should it end in a retry, the next attempt is cancelled"
                )
            if not isinstance(cancellable, tuple):
                return cancellable
            condition, attempt = cancellable
            spent = _unpublished_spent(held, cancel.generation)
            decision = cancelled(cancel, attempt=attempt, spent=spent, now=now)
            try:
                await self._writes.update_one(
                    {"_id": cancel.task_id, **condition},
                    _cancellation(cancel, attempt, decision, spent, now),
                    upsert=True,
                )
            except DuplicateKeyError:
                continue
            return Cancelled(decision)
        raise CancelContended(cancel.task_id)

    async def note_cancellation_published(self, cancel: CancelTask, decision: Finish) -> None:
        """Mark the cancellation `decision` of the cancel's task as published, while it is
        the decision stored (one conditional write)."""
        event = decision.event
        await self._collection.update_one(
            {
                "_id": cancel.task_id,
                "generation": event.generation,
                "attempt": event.attempt,
                "state": "decided",
                "owner": CANCEL_OWNER,
            },
            {"$set": {f"decision.{PUBLISHED}": True}},
        )

    async def retry_before(self, command: ScoreText) -> TaskRetrying | None:
        """The `task.retrying` of the retry the command's attempt is (the decision of the
        attempt before it, in its generation), while that decision stands: None for a first
        attempt, or when the attempt has been claimed, cancelled, or replaced since."""
        if command.attempt <= 1:
            return None
        held = await self._retry_reads.find_by_id(command.task_id)
        if held is None or held.get("decision") is None:
            return None
        if (held["generation"], held["attempt"]) != (command.generation, command.attempt - 1):
            return None
        decision = decisions.load(held["decision"])
        return decision.event if isinstance(decision, Retry) else None

    async def find(self, task_id: str) -> Document | None:
        return await self._collection.find_one({"_id": task_id})

    async def cancel_requested_at(self, command: ScoreText) -> datetime | None:
        """When a client's cancellation of the command's generation came while one of its
        attempts called the model (None: none came)."""
        held = await self._spent_reads.find_by_id(command.task_id) or {}
        return _cancel_noted(held, command.generation)

    async def _note_cancel_requested(self, under_way: _CallUnderWay, cancel: CancelTask) -> bool:
        """Note the cancellation on the running attempt; False when its state changed since
        it was read. Dropped, as it was, a cancellation answered 202 by the gateway was
        forgotten when the call ended in a retry, and the next attempt called the model
        again (found in review)."""
        noted = await self._collection.update_one(
            {"_id": cancel.task_id, **under_way.condition},
            {
                "$set": {
                    CANCEL_REQUESTED: {"generation": cancel.generation, "at": cancel.requested_at}
                }
            },
        )
        return noted.matched_count == 1


def _cancellable(
    held: Document | None, cancel: CancelTask, *, now: datetime
) -> CancelResult | _CallUnderWay | tuple[Document, int]:
    """What a cancellation does to the state read: nothing (`TooLate`), nothing new (its own
    recorded `Cancelled`), or a write under a condition that holds only while that state
    does, deciding an attempt (the attempt number)."""
    if held is None:
        return {"generation": {"$exists": False}}, 1
    if (out_of_reach := _out_of_reach(held, cancel)) is not None:
        return out_of_reach
    generation, attempt = held["generation"], held["attempt"]
    state: Document = {"generation": generation, "attempt": attempt, "state": held["state"]}
    if held["state"] == "running":
        if generation == cancel.generation and held["lease_until"] > now:
            live = state | {"owner": held.get("owner"), "lease_until": held["lease_until"]}
            return _CallUnderWay(live, attempt)
        # An expired lease (a dead worker, as a claim takes over), or an older generation's
        # claim, live or not: its late decision is fenced out. Over a live one, its call's
        # tokens go unmetered; a cancellation noted on it instead (as on its own generation's
        # call) was lost when the older generation went on to a retry (a re-read, session 59).
        condition = state | {"owner": held.get("owner"), "lease_until": held["lease_until"]}
        return condition, attempt if generation == cancel.generation else 1
    condition = state | {"decision.kind": held["decision"]["kind"]}
    decision = decisions.load(held["decision"])
    if generation < cancel.generation:
        return _cancellable_over_older(decision, condition)
    return _cancellable_decided(decision, condition, attempt)


def _cancel_noted(held: Document, generation: int) -> datetime | None:
    requested = held.get(CANCEL_REQUESTED) or {}
    at: datetime | None = requested.get("at") if requested.get("generation") == generation else None
    return at


def _out_of_reach(held: Document, cancel: CancelTask) -> TooLate | None:
    """Too late whatever state the attempt is in: a newer generation exists, or the task's
    latest outcome is still the completion a re-score's claim replaced (a retry of the
    re-score, decided or noted as cancelled while its call ran, or a newer generation over
    it, was cancelled, and its failure replaced the result)."""
    generation = held["generation"]
    if generation > cancel.generation:
        return TooLate(f"superseded by generation {generation}")
    if _completion_still_latest(held, cancel.generation):
        return TooLate(COMPLETION_STANDS)
    return None


def _completion_still_latest(held: Document, generation: int) -> bool:
    """Whether the completion a re-score's claim replaced is still the task's latest outcome
    as far as a cancel of `generation` goes: the held generation is marked over it, and is
    the cancel's own or has published no outcome since (running, or decided a retry)."""
    mark = held.get(OVER_COMPLETION)
    # Not a flag (True == 1); an int64 generation is read back as `bson.Int64`, an int.
    if not isinstance(mark, int) or isinstance(mark, bool) or mark != held["generation"]:
        return False
    if held["generation"] == generation:
        return True
    return held["state"] == "running" or (held.get("decision") or {}).get("kind") == "retry"


def _cancellable_over_older(
    decision: Finish | Retry, condition: Document
) -> CancelResult | tuple[Document, int]:
    """`_cancellable` for a decided attempt of an older generation, the cancel's not claimed
    yet: over a retry, or a failure (which a DLQ replay runs again), the cancel's generation
    is decided at its first attempt. A completion stands: the newer generation re-scores a
    completed task, and its cancellation's failure would replace the task's result."""
    if isinstance(decision, Finish) and isinstance(decision.event, TaskCompleted):
        return TooLate(COMPLETION_STANDS)
    return condition, 1


def _cancellable_decided(
    decision: Finish | Retry, condition: Document, attempt: int
) -> CancelResult | tuple[Document, int]:
    """`_cancellable` for a decided attempt of the cancel's own generation."""
    if isinstance(decision, Retry):  # waiting down the ladder: the next attempt is decided
        return condition, attempt + 1
    if is_cancellation(decision):
        return Cancelled(decision, recorded_now=False)
    return TooLate(f"attempt {attempt} finished ({decision.event.routing_key})")


def _unpublished_spent(held: Document | None, generation: int) -> Spent | None:
    """What the stored generation was billed without publishing an outcome (it is running, or
    decided a retry), as the cancelled `generation`'s; None when it published one."""
    if held is None:
        return None
    spent = Spent.loaded(held.get("spent"))
    no_outcome = held["state"] == "running" or held["decision"]["kind"] == "retry"
    published = (held.get("spent") or {}).get("published") is True
    if spent is None or spent.generation != held["generation"] or not no_outcome or published:
        return None
    return Spent(generation, spent.usage, spent.model)


def _cancellation(
    cancel: CancelTask, attempt: int, decision: Finish, spent: Spent | None, now: datetime
) -> Document:
    """The write that decides `attempt` as cancelled, keeping what the generation was billed
    (as a retry decision keeps it). Its retention (the TTL on `updated_at`) counts from the
    task's due time when that is later: a task deferred for up to seven days, as long as the
    default retention, was otherwise scored once its cancellation had expired."""
    decided: Document = {
        "tenant_id": cancel.tenant_id,
        "generation": cancel.generation,
        "attempt": attempt,
        "state": "decided",
        "owner": CANCEL_OWNER,
        "decision": decisions.store(decision),
        "raw_output": None,
        "updated_at": max(now, cancel.not_before) if cancel.not_before else now,
    }
    if spent is None:
        return {"$set": decided, "$unset": {"lease_until": "", "spent": ""}}
    return {"$set": decided | {"spent": spent.stored()}, "$unset": {"lease_until": ""}}


def _claimable_in_generation(
    command: ScoreText, *, now: datetime, owner: str, reclaim_own: bool
) -> Document:
    """The claim's filter within the command's generation: the attempt after a decided retry,
    a running attempt whose lease expired, and with `reclaim_own` one `owner` holds."""
    generation, attempt = command.generation, command.attempt
    reclaimable: list[Document] = []
    if reclaim_own:
        reclaimable.append(
            {"generation": generation, "attempt": attempt, "state": "running", "owner": owner}
        )
    return {
        "_id": command.task_id,
        "$or": [
            *reclaimable,
            {
                "generation": generation,
                "attempt": {"$lt": attempt},
                "state": "decided",
                "decision.kind": "retry",
            },
            {
                "generation": generation,
                "attempt": attempt,
                "state": "running",
                "lease_until": {"$lt": now},
            },
        ],
    }


def _standing(held: Document | None, command: ScoreText) -> ClaimResult:
    if held is None:  # removed in between; the redelivery will claim it
        return Busy(until=command.submitted_at)
    ahead = (held["generation"], held["attempt"]) > (command.generation, command.attempt)
    if held["generation"] > command.generation:
        return Superseded()
    if held["state"] == "running":
        return Superseded() if ahead else Busy(until=held["lease_until"])
    decision = decisions.load(held["decision"])
    if ahead and isinstance(decision, Retry):
        return Superseded()
    return Decided(decision, published=bool(held["decision"].get(PUBLISHED)))


def _over_a_completion() -> Document:
    """`over_completion` as a claim replacing an older generation leaves it (an aggregation
    expression on the stored document): whether the task's latest outcome before it is a
    completion, the replaced generation's own, or carried from the one it replaced while
    that published no outcome (running, or decided a retry)."""
    no_outcome = {"$or": [{"$eq": ["$state", "running"]}, {"$eq": ["$decision.kind", "retry"]}]}
    return {
        "$or": [
            {"$eq": ["$decision.event.routing_key", TaskCompleted.routing_key]},
            {"$and": [{"$eq": [f"${OVER_COMPLETION}", "$generation"]}, no_outcome]},
        ]
    }


def _spent_taken_over(generation: int) -> Document:
    """`spent` as a claim of `generation` leaves it (an aggregation expression on the stored
    document): tagged with `generation` when the claim replaces an older generation that
    published no outcome (none recorded, and `spent` not marked published by one that was
    not: `Attempts.note_spent_published`), as it stands otherwise."""
    replaces_no_outcome = {
        "$and": [
            {"$lt": ["$generation", generation]},
            {"$eq": ["$spent.generation", "$generation"]},
            {"$ne": [f"${SPENT_PUBLISHED}", True]},
            {"$or": [{"$eq": ["$state", "running"]}, {"$eq": ["$decision.kind", "retry"]}]},
        ]
    }
    carried = {"$mergeObjects": ["$spent", {"generation": generation}]}
    return {"$cond": [replaces_no_outcome, carried, "$spent"]}
