"""The cron dead-letter admin routes on the real broker and database: a run given up for good
is listed (not consumed), replayed as a new run that reaches its end and leaves the DLQ, a
letter of a job no longer configured is refused and kept, one run's letters are dropped (the
others kept as they were), a purge empties the queue, a walk cut short by its byte budget is
reported as such, the admin key is required, and a broker away is a 503 that changes nothing.

The scheduler runs in-process (`test_scheduler.scheduler`) with a frozen clock; letters come
from a job that gives up, or are published to the DLQ as the job consumer does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from functools import partial
from typing import Any

import aio_pika
import httpx
import pytest
from aiormq.abc import FieldTable
from fastapi import FastAPI
from pydantic import SecretStr

from services.scheduler.api import cron_dead_letter_routes
from services.scheduler.config import parse_config
from services.scheduler.dead_letters import CronDeadLetters, ReplayRun
from services.scheduler.dispatcher import fire_replay
from services.scheduler.errors import DispatchFailed, PermanentJobError
from services.scheduler.firings import Firing, Firings
from services.scheduler.jobs import JobOutcome, JobRun
from services.scheduler.messaging import SchedulerBus
from services.scheduler.schedule import JobCatalog
from shared.bus import publish_dead_letter
from shared.contracts import RunCronJob, new_id
from shared.dead_letters import DeadLetterWalker, dead_lettered_at
from shared.http import PROBLEM_JSON, install_problem_handlers
from shared.query_parameters import only_known_query_parameters
from shared.runtime import make_broker
from shared.topology import CRON_JOBS
from tests.faults.slow_link import SlowLink
from tests.integration import test_scheduler
from tests.integration.test_scheduler import ADMIN_KEY, QUIET, Env, firing_state, scheduler
from tests.support import drain, eventually, running

mongo_client = test_scheduler.mongo_client  # fixtures
topology = test_scheduler.topology
env = test_scheduler.env

DLQ = CRON_JOBS.dead_letter_routing_key
LETTERS = "/admin/v1/cron/dead-letters"
REPLAY = f"{LETTERS}/replay"
JOB = "probe"
CONFIG = parse_config({"jobs": {JOB: {"cron": "0 3 * * *", "enabled": False}}}, {})
OVERLAPPING = parse_config(
    {"jobs": {JOB: {"cron": "0 3 * * *", "enabled": False, "concurrency": "allow"}}}, {}
)

Json = dict[str, Any]


class Probe:
    """A job that fails for good on its first `gives_up` runs and succeeds on the others."""

    def __init__(self, gives_up: int = 0) -> None:
        self.gives_up = gives_up
        self.runs: list[JobRun] = []

    async def __call__(self, run: JobRun) -> JobOutcome:
        self.runs.append(run)
        if len(self.runs) <= self.gives_up:
            raise PermanentJobError("the probe is misconfigured")
        return JobOutcome(summary={"runs": len(self.runs)})


def _dead_run(job: str = JOB) -> RunCronJob:
    return RunCronJob(
        task_id=new_id(), job=job, scheduled_for=QUIET, fired_at=QUIET, manual=False, slice=2
    )


async def _dead_letter(
    env: Env,
    body: RunCronJob | bytes,
    *,
    reason: str = "gave up",
    earlier_death: datetime | None = None,
) -> None:
    """A letter as the job consumer dead-letters a run (`keep_dead_lettering`); with
    `earlier_death`, the run had waited on the retry ladder first (an `x-death` of then)."""
    death = {"queue": "scorebox.wait.1s", "reason": "expired", "time": earlier_death}
    broker = make_broker(env.settings())
    async with broker:
        await broker.connect()
        await publish_dead_letter(
            broker,
            CRON_JOBS,
            body=body if isinstance(body, bytes) else body.model_dump_json().encode(),
            headers={} if earlier_death is None else {"x-death": [death]},
            error=reason,
            timeout=10,
            message_id=new_id(),
            correlation_id=None if isinstance(body, bytes) else body.run_id,
        )


async def _dead_lettered_by_rabbitmq(env: Env, run: RunCronJob, *, at: datetime) -> None:
    """A letter as RabbitMQ dead-letters a run itself (at the delivery limit): no reason of
    ours, its time in `x-death`."""
    death: FieldTable = {"queue": CRON_JOBS.name, "reason": "delivery_limit", "time": at}
    connection = await aio_pika.connect(env.amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel()
        message = aio_pika.Message(
            run.model_dump_json().encode(), message_id=new_id(), headers={"x-death": [death]}
        )
        await channel.default_exchange.publish(message, routing_key=DLQ, timeout=10)


async def _depth(amqp_url: str) -> int:
    """The DLQ's depth, read beside the scheduler (a passive declaration)."""
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(DLQ, passive=True, timeout=10)
        return int(declared.declaration_result.message_count or 0)


