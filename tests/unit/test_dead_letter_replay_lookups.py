"""A replay by ids looks each letter up in a set of the ids asked for, not in their list.

The admin routes take up to 10,000 ids and a walk holds up to 10,000 letters: looked up in
the list, once per letter, one replay made up to 10,000 x 10,000 comparisons while it held
every letter of the DLQ. The ids here come as a list that refuses being searched.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from types import SimpleNamespace
from typing import Any, cast

from aio_pika.abc import AbstractIncomingMessage
from pymongo.errors import AutoReconnect, OperationFailure

from services.gateway.deadletters import DeadLetterQueue, describe
from services.gateway.submissions import ReplayRefused
from services.scheduler.config import Concurrency, MissedFirings
from services.scheduler.dead_letters import CronDeadLetters, interruption
from services.scheduler.dispatcher import fire_replay
from services.scheduler.errors import RunInProgress
from services.scheduler.firings import LeaseTaken
from services.scheduler.schedule import JobCatalog, ScheduledJob
from shared.contracts import RunCronJob, ScoreText
from shared.dead_letters import REPLAY_BUDGET_S, DeadLetterWalker
from tests.unit.test_scheduler_dispatch import Clock, FakeFirings, Published

NOW = datetime(2025, 1, 1, 10, tzinfo=UTC)


class Unsearchable(list[str]):
    """Ids as the admin routes hand them over (a list), refusing to be searched."""

    def __contains__(self, item: object) -> bool:
        raise AssertionError(f"{item!r} was looked up by walking the list of ids asked for")


@dataclass
class Letter:
    """What a walk reads of a held dead letter."""

    body: bytes
    message_id: str | None
    correlation_id: str | None = None
    headers: dict[str, Any] = field(default_factory=dict)
    timestamp: datetime | None = NOW
    processed: bool = False


class Walked(list[Letter]):
    truncated = False
    timed_out = False
    stopped_short = False


class HeldLetters:
    """A DLQ walker holding `letters`; `removed` are those acked (replayed)."""

    def __init__(self, letters: list[Letter]) -> None:
        self.letters = letters
        self.removed: list[Letter] = []

    @contextlib.asynccontextmanager
    async def walk(self, *, deadline: float | None = None) -> AsyncIterator[list[Letter]]:
        yield Walked(self.letters)  # the queue's end reached, whatever the deadline

    async def remove(self, message: Letter) -> None:
        self.removed.append(message)


def _cron_letter(run_id: str) -> Letter:
    command = RunCronJob(task_id=run_id, job="rollup", scheduled_for=NOW, fired_at=NOW)
    return Letter(body=command.model_dump_json().encode(), message_id=f"m-{run_id}")


def _rollup() -> ScheduledJob:
    # Allowed to overlap: every replay starts although no run ends.
    return ScheduledJob(
        "rollup", "5 * * * *", "UTC", MissedFirings.COALESCE, True, concurrency=Concurrency.ALLOW
    )


def _cron_dead_letters(
    held: HeldLetters, published: Published, *, replay_budget_s: float = REPLAY_BUDGET_S
) -> CronDeadLetters:
    jobs, clock = JobCatalog([_rollup()]), Clock(NOW)
    return CronDeadLetters(
        cast(DeadLetterWalker, held),
        jobs=jobs,
        replay_run=partial(
            fire_replay,
            jobs=jobs,
            firings=FakeFirings(),
            publish=published,
            clock=clock,
            owner="a",
        ),
        clock=clock,
        replay_budget_s=replay_budget_s,
    )


async def test_a_cron_replay_by_run_ids_looks_them_up_in_a_set() -> None:
    published = Published()
    held = HeldLetters([_cron_letter(run_id) for run_id in ("dead-1", "dead-2", "dead-3")])
    dead_letters = _cron_dead_letters(held, published)

    replay = await dead_letters.replay(Unsearchable(["dead-3", "nowhere", "dead-1"]))

    assert sorted(letter.dead_run_id for letter in replay.replayed) == ["dead-1", "dead-3"]
    assert replay.not_found == ["nowhere"]
    assert [letter.message_id for letter in held.removed] == ["m-dead-1", "m-dead-3"]
    assert len(published.commands) == 2


async def test_a_cron_replay_out_of_time_reports_the_runs_it_left_as_not_reached() -> None:
    """A replay answers once its budget is spent (none here: one run, the least it
    replays); the runs asked for that it left are `not_reached` (they were matched, so
    neither replayed nor reported at all), `timed_out` says so, and a run no letter holds
    is `not_found` (the walk reached the queue's end: it was `not_reached` too, and the
    operator was told to run again for a typo)."""
    published = Published()
    held = HeldLetters([_cron_letter(run_id) for run_id in ("dead-1", "dead-2", "dead-3")])
    dead_letters = _cron_dead_letters(held, published, replay_budget_s=0)

    replay = await dead_letters.replay(["dead-1", "dead-2", "dead-3", "nowhere"])

    [done] = [letter.dead_run_id for letter in replay.replayed]
    assert (replay.timed_out, replay.truncated, replay.not_found) == (True, False, ["nowhere"])
    assert sorted(replay.not_reached) == sorted({"dead-1", "dead-2", "dead-3"} - {done})
    assert [letter.message_id for letter in held.removed] == [f"m-{done}"]
    assert len(published.commands) == 1


def _out_of_time(
    held: HeldLetters, replay_run: Callable[[RunCronJob], Awaitable[tuple[Any, bool]]]
) -> CronDeadLetters:
    """The cron DLQ over `held`, each run replayed by `replay_run`, with no time to spend."""
    return CronDeadLetters(
        cast(DeadLetterWalker, held),
        jobs=JobCatalog([_rollup()]),
        replay_run=replay_run,
        clock=Clock(NOW),
        replay_budget_s=0,
    )


async def test_a_cron_run_in_progress_is_not_also_reported_not_reached() -> None:
    """Its first letter found its job's run in progress, its second was left by the budget:
    it was reported both `skipped_in_progress` and `not_reached` (the run left unseen,
    dead-y, is `not_reached` alone)."""
    letters = [_cron_letter("dead-x"), _cron_letter("dead-y"), _cron_letter("dead-x")]

    async def replay_run(command: RunCronJob) -> tuple[Any, bool]:
        if command.run_id == "dead-x":
            raise RunInProgress(command.job, "run-1", "running", None)
        return SimpleNamespace(run_id=f"new-{command.run_id}"), True

    dead_letters = _out_of_time(HeldLetters(letters), replay_run)

    replay = await dead_letters.replay(["dead-x", "dead-y"])

    assert replay.replayed == []  # out of time after the first try
    assert (replay.skipped_in_progress, replay.not_reached) == (["dead-x"], ["dead-y"])


async def test_a_cron_run_whose_lease_keeps_changing_hands_is_kept_and_the_rest_replayed() -> None:
    """Its claim gave up (`LeaseTaken`, runs of the job beginning and ending all the while):
    that ended the whole replay, the letters after it never reached (found in review)."""

    async def replay_run(command: RunCronJob) -> tuple[Any, bool]:
        if command.run_id == "dead-x":
            raise LeaseTaken(command.job)
        return SimpleNamespace(run_id=f"new-{command.run_id}"), True

    dead_letters = CronDeadLetters(
        cast(DeadLetterWalker, HeldLetters([_cron_letter("dead-x"), _cron_letter("dead-y")])),
        jobs=JobCatalog([_rollup()]),
        replay_run=replay_run,
        clock=Clock(NOW),
        replay_budget_s=60,
    )

    replay = await dead_letters.replay(None)

    assert [letter.dead_run_id for letter in replay.replayed] == ["dead-y"]
    assert replay.skipped_in_progress == ["dead-x"]


class Resubmitted:
    def __init__(self) -> None:
        self.commands: list[ScoreText] = []

    async def resubmit(self, command: ScoreText) -> None:
        self.commands.append(command)


class NoReplaysYet:
    async def replay_generation(
        self, task_id: str, *, of: int, now: datetime | None = None
    ) -> int | ReplayRefused | None:
        return None


@dataclass
class Superseding:
    """Submissions whose tasks named in `superseded` had a later generation handed out."""

    superseded: set[str]
    asked: list[str] = field(default_factory=list)

    async def replay_generation(
        self, task_id: str, *, of: int, now: datetime | None = None
    ) -> int | ReplayRefused | None:
        self.asked.append(task_id)
        return ReplayRefused.SUPERSEDED if task_id in self.superseded else of + 1


def _score_dead_letters(
    held: HeldLetters,
    resubmitted: Resubmitted | None = None,
    *,
    replay_budget_s: float = REPLAY_BUDGET_S,
    submissions: NoReplaysYet | Superseding | None = None,
) -> DeadLetterQueue:
    """The gateway's DLQ over `held` (in memory), its replays resubmitted to `resubmitted`."""
    queue = DeadLetterQueue(
        cast(Any, None),  # the broker: the walker below stands in for the one it makes
        cast(Any, resubmitted or Resubmitted()),
        cast(Any, submissions or NoReplaysYet()),
        Clock(NOW),
        timeout_s=1.0,
        replay_budget_s=replay_budget_s,
    )
    queue._dlq = cast(DeadLetterWalker, held)  # the DLQ, held in memory
    return queue


