"""`ReconnectionGates` across several connections, driven through aio-pika's own callback
collections as a robust connection calls them (a loss: `close_callbacks`; back and restored:
`reconnect_callbacks`). The broker-level behaviour is in
tests/integration/test_consumers_reconnection_gates.py."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
from aio_pika.tools import CallbackCollection

from shared.reconnection_gates import ReconnectionGates
from tests.support import eventually, loop_turns


class Connection:
    """What `ReconnectionGates.watch` uses of a robust connection."""

    def __init__(self) -> None:
        self.close_callbacks: CallbackCollection[Connection, [BaseException | None]] = (
            CallbackCollection(self)
        )
        self.reconnect_callbacks: CallbackCollection[Connection, []] = CallbackCollection(self)

    async def lose(self) -> None:
        await self.close_callbacks(ConnectionError("lost"))

    async def come_back(self) -> None:
        await self.reconnect_callbacks()


@dataclass
class Waited:
    """A `starts_after` that counts its runs and, once `hold` is cleared, waits for it."""

    runs: int = 0
    hold: asyncio.Event = field(default_factory=asyncio.Event)

    async def __call__(self) -> None:
        self.runs += 1
        await self.hold.wait()


def _gates(
    waited: Waited, consuming: Connection, *others: Connection, grace_s: float = 60.0
) -> asyncio.Event:
    gates = ReconnectionGates(others_grace_s=grace_s)
    opened = gates.gate("work", waited)
    gates.watch(consuming, consuming=True)  # type: ignore[arg-type]
    for connection in others:
        gates.watch(connection, consuming=False)  # type: ignore[arg-type]
    return opened


async def _ran(waited: Waited, times: int) -> None:
    async def ran() -> bool:
        return waited.runs == times

    await eventually(ran, what=f"starts_after run {times} times", timeout_s=5)


async def test_the_gate_stays_shut_until_every_watched_connection_is_back() -> None:
    """The own queues' connection (a replica's batch-cancels queue) came back seconds after
    the consuming one, and the gate had opened without it: a batch cancellation announced
    meanwhile was heard by no one (a review)."""
    waited, consuming, own = Waited(), Connection(), Connection()
    waited.hold.set()
    opened = _gates(waited, consuming, own)

    await consuming.lose()
    await own.lose()
    await consuming.come_back()
    await loop_turns()  # a reopening spawned now would have run its first steps

    assert not opened.is_set()
    assert waited.runs == 0
    await own.come_back()
    await eventually(lambda: _is(opened.is_set()), what="opened", timeout_s=5)
    assert waited.runs == 1


async def test_a_connection_still_down_holds_the_gate_no_longer_than_the_grace() -> None:
    """The own queues' connection alone lost and refused (a partition, until the broker
    drops the lost one): the work waits no longer than the grace."""
    waited, consuming, own = Waited(), Connection(), Connection()
    waited.hold.set()
    opened = _gates(waited, consuming, own, grace_s=0.1)

    await own.lose()

    assert not opened.is_set()
    await eventually(lambda: _is(opened.is_set()), what="opened after the grace", timeout_s=5)
    assert waited.runs == 1


async def test_failed_attempts_to_reconnect_do_not_shut_the_gate_the_grace_opened() -> None:
    """aio-pika calls the close callbacks again at each failed attempt (every 5 s for the
    own queues' connection): each shut the gate anew for another grace."""
    waited, consuming, own = Waited(), Connection(), Connection()
    waited.hold.set()
    opened = _gates(waited, consuming, own, grace_s=0.1)
    await own.lose()
    await eventually(lambda: _is(opened.is_set()), what="opened after the grace", timeout_s=5)

    await own.lose()  # an attempt failed

    assert opened.is_set()


async def test_a_loss_while_the_grace_reopens_starts_another_grace() -> None:
    """The own queues' connection down, the grace reopening (its wait for the cancels runs
    up to 15 s in the scorer), the consuming connection lost and back meanwhile: no grace
    was left to reopen, and the gate stayed shut while the own queues' connection was down
    (a walkthrough's simulation)."""
    waited, consuming, own = Waited(), Connection(), Connection()
    opened = _gates(waited, consuming, own, grace_s=0.1)
    await own.lose()
    await _ran(waited, 1)  # the grace reopening, held in what it waits for

    await consuming.lose()
    await consuming.come_back()
    waited.hold.set()

    await eventually(lambda: _is(opened.is_set()), what="opened by another grace", timeout_s=5)
    assert waited.runs == 2


async def test_a_connection_back_after_the_grace_shuts_the_gate_until_it_ran_again() -> None:
    """Its restored consumers' first deliveries must wait as after any reconnection."""
    waited, consuming, own = Waited(), Connection(), Connection()
    opened = _gates(waited, consuming, own, grace_s=0.1)
    waited.hold.set()
    await own.lose()
    await eventually(lambda: _is(opened.is_set()), what="opened after the grace", timeout_s=5)
    waited.hold.clear()

    await own.come_back()

    assert not opened.is_set()
    await _ran(waited, 2)
    waited.hold.set()
    await eventually(lambda: _is(opened.is_set()), what="opened again", timeout_s=5)


async def test_a_loss_while_reopening_leaves_the_gate_shut_for_the_next_reconnection() -> None:
    waited, consuming = Waited(), Connection()
    opened = _gates(waited, consuming)
    await consuming.lose()
    await consuming.come_back()
    await _ran(waited, 1)

    await consuming.lose()
    waited.hold.set()
    await loop_turns()

    assert not opened.is_set()
    await consuming.come_back()
    await eventually(lambda: _is(opened.is_set()), what="opened", timeout_s=5)
    assert waited.runs == 2


async def test_a_loss_in_the_turn_of_the_last_return_still_has_a_grace() -> None:
    """The grace cancelled at the return is done only a turn later: a loss in that turn took
    it for a timer asleep, started none, and the gate stayed shut while that connection was
    down (a review's model check). aio-pika calls its callbacks without awaiting them."""
    waited, consuming, own = Waited(), Connection(), Connection()
    waited.hold.set()
    opened = _gates(waited, consuming, own, grace_s=0.1)
    await consuming.lose()
    loop = asyncio.get_running_loop()

    loop.call_soon(consuming.reconnect_callbacks)
    loop.call_soon(own.close_callbacks, ConnectionError("lost"))

    await eventually(lambda: _is(opened.is_set()), what="opened after the grace", timeout_s=5)


async def test_the_grace_does_not_reopen_while_the_consuming_connection_is_down(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Reopened then, the deliveries held went to handlers on a dead channel, and those its
    restored consumers delivered before its return was called back passed the open gate
    (a review)."""
    waited, consuming, own = Waited(), Connection(), Connection()
    waited.hold.set()
    opened = _gates(waited, consuming, own, grace_s=0.1)
    await own.lose()
    await consuming.lose()

    await eventually(
        lambda: _is("held while the consuming connection is down" in caplog.text),
        what="the grace ended",
        timeout_s=5,
    )

    await loop_turns()  # a reopening the grace began would have run through by now
    assert (opened.is_set(), waited.runs) == (False, 0)
    await consuming.come_back()
    await eventually(lambda: _is(opened.is_set()), what="opened after the grace", timeout_s=5)


async def test_a_stop_opens_the_gate_for_good() -> None:
    waited, consuming = Waited(), Connection()
    gates = ReconnectionGates()
    opened = gates.gate("work", waited)
    gates.watch(consuming, consuming=True)  # type: ignore[arg-type]
    await consuming.lose()
    await consuming.come_back()
    await _ran(waited, 1)

    gates.stop()
    await consuming.lose()

    assert opened.is_set()


async def _is(value: bool) -> bool:
    return value
