"""The scheduler in-process against the real broker (a vhost of this module) and database:
replicas fire once, missed firings follow their policy, the usage rollup is idempotent, the
fan-out resumes after a crash without skipping, manual runs, housekeeping and its alerts.

Every test has databases of its own (`MONGO_DB_PREFIX`); time is a movable clock that the
scheduler reads, so nothing waits for a real fire time.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

import aio_pika
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pymongo import AsyncMongoClient

from services.scheduler.app import create_app
from services.scheduler.catalogue import Catalogue
from services.scheduler.checkpoints import Checkpoints
from services.scheduler.config import SchedulerConfig, load_config, parse_config
from services.scheduler.errors import PermanentJobError
from services.scheduler.firings import Firings, FiringState, Hold
from services.scheduler.jobs import JobHandler, JobOutcome, JobRun
from services.scheduler.jobs.fanout import fan_out_rescores
from services.scheduler.messaging import SchedulerBus
from services.scheduler.runs import Drop, RetryPolicy, run_cron_job
from services.scheduler.settings import SchedulerSettings
from shared.bus import publish_dead_letter, publish_event
from shared.contracts import (
    DeadLetterAlert,
    Phase,
    RescoreTask,
    RunCronJob,
    ScoreResult,
    TaskCompleted,
    Usage,
    event_sequence,
    new_id,
)
from shared.runtime import make_broker
from shared.topology import (
    CRON_JOBS,
    ERROR_HEADER,
    EVENTS,
    OPS_LOG,
    RESCORE_REQUESTS,
    RESCORES_WAIT,
    STATUS_PROJECTION,
    declare_topology,
)
from tests.support import drain, eventually, running

Mongo = AsyncMongoClient[dict[str, Any]]
# Frozen far from any real fire time: jobs fire only when a test moves the clock.
QUIET = datetime(2030, 1, 1, 10, 31, 30, tzinfo=UTC)


class MovableClock:
    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


ADMIN_KEY = "scheduler-admin-key"


@dataclass
class Env:
    amqp_url: str
    mongo_url: str
    db_prefix: str
    mongo: Mongo
    clock: MovableClock = field(default_factory=lambda: MovableClock(QUIET))

    def settings(self, **extra: object) -> SchedulerSettings:
        return SchedulerSettings.model_validate(
            {
                "RABBITMQ_URL": self.amqp_url,
                "MONGO_URL": self.mongo_url,
                "MONGO_DB_PREFIX": self.db_prefix,
                "SCHEDULER_TICK_S": "0.05",
                "ADMIN_API_KEY": ADMIN_KEY,
                **{key: str(value) for key, value in extra.items()},
            }
        )

    @property
    def database(self) -> str:
        return f"{self.db_prefix}_scheduler"

    def collection(self, name: str) -> Any:
        return self.mongo[self.database][name]


@pytest.fixture(scope="module")
async def mongo_client(mongo: Any) -> AsyncIterator[Mongo]:
    client: Mongo = AsyncMongoClient(mongo.url, tz_aware=True)
    yield client
    await client.close()


@pytest.fixture(scope="module")
async def topology(amqp_url: str) -> str:
    """The vhost with every queue declared (the services do it too, idempotently)."""
    broker = make_broker(SchedulerSettings.model_validate({"RABBITMQ_URL": amqp_url}))
    async with broker:
        await broker.connect()
        await declare_topology(broker)
    return amqp_url


@pytest.fixture
def env(topology: str, mongo: Any, db_prefix: str, mongo_client: Mongo) -> Env:
    return Env(topology, mongo.url, f"{db_prefix}{uuid.uuid4().hex[:6]}", mongo_client)


@asynccontextmanager
async def scheduler(
    env: Env,
    config: SchedulerConfig,
    *,
    handlers: dict[str, JobHandler] | None = None,
    **settings: object,
) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    app = create_app(env.settings(**settings), config=config, clock=env.clock, handlers=handlers)
    async with running(app) as client:
        client.headers["Authorization"] = f"Bearer {ADMIN_KEY}"
        yield client, app.state.dispatcher


class Calls:
    """A job handler that records its runs."""

    def __init__(self) -> None:
        self.runs: list[JobRun] = []

    async def __call__(self, run: JobRun) -> JobOutcome:
        self.runs.append(run)
        return JobOutcome(summary={"calls": len(self.runs)})


async def ticked(dispatchers: Sequence[Any], more_than: int) -> None:
    """Wait until every dispatcher has ticked more than `more_than` times."""

    async def enough() -> bool:
        return all(d.ticks > more_than for d in dispatchers)

    await eventually(enough, what=f"{more_than} ticks")


async def firing_state(api: httpx.AsyncClient, run_id: str, state: str) -> dict[str, Any]:
    async def reached() -> dict[str, Any] | None:
        body: dict[str, Any] = (await api.get(f"/admin/v1/cron/runs/{run_id}")).json()
        return body if body.get("state") == state else None

    return await eventually(reached, what=f"run {run_id} {state}")


# --- cron ---------------------------------------------------------------------------------


async def test_two_replicas_fire_a_job_once(env: Env) -> None:
    env.clock.now = datetime(2030, 1, 1, 10, 4, 59, 500_000, tzinfo=UTC)
    config = parse_config({"jobs": {"probe": {"cron": "*/5 * * * *"}}}, {})
    calls = Calls()
    async with (
        scheduler(env, config, handlers={"probe": calls}) as (api, first),
        scheduler(env, config, handlers={"probe": calls}) as (_, second),
    ):
        await ticked([first, second], 3)
        assert calls.runs == []
        env.clock.now = datetime(2030, 1, 1, 10, 5, 0, 300_000, tzinfo=UTC)

        async def ran() -> bool:
            return len(calls.runs) > 0

        await eventually(ran, what="the probe job ran")
        await ticked([first, second], max(first.ticks, second.ticks) + 5)
        assert [run.scheduled_for for run in calls.runs] == [
            datetime(2030, 1, 1, 10, 5, tzinfo=UTC)
        ]
        assert await env.collection("firings").count_documents({"job": "probe"}) == 1
        await firing_state(api, calls.runs[0].run_id, "succeeded")


async def _history(
    env: Env, job: str, scheduled_for: datetime, *, letter_owed: bool = False
) -> None:
    """A past firing of `job`: succeeded, or given up with its dead letter `letter_owed`."""
    firings = Firings(env.mongo, env.database)
    await firings.ensure_indexes()
    firing = await firings.claim(job, scheduled_for, now=scheduled_for, owner="past")
    assert firing is not None
    state = FiringState.FAILED if letter_owed else FiringState.SUCCEEDED
    await firings.finish(firing.run_id, state=state, now=scheduled_for, letter_owed=letter_owed)


async def test_the_schedule_position_ignores_fire_times_ahead_of_now(env: Env) -> None:
    """A firing claimed by a replica whose clock ran ahead is not the schedule's position,
    nor the cursor housekeeping keeps."""
    firings = Firings(env.mongo, env.database)
    now = datetime(2030, 1, 1, 10, 5, 30, tzinfo=UTC)
    await _history(env, "ahead", now - timedelta(hours=1))
    await _history(env, "ahead", now + timedelta(days=1))
    assert await firings.last_scheduled("ahead", not_after=now) == now - timedelta(hours=1)
    [cursor] = await firings.last_scheduled_ids(["ahead"], not_after=now)
    assert (await env.collection("firings").find_one({"_id": cursor}) or {}).get(
        "scheduled_for"
    ) == now - timedelta(hours=1)


async def test_only_a_manual_firing_still_claimed_is_withdrawn(env: Env) -> None:
    """A manual run whose publish failed unconfirmed may have reached the queue and started:
    its record stays."""
    firings = Firings(env.mongo, env.database)
    await firings.ensure_indexes()
    at = datetime(2030, 1, 1, 6, 0, 0, 1000, tzinfo=UTC)
    refused = await firings.claim("withdrawn", at, now=at, owner="a", manual=True)
    started = await firings.claim("withdrawn", at + timedelta(seconds=1), now=at, owner="a")
    assert refused is not None
    assert started is not None
    await firings.begin(started.run_id, attempt=1, now=at)

    assert await firings.forget_unpublished(refused.run_id)
    assert not await firings.forget_unpublished(started.run_id)
    assert await firings.find(refused.run_id) is None
    assert await firings.find(started.run_id) is not None


async def test_only_a_firing_still_claimed_is_superseded(env: Env) -> None:
    """A stale claim the dispatcher skips (a later firing runs in its place) may have been
    published after all and started meanwhile: then it is left to run."""
    firings = Firings(env.mongo, env.database)
    await firings.ensure_indexes()
    at = datetime(2030, 1, 1, 6, tzinfo=UTC)
    never_published = await firings.claim("superseded", at, now=at, owner="a")
    started = await firings.claim("superseded", at + timedelta(hours=1), now=at, owner="a")
    assert never_published is not None
    assert started is not None
    await firings.begin(started.run_id, attempt=1, now=at)

    assert await firings.supersede(never_published.run_id, now=at, reason="later one ran")
    assert not await firings.supersede(started.run_id, now=at, reason="later one ran")
    skipped = await firings.find(never_published.run_id)
    running = await firings.find(started.run_id)
    assert skipped is not None
    assert skipped.state is FiringState.SKIPPED
    assert running is not None
    assert running.state is FiringState.RUNNING


async def test_a_duplicate_run_failing_after_another_succeeded_leaves_it_succeeded(
    env: Env,
) -> None:
    """Two deliveries of one firing may run at once (a publish the broker confirmed late was
    sent again); the first end of the run stands."""
    firings = Firings(env.mongo, env.database)
    await firings.ensure_indexes()
    at = datetime(2030, 1, 1, 7, tzinfo=UTC)
    firing = await firings.claim("duplicated", at, now=at, owner="a")
    assert firing is not None
    await firings.begin(firing.run_id, attempt=1, now=at)
    await firings.finish(firing.run_id, state=FiringState.SUCCEEDED, now=at, result={"n": 1})

    await firings.retrying(firing.run_id, error="boom", next_attempt_at=at, now=at)
    await firings.finish(firing.run_id, state=FiringState.FAILED, now=at, error="boom")

    stored = await firings.find(firing.run_id)
    assert stored is not None
    assert stored.state is FiringState.SUCCEEDED


HOLD = timedelta(seconds=60)


@pytest.mark.parametrize("last_attempt", [False, True], ids=["permanent", "retries-spent"])
async def test_a_duplicate_run_giving_up_after_another_succeeded_owes_no_letter(
    env: Env, last_attempt: bool
) -> None:
    """Given up while another delivery of its run had succeeded, a copy was decided GiveUp
    all the same: a dead letter for a run that succeeded, the DLQ alert, and, replayed, the
    job run again (found in review)."""
    firings = Firings(env.mongo, env.database)
    await firings.ensure_indexes()
    now = env.clock()
    firing = await firings.claim("rollup", now, now=now, owner="a", exclusive=True)
    assert firing is not None
    retry = RetryPolicy(4, timedelta(seconds=5), timedelta(seconds=600))
    command = RunCronJob(
        task_id=firing.run_id,
        job="rollup",
        scheduled_for=now,
        fired_at=now,
        step=0,
        attempt=retry.max_attempts if last_attempt else 1,
    )

    async def job(run: JobRun) -> JobOutcome:
        # Meanwhile the other delivery of this run succeeded.
        await firings.finish(run.run_id, state=FiringState.SUCCEEDED, now=env.clock(), result={})
        if last_attempt:
            raise RuntimeError("a transient failure, the last attempt")
        raise PermanentJobError("a permanent failure")

    hold = Hold(handling=new_id(), message_id=command.message_id, step=0, until=now + HOLD)
    decision = await run_cron_job(
        command, handlers={"rollup": job}, firings=firings, retry=retry, clock=env.clock, hold=hold
    )

    assert isinstance(decision, Drop), decision
    stored = await firings.find(firing.run_id)
    assert stored is not None
    assert stored.state is FiringState.SUCCEEDED


async def test_missed_firings_coalesce_or_skip(env: Env) -> None:
    hourly = {"cron": "0 * * * *"}
    config = parse_config(
        {
            "jobs": {
                "coalescing": {**hourly, "missed": "coalesce"},
                "skipping": {**hourly, "missed": "skip"},
            }
        },
        {},
    )
    for job in ("coalescing", "skipping"):  # both last ran at 05:00; it is now 10:31:30
        await _history(env, job, datetime(2030, 1, 1, 5, tzinfo=UTC))
    coalescing, skipping = Calls(), Calls()
    handlers: dict[str, JobHandler] = {"coalescing": coalescing, "skipping": skipping}
    async with scheduler(env, config, handlers=handlers) as (api, dispatcher):

        async def coalesced() -> bool:
            return len(coalescing.runs) > 0

        await eventually(coalesced, what="the coalescing job ran")
        await ticked([dispatcher], dispatcher.ticks + 3)
        assert [run.scheduled_for.hour for run in coalescing.runs] == [10]
        assert skipping.runs == []
        jobs = {job["name"]: job for job in (await api.get("/admin/v1/cron/jobs")).json()["jobs"]}
        assert jobs["coalescing"]["last_firing"]["missed"] == 4
        skipped = jobs["skipping"]["last_firing"]
        assert (skipped["state"], skipped["missed"]) == ("skipped", 5)
        assert skipped["scheduled_for"].startswith("2030-01-01T10:00:00")
        assert jobs["skipping"]["next_fire_at"].startswith("2030-01-01T11:00:00")


async def test_manual_run_routes_and_a_permanent_failure_is_dead_lettered(env: Env) -> None:
    config = load_config(
        load_config.__globals__["DEFAULT_CONFIG_PATH"], {"CRON_RESCORE_FANOUT_TZ": "UTC"}
    )
    await drain(env.amqp_url, CRON_JOBS.dead_letter_routing_key)

    async def doomed(run: JobRun) -> JobOutcome:
        raise PermanentJobError("the archive housekeeping writes to is gone")

    async with scheduler(env, config, handlers={"housekeeping": doomed}) as (api, _):
        listed = (await api.get("/admin/v1/cron/jobs")).json()["jobs"]
        assert [job["name"] for job in listed] == ["usage-rollup", "rescore-fanout", "housekeeping"]
        rollup = listed[0]
        assert (rollup["cron"], rollup["tz"], rollup["missed"]) == ("5 * * * *", "UTC", "coalesce")
        assert rollup["next_fire_at"].startswith("2030-01-01T11:05:00")
        assert listed[1]["enabled"] is False
        assert listed[1]["next_fire_at"] is None

        anonymous = await api.get("/admin/v1/cron/jobs", headers={"Authorization": ""})
        assert anonymous.status_code == 401
        unknown = await api.post("/admin/v1/cron/jobs/nope/run")
        assert unknown.status_code == 404
        assert unknown.headers["content-type"].startswith("application/problem+json")
        assert (await api.get("/admin/v1/cron/runs/nope")).status_code == 404
        # A long name or run id is cut in the detail, not echoed whole (a review).
        for long in (
            await api.post(f"/admin/v1/cron/jobs/{'j' * 5_000}/run"),
            await api.get(f"/admin/v1/cron/runs/{'r' * 5_000}"),
        ):
            assert long.status_code == 404
            assert "(5,000 characters)" in long.json()["detail"]
            assert len(long.json()["detail"]) < 200

        # A body, which the route does not take: refused, nothing run (`{bad` fired a run,
        # found in a walkthrough).
        json_type = {"Content-Type": "application/json"}
        malformed = await api.post(
            "/admin/v1/cron/jobs/usage-rollup/run", content=b"{bad", headers=json_type
        )
        assert malformed.status_code == 422, malformed.text
        assert malformed.json()["detail"].endswith("; nothing was run.")
        assert (await api.get("/admin/v1/cron/jobs")).json()["jobs"][0]["last_firing"] is None

        accepted = await api.post("/admin/v1/cron/jobs/usage-rollup/run")
        assert accepted.status_code == 202, accepted.text
        body = accepted.json()
        assert body["state"] == "dispatched"
        assert accepted.headers["location"] == body["status_url"]
        done = await firing_state(api, body["run_id"], "succeeded")
        assert done["manual"] is True
        assert done["result"] == {"tagged": 0, "rolled_up": 0, "days": 0, "too_old": 0}

        # The fan-out without RUBRIC_VERSION cannot run: refused, nothing started (it ran and
        # failed into the cron DLQ).
        refused = await api.post("/admin/v1/cron/jobs/rescore-fanout/run")
        assert refused.status_code == 409
        assert refused.headers["content-type"].startswith("application/problem+json")
        assert refused.json()["type"].endswith("job-not-runnable")
        assert "RUBRIC_VERSION" in refused.json()["detail"]
        listed = (await api.get("/admin/v1/cron/jobs")).json()["jobs"]
        assert listed[1]["last_firing"] is None

        # A permanent failure: dead-lettered with the reason.
        failed = (await api.post("/admin/v1/cron/jobs/housekeeping/run")).json()
        run = await firing_state(api, failed["run_id"], "failed")
        assert "archive" in run["error"]

        async def dead_lettered() -> list[Any] | None:
            found = await drain(env.amqp_url, CRON_JOBS.dead_letter_routing_key)
            return found or None

        (letter,) = await eventually(dead_lettered, what="the failed run in the DLQ")
        assert "archive" in str(letter.headers[ERROR_HEADER])

        exposition = (await api.get("/metrics")).text
        runs = {
            (sample.labels["job"], sample.labels["result"]): sample.value
            for family in text_string_to_metric_families(exposition)
            for sample in family.samples
            if sample.name == "scorebox_cron_runs_total"
        }
        assert runs == {("usage-rollup", "finished"): 1, ("housekeeping", "gave_up"): 1}


# --- usage metering and rollup --------------------------------------------------------------


def _completed(
    task_id: str, tenant: str, day: str, model: str, prompt: int, completion: int, generation: int
) -> TaskCompleted:
    at = datetime.fromisoformat(f"{day}T12:00:00+00:00")
    return TaskCompleted(
        task_id=task_id,
        tenant_id=tenant,
        sequence=generation * 1_000_000 + 190,
        attempt=1,
        generation=generation,
        submitted_at=at,
        occurred_at=at,
        result=ScoreResult(
            score=5,
            comment="ok",
            model=model,
            usage=Usage(prompt_tokens=prompt, completion_tokens=completion),
        ),
    )


async def _publish_events(env: Env, events: Sequence[TaskCompleted]) -> None:
    broker = make_broker(env.settings())
    async with broker:
        await broker.connect()
        for event in events:
            await publish_event(broker, event, timeout=10)


async def _run_job(api: httpx.AsyncClient, job: str) -> dict[str, Any]:
    accepted = await api.post(f"/admin/v1/cron/jobs/{job}/run")
    assert accepted.status_code == 202, accepted.text
    return await firing_state(api, accepted.json()["run_id"], "succeeded")


async def _usage(api: httpx.AsyncClient, tenant: str) -> dict[str, Any]:
    response = await api.get(
        "/internal/v1/usage", params={"tenant_id": tenant, "from": "2030-01-01", "to": "2030-01-31"}
    )
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


async def test_usage_rollup_is_idempotent(env: Env) -> None:
    config = parse_config(
        {
            "jobs": {"usage-rollup": {"cron": "5 * * * *"}},
            "prices": {"priced": {"prompt_per_1k": 0.001, "completion_per_1k": 0.002}},
        },
        {},
    )
    tenant_a, tenant_b = f"a{uuid.uuid4().hex[:6]}", f"b{uuid.uuid4().hex[:6]}"
    events = [
        _completed("t1", tenant_a, "2030-01-02", "priced", 1000, 100, 0),
        _completed("t2", tenant_a, "2030-01-02", "priced", 2000, 200, 0),
        _completed("t2", tenant_a, "2030-01-02", "priced", 500, 50, 1),  # a DLQ replay
        _completed("t3", tenant_a, "2030-01-03", "unpriced", 300, 30, 0),
        _completed("t4", tenant_b, "2030-01-02", "priced", 10, 1, 0),
    ]
    async with scheduler(env, config) as (api, _):
        await _publish_events(env, [*events, events[0], events[2]])  # with redeliveries

        async def recorded() -> bool:
            count: int = await env.collection("usage_records").count_documents({})
            return count == len(events)

        await eventually(recorded, what="usage records stored")
        await _run_job(api, "usage-rollup")
        first = await _usage(api, tenant_a)
        assert first["days"] == [
            {
                "date": "2030-01-02",
                "requests": 3,
                "prompt_tokens": 3500,
                "completion_tokens": 350,
                "total_tokens": 3850,
                "cost": 0.0042,
                "unpriced_requests": 0,
            },
            {
                "date": "2030-01-03",
                "requests": 1,
                "prompt_tokens": 300,
                "completion_tokens": 30,
                "total_tokens": 330,
                "cost": None,
                "unpriced_requests": 1,
            },
        ]
        assert first["totals"]["requests"] == 4
        assert first["totals"]["cost"] == 0.0042
        assert (await _usage(api, tenant_b))["totals"]["requests"] == 1

        await _run_job(api, "usage-rollup")  # again: nothing new, nothing changes
        assert await _usage(api, tenant_a) == first
        # A rollup that died after writing the rows but before marking the records: the next
        # one recomputes the same days from scratch and writes the same totals.
        await env.collection("usage_records").update_many({}, {"$set": {"rolled_up": False}})
        again = await _run_job(api, "usage-rollup")
        assert again["result"]["days"] == 3
        assert await _usage(api, tenant_a) == first
        await _publish_events(env, events)  # late redeliveries of everything

        await _run_job(api, "usage-rollup")
        assert await _usage(api, tenant_a) == first
        assert await env.collection("usage_records").count_documents({}) == len(events)


async def test_usage_route_rejects_bad_ranges(env: Env) -> None:
    config = parse_config({"jobs": {}}, {})
    async with scheduler(env, config) as (api, _):
        for params in (
            {"tenant_id": "a", "from": "2030-01-31", "to": "2030-01-01"},
            {"tenant_id": "a", "from": "2030-01-01", "to": "2031-06-01"},
            {"tenant_id": "a", "from": "soon", "to": "2030-01-01"},
            {"tenant_id": "a", "to": "2030-01-01"},
            {"from": "2030-01-01", "to": "2030-01-01"},
        ):
            response = await api.get("/internal/v1/usage", params=params)
            assert response.status_code == 422, (params, response.text)
            assert response.headers["content-type"].startswith("application/problem+json")
        empty = await api.get(
            "/internal/v1/usage",
            params={"tenant_id": "a", "from": "2030-01-01", "to": "2030-01-01"},
        )
        assert empty.json()["days"] == []
        # Nothing to price costs 0; null is an unknown cost (requests none of which had one).
        assert empty.json()["totals"]["cost"] == 0


# --- fan-out --------------------------------------------------------------------------------


async def _seed_catalogue(env: Env, rows: Sequence[tuple[str, str | None]]) -> None:
    completed_at = QUIET - timedelta(days=1)
    await env.collection("completed_tasks").insert_many(
        [
            {
                "_id": task_id,
                "tenant_id": "acme",
                "generation": 0,
                "completed_at": completed_at,
                "model": "m",
                "rubric_version": version,
            }
            for task_id, version in rows
        ]
    )


class CrashOnce:
    """Publishes pages through a real broker; on page `crash_on` publishes half, then dies."""

    def __init__(self, bus: SchedulerBus, crash_on: int) -> None:
        self.bus = bus
        self.crash_on = crash_on
        self.pages = 0
        self.crashed = False

    async def __call__(self, page: Sequence[RescoreTask]) -> None:
        self.pages += 1
        if self.pages == self.crash_on and not self.crashed:
            self.crashed = True
            await self.bus.publish_rescore_page(page[: len(page) // 2])
            raise ConnectionError("killed mid-page")
        await self.bus.publish_rescore_page(page)


async def test_fanout_resumes_after_a_crash_without_skipping(env: Env) -> None:
    page_size, stale_count = 50, 210
    rows: list[tuple[str, str | None]] = [(f"task-{i:05d}", None) for i in range(150)]
    rows += [(f"task-{i:05d}", "v1") for i in range(150, 210)]
    rows += [(f"task-{i:05d}", "v2") for i in range(210, 230)]  # already current: not stale
    await _seed_catalogue(env, rows)
    await drain(env.amqp_url, RESCORE_REQUESTS.name)
    config = parse_config({"jobs": {"rescore-fanout": {"cron": "0 3 * * *", "enabled": False}}}, {})
    publisher_broker = make_broker(env.settings())
    async with publisher_broker:
        await publisher_broker.connect()
        publisher = CrashOnce(SchedulerBus(publisher_broker, 10, env.clock), crash_on=3)
        checkpoints = Checkpoints(env.mongo, env.database)
        fanout: JobHandler = partial(
            fan_out_rescores,
            catalogue=Catalogue(env.mongo, env.database),
            checkpoints=checkpoints,
            publish_page=publisher,
            rubric_version="v2",
            page_size=page_size,
            max_pages=2,  # two pages per delivery, then it continues in a new message
            horizon=timedelta(days=2),
            clock=env.clock,
        )
        async with scheduler(
            env,
            config,
            handlers={"rescore-fanout": fanout},
            SCHEDULER_RETRY_BASE_S=1,
            RUBRIC_VERSION="heuristic-v1",  # the fan-out runs only with one
        ) as (api, _):
            accepted = (await api.post("/admin/v1/cron/jobs/rescore-fanout/run")).json()
            await firing_state(api, accepted["run_id"], "retrying")
            assert publisher.crashed
            env.clock.now += timedelta(seconds=2)  # the retry's back-off (1 s) has passed
            run = await firing_state(api, accepted["run_id"], "succeeded")

    assert run["attempts"] == 2  # the slice that crashed was retried through the wait ladder
    messages = await drain(env.amqp_url, RESCORE_REQUESTS.name)
    published = [RescoreTask.model_validate_json(m.body) for m in messages]
    task_ids = [task.task_id for task in published]
    stale = {task_id for task_id, version in rows if version != "v2"}
    assert set(task_ids) == stale  # nothing skipped, nothing extra
    assert len(stale) == stale_count
    assert len(task_ids) - len(stale) == page_size // 2  # only the crashed half-page twice
    assert {task.rubric_version for task in published} == {"v2"}
    assert {task.generation for task in published} == {0}  # as the catalogue holds it
    assert {m.message_id for m in messages} == {
        RescoreTask.for_task(
            task_id=t,
            tenant_id="acme",
            rubric_version="v2",
            previous_rubric_version=None,
            model=None,
            run_id="x",
            generation=0,
        ).message_id
        for t in stale
    }  # one message id per (task, version, generation): consumers can drop the duplicates
    checkpoint = await checkpoints.find(accepted["run_id"])
    assert checkpoint is not None
    assert checkpoint.finished_at is not None
    assert checkpoint.published == stale_count
    assert checkpoint.last_id == max(task_id for task_id, _ in rows)  # the last one read
    assert checkpoint.scanned == len(rows)
    assert run["result"]["published"] == stale_count
    # Each task is requested once per version: a second run finds nothing left to do.
    marked = await env.collection("completed_tasks").count_documents(
        {"rescore_requested_for": "v2"}
    )
    assert marked == stale_count


@pytest.mark.parametrize(
    ("horizon", "requested"),
    [(None, {"recent"}), (str(3 * 86_400), {"recent", "two-days-old"})],
    ids=["default-a-day", "three-days"],
)
async def test_the_fanout_requests_only_tasks_the_gateway_still_knows(
    env: Env, horizon: str | None, requested: set[str]
) -> None:
    """The gateway keeps a submission `IDEMPOTENCY_TTL_S` (a day by default) and answers a
    re-score of an older task "unknown task": the fan-out requested every catalogued task,
    up to the catalogue's retention of a year, each counted against the backlog."""
    await env.collection("completed_tasks").insert_many(
        [
            {
                "_id": task_id,
                "tenant_id": "acme",
                "generation": 0,
                "completed_at": QUIET - age,
                "model": "m",
                "rubric_version": None,
            }
            for task_id, age in (
                ("recent", timedelta(hours=1)),
                ("two-days-old", timedelta(days=2)),
                ("year-old", timedelta(days=360)),
            )
        ]
    )
    await drain(env.amqp_url, RESCORE_REQUESTS.name)
    config = parse_config({"jobs": {"rescore-fanout": {"cron": "0 3 * * *", "enabled": False}}}, {})
    extra = {} if horizon is None else {"FANOUT_HORIZON_S": horizon}
    running_scheduler = scheduler(
        env, config, handlers=None, RUBRIC_VERSION="heuristic-v1", **extra
    )
    async with running_scheduler as (api, _):
        run = await _run_job(api, "rescore-fanout")

    messages = await drain(env.amqp_url, RESCORE_REQUESTS.name)
    assert {RescoreTask.model_validate_json(m.body).task_id for m in messages} == requested
    assert run["result"]["published"] == len(requested)
    assert run["result"]["scanned"] == 3  # read, not requested