def _score_letter(task_id: str) -> Letter:
    command = ScoreText(task_id=task_id, tenant_id="acme", text="some text to score")
    return Letter(body=command.model_dump_json().encode(), message_id=f"m-{task_id}")


async def test_a_score_replay_by_ids_looks_them_up_in_a_set() -> None:
    held = HeldLetters([_score_letter(task_id) for task_id in ("t-1", "t-2", "t-3")])
    resubmitted = Resubmitted()
    queue = _score_dead_letters(held, resubmitted)

    replay = await queue.replay(Unsearchable(["t-3", "m-t-2", "nowhere"]))

    assert sorted(replay.replayed) == ["t-2", "t-3"]
    assert replay.not_found == ["nowhere"]
    assert sorted(command.task_id for command in resubmitted.commands) == ["t-2", "t-3"]
    assert sorted(str(letter.message_id) for letter in held.removed) == ["m-t-2", "m-t-3"]


async def test_a_replay_starts_the_task_on_a_fresh_attempt_budget() -> None:
    """The rate-limited retries a letter had made were kept: given up at attempt 24 after 20
    of them, its replay could make 24 attempts again, all of them billed."""
    spent = ScoreText(
        task_id="t-1", tenant_id="acme", text="some text", attempt=24, rate_limited_retries=20
    )
    letter = Letter(body=spent.model_dump_json().encode(), message_id="m-t-1")
    resubmitted = Resubmitted()
    queue = _score_dead_letters(HeldLetters([letter]), resubmitted)

    await queue.replay(None)

    [fresh] = resubmitted.commands
    assert (fresh.attempt, fresh.rate_limited_retries, fresh.not_before) == (1, 0, None)
    assert fresh.generation == 1


