"""Delivering one webhook: the delivery consumer's handler (no broker, no HTTP framework).

`deliver_webhook` claims the delivery in the ledger, checks the destination (SSRF guard),
signs the body for this attempt and POSTs it, then records and returns what the broker
adapter must do:

- `Done`: nothing more (delivered, cancelled, refused by its receiver, or already
  delivered/decided elsewhere).
- `Send`: publish this command (the next attempt after a back-off, or the same one later
  when it is not yet due, another consumer holds it, or its destination is busy), then ack.
- `GiveUp`: copy the message to the dead-letter queue with the reason, then ack.

2xx is delivered. 3xx (redirects are not followed) and 4xx other than 408/429 are permanent,
and so is an unsafe destination: the delivery is recorded failed with the reason and ends
there (`Done`). Those are the tenant's receiver's doing, not ours, and the DLQ, which
operators are alerted on and nothing drains, is kept for ours. 5xx, 408, 429, timeouts and
connection failures are retried with exponential back-off and jitter (Retry-After wins, up to
the cap) until `max_attempts`. Then a delivery whose receiver answered its last attempt (5xx,
408, 429), or whose host DNS said does not exist or has no address (NXDOMAIN, NODATA), is
recorded failed and ends (`Done`), the tenant's doing as a refusal is; one that got no answer
(DNS timeout or failure, connect, TLS, timeout: perhaps our egress) is dead-lettered.
`at_delivery_limit` decides for a message its consumers kept dying or crashing on, instead of
the broker dead-lettering it unexplained.

A dead letter moved back to the queue (once its cause is mended) is tried again
(`try_moved_back_letter_again`): when its delivery's record says its attempt was given up,
the record is reopened for a fresh round of as many attempts as the last one had, numbered
on from the next, with the back-off starting over; one whose record is gone (past
retention) is sent as such a round too, as a delivery the ledger forgot is sent. One
recorded delivered, or gone on since (another copy of the letter reopened it), is handled
as any copy of its attempt: dropped, or the recorded decision carried out.

A failure alert follows its tenant's setting at every attempt, not the URL its command
carries: once removed, the delivery is cancelled unsent; once changed, it goes to the new URL.

At most `WEBHOOK_CONCURRENCY_PER_HOST` POSTs of this process are in flight to one destination
and `WEBHOOK_CONCURRENCY_PER_TENANT` for one tenant, and a tenant holding a slot takes none of
the reserve kept for idle tenants (`hosts.py`). A delivery whose destination or tenant has
no slot free is deferred before its claim: sent again later as a fresh copy (`Send`;
`PUT_OFF_DELAY`, doubling with each deferral of the attempt up to `PUT_OFF_MAX_DELAY`),
nothing recorded, its attempt not counted, its consumer slot freed at
once for other destinations and tenants. A redelivery goes the same way once what its
attempt already decided is checked (and carried out, if anything): its copy carries the
deliveries counted so far (`x-scorebox-earlier-deliveries`), so a message that keeps
killing its consumers still reaches the queue's delivery limit.

A claim's lease counts from just before its write, and covers the POST and the database
calls around it (`NotifierSettings.lease_s`). If, the claim made, the DNS check done and the
keyring read, less of it is left than the longest request (`post_time`), the attempt
is not POSTed on a claim that could lapse mid-POST (another copy would claim it then and POST
too): it is put off the same way, its claim left to run out, or to be taken over at once by
this process's own next copy.
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

import orjson

from services.notifier.errors import (
    DeliveryRejected,
    NoSuchHost,
    PermanentDeliveryError,
    ReceiverUnavailable,
    TransientDeliveryError,
)
from services.notifier.hosts import (
    DEFAULT_CONCURRENCY,
    DEFAULT_PER_HOST,
    DEFAULT_PER_TENANT,
    Slots,
    TenantSlots,
    destination_of,
    host_share,
    share_key,
)
from services.notifier.keyring import Keyring
from services.notifier.ledger import DeliveryRecord, DeliveryState, Ledger
from services.notifier.metrics import NotifierMetrics
from services.notifier.registry import FailureAlerts
from services.notifier.sender import ReceiverAnswer
from services.notifier.signing import signed_headers
from services.notifier.ssrf import Destination, WebhookGuard
from shared.backoff import capped_exponential_s, jittered_s
from shared.clock_offset import wall_clock
from shared.contracts import DeliverWebhook, WebhookPurpose, new_id
from shared.http import parse_retry_after
from shared.in_hand import InHand
from shared.runtime import HOLD_POLL_S, keep_trying_database, wait_for_claim
from shared.settings import BROKER_CONSUMER_TIMEOUT_S
from shared.topology import wait_tier_for

Clock = Callable[[], datetime]
ALERT_REMOVED = "cancelled: the tenant removed its failure alert"
# A delivery sent down the wait ladder again, not due yet: once for each tier it passes.
NOT_YET_DUE = "not yet due"
# How long a delivery put off (its destination or tenant busy) first waits: the wait ladder's
# shortest tier, so a slot freed on a healthy receiver is taken again about as soon as it is.
# Each deferral of the same attempt doubles it, up to PUT_OFF_MAX_DELAY: a backlog of
# thousands for a receiver that hangs would otherwise pass through the broker thousands of
# times a second.
PUT_OFF_DELAY = timedelta(seconds=1)
PUT_OFF_MAX_DELAY = timedelta(seconds=60)
# Why a delivery is put off unsent: its label in `scorebox_webhook_deferred_total`, and why.
PUT_OFF_BECAUSE = {
    "host_busy": "its destination has no slot free",
    "host_share_busy": "its tenant holds its share of its destination's slots",
    "tenant_busy": "its tenant has no slot free",
    "tenant_reserve": "its tenant has a slot, and only those kept for idle tenants are free",
    "lease_short": "too little of its claim's lease is left for a POST",
}
# The longest request of a POST with the default settings (`WEBHOOK_TIMEOUT_S`); the DNS check
# is done by the time the lease left is compared with it.
DEFAULT_POST_TIME = timedelta(seconds=10)


class Sender(Protocol):
    async def post(
        self, destination: Destination, *, body: bytes, headers: Mapping[str, str]
    ) -> ReceiverAnswer: ...


@dataclass(frozen=True)
class Done:
    reason: str


@dataclass(frozen=True)
class Send:
    command: DeliverWebhook
    reason: str


@dataclass(frozen=True)
class GiveUp:
    """Recorded failed: copy the message to the DLQ with `reason`."""

    reason: str


@dataclass(frozen=True)
class Hold:
    """Keep this redelivery unacknowledged and claim again at `until` (or sooner).

    Another process's lease, or another copy in this process, holds the attempt; the
    message came back (or is a copy of one that did) because the consumer holding it died,
    lost its connection or crashed, and that holder may yet fail with nobody to requeue its
    message. Held while another delivery or lease holds the attempt (about a lease each);
    what is put off for any other reason goes down the wait ladder as a copy carrying its
    delivery count instead (`_put_off`)."""

    until: datetime


DeliveryDecision = Done | Send | GiveUp


@dataclass(frozen=True)
class RetryPolicy:
    """base * 2^(attempt-1) capped, scaled by a random factor in [0.5, 1); a Retry-After longer
    than that wins, up to the cap. A shorter one does not: `Retry-After: 0` (or a date already
    past, from a receiver whose clock is behind) spent every attempt within seconds."""

    base_s: float
    cap_s: float

    def delay(self, attempt: int, *, retry_after_s: float | None, rng: random.Random) -> timedelta:
        backoff = jittered_s(
            capped_exponential_s(attempt, base_s=self.base_s, cap_s=self.cap_s), rng
        )
        hinted = min(max(retry_after_s or 0.0, 0.0), self.cap_s)
        return timedelta(seconds=max(backoff, hinted))


@dataclass(frozen=True)
class DeliveryDeps:
    ledger: Ledger
    keyring: Keyring
    alerts: FailureAlerts  # a failure alert goes where its tenant's setting says now
    guard: WebhookGuard
    sender: Sender
    policy: RetryPolicy
    clock: Clock
    rng: random.Random
    owner: str  # this process, as its claims name it (unique per process)
    lease: timedelta
    # What the times a receiver reads or sends are taken against: `webhook-timestamp`, which
    # it judges by real time (its own clock, within five minutes in the usual libraries),
    # and the date of its `Retry-After`. This host's clock tracks real time; the database's,
    # which `clock` follows, need not.
    host_clock: Clock = wall_clock
    # The (delivery id, attempt) pairs deliveries of this process are claiming or sending.
    in_hand: InHand[tuple[str, int]] = field(default_factory=InHand)
    # The POSTs of this process in flight per destination and per tenant, each bounded;
    # the tenants' also keep the slots beyond WEBHOOK_CONCURRENCY for idle tenants.
    hosts: Slots = field(default_factory=lambda: Slots(DEFAULT_PER_HOST))
    # Per tenant and destination: one tenant's share of a destination (`hosts.host_share`).
    host_shares: Slots = field(default_factory=lambda: Slots(host_share(DEFAULT_PER_HOST)))
    tenants: Slots = field(
        default_factory=lambda: TenantSlots(DEFAULT_PER_TENANT, shared=DEFAULT_CONCURRENCY)
    )
    # The longest request of one POST (its DNS check done): a claim with less of its lease
    # left then does not POST. Compared after the DNS check, with the check's time in it
    # too, a slow resolver had every try put off for good (the re-read of that change).
    post_time: timedelta = DEFAULT_POST_TIME
    metrics: NotifierMetrics = field(default_factory=NotifierMetrics)
    # The attempts of one round (`WEBHOOK_MAX_ATTEMPTS`): a fresh round of a delivery the
    # ledger forgot has no more (its command counts every round's).
    max_attempts: int = 8


def encode_payload(payload: Mapping[str, Any]) -> bytes:
    """The body exactly as signed and sent."""
    return orjson.dumps(payload)


def judge_answer(answer: ReceiverAnswer, *, now: datetime) -> None:
    """Return for 2xx; raise the error the status means otherwise."""
    status = answer.status
    if 200 <= status < 300:
        return
    if status in (408, 429) or not 300 <= status < 500:
        # A final 1xx (a proxy's 101) or a code past 5xx is no usable answer to a POST, yet
        # the receiver's: retried as its 5xx, ending as it does (not in our DLQ). A 1xx gave
        # the webhook up at once as a refusal (a review).
        raise ReceiverUnavailable(
            f"the receiver answered {status}",
            retry_after_s=parse_retry_after(answer.retry_after, now=now),
        )
    if 300 <= status < 400:
        raise DeliveryRejected(f"the receiver answered {status}; redirects are not followed")
    excerpt = " ".join(answer.excerpt.split())[:200]
    raise DeliveryRejected(f"the receiver answered {status}" + (f": {excerpt}" if excerpt else ""))


async def deliver_webhook(
    delivery: DeliverWebhook, *, deps: DeliveryDeps, redelivered: bool = False
) -> DeliveryDecision:
    """Send one attempt of a webhook, at most once per attempt and never after delivery.

    `redelivered`: a consumer was handed this message, or the copy it is of, and lost it
    unsettled (`x-delivery-count`, or deliveries carried); an attempt held elsewhere is then
    waited for (the message held) rather than re-sent or dropped."""
    while isinstance(decision := await deliver_once(delivery, deps, redelivered), Hold):
        await wait_for_claim(decision.until, deps.clock)
        redelivered = True
    return decision


async def deliver_once(
    delivery: DeliverWebhook, deps: DeliveryDeps, redelivered: bool
) -> DeliveryDecision | Hold:
    """One try of `deliver_webhook`: Hold when it must wait for a claim and try again."""
    now = deps.clock()
    if delivery.not_before is not None and wait_tier_for(
        (delivery.not_before - now).total_seconds()
    ):
        return Send(delivery, NOT_YET_DUE)
    with deps.in_hand.holding((delivery.delivery_id, delivery.attempt)) as only_here:
        if not only_here:
            # No claim: it could land before the holder's, which would take it over as a
            # stale lease of this process (two POSTs). A redelivery waits for the holder,
            # then replays what it decided: the holder may be the shielded attempt of a
            # handler a dropped connection cancelled, and may fail with nobody to requeue
            # its message (a put-off redelivery's copy carries its count, and counts as
            # one). Any other copy is dropped: the holder, or that redelivery, sees the
            # attempt through.
            if redelivered:
                return Hold(now + timedelta(seconds=HOLD_POLL_S))
            return Done("another copy in this process is working on this attempt")
        # Held by no other copy here: a lease of this process on it is stale.
        return await _claim_and_send(delivery, deps, redelivered=redelivered)


async def at_delivery_limit(
    delivery: DeliverWebhook, deps: DeliveryDeps, *, reason: str
) -> DeliveryDecision | Hold:
    """For a message at its queue's delivery limit: carry out what its attempt decided (the
    consumer died after recording it, before or while carrying it out), else record the
    delivery failed and give it up to the DLQ with `reason`. Nothing is POSTed: its consumers
    kept dying or crashing on it, maybe in the POST, and the broker dead-letters it, with no
    reason and nothing recorded, if it comes back once more.

    Hold while the attempt is held elsewhere (a copy in this process, another process's
    lease), then carry out what the holder decided."""
    now = deps.clock()
    with deps.in_hand.holding((delivery.delivery_id, delivery.attempt)) as only_here:
        if not only_here:
            return Hold(now + timedelta(seconds=HOLD_POLL_S))
        owner = f"{deps.owner}/{new_id()[:12]}"
        claim = await deps.ledger.claim(
            delivery, process=deps.owner, owner=owner, now=now, lease=deps.lease, reclaim_own=True
        )
        if not claim.won:
            return _without_claim(delivery, claim.record, now=now, redelivered=True)
        return await _give_up(
            delivery,
            reason,
            None,
            dead_letter=True,
            why="dead_lettered",
            owner=owner,
            claimed_at=now,
            deps=deps,
        )


async def try_moved_back_letter_again(letter: DeliverWebhook, deps: DeliveryDeps) -> Send | None:
    """For a dead letter moved back to the queue: Send the first attempt of a fresh round
    when the record says the letter's attempt was given up, or is gone; None otherwise, for
    the letter to be handled as any copy of its attempt. The round is recorded first
    (`Ledger.reopen`, `Ledger.reopen_forgotten`), which one copy of the letter wins: the
    others, and a redelivery of the winner's, replay it as a recorded retry."""
    record = await deps.ledger.find(letter.delivery_id)
    now = deps.clock()
    if record is None:
        # Where its round began is forgotten with it: taken as a configured round's start,
        # not 1 (a second round's letter then had twice the attempts, doubling with each).
        round_from = max(1, letter.max_attempts - deps.max_attempts + 1)
        fresh = fresh_round(letter, round_from=round_from)
        reopened = await deps.ledger.reopen_forgotten(letter, fresh=fresh, now=now)
    elif _given_up_to_the_dlq(record, letter):
        fresh = fresh_round(letter, round_from=record.round_from)
        reopened = await deps.ledger.reopen(letter, fresh=fresh, now=now)
    else:
        return None
    if not reopened:
        return None  # another copy of the letter did
    attempts = fresh.max_attempts - fresh.attempt + 1
    return Send(fresh, f"dead letter moved back: a fresh round of {attempts} attempt(s)")


