"""Looking at a work queue's dead-letter queue without consuming it, and purging it.

A walk reads every letter with `basic.get` and holds it unacknowledged; on the way out it
returns those its caller did not settle (a replay acks the ones it sent again) with
`basic.nack(requeue=True)`. RabbitMQ 4.3+ does not count that return against the DLQ's
delivery limit, 3.x and 4.0 to 4.2 do, and the DLQ's own limit
(`shared.topology.DLQ_DELIVERY_LIMIT`) is out of any operator's reach, so looking never loses
a dead letter.

A walk holds its letters on a channel of its own, closed when the walk ends: a return that
fails (a timeout on a channel that stays open) ends the returns, and the close has the broker
take back every letter the channel still holds, as it does one whose `basic.get` answer came
after the walk stopped waiting for it. On the broker's shared channel, such letters stayed
unacknowledged until that channel closed, out of every later walk's sight.

A letter one walk holds is out of another's sight: walks through one walker take turns
(those of other replicas, and the scheduler's dead-letter depth probe, which holds a DLQ's
head for a moment, may still hide a letter). Letters come back to a quorum queue out
of order, so callers sort what they show by `dead_lettered_at`. A walk holds at most `MAX_WALK`
letters and at most `MAX_WALK_BYTES` of their bodies, and says when it stopped short of the
queue's end (`HeldLetters.truncated`): having reached its bound, it takes one letter more and
gives it back behind the others, truncated only when there was one. An id it did not match
may then lie past it, so callers report such ids as not reached rather than not found
(`unmatched`). Each step on the broker is bounded as a whole: aio-pika's own `timeout` covers
only the round trip, after waiting without end for a lost connection to come back.

A drop or a purge given a cut-off (`CUT_OFF`, a listing's `listed_at`) removes only the letters
known to have been dead-lettered before it, to the whole second (`CutOff`): those of the
cut-off's second or later, and those of unknown time, are kept, so a letter dead-lettered after
an operator's listing is never removed on the strength of it. A purge with a cut-off walks the
queue as a drop does (`queue.purge` takes every letter), within the same bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
from collections.abc import (
    AsyncIterator,
    Callable,
    Collection,
    Mapping,
    Sequence,
    Set,
)
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any, Protocol

import orjson
import pydantic_core
from aio_pika.abc import (
    AbstractChannel,
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustConnection,
)
from fastapi import Depends, Query
from faststream.rabbit import RabbitBroker
from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

from shared.bus import BROKER_ERRORS
from shared.consumers import ScoreboxBroker
from shared.http import Problem, invalid_query, quoted
from shared.settings import url_shown
from shared.topology import ERROR_HEADER, FIRST_ERROR_HEADER, WorkQueue, x_deaths

log = logging.getLogger("scorebox.dead_letters")

MAX_WALK = 10_000
# What the bodies of the letters one walk holds may add up to (the last letter taken may pass
# it). A score request carries its text, up to 50,000 characters: 10,000 of them held by one
# admin request were up to about 2 GB in the gateway.
MAX_WALK_BYTES = 64 * 1024 * 1024
GET_TIMEOUT_S = 5.0
# How long a replay sends letters again before it answers with the rest left (`truncated`):
# each costs database round trips and confirmed publishes, a few milliseconds, so a replay of
# 10,000 letters in one request took about a minute, and a client's timeout (the CLI's
# 30 s) took a replay that went on for one that failed. At least one letter is always sent.
REPLAY_BUDGET_S = 20.0
# How long any walk takes letters (a listing, a show, a drop, a purge with a cut-off): one
# round trip each, so over a slow link (0.2 s) or a full queue a listing outlasted the CLI's
# 30 s, which gave up while the drop it had asked for went on and was applied (a
# walkthrough). Past it the walk stops with letters left (`timed_out`).
WALK_BUDGET_S = REPLAY_BUDGET_S
WALK_BOUND = f"{MAX_WALK:,} letters or {MAX_WALK_BYTES // (1024 * 1024)} MiB of their bodies"
# The query parameter of a drop and a purge that keeps the letters not known to have been
# dead-lettered before it; a listing's `listed_at` is one.
CUT_OFF = "dead_lettered_before"
NOTHING_REMOVED = "nothing was removed"
UNPARSEABLE_URL = "(a URL that does not parse)"
# A replay's body: it names at most `MAX_WALK` ids, far less than this.
REPLAY_BODY_LIMIT = 1024 * 1024
# RFC 3339's date-time: a zone is required (`Z` or an offset), a space for `T` is not taken
# (an unencoded `+` of an offset reaches the server as a space).
_DATE_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)", re.ASCII)


class HeldLetters(list[AbstractIncomingMessage]):
    """The letters one walk holds, in the order taken; `truncated` when the walk stopped at
    `MAX_WALK` letters or at its byte budget with a letter left behind them (letters past it
    are reached by replaying or purging those before them), `timed_out` when it stopped at
    its deadline with one left (they are reached by asking again); `bytes_held`, their
    bodies' size."""

    truncated: bool = False
    timed_out: bool = False
    bytes_held: int = 0

    @property
    def stopped_short(self) -> bool:
        """Whether letters were left behind the walk, at its bounds or its deadline."""
        return self.truncated or self.timed_out

    def take(self, message: AbstractIncomingMessage) -> None:
        self.append(message)
        self.bytes_held += len(message.body)

    def full(self, max_bytes: int) -> bool:
        """Whether the walk has reached its bound (the last letter taken may pass
        `max_bytes`; the first is always taken)."""
        return bool(self) and (len(self) >= MAX_WALK or self.bytes_held >= max_bytes)


