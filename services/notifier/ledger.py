"""The delivery ledger: one record per delivery id, the notifier's idempotency key.

    pending --published--> queued --claimed--> sending --2xx---------------> delivered
                                                 |  \\--permanent/last attempt-> failed
                                                 |  \\--delivery limit---------> failed
                                                 |  \\--failure alert removed--> cancelled
                                                 \\--transient--> retrying --claimed--> sending
    failed, or forgotten --its dead letter moved back to the queue (`reopen`)--> retrying

A consumer claims a delivery (state, attempt and a lease in one conditional update) before it
sends, so two copies of one message never POST at once and a delivered id is never sent
again. Each decision (retry with the next command, or failure with the reason) is recorded
before it is carried out on the broker; a redelivered message whose attempt was already
decided carries out the same decision again instead of sending again.

A delivery's attempts are numbered on across rounds: one given up and reopened goes on from
the next attempt, so that every copy of an earlier round's attempts finds itself superseded;
`round_from` tells where its current round began (its budget and back-off count from there).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from pymongo import ASCENDING, AsyncMongoClient, ReturnDocument
from pymongo.errors import DuplicateKeyError

from shared.contracts import DeliverWebhook

Document = dict[str, Any]


class DeliveryState(StrEnum):
    PENDING = "pending"
    QUEUED = "queued"
    SENDING = "sending"
    RETRYING = "retrying"
    DELIVERED = "delivered"
    FAILED = "failed"
    CANCELLED = "cancelled"  # a failure alert its tenant removed before this attempt


_CLAIMABLE = [DeliveryState.PENDING, DeliveryState.QUEUED, DeliveryState.RETRYING]


@dataclass(frozen=True)
class DeliveryRecord:
    delivery_id: str
    state: DeliveryState
    attempt: int
    lease_until: datetime | None = None
    last_error: str | None = None
    last_status: int | None = None
    next_delivery: DeliverWebhook | None = None
    triggers: int = 0
    # A failed delivery's message goes to the DLQ (a failure of ours), or not (the receiver
    # refused it: the tenant's business). Records of earlier builds, which dead-lettered
    # every failure, have no such field.
    dead_letter: bool = True
    # Its letter is in the DLQ (`mark_lettered`): later copies of its attempt drop, rather
    # than copy it there again.
    lettered: bool = False
    # The first attempt of the delivery's current round of attempts: 1, or the one a
    # moved-back letter reopened it at (`reopen`, `reopen_forgotten`).
    round_from: int = 1


@dataclass(frozen=True)
class Claim:
    """`won`: this consumer may send now; `record`: the delivery as the ledger holds it."""

    won: bool
    record: DeliveryRecord


def _identity(delivery: DeliverWebhook) -> Document:
    """What a delivery's record holds of it from its creation on."""
    return {
        "tenant_id": delivery.tenant_id,
        "task_id": delivery.task_id,
        "purpose": delivery.purpose.value,
        "url": delivery.url,
        "event_type": delivery.event_type,
    }


def _record_of(document: Document) -> DeliveryRecord:
    next_json = document.get("next_delivery")
    return DeliveryRecord(
        delivery_id=document["_id"],
        state=DeliveryState(document["state"]),
        attempt=document["attempt"],
        lease_until=document.get("lease_until"),
        last_error=document.get("last_error"),
        last_status=document.get("last_status"),
        next_delivery=DeliverWebhook.model_validate_json(next_json) if next_json else None,
        triggers=document.get("triggers", 0),
        dead_letter=document.get("dead_letter", True),
        lettered=document.get("lettered_at") is not None,
        round_from=document.get("round_from", 1),
    )


