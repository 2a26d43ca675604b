"""Errors of the gateway, split by what the client must do.

    GatewayError
    ├── IdempotencyConflict     409: same key, different request body
    ├── RequestInProgress       409: same key, first request still being accepted; retry
    │   └── ReplayUnfinished    409: same key, its first request received, the database
    │                                failing the replay; retry with the same key
    └── Unavailable             503: try again later; nothing was kept
        ├── BrokerUnavailable
        ├── DatabaseUnavailable
        └── StatusUnavailable

Only the HTTP adapter (`api.py`) turns these into problem+json answers.
"""

import math
import re
from datetime import datetime

from shared.away_gate import AWAY_REASON
from shared.database_errors import transient_database_error


class GatewayError(Exception):
    """Base of the gateway's errors."""


class IdempotencyConflict(GatewayError):
    """The Idempotency-Key was used before with a different request."""


class RequestInProgress(GatewayError):
    """The Idempotency-Key's first request has not finished being accepted. `retry_after_s`:
    when to ask again (`in_progress_retry_after`; 1 by default)."""

    retry_after_s = 1

    def __init__(self, idempotency_key: str, *, retry_after_s: int | None = None) -> None:
        super().__init__(idempotency_key)
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s


def in_progress_retry_after(created_at: datetime, *, until: datetime, now: datetime) -> int:
    """Seconds before a replay of a request still in progress may find it settled: as long as
    the request has run, but no later than `until`, when a request still unfinished is taken
    for dead (the outbox grace). A request alive ends within a second or two; the longer it
    has run, the likelier it died, and the fixed second it said before had a client whose
    gateway crashed mid-batch ask sixty times (a walkthrough). At least 1."""
    ran = (now - created_at).total_seconds()
    left = (until - now).total_seconds()
    return max(1, math.ceil(min(ran, left)))


class ReplayUnfinished(RequestInProgress):
    """A replay found its key taken (a submission's) or its key's batch, and the database
    failed before it could answer it: what the key names is its first request's and stays as
    it was (not a 503, "nothing was kept": it may be sent, or answered 202 already). Retry
    with the same key."""

    retry_after_s = 5


class Unavailable(GatewayError):
    """A dependency is down; the request changed nothing."""

    retry_after_s = 5
    # What is away, as a client's answer names it (`away`).
    what = "A dependency"
    # The dependency (a service of ours) answered that its database refuses the operation
    # for good (its 500 `database-refused`): retrying meets it again (`refused_for_good`).
    for_good = False

    @property
    def away(self) -> str:
        """`what` is unavailable, for a problem's detail: the class's name led it
        ("StatusUnavailable: a dependency is unavailable"), a word of the code, not the API."""
        return f"{self.what} is unavailable"


class BrokerUnavailable(Unavailable):
    """RabbitMQ did not confirm the publish."""

    what = "The message broker"


class DatabaseUnavailable(Unavailable):
    """MongoDB did not answer, or refused the operation; the PyMongo error is its cause
    (`database_away` tells the two apart). A request answers an absence with a 503 and a
    refusal for good with a 500 (`refused_for_good`): retrying would meet it again."""

    what = "The database"


def database_known_away() -> DatabaseUnavailable:
    """What the gateway's `AwayGate` raises while its database is known away."""
    return DatabaseUnavailable(AWAY_REASON)


def database_away(error: BaseException) -> bool:
    """Whether a `DatabaseUnavailable` is a database that is away, for a consumer to wait out,
    rather than an operation it refuses for good (a failed validation, a document over
    16 MiB), which recurs on every try: waited out, it held its delivery for ever.

    The stores wrap every PyMongo error, keeping it as the cause
    (`shared.database_errors.transient_database_error` judges it); one without a cause is
    taken for away, as every one was. A `DatabaseUnavailable` raised from another (a key
    creation's `KeyNotIssued`) is judged by the PyMongo error at the end of the chain."""
    cause = error.__cause__
    while isinstance(cause, DatabaseUnavailable):
        cause = cause.__cause__
    return cause is None or transient_database_error(cause)


def refused_for_good(error: BaseException) -> bool:
    """A `DatabaseUnavailable` whose operation the database refuses whatever the retry (a
    failed validation, a document over 16 MiB, a missing privilege), or a service of ours
    that answered so of its own database (`Unavailable.for_good`)."""
    if isinstance(error, Unavailable) and error.for_good:
        return True
    return isinstance(error, DatabaseUnavailable) and not database_away(error)


class StatusUnavailable(Unavailable):
    """The status service did not answer."""

    what = "The status service"


class StatusRefused(StatusUnavailable):
    """The status service answered that its database refuses the read for good."""

    for_good = True


# A well-formed Idempotency-Key: 1 to 255 visible ASCII characters.
IDEMPOTENCY_KEY = re.compile(r"^[\x21-\x7e]{1,255}\Z")


def nothing_kept(idempotency_key: str | None, *, when: str = "shortly") -> str:
    """The end of a refused submission's 503: what was kept, and when to retry. A replay is
    told that what its key's first request started goes on: "nothing was kept" told a
    client whose first request had been accepted that it was lost (a review)."""
    if idempotency_key is None:
        return f"nothing was kept. Retry {when}."
    return (
        "nothing of this request was kept, and a request accepted earlier under its "
        f"Idempotency-Key is unaffected. Retry {when} with the same Idempotency-Key."
    )