@dataclass(frozen=True)
class Dropped:
    """What one drop did: `removed`, the letters it acked (every copy of one letter the walk
    held); `walked`, the letters the walk held; `truncated`, the walk stopped short of the
    queue's end (a copy past it, or the letter itself when none was removed, may lie there);
    `kept`, the letters it matched but kept, not known dead-lettered before its cut-off."""

    removed: int
    walked: int
    truncated: bool
    kept: int = 0


class PurgeReport(BaseModel):
    """What a purge of a DLQ removed (both services' `DELETE .../dead-letters`)."""

    purged: int = Field(description="Letters removed.")
    kept: int | None = Field(
        default=None,
        description=f"Only with `{CUT_OFF}`: letters the walk reached and kept, not known to "
        "have been dead-lettered before it.",
    )
    truncated: bool | None = Field(
        default=None,
        description=f"Only with `{CUT_OFF}`, whose purge walks the queue: the walk stopped at "
        f"its bound ({WALK_BOUND}) or its {WALK_BUDGET_S:.0f} s budget with letters left "
        "behind it, not looked at and kept.",
    )


class ReplayRequest(BaseModel):
    """Which dead letters to replay: `ids` (message ids, or the ids the queue's letters are
    known by: a task's, a webhook delivery's) or `all`. Unknown fields are refused: an option
    this server does not know (`dry_run`) was ignored and the replay ran for real. `all` is
    strict: "false" is not a boolean."""

    model_config = ConfigDict(extra="forbid")

    ids: list[str] = Field(default_factory=list, max_length=MAX_WALK)
    all: StrictBool = False

    @model_validator(mode="after")
    def _one_selection(self) -> ReplayRequest:
        if self.all == bool(self.ids):
            raise ValueError("give either a non-empty `ids` or `all: true`")
        return self


class DropReport(BaseModel):
    """What a drop of one letter removed (`DELETE .../dead-letters/{letter_id}`)."""

    letter_id: str
    removed: int = Field(
        description="Letters removed: every copy of the letter(s) the id names that the walk "
        "reached."
    )
    truncated: bool = Field(
        description=f"The walk stopped at its bound ({WALK_BOUND}) or its {WALK_BUDGET_S:.0f} "
        "s budget with letters left behind it: a copy past it, if any, is still there."
    )
    kept: int | None = Field(
        default=None,
        description=f"Only with `{CUT_OFF}`: letters the id names that were kept, not known "
        "to have been dead-lettered before it (of its second or later, or of unknown time).",
    )

    @classmethod
    def of(cls, letter_id: str, dropped: Dropped, cut_off: CutOff | None) -> DropReport:
        return cls(
            letter_id=letter_id,
            removed=dropped.removed,
            truncated=dropped.truncated,
            kept=None if cut_off is None else dropped.kept,
        )


