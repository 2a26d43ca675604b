"""Indexes a collection no longer needs, dropped at start-up.

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
