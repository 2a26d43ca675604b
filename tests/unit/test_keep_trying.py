"""`shared.runtime.keep_trying`: repeats until the action succeeds, or, with
`give_up_after_s`, raises the last error instead of waiting past that bound."""

from __future__ import annotations

import pytest

from shared.runtime import keep_trying


class Flaky:
    """Fails `failures` times with OSError, then answers."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise OSError(f"failure {self.calls}")
        return "done"


async def test_it_repeats_until_the_action_succeeds() -> None:
    action = Flaky(failures=3)
    result = await keep_trying(action, what="a write", retry_on=(OSError,), first_delay_s=0.01)
    assert (result, action.calls) == ("done", 4)


async def test_past_its_bound_it_raises_the_last_error() -> None:
    action = Flaky(failures=1_000_000)
    with pytest.raises(OSError, match="failure"):
        await keep_trying(
            action, what="a write", retry_on=(OSError,), first_delay_s=0.01, give_up_after_s=0.2
        )
    assert 1 < action.calls < 1_000_000


async def test_other_errors_are_not_retried() -> None:
    async def broken() -> None:
        raise ValueError("not a database error")

    with pytest.raises(ValueError, match="not a database error"):
        await keep_trying(broken, what="a write", retry_on=(OSError,), give_up_after_s=5)
