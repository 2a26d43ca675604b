"""Every message that crosses a service line, as versioned, frozen pydantic models.

Commands are imperative (`ScoreText`), events past tense (`TaskAccepted`, `TaskScored`...).
All are JSON on the wire and carry `message_id`, `correlation_id` (= the task id),
`tenant_id`, `schema_version` and an attempt counter. Consumers ignore unknown fields
(tolerant reader), so changes within a schema version are additive only.

Ordering: task events carry a `sequence` built by `event_sequence`; a projection applies an
event only when its sequence is higher than what it holds, which makes duplicate and
out-of-order deliveries harmless.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from enum import IntEnum, StrEnum
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, computed_field

SCHEMA_VERSION = 1
DEFAULT_TENANT = "default"


def new_id() -> str:
    """A random, URL-safe identifier (UUID4 hex)."""
    return uuid.uuid4().hex


def utcnow() -> datetime:
    return datetime.now(UTC)


class TaskStatus(StrEnum):
    SCHEDULED = "scheduled"
    QUEUED = "queued"
    PROCESSING = "processing"
    RETRYING = "retrying"
    COMPLETED = "completed"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self in (TaskStatus.COMPLETED, TaskStatus.FAILED)


class Phase(IntEnum):
    """Where in one attempt an event happened; orders events within an attempt."""

    ACCEPTED = 0
    STARTED = 10
    RETRYING = 20
    TERMINAL = 90


_ATTEMPT_SPAN = 100
_GENERATION_SPAN = 1_000_000


def event_sequence(*, generation: int, attempt: int, phase: Phase) -> int:
    """Total order of a task's events: generation (DLQ replays), then attempt, then phase."""
    return generation * _GENERATION_SPAN + attempt * _ATTEMPT_SPAN + int(phase)


class Contract(BaseModel):
    """Base of every message: frozen, tolerant of unknown fields."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    message_id: str = Field(default_factory=new_id, description="Unique per message.")
    task_id: str = Field(description="The task this message is about.", examples=[new_id()])
    tenant_id: str = Field(default=DEFAULT_TENANT, description="Owner of the task.")
    schema_version: int = Field(default=SCHEMA_VERSION, description="Contract version.")
    occurred_at: datetime = Field(default_factory=utcnow)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def correlation_id(self) -> str:
        """Correlates every message of one task: it is the task id."""
        return self.task_id


Score = Annotated[float, Field(ge=0, le=10, description="0 (worst) to 10 (best).")]


class Usage(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    prompt_tokens: int = Field(default=0, ge=0)
    completion_tokens: int = Field(default=0, ge=0)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class ScoreResult(BaseModel):
    """What a completed task answers."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    score: Score
    comment: str = Field(description="A short justification of the score.")
    model: str = Field(description="The model (or provider) that scored the text.")
    usage: Usage = Field(default_factory=Usage)
    latency_ms: float = Field(default=0.0, ge=0, description="Model call time.")
    flags: list[str] = Field(
        default_factory=list,
        description="Warnings about the result, e.g. `instruction_in_text`.",
        examples=[["instruction_in_text"]],
    )
    cached: bool = Field(default=False, description="Served from the result cache.")
    prompt_version: str | None = Field(
        default=None, description="Version of the judge prompt/rubric that produced the score."
    )


class TaskError(BaseModel):
    """Why an attempt or a task failed."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    code: str = Field(examples=["model_timeout", "model_rate_limited", "unusable_output"])
    message: str
    retryable: bool


class ScoreText(Contract):
    """Command: score this text. Routed as `score.requested` to the scorer."""

    routing_key: ClassVar[str] = "score.requested"

    text: str = Field(min_length=1)
    rubric: str | None = None
    model: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    attempt: int = Field(default=1, ge=1, description="1-based attempt this delivery is.")
    max_attempts: int = Field(default=4, ge=1)
    generation: int = Field(default=0, ge=0, description="Bumped by each DLQ replay.")
    not_before: datetime | None = Field(default=None, description="Do not start before.")
    submitted_at: datetime = Field(default_factory=utcnow)
    api_key_id: str | None = Field(default=None, description="The API key that submitted it.")
    batch_id: str | None = Field(default=None, description="The batch it belongs to, if any.")
    callback_url: str | None = Field(default=None, description="Webhook for the outcome.")


class TaskEvent(Contract):
    """Base of the task lifecycle events on `scorebox.events` (routing key `task.<kind>`)."""

    routing_key: ClassVar[str] = "task.event"
    status: ClassVar[TaskStatus]

    sequence: int = Field(ge=0, description="Projection applies only newer sequences.")
    attempt: int = Field(default=0, ge=0)
    generation: int = Field(default=0, ge=0)
    submitted_at: datetime
    api_key_id: str | None = Field(default=None, description="The API key that submitted it.")


class TaskAccepted(TaskEvent):
    """The gateway accepted a submission (status `queued`, or `scheduled` when delayed)."""

    routing_key: ClassVar[str] = "task.accepted"
    status: ClassVar[TaskStatus] = TaskStatus.QUEUED

    rubric: str | None = None
    model: str | None = None
    not_before: datetime | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    batch_id: str | None = None
    callback_url: str | None = None


class TaskStarted(TaskEvent):
    routing_key: ClassVar[str] = "task.started"
    status: ClassVar[TaskStatus] = TaskStatus.PROCESSING


class TaskRetrying(TaskEvent):
    routing_key: ClassVar[str] = "task.retrying"
    status: ClassVar[TaskStatus] = TaskStatus.RETRYING

    error: TaskError
    next_attempt_at: datetime


class TaskCompleted(TaskEvent):
    routing_key: ClassVar[str] = "task.completed"
    status: ClassVar[TaskStatus] = TaskStatus.COMPLETED

    result: ScoreResult


class TaskFailed(TaskEvent):
    routing_key: ClassVar[str] = "task.failed"
    status: ClassVar[TaskStatus] = TaskStatus.FAILED

    error: TaskError
    dead_lettered: bool = Field(description="The command was moved to the dead-letter queue.")


TASK_EVENT_TYPES: dict[str, type[TaskEvent]] = {
    cls.routing_key: cls
    for cls in (TaskAccepted, TaskStarted, TaskRetrying, TaskCompleted, TaskFailed)
}


def parse_task_event(routing_key: str, body: bytes) -> TaskEvent:
    """Decode a task event by its routing key; raises `KeyError` or `ValidationError`."""
    return TASK_EVENT_TYPES[routing_key].model_validate_json(body)


class TaskFailure(TaskError):
    """A task's terminal or latest error, as a poll shows it."""

    dead_lettered: bool = False


class TaskView(BaseModel):
    """What a poll answers (`GET /v1/scores/{task_id}`); served by the status service."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    task_id: str
    status: TaskStatus
    attempts: int = Field(ge=0, description="Attempts started so far.")
    created_at: datetime
    updated_at: datetime
    result: ScoreResult | None = None
    error: TaskFailure | None = None
    next_attempt_at: datetime | None = Field(
        default=None, description="When a retrying task's next attempt is due."
    )
    not_before: datetime | None = Field(default=None, description="A scheduled task's start.")
    rubric: str | None = None
    model: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
