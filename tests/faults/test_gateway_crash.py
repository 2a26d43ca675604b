"""The gateway dies with `kill -9` while it records a batch, or accepts submissions.

The services reach the database through `SlowLink`, which holds its replies back for a while:
the batch's writes reach the server, but the gateway waits for their answers, so the test can
kill it between two of them (its batch record and the first chunk of its submissions written,
the rest not). The client's request ends without an answer; it replays the batch with the same
`Idempotency-Key` once the restarted gateway is up. That replay must answer the same batch, and
every item of it must be scored exactly once: those the dead gateway recorded (the outbox sweep
sends them) and those it never recorded (the replay records them).

The same for single submissions: many in flight with their keys when the gateway dies, each
replayed after the restart until answered; one task per key, each scored once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from pymongo import AsyncMongoClient

from devtools.infra import Endpoint
from services.gateway.submissions import BATCH_WRITE_CHUNK
from tests.faults.harness import (
    BoxParts,
    Figures,
    Outcome,
    Scorebox,
    essay,
    new_marker,
    repeated_calls,
    running_scorebox,
)
from tests.faults.slow_link import SlowLink
from tests.support import eventually

ITEMS = BATCH_WRITE_CHUNK + 50  # two chunks of submissions: the kill falls between them
REPLY_DELAY_S = 3.0  # how long the link holds each reply while the batch is recorded
MONGO_TIMEOUT_S = 60  # the gateway waits for the held replies instead of giving up
OUTBOX_GRACE_S = 2
WAIT_S = 180.0

Document = dict[str, Any]


@pytest.fixture(scope="module")
async def box(box_parts: BoxParts, link: SlowLink) -> AsyncIterator[Scorebox]:
    env = {
        "MONGO_TIMEOUT_S": str(MONGO_TIMEOUT_S),
        "OUTBOX_GRACE_S": str(OUTBOX_GRACE_S),
        "OUTBOX_INTERVAL_S": "1",
    }
    async with running_scorebox(box_parts, mongo_url=link.mongo_url, env=env) as running:
        yield running


@contextlib.asynccontextmanager
async def _gateway_database(box: Scorebox, mongo: Endpoint) -> AsyncIterator[Any]:
    """The gateway's database, reached directly (not through the slow link)."""
    client: AsyncMongoClient[Document] = AsyncMongoClient(mongo.url, timeoutMS=10_000)
    try:
        yield client[f"{box.stack.config.db_prefix}_gateway"]
    finally:
        await client.close()


async def _recorded(mongo: Endpoint, box: Scorebox, key: str) -> tuple[str, int] | None:
    """The batch recorded under `key` and how many of its submissions are, once at least one
    is (None before)."""
    async with _gateway_database(box, mongo) as database:
        batch = await database["batches"].find_one({"idempotency_key": key})
        if batch is None:
            return None
        count: int = await database["submissions"].count_documents({"batch_id": batch["_id"]})
        return (str(batch["_id"]), count) if count else None


async def _replayed(box: Scorebox, body: dict[str, Any], key: str) -> httpx.Response | None:
    """The replay's answer once it is not "still being accepted" (409 until the grace period
    has passed)."""
    response = await box.api.post("/v1/batches", json=body, headers={"Idempotency-Key": key})
    box.answers[response.status_code] += 1
    return None if response.status_code == 409 else response


async def _batch_done(box: Scorebox, batch_id: str) -> dict[str, Any] | None:
    response = await box.api.get(f"/v1/batches/{batch_id}", params={"limit": 1})
    if response.status_code != 200:
        return None
    page: dict[str, Any] = response.json()
    counts = page["counts"]
    return page if counts["completed"] + counts["failed"] == ITEMS else None


async def test_a_batch_cut_off_by_a_gateway_kill_is_completed_by_its_replay(
    box: Scorebox, link: SlowLink, mongo: Endpoint, figures: Figures, labels: tuple[str, str]
) -> None:
    box.answers.clear()
    warm = new_marker()
    await box.finish([await box.submit(essay(warm))])  # the key is cached, the stack warm

    markers = [new_marker() for _ in range(ITEMS)]
    body = {"items": [{"text": essay(m)} for m in markers]}
    key = f"crash-{uuid.uuid4().hex[:8]}"
    link.reply_delay_s = REPLY_DELAY_S
    try:
        request = asyncio.create_task(
            box.api.post("/v1/batches", json=body, headers={"Idempotency-Key": key})
        )
        batch_id, recorded = await eventually(
            functools.partial(_recorded, mongo, box, key),
            timeout_s=WAIT_S,
            what="the batch and its first submissions written",
        )
        await box.kill("gateway")
    finally:
        link.reply_delay_s = 0
    try:
        answered: httpx.Response | None = await request
    except httpx.HTTPError:
        answered = None  # cut off by the kill: the client got no answer
    assert answered is None, f"answered before the kill: {answered.status_code}"
    async with _gateway_database(box, mongo) as database:
        recorded = await database["submissions"].count_documents({"batch_id": batch_id})

    killed_at = time.monotonic()
    await box.restart("gateway")
    replay = await eventually(
        functools.partial(_replayed, box, body, key), timeout_s=WAIT_S, what="the replay"
    )
    recovered_in = time.monotonic() - killed_at
    page = await eventually(
        functools.partial(_batch_done, box, batch_id), timeout_s=WAIT_S, what="every item done"
    )

    calls = [box.calls(m) for m in markers]
    figures.record(
        Outcome(
            name="gateway killed (kill -9) while recording a batch",
            accepted=ITEMS,
            completed=page["counts"]["completed"],
            failed=page["counts"]["failed"],
            duplicate_model_calls=repeated_calls({m: box.calls(m) - 1 for m in markers}),
            http_5xx_seen=box.http_5xx(),
            time_to_recover_s=round(recovered_in, 2),
            broker=labels[0],
            database=labels[1],
            notes=f"a batch of {ITEMS} with an Idempotency-Key; the gateway killed after "
            f"recording the batch and {recorded} of its submissions (database replies held "
            f"{REPLY_DELAY_S} s by a TCP proxy to make the window); the client replayed it "
            f"after the restart: answered {replay.status_code} with the same batch, whose "
            f"missing {ITEMS - recorded} submissions the replay recorded; every item scored "
            "once; time to recover = kill until the replay's answer",
        )
    )
    assert 0 < recorded < ITEMS, f"the kill did not fall inside the batch: {recorded} recorded"
    assert replay.status_code == 200, replay.text
    assert replay.json()["batch_id"] == batch_id
    assert page["counts"]["completed"] == ITEMS, page["counts"]
    assert calls == [1] * ITEMS, [(m, n) for m, n in zip(markers, calls, strict=True) if n != 1]
    assert box.answers[500] == 0, box.answers


