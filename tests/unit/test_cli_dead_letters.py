"""`scorebox dlq drop`, `scorebox cron dlq drop` and `scorebox webhooks dlq drop`, and what
the dead-letter commands say when the service's walk of the queue stopped at its bound,
against fake servers (an httpx.MockTransport injected through `cli.transport`)."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest

from scorebox import cli
from shared import dead_letters
from shared.dead_letters import MAX_WALK, MAX_WALK_BYTES, REPLAY_BUDGET_S
from tests.unit.cli_support import cli_answered_by, run_cli
from tests.unit.test_cli_cron import FakeServer, _problem

LETTERS = "/admin/v1/dead-letters"
CRON_LETTERS = "/admin/v1/cron/dead-letters"
WEBHOOK_LETTERS = "/admin/v1/webhooks/dead-letters"
WALK_STOPPED = "truncated: the walk stopped at its bound (10,000 letters or 64 MiB"
TIMED_OUT = "timed out: the replay stopped at its time budget (20 s) with letters left"

Json = dict[str, Any]


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> FakeServer:
    fake = FakeServer()
    cli_answered_by(monkeypatch, fake)
    return fake


def _dropped(letter_id: str, removed: int = 1, *, truncated: bool = False) -> httpx.Response:
    return httpx.Response(
        200, json={"letter_id": letter_id, "removed": removed, "truncated": truncated}
    )


def _objects(text: str) -> list[Json]:
    """The JSON objects printed one after another."""
    decoder, found, at = json.JSONDecoder(), [], 0
    while text[at:].strip():
        value, at = decoder.raw_decode(text, text.index("{", at))
        found.append(value)
    return found


# --- drop --------------------------------------------------------------------------------


def test_dlq_drop_deletes_each_letter_in_a_path_segment_of_its_own(server: FakeServer) -> None:
    server.script("DELETE", f"{LETTERS}/a/b", _dropped("a/b"))
    server.script("DELETE", f"{LETTERS}/t2", _dropped("t2", removed=2))

    result = run_cli("dlq", "drop", "a/b", "t2")

    assert result.exit_code == 0, result.output
    assert [(r.method, r.url.host, r.url.raw_path) for r in server.requests] == [
        ("DELETE", "gateway.test", b"/admin/v1/dead-letters/a%2Fb"),
        ("DELETE", "gateway.test", b"/admin/v1/dead-letters/t2"),
    ]
    assert all(r.headers["authorization"] == "Bearer the-admin-key" for r in server.requests)
    reports = _objects(result.stdout)
    assert [(r["letter_id"], r["removed"]) for r in reports] == [("a/b", 1), ("t2", 2)]
    assert result.stderr == ""


def test_dlq_drop_tries_every_id_and_exits_1_when_one_was_not_dropped(
    server: FakeServer,
) -> None:
    server.script("DELETE", f"{LETTERS}/gone", _problem(404, "No dead letter 'gone'."))
    server.script("DELETE", f"{LETTERS}/t2", _dropped("t2"))

    result = run_cli("dlq", "drop", "gone", "t2")

    assert result.exit_code == 1
    assert len(server.requests) == 2
    assert "error 404: No dead letter 'gone'." in result.stderr
    assert json.loads(result.stdout)["letter_id"] == "t2"


@pytest.mark.parametrize(
    ("command", "path", "host"),
    [
        (("dlq", "drop"), LETTERS, "gateway.test"),
        (("cron", "dlq", "drop"), CRON_LETTERS, "scheduler.test"),
        (("webhooks", "dlq", "drop"), WEBHOOK_LETTERS, "notifier.test"),
    ],
)
def test_a_drop_that_does_not_get_an_answer_is_reported_and_the_other_ids_are_tried(
    server: FakeServer,
    monkeypatch: pytest.MonkeyPatch,
    command: tuple[str, ...],
    path: str,
    host: str,
) -> None:
    """A transport error (a timeout, a connection reset) on one id ended the command there:
    the ids after it were never tried."""

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == f"{path}/lost":
            server.requests.append(request)
            raise httpx.ReadTimeout("timed out", request=request)
        return server(request)

    monkeypatch.setattr(cli, "transport", httpx.MockTransport(answer))
    server.script("DELETE", f"{path}/t1", _dropped("t1"))
    server.script("DELETE", f"{path}/t3", _dropped("t3"))

    result = run_cli(*command, "t1", "lost", "t3")

    assert result.exit_code == 1
    assert [r.url.path for r in server.requests] == [
        f"{path}/{key}" for key in ("t1", "lost", "t3")
    ]
    assert [report["letter_id"] for report in _objects(result.stdout)] == ["t1", "t3"]
    assert result.stderr.splitlines() == [
        f"error: DELETE http://{host}{path}/lost: no answer (ReadTimeout: timed out)"
    ]


def test_a_drop_the_walk_did_not_reach_exits_1_with_why(server: FakeServer) -> None:
    detail = "No dead letter 't9' among the first 1300: it may lie past them."
    server.script("DELETE", f"{LETTERS}/t9", _problem(409, detail))

    result = run_cli("dlq", "drop", "t9")

    assert result.exit_code == 1
    assert f"error 409: {detail}" in result.stderr


def test_a_drop_cut_short_says_copies_may_be_left(server: FakeServer) -> None:
    server.script("DELETE", f"{LETTERS}/t1", _dropped("t1", removed=3, truncated=True))

    result = run_cli("dlq", "drop", "t1")

    assert result.exit_code == 0, result.output
    assert WALK_STOPPED in result.stderr
    assert "copies past it, if any, are still there" in result.stderr


def test_a_drop_that_kept_every_copy_past_its_cut_off_says_so_and_exits_1(
    server: FakeServer,
) -> None:
    """It printed `removed: 0, kept: 1` and exited 0, read as done (a walkthrough)."""
    kept = {"letter_id": "t1", "removed": 0, "kept": 1, "truncated": False}
    server.script("DELETE", f"{LETTERS}/t1", httpx.Response(200, json=kept))

    result = run_cli("dlq", "drop", "t1", "--before", "2026-12-06T10:00:00Z")

    assert result.exit_code == 1
    assert "t1: kept, dead-lettered at or after --before" in result.stderr
    # A letter of unknown time is kept too: it was said to be dead-lettered after the cut-off.
    assert "or at a time the letter does not say" in " ".join(result.stderr.split())


@pytest.mark.parametrize(
    "command", [("dlq", "drop"), ("cron", "dlq", "drop"), ("webhooks", "dlq", "drop")]
)
def test_a_drop_with_an_empty_id_sends_nothing(
    server: FakeServer, command: tuple[str, ...]
) -> None:
    result = run_cli(*command, "t1", "")
    assert result.exit_code == 2
    assert not server.requests


@pytest.mark.parametrize(
    "command", [("dlq", "drop"), ("cron", "dlq", "drop"), ("webhooks", "dlq", "drop")]
)
def test_a_drop_needs_an_id(server: FakeServer, command: tuple[str, ...]) -> None:
    assert run_cli(*command).exit_code == 2
    assert not server.requests


def test_cron_dlq_drop_asks_the_scheduler(server: FakeServer) -> None:
    dropped = {"run_id": "r/0", "removed": 1, "truncated": False}
    server.script("DELETE", f"{CRON_LETTERS}/r/0", httpx.Response(200, json=dropped))

    result = run_cli("cron", "dlq", "drop", "r/0")

    assert result.exit_code == 0, result.output
    [request] = server.requests
    assert (request.url.host, request.url.raw_path) == (
        "scheduler.test",
        b"/admin/v1/cron/dead-letters/r%2F0",
    )
    assert request.headers["authorization"] == "Bearer the-admin-key"
    assert json.loads(result.stdout) == dropped


# --- a walk cut short --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "path"),
    [
        (("dlq", "list"), LETTERS),
        (("cron", "dlq", "list"), CRON_LETTERS),
        (("webhooks", "dlq", "list"), WEBHOOK_LETTERS),
    ],
)
@pytest.mark.parametrize("truncated", [True, False])
def test_a_listing_says_when_its_walk_was_cut_short(
    server: FakeServer, command: tuple[str, ...], path: str, truncated: bool
) -> None:
    listing = {"count": 1300, "truncated": truncated, "items": []}
    server.script("GET", path, httpx.Response(200, json=listing))

    result = run_cli(*command)

    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == listing
    if truncated:
        assert WALK_STOPPED in result.stderr
        assert "1300 listed, the rest not reached" in result.stderr
    else:
        assert result.stderr == ""


@pytest.mark.parametrize(
    ("command", "path"),
    [
        (("dlq", "replay"), LETTERS),
        (("cron", "dlq", "replay"), CRON_LETTERS),
        (("webhooks", "dlq", "replay"), WEBHOOK_LETTERS),
    ],
)
def test_a_replay_by_ids_cut_short_names_the_ids_not_reached_and_exits_1(
    server: FakeServer, command: tuple[str, ...], path: str
) -> None:
    report: Json = {"replayed": [], "not_found": [], "not_reached": ["x", "y"], "truncated": True}
    server.script("POST", f"{path}/replay", httpx.Response(200, json=report))

    result = run_cli(*command, "x", "y")

    assert result.exit_code == 1
    assert json.loads(result.stdout) == report
    assert WALK_STOPPED in result.stderr
    assert "not reached" in result.stderr
    assert result.stderr.rstrip().endswith(": x y")
    assert "not found" not in result.stderr


@pytest.mark.parametrize(
    ("command", "path"),
    [
        (("dlq", "replay"), LETTERS),
        (("cron", "dlq", "replay"), CRON_LETTERS),
        (("webhooks", "dlq", "replay"), WEBHOOK_LETTERS),
    ],
)
@pytest.mark.parametrize(
    ("stopped", "said"),
    [
        ("truncated", (WALK_STOPPED, "run again to reach them")),
        ("timed_out", (TIMED_OUT, "run it again for the rest")),
    ],
)
def test_a_replay_of_all_stopped_short_says_so_and_exits_1(
    server: FakeServer, command: tuple[str, ...], path: str, stopped: str, said: tuple[str, str]
) -> None:
    """It exited 0: a script could not tell that letters were left unreplayed."""
    report: Json = {"replayed": ["t1"], "not_found": [], "not_reached": [], stopped: True}
    server.script("POST", f"{path}/replay", httpx.Response(200, json=report))

    result = run_cli(*command, "--all")

    assert result.exit_code == 1, result.output
    assert json.loads(result.stdout) == report
    assert all(line in result.stderr for line in said), result.stderr


def test_a_replay_by_ids_that_replayed_them_all_exits_0_though_its_walk_was_cut_short(
    server: FakeServer,
) -> None:
    """Every id asked for was replayed: letters past the walk were not asked for."""
    report: Json = {"replayed": ["t1"], "not_found": [], "not_reached": [], "truncated": True}
    server.script("POST", f"{LETTERS}/replay", httpx.Response(200, json=report))

    result = run_cli("dlq", "replay", "t1")

    assert result.exit_code == 0, result.output
    assert WALK_STOPPED in result.stderr


def _replayed_t1(**lists: list[str]) -> Json:
    """A whole replay report: `t1` replayed, the walk whole, and `lists` besides."""
    return {
        "replayed": ["t1"],
        "skipped_unreadable": [],
        "not_found": [],
        "not_reached": [],
        "truncated": False,
        "timed_out": False,
        **lists,
    }


@pytest.mark.parametrize("asked", [("t1", "t2", "t3"), ("--all",)], ids=["by-ids", "all"])
def test_a_replay_names_the_letters_superseded_and_exits_0(
    server: FakeServer, asked: tuple[str, ...]
) -> None:
    """Letters a later generation superseded were removed unsent: done, not missed."""
    report = _replayed_t1(superseded=["t2", "t3"])
    server.script("POST", f"{LETTERS}/replay", httpx.Response(200, json=report))

    result = run_cli("dlq", "replay", *asked)

    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == report
    assert result.stderr.splitlines() == ["superseded by a later generation, removed: t2 t3"]


def test_a_replay_that_kept_letters_being_rescored_says_so_and_exits_1(
    server: FakeServer,
) -> None:
    """Kept, not replayed: a script must not take them for done."""
    report = _replayed_t1(skipped_being_rescored=["t2"])
    server.script("POST", f"{LETTERS}/replay", httpx.Response(200, json=report))

    result = run_cli("dlq", "replay", "--all")

    assert result.exit_code == 1, result.output
    assert result.stderr.splitlines() == [
        "kept, a re-score of their task was being sent (replay them again shortly; "
        "one quiet for an hour keeps them no longer): t2"
    ]


@pytest.mark.parametrize(
    ("command", "path"),
    [
        (("dlq", "replay"), LETTERS),
        (("cron", "dlq", "replay"), CRON_LETTERS),
        (("webhooks", "dlq", "replay"), WEBHOOK_LETTERS),
    ],
)
def test_a_replay_out_of_time_says_to_run_it_again_not_to_replay_letters_before(
    server: FakeServer, command: tuple[str, ...], path: str
) -> None:
    """Its ids were reached (the walk was whole): advice for a walk cut short (replay or
    drop the letters before them) would send the operator the wrong way."""
    report: Json = {
        "replayed": ["w"],
        "not_found": [],
        "not_reached": ["x"],
        "truncated": False,
        "timed_out": True,
    }
    server.script("POST", f"{path}/replay", httpx.Response(200, json=report))

    result = run_cli(*command, "w", "x")

    assert result.exit_code == 1
    assert TIMED_OUT in result.stderr
    assert "not replayed yet (the replay ran out of time: run it again): x" in result.stderr
    assert "past the walk" not in result.stderr
    assert WALK_STOPPED not in result.stderr


@pytest.mark.parametrize(
    ("command", "path"),
    [
        (("dlq", "replay"), LETTERS),
        (("cron", "dlq", "replay"), CRON_LETTERS),
        (("webhooks", "dlq", "replay"), WEBHOOK_LETTERS),
    ],
)
@pytest.mark.parametrize("asked", [("w", "x"), ("--all",)], ids=["by-ids", "all"])
def test_a_replay_interrupted_says_why_and_exits_1(
    server: FakeServer, command: tuple[str, ...], path: str, asked: tuple[str, ...]
) -> None:
    """The broker failed after one letter was replayed: the rest are left, and a script
    must not take the replay for done."""
    why = "The message broker is unavailable; try again shortly."
    report: Json = {
        "replayed": ["w"],
        "not_found": [],
        "not_reached": ["x"] if asked != ("--all",) else [],
        "truncated": False,
        "timed_out": False,
        "interrupted": why,
    }
    server.script("POST", f"{path}/replay", httpx.Response(200, json=report))

    result = run_cli(*command, *asked)

    assert result.exit_code == 1, result.output
    assert json.loads(result.stdout) == report
    assert f"interrupted: {why}\n" in result.stderr  # its own advice, nothing added
    if asked != ("--all",):
        assert "not replayed yet (the replay was interrupted, as said above): x" in result.stderr
    assert TIMED_OUT not in result.stderr


def test_the_cli_checks_a_cut_off_as_the_service_does() -> None:
    assert cli.CUT_OFF_DATE_TIME.pattern == dead_letters._DATE_TIME.pattern


def test_the_bounds_the_cli_names_are_the_services_own() -> None:
    """The CLI imports nothing of the services; its words for their bounds must not drift."""
    assert f"({MAX_WALK:,} letters or {MAX_WALK_BYTES // 2**20} MiB" in cli.WALK_STOPPED
    assert f"budget ({REPLAY_BUDGET_S:.0f} s)" in cli.REPLAY_STOPPED


@pytest.mark.parametrize(
    ("command", "path", "drop"),
    [
        (("dlq", "replay"), LETTERS, "scorebox dlq drop"),
        (("cron", "dlq", "replay"), CRON_LETTERS, "scorebox cron dlq drop"),
        (("webhooks", "dlq", "replay"), WEBHOOK_LETTERS, "scorebox webhooks dlq drop"),
    ],
)
@pytest.mark.parametrize("asked", [("m1", "t2"), ("--all",)], ids=["by-ids", "all"])
def test_a_replay_that_left_letters_unreadable_names_them_and_exits_1(
    server: FakeServer, command: tuple[str, ...], path: str, drop: str, asked: tuple[str, ...]
) -> None:
    """It exited 0 with nothing on stderr, the letters still in the DLQ, as if replayed."""
    report: Json = {"replayed": ["t2"], "skipped_unreadable": ["m1", "m3"], "not_found": []}
    server.script("POST", f"{path}/replay", httpx.Response(200, json=report))

    result = run_cli(*command, *asked)

    assert result.exit_code == 1
    assert json.loads(result.stdout) == report
    assert result.stderr.splitlines() == [f"unreadable, kept (drop them with `{drop} ID`): m1 m3"]


# --- purge ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "path", "queue"),
    [
        (("dlq", "purge"), LETTERS, "scorebox.score-requests.dlq"),
        (("cron", "dlq", "purge"), CRON_LETTERS, "scorebox.cron-jobs.dlq"),
        (("webhooks", "dlq", "purge"), WEBHOOK_LETTERS, "scorebox.webhook-deliveries.dlq"),
    ],
)
@pytest.mark.parametrize(
    ("before", "asked"),
    [
        ((), ""),
        (("--before", "2026-12-05T02:00:00Z"), " dead-lettered before 2026-12-05T02:00:00Z"),
    ],
    ids=["all", "before"],
)
def test_a_purge_asks_on_stderr_naming_the_queue_and_prints_only_json(
    server: FakeServer,
    command: tuple[str, ...],
    path: str,
    queue: str,
    before: tuple[str, ...],
    asked: str,
) -> None:
    """The question went to stdout: `echo y | scorebox dlq purge | jq` read
    `Delete every dead letter? [y/N]: {"purged": 1}`."""
    server.script("DELETE", path, httpx.Response(200, json={"purged": 1}))

    result = run_cli(*command, *before, input="y\n")

    assert result.exit_code == 0, result.output
    assert result.stdout == json.dumps({"purged": 1}, indent=2) + "\n"
    assert result.stderr.startswith(f"Delete every dead letter in {queue}{asked}? [y/N]")


LISTED_AT = "2026-12-05T02:00:00.123456Z"


@pytest.mark.parametrize(
    ("command", "path"),
    [
        (("dlq", "purge", "--yes"), LETTERS),
        (("cron", "dlq", "purge", "--yes"), CRON_LETTERS),
        (("webhooks", "dlq", "purge", "--yes"), WEBHOOK_LETTERS),
    ],
    ids=["dlq", "cron", "webhooks"],
)
def test_a_purge_whose_walk_stopped_short_says_so_and_exits_1(
    server: FakeServer, command: tuple[str, ...], path: str
) -> None:
    """It exited 0, `truncated: true` in its JSON alone: a script read the purge as done
    with letters before the cut-off still there (a review of the CLI)."""
    answer = {"purged": 3, "kept": 0, "truncated": True}
    server.script("DELETE", path, httpx.Response(200, json=answer))

    result = run_cli(*command, "--before", LISTED_AT)

    assert result.exit_code == 1, result.output
    assert json.loads(result.stdout) == answer
    assert "truncated" in result.stderr
    assert "purge again" in result.stderr


def test_a_cron_drop_that_kept_its_letter_names_the_run(server: FakeServer) -> None:
    """The line read `: kept, ...`: a cron letter's answer names it `run_id` (a review)."""
    kept = {"run_id": "r1", "removed": 0, "kept": 1, "truncated": False}
    server.script("DELETE", f"{CRON_LETTERS}/r1", httpx.Response(200, json=kept))

    result = run_cli("cron", "dlq", "drop", "r1", "--before", LISTED_AT)

    assert result.exit_code == 1, result.output
    assert "r1: kept, dead-lettered at or after --before" in result.stderr


