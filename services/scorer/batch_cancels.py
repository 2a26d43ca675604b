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

Best effort, as the shared pauses are: the items' cancellations record them whatever is
heard or lost here (a replica that started later, or missed the announcement, or has
forgotten it). Nothing is stored: memory holds at most `MAX_BATCHES` announcements of any
tenant, up to 1,000 items each (tens of MB at worst).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from pydantic import ValidationError

from services.scorer.metrics import ScorerMetrics
from shared.consumers import Delivery, ScoreboxBroker, consume
from shared.contracts import BatchCancelling, ScoreText
from shared.topology import (
    SCORER_BATCH_CANCELS_BINDING,
    SCORER_BATCH_CANCELS_PREFIX,
    scorer_batch_cancels_queue,
)

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

    def hear(self, event: BatchCancelling) -> None:
        self._heard.pop(event.batch_id, None)
        self._heard[event.batch_id] = _Heard(
            tenant_id=event.tenant_id,
            requested_at=event.requested_at,
            generations=dict(event.generations),
            heard_at=self._clock(),
        )
        while len(self._heard) > self._max_batches:
            self._heard.popitem(last=False)

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
        if heard.generations.get(command.task_id) != command.generation:
            return None
        return heard.requested_at

    def _forget_old(self) -> None:
        oldest_kept = self._clock() - self._keep
        while self._heard:
            batch_id, heard = next(iter(self._heard.items()))
            if heard.heard_at >= oldest_kept:
                return
            del self._heard[batch_id]


def subscribe_batch_cancels(
    broker: ScoreboxBroker,
    batches: CancelledBatches,
    metrics: ScorerMetrics,
    *,
    replica: str,
) -> None:
    """Hear the batches cancelled on this replica's own queue (auto-acknowledged: an
    announcement lost costs only the items scored before their own cancellations come)."""

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
        batches.hear(event)
        metrics.batch_cancels_heard.inc()
        log.info(
            "batch %s cancelled: its %d open items are cancelled when they arrive",
            event.batch_id,
            len(event.generations),
        )
