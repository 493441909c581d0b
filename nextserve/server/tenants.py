"""Prefix-cache isolation between tenants: each API key is a tenant with a salt of its own, and a
request's `cache_salt` (vLLM's field) further splits its tenant's cache, so one tenant's prompt never
resumes from another's prefix image and `cached_tokens` tells nothing across tenants."""

from __future__ import annotations

import hashlib

TENANT_KEY = "nextserve.tenant_salt"  # where the auth middleware leaves the caller's tenant salt


def tenant_salt(api_key: str) -> str:
    """A key's tenant salt: a digest, so the key itself is never kept with the cache."""
    return hashlib.sha256(b"nextserve-tenant\0" + api_key.encode()).hexdigest()[:32]


def cache_salt(scope: dict, request_salt: str | None) -> str | None:
    """The engine's salt for a request: its tenant's (none without API keys), then its own cache_salt."""
    tenant = scope.get(TENANT_KEY, "")
    if not tenant and not request_salt:
        return None
    return f"{tenant}\x1f{request_salt or ''}"
