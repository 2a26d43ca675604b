"""Accepting submissions and answering polls: the gateway's handlers (no HTTP, no broker)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

from services.gateway.cache import (
    ResultCache,
    cache_key,
    cacheable,
    scored_by_key_model,
    scoring_model,
)
from services.gateway.errors import (
    BrokerUnavailable,
    DatabaseUnavailable,
    IdempotencyConflict,
    ReplayUnfinished,
    RequestInProgress,
    in_progress_retry_after,
)
from services.gateway.limits import LimitExceeded
from services.gateway.push import may_await_a_cached_completion
from services.gateway.refusals import Refusal, Refusals, may_have_been_written
from services.gateway.schemas import ScoreSubmission, named_rubric
from services.gateway.submissions import (
    BatchSize,
    KeyTaken,
    Submission,
    Submissions,
    SubmissionState,
    recently_due,
    request_hash,
)
from shared.contracts import (
    CACHED_COMPLETION_SEQUENCE,
    ScoreResult,
    ScoreText,
    TaskCompleted,
    TaskEvent,
    TaskFailed,
    TaskStatus,
    TaskView,
    new_id,
)

log = logging.getLogger("scorebox.gateway")
Clock = Callable[[], datetime]
# Records of an outbox pass read again (one `$in` by `_id`) before they are sent.
SWEEP_RECHECK_CHUNK = 50
# How far from its expiry a batch item must be for its batch's missing record to be read as
# discarded rather than expired: the clock skew tolerated between a replica and the server.
RECORD_CLOCK_MARGIN = timedelta(minutes=15)
# How long a chunk's sends may take before a send extends its batch again: the chunk's
# batches are extended to a retention past its start plus this, so that they outlive every
# item sent within it (each kept a retention from its own send).
CHUNK_ALLOWANCE = timedelta(minutes=5)
# A batch whose request died before recording every item is refused this long after it was
# made, two grace periods at least (`_incomplete_batches`): from the first one's end, a
# replay with its key may complete it.
INCOMPLETE_BATCH_HOLD = timedelta(minutes=10)


def incomplete_batch_held_until(created_at: datetime, *, grace: timedelta) -> datetime:
    """Until when a batch created at `created_at` whose request died before recording every
    item waits for a replay to complete it, before the outbox sweep refuses it whole."""
    return created_at + max(INCOMPLETE_BATCH_HOLD, 2 * grace)


class Publisher(Protocol):
    async def send(self, command: ScoreText) -> bool: ...
    async def withdraw(self, commands: Sequence[ScoreText]) -> None: ...
    async def announce_cached(self, command: ScoreText, result: ScoreResult) -> bool: ...


class StatusReader(Protocol):
    async def find(self, task_id: str, *, tenant_id: str) -> TaskView | None: ...


class InFlightGate(Protocol):
    """The per-tenant in-flight limit (`services.gateway.limits.InFlight`)."""

    @property
    def enabled(self) -> bool: ...
    async def acquire(self, tenant_id: str, tasks: int) -> None: ...
    async def refuse_if_full(self, tenant_id: str, tasks: int) -> None: ...
    async def release(self, tenant_id: str, task_id: str) -> None: ...


def counting(in_flight: InFlightGate | None) -> InFlightGate | None:
    """The gate when it counts tasks, else None (nothing to acquire, mark or release)."""
    return in_flight if in_flight is not None and in_flight.enabled else None


async def refuse_before_recording(
    gate: InFlightGate | None,
    tenant_id: str,
    tasks: int,
    *,
    idempotency_key: str | None,
    earlier: Callable[[str], Awaitable[object | None]],
) -> None:
    """`LimitExceeded` before a submission of `tasks` is recorded, when its tenant was
    refused lately and still has no room (`InFlight.refuse_if_full`). A request whose
    Idempotency-Key its tenant used already (`earlier` finds it) goes on, to be answered as
    its first request was; a lookup the database fails leaves that to the insert too."""
    if gate is None:
        return
    try:
        await gate.refuse_if_full(tenant_id, tasks)
    except LimitExceeded:
        if idempotency_key is None:
            raise
        try:
            found = await earlier(idempotency_key)
        except DatabaseUnavailable:
            return
        if found is None:
            raise


@dataclass(frozen=True)
class SubmitPolicy:
    max_attempts: int
    retention: timedelta
    default_model: str = ""  # what scores a submission naming no model (its cache key)
    # How long a submission left `accepting` may still be its request's (`OUTBOX_GRACE_S`):
    # past it, the outbox sweep sends it, and a replay of its key answers with it.
    in_progress_for: timedelta = timedelta(seconds=60)


@dataclass(frozen=True)
class Submitted:
    task_id: str
    status: TaskStatus
    created: bool  # False: an earlier request with the same Idempotency-Key
    cached_result: ScoreResult | None = None
    # When the task was submitted (a cached result's completion is dated so too).
    submitted_at: datetime | None = None
    # Its command, for what a view of it describes (None: a record of an earlier build).
    command: ScoreText | None = None


async def submit_score(
    submission: ScoreSubmission,
    *,
    tenant_id: str,
    idempotency_key: str | None,
    submissions: Submissions,
    publisher: Publisher,
    cache: ResultCache,
    policy: SubmitPolicy,
    clock: Clock,
    refusals: Refusals,
    api_key_id: str | None = None,
    in_flight: InFlightGate | None = None,
) -> Submitted:
    """Record the submission, then publish it; answer only once the broker confirmed.

    If the broker did not take the command, the record is discarded and `BrokerUnavailable`
    raised: the client sees 503 and nothing was kept (what the database does not remove at
    once, or an insert that failed without an answer, is written off later: `refusals`).
    A command written but not confirmed may still be queued: the submission is kept for the
    outbox sweep and the task accepted.
    A result-cache hit completes the task at once (its announcement unconfirmed: answered all
    the same, and kept for the outbox sweep, which announces it again; never scored).
    A task to score counts against its tenant's `in_flight` limit (`LimitExceeded`: 429,
    nothing kept) until its outcome reaches the gateway.
    """
    now = clock()
    digest = request_hash(submission.model_dump(mode="json"))
    command = ScoreText(
        task_id=new_id(),
        tenant_id=tenant_id,
        text=submission.text,
        rubric=named_rubric(submission.rubric),
        model=submission.model,
        metadata=submission.metadata,
        max_attempts=policy.max_attempts,
        not_before=submission.due_at(now),
        submitted_at=now,
        occurred_at=now,
        callback_url=submission.callback_url,
        api_key_id=api_key_id,
    )
    model = scoring_model(command.model, policy.default_model)
    key = cache_key(command.text, command.rubric, model)
    cached = None
    if submission.use_cache and command.not_before is None:
        cached = await _cached_result(cache, tenant_id=tenant_id, key=key, now=now)
    gate = None if cached is not None else counting(in_flight)
    await refuse_before_recording(
        gate,
        tenant_id,
        1,
        idempotency_key=idempotency_key,
        earlier=lambda key: submissions.find_by_key(key, tenant_id=tenant_id),
    )
    # The sweep of this process keeps off the task while its request runs here: it sends what
    # an interrupted request left, and this one may yet refuse what it recorded
    # (withdrawing, releasing and deleting take round trips that may outlast its grace).
    with refusals.holding((command.task_id,)):
        return await _record_and_send(
            command,
            cached,
            gate,
            digest=digest,
            idempotency_key=idempotency_key,
            submissions=submissions,
            publisher=publisher,
            policy=policy,
            refusals=refusals,
            now=now,
            key=key,
            key_model=model,
        )


async def _cached_result(
    cache: ResultCache, *, tenant_id: str, key: str, now: datetime
) -> ScoreResult | None:
    """The cached result answering the submission, if any. A lookup the database fails is a
    miss: it is the request's first database call, made before the insert that finds its
    Idempotency-Key taken, and its 503 ("nothing was kept") told a client replaying the key
    of an accepted task to submit again (without the key: scored twice). The insert's own
    failure keeps its answer."""
    try:
        found = await cache.find(tenant_id=tenant_id, key=key, now=now)
    except DatabaseUnavailable as error:
        log.warning("result-cache lookup failed, taken as a miss: %r", error)
        return None
    return None if found is None else found.model_copy(update={"cached": True})


async def _record_and_send(
    command: ScoreText,
    cached: ScoreResult | None,
    gate: InFlightGate | None,
    *,
    digest: str,
    idempotency_key: str | None,
    submissions: Submissions,
    publisher: Publisher,
    policy: SubmitPolicy,
    refusals: Refusals,
    now: datetime,
    key: str,
    key_model: str,
) -> Submitted:
    try:
        await submissions.insert(
            command,
            request_hash=digest,
            idempotency_key=idempotency_key,
            retention=policy.retention,
            cache_key=key,
            cache_model=key_model,
            counted=gate is not None,
            cached_result=cached,
        )
    except KeyTaken:
        assert idempotency_key is not None
        return await _earlier_submission(
            idempotency_key,
            digest,
            command.tenant_id,
            submissions,
            in_progress=lambda earlier: _may_be_in_progress(earlier, policy, refusals, now),
            in_progress_for=policy.in_progress_for,
            now=now,
        )
    except DatabaseUnavailable as error:
        if may_have_been_written(error):
            refusals.note(_refusal_of(command))  # its insert may land yet
        raise
    undo = _Undo(command, submissions, refusals)
    if cached is not None:
        await _announce_cached_or_discard(command, cached, publisher, undo)
        return Submitted(
            command.task_id,
            TaskStatus.COMPLETED,
            created=True,
            cached_result=cached,
            submitted_at=command.submitted_at,
            command=command,
        )
    await _admit_or_discard(command, in_flight=gate, undo=undo)
    await _publish_or_discard(command, publisher=publisher, in_flight=gate, undo=undo)
    return Submitted(command.task_id, _initial_status(command, now), created=True)


def _refusal_of(command: ScoreText, *, counted: bool = False) -> Refusal:
    return Refusal(command.tenant_id, (command.task_id,), counted=counted)


@dataclass(frozen=True)
class _Undo:
    """Undoing an acceptance: the record goes, or is written off later when it cannot."""

    command: ScoreText
    submissions: Submissions
    refusals: Refusals

    async def discard(self) -> None:
        try:
            await self.submissions.discard(self.command.task_id)
        except DatabaseUnavailable:
            log.warning("task %s refused, not discarded: written off later", self.command.task_id)
            self.refusals.note(_refusal_of(self.command))

    async def give_up(self, in_flight: InFlightGate | None) -> None:
        """Release the task's in-flight slot, then forget the submission."""
        if in_flight is not None:
            try:
                await in_flight.release(self.command.tenant_id, self.command.task_id)
            except DatabaseUnavailable:
                log.warning("task %s: slot not released, written off later", self.command.task_id)
                self.refusals.note(_refusal_of(self.command, counted=True))
                return
        await self.discard()