def _given_up_to_the_dlq(record: DeliveryRecord, letter: DeliverWebhook) -> bool:
    """Whether the record says the letter's attempt was given up and dead-lettered: not a
    receiver's refusal (recorded failed, never lettered), whose redelivery, still carrying a
    moved-back letter's headers when only its ack was lost, reopened a fresh round against
    the receiver that had refused it."""
    return (
        record.state is DeliveryState.FAILED
        and record.attempt == letter.attempt
        and record.dead_letter
    )


def fresh_round(letter: DeliverWebhook, *, round_from: int) -> DeliverWebhook:
    """The first attempt of a fresh round after `letter`'s, whose round began at attempt
    `round_from`: numbered on from the next attempt, with as many attempts as that round
    had (`max_attempts` counts every round's)."""
    per_round = letter.max_attempts - (round_from - 1)
    first = letter.attempt + 1
    return letter.model_copy(
        update={
            "attempt": first,
            "max_attempts": letter.attempt + per_round,
            "not_before": None,
            "message_id": new_id(),
            "deferrals": 0,
        }
    )


async def _claim_and_send(
    delivery: DeliverWebhook, deps: DeliveryDeps, *, redelivered: bool
) -> DeliveryDecision | Hold:
    # Read before the claim: when the database fails this read, no lease is left behind,
    # and the consumer sends the command again a little later, as for any database error.
    # A change made after this read reaches the next attempt, not this one.
    configured = await _as_configured_now(delivery, deps.alerts)
    if configured is None:  # cancelled unsent: no POST, no slot
        return await _claim_and_post(delivery, None, deps, redelivered=redelivered)
    destination = destination_of(configured.url, deps.guard)
    bounds = (
        (deps.hosts, destination, "host"),
        (deps.host_shares, share_key(configured.tenant_id, destination), "host_share"),
        (deps.tenants, configured.tenant_id, "tenant"),
    )
    with ExitStack() as held:
        for slots, key, bound in bounds:
            if (refused := slots.refusal(key)) is not None:
                held.close()  # put off holding no slot
                why = f"{bound}_{refused}"  # host_busy, host_share_busy, tenant_busy, ...
                return await _put_off(delivery, deps, why, redelivered=redelivered)
            held.enter_context(slots.taking(key))  # taken: nothing ran since `refusal`
        return await _claim_and_post(delivery, configured, deps, redelivered=redelivered)


