"""Cancelling a task before its model call: the gateway's side.

The gateway finds the caller's submission of the task (none: unknown, as for a poll, never
revealing another tenant's), refuses a task it knows is finished, and sends a confirmed
`CancelTask` for the task's latest generation to the scorer, which decides that generation as
failed with `cancelled` unless its model call has started (`services/scorer/cancels.py`).

Known finished: its submission records an outcome of that generation (or a later one), which
the gateway's outcome consumer notes in the write it makes for every outcome
(`Submissions.note_outcome`); its latest outcome is a completion, so its latest generation
is a re-score, which the scorer never cancels; a result-cache hit answered it (any
generation: a re-score of a completed task is not cancelled); or the status service says
completed or failed. The
submission is asked first: the scorer's attempts store may have forgotten a generation that
finished long ago (`ATTEMPTS_RETENTION_S` shorter than the submission's life), and would then
record a second, contradicting outcome of it. The status service being unavailable does not
stop a cancellation of a generation with no outcome noted: the scorer finds a finished task
too late to cancel, and the client's poll shows how it ended.

A batch (`cancel_batch`) is cancelled item by item, each as a task would be, but on the
gateway's record alone: an item not known finished from its submission is sent a
`CancelTask`, none is asked of the status service (up to 1,000 requests per batch), and the
scorer finds an item that finished meanwhile too late to cancel. The items' submissions are
read in one query without their texts, and every cancellation is sent with its confirm in
flight together.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Protocol

from services.gateway.batches import Batches, BatchRecord, BatchState
from services.gateway.errors import StatusUnavailable, in_progress_retry_after
from services.gateway.submissions import (
    CancelTarget,
    Submission,
    Submissions,
    SubmissionState,
)
from services.gateway.submit import StatusReader, incomplete_batch_held_until
from shared.contracts import (
    BatchCancelling,
    CancelTask,
    TaskStatus,
    TaskView,
    generation_of,
    new_id,
    rfc3339,
)

log = logging.getLogger("scorebox.gateway")


class CancelSender(Protocol):
    """Sends a cancellation, confirmed (`services.gateway.publisher.TaskPublisher.cancel`);
    raises `BrokerUnavailable` otherwise."""

    async def cancel(self, cancel: CancelTask) -> None: ...


class BatchCancelSender(Protocol):
    """Announces a batch's cancellation to the scorers, best effort, never raising
    (`services.gateway.publisher.TaskPublisher.announce_batch_cancel`); sends many
    cancellations, their confirms in flight together (`cancel_many`): `BrokerUnavailable`
    unless every one was confirmed (some may be queued all the same)."""

    async def announce_batch_cancel(self, event: BatchCancelling) -> None: ...

    async def cancel_many(self, cancels: Sequence[CancelTask]) -> None: ...


class TaskBeingAccepted(Exception):
    """The task's request (a batch's, whose items are listed from its insert on) may still be
    between recording it and sending it: a cancellation then had its outcome give the
    task's in-flight slot back before the request took it, and the tenant's count stayed
    one too high for good (re-read of the batch cancel's fix). `retry_after_s`: as long as
    the request has run, no later than the end of the outbox grace."""

    def __init__(self, submission: Submission, *, now: datetime, grace: timedelta) -> None:
        self.retry_after_s = in_progress_retry_after(
            submission.created_at, until=submission.created_at + grace, now=now
        )
        super().__init__(
            f"Task {submission.task_id} is still being accepted; nothing was cancelled. "
            "Ask again shortly."
        )


class CancelRefused(StrEnum):
    UNKNOWN_TASK = "unknown_task"  # expired, never existed, refused, or another tenant's
    ALREADY_FINISHED = "already_finished"


async def cancel_task(
    task_id: str,
    *,
    tenant_id: str,
    submissions: Submissions,
    status: StatusReader,
    sender: CancelSender,
    now: datetime,
    grace: timedelta,
) -> CancelTask | CancelRefused:
    """The cancellation sent, or why none was; `DatabaseUnavailable` and `BrokerUnavailable`
    when the submission cannot be read or the broker did not confirm; `TaskBeingAccepted`
    while its request may still be sending it."""
    submission = await submissions.find(task_id, tenant_id=tenant_id)
    if submission is None:
        return CancelRefused.UNKNOWN_TASK
    if await _finished(submission, status):
        return CancelRefused.ALREADY_FINISHED  # a result-cache hit's answer included
    if _being_accepted(submission, now=now, grace=grace):
        raise TaskBeingAccepted(submission, now=now, grace=grace)
    cancel = cancel_command(CancelTarget.of(submission), now=now)
    await sender.cancel(cancel)
    return cancel


def cancel_command(target: CancelTarget, *, now: datetime) -> CancelTask:
    """The cancellation of the submission's latest generation, with what its failure event
    carries (`CancelTarget.of`: a submission of an earlier build has no key, no callback)."""
    return CancelTask(
        task_id=target.task_id,
        tenant_id=target.tenant_id,
        generation=target.generation,
        submitted_at=target.submitted_at,
        api_key_id=target.api_key_id,
        callback_url=target.callback_url,
        requested_at=now,
        not_before=target.not_before,
        occurred_at=now,
    )


def known_finished(target: CancelTarget) -> bool:
    """Finished as far as the gateway's own record says: answered from the result cache (any
    generation), or an outcome of its latest generation (or a later one) applied."""
    if target.answered_from_cache:
        return True
    finished = target.finished_generation
    if finished is None:
        return False
    # The generation right after a completion that is the latest outcome noted is a
    # re-score, which the scorer never cancels: 202 "cancelling" for it once the projection
    # showed it `queued` broke the API's 409 (found in review). One further on may be a DLQ
    # replay of a failure not noted here yet (an older replica applied it, or the outcome
    # consumer is behind): the status service is asked, as before (found in review too).
    rescore = target.completed_generation == finished and target.generation == finished + 1
    return finished >= target.generation or rescore


async def _finished(submission: Submission, status: StatusReader) -> bool:
    target = CancelTarget.of(submission)
    if known_finished(target):
        return True
    try:
        view = await status.find(submission.task_id, tenant_id=submission.tenant_id)
    except StatusUnavailable as error:
        log.warning("cancelling %s without its status: %r", submission.task_id, error)
        return False
    return view is not None and _shows_the_end_of(view, target.generation)


def _shows_the_end_of(view: TaskView, generation: int) -> bool:
    """Whether the status service's view shows `generation` ended: a terminal status of it or
    a later one, or an earlier generation's completion, which stands over a re-score (the
    scorer refuses to cancel that). Not an earlier generation's failure: the newer
    generation is its DLQ replay, which the view shows only once the projection hears of it,
    and which the scorer still cancels; a 409 told the client it had finished before it ran."""
    if not view.status.is_terminal:
        return False
    if view.sequence is None or generation_of(view.sequence) >= generation:
        return True
    return view.status is TaskStatus.COMPLETED


class BatchBeingRecorded(Exception):
    """The batch's request (or its replay) has not recorded every item yet, or may still be
    sending them: cancelling those it has would leave the rest to be sent and scored after a
    202, and cancelling any before its request took their slots left the tenant's count too
    high for good. `retry_after_s`: as long
    as the request has run, no later than the end of the batch's hold (`in_progress_retry_after`:
    a fixed second had a client ask some 600 times over a held batch; a review)."""

    def __init__(
        self, record: BatchRecord, *, recorded: int, now: datetime, grace: timedelta
    ) -> None:
        held_until = incomplete_batch_held_until(record.created_at, grace=grace)
        self.retry_after_s = in_progress_retry_after(record.created_at, until=held_until, now=now)
        counted = f"{recorded} of its {len(record.members)} items recorded"
        if now - record.created_at <= grace:
            why = f"is still being accepted ({counted}); nothing was cancelled. Ask again shortly."
        elif record.keyed:
            # Its request died: only a replay under its Idempotency-Key completes it.
            why = (
                f"was left incomplete by its request ({counted}): a replay of it with its "
                f"Idempotency-Key completes it, else it is refused whole at {rfc3339(held_until)}; "
                "nothing was cancelled."
            )
        else:  # no key: nothing can complete it (a review found the replay offered)
            why = (
                f"was left incomplete by its request ({counted}) and is refused whole at "
                f"{rfc3339(held_until)}, none of its items scored; nothing was cancelled."
            )
        super().__init__(f"Batch {record.batch_id} {why}")


@dataclass(frozen=True)
class BatchCancelled:
    """What a batch's cancellation sent: one `CancelTask` per item not known to be finished."""

    batch_id: str
    sent: tuple[CancelTask, ...]
    already_finished: int