async def test_the_fanout_sends_the_requests_of_tasks_the_cache_answered_after_the_others(
    env: Env,
) -> None:
    """Sent together, the copies of a text the cache answered were looked up before the
    scored task's new result existed, and nearly all were scored again: the catalogue keeps
    from their `task.completed` that the cache answered them, and their requests wait 10
    minutes in a wait queue of their own (`RESCORES_WAIT`), marked for the gateway to
    look the text up."""
    completed = [
        TaskCompleted(
            task_id=task_id,
            tenant_id="acme",
            sequence=event_sequence(generation=0, attempt=attempt, phase=Phase.TERMINAL),
            attempt=attempt,
            submitted_at=QUIET - timedelta(hours=1),
            occurred_at=QUIET - timedelta(hours=1),
            result=ScoreResult(score=5, comment="ok", model="m", cached=not attempt),
        )
        for task_id, attempt in (("scored", 1), ("answered-from-cache", 0))
    ]
    await drain(env.amqp_url, RESCORE_REQUESTS.name)
    await drain(env.amqp_url, RESCORES_WAIT)
    config = parse_config({"jobs": {"rescore-fanout": {"cron": "0 3 * * *", "enabled": False}}}, {})
    async with scheduler(env, config, RUBRIC_VERSION="heuristic-v1") as (api, _):
        await _publish_events(env, completed)

        async def catalogued() -> dict[str, bool] | None:
            found = {
                d["_id"]: d.get("cached") async for d in env.collection("completed_tasks").find()
            }
            return found if {"scored", "answered-from-cache"} <= found.keys() else None

        assert (await eventually(catalogued, what="both catalogued")) == {
            "scored": False,
            "answered-from-cache": True,
        }
        run = await _run_job(api, "rescore-fanout")

    [now] = [
        RescoreTask.model_validate_json(m.body)
        for m in await drain(env.amqp_url, RESCORE_REQUESTS.name)
    ]
    [later] = [
        RescoreTask.model_validate_json(m.body) for m in await drain(env.amqp_url, RESCORES_WAIT)
    ]
    assert (now.task_id, now.answered_from_cache) == ("scored", False)
    assert (later.task_id, later.answered_from_cache) == ("answered-from-cache", True)
    assert run["result"]["published"] == 2


