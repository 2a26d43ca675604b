"""Synchronous helpers for tests that drive processes: deadlines, never bare sleeps."""

from __future__ import annotations

import selectors
import subprocess
import threading
import time
from collections.abc import Callable

POLL_INTERVAL_S = 0.05


def wait_for[T](probe: Callable[[], T | None], *, timeout_s: float, what: str) -> T:
    """Call `probe` until it returns something other than None/False, or fail at the deadline."""
    deadline = time.monotonic() + timeout_s
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last is not None and last is not False:
            return last
        time.sleep(POLL_INTERVAL_S)
    raise AssertionError(f"{what} not reached within {timeout_s}s (last: {last!r})")


def read_line_within(process: subprocess.Popen[bytes], *, timeout_s: float) -> str:
    """One line of a child's stdout, or fail at the deadline."""
    assert process.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout=timeout_s):
            raise AssertionError(f"no output within {timeout_s}s")
    return process.stdout.readline().decode()


class LineCollector:
    """Collects a child's stdout lines on a thread, so tests can wait on them with a deadline."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None
        self._stream = process.stdout
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._collect, daemon=True)
        self._thread.start()

    def _collect(self) -> None:
        for raw in iter(self._stream.readline, b""):
            self.lines.append(raw.decode(errors="replace"))

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for_text(self, needle: str, *, timeout_s: float) -> str:
        try:
            wait_for(lambda: needle in self.text, timeout_s=timeout_s, what=repr(needle))
        except AssertionError as error:
            raise AssertionError(f"{error}; output so far:\n{self.text}") from None
        return self.text
