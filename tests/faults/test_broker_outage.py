"""RabbitMQ goes away while the gateway takes submissions, then comes back.

By default the outage is simulated for the services' connections only: the test's own vhost
gets `max-connections: 0` and all its connections are closed (`rabbitmqctl set_vhost_limits`,
`close_all_connections`), so reconnects are refused until the limit is cleared. A real
restart of the broker (`rabbitmqctl stop_app` / `start_app`) would break every other test on
this machine's shared broker; it runs only with SCOREBOX_FAULTS_RESTART_BROKER=1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import httpx
import pytest

from shared.http import PROBLEM_JSON
from tests.faults.harness import (
    BoxParts,
    Figures,
    MemoryAlarm,
    Outcome,
    Scorebox,
    essay,
    new_marker,
    rabbitmqctl,
    rabbitmqctl_available,
    repeated_calls,
    running_scorebox,
    vhost_of,
)
from tests.support import eventually

RESTART_ENV = "SCOREBOX_FAULTS_RESTART_BROKER"
# Paces the simulated client (about ten submissions a second); nothing waits on it.
SUBMIT_INTERVAL_S = 0.1
# Slow enough that the scorer is in the middle of model calls when its connection goes.
LATENCY_MS = 500
OUTAGE_TIMEOUT_S = 90.0


@dataclass
class Answer:
    at: float
    status: int
    task_id: str | None
    marker: str
    problem: bool = False  # answered with application/problem+json


@dataclass
class Client:
    """A client submitting steadily in the background, remembering every answer."""

    box: Scorebox
    answers: list[Answer] = field(default_factory=list)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        while not self.stopping.is_set():
            marker = new_marker()
            try:
                response = await self.box.post(essay(marker))
            except httpx.HTTPError:
                self.answers.append(Answer(time.monotonic(), 0, None, marker))
            else:
                status = response.status_code
                task_id = response.json()["task_id"] if status == 202 else None
                problem = response.headers.get("content-type", "").startswith(PROBLEM_JSON)
                self.answers.append(Answer(time.monotonic(), status, task_id, marker, problem))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), SUBMIT_INTERVAL_S)

    def seen(self, status: int, *, since: float = 0.0) -> list[Answer]:
        return [a for a in self.answers if a.status == status and a.at >= since]

    def accepted(self) -> dict[str, str]:
        return {a.task_id: a.marker for a in self.answers if a.task_id is not None}


@dataclass(frozen=True)
class Outage:
    name: str
    how: str
    cut: Callable[[], Awaitable[None]]
    lift: Callable[[], Awaitable[None]]


def _vhost_cut(vhost: str) -> Outage:
    async def cut() -> None:
        await rabbitmqctl("set_vhost_limits", "-p", vhost, '{"max-connections": 0}')
        await rabbitmqctl("close_all_connections", "-p", vhost, "scorebox fault test")

    async def lift() -> None:
        await rabbitmqctl("clear_vhost_limits", "-p", vhost)

    return Outage(
        "broker outage (vhost connections cut)",
        "simulated for the services' connections: their vhost's connections closed and "
        "refused (max-connections 0) until lifted; a real broker restart is opt-in "
        f"({RESTART_ENV}=1)",
        cut,
        lift,
    )


def _broker_restart() -> Outage:
    async def cut() -> None:
        await rabbitmqctl("stop_app")

    async def lift() -> None:
        await rabbitmqctl("start_app")
        await rabbitmqctl("await_startup")

    return Outage(
        "broker restart (stop_app/start_app)",
        "the whole broker stopped and started with rabbitmqctl",
        cut,
        lift,
    )


@pytest.fixture(scope="module")
async def box(box_parts: BoxParts) -> AsyncIterator[Scorebox]:
    if not rabbitmqctl_available(box_parts.amqp_url):
        pytest.skip("needs rabbitmqctl for a broker on this machine")
    async with running_scorebox(box_parts, env={"BROKER_TIMEOUT_S": "3"}) as running:
        yield running


@pytest.mark.parametrize(
    "kind",
    [
        "vhost-cut",
        pytest.param(
            "broker-restart",
            marks=pytest.mark.skipif(
                os.environ.get(RESTART_ENV) != "1",
                reason=f"restarts the machine's shared broker, which breaks every other test "
                f"running on it; opt in with {RESTART_ENV}=1",
            ),
        ),
    ],
)
async def test_every_accepted_submission_survives_a_broker_outage(
    box: Scorebox, figures: Figures, labels: tuple[str, str], kind: str
) -> None:
    outage = _vhost_cut(vhost_of(box.amqp_url)) if kind == "vhost-cut" else _broker_restart()
    async with _submitting(box) as client:
        await eventually(
            lambda: _true(len(client.seen(202)) >= 5), timeout_s=60, what="202s before"
        )
        pids = box.stack.pids()
        cut_at = time.monotonic()
        async with _cut(outage) as cut:
            await eventually(
                lambda: _true(len(client.seen(503, since=cut_at)) >= 3),
                timeout_s=OUTAGE_TIMEOUT_S,
                what="503s while the broker is away",
            )
            await eventually(
                lambda: box.answers_ready("gateway", 503),
                timeout_s=OUTAGE_TIMEOUT_S,
                what="gateway not ready",
            )
            time_to_recover = await cut.lift(client)

    # The services reconnected by themselves: the same processes, all ready again.
    assert box.stack.pids() == pids
    await box.all_ready(timeout_s=OUTAGE_TIMEOUT_S)
    accepted = client.accepted()
    tally = await _tally(box, client, accepted)
    figures.record(
        tally.outcome(
            box,
            outage,
            time_to_recover=time_to_recover,
            labels=labels,
            notes=f"{outage.how}; {len(client.answers)} submissions, {len(tally.refused)} "
            f"refused with 503 ({tally.scored_anyway} of them scored anyway: published, "
            "confirm lost); the services reconnected by themselves",
        )
    )
    assert {a.status for a in client.answers} <= {202, 503}, box.answers
    assert all(a.problem for a in client.answers if a.status == 503)
    assert tally.statuses == ["completed"] * len(accepted), tally.statuses
    assert tally.duplicate_model_calls == 0, tally.extra
    assert box.answers[500] == 0


async def test_a_memory_alarm_holds_submissions_back_and_scores_none_it_refused(
    box: Scorebox, figures: Figures, labels: tuple[str, str]
) -> None:
    """A memory alarm blocks every publishing connection without closing it: a command the
    gateway wrote stays unconfirmed, then reaches its queue once the alarm ends. A
    submission whose publish was written is therefore never refused (503 would be a lie):
    it is answered 202 and kept for the outbox, which sends it again (the scorer claims each
    task once); a replay of its request is answered as accepted, not as still in progress,
    and a result-cache hit is answered with its result.
    Nothing the client was refused may be scored, and nothing scored twice."""
    outage = _memory_alarm(await MemoryAlarm.prepared(timeout_s=OUTAGE_TIMEOUT_S))
    async with _submitting(box) as client:
        await eventually(
            lambda: _true(len(client.seen(202)) >= 5), timeout_s=60, what="202s before"
        )
        cached_text = essay(new_marker())
        await _in_the_result_cache(box, cached_text)
        async with _cut(outage) as cut:
            cut_at = time.monotonic()
            cached = await box.post(cached_text)
            batch_markers = [new_marker() for _ in range(3)]
            batch_request = {"items": [{"text": essay(m)} for m in batch_markers]}
            batch, batch_again = await _sent_twice(box, "/v1/batches", batch_request)
            single_marker = new_marker()
            single, single_again = await _sent_twice(
                box, "/v1/scores", {"text": essay(single_marker)}
            )
            await eventually(
                lambda: _true(len([a for a in client.answers if a.at >= cut_at]) >= 3),
                timeout_s=OUTAGE_TIMEOUT_S,
                what="answers while the alarm lasts",
            )
            time_to_recover = await cut.lift(client)

    # The batch and the single submission sent during the alarm: accepted, and answered
    # as accepted when their requests are replayed (not 409 "in progress").
    assert (batch.status_code, single.status_code) == (202, 202), (batch.text, single.text)
    assert (batch_again.status_code, single_again.status_code) == (200, 200), (
        batch_again.text,
        single_again.text,
    )
    assert batch_again.json()["batch_id"] == batch.json()["batch_id"]
    assert single_again.json()["task_id"] == single.json()["task_id"]
    # A result-cache hit is answered with its result though its events are unconfirmed;
    # the outbox sweep announces them again, so the task ends completed either way.
    assert cached.status_code == 200, cached.text
    assert cached.json()["result"]["cached"] is True
    await box.finish([cached.json()["task_id"]])
    # Each of their tasks is scored once.
    batch_tasks = [item["task_id"] for item in batch.json()["items"]]
    accepted = (
        client.accepted()
        | dict(zip(batch_tasks, batch_markers, strict=True))
        | {single.json()["task_id"]: single_marker}
    )
    tally = await _tally(box, client, accepted)
    lift_at = cut.lifted_at
    assert lift_at is not None
    during = [a for a in client.answers if cut_at <= a.at < lift_at]
    figures.record(
        tally.outcome(
            box,
            outage,
            time_to_recover=time_to_recover,
            labels=labels,
            notes=f"{outage.how}; {len(client.answers)} submissions and a batch of "
            f"{len(batch_tasks)}, {len(during)} answered during the alarm "
            f"({sum(1 for a in during if a.status == 202)} with 202, the batch too), "
            f"{len(tally.refused)} refused with 503 ({tally.scored_anyway} of them scored "
            "anyway); unconfirmed commands are kept for the outbox sweep; a submission and "
            "the batch replayed with their Idempotency-Key during the alarm: answered 200 "
            "with the same task and batch; a result-cache hit: answered 200 with its result",
        )
    )
    assert {a.status for a in client.answers} <= {202, 503}, box.answers
    assert tally.scored_anyway == 0, f"{tally.scored_anyway} refused submissions were scored"
    # No delivery is left held: a handler whose publish the alarm held back retries it and
    # settles, rather than keeping its delivery (and a prefetch slot) until a restart.
    await eventually(
        lambda: _nothing_unacknowledged(box.amqp_url),
        timeout_s=OUTAGE_TIMEOUT_S,
        what="every delivery settled after the alarm",
    )
    assert tally.statuses == ["completed"] * len(accepted), tally.statuses
    assert tally.duplicate_model_calls == 0, tally.extra


async def _sent_twice(
    box: Scorebox, path: str, body: Mapping[str, object]
) -> tuple[httpx.Response, httpx.Response]:
    """A request, then its replay with the same Idempotency-Key."""
    headers = {"Idempotency-Key": new_marker()}
    first = await box.api.post(path, json=body, headers=headers)
    return first, await box.api.post(path, json=body, headers=headers)


async def _in_the_result_cache(box: Scorebox, text: str) -> None:
    """Score `text`, then wait until a submission of it is answered from the result cache
    (the gateway fills the cache when the outcome reaches it)."""
    await box.finish([await box.submit(text)])

    async def answered_from_cache() -> bool:
        return (await box.post(text)).status_code == 200

    await eventually(answered_from_cache, timeout_s=OUTAGE_TIMEOUT_S, what="a result-cache hit")


async def _nothing_unacknowledged(amqp_url: str) -> bool:
    listed = await rabbitmqctl(
        "list_queues",
        "-q",
        "-p",
        vhost_of(amqp_url),
        "name",
        "messages_unacknowledged",
        "--formatter",
        "json",
    )
    return all(queue["messages_unacknowledged"] == 0 for queue in json.loads(listed))


@contextlib.asynccontextmanager
async def _submitting(box: Scorebox) -> AsyncIterator[Client]:
    """A client submitting in the background, against a model slow enough that calls are in
    flight at any moment; stopped, and the model quick again, on the way out."""
    box.answers.clear()
    box.llm.config.latency_ms = LATENCY_MS
    client = Client(box)
    submitting = asyncio.create_task(client.run())
    try:
        yield client
    finally:
        client.stopping.set()
        await submitting
        box.llm.config.latency_ms = 0


class _Cut:
    """An outage under way; `lift` ends it (see `_cut`)."""

    def __init__(self, outage: Outage) -> None:
        self.outage = outage
        self.lifted_at: float | None = None

    async def lift(self, client: Client) -> float:
        """End the outage; seconds from then to the client's recovery (`_recovered`)."""
        self.lifted_at = time.monotonic()
        await self.outage.lift()
        return await _recovered(client, self.lifted_at)


