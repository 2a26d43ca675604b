"""Usage metering: one raw record per finished task generation that used tokens.

The scorer reports token usage in its `task.completed` events, and in `task.failed` when
answers came back and stayed unusable (the provider bills them all the same); the scheduler
keeps a raw record per (task, generation) in its own database (idempotent under redelivery:
the record's id is that pair and an existing record is never changed) and, from a
completion, the catalogue entry the re-score fan-out walks. Cost is computed when the record
is made, with the price configured for the model at that moment, in integer nano-units of
the currency (exact sums, no float drift); a model without a configured price has no cost.

The price of a model is looked up by the name the provider answered with, which is not always
the name asked for: OpenAI answers `gpt-4o-mini` with `gpt-4o-mini-2024-07-18`. A dated name
without a price of its own takes the price of its undated name (`price_of`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any, Final

from services.scheduler.catalogue import Catalogue, CompletedTask
from services.scheduler.config import Price
from services.scheduler.jobs import Clock
from services.scheduler.usage_store import UsageRecord, UsageRecords
from shared.contracts import TaskCompleted, TaskFailed, Usage

NANOS_PER_UNIT = 10**9
UNKNOWN_MODEL = "unknown"  # a failed task's event from before it named its model
_NANOS_PER_1K_TOKENS_TO_PER_TOKEN = Decimal(NANOS_PER_UNIT) / 1000
# The snapshot date a provider appends to the model name it answers with: `-2024-07-18`
# (OpenAI's today), `-0613` (its older month-day form, `gpt-4-0613`).
_SNAPSHOT_SUFFIX: Final = re.compile(r"-(?:\d{4}-\d{2}-\d{2}|\d{4})$")


def price_of(model: str, prices: Mapping[str, Price]) -> Price | None:
    """The configured price of the answered `model`: its own, else that of its name without
    the snapshot date (`gpt-4o-mini-2024-07-18` -> `gpt-4o-mini`), else None.

    Only a date is dropped, never another part of the name: `gpt-4o-mini-2024-07-18` never
    takes the price of `gpt-4o` (about 16 times that of `gpt-4o-mini`), priced or not. A
    model priced neither itself nor by its undated name stays unpriced (counted as such in
    the usage report), rather than billed at a neighbour's price.
    """
    if (price := prices.get(model)) is not None:
        return price
    if snapshot := _SNAPSHOT_SUFFIX.search(model):
        return prices.get(model[: snapshot.start()])
    return None


def cost_nanos(usage: Usage, price: Price | None) -> int | None:
    """The cost of `usage` at `price` in nano-units of the currency; None without a price."""
    if price is None:
        return None
    exact = (
        usage.prompt_tokens * price.prompt_per_1k
        + usage.completion_tokens * price.completion_per_1k
    ) * _NANOS_PER_1K_TOKENS_TO_PER_TOKEN
    return int(exact.to_integral_value(rounding=ROUND_HALF_EVEN))


def day_of(instant: datetime) -> str:
    """The UTC calendar day of `instant`, `YYYY-MM-DD` (usage days are UTC days)."""
    return instant.astimezone(UTC).date().isoformat()


@dataclass(frozen=True)
class Extras:
    """Fields a `task.completed` event may carry beyond today's contract (tolerant reader)."""

    prompt_version: str | None = None
    api_key_id: str | None = None

    @classmethod
    def of(cls, raw: Mapping[str, Any]) -> Extras:
        result = raw.get("result")
        result = result if isinstance(result, Mapping) else {}
        version = result.get("prompt_version", raw.get("prompt_version"))
        api_key = raw.get("api_key_id")
        return cls(
            prompt_version=None if version is None else str(version),
            api_key_id=None if api_key is None else str(api_key),
        )


def usage_record_of(
    event: TaskCompleted, *, extras: Extras, prices: Mapping[str, Price], recorded_at: datetime
) -> UsageRecord:
    result = event.result
    # A result-cache hit carries the usage of the call that made the result; it made none.
    spent = Usage() if result.cached else result.usage
    return UsageRecord(
        task_id=event.task_id,
        generation=event.generation,
        tenant_id=event.tenant_id,
        api_key_id=extras.api_key_id,
        model=result.model,
        prompt_tokens=spent.prompt_tokens,
        completion_tokens=spent.completion_tokens,
        # Known to be nothing, priced or not: an unpriced model's hits read "unpriced".
        cost_nanos=0 if result.cached else cost_nanos(spent, price_of(result.model, prices)),
        cached=result.cached,
        day=day_of(event.occurred_at),
        completed_at=event.occurred_at,
        recorded_at=recorded_at,
    )


def failed_usage_record_of(
    event: TaskFailed, *, extras: Extras, prices: Mapping[str, Price], recorded_at: datetime
) -> UsageRecord:
    model = event.model or UNKNOWN_MODEL
    return UsageRecord(
        task_id=event.task_id,
        generation=event.generation,
        tenant_id=event.tenant_id,
        api_key_id=extras.api_key_id,
        model=model,
        prompt_tokens=event.usage.prompt_tokens,
        completion_tokens=event.usage.completion_tokens,
        cost_nanos=cost_nanos(event.usage, price_of(model, prices)),
        cached=False,
        day=day_of(event.occurred_at),
        completed_at=event.occurred_at,
        recorded_at=recorded_at,
    )


def completed_task_of(event: TaskCompleted, *, extras: Extras) -> CompletedTask:
    return CompletedTask(
        task_id=event.task_id,
        tenant_id=event.tenant_id,
        generation=event.generation,
        completed_at=event.occurred_at,
        model=event.result.model,
        rubric_version=extras.prompt_version,
        cached=event.result.cached,
    )


async def record_task_finished(
    event: TaskCompleted | TaskFailed,
    *,
    extras: Extras,
    usage: UsageRecords,
    catalogue: Catalogue,
    prices: Mapping[str, Price],
    clock: Clock,
) -> None:
    """Keep the usage record and the catalogue entry of a completed task, the usage record of
    a failed one whose model calls used tokens (idempotent)."""
    if isinstance(event, TaskFailed):
        if event.usage.total_tokens:
            record = failed_usage_record_of(
                event, extras=extras, prices=prices, recorded_at=clock()
            )
            await usage.record(record)
        return
    await usage.record(usage_record_of(event, extras=extras, prices=prices, recorded_at=clock()))
    await catalogue.record(completed_task_of(event, extras=extras))
