"""Why scoring a text failed, split by what the caller must do.

    ScoringError                    .code, .message, .retryable, .to_task_error(),
                                    .usage, .model (what answered calls billed)
    ├── PermanentError              fail the task now; a retry would fail the same way
    │   ├── InputRejected           the model or provider refuses this input
    │   │                           (content policy, context too long, empty text)
    │   ├── UnusableOutput          the output is malformed or out of range, even after
    │   │                           one repair attempt
    │   └── ModelMisconfigured      the provider rejects our configuration
    │                               (401, 403, 404, unknown model, no quota)
    └── TransientError              retry later; .retry_after_s from Retry-After when known
        ├── ModelTimeout            LLM_TIMEOUT_S elapsed before an answer
        ├── ModelRateLimited        429
        └── ModelUnavailable        5xx, connection refused or reset
            └── ModelReplyUnusable  the provider answered, not usably: another 4xx, a
                                    reply over the size bound, a completion without a choice

Configuration errors are permanent on purpose: retrying a wrong API key only hides it.
"""

from __future__ import annotations

from typing import ClassVar

from shared.contracts import TaskError, Usage


class ScoringError(Exception):
    """Base of every failure of the scorer's model layer.

    `usage` and `model`: what the calls of the attempt that answered on the way used (a
    refusal, an answer unusable before its repair failed or timed out), billed all the same
    whatever became of the attempt; None when no call answered."""

    code: ClassVar[str] = "scoring_error"
    retryable: ClassVar[bool] = False

    def __init__(
        self, message: str, *, usage: Usage | None = None, model: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.usage = usage
        self.model = model

    def also_spent(self, usage: Usage, model: str) -> None:
        """Count an earlier answered call of the same attempt in."""
        earlier = self.usage or Usage()
        self.usage = Usage(
            prompt_tokens=usage.prompt_tokens + earlier.prompt_tokens,
            completion_tokens=usage.completion_tokens + earlier.completion_tokens,
        )
        self.model = self.model or model

    def to_task_error(self) -> TaskError:
        """The failure as the contract the scorer publishes."""
        return TaskError(code=self.code, message=self.message, retryable=self.retryable)


class PermanentError(ScoringError):
    """Fail the task now: retrying cannot succeed."""

    code: ClassVar[str] = "permanent_error"


class InputRejected(PermanentError):
    """The model or provider refuses this input (content policy, too long, empty)."""

    code: ClassVar[str] = "input_rejected"


class UnusableOutput(PermanentError):
    """The model's output is malformed or out of range, even after one repair attempt."""

    code: ClassVar[str] = "unusable_output"

    def __init__(
        self,
        message: str,
        *,
        raw_output: str | None = None,
        usage: Usage | None = None,
        model: str | None = None,
    ) -> None:
        super().__init__(message, usage=usage, model=model)
        self.raw_output = raw_output


class ModelMisconfigured(PermanentError):
    """The provider rejects our configuration: key, permissions, model name, quota."""

    code: ClassVar[str] = "model_misconfigured"


class TransientError(ScoringError):
    """Retry later; `retry_after_s` is the provider's hint (Retry-After) when it gave one."""

    code: ClassVar[str] = "transient_error"
    retryable: ClassVar[bool] = True
    # Whether the failure says the provider is down or silent (what the scorer's circuit
    # breaker counts), rather than that it answered this call amiss.
    provider_down: ClassVar[bool] = False

    def __init__(
        self,
        message: str,
        *,
        retry_after_s: float | None = None,
        usage: Usage | None = None,
        model: str | None = None,
    ) -> None:
        super().__init__(message, usage=usage, model=model)
        self.retry_after_s = retry_after_s


class ModelTimeout(TransientError):
    """No answer within LLM_TIMEOUT_S."""

    code: ClassVar[str] = "model_timeout"
    provider_down: ClassVar[bool] = True


class RepairCutShort(ModelTimeout):
    """The provider answered, unusably, and LLM_TIMEOUT_S ran out during the repair call: a
    slow provider, not a silent one. Counted as one that answered, three such texts in a
    row tripped the outage breaker and paused every replica's calls (review)."""

    provider_down: ClassVar[bool] = False


class ModelRateLimited(TransientError):
    """The provider throttles us (429)."""

    code: ClassVar[str] = "model_rate_limited"


class ModelUnavailable(TransientError):
    """The provider cannot answer now: 5xx, connection refused or reset."""

    code: ClassVar[str] = "model_unavailable"
    provider_down: ClassVar[bool] = True


class ModelReplyUnusable(ModelUnavailable):
    """The provider answered, but with nothing to use and no reason given that another class
    names: a 4xx such as 409 or 408, a reply over the size bound, a completion without any
    choice. Retried as `ModelUnavailable` (its code), yet the provider is up: three texts in
    a row answered so paused every model call as an outage's would."""

    provider_down: ClassVar[bool] = False
