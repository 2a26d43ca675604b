"""Gateway settings checked when they are read, before anything is reached: an outbox grace
a slow submission outlasts (warned of), and a `BOOTSTRAP_API_KEY` that is no key (refused)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.gateway.keys import generate_key
from services.gateway.settings import GatewaySettings


@pytest.mark.parametrize(
    "given",
    [
        {"MONGO_TIMEOUT_S": "6"},  # 7 x 6 + 2 x 10 = 62, the grace left at its default 60
        {"BROKER_TIMEOUT_S": "12.5"},  # 7 x 5 + 2 x 12.5 = 60: not above it
        {"OUTBOX_GRACE_S": "55"},  # 7 x 5 + 2 x 10 = 55
        # Above the first bound (3 x 1 + 2 = 5) and the second (5 x 1 + 2 x 2 = 9), below the
        # true one: 7 x 1 + 2 x 2 = 11 (a refusal within every timeout was sent by another
        # replica's sweep; found in review, the two reads before the insert in a later one).
        {"MONGO_TIMEOUT_S": "1", "BROKER_TIMEOUT_S": "2", "OUTBOX_GRACE_S": "5.5"},
        {"MONGO_TIMEOUT_S": "1", "BROKER_TIMEOUT_S": "2", "OUTBOX_GRACE_S": "10"},
    ],
)
def test_an_outbox_grace_a_submission_may_outlast_is_warned_of(given: dict[str, str]) -> None:
    """The README says to keep `OUTBOX_GRACE_S` above 7 x `MONGO_TIMEOUT_S` + 2 x
    `BROKER_TIMEOUT_S`, the longest a submission takes to be refused (the cache lookup, the
    in-flight count and the key's lookup of a tenant refused lately, the insert, the slot,
    the refused publish, the withdrawal, the slot's release, the delete);
    below it another replica's sweep may send a submission still being refused (its client
    answered 503, its task scored)."""
    warning = GatewaySettings.model_validate(given).outbox_grace_warning()
    assert warning is not None
    for name in ("OUTBOX_GRACE_S", "MONGO_TIMEOUT_S", "BROKER_TIMEOUT_S"):
        assert name in warning

    # Above it, nothing to say; nor of the defaults.
    assert GatewaySettings.model_validate({"OUTBOX_GRACE_S": "55.5"}).outbox_grace_warning() is None
    defaults = GatewaySettings.model_validate({})
    assert defaults.outbox_grace_warning() is None
    longest_refusal = 7 * defaults.mongo_timeout_s + 2 * defaults.broker_timeout_s
    assert defaults.outbox_grace_s > longest_refusal


@pytest.mark.parametrize(
    "token",
    ["not-a-key", "sbx_0123456789abcdef_short", " " + "x" * 60],
    ids=["words", "too-short", "no-prefix"],
)
def test_a_bootstrap_key_that_is_no_key_is_refused_with_the_settings(token: str) -> None:
    """It was parsed only once the database was ready: with MongoDB away the gateway exited
    on a bare TimeoutError after STARTUP_TIMEOUT_S, the key's error never shown."""
    with pytest.raises(ValidationError) as refused:
        GatewaySettings.model_validate({"BOOTSTRAP_API_KEY": token})
    message = str(refused.value)
    assert "BOOTSTRAP_API_KEY is not a Scorebox key" in message
    assert token.strip() not in message  # a secret, even a malformed one

    # A key is taken, and so is none (empty: compose passes `${SCOREBOX_API_KEY:-}`).
    for taken in ("", generate_key().token):
        settings = GatewaySettings.model_validate({"BOOTSTRAP_API_KEY": taken})
        assert settings.bootstrap_api_key is not None
        assert settings.bootstrap_api_key.get_secret_value() == taken


@pytest.mark.parametrize("other", ["ADMIN_API_KEY", "METRICS_API_KEY", "INTERNAL_API_KEY"])
def test_a_bootstrap_key_equal_to_a_guard_key_is_refused(other: str) -> None:
    """The guards compare the whole header: the default tenant's key opened their routes."""
    token = generate_key().token
    with pytest.raises(ValidationError) as refused:
        GatewaySettings.model_validate({"BOOTSTRAP_API_KEY": token, other: token})
    assert f"BOOTSTRAP_API_KEY must differ from {other}" in str(refused.value)
    assert token not in str(refused.value)
    GatewaySettings.model_validate({"BOOTSTRAP_API_KEY": "", other: ""})


def test_the_key_cache_is_bounded_as_a_revocation_is_promised_to_reach_every_replica() -> None:
    """A revoked key works on the other replicas for as long as their cache keeps it: a year
    was taken (found in review)."""
    with pytest.raises(ValidationError, match="API_KEY_CACHE_TTL_S"):
        GatewaySettings.model_validate({"API_KEY_CACHE_TTL_S": "31536000"})
    assert GatewaySettings.model_validate({"API_KEY_CACHE_TTL_S": "60"}).api_key_cache_ttl_s == 60
