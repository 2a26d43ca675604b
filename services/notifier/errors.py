"""Why a webhook delivery failed, split by what the delivery consumer must do.

    DeliveryError                   .reason
    ├── PermanentDeliveryError      give up now (recorded failed, not dead-lettered: the
    │   │                           receiver's doing); another attempt would fail the same way
    │   ├── UnsafeDestination       the URL, or an address its host resolves to, is not
    │   │                           public (SSRF guard)
    │   └── DeliveryRejected        the receiver answered 4xx (not 408/429), or 3xx
    │                               (redirects are never followed)
    └── TransientDeliveryError      retry later; .retry_after_s when the receiver sent one
        ├── ResolutionFailed        no DNS answer in time, or a failure (SERVFAIL, REFUSED)
        │   └── NoSuchHost          DNS answered that the name does not exist (NXDOMAIN)
        │                           or has no address (NODATA)
        ├── ReceiverUnreachable     connect or TLS failure, timeout, connection lost
        └── ReceiverUnavailable     5xx, 408 or 429

Only the broker adapter (`consumer.py`) turns these into broker outcomes.
"""

from __future__ import annotations


class DeliveryError(Exception):
    """Base of every failure of one delivery attempt."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class PermanentDeliveryError(DeliveryError):
    """Give the delivery up now; the tenant's receiver's doing, so not to the DLQ."""


class UnsafeDestination(PermanentDeliveryError):
    """The URL or one of its host's addresses is not public."""


class DeliveryRejected(PermanentDeliveryError):
    """The receiver refused the webhook for good (4xx other than 408/429, or a redirect)."""


class TransientDeliveryError(DeliveryError):
    """Retry later; `retry_after_s` is the receiver's Retry-After when it sent one."""

    def __init__(self, reason: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(reason)
        self.retry_after_s = retry_after_s


class ResolutionFailed(TransientDeliveryError):
    """The host name did not resolve: no answer in time, or a failure of the lookup."""


class NoSuchHost(ResolutionFailed):
    """The name's DNS answered that it does not exist or has no address: the URL's doing (a
    misspelt domain, one let lapse, one with only MX records), as an answer of the
    receiver's is; retried all the same (a domain just registered may not have reached every
    resolver yet)."""


class ReceiverUnreachable(TransientDeliveryError):
    """Connecting, the TLS handshake or the exchange failed or timed out."""


class ReceiverUnavailable(TransientDeliveryError):
    """The receiver answered 5xx, 408 or 429."""