async def _announce_cached_or_discard(
    command: ScoreText, result: ScoreResult, publisher: Publisher, undo: _Undo
) -> None:
    try:
        confirmed = await publisher.announce_cached(command, result)
    except BrokerUnavailable:
        await undo.discard()
        raise
    with contextlib.suppress(DatabaseUnavailable):
        if confirmed:
            await undo.submissions.mark_accepted(command.task_id)
        else:
            # Its events may arrive yet, or never: the outbox sweep announces them again
            # (idempotent: the same sequence, delivery ids and usage record).
            await undo.submissions.mark_unconfirmed(command.task_id)


async def _admit_or_discard(
    command: ScoreText, *, in_flight: InFlightGate | None, undo: _Undo
) -> None:
    if in_flight is None:
        return
    try:
        await in_flight.acquire(command.tenant_id, 1)
    except LimitExceeded:
        await undo.discard()
        raise
    except DatabaseUnavailable as error:
        if may_have_been_written(error):
            await undo.give_up(in_flight)
        else:  # never sent (queued past its deadline, no server): no slot to give back
            await undo.discard()
        raise


async def _publish_or_discard(
    command: ScoreText, *, publisher: Publisher, in_flight: InFlightGate | None, undo: _Undo
) -> None:
    try:
        confirmed = await publisher.send(command)
    except BrokerUnavailable:
        await publisher.withdraw([command])
        await undo.give_up(in_flight)
        raise
    try:
        if confirmed:
            await undo.submissions.mark_accepted(command.task_id)
        else:
            # Written, not confirmed: it may reach its queue yet (a blocked connection
            # delivers it once unblocked), so refusing it would be a lie. The outbox sweep
            # sends it again and the scorer claims it once.
            log.warning("task %s unconfirmed; the outbox sweep re-sends it", command.task_id)
            await undo.submissions.mark_unconfirmed(command.task_id)
    except DatabaseUnavailable:
        log.warning("task %s left `accepting`; the outbox sweep re-sends it", command.task_id)


