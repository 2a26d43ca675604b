"""Settings of the gateway (environment variables in README)."""

from __future__ import annotations

from pydantic import Field, SecretStr, field_validator, model_validator

from services.gateway.keys import parse_key
from shared.contracts import (
    HEURISTIC_PROMPT_VERSION,
    MAX_BATCH_ITEMS,
    PROMPT_VERSIONS,
    known_rubric_version,
)
from shared.settings import (
    DEFAULT_LLM_MODEL,
    MAX_DURATION_S,
    READ_YOUR_WRITES_MAX_S,
    AdminApiSettings,
    http_url,
    require_distinct_keys,
)

# The longest a revoked key may still be taken by another replica.
MAX_KEY_CACHE_TTL_S = 60.0


class GatewaySettings(AdminApiSettings):
    port: int = Field(default=8000, validation_alias="GATEWAY_PORT")
    status_url: str = Field(default="http://127.0.0.1:8001", validation_alias="STATUS_URL")
    status_timeout_s: float = Field(default=5.0, gt=0, validation_alias="STATUS_TIMEOUT_S")
    # The notifier keeps each tenant's webhook secret and failure-alert URL (`/v1/webhooks`).
    notifier_url: str = Field(default="http://127.0.0.1:8004", validation_alias="NOTIFIER_URL")
    notifier_timeout_s: float = Field(default=5.0, gt=0, validation_alias="NOTIFIER_TIMEOUT_S")
    # The scheduler keeps each tenant's daily usage (`GET /v1/usage` reads it).
    scheduler_url: str = Field(default="http://127.0.0.1:8003", validation_alias="SCHEDULER_URL")
    scheduler_timeout_s: float = Field(default=5.0, gt=0, validation_alias="SCHEDULER_TIMEOUT_S")
    # Task outcomes (and live events) one gateway replica holds at once: the back-pressure of
    # its database writes. Unset, the channel's prefetch was unlimited (RabbitMQ caps that
    # at 2,000 per quorum consumer), each held outcome retrying its write in a database outage.
    outcome_prefetch: int = Field(default=256, ge=1, le=10_000, validation_alias="OUTCOME_PREFETCH")
    # Re-score requests (`scorebox.rescore-requests`) handled at once by one gateway replica.
    rescore_prefetch: int = Field(default=16, ge=1, le=1000, validation_alias="RESCORE_PREFETCH")
    max_text_chars: int = Field(default=50_000, gt=0, validation_alias="MAX_TEXT_CHARS")
    max_body_bytes: int = Field(default=1_048_576, gt=0, validation_alias="MAX_BODY_BYTES")
    max_attempts: int = Field(default=4, ge=1, le=20, validation_alias="SCORE_MAX_ATTEMPTS")
    result_cache_ttl_s: int = Field(
        default=86_400, gt=0, le=MAX_DURATION_S, validation_alias="RESULT_CACHE_TTL_S"
    )
    # The current rubric/prompt version (the scheduler's setting too): the result cache
    # answers only with results scored under it (`cached_prompt_versions`), so a new rubric is
    # not bypassed by the cache for `RESULT_CACHE_TTL_S`.
    rubric_version: str | None = Field(default=None, validation_alias="RUBRIC_VERSION")
    # The scorer's own settings, read for the result cache: a submission naming no model is
    # scored by the scorer's default, which is part of its cache key. Without it, switching
    # LLM_PROVIDER (or LLM_MODEL) served the old scorer's results for `RESULT_CACHE_TTL_S`.
    llm_provider: str = Field(default="heuristic", validation_alias="LLM_PROVIDER")
    llm_model: str = Field(default=DEFAULT_LLM_MODEL, validation_alias="LLM_MODEL")
    # The models a submission may name, comma-separated, besides `LLM_MODEL` (empty: any).
    llm_allowed_models: str = Field(default="", validation_alias="LLM_ALLOWED_MODELS")

    @field_validator("rubric_version")
    @classmethod
    def _a_prompt_version(cls, value: str | None) -> str | None:
        return known_rubric_version(value)

    idempotency_ttl_s: int = Field(
        default=86_400, gt=0, le=MAX_DURATION_S, validation_alias="IDEMPOTENCY_TTL_S"
    )
    # Polls answer from the gateway's own record while the status projection has not yet heard
    # of a task this young (read-your-writes); an older unknown task is expired or never was.
    read_your_writes_window_s: float = Field(
        default=300.0,
        gt=0,
        le=READ_YOUR_WRITES_MAX_S,
        validation_alias="READ_YOUR_WRITES_WINDOW_S",
    )
    # A submission still `accepting` (interrupted) or `unconfirmed` after this long is sent by
    # the outbox sweep.
    # Above `longest_refusal_s` (55 s with the default timeouts): see `outbox_grace_warning`.
    outbox_grace_s: float = Field(
        default=60.0, gt=0, le=MAX_DURATION_S, validation_alias="OUTBOX_GRACE_S"
    )
    outbox_interval_s: float = Field(
        default=10.0, gt=0, le=MAX_DURATION_S, validation_alias="OUTBOX_INTERVAL_S"
    )
    # Batches (`POST /v1/batches`): items per batch and the body limit of a batch request.
    max_batch_items: int = Field(
        default=MAX_BATCH_ITEMS, ge=1, le=MAX_BATCH_ITEMS, validation_alias="MAX_BATCH_ITEMS"
    )
    max_batch_body_bytes: int = Field(
        default=16 * 1_048_576, gt=0, validation_alias="MAX_BATCH_BODY_BYTES"
    )
    # Live push (SSE and `?wait=`): open waiters per replica and per tenant, the SSE heartbeat,
    # how long one stream may stay open (the client resumes with Last-Event-ID), and how long a
    # read may be retried until the status projection reflects an event the replica has seen.
    live_max_waiters: int = Field(default=10_000, gt=0, validation_alias="LIVE_MAX_WAITERS")
    live_max_waiters_per_tenant: int = Field(
        default=1_000, gt=0, validation_alias="LIVE_MAX_WAITERS_PER_TENANT"
    )
    sse_heartbeat_s: float = Field(default=15.0, gt=0, validation_alias="SSE_HEARTBEAT_S")
    sse_max_stream_s: float = Field(default=1800.0, gt=0, validation_alias="SSE_MAX_STREAM_S")
    sse_retry_ms: int = Field(default=3000, ge=0, validation_alias="SSE_RETRY_MS")
    live_settle_s: float = Field(default=2.0, ge=0, validation_alias="LIVE_SETTLE_S")
    # API keys (`services/gateway/keys.py`): a key registered for the default tenant at start-up
    # (idempotent; `make run` sets it), and how long a key lookup is cached in-process, which
    # is how long a revoked key may keep working on other replicas, open streams included
    # (0 = no cache; bounded, found in review).
    bootstrap_api_key: SecretStr | None = Field(default=None, validation_alias="BOOTSTRAP_API_KEY")
    api_key_cache_ttl_s: float = Field(
        default=5.0, ge=0, le=MAX_KEY_CACHE_TTL_S, validation_alias="API_KEY_CACHE_TTL_S"
    )
    # Lookups that find no key each client address may cause per minute, per replica
    # (`services/gateway/unknown_keys.py`; 0 = no bound): each costs a database read.
    unknown_keys_per_min: int = Field(
        default=60, ge=0, validation_alias="UNKNOWN_KEYS_PER_MIN_PER_ADDRESS"
    )
    # And all addresses together (0 = no bound): clients with many addresses each within its
    # budget, or more than the addresses remembered, had no ceiling.
    unknown_keys_per_min_per_replica: int = Field(
        default=6_000, ge=0, validation_alias="UNKNOWN_KEYS_PER_MIN_PER_REPLICA"
    )
    # Limits (`services/gateway/limits.py`), shared by every replica; 0 switches one off.
    rate_limit_per_min: int = Field(default=600, ge=0, validation_alias="RATE_LIMIT_PER_MIN")
    max_in_flight_per_tenant: int = Field(
        default=10_000, ge=0, validation_alias="MAX_IN_FLIGHT_PER_TENANT"
    )
    # Admission control of submissions (`services/gateway/admission.py`): the latency each
    # gateway process steers its limit of submissions at once by (0 = no admission control),
    # and that limit's ceiling.
    submit_latency_target_ms: float = Field(
        default=2000.0, ge=0, validation_alias="SUBMIT_LATENCY_TARGET_MS"
    )
    submit_max_concurrency: int = Field(
        default=512, ge=1, validation_alias="SUBMIT_MAX_CONCURRENCY"
    )
    # How long receiving one request's body may take before the gateway answers 408.
    request_body_timeout_s: float = Field(
        default=30.0, gt=0, validation_alias="REQUEST_BODY_TIMEOUT_S"
    )

    @model_validator(mode="after")
    def _a_full_batch_fits_in_flight(self) -> GatewaySettings:
        """A batch larger than the in-flight limit was answered 429 "retry when some have
        finished" for ever, with no task of the tenant in flight."""
        limit = self.max_in_flight_per_tenant
        if limit and self.max_batch_items > limit:
            raise ValueError(
                f"MAX_BATCH_ITEMS ({self.max_batch_items}) exceeds MAX_IN_FLIGHT_PER_TENANT "
                f"({limit}): such batches could never be admitted"
            )
        return self

    @model_validator(mode="after")
    def _submissions_outlive_the_outbox(self) -> GatewaySettings:
        """A submission the outbox sweep sends is sent `OUTBOX_GRACE_S` after its request at
        the earliest, and up to `OUTBOX_INTERVAL_S` later: with a shorter
        `IDEMPOTENCY_TTL_S` it expired (its idempotency key, its text and its in-flight mark
        with it) as soon as it was sent, and under earlier builds before the sweep looked."""
        outbox = self.outbox_grace_s + self.outbox_interval_s
        if self.idempotency_ttl_s < outbox:
            raise ValueError(
                f"IDEMPOTENCY_TTL_S ({self.idempotency_ttl_s}) is shorter than OUTBOX_GRACE_S "
                f"({self.outbox_grace_s:g}) plus OUTBOX_INTERVAL_S "
                f"({self.outbox_interval_s:g}): submissions left to the outbox sweep would "
                "expire before it sends them"
            )
        return self

    @property
    def longest_refusal_s(self) -> float:
        """The longest a submission takes, from its record's `created_at`, to be refused and
        its record deleted: the result-cache lookup, the in-flight count and the
        Idempotency-Key lookup of a tenant refused lately (`submit.refuse_before_recording`),
        the insert and the in-flight slot (`MONGO_TIMEOUT_S` each), the publish the broker
        refuses and the withdrawal from the projection (`BROKER_TIMEOUT_S` each), then the
        slot's release and the record's delete (`MONGO_TIMEOUT_S` each). It was 3 x
        `MONGO_TIMEOUT_S` + `BROKER_TIMEOUT_S`, which left out the lookup, the withdrawal and
        the release (found in review), then 5 x + 2 x, which left out the two reads before
        the insert (the gateway's re-read, session 59)."""
        return 7 * self.mongo_timeout_s + 2 * self.broker_timeout_s

    def outbox_grace_warning(self) -> str | None:
        """Why `OUTBOX_GRACE_S` is too short, if it is. Another replica's outbox sweep takes a
        submission still unsent after the grace for one whose request was interrupted, and
        sends it; a submission takes up to `longest_refusal_s` to be refused. With a shorter
        grace a request still running may be sent by the sweep, then refused: its client
        answered 503 while its task is scored. A warning, not a refusal: tests and fault
        drills shorten the grace on purpose to make the sweep act at once."""
        longest = self.longest_refusal_s
        if self.outbox_grace_s > longest:
            return None
        return (
            f"OUTBOX_GRACE_S ({self.outbox_grace_s:g}) should exceed 7 x MONGO_TIMEOUT_S "
            f"({self.mongo_timeout_s:g}) plus 2 x BROKER_TIMEOUT_S ({self.broker_timeout_s:g}), "
            f"{longest:g} s, the longest a submission takes to be refused: another "
            "replica's outbox sweep may send a submission its request is still refusing"
        )

    @model_validator(mode="after")
    def _the_bootstrap_key_opens_nothing_else(self) -> GatewaySettings:
        """The admin, metrics and internal guards compare the whole `Authorization` header:
        one of their keys shaped like a Scorebox key and also given as the bootstrap key
        made the default tenant's API key open their routes too."""
        require_distinct_keys(
            self, "bootstrap_api_key", ("admin_api_key", "metrics_api_key", "internal_api_key")
        )
        return self

    @field_validator("bootstrap_api_key")
    @classmethod
    def _a_scorebox_key(cls, key: SecretStr | None) -> SecretStr | None:
        """Checked here, not when the key is registered: that comes after the database is
        ready, and with MongoDB away the gateway exited on a bare TimeoutError, the key's
        error never shown. Empty means unset (compose passes `${SCOREBOX_API_KEY:-}`)."""
        token = "" if key is None else key.get_secret_value()
        if token and parse_key(token) is None:
            raise ValueError(
                "BOOTSTRAP_API_KEY is not a Scorebox key (sbx_<16 hex>_<43 URL-safe "
                "characters>); make one with `python -m services.gateway.keys new`"
            )
        return key

    @field_validator("status_url", "notifier_url", "scheduler_url")
    @classmethod
    def _service_url(cls, url: str) -> str:
        return http_url(url)

    @property
    def allowed_models(self) -> tuple[str, ...]:
        """The models a submission may name, sorted; empty when any may be named."""
        listed = {name.strip() for name in self.llm_allowed_models.split(",") if name.strip()}
        if not listed:
            return ()
        return tuple(sorted(listed | {self.llm_model.strip() or DEFAULT_LLM_MODEL}))

    @property
    def cached_prompt_versions(self) -> frozenset[str]:
        """The prompt versions whose results the result cache keeps and serves:
        `RUBRIC_VERSION`, or unset, those this build's scorers make (`PROMPT_VERSIONS`; the
        cache key names the model, so one provider's results never answer for another's).
        Unset, any was served: after a deploy that changed the prompt, the old prompt's
        scores answered identical texts for `RESULT_CACHE_TTL_S` (a review). Not the version
        of this service's `LLM_PROVIDER` alone: only the scorer knows its provider for
        certain, and this filter is no place to judge it (the cache key's model is)."""
        if self.rubric_version is not None:
            return frozenset({self.rubric_version})
        return PROMPT_VERSIONS

    @property
    def default_model(self) -> str:
        """The model that scores a submission naming none (as the scorer's settings say)."""
        if self.llm_provider.strip() == "heuristic":
            return HEURISTIC_PROMPT_VERSION  # the offline scorer's name for itself
        return self.llm_model.strip() or DEFAULT_LLM_MODEL
