"""Runs of one job never overlap unless the job allows it (`concurrency`, default `forbid`).

An hourly roll-up whose chain of slices outlasted the hour started a second chain on the same
pending records, and every hour after it another, up to the consumer's slots, all doing the
same work and contending for it; a daily fan-out over a large catalogue did the same. Now a
run of a job that forbids overlapping runs holds its job's lease (`Firings`, a unique index:
two replicas cannot both take it) from its claim until it ends, and a firing that finds the
lease held is not started:

- a scheduled fire time is recorded as skipped, its reason "overlap: ..." shown as the run's
  error (`GET /admin/v1/cron/runs/{id}`, a job's `last_firing`); the run in progress does
  the work, and the next fire time after it ends runs as usual (Kubernetes' `Forbid`);
- a manual run is refused (`RunInProgress`, 409 naming the run in progress), and a replay
  of a dead letter keeps the letter (reported `skipped_in_progress`): an operator's run
  beside a chain is the duplicate work this prevents, and the operator can see why.

A fire time that finds the lease held by a run by hand still being published (`claimed`)
waits instead: it is asked again at the next tick, when that run has gone ahead or been
withdrawn (`Overlap.undecided`).

Two holders give way instead:

- a scheduled firing still `claimed` (never published: the broker was away) to a later fire
  time of its job, as the missed-firing policy has it (the latest runs);
- a run silent for longer than `stale_after` (`SCHEDULER_RUN_STALE_S`) is taken for dead
  (its message lost, say) and recorded failed ("abandoned"), so no crashed run holds its job
  for ever. A run's heartbeat is every write of its progress (claim, re-claim, publish, the
  start of each delivery, each retry recorded); a live run writes one at least every
  consumer timeout plus the longest back-off, which the setting must exceed. A run
  abandoned that was alive after all is dropped at its next delivery (it has ended).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from services.scheduler.firings import Firing, FiringState, FiringStore, LeaseTaken
from services.scheduler.jobs import Clock
from services.scheduler.schedule import ScheduledJob
from shared.contracts import rfc3339

log = logging.getLogger("scorebox.scheduler.overlap")

# Claims tried while the lease changes hands under us (a run ending, another replica's
# run starting); past them the lease is reported taken.
LEASE_TRIES = 3


@dataclass(frozen=True)
class Overlap:
    """A firing not started because `holder` is in progress."""

    holder: Firing

    @property
    def undecided(self) -> bool:
        """Whether the holder is a run by hand still being published: it may yet be withdrawn
        (the broker refused it), and a fire time skipped for it then ran nowhere (a
        walkthrough lost a minute's run so; a daily job with `skip` loses its day)."""
        return self.holder.manual and self.holder.state is FiringState.CLAIMED

    @property
    def reason(self) -> str:
        heard = self.holder.heartbeat_at
        since = "" if heard is None else f", last heard of at {rfc3339(heard)}"
        return (
            f"overlap: run {self.holder.run_id} of this job is in progress "
            f"({self.holder.state.value}{since}); concurrency policy forbid"
        )


@dataclass(frozen=True)
class Claim:
    """What to claim: a fire time of `job` (`manual`: a run by hand, `replay_of` a dead run)."""

    job: ScheduledJob
    scheduled_for: datetime
    owner: str
    manual: bool = False
    missed: int = 0
    replay_of: str | None = None


async def claim_unless_overlapping(
    claim: Claim, *, firings: FiringStore, clock: Clock, stale_after: timedelta
) -> Firing | Overlap | None:
    """Claim the fire time (None when another replica holds it), unless a run of a job that
    forbids overlapping runs is in progress (`Overlap`). Raises `LeaseTaken` when the lease
    kept changing hands."""
    for _ in range(LEASE_TRIES):
        try:
            return await firings.claim(
                claim.job.name,
                claim.scheduled_for,
                # Stamped now: a claim is stale `redispatch_after` after it.
                now=clock(),
                owner=claim.owner,
                manual=claim.manual,
                missed=claim.missed,
                replay_of=claim.replay_of,
                exclusive=claim.job.forbids_overlap,
            )
        except LeaseTaken:
            holder = await firings.active_run(claim.job.name)
            if holder is None:
                continue  # it ended meanwhile
            if not await _gave_way(holder, claim, firings=firings, clock=clock, stale=stale_after):
                return Overlap(holder)
    raise LeaseTaken(claim.job.name)


async def _gave_way(
    holder: Firing, claim: Claim, *, firings: FiringStore, clock: Clock, stale: timedelta
) -> bool:
    """Whether `holder` ended to let `claim` through: superseded, or abandoned as dead."""
    if _superseded_by(holder, claim):
        reason = f"superseded by the firing for {rfc3339(claim.scheduled_for)} (never published)"
        if await firings.supersede(holder.run_id, now=clock(), reason=reason):
            log.warning("job %s: run %s skipped: %s", holder.job, holder.run_id, reason)
            return True
        return False
    now = clock()
    silent_since = now - stale
    if holder.heartbeat_at is None or holder.heartbeat_at >= silent_since:
        return False
    reason = (
        f"abandoned: no sign of progress since {rfc3339(holder.heartbeat_at)} (longer "
        f"than SCHEDULER_RUN_STALE_S, {stale.total_seconds():g} s); its job's next run "
        "took its place"
    )
    if await firings.abandon(holder.run_id, silent_since=silent_since, now=now, reason=reason):
        log.error("job %s: run %s %s", holder.job, holder.run_id, reason)
        return True
    return False


def _superseded_by(holder: Firing, claim: Claim) -> bool:
    """A scheduled firing never published gives way to a later fire time of its job (the
    missed-firing policy runs the latest): it has not started, so nothing overlaps."""
    return (
        holder.state is FiringState.CLAIMED
        and not holder.manual
        and not claim.manual
        and holder.scheduled_for < claim.scheduled_for
    )
