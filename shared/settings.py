"""Settings every service shares; each service extends `ServiceSettings` with its own.

Names of environment variables are part of the public contract (see README).
Settings are built once in a service's entrypoint and passed down, never read at import.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="", extra="ignore", frozen=True)

    rabbitmq_url: str = Field(
        default="amqp://guest:guest@127.0.0.1:5672/", validation_alias="RABBITMQ_URL"
    )
    mongo_url: str = Field(default="mongodb://127.0.0.1:27017", validation_alias="MONGO_URL")
    mongo_database_prefix: str = Field(default="scorebox", validation_alias="MONGO_DB_PREFIX")
    http_host: str = Field(default="127.0.0.1", validation_alias="HTTP_HOST")
    port: int = Field(
        default=0, description="Each service names its own variable (GATEWAY_PORT...)."
    )
    log_level: str = Field(default="INFO", validation_alias="LOG_LEVEL")
    # Timeouts of the infrastructure calls (seconds).
    broker_timeout_s: float = Field(default=10.0, gt=0, validation_alias="BROKER_TIMEOUT_S")
    mongo_timeout_s: float = Field(default=5.0, gt=0, validation_alias="MONGO_TIMEOUT_S")
    startup_timeout_s: float = Field(default=60.0, gt=0, validation_alias="STARTUP_TIMEOUT_S")

    def database_name(self, service: str) -> str:
        return f"{self.mongo_database_prefix}_{service}"


def redact_url(url: str) -> str:
    """The URL with its password replaced, fit for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return urlunsplit(parts._replace(netloc=netloc))
