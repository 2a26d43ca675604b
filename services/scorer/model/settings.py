"""Settings of the scorer's model layer (environment variables `LLM_*`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from yarl import URL

from shared.contracts import known_rubric_version, rubric_version_of_provider
from shared.settings import DEFAULT_LLM_MODEL, http_url

Provider = Literal["heuristic", "openai"]
JsonMode = Literal["json_schema", "json_object", "none"]
TokenLimitField = Literal["max_tokens", "max_completion_tokens"]


# A redelivery held while another worker's claim lasts (2 x this + LEASE_MARGIN_S) then makes
# its own call, inside RabbitMQ's consumer timeout (30 min), past which the broker takes back
# every delivery of the channel: at 600 the claim and the call alone took 1,830 s. The whole
# hold, with the other settings, is checked at start (`scorer.app.longest_hold_s`).
MAX_LLM_TIMEOUT_S = 540.0


class ModelSettings(BaseSettings):
    """Which model scores texts and how it is called.

    `LLM_JSON_MODE` picks the `response_format` sent to the provider: `json_schema`
    (OpenAI structured outputs), `json_object`, or `none` for servers that know neither,
    such as older vLLM or llama.cpp builds.
    """

    # `inf` and `nan` refused in every float setting, as in `ServiceSettings`.
    model_config = SettingsConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)

    llm_provider: Provider = Field(default="heuristic", validation_alias="LLM_PROVIDER")
    llm_base_url: str = Field(default="https://api.openai.com/v1", validation_alias="LLM_BASE_URL")
    llm_api_key: SecretStr = Field(default=SecretStr(""), validation_alias="LLM_API_KEY")
    llm_model: str = Field(default=DEFAULT_LLM_MODEL, min_length=1, validation_alias="LLM_MODEL")
    # Bounded (see MAX_LLM_TIMEOUT_S): a held redelivery waits out a claim and then calls;
    # `inf` passed and crashed the scorer.
    llm_timeout_s: float = Field(
        default=30.0, gt=0, le=MAX_LLM_TIMEOUT_S, validation_alias="LLM_TIMEOUT_S"
    )
    llm_max_input_chars: int = Field(default=6000, ge=100, validation_alias="LLM_MAX_INPUT_CHARS")
    llm_max_output_tokens: int = Field(default=300, ge=16, validation_alias="LLM_MAX_OUTPUT_TOKENS")
    llm_json_mode: JsonMode = Field(default="json_schema", validation_alias="LLM_JSON_MODE")
    # The field the output limit is sent as: OpenAI's reasoning models (o1, o3, o4-mini,
    # gpt-5) refuse `max_tokens` with a 400, and every task failed as misconfigured.
    llm_token_limit_field: TokenLimitField = Field(
        default="max_tokens", validation_alias="LLM_TOKEN_LIMIT_FIELD"
    )
    # Sent as `temperature` unless blank: those models refuse any but their default.
    llm_temperature: float | None = Field(
        default=0.0, ge=0, le=2, validation_alias="LLM_TEMPERATURE"
    )
    # The current rubric version (the gateway's and the scheduler's setting): checked against
    # the version this provider's results carry.
    rubric_version: str | None = Field(default=None, validation_alias="RUBRIC_VERSION")

    @model_validator(mode="after")
    def _an_http_url_to_call(self) -> ModelSettings:
        """For a provider called over HTTP, an http(s) URL with a host: found wrong at
        start-up rather than at every task (one without a scheme was retried as an
        unreachable provider; one that is no URL crashed the attempt). Credentials in it
        (basic auth to a proxy in front of the model) and `LLM_API_KEY` both: aiohttp
        refuses to send two, and every attempt crashed (a review)."""
        if self.llm_provider != "openai":
            return self
        try:
            http_url(self.llm_base_url)
        except ValueError as error:
            raise ValueError(f"LLM_BASE_URL: {error}") from None
        if URL(self.llm_base_url).user is not None and self.llm_api_key.get_secret_value():
            raise ValueError(
                "LLM_BASE_URL carries credentials (user:password@) and LLM_API_KEY is set: "
                "both would be the Authorization header; keep one"
            )
        return self

    @field_validator("rubric_version")
    @classmethod
    def _a_prompt_version(cls, value: str | None) -> str | None:
        return known_rubric_version(value)

    @model_validator(mode="after")
    def _a_rubric_version_this_provider_scores_under(self) -> ModelSettings:
        """`RUBRIC_VERSION` (the gateway's and the scheduler's setting, which a deployment
        passes every service) names results this scorer never makes: refused here, where
        the provider is known for certain."""
        rubric_version_of_provider(self.rubric_version, self.llm_provider)
        return self

    @field_validator("llm_temperature", mode="before")
    @classmethod
    def _blank_sends_none(cls, temperature: object) -> object:
        if isinstance(temperature, str) and not temperature.strip():
            return None
        return temperature

    @field_validator("llm_model", mode="before")
    @classmethod
    def _model_as_the_gateway_reads_it(cls, model: object) -> object:
        """Without surrounding whitespace, blank taken as the default, as the gateway reads
        `LLM_MODEL` for its result-cache key: the name the scorer asks for is compared with
        the key's (`task.completed`'s `requested_model`), and a stray newline from an env
        file made every completion a mismatch, never cached."""
        if isinstance(model, str):
            return model.strip() or DEFAULT_LLM_MODEL
        return model

    @field_validator("llm_api_key")
    @classmethod
    def _usable_in_a_header(cls, key: SecretStr) -> SecretStr:
        """Without the surrounding whitespace a secret file often ends with (`echo key >`);
        a key with a control character inside cannot be sent in a header at all."""
        value = key.get_secret_value().strip()
        if any(ord(character) < 0x20 or ord(character) == 0x7F for character in value):
            raise ValueError("LLM_API_KEY contains a control character")
        return SecretStr(value)
