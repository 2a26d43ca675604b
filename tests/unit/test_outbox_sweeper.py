"""The gateway's background outbox task outlives a pass that fails on something other than an
unavailable database or broker: one stored document that no longer reads ended it silently,
and with it every later write-off and sweep of the process."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import cast

import pytest
from pydantic import ValidationError

from services.gateway.api import GatewayDeps
from services.gateway.batches import Batches
from services.gateway.consumers import keep_outbox_swept
from services.gateway.refusals import Refusal, Refusals
from services.gateway.submissions import Submission
from services.gateway.submit import Publisher
from shared.contracts import ScoreText
from tests.support import eventually

NOW = datetime(2030, 5, 17, 12, 0, tzinfo=UTC)


@dataclass
class UnreadableOnce:
    """Submissions whose first outbox read meets a document that does not validate, and
    whose tombstones take on the first write-off fails the same way."""

    swept: asyncio.Event = field(default_factory=asyncio.Event)
    reads: int = 0
    abandoned: list[str] = field(default_factory=list)
    abandons: int = 0

    async def interrupted(
        self, *, older_than: datetime, limit: int = 500, excluding_batches: Collection[str] = ()
    ) -> list[Submission]:
        self.reads += 1
        if self.reads == 1:
            ScoreText.model_validate({"task_id": "t-1"})  # raises ValidationError
        self.swept.set()
        return []

    async def abandon(self, task_ids: tuple[str, ...], *, now: datetime) -> set[str]:
        self.abandons += 1
        if self.abandons == 1:
            raise KeyError("state")
        self.abandoned.extend(task_ids)
        return set()  # every tombstone applied

    async def uncount(self, task_ids: Collection[str]) -> None:
        """Nothing kept, nothing to uncount."""


@dataclass
class NoBatchDue:
    """No batch comes near its expiry (`hold_unsent_batches` looks at none)."""

    looks: int = 0

    async def due_for_hold_check(self, *, now: datetime, limit: int) -> list[object]:
        self.looks += 1
        return []


async def _either(*conditions: bool) -> bool:
    return any(conditions)


async def test_the_outbox_task_logs_a_failed_pass_and_runs_the_next(
    caplog: pytest.LogCaptureFixture,
) -> None:
    submissions, refusals = UnreadableOnce(), Refusals()
    refusals.note(Refusal("default", ("t-2",)))
    deps = SimpleNamespace(
        settings=SimpleNamespace(
            outbox_grace_s=30.0, outbox_interval_s=0.01, idempotency_ttl_s=86_400
        ),
        submissions=submissions,
        refusals=refusals,
        in_flight=None,
        clock=lambda: NOW,
    )
    publisher = cast(Publisher, object())  # nothing to send
    batches = NoBatchDue()
    caplog.set_level(logging.ERROR, logger="scorebox.gateway")

    sweeper = asyncio.create_task(
        keep_outbox_swept(cast(GatewayDeps, deps), publisher, cast(Batches, batches))
    )
    try:
        await eventually(
            lambda: _either(submissions.swept.is_set(), sweeper.done()),
            timeout_s=10,
            what="a second pass, or the task's end",
        )
        assert not sweeper.done(), sweeper
    finally:
        sweeper.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sweeper

    assert submissions.reads >= 2  # the pass after the failed one ran
    assert submissions.abandoned == ["t-2"]  # the write-off too
    assert batches.looks >= 2  # and the hold of batches with unsent items, each pass
    assert refusals.pending() == []
    logged = {
        (record.getMessage(), record.exc_info[0])
        for record in caplog.records
        if record.exc_info is not None
    }
    assert logged == {
        ("writing off refused requests failed; tried again next pass", KeyError),
        ("outbox sweep failed; tried again next pass", ValidationError),
    }
