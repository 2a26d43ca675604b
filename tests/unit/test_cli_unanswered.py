"""What `scorebox` says of a request the server got and never answered, against a real HTTP
server (`stub_server`): "unreachable" only when nothing was sent; a request sent and left
unanswered (held past its timeout, or the connection closed) may have been done, and the
line says so and what to do before running the command again. Also how `submit` ends: a
failed task exits 2 only under --wait, a busy answer to the submission of a wait is asked
again within --timeout, and a wait whose last poll ran out of time says "still ...".

Found in review (its repro: a gateway that reads each request whole and never answers)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from scorebox import cli
from tests.unit.cli_support import HANG_UP, HELD, Reply, StubServer, run_cli, stub_server

# The client's own bound on a request in these tests (30 s in use): a held reply outlasts it.
REQUEST_TIMEOUT_S = 0.3
QUEUED = {"task_id": "t1", "status": "queued", "status_url": "/v1/scores/t1"}
BATCH = {"batch_id": "b1", "items": []}
RUN = {"run_id": "r1", "job": "usage-rollup", "state": "dispatched", "status_url": "/r1"}


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[StubServer]:
    monkeypatch.setattr(cli, "REQUEST_TIMEOUT_S", REQUEST_TIMEOUT_S)
    monkeypatch.delenv("SCOREBOX_API_KEY", raising=False)
    with stub_server(monkeypatch) as stub:
        yield stub


@pytest.fixture
def essay(tmp_path: Path) -> Path:
    path = tmp_path / "essay.txt"
    path.write_text("An essay.", encoding="utf-8")
    return path


@pytest.fixture
def items(tmp_path: Path) -> Path:
    path = tmp_path / "items.jsonl"
    path.write_text('"one"\n"two"\n', encoding="utf-8")
    return path


# Each command that changes something, the route it sends, and what its line advises.
CHANGES = [
    pytest.param(("submit", "{essay}"), ("POST", "/v1/scores"), "scored twice", id="submit"),
    pytest.param(
        ("submit", "{essay}", "--wait", "--timeout", "300"),
        ("POST", "/v1/scores"),
        "submit it again with the same --idempotency-key scorebox-cli-",
        id="submit-wait-longer-than-the-client-bound",
    ),
    pytest.param(
        ("submit", "{essay}", "--idempotency-key", "k-1"),
        ("POST", "/v1/scores"),
        "submit it again with the same --idempotency-key",
        id="submit-keyed",
    ),
    pytest.param(
        ("submit-batch", "{items}"), ("POST", "/v1/batches"), "scorebox batches", id="batch"
    ),
    pytest.param(
        ("submit-batch", "{items}", "--idempotency-key", "k-2"),
        ("POST", "/v1/batches"),
        "submit it again with the same --idempotency-key",
        id="batch-keyed",
    ),
    pytest.param(
        ("keys", "create", "--tenant", "acme"),
        ("POST", "/admin/v1/keys"),
        "scorebox keys list --tenant acme",
        id="keys-create",
    ),
    pytest.param(
        ("cron", "run", "usage-rollup"),
        ("POST", "/admin/v1/cron/jobs/usage-rollup/run"),
        "scorebox cron list",
        id="cron-run",
    ),
    pytest.param(
        ("dlq", "replay", "--all"),
        ("POST", "/admin/v1/dead-letters/replay"),
        "check before running it again",
        id="dlq-replay",
    ),
    pytest.param(("cancel", "t1"), ("POST", "/v1/scores/t1/cancel"), "check before", id="cancel"),
]


def _args(command: tuple[str, ...], essay: Path, items: Path) -> list[str]:
    return [arg.format(essay=essay, items=items) for arg in command]


@pytest.mark.parametrize("reply", [HELD, HANG_UP], ids=["held", "hung-up"])
@pytest.mark.parametrize(("command", "route", "advice"), CHANGES)
def test_a_request_sent_and_unanswered_may_have_been_done(
    server: StubServer,
    essay: Path,
    items: Path,
    command: tuple[str, ...],
    route: tuple[str, str],
    advice: str,
    reply: Reply,
) -> None:
    """Each said "error: URL unreachable: timed out" (or "Server disconnected"), though the
    server had the request: a user ran it again, and a text was scored twice, a key created
    twice, a cron job fired twice."""
    server.reply(*route, reply)
    result = run_cli(*_args(command, essay, items))
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert [(request.method, request.path) for request in server.received] == [route]
    [line] = result.stderr.splitlines()
    assert "unreachable" not in line
    assert line.startswith(f"error: {route[0]} {server.url}{route[1]} was sent, but no answer ")
    assert "may have been" in line or "may have accepted" in line
    assert advice in line


@pytest.mark.parametrize("reply", [HELD, HANG_UP], ids=["held", "hung-up"])
def test_a_read_sent_and_unanswered_says_only_that(server: StubServer, reply: Reply) -> None:
    """A GET changes nothing: no advice to check what it did."""
    server.reply("GET", "/v1/scores/t1", reply)
    result = run_cli("status", "t1")
    assert result.exit_code == 1, result.output
    [line] = result.stderr.splitlines()
    assert line.startswith(f"error: GET {server.url}/v1/scores/t1 was sent, but no answer came")
    assert "may have" not in line


@pytest.mark.parametrize(("command", "route", "advice"), CHANGES)
def test_a_server_not_listening_is_unreachable_with_nothing_sent(
    monkeypatch: pytest.MonkeyPatch,
    essay: Path,
    items: Path,
    command: tuple[str, ...],
    route: tuple[str, str],
    advice: str,
) -> None:
    """A connection refused: nothing was sent, and running the command again is safe."""
    with socket.socket() as bound_not_listening:  # the port stays ours, refusing connections
        bound_not_listening.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{bound_not_listening.getsockname()[1]}"
        monkeypatch.setattr(cli, "transport", None)
        monkeypatch.setenv("SCOREBOX_URL", url)
        monkeypatch.setenv("SCOREBOX_SCHEDULER_URL", url)
        monkeypatch.setenv("SCOREBOX_ADMIN_KEY", "the-admin-key")
        result = run_cli(*_args(command, essay, items))
    assert result.exit_code == 1, result.output
    [line] = result.stderr.splitlines()
    assert line.startswith(f"error: {url} unreachable (nothing was sent): ")
    assert "may have" not in line


def test_a_submission_unanswered_within_a_short_wait_gives_the_same_advice(
    server: StubServer, essay: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wait shorter than the client's bound says its own line, with the same advice."""
    monkeypatch.setattr(cli, "REQUEST_TIMEOUT_S", 30.0)
    server.reply("POST", "/v1/scores", HELD)
    result = run_cli("submit", str(essay), "--wait", "--timeout", "0.3", "--idempotency-key", "k")
    assert result.exit_code == 1, result.output
    [line] = result.stderr.splitlines()
    assert line.startswith("error: submission still unanswered after 0.3s: ")
    assert "submit it again with the same --idempotency-key" in line