async def _listed(api: httpx.AsyncClient) -> Json:
    answer = await api.get(LETTERS)
    assert answer.status_code == 200, answer.text
    body: Json = answer.json()
    assert body["count"] == len(body["items"])
    return body


def _run_ids(listing: Json) -> list[str]:
    return [item["run_id"] for item in listing["items"]]


def _assert_problem(answer: httpx.Response, status: int) -> Json:
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"].startswith(PROBLEM_JSON)
    body: Json = answer.json()
    assert body["status"] == status
    return body


async def test_a_run_given_up_is_listed_then_replayed_as_a_new_run(env: Env) -> None:
    await drain(env.amqp_url, DLQ)
    job = Probe(gives_up=1)
    async with scheduler(env, CONFIG, handlers={JOB: job}) as (api, _):
        accepted = (await api.post(f"/admin/v1/cron/jobs/{JOB}/run")).json()
        dead = await firing_state(api, accepted["run_id"], "failed")

        async def listed_once() -> Json | None:
            listing = await _listed(api)
            return listing if listing["count"] else None

        listing = await eventually(listed_once, what="the given-up run in the DLQ")
        (letter,) = listing["items"]
        assert (letter["run_id"], letter["job"], letter["job_configured"]) == (
            dead["run_id"],
            JOB,
            True,
        )
        assert letter["scheduled_for"] == dead["scheduled_for"]
        assert letter["fired_at"] == dead["fired_at"]
        assert letter["manual"] is True
        assert letter["reason"] == dead["error"]
        assert "misconfigured" in letter["reason"]
        assert letter["dead_lettered_at"] is not None
        assert listing["truncated"] is False
        assert _run_ids(await _listed(api)) == [dead["run_id"]]  # looking consumed nothing

        answer = await api.post(REPLAY, json={"run_ids": [dead["run_id"]]})
        assert answer.status_code == 200, answer.text
        report = answer.json()
        (replayed,) = report["replayed"]
        assert (replayed["dead_run_id"], replayed["job"]) == (dead["run_id"], JOB)
        assert replayed["started_now"] is True
        assert replayed["run_id"] != dead["run_id"]
        assert replayed["status_url"] == f"/admin/v1/cron/runs/{replayed['run_id']}"
        assert (report["skipped_unreadable"], report["not_found"]) == ([], [])

        done = await firing_state(api, replayed["run_id"], "succeeded")
        assert (done["replay_of"], done["manual"], done["result"]) == (
            dead["run_id"],
            True,
            {"runs": 2},
        )
        again = (await api.get(f"/admin/v1/cron/runs/{dead['run_id']}")).json()
        assert (again["state"], again["replayed_as"]) == ("failed", replayed["run_id"])
        assert (await _listed(api))["count"] == 0
    assert [run.run_id for run in job.runs] == [dead["run_id"], replayed["run_id"]]
    assert await _depth(env.amqp_url) == 0


