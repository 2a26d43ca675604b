"""Signing webhooks in the Standard Webhooks format (https://www.standardwebhooks.com/).

Each request carries `webhook-id` (the delivery id, the same on every attempt),
`webhook-timestamp` (unix seconds of this attempt) and `webhook-signature`: space-separated
`v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">`, one per secret that is valid now
(the current one, and the previous one for a grace period after a rotation). Secrets are
`whsec_` + base64 of 32 random bytes. The HMAC itself is the reference library's.
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Sequence
from datetime import UTC, datetime

from standardwebhooks import Webhook

SECRET_PREFIX = "whsec_"  # noqa: S105 - the format's prefix, not a secret
SECRET_BYTES = 32


def new_secret() -> str:
    """A fresh signing secret in the Standard Webhooks form."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def sign(secret: str, *, webhook_id: str, timestamp: int, body: bytes) -> str:
    """One `v1,<signature>` for `body` sent as `webhook_id` at `timestamp`."""
    moment = datetime.fromtimestamp(timestamp, UTC)
    return Webhook(secret).sign(msg_id=webhook_id, timestamp=moment, data=body.decode())


def signed_headers(
    secrets_in_force: Sequence[str], *, webhook_id: str, timestamp: int, body: bytes
) -> dict[str, str]:
    """The three Standard Webhooks headers for one attempt."""
    if not secrets_in_force:
        raise ValueError("at least one signing secret is needed")
    signatures = " ".join(
        sign(secret, webhook_id=webhook_id, timestamp=timestamp, body=body)
        for secret in secrets_in_force
    )
    return {
        "webhook-id": webhook_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": signatures,
    }
