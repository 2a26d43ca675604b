"""A setting a service refuses stops it at start-up with one line naming the variable and
exit status 2, not pydantic's traceback (found in a walkthrough of `make run`, where the
variable's name was buried in fifteen lines of it). Each service runs as a real process."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

from services.gateway.settings import GatewaySettings
from shared.settings import refused_settings

SERVICES = ["gateway", "scorer", "status", "scheduler", "notifier"]


def _refused_at_start(service: str, environment: Mapping[str, str]) -> list[str]:
    """Start the service as a process: it must stop with status 2 and no traceback; the
    lines it wrote to stderr."""
    stopped = subprocess.run(
        [sys.executable, "-m", f"services.{service}"],
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert stopped.returncode == 2, stopped.stderr
    assert "Traceback" not in stopped.stderr
    return stopped.stderr.strip().splitlines()


@pytest.mark.parametrize("service", SERVICES)
def test_a_refused_setting_stops_the_service_naming_it(service: str) -> None:
    lines = _refused_at_start(
        service, os.environ | {"LOG_FORMAT": "xml", "BROKER_TIMEOUT_S": "nan"}
    )
    assert lines[0] == f"{service}: cannot start, 2 setting(s) refused:"
    assert lines[1].startswith("  LOG_FORMAT: ")
    assert lines[2].startswith("  BROKER_TIMEOUT_S: ")


def test_a_refusal_of_settings_together_names_none_and_hides_the_values() -> None:
    """A cross-field refusal has no variable of its own: its message names them; the values
    given are never echoed (some are keys)."""
    secret = "sbx_" + "k" * 40
    try:
        GatewaySettings.model_validate(
            {"OUTBOX_GRACE_S": "100", "IDEMPOTENCY_TTL_S": "50", "ADMIN_API_KEY": secret}
        )
    except Exception as error:  # noqa: BLE001 - the refusal under test
        message = refused_settings("gateway", error)  # type: ignore[arg-type]
    else:
        raise AssertionError("refused settings were taken")

    assert message.splitlines()[1].startswith("  IDEMPOTENCY_TTL_S (50) is shorter than")
    assert "Value error" not in message
    assert secret not in message


@pytest.mark.parametrize(
    "url",
    ["https://u:hunter2@status:99999", "ftp://u:hunter2@status:8001", "http://u:hunter2@[::1"],
    ids=["bad-port", "bad-scheme", "unparsable"],
)
def test_a_refused_url_is_shown_without_its_password(url: str) -> None:
    """The URL was echoed whole in the refusal, password and all (found in review)."""
    try:
        GatewaySettings.model_validate({"STATUS_URL": url})
    except Exception as error:  # noqa: BLE001 - the refusal under test
        message = refused_settings("gateway", error)  # type: ignore[arg-type]
    else:
        raise AssertionError("a refused URL was taken")

    assert "STATUS_URL" in message
    assert "hunter2" not in message


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ({"CRON_USAGE_ROLLUP": "61 * * * *"}, "invalid cron expression '61 * * * *'"),
        ({"CRON_RESCORE_FANOUT_ENABLED": "true"}, "enabled cron jobs that cannot run"),
        ({"SCHEDULER_CONFIG": "/nonexistent/scheduler.toml"}, "/nonexistent/scheduler.toml"),
        ({"SCHEDULER_CONFIG": "/"}, "scheduler configuration / unreadable"),
        ({"SCHEDULER_CONFIG": sys.executable}, "is not UTF-8 text"),
    ],
    ids=[
        "cron-expression",
        "job-unable-to-run",
        "missing-file",
        "a-directory",
        "not-text",
    ],
)
def test_a_refused_schedule_stops_the_scheduler_in_one_line(
    setting: dict[str, str], named: str
) -> None:
    """The schedule is checked as the app is built, after the settings: a refusal there
    printed a traceback of 40 to 70 lines and exit status 1 (found in a review of the
    README's promise of one line and status 2)."""
    environment = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith("CRON_") and name not in {"RUBRIC_VERSION", "SCHEDULER_CONFIG"}
    }
    lines = _refused_at_start("scheduler", environment | setting)
    assert lines[-1].startswith("scheduler: cannot start: "), lines
    assert named in lines[-1]


@pytest.mark.parametrize(
    ("schedule", "named"),
    [
        ('[jobs]\nusage-rollup = "5 * * * *"\n', "jobs.usage-rollup must be one of the"),
        ('[[jobs]]\nname = "usage-rollup"\ncron = "5 * * * *"\n', "jobs must be"),
        ('jobs = ["usage-rollup"]\n', "jobs must be"),
    ],
    ids=["job-as-a-value", "array-of-tables", "list"],
)
def test_jobs_written_in_another_shape_stop_the_scheduler_in_one_line(
    schedule: str, named: str, tmp_path: Path
) -> None:
    """Copied as tables before the validation, each stopped the start with a traceback that
    named neither the file nor the key, and exit status 1 (found in review)."""
    path = tmp_path / "scheduler.toml"
    path.write_text(schedule)
    environment = {
        name: value for name, value in os.environ.items() if not name.startswith("CRON_")
    }
    lines = _refused_at_start("scheduler", environment | {"SCHEDULER_CONFIG": str(path)})
    assert lines[-1].startswith("scheduler: cannot start: "), lines
    assert named in lines[-1]
    assert '[jobs.<name>] tables, each with cron = "..."' in lines[-1]


@pytest.mark.parametrize(
    ("service", "variable", "value"),
    [
        ("gateway", "MONGO_URL", "bogus://x"),
        ("scorer", "MONGO_DB_PREFIX", "bad/prefix"),
        ("status", "RABBITMQ_URL", "notaurl"),
        ("notifier", "RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:notaport/"),
    ],
)
def test_an_infrastructure_url_the_drivers_refuse_stops_the_service_in_one_line(
    service: str, variable: str, value: str
) -> None:
    """Each stopped with a driver's traceback (exit status 1), or, `notaurl` read as a vhost
    on localhost, waited out STARTUP_TIMEOUT_S and then stopped with one (exit status 3)
    (found in a walkthrough)."""
    lines = _refused_at_start(service, os.environ | {variable: value})
    assert lines[0] == f"{service}: cannot start, 1 setting(s) refused:"
    assert len(lines) == 2, lines
    assert lines[1].startswith(f"  {variable}: ")
