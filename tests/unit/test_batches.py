"""Batch validation, acceptance and progress with fakes (no broker, no database)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import aio_pika
import pytest
from aiormq.exceptions import DeliveryError
from pamqp.commands import Basic
from pydantic import ValidationError
from pymongo.errors import BulkWriteError

from services.gateway.api import in_progress_problem
from services.gateway.batches import (
    MAX_TEXT_CHARS_CONTEXT,
    BatchMember,
    BatchPolicy,
    BatchRecord,
    BatchSubmission,
    read_batch,
    submit_batch,
)
from services.gateway.batches_api import _field
from services.gateway.errors import (
    BrokerUnavailable,
    DatabaseUnavailable,
    ReplayUnfinished,
    RequestInProgress,
)
from services.gateway.publisher import TaskPublisher
from services.gateway.refusals import Refusals
from services.gateway.schemas import EXPIRED, ScoreSubmission, named_rubric
from services.gateway.submissions import BatchRow, _only_duplicate_ids
from shared.contracts import (
    MAX_BATCH_ITEMS,
    BatchItemProgress,
    BatchProgress,
    ScoreResult,
    ScoreText,
    TaskAccepted,
    TaskStatus,
    utcnow,
)

T0 = datetime(2030, 5, 17, 12, 0, 0, tzinfo=UTC)
POLICY = BatchPolicy(
    max_attempts=4, retention=timedelta(days=1), in_progress_for=timedelta(seconds=30)
)


def _batch(*texts: str, **extra: Any) -> BatchSubmission:
    return BatchSubmission.model_validate({"items": [{"text": t} for t in texts], **extra})


# --- Validation ----------------------------------------------------------------------------------


def test_items_take_the_batch_defaults_unless_they_have_their_own() -> None:
    batch = BatchSubmission.model_validate(
        {"rubric": "r", "model": "m", "items": [{"text": "a"}, {"text": "b", "rubric": "own"}]}
    )
    assert batch.items[1].rubric == "own"
    assert batch.items[0].rubric is None  # the default is applied when commands are made


def test_the_text_limit_comes_from_the_validation_context() -> None:
    payload = {"items": [{"text": "x" * 11}]}
    BatchSubmission.model_validate(payload)
    with pytest.raises(ValidationError) as error:
        BatchSubmission.model_validate(payload, context={MAX_TEXT_CHARS_CONTEXT: 10})
    assert error.value.errors()[0]["loc"] == ("items", 0, "text")


@pytest.mark.parametrize(
    "payload",
    [
        {"items": []},
        {"items": [{"text": "a"}] * (MAX_BATCH_ITEMS + 1)},
        {"items": [{"text": "  "}]},
        {"items": [{"text": "\x00\x80 \t"}]},  # nothing left to score once normalised
        {"items": [{"text": "a", "client_id": ""}]},
        {"items": [{"text": "a", "metadata": {"a.b": 1}}]},
        {"items": [{"text": "a", "delay_seconds": 5}]},
        {"items": [{"text": "a", "model": " \t"}]},
        {"items": [{"text": "a"}], "model": "  "},
    ],
)
def test_invalid_batches(payload: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        BatchSubmission.model_validate(payload)


def test_a_repeated_client_id_is_found_at_its_second_use() -> None:
    batch = BatchSubmission.model_validate(
        {
            "items": [
                {"text": "a", "client_id": "x"},
                {"text": "b"},
                {"text": "c"},
                {"text": "d", "client_id": "x"},
            ]
        }
    )
    assert batch.duplicate_client_id() == (3, "x")
    assert _batch("a", "b").duplicate_client_id() is None


@pytest.mark.parametrize(
    ("location", "field"),
    [
        (("items", 3, "text"), "items[3].text"),
        (("items",), "items"),
        (("items", 0, "metadata", "a"), "items[0].metadata.a"),
        ((), "body"),
    ],
)
def test_error_fields_name_the_item_index(location: tuple[Any, ...], field: str) -> None:
    assert _field(location) == field


def test_a_replay_the_database_failed_is_told_to_retry_with_the_same_key() -> None:
    """Its batch is kept (its first request's, perhaps answered 202): not a 503, which says
    nothing was kept, and a client retrying without the key would have it scored twice."""
    texts = {"unfinished": "kept; retry with the same key", "pending": "being accepted"}
    problem = in_progress_problem(ReplayUnfinished("key-1"), **texts)
    assert (problem.status, problem.kind, problem.detail) == (
        409,
        "request-in-progress",
        texts["unfinished"],
    )
    assert problem.headers == {"Retry-After": "5"}
    pending = in_progress_problem(RequestInProgress("key-1"), **texts)
    assert (pending.detail, pending.headers) == (texts["pending"], {"Retry-After": "1"})


# --- Publishing: one confirm round ---------------------------------------------------------------


def _nack() -> DeliveryError:
    """What aiormq raises for a negative confirm."""
    return DeliveryError(None, Basic.Nack(delivery_tag=1))


class ConcurrentBroker:
    """A broker whose publishes confirm only once `expected` of them are in flight together:
    publishing one after another would never get there."""

    def __init__(
        self,
        expected: int,
        fail_routing_key: str | None = None,
        failure: Callable[[], Exception] = _nack,
        failures: int = 1,
    ) -> None:
        self.expected = expected
        self.in_flight = 0
        self.published: list[tuple[str, bytes]] = []
        self.all_in_flight = asyncio.Event()
        self.fail = fail_routing_key
        self.failure = failure
        self.failures = failures

    async def declare_exchange(self, exchange: Any) -> ConcurrentBroker:
        return self  # publishes go to the exchange `shared.bus` gets from here

    async def publish(self, message: aio_pika.Message, *, routing_key: str, **_: Any) -> None:
        self.in_flight += 1
        if self.in_flight == self.expected:
            self.all_in_flight.set()
        await self.all_in_flight.wait()
        self.published.append((routing_key, message.body))
        if routing_key == self.fail and len(self.published) <= self.failures:
            raise self.failure()


def _commands(count: int) -> list[ScoreText]:
    return [
        ScoreText(task_id=f"t{i}", text=f"text {i}", batch_id="b1", batch_index=i)
        for i in range(count)
    ]


async def test_a_batch_is_published_with_all_confirms_in_flight_together() -> None:
    broker = ConcurrentBroker(expected=25)
    publisher = TaskPublisher(broker, clock=utcnow, timeout_s=5)  # type: ignore[arg-type]
    await publisher.send_many(_commands(25))
    assert len(broker.published) == 25
    assert {key for key, _ in broker.published} == {"score.requested"}


async def test_only_commands_that_wait_are_announced_and_all_in_one_round() -> None:
    """A command sent now reaches the projection itself; one sent down the wait ladder is
    announced by `task.accepted` (status `scheduled`)."""
    due = datetime.now(UTC) + timedelta(hours=1)
    waiting = [c.model_copy(update={"not_before": due}) for c in _commands(25)]
    broker = ConcurrentBroker(expected=25)
    await TaskPublisher(broker, clock=utcnow, timeout_s=5).send_many(waiting)  # type: ignore[arg-type]
    keys = [key for key, _ in broker.published]
    assert all(key.endswith(".score.requested") for key in keys[:25])  # down the ladder
    assert keys[25:] == ["task.accepted"] * 25
    assert all(b'"batch_index"' in body for _, body in broker.published[25:])


async def test_a_single_command_is_announced_only_when_it_waits() -> None:
    now_broker, later_broker = ConcurrentBroker(expected=1), ConcurrentBroker(expected=1)
    [command] = _commands(1)
    await TaskPublisher(now_broker, clock=utcnow, timeout_s=5).send(command)  # type: ignore[arg-type]
    assert [key for key, _ in now_broker.published] == ["score.requested"]

    due = datetime.now(UTC) + timedelta(minutes=5)
    waiting = command.model_copy(update={"not_before": due})
    await TaskPublisher(later_broker, clock=utcnow, timeout_s=5).send(waiting)  # type: ignore[arg-type]
    [(ladder_key, _), (announced_key, body)] = later_broker.published
    assert ladder_key.endswith(".score.requested")
    assert announced_key == "task.accepted"
    assert TaskAccepted.model_validate_json(body).not_before == due


async def test_a_batch_the_broker_took_none_of_is_refused_after_every_publish_ended() -> None:
    broker = ConcurrentBroker(expected=10, fail_routing_key="score.requested", failures=10)
    with pytest.raises(BrokerUnavailable):
        await TaskPublisher(broker, clock=utcnow, timeout_s=5).send_many(_commands(10))  # type: ignore[arg-type]
    assert len(broker.published) == 10  # none left running behind the 503


@pytest.mark.parametrize(
    "failure",
    [
        pytest.param(_nack, id="one refused (nack)"),
        pytest.param(lambda: ConnectionError("lost"), id="one unconfirmed (connection lost)"),
    ],
)
async def test_a_batch_partly_taken_is_reported_unconfirmed_not_refused(
    failure: Callable[[], Exception],
) -> None:
    """Some commands may be queued: refusing the batch would leave them to be scored for a
    batch the client was told was not kept. The caller keeps it for the outbox instead."""
    broker = ConcurrentBroker(expected=10, fail_routing_key="score.requested", failure=failure)
    confirmed = await TaskPublisher(broker, clock=utcnow, timeout_s=5).send_many(_commands(10))  # type: ignore[arg-type]
    assert confirmed is False
    assert len(broker.published) == 10


async def test_a_single_command_written_but_unconfirmed_is_reported_not_refused() -> None:
    broker = ConcurrentBroker(expected=1, fail_routing_key="score.requested", failure=TimeoutError)
    [command] = _commands(1)
    assert await TaskPublisher(broker, clock=utcnow, timeout_s=5).send(command) is False  # type: ignore[arg-type]
    refused = ConcurrentBroker(expected=1, fail_routing_key="score.requested")
    with pytest.raises(BrokerUnavailable):
        await TaskPublisher(refused, clock=utcnow, timeout_s=5).send(command)  # type: ignore[arg-type]


# --- Accepting -----------------------------------------------------------------------------------


class FakeBatches:
    def __init__(self, *, fail: set[str] | None = None) -> None:
        self.records: dict[str, BatchRecord] = {}
        self.accepted: list[str] = []
        self.fail = fail or set()  # the methods that answer DatabaseUnavailable

    async def insert(self, record: BatchRecord, **_: Any) -> None:
        if "insert" in self.fail:
            raise DatabaseUnavailable("no answer")
        self.records[record.batch_id] = record

    async def mark_accepted(self, batch_id: str) -> None:
        self.accepted.append(batch_id)

    async def mark_recorded(self, batch_id: str, **_: Any) -> str | None:
        if "mark_recorded" in self.fail:
            raise DatabaseUnavailable("no answer")
        record = self.records.get(batch_id)
        return None if record is None else record.state

    async def discard(self, batch_id: str) -> bool:
        if "discard" in self.fail:
            raise DatabaseUnavailable("no answer")
        return self.records.pop(batch_id, None) is not None

    async def find(self, batch_id: str, *, tenant_id: str) -> BatchRecord | None:
        record = self.records.get(batch_id)
        return record if record is not None and record.tenant_id == tenant_id else None


class FakeSubmissions:
    def __init__(self, *, fail: set[str] | None = None) -> None:
        self.commands: list[ScoreText] = []
        self.accepted: list[str] = []
        self.fail = fail or set()

    async def insert_batch(self, commands: list[BatchRow], **_: Any) -> None:
        if "insert_batch" in self.fail:
            raise DatabaseUnavailable("no answer")
        self.commands.extend(command for command, _, _, _ in commands)

    async def mark_batch_accepted(self, batch_id: str, task_ids: list[str]) -> None:
        self.accepted.extend(task_ids)

    async def discard_batch(self, batch_id: str) -> None:
        if "discard_batch" in self.fail:
            raise DatabaseUnavailable("no answer")
        self.commands = [c for c in self.commands if c.batch_id != batch_id]


class FakePublisher:
    def __init__(self, *, fail: bool = False) -> None:
        self.fail = fail
        self.sent: list[ScoreText] = []
        self.withdrawn: list[ScoreText] = []

    async def send_many(self, commands: Sequence[ScoreText]) -> bool:
        if self.fail:
            raise BrokerUnavailable("down")
        self.sent.extend(commands)
        return True

    async def withdraw(self, commands: Sequence[ScoreText]) -> None:
        self.withdrawn.extend(commands)


async def _submit(
    batch: BatchSubmission,
    batches: FakeBatches,
    submissions: FakeSubmissions,
    publisher: Any,
    refusals: Refusals | None = None,
) -> Any:
    return await submit_batch(
        batch,
        tenant_id="a",
        api_key_id="k1",
        idempotency_key=None,
        batches=batches,  # type: ignore[arg-type]
        submissions=submissions,  # type: ignore[arg-type]
        publisher=publisher,
        policy=POLICY,
        clock=lambda: T0,
        refusals=refusals or Refusals(),
    )


async def test_an_accepted_batch_is_recorded_published_and_marked_in_order() -> None:
    batches, submissions, publisher = FakeBatches(), FakeSubmissions(), FakePublisher()
    batch = BatchSubmission.model_validate(
        {
            "rubric": "r",
            "items": [{"text": "a", "client_id": "x"}, {"text": "b", "rubric": "own"}],
        }
    )
    submitted = await _submit(batch, batches, submissions, publisher)
    record = submitted.record
    assert submitted.created
    assert [m.client_id for m in record.members] == ["x", None]
    sent = publisher.sent
    assert [c.task_id for c in sent] == [m.task_id for m in record.members]
    assert [(c.batch_id, c.batch_index) for c in sent] == [
        (record.batch_id, 0),
        (record.batch_id, 1),
    ]
    assert [c.rubric for c in sent] == ["r", "own"]
    assert {c.api_key_id for c in sent} == {"k1"}
    assert submissions.accepted == [c.task_id for c in sent]
    assert batches.accepted == [record.batch_id]


async def test_a_broker_failure_keeps_nothing() -> None:
    batches, submissions, refusals = FakeBatches(), FakeSubmissions(), Refusals()
    with pytest.raises(BrokerUnavailable):
        await _submit(_batch("a", "b"), batches, submissions, FakePublisher(fail=True), refusals)
    assert batches.records == {}
    assert submissions.commands == []
    assert refusals.pending() == []


@pytest.mark.parametrize(
    ("failing", "error", "whole"),
    [
        pytest.param({"discard_batch"}, BrokerUnavailable, True, id="records not removed"),
        pytest.param({"discard"}, BrokerUnavailable, True, id="batch record not removed"),
        pytest.param({"insert_batch"}, DatabaseUnavailable, True, id="submissions' insert"),
        pytest.param({"insert"}, DatabaseUnavailable, False, id="batch record's insert"),
    ],
)
async def test_records_a_refused_batch_may_leave_are_noted_for_writing_off(
    failing: set[str], error: type[Exception], whole: bool
) -> None:
    batches, submissions = FakeBatches(fail=failing), FakeSubmissions(fail=failing)
    refusals = Refusals()
    with pytest.raises(error):
        await _submit(_batch("a", "b"), batches, submissions, FakePublisher(fail=True), refusals)
    [refusal] = refusals.pending()
    assert refusal.batch_id is not None
    assert not refusal.counted
    assert len(refusal.task_ids) == (2 if whole else 0)
    assert all(refusals.holds(task_id) for task_id in refusal.task_ids)


# --- Reading -------------------------------------------------------------------------------------


class FakeStatus:
    def __init__(self, progress: BatchProgress) -> None:
        self.progress = progress
        self.calls: list[tuple[int, int]] = []

    async def batch(
        self, batch_id: str, *, tenant_id: str, after: int, limit: int
    ) -> BatchProgress:
        self.calls.append((after, limit))
        items = [i for i in self.progress.items if i.batch_index > after][:limit]
        return self.progress.model_copy(update={"items": items})


def _record(count: int, created_at: datetime = T0) -> BatchRecord:
    return BatchRecord(
        batch_id="b1",
        tenant_id="a",
        state="accepted",
        request_hash="h",
        created_at=created_at,
        members=tuple(BatchMember(f"t{i}", f"c{i}") for i in range(count)),
    )


def _progress(*known: tuple[int, TaskStatus]) -> BatchProgress:
    counts: dict[TaskStatus, int] = {}
    for _, status in known:
        counts[status] = counts.get(status, 0) + 1
    return BatchProgress(
        batch_id="b1",
        counts=counts,
        items=[
            BatchItemProgress(
                task_id=f"t{index}",
                batch_index=index,
                status=status,
                updated_at=T0,
                result=ScoreResult(score=5, comment="c", model="m")
                if status is TaskStatus.COMPLETED
                else None,
            )
            for index, status in known
        ],
    )


class FakeUnsent:
    """The batch's submissions not sent yet (`Submissions.unsent_in_batch`)."""

    def __init__(self, *task_ids: str) -> None:
        self.task_ids = frozenset(task_ids)
        self.lookups = 0

    async def unsent_in_batch(self, batch_id: str, *, sent_since: datetime) -> frozenset[str]:
        self.lookups += 1
        return self.task_ids


async def _read(
    record: BatchRecord,
    progress: BatchProgress,
    *,
    start: int,
    limit: int,
    now: datetime,
    unsent: FakeUnsent | None = None,
) -> Any:
    batches = FakeBatches()
    batches.records["b1"] = record
    return await read_batch(
        "b1",
        tenant_id="a",
        start=start,
        limit=limit,
        batches=batches,  # type: ignore[arg-type]
        status=FakeStatus(progress),
        submissions=unsent or FakeUnsent(),
        clock=lambda: now,
        window=timedelta(minutes=5),
        grace=timedelta(seconds=30),
    )


async def test_items_the_status_service_has_not_heard_of_read_as_queued_while_young() -> None:
    progress = _progress((0, TaskStatus.COMPLETED), (2, TaskStatus.PROCESSING))
    page = await _read(_record(5), progress, start=0, limit=3, now=T0 + timedelta(seconds=1))
    assert [(i.index, i.client_id, i.status) for i in page.items] == [
        (0, "c0", "completed"),
        (1, "c1", "queued"),
        (2, "c2", "processing"),
    ]
    assert page.items[0].result is not None
    assert page.counts["completed"] == 1
    assert page.counts["processing"] == 1
    assert page.counts["queued"] == 3
    assert page.counts[EXPIRED] == 0
    assert sum(page.counts.values()) == page.total == 5
    assert page.next_cursor == 3

    last = await _read(_record(5), progress, start=3, limit=3, now=T0 + timedelta(seconds=1))
    assert [i.index for i in last.items] == [3, 4]
    assert last.next_cursor is None


async def test_unknown_items_of_an_old_batch_read_as_expired() -> None:
    progress = _progress((1, TaskStatus.COMPLETED))
    page = await _read(_record(3), progress, start=0, limit=10, now=T0 + timedelta(hours=2))
    assert [i.status for i in page.items] == [EXPIRED, "completed", EXPIRED]
    assert page.counts[EXPIRED] == 2
    assert page.counts["queued"] == 0


async def test_unknown_items_of_an_old_batch_not_sent_yet_read_as_queued() -> None:
    """Items whose submissions are still `accepting` or `unconfirmed` (a broker alarm, a
    crashed gateway) have not reached the status service however old the batch: they read
    `expired` once it was five minutes old, and a client resubmitting them had them scored
    twice when the outbox sweep sent the originals."""
    progress = _progress((1, TaskStatus.COMPLETED))
    unsent = FakeUnsent("t0", "t3")
    page = await _read(
        _record(4), progress, start=0, limit=3, now=T0 + timedelta(hours=2), unsent=unsent
    )
    assert [i.status for i in page.items] == ["queued", "completed", EXPIRED]
    assert (page.counts["queued"], page.counts[EXPIRED]) == (2, 1)  # t3 too, past the page
    assert unsent.lookups == 1


@pytest.mark.parametrize(
    ("minutes", "unheard_as"), [(6, "queued"), (11, EXPIRED)], ids=["held", "past the hold"]
)
async def test_the_items_of_a_batch_held_for_a_replay_read_as_queued(
    minutes: int, unheard_as: str
) -> None:
    """Its request died after recording one of its three items: the two never recorded read
    `expired`, as if scored, from the read-your-writes window's end (5 min) until the batch
    was refused (10 min; a review)."""
    held = dataclasses.replace(_record(3), state="accepting", recorded=False)
    progress = _progress((0, TaskStatus.QUEUED))
    page = await _read(held, progress, start=0, limit=3, now=T0 + timedelta(minutes=minutes))
    assert [i.status for i in page.items] == ["queued", unheard_as, unheard_as]
    assert page.counts[EXPIRED] == (2 if unheard_as == EXPIRED else 0)


async def test_a_young_or_wholly_heard_batch_reads_no_submission() -> None:
    unsent = FakeUnsent("t0")
    young = await _read(
        _record(2), _progress(), start=0, limit=2, now=T0 + timedelta(seconds=1), unsent=unsent
    )
    assert [i.status for i in young.items] == ["queued", "queued"]
    heard = _progress((0, TaskStatus.COMPLETED), (1, TaskStatus.PROCESSING))
    old = await _read(
        _record(2), heard, start=0, limit=2, now=T0 + timedelta(hours=2), unsent=unsent
    )
    assert [i.status for i in old.items] == ["completed", "processing"]
    assert unsent.lookups == 0


async def test_another_tenants_batch_reads_as_none() -> None:
    batches = FakeBatches()
    batches.records["b1"] = _record(1)
    page = await read_batch(
        "b1",
        tenant_id="someone-else",
        start=0,
        limit=10,
        batches=batches,  # type: ignore[arg-type]
        status=FakeStatus(_progress()),
        submissions=FakeUnsent(),
        clock=lambda: T0,
        window=timedelta(minutes=5),
        grace=timedelta(seconds=30),
    )
    assert page is None


# --- Recording a batch's submissions -------------------------------------------------------------


@pytest.mark.parametrize(
    ("details", "already_there"),
    [
        ({"writeErrors": [{"code": 11000}, {"code": 11000}]}, True),
        ({"writeErrors": [{"code": 11000}, {"code": 121}]}, False),  # a validation failure
        ({"writeErrors": [{"code": 11000}], "writeConcernErrors": [{"code": 64}]}, False),
    ],
)
def test_only_documents_already_there_let_a_batch_insert_pass(
    details: dict[str, Any], already_there: bool
) -> None:
    assert _only_duplicate_ids(BulkWriteError(details)) is already_there


@pytest.mark.parametrize("model", ["", " ", "\t\n", "\u0000", "gpt\u00004o", "gpt-4o\x7f"])
def test_a_blank_model_name_is_refused(model: str) -> None:
    """It was accepted (202) and sent to the provider as it stood: a model no provider has;
    so was one holding a control character (found in review)."""
    with pytest.raises(ValidationError) as error:
        ScoreSubmission.model_validate({"text": "a", "model": model})
    assert error.value.errors()[0]["loc"] == ("model",)


def test_a_model_name_is_taken_without_surrounding_blanks() -> None:
    """As the provider names it: the result cache and the idempotency key see one name."""
    assert ScoreSubmission.model_validate({"text": "a", "model": " gpt-4o "}).model == "gpt-4o"
    payload = {"items": [{"text": "a", "model": " m "}], "model": " d"}
    batch = BatchSubmission.model_validate(payload)
    assert (batch.items[0].model, batch.model) == ("m", "d")


def test_a_blank_rubric_names_none_but_the_request_keeps_it_as_sent() -> None:
    """The command names none (a task showed `"   "` for a rubric its scorer read as none);
    the request keeps it as sent, for its hash, which a replay of its key must match."""
    single = ScoreSubmission.model_validate({"text": "hi", "rubric": "   "})
    batch = BatchSubmission.model_validate(
        {"rubric": "\n", "items": [{"text": "a", "rubric": " "}, {"text": "b", "rubric": "r"}]}
    )
    assert (single.rubric, batch.rubric, batch.items[0].rubric) == ("   ", "\n", " ")
    named = [named_rubric(each) for each in ("   ", "\n", "\u200b\ufe0f", None, " r ")]
    assert named == [None, None, None, None, " r "]
