"""The status projection forgets a task whose command the broker refused (`score.withdrawn`),
whichever of the command's copy and the withdrawal it applies first, and never a task some
attempt moved on; a stale event that comes back after a task's document expired brings it
back for a bounded time only. On the real database (MongoDB or the stand-in), through the
projection's own write path."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from faststream.rabbit import RabbitBroker
from pymongo.asynchronous.collection import AsyncCollection

from devtools.infra import Endpoint
from services.gateway.publisher import TaskPublisher
from services.status.projection import (
    UNFINISHED_RETENTION,
    apply_projected,
    ensure_indexes,
    find_task,
    projected_event,
)
from shared.contracts import (
    Phase,
    ScoreResult,
    ScoreText,
    ScoreWithdrawn,
    TaskCompleted,
    TaskStarted,
    event_sequence,
    new_id,
    utcnow,
)
from shared.group_writes import GroupWriter
from shared.topology import STATUS_PROJECTION
from tests.support import CommandCounter, drain, scratch_collection

Document = dict[str, Any]
TTL = timedelta(hours=1)
BROKER_TIMEOUT_S = 10.0


@pytest.fixture
async def tasks(mongo: Endpoint) -> AsyncIterator[AsyncCollection[Document]]:
    async with scratch_collection(mongo.url, CommandCounter(), prefix="withdrawals") as docs:
        yield docs


async def _apply(
    tasks: AsyncCollection[Document], routing_key: str, body: bytes, *, now: datetime | None = None
) -> None:
    message = projected_event(routing_key, body)
    assert message is not None
    await apply_projected(message, writes=GroupWriter(tasks), finished_ttl=TTL, now=now or utcnow())


async def _command(tasks: AsyncCollection[Document], command: ScoreText) -> None:
    await _apply(tasks, ScoreText.routing_key, command.model_dump_json().encode())


async def _withdrawal(tasks: AsyncCollection[Document], command: ScoreText) -> None:
    withdrawal = ScoreWithdrawn(task_id=command.task_id, tenant_id=command.tenant_id)
    await _apply(tasks, ScoreWithdrawn.routing_key, withdrawal.model_dump_json().encode())


async def _readable(tasks: AsyncCollection[Document], command: ScoreText) -> bool:
    view = await find_task(command.task_id, tenant_id=command.tenant_id, tasks=tasks, now=utcnow())
    return view is not None


def _refused() -> ScoreText:
    return ScoreText(task_id=new_id(), tenant_id="acme", text="Refused by a full queue.")


async def test_a_withdrawal_after_the_commands_copy_hides_the_task(
    tasks: AsyncCollection[Document],
) -> None:
    command = _refused()
    await _command(tasks, command)
    assert await _readable(tasks, command)
    await _withdrawal(tasks, command)
    assert not await _readable(tasks, command)


async def test_a_copy_after_the_withdrawal_does_not_bring_the_task_back(
    tasks: AsyncCollection[Document],
) -> None:
    command = _refused()
    await _withdrawal(tasks, command)
    await _command(tasks, command)
    assert not await _readable(tasks, command)


async def _ttl_monitor_pass(tasks: AsyncCollection[Document]) -> None:
    """What MongoDB's TTL monitor does about once a minute: remove what has expired."""
    await tasks.delete_many({"expires_at": {"$lt": utcnow()}})


async def test_a_copy_redelivered_after_the_ttl_monitor_ran_stays_hidden(
    tasks: AsyncCollection[Document],
) -> None:
    """The projection's queue may hold a copy of the command for hours (its service down);
    the tombstone outlives the TTL monitor's passes meanwhile."""
    command = _refused()
    await _command(tasks, command)
    await _withdrawal(tasks, command)
    await _ttl_monitor_pass(tasks)
    await _command(tasks, command)
    assert not await _readable(tasks, command)


async def test_a_task_scored_after_all_is_not_hidden(tasks: AsyncCollection[Document]) -> None:
    """Refused by one queue yet taken by the scorer's: its outcome outranks the withdrawal,
    whichever arrives first."""
    command = _refused()
    completed = TaskCompleted(
        task_id=command.task_id,
        tenant_id=command.tenant_id,
        sequence=event_sequence(generation=0, attempt=1, phase=Phase.TERMINAL),
        submitted_at=command.submitted_at,
        result=ScoreResult(score=7, comment="Fine.", model="m"),
    )
    body = completed.model_dump_json().encode()

    await _withdrawal(tasks, command)
    await _apply(tasks, TaskCompleted.routing_key, body)
    assert await _readable(tasks, command)

    other = _refused()
    of_other = completed.model_copy(update={"task_id": other.task_id})
    await _apply(tasks, TaskCompleted.routing_key, of_other.model_dump_json().encode())
    await _withdrawal(tasks, other)
    assert await _readable(tasks, other)