async def test_a_run_replayed_already_is_not_run_again(env: Env) -> None:
    """Two copies of one letter (or a letter whose ack after its replay was lost)."""
    await drain(env.amqp_url, DLQ)
    dead = _dead_run()
    await _dead_letter(env, dead)
    await _dead_letter(env, dead)
    job = Probe()
    async with scheduler(env, CONFIG, handlers={JOB: job}) as (api, _):
        answer = await api.post(REPLAY, json={"all": True})
        assert answer.status_code == 200, answer.text
        replayed = answer.json()["replayed"]
        assert [r["dead_run_id"] for r in replayed] == [dead.run_id, dead.run_id]
        assert [r["started_now"] for r in replayed] == [True, False]
        assert replayed[0]["run_id"] == replayed[1]["run_id"]
        await firing_state(api, replayed[0]["run_id"], "succeeded")
        assert (await _listed(api))["count"] == 0
    assert [run.run_id for run in job.runs] == [replayed[0]["run_id"]]


async def test_a_letter_of_a_job_no_longer_configured_is_refused_and_kept(env: Env) -> None:
    await drain(env.amqp_url, DLQ)
    retired, kept = _dead_run("retired-job"), _dead_run()
    await _dead_letter(env, retired)
    await _dead_letter(env, kept)
    await _dead_letter(env, b"not a cron run", reason="unreadable cron.run")
    job = Probe()
    async with scheduler(env, CONFIG, handlers={JOB: job}) as (api, _):
        listing = await _listed(api)
        assert listing["count"] == 3
        by_run = {item["run_id"]: item for item in listing["items"]}
        assert by_run[retired.run_id]["job_configured"] is False
        assert by_run[kept.run_id]["job_configured"] is True
        assert (by_run[kept.run_id]["slice"], by_run[kept.run_id]["manual"]) == (2, False)
        unreadable = by_run[None]
        assert (unreadable["job"], unreadable["body_preview"]) == (None, "not a cron run")

        refused = _assert_problem(
            await api.post(REPLAY, json={"run_ids": [kept.run_id, retired.run_id]}), 409
        )
        assert refused["type"].endswith("/unknown-job")
        assert refused["runs"] == {retired.run_id: "retired-job"}
        assert retired.run_id in refused["detail"]
        assert (await _listed(api))["count"] == 3  # every letter kept, nothing run
        assert job.runs == []

        answer = await api.post(REPLAY, json={"run_ids": [kept.run_id, "no-such-run"]})
        assert answer.status_code == 200, answer.text
        report = answer.json()
        assert [r["dead_run_id"] for r in report["replayed"]] == [kept.run_id]
        assert report["not_found"] == ["no-such-run"]
        await firing_state(api, report["replayed"][0]["run_id"], "succeeded")

        left = await _listed(api)
        assert sorted(_run_ids(left), key=str) == sorted([retired.run_id, None], key=str)
        _assert_problem(await api.post(REPLAY, json={"run_ids": [retired.run_id]}), 409)
        assert (await _listed(api))["count"] == 2


async def test_a_replay_of_all_skips_the_letters_of_jobs_no_longer_configured(env: Env) -> None:
    """One retired job's letter does not hold back the others' (it is kept and reported)."""
    await drain(env.amqp_url, DLQ)
    retired, kept = _dead_run("retired-job"), _dead_run()
    await _dead_letter(env, retired)
    await _dead_letter(env, kept)
    job = Probe()
    async with scheduler(env, CONFIG, handlers={JOB: job}) as (api, _):
        answer = await api.post(REPLAY, json={"all": True})
        assert answer.status_code == 200, answer.text
        report = answer.json()
        assert [r["dead_run_id"] for r in report["replayed"]] == [kept.run_id]
        assert report["skipped_unconfigured"] == [retired.run_id]
        await firing_state(api, report["replayed"][0]["run_id"], "succeeded")
        assert _run_ids(await _listed(api)) == [retired.run_id]
    assert await _depth(env.amqp_url) == 1
    await drain(env.amqp_url, DLQ)


