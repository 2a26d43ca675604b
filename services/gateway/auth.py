"""Who is calling: the tenant (and API key) behind a request.

Every public route takes a `Caller` through `Depends(...)` on the dependency built by
`caller_dependency`; handlers only ever see `caller.tenant_id`, never a raw key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import Depends

from shared.contracts import DEFAULT_TENANT


@dataclass(frozen=True)
class Caller:
    tenant_id: str
    key_id: str | None = None


def caller_dependency() -> Any:
    """The FastAPI dependency that resolves the caller (single default tenant for now)."""

    async def resolve_caller() -> Caller:
        return Caller(tenant_id=DEFAULT_TENANT)

    return Depends(resolve_caller)
