"""A retry's next attempt put off down the wait ladder by a pause of the model calls tells the
task's status its later due time: its `task.retrying`, told again under the same sequence
with the copy's `not_before` as `next_attempt_at` (`scoring._put_off`).

The status read the first time, long past, for as long as the pause held the attempt (a
review): a client polling saw its next attempt "long past" and could not tell when it would
come. `score_text` runs on the test database against the fake model server; the last test
runs the scorer and the status service in process on the real broker, and pauses the
scorer's calls as another replica's announcement would (`ops.model.paused`)."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timedelta
from typing import Any

import httpx
import pytest

from devtools.fake_llm import FakeLLM
from services.scorer.decisions import Defer, Retry
from services.scorer.scoring import RetryPolicy, ScorerDeps, score_text
from services.scorer.shared_pauses import provider_of
from services.scorer.throttle import ModelThrottle
from services.status.app import create_app as create_status
from services.status.settings import StatusSettings
from shared.bus import publish_command, publish_ops_event
from shared.contracts import CancelTask, ModelCallsPaused, ScoreText, TaskRetrying, new_id, utcnow
from shared.runtime import make_broker
from shared.topology import declare_topology
from tests.integration.in_process import scorer_over
from tests.integration.scorer_parts import attempts_store, fake_model, scorer_deps
from tests.support import eventually, metric_sum, running

pytestmark = pytest.mark.integration

Deps = Callable[[], ScorerDeps]
HOLD_S = 30.0  # what a delivery may wait in hand (RATE_LIMIT_HOLD_S's default)
PEER_PAUSE_S = 120.0  # another replica's pause: beyond the hold, so deliveries are put off


@pytest.fixture
async def make_deps(fake_llm: FakeLLM, mongo: Any, db_prefix: str) -> AsyncIterator[Deps]:
    async with fake_model(fake_llm) as model, attempts_store(mongo.url, db_prefix) as attempts:

        def deps() -> ScorerDeps:
            return scorer_deps(
                attempts=attempts,
                model=model,
                retry_policy=RetryPolicy(base_s=0.01, cap_s=0.05),
                throttle=ModelThrottle(hold_s=HOLD_S, base_s=0.02, rng=random.Random(0)),
            )

        yield deps


async def _retried(deps: ScorerDeps, fake_llm: FakeLLM) -> Retry:
    """A task's first attempt answered 429 (a short pause): its retry, recorded."""
    fake_llm.config.rate_limited_calls = 1
    retry = await score_text(ScoreText(task_id=new_id(), text="Rate limited once."), deps=deps)
    assert isinstance(retry, Retry)
    return retry


def _due(command: ScoreText) -> ScoreText:
    """The retry's next attempt as the wait ladder hands it back, due."""
    return command.model_copy(update={"not_before": utcnow()})


async def test_a_retry_put_off_by_a_pause_tells_its_later_due_time(
    make_deps: Deps, fake_llm: FakeLLM
) -> None:
    deps = make_deps()
    retry = await _retried(deps, fake_llm)
    deps.throttle.paused_elsewhere(PEER_PAUSE_S)  # the pause outlasts the hold now

    put_off = await score_text(_due(retry.next_command), deps=deps)

    assert isinstance(put_off, Defer)
    assert put_off.command.attempt == 2  # no attempt spent
    told = put_off.retry_due_later
    assert isinstance(told, TaskRetrying)
    assert put_off.command.not_before is not None
    assert told.next_attempt_at == put_off.command.not_before
    assert told.next_attempt_at > retry.event.next_attempt_at
    # The retry's own event, told again: the state it amends, with its error.
    assert (told.sequence, told.attempt, told.error) == (
        retry.event.sequence,
        retry.event.attempt,
        retry.event.error,
    )
    assert told.message_id != retry.event.message_id
    assert fake_llm.stats()["calls"] == 1  # the 429 only