async def _claim_and_post(
    delivery: DeliverWebhook,
    configured: DeliverWebhook | None,
    deps: DeliveryDeps,
    *,
    redelivered: bool,
) -> DeliveryDecision | Hold:
    """Claim the attempt, then POST it as `configured` (or cancel it unsent when None)."""
    owner = f"{deps.owner}/{new_id()[:12]}"
    now = deps.clock()  # the lease counts from here, not from before the alert lookup
    claim = await deps.ledger.claim(
        configured or delivery,
        process=deps.owner,
        owner=owner,
        now=now,
        lease=deps.lease,
        reclaim_own=True,
    )
    if not claim.won:
        return _without_claim(delivery, claim.record, now=now, redelivered=redelivered)
    if configured is None:
        return await _cancel(delivery, ALERT_REMOVED, owner=owner, deps=deps)
    return await _send(
        configured,
        deps,
        now,
        owner=owner,
        redelivered=redelivered,
        round_from=claim.record.round_from,
    )


async def _put_off(
    delivery: DeliverWebhook, deps: DeliveryDeps, why: str, *, redelivered: bool
) -> DeliveryDecision:
    """Put the delivery off unsent, its attempt not counted, `why` a key of PUT_OFF_BECAUSE:
    its destination or tenant has no slot free in this process (unclaimed), or too little
    of the lease of the claim just made is left for a POST (the claim left to lapse).

    A copy goes down the wait ladder and this one is acked, freeing its consumer slot. A
    redelivery first carries out what its attempt already decided (its consumer died before
    acking), if anything. Held instead, as it once was, a redelivery kept its consumer slot
    while it polled for a free one (new deliveries took the freed slots first), could wait
    past the broker's consumer timeout under a long saturation, and one refused the reserve
    kept for idle tenants filled that very reserve (found in review). The copy carries the
    delivery count (`Send` of the same attempt), which holding was there to keep.

    Counted in `scorebox_webhook_deferred_total` only when a copy is put off: a redelivery
    that carries out its recorded decision was counted too, as if put off (found in review)."""
    if redelivered:
        record = await deps.ledger.find(delivery.delivery_id)
        if record is not None and (decided := recorded_decision(delivery, record)) is not None:
            return decided
    deps.metrics.deferred.labels(why).inc()
    wait = put_off_wait(delivery.deferrals, deps.rng)
    later = deps.clock() + wait  # from now: the ladder sends a past one at once
    deferred = delivery.model_copy(
        update={"not_before": later, "message_id": new_id(), "deferrals": delivery.deferrals + 1}
    )
    return Send(deferred, f"deferred: {PUT_OFF_BECAUSE[why]}")


