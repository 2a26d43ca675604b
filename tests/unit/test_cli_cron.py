"""`scorebox cron ...` and `scorebox usage` against fake servers (an httpx.MockTransport
injected through `cli.transport`): what they send, what they show, their exit codes."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from scorebox import cli
from tests.unit.cli_support import cli_answered_by, run_cli

Answer = Callable[[httpx.Request], httpx.Response]

RUN_URL = "/admin/v1/cron/runs/r1"
ACCEPTED = {
    "run_id": "r1",
    "job": "usage-rollup",
    "state": "dispatched",
    "scheduled_for": "2030-01-01T10:00:00Z",
    "status_url": RUN_URL,
}


def _job(name: str, *, enabled: bool = True, last: str | None = None) -> dict[str, Any]:
    return {
        "name": name,
        "description": "",
        "cron": "5 * * * *",
        "tz": "Europe/Paris",
        "missed": "coalesce",
        "enabled": enabled,
        "next_fire_at": "2030-01-01T11:05:00Z" if enabled else None,
        "next_fire_local": None,
        "last_firing": None if last is None else {"run_id": "r0", "state": last},
    }


def _run_state(state: str) -> dict[str, Any]:
    return {"run_id": "r1", "job": "usage-rollup", "state": state, "result": None, "error": None}


def _problem(status: int, detail: str) -> httpx.Response:
    body = {"type": "about:blank", "title": "x", "status": status, "detail": detail}
    return httpx.Response(status, json=body, headers={"content-type": "application/problem+json"})


class FakeServer:
    """Answers each request with the next scripted answer for its (method, path)."""

    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []
        self.answers: dict[tuple[str, str], list[httpx.Response]] = {}

    def script(self, method: str, path: str, *answers: httpx.Response) -> None:
        self.answers[(method, path)] = list(answers)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        queue = self.answers.get((request.method, request.url.path))
        if not queue:
            return _problem(404, f"nothing scripted for {request.url.path}")
        return queue.pop(0) if len(queue) > 1 else queue[0]


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> FakeServer:
    fake = FakeServer()
    cli_answered_by(monkeypatch, fake, api_key="an-api-key")
    return fake


# --- cron list ---------------------------------------------------------------------------


def test_cron_list_shows_a_table_of_the_jobs(server: FakeServer) -> None:
    jobs = [_job("usage-rollup", last="succeeded"), _job("rescore-fanout", enabled=False)]
    server.script("GET", "/admin/v1/cron/jobs", httpx.Response(200, json={"jobs": jobs}))

    result = run_cli("cron", "list")

    assert result.exit_code == 0, result.output
    [request] = server.requests
    assert request.url.host == "scheduler.test"
    assert request.headers["authorization"] == "Bearer the-admin-key"
    header, first, second = result.output.splitlines()
    assert header.split() == [
        "NAME",
        "CRON",
        "TZ",
        "ENABLED",
        "NEXT",
        "FIRE",
        "(UTC)",
        "LAST",
        "STATE",
    ]
    assert first.split() == [
        "usage-rollup",
        "5",
        "*",
        "*",
        "*",
        "*",
        "Europe/Paris",
        "yes",
        "2030-01-01T11:05:00Z",
        "succeeded",
    ]
    assert second.split()[-3:] == ["no", "-", "-"]
    assert header.index("TZ") == first.index("Europe/Paris")  # the columns line up


def test_cron_list_reports_an_unavailable_scheduler(server: FakeServer) -> None:
    server.script("GET", "/admin/v1/cron/jobs", _problem(503, "database unavailable"))
    result = run_cli("cron", "list")
    assert result.exit_code == 1
    assert "error 503: database unavailable" in result.output


def test_cron_list_without_a_scheduler_fails_cleanly(
    server: FakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    monkeypatch.setattr(cli, "transport", httpx.MockTransport(refuse))
    result = run_cli("cron", "list")
    assert result.exit_code == 1
    assert (
        "error: http://scheduler.test unreachable (nothing was sent): connection refused"
        in result.output
    )


# --- cron run ----------------------------------------------------------------------------


def test_cron_run_fires_the_job_and_prints_the_accepted_run(server: FakeServer) -> None:
    server.script(
        "POST", "/admin/v1/cron/jobs/usage-rollup/run", httpx.Response(202, json=ACCEPTED)
    )

    result = run_cli("cron", "run", "usage-rollup")

    assert result.exit_code == 0, result.output
    [request] = server.requests
    assert (request.method, request.url.host) == ("POST", "scheduler.test")
    assert json.loads(result.output)["run_id"] == "r1"


@pytest.mark.parametrize(("final", "code"), [("succeeded", 0), ("skipped", 0), ("failed", 2)])
def test_cron_run_wait_polls_the_run_until_it_ends(
    server: FakeServer, final: str, code: int
) -> None:
    server.script(
        "POST", "/admin/v1/cron/jobs/usage-rollup/run", httpx.Response(202, json=ACCEPTED)
    )
    server.script(
        "GET",
        RUN_URL,
        httpx.Response(200, json=_run_state("dispatched")),
        httpx.Response(200, json=_run_state("running")),
        httpx.Response(200, json=_run_state(final)),
    )

    result = run_cli("cron", "run", "usage-rollup", "--wait", "--poll-s", "0")

    assert result.exit_code == code, result.output
    polls = [r for r in server.requests if r.method == "GET"]
    assert [r.url.path for r in polls] == [RUN_URL] * 3
    assert json.loads(result.stdout)["state"] == final
    assert "run r1 fired" in result.stderr


@pytest.mark.parametrize("status", [404, 503])
def test_cron_run_refused_exits_1(server: FakeServer, status: int) -> None:
    server.script("POST", "/admin/v1/cron/jobs/nope/run", _problem(status, "no such job"))
    result = run_cli("cron", "run", "nope", "--wait")
    assert result.exit_code == 1
    assert f"error {status}: no such job" in result.output


def _typed_problem(status: int, kind: str, retry_after: str | None = "0") -> httpx.Response:
    body = {"type": f"https://scorebox.dev/problems/{kind}", "status": status, "detail": kind}
    headers = {"content-type": "application/problem+json"}
    if retry_after is not None:
        headers["Retry-After"] = retry_after
    return httpx.Response(status, json=body, headers=headers)


def test_cron_run_wait_fires_again_after_a_refusal_that_started_nothing(
    server: FakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker away for a moment (the run withdrawn), the job's lease contended, or too
    many runs asked: nothing was started, and the wait ended with exit 1 however much of
    --timeout was left."""
    server.script(
        "POST",
        "/admin/v1/cron/jobs/usage-rollup/run",
        _typed_problem(503, "broker-unavailable", retry_after="3"),
        _typed_problem(503, "lease-contended"),
        _typed_problem(429, "too-many-requests"),
        httpx.Response(202, json=ACCEPTED),
    )
    server.script("GET", RUN_URL, httpx.Response(200, json=_run_state("succeeded")))
    pauses: list[float] = []
    monkeypatch.setattr(time, "sleep", pauses.append)

    result = run_cli("cron", "run", "usage-rollup", "--wait", "--poll-s", "0")

    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["state"] == "succeeded"
    assert len([r for r in server.requests if r.method == "POST"]) == 4
    assert pauses[0] == 3


