"""`python -m bench.history [DIR]`: one row per benchmark run kept, oldest first.

Reads every results file directly in `bench/results/` (or DIR) that has a throughput run with
its Celery baseline, and prints a Markdown table of the figures that compare across runs:
the host's speed (the reference workload), and Scorebox's CPU per task as a ratio to Celery's
measured in the same run. Absolute figures are shown too, but move with the host.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from bench.summary import DASH, TIMES

RESULTS_DIR = Path(__file__).resolve().parent / "results"

HEADER = (
    "| run | commit | reference workload ms | Scorebox tasks/s | Celery tasks/s "
    "| scorer CPU ms/task | Celery worker ms/task | scorer / worker "
    "| all Scorebox processes / worker + producer | drain last / first |",
    "|---|---|---|---|---|---|---|---|---|---|",
)


def history_rows(directory: Path = RESULTS_DIR) -> Iterator[str]:
    for path in sorted(directory.glob("*.json")):
        row = _row(path.stem, json.loads(path.read_text()))
        if row is not None:
            yield row


def _row(name: str, results: dict[str, Any]) -> str | None:
    """The run's row, or None when it has no throughput run with a Celery baseline; a figure
    a run did not record shows as a dash."""
    throughput = results.get("scenarios", {}).get("throughput", {})
    scorebox, celery = throughput.get("scorebox"), throughput.get("celery")
    if not scorebox or not celery:
        return None
    cpu = scorebox.get("cpu_ms_per_task") or {}
    worker = celery.get("worker_cpu_ms_per_task")
    producer = celery.get("producer_cpu_ms_per_task")
    cells = [
        name,
        str(results.get("git", "?"))[:7],
        _number(results.get("machine", {}).get("reference_workload_ms"), "{:.0f}"),
        _number(scorebox.get("tasks_per_s"), "{:.1f}"),
        _number(celery.get("tasks_per_s"), "{:.1f}"),
        _number(cpu.get("scorer"), "{:.2f}"),
        _number(worker, "{:.2f}"),
        _ratio(cpu.get("scorer"), worker),
        _ratio(cpu.get("scorebox_total"), None if worker is None else worker + (producer or 0)),
        _drain(results),
    ]
    return "| " + " | ".join(cells) + " |"


def _drain(results: dict[str, Any]) -> str:
    scorebox = results.get("scenarios", {}).get("growth", {}).get("scorebox") or {}
    drain = scorebox.get("drain") or {}
    return _ratio(drain.get("last_quarter_per_s"), drain.get("first_quarter_per_s"))


def _ratio(numerator: float | None, denominator: float | None) -> str:
    if not numerator or not denominator:
        return DASH
    return f"{numerator / denominator:.2f}{TIMES}"


def _number(value: float | None, spec: str) -> str:
    return DASH if value is None else spec.format(value)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.history", description=__doc__)
    parser.add_argument("directory", nargs="?", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    print("\n".join([*HEADER, *history_rows(args.directory)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
