"""A batch's record outlives its unsent items.

A batch record expires `IDEMPOTENCY_TTL_S` after its creation. A batch whose request died
before it noted every item recorded is looked at earlier, at the end of its wait for a replay,
and refused whole then (`_without_unrecorded`). Its items' submissions do not
expire while unsent (`services/gateway/submissions.py`), so after a broker outage longer than
that the record went first: the batch read 404 while its items were still to be scored, and
its idempotency key was free again, so a client replaying the request had every item scored
twice. Each outbox sweep pass now looks at the batches whose expiry comes within their hold
lead (`hold_check_at`, set at insert): one with an item still unsent, or whose request may
still be running, is held `IDEMPOTENCY_TTL_S` from now; the others are settled (the field
removed) and expire as their record says. A held batch thus expires about `IDEMPOTENCY_TTL_S`
after its last item was sent, as its items do. That needs the sweep's part too: before it
sends a chunk it lets the chunk's batches live `IDEMPOTENCY_TTL_S` from the chunk's sends
(`Batches.outlive_sends`); a batch whose last items it sent just before its look was settled
there and expired about an hour after the send.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from services.gateway.batches import Batches, BatchRecord, BatchState
from services.gateway.submissions import Submissions
from services.gateway.submit import incomplete_batch_held_until

log = logging.getLogger("scorebox.gateway.batch_expiry")

HOLD_CHECK_CHUNK = 200
MAX_CHUNKS_PER_PASS = 10  # the rest waits for the next pass, the most urgent first


async def hold_unsent_batches(
    *,
    batches: Batches,
    submissions: Submissions,
    now: datetime,
    retention: timedelta,
    in_progress_for: timedelta,
) -> int:
    """Hold the batches due for a look that still have items to send; how many were held."""
    held = 0
    for _ in range(MAX_CHUNKS_PER_PASS):
        listed = await batches.due_for_hold_check(now=now, limit=HOLD_CHECK_CHUNK)
        if not listed:
            break
        due, waiting = await _without_unrecorded(
            listed, batches, now=now, grace=in_progress_for, retention=retention
        )
        held += waiting
        unsent = await submissions.batches_with_unsent([batch.batch_id for batch in due])
        hold = {
            batch.batch_id
            for batch in due
            if batch.batch_id in unsent
            or (batch.state == BatchState.ACCEPTING and batch.created_at > now - in_progress_for)
        }
        await batches.hold(sorted(hold), now=now, retention=retention)
        await batches.settle([batch.batch_id for batch in due if batch.batch_id not in hold])
        held += len(hold)
        if len(listed) < HOLD_CHECK_CHUNK:
            break
    return held


async def _without_unrecorded(
    due: list[BatchRecord],
    batches: Batches,
    *,
    now: datetime,
    grace: timedelta,
    retention: timedelta,
) -> tuple[list[BatchRecord], int]:
    """`due` less the batches whose request has not noted every item recorded (`recorded`
    False, still `accepting`, none of their items sent), and how many of those wait for a
    replay. Once its wait is over, each is refused whole (`abandon_unrecorded`, as the
    outbox sweep refuses one with items recorded), or left for a later pass when a write
    noted it recorded, or a replay accepted it, since it was read. Looked at within its wait
    (a retention short enough to bring its usual look first), it is held to the wait's end
    and looked at then: passed on, it was settled once past the grace, and never refused
    (the review of this change).

    The outbox sweep finds an incomplete batch by its recorded items, so one whose request
    died before its first chunk of items landed (a gateway killed, an insert timed out and
    its refusal lost with the process) was never refused: it was listed, its items read
    `expired` as if scored, a cancel was told to wait for a refusal due long before, for a
    day (a review). Its look now comes at the end of that wait (`Batches.insert`)."""
    kept, waiting = [], 0
    for batch in due:
        held_until = incomplete_batch_held_until(batch.created_at, grace=grace)
        if not batch.left_unrecorded:
            kept.append(batch)
        elif held_until > now:
            await batches.hold_for_replay(batch.batch_id, until=held_until, retention=retention)
            waiting += 1
        elif await batches.abandon_unrecorded(batch.batch_id, now=now):
            log.warning(
                "batch %s: its request died before recording every item; refused",
                batch.batch_id,
            )
    return kept, waiting
