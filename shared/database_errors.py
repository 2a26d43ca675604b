"""Which PyMongo errors pass by themselves, to be waited out, and which recur on every try.

`keep_trying(..., retry_on=(PyMongoError,))` waited out every database error with the
delivery held, permanent ones too (a document over 16 MiB, a failed schema validation, a
write refused for good): such a delivery was held and retried for ever instead of being
counted and dead-lettered. Only these are transient:

- the server unreachable, no primary, a network or server-selection timeout, an exhausted
  pool (`ConnectionFailure`: `AutoReconnect`, `NotPrimaryError`, `NetworkTimeout`,
  `ServerSelectionTimeoutError`, `WaitQueueTimeoutError`);
- any timeout PyMongo reports as one (`error.timeout`: `ExecutionTimeout`, a write concern's
  `WTimeoutError`, a client-side operation timeout);
- an error the server labels retryable (`RetryableWriteError`, `TransientTransactionError`),
  or whose code the retryable-writes specification lists (not primary, shutting down,
  host unreachable, exceeded time limit...), which a write error or a write concern error in
  a bulk answer may carry without the label;
- a cursor the server lost (`CursorNotFound`: a read begun again works);
- `shared.group_writes.WriteOutcomeUnknown`: a write sent in a round trip that failed
  part-way (an idempotent write is simply sent again).

Everything else (`WriteError`, `DuplicateKeyError`, `OperationFailure` of another code,
`InvalidOperation`, `ConfigurationError`...) is permanent for the caller.
"""

from __future__ import annotations

from pymongo.errors import ConnectionFailure, CursorNotFound, OperationFailure, PyMongoError

from shared.group_writes import WriteOutcomeUnknown

TRANSIENT_LABELS = frozenset({"RetryableWriteError", "TransientTransactionError"})
# The retryable-writes specification's codes (PyMongo's `_RETRYABLE_ERROR_CODES`, private).
TRANSIENT_CODES = frozenset(
    {
        6,  # HostUnreachable
        7,  # HostNotFound
        89,  # NetworkTimeout
        91,  # ShutdownInProgress
        134,  # ReadConcernMajorityNotAvailableYet
        189,  # PrimarySteppedDown
        262,  # ExceededTimeLimit
        9001,  # SocketException
        10058,  # LegacyNotPrimary
        10107,  # NotWritablePrimary
        11600,  # InterruptedAtShutdown
        11602,  # InterruptedDueToReplStateChange
        13435,  # NotPrimaryNoSecondaryOk
        13436,  # NotPrimaryOrSecondary
    }
)


def transient_database_error(error: BaseException) -> bool:
    """Whether `error` may pass by itself (retry the same operation) rather than recur."""
    if not isinstance(error, PyMongoError):
        return False
    if isinstance(error, ConnectionFailure | CursorNotFound | WriteOutcomeUnknown):
        return True
    if error.timeout or any(error.has_error_label(label) for label in TRANSIENT_LABELS):
        return True
    return isinstance(error, OperationFailure) and error.code in TRANSIENT_CODES
