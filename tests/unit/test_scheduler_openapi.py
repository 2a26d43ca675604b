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


def operations(document: Json, prefix: str) -> list[tuple[str, Json]]:
    return [
        (f"{method.upper()} {path}", operation)
        for path, methods in document["paths"].items()
        if path.startswith(prefix)
        for method, operation in methods.items()
        if method in {"get", "put", "post", "delete", "patch"}
    ]


def is_problem(response: Json) -> bool:
    return PROBLEM_JSON in response.get("content", {})


def test_every_admin_route_documents_the_admin_guard_and_an_unavailable_dependency(
    document: Json,
) -> None:
    """Every route behind the admin key lists the guard's 401 (no key, or not this one) and
    403 (ADMIN_API_KEY unset), and the 503 (with `Retry-After`) of its database or broker."""
    guarded = [
        (name, operation)
        for name, operation in operations(document, "/")
        if {"AdminKey": []} in operation.get("security", [])
    ]
    assert [name for name, _ in guarded] == [name for name, _ in operations(document, "/admin/")]
    assert len(guarded) == 7
    for name, operation in guarded:
        responses = operation["responses"]
        for status in ("401", "403", "503"):
            assert is_problem(responses.get(status, {})), (name, status)
        assert "ADMIN_API_KEY" in responses["401"]["description"], name
        assert "Retry-After" in responses["503"]["headers"], name


def test_a_run_by_hand_documents_every_answer(document: Json) -> None:
    responses = document["paths"]["/admin/v1/cron/jobs/{name}/run"]["post"]["responses"]
    assert responses["202"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/RunAccepted"
    }
    for status in ("401", "403", "404", "409", "429", "500", "503"):
        assert is_problem(responses.get(status, {})), status
    assert "unknown-job" in responses["404"]["description"]
    assert "run-in-progress" in responses["409"]["description"]
    assert "database-refused" in responses["500"]["description"]
    assert "headers" not in responses["500"]  # retrying meets the same refusal
    assert "broker-unavailable" in responses["503"]["description"]
    assert "database-unavailable" in responses["503"]["description"]
    for status in ("429", "503"):
        assert "Retry-After" in responses[status]["headers"], status
    # The run's URL: of the run started, and of one whose outcome is unknown.
    assert "Location" in responses["202"]["headers"]
    assert "Location" in responses["503"]["headers"]


def test_a_run_read_documents_an_unknown_run(document: Json) -> None:
    responses = document["paths"]["/admin/v1/cron/runs/{run_id}"]["get"]["responses"]
    assert is_problem(responses.get("404", {}))
    assert responses["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/FiringView"
    }


def test_a_cron_replay_documents_its_refusals(document: Json) -> None:
    responses = document["paths"]["/admin/v1/cron/dead-letters/replay"]["post"]["responses"]
    for status in ("400", "409", "413", "415", "422", "429", "500", "503"):
        assert is_problem(responses.get(status, {})), status
    assert "unknown-job" in responses["409"]["description"]


def test_the_usage_read_documents_its_database_away(document: Json) -> None:
    responses = document["paths"]["/internal/v1/usage"]["get"]["responses"]
    for status in ("401", "422", "503"):
        assert is_problem(responses.get(status, {})), status
    assert "Retry-After" in responses["503"]["headers"]
