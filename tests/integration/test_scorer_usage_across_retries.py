"""Every call the provider billed reaches the task's outcome once, across retries.

An unusable first answer is billed; when its repair then fails for now (a 5xx, a timeout),
the attempt is retried and the retry publishes nothing the usage meter reads. Those tokens
used to be lost: the outcome carried only the last attempt's usage. Here the scorer runs
whole on the real broker and database, the fake model server scripting each task's answers
(`[[fake:malformedx1]]` an unusable first answer, then `[[fake:503xN]]` failures;
`[[fake:nochoicesx1]]` a first answer without a choice), and the outcome's usage is compared
with what the fake billed, call by call.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, override

import aio_pika
import pytest
from faststream.rabbit import RabbitBroker

from devtools.fake_llm import (
    CHARS_PER_TOKEN,
    MALFORMED_CONTENT,
    FakeLLM,
    FakeLLMConfig,
    extract_judged_text,
    score_content,
    start_fake_llm,
)
from services.scorer.attempts import Attempts
from services.scorer.consumer import (
    UNSTARTED_RESETS,
    UNSTARTED_RESETS_HEADER,
    BrokerActions,
    _at_delivery_limit,
)
from services.scorer.decisions import Retry
from services.scorer.model.preparation import prepare_text
from services.scorer.model.prompt import build_messages
from services.scorer.scoring import score_text
from services.scorer.settings import ScorerSettings
from shared.bus import publish_command
from shared.consumers import Delivery
from shared.contracts import (
    ScoreText,
    TaskCompleted,
    TaskEvent,
    TaskFailed,
    TaskRetrying,
    Usage,
    new_id,
    parse_task_event,
    utcnow,
)
from shared.event_batches import is_batch, split_batch
from shared.runtime import make_broker
from shared.topology import DEAD_LETTERED_FROM_HEADER, ERROR_HEADER, EVENTS, SCORE_REQUESTS
from tests.integration import test_scorer_own_claims as own_claims
from tests.integration.in_process import scorer_over
from tests.integration.test_scorer_own_claims import Deps, _letters
from tests.support import HandedDelivery, eventually, running

attempts = own_claims.attempts  # fixtures
make_deps = own_claims.make_deps

ANSWERED_MODEL = "fake-judge-1-2024-07-18"
TIMEOUT_S = 2
_OUTCOMES = (TaskCompleted.routing_key, TaskFailed.routing_key, TaskRetrying.routing_key)


def _add(*usages: Usage) -> Usage:
    return Usage(
        prompt_tokens=sum(usage.prompt_tokens for usage in usages),
        completion_tokens=sum(usage.completion_tokens for usage in usages),
    )


def _billed(text: str, *, unusable: bool) -> Usage:
    """What the fake model bills for the first call on `text`: its prompt and its answer,
    at four characters a token."""
    messages = build_messages(prepare_text(text, max_chars=6000).text, None)
    answer = MALFORMED_CONTENT if unusable else score_content(extract_judged_text(messages))
    prompt_chars = sum(len(message["content"]) for message in messages)
    return Usage(
        prompt_tokens=max(1, prompt_chars // CHARS_PER_TOKEN),
        completion_tokens=max(1, len(answer) // CHARS_PER_TOKEN),
    )


@dataclass
class Scorer:
    amqp_url: str
    llm: FakeLLM

    async def send(self, command: ScoreText) -> None:
        broker = make_broker(ScorerSettings.model_validate({"RABBITMQ_URL": self.amqp_url}))
        async with broker:
            await broker.connect()
            await publish_command(broker, command, now=utcnow(), timeout=10)

    def calls(self, marker: str) -> int:
        return int(self.llm.stats()["by_id"].get(marker, 0))


@pytest.fixture(scope="module")
async def scorer(amqp_url: str, mongo: Any, db_prefix: str) -> AsyncIterator[Scorer]:
    llm = await start_fake_llm(FakeLLMConfig())
    setup = scorer_over(
        llm, amqp_url=amqp_url, mongo_url=mongo.url, db_prefix=db_prefix, llm_timeout_s=TIMEOUT_S
    )
    async with running(setup.app()):
        yield Scorer(amqp_url, llm)
    await llm.stop()


class Outcomes:
    """The outcomes (retries included) the scorer publishes, as a queue bound to the events
    exchange receives them: `seen` holds those of the tasks asked about, in the order they
    came; the others wait until they are asked about."""

    def __init__(self, queue: aio_pika.abc.AbstractQueue) -> None:
        self._queue = queue
        self._received: list[TaskEvent] = []
        self.seen: list[TaskEvent] = []

    def of(self, task_id: str, kind: type[TaskEvent] = TaskEvent) -> list[TaskEvent]:
        """The events of `kind` seen for the task, in the order they came."""
        return [e for e in self.seen if e.task_id == task_id and isinstance(e, kind)]

    async def next_of(self, task_id: str, kind: type[TaskEvent]) -> Any:
        """The next event of `kind` for the task, keeping every event seen on the way."""
        taken = len(self.of(task_id, kind))

        async def arrived() -> TaskEvent | None:
            await self.read_for(task_id)
            ours = self.of(task_id, kind)
            return ours[taken] if len(ours) > taken else None

        return await eventually(arrived, timeout_s=60, what=f"{kind.__name__} of {task_id}")

    async def first_of_each(self, task_ids: set[str]) -> dict[str, TaskEvent]:
        """The first outcome of each task."""

        async def all_ended() -> dict[str, TaskEvent] | None:
            await self.read_for(*task_ids)
            first = {task_id: self.of(task_id) for task_id in task_ids}
            return {k: v[0] for k, v in first.items()} if all(first.values()) else None

        return await eventually(all_ended, timeout_s=60, what="an outcome of every task")

    async def read_for(self, *task_ids: str) -> None:
        """Take what has arrived, keeping the events of these tasks in `seen`."""
        while (message := await self._queue.get(no_ack=True, fail=False, timeout=5)) is not None:
            self._received += _events_in(message)
        asked = set(task_ids)
        self.seen += [event for event in self._received if event.task_id in asked]
        self._received = [event for event in self._received if event.task_id not in asked]


def _events_in(message: aio_pika.abc.AbstractIncomingMessage) -> list[TaskEvent]:
    """The events of one delivery: completions without a callback may come several to a
    message (`shared/batched_publish.py`)."""
    key = message.routing_key or ""
    if not is_batch(message.headers):
        return [parse_task_event(key, message.body)]
    return [parse_task_event(key, part.body) for part in split_batch(message.body, message.headers)]


@asynccontextmanager
async def outcomes(amqp_url: str) -> AsyncIterator[Outcomes]:
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(exclusive=True, timeout=10)
        for key in _OUTCOMES:
            await queue.bind(EVENTS.name, routing_key=key, timeout=10)
        yield Outcomes(queue)


def _task(faults: str) -> tuple[ScoreText, str]:
    marker = f"u{uuid.uuid4().hex[:12]}"
    text = f"An essay whose first answer is unusable [[id:{marker}]] {faults}"
    return ScoreText(task_id=new_id(), text=text), marker


@pytest.mark.parametrize(
    ("faults", "attempts_made", "calls"),
    [
        # the repair answers 503; attempt 2 is answered
        pytest.param("[[fake:malformedx1]][[fake:503x1]]", 2, 3, id="repair-503"),
        # the repair never answers within LLM_TIMEOUT_S; attempt 2 is answered
        pytest.param("[[fake:malformedx1]][[fake:hangx1]]", 2, 3, id="repair-timeout"),
        # the repair answers 503, attempt 2's first call too; attempt 3 is answered
        pytest.param("[[fake:malformedx1]][[fake:503x2]]", 3, 4, id="then-first-call-503"),
    ],
)
async def test_a_retried_unusable_answer_is_in_the_completions_usage_once(
    scorer: Scorer, faults: str, attempts_made: int, calls: int
) -> None:
    command, marker = _task(faults)
    async with outcomes(scorer.amqp_url) as published:
        await scorer.send(command)
        completed: TaskCompleted = await published.next_of(command.task_id, TaskCompleted)

        assert completed.attempt == attempts_made
        assert scorer.calls(marker) == calls
        unusable, answered = (
            _billed(command.text, unusable=True),
            _billed(command.text, unusable=False),
        )
        assert completed.result.usage == _add(unusable, answered)
        assert completed.result.model == ANSWERED_MODEL

        # Delivered again, the decided attempt's recorded outcome is published again, as it
        # was: the tokens are not counted twice (and the meter keeps one record per task
        # generation).
        await scorer.send(
            command.model_copy(update={"attempt": attempts_made, "message_id": new_id()})
        )
        again: TaskCompleted = await published.next_of(command.task_id, TaskCompleted)
    assert again.sequence == completed.sequence
    assert again.result.usage == completed.result.usage
    assert scorer.calls(marker) == calls
    retries = [event for event in published.seen if isinstance(event, TaskRetrying)]
    assert [retry.attempt for retry in retries] == list(range(1, attempts_made))


async def test_a_task_given_up_after_an_unusable_answer_reports_its_tokens(
    scorer: Scorer,
) -> None:
    """Attempt 1: unusable, its repair 503. Attempt 2 (the last): its first call 503. The
    task is dead-lettered; `task.failed` carries the unusable answer's tokens."""
    command, marker = _task("[[fake:malformedx1]][[fake:503x2]]")
    command = command.model_copy(update={"max_attempts": 2})
    async with outcomes(scorer.amqp_url) as published:
        await scorer.send(command)
        failed: TaskFailed = await published.next_of(command.task_id, TaskFailed)

    assert (failed.attempt, failed.dead_lettered) == (2, True)
    assert failed.error.code == "model_unavailable"
    assert failed.usage == _billed(command.text, unusable=True)
    assert failed.model == ANSWERED_MODEL
    assert scorer.calls(marker) == 3


