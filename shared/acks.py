"""Acknowledgements of one channel, sent together.

Handlers that finish in the same pass of the event loop (a group commit's round trip wakes
dozens at once) each ack their own delivery. `ChannelAcks` sends those acks as one
`basic.ack` with `multiple` where that is exact, instead of one frame each: every frame costs
the consumer an encode, a write and a wake-up, and the broker a command (on a quorum queue, a
settle in its log). `python -m bench.micro` measures the difference.

`multiple` acknowledges every outstanding delivery of the channel up to its tag, so it is
used only up to the highest tag below which everything is settled by us (acked, nacked or
rejected, each frame queued before the coalesced one). An ack above a gap (a delivery still
in a handler) goes on its own at once, as before: holding it back would keep the broker from
sending the next delivery in the prefetch window. Settled tags above the gap are kept as
runs, so what is remembered stays as small as the number of gaps (at most the deliveries in
hand), even when a delivery is never settled (a handler that raised leaves it to the
channel's close): the acks after it then go one by one.

Frames are planned and queued one batch at a time, in order, so a coalesced ack never
reaches the broker before a single ack of a tag it covers (which would then be unknown to the
broker and close the channel).
"""

from __future__ import annotations

import asyncio
import bisect
import contextvars
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import aiormq.abc

log = logging.getLogger("scorebox.consumers")


@dataclass(frozen=True, slots=True)
class AckFrame:
    tag: int
    multiple: bool


@dataclass(slots=True)
class SettledTags:
    """Which delivery tags of a channel are settled: all up to `through`, and `runs` above it
    (sorted, disjoint, not touching, inclusive; each starts past `through + 1`)."""

    through: int = 0
    runs: list[tuple[int, int]] = field(default_factory=list)

    def settle(self, tag: int) -> None:
        if tag <= self.through:
            return
        at = bisect.bisect_left(self.runs, (tag, tag))
        first, last = tag, tag
        if at > 0 and self.runs[at - 1][1] >= tag - 1:
            at -= 1
            first, last = self.runs[at][0], max(self.runs[at][1], tag)
        end = at
        while end < len(self.runs) and self.runs[end][0] <= last + 1:
            last = max(last, self.runs[end][1])
            end += 1
        self.runs[at:end] = [(first, last)]
        if self.runs[0][0] == self.through + 1:
            self.through = self.runs.pop(0)[1]

    def plan(self, due: Iterable[int]) -> list[AckFrame]:
        """Settle `due` and return the frames that ack exactly those tags."""
        due = sorted(set(due))
        for tag in due:
            self.settle(tag)
        covered = [tag for tag in due if tag <= self.through]
        frames = [AckFrame(covered[-1], multiple=len(covered) > 1)] if covered else []
        frames.extend(AckFrame(tag, multiple=False) for tag in due if tag > self.through)
        return frames


class ChannelAcks:
    """The acks of one (aiormq) channel: requested by handlers, sent once per loop pass."""

    def __init__(self, channel: aiormq.abc.AbstractChannel) -> None:
        self._channel = channel
        self._tags = SettledTags()
        self._due: list[int] = []
        self._sending = asyncio.Lock()
        self._flushes: set[asyncio.Task[None]] = set()

    def ack(self, tag: int) -> None:
        """Ack `tag` at the end of this pass of the loop, with the others asked for in it.

        Nothing waits for the frame: a failure to send it (the channel closed) is logged, and
        the broker redelivers the message as it would after any lost ack. `drain()` waits
        for everything asked for so far, before the connection closes."""
        if not self._due:
            # In a context of its own: it sends the acks of many deliveries, not the first's
            # (whose correlation id its log lines would carry).
            asyncio.get_running_loop().call_soon(self._flush, context=contextvars.Context())
        self._due.append(tag)

    def settled(self, tag: int) -> None:
        """`tag` was nacked or rejected: its frame is queued, so a later `multiple` may
        cover it."""
        self._tags.settle(tag)

    async def drain(self) -> None:
        """Wait until the acks asked for so far are written (or failed).

        Only sends still running are waited for: a finished one stays in `_flushes` until its
        done-callback runs, and waiting on finished tasks (`gather` completes at once, without
        yielding) would spin without ever letting that callback run."""
        while True:
            self._flush()
            running = [task for task in self._flushes if not task.done()]
            if not running:
                return
            await asyncio.wait(running)

    def _flush(self) -> None:
        if not self._due:
            return
        due, self._due = self._due, []
        task = asyncio.get_running_loop().create_task(
            self._send(due), context=contextvars.Context()
        )
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def _send(self, due: list[int]) -> None:
        try:
            async with self._sending:
                frames = self._tags.plan(due)
                for frame in frames[:-1]:
                    await self._channel.basic_ack(frame.tag, multiple=frame.multiple, wait=False)
                await self._channel.basic_ack(frames[-1].tag, multiple=frames[-1].multiple)
        except Exception as error:  # noqa: BLE001 - logged; the broker redelivers what it lost
            log.warning(
                "channel %s: acks of %d deliveries not sent (%r); the broker redelivers them",
                self._channel.number,
                len(due),
                error,
            )
