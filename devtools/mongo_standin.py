"""A MongoDB wire-protocol stand-in (mongoeco) for machines without a MongoDB server.

    python -m devtools.mongo_standin --host 127.0.0.1 --port 27017 [--engine memory|sqlite]
                                     [--path FILE] [--exit-with-parent] [--write-costs FILE]

Once listening it prints one JSON line, `{"url": "mongodb://HOST:PORT/?directConnection=true"}`,
and serves until SIGINT or SIGTERM. `--port 0` picks a free port. It is NOT MongoDB: development
and tests only (no change streams; single-threaded, so it bounds throughput measured on it).
`--write-costs FILE` writes, when it stops, the CPU its write commands took per
`database.collection` (where its time goes, run as the `MONGO_URL` of `python -m bench.run`).

It runs on the standard asyncio loop, not uvloop: mongoeco's shutdown calls
`asyncio.Server.abort_clients()` (Python 3.13), which uvloop's server does not have.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from devtools.lifetime import run_until_stopped, starter_to_outlive


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m devtools.mongo_standin",
        description="MongoDB wire-protocol stand-in (mongoeco); NOT MongoDB, for dev and tests.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=27017, help="0 picks a free port")
    parser.add_argument("--engine", choices=("memory", "sqlite"), default="memory")
    parser.add_argument("--path", help="database file of the sqlite engine")
    parser.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="stop when the process that started this one goes away",
    )
    parser.add_argument(
        "--write-costs",
        type=Path,
        help="at stop, write the CPU of its write commands per collection to this JSON file",
    )
    args = parser.parse_args(argv)
    if args.engine == "sqlite" and not args.path:
        parser.error("--engine sqlite needs --path FILE")
    return args


def make_engine(engine: str, path: str | None) -> Any:
    """The mongoeco storage engine to serve (imported here: mongoeco is a dev-only extra)."""
    if engine == "sqlite":
        from mongoeco.engines.sqlite import SQLiteEngine  # noqa: PLC0415

        return SQLiteEngine(path=str(path))
    from mongoeco.engines.memory import MemoryEngine  # noqa: PLC0415

    skip_scan_on_missing_string_id(MemoryEngine)
    skip_duplicate_scan_for_string_id(MemoryEngine)
    return MemoryEngine()


def skip_scan_on_missing_string_id(engine_class: Any) -> None:
    """Answer a filter on string `_id`s by key lookups, never by a scan.

    mongoeco 4.11's memory engine looks one `_id` up directly, but when the document is
    absent (every upsert of a new document) it falls back to scanning the whole collection,
    which made each insert-by-upsert cost time proportional to the collection's size; and it
    answers `{_id: {$in: [...]}}` (`shared.group_reads`) with a scan every time, over a second
    for 500 ids among 20,000 documents, where MongoDB walks its `_id` index. Without a
    collation a string `_id` equals only the same string, so the keys find every match.
    """
    from mongoeco.core.query_plan import AndCondition, InCondition  # noqa: PLC0415

    original = getattr(engine_class, "_candidate_items_for_plan_locked", None)
    if original is None or getattr(original, "_scorebox_patched", False):
        return  # another mongoeco version: served as it is

    def listed_string_ids(query_plan: Any) -> tuple[str, ...] | None:
        clauses = query_plan.clauses if isinstance(query_plan, AndCondition) else (query_plan,)
        for clause in clauses:
            if isinstance(clause, InCondition) and clause.field == "_id":
                strings = [value for value in clause.values if isinstance(value, str)]
                if len(strings) == len(clause.values):
                    return tuple(dict.fromkeys(strings))
        return None

    def candidate_items(self: Any, coll: Any, query_plan: Any, **options: Any) -> Any:
        if options.get("collation") is not None:
            return original(self, coll, query_plan, **options)
        wanted = self._direct_id_lookup_from_plan(query_plan)
        if isinstance(wanted, str) and self._storage_key(wanted) not in coll:
            return []
        listed = listed_string_ids(query_plan) if wanted is None else None
        if listed is not None:
            keys = (self._storage_key(value) for value in listed)
            return [(key, coll[key]) for key in keys if key in coll]
        return original(self, coll, query_plan, **options)

    candidate_items._scorebox_patched = True  # type: ignore[attr-defined]
    engine_class._candidate_items_for_plan_locked = candidate_items


def skip_duplicate_scan_for_string_id(engine_class: Any) -> None:
    """Check a new document's string `_id` for duplicates by its key alone.

    mongoeco 4.11 inserts one document by comparing its `_id` with every stored one (so that
    `1` and `1.0` collide), on top of the direct key lookup: time proportional to the
    collection's size per insert. A string `_id` equals only the same string, which the direct
    lookup already finds.
    """
    original = getattr(engine_class, "_ensure_unique_indexes", None)
    if original is None or getattr(original, "_scorebox_patched", False):
        return  # another mongoeco version: served as it is

    def ensure_unique_indexes(
        self: Any, db_name: str, coll_name: str, candidate: Any, **options: Any
    ) -> Any:
        if options.get("scan_payload_id") and isinstance(candidate.get("_id"), str):
            options["scan_payload_id"] = False
        return original(self, db_name, coll_name, candidate, **options)

    ensure_unique_indexes._scorebox_patched = True  # type: ignore[attr-defined]
    engine_class._ensure_unique_indexes = ensure_unique_indexes


class WriteCosts:
    """The CPU (`time.process_time`) of the stand-in's insert, update and delete commands per
    `<kind> <database>.<collection>`: commands, statements, seconds. The memory engine
    answers a command without yielding to the loop, so the time is the command's own."""

    KINDS = ("insert", "update", "delete")

    def __init__(self) -> None:
        self.costs: defaultdict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])

    def install(self) -> None:
        from mongoeco.api._async import _database_admin_write_commands as commands  # noqa: PLC0415

        service = commands.DatabaseAdminWriteCommandService
        for kind in self.KINDS:
            setattr(
                service, f"command_{kind}", self._timed(kind, getattr(service, f"command_{kind}"))
            )

    def _timed(
        self, kind: str, command: Callable[..., Awaitable[object]]
    ) -> Callable[..., Awaitable[object]]:
        statements_field = {"insert": "documents", "update": "updates", "delete": "deletes"}[kind]

        async def timed(service: Any, spec: dict[str, Any], **options: Any) -> object:
            started = time.process_time()
            try:
                return await command(service, spec, **options)
            finally:
                name = f"{kind} {service._admin._database.name}.{spec.get(kind)}"
                entry = self.costs[name]
                entry[0] += 1
                entry[1] += len(spec.get(statements_field) or ())
                entry[2] += time.process_time() - started

        return timed

    def write(self, path: Path) -> None:
        report = {
            name: {"commands": int(c), "statements": int(n), "cpu_s": round(s, 4)}
            for name, (c, n, s) in sorted(self.costs.items(), key=lambda kv: -kv[1][2])
        }
        path.write_text(json.dumps(report, indent=1) + "\n")


async def serve(args: argparse.Namespace) -> None:
    from mongoeco.wire.proxy import AsyncMongoEcoProxyServer  # noqa: PLC0415

    parent_pid = starter_to_outlive(exit_with_parent=args.exit_with_parent)
    costs = WriteCosts() if args.write_costs else None
    if costs is not None:
        costs.install()
    server = AsyncMongoEcoProxyServer(
        engine=make_engine(args.engine, args.path), host=args.host, port=args.port
    )
    address = await server.start()
    try:
        print(json.dumps({"url": address.uri}), flush=True)
        await run_until_stopped(parent_pid=parent_pid)
    finally:
        await server.close()
        if costs is not None:
            costs.write(args.write_costs)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        asyncio.run(serve(args))
    except OSError as error:
        print(f"mongo stand-in: cannot listen on {args.host}:{args.port}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