def put_off_wait(deferrals: int, rng: random.Random) -> timedelta:
    """The wait of a delivery put off `deferrals` times already: doubling from
    PUT_OFF_DELAY up to PUT_OFF_MAX_DELAY, with up to half again of jitter so that a
    backlog put off together does not come back together."""
    doubled = capped_exponential_s(
        deferrals + 1,
        base_s=PUT_OFF_DELAY.total_seconds(),
        cap_s=PUT_OFF_MAX_DELAY.total_seconds(),
    )
    return timedelta(seconds=doubled) * (1 + rng.random() / 2)


async def _as_configured_now(
    delivery: DeliverWebhook, alerts: FailureAlerts
) -> DeliverWebhook | None:
    """The delivery as its tenant's settings have it now; None when they no longer ask for it.

    A failure alert goes to the URL registered now, whatever its command carries (the URL
    when the task failed), and to none once removed. A callback's URL is its task's, set at
    submit, and never changes."""
    if delivery.purpose is not WebhookPurpose.FAILURE_ALERT:
        return delivery
    url = await alerts.url_of(delivery.tenant_id)
    if url is None:
        return None
    return delivery if url == delivery.url else delivery.model_copy(update={"url": url})


async def _send(
    delivery: DeliverWebhook,
    deps: DeliveryDeps,
    now: datetime,
    *,
    owner: str,
    redelivered: bool,
    round_from: int,
) -> DeliveryDecision | Hold:
    """POST the attempt this process claimed (as `owner`, at `now`) and record what came of
    it; put it off unsent when its lease could run out during the POST. `round_from`: the
    first attempt of the delivery's current round (`DeliveryRecord.round_from`)."""
    status: int | None = None
    started = time.perf_counter()
    try:
        destination = await deps.guard.vet(delivery.url)
        # The secrets read after the DNS check, just before signing: read first, a rotation
        # during the check had the receiver, already holding the new secret, refuse the
        # old one's signature for good, a 4xx (review of the notifier).
        secrets = await deps.keyring.in_force(delivery.tenant_id, now=deps.clock())
        if now + deps.lease - deps.clock() < deps.post_time:
            return await _put_off(delivery, deps, "lease_short", redelivered=redelivered)
        body = encode_payload(delivery.payload)
        # Signed as sent, not as claimed: the claim, the keyring's read and the DNS check
        # come between, up to minutes with slow ones, and a receiver refuses (for good, a
        # 4xx) a timestamp older than its tolerance, five minutes in the usual libraries.
        sent_at = int(deps.host_clock().timestamp())
        headers = signed_headers(
            secrets, webhook_id=delivery.delivery_id, timestamp=sent_at, body=body
        )
        answer = await deps.sender.post(destination, body=body, headers=headers)
        status = answer.status
        judge_answer(answer, now=deps.host_clock())
    except PermanentDeliveryError as error:
        deps.metrics.count_attempt(delivery.purpose, "rejected", time.perf_counter() - started)
        return await _give_up(
            delivery,
            error.reason,
            status,
            dead_letter=False,  # the receiver's doing: recorded, not an operator's alert
            why="rejected",
            owner=owner,
            claimed_at=now,
            deps=deps,
        )
    except TransientDeliveryError as error:
        deps.metrics.count_attempt(delivery.purpose, "unavailable", time.perf_counter() - started)
        return await _retry_or_give_up(
            delivery, error, status, owner=owner, claimed_at=now, round_from=round_from, deps=deps
        )
    deps.metrics.count_attempt(delivery.purpose, "delivered", time.perf_counter() - started)
    # Past the lease too, the delivery held meanwhile: given up at the lease's end, the error
    # had the consumer send the attempt again as a copy, which claimed the lapsed lease once
    # the database was back and POSTed a webhook known to be delivered. The write is
    # unconditional and idempotent, and DELIVERED is final. Bounded all the same, well inside
    # the broker's consumer timeout, past which the channel closes and every delivery in
    # hand on it comes back counted.
    await keep_trying_database(
        lambda: deps.ledger.mark_delivered(delivery, now=deps.clock(), status=answer.status),
        what=f"recording delivery {delivery.delivery_id} as delivered",
        give_up_after_s=DELIVERED_RECORD_PATIENCE_S,
    )
    return Done(f"delivered ({answer.status})")


