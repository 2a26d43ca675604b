"""What a consumer waits for at start (`consume(..., starts_after=...)`), waited for again
after each reconnection.

aio-pika restores every consumer of a robust connection at once when the connection comes
back, so a consumer that started only once something was done (the scorer's work, once the
cancellations queued before it were handled) got its deliveries alongside the others again:
a cancellation queued while the connection was down raced its task's delivery, and the task
was claimed and scored. `ReconnectionGates` closes such a consumer's gate when any connection
it watches is lost (the consuming one, and a replica's own queues', whose queue hears the
batch cancellations), and opens it once every one is back and the `starts_after` of each
gated consumer, in their order, has run again: the deliveries that arrive meanwhile wait in
hand (the prefetch bounds them). A connection still down `OTHERS_GRACE_S` after the gates
shut (the own queues' one after a partition, refused until the broker drops the lost one)
holds them no longer: they reopen then, and shut and reopen once more when it is back. A
`starts_after` that raises is logged and opens its gate all the same (at start it would
have stopped the service; here the service runs on). A loss during the wait leaves the
gates shut for the next reconnection's run; a stop opens them all, for the deliveries in
hand to be handled as a stop handles them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aio_pika.abc import AbstractRobustConnection

log = logging.getLogger("scorebox.consumers")
# How long a watched connection still down keeps the gates shut.
OTHERS_GRACE_S = 60.0

StartsAfter = Callable[[], Awaitable[object]]


@dataclass(frozen=True)
class _Gate:
    queue: str
    starts_after: StartsAfter
    opened: asyncio.Event = field(default_factory=asyncio.Event)


class ReconnectionGates:
    """The gates of the consumers that wait for something, and the connections that shut
    them (see module)."""

    def __init__(self, *, others_grace_s: float = OTHERS_GRACE_S) -> None:
        self._gates: list[_Gate] = []
        self._others_grace_s = others_grace_s
        self._down: set[int] = set()  # the watched connections lost, by id
        self._consuming: set[int] = set()  # those the gated consumers' deliveries come on
        self._losses = 0
        self._stopped = False
        self._reopening: set[asyncio.Task[None]] = set()
        self._grace: asyncio.Task[None] | None = None

    def gate(self, queue: str, starts_after: StartsAfter) -> asyncio.Event:
        """An open gate for the consumer of `queue`, in line after those made before."""
        gate = _Gate(queue, starts_after)
        gate.opened.set()
        self._gates.append(gate)
        return gate.opened

    def watch(self, connection: AbstractRobustConnection, *, consuming: bool) -> None:
        """Shut the gates when `connection` is lost, reopen them once it is back. The gated
        consumers' deliveries come on a `consuming` one: the grace never reopens while it
        is down (reopened then, what was held went to handlers on a dead channel, and what
        its restored consumers delivered before it was called back passed the gate; a
        review)."""
        if self._gates:
            if consuming:
                self._consuming.add(id(connection))
            connection.close_callbacks.add(self._lost)
            connection.reconnect_callbacks.add(self._back)

    def stop(self) -> None:
        """Open every gate for good (the service stops)."""
        self._stopped = True
        for gate in self._gates:
            gate.opened.set()
        for reopening in self._reopening:
            reopening.cancel()

    def _lost(self, connection: object, *_callback_args: object) -> None:
        """A loss of a connection up. aio-pika calls it again at each failed attempt to
        connect or restore: not new losses, or a connection refused for good would shut
        the gates again each time the grace had opened them."""
        if self._stopped or id(connection) in self._down:
            return
        self._down.add(id(connection))
        log.warning(
            "%s: held until the broker connection is back and what it waits for ran again",
            ", ".join(gate.queue for gate in self._gates),
        )
        self._shut()
        self._keep_the_grace()

    def _back(self, connection: object, *_callback_args: object) -> None:
        """Shut again (a gate the grace opened must not let the restored consumers' first
        deliveries through), and reopen once every watched connection is back."""
        if self._stopped:
            return
        self._down.discard(id(connection))
        self._shut()
        if self._down:
            self._keep_the_grace()
            return
        if self._grace is not None:
            # Done only a loop turn later: a loss in this turn took it for a timer asleep,
            # and none reopened while that connection was down (a review's model check).
            self._grace.cancel()
            self._grace = None
        self._spawn(self._reopen(self._losses))

    def _keep_the_grace(self) -> None:
        """A grace timer sleeping while a connection is down. Its reopening runs apart: one
        it began can be cut short by a loss, and a timer still inside it was taken for one
        asleep, so a loss then started none and the gates stayed shut for as long as the
        other connection was down (a walkthrough's simulation)."""
        if self._grace is None or self._grace.done():
            self._grace = self._spawn(self._reopen_after_grace())

    def _shut(self) -> None:
        self._losses += 1
        for gate in self._gates:
            gate.opened.clear()

    def _spawn(self, reopening: Coroutine[object, object, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(reopening)
        self._reopening.add(task)
        task.add_done_callback(self._reopening.discard)
        return task

    async def _reopen_after_grace(self) -> None:
        await asyncio.sleep(self._others_grace_s)
        if self._down & self._consuming:
            log.warning("held while the consuming connection is down, past the grace")
            return  # its return reopens them, or starts the grace again
        if self._down and not self._stopped:
            log.warning(
                "a connection is still down %.0f s after the gates shut: consuming again",
                self._others_grace_s,
            )
            self._spawn(self._reopen(self._losses))

    async def _reopen(self, loss: int) -> None:
        for gate in self._gates:
            began = time.perf_counter()
            try:
                await gate.starts_after()
            except Exception:
                log.exception("%s: what it waits for failed after a reconnection", gate.queue)
            if loss != self._losses or self._stopped:
                return  # lost again meanwhile: the next reconnection reopens it
            gate.opened.set()
            log.info(
                "%s: consuming again after the reconnection, %.2f s later",
                gate.queue,
                time.perf_counter() - began,
            )