async def test_an_answer_without_a_choice_is_retried_and_its_tokens_billed(
    scorer: Scorer,
) -> None:
    """Attempt 1 is answered with a chat completion without a choice, which bills its prompt:
    retried as the provider unavailable, and the completion carries those tokens too."""
    command, marker = _task("[[fake:nochoicesx1]]")
    async with outcomes(scorer.amqp_url) as published:
        await scorer.send(command)
        completed: TaskCompleted = await published.next_of(command.task_id, TaskCompleted)

    [retrying] = [event for event in published.seen if isinstance(event, TaskRetrying)]
    assert (retrying.attempt, retrying.error.code) == (1, "model_unavailable")
    assert retrying.error.retryable
    assert completed.attempt == 2
    no_choice = Usage(prompt_tokens=_billed(command.text, unusable=False).prompt_tokens)
    assert completed.result.usage == _add(no_choice, _billed(command.text, unusable=False))
    assert scorer.calls(marker) == 2


class PublishingFailures(BrokerActions):
    """The scorer's broker actions on `broker`, remembering the reasons of the dead letters
    the broker confirmed (`dead_lettered`); the letters themselves are in the score queue's
    DLQ (`_letters` reads them). Counted without being sent, a letter routed nowhere, or to
    the wrong queue, passed."""

    def __init__(self, broker: RabbitBroker) -> None:
        super().__init__(broker=broker, timeout_s=10, clock=utcnow)
        self.dead_lettered: list[str] = []

    @override
    async def dead_letter(self, message: Delivery, error: str) -> bool:
        lettered = await super().dead_letter(message, error)
        if lettered:
            self.dead_lettered.append(error)
        return lettered


