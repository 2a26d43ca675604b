"""Standard Webhooks signatures: the specification's test vector, secrets, rotation."""

from __future__ import annotations

import base64
import hashlib
import hmac
import time

import pytest
from standardwebhooks import Webhook, WebhookVerificationError

from services.notifier.signing import SECRET_BYTES, new_secret, sign, signed_headers

# The test vector of the Standard Webhooks specification (and its reference libraries).
VECTOR_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
VECTOR_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
VECTOR_TIMESTAMP = 1614265330
VECTOR_BODY = b'{"test": 2432232314}'
VECTOR_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def test_the_specification_test_vector() -> None:
    signature = sign(
        VECTOR_SECRET, webhook_id=VECTOR_ID, timestamp=VECTOR_TIMESTAMP, body=VECTOR_BODY
    )

    assert signature == VECTOR_SIGNATURE


def test_the_vector_by_hand_hmac_sha256_over_id_timestamp_body() -> None:
    key = base64.b64decode(VECTOR_SECRET.removeprefix("whsec_"))
    signed = f"{VECTOR_ID}.{VECTOR_TIMESTAMP}.".encode() + VECTOR_BODY
    digest = hmac.new(key, signed, hashlib.sha256).digest()

    assert f"v1,{base64.b64encode(digest).decode()}" == VECTOR_SIGNATURE


def test_headers_carry_id_timestamp_and_signature() -> None:
    headers = signed_headers(
        [VECTOR_SECRET], webhook_id=VECTOR_ID, timestamp=VECTOR_TIMESTAMP, body=VECTOR_BODY
    )

    assert headers == {
        "webhook-id": VECTOR_ID,
        "webhook-timestamp": str(VECTOR_TIMESTAMP),
        "webhook-signature": VECTOR_SIGNATURE,
    }


def test_secrets_are_whsec_base64_of_32_random_bytes() -> None:
    secrets = {new_secret() for _ in range(20)}

    assert len(secrets) == 20
    for secret in secrets:
        assert secret.startswith("whsec_")
        assert len(base64.b64decode(secret.removeprefix("whsec_"), validate=True)) == SECRET_BYTES


def test_during_a_rotation_both_secrets_sign_and_either_verifies() -> None:
    old, new = new_secret(), new_secret()
    body = b'{"type":"task.completed","data":{"task_id":"t1"}}'
    headers = signed_headers([new, old], webhook_id="msg_1", timestamp=int(time.time()), body=body)

    assert len(headers["webhook-signature"].split(" ")) == 2
    for secret in (old, new):
        assert Webhook(secret).verify(body, headers) == {
            "type": "task.completed",
            "data": {"task_id": "t1"},
        }
    with pytest.raises(WebhookVerificationError):
        Webhook(new_secret()).verify(body, headers)


def test_a_changed_body_does_not_verify() -> None:
    secret = new_secret()
    headers = signed_headers([secret], webhook_id="msg_1", timestamp=int(time.time()), body=b"{}")

    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(b'{"x":1}', headers)


def test_signing_needs_a_secret() -> None:
    with pytest.raises(ValueError, match="at least one"):
        signed_headers([], webhook_id="msg_1", timestamp=1, body=b"{}")
