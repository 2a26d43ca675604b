"""`bench.run.evaluate_targets`: the issue's targets, judged from a results file."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from bench.report import render
from bench.run import evaluate_targets
from bench.summary import TIMES

README_RUN = Path(__file__).resolve().parents[2] / "bench/results/20261201T144835Z.json"
SIDE_BY_SIDE = f"scorer CPU ≤ 0.5 {TIMES} Celery's worker (the same run)"


def _results() -> dict[str, Any]:
    results: dict[str, Any] = json.loads(README_RUN.read_text())
    return results


def _target(results: dict[str, Any], name: str) -> dict[str, Any]:
    return next(t for t in evaluate_targets(results) if t["target"] == name)


def test_the_scorer_is_judged_against_celerys_worker_of_the_same_run() -> None:
    results = _results()
    throughput = results["scenarios"]["throughput"]
    ratio = (
        throughput["scorebox"]["cpu_ms_per_task"]["scorer"]
        / (throughput["celery"]["worker_cpu_ms_per_task"])
    )
    target = _target(results, SIDE_BY_SIDE)
    assert target["measured"] == f"{ratio:.3g}{TIMES}"
    assert target["met"] is False


def test_a_scorer_under_half_of_celerys_worker_meets_it() -> None:
    results = copy.deepcopy(_results())
    throughput = results["scenarios"]["throughput"]
    throughput["scorebox"]["cpu_ms_per_task"]["scorer"] = (
        0.4 * throughput["celery"]["worker_cpu_ms_per_task"]
    )
    assert _target(results, SIDE_BY_SIDE)["met"] is True


def test_without_a_celery_baseline_the_side_by_side_target_is_left_out() -> None:
    results = copy.deepcopy(_results())
    del results["scenarios"]["throughput"]["celery"]
    assert all(t["target"] != SIDE_BY_SIDE for t in evaluate_targets(results))


def test_the_readme_run_renders_with_every_target() -> None:
    block = render(_results(), README_RUN.name)
    assert SIDE_BY_SIDE in block
    assert "drain: last quarter" in block


def test_a_run_of_the_scorers_alone_is_not_passed_off_as_the_whole_stack() -> None:
    results = copy.deepcopy(_results())
    inflight = results["scenarios"]["inflight"]
    many = next(
        t["target"] for t in evaluate_targets(results) if "Celery gevent at C" in t["target"]
    )
    assert "the scorers alone" not in _target(results, many)["note"]
    inflight["parameters"]["mode"] = "alone"
    assert "the scorers alone" in _target(results, many)["note"]
    assert "Alone mode:" in render(results, README_RUN.name)