async def test_a_first_attempt_put_off_tells_nothing(make_deps: Deps, fake_llm: FakeLLM) -> None:
    """A first attempt's task reads `queued`, with no due time to correct."""
    deps = make_deps()
    deps.throttle.paused_elsewhere(PEER_PAUSE_S)

    put_off = await score_text(ScoreText(task_id=new_id(), text="Never called."), deps=deps)

    assert isinstance(put_off, Defer)
    assert put_off.retry_due_later is None


async def test_a_retry_cancelled_meanwhile_is_not_told_again(
    make_deps: Deps, fake_llm: FakeLLM
) -> None:
    """The client cancelled while the retry waited: the cancellation stands over it (the
    claim carries it out when the copy is back), and no retry is told again."""
    deps = make_deps()
    retry = await _retried(deps, fake_llm)
    command = retry.next_command
    cancel = CancelTask(
        task_id=command.task_id,
        tenant_id=command.tenant_id,
        generation=command.generation,
        submitted_at=command.submitted_at,
        requested_at=utcnow(),
    )
    await deps.attempts.cancel(cancel, now=utcnow())
    deps.throttle.paused_elsewhere(PEER_PAUSE_S)

    put_off = await score_text(_due(command), deps=deps)

    assert isinstance(put_off, Defer)
    assert put_off.retry_due_later is None


async def _view(status: httpx.AsyncClient, task_id: str) -> dict[str, Any] | None:
    answer = await status.get(f"/internal/v1/tasks/{task_id}", params={"tenant_id": "default"})
    return answer.json() if answer.status_code == 200 else None


async def test_the_status_of_a_retry_a_pause_put_off_reads_its_later_due_time(
    fake_llm: FakeLLM, amqp_url: str, mongo: Any, db_prefix: str
) -> None:
    """The task is answered 429 (`Retry-After: 10`), then another replica's pause of two
    minutes comes before its retry: the retry is put off, and the status, which read the
    first due time, reads the later one. Without it, it read the first, past, all along."""
    fake_llm.config.rate_limited_calls = 1
    # The peer's pause must reach the scorer before the retry is due: a margin for a loaded
    # machine, not a wait (the test polls).
    fake_llm.config.rate_limit_retry_s = 10
    setup = scorer_over(fake_llm, amqp_url=amqp_url, mongo_url=mongo.url, db_prefix=db_prefix)
    env = {"RABBITMQ_URL": amqp_url, "MONGO_URL": mongo.url, "MONGO_DB_PREFIX": db_prefix}
    command = ScoreText(task_id=new_id(), text="Retried during a pause.")

    status_app = create_status(StatusSettings.model_validate(env))
    async with running(status_app) as status, running(setup.app()) as scorer:
        publisher = make_broker(setup.settings)
        async with publisher:
            await publisher.connect()
            await declare_topology(publisher)
            await publish_command(publisher, command, now=utcnow(), timeout=10)

            async def retrying() -> dict[str, Any] | None:
                view = await _view(status, command.task_id)
                return view if view is not None and view["status"] == "retrying" else None

            first = await eventually(retrying, what="the task retrying")
            first_due = datetime.fromisoformat(first["next_attempt_at"])
            peer = ModelCallsPaused(
                task_id=new_id(),
                provider=provider_of(setup.model_settings),
                pause_s=PEER_PAUSE_S,
                replica="another-replica",
            )
            await publish_ops_event(publisher, peer, timeout=10)

            async def due_later() -> dict[str, Any] | None:
                view = await _view(status, command.task_id)
                if view is None or view["next_attempt_at"] is None:
                    return None
                later = datetime.fromisoformat(view["next_attempt_at"])
                return view if later > first_due + timedelta(seconds=HOLD_S) else None

            view = await eventually(due_later, what="the later due time told")
        paused_here = metric_sum((await scorer.get("/metrics")).text, "scorebox_model_calls_paused")

    assert (view["status"], view["attempts"]) == ("retrying", 1)
    assert view["error"]["code"] == "model_rate_limited"
    assert paused_here == 1
    assert fake_llm.stats()["calls"] == 1  # the 429: the retry was put off uncalled
