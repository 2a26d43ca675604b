"""Claims on tasks, in the scorer's own database: one document per task.

    {_id: task_id, generation, attempt, state: "running" | "decided",
     lease_until, owner, decision, raw_output, updated_at, spent}

`spent` ({generation, prompt_tokens, completion_tokens, model}) is what the provider billed
the retried attempts of a generation (`decisions.Spent`): written with a retry decision,
kept by the claims that follow (which clear the decision) and read by the next attempt,
whose outcome counts it in. A newer generation (a DLQ replay) starts from nothing: the
outcome of the one it replaces counted it already.

A claim is one atomic conditional upsert. It succeeds for a task never seen, a newer
generation (a DLQ replay), the attempt after a decided retry, a running attempt whose
lease expired (its worker died), or, when the caller says so, a running attempt it claimed
itself and no longer works on (the claim's write landed but its answer was lost). Anything
else collides on `_id` and is classified: the same attempt running elsewhere (busy),
already decided (replay the decision), or older than what is stored (superseded).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from pymongo import AsyncMongoClient
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import DuplicateKeyError, OperationFailure

from services.scorer import decisions
from services.scorer.decisions import Finish, Retry, Spent
from shared.contracts import ScoreText
from shared.group_writes import GroupWriter
from shared.indexes import drop_retired_indexes

Document = dict[str, Any]
RETIRED_LEASE_INDEX = "lease_until_1"
# An index made again with other options: MongoDB's IndexOptionsConflict, the stand-in's
# IndexKeySpecsConflict.
INDEX_CONFLICTS = frozenset({85, 86})
log = logging.getLogger("scorebox.scorer")


@dataclass(frozen=True)
class Claimed:
    pass


@dataclass(frozen=True)
class Busy:
    until: datetime


@dataclass(frozen=True)
class Decided:
    decision: Finish | Retry


@dataclass(frozen=True)
class Superseded:
    pass


ClaimResult = Claimed | Busy | Decided | Superseded


class Attempts:
    def __init__(
        self, client: AsyncMongoClient[Document], database: str, *, retention: timedelta
    ) -> None:
        self._collection: AsyncCollection[Document] = client[database]["attempts"]
        # Claims and decisions of concurrent deliveries share round trips.
        self._writes = GroupWriter(self._collection)
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
        generation, attempt = command.generation, command.attempt
        reclaimable: list[Document] = []
        if reclaim_own:
            reclaimable.append(
                {"generation": generation, "attempt": attempt, "state": "running", "owner": owner}
            )
        claimable = {
            "_id": command.task_id,
            "$or": [
                *reclaimable,
                {"generation": {"$lt": generation}},
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
        claim = {
            "$set": {
                "tenant_id": command.tenant_id,
                "generation": generation,
                "attempt": attempt,
                "state": "running",
                "lease_until": now + lease,
                "owner": owner,
                "updated_at": now,
            },
            "$unset": {"decision": "", "raw_output": ""},
        }
        try:
            await self._writes.update_one(claimable, claim, upsert=True)
        except DuplicateKeyError:
            return await self.standing(command)
        return Claimed()

    async def standing(self, command: ScoreText) -> ClaimResult:
        """Where the command's attempt stands, without claiming it: decided (and how), behind
        a newer attempt, or not decided yet (Busy, until its claim's lease ends)."""
        held = await self._collection.find_one({"_id": command.task_id})
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
        return Decided(decision)

    async def spent_before(self, command: ScoreText) -> Spent | None:
        """What the earlier attempts of the command's generation were billed, as their retry
        decisions recorded it (None: nothing). The first attempt of a generation has none."""
        if command.attempt <= 1:
            return None
        held = await self._collection.find_one({"_id": command.task_id}, {"spent": True})
        spent = Spent.loaded(held.get("spent")) if held is not None else None
        if spent is None or spent.generation != command.generation:
            return None
        return spent

    async def decide(
        self,
        command: ScoreText,
        decision: Finish | Retry,
        *,
        now: datetime,
        raw_output: str | None,
        owner: str,
    ) -> bool:
        """Record the decision of the attempt `owner` holds; False when another worker has
        taken it over (our lease ended while the model answered or the database was slow):
        its decision is the one that stands. Writing it anyway overwrote that worker's
        claim, and both carried out their own decision, two outcomes of one attempt.

        Fenced by the owner in the filter; a refused filter shows as the upsert colliding on
        `_id` (a bulk write reports no match count per write). Writing again what already
        landed (an answer lost) matches: it is still ours. A retry's `spent` lands with it,
        or not at all: a refused decision's tokens are not carried on."""
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
            },
            {"$set": decided, "$unset": {"lease_until": ""}},
        )

    async def find(self, task_id: str) -> Document | None:
        return await self._collection.find_one({"_id": task_id})
