"""`python -m bench.history`: the runs' comparable figures, computed from their result files."""

from __future__ import annotations

import json
from pathlib import Path

from bench.history import RESULTS_DIR, history_rows, main
from bench.summary import DASH, TIMES


def _run(scorer: float, total: float, worker: float, producer: float) -> dict[str, object]:
    return {
        "git": "0123456789ab",
        "machine": {"reference_workload_ms": 100.0},
        "scenarios": {
            "throughput": {
                "scorebox": {
                    "tasks_per_s": 50.0,
                    "cpu_ms_per_task": {"scorer": scorer, "scorebox_total": total},
                },
                "celery": {
                    "tasks_per_s": 300.0,
                    "worker_cpu_ms_per_task": worker,
                    "producer_cpu_ms_per_task": producer,
                },
            },
            "growth": {
                "scorebox": {"drain": {"first_quarter_per_s": 80.0, "last_quarter_per_s": 72.0}}
            },
        },
    }


def test_each_run_is_compared_with_the_celery_baseline_of_the_same_run(tmp_path: Path) -> None:
    (tmp_path / "20260101T000000Z.json").write_text(json.dumps(_run(1.0, 6.0, 2.0, 1.0)))
    (tmp_path / "20260102T000000Z.json").write_text(json.dumps({"scenarios": {}}))

    rows = list(history_rows(tmp_path))

    assert rows == [
        "| 20260101T000000Z | 0123456 | 100 | 50.0 | 300.0 | 1.00 | 2.00 "
        f"| 0.50{TIMES} | 2.00{TIMES} | 0.90{TIMES} |"
    ]


def test_a_run_missing_a_figure_shows_a_dash(tmp_path: Path) -> None:
    run = _run(1.0, 6.0, 2.0, 1.0)
    celery = run["scenarios"]["throughput"]["celery"]  # type: ignore[index]
    del celery["worker_cpu_ms_per_task"]
    celery["producer_cpu_ms_per_task"] = None
    (tmp_path / "20260101T000000Z.json").write_text(json.dumps(run))

    [row] = history_rows(tmp_path)

    assert row.count(f" {DASH} ") == 3  # the worker's CPU and the two ratios over it


def test_every_kept_run_renders() -> None:
    assert main([str(RESULTS_DIR)]) == 0
    assert all(row.startswith("| 2026") for row in history_rows())
