"""The result cache (seed 1, §5.4): a completed result for the same normalised text, rubric
and model, per tenant, answers a new submission at once without a model call.

Filled from `task.completed` events (the gateway keeps each submission's cache key and the
model it names; a completion whose scorer asked for another model, as after a switch of
`LLM_MODEL`, is not cached), read at submit time. Results that were themselves served from
the cache, or flagged as suspicious, are not cached. With `RUBRIC_VERSION` set, only results
scored under that version are kept and served: after a rubric change, a submission is scored
under the new one.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Callable, Collection
from datetime import datetime, timedelta
from typing import Any

import orjson
from pymongo import ASCENDING, AsyncMongoClient
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import PyMongoError

from services.gateway.errors import DatabaseUnavailable
from shared.contracts import HEURISTIC_PROMPT_VERSION, ScoreResult
from shared.group_reads import GroupReader
from shared.group_writes import GroupWriter
from shared.log_rate import Tally
from shared.text import normalise_text

log = logging.getLogger("scorebox.gateway.cache")

Document = dict[str, Any]
UNCACHEABLE_FLAGS = frozenset({"instruction_in_text"})
# How often at most the completions not cached for another model than their key's are logged.
OTHER_MODEL_REPORT_S = 60.0
# A provider's answer names the model asked for with its snapshot's date, as OpenAI's
# "gpt-4o-mini-2024-07-18" and Anthropic's "claude-3-5-haiku-20241022".
_SNAPSHOT_DATE = r"(?:-\d{4}-\d{2}-\d{2}|-\d{8})?"


def cache_key(text: str, rubric: str | None, model: str | None) -> str:
    """Texts match when the scorer would send the model the same text: `normalise_text`,
    its own rule (Unicode form, runs of spaces, blank-line runs, outer blanks). Line and
    paragraph breaks count: the model reads them, and a long text is cut at a paragraph's
    end, so texts differing only there may be scored, or cut, differently."""
    canonical = normalise_text(text)
    return hashlib.sha256(orjson.dumps([canonical, rubric or "", model or ""])).hexdigest()


def scoring_model(requested: str | None, default_model: str) -> str:
    """The model that will score a submission, as its cache key names it. The offline
    heuristic scores whatever model a submission names: keyed by the name asked for, its
    results were served after a switch to that model for real (`default_model` names the
    heuristic while it is the provider)."""
    if default_model == HEURISTIC_PROMPT_VERSION:
        return default_model
    return requested or default_model


def cacheable(result: ScoreResult) -> bool:
    return not result.cached and not UNCACHEABLE_FLAGS.intersection(result.flags)


def scored_by_key_model(
    *, requested_model: str | None, result: ScoreResult, key_model: str | None
) -> bool:
    """Whether a completion was scored by the model its submission's cache key names. The
    scorer says which model it asked for (`requested_model`); a scorer switched to another
    `LLM_MODEL` after the submission was accepted, or a gateway whose default names another
    model, filled that model's key with this one's results. A scorer of an earlier build
    does not say: the provider's answer must name the key's model, dated or not, or the
    result is not cached (taken as the key's, as first built, another provider's results
    filled the key during a rolling deploy). A submission recorded before its key's model
    was (`key_model` None): cached as before."""
    if key_model is None:
        return True
    if requested_model is not None:
        return requested_model == key_model
    return re.fullmatch(re.escape(key_model) + _SNAPSHOT_DATE, result.model) is not None


class OtherModelCompletions:
    """A WARNING line, at most once a `every_s`, about the completions not cached because
    their scorer asked for another model than their cache key names. Passing after a switch
    of `LLM_MODEL` (the tasks accepted before it); lasting, the gateway keys submissions
    naming no model by another default than the scorer's, and the cache never fills (it was
    logged at debug only: a cache silently empty)."""

    def __init__(
        self, *, every_s: float = OTHER_MODEL_REPORT_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._tally = Tally(every_s, clock)

    def note(self, task_id: str, *, scored_by: str | None, keyed_by: str | None) -> None:
        log.debug("task %s: scored by %s, keyed by %s: not cached", task_id, scored_by, keyed_by)
        if (count := self._tally.count()) is None:
            return
        log.warning(
            "result cache: completions scored by another model than their key names are not "
            "cached: %d since the last line, the latest task %s, scored by %s, keyed by %s. "
            "Lasting past the tasks accepted before a switch of LLM_MODEL, the gateway's "
            "LLM_PROVIDER and LLM_MODEL differ from the scorer's: set them alike.",
            count,
            task_id,
            scored_by,
            keyed_by,
        )


class ResultCache:
    def __init__(
        self,
        client: AsyncMongoClient[Document],
        database: str,
        ttl: timedelta,
        *,
        prompt_versions: Collection[str] | None = None,
        other_model: OtherModelCompletions | None = None,
    ) -> None:
        self._collection: AsyncCollection[Document] = client[database]["result_cache"]
        self.other_model = other_model or OtherModelCompletions()
        self._ttl = ttl
        self._prompt_versions = prompt_versions
        self._writes = GroupWriter(self._collection)
        self._reads = GroupReader(self._collection)

    async def ensure_indexes(self) -> None:
        await self._collection.create_index([("expires_at", ASCENDING)], expireAfterSeconds=0)

    async def find(self, *, tenant_id: str, key: str, now: datetime) -> ScoreResult | None:
        try:
            document = await self._reads.find_by_id(f"{tenant_id}:{key}")
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error
        # Expired entries linger until the TTL monitor's next pass (once a minute).
        if document is None or document["expires_at"] <= now:
            return None
        result = ScoreResult.model_validate(document["result"])
        return result if self._current(result) else None

    def _current(self, result: ScoreResult) -> bool:
        """Scored under a current prompt version (any, when none is given)."""
        return self._prompt_versions is None or result.prompt_version in self._prompt_versions

    async def remember(
        self, *, tenant_id: str, key: str, result: ScoreResult, task_id: str, now: datetime
    ) -> None:
        if not self._current(result):
            return  # a re-score or a late outcome of an earlier rubric: never served
        entry = {
            "result": result.model_dump(mode="json"),
            "task_id": task_id,
            "expires_at": now + self._ttl,
        }
        try:
            await self._writes.update_one(
                {"_id": f"{tenant_id}:{key}"}, {"$set": entry}, upsert=True
            )
        except PyMongoError as error:
            raise DatabaseUnavailable(str(error)) from error
