"""Rate-limit pauses shared by the scorer replicas.

A provider's rate limit belongs to its account, not to one process: when one replica is
answered 429, the others' calls are refused as well. Each replica used to learn that from
its own calls, a round of 429s as wide as its model slots, each answer a call the provider
counts against the limit. Now a replica that begins a pause while none lasted
(`ModelThrottle`) publishes `ModelCallsPaused` (`ops.model.paused` on `scorebox.events`), and
every other replica calling the same provider with the same API key pauses for what is left
of it, then probes as after a pause of its own.

Best effort by design, with no retry: an announcement lost (the broker away) or late costs
only what the replicas paid before, each learning the limit from its own 429s. Nothing
waits for it: it is published in the background, one task per series of pauses, bounded by
the broker timeout, and none once the scorer stops.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime

from pydantic import ValidationError
from yarl import URL

from services.scorer.metrics import ScorerMetrics
from services.scorer.model.settings import ModelSettings
from services.scorer.throttle import MAX_PAUSE_S, ModelThrottle
from shared.consumers import Delivery, ScoreboxBroker, consume
from shared.contracts import ModelCallsPaused, new_id
from shared.settings import url_shown
from shared.topology import SCORER_PAUSES_BINDING, SCORER_PAUSES_PREFIX, scorer_pauses_queue

log = logging.getLogger("scorebox.scorer.pauses")

Publish = Callable[[ModelCallsPaused], Awaitable[None]]


def provider_of(settings: ModelSettings) -> str:
    """What a rate limit applies to: the provider's URL and the account's API key, as a
    fingerprint (a short digest of the key, never the key; the credentials a URL may carry
    stand for it, digested too: their password went out on the broker; a review)."""
    if settings.llm_provider != "openai":
        return settings.llm_provider
    url = URL(settings.llm_base_url)
    account = settings.llm_api_key.get_secret_value()
    if url.raw_user is None and not url.raw_query_string:
        # As earlier builds name it, character for character: replicas of two builds
        # heard each other's pauses through a rolling upgrade (a review).
        shown = settings.llm_base_url.rstrip("/")
    else:
        # Its credentials and query (a key may be there) stand for the account, digested.
        account += f" {url.raw_user or ''}:{url.raw_password or ''}?{url.raw_query_string}"
        shown = url_shown(settings.llm_base_url).rstrip("/")
    digest = hashlib.sha256(account.encode()).hexdigest()
    return f"{shown} key:{digest[:12]}"


class PauseAnnouncer:
    """Tells the other replicas of each pause this one begins (`ModelThrottle`'s `on_pause`)."""

    def __init__(
        self,
        *,
        publish: Publish,
        replica: str,
        provider: str,
        timeout_s: float,
        clock: Callable[[], datetime],
    ) -> None:
        self._publish = publish
        # What the pause is dated by: the clock its peers read its age on (the database's).
        self._clock = clock
        self._replica = replica
        self._provider = provider
        self._timeout_s = timeout_s
        self._sending: set[asyncio.Task[None]] = set()
        self._closed = False

    def announce(self, pause_s: float, outage: bool = False) -> None:
        """Publish in the background; never raises into the model call's 429 path."""
        if pause_s <= 0 or self._closed:
            return
        event = ModelCallsPaused(
            task_id=new_id(),
            provider=self._provider,
            pause_s=min(pause_s, MAX_PAUSE_S),
            replica=self._replica,
            outage=outage,
            occurred_at=self._clock(),
        )
        sending = asyncio.get_running_loop().create_task(self._send(event))
        self._sending.add(sending)
        sending.add_done_callback(self._sending.discard)

    async def close(self) -> None:
        """Cancel the announcements in flight and make no more (at stop: the calls still
        finishing in their slots may meet a 429 while the broker closes)."""
        self._closed = True
        for sending in list(self._sending):
            sending.cancel()
        await asyncio.gather(*self._sending, return_exceptions=True)

    async def _send(self, event: ModelCallsPaused) -> None:
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._publish(event)
        except Exception as error:  # noqa: BLE001 - best effort: the others learn it themselves
            log.warning(
                "the other scorers were not told of a %.1f s pause: %r", event.pause_s, error
            )


def peer_pause_left_s(
    event: ModelCallsPaused, *, replica: str, provider: str, now: datetime
) -> float:
    """What is left of another replica's pause for this one: 0 for its own, for another
    provider or key, and once over. Its age is read from the publisher's clock; a clock ahead
    of this one makes it look younger, never longer than it was."""
    if event.replica == replica or event.provider != provider:
        return 0.0
    age_s = max(0.0, (now - event.occurred_at).total_seconds())
    return max(0.0, event.pause_s - age_s)


def subscribe_shared_pauses(
    broker: ScoreboxBroker,
    throttle: ModelThrottle,
    metrics: ScorerMetrics,
    *,
    replica: str,
    provider: str,
    clock: Callable[[], datetime],
) -> None:
    """Hear the other replicas' pauses on this replica's own queue (auto-acknowledged: a
    pause lost costs only the 429s it would have saved)."""

    @consume(
        broker,
        scorer_pauses_queue(replica),
        ack_first=True,
        metric_label=SCORER_PAUSES_PREFIX.removesuffix("."),
        bindings=(SCORER_PAUSES_BINDING,),
    )
    async def pause_too(message: Delivery) -> None:
        try:
            event = ModelCallsPaused.model_validate_json(message.body)
        except ValidationError as error:
            log.warning("ignoring an unreadable pause announcement: %s", error)
            return
        left_s = peer_pause_left_s(event, replica=replica, provider=provider, now=clock())
        if left_s > 0 and throttle.paused_elsewhere(left_s, outage=event.outage):
            metrics.shared_pauses.inc()
            log.info(
                "model calls paused %.1f s: replica %s %s",
                left_s,
                event.replica,
                "found the provider down" if event.outage else "was answered 429",
            )
