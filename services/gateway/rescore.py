"""Re-scoring: the gateway's side of the scheduler's re-score fan-out.

The scheduler publishes a `RescoreTask` per stale task to `scorebox.rescore-requests`. The
gateway owns the submissions and their texts, so it submits the task again: the same task
id, the submission's next generation (the scorer claims a newer generation afresh and the
status projection shows the task `queued` again, as after a DLQ replay), attempt 1 and a
fresh message id, queued now; the command is published with a confirm, to the scorer alone,
and announced to the projection once confirmed (`TaskPublisher.resubmit`): a re-score the full
score queue refuses leaves the task's earlier outcome in view.

A submission is re-scored once per generation a request names: the one the fan-out found
completed, taken only while it is the task's latest outcome (`Submissions.claim_rescore`),
so duplicate requests (a fan-out run repeated, the same request twice) and late ones score
nothing twice, and a version switched back to is scored again; a request naming none (a
scheduler of an earlier build) is taken once per rubric version. A
request that is retried (`attempt` > 1) or redelivered may resume a claim whose command was
not recorded as sent, with the same generation (the scorer claims each generation once).

A task the result cache answered (`RescoreTask.answered_from_cache`, sent by the fan-out
after the others) is answered from the cache again when its text was scored under the
request's version since, most often by the re-score of the task the cache answered it from:
its new generation is announced accepted and completed at once (`cached: true`, no model
call), as a submission the cache answers is. How a claim is answered is decided once
(`Submissions.answer_rescore`), and a retry of the claim repeats it: decided again, a claim
announced from the cache, its confirms lost, and sent to the scorer at its retry, had its
generation both answered and scored. Each such task made a model call of its own at a
rubric change, where the submissions cost one (a review in session 54).

Each delivery is acknowledged by hand:

- unreadable body: rejected without requeue (the queue's DLQ keeps it);
- unknown task (expired after `IDEMPOTENCY_TTL_S`, never existed, another tenant's), a text
  not kept (accepted before texts were kept) or a duplicate request: logged, acked;
- MongoDB unavailable: retried in place (`keep_trying`); the delivery is held meanwhile;
- an operation MongoDB refuses for good (`database_away`: a failed validation, say):
  returned as failed (`Delivery.requeue_failed`), for the queue's delivery limit to
  dead-letter; waited out, it held the delivery for ever;
- the command not sent (no confirm, a negative one when the score queue is full, an
  unroutable message): the request goes down the wait ladder with the next `attempt`, after
  5 s, 30 s, 2 min and 10 min, and then every 10 min for as long as sending fails, never to
  the DLQ; acked each time. The 10-minute waits are spent in `scorebox.wait.rescores`,
  which the scheduler's fan-out counts against its backlog bound. Its claim stays unsent,
  so the retry resumes it with the same generation. Given up to the DLQ (as before session
  54, for every failure but a full queue), the request was lost for good: its task is
  marked requested for the version in the scheduler's catalogue, so no later run asks
  again, and nothing replays that DLQ. A claim an earlier build gave up
  (`rescore.given_up`) is taken again by the next request that finds the task's completed
  generation the latest. Sending the retry itself is tried until the broker confirms it,
  the delivery held meanwhile (`keep_publishing`).

Why the wait ladder rather than leaving the delivery unacknowledged: a full score queue is
back-pressure that lasts minutes; an unacknowledged delivery would hold a prefetch slot until
the connection drops, and a nack with requeue would spin through the delivery limit at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final, Protocol

from faststream.rabbit import RabbitBroker
from pydantic import ValidationError

from services.gateway.cache import ResultCache
from services.gateway.errors import BrokerUnavailable, DatabaseUnavailable, database_away
from services.gateway.submissions import RescoreAnswer, RescoreClaim, RescoreRefused, Submissions
from shared.bus import error_words, publish_delayed, publish_through_wait_queue
from shared.consumers import Delivery, ScoreboxBroker, consume
from shared.contracts import RescoreTask, ScoreResult, ScoreText, new_id
from shared.failed_deliveries import return_failed
from shared.runtime import keep_publishing, keep_trying
from shared.topology import RESCORE_REQUESTS, RESCORES_WAIT_TIER, TASKS

log = logging.getLogger("scorebox.gateway.rescore")

Clock = Callable[[], datetime]
# Each delay is a wait tier's own TTL, so a retry arrives due after one hop (a `RescoreTask`
# has no `not_before` to send it down the ladder again by). The last, repeated for as long as
# sending fails, is spent in the re-score requests' own wait queue (`RESCORES_WAIT`), which
# the scheduler's fan-out counts against its backlog bound: they come back as re-scores.
RETRY_DELAYS_S: Final = (5, 30, 120, RESCORES_WAIT_TIER[1])


class Resubmitter(Protocol):
    """Sends a task again, confirmed (`services.gateway.publisher.TaskPublisher.resubmit`),
    or announces it answered from the cache (`announce_cached`)."""

    async def resubmit(self, command: ScoreText) -> None: ...

    async def announce_cached(self, command: ScoreText, result: ScoreResult) -> bool: ...


SCORER: Final = RescoreAnswer()


@dataclass(frozen=True)
class Rescored:
    command: ScoreText
    resumed: bool
    cached: bool = False  # answered from the result cache, not sent to the scorer


RescoreOutcome = Rescored | RescoreRefused


def rescore_command(claim: RescoreClaim, *, now: datetime) -> ScoreText:
    """The submitted command as the claimed generation's first attempt, due now (and queued
    now: the projection shows the new generation accepted at `now`)."""
    return claim.command.model_copy(
        update={
            "generation": claim.generation,
            "attempt": 1,
            "not_before": None,
            "message_id": new_id(),
            "occurred_at": now,
        }
    )


async def rescore_task(
    request: RescoreTask,
    *,
    submissions: Submissions,
    publisher: Resubmitter,
    clock: Clock,
    may_resume: bool = False,
    cache: ResultCache | None = None,
) -> RescoreOutcome:
    """Claim the task's next generation and send it, or answer it from `cache` (see
    `_answer`); raises `BrokerUnavailable` when the command, or the answer's events, are
    not confirmed (the claim then stays unsent and a retry resumes it)."""
    tried = False

    async def claim_once() -> RescoreClaim | RescoreRefused:
        # A try whose claim landed but whose answer was lost left this request's own claim
        # unsent: the next try resumes it rather than dropping it as a duplicate's.
        nonlocal tried
        resume, tried = may_resume or tried, True
        return await submissions.claim_rescore(
            request.task_id,
            tenant_id=request.tenant_id,
            rubric_version=request.rubric_version,
            request_id=request.message_id,
            now=clock(),  # read again at each try: a database outage may have lasted hours
            may_resume=resume,
            generation=request.generation,
        )

    claim = await keep_trying(
        claim_once,
        what=f"claiming the re-score of {request.task_id}",
        retry_on=(DatabaseUnavailable,),
        retry_if=database_away,
    )
    if isinstance(claim, RescoreRefused):
        return claim
    if claim.resumed:
        await _note_tried(submissions, request, claim, now=clock())
    command = rescore_command(claim, now=clock())
    answer = await keep_trying(
        lambda: _answer(request, claim, submissions=submissions, cache=cache, now=clock()),
        what=f"answering the re-score of {request.task_id}",
        retry_on=(DatabaseUnavailable,),
        retry_if=database_away,
    )
    if answer.cached is None:
        await publisher.resubmit(command)
    elif not await publisher.announce_cached(command, answer.cached):
        raise BrokerUnavailable(f"the cached answer of {request.task_id} was not confirmed")
    await keep_trying(
        lambda: submissions.finish_rescore(
            request.task_id, rubric_version=request.rubric_version, now=clock()
        ),
        what=f"recording the re-score of {request.task_id} as sent",
        retry_on=(DatabaseUnavailable,),
        retry_if=database_away,
    )
    return Rescored(command, resumed=claim.resumed, cached=answer.cached is not None)


async def _answer(
    request: RescoreTask,
    claim: RescoreClaim,
    *,
    submissions: Submissions,
    cache: ResultCache | None,
    now: datetime,
) -> RescoreAnswer:
    """How the claim is answered, decided once (`Submissions.answer_rescore`): a task the
    cache answered (`answered_from_cache`, sent by the fan-out after the others) is
    answered from it when its text was scored under the request's version since, by
    another task's re-score most often; anything else goes to the scorer. Not consulted
    for a task that was scored: it may have been submitted with `use_cache: false`."""
    if claim.answer is not None:
        return claim.answer
    if not request.answered_from_cache or cache is None or claim.cache_key is None:
        return SCORER
    found = await cache.find(tenant_id=request.tenant_id, key=claim.cache_key, now=now)
    if found is None or found.prompt_version != request.rubric_version:
        return await submissions.answer_rescore(
            request.task_id, generation=claim.generation, answer=SCORER
        )
    return await submissions.answer_rescore(
        request.task_id,
        generation=claim.generation,
        answer=RescoreAnswer(cached=found.model_copy(update={"cached": True})),
    )


async def _note_tried(
    submissions: Submissions, request: RescoreTask, claim: RescoreClaim, *, now: datetime
) -> None:
    """Best effort: unnoted for an hour (`RESCORE_ORPHANED_AFTER`), the claim is taken for
    orphaned and a DLQ replay of the task runs above it. Under the claim's own request id: a
    request naming no generation (a scheduler of an earlier build) resumes another's."""
    try:
        await submissions.note_rescore_tried(
            request.task_id, request_id=claim.request_id or request.message_id, now=now
        )
    except DatabaseUnavailable as error:
        log.warning("the re-score of %s not noted as tried again: %r", request.task_id, error)