async def test_a_retried_attempt_given_up_at_the_delivery_limit_reports_earlier_tokens(
    make_deps: Deps, amqp_url: str, task_broker: RabbitBroker
) -> None:
    """Attempt 2 killed its consumers before its claim until the delivery limit, as often
    as it is sent again for that, deciding nothing: the task fails without a model answer
    of its own, with attempt 1's billed tokens."""
    command, _ = _task("[[fake:malformedx1]][[fake:503x1]]")
    deps = make_deps("scorer-a")
    retry = await score_text(command, deps=deps)
    assert isinstance(retry, Retry)
    assert retry.spent is not None
    assert retry.spent.usage == _billed(command.text, unusable=True)
    second = retry.next_command
    at_limit = HandedDelivery.redelivery(
        second.model_dump_json().encode(), count=SCORE_REQUESTS.delivery_limit
    )
    at_limit.headers[UNSTARTED_RESETS_HEADER] = UNSTARTED_RESETS

    async with outcomes(amqp_url) as published:
        actions = PublishingFailures(task_broker)
        await _at_delivery_limit(second, at_limit, deps, actions, SCORE_REQUESTS.delivery_limit)
        failed: TaskFailed = await published.next_of(command.task_id, TaskFailed)

    [letter] = await _letters(amqp_url, second.model_dump_json().encode())  # attempt 2's
    assert [letter.headers[ERROR_HEADER]] == actions.dead_lettered
    assert letter.headers[DEAD_LETTERED_FROM_HEADER] == SCORE_REQUESTS.name
    assert (failed.attempt, failed.dead_lettered) == (2, True)
    assert failed.usage == _billed(command.text, unusable=True)
    assert failed.model == ANSWERED_MODEL


async def test_a_replayed_generation_does_not_count_the_earlier_ones_tokens(
    make_deps: Deps, attempts: Attempts
) -> None:
    """A DLQ replay's retry (the next generation) reads nothing of the earlier generation's
    tokens: only a claim that replaces that generation takes them over, when it published no
    outcome (`test_scorer_usage_across_generations.py`)."""
    command, _ = _task("[[fake:malformedx1]][[fake:503x1]]")
    deps = make_deps("scorer-a")
    assert isinstance(await score_text(command, deps=deps), Retry)
    replayed_retry = command.model_copy(update={"generation": 1, "attempt": 2})

    assert await attempts.spent_before(replayed_retry) is None
    assert await attempts.spent_before(command.model_copy(update={"attempt": 2})) is not None
