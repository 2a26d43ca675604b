"""The usage meter (and the cron runner) wait out only a database that is away: a write
the database refuses for good (a document too large, a failed validation) counts as a failed
attempt and reaches the DLQ at `USAGE_METER_MAX_ATTEMPTS`. Waited out like an outage, it held
its delivery for ever. And which PyMongo errors are transient (`shared.database_errors`)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest
from pymongo.errors import (
    AutoReconnect,
    BulkWriteError,
    CursorNotFound,
    DocumentTooLarge,
    DuplicateKeyError,
    ExecutionTimeout,
    InvalidOperation,
    NetworkTimeout,
    NotPrimaryError,
    OperationFailure,
    PyMongoError,
    ServerSelectionTimeoutError,
    WriteConcernError,
    WriteError,
    WTimeoutError,
)

from services.scheduler.catalogue import Catalogue
from services.scheduler.consumer import CronJobRunner, UsageMeter
from services.scheduler.firings import Firing, Held, Hold
from services.scheduler.jobs import JobOutcome, JobRun
from services.scheduler.messaging import SchedulerBus
from services.scheduler.runs import RetryPolicy
from services.scheduler.usage_store import UsageRecord, UsageRecords
from shared.contracts import RunCronJob, ScoreResult, TaskCompleted, Usage
from shared.database_errors import transient_database_error
from shared.group_writes import WriteOutcomeUnknown
from shared.topology import ATTEMPTS_HEADER
from tests.support import HandedDelivery
from tests.unit.test_scheduler_dispatch import FakeFirings

NOW = datetime(2030, 1, 10, 10, 31, 30, tzinfo=UTC)
# Bounds a handler that never returns (the bug): it fails the test rather than hanging it.
HANDLER_DEADLINE_S = 10.0


class RefusingRecords:
    """Usage records whose every write fails with `error`."""

    def __init__(self, error: PyMongoError) -> None:
        self.error = error
        self.writes = 0

    async def record(self, record: UsageRecord) -> None:
        self.writes += 1
        raise self.error


class NoCatalogue:
    async def record(self, task: object) -> bool:
        return True


class RetriesSent:
    def __init__(self) -> None:
        self.headers: list[dict[str, Any]] = []

    async def retry_usage_event(
        self, event: object, *, not_before: datetime, headers: dict[str, Any]
    ) -> None:
        self.headers.append(headers)


def _meter(records: RefusingRecords, bus: RetriesSent) -> UsageMeter:
    return UsageMeter(
        records=cast(UsageRecords, records),
        catalogue=cast(Catalogue, NoCatalogue()),
        prices={},
        bus=cast(SchedulerBus, bus),
        clock=lambda: NOW,
        max_attempts=5,
        retry_after=timedelta(seconds=5),
    )


def _completion() -> HandedDelivery:
    event = TaskCompleted(
        task_id="t-1",
        tenant_id="acme",
        sequence=1,
        attempt=1,
        submitted_at=NOW,
        occurred_at=NOW,
        result=ScoreResult(score=5, comment="ok", model="m", usage=Usage(prompt_tokens=3)),
    )
    return HandedDelivery(
        event.model_dump_json().encode(),
        routing_key=TaskCompleted.routing_key,
        headers={ATTEMPTS_HEADER: 2},
    )


@pytest.mark.parametrize(
    "refusal",
    [
        WriteError("Document failed validation", 121, {"code": 121}),
        WriteError("BSONObj size: 17000000 is invalid", 10334, {"code": 10334}),
    ],
    ids=["validation", "too-large"],
)
async def test_a_write_refused_for_good_is_a_failed_attempt(refusal: PyMongoError) -> None:
    records, bus = RefusingRecords(refusal), RetriesSent()

    async with asyncio.timeout(HANDLER_DEADLINE_S):
        await _meter(records, bus).on_message(_completion())

    assert records.writes == 1
    assert [headers[ATTEMPTS_HEADER] for headers in bus.headers] == [3]


TRANSIENT: list[PyMongoError] = [
    AutoReconnect("connection reset"),
    NetworkTimeout("timed out"),
    NotPrimaryError("not primary"),
    ServerSelectionTimeoutError("no servers"),
    ExecutionTimeout("operation exceeded time limit", 50),
    WTimeoutError("waiting for replication timed out", 64, {"code": 64}),
    CursorNotFound("cursor id not found", 43),
    OperationFailure("interrupted due to repl state change", 11602),
    WriteError("not primary", 10107, {"code": 10107}),
    WriteConcernError("labelled", 100, {"code": 100, "errorLabels": ["RetryableWriteError"]}),
    WriteOutcomeUnknown("sent with a write that failed"),
]
PERMANENT: list[PyMongoError] = [
    WriteError("Document failed validation", 121, {"code": 121}),
    DuplicateKeyError("E11000", 11000, {"code": 11000}),
    OperationFailure("unauthorized", 13),
    BulkWriteError({"writeErrors": [{"code": 121}], "writeConcernErrors": []}),
    InvalidOperation("cannot use the client after close"),
]


@pytest.mark.parametrize("error", TRANSIENT, ids=lambda error: type(error).__name__)
def test_a_database_that_is_away_is_transient(error: PyMongoError) -> None:
    assert transient_database_error(error)


@pytest.mark.parametrize("error", PERMANENT, ids=lambda error: type(error).__name__)
def test_a_write_refused_for_good_is_permanent(error: PyMongoError) -> None:
    assert not transient_database_error(error)


def test_an_unencodable_document_is_no_database_error() -> None:
    """pymongo raises a document over 16 MiB before sending it, as bson's `InvalidDocument`:
    never waited out, it always was an attempt."""
    assert not transient_database_error(DocumentTooLarge("too large"))


class FiringsRefusing(FakeFirings):
    """Firings whose record of a run's start fails with `error`."""

    def __init__(self, error: PyMongoError) -> None:
        super().__init__()
        self.error = error

    async def begin(
        self, run_id: str, *, attempt: int, now: datetime, hold: Hold | None = None
    ) -> Firing | Held | None:
        raise self.error


