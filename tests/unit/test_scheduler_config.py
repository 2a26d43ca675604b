"""The scheduler's job configuration: the shipped file, environment overrides, bad input."""

from __future__ import annotations

import logging
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import pytest

from services.scheduler.app import create_app
from services.scheduler.config import (
    DEFAULT_CONFIG_PATH,
    HousekeepingConfig,
    MissedFirings,
    catalogue_retention,
    env_name,
    load_config,
    parse_config,
)
from services.scheduler.errors import ConfigurationError
from services.scheduler.settings import SchedulerSettings


def test_the_shipped_file_defines_the_three_jobs() -> None:
    config = load_config(DEFAULT_CONFIG_PATH, {})
    assert list(config.jobs) == ["usage-rollup", "rescore-fanout", "housekeeping"]
    assert config.jobs["usage-rollup"].cron == "5 * * * *"
    assert config.jobs["usage-rollup"].tz == "UTC"
    assert config.jobs["usage-rollup"].missed is MissedFirings.COALESCE
    fanout = config.jobs["rescore-fanout"]
    assert (fanout.cron, fanout.tz, fanout.enabled) == ("0 3 * * *", "Asia/Shanghai", False)
    assert config.jobs["housekeeping"].cron == "*/10 * * * *"
    assert config.prices["gpt-4o-mini"].prompt_per_1k == Decimal("0.00015")


def test_settings_point_at_the_shipped_file_by_default() -> None:
    assert SchedulerSettings().config_path == DEFAULT_CONFIG_PATH
    moved = SchedulerSettings.model_validate({"SCHEDULER_CONFIG": "/etc/scorebox/s.toml"})
    assert moved.config_path == Path("/etc/scorebox/s.toml")


def test_environment_overrides_spec_zone_and_enabled() -> None:
    config = load_config(
        DEFAULT_CONFIG_PATH,
        {
            "CRON_USAGE_ROLLUP": "7 * * * *",
            "CRON_USAGE_ROLLUP_TZ": "Europe/Berlin",
            "CRON_RESCORE_FANOUT_ENABLED": "true",
        },
    )
    assert config.jobs["usage-rollup"].cron == "7 * * * *"
    assert config.jobs["usage-rollup"].tz == "Europe/Berlin"
    assert config.jobs["rescore-fanout"].enabled is True


def test_env_names() -> None:
    assert env_name("usage-rollup") == "CRON_USAGE_ROLLUP"
    assert env_name("housekeeping") == "CRON_HOUSEKEEPING"


@pytest.mark.parametrize(
    ("document", "environ", "message"),
    [
        ({"jobs": {"j": {"cron": "61 * * * *"}}}, {}, "invalid cron expression"),
        ({"jobs": {"j": {"cron": "5 * * * *"}}}, {"CRON_J": "nope"}, "invalid cron expression"),
        ({"jobs": {"j": {"cron": "5 * * * *", "tz": "Nowhere/City"}}}, {}, "unknown time zone"),
        ({"jobs": {"j": {"cron": "5 * * * *", "tz": "localtime"}}}, {}, "depends on the host"),
        ({"jobs": {"j": {"cron": "5 * * * *", "tz": "posixrules"}}}, {}, "depends on the host"),
        ({"jobs": {"j": {"cron": "5 * * * *", "tz": "right/UTC"}}}, {}, "depends on the host"),
        ({"jobs": {"j": {"cron": "5 * * * *", "tz": "posix/Europe/Berlin"}}}, {}, "on the host"),
        ({"jobs": {"j": {"cron": "5 * * * *", "missed": "sometimes"}}}, {}, "missed"),
        ({"jobs": {"j": {"cron": "5 * * * *", "colour": "red"}}}, {}, "colour"),
        ({"jobs": {"j": {"cron": "5 * * * *"}}}, {"CRON_J_ENABLED": "maybe"}, "CRON_J_ENABLED"),
        ({"prices": {"m": {"prompt_per_1k": -1, "completion_per_1k": 0}}}, {}, "prompt_per_1k"),
        ({"jobs": {"j": {"cron": "0 0 30 2 *"}}}, {}, "never fires"),
        ({"jobs": {"j": {"cron": "0 0 31 4 *", "enabled": False}}}, {}, "never fires"),
        ({"jobs": {"j": {"cron": "0 0 1 1 * 0 2020"}}}, {}, "never fires"),
        ({"jobs": {"j": {"cron": "5 * * * *"}}}, {"CRON_J": "0 0 30 2 *"}, "never fires"),
        ({"jobs": {"j": {"cron": "R * * * *"}}}, {}, "random or hashed fields"),
        ({"jobs": {"j": {"cron": "5 * * * *"}}}, {"CRON_J": "0 H * * *"}, "random or hashed"),
        # Ten years at most: past it, `now - timedelta(days=...)` overflowed in every run.
        ({"usage": {"raw_retention_days": 1_000_000}}, {}, "raw_retention_days"),
        ({"housekeeping": {"firing_retention_days": 3651}}, {}, "firing_retention_days"),
        ({"housekeeping": {"catalogue_retention_days": 10**10}}, {}, "catalogue_retention"),
        # Their overrides would be one set of variables (a review).
        (
            {
                "jobs": {
                    "nightly-report": {"cron": "5 * * * *"},
                    "nightly_report": {"cron": "6 * * * *"},
                }
            },
            {},
            "'nightly-report' and 'nightly_report' would share the variables CRON_NIGHTLY_REPORT",
        ),
    ],
)
def test_bad_configuration_refuses_to_start(
    document: dict[str, object], environ: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        parse_config(document, environ)


def test_missing_or_broken_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="not found"):
        load_config(tmp_path / "absent.toml", {})
    broken = tmp_path / "broken.toml"
    broken.write_text("[jobs.x\ncron = ")
    with pytest.raises(ConfigurationError, match="not valid TOML"):
        load_config(broken, {})


