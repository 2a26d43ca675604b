"""Scheduler settings the scheduler cannot work with are refused at start-up, each with the
variables it concerns named."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.scheduler.settings import BROKER_CONSUMER_TIMEOUT_S, SchedulerSettings


@pytest.mark.parametrize(("backlog", "page"), [("999", "1000"), ("1", "2"), ("1000", "10000")])
def test_a_backlog_smaller_than_a_page_is_refused(backlog: str, page: str) -> None:
    """Every full page was then refused for room (the requests waiting plus the page always
    exceeded the backlog), so the fan-out waited for room that never came, and published
    nothing."""
    with pytest.raises(ValidationError) as refused:
        SchedulerSettings.model_validate({"FANOUT_MAX_BACKLOG": backlog, "FANOUT_PAGE_SIZE": page})
    message = str(refused.value)
    assert "FANOUT_MAX_BACKLOG" in message
    assert "FANOUT_PAGE_SIZE" in message


def test_a_backlog_that_holds_a_page_is_taken() -> None:
    settings = SchedulerSettings.model_validate(
        {"FANOUT_MAX_BACKLOG": "1000", "FANOUT_PAGE_SIZE": "1000"}
    )
    assert settings.fanout_max_backlog == settings.fanout_page_size == 1000
    defaults = SchedulerSettings.model_validate({})
    assert defaults.fanout_max_backlog >= defaults.fanout_page_size


def test_the_job_database_deadline_outlasts_the_request_one_by_default() -> None:
    settings = SchedulerSettings.model_validate({})
    assert settings.job_db_timeout_s == 300
    assert settings.job_db_timeout_s > settings.mongo_timeout_s
    taken = SchedulerSettings.model_validate({"SCHEDULER_JOB_DB_TIMEOUT_S": "1200"})
    assert taken.job_db_timeout_s == 1200


@pytest.mark.parametrize("seconds", ["0", "-1", str(BROKER_CONSUMER_TIMEOUT_S), "3600", "inf"])
def test_a_job_database_deadline_out_of_range_is_refused(seconds: str) -> None:
    """Zero or less is no deadline at all; at or past the broker's consumer timeout, the
    broker closes the channel of a delivery still held while its job waits on the database."""
    with pytest.raises(ValidationError, match="SCHEDULER_JOB_DB_TIMEOUT_S"):
        SchedulerSettings.model_validate({"SCHEDULER_JOB_DB_TIMEOUT_S": seconds})


def test_the_fanout_horizon_mirrors_the_gateways_submission_retention_by_default() -> None:
    """The gateway keeps a submission `IDEMPOTENCY_TTL_S` (a day by default) and answers a
    re-score of an older task "unknown task"."""
    assert SchedulerSettings.model_validate({}).fanout_horizon_s == 86_400
    taken = SchedulerSettings.model_validate({"FANOUT_HORIZON_S": "604800"})
    assert taken.fanout_horizon_s == 604_800


@pytest.mark.parametrize("seconds", ["0", "-1", "inf", "1.5", str(11 * 365 * 86_400)])
def test_a_fanout_horizon_out_of_range_is_refused(seconds: str) -> None:
    with pytest.raises(ValidationError, match="FANOUT_HORIZON_S"):
        SchedulerSettings.model_validate({"FANOUT_HORIZON_S": seconds})