async def test_the_letters_of_a_job_its_settings_leave_unable_to_run_are_kept(env: Env) -> None:
    """The fan-out without `RUBRIC_VERSION`: asked for by id, the replay is refused and
    nothing runs; a replay of all skips its letter and replays the others. Replayed, it
    failed at once into the DLQ again."""
    await drain(env.amqp_url, DLQ)
    fanout, kept = _dead_run("rescore-fanout"), _dead_run()
    await _dead_letter(env, fanout)
    await _dead_letter(env, kept)
    config = parse_config(
        {
            "jobs": {
                JOB: {"cron": "0 3 * * *", "enabled": False},
                "rescore-fanout": {"cron": "0 3 * * *", "enabled": False},
            }
        },
        {},
    )
    job = Probe()
    async with scheduler(env, config, handlers={JOB: job}) as (api, _):
        refused = _assert_problem(await api.post(REPLAY, json={"run_ids": [fanout.run_id]}), 409)
        assert refused["runs"] == {fanout.run_id: "rescore-fanout"}
        listed = await _listed(api)
        assert listed["count"] == 2
        # The listing says so: it said "configured" of a letter the replay refuses (review).
        configured = {item["run_id"]: item["job_configured"] for item in listed["items"]}
        assert configured == {fanout.run_id: False, kept.run_id: True}

        report = (await api.post(REPLAY, json={"all": True})).json()
        assert [r["dead_run_id"] for r in report["replayed"]] == [kept.run_id]
        assert report["skipped_unconfigured"] == [fanout.run_id]
        await firing_state(api, report["replayed"][0]["run_id"], "succeeded")
        assert _run_ids(await _listed(api)) == [fanout.run_id]
    await drain(env.amqp_url, DLQ)


@pytest.mark.parametrize("selection", [{"all": "true"}, {"all": 1}], ids=["string", "number"])
async def test_a_replay_of_all_needs_a_json_boolean_and_replays_nothing_otherwise(
    env: Env, selection: Json
) -> None:
    """ "true" and 1 were read as `all: true` (and "no" or 0 as false)."""
    await drain(env.amqp_url, DLQ)
    await _dead_letter(env, _dead_run())
    async with scheduler(env, CONFIG, handlers={JOB: Probe()}) as (api, _):
        _assert_problem(await api.post(REPLAY, json=selection), 422)
        assert (await _listed(api))["count"] == 1
    assert await _depth(env.amqp_url) == 1
    await drain(env.amqp_url, DLQ)


async def test_an_unreadable_letter_is_skipped_and_kept(env: Env) -> None:
    await drain(env.amqp_url, DLQ)
    await _dead_letter(env, b"{}", reason="unreadable cron.run")
    async with scheduler(env, CONFIG, handlers={JOB: Probe()}) as (api, _):
        answer = await api.post(REPLAY, json={"all": True})
        assert answer.status_code == 200, answer.text
        report = answer.json()
        assert report["replayed"] == []
        assert len(report["skipped_unreadable"]) == 1
        assert (await _listed(api))["count"] == 1


async def test_a_letter_whose_run_the_broker_did_not_confirm_is_kept(env: Env) -> None:
    """The letter leaves the DLQ only once its new run is confirmed."""
    await drain(env.amqp_url, DLQ)
    await _dead_letter(env, _dead_run())
    sent: list[str] = []

    async def refused(dead: RunCronJob) -> tuple[Firing, bool]:
        sent.append(dead.run_id)
        raise DispatchFailed("the broker did not accept the run")

    broker = make_broker(env.settings())
    async with broker:
        await broker.connect()
        letters = CronDeadLetters(
            DeadLetterWalker(broker, CRON_JOBS, timeout_s=10),
            jobs=JobCatalog.from_config(CONFIG.jobs),
            replay_run=refused,
            clock=env.clock,
        )
        with pytest.raises(DispatchFailed):
            await letters.replay(None)
        assert len(sent) == 1
        assert len((await letters.letters()).letters) == 1
    assert await _depth(env.amqp_url) == 1
    await drain(env.amqp_url, DLQ)


