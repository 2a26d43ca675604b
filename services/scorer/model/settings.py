"""Settings of the scorer's model layer (environment variables `LLM_*`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

Provider = Literal["heuristic", "openai"]
JsonMode = Literal["json_schema", "json_object", "none"]


class ModelSettings(BaseSettings):
    """Which model scores texts and how it is called.

    `LLM_JSON_MODE` picks the `response_format` sent to the provider: `json_schema`
    (OpenAI structured outputs), `json_object`, or `none` for servers that know neither,
    such as older vLLM or llama.cpp builds.
    """

    model_config = SettingsConfigDict(extra="ignore", frozen=True)

    llm_provider: Provider = Field(default="heuristic", validation_alias="LLM_PROVIDER")
    llm_base_url: str = Field(default="https://api.openai.com/v1", validation_alias="LLM_BASE_URL")
    llm_api_key: SecretStr = Field(default=SecretStr(""), validation_alias="LLM_API_KEY")
    llm_model: str = Field(default="gpt-4o-mini", min_length=1, validation_alias="LLM_MODEL")
    llm_timeout_s: float = Field(default=30.0, gt=0, validation_alias="LLM_TIMEOUT_S")
    llm_max_input_chars: int = Field(default=6000, ge=100, validation_alias="LLM_MAX_INPUT_CHARS")
    llm_max_output_tokens: int = Field(default=300, ge=16, validation_alias="LLM_MAX_OUTPUT_TOKENS")
    llm_json_mode: JsonMode = Field(default="json_schema", validation_alias="LLM_JSON_MODE")
