"""Faults of the model API and of the messages themselves, against the services as processes.

- The model: 429 with Retry-After, 500 bursts, a persistent 500, a hang past LLM_TIMEOUT_S,
  malformed JSON, an out-of-range score; each ends as documented (retried and completed,
  or failed, dead-lettered only when retries ran out).
- The provider rate-limits every call for a while (longer than a task's attempts take): no
  task fails; the scorer pauses its calls and the 429s spend no attempt.
- The provider fails every call for a while (longer than a task's attempts take): no task
  fails; after the calls of three texts in a row fail the scorer pauses its calls, and the
  probes that find the provider still down spend no attempt.
- A batch of texts each failing on its own, with no other traffic: each task is
  dead-lettered after its attempts and two free calls at most (a check of the provider
  probes the "outage"; a text seen failing in two outages so ended is a suspect).
- The same `score.requested` delivered twice: one model call.
- A body that is not a command (poison): dead-lettered with the reason, the consumer lives.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from devtools.fake_llm import FakeLLM
from services.scorer.settings import ScorerSettings
from services.scorer.throttle import SUSPECT_AFTER
from shared.bus import publish_command
from shared.contracts import ScoreText, new_id, utcnow
from shared.runtime import make_broker
from shared.topology import ERROR_HEADER, SCORE_REQUESTS, TASKS, WAIT_TIERS
from tests.faults.harness import (
    BoxParts,
    DeadLetter,
    Figures,
    Outcome,
    Scorebox,
    dead_letters,
    essay,
    new_marker,
    queue_depths,
    running_scorebox,
)
from tests.support import eventually

LLM_TIMEOUT_S = 8  # well above the fake's `slow` (2 s), which the duplicate test needs
MAX_ATTEMPTS = 4  # the gateway's default SCORE_MAX_ATTEMPTS
DRAIN_TIMEOUT_S = 120.0
# Every call answered 429 for this long: far longer than a task's four attempts took with
# these tests' back-off (RETRY_BASE_S 0.2, RETRY_CAP_S 1), and a few of the default's.
RATE_LIMIT_WINDOW_S = 20.0
RATE_LIMITED_TASKS = 12
# Every call answered 503 for this long (a provider restarting): a task's four attempts took
# under 2 s with these tests' back-off, so every task consumed meanwhile failed.
PROVIDER_DOWN_S = 8.0
PROVIDER_DOWN_TASKS = 12
# Texts the provider fails every time, submitted together with nothing else: more than the
# three in a row an outage is taken for.
FAILING_ALONE_TASKS = 8


@pytest.fixture(scope="module")
async def box(box_parts: BoxParts) -> AsyncIterator[Scorebox]:
    async with running_scorebox(box_parts, env={"LLM_TIMEOUT_S": str(LLM_TIMEOUT_S)}) as running:
        yield running


@dataclass(frozen=True)
class Expected:
    """How a model fault ends: status, error code, dead-lettered, attempts, model calls."""

    faults: str
    status: str
    code: str | None
    dead_lettered: bool
    attempts: int
    calls: int
    # One attempt more may come, free: a call taken for an outage's (the breaker) is not the
    # task's. Each attempt is still one call.
    or_one_more: bool = False

    @property
    def repairs(self) -> int:
        """Calls beyond one per attempt: a repair request after an unusable answer."""
        return self.calls - self.attempts


EVERY_CALL_FAILS = "500 on every call"
MODEL_FAULTS: dict[str, Expected] = {
    "429 with Retry-After, twice": Expected(
        "[[fake:429x2:retry=1]]", "completed", None, False, attempts=3, calls=3
    ),
    "500 burst (two)": Expected("[[fake:500x2]]", "completed", None, False, attempts=3, calls=3),
    "500 on every call": Expected(
        "[[fake:500]]",
        "failed",
        "model_unavailable",
        True,
        attempts=MAX_ATTEMPTS,
        calls=MAX_ATTEMPTS,
        or_one_more=True,
    ),
    "hang past the timeout, once": Expected(
        "[[fake:hangx1]]", "completed", None, False, attempts=2, calls=2
    ),
    # One repair request follows an unusable answer within the same attempt.
    "malformed JSON": Expected(
        "[[fake:malformed]]", "failed", "unusable_output", False, attempts=1, calls=2
    ),
    "score out of range": Expected(
        "[[fake:range]]", "failed", "unusable_output", False, attempts=1, calls=2
    ),
}


async def test_model_api_faults_end_as_documented(
    box: Scorebox, figures: Figures, labels: tuple[str, str]
) -> None:
    box.answers.clear()
    markers = {kind: new_marker() for kind in MODEL_FAULTS}
    tasks = {
        kind: await box.submit(essay(markers[kind], expected.faults))
        for kind, expected in MODEL_FAULTS.items()
        if kind != EVERY_CALL_FAILS
    }
    views = await box.finish(tasks.values())
    # Once the others have ended, their last answers the provider's: submitted beside them,
    # the calls of three texts in a row finding it down were now and then taken for two
    # outages, each taking one of this text's calls, and it made 6 attempts (CI).
    alone = MODEL_FAULTS[EVERY_CALL_FAILS]
    tasks[EVERY_CALL_FAILS] = await box.submit(essay(markers[EVERY_CALL_FAILS], alone.faults))
    views |= await box.finish([tasks[EVERY_CALL_FAILS]])
    calls = {kind: box.calls(markers[kind]) for kind in MODEL_FAULTS}
    statuses = [v["status"] for v in views.values()]
    figures.record(
        Outcome(
            name="model API faults (429, 500s, hang, malformed, out of range)",
            accepted=len(tasks),
            completed=statuses.count("completed"),
            failed=statuses.count("failed"),
            duplicate_model_calls=sum(
                max(0, calls[kind] - views[tasks[kind]]["attempts"] - expected.repairs)
                for kind, expected in MODEL_FAULTS.items()
            ),
            http_5xx_seen=box.http_5xx(),
            time_to_recover_s=None,
            broker=labels[0],
            database=labels[1],
            notes="; ".join(
                f"{kind}: {views[tasks[kind]]['status']} after {calls[kind]} call(s)"
                for kind in MODEL_FAULTS
            ),
        )
    )
    for kind, expected in MODEL_FAULTS.items():
        view = views[tasks[kind]]
        ended = {
            "status": view["status"],
            "code": (view["error"] or {}).get("code"),
            "dead_lettered": bool((view["error"] or {}).get("dead_lettered")),
            "attempts": view["attempts"],
            "calls": calls[kind],
        }
        wanted = {
            "status": expected.status,
            "code": expected.code,
            "dead_lettered": expected.dead_lettered,
            "attempts": expected.attempts,
            "calls": expected.calls,
        }
        if expected.or_one_more and ended["attempts"] == expected.attempts + 1:
            wanted |= {"attempts": expected.attempts + 1, "calls": expected.calls + 1}
        assert ended == wanted, kind
    exhausted = tasks[EVERY_CALL_FAILS].encode()
    dead = [d for d in await dead_letters(box.amqp_url) if exhausted in d.body]
    assert len(dead) == 1
    assert "model_unavailable" in str(dead[0].headers[ERROR_HEADER])
    assert box.answers[500] == 0


@dataclass(frozen=True)
class ProviderWide:
    """A fault of every call for a while, whatever its task: the fake's `until` setting, the
    status it answers, its duration and the tasks submitted during it."""

    name: str
    until: str  # the `FakeLLMConfig` field the fault lasts until
    status: int
    window_s: float
    tasks: int


async def _fails_no_task(
    fault: ProviderWide,
    box: Scorebox,
    llm: FakeLLM,
    figures: Figures,
    labels: tuple[str, str],
    *,
    notes: str,
) -> None:
    """Submit `fault.tasks` tasks while `fault` lasts; each must complete, scored once (the
    fault spends no task's fault budget at the fake, so a task's calls are those answered)."""
    box.answers.clear()
    markers = [new_marker() for _ in range(fault.tasks)]
    status = str(fault.status)
    answered_before = llm.stats()["status_counts"].get(status, 0)
    setattr(llm.config, fault.until, time.monotonic() + fault.window_s)
    try:
        tasks = [await box.submit(essay(marker)) for marker in markers]
        views = await box.finish(tasks)
    finally:
        setattr(llm.config, fault.until, 0.0)
    statuses = [view["status"] for view in views.values()]
    answered = llm.stats()["status_counts"].get(status, 0) - answered_before
    scored_twice = sum(max(0, box.calls(marker) - 1) for marker in markers)
    figures.record(
        Outcome(
            name=f"{fault.name} (every call {status} for {fault.window_s:g} s)",
            accepted=len(tasks),
            completed=statuses.count("completed"),
            failed=statuses.count("failed"),
            duplicate_model_calls=scored_twice,
            http_5xx_seen=box.http_5xx(),
            time_to_recover_s=None,
            broker=labels[0],
            database=labels[1],
            notes=f"{answered} calls answered {status}{notes}; at most "
            f"{max(v['attempts'] for v in views.values())} attempts for a task",
        )
    )
    assert statuses == ["completed"] * len(tasks), [view.get("error") for view in views.values()]
    assert scored_twice == 0


async def test_a_provider_wide_rate_limit_fails_no_task(
    box: Scorebox, llm: FakeLLM, figures: Figures, labels: tuple[str, str]
) -> None:
    limit = ProviderWide(
        "provider-wide rate limit",
        "rate_limited_until",
        429,
        RATE_LIMIT_WINDOW_S,
        RATE_LIMITED_TASKS,
    )
    await _fails_no_task(limit, box, llm, figures, labels, notes="")


async def test_a_provider_down_for_longer_than_a_tasks_retries_fails_no_task(
    box: Scorebox, llm: FakeLLM, figures: Figures, labels: tuple[str, str]
) -> None:
    outage = ProviderWide(
        "model provider down", "unavailable_until", 503, PROVIDER_DOWN_S, PROVIDER_DOWN_TASKS
    )
    notes = f" for {PROVIDER_DOWN_TASKS} tasks (four attempts take under 2 s here)"
    await _fails_no_task(outage, box, llm, figures, labels, notes=notes)


async def test_texts_failing_on_their_own_with_no_other_traffic_spend_their_attempts(
    box: Scorebox, figures: Figures, labels: tuple[str, str]
) -> None:
    """Texts the provider fails every time, the only calls: taken for an outage, their calls
    were its probes, one per pause of up to a minute for them all, and a batch of them took
    an hour or more to be dead-lettered (session 48). The outage is probed by a check of the
    provider instead, which it answers; every text calls again, and a text seen failing in
    two such outages is a suspect, its calls charged: each task ends after its attempts and
    a free call at most in each of those outages."""
    box.answers.clear()
    markers = [new_marker() for _ in range(FAILING_ALONE_TASKS)]
    tasks = {await box.submit(essay(marker, "[[fake:500]]")): marker for marker in markers}
    views = await box.finish(tasks)
    attempts = [views[task]["attempts"] for task in tasks]
    figures.record(
        Outcome(
            name="texts failing on their own, no other traffic (every call of each 500)",
            accepted=len(tasks),
            completed=0,
            failed=[view["status"] for view in views.values()].count("failed"),
            duplicate_model_calls=sum(
                box.calls(marker) - views[task]["attempts"] for task, marker in tasks.items()
            ),
            http_5xx_seen=box.http_5xx(),
            time_to_recover_s=None,
            broker=labels[0],
            database=labels[1],
            notes=f"{len(tasks)} texts at once; each dead-lettered after {min(attempts)} to "
            f"{max(attempts)} attempts (SCORE_MAX_ATTEMPTS {MAX_ATTEMPTS}, and those the "
            "outages before it was a suspect took for their own), its calls one per attempt",
        )
    )
    for task, marker in tasks.items():
        view = views[task]
        error = view["error"] or {}
        assert (view["status"], error.get("code"), error.get("dead_lettered")) == (
            "failed",
            "model_unavailable",
            True,
        )
        assert MAX_ATTEMPTS <= view["attempts"] <= MAX_ATTEMPTS + SUSPECT_AFTER
        assert box.calls(marker) == view["attempts"]


async def _drained(box: Scorebox) -> bool:
    """No score request left anywhere: not in the queue, not held, not waiting on the ladder."""
    depths = await queue_depths(box.amqp_url)
    queues = [SCORE_REQUESTS.name, *(f"scorebox.wait.{tier}" for tier, _ in WAIT_TIERS)]
    return all(depths.get(name, 0) == 0 for name in queues)


async def _publish(box: Scorebox, command: ScoreText, times: int) -> None:
    broker = make_broker(ScorerSettings.model_validate({"RABBITMQ_URL": box.amqp_url}))
    async with broker:
        await broker.connect()
        for _ in range(times):
            await publish_command(broker, command, now=utcnow(), timeout=30)


async def test_a_message_delivered_twice_calls_the_model_once(
    box: Scorebox, figures: Figures, labels: tuple[str, str]
) -> None:
    box.answers.clear()
    # Both copies at once, the first still in its (slow) model call when the second comes...
    busy = new_marker()
    while_busy = ScoreText(task_id=new_id(), text=essay(busy, "[[fake:slow]]"))
    await _publish(box, while_busy, times=2)
    # ... and a copy that comes after the task was decided.
    done = new_marker()
    after_done = ScoreText(task_id=new_id(), text=essay(done))
    await _publish(box, after_done, times=1)
    await box.finish([after_done.task_id])
    await _publish(box, after_done, times=1)

    await box.finish([while_busy.task_id, after_done.task_id])
    await eventually(lambda: _drained(box), timeout_s=DRAIN_TIMEOUT_S, what="every copy handled")
    views = await box.finish([while_busy.task_id, after_done.task_id])  # as it ended
    statuses = [v["status"] for v in views.values()]
    calls = [box.calls(busy), box.calls(done)]
    figures.record(
        Outcome(
            name="the same message delivered twice",
            accepted=len(views),
            completed=statuses.count("completed"),
            failed=statuses.count("failed"),
            duplicate_model_calls=sum(n - 1 for n in calls),
            http_5xx_seen=box.http_5xx(),
            time_to_recover_s=None,
            broker=labels[0],
            database=labels[1],
            notes="published by hand: a copy during the model call, a copy after the decision",
        )
    )
    assert statuses == ["completed", "completed"], views
    assert calls == [1, 1]
    assert all(v["attempts"] == 1 for v in views.values()), views


async def test_poison_message_is_dead_lettered_and_the_consumer_stays_healthy(
    box: Scorebox, figures: Figures, labels: tuple[str, str]
) -> None:
    box.answers.clear()
    scorer_pids = box.stack.pids()["scorer"]
    token = uuid.uuid4().hex
    broker = make_broker(ScorerSettings.model_validate({"RABBITMQ_URL": box.amqp_url}))
    async with broker:
        await broker.connect()
        await broker.publish(
            f'{{"not": "a command", "token": "{token}"}}'.encode(),
            exchange=TASKS,
            routing_key=ScoreText.routing_key,
            persist=True,
            timeout=30,
        )

    async def dead_lettered() -> list[DeadLetter] | None:
        found = [d for d in await dead_letters(box.amqp_url) if token.encode() in d.body]
        return found or None

    dead = await eventually(dead_lettered, timeout_s=DRAIN_TIMEOUT_S, what="poison in the DLQ")
    assert len(dead) == 1
    reason = str(dead[0].headers[ERROR_HEADER])
    assert "unreadable score.requested" in reason, reason
    assert "validation error" in reason, reason

    alive = new_marker()
    views = await box.finish([await box.submit(essay(alive))])
    assert [v["status"] for v in views.values()] == ["completed"]
    assert box.calls(alive) == 1
    assert box.stack.pids()["scorer"] == scorer_pids, "the scorer was restarted"
    assert await box.ready("scorer") == 200
    figures.record(
        Outcome(
            name="poison message (fails validation)",
            accepted=1,
            completed=1,
            failed=0,
            duplicate_model_calls=box.calls(alive) - 1,
            http_5xx_seen=box.http_5xx(),
            time_to_recover_s=None,
            broker=labels[0],
            database=labels[1],
            notes="dead-lettered with the validation error as reason; the same scorer "
            "process then scored a new task",
        )
    )