async def test_letters_are_listed_oldest_first_and_purged(env: Env) -> None:
    await drain(env.amqp_url, DLQ)
    runs = [_dead_run(), _dead_run("retired-job"), _dead_run()]
    hours = [2, 0, 1]  # published in this order, dead-lettered in another
    for run, hour in zip(runs, hours, strict=True):
        await _dead_lettered_by_rabbitmq(env, run, at=datetime(2029, 12, 31, hour, tzinfo=UTC))
    async with scheduler(env, CONFIG, handlers={JOB: Probe()}) as (api, _):
        listing = await _listed(api)
        assert _run_ids(listing) == [runs[1].run_id, runs[2].run_id, runs[0].run_id]
        assert [item["dead_lettered_at"][:13] for item in listing["items"]] == [
            "2029-12-31T00",
            "2029-12-31T01",
            "2029-12-31T02",
        ]
        purged = await api.delete(LETTERS)
        assert purged.status_code == 200, purged.text
        assert purged.json() == {"purged": 3}
        assert (await _listed(api))["count"] == 0
    assert await _depth(env.amqp_url) == 0


async def test_dropping_a_run_leaves_the_other_letters_as_they_were(env: Env) -> None:
    """The way out for a letter whose job is no longer configured, which replay refuses."""
    await drain(env.amqp_url, DLQ)
    runs = [_dead_run(), _dead_run("retired-job"), _dead_run()]
    for hour, run in enumerate(runs):
        await _dead_lettered_by_rabbitmq(env, run, at=datetime(2029, 12, 31, hour, tzinfo=UTC))
    job = Probe()
    async with scheduler(env, CONFIG, handlers={JOB: job}) as (api, _):
        _assert_problem(await api.post(REPLAY, json={"run_ids": [runs[1].run_id]}), 409)
        answer = await api.delete(f"{LETTERS}/{runs[1].run_id}")
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"run_id": runs[1].run_id, "removed": 1, "truncated": False}
        assert _run_ids(await _listed(api)) == [runs[0].run_id, runs[2].run_id]
    left = await drain(env.amqp_url, DLQ)
    assert [RunCronJob.model_validate_json(letter.body) for letter in left] == [runs[0], runs[2]]
    assert [dead_lettered_at(letter, QUIET) for letter in left] == [
        datetime(2029, 12, 31, hour, tzinfo=UTC) for hour in (0, 2)
    ]
    assert job.runs == []


async def test_dropping_a_run_held_twice_removes_both_copies(env: Env) -> None:
    await drain(env.amqp_url, DLQ)
    twice, other = _dead_run(), _dead_run()
    for run in (twice, other, twice):
        await _dead_letter(env, run)
    job = Probe()
    async with scheduler(env, CONFIG, handlers={JOB: job}) as (api, _):
        answer = await api.delete(f"{LETTERS}/{twice.run_id}")
        assert answer.status_code == 200, answer.text
        assert (answer.json()["removed"], answer.json()["truncated"]) == (2, False)
        assert _run_ids(await _listed(api)) == [other.run_id]
    assert await _depth(env.amqp_url) == 1
    assert job.runs == []
    await drain(env.amqp_url, DLQ)


async def test_a_letter_that_holds_no_run_is_dropped_by_its_message_id(env: Env) -> None:
    await drain(env.amqp_url, DLQ)
    await _dead_letter(env, b"not a cron run", reason="unreadable cron.run")
    await _dead_letter(env, _dead_run())
    async with scheduler(env, CONFIG, handlers={JOB: Probe()}) as (api, _):
        (unreadable,) = [item for item in (await _listed(api))["items"] if item["run_id"] is None]
        answer = await api.delete(f"{LETTERS}/{unreadable['message_id']}")
        assert answer.status_code == 200, answer.text
        assert answer.json()["removed"] == 1
        assert None not in _run_ids(await _listed(api))
    assert await _depth(env.amqp_url) == 1
    await drain(env.amqp_url, DLQ)


