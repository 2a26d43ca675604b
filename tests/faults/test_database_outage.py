"""MongoDB stops while tasks are in flight, then comes back on the same address.

The database is a MongoDB stand-in of this test's own (mongoeco's wire-protocol server, NOT
MongoDB), because the test must stop and start it. It runs on its sqlite engine with a file,
so like a MongoDB server it keeps its data across the restart: on its memory engine everything
would be gone afterwards, API keys and indexes included, and the test could check nothing but
that the services answer again.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from devtools.infra import standin_label
from shared.http import PROBLEM_JSON
from tests.faults.harness import (
    BoxParts,
    Figures,
    Outcome,
    Scorebox,
    StandIn,
    essay,
    new_marker,
    repeated_calls,
    running_scorebox,
    running_standin,
)
from tests.support import eventually

OUTAGE_TIMEOUT_S = 90.0
IN_FLIGHT = 4
LATENCY_MS = 1500


@pytest.fixture(scope="module")
async def standin(log_dir: Path) -> AsyncIterator[StandIn]:
    async with running_standin(log_dir, "standin") as server:
        yield server


@pytest.fixture(scope="module")
async def box(box_parts: BoxParts, standin: StandIn) -> AsyncIterator[Scorebox]:
    env = {"MONGO_TIMEOUT_S": "2"}
    async with running_scorebox(box_parts, mongo_url=standin.url, env=env) as running:
        yield running


async def test_database_outage_answers_503_and_recovers(
    box: Scorebox, standin: StandIn, figures: Figures, labels: tuple[str, str]
) -> None:
    box.answers.clear()
    before = [new_marker() for _ in range(3)]
    accepted = {await box.submit(essay(m)): m for m in before}
    await box.finish(accepted)

    calls = box.calls_in_flight(IN_FLIGHT, latency_ms=LATENCY_MS, timeout_s=OUTAGE_TIMEOUT_S)
    async with calls as (in_flight, calls_in_flight):
        await standin.stop()
    accepted |= in_flight

    refused = await eventually(
        lambda: _refused(box), timeout_s=OUTAGE_TIMEOUT_S, what="a 503 while MongoDB is down"
    )
    assert refused["status"] == 503
    assert refused["type"].endswith("/unavailable"), refused
    assert refused["detail"], refused
    await eventually(
        lambda: box.answers_ready("gateway", 503), timeout_s=OUTAGE_TIMEOUT_S, what="not ready"
    )

    lifted_at = time.monotonic()
    await standin.start()
    after = [new_marker() for _ in range(3)]
    first = await eventually(
        lambda: _accepted(box, essay(after[0])),
        timeout_s=OUTAGE_TIMEOUT_S,
        what="a 202 after MongoDB came back",
    )
    time_to_recover = time.monotonic() - lifted_at
    accepted[first] = after[0]
    accepted |= {await box.submit(essay(m)): m for m in after[1:]}
    await box.all_ready(timeout_s=OUTAGE_TIMEOUT_S)

    views = await box.finish(accepted)
    statuses = [v["status"] for v in views.values()]
    # Model calls beyond one per attempt (a timeout's retry is an attempt, not a duplicate).
    extra = box.calls_beyond_attempts(accepted, views)
    figures.record(
        Outcome(
            name="MongoDB stopped and restarted",
            accepted=len(accepted),
            completed=statuses.count("completed"),
            failed=statuses.count("failed"),
            duplicate_model_calls=repeated_calls(extra),
            http_5xx_seen=box.http_5xx(),
            time_to_recover_s=round(time_to_recover, 2),
            broker=labels[0],
            database=f"{standin_label()}, sqlite engine, a stand-in of the test's own",
            notes=f"{IN_FLIGHT} tasks being scored (model slowed to {LATENCY_MS} ms, "
            f"{calls_in_flight} calls in flight) when it stopped: a call whose result could "
            "not be recorded within the claim's lease is made again once it has expired",
        )
    )
    assert statuses == ["completed"] * len(accepted), views
    assert all(extra[m] == 0 for m in before + after), extra
    # A call that ended while MongoDB was down is recorded once it is back, unless the outage
    # outlasted the claim's lease: then the call is made once more.
    assert all(0 <= extra[m] <= 1 for m in in_flight.values()), extra
    assert box.answers[500] == 0, box.answers


async def _refused(box: Scorebox) -> dict[str, Any] | None:
    response = await box.post(essay(new_marker()))
    if response.status_code == 202:
        return None
    assert response.status_code == 503, response.text
    assert response.headers["content-type"].startswith(PROBLEM_JSON), response.headers
    assert response.headers.get("retry-after"), response.headers
    with contextlib.suppress(ValueError):
        problem: dict[str, Any] = response.json()
        return problem
    raise AssertionError(f"503 without a JSON body: {response.text!r}")


async def _accepted(box: Scorebox, text: str) -> str | None:
    response = await box.post(text)
    if response.status_code != 202:
        assert response.status_code == 503, response.text
        return None
    task_id: str = response.json()["task_id"]
    return task_id
