"""How `scorebox` fails: one line and a non-zero exit, never a traceback, and never 0 when
nothing happened. Against a fake gateway (httpx.MockTransport)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from scorebox import cli


def _run(*args: str) -> Any:
    return CliRunner().invoke(cli.app, list(args))


@pytest.fixture(autouse=True)
def environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SCOREBOX_URL", "http://gateway.test")
    monkeypatch.setenv("SCOREBOX_ADMIN_KEY", "the-admin-key")


def _gateway(monkeypatch: pytest.MonkeyPatch, answer: Any) -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        if isinstance(answer, Exception):
            raise answer
        result: httpx.Response = answer(request)
        return result

    monkeypatch.setattr(cli, "transport", httpx.MockTransport(handle))


@pytest.mark.parametrize(
    "command",
    [
        ("dlq", "list"),
        ("dlq", "show", "x"),
        ("dlq", "replay", "--all"),
        ("dlq", "purge", "--yes"),
        ("keys", "list"),
        ("keys", "revoke", "k"),
        ("keys", "create", "--tenant", "acme"),
        ("status", "t"),
    ],
)
@pytest.mark.parametrize(
    "failure", [httpx.ConnectError("refused"), httpx.ReadTimeout("no answer in time")]
)
def test_a_gateway_down_or_slow_is_one_line_and_exit_1(
    monkeypatch: pytest.MonkeyPatch, command: tuple[str, ...], failure: Exception
) -> None:
    """Every command but `usage` and `cron` printed a traceback of a few hundred lines."""
    _gateway(monkeypatch, failure)
    result = _run(*command)
    assert result.exit_code == 1
    assert isinstance(result.exception, SystemExit)
    assert "unreachable" in result.output
    assert "Traceback" not in result.output


def test_a_text_that_cannot_be_read_is_one_line_and_exit_1(tmp_path: Path) -> None:
    result = _run("submit", str(tmp_path / "absent.txt"))
    assert result.exit_code == 1
    assert isinstance(result.exception, SystemExit)
    assert "cannot read" in result.output


def test_a_replay_of_letters_not_found_exits_1(monkeypatch: pytest.MonkeyPatch) -> None:
    body = {"replayed": [], "skipped_unreadable": [], "not_found": ["nope"]}
    _gateway(monkeypatch, lambda request: httpx.Response(200, json=body))
    result = _run("dlq", "replay", "nope")
    assert result.exit_code == 1
    assert "not found: nope" in result.output


def test_a_wait_that_runs_out_exits_1(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """It exited 0 with the task still queued, as if it had finished."""
    essay = tmp_path / "essay.txt"
    essay.write_text("An essay.", encoding="utf-8")
    queued = {"task_id": "t1", "status": "queued", "status_url": "/v1/scores/t1"}
    _gateway(
        monkeypatch,
        lambda request: httpx.Response(202 if request.method == "POST" else 200, json=queued),
    )
    result = _run("submit", str(essay), "--wait", "--timeout", "0")
    assert result.exit_code == 1
    assert "still queued" in result.output