class RunsSent:
    def __init__(self) -> None:
        self.commands: list[RunCronJob] = []

    async def publish_run(self, command: RunCronJob, *, headers: Any = None) -> None:
        self.commands.append(command)


def _runner(firings: FakeFirings, bus: RunsSent) -> CronJobRunner:
    async def job(run: JobRun) -> JobOutcome:
        return JobOutcome()

    return CronJobRunner(
        handlers={"rollup": job},
        firings=firings,
        retry=RetryPolicy(3, timedelta(seconds=5), timedelta(minutes=10)),
        bus=cast(SchedulerBus, bus),
        clock=lambda: NOW,
        job_db_timeout_s=60.0,
    )


def _run_delivery() -> HandedDelivery:
    command = RunCronJob(task_id="run-1", job="rollup", scheduled_for=NOW, fired_at=NOW)
    return HandedDelivery(command.model_dump_json().encode(), routing_key="cron.run")


async def test_a_run_whose_record_the_database_refuses_for_good_is_not_resent_for_ever() -> None:
    """Re-sent uncounted like an outage, it came back every few seconds without end; returned
    as failed, its queue's delivery limit bounds it."""
    bus = RunsSent()
    runner = _runner(FiringsRefusing(WriteError("failed validation", 121, {"code": 121})), bus)
    with pytest.raises(WriteError):
        await runner.on_message(_run_delivery())
    assert bus.commands == []


async def test_a_run_whose_record_meets_an_outage_is_sent_again_uncounted() -> None:
    bus = RunsSent()
    await _runner(FiringsRefusing(AutoReconnect("gone")), bus).on_message(_run_delivery())
    assert [(command.run_id, command.attempt) for command in bus.commands] == [("run-1", 1)]
