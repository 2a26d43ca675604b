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
        {"MONGO_TIMEOUT_S": "20"},  # 3 x 20 + 10 = 70, the grace left at its default 30
        {"BROKER_TIMEOUT_S": "15"},  # 3 x 5 + 15 = 30: not above it
        {"OUTBOX_GRACE_S": "25"},  # 3 x 5 + 10 = 25
    ],
)
def test_an_outbox_grace_a_submission_may_outlast_is_warned_of(given: dict[str, str]) -> None:
    """The README says to keep `OUTBOX_GRACE_S` above 3 x `MONGO_TIMEOUT_S` +
    `BROKER_TIMEOUT_S`, the longest a submission takes to be refused; the gateway said
    nothing of any value, and another replica's sweep then sent submissions still being
    refused (their clients answered 503, their tasks scored)."""
    warning = GatewaySettings.model_validate(given).outbox_grace_warning()
    assert warning is not None
    for name in ("OUTBOX_GRACE_S", "MONGO_TIMEOUT_S", "BROKER_TIMEOUT_S"):
        assert name in warning

    # Above it, nothing to say; nor of the defaults.
    assert GatewaySettings.model_validate({"OUTBOX_GRACE_S": "25.5"}).outbox_grace_warning() is None
    defaults = GatewaySettings.model_validate({})
    assert defaults.outbox_grace_warning() is None
    longest_submission = 3 * defaults.mongo_timeout_s + defaults.broker_timeout_s
    assert defaults.outbox_grace_s > longest_submission


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
