"""Markers by directory: ``unit`` (fake backend, seconds), ``e2e`` (real servers on the real
model, minutes) and ``deploy`` (images, compose, Kubernetes manifests, the nginx router).
``./test.sh`` runs them all; ``./test.sh -m unit`` just the fast ones."""

from __future__ import annotations

from pathlib import Path

import pytest

KINDS = ("unit", "e2e", "deploy")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.fspath)).parts
        for kind in KINDS:
            if kind in parts:
                item.add_marker(getattr(pytest.mark, kind))
