"""The public request and response bodies of the gateway's HTTP API."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

import orjson
from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_validator,
)

from shared import contracts
from shared.text import is_blank
from shared.webhook_urls import MAX_URL_LENGTH, validate_webhook_url

MAX_METADATA_BYTES = 8_192
MAX_METADATA_DEPTH = 16  # MongoDB refuses documents nested more than 100 levels deep
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_DELAY_S = 7 * 24 * 3600
# Why a text with nothing to score is refused (`shared.text.is_blank`); the scorer would only
# fail its task.
BLANK_TEXT = (
    "text must contain something other than whitespace, control characters and invisible "
    "characters (format characters such as U+200B, fillers such as U+3164, variation "
    "selectors, combining marks alone)"
)
# The status of a task the status service no longer holds (finished, then expired).
EXPIRED = "expired"
# A model's name as the provider takes it: surrounding blanks dropped, something left, no
# control character. A blank name, or one holding a NUL, was accepted (202) and sent to the
# provider as it stood, a model no provider has, and the task could only fail.
# The validation context's models a submission may name (`LLM_ALLOWED_MODELS` and `LLM_MODEL`;
# absent: any).
ALLOWED_MODELS_CONTEXT = "allowed_models"
# The validation context's time a `not_before` is judged by: the gateway's clock, the one
# it makes the task due by (absent: this host's).
NOW_CONTEXT = "now"


def _offered(model: str, info: ValidationInfo) -> str:
    """`model` when the gateway offers it: any, unless `LLM_ALLOWED_MODELS` lists them. A
    name the provider does not serve was accepted and failed on its call, or, on the offline
    scorer, scored and billed as unpriced (`../../etc`, a walkthrough)."""
    allowed = (info.context or {}).get(ALLOWED_MODELS_CONTEXT)
    if allowed and model not in allowed:
        raise ValueError(f"model {model!r} is not offered; choose one of {', '.join(allowed)}")
    return model


ModelName = Annotated[
    str,
    StringConstraints(
        strip_whitespace=True, min_length=1, max_length=200, pattern=r"^[^\x00-\x1f\x7f]+$"
    ),
    AfterValidator(_offered),
]


# A rubric as sent (the request's hash, which a replay of its key must match, covers it as
# sent: made of the normalised one, a key used before that normalisation conflicted with
# its own replay; a review).
Rubric = Annotated[str | None, Field(max_length=4_000)]


def named_rubric(rubric: str | None) -> str | None:
    """The rubric a request names: none for a blank one (`shared.text.is_blank`, as a text
    is), as the scorer reads it. Kept as sent, the task showed `"   "` for a rubric (a
    walkthrough), and its result-cache key differed from none's."""
    return None if rubric is None or is_blank(rubric) else rubric


def checked_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    """Client metadata as the database can keep it: no operator-like keys, integers within
    64 bits (JSON allows more, BSON does not), nested at most `MAX_METADATA_DEPTH` levels,
    at most `MAX_METADATA_BYTES` as JSON.

    The JSON parser reads an integer literal past 64 bits as a float (2**70 + 1 arrives as
    1.1805916207174113e+21), so a float of magnitude 2**63 or more (every one of which is
    integral) is refused as that integer would be: it is no longer the client's value and
    would not round-trip. Parsed, a float literal (1.5e20) cannot be told from such an
    integer, so it is refused too (BSON would keep it), with words for both: a client sends
    either as a string. It was told "integers must fit in 64 bits", about a float (found in
    a walkthrough)."""
    _check_metadata_values(metadata)
    if len(orjson.dumps(metadata)) > MAX_METADATA_BYTES:
        raise ValueError(f"metadata must serialise to at most {MAX_METADATA_BYTES} bytes")
    return metadata


def _check_metadata_values(value: Any, path: str = "", depth: int = 1) -> None:
    """Refuse what the database cannot keep; `path` is where within the metadata (pydantic
    names the field itself: "metadata: metadata: key ..." read twice)."""
    at = f"at {path}: " if path else ""
    if isinstance(value, dict | list) and depth > MAX_METADATA_DEPTH:
        raise ValueError(f"{at}metadata may nest at most {MAX_METADATA_DEPTH} levels deep")
    if isinstance(value, dict):
        for key, item in value.items():
            if key.startswith("$") or "." in key or "\x00" in key:
                raise ValueError(
                    f"{at}key {key!r} may not start with '$' nor contain '.' or a NUL character"
                )
            _check_metadata_values(item, f"{path}.{key}" if path else key, depth + 1)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_metadata_values(item, f"{path}[{index}]", depth + 1)
    elif isinstance(value, float) and abs(value) >= FLOAT_REFUSED_FROM:
        raise ValueError(
            f"{at}numbers of magnitude 2^63 or more must be sent as strings: an integer that "
            "large does not fit in 64 bits and the JSON parser reads it as a float, so no "
            "float that large is taken either"
        )
    elif isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(
            f"{at}integers must fit in 64 bits (signed); send a larger one as a string"
        )


# Every float this large is integral: it may be an integer literal past 64 bits, parsed.
FLOAT_REFUSED_FROM = 2.0**63


