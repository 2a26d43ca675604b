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
from typing import Annotated, Any, ClassVar, Final

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    WithJsonSchema,
    computed_field,
)

# 2: outcomes carry `has_callback` and `callback_url`, and their publishers mark those with a
# callback for the notifier (`shared.topology.CALLBACK_HEADER`). Version 1 messages still parse.
SCHEMA_VERSION = 2
DEFAULT_TENANT = "default"


def new_id() -> str:
    """A random, URL-safe identifier (UUID4 hex)."""
    return uuid.uuid4().hex


def utcnow() -> datetime:
    return datetime.now(UTC)


def to_millis(instant: datetime) -> datetime:
    """`instant` in UTC at MongoDB's precision (milliseconds), so stored and sent times match."""
    instant = instant.astimezone(UTC)
    return instant.replace(microsecond=instant.microsecond // 1000 * 1000)


# Any time up to here plus the longest retention (ten years, `MAX_DURATION_S`) stays inside
# `datetime`'s range.
MAX_YEAR: Final = 9000


def _utc_instant(value: datetime) -> datetime:
    """A message's time: one without an offset is taken as UTC (compared with the aware
    times of a consumer, it raised `TypeError` and held its delivery), and one past
    `MAX_YEAR` is refused (a retention added to it overflowed `datetime` alike)."""
    if value.year > MAX_YEAR:
        raise ValueError(f"a time after the year {MAX_YEAR}")
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def rfc3339(instant: datetime) -> str:
    """An instant as every answer and message writes it (RFC 3339): UTC, to the microsecond,
    with `Z`. Left to pydantic, a whole second lost its fraction (cron times), and the keys'
    and webhooks' `isoformat()` wrote `+00:00`: three shapes of one thing in one API."""
    utc = _utc_instant(instant).astimezone(UTC).replace(tzinfo=None)
    return f"{utc.isoformat(timespec='microseconds')}Z"


Instant = Annotated[
    datetime,
    AfterValidator(_utc_instant),
    PlainSerializer(rfc3339, when_used="json"),
    WithJsonSchema({"type": "string", "format": "date-time"}, mode="serialization"),
]


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
    WITHDRAWN = 5  # the command was refused (`ScoreWithdrawn`): above its acceptance only
    STARTED = 10
    RETRYING = 20
    TERMINAL = 90


_ATTEMPT_SPAN = 100
_GENERATION_SPAN = 1_000_000
# What a BSON int64 holds: a larger integer passed validation and then failed every write of
# it (`bson.errors.InvalidDocument`, no `PyMongoError`), holding its delivery. Every integer
# of a contract is bounded by it or by less (`tests/unit/test_contracts.py` checks).
MAX_INT64: Final = 2**63 - 1
MAX_SEQUENCE: Final = MAX_INT64
MAX_GENERATION: Final = MAX_SEQUENCE // _GENERATION_SPAN - 1
# An attempt past it would number its events as the next generation's.
MAX_ATTEMPT: Final = _GENERATION_SPAN // _ATTEMPT_SPAN - 1
# A command's own budgets, far above any setting's: their sum plus one stays a valid attempt,
# so a retry the scorer builds is never refused by its contract.
MAX_ATTEMPT_BUDGET: Final = 1000
# A task's tokens: room for thousands of calls of the most a scorer reads of one call
# (`services.scorer.model.openai`), with a total and a usage rollup's sums inside int64.
MAX_TOKENS: Final = 2**48


def event_sequence(*, generation: int, attempt: int, phase: Phase) -> int:
    """Total order of a task's events: generation (DLQ replays), then attempt, then phase."""
    return generation * _GENERATION_SPAN + attempt * _ATTEMPT_SPAN + int(phase)


def generation_of(sequence: int) -> int:
    """The generation of the event `sequence` numbers (`event_sequence`)."""
    return sequence // _GENERATION_SPAN


def cached_completion_sequence(generation: int) -> int:
    """The completion of a generation answered from the result cache (generation 0: a
    submission; above: a re-score): no attempt ran (a scoring attempt of that generation,
    should its command be sent after all, supersedes it)."""
    return event_sequence(generation=generation, attempt=0, phase=Phase.TERMINAL)


# A submission's result-cache hit.
CACHED_COMPLETION_SEQUENCE: Final = cached_completion_sequence(0)


class Contract(BaseModel):
    """Base of every message: frozen, tolerant of unknown fields. Every contract refuses a
    float that is not a number (`allow_inf_nan`: `Infinity` passed `ge=0` and left a
    reader's JSON answer unserialisable)."""

    model_config = ConfigDict(frozen=True, extra="ignore", allow_inf_nan=False)

    message_id: str = Field(default_factory=new_id, description="Unique per message.")
    task_id: str = Field(
        description="The task this message is about.", examples=["9f0c2b6e4d1a4c8e8b7a6f5e4d3c2b1a"]
    )
    tenant_id: str = Field(default=DEFAULT_TENANT, description="Owner of the task.")
    schema_version: int = Field(
        default=SCHEMA_VERSION, ge=0, le=MAX_INT64, description="Contract version."
    )
    occurred_at: Instant = Field(default_factory=utcnow)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def correlation_id(self) -> str:
        """Correlates every message of one task: it is the task id."""
        return self.task_id


Score = Annotated[float, Field(ge=0, le=10, description="0 (worst) to 10 (best).")]


# The prompt versions a result can carry (`ScoreResult.prompt_version`): the judge's prompt
# and the offline heuristic scorer. `RUBRIC_VERSION` (gateway, scheduler) must name one of
# them: any other value matched no result, so the result cache served nothing and the
# re-score fan-out scored every task again.
JUDGE_PROMPT_VERSION: Final = "judge-2025-1"
HEURISTIC_PROMPT_VERSION: Final = "heuristic-v1"
PROMPT_VERSIONS: Final = frozenset({JUDGE_PROMPT_VERSION, HEURISTIC_PROMPT_VERSION})


# The prompt version each scorer provider's results carry (`LLM_PROVIDER`).
PROVIDER_PROMPT_VERSIONS: Final = {
    "heuristic": HEURISTIC_PROMPT_VERSION,
    "openai": JUDGE_PROMPT_VERSION,
}


def rubric_version_of_provider(rubric_version: str | None, provider: str | None) -> None:
    """Refuse a `RUBRIC_VERSION` that the scorer's `LLM_PROVIDER` (when known) never
    produces: every result of it was stale, so the result cache served nothing and each
    run of the re-score fan-out called the model again for every task, billed, whose new
    result was stale again (a walkthrough: `heuristic-v1` with `openai`)."""
    if rubric_version is None or provider is None:
        return
    produced = PROVIDER_PROMPT_VERSIONS.get(provider.strip())
    if produced is not None and produced != rubric_version:
        raise ValueError(
            f"RUBRIC_VERSION={rubric_version} is not what LLM_PROVIDER={provider.strip()} "
            f"scores under ({produced}): no result would ever be current; set "
            f"RUBRIC_VERSION={produced}, or leave it unset"
        )


def known_rubric_version(value: str | None) -> str | None:
    """`RUBRIC_VERSION` as a setting: unset (or blank) is None; else one of `PROMPT_VERSIONS`."""
    if value is None or not value.strip():
        return None
    if value.strip() not in PROMPT_VERSIONS:
        raise ValueError(
            f"{value!r} is no prompt version results carry; use one of "
            f"{', '.join(sorted(PROMPT_VERSIONS))}"
        )
    return value.strip()


class Usage(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore", allow_inf_nan=False)

    prompt_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS)
    completion_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class ScoreResult(BaseModel):
    """What a completed task answers."""

    model_config = ConfigDict(frozen=True, extra="ignore", allow_inf_nan=False)

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

    model_config = ConfigDict(frozen=True, extra="ignore", allow_inf_nan=False)

    code: str = Field(examples=["model_timeout", "model_rate_limited", "unusable_output"])
    message: str
    retryable: bool


class ScoreText(Contract):
    """Command: score this text. Routed as `score.requested` to the scorer (and, when sent
    now, to the status projection, which learns the task from it)."""

    routing_key: ClassVar[str] = "score.requested"
    # A task sent again (re-score, DLQ replay): to the scorer, not the status projection.
    resubmission_routing_key: ClassVar[str] = "score.resubmitted"

    text: str = Field(min_length=1)
    rubric: str | None = None
    model: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    attempt: int = Field(
        default=1, ge=1, le=MAX_ATTEMPT, description="1-based attempt this delivery is."
    )
    max_attempts: int = Field(default=4, ge=1, le=MAX_ATTEMPT_BUDGET)
    rate_limited_retries: int = Field(
        default=0,
        ge=0,
        le=MAX_ATTEMPT_BUDGET,
        description="Attempts the model provider's rate limit ended, which do not count "
        "against max_attempts (up to the scorer's RATE_LIMIT_RETRIES).",
    )
    generation: int = Field(
        default=0, ge=0, le=MAX_GENERATION, description="Bumped by each DLQ replay."
    )
    not_before: Instant | None = Field(default=None, description="Do not start before.")
    submitted_at: Instant = Field(default_factory=utcnow)
    api_key_id: str | None = Field(default=None, description="The API key that submitted it.")
    batch_id: str | None = Field(default=None, description="The batch it belongs to, if any.")
    callback_url: str | None = Field(default=None, description="Webhook for the outcome.")
    batch_index: int | None = Field(
        default=None,
        ge=0,
        le=MAX_INT64,
        description="Position in its batch (request order), if any.",
    )


class TaskEvent(Contract):
    """Base of the task lifecycle events on `scorebox.events` (routing key `task.<kind>`)."""

    routing_key: ClassVar[str] = "task.event"
    status: ClassVar[TaskStatus]

    sequence: int = Field(
        ge=0, le=MAX_SEQUENCE, description="Projection applies only newer sequences."
    )
    attempt: int = Field(default=0, ge=0, le=MAX_ATTEMPT)
    generation: int = Field(default=0, ge=0, le=MAX_GENERATION)
    submitted_at: Instant
    api_key_id: str | None = Field(default=None, description="The API key that submitted it.")


class TaskAccepted(TaskEvent):
    """The gateway accepted a submission whose command waits on the ladder (status
    `scheduled`). A command sent now is not announced: the status projection reads the same
    acceptance (status `queued`) from its own copy of the command (`accepted_event`)."""

    routing_key: ClassVar[str] = "task.accepted"
    status: ClassVar[TaskStatus] = TaskStatus.QUEUED

    rubric: str | None = None
    model: str | None = None
    not_before: Instant | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    batch_id: str | None = None
    callback_url: str | None = None
    batch_index: int | None = Field(
        default=None, ge=0, le=MAX_INT64, description="Position in its batch."
    )


class TaskStarted(TaskEvent):
    """An attempt has been running for the scorer's `SCORER_STARTED_AFTER_S` (status
    `processing`). An attempt that ends sooner publishes only its outcome. Best effort: the
    outcome supersedes it."""

    routing_key: ClassVar[str] = "task.started"
    status: ClassVar[TaskStatus] = TaskStatus.PROCESSING


class TaskRetrying(TaskEvent):
    """An attempt failed and the next is due at `next_attempt_at` (status `retrying`). Told
    again, under the same sequence and with a later `next_attempt_at`, when a pause of the
    scorer's model calls (a provider's rate limit or outage) puts that next attempt off past
    it: a reader keeps the latest time for the state it holds, never an earlier one."""

    routing_key: ClassVar[str] = "task.retrying"
    status: ClassVar[TaskStatus] = TaskStatus.RETRYING

    error: TaskError
    next_attempt_at: Instant


HAS_CALLBACK_DESCRIPTION = (
    "Whether the task was submitted with a `callback_url` (then carried in `callback_url`); "
    "null when the producer did not say (the notifier then looks the task up)."
)
CALLBACK_URL_DESCRIPTION = "The task's webhook for its outcome, when it has one."


class TaskCompleted(TaskEvent):
    """A task's result. Completions without a callback that finish together may travel in
    one message: its body the JSON array of their bodies, its header `x-scorebox-batch`
    listing `[length, message_id, task_id, tenant_id]` for each (`shared.event_batches`);
    a consumer takes each as a message of its own."""

    routing_key: ClassVar[str] = "task.completed"
    status: ClassVar[TaskStatus] = TaskStatus.COMPLETED

    result: ScoreResult
    has_callback: bool | None = Field(default=None, description=HAS_CALLBACK_DESCRIPTION)
    callback_url: str | None = Field(default=None, description=CALLBACK_URL_DESCRIPTION)
    requested_model: str | None = Field(
        default=None,
        description=(
            "The model the scorer asked for: the command's `model` or its `LLM_MODEL` (the "
            "offline heuristic: its own name, whatever the command named), as the gateway's "
            "result-cache key names it; not the provider's answer (`result.model`, often "
            "dated). Null from scorers that predate it, and for results served from the cache."
        ),
        examples=["gpt-4o-mini"],
    )


class TaskFailed(TaskEvent):
    """A task's end without a result: its error (cancelled, attempts spent, unusable input),
    whether its command was dead-lettered, and the tokens its calls used."""

    routing_key: ClassVar[str] = "task.failed"
    status: ClassVar[TaskStatus] = TaskStatus.FAILED

    error: TaskError
    dead_lettered: bool = Field(description="The command was moved to the dead-letter queue.")
    # What the failed attempt's model calls used when answers came back (an answer still
    # unusable after its repair): metered like a completion's. Zero when none did.
    usage: Usage = Field(default_factory=Usage)
    model: str | None = Field(default=None, description="The model that answered, if any.")
    has_callback: bool | None = Field(default=None, description=HAS_CALLBACK_DESCRIPTION)
    callback_url: str | None = Field(default=None, description=CALLBACK_URL_DESCRIPTION)


TASK_EVENT_TYPES: dict[str, type[TaskEvent]] = {
    cls.routing_key: cls
    for cls in (TaskAccepted, TaskStarted, TaskRetrying, TaskCompleted, TaskFailed)
}


def parse_task_event(routing_key: str, body: bytes) -> TaskEvent:
    """Decode a task event by its routing key; raises `KeyError` or `ValidationError`."""
    return TASK_EVENT_TYPES[routing_key].model_validate_json(body)


def accepted_event(command: ScoreText) -> TaskAccepted:
    """What a command tells of its task's acceptance: queued (or scheduled, while its
    `not_before` lies ahead) at the command's `occurred_at`."""
    return TaskAccepted(
        task_id=command.task_id,
        tenant_id=command.tenant_id,
        sequence=event_sequence(generation=command.generation, attempt=0, phase=Phase.ACCEPTED),
        generation=command.generation,
        submitted_at=command.submitted_at,
        occurred_at=command.occurred_at,
        rubric=command.rubric,
        model=command.model,
        not_before=command.not_before,
        metadata=command.metadata,
        api_key_id=command.api_key_id,
        batch_id=command.batch_id,
        callback_url=command.callback_url,
        batch_index=command.batch_index,
    )


class TaskFailure(TaskError):
    """A task's terminal or latest error, as a poll shows it."""

    dead_lettered: bool = False


class TaskView(BaseModel):
    """What a poll answers (`GET /v1/scores/{task_id}`); served by the status service."""

    model_config = ConfigDict(frozen=True, extra="ignore", allow_inf_nan=False)

    task_id: str
    status: TaskStatus
    attempts: int = Field(
        ge=0,
        le=MAX_INT64,
        description="The attempt the task is at (1 for the first), not a count of model calls: "
        "a call made again after its scorer died stays in its attempt, and a cancellation is "
        "decided as the next attempt.",
    )
    created_at: Instant
    updated_at: Instant
    result: ScoreResult | None = None
    error: TaskFailure | None = None
    next_attempt_at: Instant | None = Field(
        default=None, description="When a retrying task's next attempt is due."
    )
    not_before: Instant | None = Field(default=None, description="A scheduled task's start.")
    rubric: str | None = None
    model: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    sequence: int | None = Field(
        default=None,
        ge=0,
        le=MAX_SEQUENCE,
        description="Sequence of the latest state change applied (the id of its "
        "Server-Sent Event); None until the status service has heard of the task.",
    )


# --- Scheduler: cron runs, re-score requests, operations events -------------------------------
#
# A cron run is the unit these messages correlate on: their `task_id` is the run id (or, for
# `RescoreTask`, the task to re-score), so `correlation_id` keeps meaning "the thing this is
# about" across every contract.


class RunCronJob(Contract):
    """Command: run one firing of a cron job (`scorebox.cron`, routing key `cron.run`).

    Sent by the scheduler's dispatcher for a claimed firing (or a manual trigger), consumed by
    the scheduler's job consumer. `task_id` is the run id (`run_id` on the wire as well). A
    long job continues itself in a new message with the same run id and the next `slice`.
    """

    routing_key: ClassVar[str] = "cron.run"

    job: str = Field(description="Name of the cron job.", examples=["usage-rollup"])
    scheduled_for: Instant = Field(description="The fire time (UTC); trigger time if manual.")
    fired_at: Instant = Field(description="When the scheduler claimed the firing.")
    manual: bool = Field(default=False, description="Triggered by hand, not by the clock.")
    attempt: int = Field(
        default=1, ge=1, le=MAX_INT64, description="1-based attempt of this slice."
    )
    slice: int = Field(
        default=0, ge=0, le=MAX_INT64, description="Continuation number of a long run."
    )
    step: int | None = Field(
        default=None,
        ge=0,
        le=MAX_INT64,
        description="The run's step this message carries out: 0 for the firing, one more for "
        "each next slice or retry. Copies of a step the run has passed are dropped. None: "
        "sent by a scheduler that numbered no steps.",
    )
    not_before: Instant | None = Field(default=None, description="Do not start before.")

    @computed_field  # type: ignore[prop-decorator]
    @property
    def run_id(self) -> str:
        """The firing this run belongs to: the task id of cron messages."""
        return self.task_id


class ScoreWithdrawn(Contract):
    """Command: forget this task, whose `score.requested` the broker refused (the client was
    answered 503). Sent by the gateway to the status projection only, which may hold a copy
    of the command all the same: the broker routes one publish to two queues and refuses it
    when one of them (a full score queue) does not take it."""

    routing_key: ClassVar[str] = "score.withdrawn"

    @property
    def sequence(self) -> int:
        """Above the refused command's acceptance, below anything a scoring attempt sends."""
        return event_sequence(generation=0, attempt=0, phase=Phase.WITHDRAWN)


# The error code of a task its client cancelled before its model call (`CancelTask`).
CANCELLED_CODE: Final = "cancelled"


class CancelTask(Contract):
    """Command: cancel this generation of the task unless its model call has started
    (`scorebox.tasks`, routing key `score.cancel`). Sent by the gateway for the task's client;
    consumed by the scorer, which records the generation as failed with `cancelled` and
    publishes that `task.failed` (whose other fields this command carries)."""

    routing_key: ClassVar[str] = "score.cancel"

    generation: int = Field(
        ge=0, le=MAX_GENERATION, description="The generation to cancel (the task's latest)."
    )
    submitted_at: Instant
    api_key_id: str | None = Field(default=None, description="The API key that submitted it.")
    callback_url: str | None = Field(default=None, description="Webhook for the outcome.")
    requested_at: Instant = Field(default_factory=utcnow, description="When it was asked.")
    not_before: Instant | None = Field(
        default=None, description="When the task is due: its cancellation outlives that."
    )


class RescoreTask(Contract):
    """Command: score this completed task again (`scorebox.tasks`, routing key `score.rescore`).

    Sent by the scheduler's re-score fan-out; consumed by the gateway, which owns the texts.
    `message_id` is derived from (task, rubric version, generation), so a consumer can drop
    duplicates of the same request across fan-out runs.
    """

    routing_key: ClassVar[str] = "score.rescore"

    reason: str = Field(
        default="rubric_version_outdated",
        description="Why the task is scored again.",
        examples=["rubric_version_outdated"],
    )
    rubric_version: str = Field(description="The rubric/prompt version to score with now.")
    previous_rubric_version: str | None = Field(
        default=None, description="The version the task was scored with (None: unknown)."
    )
    model: str | None = Field(default=None, description="The model of the last result.")
    run_id: str = Field(description="The fan-out run that requested it.")
    attempt: int = Field(default=1, ge=1, le=MAX_INT64)
    generation: int | None = Field(
        default=None,
        ge=0,
        le=MAX_INT64,
        description="The task's generation the fan-out found completed: the re-score is "
        "taken only while it is the task's latest, so that a version switched back to is "
        "scored again and a stale request is not (None, an earlier scheduler's: once per "
        "version).",
    )
    answered_from_cache: bool = Field(
        default=False,
        description="The task's result came from the result cache: the gateway answers the "
        "re-score from the cache too when the same text was scored under `rubric_version` "
        "since (the fan-out sends these requests after the others); otherwise it is scored.",
    )

    @classmethod
    def for_task(
        cls,
        *,
        task_id: str,
        tenant_id: str,
        rubric_version: str,
        previous_rubric_version: str | None,
        model: str | None,
        run_id: str,
        generation: int | None = None,
        answered_from_cache: bool = False,
    ) -> RescoreTask:
        key = f"rescore:{task_id}:{rubric_version}"
        if generation is not None:
            key += f":g{generation}"
        return cls(
            message_id=uuid.uuid5(uuid.NAMESPACE_URL, key).hex,
            task_id=task_id,
            tenant_id=tenant_id,
            rubric_version=rubric_version,
            previous_rubric_version=previous_rubric_version,
            model=model,
            run_id=run_id,
            generation=generation,
            answered_from_cache=answered_from_cache,
        )


class HousekeepingRequested(Contract):
    """Event: housekeeping ran; each service may now clean its own database
    (`scorebox.events`, routing key `ops.housekeeping`). `task_id` is the cron run id.

    The scheduler never touches another service's database: expired idempotency keys and
    stale leases are removed by TTL indexes where they live; this event lets a service do any
    clean-up a TTL index cannot express.
    """

    routing_key: ClassVar[str] = "ops.housekeeping"

    scheduled_for: Instant

    @computed_field  # type: ignore[prop-decorator]
    @property
    def run_id(self) -> str:
        return self.task_id


class DeadLetterDepth(BaseModel):
    """One dead-letter queue in a `DeadLetterAlert`."""

    model_config = ConfigDict(frozen=True, extra="ignore", allow_inf_nan=False)

    queue: str = Field(description="The work queue.", examples=["scorebox.score-requests"])
    dead_letter_queue: str = Field(examples=["scorebox.score-requests.dlq"])
    depth: int = Field(ge=0, le=MAX_INT64, description="Messages waiting in the dead-letter queue.")
    threshold: int = Field(ge=0, le=MAX_INT64, description="Depth at which an alert is raised.")
    oldest_age_s: float | None = Field(
        default=None, description="Age of the oldest dead letter; None when the queue is empty."
    )


class DeadLetterAlert(Contract):
    """Event: dead-letter queues crossed their threshold (`scorebox.events`, routing key
    `ops.alert.dead-letters`). `task_id` is the housekeeping run id."""

    routing_key: ClassVar[str] = "ops.alert.dead-letters"

    queues: list[DeadLetterDepth] = Field(description="Only the queues over the threshold.")

    @computed_field  # type: ignore[prop-decorator]
    @property
    def run_id(self) -> str:
        return self.task_id


class ModelCallsPaused(Contract):
    """Event: the provider answered a scorer 429 (or was found down: `outage`), and it pauses
    its model calls for `pause_s`
    (`scorebox.events`, routing key `ops.model.paused`). Every other scorer replica calling the
    same `provider` pauses as long, less the event's age; the ops log keeps it for operators.
    `task_id` is the pause's own id."""

    routing_key: ClassVar[str] = "ops.model.paused"

    provider: str = Field(
        description="The provider's URL and a fingerprint of the API key the limit applies to.",
        examples=["https://api.openai.com/v1 key:3f2a9c1b0d4e"],
    )
    pause_s: float = Field(gt=0, le=3600, description="How long the pause lasts from occurred_at.")
    replica: str = Field(
        description="The scorer replica that paused (answered 429, or found the provider down)."
    )
    outage: bool = Field(
        default=False,
        description="The pause is an outage's (the provider found unavailable by the calls of "
        "several texts in a row, or by a starting replica's first call and a check of the "
        "provider), not a rate limit's: a probe finding it still down spends no attempt of "
        "its task.",
    )


# The most items a batch holds (`MAX_BATCH_ITEMS` may set fewer), and so the most a
# broadcast of its cancellation names.
MAX_BATCH_ITEMS = 1000


class BatchCancelling(Contract):
    """Event: a client cancelled a batch, and the gateway is sending a `CancelTask` for each
    of its items not known finished (`scorebox.events`, routing key `batch.cancelling`).
    Every scorer replica hears it and, for a while (`services/scorer/batch_cancels.py`),
    cancels at delivery any item it names at the generation named, instead of claiming it:
    the cancellations trailed the items' scoring, and most of a batch was scored after its
    client had cancelled it. `task_id` is the announcement's own id."""

    routing_key: ClassVar[str] = "batch.cancelling"

    batch_id: str = Field(description="The batch cancelled.")
    requested_at: Instant = Field(description="When the client cancelled it.")
    generations: dict[str, Annotated[int, Field(ge=0, le=MAX_GENERATION)]] = Field(
        max_length=MAX_BATCH_ITEMS,
        description="The generation being cancelled of each item (task id) not known finished.",
    )


# The events of `ops.` routing keys: for operators (the ops log) and for the services' own
# coordination, never about one task's state.
OpsEvent = HousekeepingRequested | DeadLetterAlert | ModelCallsPaused


# --- Webhooks: callbacks and failure alerts ---------------------------------------------------
#
# The notifier turns terminal task events into webhook deliveries. One `DeliverWebhook` is one
# delivery (one URL, one event); its `delivery_id` is the `webhook-id` header of the Standard
# Webhooks format and stays the same across attempts, so receivers can drop duplicates.


class WebhookPurpose(StrEnum):
    """Why a webhook is sent: the submitter's `callback_url`, or the tenant's failure alert."""

    CALLBACK = "callback"
    FAILURE_ALERT = "failure_alert"


class DeliverWebhook(Contract):
    """Command: POST one signed webhook (`scorebox.tasks`, routing key `webhook.deliver`).

    Sent and consumed by the notifier (`scorebox.webhook-deliveries`); a retry is the same
    delivery with the next `attempt`, sent down the wait ladder until `not_before`.
    """

    routing_key: ClassVar[str] = "webhook.deliver"

    delivery_id: str = Field(
        description="The `webhook-id`: the same for every attempt of one delivery.",
        examples=["msg_2f0c3b7e9d4a4c5f8e1a6b2d3c4e5f60"],
    )
    purpose: WebhookPurpose
    url: str = Field(description="The https URL to POST to.", max_length=2048)
    event_type: str = Field(examples=["task.completed", "task.failed"])
    payload: dict[str, Any] = Field(description="The JSON body, exactly as signed and sent.")
    attempt: int = Field(
        default=1, ge=1, le=MAX_INT64, description="1-based attempt this delivery is."
    )
    max_attempts: int = Field(default=8, ge=1, le=MAX_INT64)
    not_before: Instant | None = Field(default=None, description="Do not send before.")
    deferrals: int = Field(
        default=0,
        ge=0,
        le=MAX_INT64,
        description="Times this attempt was put off unsent because its destination or its "
        "tenant had as many POSTs in flight as it may, or its claim's lease was too short "
        "for a POST; each doubles the next wait.",
    )


# --- Status reads: task history (live push) and batch progress ---------------------------------
#
# Answers of the status service's internal HTTP API, like `TaskView`: the gateway reads them
# and never the status database.


class StateChange(BaseModel):
    """One state change of a task as the status service recorded it (its bounded history) and
    as `GET /v1/scores/{task_id}/events` streams it; `sequence` is the Server-Sent Event id."""

    model_config = ConfigDict(frozen=True, extra="ignore", allow_inf_nan=False)

    sequence: int = Field(
        ge=0, le=MAX_SEQUENCE, description="Orders a task's changes; the SSE `id`."
    )
    status: TaskStatus
    occurred_at: Instant
    attempt: int = Field(default=0, ge=0, le=MAX_ATTEMPT)
    error: TaskFailure | None = Field(default=None, description="Retrying or failed: why.")
    next_attempt_at: Instant | None = Field(default=None, description="Retrying: when next.")
    result: ScoreResult | None = Field(default=None, description="Completed: the score.")

    @classmethod
    def of_event(cls, event: TaskEvent) -> StateChange:
        """The state change a task event makes (an acceptance with a future start: scheduled)."""
        status = event.status
        if (
            isinstance(event, TaskAccepted)
            and event.not_before
            and event.not_before > event.occurred_at
        ):
            status = TaskStatus.SCHEDULED
        change: dict[str, Any] = {}
        if isinstance(event, TaskRetrying):
            change = {
                "error": TaskFailure(**event.error.model_dump()),
                "next_attempt_at": event.next_attempt_at,
            }
        elif isinstance(event, TaskFailed):
            change = {
                "error": TaskFailure(**event.error.model_dump(), dead_lettered=event.dead_lettered)
            }
        elif isinstance(event, TaskCompleted):
            change = {"result": event.result}
        return cls(
            sequence=event.sequence,
            status=status,
            occurred_at=event.occurred_at,
            attempt=event.attempt,
            **change,
        )


class TaskHistory(BaseModel):
    """A task's recorded state changes after a given sequence (oldest first)."""

    model_config = ConfigDict(frozen=True, extra="ignore", allow_inf_nan=False)

    task_id: str
    status: TaskStatus = Field(description="The task's current status.")
    sequence: int = Field(ge=0, le=MAX_SEQUENCE, description="Sequence of the current status.")
    changes: list[StateChange] = Field(default_factory=list)


class BatchItemProgress(BaseModel):
    """One task of a batch as the status projection holds it."""

    model_config = ConfigDict(frozen=True, extra="ignore", allow_inf_nan=False)

    task_id: str
    batch_index: int = Field(ge=0, le=MAX_INT64, description="Position in the batch request.")
    status: TaskStatus
    attempts: int = Field(default=0, ge=0, le=MAX_INT64)
    updated_at: Instant
    result: ScoreResult | None = None
    error: TaskFailure | None = None


class BatchProgress(BaseModel):
    """A batch's progress as the status projection holds it: tasks it has not heard of (or
    that expired) are in neither `counts` nor `items`."""

    model_config = ConfigDict(frozen=True, extra="ignore", allow_inf_nan=False)

    batch_id: str
    counts: dict[TaskStatus, Annotated[int, Field(ge=0, le=MAX_INT64)]] = Field(
        default_factory=dict, description="Tasks per status."
    )
    items: list[BatchItemProgress] = Field(
        default_factory=list, description="A page of tasks ordered by `batch_index`."
    )
