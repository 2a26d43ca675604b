"""`python -m services.gateway`: run the public API."""

from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings
from shared.runtime import run_service
from shared.settings import settings_or_exit

if __name__ == "__main__":
    settings = settings_or_exit(GatewaySettings, "gateway")
    run_service("gateway", settings, lambda: create_app(settings))
