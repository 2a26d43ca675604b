"""`python -m services.gateway`: run the public API."""

from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings
from shared.runtime import run_service

if __name__ == "__main__":
    settings = GatewaySettings()
    run_service("gateway", settings, lambda: create_app(settings))