# How long a 2xx's record is tried before the error goes to the consumer (`_send`).
DELIVERED_RECORD_PATIENCE_S = BROKER_CONSUMER_TIMEOUT_S / 2


async def _while_leased[T](
    record: Callable[[], Awaitable[T]], *, deps: DeliveryDeps, claimed_at: datetime, what: str
) -> T:
    """Record an attempt's outcome, trying again while our claim's lease holds.

    The POST has been made: an outcome lost to a slow or absent database would have the
    attempt's message sent again, and its redelivery POST again (at once in this process,
    which takes its own lease over). Until the lease ends no other delivery claims the
    attempt, so the write is repeated (it is idempotent); past it, the error goes to the
    consumer, as for any database failure. A write the database refuses for good goes to
    the consumer at once, as a crash (repeated, it would be refused until the lease ended).
    """
    held_for = (claimed_at + deps.lease - deps.clock()).total_seconds()
    return await keep_trying_database(
        record,
        what=what,
        give_up_after_s=held_for,
    )


def _without_claim(
    delivery: DeliverWebhook, record: DeliveryRecord, *, now: datetime, redelivered: bool
) -> DeliveryDecision | Hold:
    """Another copy or attempt owns the delivery: drop, defer, or replay its decision."""
    if (decided := recorded_decision(delivery, record)) is not None:
        return decided
    later = max(record.lease_until or now, now + timedelta(seconds=1))
    if redelivered:
        return Hold(later)
    return Send(
        delivery.model_copy(update={"not_before": later, "message_id": new_id()}),
        "claimed by another consumer",
    )


