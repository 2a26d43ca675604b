"""The gateway's outbound messages.

A command the broker did not take (a nack, unroutable, the channel closed before it was
written) surfaces as `BrokerUnavailable`: it reached no queue. One written but not confirmed
(`shared.bus.PublishUnconfirmed`: a timeout, a connection lost or blocked meanwhile) may
still reach its queue, so `send` and `send_many` report it instead of raising: the caller
keeps the submission for the outbox sweep, which sends it again (the scorer claims each task
once), rather than refusing a task that would be scored anyway.

A refused command may still have reached the status projection's queue (the broker routes one
publish to both queues, and a full score queue refuses it): the caller that answers 503
`withdraw`s it, so the projection never shows a task nobody was told of.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from faststream.rabbit import RabbitBroker

from services.gateway.errors import BrokerUnavailable
from shared.bus import (
    BROKER_ERRORS,
    PublishUnconfirmed,
    error_words,
    publish_batch_cancelling,
    publish_cancel,
    publish_command,
    publish_delayed,
    publish_event,
    publish_events,
)
from shared.contracts import (
    BatchCancelling,
    CancelTask,
    ScoreResult,
    ScoreText,
    ScoreWithdrawn,
    TaskCompleted,
    accepted_event,
    cached_completion_sequence,
)
from shared.log_rate import Tally
from shared.topology import TASKS

log = logging.getLogger("scorebox.gateway.publisher")
# How often at most the commands the broker did not take are logged, with their count.
NOT_SENT_LOG_EVERY_S = 60.0


class TaskPublisher:
    """Sends `score.requested`, confirmed by the broker.

    A command sent now needs no announcement: the status projection takes its own copy of it
    from `scorebox.tasks`. One that waits on the ladder, and a resubmission, are announced by
    `task.accepted` (status `scheduled` or `queued`), best effort: without it the projection
    learns of the task's generation when it starts, and polls of a new task meanwhile answer
    from the gateway's own record."""

    def __init__(
        self, broker: RabbitBroker, *, timeout_s: float, clock: Callable[[], datetime]
    ) -> None:
        self._broker = broker
        self._timeout_s = timeout_s
        self._clock = clock  # what a delayed command's `not_before` is judged by
        # A line per refused submission flooded the log while the broker was away (318 for
        # 159 refusals in 14 s; a walkthrough): one a minute at most, with the count.
        self._unconfirmed = Tally(NOT_SENT_LOG_EVERY_S, time.monotonic)
        self._not_taken = Tally(NOT_SENT_LOG_EVERY_S, time.monotonic)
        self._not_withdrawn = Tally(NOT_SENT_LOG_EVERY_S, time.monotonic)

    async def send(self, command: ScoreText) -> bool:
        """True when the broker confirmed the command; False when it was written but not
        confirmed (it may be queued: keep its submission for the outbox)."""
        try:
            sent_now = await publish_command(
                self._broker, command, timeout=self._timeout_s, now=self._clock()
            )
        except PublishUnconfirmed as error:
            self._log_not_sent(self._unconfirmed, "unconfirmed", command, error)
            return False
        except Exception as error:
            if isinstance(error, BROKER_ERRORS):
                self._log_not_sent(self._not_taken, "not taken", command, error)
            else:  # a bug, not the broker: its traceback, every time
                log.exception("score.requested for %s not sent", command.task_id)
            raise BrokerUnavailable(str(error) or type(error).__name__) from error
        if not sent_now:
            await self._announce_accepted([command])
        return True

    async def resubmit(self, command: ScoreText) -> None:
        """Send a task again (re-score, DLQ replay), due now, for callers that settle only
        what the broker confirmed (they send again on failure): a failure of the broker is
        `BrokerUnavailable`; any other error is raised as it is (a re-score's request took it
        for the broker's and retried it every 10 minutes for ever).

        It goes to the scorer alone (`score.resubmitted`): the status projection holds the
        task's earlier outcome, and its copy of a command the full score queue refused would
        show the task queued for a generation that never runs. The confirmed command is
        announced to it instead (`task.accepted` of the new generation, best effort: without
        it the projection shows the earlier outcome until the attempt starts)."""
        try:
            await publish_delayed(
                self._broker,
                command,
                exchange=TASKS,
                routing_key=command.resubmission_routing_key,
                not_before=None,
                timeout=self._timeout_s,
                now=self._clock(),
            )
        except BROKER_ERRORS as error:  # anything else is no broker's doing: raised as it is
            log.warning("score.resubmitted for %s not confirmed: %r", command.task_id, error)
            raise BrokerUnavailable(str(error) or type(error).__name__) from error
        await self._announce_accepted([command])

    async def cancel(self, cancel: CancelTask) -> None:
        """Send a client's cancellation to the scorer, confirmed; anything else is
        `BrokerUnavailable` (a cancellation is idempotent: the client sends it again)."""
        try:
            await publish_cancel(self._broker, cancel, timeout=self._timeout_s)
        except Exception as error:
            log.warning("score.cancel for %s not confirmed: %r", cancel.task_id, error)
            raise BrokerUnavailable(str(error) or type(error).__name__) from error

    async def announce_batch_cancel(self, event: BatchCancelling) -> None:
        """Tell every scorer replica of a batch's cancellation, best effort: never raises
        (the items' own cancellations, sent next, are what records them)."""
        try:
            await publish_batch_cancelling(self._broker, event, timeout=self._timeout_s)
        except Exception as error:  # noqa: BLE001 - the scorers then wait for each item's
            # Not a warning: with no scorer running (a restart) nothing is bound to hear it
            # and it comes back unroutable; the cancels, sent alongside, say what matters.
            log.info("batch.cancelling for %s not heard: %r", event.batch_id, error)

    async def cancel_many(self, cancels: Sequence[CancelTask]) -> None:
        """Send a batch's cancellations with their confirms in flight together (one round, as
        `send_many`); `BrokerUnavailable` unless every one was confirmed in time: some may be
        queued all the same, and sending them all again is harmless (idempotent per task)."""
        try:
            async with asyncio.timeout(self._timeout_s * 2):
                published = await _together(
                    publish_cancel(self._broker, cancel, timeout=self._timeout_s)
                    for cancel in cancels
                )
        except TimeoutError as error:
            log.warning("%d score.cancel unconfirmed in time", len(cancels))
            raise BrokerUnavailable("the cancellations were not confirmed in time") from error
        if published.failures:
            log.warning(
                "%d of %d score.cancel not confirmed: %r",
                len(published.failures),
                len(cancels),
                published.first,
            )
            raise published.refusal()

    async def announce_cached(self, command: ScoreText, result: ScoreResult) -> bool:
        """A task (or a re-score's generation) answered from the result cache: accepted and
        completed at once. True when both events were confirmed; False when some may have
        been written without a confirm (keep the submission for the outbox);
        `BrokerUnavailable` when none was taken."""
        completed = TaskCompleted(
            task_id=command.task_id,
            tenant_id=command.tenant_id,
            generation=command.generation,
            sequence=cached_completion_sequence(command.generation),
            submitted_at=command.submitted_at,
            occurred_at=command.occurred_at,
            api_key_id=command.api_key_id,
            result=result,
            has_callback=command.callback_url is not None,
            callback_url=command.callback_url,
        )
        published = await _together(
            publish_event(self._broker, event, timeout=self._timeout_s)
            for event in (accepted_event(command), completed)
        )
        if not published.failures:
            return True
        log.warning("cached result for %s not confirmed: %r", command.task_id, published.first)
        if published.none_taken:
            raise published.refusal()
        return False

    async def send_many(self, commands: Sequence[ScoreText]) -> bool:
        """Send a batch's commands with their confirms in flight together (one round): True
        when every one was confirmed; False when some may be queued but not all are known
        to be (keep the submissions for the outbox); `BrokerUnavailable` when none was
        taken."""
        try:
            async with asyncio.timeout(self._timeout_s * 2):
                published = await _together(
                    publish_command(
                        self._broker, command, timeout=self._timeout_s, now=self._clock()
                    )
                    for command in commands
                )
        except TimeoutError:
            log.warning("%d score.requested unconfirmed in time", len(commands))
            return False
        if published.none_taken:
            log.warning("none of %d score.requested taken: %r", len(commands), published.first)
            raise published.refusal()
        if published.failures:
            log.warning(
                "%d of %d score.requested not confirmed: %r",
                len(published.failures),
                len(commands),
                published.first,
            )
            return False
        await self._announce_accepted(
            [
                command
                for command, now in zip(commands, published.outcomes, strict=True)
                if now is False
            ]
        )
        return True

    async def withdraw(self, commands: Sequence[ScoreText]) -> None:
        """Tell the projection to forget refused commands, all confirms in flight together;
        best effort: a withdrawal lost leaves the task `queued` there, as before."""
        now = self._clock()
        published = await _together(
            publish_delayed(
                self._broker,
                ScoreWithdrawn(
                    task_id=command.task_id, tenant_id=command.tenant_id, occurred_at=now
                ),
                exchange=TASKS,
                routing_key=ScoreWithdrawn.routing_key,
                not_before=None,
                timeout=self._timeout_s,
                now=now,
            )
            for command in commands
        )
        if published.failures and (lines := self._not_withdrawn.count()) is not None:
            log.warning(
                "withdrawals not confirmed (%d time(s) since the last line), the latest %d of "
                "%d: %s",
                lines,
                len(published.failures),
                len(commands),
                error_words(published.first) if published.first else "no error",
            )

    def _log_not_sent(
        self, tally: Tally, how: str, command: ScoreText, error: BaseException
    ) -> None:
        """One line a minute at most for each kind (`how`): a line for the refused ones
        hid the unconfirmed, and the other way round, under one count (a review)."""
        if (count := tally.count()) is None:
            return
        log.warning(
            "score.requested %s (%d since the last line), the latest for %s: %s",
            how,
            count,
            command.task_id,
            error_words(error),
        )

    async def _announce_accepted(self, commands: Sequence[ScoreText]) -> None:
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


@dataclass(frozen=True)
class _Round:
    """What became of publishes whose confirms were in flight together."""

    outcomes: list[object]  # each publish's result, or the exception it raised

    @property
    def failures(self) -> list[BaseException]:
        return [outcome for outcome in self.outcomes if isinstance(outcome, BaseException)]

    @property
    def first(self) -> BaseException | None:
        return next(iter(self.failures), None)

    @property
    def none_taken(self) -> bool:
        """Every publish failed, and none of them may have been written all the same."""
        failures = self.failures
        return len(failures) == len(self.outcomes) and not any(
            isinstance(failure, PublishUnconfirmed) for failure in failures
        )

    def refusal(self) -> BrokerUnavailable:
        error = self.first
        return BrokerUnavailable(str(error) or type(error).__name__)


async def _together(publishes: Iterable[Awaitable[object]]) -> _Round:
    return _Round(list(await asyncio.gather(*publishes, return_exceptions=True)))
