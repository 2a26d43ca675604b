"""The gateway's outbound messages; any broker failure surfaces as `BrokerUnavailable`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Sequence
from datetime import datetime

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


def accepted_event(command: ScoreText, *, at: datetime | None = None) -> TaskAccepted:
    """The `task.accepted` of a command; `at` defaults to its submission (a re-score passes
    the time it was queued again)."""
    return TaskAccepted(
        task_id=command.task_id,
        tenant_id=command.tenant_id,
        sequence=event_sequence(generation=command.generation, attempt=0, phase=Phase.ACCEPTED),
        generation=command.generation,
        submitted_at=command.submitted_at,
        occurred_at=at or command.submitted_at,
        rubric=command.rubric,
        model=command.model,
        not_before=command.not_before,
        metadata=command.metadata,
        api_key_id=command.api_key_id,
        batch_id=command.batch_id,
        callback_url=command.callback_url,
        batch_index=command.batch_index,
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

    async def announce_accepted(self, command: ScoreText, *, at: datetime | None = None) -> None:
        try:
            await publish_event(
                self._broker, accepted_event(command, at=at), timeout=self._timeout_s
            )
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
            has_callback=command.callback_url is not None,
            callback_url=command.callback_url,
        )
        try:
            await publish_events(
                self._broker, (accepted_event(command), completed), timeout=self._timeout_s
            )
        except Exception as error:
            log.warning("cached result for %s not confirmed: %r", command.task_id, error)
            raise BrokerUnavailable(str(error) or type(error).__name__) from error

    async def send_many(self, commands: Sequence[ScoreText]) -> None:
        """Send a batch's commands with their confirms in flight together (one round)."""
        await self._all_confirmed(
            "score.requested",
            [
                publish_command(self._broker, command, timeout=self._timeout_s)
                for command in commands
            ],
        )

    async def announce_accepted_many(self, commands: Sequence[ScoreText]) -> None:
        """Announce a batch's `task.accepted` events, confirms in flight together."""
        await self._all_confirmed(
            "task.accepted",
            [
                publish_event(self._broker, accepted_event(command), timeout=self._timeout_s)
                for command in commands
            ],
        )

    async def _all_confirmed(self, what: str, publishes: list[Awaitable[None]]) -> None:
        # Every publish is awaited to its end (no stray publish outlives the request), then
        # any failure fails the whole round.
        try:
            async with asyncio.timeout(self._timeout_s * 2):
                outcomes = await asyncio.gather(*publishes, return_exceptions=True)
        except TimeoutError as error:
            log.warning("%d %s publishes not confirmed in time", len(publishes), what)
            raise BrokerUnavailable(f"{what} not confirmed in time") from error
        failures = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
        if failures:
            log.warning(
                "%d of %d %s not confirmed: %r", len(failures), len(outcomes), what, failures[0]
            )
            raise BrokerUnavailable(str(failures[0]) or type(failures[0]).__name__)