async def _left_to_the_sweep(
    earlier: Submission, submissions: Submissions, *, in_progress: bool, key: str
) -> bool:
    """Whether a replay may answer a submission left `accepting` as accepted: not while its
    request may still run, and only once marked for the sweep, which another replica's
    pending refusal then leaves alone (answered 200, the record was written off after all:
    404, and the key free again; found in review)."""
    if in_progress:
        return False
    try:
        return await submissions.leave_to_the_sweep(earlier.task_id)
    except DatabaseUnavailable as error:
        raise ReplayUnfinished(key) from error


def _may_be_in_progress(
    earlier: Submission, policy: SubmitPolicy, refusals: Refusals, now: datetime
) -> bool:
    """Whether a submission left `accepting` may still be its request's: younger than the
    grace, or held here (its request runs, or its refusal waits to be written off)."""
    young = earlier.created_at > now - policy.in_progress_for
    return young or refusals.holds(earlier.task_id)


async def _earlier_submission(
    idempotency_key: str,
    digest: str,
    tenant_id: str,
    submissions: Submissions,
    *,
    in_progress: Callable[[Submission], bool],
    in_progress_for: timedelta,
    now: datetime,
) -> Submitted:
    """The submission the key names (its insert collided on the key), as recorded: answered
    from the result cache (its result), delayed, or queued. The route answers with the
    status service's view, and with this when it cannot read one (every replay read
    `queued` then, a cached result's and a delayed task's too, found in review).

    A lookup the database fails is `ReplayUnfinished` (409, retry with the same key), not a
    503 ("nothing was kept"): the key's first request was received and may have been
    answered 202 and be being scored, and a client resubmitting without the key had its text
    scored twice.

    A submission still `accepting` is the key's request in progress (409, retry shortly)
    only while it may be (`in_progress`): past the outbox grace, the sweep sends it (its
    request died after the send, or could not mark it), and the replay answers with it, as
    a batch's does. A replay answered 409 for as long as the sweep could not send it (the
    broker refusing it), and a client whose retries ran out resubmitted without the key
    (found in review)."""
    try:
        earlier = await submissions.find_by_key(idempotency_key, tenant_id=tenant_id)
    except DatabaseUnavailable as error:
        raise ReplayUnfinished(idempotency_key) from error
    if earlier is not None and earlier.request_hash != digest:
        raise IdempotencyConflict(idempotency_key)  # at once, as for a batch
    if earlier is None:
        raise RequestInProgress(idempotency_key)  # discarded just now: the client may retry
    if earlier.state is SubmissionState.ACCEPTING and not await _left_to_the_sweep(
        earlier, submissions, in_progress=in_progress(earlier), key=idempotency_key
    ):
        until = earlier.created_at + in_progress_for
        retry_after_s = in_progress_retry_after(earlier.created_at, until=until, now=now)
        raise RequestInProgress(idempotency_key, retry_after_s=retry_after_s)
    return Submitted(
        earlier.task_id,
        _status_as_recorded(earlier, now),
        created=False,
        cached_result=earlier.cached_result,
        submitted_at=earlier.created_at,
        command=earlier.command,
    )