@contextlib.asynccontextmanager
async def _cut(outage: Outage) -> AsyncIterator[_Cut]:
    """The outage for the block's duration: lifted on the way out unless the block did."""
    await outage.cut()
    cut = _Cut(outage)
    try:
        yield cut
    finally:
        if cut.lifted_at is None:
            await outage.lift()


def _memory_alarm(alarm: MemoryAlarm) -> Outage:
    return Outage(
        "broker memory alarm (publishes blocked)",
        "the broker's memory watermark set below its use, then restored",
        alarm.raise_,
        alarm.lift,
    )


async def _recovered(client: Client, lift_at: float) -> float:
    """Seconds from the lift to the first 202, once five more have followed it."""
    recovered = await eventually(
        lambda: _true(client.seen(202, since=lift_at) or None),
        timeout_s=OUTAGE_TIMEOUT_S,
        what="a 202 after the outage",
    )
    await eventually(
        lambda: _true(len(client.seen(202, since=recovered[0].at)) >= 5),
        timeout_s=OUTAGE_TIMEOUT_S,
        what="202s after",
    )
    return max(0.0, recovered[0].at - lift_at)


@dataclass(frozen=True)
class Tally:
    """What became of the client's submissions once every accepted task finished."""

    statuses: list[str]
    extra: dict[str, int]  # model calls beyond one per attempt, by marker
    refused: list[str]  # markers answered other than 202
    scored_anyway: int  # refused, yet the model was called for them

    @property
    def duplicate_model_calls(self) -> int:
        return repeated_calls(self.extra)

    def outcome(
        self,
        box: Scorebox,
        outage: Outage,
        *,
        time_to_recover: float,
        labels: tuple[str, str],
        notes: str,
    ) -> Outcome:
        """The row of the README's reliability table."""
        return Outcome(
            name=outage.name,
            accepted=len(self.statuses),
            completed=self.statuses.count("completed"),
            failed=self.statuses.count("failed"),
            duplicate_model_calls=self.duplicate_model_calls,
            http_5xx_seen=box.http_5xx(),
            time_to_recover_s=round(time_to_recover, 2),
            broker=labels[0],
            database=labels[1],
            notes=notes,
        )


async def _tally(box: Scorebox, client: Client, accepted: dict[str, str]) -> Tally:
    views = await box.finish(accepted)
    refused = [a.marker for a in client.answers if a.status != 202]
    return Tally(
        statuses=[v["status"] for v in views.values()],
        extra=box.calls_beyond_attempts(accepted, views),
        refused=refused,
        scored_anyway=sum(1 for m in refused if box.calls(m) > 0),
    )


def _true[T](value: T) -> Awaitable[T]:
    """`value` as an awaitable, for `eventually` probes that need no I/O."""
    future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future
