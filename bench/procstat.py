"""CPU time and memory of processes, read from `/proc` (Linux only).

A `CpuMeter` snapshots named groups of processes (a service's replicas, the broker, the
database) before and after a measured window and samples them meanwhile, so a report can say
how many CPU milliseconds each group spent per task, how busy it was at its busiest and how
large each process grew (`VmHWM`, the peak resident set since the process started).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PROC = Path("/proc")
SAMPLE_INTERVAL_S = 0.5
MACHINE = "machine"  # the whole machine, every process of every user


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of `pid` (threads included), or None once it is gone."""
    try:
        raw = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: the fields follow the last ')'.
    fields = raw.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine spent busy (all cores; idle and iowait excluded)."""
    fields = [int(x) for x in (PROC / "stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / CLOCK_TICKS


def memory_kib(pid: int) -> tuple[int, int] | None:
    """(current RSS, peak RSS) of `pid` in KiB, or None once it is gone."""
    try:
        lines = (PROC / str(pid) / "status").read_text().splitlines()
    except OSError:
        return None
    values: dict[str, int] = {}
    for line in lines:
        key, _, rest = line.partition(":")
        if key in {"VmRSS", "VmHWM"}:
            values[key] = int(rest.split()[0])
    return values.get("VmRSS", 0), values.get("VmHWM", 0)


def children_of(pid: int) -> list[int]:
    """Every descendant of `pid` (celery, for one, may fork helpers)."""
    parents: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(raw.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(entry.name))
    found: list[int] = []
    pending = [pid]
    while pending:
        for child in parents.get(pending.pop(), []):
            found.append(child)
            pending.append(child)
    return found


def command_line(pid: int) -> str:
    with contextlib.suppress(OSError):
        return (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    return ""


def find_processes(executable: str, must_contain: str) -> list[int]:
    """Pids whose `comm` is `executable` and whose command line contains `must_contain`."""
    found = []
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if comm == executable and must_contain in command_line(int(entry.name)):
            found.append(int(entry.name))
    return found


@dataclass
class GroupUsage:
    """What one named group of processes used during a window.

    `idle_cores` is what the group used while nothing was submitted (timers, heartbeats,
    other users of a shared broker), measured just before the window; `net_cpu_s` takes
    it out, which matters for slow runs, where fixed background costs swamp per-task ones.
    """

    cpu_s: float
    wall_s: float
    peak_utilisation: float  # busiest sample, in cores
    peak_rss_kib: dict[int, int]  # per pid
    idle_cores: float | None = None

    @property
    def mean_utilisation(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def net_cpu_s(self) -> float | None:
        if self.idle_cores is None:
            return None
        return max(0.0, self.cpu_s - self.idle_cores * self.wall_s)

    def as_dict(self, tasks: int) -> dict[str, object]:
        net = self.net_cpu_s
        return {
            "cpu_ms": round(self.cpu_s * 1000, 1),
            "cpu_ms_per_task": round(self.cpu_s * 1000 / tasks, 3) if tasks else None,
            "net_cpu_ms_per_task": round(net * 1000 / tasks, 3)
            if tasks and net is not None
            else None,
            "idle_cores": None if self.idle_cores is None else round(self.idle_cores, 3),
            "mean_cores": round(self.mean_utilisation, 3),
            "peak_cores": round(self.peak_utilisation, 3),
            "peak_rss_mib": {
                str(pid): round(kib / 1024, 1) for pid, kib in self.peak_rss_kib.items()
            },
            "processes": len(self.peak_rss_kib),
        }


@dataclass
class CpuMeter:
    """Measure named groups of pids over a window: `await idle(s)`, `start()`, `await stop()`.

    Groups are fixed when first used (descendants included, except for the groups in
    `alone`); a process that exits during the window keeps the CPU it was last seen with.
    """

    groups: Mapping[str, Sequence[int]]
    interval_s: float = SAMPLE_INTERVAL_S
    # Measured without their descendants (the bench itself: its children are the services,
    # measured on their own).
    alone: frozenset[str] = frozenset({"bench"})
    _pids: dict[str, list[int]] = field(default_factory=dict)
    _first: dict[int, float] = field(default_factory=dict)
    _last: dict[int, float] = field(default_factory=dict)
    _peak: dict[str, float] = field(default_factory=dict)
    _idle: dict[str, float] = field(default_factory=dict)
    _started: float = 0.0
    _machine_first: float = 0.0
    _sampler: asyncio.Task[None] | None = None

    def _resolve(self) -> None:
        if self._pids:
            return
        for name, pids in self.groups.items():
            found = set(pids)
            if name not in self.alone:
                found.update(child for pid in pids for child in children_of(pid))
            self._pids[name] = sorted(found)

    async def idle(self, seconds: float) -> None:
        """Measure each group's background use over `seconds` (call before `start`)."""
        self._resolve()
        before, machine_before, at = self._read(), machine_busy_seconds(), time.monotonic()
        await asyncio.sleep(seconds)
        after, machine_after = self._read(), machine_busy_seconds()
        elapsed = time.monotonic() - at
        for name, pids in self._pids.items():
            spent = sum(after.get(p, 0.0) - before.get(p, 0.0) for p in pids if p in before)
            self._idle[name] = spent / elapsed
        self._idle[MACHINE] = (machine_after - machine_before) / elapsed

    def start(self) -> None:
        self._resolve()
        self._first = self._read()
        self._last = dict(self._first)
        self._peak = dict.fromkeys([*self._pids, MACHINE], 0.0)
        self._machine_first = machine_busy_seconds()
        self._started = time.monotonic()
        self._sampler = asyncio.create_task(self._sample())

    async def stop(self) -> dict[str, GroupUsage]:
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler
        self._last.update(self._read())
        wall = time.monotonic() - self._started
        usage = {}
        for name, pids in self._pids.items():
            cpu = sum(self._last.get(pid, 0.0) - self._first.get(pid, 0.0) for pid in pids)
            peaks = {pid: mem[1] for pid in pids if (mem := memory_kib(pid)) is not None}
            usage[name] = GroupUsage(
                cpu_s=cpu,
                wall_s=wall,
                peak_utilisation=max(self._peak.get(name, 0.0), cpu / wall if wall else 0.0),
                peak_rss_kib=peaks,
                idle_cores=self._idle.get(name),
            )
        machine = machine_busy_seconds() - self._machine_first
        usage[MACHINE] = GroupUsage(
            cpu_s=machine,
            wall_s=wall,
            peak_utilisation=max(self._peak[MACHINE], machine / wall if wall else 0.0),
            peak_rss_kib={},
            idle_cores=self._idle.get(MACHINE),
        )
        return usage

    def _read(self) -> dict[int, float]:
        readings = {}
        for pids in self._pids.values():
            for pid in pids:
                seconds = cpu_seconds(pid)
                if seconds is not None:
                    readings[pid] = seconds
        return readings

    async def _sample(self) -> None:
        previous, previous_at = dict(self._first), time.monotonic()
        machine_before = self._machine_first
        while True:
            await asyncio.sleep(self.interval_s)
            now, now_at = self._read(), time.monotonic()
            elapsed = now_at - previous_at
            machine_now = machine_busy_seconds()
            if elapsed:
                self._peak[MACHINE] = max(
                    self._peak[MACHINE], (machine_now - machine_before) / elapsed
                )
                for name, pids in self._pids.items():
                    spent = sum(
                        now.get(p, previous.get(p, 0.0)) - previous.get(p, 0.0) for p in pids
                    )
                    self._peak[name] = max(self._peak[name], spent / elapsed)
            machine_before = machine_now
            self._last.update(now)
            previous, previous_at = {**previous, **now}, now_at