def recorded_decision(delivery: DeliverWebhook, record: DeliveryRecord) -> DeliveryDecision | None:
    """What the ledger says a copy of `delivery` does: drop it once the delivery is over or a
    later attempt took over, or carry out again what its attempt decided; None when its
    attempt is still undecided."""
    if (over := _when_over(delivery, record)) is not None:
        return over
    if record.attempt > delivery.attempt:
        return _after_our_attempt(delivery, record)
    return None


def _when_over(delivery: DeliverWebhook, record: DeliveryRecord) -> DeliveryDecision | None:
    """What a copy does once the delivery is over (delivered, given up, cancelled); None
    while it is not."""
    match record.state:
        case DeliveryState.DELIVERED:
            return Done("already delivered")
        case DeliveryState.CANCELLED:
            return Done("already cancelled")
        case DeliveryState.FAILED if (
            record.attempt == delivery.attempt and record.dead_letter and not record.lettered
        ):
            return GiveUp(record.last_error or "failed")  # our attempt was decided: again
        case DeliveryState.FAILED:
            return Done("already given up")
        case _:
            return None


def _after_our_attempt(delivery: DeliverWebhook, record: DeliveryRecord) -> DeliveryDecision:
    """A later attempt is recorded: replay the retry our attempt decided, or drop."""
    following = record.next_delivery
    if (
        record.state is DeliveryState.RETRYING
        and following is not None
        and following.attempt == delivery.attempt + 1
    ):
        return Send(following, "replaying the recorded retry")
    return Done(f"superseded by attempt {record.attempt}")