async def test_dropping_an_unknown_run_is_a_404_and_changes_nothing(env: Env) -> None:
    await drain(env.amqp_url, DLQ)
    runs = [_dead_run(), _dead_run()]
    for hour, run in enumerate(runs):
        await _dead_lettered_by_rabbitmq(env, run, at=datetime(2029, 12, 31, hour, tzinfo=UTC))
    async with scheduler(env, CONFIG, handlers={JOB: Probe()}) as (api, _):
        problem = _assert_problem(await api.delete(f"{LETTERS}/no-such-run"), 404)
        assert "nothing was removed" in problem["detail"]
        # What a walk cannot see: a letter another walk holds at that moment.
        assert "another scheduler replica" in problem["detail"]
        assert "dead-letter depth probe" in problem["detail"]
        assert _run_ids(await _listed(api)) == [run.run_id for run in runs]
    left = await drain(env.amqp_url, DLQ)
    assert [RunCronJob.model_validate_json(letter.body) for letter in left] == runs


@asynccontextmanager
async def _walking_part_of_the_queue(
    env: Env, *, max_bytes: int, failing_after: int | None = None
) -> AsyncIterator[httpx.AsyncClient]:
    """The cron dead-letter routes over a walk of `max_bytes` of letter bodies (the
    scheduler's own walks the service's bound), replaying as the scheduler does; the job may
    overlap itself, so that every letter reached is replayed. Given `failing_after`, the
    replays after that many fail as a broker refusing the run's publish does."""
    firings = Firings(env.mongo, env.database)
    await firings.ensure_indexes()
    jobs = JobCatalog.from_config(OVERLAPPING.jobs)
    broker = make_broker(env.settings())
    async with broker:
        await broker.connect()
        replay_run: ReplayRun = partial(
            fire_replay,
            jobs=jobs,
            firings=firings,
            publish=SchedulerBus(broker, 10, env.clock).publish_run,
            clock=env.clock,
            owner="bounded",
        )
        if failing_after is not None:
            replay_run = _failing_after(replay_run, failing_after)
        walker = DeadLetterWalker(broker, CRON_JOBS, timeout_s=10, max_bytes=max_bytes)
        dead_letters = CronDeadLetters(walker, jobs=jobs, replay_run=replay_run, clock=env.clock)
        app = FastAPI(dependencies=[only_known_query_parameters()])  # as the services'
        install_problem_handlers(app)
        app.include_router(
            cron_dead_letter_routes(dead_letters=dead_letters, admin_key=SecretStr(ADMIN_KEY))
        )
        async with running(app) as api:
            api.headers["Authorization"] = f"Bearer {ADMIN_KEY}"
            yield api


def _failing_after(replay_run: ReplayRun, replays: int) -> ReplayRun:
    done = 0

    async def replay(run: RunCronJob) -> tuple[Firing, bool]:
        nonlocal done
        if done == replays:
            raise DispatchFailed("run not published: the broker did not confirm it")
        done += 1
        return await replay_run(run)

    return replay


async def test_a_replay_the_broker_fails_part_way_reports_what_it_did_and_what_it_left(
    env: Env,
) -> None:
    """It answered 503 though a run had been replayed and its letter removed: the retry
    the 503 asked for reported that run `not_found`."""
    await drain(env.amqp_url, DLQ)
    runs = [_dead_run() for _ in range(3)]
    for run in runs:
        await _dead_letter(env, run)
    asked = [run.run_id for run in runs]
    everything = 10 * _three_of_five_letters()
    async with _walking_part_of_the_queue(env, max_bytes=everything, failing_after=1) as api:
        answer = await api.post(REPLAY, json={"run_ids": asked})
        assert answer.status_code == 200, answer.text
        report = answer.json()
        assert [letter["dead_run_id"] for letter in report["replayed"]] == asked[:1]
        assert sorted(report["not_reached"]) == sorted(asked[1:])
        assert (report["not_found"], report["timed_out"]) == ([], False)
        assert report["interrupted"] == (
            "run not published: the broker did not confirm it; try again shortly."
        )
        assert await _depth(env.amqp_url) == 2
    async with _walking_part_of_the_queue(env, max_bytes=everything, failing_after=0) as api:
        problem = _assert_problem(await api.post(REPLAY, json={"run_ids": asked}), 503)
    assert "did not confirm" in problem["detail"]
    assert await _depth(env.amqp_url) == 2  # failing before any replay: nothing changed
    await drain(env.amqp_url, CRON_JOBS.name)
    await drain(env.amqp_url, DLQ)