# --- a cut-off -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "path", "answer"),
    [
        (("dlq", "drop", "t1"), f"{LETTERS}/t1", {"letter_id": "t1", "removed": 1, "kept": 1}),
        (("dlq", "purge", "--yes"), LETTERS, {"purged": 2, "kept": 1, "truncated": False}),
        (("cron", "dlq", "drop", "r1"), f"{CRON_LETTERS}/r1", {"run_id": "r1", "removed": 1}),
        (("cron", "dlq", "purge", "--yes"), CRON_LETTERS, {"purged": 0, "kept": 3}),
        (
            ("webhooks", "dlq", "drop", "msg_1"),
            f"{WEBHOOK_LETTERS}/msg_1",
            {"letter_id": "msg_1", "removed": 2},
        ),
        (("webhooks", "dlq", "purge", "--yes"), WEBHOOK_LETTERS, {"purged": 1, "kept": 0}),
    ],
    ids=["drop", "purge", "cron-drop", "cron-purge", "webhooks-drop", "webhooks-purge"],
)
def test_before_sends_the_listings_time_as_the_cut_off(
    server: FakeServer, command: tuple[str, ...], path: str, answer: Json
) -> None:
    """`--before` a listing's `listed_at`: the letters dead-lettered since are kept."""
    server.script("DELETE", path, httpx.Response(200, json=answer))

    result = run_cli(*command, "--before", LISTED_AT)

    assert result.exit_code == 0, result.output
    [request] = server.requests
    assert dict(request.url.params) == {"dead_lettered_before": LISTED_AT}
    assert json.loads(result.stdout) == answer