def _log_outcome(request: RescoreTask, outcome: RescoreOutcome) -> None:
    where = f"task {request.task_id} (tenant {request.tenant_id}, {request.rubric_version})"
    match outcome:
        case Rescored(command=command, resumed=resumed, cached=cached):
            how = "resumed" if resumed else "queued"
            if cached:
                how = f"answered from the result cache{' (resumed)' if resumed else ''}"
            log.info("re-score of %s %s as generation %d", where, how, command.generation)
        case RescoreRefused.UNKNOWN_TASK:
            log.info("re-score of %s ignored: no such submission (expired?)", where)
        case RescoreRefused.TEXT_NOT_KEPT:
            log.warning("re-score of %s ignored: its text was not kept", where)
        case RescoreRefused.ALREADY_REQUESTED:
            log.info("re-score of %s ignored: a duplicate request", where)


def may_resume(request: RescoreTask, message: Delivery) -> bool:
    """Only a retry or a redelivery may resume an unsent claim: a first delivery meeting one
    is a duplicate whose twin is being sent right now."""
    return request.attempt > 1 or message.redelivered


@dataclass(frozen=True)
class RescoreRequests:
    """The consumer of `scorebox.rescore-requests` (see the module docstring)."""

    submissions: Submissions
    publisher: Resubmitter
    broker: RabbitBroker
    clock: Clock
    timeout_s: float
    cache: ResultCache | None = None

    async def on_message(self, message: Delivery) -> None:
        try:
            request = RescoreTask.model_validate_json(message.body)
        except ValidationError as error:
            log.warning("dead-lettering an unreadable score.rescore: %s", error)
            await message.reject(requeue=False)
            return
        try:
            outcome = await rescore_task(
                request,
                submissions=self.submissions,
                publisher=self.publisher,
                clock=self.clock,
                may_resume=may_resume(request, message),
                cache=self.cache,
            )
        except BrokerUnavailable as error:
            await self._retry_later(request, error)
        except DatabaseUnavailable as error:  # refused for good: `rescore_task` waits out the rest
            log.exception("the database refused the re-score of %s", request.task_id)
            await return_failed(
                self.broker,
                RESCORE_REQUESTS,
                message,
                error=error.__cause__ or error,
                timeout=self.timeout_s,
            )
            return
        else:
            _log_outcome(request, outcome)
        await message.ack()

    async def _retry_later(self, request: RescoreTask, error: BrokerUnavailable) -> None:
        """Send the request down the wait ladder, and every 10 min past it."""
        if request.attempt > len(RETRY_DELAYS_S):
            log.error(
                "re-score of %s still not sent after %d attempts (%s); trying every %d s",
                request.task_id,
                request.attempt,
                error_words(error),
                RETRY_DELAYS_S[-1],
            )
        await self._send_again(request, error)

    async def _send_again(self, request: RescoreTask, error: BrokerUnavailable) -> None:
        delay = timedelta(seconds=RETRY_DELAYS_S[min(request.attempt, len(RETRY_DELAYS_S)) - 1])
        log.warning(
            "re-score of %s not sent (%r); attempt %d in %s",
            request.task_id,
            error,
            request.attempt + 1,
            delay,
        )
        await keep_publishing(
            lambda: self._publish_retry(
                request.model_copy(update={"attempt": request.attempt + 1}), delay
            ),
            what=f"the re-score retry of {request.task_id}",
        )

    async def _publish_retry(self, request: RescoreTask, delay: timedelta) -> None:
        """`request` (the next attempt) after `delay`: the ladder's last step, and every one
        past it, in `RESCORES_WAIT`."""
        if request.attempt > len(RETRY_DELAYS_S):
            await publish_through_wait_queue(
                self.broker,
                request,
                tier=RESCORES_WAIT_TIER[0],
                routing_key=request.routing_key,
                timeout=self.timeout_s,
            )
            return
        now = self.clock()
        await publish_delayed(
            self.broker,
            request,
            exchange=TASKS,
            routing_key=request.routing_key,
            not_before=now + delay,
            now=now,
            timeout=self.timeout_s,
        )


def subscribe_rescore_requests(
    broker: ScoreboxBroker, requests: RescoreRequests, *, prefetch: int
) -> None:
    """Consume `scorebox.rescore-requests`, `prefetch` deliveries at a time."""

    @consume(broker, RESCORE_REQUESTS.queue, prefetch=prefetch)
    async def rescore_requested(message: Delivery) -> None:
        await requests.on_message(message)
