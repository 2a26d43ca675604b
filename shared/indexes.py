"""Indexes a collection no longer needs, dropped at start-up; and queries a partial index
serves.

An index costs every write that touches its fields; one that no query uses costs only that.
When a release stops using one, `drop_retired_indexes` removes it from deployments that
created it earlier (`create_index` never removes anything). Idempotent: a missing index, or
a missing collection, is what it wants.
"""

from __future__ import annotations

from typing import Any

from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import OperationFailure

# MongoDB's IndexNotFound and NamespaceNotFound.
ALREADY_GONE = frozenset({26, 27})


async def drop_retired_indexes(collection: AsyncCollection[Any], *names: str) -> None:
    for name in names:
        try:
            await collection.drop_index(name)
        except OperationFailure as error:
            if error.code not in ALREADY_GONE:
                raise


def string_key(value: str) -> dict[str, Any]:
    """A query condition on a field indexed only where it is a string (a partial index with
    `partialFilterExpression: {field: {$type: "string"}}`).

    MongoDB's planner uses a partial index only for a query that provably implies its
    filter, and an equality to a string does not imply `$type: "string"` to it: without the
    clause repeated, such a query scans the collection (a batch's progress, an
    `Idempotency-Key` lookup)."""
    return {"$eq": value, "$type": "string"}