@pytest.mark.parametrize(
    "command",
    [
        ("dlq", "purge"),
        ("cron", "dlq", "purge"),
        ("webhooks", "dlq", "purge"),
        ("dlq", "drop", "t1"),
    ],
    ids=["purge", "cron-purge", "webhooks-purge", "drop"],
)
@pytest.mark.parametrize(
    "before",
    [
        "garbage",
        "2030-01-01",
        "2030-01-01T10:00:00",
        "2030-01-01T10:00Z",
        "2030-01-01T10:00:00+0100",
        "20300101T100000Z",
        "2030-02-30T10:00:00Z",
    ],
)
def test_a_cut_off_that_is_no_zoned_time_is_refused_before_asking_or_sending(
    server: FakeServer, command: tuple[str, ...], before: str
) -> None:
    """A purge asked its question first; refused by the service only after a yes (found in
    a walkthrough)."""
    result = run_cli(*command, "--before", before, input="y\n")

    assert result.exit_code == 2, result.output
    assert "Delete every dead letter" not in result.stderr
    said = " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.stderr).split())  # rich's box, unwrapped
    assert "RFC 3339 date-time with a zone" in said
    assert server.requests == []


def test_a_purge_without_before_sends_no_cut_off(server: FakeServer) -> None:
    server.script("DELETE", LETTERS, httpx.Response(200, json={"purged": 4}))

    result = run_cli("dlq", "purge", "--yes")

    assert result.exit_code == 0, result.output
    [request] = server.requests
    assert not request.url.params


