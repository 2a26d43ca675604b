"""Gateway settings it cannot work with are refused at start-up, each with the variables it
concerns named."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.gateway.settings import GatewaySettings


@pytest.mark.parametrize(
    ("ttl", "grace", "interval"),
    [("10", "30", "10"), ("39", "30", "10"), ("1", "1", "0.5"), ("86400", "86000", "600")],
)
def test_a_retention_shorter_than_the_outbox_delay_is_refused_at_start_up(
    ttl: str, grace: str, interval: str
) -> None:
    """A submission left to the outbox sweep is sent `OUTBOX_GRACE_S` after its request at
    the earliest and up to `OUTBOX_INTERVAL_S` later: it expired before (earlier builds
    deleted it unsent, an accepted task lost) or as soon as it was sent."""
    with pytest.raises(ValidationError) as refused:
        GatewaySettings.model_validate(
            {"IDEMPOTENCY_TTL_S": ttl, "OUTBOX_GRACE_S": grace, "OUTBOX_INTERVAL_S": interval}
        )
    message = str(refused.value)
    for name in ("IDEMPOTENCY_TTL_S", "OUTBOX_GRACE_S", "OUTBOX_INTERVAL_S"):
        assert name in message

    # At the bound, it is taken; so are the defaults.
    taken = GatewaySettings.model_validate(
        {"IDEMPOTENCY_TTL_S": "40", "OUTBOX_GRACE_S": "30", "OUTBOX_INTERVAL_S": "10"}
    )
    assert taken.idempotency_ttl_s == 40
    defaults = GatewaySettings.model_validate({})
    assert defaults.idempotency_ttl_s >= defaults.outbox_grace_s + defaults.outbox_interval_s
