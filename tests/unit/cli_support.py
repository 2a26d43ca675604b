"""`scorebox` (the CLI) run in-process against fake servers: its requests answered by a function
(an `httpx.MockTransport` injected through `cli.transport`) or by a real HTTP server
(`stub_server`), its environment as an operator sets it."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner, Result

from scorebox import cli

GATEWAY_URL = "http://gateway.test"
SCHEDULER_URL = "http://scheduler.test"
NOTIFIER_URL = "http://notifier.test"
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
    `SCHEDULER_URL`, the notifier at `NOTIFIER_URL`, the admin key `ADMIN_KEY`, and
    `SCOREBOX_API_KEY` set to `api_key` when one is given (left as it is otherwise)."""
    monkeypatch.setattr(cli, "transport", httpx.MockTransport(answer))
    monkeypatch.setenv("SCOREBOX_URL", GATEWAY_URL)
    monkeypatch.setenv("SCOREBOX_SCHEDULER_URL", SCHEDULER_URL)
    monkeypatch.setenv("SCOREBOX_NOTIFIER_URL", NOTIFIER_URL)
    monkeypatch.setenv("SCOREBOX_ADMIN_KEY", ADMIN_KEY)
    if api_key is not None:
        monkeypatch.setenv("SCOREBOX_API_KEY", api_key)


# --- A real HTTP server ---------------------------------------------------------------------
# As `test_cli_cron_wait.py`'s stub scheduler, for any route: the CLI's requests go over the
# network, so that a timeout or a connection closed is the one httpx meets.

# How long a held reply waits for the test to end at most: far past the request timeout the
# tests set (`short_request_timeout`), so that a CLI which waited for it would get an answer.
HELD_S = 10.0


@dataclass(frozen=True)
class Reply:
    """One answer of `StubServer`: `held` ones never come (the server reads the request and
    keeps the connection open until the test ends); `hang_up` closes the connection having
    read the request, answering nothing."""

    status: int = 200
    body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    held: bool = False
    hang_up: bool = False


HELD, HANG_UP = Reply(held=True), Reply(hang_up=True)


@dataclass(frozen=True)
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class StubServer:
    """Answers each request with the next of `replies[(method, path)]` (the last one again
    once they run out; 404 for a route it has none for); every request read whole is in
    `received`."""

    url: str
    replies: dict[tuple[str, str], list[Reply]] = field(default_factory=dict)
    received: list[Received] = field(default_factory=list)
    released: threading.Event = field(default_factory=threading.Event)

    def reply(self, method: str, path: str, *replies: Reply) -> None:
        self.replies[(method, path)] = list(replies)

    def next_reply(self, method: str, path: str) -> Reply:
        replies = self.replies.get((method, path)) or [Reply(404, {"detail": "no such route"})]
        return replies.pop(0) if len(replies) > 1 else replies[0]


def _stub_handler(stub: StubServer) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            self._answer()

        def do_POST(self) -> None:
            self._answer()

        def do_DELETE(self) -> None:
            self._answer()

        def _answer(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            path = self.path.partition("?")[0]
            stub.received.append(Received(self.command, path, dict(self.headers), body))
            reply = stub.next_reply(self.command, path)
            self.close_connection = True
            if reply.held:
                stub.released.wait(HELD_S)
            if reply.held or reply.hang_up:
                return  # the connection closes with no answer
            data = json.dumps(reply.body).encode()
            try:
                self.send_response(reply.status)
                self.send_header("Content-Type", "application/json")
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except OSError:  # the CLI hung up
                pass

    return Handler


@contextlib.contextmanager
def stub_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[StubServer]:
    """A `StubServer` on a free local port, the CLI's gateway and scheduler both, reached
    over the network (no injected transport); stopped, its held replies let go, at the end."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    stub = StubServer(url=f"http://127.0.0.1:{server.server_port}")
    server.RequestHandlerClass = _stub_handler(stub)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    monkeypatch.setattr(cli, "transport", None)
    monkeypatch.setenv("SCOREBOX_URL", stub.url)
    monkeypatch.setenv("SCOREBOX_SCHEDULER_URL", stub.url)
    monkeypatch.setenv("SCOREBOX_ADMIN_KEY", ADMIN_KEY)
    try:
        yield stub
    finally:
        stub.released.set()
        server.shutdown()
        server.server_close()
        thread.join()
