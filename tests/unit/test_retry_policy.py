"""Back-off: exponential, jittered, capped, and never earlier than the model's Retry-After."""

from __future__ import annotations

import random

from services.scorer.decisions import Finish, Retry, load, store
from services.scorer.scoring import MAX_RETRY_AFTER_S, RetryPolicy
from shared.contracts import ScoreResult, ScoreText, TaskCompleted, TaskError, TaskRetrying, utcnow

POLICY = RetryPolicy(base_s=2.0, cap_s=60.0)


def test_delay_grows_exponentially_within_the_jitter_band() -> None:
    rng = random.Random(7)
    for attempt, ceiling in [(1, 2.0), (2, 4.0), (3, 8.0), (4, 16.0), (10, 60.0)]:
        delay = POLICY.delay_s(attempt, None, rng)
        assert ceiling / 2 <= delay <= ceiling


def test_retry_after_is_a_floor() -> None:
    assert POLICY.delay_s(1, 30.0, random.Random(1)) == 30.0


def test_retry_after_is_honoured_up_to_a_day() -> None:
    """A broken or hopeless hint (1e12 s overflowed the due date) waits a day at most."""
    for hint in (MAX_RETRY_AFTER_S + 1, 1e9, 1e12):
        assert POLICY.delay_s(1, hint, random.Random(1)) == MAX_RETRY_AFTER_S


def test_jitter_spreads_retries() -> None:
    rng = random.Random(3)
    assert len({round(POLICY.delay_s(3, None, rng), 6) for _ in range(20)}) > 10


def test_decisions_survive_storage_unchanged() -> None:
    now = utcnow()
    command = ScoreText(task_id="t", text="x", attempt=2)
    retry = Retry(
        event=TaskRetrying(
            task_id="t",
            sequence=220,
            attempt=2,
            submitted_at=now,
            error=TaskError(code="model_timeout", message="slow", retryable=True),
            next_attempt_at=now,
        ),
        next_command=command,
    )
    finish = Finish(
        TaskCompleted(
            task_id="t",
            sequence=290,
            submitted_at=now,
            result=ScoreResult(score=1, comment="c", model="m"),
        ),
        dead_letter_error="why",
    )
    assert load(store(retry)) == retry
    assert load(store(finish)) == finish


def test_an_attempt_far_past_the_cap_waits_the_cap() -> None:
    """The contract allows attempts up to 9,999: past 1,024 the exponential overflowed."""
    assert 30.0 <= POLICY.delay_s(9_999, None, random.Random(1)) <= 60.0