class Ledger:
    def __init__(
        self, client: AsyncMongoClient[Document], database: str, *, retention: timedelta
    ) -> None:
        self._deliveries = client[database]["deliveries"]
        self._retention = retention

    async def ensure_indexes(self) -> None:
        await self._deliveries.create_index([("expires_at", ASCENDING)], expireAfterSeconds=0)
        await self._deliveries.create_index([("task_id", ASCENDING)])

    async def register(self, delivery: DeliverWebhook, *, now: datetime) -> DeliveryRecord:
        """The delivery's record, created `pending` the first time its id is seen."""
        document = await self._deliveries.find_one_and_update(
            {"_id": delivery.delivery_id},
            {
                "$setOnInsert": {
                    **_identity(delivery),
                    "state": DeliveryState.PENDING.value,
                    "attempt": delivery.attempt,
                    "created_at": now,
                    "expires_at": now + self._retention,
                },
                "$inc": {"triggers": 1},
            },
            upsert=True,
            return_document=ReturnDocument.AFTER,
        )
        assert document is not None
        return _record_of(document)

    async def mark_queued(self, delivery_id: str, *, now: datetime) -> None:
        await self._deliveries.update_one(
            {"_id": delivery_id, "state": DeliveryState.PENDING.value},
            {"$set": {"state": DeliveryState.QUEUED.value, "updated_at": now}},
        )

    async def claim(
        self,
        delivery: DeliverWebhook,
        *,
        process: str,
        owner: str,
        now: datetime,
        lease: timedelta,
        reclaim_own: bool = False,
    ) -> Claim:
        """Take the delivery for this attempt, unless it is finished, newer, or leased.

        `owner` names this claim, `process` the notifier process making it. With
        `reclaim_own`, a lease of the same process on this attempt is taken over too: the
        caller works on none of it (a claim whose answer was lost)."""
        reclaimable: list[Document] = []
        if reclaim_own:
            reclaimable.append(
                {
                    "state": DeliveryState.SENDING.value,
                    "attempt": delivery.attempt,
                    "process": process,
                }
            )
        for _ in range(2):
            document = await self._deliveries.find_one_and_update(
                {
                    "_id": delivery.delivery_id,
                    "attempt": {"$lte": delivery.attempt},
                    "$or": [
                        {"state": {"$in": [state.value for state in _CLAIMABLE]}},
                        {"state": DeliveryState.SENDING.value, "lease_until": {"$lte": now}},
                        *reclaimable,
                    ],
                },
                {
                    "$set": {
                        "state": DeliveryState.SENDING.value,
                        "attempt": delivery.attempt,
                        "url": delivery.url,  # a failure alert's may have changed
                        "owner": owner,
                        "process": process,
                        "lease_until": now + lease,
                        "updated_at": now,
                    }
                },
                return_document=ReturnDocument.AFTER,
            )
            if document is not None:
                return Claim(won=True, record=_record_of(document))
            current = await self._deliveries.find_one({"_id": delivery.delivery_id})
            if current is not None:
                return Claim(won=False, record=_record_of(current))
            # A delivery the ledger never saw (or has forgotten): record it, then claim it.
            await self.register(delivery, now=now)
        raise AssertionError("unreachable: a registered delivery is either claimed or found")

    async def mark_delivered(self, delivery: DeliverWebhook, *, now: datetime, status: int) -> None:
        await self._deliveries.update_one(
            {"_id": delivery.delivery_id},
            {
                "$set": {
                    "state": DeliveryState.DELIVERED.value,
                    "last_status": status,
                    "last_error": None,
                    "lease_until": None,
                    "delivered_at": now,
                    "updated_at": now,
                }
            },
        )

    async def mark_retrying(
        self,
        delivery: DeliverWebhook,
        *,
        owner: str,
        now: datetime,
        next_delivery: DeliverWebhook,
        error: str,
        status: int | None,
    ) -> bool:
        """Record the retry (and the command that carries it); False if the claim was lost."""
        return await self._decide(
            delivery,
            owner=owner,
            fields={
                "state": DeliveryState.RETRYING.value,
                "attempt": next_delivery.attempt,
                "next_delivery": next_delivery.model_dump_json(),
                "next_attempt_at": next_delivery.not_before,
                "last_error": error,
                "last_status": status,
                "lease_until": None,
                "updated_at": now,
            },
        )

    async def mark_failed(
        self,
        delivery: DeliverWebhook,
        *,
        owner: str,
        now: datetime,
        error: str,
        status: int | None,
        dead_letter: bool,
    ) -> bool:
        """Record that the delivery is given up, and whether its message goes to the DLQ;
        False if the claim was lost meanwhile."""
        return await self._decide(
            delivery,
            owner=owner,
            fields={
                "state": DeliveryState.FAILED.value,
                "last_error": error,
                "last_status": status,
                "dead_letter": dead_letter,
                "lease_until": None,
                "failed_at": now,
                "updated_at": now,
            },
        )

    async def mark_lettered(self, delivery: DeliverWebhook, *, now: datetime) -> None:
        """Record that the given-up attempt's message is in the DLQ (the broker confirmed
        it), so that no later copy of the attempt copies it there again."""
        await self._deliveries.update_one(
            {
                "_id": delivery.delivery_id,
                "state": DeliveryState.FAILED.value,
                "attempt": delivery.attempt,
            },
            {"$set": {"lettered_at": now}},
        )

    async def reopen(self, letter: DeliverWebhook, *, fresh: DeliverWebhook, now: datetime) -> bool:
        """Start a fresh round of attempts, `fresh` its first, for a delivery given up at the
        attempt of `letter` (its dead letter, moved back to the queue): recorded `retrying`
        with `fresh` as its next command, as a retry is, so that a copy of the letter that
        comes later replays it. One conditional update: of copies of the letter moved back
        at once, on any replica, one reopens it; False for the others (and once the delivery
        went on)."""
        result = await self._deliveries.update_one(
            {
                "_id": letter.delivery_id,
                "state": DeliveryState.FAILED.value,
                "attempt": letter.attempt,
            },
            {
                "$set": self._reopened(fresh, now=now),
                # The new round's give-up is lettered anew (`mark_lettered`).
                "$unset": {"lettered_at": "", "failed_at": ""},
            },
        )
        return result.matched_count == 1

    async def reopen_forgotten(
        self, letter: DeliverWebhook, *, fresh: DeliverWebhook, now: datetime
    ) -> bool:
        """`reopen` for a letter whose delivery the ledger has forgotten (past retention):
        recorded anew, as reopened. One insert: False when a record is there, or another copy
        inserted it at the same moment (two upserts at once may fail on `_id`)."""
        try:
            result = await self._deliveries.update_one(
                {"_id": letter.delivery_id},
                {
                    "$setOnInsert": {
                        **_identity(letter),
                        "created_at": now,
                        **self._reopened(fresh, now=now),
                    }
                },
                upsert=True,
            )
        except DuplicateKeyError:
            return False
        return result.upserted_id is not None

    def _reopened(self, fresh: DeliverWebhook, *, now: datetime) -> Document:
        """A reopened record's fields. It lives a retention from now: the new round may
        outlast the old expiry."""
        return {
            "state": DeliveryState.RETRYING.value,
            "attempt": fresh.attempt,
            "round_from": fresh.attempt,
            "next_delivery": fresh.model_dump_json(),
            "next_attempt_at": fresh.not_before,
            "lease_until": None,
            "reopened_at": now,
            "updated_at": now,
            "expires_at": now + self._retention,
        }

    async def mark_cancelled(
        self, delivery: DeliverWebhook, *, owner: str, now: datetime, reason: str
    ) -> bool:
        """Record that the delivery stops unsent; False if the claim was lost meanwhile."""
        return await self._decide(
            delivery,
            owner=owner,
            fields={
                "state": DeliveryState.CANCELLED.value,
                "cancel_reason": reason,
                "lease_until": None,
                "cancelled_at": now,
                "updated_at": now,
            },
        )

    async def _decide(self, delivery: DeliverWebhook, *, owner: str, fields: Document) -> bool:
        """Record the decision of the attempt `owner` claimed; False if the claim was lost.

        Repeatable: a decision already recorded under this claim (the reply to an earlier try
        was lost) matches again and changes nothing (`owner` names one claim, never reused).
        """
        decided = {"state": fields["state"], "attempt": fields.get("attempt", delivery.attempt)}
        result = await self._deliveries.update_one(
            {
                "_id": delivery.delivery_id,
                "owner": owner,
                "$or": [
                    {"state": DeliveryState.SENDING.value, "attempt": delivery.attempt},
                    decided,
                ],
            },
            {"$set": fields},
        )
        return result.matched_count == 1

    async def find(self, delivery_id: str) -> DeliveryRecord | None:
        document = await self._deliveries.find_one({"_id": delivery_id})
        return None if document is None else _record_of(document)
