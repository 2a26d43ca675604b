"""The notifier's wait after a database error is jittered: after a MongoDB outage, every
event and delivery held through it came back in the same second."""

from __future__ import annotations

from services.notifier.consumer import DATABASE_RETRY_DELAY, database_retry_wait


def test_the_wait_varies_within_half_the_delay_either_way() -> None:
    waits = [database_retry_wait() for _ in range(200)]

    assert all(DATABASE_RETRY_DELAY * 0.5 <= wait <= DATABASE_RETRY_DELAY * 1.5 for wait in waits)
    assert len(set(waits)) > 100
    assert min(waits) < DATABASE_RETRY_DELAY < max(waits)
