"""Capped exponential back-off: the one formula behind every retry's pause (the scorer's
model calls, the scheduler's job runs, the notifier's webhook deliveries, the consumers'
failed deliveries), each owner keeping its own base, cap and what it does with the pause."""

from __future__ import annotations

import random

# 2**64 times any base worth having is past any cap: more doublings change nothing. Capped
# before multiplying, since attempts are counted by the broker, by replays and by
# publishers: an int exponent past 1,023 made `float * 2**n` raise OverflowError.
MAX_DOUBLINGS = 64


def capped_exponential_s(attempt: int, *, base_s: float, cap_s: float) -> float:
    """`base_s` after the first attempt (1-based), doubling with each one after, at most
    `cap_s`; an attempt below 1 counts as the first."""
    doublings = min(max(attempt - 1, 0), MAX_DOUBLINGS)
    return min(cap_s, base_s * 2.0**doublings)


def jittered_s(delay_s: float, rng: random.Random) -> float:
    """`delay_s` scaled by a random factor in [0.5, 1): retries that failed together spread
    out instead of coming back together."""
    return delay_s * rng.uniform(0.5, 1.0)