class Purgeable(Protocol):
    async def purge(self) -> int: ...

    async def purge_before(self, cut_off: CutOff) -> Dropped: ...


async def purge_report(dead_letters: Purgeable, cut_off: CutOff | None) -> PurgeReport:
    """Purge the whole queue (`queue.purge`), or, given a cut-off, what a walk finds
    dead-lettered before it."""
    if cut_off is None:
        return PurgeReport(purged=await dead_letters.purge())
    purged = await dead_letters.purge_before(cut_off)
    return PurgeReport(purged=purged.removed, kept=purged.kept, truncated=purged.truncated)


@dataclass(frozen=True)
class CutOff:
    """A drop's or a purge's cut-off, as the whole second (UTC) it falls in: AMQP timestamps
    and `x-death` times have whole seconds, so a letter recorded in that second may have been
    dead-lettered after the cut-off, and is kept."""

    second: datetime

    @classmethod
    def at(cls, when: datetime) -> CutOff:
        return cls(when.astimezone(UTC).replace(microsecond=0))

    def passed(self, message: AbstractIncomingMessage) -> bool:
        """Whether the letter is known to have been dead-lettered before the cut-off."""
        when = dead_lettered_at(message, self.second)
        return when is not None and when < self.second


def parse_cut_off(value: str) -> CutOff:
    """`value` as an RFC 3339 date-time with a zone; a 422 problem otherwise."""
    text = value.upper()  # RFC 3339 takes `t` and `z` too
    if _DATE_TIME.fullmatch(text):
        with contextlib.suppress(ValueError, OverflowError):  # 2030-02-30, 0001-01-01...+01:00
            return CutOff.at(datetime.fromisoformat(text))
    raise invalid_query(
        CUT_OFF,
        "must be an RFC 3339 date-time with a zone, such as a listing's `listed_at` "
        f"(2030-01-01T10:00:00Z; send the `+` of an offset as %2B), not {quoted(value)}",
        outcome=NOTHING_REMOVED,
    )


def _cut_off(
    dead_lettered_before: Annotated[
        str | None,
        Query(
            description="Remove only the letters known to have been dead-lettered before this "
            "RFC 3339 date-time with a zone (a listing's `listed_at`), compared to the whole "
            "second: a letter of that second or later, or of unknown time, is kept and "
            "counted in `kept`. Without it, every letter asked for is removed.",
        ),
    ] = None,
) -> CutOff | None:
    """The cut-off of a drop or a purge. Any other query parameter is refused, as on every
    route (`shared.query_parameters`): a misspelt cut-off, ignored, would have the purge
    remove every letter."""
    return None if dead_lettered_before is None else parse_cut_off(dead_lettered_before)


# A route's cut-off (`CUT_OFF`), None without one; a 422 problem when it is malformed.
CutOffQuery = Annotated[CutOff | None, Depends(_cut_off)]


def nothing_dropped(named: str, dropped: Dropped, *, out_of_sight: str) -> Problem:
    """The answer of both admin APIs to a drop that removed nothing (`named`: the letter
    asked for): a 404 when the walk reached the end of the queue; a 409 when it stopped short
    of it, as the letter may lie past it (a client taking a 404 to a DELETE as done would
    stop)."""
    if not dropped.truncated:
        return Problem(404, f"{named}; nothing was removed ({out_of_sight}; ask again to be sure).")
    return Problem(
        409,
        f"{named} among the first {dropped.walked}: the walk stops at {WALK_BOUND} or after "
        f"{WALK_BUDGET_S:.0f} s, and the queue holds more, so it may lie past them. Nothing "
        "was removed; ask again, or replay or drop letters before it first.",
        kind="not-reached",
        walked=dropped.walked,
    )


