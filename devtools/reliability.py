"""Render the fault tests' figures into the README's reliability section.

    python -m devtools.reliability [--results .run/results/faults.json] [--readme README.md]
                                   [--check | --stdout]

The fault tests (`tests/faults`) write one entry per test to `.run/results/faults.json`:
`{name, accepted, completed, failed, duplicate_model_calls, http_5xx_seen, time_to_recover_s,
broker, database, notes}`, plus the command that ran them. This turns that file into a Markdown
table and replaces what stands between the README's markers

    <!-- reliability:begin -->
    <!-- reliability:end -->

so the published figures are always the ones a test run produced, never typed by hand.
`--check` only says whether the README is current (exit 1 if not); `--stdout` prints the block.

Exit codes: 0 done (or current), 1 `--check` found the README stale, 2 no results or no markers.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

BEGIN = "<!-- reliability:begin -->"
END = "<!-- reliability:end -->"
DEFAULT_RESULTS = Path(".run/results/faults.json")
DEFAULT_README = Path("README.md")


class ReliabilityError(Exception):
    """The results or the README cannot be used; the message says what to do."""


@dataclass(frozen=True)
class Outcome:
    """One fault test's figures."""

    name: str
    accepted: int
    completed: int
    failed: int
    duplicate_model_calls: int
    http_5xx_seen: dict[str, int]
    time_to_recover_s: float | None
    broker: str
    database: str
    notes: str


@dataclass(frozen=True)
class Results:
    """A test run's figures and how they were produced."""

    command: str
    invocation: str
    generated_at: str
    environment: str
    outcomes: tuple[Outcome, ...]


def _field[T](entry: dict[str, Any], name: str, kind: type[T], where: str) -> T:
    value = entry.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ReliabilityError(f"{where}: `{name}` should be {kind.__name__}, got {value!r}")
    return value


def _outcome(entry: object, index: int) -> Outcome:
    where = f"result #{index + 1}"
    if not isinstance(entry, dict):
        raise ReliabilityError(f"{where} is not an object")
    seen = _field(entry, "http_5xx_seen", dict, where)
    recover = entry.get("time_to_recover_s")
    if recover is not None and not isinstance(recover, int | float):
        raise ReliabilityError(f"{where}: `time_to_recover_s` should be a number or null")
    return Outcome(
        name=_field(entry, "name", str, where),
        accepted=_field(entry, "accepted", int, where),
        completed=_field(entry, "completed", int, where),
        failed=_field(entry, "failed", int, where),
        duplicate_model_calls=_field(entry, "duplicate_model_calls", int, where),
        http_5xx_seen={str(code): int(count) for code, count in seen.items()},
        time_to_recover_s=None if recover is None else float(recover),
        broker=_field(entry, "broker", str, where),
        database=_field(entry, "database", str, where),
        notes=str(entry.get("notes") or ""),
    )


def load_results(path: Path) -> Results:
    """Read and check the JSON the fault tests wrote."""
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        raise ReliabilityError(
            f"no fault-test results at {path}: run `make test-faults` first"
        ) from None
    except (OSError, ValueError) as error:
        raise ReliabilityError(f"cannot read {path}: {error}") from error
    if not isinstance(document, dict) or not isinstance(document.get("results"), list):
        raise ReliabilityError(f"{path} has no `results` list")
    outcomes = tuple(_outcome(entry, i) for i, entry in enumerate(document["results"]))
    if not outcomes:
        raise ReliabilityError(f"{path} holds no results: run `make test-faults`")
    environment = ", ".join(
        str(document[key]) for key in ("python", "host") if document.get(key) is not None
    )
    return Results(
        command=str(document.get("command") or "make test-faults"),
        invocation=str(document.get("invocation") or ""),
        generated_at=str(document.get("generated_at") or "?"),
        environment=f"Python {environment}" if environment else "",
        outcomes=outcomes,
    )


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _when(stamp: str) -> str:
    try:
        return datetime.fromisoformat(stamp).strftime("%Y-%m-%d %H:%M UTC")
    except ValueError:
        return stamp