# --- housekeeping ---------------------------------------------------------------------------


async def _fill(amqp_url: str, exchange_name: str, routing_key: str, count: int) -> None:
    """`count` confirmed, mandatory publishes, 500 in flight at a time."""
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(exchange_name, ensure=False)
        for start in range(0, count, 500):
            await asyncio.gather(
                *(
                    exchange.publish(
                        aio_pika.Message(f"filler {n}".encode()),
                        routing_key=routing_key,
                        mandatory=True,
                        timeout=30,
                    )
                    for n in range(start, min(count, start + 500))
                )
            )


async def test_housekeeping_goes_on_when_nobody_reads_the_ops_log(env: Env) -> None:
    """The ops log, unread and full, drops its oldest events: housekeeping's events are
    published and the run succeeds (a queue refusing publishes failed every run)."""
    config = parse_config(
        {
            "jobs": {"housekeeping": {"cron": "*/10 * * * *", "enabled": False}},
            "housekeeping": {"dead_letter_threshold": 1_000_000},
        },
        {},
    )
    await drain(env.amqp_url, OPS_LOG.name)
    await _fill(env.amqp_url, EVENTS.name, "ops.filler", OPS_LOG.max_length)
    async with scheduler(env, config) as (api, _):
        run = await _run_job(api, "housekeeping")

    assert run["state"] == "succeeded"
    events = await drain(env.amqp_url, OPS_LOG.name)
    assert len(events) == OPS_LOG.max_length
    assert events[0].body == b"filler 1"  # the oldest one made room
    assert events[-1].routing_key == "ops.housekeeping"


