"""The compile child (``python -m server.constrained.child``): reads one JSON request a line
on stdin, answers one JSON line on stdout. See ``worker``.

Requests: ``{"op": "schema", "canon", "prefix", "suffix"}``, ``{"op": "grammar", "kind",
"text"}``, ``{"op": "ping"}``. Answers: ``{"grammar": text}`` (llguidance's grammar, checked)
or ``{"where": pointer, "reason": text}``. Each request runs on a new thread whose stack is
``SERVER_CONSTRAINT_STACK`` bytes, whatever ``ulimit -s`` says, so what overflows here is
decided by this number alone; the address space is capped at ``SERVER_CONSTRAINT_MEMORY``;
the process runs at the lowest CPU priority. It dies with the server (``SERVER_CONSTRAINT_
PARENT``): at once when the server is gone, even in the middle of a compile, and also when
its stdin closes."""

from __future__ import annotations

import json
import os
import resource
import select
import sys
import threading
import time

from .spec import ConstraintError, compile_grammar, compile_schema
from .worker import CompileAnswer, CompileRequest


def answer(request: CompileRequest) -> CompileAnswer:
    """The answer to one request (never raises)."""
    try:
        op = request.get("op")
        if op == "schema":
            return {
                "grammar": compile_schema(request["canon"], request["prefix"], request["suffix"])
            }
        if op == "grammar":
            return {"grammar": compile_grammar(request["kind"], request["text"])}
        return {"pong": True}
    except ConstraintError as e:
        return {"where": e.where, "reason": e.reason}
    except (ValueError, TypeError, RecursionError, MemoryError) as e:
        return {"where": "", "reason": f"{type(e).__name__}: {e}"}


def _limit_memory() -> None:
    limit = int(os.environ.get("SERVER_CONSTRAINT_MEMORY", "0"))
    if limit > 0:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _await_exit(pidfd: int | None, parent: int) -> None:
    """Block until ``parent`` has exited (its pidfd turns readable; without one, the parent
    pid changes as the child is re-parented), then end this process, whatever runs."""
    if pidfd is not None:
        select.select([pidfd], [], [])
    else:
        while os.getppid() == parent:
            time.sleep(0.2)
    os._exit(0)


def die_with_parent(parent: int) -> None:
    """End this process as soon as ``parent`` (the server) exits, killed or not. Not stdin's
    end alone: a compile in progress reads no stdin, and the server's exit closes the pipe
    only when no other process holds a copy of its end. Not PR_SET_PDEATHSIG either: that
    fires when the *thread* that started the child ends (the server starts its first child
    from a short-lived thread). A watcher thread waits on the parent's pidfd instead."""
    try:
        pidfd: int | None = os.pidfd_open(parent)
    except (AttributeError, OSError):  # Linux < 5.3, or the parent is gone already
        pidfd = None
    if os.getppid() != parent:  # it exited before the pidfd (which may name another pid)
        os._exit(0)
    threading.Thread(target=_await_exit, args=(pidfd, parent), daemon=True).start()


def main() -> None:
    die_with_parent(int(os.environ.get("SERVER_CONSTRAINT_PARENT") or os.getppid()))
    threading.stack_size(int(os.environ.get("SERVER_CONSTRAINT_STACK", str(8 << 20))))
    _limit_memory()
    os.nice(19)  # compiling waits for generation, never the other way round
    # The protocol gets its own descriptor; fd 1 goes to stderr, so that nothing a library
    # prints can be taken for an answer.
    out_channel = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    out_channel.write(b"ready\n")
    out_channel.flush()
    for line in sys.stdin.buffer:
        out: CompileAnswer = {}
        t = threading.Thread(target=lambda r=json.loads(line), o=out: o.update(answer(r)))
        t.start()
        t.join()
        out_channel.write(json.dumps(out).encode() + b"\n")
        out_channel.flush()


if __name__ == "__main__":
    main()