async def _looking_connection(broker: RabbitBroker) -> AbstractRobustConnection:
    """The consuming connection, where the broker has one: it never publishes, so a memory or
    disk alarm, which has RabbitMQ stop reading every connection that published, never blocks
    a look (nor an operator's purge of the DLQ during an alarm the DLQ's letters raised); on
    the publishing one, a listing, a replay's walk or a purge waited out the alarm and
    answered 503. The broker's own connection otherwise."""
    if isinstance(broker, ScoreboxBroker) and broker.consumer_connection is not None:
        return broker.consumer_connection
    return await broker.connect()


@contextlib.asynccontextmanager
async def own_channel(
    broker: RabbitBroker, *, timeout_s: float, what: str
) -> AsyncIterator[AbstractChannel]:
    """A channel of its own on the broker's connection for a look at a DLQ (`what`), closed
    when the look ends: whatever it still holds goes back to the queue (a letter whose return
    failed, or whose `basic.get` answer came after the look stopped waiting), and no other
    work shares it. A connection being restored is waited for within `timeout_s`; so is the
    close, and a close that fails is left to the connection, whose loss (at worst by missed
    heartbeats) closes the channel too."""
    async with asyncio.timeout(timeout_s):
        connection = await _looking_connection(broker)
        await connection.ready()
        try:
            opening = connection.channel(publisher_confirms=False)
        except RuntimeError as error:  # lost again since: "Connection was not opened"
            raise ConnectionError(f"the connection to the broker is gone: {error}") from error
        channel = await opening
    try:
        yield channel
    finally:
        try:
            async with asyncio.timeout(timeout_s):
                await channel.close()
        except BROKER_ERRORS as error:
            log.warning("the channel of a look at %s not closed: %r", what, error)


class WalkBusy(Problem):
    """Another walk of the DLQ held it past a walk's deadline (a replay's budget, or any
    other walk's `WALK_BUDGET_S`): a 503 to retry shortly, whichever route raised it."""

    retry_after_s = 5

    def __init__(self, queue: str) -> None:
        super().__init__(
            503,
            f"Another look at {queue} is under way on this replica; try again shortly.",
            kind="dead-letters-busy",
            headers={"Retry-After": str(self.retry_after_s)},
        )


def _past(deadline: float, held: HeldLetters) -> bool:
    """Whether a walk with `deadline` has passed it (the first letter is always taken)."""
    return bool(held) and asyncio.get_running_loop().time() >= deadline


