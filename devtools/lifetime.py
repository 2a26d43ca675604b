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


async def run_until_stopped(*, exit_with_parent: bool) -> None:
    """Wait for SIGINT/SIGTERM, or for the parent to go when `exit_with_parent`."""
    stop = asyncio.Event()
    install_stop_signals(stop)
    if exit_with_parent:
        await watch_parent(stop, os.getppid())
    await stop.wait()