class ScoreSubmission(BaseModel):
    """`POST /v1/scores`: a text to score."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "text": "Queues turn a slow synchronous call into a task the client polls.",
                    "rubric": "clarity and argument",
                    "metadata": {"source": "docs"},
                }
            ]
        },
    )

    text: str = Field(
        description="The text to score: more than whitespace and control characters (see "
        "MAX_TEXT_CHARS)."
    )
    rubric: Rubric = None
    model: ModelName | None = None
    metadata: dict[str, Any] = Field(default_factory=dict, description="Kept with the task.")
    # Strict: JSON `true` was read as a one-second delay and "30" as 30.
    delay_seconds: StrictInt | None = Field(default=None, ge=0, le=MAX_DELAY_S)
    not_before: AwareDatetime | None = Field(default=None, description="Do not score before.")
    # Strict: "no" and 0 were read as false.
    use_cache: StrictBool = Field(
        default=True,
        description="Answer at once from an earlier identical result (same normalised text, "
        "rubric and model) when there is one; false always scores anew.",
    )

    callback_url: str | None = Field(
        default=None,
        max_length=MAX_URL_LENGTH,
        description="An https URL that receives the outcome (`task.completed` or "
        "`task.failed`) as a signed Standard Webhooks POST; private addresses are refused.",
        examples=["https://example.com/hooks/scorebox"],
    )

    @field_validator("callback_url")
    @classmethod
    def _callback_url_safe(cls, url: str | None) -> str | None:
        return None if url is None else validate_webhook_url(url)

    @field_validator("not_before", mode="before")
    @classmethod
    def _not_before_not_a_number(cls, when: Any) -> Any:
        """A number was read as a Unix time: `30` meant to wait was 1970, due at once."""
        if isinstance(when, int | float):
            message = "not_before must be an RFC 3339 date-time string with an offset"
            raise ValueError(message)  # noqa: TRY004 - becomes a ValidationError
        return when

    @field_validator("not_before")
    @classmethod
    def _not_before_in_range(cls, when: datetime | None, info: ValidationInfo) -> datetime | None:
        if when is None:
            return None
        try:
            in_utc = when.astimezone(UTC)
        except OverflowError:
            raise ValueError("not_before is outside the range of dates (in UTC)") from None
        now = (info.context or {}).get(NOW_CONTEXT) or datetime.now(UTC)
        if in_utc > now + timedelta(seconds=MAX_DELAY_S):
            raise ValueError(f"not_before may lie at most {MAX_DELAY_S} seconds (7 days) ahead")
        return in_utc

    @field_validator("text")
    @classmethod
    def _text_not_blank(cls, text: str) -> str:
        if is_blank(text):
            raise ValueError(BLANK_TEXT)
        return text

    @field_validator("metadata")
    @classmethod
    def _metadata_safe(cls, metadata: dict[str, Any]) -> dict[str, Any]:
        return checked_metadata(metadata)

    @model_validator(mode="after")
    def _one_delay(self) -> ScoreSubmission:
        if self.delay_seconds is not None and self.not_before is not None:
            raise ValueError("give either delay_seconds or not_before, not both")
        return self

    def due_at(self, now: datetime) -> datetime | None:
        if self.delay_seconds:
            return now + timedelta(seconds=self.delay_seconds)
        return self.not_before


class SubmissionAccepted(BaseModel):
    """`202 Accepted`: the task id and where to poll."""

    task_id: str
    status: str = Field(
        examples=["queued"],
        description="`queued` or `scheduled`; for a repeated Idempotency-Key, the task's status "
        "now, or `expired` once the status service no longer holds the finished task.",
    )
    status_url: str = Field(examples=["/v1/scores/6f1c0c0b3b0b4d8a9f7e1f3f0a9d2c11"])


class CancelRequested(BaseModel):
    """`202 Accepted`: the cancellation was sent; poll the task for its outcome."""

    task_id: str
    status: Literal["cancelling"] = Field(
        default="cancelling",
        description="The task fails with `error.code` `cancelled` unless its model call had "
        "started, in which case it ends as that call decides.",
    )
    status_url: str = Field(examples=["/v1/scores/6f1c0c0b3b0b4d8a9f7e1f3f0a9d2c11"])


class BatchCancelRequested(BaseModel):
    """`202 Accepted`: a cancellation was sent for each item not known to be finished; poll
    the batch for their outcomes."""

    batch_id: str
    cancelling: int = Field(
        description="Items sent a cancellation: each fails with `error.code` `cancelled` "
        "unless its model call had started, in which case it ends as that call decides."
    )
    already_finished: int = Field(
        description="Items whose outcome the gateway had applied (or that were answered from "
        "the result cache): left as they are. Items no longer kept count in neither."
    )
    status_url: str = Field(examples=["/v1/batches/0b7f3c1e9d2a4b6f8e1d3c5a7b9f0e2d"])


class TaskView(contracts.TaskView):
    """A task as the API answers it: the status service's view and the task's own URL (the
    body of `GET /v1/scores/{task_id}`, and of a submission answered at once: a result-cache
    hit or a repeated Idempotency-Key)."""

    status_url: str = Field(
        examples=["/v1/scores/6f1c0c0b3b0b4d8a9f7e1f3f0a9d2c11"],
        description="Where to poll this task.",
    )
