"""The suite's own schedule (tests/conftest.py): every file it names exists, so that a renamed
file cannot silently leave the serial phase or the slowest-first order."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import SERIAL, SLOWEST_FIRST

TESTS = Path(__file__).resolve().parents[1]


def test_named_files_exist() -> None:
    names = {p.name for p in TESTS.rglob("test_*.py")}
    assert set(SERIAL) <= names, set(SERIAL) - names
    assert set(SLOWEST_FIRST) <= names, set(SLOWEST_FIRST) - names
    assert len(set(SLOWEST_FIRST)) == len(SLOWEST_FIRST)


def test_serial_files_are_not_in_the_parallel_order() -> None:
    # a serial file runs alone after the workers: its place among theirs would mean nothing
    assert not set(SERIAL) & set(SLOWEST_FIRST)
