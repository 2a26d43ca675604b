"""`python -m bench.report [RESULTS.json] [--readme README.md]`: put a run into the README.

Renders the given results file (default: the newest in `bench/results/`) as Markdown and
replaces what lies between `<!-- bench:begin -->` and `<!-- bench:end -->` in the README:
the command that reproduces it, the machine, broker, database and versions, one table per
scenario, the targets, and where the MongoDB stand-in bounded a number.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.run import evaluate_targets
from bench.summary import setting_lines, tables, targets_table

BEGIN = "<!-- bench:begin -->"
END = "<!-- bench:end -->"
RESULTS_DIR = Path(__file__).resolve().parent / "results"
README = Path(__file__).resolve().parent.parent / "README.md"


class ReportError(RuntimeError):
    pass


def latest_results(directory: Path = RESULTS_DIR) -> Path:
    found = sorted(directory.glob("*.json"), key=lambda p: (p.stat().st_mtime, p.name))
    if not found:
        raise ReportError(f"no results in {directory}/: run `make bench` first")
    return found[-1]


def render(results: dict[str, Any], source: str) -> str:
    """The Markdown block for one run (targets judged again by the current rules)."""
    results = {**results, "targets": evaluate_targets(results)}
    lines = [
        f"Produced by `python -m bench.report` from `{source}`; reproduce with:",
        "",
        "```",
        results["command"],
        "```",
        "",
        *[f"- {line}" for line in setting_lines(results)[1:]],  # [0] is the command
    ]
    database = results["database"]
    if database.get("is_standin"):
        lines += [
            "",
            "> **The database was the mongoeco stand-in, NOT MongoDB.** It is one Python thread "
            f"that spent {_standin_cost(results)} of CPU on each command, so wherever a row says "
            "*bounded by the MongoDB stand-in*, the number measures the stand-in rather than "
            "Scorebox; "
            "Scorebox's own CPU per task is not its CPU but depends on it too: its slow answers "
            'group writes that a MongoDB would answer one by one (docs/architecture.md, "The '
            'scorers on their own"). Set `MONGO_URL` (or run where '
            "Docker is available) for numbers against MongoDB.",
        ]
        if database.get("reduced_for_standin"):
            lines.append(
                "> Sizes reduced for the stand-in: "
                + ", ".join(database["reduced_for_standin"])
                + "."
            )
    if not results.get("finished_at"):
        lines += ["", "> This run did not finish; the tables hold what it measured."]
    for table in [*tables(results), targets_table(results)]:
        lines += ["", table.markdown()]
    failures = [
        f"{name}: {scenario[key]}"
        for name, scenario in results.get("scenarios", {}).items()
        for key in ("scorebox_error", "celery_error")
        if key in scenario
    ]
    if failures:
        lines += ["", "Failures:", *[f"- {failure}" for failure in failures]]
    return "\n".join(lines)


def replace_block(readme: str, block: str) -> str:
    begin, end = readme.find(BEGIN), readme.find(END)
    if begin < 0 or end < 0 or end < begin:
        raise ReportError(
            f"README has no `{BEGIN}` ... `{END}` block; add both markers where the "
            "performance numbers belong"
        )
    return readme[: begin + len(BEGIN)] + "\n" + block + "\n" + readme[end:]


def _standin_cost(results: dict[str, Any]) -> str:
    """The stand-in's CPU per command in the throughput run, e.g. "about 1.9 ms"."""
    run = results.get("scenarios", {}).get("throughput", {}).get("scorebox", {})
    cpu_ms = run.get("cpu_ms_per_task", {}).get("mongodb")
    commands = run.get("mongodb_ops_per_task", {}).get("total")
    if not cpu_ms or not commands:
        return "well over a tenth of a millisecond"
    return f"about {cpu_ms / commands:.1f} ms (in the throughput run)"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__)
    parser.add_argument("results", nargs="?", type=Path, help="default: the newest run")
    parser.add_argument("--readme", type=Path, default=README)
    parser.add_argument("--print", action="store_true", help="print the block, change nothing")
    args = parser.parse_args(argv)
    try:
        path = args.results or latest_results()
        results = json.loads(path.read_text())
        try:
            source = str(path.resolve().relative_to(Path.cwd()))
        except ValueError:
            source = str(path)
        block = render(results, source)
        if args.print:
            print(block)
            return 0
        readme = args.readme.read_text()
        args.readme.write_text(replace_block(readme, block))
    except (ReportError, OSError, json.JSONDecodeError, KeyError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"{args.readme}: performance section updated from {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
