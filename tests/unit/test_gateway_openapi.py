"""The gateway's OpenAPI document says what its routes do: who may call them (security
schemes), the problem+json answers each can give, the bodies of its 200s and the headers
(`Location`, `Retry-After`) a client acts on."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import orjson
import pytest

from services.gateway.api import _view_json
from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings
from shared.contracts import TaskStatus, TaskView
from shared.http import PROBLEM_JSON

Json = dict[str, Any]
METHODS = {"get", "put", "post", "delete", "patch", "head"}


@pytest.fixture(scope="module")
def document() -> Json:
    app = create_app(GatewaySettings.model_validate({"ADMIN_API_KEY": "admin-key"}))
    schema: Json = app.openapi()
    return schema


def operations(document: Json, prefix: str) -> list[tuple[str, Json]]:
    return [
        (f"{method.upper()} {path}", operation)
        for path, methods in document["paths"].items()
        if path.startswith(prefix)
        for method, operation in methods.items()
        if method in METHODS
    ]


def is_problem(response: Json) -> bool:
    return PROBLEM_JSON in response.get("content", {})


def test_admin_routes_declare_the_admin_key_and_the_problems_they_give(document: Json) -> None:
    schemes = document["components"]["securitySchemes"]
    admin = operations(document, "/admin/v1/")
    assert len(admin) >= 7
    for name, operation in admin:
        (requirement,) = operation.get("security", [{}])
        (scheme,) = requirement or [None]
        assert scheme is not None, f"{name} declares no security scheme"
        assert schemes[scheme] == {**schemes[scheme], "type": "http", "scheme": "bearer"}
        assert "admin" in schemes[scheme]["description"].lower(), name
        parameters = {p["name"].lower() for p in operation.get("parameters", [])}
        assert "authorization" not in parameters, f"{name} lists the key as a parameter"
        for status in ("401", "403", "503"):
            assert is_problem(operation["responses"].get(status, {})), (name, status)
    paths = dict(admin)
    for name in (
        "GET /admin/v1/dead-letters/{letter_id}",
        "DELETE /admin/v1/dead-letters/{letter_id}",
        "DELETE /admin/v1/keys/{key_id}",
    ):
        assert is_problem(paths[name]["responses"].get("404", {})), name


def test_dead_letter_answers_document_a_walk_cut_short(document: Json) -> None:
    """A drop past a walk cut short is a 409 (not a 404 a client would take as done), and the
    reports of a drop and a replay say what `truncated` and `not_reached` mean."""
    paths = document["paths"]
    drop = paths["/admin/v1/dead-letters/{letter_id}"]["delete"]["responses"]
    replay = paths["/admin/v1/dead-letters/replay"]["post"]["responses"]
    assert is_problem(drop["409"])
    assert "may lie past" in drop["409"]["description"]
    assert "dead-letter depth probe" in drop["404"]["description"]
    schemas = document["components"]["schemas"]
    for name, answered in (("DropReport", drop), ("ReplayReport", replay)):
        assert answered["200"]["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{name}"
        }
        assert "bound" in schemas[name]["properties"]["truncated"]["description"], name
    reported = schemas["ReplayReport"]["properties"]
    assert "may name letters past it" in reported["not_reached"]["description"]
    assert "end of the queue" in reported["not_found"]["description"]


def test_admin_and_api_keys_are_different_schemes(document: Json) -> None:
    public = {s for _, o in operations(document, "/v1/") for r in o["security"] for s in r}
    admin = {s for _, o in operations(document, "/admin/v1/") for r in o["security"] for s in r}
    assert len(public) == len(admin) == 1
    assert public != admin


def test_webhook_routes_document_a_missing_key_and_the_rate_limit(document: Json) -> None:
    webhooks = operations(document, "/v1/webhooks/")
    assert len(webhooks) == 5
    for name, operation in webhooks:
        for status in ("401", "429"):
            assert is_problem(operation["responses"].get(status, {})), (name, status)


def test_a_repeated_submission_documents_the_body_it_answers(document: Json) -> None:
    scores = document["paths"]["/v1/scores"]["post"]["responses"]["200"]
    refs = {
        option["$ref"].rsplit("/", 1)[1]
        for option in scores["content"]["application/json"]["schema"]["anyOf"]
    }
    assert refs == {"TaskView", "SubmissionAccepted"}
    batches = document["paths"]["/v1/batches"]["post"]["responses"]["200"]
    assert batches["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/BatchAccepted"
    }


def test_the_task_view_schema_is_what_a_poll_answers(document: Json) -> None:
    now = datetime(2025, 1, 1, tzinfo=UTC)
    view = TaskView(
        task_id="t1", status=TaskStatus.QUEUED, attempts=0, created_at=now, updated_at=now
    )
    body = orjson.loads(_view_json(view).body)
    documented = document["components"]["schemas"]["TaskView"]
    assert set(body) == set(documented["properties"])
    assert set(documented["required"]) <= set(body)
    assert "status_url" in documented["required"]
    poll = document["paths"]["/v1/scores/{task_id}"]["get"]["responses"]["200"]
    assert poll["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/TaskView"
    }


@pytest.mark.parametrize("path", ["/v1/scores", "/v1/batches"])
@pytest.mark.parametrize("status", ["200", "202"])
def test_submissions_document_their_location(document: Json, path: str, status: str) -> None:
    response = document["paths"][path]["post"]["responses"][status]
    assert "Location" in response.get("headers", {})


def test_every_429_and_503_documents_retry_after(document: Json) -> None:
    """Every problem a client may retry says when; `/readyz`'s 503 is a probe's answer, not a
    problem, and sends no `Retry-After`."""
    checked = 0
    for name, operation in operations(document, "/"):
        if name == "GET /readyz":
            continue
        for status in ("429", "503"):
            if status in operation["responses"]:
                checked += 1
                headers = operation["responses"][status].get("headers", {})
                assert "Retry-After" in headers, (name, status)
    assert checked >= 20


def test_the_cancel_route_documents_its_location_and_problems(document: Json) -> None:
    responses = document["paths"]["/v1/scores/{task_id}/cancel"]["post"]["responses"]
    assert "Location" in responses["202"]["headers"]
    assert responses["202"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/CancelRequested"
    }
    for status in ("401", "404", "409", "429", "503"):
        assert is_problem(responses[status]), status
    assert "Retry-After" in responses["409"]["headers"]  # `task-being-accepted` sends it
    # A repeat is answered 202 only until the outcome is applied; a 503 may have queued it.
    description = document["paths"]["/v1/scores/{task_id}/cancel"]["post"]["description"]
    assert "Idempotent" not in description
    assert "after it, 409" in description
    assert "may or may not have been queued" in responses["503"]["description"]


def test_the_batch_cancel_route_documents_its_location_and_problems(document: Json) -> None:
    operation = document["paths"]["/v1/batches/{batch_id}/cancel"]["post"]
    responses = operation["responses"]
    assert operation["tags"] == ["batches"]
    assert "Location" in responses["202"]["headers"]
    assert responses["202"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/BatchCancelRequested"
    }
    for status in ("401", "404", "409", "429", "503"):
        assert is_problem(responses[status]), status
    assert "Retry-After" in responses["409"]["headers"]  # `batch-being-accepted` sends it
    # Not the 503 of a request that kept nothing: some cancellations may be queued.
    assert "may have been queued" in responses["503"]["description"]
    assert "send it again" in responses["503"]["description"]
    counts = document["components"]["schemas"]["BatchCancelRequested"]["required"]
    assert set(counts) == {"batch_id", "cancelling", "already_finished", "status_url"}


@pytest.mark.parametrize("path", ["/v1/scores", "/v1/batches"])
def test_submissions_document_a_write_the_database_refuses(document: Json, path: str) -> None:
    """500 `database-refused` (README): no `Retry-After`, since retrying meets it again."""
    refused = document["paths"][path]["post"]["responses"].get("500", {})
    assert is_problem(refused)
    assert "database-refused" in refused["description"]
    assert "headers" not in refused


@pytest.mark.parametrize(("status", "state"), [("200", "ready"), ("503", "unavailable")])
def test_readiness_documents_both_answers(document: Json, status: str, state: str) -> None:
    """`/readyz` comes from `shared.http.health_router`, which every service mounts: checked
    once, on the gateway's document."""
    responses = document["paths"]["/readyz"]["get"]["responses"]
    schema = responses[status]["content"]["application/json"]["schema"]
    readiness = document["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    assert {"status", "checks"} <= set(readiness["required"])
    assert state in readiness["properties"]["status"]["enum"]
    assert set(responses) == {"200", "503", "422", "500"}  # 422, 500: every route's


def test_the_public_routes_name_their_key_scheme_as_before(document: Json) -> None:
    """`HTTPBearer`, FastAPI's name for its bearer scheme: clients generated from the
    document look the scheme up by it (it became `BearerScheme` with the one key parser)."""
    assert document["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    (_, submit), *_ = operations(document, "/v1/scores")
    assert submit["security"] == [{"HTTPBearer": []}]