@pytest.mark.parametrize(("rubric_version", "starts"), [(None, False), ("heuristic-v1", True)])
def test_the_fan_out_enabled_without_a_rubric_version_refuses_to_start(
    rubric_version: str | None, starts: bool
) -> None:
    """Each firing of it failed into the cron DLQ (`PermanentJobError`), every day."""
    config = load_config(DEFAULT_CONFIG_PATH, {"CRON_RESCORE_FANOUT_ENABLED": "true"})
    settings = SchedulerSettings.model_validate(
        {"RABBITMQ_URL": "amqp://guest:guest@127.0.0.1:1/", "MONGO_URL": "mongodb://127.0.0.1:1"}
        | ({} if rubric_version is None else {"RUBRIC_VERSION": rubric_version})
    )
    if starts:
        create_app(settings, config=config)
    else:
        with pytest.raises(ConfigurationError, match=r"rescore-fanout.*RUBRIC_VERSION"):
            create_app(settings, config=config)


@pytest.mark.parametrize(
    "variable",
    ["CRON_USAGE_ROLLUP_ENABLE", "CRON_USAGEROLLUP", "CRON_NOSUCHJOB", "CRON_HOUSEKEEPING_ZONE"],
)
def test_a_variable_that_overrides_no_job_is_named_in_a_warning(
    variable: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A typo started the scheduler with the job as configured, the operator taking it for
    disabled or moved, and nothing said so (a walkthrough)."""
    with caplog.at_level(logging.WARNING, logger="scorebox.scheduler.config"):
        config = load_config(DEFAULT_CONFIG_PATH, {variable: "false"})
    assert config.jobs["usage-rollup"].enabled
    [warning] = [record.getMessage() for record in caplog.records]
    assert warning.startswith(f"{variable}: no configured job has such a variable")


@pytest.mark.parametrize(
    "environ",
    [
        pytest.param({"CRON_NOSUCHJOB": " ", "CRON_HOUSEKEEPING": ""}, id="empty"),
        pytest.param(
            {"CRON_SERVICE_HOST": "10.0.0.7", "CRON_PORT_80_TCP": "tcp://10.0.0.7:80"},
            id="kubernetes-service-links",
        ),
    ],
)
def test_variables_no_operator_set_for_the_schedule_are_let_be(
    environ: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """Compose passes variables left unset through, empty; Kubernetes sets a Service named
    `cron`'s address in every pod (refused at first, a review found that)."""
    with caplog.at_level(logging.WARNING, logger="scorebox.scheduler.config"):
        config = load_config(DEFAULT_CONFIG_PATH, environ)
    assert config.jobs["housekeeping"].cron == "*/10 * * * *"
    assert caplog.records == []


def test_the_catalogue_keeps_the_fanout_horizon_and_a_day_unless_told_otherwise() -> None:
    """Only the fan-out reads it, and only tasks within its horizon are due: kept a year,
    each daily run walked 365 times the entries it could use (review of the scheduler)."""
    horizon = timedelta(days=1)
    assert catalogue_retention(HousekeepingConfig(), horizon=horizon) == timedelta(days=2)
    told = HousekeepingConfig(catalogue_retention_days=30)
    assert catalogue_retention(told, horizon=horizon) == timedelta(days=30)