class DeadLetterWalker:
    """The DLQ of one work queue, walked and purged with bounded broker calls."""

    def __init__(
        self,
        broker: RabbitBroker,
        work_queue: WorkQueue,
        *,
        timeout_s: float,
        max_bytes: int = MAX_WALK_BYTES,
        budget_s: float = WALK_BUDGET_S,
    ) -> None:
        self._broker = broker
        self._name = work_queue.dead_letter_routing_key
        self._timeout_s = timeout_s
        self._max_bytes = max_bytes
        self._budget_s = budget_s
        self._walking = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def walk(self, *, deadline: float | None = None) -> AsyncIterator[HeldLetters]:
        """Hold every dead letter unacknowledged, up to `MAX_WALK` letters and the walker's
        byte budget (`MAX_WALK_BYTES` of bodies unless told); return the ones not settled on
        exit, then close the walk's channel: nothing it took stays held. Given a `deadline`
        (the event loop's clock), else the walker's budget from now (`WALK_BUDGET_S`), the
        walk waits for its turn only until then (`WalkBusy`, a 503) and takes no letter past
        it but the first (`timed_out` when more were left)."""
        # Without a deadline, its turn and its letters are taken within its budget: waiting
        # for its turn without one, a drop queued behind a replay outlasted the CLI's 30 s
        # and was applied after it had given up (the re-read of that change).
        loop = asyncio.get_running_loop()
        stop_at = loop.time() + self._budget_s if deadline is None else deadline
        await self._take_turn(stop_at)
        try:
            async with own_channel(
                self._broker, timeout_s=self._timeout_s, what=self._name
            ) as channel:
                held = HeldLetters()
                past: list[AbstractIncomingMessage] = []
                try:
                    queue = await channel.get_queue(self._name, ensure=False)
                    while (message := await self._get(queue)) is not None:
                        if held.full(self._max_bytes) or _past(stop_at, held):
                            # One letter past the bound: there is more. Not held (the caller
                            # never sees it), it goes back behind the others.
                            past.append(message)
                            held.truncated = held.full(self._max_bytes)
                            held.timed_out = not held.truncated
                            break
                        held.take(message)
                    yield held
                finally:
                    await self._give_back([*held, *past])
        finally:
            self._walking.release()

    async def _take_turn(self, deadline: float) -> None:
        """Walks through this walker take turns, each waiting until its `deadline`."""
        try:
            async with asyncio.timeout_at(deadline):
                await self._walking.acquire()
        except TimeoutError as error:
            raise WalkBusy(self._name) from error

    async def _get(self, queue: AbstractQueue) -> AbstractIncomingMessage | None:
        async with asyncio.timeout(GET_TIMEOUT_S + self._timeout_s):
            return await queue.get(no_ack=False, fail=False, timeout=GET_TIMEOUT_S)

    async def _give_back(self, letters: Sequence[AbstractIncomingMessage]) -> None:
        """Return the letters not settled, in the order taken. The first return that fails
        ends them: the channel is gone or stalled, every other return would fail (or wait)
        alike, and the walk's channel, closed next, has the broker take back the rest."""
        for message in letters:
            if message.processed:
                continue
            try:
                async with asyncio.timeout(self._timeout_s):
                    await message.nack(requeue=True)
            except BROKER_ERRORS as error:
                log.warning(
                    "dead letters of %s left to the broker to return as the walk's channel "
                    "closes: %r",
                    self._name,
                    error,
                )
                return

    async def remove(self, message: AbstractIncomingMessage) -> None:
        """Ack a held letter: it leaves the DLQ."""
        async with asyncio.timeout(self._timeout_s):
            await message.ack()

    async def drop(
        self, matches: Callable[[AbstractIncomingMessage], bool], *, cut_off: CutOff | None = None
    ) -> Dropped:
        """Remove every letter of one walk that `matches` (a DLQ may hold copies of one
        letter) and, given a `cut_off`, is known to have been dead-lettered before it (the
        others matching are `kept`); the others go back to the queue as every walk returns
        them, in the order taken."""
        async with self.walk() as held:
            chosen = [message for message in held if matches(message)]
            due = chosen if cut_off is None else [m for m in chosen if cut_off.passed(m)]
            for message in due:
                await self.remove(message)
        return Dropped(
            len(due), walked=len(held), truncated=held.stopped_short, kept=len(chosen) - len(due)
        )

    async def purge_before(self, cut_off: CutOff) -> Dropped:
        """Remove every letter of one walk known to have been dead-lettered before `cut_off`:
        letters past the walk's bounds are not looked at (`truncated`)."""
        return await self.drop(lambda _: True, cut_off=cut_off)

    async def purge(self) -> int:
        """Delete every letter not held by a walk; the number deleted. It takes its turn
        after this walker's walks (waiting the walker's budget at most, `WalkBusy`):
        `queue.purge` skips the letters a walk holds (every one of the queue's, up to its
        bound), and a purge during a listing or a replay answered 200 with those letters
        left, back in the queue when the walk ended."""
        await self._take_turn(asyncio.get_running_loop().time() + self._budget_s)
        try:
            async with own_channel(
                self._broker, timeout_s=self._timeout_s, what=self._name
            ) as channel:
                async with asyncio.timeout(self._timeout_s):
                    queue = await channel.get_queue(self._name, ensure=False)
                    result = await queue.purge(timeout=self._timeout_s)
        finally:
            self._walking.release()
        return int(result.message_count or 0)


