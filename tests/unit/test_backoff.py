"""`shared.backoff`: the one capped exponential behind every retry's pause."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest

from services.notifier.deliveries import RetryPolicy as DeliveryRetryPolicy
from services.scheduler.runs import RetryPolicy as JobRetryPolicy
from shared.backoff import capped_exponential_s, jittered_s


@pytest.mark.parametrize(
    ("attempt", "expected"), [(-3, 2.0), (0, 2.0), (1, 2.0), (2, 4.0), (3, 8.0), (6, 60.0)]
)
def test_doubles_from_the_base_after_the_first_attempt_up_to_the_cap(
    attempt: int, expected: float
) -> None:
    assert capped_exponential_s(attempt, base_s=2.0, cap_s=60.0) == expected


@pytest.mark.parametrize("attempt", [1_025, 9_999, 10**30])
def test_an_attempt_of_any_size_is_the_cap(attempt: int) -> None:
    assert capped_exponential_s(attempt, base_s=0.5, cap_s=300.0) == 300.0


def test_the_jitter_is_between_half_and_the_whole() -> None:
    rng = random.Random(7)
    pauses = [jittered_s(10.0, rng) for _ in range(1_000)]
    assert all(5.0 <= pause < 10.0 for pause in pauses)
    assert max(pauses) - min(pauses) > 4.0  # spread, not one value


def test_a_webhook_delivery_attempt_past_1024_gets_the_cap() -> None:
    # Replays add rounds to a delivery's attempts; `2 ** (attempt - 1)` as an int overflowed
    # the float multiplication at 1,025.
    policy = DeliveryRetryPolicy(base_s=1.0, cap_s=3_600.0)
    delay = policy.delay(1_025, retry_after_s=None, rng=random.Random(1))
    assert timedelta(seconds=1_800) <= delay <= timedelta(seconds=3_600)


def test_a_job_run_attempt_of_any_size_gets_the_cap() -> None:
    policy = JobRetryPolicy(max_attempts=5, base=timedelta(seconds=5), cap=timedelta(hours=1))
    assert policy.delay(10**6) == timedelta(hours=1)
    assert policy.delay(2) == timedelta(seconds=10)
