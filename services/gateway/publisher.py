"""The gateway's outbound messages; any broker failure surfaces as `BrokerUnavailable`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Sequence

from faststream.rabbit import RabbitBroker

from services.gateway.errors import BrokerUnavailable
from shared.bus import publish_command, publish_events
from shared.contracts import (
    Phase,
    ScoreResult,
    ScoreText,
    TaskCompleted,
    accepted_event,
    event_sequence,
)

log = logging.getLogger("scorebox.gateway.publisher")


class TaskPublisher:
    """Sends `score.requested`, confirmed by the broker.

    A command sent now needs no announcement: the status projection takes its own copy of it
    from `scorebox.tasks`. One that waits on the ladder is announced by `task.accepted`
    (status `scheduled`), best effort: without it the projection learns of the task when it
    starts, and polls meanwhile answer from the gateway's own record."""

    def __init__(self, broker: RabbitBroker, *, timeout_s: float) -> None:
        self._broker = broker
        self._timeout_s = timeout_s

    async def send(self, command: ScoreText) -> None:
        try:
            sent_now = await publish_command(self._broker, command, timeout=self._timeout_s)
        except Exception as error:
            log.warning("score.requested for %s not confirmed: %r", command.task_id, error)
            raise BrokerUnavailable(str(error) or type(error).__name__) from error
        if not sent_now:
            await self._announce_waiting([command])

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
        sent_now = await self._all_confirmed(
            "score.requested",
            [
                publish_command(self._broker, command, timeout=self._timeout_s)
                for command in commands
            ],
        )
        await self._announce_waiting(
            [command for command, now in zip(commands, sent_now, strict=True) if not now]
        )

    async def _announce_waiting(self, commands: Sequence[ScoreText]) -> None:
        if not commands:
            return
        try:
            await publish_events(
                self._broker, [accepted_event(c) for c in commands], timeout=self._timeout_s
            )
        except Exception as error:  # noqa: BLE001 - best effort, see the class
            log.warning(
                "task.accepted of %d waiting task(s) not confirmed: %r", len(commands), error
            )

    async def _all_confirmed[T](self, what: str, publishes: list[Awaitable[T]]) -> list[T]:
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
        return [outcome for outcome in outcomes if not isinstance(outcome, BaseException)]