def unmatched(
    asked: Collection[str], found: Set[str], *, truncated: bool, left: Set[str] = frozenset()
) -> tuple[list[str], list[str]]:
    """The ids `asked` that no letter of a walk matched, as (not found, not reached): past a
    walk that stopped short of the queue's end, an id no letter matched may still name one.
    Those of letters matched but `left` (a replay out of time) are not reached either."""
    missing = [key for key in asked if key not in found]
    stopped = [key for key in asked if key in left]
    return ([], missing + stopped) if truncated else (missing, stopped)


def letter_id(message: AbstractIncomingMessage) -> str:
    """A letter's id: its message id, else one made of its body (`body-` and 16 hex digits of
    its SHA-256). A letter published without a message id (by hand, or by a foreign
    producer) was listed as `?` and could not be named to drop it; letters of one body
    share the id, as copies of one letter share theirs."""
    if message.message_id:
        return message.message_id
    return f"body-{hashlib.sha256(message.body).hexdigest()[:16]}"


def readable_body(body: bytes) -> Any:
    """A letter's body as JSON when it is JSON the answer can hold, else as text (undecodable
    bytes replaced). JSON nested deeper than the answer's serializer goes (about 250 levels:
    orjson reads 1,024) is shown as text: as JSON, showing it was a 500, and an unreadable
    body from a foreign or faulty producer is what the scorer dead-letters."""
    try:
        parsed = orjson.loads(body)
        pydantic_core.to_json([parsed])  # one level down, as the answer holds it
    except (orjson.JSONDecodeError, pydantic_core.PydanticSerializationError):
        return body.decode("utf-8", "replace")
    return parsed


def shown_url(url: str) -> str:
    """A letter's URL as an admin route shows it: without credentials or query (a callback's
    query often carries the tenant's token); one that does not parse as a placeholder (it
    made a whole listing a 500)."""
    try:
        return url_shown(url)
    except ValueError:
        return UNPARSEABLE_URL


def with_url_shown(body: Any, field: str) -> Any:
    """A letter's body as shown whole: its URL at `field`, when it has one, as `shown_url`."""
    if isinstance(body, dict) and isinstance(body.get(field), str):
        return {**body, field: shown_url(body[field])}
    return body


def reason(headers: Mapping[str, Any]) -> str:
    """Why a letter was dead-lettered: our `x-scorebox-error`, and the first letter's when it
    was moved back and dead-lettered again (`x-scorebox-first-error`: the cause to mend is
    often that one); else RabbitMQ's `x-death`."""
    if ERROR_HEADER in headers:
        latest = str(headers[ERROR_HEADER])
        first = headers.get(FIRST_ERROR_HEADER)
        return latest if first is None else f"{latest} (first dead-lettered for: {first})"
    deaths = x_deaths(headers)
    if deaths:
        death = deaths[0]
        why = death.get("reason", "dead-lettered")
        return f"{why} by RabbitMQ (x-death, from {death.get('queue')})"
    return "unknown"


def dead_lettered_at(message: AbstractIncomingMessage, now: datetime) -> datetime | None:
    """When we dead-lettered it (a copy published with `x-scorebox-error`: its timestamp;
    an `x-death` it carries is an earlier death, a retry's wait on the ladder), else when
    RabbitMQ did (`x-death`); a time without a zone is taken in `now`'s."""
    deaths = x_deaths(message.headers)
    when = message.timestamp
    ours = ERROR_HEADER in message.headers and when is not None
    death = deaths[0] if deaths else {}
    if not ours and isinstance(death.get("time"), datetime):
        when = death["time"]
    if when is not None and when.tzinfo is None:
        when = when.replace(tzinfo=now.tzinfo)
    return when


def oldest_first(when: datetime | None) -> tuple[bool, datetime]:
    """A sort key: earliest first, letters of unknown time last."""
    return (when is None, when or datetime.min.replace(tzinfo=UTC))
