"""Tenant names (--cache-isolation): who may reuse a cached prefix, and which names may
leave the process (disk-tier files, slot files).

A tenant is a plain string compared for equality everywhere (slots, RAM cache, disk tier,
prefix sharing). Contracts:

- ``""`` is everyone's (no isolation, no salt).
- ``salt:<digest>`` and ``key:<digest>[/salt:<digest>]`` are stable: the same salt or API
  key gives the same name in every process, after a restart and on every replica, so a
  conversation keeps its cache across them. Only digests are kept, so a name written to a
  shared directory does not disclose the salt.
- ``<tenant>|lora:<digest>``: the same tenant's prompts computed under a LoRA adapter set
  (``with_adapters``; the digest names the adapter files and their scales, the same in
  every process). A KV state depends on the adapters it was computed under, so the set is
  part of the key every tier matches on: slots, prefix sharing, the RAM cache, the disk
  tier and slot files never serve a state of one set to a request under another. Who a
  tenant is (``owner``: authorization under --cache-isolation) ignores the set.
- ``private:<128 random bits>`` is one request's alone (``--cache-isolation salt`` without a
  ``cache_salt``): unguessable, never the same twice, and never persisted (``persistable``
  is false), so no other process can ever hold an entry under it.
"""

from __future__ import annotations

import hashlib
import secrets

PRIVATE_PREFIX = "private:"
ADAPTERS_SEP = "|lora:"
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


def with_adapters(tenant: str, adapters: str) -> str:
    """The cache key of ``tenant``'s prompts under the adapter set named ``adapters`` (its
    digest; ``""``: no adapter, the tenant itself)."""
    return f"{tenant}{ADAPTERS_SEP}{adapters}" if adapters else tenant


def owner(key: str) -> str:
    """The tenant of a cache key (``with_adapters`` undone): who may see and act on it."""
    return key.split(ADAPTERS_SEP, 1)[0]


def adapters_of(key: str) -> str:
    """The adapter set digest of a cache key (``""``: computed without adapters)."""
    parts = key.split(ADAPTERS_SEP, 1)
    return parts[1] if len(parts) == 2 else ""
