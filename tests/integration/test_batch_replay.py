"""A batch whose request stopped part-way (its process died) is completed by a replay of the
request: every item ends up recorded and sent once, none is lost. On the real database."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from devtools.infra import Endpoint
from services.gateway.batches import (
    Batches,
    BatchPolicy,
    BatchState,
    BatchSubmission,
    BatchSubmitted,
    submit_batch,
)
from services.gateway.errors import BrokerUnavailable, DatabaseUnavailable, RequestInProgress
from services.gateway.limits import InFlight
from services.gateway.refusals import Refusal, Refusals, write_off
from services.gateway.submissions import BATCH_WRITE_CHUNK, Submissions, SubmissionState
from services.gateway.submit import sweep_outbox
from shared.contracts import ScoreText
from tests.integration.gateway_records import GatewayRecords as Gateway
from tests.integration.gateway_records import Recorded, gateway_records

Document = dict[str, Any]
T0 = datetime(2030, 5, 17, 12, 0, tzinfo=UTC)
GRACE = timedelta(seconds=30)
POLICY = BatchPolicy(max_attempts=4, retention=timedelta(days=1), in_progress_for=GRACE)
TENANT = "tenant-a"
KEY = "batch-key-1"


class ProcessDied(BaseException):
    """Stands for the gateway process ending where it is raised: nothing after it runs."""


class Dying(Recorded):
    """A publisher whose process ends at the batch's publish."""

    async def send_many(self, commands: Sequence[ScoreText]) -> bool:
        raise ProcessDied


@pytest.fixture
async def gateway(mongo: Endpoint, db_prefix: str) -> AsyncIterator[Gateway]:
    async with gateway_records(mongo.url, db_prefix) as records:
        yield records


def _request(count: int) -> BatchSubmission:
    return BatchSubmission.model_validate(
        {"rubric": "clarity", "items": [{"text": f"Essay number {i}."} for i in range(count)]}
    )


async def _submit(
    gateway: Gateway,
    request: BatchSubmission,
    broker: Recorded,
    at: datetime,
    submissions: Submissions | None = None,
    *,
    batches: Batches | None = None,
    refusals: Refusals | None = None,
) -> BatchSubmitted:
    return await submit_batch(
        request,
        tenant_id=TENANT,
        api_key_id=None,
        idempotency_key=KEY,
        batches=batches or gateway.batches,
        submissions=submissions or gateway.submissions,
        publisher=broker,
        policy=POLICY,
        clock=lambda: at,
        refusals=refusals or Refusals(),
    )


async def _interrupted(gateway: Gateway, request: BatchSubmission, recorded: int) -> str:
    """The records of a request whose process died after recording the batch and only its
    first `recorded` submissions; returns the batch's id."""
    with pytest.raises(ProcessDied):
        await _submit(gateway, request, Dying(), T0)
    batch = await gateway.raw["batches"].find_one({"idempotency_key": KEY})
    await gateway.raw["submissions"].delete_many(
        {"batch_id": batch["_id"], "command.batch_index": {"$gte": recorded}}
    )
    return str(batch["_id"])


async def _stored(gateway: Gateway, batch_id: str) -> dict[int, Document]:
    cursor = gateway.raw["submissions"].find({"batch_id": batch_id})
    return {document["command"]["batch_index"]: document async for document in cursor}


