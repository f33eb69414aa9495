"""--cache-isolation salt across restarts and replicas (issue 25, section 4), end to end on
the default model with --cache-disk.

A request without a ``cache_salt`` shares with nobody, ever: not with the next process on
the same directory, not with a replica sharing it. Its tenant used to come from a counter
starting at 1 in every process ("private:1"), and was written into the disk tier's files: a
new process's first salt-less client got the previous one's prompt from disk (880 of 884
tokens). Salted conversations keep their cache across both.

Prompts are ~1,650 tokens, over three sliding windows of the default model (512): what
comes back from disk is the last window plus the file's checkpoints.
"""

from __future__ import annotations

import signal
from pathlib import Path

from .conftest import ServerProc, long_text
from .test_disk_cache_e2e import wait_for

SECRET = "Private memo: the launch code is 7741. " + long_text(1400, seed=5) + " Summary?"
SALTED = "Team notes. " + long_text(450, seed=6) + " What next?"  # ~560 tokens
MORE = " And then?"
SALT = "team-salt-4f9c2b7e"


def isolated(make_server, d: Path, *extra: str) -> ServerProc:
    return make_server(
        "-np", "1", "-c", "4096", "--cache-isolation", "salt", "--cache-disk", str(d), *extra
    )


def complete(s: ServerProc, prompt: str, salt: str | None = None) -> dict:
    """One token; the response's timings (cache_n, prompt_n)."""
    body: dict = {"prompt": prompt, "n_predict": 1, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    r = s.client.post("/completion", json=body)
    r.raise_for_status()
    return r.json()["timings"]


def disk(s: ServerProc, salt: str | None = None) -> dict:
    """/cache's disk tier as a client of ``salt`` sees it (its entries; the counters)."""
    params = {"cache_salt": salt} if salt else {}
    return s.client.get("/cache", params=params).json()["disk"]


def files(d: Path) -> list[bytes]:
    return [p.read_bytes() for p in sorted(d.glob("*.lsc")) if not p.name.startswith(".")]


def assert_cold(s: ServerProc, prompt: str, got: dict) -> None:
    """Nothing of ``prompt`` came from any cache: every token was computed."""
    assert (got["cache_n"], got["prompt_n"]) == (0, len(s.tokenize(prompt))), got


def assert_salted_hit(s: ServerProc, got: dict) -> None:
    """The salted follow-up reused exactly the salted conversation, from disk."""
    n_prefix = len(s.tokenize(SALTED))
    assert s.tokenize(SALTED + MORE)[:n_prefix] == s.tokenize(SALTED)
    n = len(s.tokenize(SALTED + MORE))
    assert (got["cache_n"], got["prompt_n"]) == (n_prefix, n - n_prefix), got
    assert disk(s)["counters"]["hits"] == 1


def test_a_saltless_prompt_is_nobodys_after_a_restart(make_server, tmp_path):
    a = isolated(make_server, tmp_path)
    assert_cold(a, SECRET, complete(a, SECRET))  # client 1, no salt
    complete(a, SALTED, salt=SALT)  # displaces the secret into the RAM cache
    a.proc.send_signal(signal.SIGTERM)  # RAM cache and idle slot are spilled on the way out
    assert a.proc.wait(30) == 0
    b = isolated(make_server, tmp_path)  # the restart, on the same directory
    # client 2, no salt, sends the secret's prompt and more: nothing of it is cached
    assert_cold(b, SECRET + MORE, complete(b, SECRET + MORE))
    assert disk(b)["counters"]["hits"] == 0
    # only the salted conversation reached the disk, under a name that is not its salt
    written = files(tmp_path)
    assert len(written) == 1 and b"private:" not in written[0]
    assert SALT.encode() not in written[0] and disk(b, SALT)["n_entries"] == 1
    # the salted conversation continues from disk across the restart
    assert_salted_hit(b, complete(b, SALTED + MORE, salt=SALT))
    b.assert_integrity()


def test_replicas_on_one_directory_share_no_saltless_prompt(make_server, tmp_path):
    # 1 MiB of RAM holds nothing: each displaced slot state goes straight to the disk tier
    a = isolated(make_server, tmp_path, "--cache-ram", "1")
    assert_cold(a, SECRET, complete(a, SECRET))
    complete(a, SALTED, salt=SALT)  # displaces the secret (dropped, never written)
    complete(a, "Hello there.")  # displaces the salted conversation: written
    # the writer takes entries in order: the secret's (if queued) went first
    wait_for(lambda: disk(a)["counters"]["writes"] >= 1, "the salted entry's file")
    b = isolated(make_server, tmp_path, "--cache-ram", "1")  # a replica, started now
    assert_cold(b, SECRET + MORE, complete(b, SECRET + MORE))
    assert disk(b)["counters"]["hits"] == 0
    assert disk(a)["counters"]["writes"] == 1 and len(files(tmp_path)) == 1
    assert_salted_hit(b, complete(b, SALTED + MORE, salt=SALT))
    a.assert_integrity()
    b.assert_integrity()
