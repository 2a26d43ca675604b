"""Scheduler settings the scheduler cannot work with are refused at start-up, each with the
variables it concerns named."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.scheduler.settings import SchedulerSettings
from shared.settings import BROKER_CONSUMER_TIMEOUT_S


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


@pytest.mark.parametrize("attempts", ["0", "21", "60", "1000000"])
def test_job_attempts_out_of_range_are_refused(attempts: str) -> None:
    """Unbounded, a run retried past attempt 44 (of a 5 s base) failed its back-off with an
    overflow; past the back-off's cap each further attempt only waits the cap again."""
    with pytest.raises(ValidationError, match="SCHEDULER_JOB_MAX_ATTEMPTS"):
        SchedulerSettings.model_validate({"SCHEDULER_JOB_MAX_ATTEMPTS": attempts})
    taken = SchedulerSettings.model_validate({"SCHEDULER_JOB_MAX_ATTEMPTS": "20"})
    assert taken.job_max_attempts == 20


@pytest.mark.parametrize(
    "given",
    [
        {"BROKER_TIMEOUT_S": "20"},  # 20 + 2 x 5 = 30
        {"MONGO_TIMEOUT_S": "10"},  # 10 + 2 x 10 = 30
        {"SCHEDULER_REDISPATCH_S": "15"},
        {"BROKER_TIMEOUT_S": "1", "MONGO_TIMEOUT_S": "1", "SCHEDULER_REDISPATCH_S": "3"},
    ],
)
def test_a_redispatch_delay_an_ordinary_slow_send_reaches_is_refused(
    given: dict[str, str],
) -> None:
    """A firing stays `claimed` through its claim's insert, its publish and its mark as sent;
    another replica publishes one left so for `SCHEDULER_REDISPATCH_S`: a shorter delay took
    a slow but ordinary send for a lost one, and the fire time ran twice."""
    with pytest.raises(ValidationError) as refused:
        SchedulerSettings.model_validate(given)
    message = str(refused.value)
    for variable in ("SCHEDULER_REDISPATCH_S", "BROKER_TIMEOUT_S", "MONGO_TIMEOUT_S"):
        assert variable in message


def test_the_default_redispatch_delay_outlasts_a_slow_send() -> None:
    defaults = SchedulerSettings.model_validate({})
    sending = defaults.broker_timeout_s + 2 * defaults.mongo_timeout_s
    assert sending < defaults.redispatch_after_s
    taken = SchedulerSettings.model_validate(
        {"BROKER_TIMEOUT_S": "1", "MONGO_TIMEOUT_S": "1", "SCHEDULER_REDISPATCH_S": "3.5"}
    )
    assert taken.redispatch_after_s == 3.5