async def test_a_replay_records_what_the_interrupted_batch_had_not_and_all_is_sent_once(
    gateway: Gateway,
) -> None:
    count = BATCH_WRITE_CHUNK + 50  # it died between two chunks of its submissions
    request = _request(count)
    batch_id = await _interrupted(gateway, request, recorded=BATCH_WRITE_CHUNK)
    swept_before = Recorded()  # a sweep during the grace period already sent one of them
    first = (await _stored(gateway, batch_id))[0]
    await gateway.submissions.mark_accepted(first["_id"])
    swept_before.sent.append(first["_id"])

    replay = await _submit(gateway, request, Recorded(), T0 + GRACE + timedelta(seconds=1))

    assert not replay.created
    assert replay.record.batch_id == batch_id
    stored = await _stored(gateway, batch_id)
    members = [member.task_id for member in replay.record.members]
    assert sorted(stored) == list(range(count))
    assert [stored[index]["_id"] for index in range(count)] == members
    assert stored[0]["state"] == SubmissionState.ACCEPTED  # what was there is left as it is
    for index in range(1, count):
        command = ScoreText.model_validate(stored[index]["command"])
        assert stored[index]["state"] == SubmissionState.ACCEPTING
        assert stored[index]["created_at"] == T0
        assert (command.text, command.rubric, command.batch_index) == (
            f"Essay number {index}.",
            "clarity",
            index,
        )
    batch = await gateway.raw["batches"].find_one({"_id": batch_id})
    assert batch["state"] == BatchState.ACCEPTED

    sweep = Recorded()
    while await sweep_outbox(
        submissions=gateway.submissions,
        publisher=sweep,
        clock=lambda: T0 + GRACE + timedelta(seconds=2),
        grace=GRACE,
        refusals=Refusals(),
    ):
        pass
    assert sorted(swept_before.sent + sweep.sent) == sorted(members)  # each sent exactly once


async def test_a_second_replay_changes_nothing(gateway: Gateway) -> None:
    request = _request(3)
    batch_id = await _interrupted(gateway, request, recorded=1)
    later = T0 + GRACE + timedelta(seconds=1)
    await _submit(gateway, request, Recorded(), later)
    before = await _stored(gateway, batch_id)

    again = await _submit(gateway, request, Recorded(), later + timedelta(seconds=5))

    assert again.record.batch_id == batch_id
    assert not again.created
    assert await _stored(gateway, batch_id) == before


async def test_a_replay_within_the_grace_period_is_told_to_wait_and_records_nothing(
    gateway: Gateway,
) -> None:
    request = _request(3)
    batch_id = await _interrupted(gateway, request, recorded=1)

    with pytest.raises(RequestInProgress):
        await _submit(gateway, request, Recorded(), T0 + GRACE - timedelta(seconds=1))

    assert sorted(await _stored(gateway, batch_id)) == [0]
    batch = await gateway.raw["batches"].find_one({"_id": batch_id})
    assert batch["state"] == BatchState.ACCEPTING


async def _sent_by_sweeps(gateway: Gateway, refusals: Refusals) -> list[str]:
    sweep = Recorded()
    while await sweep_outbox(
        submissions=gateway.submissions,
        publisher=sweep,
        clock=lambda: T0 + GRACE + timedelta(seconds=2),
        grace=GRACE,
        refusals=refusals,
    ):
        pass
    return sweep.sent


async def _refused(gateway: Gateway, request: BatchSubmission) -> tuple[str, Refusals]:
    """A batch refused part-way (503) whose write-off has not run yet (the database was away
    for longer than the grace period): its records and its pending refusal."""
    batch_id = await _interrupted(gateway, request, recorded=1)
    batch = await gateway.raw["batches"].find_one({"_id": batch_id})
    refusals = Refusals()
    task_ids = tuple(member["task_id"] for member in batch["members"])
    refusals.note(Refusal(TENANT, task_ids, batch_id=batch_id))
    return batch_id, refusals


async def _write_off(gateway: Gateway, refusals: Refusals) -> None:
    await write_off(
        refusals,
        submissions=gateway.submissions,
        batches=gateway.batches,
        in_flight=None,
        now=T0 + GRACE + timedelta(seconds=2),
    )


async def test_a_refused_batch_a_replay_accepted_before_its_write_off_is_sent(
    gateway: Gateway,
) -> None:
    """The replay answered 200: its items must be scored, not turned into tombstones by the
    write-off that comes after it."""
    request = _request(3)
    batch_id, refusals = await _refused(gateway, request)
    replay = await _submit(gateway, request, Recorded(), T0 + GRACE + timedelta(seconds=1))

    await _write_off(gateway, refusals)

    members = sorted(member.task_id for member in replay.record.members)
    assert sorted(await _sent_by_sweeps(gateway, refusals)) == members
    batch = await gateway.raw["batches"].find_one({"_id": batch_id})
    assert batch["state"] == BatchState.ACCEPTED


