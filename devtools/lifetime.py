"""How the development servers (`mongo_standin`, `fake_llm`) end: on SIGINT or SIGTERM, and,
when asked, once the process that started them is gone (killed before it could stop them)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

PARENT_CHECK_INTERVAL_S = 1.0


def install_stop_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)


async def watch_parent(stop: asyncio.Event, parent_pid: int) -> None:
    """Set `stop` once this process is re-parented (its starter died without stopping us)."""
    while not stop.is_set():
        if os.getppid() != parent_pid:
            stop.set()
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=PARENT_CHECK_INTERVAL_S)


def starter_to_outlive(*, exit_with_parent: bool) -> int | None:
    """The pid `run_until_stopped` watches: read before the server announces itself. Read
    after, a starter killed as soon as it read the announcement was missed (its orphan then
    watched its new parent, and served on)."""
    return os.getppid() if exit_with_parent else None


async def run_until_stopped(*, parent_pid: int | None) -> None:
    """Wait for SIGINT/SIGTERM, or, given `parent_pid`, for that parent to go."""
    stop = asyncio.Event()
    install_stop_signals(stop)
    if parent_pid is not None:
        await watch_parent(stop, parent_pid)
    await stop.wait()