# --- A failed task ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("wait", "code"), [((), 0), (("--wait",), 2)], ids=["without-wait", "under-wait"]
)
def test_a_failed_task_exits_2_only_under_wait(
    server: StubServer, essay: Path, wait: tuple[str, ...], code: int
) -> None:
    """A keyed submission answered with its earlier task, failed, exited 2 without --wait,
    where the README gives 2 to a task that failed under --wait and `status` of that task
    exits 0."""
    failed = {"task_id": "t1", "status": "failed", "error": "the model refused"}
    server.reply("POST", "/v1/scores", Reply(200, failed))
    result = run_cli("submit", str(essay), "--idempotency-key", "k-1", *wait)
    assert result.exit_code == code, result.output
    assert json.loads(result.stdout)["status"] == "failed"


def test_a_wait_whose_key_answers_an_expired_task_ends_saying_so(
    server: StubServer, essay: Path
) -> None:
    """A keyed replay of a task finished and gone answers `expired`: the wait polled it,
    read 404, and said "unknown or expired task" as if the submission had gone wrong."""
    server.reply("POST", "/v1/scores", Reply(200, {"task_id": "t1", "status": "expired"}))
    result = run_cli("submit", str(essay), "--idempotency-key", "k-1", "--wait")
    assert result.exit_code == 1, result.output
    assert json.loads(result.stdout)["status"] == "expired"
    assert "finished earlier and has expired" in result.stderr
    assert [request.method for request in server.received] == ["POST"]


# --- A busy answer to the submission of a wait ---------------------------------------------


@pytest.mark.parametrize("key", [("--idempotency-key", "k-1"), ()], ids=["keyed", "keyless"])
def test_a_wait_asks_again_after_a_busy_answer_to_its_submission(
    server: StubServer, essay: Path, monkeypatch: pytest.MonkeyPatch, key: tuple[str, ...]
) -> None:
    """A 429 or 503 to the submission (`Retry-After`) ended `submit --wait` with exit 1
    however much of --timeout was left; only its polls were asked again. Asked again under
    one key, its own when none is given: not every 503 kept nothing of it (a proxy's after
    forwarding it), and a keyless retry had the text scored twice (a review)."""
    server.reply(
        "POST",
        "/v1/scores",
        Reply(503, {"detail": "Queue full."}, {"Retry-After": "3"}),
        Reply(429, {"detail": "Too many."}, {"Retry-After": "2"}),
        Reply(202, QUEUED),
    )
    server.reply("GET", "/v1/scores/t1", Reply(200, {"task_id": "t1", "status": "completed"}))
    pauses: list[float] = []
    monkeypatch.setattr(time, "sleep", pauses.append)
    result = run_cli("submit", str(essay), "--wait", *key)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["status"] == "completed"
    assert pauses[:2] == [3, 2]
    posts = [request for request in server.received if request.method == "POST"]
    assert len(posts) == 3
    assert len({(request.body, request.headers["Idempotency-Key"]) for request in posts}) == 1


