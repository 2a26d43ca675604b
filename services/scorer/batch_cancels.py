"""Batches cancelled, heard by every scorer replica, so their items are cancelled at delivery.

A batch's cancellation is one `CancelTask` per item (`services/gateway/cancels.py`), each a
read, a write and a publish on `score.cancel`, racing the items' own deliveries on
`score.requested`: they went at the pace of the scoring, and most of a batch cancelled at
once was scored all the same (579 of 934 open items cancelled, in a walkthrough of `make
run`). The gateway now announces the batch's cancellation alongside them (`BatchCancelling`,
with the generation of each item it cancels), every replica keeps it here for `KEEP_S`, and
a delivery of an item it names, at that generation, is cancelled before it claims anything
(`scoring.score_text`), through `Attempts.cancel` as its own `CancelTask` is: that
cancellation, coming first or after, finds it recorded and publishes the failure again,
which every consumer of outcomes takes as a repeat.

Applied at each delivery while it is kept: an item whose model call was under way when its
`CancelTask` came (too late, then) and whose claim has since expired (its scorer died, and
the delivery came back) is cancelled rather than called again. A 503 for the cancels (not
all confirmed) may still cancel the items, as the cancels it did queue would.

Kept in memory, where each delivery looks, and stored in the scorer's own database
(`BatchCancelRecords`, the `batch_cancels` collection: one document per batch, written by
every replica that hears it, gone `KEEP_S` after): the announcement goes to each replica's
own queue once, so a replica killed after hearing it and started again (or one started
since) never heard it, and the items' `CancelTask`s raced their deliveries again (92 of a
1,000-item batch scored, in a walkthrough). A replica reads the records before it consumes
anything (`recall_cancelled_batches`). Best effort still, as the shared pauses are: a record
not written (the database away) leaves the memory's copy; the items' cancellations record
them whatever is heard, stored or lost here. Memory holds at most `MAX_BATCHES`
announcements of any tenant, up to 1,000 items each (tens of MB at worst).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from pydantic import ValidationError
from pymongo import ASCENDING, DESCENDING, AsyncMongoClient
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import PyMongoError

from services.scorer.metrics import ScorerMetrics
from shared.consumers import Delivery, ScoreboxBroker, consume
from shared.contracts import BatchCancelling, ScoreText
from shared.group_writes import GroupWriter
from shared.topology import (
    SCORER_BATCH_CANCELS_BINDING,
    SCORER_BATCH_CANCELS_PREFIX,
    scorer_batch_cancels_queue,
)

Document = dict[str, Any]
log = logging.getLogger("scorebox.scorer.batch_cancels")

# How long an announcement is kept: its items' cancellations, sent right after it, are
# recorded within seconds unless the broker or the database is away; past this, they are.
KEEP_S = 900.0
# Announcements kept at most (each up to 1,000 items): the oldest goes first.
MAX_BATCHES = 256


@dataclass(frozen=True)
class _Heard:
    tenant_id: str
    requested_at: datetime
    generations: dict[str, int]
    heard_at: datetime


class CancelledBatches:
    """The batch cancellations this replica has heard of, newest last."""

    def __init__(
        self,
        *,
        clock: Callable[[], datetime],
        keep_s: float = KEEP_S,
        max_batches: int = MAX_BATCHES,
    ) -> None:
        self._clock = clock
        self._keep = timedelta(seconds=keep_s)
        self._max_batches = max_batches
        self._heard: OrderedDict[str, _Heard] = OrderedDict()

    def __len__(self) -> int:
        return len(self._heard)

    def hear(self, event: BatchCancelling) -> datetime:
        """Keep `event`, heard now, unless the batch's kept cancellation was requested later
        (the two heard out of order: the later generation's items went uncancelled here);
        returns when (its record's `heard_at`)."""
        heard_at = self._clock()
        kept = self._heard.get(event.batch_id)
        if kept is None or kept.requested_at <= event.requested_at:
            self._keep_heard(event, heard_at)
        return heard_at

    def recall(self, event: BatchCancelling, heard_at: datetime) -> bool:
        """Keep an announcement heard before (its record), unless it is too old or the
        batch's kept one was requested as late already (a cancellation heard again);
        whether it was kept."""
        kept = self._heard.get(event.batch_id)
        if kept is not None and kept.requested_at >= event.requested_at:
            return False
        if heard_at < self._clock() - self._keep:
            return False
        self._keep_heard(event, heard_at)
        return True

    def requested_at(self, command: ScoreText) -> datetime | None:
        """When the command's batch was cancelled, if the announcement names this item at
        the command's generation (a later one, a DLQ replay or a re-score sent since, is
        not cancelled, as its own `CancelTask` would not be); None otherwise."""
        if command.batch_id is None or not self._heard:
            return None
        self._forget_old()
        heard = self._heard.get(command.batch_id)
        if heard is None or heard.tenant_id != command.tenant_id:
            return None
        # Its own age too: one recalled after a newer one was heard sits behind it.
        if heard.heard_at < self._clock() - self._keep:
            return None
        if heard.generations.get(command.task_id) != command.generation:
            return None
        return heard.requested_at

    def _keep_heard(self, event: BatchCancelling, heard_at: datetime) -> None:
        self._heard.pop(event.batch_id, None)
        self._heard[event.batch_id] = _Heard(
            tenant_id=event.tenant_id,
            requested_at=event.requested_at,
            generations=dict(event.generations),
            heard_at=heard_at,
        )
        while len(self._heard) > self._max_batches:
            self._heard.popitem(last=False)

    def _forget_old(self) -> None:
        oldest_kept = self._clock() - self._keep
        while self._heard:
            batch_id, heard = next(iter(self._heard.items()))
            if heard.heard_at >= oldest_kept:
                return
            del self._heard[batch_id]


@dataclass(frozen=True)
class StoredCancel:
    event: BatchCancelling
    heard_at: datetime


class BatchCancelRecords:
    """The announcements heard, in the scorer's own database, for a replica that starts
    after them: one document per batch, the same whichever replica writes it.

        {_id: batch_id, requested_at, announcement (the event's JSON), heard_at, expires_at}

    The announcement is kept as its JSON (its items are task ids, which a document's field
    names need not accept) and read back through its contract. Each call is bounded by the
    client's `timeoutMS`, as the attempts' are."""

    def __init__(
        self, client: AsyncMongoClient[Document], database: str, *, keep_s: float = KEEP_S
    ) -> None:
        self._collection: AsyncCollection[Document] = client[database]["batch_cancels"]
        self._writes = GroupWriter(self._collection)
        self._keep = timedelta(seconds=keep_s)

    async def ensure_indexes(self) -> None:
        await self._collection.create_index([("expires_at", ASCENDING)], expireAfterSeconds=0)

    async def record(self, event: BatchCancelling, *, heard_at: datetime) -> None:
        """Upsert the batch's record, idempotent: every replica hearing the announcement
        writes it, and a later cancellation of the batch (after a replay) replaces it, never
        the reverse (a replica that heard the two late writes the earlier one last): the
        guard names the batch at an earlier or equal request (`guarded_upsert`, which also
        tells a record of a later one from another replica's insert of the same moment)."""
        document = {
            "requested_at": event.requested_at,
            "announcement": event.model_dump_json(),
            "heard_at": heard_at,
            "expires_at": heard_at + self._keep,
        }
        earlier = {"_id": event.batch_id, "requested_at": {"$lte": event.requested_at}}
        await self._writes.guarded_upsert(earlier, {"$set": document})

    async def recent(self, *, now: datetime, limit: int = MAX_BATCHES) -> list[StoredCancel]:
        """The records not expired at `now`, the `limit` heard last, oldest first. Expired
        ones linger until the TTL monitor's next pass (once a minute): the filter drops them."""
        cursor = self._collection.find(
            {"expires_at": {"$gt": now}},
            projection={"announcement": True, "heard_at": True},
            sort=[("heard_at", DESCENDING)],
            limit=limit,
        )
        documents = await cursor.to_list()
        return [stored for document in reversed(documents) if (stored := _read(document))]


def _read(document: Document) -> StoredCancel | None:
    try:
        event = BatchCancelling.model_validate_json(document["announcement"])
    except ValidationError as error:
        log.warning("ignoring an unreadable record of batch %s: %s", document["_id"], error)
        return None
    return StoredCancel(event=event, heard_at=document["heard_at"])


async def recall_again(
    batches: CancelledBatches, records: BatchCancelRecords, *, now: datetime
) -> None:
    """Read the records once more once this replica's own queue is bound (the broker's
    start): an announcement sent between the first read and the binding reached only the
    other replicas, which stored it. Best effort: the first read stands if this one fails."""
    try:
        await recall_cancelled_batches(batches, records, now=now)
    except PyMongoError as error:
        log.warning("batch cancellations not read again after the start: %r", error)


async def recall_cancelled_batches(
    batches: CancelledBatches, records: BatchCancelRecords, *, now: datetime
) -> None:
    """Keep the batch cancellations heard in the last `KEEP_S`, by this replica before it
    was restarted or by the others (at start-up, before anything is consumed: an item of
    such a batch delivered first would be claimed and scored)."""
    stored = await records.recent(now=now)
    kept = sum(batches.recall(record.event, record.heard_at) for record in stored)
    if kept:  # the second reading's, only those it found new (a walkthrough read two lines)
        log.info("%d batch cancellations recalled from the last %.0f s", kept, KEEP_S)


def subscribe_batch_cancels(
    broker: ScoreboxBroker,
    batches: CancelledBatches,
    records: BatchCancelRecords,
    metrics: ScorerMetrics,
    *,
    replica: str,
) -> None:
    """Hear the batches cancelled on this replica's own queue (auto-acknowledged: an
    announcement lost costs only the items scored before their own cancellations come),
    keep each in memory, then store it for the replicas that start later."""

    @consume(
        broker,
        scorer_batch_cancels_queue(replica),
        ack_first=True,
        metric_label=SCORER_BATCH_CANCELS_PREFIX.removesuffix("."),
        bindings=(SCORER_BATCH_CANCELS_BINDING,),
    )
    async def hear_batch_cancel(message: Delivery) -> None:
        try:
            event = BatchCancelling.model_validate_json(message.body)
        except ValidationError as error:
            log.warning("ignoring an unreadable batch cancellation: %s", error)
            return
        heard_at = batches.hear(event)
        metrics.batch_cancels_heard.inc()
        log.info(
            "batch %s cancelled: its %d open items are cancelled when they arrive",
            event.batch_id,
            len(event.generations),
        )
        await _store(records, event, heard_at)


async def _store(records: BatchCancelRecords, event: BatchCancelling, heard_at: datetime) -> None:
    """Best effort: the copy in memory stands whatever happens here (a replica started later
    misses a record not written, and the items' own cancellations still come)."""
    try:
        await records.record(event, heard_at=heard_at)
    except PyMongoError as error:
        log.warning(
            "batch %s's cancellation not stored: a scorer starting before it is forgotten "
            "will not know of it: %r",
            event.batch_id,
            error,
        )
