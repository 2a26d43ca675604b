"""The status projection, the scorer and the gateway's outcome consumer wait out only a
database that is away: a write it refuses for good (a failed validation, a document over
16 MiB) is a failed delivery that their queue's delivery limit (or the scorer's crash limit)
bounds. Waited out like an outage, it held its delivery for ever (the projection, the
gateway), or until the claim's lease ended and then again without end, calling the model
each time (the scorer). The collections are real; a wrapper makes their bulk writes fail.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, cast, override

import pytest
from faststream.rabbit import RabbitBroker
from pymongo import AsyncMongoClient
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import AutoReconnect, BulkWriteError, PyMongoError, WriteError

from services.gateway.api import GatewayDeps
from services.gateway.consumers import subscribe_task_outcomes
from services.gateway.errors import DatabaseUnavailable, database_away
from services.gateway.submissions import Submissions
from services.scorer.attempts import Attempts
from services.scorer.consumer import CRASHES_HEADER, subscribe_scorer
from services.scorer.decisions import Decision
from services.status.app import subscribe_projection
from services.status.settings import StatusSettings
from shared.consumers import ScoreboxBroker
from shared.contracts import ScoreResult, ScoreText, TaskCompleted, TaskEvent, new_id, utcnow
from shared.group_writes import GroupWriter
from tests.integration import test_scorer_own_claims as own_claims
from tests.integration.test_scorer_own_claims import CarriedOut, Deps, _command
from tests.support import HandedDelivery, HandlerOnly

attempts = own_claims.attempts  # fixtures
make_deps = own_claims.make_deps

Json = dict[str, Any]
# Bounds a handler that never returns (the bug): it fails the test rather than hanging it.
HANDLER_DEADLINE_S = 20.0
RETURNED_AS_FAILED = ["reject(requeue=True)"]


def _validation_failure(index: int) -> Json:
    return {"index": index, "code": 121, "errmsg": "Document failed validation"}


class RefusingCollection:
    """A real collection whose bulk writes fail: every write of them refused for good (a
    failed validation), or, with `away_once`, the first round trip lost to an outage."""

    def __init__(self, collection: AsyncCollection[Json], *, away_once: bool = False) -> None:
        self._collection = collection
        self._away_once = away_once
        self.bulk_writes = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._collection, name)

    async def bulk_write(self, requests: list[Any], **options: Any) -> Any:
        self.bulk_writes += 1
        if self._away_once:
            if self.bulk_writes == 1:
                raise AutoReconnect("connection reset")
            return await self._collection.bulk_write(requests, **options)
        refused = [_validation_failure(index) for index in range(len(requests))]
        raise BulkWriteError({"writeErrors": refused, "writeConcernErrors": [], "nInserted": 0})


@pytest.fixture
async def database(mongo: Any, db_prefix: str) -> AsyncIterator[Any]:
    client: AsyncMongoClient[Json] = AsyncMongoClient(mongo.url, tz_aware=True)
    yield client[f"{db_prefix}_refusals"]
    await client.close()


def _completion(task_id: str, tenant_id: str = "acme") -> HandedDelivery:
    now = utcnow()
    event = TaskCompleted(
        task_id=task_id,
        tenant_id=tenant_id,
        sequence=1,
        submitted_at=now,
        occurred_at=now,
        result=ScoreResult(score=5, comment="ok", model="m"),
    )
    return HandedDelivery(event.model_dump_json().encode(), routing_key=TaskCompleted.routing_key)


# The status projection.


async def _projected(collection: RefusingCollection, delivery: HandedDelivery) -> None:
    broker = HandlerOnly()
    writes = GroupWriter(cast("AsyncCollection[Json]", collection))
    subscribe_projection(cast(ScoreboxBroker, broker), writes, StatusSettings(), clock=utcnow)
    async with asyncio.timeout(HANDLER_DEADLINE_S):
        await broker.handler(delivery)


async def test_an_event_the_projection_database_refuses_for_good_is_returned_as_failed(
    database: Any,
) -> None:
    tasks = RefusingCollection(database["tasks"])
    delivery = _completion(new_id())

    await _projected(tasks, delivery)

    assert tasks.bulk_writes == 1
    assert delivery.settled == RETURNED_AS_FAILED


async def test_an_event_whose_projection_database_is_away_is_applied_once_it_is_back(
    database: Any,
) -> None:
    tasks = RefusingCollection(database["tasks"], away_once=True)
    task_id = new_id()
    delivery = _completion(task_id)

    await _projected(tasks, delivery)

    assert delivery.settled == ["ack"]
    assert await database["tasks"].find_one({"_id": task_id}) is not None


# The scorer's decision record.


@dataclass
class Refused:
    decisions: int = 0


class DecisionsRefused(Attempts):
    """The scorer's attempts, every decision the database refuses for good."""

    def __init__(self, attempts: Attempts, refused: Refused) -> None:
        self.__dict__.update(attempts.__dict__)  # shares the real one's collections
        self.refused = refused

    @override
    async def decide(self, command: ScoreText, decision: Decision, **_: Any) -> bool:
        self.refused.decisions += 1
        raise WriteError("Document failed validation", 121, _validation_failure(0))


