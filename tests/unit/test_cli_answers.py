"""`scorebox` against URLs it cannot use and answers it cannot read: one line and exit 1, never
a traceback; and which requests go through the environment's proxy (remote ones only)."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner, Result

from scorebox import cli
from tests.unit.cli_support import run_cli

Answer = Callable[[httpx.Request], httpx.Response]


def _clean_exit_1(result: Result) -> None:
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output


@pytest.fixture(autouse=True)
def environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SCOREBOX_URL", "http://gateway.test")
    monkeypatch.setenv("SCOREBOX_SCHEDULER_URL", "http://scheduler.test")
    monkeypatch.setenv("SCOREBOX_ADMIN_KEY", "the-admin-key")
    monkeypatch.delenv("SCOREBOX_API_KEY", raising=False)


def _serve(monkeypatch: pytest.MonkeyPatch, answer: Answer) -> list[httpx.Request]:
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return answer(request)

    monkeypatch.setattr(cli, "transport", httpx.MockTransport(handle))
    return seen


# --- URLs ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "127.0.0.1:8000",  # no scheme: was "127.0.0.1:8000/ unreachable"
        "http://[::1",  # was an InvalidURL traceback
        "ftp://gateway.test",
        "http://127.0.0.1:99999",
        "http://",
    ],
)
@pytest.mark.parametrize(
    ("variable", "command"),
    [("SCOREBOX_URL", ("status", "t")), ("SCOREBOX_SCHEDULER_URL", ("cron", "list"))],
)
def test_a_malformed_url_names_its_variable(
    monkeypatch: pytest.MonkeyPatch, url: str, variable: str, command: tuple[str, ...]
) -> None:
    seen = _serve(monkeypatch, lambda request: httpx.Response(200, json={}))
    monkeypatch.setenv(variable, url)

    result = run_cli(*command)

    _clean_exit_1(result)
    assert f"error: {variable}={url!r}" in result.output
    assert seen == []


def test_an_empty_url_variable_means_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _serve(monkeypatch, lambda request: httpx.Response(200, json={"task_id": "t"}))
    monkeypatch.setenv("SCOREBOX_URL", "")

    result = run_cli("status", "t")

    assert result.exit_code == 0, result.output
    assert str(seen[0].url) == "http://127.0.0.1:8000/v1/scores/t"


# --- answers that are not what a Scorebox service sends -------------------------------------


NOT_JSON = httpx.Response(
    200,
    text="<html><body>\n<h1>It works!</h1>\n</body></html>",
    headers={"content-type": "text/html"},
)


@pytest.mark.parametrize(
    "command",
    [
        ("status", "t"),
        ("usage",),
        ("dlq", "list"),
        ("keys", "list"),
        ("cron", "list"),
        ("cron", "run", "usage-rollup"),
    ],
)
@pytest.mark.parametrize(
    "answer",
    [
        NOT_JSON,
        httpx.Response(200, content=b"\xff\xfe not UTF-8"),
        httpx.Response(200, json=["a", "list"]),
        httpx.Response(200, content=b""),
    ],
)
def test_an_answer_that_is_no_json_object_is_one_line(
    monkeypatch: pytest.MonkeyPatch, command: tuple[str, ...], answer: httpx.Response
) -> None:
    """`response.json()` raised (JSONDecodeError, or a TypeError/KeyError further on)."""
    status = 202 if command[:2] == ("cron", "run") else 200
    _serve(
        monkeypatch,
        lambda request: httpx.Response(status, content=answer.content, headers=answer.headers),
    )

    result = run_cli(*command)

    _clean_exit_1(result)
    assert "with no JSON object" in result.output
    [line] = result.output.splitlines()
    assert line.startswith(("error: GET ", "error: POST "))


def test_a_long_html_page_is_quoted_short_on_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    page = "<html>\n" + "<p>padding</p>\n" * 500 + "</html>"
    _serve(monkeypatch, lambda request: httpx.Response(200, text=page))

    result = run_cli("status", "t")

    _clean_exit_1(result)
    [line] = result.output.splitlines()
    assert len(line) < 500
    assert line.endswith("...")


@pytest.mark.parametrize(
    ("command", "status", "body", "missing"),
    [
        (("submit", "-"), 202, {"ok": True}, "task_id, status"),
        (("submit", "-", "--wait"), 202, {"task_id": "t1"}, "status"),
        (("cron", "list"), 200, {"ok": True}, "jobs"),
        (("cron", "run", "usage-rollup", "--wait"), 202, {"run_id": "r1"}, "state, status_url"),
    ],
)
def test_an_object_without_the_fields_needed_is_one_line(
    monkeypatch: pytest.MonkeyPatch,
    command: tuple[str, ...],
    status: int,
    body: dict[str, Any],
    missing: str,
) -> None:
    _serve(monkeypatch, lambda request: httpx.Response(status, json=body))

    result = CliRunner().invoke(cli.app, list(command), input="A text.")

    _clean_exit_1(result)
    assert f"without {missing}" in result.output


def test_a_job_list_of_something_else_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    _serve(monkeypatch, lambda request: httpx.Response(200, json={"jobs": [{"name": "x"}]}))

    result = run_cli("cron", "list")

    _clean_exit_1(result)
    assert "a job list without jobs" in result.output


@pytest.mark.parametrize(
    ("body", "shown"),
    [
        (["boom"], '["boom"]'),
        ("boom", '"boom"'),
        (None, "null"),
        (42, "42"),
        ({"detail": [{"field": "text", "message": "required"}]}, '"field": "text"'),
        ({"error": "no detail here"}, '{"error": "no detail here"}'),
    ],
)
def test_an_error_body_of_any_json_shape_is_one_line(
    monkeypatch: pytest.MonkeyPatch, body: Any, shown: str
) -> None:
    """An error body that is no object raised AttributeError ('list' has no 'get')."""
    _serve(monkeypatch, lambda request: httpx.Response(500, content=json.dumps(body).encode()))

    for command in (("status", "t"), ("dlq", "list"), ("cron", "list")):
        result = run_cli(*command)
        _clean_exit_1(result)
        assert result.output.startswith("error 500: ")
        assert shown in result.output


def test_an_empty_error_body_shows_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    _serve(monkeypatch, lambda request: httpx.Response(502, content=b""))

    result = run_cli("status", "t")

    _clean_exit_1(result)
    assert result.output.strip() == "error 502: Bad Gateway"


def test_cron_help_says_it_needs_the_admin_key() -> None:
    """The help said the scheduler's admin routes check no key; they check ADMIN_API_KEY."""
    result = run_cli("cron", "--help")

    assert result.exit_code == 0
    assert "SCOREBOX_ADMIN_KEY" in result.output
    assert "check no key" not in (cli.__doc__ or "")