async def cancel_batch(
    batch_id: str,
    *,
    tenant_id: str,
    batches: Batches,
    submissions: Submissions,
    sender: BatchCancelSender,
    now: datetime,
    grace: timedelta,
) -> BatchCancelled | None:
    """Cancel every item of the tenant's batch whose latest generation is not known to be
    finished (`known_finished`: the gateway's own record, never the status service, one
    request per item), all sent in one round of confirms; None for a batch the tenant has not
    (unknown, expired, refused, or another tenant's). Two reads: the batch, then its items'
    submissions without their texts. `BatchBeingRecorded` while its request has not recorded
    every item, nothing sent. `DatabaseUnavailable`, and `BrokerUnavailable` when not
    every cancellation was confirmed (some may be queued: sending it again is harmless, the
    scorer records a task's cancellation once). An item whose submission is gone (expired)
    counts as neither sent nor finished."""
    record = await batches.find(batch_id, tenant_id=tenant_id)
    if record is None:
        return None
    targets = await submissions.cancel_targets(
        batch_id, tenant_id=tenant_id, expected=len(record.members)
    )
    # Listed, and found, from its record's insert on: its items recorded after this read
    # would be sent uncancelled (a review), and those recorded may not be counted yet.
    unrecorded = _being_recorded(record) and len(targets) < len(record.members)
    if unrecorded or _may_be_sending(record, now=now, grace=grace):
        raise BatchBeingRecorded(record, recorded=len(targets), now=now, grace=grace)
    open_targets = [target for target in targets if not known_finished(target)]
    # Last item first: the items are queued, and scored, in their order, so cancellations in
    # that order trailed the scoring and each found its item just scored; from the end they
    # meet it, and every item they reach first is cancelled.
    position = {member.task_id: index for index, member in enumerate(record.members)}
    open_targets.sort(key=lambda target: position.get(target.task_id, 0), reverse=True)
    cancels = tuple(cancel_command(target, now=now) for target in open_targets)
    if cancels:
        # In the same round as the cancels (a broker slow to confirm costs one timeout, not
        # two): the scorers cancel the items they are handed without waiting for each item's
        # own cancellation, which comes through a queue of its own, one at a time
        # (`services/scorer/batch_cancels.py`).
        await asyncio.gather(
            sender.announce_batch_cancel(_announcement(batch_id, tenant_id, cancels, now)),
            sender.cancel_many(cancels),
        )
    return BatchCancelled(
        batch_id=batch_id, sent=cancels, already_finished=len(targets) - len(cancels)
    )


