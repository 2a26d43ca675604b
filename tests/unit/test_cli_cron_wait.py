"""`scorebox cron run --wait` keeps `submit --wait`'s rules, against a real HTTP server (a stub
scheduler on a free local port): each poll bounded by what is left of the wait, a busy answer
(429, 503) polled again after its Retry-After, the fired run named before the wait, and a
`--timeout` or `--poll-s` that is no duration refused before anything is sent."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from scorebox import cli
from scorebox.cli import MIN_POLL_PAUSE_S
from tests.unit.cli_support import run_cli

RUN_ID = "run-42"
RUN_PATH = f"/admin/v1/cron/runs/{RUN_ID}"
ACCEPTED = {"run_id": RUN_ID, "job": "housekeeping", "state": "dispatched", "status_url": RUN_PATH}
# How long the stub holds a poll it never means to answer in time: far past the `--timeout 1`
# of the test, well short of the CLI's 30 s request timeout, so that a CLI which waits for
# the answer gets it, and a run that succeeded.
HELD_S = 8.0


@dataclass(frozen=True)
class Poll:
    """One answer to a poll of the run; `held` ones come only after `HELD_S` (or the test's
    end)."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    held: bool = False


def _run(state: str) -> Poll:
    return Poll(200, {"run_id": RUN_ID, "job": "housekeeping", "state": state})


def _busy(status: int, retry_after: str) -> Poll:
    detail = "The database is unavailable; retry shortly."
    return Poll(status, {"detail": detail}, {"Retry-After": retry_after})


@dataclass
class StubScheduler:
    """Answers POST .../run with 202 for `RUN_ID`, and each GET of the run with the next of
    `polls` (the last one again once they run out)."""

    polls: list[Poll]
    requests: list[str] = field(default_factory=list)
    released: threading.Event = field(default_factory=threading.Event)

    def next_poll(self) -> Poll:
        return self.polls.pop(0) if len(self.polls) > 1 else self.polls[0]


def _handler(stub: StubScheduler) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            stub.requests.append(f"POST {self.path}")
            self._send(Poll(202, ACCEPTED))

        def do_GET(self) -> None:
            stub.requests.append(f"GET {self.path}")
            poll = stub.next_poll()
            if poll.held:
                stub.released.wait(HELD_S)
            self._send(poll)

        def _send(self, poll: Poll) -> None:
            data = json.dumps(poll.body).encode()
            try:
                self.send_response(poll.status)
                self.send_header("Content-Type", "application/json")
                for name, value in poll.headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except OSError:  # the CLI gave up on a held answer and hung up
                pass

    return Handler


@pytest.fixture
def scheduler(monkeypatch: pytest.MonkeyPatch) -> Iterator[StubScheduler]:
    stub = StubScheduler(polls=[_run("running")])
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(stub))
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    monkeypatch.setattr(cli, "transport", None)  # the network: a real HTTP exchange
    monkeypatch.setenv("SCOREBOX_SCHEDULER_URL", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setenv("SCOREBOX_ADMIN_KEY", "the-admin-key")
    try:
        yield stub
    finally:
        stub.released.set()
        server.shutdown()
        server.server_close()
        thread.join()


def test_each_poll_of_a_run_wait_is_bounded_by_what_is_left_of_it(
    scheduler: StubScheduler,
) -> None:
    """A scheduler that accepted the run, then never answered its read, held a `--timeout 3`
    wait for the client's 30 s: here the CLI would have waited for the held answer."""
    scheduler.polls = [Poll(200, _run("succeeded").body, held=True)]
    result = run_cli("cron", "run", "housekeeping", "--wait", "--timeout", "1")
    assert result.exit_code == 1, result.output
    # The wait ran out, as one whose polls kept answering does: not "unreachable".
    assert result.stderr.splitlines()[-1] == f"run {RUN_ID} still dispatched after 1s"
    assert "succeeded" not in result.output


def test_a_run_wait_polls_on_through_busy_answers_after_their_retry_after(
    scheduler: StubScheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first 503 while polling (a database blip) ended the wait at once with exit 1."""
    scheduler.polls = [_busy(503, "1"), _busy(429, "2"), _run("succeeded")]
    pauses: list[float] = []
    monkeypatch.setattr(time, "sleep", pauses.append)
    result = run_cli("cron", "run", "housekeeping", "--wait", "--timeout", "60")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["state"] == "succeeded"
    assert pauses == [1, 2]


def test_a_run_wait_of_no_pause_between_polls_still_pauses_a_little(
    scheduler: StubScheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--poll-s 0` asked the scheduler back to back for as long as the run took (a review
    of the CLI)."""
    scheduler.polls = [_run("running"), _run("running"), _run("succeeded")]
    pauses: list[float] = []
    monkeypatch.setattr(time, "sleep", pauses.append)
    result = run_cli("cron", "run", "housekeeping", "--wait", "--poll-s", "0")
    assert result.exit_code == 0, result.output
    assert pauses
    assert min(pauses) >= MIN_POLL_PAUSE_S


@pytest.mark.parametrize(
    "poll",
    [_busy(503, "60"), Poll(500, {"detail": "oops"}), Poll(404, {"detail": "no such run"})],
    ids=["busy-past-the-deadline", "an-error", "the-run-gone"],
)
def test_the_fired_run_is_named_however_the_wait_ends(scheduler: StubScheduler, poll: Poll) -> None:
    """The run id was never shown when the wait failed, though the run was fired and went on:
    running the command again fired the job a second time."""
    scheduler.polls = [poll]
    result = run_cli("cron", "run", "housekeeping", "--wait", "--timeout", "1")
    assert result.exit_code == 1, result.output
    assert f"run {RUN_ID} fired" in result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--timeout", "nan"),
        ("--timeout", "inf"),
        ("--timeout", "-1"),
        ("--poll-s", "nan"),
        ("--poll-s", "inf"),
    ],
)
def test_a_wait_option_that_is_no_duration_is_a_usage_error(
    scheduler: StubScheduler, monkeypatch: pytest.MonkeyPatch, option: str, value: str
) -> None:
    """`--timeout nan` polled for ever (no time is past nan), `--poll-s inf` printed an
    OverflowError traceback; both after the job was fired."""

    def polling(seconds: float) -> None:
        raise AssertionError("the wait began: it would poll for ever, or sleep(inf)")

    monkeypatch.setattr(time, "sleep", polling)
    result = run_cli("cron", "run", "housekeeping", "--wait", option, value)
    assert result.exit_code == 2, result.output
    assert f"{option} must be a number of seconds" in result.stderr
    assert scheduler.requests == []