# --- proxies ---------------------------------------------------------------------------------


class _Named(http.server.BaseHTTPRequestHandler):
    """Answers every GET with a task whose id names the server (`server.name`) and the target."""

    def do_GET(self) -> None:
        name: str = self.server.name  # type: ignore[attr-defined]
        body = json.dumps({"task_id": f"{name} {self.path}", "status": "queued"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def servers() -> Iterator[Callable[[str], str]]:
    """`start(name)` serves `_Named` on 127.0.0.1 and gives its URL; all stopped after."""
    started: list[http.server.ThreadingHTTPServer] = []

    def start(name: str) -> str:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Named)
        server.name = name  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in started:
        server.shutdown()
        server.server_close()


@pytest.fixture
def proxy(monkeypatch: pytest.MonkeyPatch, servers: Callable[[str], str]) -> str:
    url = servers("proxy")
    for name in ("no_proxy", "NO_PROXY", "all_proxy", "ALL_PROXY", "https_proxy", "HTTPS_PROXY"):
        monkeypatch.delenv(name, raising=False)
    for name in ("http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(name, url)
    return url


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_a_gateway_on_this_machine_is_called_directly_despite_a_proxy(
    monkeypatch: pytest.MonkeyPatch, servers: Callable[[str], str], proxy: str, host: str
) -> None:
    """The CLI asked the environment's proxy for 127.0.0.1 (the proxy's own loopback)."""
    gateway = servers("gateway").replace("127.0.0.1", host)
    monkeypatch.setenv("SCOREBOX_URL", gateway)

    result = run_cli("status", "t")

    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["task_id"] == "gateway /v1/scores/t"


def test_a_remote_gateway_is_still_called_through_the_proxy(
    monkeypatch: pytest.MonkeyPatch, proxy: str
) -> None:
    monkeypatch.setenv("SCOREBOX_URL", "http://gateway.example.test")

    result = run_cli("status", "t")

    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["task_id"] == "proxy http://gateway.example.test/v1/scores/t"
