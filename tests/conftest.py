"""Markers by directory: ``unit`` (fake backend, seconds), ``e2e`` (real servers on the real
model, minutes) and ``deploy`` (images, compose, Kubernetes manifests, the nginx router).
``./test.sh`` runs them all; ``./test.sh -m unit`` just the fast ones."""

from __future__ import annotations

from pathlib import Path

import pytest

KINDS = ("unit", "e2e", "deploy")
# Files whose tests measure latencies or race a watcher against the server: a second worker's
# load would make them flaky, so ./test.sh runs them alone (marker ``serial``), after the rest.
# A file with only a few such tests marks those itself (``@pytest.mark.serial``:
# test_security_e2e, test_tenancy_e2e, test_disk_cache_e2e, test_llmd_e2e) and its other
# tests run on the workers.
SERIAL = {
    "test_constraint_safety_e2e.py",
    "test_cors_proxy_e2e.py",
    "test_disk_races_e2e.py",
    "test_slot_tenancy_e2e.py",
    "test_backpressure.py",
    "test_disk_races.py",
    "test_slot_tenancy.py",
    "test_disk_cache.py",
    "test_router_e2e.py",
    "test_sleep_e2e.py",
}
# The slowest files, slowest first (by their server starts and long prompts). pytest-xdist
# hands a file to whichever worker is free, in collection order (test.sh passes
# --no-loadscope-reorder: xdist's own order, most tests first, sends these few-test files
# last, where one worker may still run one while the other has nothing left). Longest first,
# the files left at the end are short ones. Every other file keeps its place after these.
SLOWEST_FIRST = (
    "test_disk_cache_e2e.py",
    "test_llmd_e2e.py",
    "test_webui_e2e.py",
    "test_slots_e2e.py",
    "test_kv_options_e2e.py",
    "test_lora_e2e.py",
    "test_tenancy_e2e.py",
    "test_image_tiers_e2e.py",
    "test_deploy.py",
    "test_tools_e2e.py",
    "test_anthropic_e2e.py",
    "test_streams_e2e.py",
    "test_flags_e2e.py",
    "test_structured_e2e.py",
    "test_constraint_fuzz_e2e.py",
    "test_lora_runtime_e2e.py",
    "test_cache_reuse_e2e.py",
    "test_draft_model_e2e.py",
    "test_router_zygote.py",
    "test_engine_e2e.py",
    "test_security_e2e.py",
    "test_metrics_e2e.py",
)


def _run_order(item: pytest.Item) -> int:
    name = Path(str(item.fspath)).name
    return SLOWEST_FIRST.index(name) if name in SLOWEST_FIRST else len(SLOWEST_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.fspath)).parts
        for kind in KINDS:
            if kind in parts:
                item.add_marker(getattr(pytest.mark, kind))
        if parts[-1] in SERIAL:
            item.add_marker(pytest.mark.serial)
    # a stable sort: a file's tests stay together and in their order (its module fixtures
    # start once)
    items.sort(key=_run_order)
