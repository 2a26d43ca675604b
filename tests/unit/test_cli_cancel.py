"""`scorebox cancel TASK_ID`: a POST to the task's cancel route, its answer printed; exit 1
on a refusal. Against a fake gateway (httpx.MockTransport)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from scorebox import cli

PROBLEM = {"content-type": "application/problem+json"}


@pytest.fixture(autouse=True)
def environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SCOREBOX_URL", "http://gateway.test")
    monkeypatch.setenv("SCOREBOX_API_KEY", "sbx_key")


def _gateway(monkeypatch: pytest.MonkeyPatch, status: int, body: dict[str, Any]) -> list[str]:
    seen: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url.raw_path.decode()}")
        headers = PROBLEM if status >= 400 else {}
        return httpx.Response(status, json=body, headers=headers)

    monkeypatch.setattr(cli, "transport", httpx.MockTransport(handle))
    return seen


def test_a_cancel_posts_to_the_tasks_cancel_route_and_prints_the_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    answer = {"task_id": "t1", "status": "cancelling", "status_url": "/v1/scores/t1"}
    seen = _gateway(monkeypatch, 202, answer)

    result = CliRunner().invoke(cli.app, ["cancel", "t1"])

    assert result.exit_code == 0, result.output
    assert seen == ["POST /v1/scores/t1/cancel"]
    assert json.loads(result.stdout) == answer


@pytest.mark.parametrize("status", [404, 409, 503])
def test_a_refused_cancel_exits_1_with_its_detail(
    monkeypatch: pytest.MonkeyPatch, status: int
) -> None:
    _gateway(monkeypatch, status, {"status": status, "detail": "not this one"})

    result = CliRunner().invoke(cli.app, ["cancel", "t1"])

    assert result.exit_code == 1
    assert "not this one" in result.stderr


def test_the_task_id_stays_inside_its_path_segment(monkeypatch: pytest.MonkeyPatch) -> None:
    answer = {"task_id": "x", "status": "cancelling", "status_url": "/v1/scores/x"}
    seen = _gateway(monkeypatch, 202, answer)

    CliRunner().invoke(cli.app, ["cancel", "../../healthz"])

    assert seen == ["POST /v1/scores/..%2F..%2Fhealthz/cancel"]
