"""The scheduler's OpenAPI document says what its cron dead-letter routes answer: a drop's
404 and its 409 when the walk stopped before reaching the letter, and what `truncated` and
`not_reached` mean in a replay's report."""

from __future__ import annotations

from typing import Any

import pytest

from services.scheduler.app import create_app
from services.scheduler.config import parse_config
from services.scheduler.settings import SchedulerSettings
from shared.http import PROBLEM_JSON

Json = dict[str, Any]


@pytest.fixture(scope="module")
def document() -> Json:
    settings = SchedulerSettings.model_validate({"ADMIN_API_KEY": "admin-key"})
    schema: Json = create_app(settings, config=parse_config({"jobs": {}}, {})).openapi()
    return schema


def test_a_cron_drop_documents_its_problems_and_its_report(document: Json) -> None:
    responses = document["paths"]["/admin/v1/cron/dead-letters/{run_id}"]["delete"]["responses"]
    for status in ("404", "409", "503"):
        assert PROBLEM_JSON in responses[status]["content"], status
    assert "may lie past" in responses["409"]["description"]
    assert "dead-letter depth probe" in responses["404"]["description"]
    assert "Retry-After" in responses["503"]["headers"]
    assert responses["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/CronDropReport"
    }
    report = document["components"]["schemas"]["CronDropReport"]["properties"]
    assert {"run_id", "removed", "truncated"} <= set(report)


def test_a_cron_replay_report_says_what_a_walk_cut_short_left(document: Json) -> None:
    report = document["components"]["schemas"]["CronReplayReport"]["properties"]
    assert "may name letters past it" in report["not_reached"]["description"]
    assert "end of the queue" in report["not_found"]["description"]
    assert "bound" in report["truncated"]["description"]
