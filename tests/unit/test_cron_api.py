"""The manual-run route's answers to what triggering a run can raise."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from fastapi import FastAPI
from pydantic import SecretStr

from services.scheduler.api import cron_routes
from services.scheduler.errors import DispatchFailed, RunInProgress, TriggeredTooOften
from services.scheduler.firings import Firing, LeaseTaken
from services.scheduler.schedule import JobCatalog
from shared.contracts import rfc3339
from shared.http import install_problem_handlers
from tests.support import running
from tests.unit.test_scheduler_dispatch import FakeFirings

NOW = datetime(2030, 1, 1, tzinfo=UTC)
ADMIN = {"Authorization": "Bearer admin-key"}


def app_raising(error: Exception) -> FastAPI:
    async def trigger(name: str) -> Firing:
        raise error

    app = FastAPI()
    install_problem_handlers(app)
    app.include_router(
        cron_routes(
            jobs=JobCatalog([]),
            firings=FakeFirings(),
            trigger=trigger,
            clock=lambda: NOW,
            admin_key=SecretStr("admin-key"),
        )
    )
    return app


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [
        (TriggeredTooOften("rollup"), 429, "too-many-requests"),
        (DispatchFailed("the broker did not accept it"), 503, "broker-unavailable"),
        (RunInProgress("rollup", "run-1", "running", NOW), 409, "run-in-progress"),
        # The lease changing hands at every try: a 500, unmapped (found in review).
        (LeaseTaken("rollup"), 503, "lease-contended"),
    ],
)
async def test_a_refused_manual_run_says_why(error: Exception, status: int, kind: str) -> None:
    """Colliding manual runs were answered as a broker outage (503)."""
    async with running(app_raising(error)) as client:
        answer = await client.post("/admin/v1/cron/jobs/rollup/run", headers=ADMIN)
    assert answer.status_code == status
    assert answer.headers["content-type"].startswith("application/problem+json")
    assert answer.json()["type"].endswith(kind)
    if status == 429 or kind == "lease-contended":
        assert answer.headers["retry-after"] == "1"


async def test_a_run_in_progress_names_its_last_sign_of_life_as_every_time_is_written() -> None:
    """RFC 3339 with `Z`, as the API's times: it read `+00:00` (a walkthrough)."""
    async with running(app_raising(RunInProgress("rollup", "run-1", "running", NOW))) as client:
        answer = await client.post("/admin/v1/cron/jobs/rollup/run", headers=ADMIN)
    assert f"last heard of at {rfc3339(NOW)})" in answer.json()["detail"]
    assert rfc3339(NOW).endswith("Z")
