"""Fail fast while a service's database is known away.

Without it, every request's database operation waited the whole server selection
(`MONGO_TIMEOUT_S`, 5 s) for its 503, though the driver already knew no server answered: a
client with a timeout of 5 s or less never saw the 503 or its Retry-After (a walkthrough and
a review of the gateway's key lookups and rate counts; a later review of the status
service's reads, which the gateway's status client gave up on at `STATUS_TIMEOUT_S`, 5 s,
poll after poll). Once an operation found no server in time, the gate refuses at once (with
the service's own `refusal`, the same 503) while the client knows no server to write to,
and lets one operation through every `probe_every_s` to find the database back (its own
selection makes the driver look again).
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from pymongo.errors import PyMongoError, ServerSelectionTimeoutError

PROBE_EVERY_S = 1.0
AWAY_REASON = "the database did not answer a moment ago, nor since"


def found_no_server(error: BaseException) -> bool:
    """Whether `error`, or one it was raised from, is a server selection that timed out."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, ServerSelectionTimeoutError):
            return True
        cause = cause.__cause__
    return False


@dataclass
class AwayGate:
    """`known`: whether the client knows a server to write to now; `refusal`, what `check`
    raises while the database is known away."""

    known: Callable[[], bool]
    refusal: Callable[[], Exception]
    clock: Callable[[], float] = time.monotonic
    probe_every_s: float = PROBE_EVERY_S
    _away: bool = field(default=False, init=False)
    _probed_at: float = field(default=-math.inf, init=False)

    def check(self) -> None:
        """Return when the operation may go to the database; `refusal()` is raised at once
        while it is known away and this is not the second's probe."""
        if not self._away:
            return
        if self.known():
            self._away = False
            return
        now = self.clock()
        if now - self._probed_at >= self.probe_every_s:
            self._probed_at = now
            return
        raise self.refusal()

    def note(self, error: BaseException) -> None:
        """An operation failed with `error`: the database is away when no server was found."""
        if found_no_server(error):
            self._away = True
            self._probed_at = self.clock()

    def answered(self) -> None:
        self._away = False

    async def through[T](self, operation: Callable[[], Awaitable[T]]) -> T:
        """`operation()` past the gate, its PyMongo error noted (`check`, `note`)."""
        self.check()
        try:
            result = await operation()
        except PyMongoError as error:
            self.note(error)
            raise
        self.answered()
        return result
