import pytest

from services.scorer.errors import (
    InputRejected,
    ModelMisconfigured,
    ModelRateLimited,
    ModelTimeout,
    ModelUnavailable,
    PermanentError,
    ScoringError,
    TransientError,
    UnusableOutput,
)
from shared.contracts import TaskError


@pytest.mark.parametrize(
    ("error", "code", "retryable", "family"),
    [
        (InputRejected("too long"), "input_rejected", False, PermanentError),
        (UnusableOutput("not JSON"), "unusable_output", False, PermanentError),
        (ModelMisconfigured("401"), "model_misconfigured", False, PermanentError),
        (ModelTimeout("slow"), "model_timeout", True, TransientError),
        (ModelRateLimited("429", retry_after_s=2.0), "model_rate_limited", True, TransientError),
        (ModelUnavailable("503"), "model_unavailable", True, TransientError),
    ],
)
def test_each_error_knows_its_code_and_whether_to_retry(
    error: ScoringError, code: str, retryable: bool, family: type[ScoringError]
) -> None:
    assert isinstance(error, family)
    assert error.to_task_error() == TaskError(code=code, message=error.message, retryable=retryable)


def test_transient_errors_carry_the_retry_after_hint() -> None:
    assert ModelRateLimited("429", retry_after_s=2.5).retry_after_s == 2.5
    assert ModelUnavailable("503").retry_after_s is None


def test_the_message_is_also_the_exception_text() -> None:
    assert str(InputRejected("context too long")) == "context too long"