@pytest.mark.parametrize(
    "wait", [("--wait", "--timeout", "5"), ()], ids=["past-the-deadline", "without-wait"]
)
def test_a_busy_answer_to_a_submission_is_not_asked_again_past_the_wait(
    server: StubServer, essay: Path, monkeypatch: pytest.MonkeyPatch, wait: tuple[str, ...]
) -> None:
    """Its Retry-After past the wait's deadline, or no wait at all: one line and exit 1,
    which says the 503 may have kept the text, and under which key to send it again: the
    key `--wait` made for itself was shown nowhere, and a run again under a new one scored
    the text twice (a review of the CLI)."""
    server.reply("POST", "/v1/scores", Reply(503, {"detail": "Queue full."}, {"Retry-After": "60"}))
    monkeypatch.setattr(time, "sleep", lambda seconds: None)
    result = run_cli("submit", str(essay), *wait)
    assert result.exit_code == 1, result.output
    line = result.stderr.strip()
    assert line.startswith("error 503: Queue full. (retry after 60 s); the gateway may have ")
    assert len(server.received) == 1
    if wait:
        key = server.received[0].headers["Idempotency-Key"]
        assert f"--idempotency-key {key}" in line
    else:
        assert "an --idempotency-key makes submitting again safe" in line


def test_a_refusal_that_kept_nothing_gives_no_advice_to_submit_again(
    server: StubServer, essay: Path
) -> None:
    server.reply("POST", "/v1/scores", Reply(422, {"detail": "text: blank."}))
    result = run_cli("submit", str(essay))
    assert result.exit_code == 1, result.output
    assert result.stderr.strip() == "error 422: text: blank."


IN_PROGRESS = {
    "type": "https://scorebox.dev/problems/request-in-progress",
    "detail": "A request with this Idempotency-Key is still being accepted; retry shortly.",
}
REUSED = {
    "type": "https://scorebox.dev/problems/idempotency-key-reused",
    "detail": "This Idempotency-Key was used with a different request body.",
}


def test_a_wait_asks_again_while_its_keys_first_request_is_being_accepted(
    server: StubServer, essay: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A proxy's 503 after forwarding the submission, then the retry under the same key
    told the first is still being accepted: the wait ended with exit 1 (a review)."""
    server.reply(
        "POST",
        "/v1/scores",
        Reply(503, {"detail": "upstream reset"}, {"Retry-After": "1"}),
        Reply(409, IN_PROGRESS, {"Retry-After": "2"}),
        Reply(200, {"task_id": "t1", "status": "completed"}),
    )
    monkeypatch.setattr(time, "sleep", lambda seconds: None)
    result = run_cli("submit", str(essay), "--wait")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["status"] == "completed"
    assert len(server.received) == 3


def test_a_key_reused_with_another_body_ends_the_wait_at_once(
    server: StubServer, essay: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server.reply("POST", "/v1/scores", Reply(409, REUSED))
    monkeypatch.setattr(time, "sleep", lambda seconds: None)
    result = run_cli("submit", str(essay), "--wait", "--idempotency-key", "k-1")
    assert result.exit_code == 1, result.output
    assert len(server.received) == 1


# --- A wait whose last poll ran out of time --------------------------------------------------


def test_a_poll_that_outlasts_the_wait_ends_it_as_still_unfinished(
    server: StubServer, essay: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A poll bounded by what was left of the wait, timing out, said "unreachable": the
    wait had run out, the task accepted and going on."""
    monkeypatch.setattr(cli, "REQUEST_TIMEOUT_S", 30.0)
    monkeypatch.setattr(cli, "MIN_POLL_S", 0.1)
    server.reply("POST", "/v1/scores", Reply(202, QUEUED))
    server.reply("GET", "/v1/scores/t1", HELD)
    result = run_cli("submit", str(essay), "--wait", "--timeout", "0.3")
    assert result.exit_code == 1, result.output
    assert json.loads(result.stdout)["status"] == "queued"
    assert result.stderr.splitlines() == [
        "task t1 accepted; waiting up to 0.3 s for it",
        "task t1 still queued after 0.3s",
    ]
    assert ("GET", "/v1/scores/t1") in [(r.method, r.path) for r in server.received]


def test_a_run_poll_that_outlasts_the_wait_ends_it_as_still_unfinished(
    server: StubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli, "REQUEST_TIMEOUT_S", 30.0)
    monkeypatch.setattr(cli, "MIN_POLL_S", 0.1)
    server.reply("POST", "/admin/v1/cron/jobs/usage-rollup/run", Reply(202, RUN))
    server.reply("GET", "/r1", HELD)
    result = run_cli("cron", "run", "usage-rollup", "--wait", "--timeout", "0.3")
    assert result.exit_code == 1, result.output
    assert result.stderr.splitlines()[-1] == "run r1 still dispatched after 0.3s"