async def test_housekeeping_expires_own_records_and_reports_dead_letters(env: Env) -> None:
    config = parse_config(
        {
            "jobs": {  # disabled: only the manual run below, no catch-up of the old history
                "housekeeping": {"cron": "*/10 * * * *", "enabled": False},
                "yearly": {"cron": "0 0 1 1 *", "enabled": False},
            },
            "housekeeping": {"firing_retention_days": 30, "dead_letter_threshold": 1},
        },
        {},
    )
    old = QUIET - timedelta(days=40)
    for minutes in (0, 10, 20):  # the last of them is the job's cursor: kept
        await _history(env, "housekeeping", old + timedelta(minutes=minutes))
    await _history(env, "yearly", old)  # old, but the yearly job's cursor: kept
    # Given up, its dead letter not yet written: deleted, a later copy of the run was
    # dropped with no letter at all (found in review).
    await _history(env, "housekeeping", old + timedelta(minutes=5), letter_owed=True)
    # The re-score catalogue keeps the fan-out's horizon (a day) and a day: kept a year, each
    # daily run walked 365 times the entries it could use (review of the scheduler).
    catalogued = {"within-the-horizon": timedelta(hours=30), "past-it": timedelta(hours=50)}
    await env.collection("completed_tasks").insert_many(
        [
            {
                "_id": f"{name}-{uuid.uuid4().hex}",
                "tenant_id": "acme",
                "generation": 0,
                "completed_at": QUIET - age,
                "model": "m",
                "rubric_version": None,
            }
            for name, age in catalogued.items()
        ]
    )
    await drain(env.amqp_url, OPS_LOG.name)
    broker = make_broker(env.settings())
    async with broker:
        await broker.connect()
        await publish_dead_letter(
            broker,
            STATUS_PROJECTION,
            body=b"{}",
            headers={},
            error="a poison event for the report",
            timeout=10,
        )
    async with scheduler(env, config, handlers={"yearly": Calls()}) as (api, _):
        run = await _run_job(api, "housekeeping")

    assert run["result"]["deleted"]["firings"] == 2
    left = {d["_id"].rsplit("-", 1)[0] async for d in env.collection("completed_tasks").find()}
    assert "within-the-horizon" in left
    assert "past-it" not in left
    assert await env.collection("firings").count_documents({"job": "yearly"}) == 1
    kept = env.collection("firings").find({"job": "housekeeping", "manual": False})
    assert sorted([f["scheduled_for"] async for f in kept]) == [
        old + timedelta(minutes=5),
        old + timedelta(minutes=20),
    ]
    depths = {entry["queue"]: entry["depth"] for entry in run["result"]["dead_letters"]}
    assert depths[STATUS_PROJECTION.dead_letter_routing_key] >= 1
    assert STATUS_PROJECTION.dead_letter_routing_key in run["result"]["alerted"]
    events = await drain(env.amqp_url, OPS_LOG.name)
    kinds = [message.routing_key for message in events]
    assert kinds == ["ops.alert.dead-letters", "ops.housekeeping"]
    alert = DeadLetterAlert.model_validate_json(events[0].body)
    assert alert.run_id == run["run_id"]
    assert STATUS_PROJECTION.dead_letter_routing_key in {q.dead_letter_queue for q in alert.queues}
    (projection,) = [
        q for q in alert.queues if q.dead_letter_queue == STATUS_PROJECTION.dead_letter_routing_key
    ]
    assert projection.oldest_age_s is not None
    assert projection.oldest_age_s >= 0
    assert all(q.oldest_age_s is None for q in alert.queues if q.depth == 0)
    await drain(env.amqp_url, STATUS_PROJECTION.dead_letter_routing_key)


