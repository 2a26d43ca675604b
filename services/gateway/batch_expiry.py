"""A batch's record outlives its unsent items.

A batch record expires `IDEMPOTENCY_TTL_S` after its creation. Its items' submissions do not
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

from datetime import datetime, timedelta

from services.gateway.batches import Batches, BatchState
from services.gateway.submissions import Submissions

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
        due = await batches.due_for_hold_check(now=now, limit=HOLD_CHECK_CHUNK)
        if not due:
            break
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
        if len(due) < HOLD_CHECK_CHUNK:
            break
    return held
