"""Settings of the gateway (environment variables in README)."""

from __future__ import annotations

from pydantic import Field, SecretStr

from shared.settings import ServiceSettings


class GatewaySettings(ServiceSettings):
    port: int = Field(default=8000, validation_alias="GATEWAY_PORT")
    admin_api_key: SecretStr | None = Field(default=None, validation_alias="ADMIN_API_KEY")
    status_url: str = Field(default="http://127.0.0.1:8001", validation_alias="STATUS_URL")
    status_timeout_s: float = Field(default=5.0, gt=0, validation_alias="STATUS_TIMEOUT_S")
    max_text_chars: int = Field(default=50_000, gt=0, validation_alias="MAX_TEXT_CHARS")
    max_body_bytes: int = Field(default=1_048_576, gt=0, validation_alias="MAX_BODY_BYTES")
    max_attempts: int = Field(default=4, ge=1, le=20, validation_alias="SCORE_MAX_ATTEMPTS")
    result_cache_ttl_s: int = Field(default=86_400, gt=0, validation_alias="RESULT_CACHE_TTL_S")
    idempotency_ttl_s: int = Field(default=86_400, gt=0, validation_alias="IDEMPOTENCY_TTL_S")
    # Polls answer from the gateway's own record while the status projection has not yet heard
    # of a task this young (read-your-writes); an older unknown task is expired or never was.
    read_your_writes_window_s: float = Field(
        default=300.0, gt=0, validation_alias="READ_YOUR_WRITES_WINDOW_S"
    )
    # A submission still `accepting` after this long was interrupted; the outbox sweep sends it.
    outbox_grace_s: float = Field(default=30.0, gt=0, validation_alias="OUTBOX_GRACE_S")
    outbox_interval_s: float = Field(default=10.0, gt=0, validation_alias="OUTBOX_INTERVAL_S")