def _initial_status(command: ScoreText, now: datetime) -> TaskStatus:
    if command.not_before is not None and command.not_before > now:
        return TaskStatus.SCHEDULED
    return TaskStatus.QUEUED


async def read_score(
    task_id: str,
    *,
    tenant_id: str,
    status: StatusReader,
    submissions: Submissions,
    clock: Clock,
    window: timedelta,
) -> TaskView | None:
    """The task as the status service sees it, or as we recorded it if it has not yet heard.

    The fallback gives read-your-writes: a poll right after the 202 never answers 404. It is
    limited to young submissions, so a finished task that expired from the projection reads
    as 404 rather than as queued again. A task the status service shows at its acceptance
    within `window` may be a result-cache hit whose completion it has not applied (the
    outbox sweep announces it again after `OUTBOX_GRACE_S`, later when the broker still
    refuses it).
    """
    view = await status.find(task_id, tenant_id=tenant_id)
    now = clock()
    if view is not None:
        if not _may_await_a_cached_completion(view, now=now, window=window):
            return view
        return await _with_cached_completion(view, submissions, tenant_id=tenant_id)
    submission = await submissions.find(task_id, tenant_id=tenant_id)
    if submission is None or not recently_due(submission, now=now, window=window):
        return None
    return _view_of_submission(submission, now)