def _three_of_five_letters() -> int:
    """A walk budget that reaches three of five letters of `_dead_run`'s size."""
    return int(2.5 * len(_dead_run().model_dump_json().encode()))


async def test_a_replay_by_run_ids_cut_short_reports_the_runs_it_did_not_reach(env: Env) -> None:
    """The two letters past the walk and a run id no letter carries are not reached, none of
    them "not found" (it was: an operator was told a letter past the walk did not exist)."""
    await drain(env.amqp_url, DLQ)
    runs = [_dead_run() for _ in range(5)]
    for run in runs:
        await _dead_letter(env, run)
    asked = [run.run_id for run in runs]
    async with _walking_part_of_the_queue(env, max_bytes=_three_of_five_letters()) as api:
        answer = await api.post(REPLAY, json={"run_ids": [*asked, "no-such-run"]})
    await drain(env.amqp_url, CRON_JOBS.name)  # the replays' runs, whatever follows
    assert answer.status_code == 200, answer.text
    report = answer.json()
    assert (report["truncated"], report["not_found"]) == (True, [])
    replayed = [letter["dead_run_id"] for letter in report["replayed"]]
    assert len(replayed) == 3
    assert sorted(report["not_reached"]) == sorted(
        [run_id for run_id in asked if run_id not in replayed] + ["no-such-run"]
    )
    assert await _depth(env.amqp_url) == 2
    await drain(env.amqp_url, DLQ)


async def test_dropping_a_run_past_a_walk_cut_short_is_a_409_not_reached(env: Env) -> None:
    await drain(env.amqp_url, DLQ)
    for _ in range(5):
        await _dead_letter(env, _dead_run())
    async with _walking_part_of_the_queue(env, max_bytes=_three_of_five_letters()) as api:
        problem = _assert_problem(await api.delete(f"{LETTERS}/no-such-run"), 409)
    assert problem["type"].endswith("/not-reached")
    assert problem["walked"] == 3
    assert "may lie past" in problem["detail"]
    assert await _depth(env.amqp_url) == 5
    await drain(env.amqp_url, DLQ)


@pytest.mark.parametrize("path", [f"{LETTERS}/", f"{LETTERS}//"], ids=["slash", "slashes"])
async def test_a_drop_with_an_empty_run_id_never_reaches_the_purge(env: Env, path: str) -> None:
    """`DELETE /admin/v1/cron/dead-letters/` (a script's drop of an empty run id) was
    redirected (307) to the purge, and a client following redirects keeps the method and the
    key: every dead run was purged. The scheduler answers it itself now; nothing is removed."""
    await drain(env.amqp_url, DLQ)
    run = _dead_run()
    await _dead_letter(env, run)
    # Asserted once the scheduler has stopped: its lifespan does not stop it on an error.
    async with scheduler(env, CONFIG, handlers={JOB: Probe()}) as (api, _):
        answer = await api.delete(path, follow_redirects=True)
        listed = await api.get(LETTERS)
    assert answer.status_code in (404, 405), answer.text
    assert answer.history == []
    assert _run_ids(listed.json()) == [run.run_id]
    assert await _depth(env.amqp_url) == 1
    await drain(env.amqp_url, DLQ)


async def test_the_cron_dead_letter_routes_need_the_admin_key(env: Env) -> None:
    await drain(env.amqp_url, DLQ)
    run = _dead_run()
    await _dead_letter(env, run)
    async with scheduler(env, CONFIG, handlers={JOB: Probe()}) as (api, _):
        for authorization in ("", "Bearer not-the-admin-key", ADMIN_KEY):
            for method, path, body in (
                ("GET", LETTERS, None),
                ("POST", REPLAY, {"all": True}),
                ("DELETE", f"{LETTERS}/{run.run_id}", None),
                ("DELETE", LETTERS, None),
            ):
                answer = await api.request(
                    method, path, json=body, headers={"Authorization": authorization}
                )
                _assert_problem(answer, 401)
                assert answer.headers["www-authenticate"].startswith("Bearer")
        assert (await _listed(api))["count"] == 1
    assert await _depth(env.amqp_url) == 1
    await drain(env.amqp_url, DLQ)


