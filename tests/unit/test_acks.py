"""`shared.acks.SettledTags`: the ack frames planned for a batch acknowledge exactly the
deliveries whose acks were asked for, whatever the order handlers settle in."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.acks import AckFrame, SettledTags


@dataclass
class Broker:
    """What a channel's broker side holds: unacknowledged delivery tags. Stricter than
    RabbitMQ: a `multiple` ack must name an unacknowledged tag too."""

    unacked: set[int]
    acked: set[int] = field(default_factory=set)

    def apply(self, frame: AckFrame) -> set[int]:
        assert frame.tag in self.unacked, f"{frame} names a tag the broker does not hold"
        covered = {t for t in self.unacked if t <= frame.tag} if frame.multiple else {frame.tag}
        self.unacked -= covered
        self.acked |= covered
        return covered

    def settle_otherwise(self, tag: int) -> None:
        self.unacked.discard(tag)


def test_acks_finishing_in_order_go_as_one_multiple_frame() -> None:
    tags = SettledTags()
    assert tags.plan([3, 1, 2]) == [AckFrame(3, multiple=True)]
    assert tags.plan([4]) == [AckFrame(4, multiple=False)]


def test_an_ack_above_a_delivery_still_in_hand_goes_on_its_own() -> None:
    tags = SettledTags()
    assert tags.plan([1, 3, 4]) == [
        AckFrame(1, multiple=False),
        AckFrame(3, multiple=False),
        AckFrame(4, multiple=False),
    ]
    # 2 settles: the next batch may cover everything up to its own highest tag.
    assert tags.plan([2, 5, 6]) == [AckFrame(6, multiple=True)]


def test_a_delivery_nacked_or_rejected_closes_the_gap() -> None:
    tags = SettledTags()
    tags.settle(1)
    assert tags.plan([2, 3]) == [AckFrame(3, multiple=True)]
    assert tags.through == 3
    assert tags.runs == []


def test_a_delivery_never_settled_stops_coalescing_at_its_tag() -> None:
    tags = SettledTags()
    tags.plan([1])
    frames = tags.plan([3, 4, 5])
    assert all(not frame.multiple for frame in frames)
    assert tags.through == 1
    assert tags.runs == [(3, 5)]


def test_what_is_remembered_above_a_gap_stays_one_run() -> None:
    """Ten thousand deliveries settled after one that never is: one run, not ten thousand."""
    tags = SettledTags()
    for tag in range(10_001, 1, -1):  # in reverse, the worst order for merging
        tags.settle(tag)
    assert tags.through == 0
    assert tags.runs == [(2, 10_001)]
    tags.settle(1)
    assert tags.through == 10_001
    assert tags.runs == []


@st.composite
def settling(draw: st.DrawFn) -> tuple[int, list[tuple[str, int]]]:
    """Deliveries 1..n settled in any order, as ack (batched) or otherwise, some never;
    `flush` marks where a batch of acks is planned and sent."""
    n = draw(st.integers(min_value=1, max_value=60))
    order = draw(st.permutations(range(1, n + 1)))
    events: list[tuple[str, int]] = []
    for tag in order:
        kind = draw(st.sampled_from(["ack", "ack", "ack", "other", "never"]))
        if kind != "never":
            events.append((kind, tag))
        if draw(st.booleans()):
            events.append(("flush", 0))
    events.append(("flush", 0))
    return n, events


@settings(max_examples=2000, deadline=None)
@given(settling())
def test_planned_frames_ack_exactly_what_was_asked(case: tuple[int, list[tuple[str, int]]]) -> None:
    n, events = case
    broker = Broker(unacked=set(range(1, n + 1)))
    tags = SettledTags()
    due: list[int] = []
    asked: set[int] = set()
    settled_otherwise: set[int] = set()
    for kind, tag in events:
        if kind == "ack":
            due.append(tag)
            asked.add(tag)
        elif kind == "other":
            broker.settle_otherwise(tag)
            tags.settle(tag)
            settled_otherwise.add(tag)
        else:
            for frame in tags.plan(due):
                covered = broker.apply(frame)
                assert covered <= asked, "a multiple ack covered a delivery still in hand"
            due = []
    assert broker.acked == asked
    assert broker.unacked == set(range(1, n + 1)) - asked - settled_otherwise
    settled = asked | settled_otherwise
    assert all(tag in settled for tag in range(1, tags.through + 1))
    assert {t for first, last in tags.runs for t in range(first, last + 1)} == {
        tag for tag in settled if tag > tags.through
    }
    assert all(b[0] > a[1] + 1 for a, b in pairwise(tags.runs)), "runs touch or overlap"