async def _cancel(
    delivery: DeliverWebhook, reason: str, *, owner: str, deps: DeliveryDeps
) -> DeliveryDecision:
    """Stop the delivery unsent. Nothing was POSTed, so a write that fails here needs no
    retry under the lease: the consumer sends the command again later, as for any database
    error, and that copy claims the attempt again, or finds it cancelled."""
    cancelled = await deps.ledger.mark_cancelled(
        delivery, owner=owner, now=deps.clock(), reason=reason
    )
    return Done(reason) if cancelled else Done("claim lost before cancelling")


async def _give_up(
    delivery: DeliverWebhook,
    reason: str,
    status: int | None,
    *,
    dead_letter: bool,
    why: str,
    owner: str,
    claimed_at: datetime,
    deps: DeliveryDeps,
) -> DeliveryDecision:
    """Record the delivery failed; GiveUp (to the DLQ) when `dead_letter`, else it ends here.
    `why` labels it in `scorebox_webhook_deliveries_failed`."""
    decided = await _while_leased(
        lambda: deps.ledger.mark_failed(
            delivery,
            owner=owner,
            now=deps.clock(),
            error=reason,
            status=status,
            dead_letter=dead_letter,
        ),
        deps=deps,
        claimed_at=claimed_at,
        what=f"recording delivery {delivery.delivery_id} as failed",
    )
    if not decided:
        return Done("claim lost before giving up")
    deps.metrics.failed.labels(delivery.purpose, why).inc()
    return GiveUp(reason) if dead_letter else Done(f"failed, its receiver's doing: {reason}")


