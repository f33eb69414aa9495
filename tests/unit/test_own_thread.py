"""server.llama.own_thread: the function runs on a new thread, which has exited when the
call returns; its result comes back and its exception is raised to the caller."""

from __future__ import annotations

import threading

import pytest

from server.llama.own_thread import run_on_own_thread


def test_runs_on_a_new_thread_that_has_exited_and_returns_the_result():
    seen: list[threading.Thread] = []

    def fn() -> int:
        seen.append(threading.current_thread())
        return 7

    assert run_on_own_thread(fn, "t") == 7
    assert seen[0] is not threading.current_thread() and seen[0].name == "t"
    assert not seen[0].is_alive()


def test_the_exception_is_raised_to_the_caller():
    def fn() -> int:
        raise ValueError("bad image")

    with pytest.raises(ValueError, match="bad image"):
        run_on_own_thread(fn, "t")
