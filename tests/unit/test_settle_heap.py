"""`settle_heap`: what a service built before serving is left out of the cyclic collector's
walks, and the youngest generation is collected less often."""

import gc
import weakref
from collections.abc import Iterator

import pytest

from shared.runtime import GC_YOUNG_THRESHOLD, settle_heap


@pytest.fixture
def restored_collector() -> Iterator[None]:
    thresholds = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


@pytest.mark.usefixtures("restored_collector")
def test_objects_built_before_serving_are_no_longer_walked() -> None:
    class Node:
        def __init__(self) -> None:
            self.peer: Node | None = None

    built_at_start_up = [Node() for _ in range(1_000)]
    settle_heap()
    tracked = {id(thing) for thing in gc.get_objects()}
    assert not tracked & {id(node) for node in built_at_start_up}
    assert gc.get_freeze_count() >= len(built_at_start_up)


@pytest.mark.usefixtures("restored_collector")
def test_the_youngest_generation_waits_for_more_allocations() -> None:
    _, middle, oldest = gc.get_threshold()
    settle_heap()
    assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, middle, oldest)


@pytest.mark.usefixtures("restored_collector")
def test_garbage_cycles_made_after_start_up_are_still_collected() -> None:
    settle_heap()

    class Cycle:
        def __init__(self) -> None:
            self.me = self

    collected: list[bool] = []
    probe = Cycle()
    weakref.finalize(probe, collected.append, True)
    del probe
    gc.collect()
    assert collected == [True]
