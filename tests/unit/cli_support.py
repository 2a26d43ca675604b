"""`scorebox` (the CLI) run in-process against fake servers: its requests answered by a function
(an `httpx.MockTransport` injected through `cli.transport`), its environment as an operator
sets it."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
from typer.testing import CliRunner, Result

from scorebox import cli

GATEWAY_URL = "http://gateway.test"
SCHEDULER_URL = "http://scheduler.test"
ADMIN_KEY = "the-admin-key"


def run_cli(*args: str, input: str | bytes | None = None) -> Result:
    """`scorebox ARGS` (reading `input` as its standard input), its output and exit code."""
    return CliRunner().invoke(cli.app, list(args), input=input)


def cli_answered_by(
    monkeypatch: pytest.MonkeyPatch,
    answer: Callable[[httpx.Request], httpx.Response],
    *,
    api_key: str | None = None,
) -> None:
    """The CLI's requests answered by `answer`, the gateway at `GATEWAY_URL`, the scheduler at
    `SCHEDULER_URL`, the admin key `ADMIN_KEY`, and `SCOREBOX_API_KEY` set to `api_key` when
    one is given (left as it is otherwise)."""
    monkeypatch.setattr(cli, "transport", httpx.MockTransport(answer))
    monkeypatch.setenv("SCOREBOX_URL", GATEWAY_URL)
    monkeypatch.setenv("SCOREBOX_SCHEDULER_URL", SCHEDULER_URL)
    monkeypatch.setenv("SCOREBOX_ADMIN_KEY", ADMIN_KEY)
    if api_key is not None:
        monkeypatch.setenv("SCOREBOX_API_KEY", api_key)
