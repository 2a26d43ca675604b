"""What the scorer decided about one delivery, and how a decision is stored for replay.

A decision is recorded in the scorer's database before it is carried out on the broker;
a redelivered message whose attempt was already decided carries out the same decision
again instead of calling the model again (exactly-once effect on at-least-once delivery).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from shared.contracts import (
    CANCELLED_CODE,
    CancelTask,
    Phase,
    ScoreText,
    TaskError,
    TaskEvent,
    TaskFailed,
    TaskRetrying,
    Usage,
    event_sequence,
    parse_task_event,
)


def add_usage(first: Usage, second: Usage) -> Usage:
    return Usage(
        prompt_tokens=first.prompt_tokens + second.prompt_tokens,
        completion_tokens=first.completion_tokens + second.completion_tokens,
    )


@dataclass(frozen=True)
class Spent:
    """What the provider billed the attempts of one generation of a task that were retried
    (an unusable answer whose repair then failed for now, timed out or was throttled).

    A retry publishes no metered event (the usage meter reads outcomes only, one per task and
    generation), so these tokens travel to the generation's outcome: recorded with the retry
    decision (`Attempts.decide`), read by the next attempt (`Attempts.spent_before`) and
    added to its outcome's usage.
    """

    generation: int
    usage: Usage
    model: str | None = None

    def plus(self, usage: Usage | None, model: str | None) -> Spent:
        """These tokens and those of one more attempt (`model`, when it answered, named last)."""
        if usage is None:
            return self
        return Spent(self.generation, add_usage(self.usage, usage), model or self.model)

    def stored(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "prompt_tokens": self.usage.prompt_tokens,
            "completion_tokens": self.usage.completion_tokens,
            "model": self.model,
        }

    @classmethod
    def loaded(cls, stored: Any) -> Spent | None:
        """The stored form read back; None when it is missing or unreadable."""
        if not isinstance(stored, dict) or not isinstance(stored.get("generation"), int):
            return None
        model = stored.get("model")
        try:
            usage = Usage.model_validate(
                {key: stored.get(key, 0) for key in ("prompt_tokens", "completion_tokens")}
            )
        except ValidationError:
            return None
        return cls(stored["generation"], usage, model if isinstance(model, str) else None)


@dataclass(frozen=True)
class Finish:
    """The task ended: publish its terminal event (after dead-lettering, when asked)."""

    event: TaskEvent
    dead_letter_error: str | None = None


def cancelled(cancel: CancelTask, *, attempt: int, spent: Spent | None, now: datetime) -> Finish:
    """The decision a client's cancellation records as `attempt`'s: the task failed with
    `cancelled`, nothing dead-lettered; metered with what the generation was billed before
    (`spent`), for this is its outcome, as a give-up's is."""
    billed: dict[str, Any] = {}
    if spent is not None:
        billed = {"usage": spent.usage, "model": spent.model}
    error = TaskError(code=CANCELLED_CODE, message="cancelled by the client", retryable=False)
    sequence = event_sequence(generation=cancel.generation, attempt=attempt, phase=Phase.TERMINAL)
    failed = TaskFailed(
        task_id=cancel.task_id,
        tenant_id=cancel.tenant_id,
        sequence=sequence,
        attempt=attempt,
        generation=cancel.generation,
        submitted_at=cancel.submitted_at,
        occurred_at=now,
        api_key_id=cancel.api_key_id,
        error=error,
        dead_lettered=False,
        has_callback=cancel.callback_url is not None,
        callback_url=cancel.callback_url,
        **billed,
    )
    return Finish(failed)


def is_cancellation(decision: Finish | Retry) -> bool:
    event = decision.event
    return isinstance(event, TaskFailed) and event.error.code == CANCELLED_CODE


@dataclass(frozen=True)
class Retry:
    """Another attempt later: send `next_command` down the wait ladder, announce it.

    `spent`: what the generation's attempts were billed so far, this one's included (None:
    nothing), for the outcome of a later attempt to count in. `Attempts.decide` keeps it in
    the attempt's document beside the stored decision (the next claim clears the decision),
    so a decision loaded for replay has none: replaying a retry meters nothing.
    """

    event: TaskRetrying
    next_command: ScoreText
    spent: Spent | None = None


@dataclass(frozen=True)
class Defer:
    """Not now: send this command down the wait ladder (not yet due, or claimed elsewhere).

    `retry_due_later`: for a retry's attempt put off by a pause of the model calls, its
    `task.retrying` told again with the later `next_attempt_at` (the copy's `not_before`),
    published best effort once the copy is confirmed, so that the task's status does not
    read a next attempt long past (`scoring._put_off`)."""

    command: ScoreText
    retry_due_later: TaskRetrying | None = None


@dataclass(frozen=True)
class Hold:
    """Keep this redelivery unacknowledged and claim again at `until` (or sooner).

    Its claim is held by a worker that may have died holding it. Deferring would ack it and
    send a fresh copy, whose delivery count starts again at zero: a message that kills its
    consumer would then loop forever instead of reaching the queue's delivery limit.
    """

    until: datetime


@dataclass(frozen=True)
class Drop:
    """Nothing to do: a newer attempt or generation of the task exists."""

    reason: str


Decision = Finish | Retry | Defer | Hold | Drop


def _stored_event(event: TaskEvent) -> dict[str, str]:
    return {"routing_key": event.routing_key, "body": event.model_dump_json()}


def _loaded_event(stored: dict[str, str]) -> TaskEvent:
    return parse_task_event(stored["routing_key"], stored["body"].encode())


def store(decision: Finish | Retry) -> dict[str, Any]:
    if isinstance(decision, Finish):
        return {
            "kind": "finish",
            "event": _stored_event(decision.event),
            "dead_letter_error": decision.dead_letter_error,
        }
    return {
        "kind": "retry",
        "event": _stored_event(decision.event),
        "next_command": decision.next_command.model_dump_json(),
    }


def load(stored: dict[str, Any]) -> Finish | Retry:
    event = _loaded_event(stored["event"])
    if stored["kind"] == "finish":
        return Finish(event=event, dead_letter_error=stored.get("dead_letter_error"))
    assert isinstance(event, TaskRetrying)
    return Retry(event=event, next_command=ScoreText.model_validate_json(stored["next_command"]))