async def _with_cached_completion(
    view: TaskView, submissions: Submissions, *, tenant_id: str
) -> TaskView:
    """The status service's view, completed by the cache hit that answered the task, if one
    did. The gateway's own database away, the view is the answer: it was one before."""
    try:
        cached = await submissions.cached_result(view.task_id, tenant_id=tenant_id)
    except DatabaseUnavailable as error:
        log.warning("%s read without its submission: %r", view.task_id, error)
        return view
    if cached is None:
        return view
    return view.model_copy(
        update={
            "status": TaskStatus.COMPLETED,
            "result": cached,
            "sequence": CACHED_COMPLETION_SEQUENCE,
        }
    )


def _may_await_a_cached_completion(view: TaskView, *, now: datetime, window: timedelta) -> bool:
    """Whether the status service shows only the acceptance of what may be a result-cache
    hit, whose completion (a publish of its own) it has not applied: answered `completed`
    by its POST, the task read `queued` with no result until the outbox sweep announced the
    completion again (found in review). Only then is the submission read: a young task at
    its acceptance."""
    return may_await_a_cached_completion(
        view.status, view.sequence, view.created_at, now=now, window=window
    )


def _status_as_recorded(submission: Submission, now: datetime) -> TaskStatus:
    if submission.cached_result is not None:  # as the submission's own answer showed it
        return TaskStatus.COMPLETED
    if submission.not_before is not None and submission.not_before > now:
        return TaskStatus.SCHEDULED
    return TaskStatus.QUEUED


def _view_of_submission(submission: Submission, now: datetime) -> TaskView:
    """The task as the gateway recorded it, as the status service shows it once it has heard
    (what it describes included: the POST and the first polls showed no rubric, model nor
    metadata, found in a walkthrough)."""
    cached = submission.cached_result is not None
    return TaskView(
        task_id=submission.task_id,
        status=_status_as_recorded(submission, now),
        attempts=0,
        created_at=submission.created_at,
        updated_at=submission.created_at,
        result=submission.cached_result,
        not_before=submission.not_before,
        sequence=CACHED_COMPLETION_SEQUENCE if cached else None,
        **described_by(submission.command),
    )


def described_by(command: ScoreText | None) -> dict[str, Any]:
    """What a task's view describes of its command (nothing for a record without one)."""
    if command is None:
        return {}
    return {"rubric": command.rubric, "model": command.model, "metadata": command.metadata}


class SweptBatches(Protocol):
    """The batch records the outbox sweep consults (`services.gateway.batches.Batches`)."""

    async def states(self, batch_ids: Sequence[str]) -> dict[str, str]: ...
    async def unsent_sizes(self, batch_ids: Sequence[str]) -> dict[str, BatchSize]: ...
    async def abandon_unrecorded(self, batch_id: str, *, now: datetime) -> bool: ...
    async def outlive_sends(
        self, batch_ids: Sequence[str], *, sent_at: datetime, retention: timedelta
    ) -> None: ...


