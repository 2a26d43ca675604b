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


class GatewayError(Exception):
    """Base of the gateway's errors."""


class IdempotencyConflict(GatewayError):
    """The Idempotency-Key was used before with a different request."""


class RequestInProgress(GatewayError):
    """The Idempotency-Key's first request has not finished being accepted."""

    retry_after_s = 1


class ReplayUnfinished(RequestInProgress):
    """A replay found its key taken (a submission's) or its key's batch, and the database
    failed before it could answer it: what the key names is its first request's and stays as
    it was (not a 503, "nothing was kept": it may be sent, or answered 202 already). Retry
    with the same key."""

    retry_after_s = 5


class Unavailable(GatewayError):
    """A dependency is down; the request changed nothing."""

    retry_after_s = 5


class BrokerUnavailable(Unavailable):
    """RabbitMQ did not confirm the publish."""


class DatabaseUnavailable(Unavailable):
    """MongoDB did not answer."""


class StatusUnavailable(Unavailable):
    """The status service did not answer."""