async def test_a_letter_without_a_message_id_is_named_by_its_body() -> None:
    """A letter published without a message id (by a client other than ours: aiormq gives
    every message one) holding no command was reported as `?`, which no drop could name."""
    nameless = Letter(body=b"not a command", message_id=None)
    named = f"body-{hashlib.sha256(nameless.body).hexdigest()[:16]}"
    held = HeldLetters([nameless, _score_letter("t-1")])
    queue = _score_dead_letters(held)

    replay = await queue.replay(None)
    cron = await _cron_dead_letters(HeldLetters([nameless]), Published()).replay(None)

    assert replay.skipped_unreadable == [named]
    assert cron.skipped_unreadable == [named]
    letter = describe(cast(AbstractIncomingMessage, nameless), NOW)
    assert (letter.message_id, letter.matches({named})) == (named, True)


async def test_a_score_replay_out_of_time_leaves_what_it_matched_and_says_so() -> None:
    """The walk whole, the replay's loop out of time after one letter: the ids of letters it
    matched and left are `not_reached` ("run it again"), an id no letter holds `not_found`
    (the walk reached the queue's end: it was `not_reached` too, and the operator was told
    to run again for a typo), and the answer `timed_out`, not `truncated`."""
    held = HeldLetters([_score_letter(task_id) for task_id in ("t-1", "t-2", "t-3")])
    queue = _score_dead_letters(held, replay_budget_s=0)

    replay = await queue.replay(["t-1", "t-2", "t-3", "nowhere"])

    [done] = replay.replayed
    assert (replay.timed_out, replay.truncated, replay.not_found) == (True, False, ["nowhere"])
    assert sorted(replay.not_reached) == sorted({"t-1", "t-2", "t-3"} - {done})


async def test_a_cron_replay_keeps_its_budget_while_every_run_it_tries_is_in_progress() -> None:
    """The budget held only once a letter was replayed: letters whose job had a run in
    progress (each tried at the cost of database round trips) were tried without end."""
    tried: list[str] = []

    async def replay_run(command: RunCronJob) -> tuple[Any, bool]:
        tried.append(command.run_id)
        raise RunInProgress(command.job, "run-1", "running", None)

    dead_letters = _out_of_time(
        HeldLetters([_cron_letter(f"dead-{n}") for n in range(5)]), replay_run
    )

    replay = await dead_letters.replay(None)

    assert tried == ["dead-0"]
    assert (replay.timed_out, replay.skipped_in_progress) == (True, ["dead-0"])


async def test_a_superseded_letter_is_removed_unsent_and_reported() -> None:
    """A letter whose task a later generation superseded (a re-score since) was sent again:
    the task scored once more, a model call nobody asked for."""
    held = HeldLetters([_score_letter(task_id) for task_id in ("t-1", "t-2")])
    resubmitted = Resubmitted()
    queue = _score_dead_letters(held, resubmitted, submissions=Superseding({"t-1"}))

    replay = await queue.replay(None)

    assert (replay.replayed, replay.superseded) == (["t-2"], ["t-1"])
    assert [command.task_id for command in resubmitted.commands] == ["t-2"]
    assert sorted(str(letter.message_id) for letter in held.removed) == ["m-t-1", "m-t-2"]


async def test_a_superseded_letter_counts_against_the_replays_budget() -> None:
    """Only replayed letters counted: a DLQ of superseded letters (each costing database
    round trips) was tried to its end, past the budget and the client's timeout."""
    held = HeldLetters([_score_letter(f"t-{n}") for n in range(5)])
    submissions = Superseding({f"t-{n}" for n in range(5)})
    queue = _score_dead_letters(held, replay_budget_s=0, submissions=submissions)

    replay = await queue.replay(None)

    assert submissions.asked == ["t-0"]
    assert (replay.superseded, replay.replayed, replay.timed_out) == (["t-0"], [], True)


def test_a_cron_replay_stopped_by_a_refusal_for_good_does_not_say_to_try_again_shortly() -> None:
    """It said the database was unavailable, to try again shortly (found in review)."""
    refused = interruption(OperationFailure("not authorized", code=13))
    assert "refused an operation for good" in refused
    assert "try again shortly" not in refused
    assert interruption(AutoReconnect("gone")).startswith("The database is unavailable")