async def sweep_outbox(
    *,
    submissions: Submissions,
    publisher: Publisher,
    clock: Clock,
    grace: timedelta,
    refusals: Refusals,
    retention: timedelta,
    batches: SweptBatches,
    held: HeldBatches | None = None,
) -> int:
    """Send submissions left `accepting` by an interrupted request, or `unconfirmed` by a
    publish the broker did not confirm; returns how many the broker confirmed (the others
    stay for the next sweep). Refused ones not yet written off are not sent; those sent are
    kept at least `retention` from then.

    The pass reads its list once, and sending it takes a broker round trip per record, so a
    record's request held here when the list was read may have refused it since (503,
    "nothing was kept"), deleted it, and let go of it. So each chunk of the list, once its
    records are no longer held, is read again by `_id` (`Submissions.still_unsent`), and
    only those still unsent are sent: a request of this process that holds a task no longer
    has finished with its record, so that read is its last word. The pass ends at the first
    send the broker does not confirm.

    Two more things per chunk: a batch item left `accepting` whose batch was refused is
    written off, not sent, and one whose batch is held for a replay stays
    (`_without_refused_batch_items`); the batches of the items about to be sent are let live
    a retention from then (`_outlive_the_chunk`). The batches held are left out of the next
    passes' lists (`held`, kept by the caller across passes): their items, the oldest unsent,
    filled the list of 500 on every pass of the hold, and nothing else was sent (a review)."""
    sent = 0
    held = held or HeldBatches()
    listed = await submissions.interrupted(
        older_than=clock() - grace, excluding_batches=await _still_held(held, batches, clock())
    )
    for start in range(0, len(listed), SWEEP_RECHECK_CHUNK):
        chunk = [
            submission
            for submission in listed[start : start + SWEEP_RECHECK_CHUNK]
            if submission.command is not None and not refusals.holds(submission.task_id)
        ]
        if not chunk:
            continue
        unsent = await submissions.still_unsent([submission.task_id for submission in chunk])
        chunk = [submission for submission in chunk if submission.task_id in unsent]
        chunk = await _without_refused_batch_items(
            chunk, batches, submissions, now=clock(), grace=grace, held=held
        )
        # The chunk's batches outlive every send of it made within the allowance; a slower
        # send extends its own batch again.
        allowed_until = clock() + CHUNK_ALLOWANCE
        await _outlive_the_chunk(chunk, batches, sent_at=allowed_until, retention=retention)
        for submission in chunk:
            # Held again since (a refusal noted meanwhile): not to be sent, as before.
            if refusals.holds(submission.task_id):
                continue
            assert submission.command is not None
            if not await _send_again(submission.command, submission.cached_result, publisher):
                # The broker takes nothing now (an alarm makes each send wait out its whole
                # timeout): the rest waits for the next pass. Sending on, a pass of 500 took
                # over an hour, and the write-offs and batch holds after it waited as long.
                return sent
            sent_at = clock()
            if sent_at > allowed_until:
                await _outlive_the_chunk(
                    [submission], batches, sent_at=sent_at, retention=retention
                )
            await submissions.mark_accepted(
                submission.task_id, sent_at=sent_at, retention=retention
            )
            sent += 1
    return sent


async def _outlive_the_chunk(
    chunk: Sequence[Submission], batches: SweptBatches, *, sent_at: datetime, retention: timedelta
) -> None:
    """Let the batches of a chunk about to be sent live `retention` from `sent_at` at least
    (one write), before the sends: a batch whose look settled it just after the sweep sent
    its last items expired about an hour later, its key free again. Written first, a
    failure leaves the items unsent."""
    batch_ids = {
        submission.command.batch_id
        for submission in chunk
        if submission.command is not None and submission.command.batch_id is not None
    }
    if batch_ids:
        await batches.outlive_sends(sorted(batch_ids), sent_at=sent_at, retention=retention)


