"""How much CPU the cyclic garbage collector takes in each process of a run.

Put `bench/gc_probe` on `PYTHONPATH` and name a directory in `GC_PROBE_DIR`; every Python
process started so (the services of `python -m bench.run` included) then times its
collections with `gc.callbacks` and rewrites `<GC_PROBE_DIR>/<pid>.txt` every
`GC_PROBE_EVERY_S` seconds (5) and at exit, counting only after `GC_PROBE_AFTER_S` seconds
(25: start-up left out; CPU time is counted from the first rewrite or collection after it):

    GC_PROBE_DIR=/tmp/gc PYTHONPATH=bench/gc_probe \\
        python -m bench.run --scenario throughput --n 3000 --no-celery --out /tmp/gc.json
    cat /tmp/gc/*.txt

Each line: the command, CPU time and collector time since the warm-up, and per generation
how many collections took how long. A diagnosis, not part of the benchmark's results.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any


class GcTimer:
    """Collections and their thread CPU time, per generation, after a warm-up."""

    def __init__(self, out: Path, *, after_s: float) -> None:
        self.out = out
        self.counted_from = time.monotonic() + after_s
        self.cpu_from: float | None = None
        self.count = [0, 0, 0]
        self.spent_s = [0.0, 0.0, 0.0]
        self._began = 0.0

    def on_collection(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.thread_time()
            return
        if not self._counting():
            return
        generation = int(info["generation"])
        self.count[generation] += 1
        self.spent_s[generation] += time.thread_time() - self._began

    def _counting(self) -> bool:
        """Whether the warm-up is over; the CPU time is counted from the first call after it."""
        if time.monotonic() < self.counted_from:
            return False
        if self.cpu_from is None:
            self.cpu_from = time.process_time()
        return True

    def line(self) -> str:
        self._counting()
        cpu_s = time.process_time() - self.cpu_from if self.cpu_from is not None else 0.0
        spent_s = sum(self.spent_s)
        share = f"{spent_s / cpu_s * 100:.1f} %" if cpu_s else "-"
        generations = " ".join(
            f"gen{generation} {count} in {spent * 1000:.0f} ms"
            for generation, (count, spent) in enumerate(zip(self.count, self.spent_s, strict=True))
        )
        command = " ".join(sys.argv)[-60:]
        return (
            f"{command}: CPU {cpu_s:.2f} s, collector {spent_s * 1000:.0f} ms ({share}); "
            f"{generations}\n"
        )

    def write(self) -> None:
        self.out.write_text(self.line())


def install() -> None:
    """Time this process's collections when `GC_PROBE_DIR` is set (else do nothing)."""
    directory = os.environ.get("GC_PROBE_DIR")
    if not directory:
        return
    timer = GcTimer(
        Path(directory) / f"{os.getpid()}.txt",
        after_s=float(os.environ.get("GC_PROBE_AFTER_S", "25")),
    )
    gc.callbacks.append(timer.on_collection)
    atexit.register(timer.write)
    _rewrite_every(timer, float(os.environ.get("GC_PROBE_EVERY_S", "5")))


def _rewrite_every(timer: GcTimer, seconds: float) -> None:
    # Services may end without running atexit (a signal), so the file is kept current.
    def tick() -> None:
        timer.write()
        _rewrite_every(timer, seconds)

    repeat = threading.Timer(seconds, tick)
    repeat.daemon = True
    repeat.start()
