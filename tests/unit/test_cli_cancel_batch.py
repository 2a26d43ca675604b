"""`scorebox cancel-batch BATCH_ID`: a POST to the batch's cancel route, its answer printed;
exit 1 on a refusal. Against a fake gateway (httpx.MockTransport), as `test_cli_cancel`."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from scorebox import cli
from tests.unit import test_cli_cancel
from tests.unit.test_cli_cancel import _gateway

environment = test_cli_cancel.environment  # autouse: SCOREBOX_URL and SCOREBOX_API_KEY set

ANSWER = {
    "batch_id": "b1",
    "cancelling": 2,
    "already_finished": 1,
    "status_url": "/v1/batches/b1",
}


def test_a_batch_cancel_posts_to_the_batchs_cancel_route_and_prints_the_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen = _gateway(monkeypatch, 202, ANSWER)

    result = CliRunner().invoke(cli.app, ["cancel-batch", "b1"])

    assert result.exit_code == 0, result.output
    assert seen == ["POST /v1/batches/b1/cancel"]
    assert json.loads(result.stdout) == ANSWER


@pytest.mark.parametrize("status", [404, 503])
def test_a_refused_batch_cancel_exits_1_with_its_detail(
    monkeypatch: pytest.MonkeyPatch, status: int
) -> None:
    _gateway(monkeypatch, status, {"status": status, "detail": "not this one"})

    result = CliRunner().invoke(cli.app, ["cancel-batch", "b1"])

    assert result.exit_code == 1
    assert "not this one" in result.stderr


def test_an_answer_without_its_counts_exits_1(monkeypatch: pytest.MonkeyPatch) -> None:
    _gateway(monkeypatch, 202, {"batch_id": "b1"})

    result = CliRunner().invoke(cli.app, ["cancel-batch", "b1"])

    assert result.exit_code == 1
    assert "without cancelling, already_finished" in result.stderr


def test_the_batch_id_stays_inside_its_path_segment(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _gateway(monkeypatch, 202, ANSWER)

    CliRunner().invoke(cli.app, ["cancel-batch", "../../healthz"])
    CliRunner().invoke(cli.app, ["cancel-batch", ".."])

    assert seen == ["POST /v1/batches/..%2F..%2Fhealthz/cancel", "POST /v1/batches/%2E%2E/cancel"]
