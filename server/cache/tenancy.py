"""Tenant names (--cache-isolation): who may reuse a cached prefix, and which names may
leave the process (disk-tier files, slot files).

A tenant is a plain string compared for equality everywhere (slots, RAM cache, disk tier,
prefix sharing). Contracts:

- ``""`` is everyone's (no isolation, no salt).
- ``salt:<digest>`` and ``key:<digest>[/salt:<digest>]`` are stable: the same salt or API
  key gives the same name in every process, after a restart and on every replica, so a
  conversation keeps its cache across them. Only digests are kept, so a name written to a
  shared directory does not disclose the salt.
- ``private:<128 random bits>`` is one request's alone (``--cache-isolation salt`` without a
  ``cache_salt``): unguessable, never the same twice, and never persisted (``persistable``
  is false), so no other process can ever hold an entry under it.
"""

from __future__ import annotations

import hashlib
import secrets

PRIVATE_PREFIX = "private:"
SALT_PREFIX = "salt:"


def private_tenant() -> str:
    """A tenant nobody else has or will have: 128 random bits."""
    return PRIVATE_PREFIX + secrets.token_hex(16)


def is_private(tenant: str) -> bool:
    """Whether ``tenant`` is one request's alone (see ``private_tenant``)."""
    return tenant.startswith(PRIVATE_PREFIX)


def persistable(tenant: str) -> bool:
    """Whether an entry of ``tenant`` may be written where another process reads it (the
    disk tier, slot files): everyone's and stable tenants, never a private one."""
    return not is_private(tenant)


def salt_tenant(salt: str) -> str:
    """The stable tenant of a ``cache_salt``: a 128-bit digest of it (the salt itself never
    reaches a file)."""
    digest = hashlib.sha256(salt.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return SALT_PREFIX + digest