def _http_5xx(seen: dict[str, int]) -> str:
    shown = {"503": seen.get("503", 0), "500": seen.get("500", 0)}
    shown |= {code: n for code, n in sorted(seen.items()) if code not in shown and n}
    return ", ".join(f"{code}: {n}" for code, n in shown.items())


def render(results: Results) -> str:
    """The Markdown that goes between the README's markers (markers excluded)."""
    broker, _ = Counter(o.broker for o in results.outcomes).most_common(1)[0]
    database, _ = Counter(o.database for o in results.outcomes).most_common(1)[0]
    ran = f"`{results.command}`"
    if results.invocation:
        ran += f" (`{results.invocation}`)"
    lines = [
        f"Figures of the last fault-test run, produced by {ran} on "
        f"{_when(results.generated_at)}"
        + (f" ({results.environment})" if results.environment else "")
        + "; rendered by `python -m devtools.reliability`, not typed by hand.",
        "",
        f"- Broker: {broker}.",
        f"- Database: {database}.",
        "- Duplicate model calls: calls beyond the documented retries and repairs.",
        "- Time to recover: from the fault being lifted to the first successful 202 "
        "(or `/readyz` 200 of a restarted service).",
        "",
        "| Fault | Accepted | Completed | Failed | Duplicate model calls | 5xx seen by clients "
        "| Time to recover | Notes |",
        "|---|---:|---:|---:|---:|---|---:|---|",
    ]
    for o in results.outcomes:
        notes = [o.notes] if o.notes else []
        if o.broker != broker:
            notes.append(f"broker: {o.broker}")
        if o.database != database:
            notes.append(f"database: {o.database}")
        recover = "n/a" if o.time_to_recover_s is None else f"{o.time_to_recover_s:.1f} s"
        cells = [
            o.name,
            str(o.accepted),
            str(o.completed),
            str(o.failed),
            str(o.duplicate_model_calls),
            _http_5xx(o.http_5xx_seen),
            recover,
            "; ".join(notes),
        ]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def replace_block(readme: str, block: str, *, readme_name: str = "README.md") -> str:
    """`readme` with the text between the markers replaced by `block`."""
    begins, ends = readme.count(BEGIN), readme.count(END)
    start, stop = readme.find(BEGIN), readme.find(END)
    if begins != 1 or ends != 1 or stop < start:
        found = f"found {begins} begin and {ends} end marker(s)"
        raise ReliabilityError(
            f"{readme_name} has no usable reliability block ({found}): put the line {BEGIN} "
            f"and, below it, the line {END} where the table belongs, once each"
        )
    head = readme[: start + len(BEGIN)]
    tail = readme[stop:]
    return f"{head}\n{block}{tail}"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m devtools.reliability",
        description="Render the fault tests' figures into the README's reliability section.",
    )
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    parser.add_argument("--readme", type=Path, default=DEFAULT_README)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 if the README is not current")
    mode.add_argument("--stdout", action="store_true", help="print the block, touch nothing")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        block = render(load_results(args.results))
        if args.stdout:
            sys.stdout.write(block)
            return 0
        try:
            readme = args.readme.read_text()
        except OSError as error:
            raise ReliabilityError(f"cannot read {args.readme}: {error}") from error
        updated = replace_block(readme, block, readme_name=str(args.readme))
    except ReliabilityError as error:
        print(f"reliability: {error}", file=sys.stderr)
        return 2
    if updated == readme:
        print(f"{args.readme}: reliability section is current")
        return 0
    if args.check:
        print(f"{args.readme}: reliability section is stale; run `python -m devtools.reliability`")
        return 1
    args.readme.write_text(updated)
    print(f"{args.readme}: reliability section updated from {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