@pytest.mark.parametrize(
    "refusal",
    [
        _typed_problem(503, "database-unavailable"),
        _typed_problem(503, "run-outcome-unknown", retry_after=None),
        httpx.Response(503, text="upstream reset", headers={"Retry-After": "0"}),
    ],
    ids=["database-away", "outcome-unknown", "a-proxy's"],
)
@pytest.mark.parametrize(
    "wait", [("--wait", "--timeout", "2"), ()], ids=["under-wait", "without-wait"]
)
def test_cron_run_never_fires_again_after_a_refusal_that_may_have_started_a_run(
    server: FakeServer,
    monkeypatch: pytest.MonkeyPatch,
    refusal: httpx.Response,
    wait: tuple[str, ...],
) -> None:
    """Those may have recorded or dispatched the run: fired again, the job runs twice."""
    server.script("POST", "/admin/v1/cron/jobs/usage-rollup/run", refusal)
    monkeypatch.setattr(time, "sleep", lambda seconds: None)
    result = run_cli("cron", "run", "usage-rollup", *wait)
    assert result.exit_code == 1, result.output
    assert "error 503" in result.stderr
    assert len(server.requests) == 1


def test_cron_run_without_wait_fires_once_whatever_the_refusal(
    server: FakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    server.script(
        "POST", "/admin/v1/cron/jobs/usage-rollup/run", _typed_problem(503, "broker-unavailable")
    )
    monkeypatch.setattr(time, "sleep", lambda seconds: None)
    result = run_cli("cron", "run", "usage-rollup")
    assert result.exit_code == 1
    assert len(server.requests) == 1


def test_cron_run_wait_exits_1_when_the_run_is_gone(server: FakeServer) -> None:
    server.script(
        "POST", "/admin/v1/cron/jobs/usage-rollup/run", httpx.Response(202, json=ACCEPTED)
    )
    server.script("GET", RUN_URL, _problem(404, "No cron run 'r1' is known"))
    result = run_cli("cron", "run", "usage-rollup", "--wait", "--poll-s", "0")
    assert result.exit_code == 1
    assert "error 404" in result.output


def test_cron_run_wait_gives_up_at_its_timeout(server: FakeServer) -> None:
    server.script(
        "POST", "/admin/v1/cron/jobs/usage-rollup/run", httpx.Response(202, json=ACCEPTED)
    )
    server.script("GET", RUN_URL, httpx.Response(200, json=_run_state("running")))
    result = run_cli("cron", "run", "usage-rollup", "--wait", "--timeout", "0", "--poll-s", "0")
    assert result.exit_code == 1
    assert "still running" in result.output


def test_cron_sends_no_key_when_none_is_set(
    server: FakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SCOREBOX_ADMIN_KEY")
    server.script("GET", "/admin/v1/cron/jobs", httpx.Response(200, json={"jobs": []}))
    assert run_cli("cron", "list").exit_code == 0
    assert "authorization" not in server.requests[0].headers


# --- usage -------------------------------------------------------------------------------


def test_usage_asks_the_gateway_with_the_api_key(server: FakeServer) -> None:
    report = {"tenant_id": "acme", "from": "2030-01-01", "to": "2030-01-31", "days": []}
    server.script("GET", "/v1/usage", httpx.Response(200, json=report))

    result = run_cli("usage", "--from", "2030-01-01", "--to", "2030-01-31")

    assert result.exit_code == 0, result.output
    [request] = server.requests
    assert request.url.host == "gateway.test"
    assert request.headers["authorization"] == "Bearer an-api-key"
    assert dict(request.url.params) == {"from": "2030-01-01", "to": "2030-01-31"}
    assert json.loads(result.output) == report


def test_usage_leaves_the_period_to_the_gateway_when_not_given(server: FakeServer) -> None:
    server.script("GET", "/v1/usage", httpx.Response(200, json={"days": []}))
    assert run_cli("usage").exit_code == 0
    assert dict(server.requests[0].url.params) == {}


def test_usage_reports_a_refused_period(server: FakeServer) -> None:
    server.script("GET", "/v1/usage", _problem(422, "`to` must not be before `from`."))
    result = run_cli("usage", "--from", "2030-01-31", "--to", "2030-01-01")
    assert result.exit_code == 1
    assert "error 422: `to` must not be before `from`." in result.output


# --- cron dlq ----------------------------------------------------------------------------

CRON_DLQ = "/admin/v1/cron/dead-letters"


def test_cron_dlq_list_asks_the_scheduler_with_the_admin_key(server: FakeServer) -> None:
    letter = {"run_id": "r0", "job": "usage-rollup", "reason": "gave up", "job_configured": True}
    listing = {"count": 1, "truncated": False, "letters": [letter]}
    server.script("GET", CRON_DLQ, httpx.Response(200, json=listing))

    result = run_cli("cron", "dlq", "list")

    assert result.exit_code == 0, result.output
    [request] = server.requests
    assert request.url.host == "scheduler.test"
    assert request.headers["authorization"] == "Bearer the-admin-key"
    assert json.loads(result.output) == listing


def test_cron_dlq_replay_sends_the_run_ids(server: FakeServer) -> None:
    report = {"replayed": [{"dead_run_id": "r0", "run_id": "r9"}], "not_found": []}
    server.script("POST", f"{CRON_DLQ}/replay", httpx.Response(200, json=report))

    result = run_cli("cron", "dlq", "replay", "r0")

    assert result.exit_code == 0, result.output
    [request] = server.requests
    assert request.url.host == "scheduler.test"
    assert json.loads(request.content) == {"run_ids": ["r0"]}
    assert json.loads(result.output) == report


def test_cron_dlq_replay_all(server: FakeServer) -> None:
    server.script("POST", f"{CRON_DLQ}/replay", httpx.Response(200, json={"replayed": []}))
    result = run_cli("cron", "dlq", "replay", "--all")
    assert result.exit_code == 0, result.output
    assert json.loads(server.requests[0].content) == {"all": True}


@pytest.mark.parametrize(
    ("args", "said"),
    [((), "give ids, or --all"), (("r0", "--all"), "ids and --all: give one or the other")],
)
def test_cron_dlq_replay_wants_ids_or_all(
    server: FakeServer, args: tuple[str, ...], said: str
) -> None:
    """Given neither, it said "(not both)" (found in a walkthrough)."""
    result = run_cli("cron", "dlq", "replay", *args)
    assert result.exit_code == 2
    assert result.stderr == f"error: {said}\n"  # as every other refusal says it
    assert not server.requests


def test_cron_dlq_replay_exits_1_on_a_run_not_found(server: FakeServer) -> None:
    report = {"replayed": [], "not_found": ["r7"]}
    server.script("POST", f"{CRON_DLQ}/replay", httpx.Response(200, json=report))
    result = run_cli("cron", "dlq", "replay", "r7")
    assert result.exit_code == 1
    assert "not found: r7" in result.output


@pytest.mark.parametrize(
    ("field", "said"),
    [
        ("skipped_in_progress", "kept, their job has a run in progress"),
        ("skipped_unconfigured", "kept, their job is no longer configured"),
    ],
)
def test_cron_dlq_replay_that_kept_letters_says_why_and_exits_1(
    server: FakeServer, field: str, said: str
) -> None:
    """It exited 0 and said nothing, the letter still in the queue (a walkthrough)."""
    report = {"replayed": [], "not_found": [], field: ["r3"]}
    server.script("POST", f"{CRON_DLQ}/replay", httpx.Response(200, json=report))
    result = run_cli("cron", "dlq", "replay", "--all")
    assert result.exit_code == 1
    assert f"{said}" in result.stderr
    assert "r3" in result.stderr


def test_cron_dlq_replay_refused_for_a_job_gone_exits_1(server: FakeServer) -> None:
    refused = _problem(409, "job no longer configured: old-job (run r0)")
    server.script("POST", f"{CRON_DLQ}/replay", refused)
    result = run_cli("cron", "dlq", "replay", "r0")
    assert result.exit_code == 1
    assert "error 409: job no longer configured" in result.output


def test_cron_dlq_purge_asks_first(server: FakeServer) -> None:
    server.script("DELETE", CRON_DLQ, httpx.Response(200, json={"purged": 3}))

    declined = CliRunner().invoke(cli.app, ["cron", "dlq", "purge"], input="n\n")
    assert declined.exit_code == 1
    assert not server.requests

    result = run_cli("cron", "dlq", "purge", "--yes")
    assert result.exit_code == 0, result.output
    [request] = server.requests
    assert (request.method, request.url.host) == ("DELETE", "scheduler.test")
    assert json.loads(result.output) == {"purged": 3}
