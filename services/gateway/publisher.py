"""The gateway's outbound messages; any broker failure surfaces as `BrokerUnavailable`."""

from __future__ import annotations

import logging

from faststream.rabbit import RabbitBroker

from services.gateway.errors import BrokerUnavailable
from shared.bus import publish_command, publish_event, publish_events
from shared.contracts import (
    Phase,
    ScoreResult,
    ScoreText,
    TaskAccepted,
    TaskCompleted,
    event_sequence,
)

log = logging.getLogger("scorebox.gateway.publisher")


def accepted_event(command: ScoreText) -> TaskAccepted:
    return TaskAccepted(
        task_id=command.task_id,
        tenant_id=command.tenant_id,
        sequence=event_sequence(generation=command.generation, attempt=0, phase=Phase.ACCEPTED),
        generation=command.generation,
        submitted_at=command.submitted_at,
        occurred_at=command.submitted_at,
        rubric=command.rubric,
        model=command.model,
        not_before=command.not_before,
        metadata=command.metadata,
        api_key_id=command.api_key_id,
        batch_id=command.batch_id,
        callback_url=command.callback_url,
    )


class TaskPublisher:
    """Sends `score.requested` and announces `task.accepted`, each confirmed by the broker."""

    def __init__(self, broker: RabbitBroker, *, timeout_s: float) -> None:
        self._broker = broker
        self._timeout_s = timeout_s

    async def send(self, command: ScoreText) -> None:
        try:
            await publish_command(self._broker, command, timeout=self._timeout_s)
        except Exception as error:
            log.warning("score.requested for %s not confirmed: %r", command.task_id, error)
            raise BrokerUnavailable(str(error) or type(error).__name__) from error

    async def announce_accepted(self, command: ScoreText) -> None:
        try:
            await publish_event(self._broker, accepted_event(command), timeout=self._timeout_s)
        except Exception as error:
            log.warning("task.accepted for %s not confirmed: %r", command.task_id, error)
            raise BrokerUnavailable(str(error) or type(error).__name__) from error

    async def announce_cached(self, command: ScoreText, result: ScoreResult) -> None:
        """A task answered from the result cache: accepted and completed at once."""
        completed = TaskCompleted(
            task_id=command.task_id,
            tenant_id=command.tenant_id,
            sequence=event_sequence(generation=0, attempt=0, phase=Phase.TERMINAL),
            submitted_at=command.submitted_at,
            occurred_at=command.submitted_at,
            api_key_id=command.api_key_id,
            result=result,
        )
        try:
            await publish_events(
                self._broker, (accepted_event(command), completed), timeout=self._timeout_s
            )
        except Exception as error:
            log.warning("cached result for %s not confirmed: %r", command.task_id, error)
            raise BrokerUnavailable(str(error) or type(error).__name__) from error
