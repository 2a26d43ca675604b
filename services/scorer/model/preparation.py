"""The text a model actually sees: normalised, within budget, with its warning flags."""

from __future__ import annotations

from dataclasses import dataclass

from services.scorer.errors import InputRejected
from services.scorer.model.base import FLAG_INSTRUCTION_IN_TEXT, FLAG_TRUNCATED
from services.scorer.model.normalise import fit_to_budget
from services.scorer.model.prompt import detect_instructions
from shared.text import is_blank, normalise_text


@dataclass(frozen=True)
class PreparedText:
    """A text ready to score and the flags its result must carry."""

    text: str
    flags: tuple[str, ...]

    @property
    def truncated(self) -> bool:
        return FLAG_TRUNCATED in self.flags


def prepare_text(text: str, *, max_chars: int) -> PreparedText:
    """Normalise `text`, fit it to `max_chars` and flag what the result must warn about.

    Raises `InputRejected` when nothing is left to score (`shared.text.is_blank`, which the
    gateway checks up front). Instructions are looked for in the whole text, cut part
    included: an attempt to steer the judge is worth flagging anywhere.
    """
    normalised = normalise_text(text)
    if is_blank(normalised):
        raise InputRejected(
            "the text has nothing but blanks, control characters and invisible characters"
        )
    fitted, truncated = fit_to_budget(normalised, max_chars)
    flags: list[str] = []
    if truncated:
        flags.append(FLAG_TRUNCATED)
    if detect_instructions(normalised):
        flags.append(FLAG_INSTRUCTION_IN_TEXT)
    return PreparedText(text=fitted, flags=tuple(flags))