class WrittenOffMeanwhile(Submissions):
    """The replay's records land as the batch's write-off runs (on another replica, say)."""

    def __init__(self, gateway: Gateway, refusals: Refusals) -> None:
        super().__init__(gateway.raw.client, gateway.name)
        self._meanwhile = (gateway, refusals)

    async def insert_batch(
        self,
        commands: list[tuple[ScoreText, str, str]],
        *,
        retention: timedelta,
        counted: bool = False,
    ) -> None:
        await super().insert_batch(commands, retention=retention, counted=counted)
        await _write_off(*self._meanwhile)


async def test_a_replay_of_a_batch_written_off_meanwhile_is_refused(gateway: Gateway) -> None:
    request = _request(3)
    batch_id, refusals = await _refused(gateway, request)

    with pytest.raises(DatabaseUnavailable):
        await _submit(
            gateway,
            request,
            Recorded(),
            T0 + GRACE + timedelta(seconds=1),
            submissions=WrittenOffMeanwhile(gateway, refusals),
        )

    assert await _sent_by_sweeps(gateway, refusals) == []
    batch = await gateway.raw["batches"].find_one({"_id": batch_id})
    assert batch["state"] == BatchState.ABANDONED


async def test_a_replay_of_a_batch_whose_insert_timed_out_and_was_written_off_keeps_nothing(
    gateway: Gateway,
) -> None:
    """The refusal of a batch whose insert timed out names no submissions (none were
    written). A replay after the grace period recorded them all, found the batch written
    off, and answered 503, leaving them to the outbox sweep, which sent every one."""
    request = _request(3)
    batch_id = await _interrupted(gateway, request, recorded=0)
    refusals = Refusals()
    refusals.note(Refusal(TENANT, (), batch_id=batch_id))

    with pytest.raises(DatabaseUnavailable):
        await _submit(
            gateway,
            request,
            Recorded(),
            T0 + GRACE + timedelta(seconds=1),
            submissions=WrittenOffMeanwhile(gateway, refusals),
        )

    assert await _sent_by_sweeps(gateway, refusals) == []


class AcceptanceLost(Batches):
    """Marking a batch accepted fails (the database away)."""

    async def mark_accepted(self, batch_id: str) -> bool:
        raise DatabaseUnavailable("timed out")


async def test_a_replay_that_cannot_mark_its_batch_accepted_keeps_nothing(
    gateway: Gateway,
) -> None:
    """Answered 503: the submissions it recorded were left `accepting`, and the sweep sent
    them. Now they are written off with the batch once the database is back."""
    request = _request(3)
    batch_id = await _interrupted(gateway, request, recorded=1)
    refusals = Refusals()

    with pytest.raises(DatabaseUnavailable):
        await _submit(
            gateway,
            request,
            Recorded(),
            T0 + GRACE + timedelta(seconds=1),
            batches=AcceptanceLost(gateway.raw.client, gateway.name),
            refusals=refusals,
        )
    await _write_off(gateway, refusals)

    assert await _sent_by_sweeps(gateway, refusals) == []
    batch = await gateway.raw["batches"].find_one({"_id": batch_id})
    assert batch["state"] == BatchState.ABANDONED


class RefusingBatches(Recorded):
    """A broker that takes none of a batch's commands."""

    async def send_many(self, commands: Sequence[ScoreText]) -> bool:
        raise BrokerUnavailable("refused")

    async def withdraw(self, commands: Sequence[ScoreText]) -> None:
        return None


