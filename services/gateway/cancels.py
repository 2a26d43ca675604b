"""Cancelling a task before its model call: the gateway's side.

The gateway finds the caller's submission of the task (none: unknown, as for a poll, never
revealing another tenant's), refuses a task it knows is finished, and sends a confirmed
`CancelTask` for the task's latest generation to the scorer, which decides that generation as
failed with `cancelled` unless its model call has started (`services/scorer/cancels.py`).

Known finished: its submission records an outcome of that generation (or a later one), which
the gateway's outcome consumer notes in the write it makes for every outcome
(`Submissions.note_outcome`); a result-cache hit answered it (any generation: a re-score of a
completed task is not cancelled); or the status service says completed or failed. The
submission is asked first: the scorer's attempts store may have forgotten a generation that
finished long ago (`ATTEMPTS_RETENTION_S` shorter than the submission's life), and would then
record a second, contradicting outcome of it. The status service being unavailable does not
stop a cancellation of a generation with no outcome noted: the scorer finds a finished task
too late to cancel, and the client's poll shows how it ended.
"""

from __future__ import annotations

import logging
from datetime import datetime
from enum import StrEnum
from typing import Protocol

from services.gateway.errors import StatusUnavailable
from services.gateway.submissions import Submission, Submissions
from services.gateway.submit import StatusReader
from shared.contracts import CancelTask

log = logging.getLogger("scorebox.gateway")


class CancelSender(Protocol):
    """Sends a cancellation, confirmed (`services.gateway.publisher.TaskPublisher.cancel`);
    raises `BrokerUnavailable` otherwise."""

    async def cancel(self, cancel: CancelTask) -> None: ...


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
) -> CancelTask | CancelRefused:
    """The cancellation sent, or why none was; `DatabaseUnavailable` and `BrokerUnavailable`
    when the submission cannot be read or the broker did not confirm."""
    submission = await submissions.find(task_id, tenant_id=tenant_id)
    if submission is None:
        return CancelRefused.UNKNOWN_TASK
    if await _finished(submission, status):
        return CancelRefused.ALREADY_FINISHED
    cancel = cancel_command(submission, now=now)
    await sender.cancel(cancel)
    return cancel


def cancel_command(submission: Submission, *, now: datetime) -> CancelTask:
    """The cancellation of the submission's latest generation, with what its failure event
    carries (a submission of an earlier build without its command: no key, no callback)."""
    command = submission.command
    return CancelTask(
        task_id=submission.task_id,
        tenant_id=submission.tenant_id,
        generation=submission.generation,
        submitted_at=command.submitted_at if command else submission.created_at,
        api_key_id=command.api_key_id if command else None,
        callback_url=command.callback_url if command else None,
        requested_at=now,
        not_before=submission.not_before,
        occurred_at=now,
    )


async def _finished(submission: Submission, status: StatusReader) -> bool:
    if submission.cached_result is not None:
        return True
    finished = submission.finished_generation
    if finished is not None and finished >= submission.generation:
        return True
    try:
        view = await status.find(submission.task_id, tenant_id=submission.tenant_id)
    except StatusUnavailable as error:
        log.warning("cancelling %s without its status: %r", submission.task_id, error)
        return False
    return view is not None and view.status.is_terminal
