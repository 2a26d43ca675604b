"""A line logged for each of many occurrences floods the log while a condition lasts (a
steady rate limit logged 7,300 lines an hour): `Tally` counts them and says when a line,
with the count since the last one, is due."""

from __future__ import annotations

import logging
import math
import time
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

    def report(self) -> int:
        """Report now, whenever the last report was: how many since it (this one included,
        once counted)."""
        counted, self._count, self._reported_at = self._count, 0, self._clock()
        return counted


# How often at most `FailedCalls` writes its line.
FAILED_CALLS_REPORT_S = 60.0


class FailedCalls:
    """A WARNING line about the failed calls to a service, at most once a `every_s`, with
    their count and the latest reason: a gateway answering its clients 503 for a service
    away (or at a wrong URL) said nothing of it in its own log (a review)."""

    def __init__(
        self,
        service: str,
        log: logging.Logger,
        *,
        every_s: float = FAILED_CALLS_REPORT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._service = service
        self._log = log
        self._tally = Tally(every_s, clock)

    def note(self, error: BaseException) -> None:
        if (count := self._tally.count()) is None:
            return
        self._log.warning(
            "calls to the %s failed: %d since the last line, the latest: %s",
            self._service,
            count,
            error,
        )
