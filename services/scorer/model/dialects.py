"""What each model takes of a request's optional parameters, learnt from its refusals.

OpenAI's reasoning models (o1, o3, o4-mini, gpt-5) refuse `max_tokens` (they take
`max_completion_tokens`) and any `temperature` but their own, with a 400 naming the
parameter (`code: unsupported_parameter` or `unsupported_value`, `param`). The settings
(`LLM_TOKEN_LIMIT_FIELD`, `LLM_TEMPERATURE`) are one for all models, so where a request may
name another model than `LLM_MODEL` (`LLM_ALLOWED_MODELS`), whichever way they were set every
task of the other kind failed as misconfigured. A refusal of one of these two parameters is
therefore a question of dialect, not a failure: the call is sent again at once, adapted, and
the model's calls are sent so from then on (a 400 bills nothing). Any other 400 is the task's
failure as before.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Final

log = logging.getLogger("scorebox.scorer.model")

TOKEN_LIMIT_FIELDS: Final = ("max_tokens", "max_completion_tokens")
_REFUSALS: Final = frozenset({"unsupported_parameter", "unsupported_value"})
# Models whose dialect is kept; the oldest learnt is forgotten past it (any model may be
# named where `LLM_ALLOWED_MODELS` is empty).
MAX_MODELS_KEPT: Final = 256


@dataclass(frozen=True)
class Dialect:
    """How a model is sent the output limit (`token_limit_field`) and the `temperature`
    (None: not sent)."""

    token_limit_field: str
    temperature: float | None

    def adapted_to(
        self, error: Mapping[str, Any] | None, *, refused: frozenset[str] = frozenset()
    ) -> Dialect | None:
        """The dialect a 400 refusing one of these parameters asks for; None for any other
        error, one that names a parameter this dialect does not send, or one that asks for
        a field `refused` already (a server refusing both would be asked for ever)."""
        if not error or str(error.get("code") or "") not in _REFUSALS:
            return None
        param = str(error.get("param") or "")
        if param == self.token_limit_field:
            other = next(field for field in TOKEN_LIMIT_FIELDS if field != param)
            return None if other in refused else replace(self, token_limit_field=other)
        if param == "temperature" and self.temperature is not None:
            return replace(self, temperature=None)
        return None


class Dialects:
    """The dialect of each model: the configured one until a model refuses it."""

    def __init__(self, configured: Dialect) -> None:
        self._configured = configured
        self._learnt: dict[str, Dialect] = {}

    def of(self, model: str) -> Dialect:
        return self._learnt.get(model, self._configured)

    def learn(self, model: str, dialect: Dialect, *, refused: str) -> Dialect:
        """`model` refused a parameter (`refused`, the provider's words): it is sent
        `dialect` from now on."""
        if model not in self._learnt and len(self._learnt) >= MAX_MODELS_KEPT:
            del self._learnt[next(iter(self._learnt))]
        self._learnt[model] = dialect
        temperature = "none" if dialect.temperature is None else f"{dialect.temperature:g}"
        log.warning(
            "%s refused a parameter (%s): its calls send the output limit as %s and "
            "temperature %s from now on (LLM_TOKEN_LIMIT_FIELD, LLM_TEMPERATURE)",
            model,
            refused,
            dialect.token_limit_field,
            temperature,
        )
        return dialect
