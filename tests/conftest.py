"""Markers by directory: ``unit`` (fake backend, seconds), ``e2e`` (real servers on the real
model, minutes) and ``deploy`` (images, compose, Kubernetes manifests, the nginx router).
``./test.sh`` runs them all; ``./test.sh -m unit`` just the fast ones."""

from __future__ import annotations

from pathlib import Path

import pytest

KINDS = ("unit", "e2e", "deploy")
# Files whose tests measure latencies or race a watcher against the server: a second worker's
# load would make them flaky, so ./test.sh runs them alone (marker ``serial``), after the rest.
SERIAL = {
    "test_constraint_safety_e2e.py",
    "test_cors_proxy_e2e.py",
    "test_disk_races_e2e.py",
    "test_slot_tenancy_e2e.py",
    "test_tenancy_e2e.py",
    "test_security_e2e.py",
    "test_metrics_e2e.py",
    "test_llmd_e2e.py",
    "test_disk_cache_e2e.py",
    "test_backpressure.py",
    "test_disk_races.py",
    "test_slot_tenancy.py",
    "test_disk_cache.py",
    "test_router_e2e.py",
    "test_sleep_e2e.py",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.fspath)).parts
        for kind in KINDS:
            if kind in parts:
                item.add_marker(getattr(pytest.mark, kind))
        if parts[-1] in SERIAL:
            item.add_marker(pytest.mark.serial)
