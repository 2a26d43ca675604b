"""Settings a service cannot work with are refused at start-up, with the variable named."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.gateway.settings import GatewaySettings
from services.status.settings import StatusSettings


@pytest.mark.parametrize("variable", ["STATUS_URL", "NOTIFIER_URL", "SCHEDULER_URL"])
@pytest.mark.parametrize(
    "url", ["127.0.0.1:8001", "status:8001", "", "ftp://status", "http://[::1"]
)
def test_a_service_url_that_is_no_http_url_is_refused(variable: str, url: str) -> None:
    """It was accepted, and every poll (webhook, usage) then answered 503."""
    with pytest.raises(ValidationError, match=variable):
        GatewaySettings.model_validate({variable: url})


def test_a_service_url_with_a_host_is_taken() -> None:
    settings = GatewaySettings.model_validate({"STATUS_URL": "http://status:8001"})
    assert settings.status_url == "http://status:8001"


@pytest.mark.parametrize("port", ["-1", "65536", "70000"])
def test_a_port_out_of_range_is_refused(port: str) -> None:
    """`make run` died with an OverflowError traceback at its free-port check."""
    with pytest.raises(ValidationError, match="GATEWAY_PORT"):
        GatewaySettings.model_validate({"GATEWAY_PORT": port})
    with pytest.raises(ValidationError, match="STATUS_PORT"):
        StatusSettings.model_validate({"STATUS_PORT": port})