def test_webhooks_dlq_show_asks_the_notifier_for_one_letter(server: FakeServer) -> None:
    shown = {"delivery_id": "msg/1", "body": {"type": "task.completed"}}
    server.script("GET", f"{WEBHOOK_LETTERS}/msg/1", httpx.Response(200, json=shown))  # decoded

    result = run_cli("webhooks", "dlq", "show", "msg/1")

    assert result.exit_code == 0, result.output
    [request] = server.requests
    assert (request.url.host, request.url.raw_path) == (
        "notifier.test",
        b"/admin/v1/webhooks/dead-letters/msg%2F1",
    )
    assert json.loads(result.stdout) == shown


@pytest.mark.parametrize(
    ("command", "path"),
    [(("dlq", "replay"), LETTERS), (("webhooks", "dlq", "replay"), WEBHOOK_LETTERS)],
)
def test_a_replay_of_an_id_not_found_says_it_may_be_gone_since(
    server: FakeServer, command: tuple[str, ...], path: str
) -> None:
    """The loser of two replays at once read `not found: ID` as a mistyped id (a
    walkthrough): the other one had just moved the letter."""
    report: Json = {"replayed": [], "not_found": ["x"], "not_reached": [], "truncated": False}
    server.script("POST", f"{path}/replay", httpx.Response(200, json=report))

    result = run_cli(*command, "x")

    assert result.exit_code == 1
    assert "not found: x (no letter of the queue has it: replayed or dropped since" in (
        " ".join(result.stderr.split())
    )
