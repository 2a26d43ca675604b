"""Coalesced point reads: concurrent `find_one({"_id": ...})` calls on one collection share one
`find({"_id": {"$in": [...]}})` round trip (`shared.coalescing`).

Each caller gets the document with its `_id` (only the fields of the reader's `projection`,
when it has one), or None; a failed round trip fails every read of
its batch with the same error. A read queued after a write completed is sent after it, so it
sees that write, as a lone `find_one` would.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pymongo.asynchronous.collection import AsyncCollection

from shared.coalescing import Coalescer, Queued, settle

Document = dict[str, Any]
MAX_BATCH = 500


class GroupReader(Coalescer[str, Document | None]):
    """Point reads by `_id` (a string) from `collection`, coalesced into `$in` queries."""

    def __init__(
        self,
        collection: AsyncCollection[Document],
        *,
        projection: Mapping[str, Any] | None = None,
        max_batch: int = MAX_BATCH,
    ):
        # No `ServerWatch`: a read has nothing to tell "never sent" from "maybe written".
        super().__init__(max_batch=max_batch, deadline_s=collection.database.client.options.timeout)
        self.collection = collection
        self._projection = projection

    async def find_by_id(self, document_id: str) -> Document | None:
        return await self.submit(document_id)

    async def _send(self, batch: list[Queued[str, Document | None]]) -> None:
        wanted = list({queued.op for queued in batch})
        found: dict[str, Document] = {}
        query = self.collection.find({"_id": {"$in": wanted}}, projection=self._projection)
        async for document in query.batch_size(len(wanted)):
            found[document["_id"]] = document
        for queued in batch:
            settle(queued, found.get(queued.op))
