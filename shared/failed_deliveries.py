"""Deliveries whose handling failed: returned to their queue, and at its delivery limit
dead-lettered by the consumer itself, with the reason.

A consumer returns a delivery it could not handle (a write the database refused for good,
a crash) with `Delivery.requeue_failed`, and the queue's `x-delivery-limit` bounds the
returns: RabbitMQ dead-letters the delivery it would hand out once more. It says no more
than `delivery_limit` in `x-death`, so the dead letter did not tell an operator why. The
delivery the limit would dead-letter on its return (`x-delivery-count` at the limit) is
copied to the DLQ here instead, with the error as `x-scorebox-error`, and acked.

The copy is tried for `LETTER_DEADLINE_S` at most (`shared.runtime.keep_dead_lettering`,
as every copy a handler sends to a DLQ): a broker that refuses it that long (a memory alarm,
a DLQ deleted) gets the delivery back as failed, and dead-letters it itself without the
reason, rather than the handler holding it, and its prefetch slot, for as long.
"""

from __future__ import annotations

from typing import Any

from faststream.rabbit import RabbitBroker

from shared.consumers import Delivery
from shared.runtime import LETTER_DEADLINE_S, keep_dead_lettering
from shared.topology import (
    DELIVERY_COUNT_HEADER,
    EARLIER_DELIVERIES_HEADER,
    WorkQueue,
    deliveries_lost,
)

# `publish_dead_letter` keeps 1,000 characters of the reason: the error's text is cut first,
# so that what follows it is kept.
_ERROR_TEXT_MAX = 900
# Counts that describe this copy's deliveries, not the letter: a letter moved back to its
# queue starts with none (with the limit's count it would be given up at once).
_COUNTS = (DELIVERY_COUNT_HEADER, EARLIER_DELIVERIES_HEADER)


async def return_failed(
    broker: RabbitBroker,
    work_queue: WorkQueue,
    message: Delivery,
    *,
    error: BaseException | str,
    timeout: float,
    letter_deadline_s: float = LETTER_DEADLINE_S,
) -> None:
    """Return `message` to its queue as failed, or, on the delivery that its queue's limit
    would dead-letter when returned, dead-letter it with `error` and ack it."""
    if deliveries_lost(message.headers) < work_queue.delivery_limit:
        await message.requeue_failed()
        return
    if await keep_dead_lettering(
        broker,
        work_queue,
        message,
        error=failure_reason(error),
        timeout=timeout,
        headers=_letter_headers(message.headers),
        letter_deadline_s=letter_deadline_s,
    ):
        await message.ack()


def failure_reason(error: BaseException | str) -> str:
    what = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return f"{what[:_ERROR_TEXT_MAX]} (at the queue's delivery limit)"


def _letter_headers(headers: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in headers.items() if key not in _COUNTS}