def _attempts_made(delivery: DeliverWebhook, round_from: int) -> str:
    """The attempts a give-up names: those of its round too, once its letter was moved back
    (attempts are numbered on across rounds, and "gave up after 4 attempt(s)" with
    `WEBHOOK_MAX_ATTEMPTS` 2 read as the setting ignored: a walkthrough)."""
    made = f"{delivery.attempt} attempt(s)"
    if round_from <= 1:
        return made
    return f"{made}, {delivery.attempt - round_from + 1} since its dead letter was moved back"


async def _retry_or_give_up(
    delivery: DeliverWebhook,
    error: TransientDeliveryError,
    status: int | None,
    *,
    owner: str,
    claimed_at: datetime,
    round_from: int,
    deps: DeliveryDeps,
) -> DeliveryDecision:
    if delivery.attempt >= delivery.max_attempts:
        reason = f"gave up after {_attempts_made(delivery, round_from)}; last: {error.reason}"
        # Its receiver answered the last attempt (5xx, 408, 429), or DNS answered that its
        # host does not exist or has no address (NXDOMAIN, NODATA): the tenant's doing, as a
        # refusal is, recorded and not an operator's alert (a misspelt callback domain, or
        # one with only MX records, put a letter in the DLQ per task). No answer (DNS
        # timeout, SERVFAIL or refusal, connect, TLS, timeout) may be ours, an egress or
        # resolver outage: to the DLQ.
        answered = isinstance(error, ReceiverUnavailable | NoSuchHost)
        return await _give_up(
            delivery,
            reason,
            status,
            dead_letter=not answered,
            why="receiver_failing" if answered else "dead_lettered",
            owner=owner,
            claimed_at=claimed_at,
            deps=deps,
        )
    now = deps.clock()
    in_round = delivery.attempt - round_from + 1  # a fresh round backs off from the start
    delay = deps.policy.delay(in_round, retry_after_s=error.retry_after_s, rng=deps.rng)
    following = delivery.model_copy(
        update={
            "attempt": delivery.attempt + 1,
            "not_before": now + delay,
            "message_id": new_id(),
            "deferrals": 0,  # the next attempt's own
        }
    )
    decided = await _while_leased(
        lambda: deps.ledger.mark_retrying(
            delivery,
            owner=owner,
            now=now,
            next_delivery=following,
            error=error.reason,
            status=status,
        ),
        deps=deps,
        claimed_at=claimed_at,
        what=f"recording the retry of delivery {delivery.delivery_id}",
    )
    if not decided:
        return Done("claim lost before retrying")
    return Send(following, f"attempt {delivery.attempt} failed: {error.reason}")
