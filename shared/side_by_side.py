"""Round trips made at once instead of one after another (the topology's declarations, the
consumers' starts), failing as the first of them fails."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterable
from typing import Any, cast


async def side_by_side[T](steps: Iterable[Coroutine[Any, Any, T]]) -> list[T]:
    """Every one of `steps` at once, their results in order. The first failure is raised as
    it is, the others cancelled, as when they ran one after another (a `TaskGroup`'s
    `ExceptionGroup` hid a `TimeoutError` from the start-up's handling of its deadline)."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(each) for each in steps]
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [task.result() for task in tasks]


async def all_through[T](steps: Iterable[Coroutine[Any, Any, T]]) -> list[T]:
    """Every one of `steps` at once, each left to finish; then the first failure raised as it
    is, else their results in order. For steps whose cancellation would do harm of its own:
    a consumer's start cancelled during its `basic.consume` was left consuming, uncounted,
    and aiormq closes the channel of an RPC it cancels, the shared consuming channel
    included (a re-read of `side_by_side` there)."""
    settled = await asyncio.gather(*steps, return_exceptions=True)
    for each in settled:
        if isinstance(each, BaseException):
            raise each
    return cast("list[T]", settled)
