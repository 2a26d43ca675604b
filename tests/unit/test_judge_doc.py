"""The documented judge prompt is the one the scorer sends."""

from __future__ import annotations

from devtools.judge_doc import DOC, render


def test_docs_show_the_prompt_the_scorer_sends() -> None:
    assert DOC.read_text(encoding="utf-8") == render(), "run python -m devtools.judge_doc"
