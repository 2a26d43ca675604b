"""A service's failed calls, told in the log at most once a minute with their count: the
gateway answered 503 for a service away, or at a wrong URL, and said nothing of it."""

from __future__ import annotations

import logging

import httpx
import pytest

from services.gateway.errors import StatusUnavailable
from services.gateway.scheduler_client import SchedulerClient, SchedulerUnavailable
from services.gateway.status_client import StatusClient
from services.gateway.webhooks_api import NotifierClient, NotifierUnavailable
from shared.log_rate import FailedCalls
from tests.support import closed_port

log = logging.getLogger("tests.failed_calls")


def test_the_first_failure_is_told_at_once_then_one_line_a_minute_with_the_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    failed = FailedCalls("scheduler", log, every_s=60, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger=log.name):
        failed.note(RuntimeError("first"))
        for second in (1.0, 30.0, 59.0):
            now[0] = second
            failed.note(RuntimeError(f"at {second}"))
        now[0] = 61.0
        failed.note(RuntimeError("latest"))
    assert [record.getMessage() for record in caplog.records] == [
        "calls to the scheduler failed: 1 since the last line, the latest: first",
        "calls to the scheduler failed: 4 since the last line, the latest: latest",
    ]
    assert {record.levelno for record in caplog.records} == {logging.WARNING}


async def test_each_service_client_tells_its_failed_calls(
    caplog: pytest.LogCaptureFixture,
) -> None:
    base_url = f"http://127.0.0.1:{closed_port()}"  # nothing listens
    async with httpx.AsyncClient() as http:
        with caplog.at_level(logging.WARNING, logger="scorebox.gateway"):
            with pytest.raises(StatusUnavailable):
                await StatusClient(http, base_url=base_url).find("t1", tenant_id="acme")
            with pytest.raises(SchedulerUnavailable):
                await SchedulerClient(http, base_url=base_url).usage(
                    "acme", first_day="2030-01-01", last_day="2030-01-02"
                )
            with pytest.raises(NotifierUnavailable):
                await NotifierClient(http, base_url=base_url).signing_secret("acme")
    told = [record.getMessage() for record in caplog.records]
    for service in ("status service", "scheduler", "notifier"):
        assert any(f"calls to the {service} failed: 1" in line for line in told), told


async def test_an_unreadable_answer_is_told_without_quoting_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A notifier's 200 the gateway cannot read went unlogged; and a ValidationError's text,
    which quotes the body, would have put a signing secret in the log (a review)."""
    leaked = {"secret": 12345678, "created_at": "whsec_THE_SECRET"}
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=leaked))
    async with httpx.AsyncClient(transport=transport) as http:
        with (
            caplog.at_level(logging.WARNING, logger="scorebox.gateway"),
            pytest.raises(NotifierUnavailable) as raised,
        ):
            await NotifierClient(http, base_url="http://notifier").signing_secret("acme")
    told = [record.getMessage() for record in caplog.records]
    assert any("calls to the notifier failed: 1" in line for line in told), told
    assert "THE_SECRET" not in " ".join(told)
    assert "12345678" not in " ".join(told)
    assert "THE_SECRET" not in str(raised.value)