async def _without_refused_batch_items(
    chunk: list[Submission],
    batches: SweptBatches,
    submissions: Submissions,
    *,
    now: datetime,
    grace: timedelta,
    held: HeldBatches,
) -> list[Submission]:
    """`chunk` less the items of refused batches, which are written off here (tombstones, as
    `refusals.write_off` makes them: never sent, key freed, in-flight mark dropped, their
    slots having been released before the batch went). One `$in` read of the chunk's batches.

    A batch's record goes before its items when it is refused (`_discard` deletes it,
    `write_off` makes it a tombstone), so that a replay that accepted it meanwhile keeps
    them; an item left `accepting` after its batch went is one whose refusal stopped in
    between: its process died (the refusal was in memory only), or it runs on another
    replica. Sent, it was scored for a client told nothing was kept, whose retry with the
    key, free again, created the batch anew: every text scored twice.

    Only `accepting` items: an `unconfirmed` one belongs to a batch that was accepted, which
    no refusal removes. A missing record is taken as discarded only while it cannot have
    expired: the item's own expiry set at its insert (`expires_once_sent`, its batch's
    creation plus the retention then in force, as the record's) is more than
    `RECORD_CLOCK_MARGIN` away. Measured by the retention now in force, a retention raised
    since (or a replica's clock behind the server's) wrote off the items of an accepted
    batch whose record had expired unheld: tasks answered 202, never scored. An item of an
    earlier build without that expiry is sent as before.

    Nor are the items of a batch whose request died before it recorded them all
    (`_incomplete_batches`): held while a replay of its request may still complete it,
    refused after that, all or nothing."""
    candidates = {
        submission.command.batch_id
        for submission in chunk
        if submission.command is not None
        and submission.command.batch_id is not None
        and submission.state is SubmissionState.ACCEPTING
    }
    if not candidates:
        return chunk
    states = await batches.states(sorted(candidates))
    refused = {
        batch_id
        for batch_id in candidates
        if states.get(batch_id) == SubmissionState.ABANDONED.value
    }
    accepting = sorted(b for b in candidates if states.get(b) == SubmissionState.ACCEPTING.value)
    holding, refused_now = await _incomplete_batches(
        accepting, batches, submissions, now=now, grace=grace
    )
    for batch_id, until in holding.items():
        held.hold(batch_id, until=until)
    refused |= refused_now
    chunk = [s for s in chunk if s.command is None or s.command.batch_id not in holding]
    missing = candidates - states.keys()
    orphans = tuple(
        submission.task_id
        for submission in chunk
        if submission.command is not None
        and submission.state is SubmissionState.ACCEPTING
        and (
            submission.command.batch_id in refused
            or (
                submission.command.batch_id in missing
                and _record_cannot_have_expired(submission, now)
            )
        )
    )
    if not orphans:
        return chunk
    log.warning("writing off %d unsent item(s) of refused batches, not sent", len(orphans))
    await submissions.abandon(orphans, now=now)
    written_off = set(orphans)
    return [submission for submission in chunk if submission.task_id not in written_off]


async def _incomplete_batches(
    batch_ids: Sequence[str],
    batches: SweptBatches,
    submissions: Submissions,
    *,
    now: datetime,
    grace: timedelta,
) -> tuple[dict[str, datetime], set[str]]:
    """Of these batches still `accepting`, those whose request died before it recorded every
    item: held (their items neither sent nor written off), until when, and refused here
    (tombstones).

    Such a request published nothing and answered nothing (it records all items before its
    first publish), and only a replay with its `Idempotency-Key` can record the missing items
    (`_complete_interrupted`, from the end of the grace period). The sweep sent the recorded
    ones all the same: a walkthrough's batch of 1,000, its gateway killed while recording
    it, was listed with 200 items scored and 800 `queued`, then `expired`, never to run, and
    a client without a key could do nothing about it. Now the batch waits for a replay
    (`INCOMPLETE_BATCH_HOLD`), then is refused as a whole, the record first, its key freed:
    a replay after that records the batch anew. The refusal is one conditional write that
    a replay's acceptance or the request's own `mark_recorded` (a request alive but slow
    beyond the hold) excludes, whichever comes first. A batch the sweep has sent items of
    (an earlier build) is sent on, as before."""
    sizes = await batches.unsent_sizes(batch_ids)
    recorded = await submissions.recorded_per_batch(sorted(sizes))
    incomplete = {b: size for b, size in sizes.items() if recorded.get(b, 0) < size.items}
    refused = set()
    holding = {}
    for batch_id, size in sorted(incomplete.items()):
        held_until = incomplete_batch_held_until(size.created_at, grace=grace)
        if held_until >= now:
            holding[batch_id] = held_until
        elif await batches.abandon_unrecorded(batch_id, now=now):
            log.warning(
                "batch %s: its request died after recording %d of its %d items; refused",
                batch_id,
                recorded.get(batch_id, 0),
                size.items,
            )
            refused.add(batch_id)
    return holding, refused


async def _still_held(held: HeldBatches, batches: SweptBatches, now: datetime) -> list[str]:
    """The batches `held` holds that are still incomplete: one a replay completed and
    accepted meanwhile (on any replica) is let go at once, for its items to be sent, not
    left out until its hold ended (a review)."""
    holding = held.current(now)
    if not holding:
        return []
    still = await batches.unsent_sizes(holding)
    held.let_go(set(holding) - still.keys())
    return sorted(still)