async def test_the_cron_dead_letter_routes_answer_503_while_the_broker_is_away(
    env: Env, broker_link: SlowLink
) -> None:
    await drain(env.amqp_url, DLQ)
    run = _dead_run()
    await _dead_letter(env, run)
    link = broker_link
    settings = {"RABBITMQ_URL": link.url_through(env.amqp_url), "BROKER_TIMEOUT_S": 1}
    async with scheduler(env, CONFIG, handlers={JOB: Probe()}, **settings) as (api, _):
        assert (await _listed(api))["count"] == 1
        await link.cut()

        async def broker_down() -> bool:
            return (await api.get("/readyz")).status_code == 503

        await eventually(broker_down, what="the scheduler saw the broker go")
        for method, path, body in (
            ("GET", LETTERS, None),
            ("POST", REPLAY, {"all": True}),
            ("DELETE", f"{LETTERS}/{run.run_id}", None),
            ("DELETE", LETTERS, None),
        ):
            async with asyncio.timeout(60):  # only stops a hang
                answer = await api.request(method, path, json=body)
            problem = _assert_problem(answer, 503)
            assert problem["type"].endswith("/broker-unavailable")
            assert "Retry-After" in answer.headers
        link.down = False  # the scheduler stops on a broker that is back
    assert await _depth(env.amqp_url) == 1  # nothing replayed, nothing purged
    await drain(env.amqp_url, DLQ)


class BothLookFirst(Firings):
    """The firings, where the first two looks for a run's replay both answer before either
    replica claims one: two replicas, each holding a copy of the letter, at the same time."""

    def __init__(self, env: Env) -> None:
        super().__init__(env.mongo, env.database)
        self.looked = 0
        self.both_looked = asyncio.Event()

    async def replayed_as(self, run_id: str) -> Firing | None:
        found = await super().replayed_as(run_id)
        self.looked += 1
        if self.looked == 2:
            self.both_looked.set()
        if self.looked <= 2:
            await self.both_looked.wait()
        return found


async def test_two_replicas_replaying_copies_of_one_run_at_once_start_one_run(env: Env) -> None:
    """Both find no replay yet; the firings' unique `replay_of` lets one of them start a run,
    and the other answers with it."""
    firings = BothLookFirst(env)
    await firings.ensure_indexes()
    dead = _dead_run()
    broker = make_broker(env.settings())
    async with broker:
        await broker.connect()
        bus = SchedulerBus(broker, 10, env.clock)

        async def replay(owner: str) -> tuple[Firing, bool]:
            return await fire_replay(
                dead,
                jobs=JobCatalog.from_config(CONFIG.jobs),
                firings=firings,
                publish=bus.publish_run,
                clock=env.clock,
                owner=owner,
            )

        async with asyncio.timeout(30):
            answers = await asyncio.gather(replay("one"), replay("other"))
    assert sorted(started for _, started in answers) == [False, True]
    assert answers[0][0].run_id == answers[1][0].run_id
    assert answers[0][0].replay_of == dead.run_id
    started = await drain(env.amqp_url, CRON_JOBS.name)
    assert [RunCronJob.model_validate_json(m.body).run_id for m in started] == [
        answers[0][0].run_id
    ]


async def test_a_run_given_up_after_a_retry_is_listed_at_its_give_up(env: Env) -> None:
    """A retried run waited on the ladder, whose `x-death` it carries into the letter: the
    letter was dead-lettered when the scheduler gave it up, not when that wait ended."""
    await drain(env.amqp_url, DLQ)
    await _dead_letter(env, _dead_run(), earlier_death=datetime(2020, 1, 1, tzinfo=UTC))
    async with scheduler(env, CONFIG, handlers={JOB: Probe()}) as (api, _):
        (letter,) = (await _listed(api))["items"]
    assert letter["dead_lettered_at"][:4] != "2020"
    assert letter["reason"] == "gave up"
    await drain(env.amqp_url, DLQ)
