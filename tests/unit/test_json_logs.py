"""`LOG_FORMAT=json`: one JSON object per line, from our loggers and from uvicorn's."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import textwrap
from datetime import datetime

import pytest
from pydantic import ValidationError

from shared.log_context import CorrelationFilter, correlated
from shared.runtime import json_log_formatter
from shared.settings import ServiceSettings
from tests.support_sync import read_line_within

SERVICE = textwrap.dedent(
    """
    import logging
    import warnings
    from fastapi import FastAPI
    from shared.runtime import run_service
    from shared.settings import ServiceSettings

    def make_app() -> FastAPI:
        logging.getLogger("scorebox.probe").warning("built", extra={"task_id": "t-1"})
        warnings.warn("a deprecation", UserWarning, stacklevel=1)
        return FastAPI()

    run_service("probe", ServiceSettings.model_validate({"LOG_FORMAT": "json"}), make_app)
    """
)


def test_a_record_is_one_json_object_with_its_extras_and_traceback() -> None:
    record = logging.LogRecord(
        "scorebox.gateway", logging.ERROR, __file__, 1, "boom %s", ("x",), None
    )
    error = RuntimeError("a bug")
    record.exc_info = (RuntimeError, error, None)
    record.task_id = "t-1"
    line = json_log_formatter("gateway").format(record)

    assert "\n" not in line
    entry = json.loads(line)
    assert (entry["level"], entry["logger"], entry["message"]) == (
        "ERROR",
        "scorebox.gateway",
        "boom x",
    )
    assert (entry["service"], entry["task_id"]) == ("gateway", "t-1")
    assert "RuntimeError: a bug" in entry["exc_info"]
    assert datetime.fromisoformat(entry["time"]).utcoffset() is not None


def test_a_service_run_with_json_logs_writes_only_json_lines_uvicorns_included() -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", SERVICE], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    lines: list[str] = []
    try:
        while not lines or "Uvicorn running" not in lines[-1]:
            lines.append(read_line_within(process, timeout_s=30))
    finally:
        process.send_signal(signal.SIGTERM)
        rest, _ = process.communicate(timeout=30)
    lines += rest.decode().splitlines()
    entries = [json.loads(line) for line in lines if line.strip()]
    assert {entry["service"] for entry in entries} == {"probe"}
    assert not [entry for entry in entries if "color_message" in entry]  # no terminal codes
    loggers = {entry["logger"] for entry in entries}
    assert {"scorebox.probe", "uvicorn.error", "py.warnings"} <= loggers
    built = next(entry for entry in entries if entry["logger"] == "scorebox.probe")
    assert (built["message"], built["task_id"], built["level"]) == ("built", "t-1", "WARNING")


def test_an_unknown_log_format_is_refused_at_start_up() -> None:
    with pytest.raises(ValidationError, match="LOG_FORMAT"):
        ServiceSettings.model_validate({"LOG_FORMAT": "xml"})


def test_records_logged_while_a_delivery_is_handled_carry_its_correlation_id() -> None:
    formatter, correlation = json_log_formatter("scorer"), CorrelationFilter()

    def logged(message: str) -> dict[str, object]:
        record = logging.LogRecord("scorebox.scorer", logging.INFO, __file__, 1, message, (), None)
        correlation.filter(record)
        entry: dict[str, object] = json.loads(formatter.format(record))
        return entry

    with correlated("task-7"):
        inside = logged("scoring")
    outside = logged("idle")

    assert inside["correlation_id"] == "task-7"
    assert "correlation_id" not in outside


def test_extras_never_make_invalid_json_nor_replace_standard_fields() -> None:
    """`NaN` was written as is (strict parsers refuse the line), and an extra named `level`,
    `logger` or `service` replaced the record's own."""
    record = logging.LogRecord("scorebox.scorer", logging.INFO, __file__, 1, "m", (), None)
    record.ratio = float("nan")
    record.limits = {"upper": float("inf")}
    record.level = "made up"
    record.service = "spoofed"
    entry = json.loads(json_log_formatter("scorer").format(record), parse_constant=_refuse)
    assert (entry["ratio"], entry["limits"]) == ("nan", {"upper": "inf"})
    assert (entry["level"], entry["service"], entry["logger"]) == (
        "INFO",
        "scorer",
        "scorebox.scorer",
    )
    assert (entry["extra_level"], entry["extra_service"]) == ("made up", "spoofed")


def _refuse(constant: str) -> object:
    raise AssertionError(f"not JSON: {constant}")