async def test_a_stale_event_after_the_task_expired_does_not_bring_it_back_for_ever(
    tasks: AsyncCollection[Document],
) -> None:
    """A `task.started` redelivered after the finished task's document expired inserts a new
    one: it used to read `processing` for good, with no expiry."""
    command = _refused()
    long_ago = utcnow() - 2 * TTL
    started = TaskStarted(
        task_id=command.task_id,
        tenant_id=command.tenant_id,
        attempt=1,
        sequence=event_sequence(generation=0, attempt=1, phase=Phase.STARTED),
        submitted_at=long_ago,
        occurred_at=long_ago,
    )
    completed = TaskCompleted(
        task_id=command.task_id,
        tenant_id=command.tenant_id,
        attempt=1,
        sequence=event_sequence(generation=0, attempt=1, phase=Phase.TERMINAL),
        submitted_at=long_ago,
        occurred_at=long_ago,
        result=ScoreResult(score=7, comment="Fine.", model="m"),
    )
    for event in (started, completed):  # applied when they happened
        await _apply(tasks, event.routing_key, event.model_dump_json().encode(), now=long_ago)
    assert not await _readable(tasks, command)  # finished, past FINISHED_TASK_TTL_S
    await _ttl_monitor_pass(tasks)

    await _apply(tasks, started.routing_key, started.model_dump_json().encode())
    later = started.occurred_at + UNFINISHED_RETENTION + timedelta(seconds=1)
    back = await find_task(command.task_id, tenant_id=command.tenant_id, tasks=tasks, now=later)
    assert back is None


async def test_an_unfinished_task_of_an_earlier_build_expires_after_the_upgrade(
    tasks: AsyncCollection[Document],
) -> None:
    """Earlier builds wrote an unfinished task with `expires_at: null`, which the TTL monitor
    never removes: such a task (one a stale event brought back, say) read `processing` for
    ever after the upgrade that gave new documents their expiry."""
    now = utcnow()
    processing = {
        "tenant_id": "acme",
        "status": "processing",
        "sequence": 3,
        "generation": 0,
        "attempts": 1,
        "created_at": now,
        "updated_at": now,
    }
    await tasks.insert_many(
        [
            {"_id": "legacy", **processing, "expires_at": None},
            {"_id": "current", **processing, "expires_at": now + timedelta(hours=2)},
        ]
    )

    await ensure_indexes(tasks, now=now)
    await ensure_indexes(tasks, now=now + timedelta(days=1))  # each start: changes nothing more

    expiries = {doc["_id"]: doc["expires_at"] async for doc in tasks.find({})}
    wanted = {"legacy": now + UNFINISHED_RETENTION, "current": now + timedelta(hours=2)}
    for task_id, expiry in wanted.items():  # BSON dates keep milliseconds
        assert abs(expiries[task_id] - expiry) < timedelta(milliseconds=1), task_id
    later = now + UNFINISHED_RETENTION + timedelta(seconds=1)
    assert await find_task("legacy", tenant_id="acme", tasks=tasks, now=later) is None


async def test_a_withdrawal_is_dated_by_the_gateways_clock(
    task_broker: RabbitBroker, amqp_url: str
) -> None:
    # Its date plus `WITHDRAWN_RETENTION` is the tombstone's expiry, which the projection's
    # reads and MongoDB's TTL monitor judge by the database's clock, the gateway's too.
    gateways_clock = datetime(2030, 1, 1, tzinfo=UTC)
    command = ScoreText(task_id=new_id(), tenant_id="acme", text="Refused by the broker.")
    publisher = TaskPublisher(task_broker, clock=lambda: gateways_clock, timeout_s=BROKER_TIMEOUT_S)

    await publisher.withdraw([command])

    copies = await drain(amqp_url, STATUS_PROJECTION.name)
    withdrawals = [ScoreWithdrawn.model_validate_json(copy.body) for copy in copies]
    assert [(w.task_id, w.occurred_at) for w in withdrawals] == [(command.task_id, gateways_clock)]