SUBMISSIONS = 24


def _counted(statuses: Counter[int]) -> str:
    return ", ".join(f"{status}: {n}" for status, n in sorted(statuses.items()))


async def _recorded_submissions(mongo: Endpoint, box: Scorebox, markers: list[str]) -> int | None:
    """How many of the submissions carrying `markers` are recorded, once half of them are."""
    async with _gateway_database(box, mongo) as database:
        pattern = "|".join(markers)
        count: int = await database["submissions"].count_documents(
            {"command.text": {"$regex": pattern}}
        )
    return count if count >= len(markers) // 2 else None


async def _settled(box: Scorebox, marker: str, key: str, replies: Counter[int]) -> str | None:
    """Submit (or replay) one request until it is answered 202 or 200; its task id."""
    response = await box.post(essay(marker), use_cache=False, headers={"Idempotency-Key": key})
    replies[response.status_code] += 1
    if response.status_code in (202, 200):
        task_id: str = response.json()["task_id"]
        return task_id
    assert response.status_code in (409, 503), response.text  # in progress, or not yet up
    return None


async def test_submissions_cut_off_by_a_gateway_kill_are_scored_once_when_replayed(
    box: Scorebox, link: SlowLink, mongo: Endpoint, figures: Figures, labels: tuple[str, str]
) -> None:
    box.answers.clear()
    markers = [new_marker() for _ in range(SUBMISSIONS)]
    keys = {m: f"crash-{m}" for m in markers}
    link.reply_delay_s = REPLY_DELAY_S
    try:
        requests = {
            m: asyncio.create_task(
                box.post(essay(m), use_cache=False, headers={"Idempotency-Key": keys[m]})
            )
            for m in markers
        }
        recorded = await eventually(
            functools.partial(_recorded_submissions, mongo, box, markers),
            timeout_s=WAIT_S,
            what="half of the submissions written",
        )
        await box.kill("gateway")
    finally:
        link.reply_delay_s = 0
    answered: dict[str, str] = {}
    for marker, request in requests.items():
        with contextlib.suppress(httpx.HTTPError):
            response = await request
            if response.status_code == 202:
                answered[marker] = response.json()["task_id"]

    killed_at = time.monotonic()
    await box.restart("gateway")
    replies: Counter[int] = Counter()
    settled = {
        m: await eventually(
            functools.partial(_settled, box, m, keys[m], replies),
            timeout_s=WAIT_S,
            what=f"replay {m}",
        )
        for m in markers
    }
    recovered_in = time.monotonic() - killed_at
    views = await box.finish(settled.values())

    calls = [box.calls(m) for m in markers]
    extra = box.calls_beyond_attempts({t: m for m, t in settled.items()}, views)
    statuses = [views[t]["status"] for t in settled.values()]
    figures.record(
        Outcome(
            name="gateway killed (kill -9) while accepting submissions",
            accepted=len(settled),
            completed=statuses.count("completed"),
            failed=statuses.count("failed"),
            duplicate_model_calls=repeated_calls(extra),
            http_5xx_seen=box.http_5xx(),
            time_to_recover_s=round(recovered_in, 2),
            broker=labels[0],
            database=labels[1],
            notes=f"{SUBMISSIONS} submissions with Idempotency-Keys in flight (database replies "
            f"held {REPLY_DELAY_S} s by a TCP proxy), the gateway killed once {recorded} were "
            f"recorded; {len(answered)} answered before the kill; every request replayed after "
            "the restart with its key until answered 202 (not recorded) or 200 (recorded "
            "before the kill; 409 while its record waits for the outbox sweep), answered "
            f"{_counted(replies)}: one task per key, each scored once; time to recover = kill "
            "until the last replay's answer",
        )
    )
    assert recorded >= SUBMISSIONS // 2
    assert all(settled[m] == task_id for m, task_id in answered.items()), (answered, settled)
    assert len(set(settled.values())) == SUBMISSIONS
    assert statuses == ["completed"] * SUBMISSIONS, views
    assert calls == [1] * SUBMISSIONS, dict(zip(markers, calls, strict=True))
    assert box.answers[500] == 0, box.answers