@dataclass
class HeldBatches:
    """The batches the outbox sweep holds for a replay (`_incomplete_batches`), until when,
    in this process: left out of its lists meanwhile (`sweep_outbox`)."""

    until: dict[str, datetime] = field(default_factory=dict)

    def hold(self, batch_id: str, *, until: datetime) -> None:
        self.until[batch_id] = until

    def let_go(self, batch_ids: Collection[str]) -> None:
        for batch_id in batch_ids:
            self.until.pop(batch_id, None)

    def current(self, now: datetime) -> list[str]:
        """The batches held at `now` (those whose hold ended are forgotten)."""
        self.until = {batch_id: end for batch_id, end in self.until.items() if end >= now}
        return sorted(self.until)


def _record_cannot_have_expired(item: Submission, now: datetime) -> bool:
    """Whether the record of `item`'s batch, written just before it with the same retention,
    is still within that retention, by a margin for the clocks."""
    insert_expiry = item.expires_once_sent
    if insert_expiry is None:
        return False
    # At most a quarter of a short retention, so that the margin leaves the rule some of it.
    margin = min(RECORD_CLOCK_MARGIN, (insert_expiry - item.created_at) / 4)
    return now < insert_expiry - margin


async def _send_again(command: ScoreText, cached: ScoreResult | None, publisher: Publisher) -> bool:
    """A result-cache hit is announced again (its events are idempotent), never scored: its
    client was answered 200 with the cached result, and the command sent instead called the
    model and replaced that result (and the callback's) with another."""
    if cached is not None:
        return await publisher.announce_cached(command, cached)
    return await publisher.send(command)


@dataclass
class OutcomeProgress:
    """What one handling of an outcome has done so far, across its tries."""

    released: bool = False


async def settle_outcome(
    event: TaskEvent,
    *,
    submissions: Submissions,
    in_flight: InFlightGate | None,
    cache: ResultCache,
    now: datetime,
    progress: OutcomeProgress | None = None,
) -> None:
    """The gateway's part of a task's end (`task.completed` or `task.failed`): release its
    in-flight slot if it holds one; note the generation that finished (`cancel_task` refuses
    it from then on); for a completion also note the task's generation and put its result
    into the cache under its submission's key, when the scorer asked for the model that key
    names (`scored_by_key_model`). Idempotent: redeliveries and duplicates change nothing
    more (see `limits` for the slot).

    `progress` carries what a failed try did to the next: a try that released the slot and
    then failed to remove the mark does not release again (a release is idempotent only
    while the tenant's counter remembers the task among its latest releases).
    """
    progress = progress or OutcomeProgress()
    owner = await submissions.owner(event.task_id)
    if owner is None:
        # Expired before its outcome (retries waiting out long Retry-Afters, a day of
        # backlog): whether it was counted went with it. A first run's outcome releases all
        # the same: the count may under-count, never keep a slot for good (it did).
        if in_flight is not None and event.generation == 0 and not progress.released:
            await in_flight.release(event.tenant_id, event.task_id)
            progress.released = True
        return
    completed = event if isinstance(event, TaskCompleted) else None
    if owner.counted and in_flight is not None and not progress.released:
        await in_flight.release(owner.tenant_id, event.task_id)
        progress.released = True
    await submissions.note_outcome(
        event.task_id,
        generation=None if completed is None else completed.generation,
        finished=event.generation if isinstance(event, TaskCompleted | TaskFailed) else None,
        uncount=owner.counted and in_flight is not None,
        completed=None if completed is None else completed.generation,
    )
    if completed is None or owner.cache_key is None or not cacheable(completed.result):
        return
    if not scored_by_key_model(
        requested_model=completed.requested_model,
        result=completed.result,
        key_model=owner.cache_model,
    ):
        cache.other_model.note(
            event.task_id,
            scored_by=completed.requested_model or completed.result.model,
            keyed_by=owner.cache_model,
        )
        return
    await cache.remember(
        tenant_id=owner.tenant_id,
        key=owner.cache_key,
        result=completed.result,
        task_id=event.task_id,
        now=now,
    )
