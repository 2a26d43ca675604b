"""`devtools.reliability`: the figures the fault tests write become the README's table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from devtools.reliability import (
    BEGIN,
    END,
    ReliabilityError,
    load_results,
    main,
    render,
    replace_block,
)

RESULTS = {
    "generated_at": "2026-11-30T16:01:00+00:00",
    "command": "make test-faults",
    "invocation": "pytest tests/faults -q",
    "python": "3.13.0",
    "host": "2 CPU(s)",
    "results": [
        {
            "name": "scorer killed | kill -9",
            "accepted": 40,
            "completed": 40,
            "failed": 0,
            "duplicate_model_calls": 8,
            "http_5xx_seen": {"500": 0, "503": 0},
            "time_to_recover_s": 1.44,
            "broker": "RabbitMQ 3.10.8",
            "database": "stand-in (NOT MongoDB)",
            "notes": "8 in flight",
        },
        {
            "name": "MongoDB stopped",
            "accepted": 10,
            "completed": 10,
            "failed": 0,
            "duplicate_model_calls": 4,
            "http_5xx_seen": {"500": 0, "503": 3},
            "time_to_recover_s": None,
            "broker": "RabbitMQ 3.10.8",
            "database": "its own stand-in",
            "notes": "",
        },
    ],
}
README = f"# Scorebox\n\n## Reliability\n\n{BEGIN}\n(not yet generated)\n{END}\n\n## Next\n"


@pytest.fixture
def results_file(tmp_path: Path) -> Path:
    path = tmp_path / "faults.json"
    path.write_text(json.dumps(RESULTS))
    return path


def test_the_table_has_a_row_per_fault_and_names_command_broker_and_database(
    results_file: Path,
) -> None:
    block = render(load_results(results_file))
    assert "`make test-faults` (`pytest tests/faults -q`)" in block
    assert "- Broker: RabbitMQ 3.10.8." in block
    assert "| scorer killed \\| kill -9 | 40 | 40 | 0 | 8 | 503: 0, 500: 0 | 1.4 s |" in block
    assert "| MongoDB stopped | 10 | 10 | 0 | 4 | 503: 3, 500: 0 | n/a |" in block
    assert "database: its own stand-in" in block


def test_only_the_block_between_the_markers_is_replaced(results_file: Path, tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(README)
    assert main(["--results", str(results_file), "--readme", str(readme), "--check"]) == 1
    assert main(["--results", str(results_file), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# Scorebox\n\n## Reliability\n\n" + BEGIN + "\n")
    assert text.endswith(END + "\n\n## Next\n")
    assert "(not yet generated)" not in text
    assert main(["--results", str(results_file), "--readme", str(readme), "--check"]) == 0


def test_missing_markers_or_results_stop_with_a_clear_message(
    results_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# Scorebox\n")
    assert main(["--results", str(results_file), "--readme", str(readme)]) == 2
    assert f"put the line {BEGIN}" in capsys.readouterr().err
    assert readme.read_text() == "# Scorebox\n"
    assert main(["--results", str(tmp_path / "none.json"), "--readme", str(readme)]) == 2
    assert "run `make test-faults` first" in capsys.readouterr().err
    with pytest.raises(ReliabilityError, match="once each"):
        replace_block(f"{END}\n{BEGIN}\n", "x")