class Crashes(CarriedOut):
    """The scorer's broker actions on `broker`, remembering what they sent again,
    dead-lettered and failed once the broker took it."""

    def __init__(self, broker: RabbitBroker) -> None:
        super().__init__(broker)
        self.resent: list[dict[str, Any]] = []
        self.dead_lettered: list[str] = []
        self.failed: list[str] = []

    @override
    async def resend(self, command: ScoreText, *, headers: dict[str, Any]) -> None:
        await super().resend(command, headers=headers)
        self.resent.append(headers)

    @override
    async def dead_letter(self, message: Any, error: str) -> bool:
        lettered = await super().dead_letter(message, error)
        self.dead_lettered.append(error)
        return lettered

    @override
    async def fail_task(self, failed: TaskEvent) -> None:
        await super().fail_task(failed)
        self.failed.append(failed.task_id)


async def test_a_decision_the_database_refuses_for_good_is_a_crash_given_up_at_the_limit(
    make_deps: Deps, attempts: Attempts, task_broker: RabbitBroker
) -> None:
    """Repeated until the claim's lease ended, then re-sent uncounted: each copy called the
    model again and was refused again, for ever."""
    refused = Refused()
    deps = replace(make_deps("scorer-a"), attempts=DecisionsRefused(attempts, refused))
    broker, actions = HandlerOnly(), Crashes(task_broker)
    subscribe_scorer(cast(ScoreboxBroker, broker), deps, actions, crash_limit=2)
    command, _ = _command("An essay whose decision the database refuses.")
    body = command.model_dump_json().encode()

    first, last = HandedDelivery(body), HandedDelivery(body, headers={CRASHES_HEADER: 1})
    async with asyncio.timeout(HANDLER_DEADLINE_S):
        await broker.handler(first)  # a crash: sent again, counted
        await broker.handler(last)  # at the crash limit: given up, its give-up unrecorded

    assert [headers.get(CRASHES_HEADER) for headers in actions.resent] == [1]
    assert (len(actions.dead_lettered), actions.failed) == (1, [command.task_id])
    assert (first.settled, last.settled) == (["ack"], ["ack"])
    # Each delivery's decision, and the give-up: each tried once.
    assert refused.decisions == 3


# The gateway's outcome consumer.


async def _outcome_settled(
    database: Any, collection: RefusingCollection, delivery: HandedDelivery
) -> None:
    submissions = Submissions(cast("AsyncMongoClient[Json]", database.client), database.name)
    # The store's own group writer, over the refusing collection.
    submissions._writes = GroupWriter(cast("AsyncCollection[Json]", collection))
    deps = SimpleNamespace(submissions=submissions, in_flight=None, cache=None, clock=utcnow)
    broker = HandlerOnly()
    subscribe_task_outcomes(
        cast(ScoreboxBroker, broker), cast(GatewayDeps, deps), broker_timeout_s=5.0
    )
    async with asyncio.timeout(HANDLER_DEADLINE_S):
        await broker.handler(delivery)


async def _submitted(database: Any) -> str:
    task_id = new_id()
    expires_at = utcnow() + timedelta(hours=1)
    await database["submissions"].insert_one(
        {"_id": task_id, "tenant_id": "acme", "state": "sent", "expires_at": expires_at}
    )
    return task_id


async def test_an_outcome_the_gateway_database_refuses_for_good_is_returned_as_failed(
    database: Any,
) -> None:
    submissions = RefusingCollection(database["submissions"])
    delivery = _completion(await _submitted(database))

    await _outcome_settled(database, submissions, delivery)

    assert submissions.bulk_writes == 1
    assert delivery.settled == RETURNED_AS_FAILED


async def test_an_outcome_whose_gateway_database_is_away_is_settled_once_it_is_back(
    database: Any,
) -> None:
    submissions = RefusingCollection(database["submissions"], away_once=True)
    delivery = _completion(await _submitted(database))

    await _outcome_settled(database, submissions, delivery)

    assert submissions.bulk_writes == 2
    assert delivery.settled == ["ack"]


@pytest.mark.parametrize(
    ("cause", "away"),
    [
        (AutoReconnect("connection reset"), True),
        (WriteError("Document failed validation", 121, _validation_failure(0)), False),
        (None, True),
    ],
    ids=["outage", "refused", "no-cause"],
)
def test_a_gateway_database_error_is_away_only_when_its_cause_is_transient(
    cause: PyMongoError | None, away: bool
) -> None:
    error = DatabaseUnavailable(str(cause))
    error.__cause__ = cause
    assert database_away(error) is away