def _being_accepted(submission: Submission, *, now: datetime, grace: timedelta) -> bool:
    """A batch's item `accepting`, not sent by the outbox sweep, within the grace: its
    request may not have taken its slot yet (see `TaskBeingAccepted`). Not a task of its
    own: its id is known only from its 202, its slot taken before (one left `accepting` by
    a database blip after its 202 was refused a cancel; the re-read)."""
    return (
        submission.command is not None
        and submission.command.batch_id is not None
        and submission.state == SubmissionState.ACCEPTING
        and submission.sent_at is None
        and now - submission.created_at <= grace
    )


def _may_be_sending(record: BatchRecord, *, now: datetime, grace: timedelta) -> bool:
    """Whether the batch's request may still be between recording its items and sending
    them: `accepting`, not sent by the outbox sweep, within the grace. Its items' outcomes
    (cancelled before they were sent) then gave their in-flight slots back before the
    request took them, and the tenant's count stayed that much too high for good (review
    of batches)."""
    return (
        record.state == BatchState.ACCEPTING
        and not record.swept
        and now - record.created_at <= grace
    )


def _being_recorded(record: BatchRecord) -> bool:
    """Whether items of the batch may still be recorded: `accepting`, not noted recorded
    whole (records of earlier builds note nothing: taken for whole) and not sent by the
    outbox sweep. Not the item count alone: a batch the sweep sent stays `accepting`, and
    its first items' submissions expire before its record (a review)."""
    return record.left_unrecorded


def _announcement(
    batch_id: str, tenant_id: str, cancels: Sequence[CancelTask], now: datetime
) -> BatchCancelling:
    return BatchCancelling(
        task_id=new_id(),
        tenant_id=tenant_id,
        batch_id=batch_id,
        requested_at=now,
        generations={cancel.task_id: cancel.generation for cancel in cancels},
        occurred_at=now,
    )