async def _refused_by_the_broker(gateway: Gateway, refusals: Refusals, in_flight: InFlight) -> None:
    """A batch of 3, counted in flight, whose commands the broker refuses (503)."""
    with pytest.raises(BrokerUnavailable):
        await submit_batch(
            _request(3),
            tenant_id=TENANT,
            api_key_id=None,
            idempotency_key=None,
            batches=gateway.batches,
            submissions=gateway.submissions,
            publisher=RefusingBatches(),
            policy=POLICY,
            clock=lambda: T0,
            refusals=refusals,
            in_flight=in_flight,
        )


class SecondReleaseFails(InFlight):
    """Counts the releases of each task; the second release made fails, once."""

    def __init__(self, gateway: Gateway) -> None:
        super().__init__(gateway.raw.client, gateway.name, max_per_tenant=100)
        self.released: list[str] = []
        self._to_fail = 2

    async def release(self, tenant_id: str, task_id: str) -> None:
        self._to_fail -= 1
        if self._to_fail == 0:
            raise DatabaseUnavailable("timed out")
        await super().release(tenant_id, task_id)
        self.released.append(task_id)


async def test_a_refused_batch_whose_slots_were_partly_released_releases_the_rest_once(
    gateway: Gateway,
) -> None:
    """The write-off used to release every slot of the batch again, the ones released
    before the failure too (more than the counter remembers for a large batch)."""
    in_flight = SecondReleaseFails(gateway)
    refusals = Refusals()
    await _refused_by_the_broker(gateway, refusals, in_flight)
    [refusal] = refusals.pending()

    await write_off(
        refusals,
        submissions=gateway.submissions,
        batches=gateway.batches,
        in_flight=in_flight,
        now=T0,
    )

    assert sorted(in_flight.released) == sorted(refusal.task_ids)  # each task once
    assert await in_flight.count(TENANT) == 0
    assert refusals.pending() == []


class SweepDuringRelease(InFlight):
    """The outbox sweep runs while a refused batch's slots are being released, one by one
    (1,000 of them took longer than the outbox grace period)."""

    def __init__(self, gateway: Gateway, refusals: Refusals) -> None:
        super().__init__(gateway.raw.client, gateway.name, max_per_tenant=100)
        self._meanwhile = (gateway, refusals)
        self.swept: list[str] | None = None

    async def release(self, tenant_id: str, task_id: str) -> None:
        if self.swept is None:
            self.swept = await _sent_by_sweeps(*self._meanwhile)
        await super().release(tenant_id, task_id)


async def test_a_refused_batch_is_not_sent_by_a_sweep_while_its_slots_are_released(
    gateway: Gateway,
) -> None:
    refusals = Refusals()
    in_flight = SweepDuringRelease(gateway, refusals)
    await _refused_by_the_broker(gateway, refusals, in_flight)

    assert in_flight.swept == []
    assert await _sent_by_sweeps(gateway, refusals) == []
    assert await in_flight.count(TENANT) == 0


class AbandonFailsOnce(WrittenOffMeanwhile):
    """The replay's records land as the batch is written off, and forgetting them fails."""

    failures = 1

    async def abandon(self, task_ids: tuple[str, ...], *, now: datetime) -> None:
        if self.failures:
            self.failures -= 1
            raise DatabaseUnavailable("timed out")
        await super().abandon(task_ids, now=now)


async def test_a_replay_that_cannot_forget_its_records_leaves_them_to_the_write_off(
    gateway: Gateway,
) -> None:
    request = _request(3)
    batch_id = await _interrupted(gateway, request, recorded=0)
    meanwhile = Refusals()
    meanwhile.note(Refusal(TENANT, (), batch_id=batch_id))
    refusals = Refusals()

    with pytest.raises(DatabaseUnavailable):
        await _submit(
            gateway,
            request,
            Recorded(),
            T0 + GRACE + timedelta(seconds=1),
            submissions=AbandonFailsOnce(gateway, meanwhile),
            refusals=refusals,
        )
    assert await _sent_by_sweeps(gateway, refusals) == []  # held here until written off
    await _write_off(gateway, refusals)

    assert await _sent_by_sweeps(gateway, refusals) == []