async def test_the_catalogue_is_expired_a_chunk_at_a_time_until_told_to_stop(env: Env) -> None:
    """One delete of every expired entry outlasted the job's deadline where a year of them
    was due at once (upgrading from the year's retention), and housekeeping failed until
    dead-lettered (re-read). What `stop` leaves is the next run's."""
    catalogue = Catalogue(env.mongo, env.database)
    prefix = f"chunked-{uuid.uuid4().hex}"
    cutoff = datetime(2029, 6, 1, tzinfo=UTC)
    await env.collection("completed_tasks").insert_many(
        [
            {
                "_id": f"{prefix}-{i}",
                "tenant_id": "acme",
                "generation": 0,
                "completed_at": cutoff - timedelta(days=400 + i),
                "model": "m",
                "rubric_version": None,
            }
            for i in range(25)
        ]
    )

    chunks: list[int] = []

    def after_the_first() -> bool:
        chunks.append(1)
        return True

    assert await catalogue.delete_completed_before(cutoff, stop=after_the_first, chunk=10) == 10
    assert await catalogue.delete_completed_before(cutoff, stop=lambda: False, chunk=10) >= 15
    left = await env.collection("completed_tasks").count_documents(
        {"_id": {"$regex": f"^{prefix}"}}
    )
    assert (left, chunks) == (0, [1])


async def test_housekeeping_deletes_the_checkpoints_of_runs_given_up_too(env: Env) -> None:
    """A run given up (its attempts spent, or 6 hours of waiting for room) never finishes:
    its checkpoint was kept for ever, one per failed run."""
    checkpoints = Checkpoints(env.mongo, env.database)
    long_ago, cutoff = datetime(2029, 1, 1, tzinfo=UTC), datetime(2029, 6, 1, tzinfo=UTC)
    for run_id in ("finished", "given-up", "running"):
        started = cutoff + timedelta(days=1) if run_id == "running" else long_ago
        await checkpoints.start_or_resume(
            run_id, job="rescore-fanout", rubric_version="v2", now=started
        )
    await checkpoints.finish("finished", now=long_ago)

    assert await checkpoints.delete_finished_before(cutoff) == 2
    assert await checkpoints.find("running") is not None
    assert await checkpoints.find("given-up") is None
