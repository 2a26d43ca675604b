"""Fail fast while the gateway's database is known away.

Without it, every request's key lookup and rate count waited the whole server selection
(`MONGO_TIMEOUT_S`, 5 s) for its 503, though the driver already knew no server answered: a
client with a timeout of 5 s or less never saw the 503 or its Retry-After (a walkthrough and
a review). Once an operation found no server in time, the gate refuses at once
(`DatabaseUnavailable`, the same 503) while the client knows no server to write to, and lets
one operation through every `probe_every_s` to find the database back (its own selection
makes the driver look again).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pymongo.errors import ServerSelectionTimeoutError

from services.gateway.errors import DatabaseUnavailable

PROBE_EVERY_S = 1.0


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
    """`known`: whether the client knows a server to write to now."""

    known: Callable[[], bool]
    clock: Callable[[], float] = time.monotonic
    probe_every_s: float = PROBE_EVERY_S
    _away: bool = field(default=False, init=False)
    _probed_at: float = field(default=-math.inf, init=False)

    def check(self) -> None:
        """Return when the operation may go to the database; `DatabaseUnavailable` at once
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
        raise DatabaseUnavailable("the database did not answer a moment ago, nor since")

    def note(self, error: BaseException) -> None:
        """An operation failed with `error`: the database is away when no server was found."""
        if found_no_server(error):
            self._away = True
            self._probed_at = self.clock()

    def answered(self) -> None:
        self._away = False
