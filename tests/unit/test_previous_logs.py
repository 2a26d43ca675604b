"""`make run` keeps the last run's logs in `<log dir>/previous/`: every run started its logs
afresh, so a run started to look into a failure wrote over the logs of it (found in a
walkthrough)."""

from __future__ import annotations

from pathlib import Path

from devtools.stack import keep_previous_logs


def test_the_last_runs_logs_move_to_previous_replacing_the_run_before(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    (logs / "previous").mkdir(parents=True)
    (logs / "previous" / "gateway.log").write_text("the run before the last\n")
    (logs / "previous" / "notifier.log").write_text("the run before the last\n")
    (logs / "gateway.log").write_text("the last run\n")
    (logs / "mongo.log").write_text("the last run's stand-in\n")

    keep_previous_logs(logs)

    assert sorted(path.name for path in logs.glob("*.log")) == []
    kept = {path.name: path.read_text() for path in (logs / "previous").iterdir()}
    assert kept == {"gateway.log": "the last run\n", "mongo.log": "the last run's stand-in\n"}


def test_a_first_run_has_nothing_to_keep(tmp_path: Path) -> None:
    keep_previous_logs(tmp_path / "logs")  # no directory yet
    assert not (tmp_path / "logs").exists()
