"""A line logged for each of many occurrences floods the log while a condition lasts (a
steady rate limit logged 7,300 lines an hour): `Tally` counts them and says when a line,
with the count since the last one, is due."""

from __future__ import annotations

import math
from collections.abc import Callable


class Tally:
    """Occurrences counted between reports; a report at most once per `every_s` (the first
    at once)."""

    def __init__(self, every_s: float, clock: Callable[[], float]) -> None:
        self._every_s = every_s
        self._clock = clock
        self._count = 0
        self._reported_at = -math.inf

    def count(self) -> int | None:
        """Count one occurrence: how many since the last report when one is due now (the
        caller logs it), else None."""
        self._count += 1
        now = self._clock()
        if now - self._reported_at < self._every_s:
            return None
        counted, self._count, self._reported_at = self._count, 0, now
        return counted
