"""/slots actions and /cache under --cache-isolation key, and a slot file's appendix read
off the engine thread (issue 25, sections 4 and 6), end to end on the default model.

Findings rebuilt here: another key could erase a slot holding someone's prompt, restore a
file someone saved (and then own their prompt's KV), restore over someone's slot, and list
every tenant's cache entries; a file with a 200,000-checkpoint appendix stalled a running
stream for 1.8 s while it was restored.
"""

from __future__ import annotations

import struct
import threading
import time

import httpx

from .conftest import ServerProc, long_text

A = {"Authorization": "Bearer ka"}
B = {"Authorization": "Bearer kb"}
PROMPT_A = "Alice's contract draft. " + long_text(650, seed=1) + " Review it?"  # ~800 tokens
PROMPT_B = "Bob's shopping list. " + long_text(250, seed=2) + " Anything else?"  # ~320
SCKP = 0x504B4353
STNT = 0x544E5453


def keyed(make_server, *extra: str) -> ServerProc:
    return make_server(
        "-np", "2", "-c", "4096", "--cache-isolation", "key", *extra,
        env={"LLAMA_API_KEY": "ka,kb"},
    )  # fmt: skip


def fill(s: ServerProc, who: dict, slot: int, prompt: str) -> dict:
    body = {"prompt": prompt, "n_predict": 1, "temperature": 0, "id_slot": slot}
    r = s.client.post("/completion", json=body, headers=who)
    r.raise_for_status()
    return r.json()["timings"]


def act(s: ServerProc, who: dict, slot: int, action: str, name: str | None = None):
    body = {"filename": name} if name else None
    return s.client.post(f"/slots/{slot}", params={"action": action}, json=body, headers=who)


def n_tokens(s: ServerProc, slot: int) -> int:
    return next(x["n_tokens"] for x in s.client.get("/slots", headers=A).json() if x["id"] == slot)


def n_tok(s: ServerProc, text: str) -> int:
    return len(
        s.client.post("/tokenize", json={"content": text, "add_special": True}, headers=A).json()[
            "tokens"
        ]
    )


def assert_refused(r: httpx.Response) -> None:
    assert r.status_code == 403, r.text
    err = r.json()["error"]
    assert err["type"] == "permission_error" and err["code"] == 403, err


def test_slot_actions_are_checked_against_the_callers_key(make_server, save_dir):
    s = keyed(make_server, "--slot-save-path", str(save_dir), "--no-cache-idle-slots")
    n_a, n_b = n_tok(s, PROMPT_A), n_tok(s, PROMPT_B)
    fill(s, A, 0, PROMPT_A)
    assert_refused(act(s, B, 0, "erase"))  # B cannot erase A's slot
    assert n_tokens(s, 0) == n_a
    assert act(s, A, 0, "save", "a.bin").json()["n_saved"] == n_a
    assert_refused(act(s, B, 1, "restore", "a.bin"))  # nor restore A's file into a free slot
    assert n_tokens(s, 1) == 0
    fill(s, B, 1, PROMPT_B)
    assert act(s, B, 1, "save", "b.bin").json()["n_saved"] == n_b
    assert_refused(act(s, B, 0, "restore", "b.bin"))  # nor its own file over A's slot
    assert n_tokens(s, 0) == n_a
    # each key keeps full use of its own slots and files
    assert act(s, B, 1, "erase").json() == {"id_slot": 1, "n_erased": n_b}
    # B's probe of A's prompt on an empty slot: nothing of A's comes its way
    n_probe = n_tok(s, PROMPT_A + " Now.")
    assert fill(s, B, 1, PROMPT_A + " Now.")["cache_n"] == 0
    assert act(s, B, 1, "erase").json() == {"id_slot": 1, "n_erased": n_probe}
    assert act(s, A, 1, "restore", "a.bin").json()["n_restored"] == n_a
    follow = fill(s, A, 1, PROMPT_A + " Now.")
    assert (follow["cache_n"], follow["prompt_n"]) == (n_a, n_probe - n_a)
    assert act(s, A, 0, "erase").json() == {"id_slot": 0, "n_erased": n_a}
    integrity = s.client.get("/debug/integrity", headers=A).json()
    assert integrity == {"ok": True, "problems": []}


def test_a_file_without_a_recorded_tenant_is_nobodys_under_isolation(make_server, save_dir):
    # saved by a server without isolation: the file records the empty tenant, not a key's
    plain = make_server("-np", "1", "-c", "4096", "--slot-save-path", str(save_dir))
    fill(plain, {}, 0, PROMPT_B)
    act(plain, {}, 0, "save", "shared.bin").raise_for_status()
    plain.stop()
    raw = (save_dir / "shared.bin").read_bytes()
    n_tenant, _version, magic = struct.unpack_from("<III", raw, len(raw) - 12)
    assert (magic, n_tenant) == (STNT, 0)  # the STNT footer, naming the empty tenant
    (save_dir / "bare.bin").write_bytes(raw[: len(raw) - 12])  # as llama-server writes
    s = keyed(make_server, "--slot-save-path", str(save_dir))
    for name in ("shared.bin", "bare.bin"):  # the empty tenant's; none recorded at all
        assert_refused(act(s, A, 0, "restore", name))
    assert n_tokens(s, 0) == 0


def cache_lengths(s: ServerProc, who: dict) -> tuple[list[int], dict]:
    info = s.client.get("/cache", headers=who).json()
    return sorted(e["n_tokens"] for e in info["entries"]), info


def test_cache_lists_only_the_callers_entries(make_server):
    s = keyed(make_server)
    n_a, n_b = n_tok(s, PROMPT_A), n_tok(s, PROMPT_B)
    fill(s, A, 0, PROMPT_A)
    fill(s, B, 1, PROMPT_B)
    fill(s, A, 0, "Hello.")  # launching a task saves the idle slots into the RAM cache
    mine, info_a = cache_lengths(s, A)
    theirs, info_b = cache_lengths(s, B)
    assert (mine, theirs) == ([n_a], [n_b])
    for info, n in ((info_a, n_a), (info_b, n_b)):
        assert (info["n_entries"], info["n_tokens"]) == (1, n)
        assert info["n_bytes"] == info["entries"][0]["n_bytes"] > 0


def many_checkpoints(good: bytes, count: int) -> bytes:
    """``good`` with its appendices replaced by an SCKP of ``count`` one-byte checkpoints,
    each within the file's tokens (so none is dropped for not matching the slot)."""
    n = struct.unpack_from("<I", good, 8)[0]
    state_end = good.rfind(struct.pack("<II", SCKP, 1))
    rec = [struct.pack("<III", SCKP, 1, count)]
    for i in range(count):
        nt = 1 + i % n
        rec.append(struct.pack("<qiiQ", nt, 0, nt - 1, 1) + b"x" + struct.pack("<QQ", 0, 0))
    return good[:state_end] + b"".join(rec)


def restore_under_stream(s: ServerProc, name: str) -> tuple[float, dict]:
    """Restore ``name`` into slot 0 while slot 1 streams; the stream's longest pause between
    two tokens around the restore, and the restore's response."""
    stamps: list[float] = []
    body = {"prompt": "Story:", "n_predict": 200, "ignore_eos": True, "stream": True}

    def stream() -> None:
        with httpx.stream("POST", s.url + "/completion", json={**body, "id_slot": 1}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    stamps.append(time.perf_counter())

    t = threading.Thread(target=stream)
    t.start()
    while len(stamps) < 10:
        time.sleep(0.01)
    t0 = time.perf_counter()
    r = s.client.post("/slots/0?action=restore", json={"filename": name})
    t1 = time.perf_counter()
    t.join()
    r.raise_for_status()
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False) if b > t0 and a < t1]
    return max(gaps), r.json()


def test_a_huge_checkpoint_appendix_does_not_stall_the_engine(make_server, save_dir):
    s = make_server("-np", "2", "-c", "4096", "--slot-save-path", str(save_dir))
    n = len(s.tokenize(PROMPT_B))
    fill(s, {}, 0, PROMPT_B)
    act(s, {}, 0, "save", "good.bin").raise_for_status()
    good = (save_dir / "good.bin").read_bytes()
    (save_dir / "huge.bin").write_bytes(many_checkpoints(good, 200_000))  # 8 MB of records
    (save_dir / "many.bin").write_bytes(many_checkpoints(good, 4_000))
    base, _ = restore_under_stream(s, "good.bin")
    # the engine thread loads the state only: the stream pauses no longer than for a plain
    # restore of the same state (it paused 1.8-3.7 s, every time, when the engine took the
    # 200,000). Of two tries, the shorter: a loaded test machine may pause any one stream.
    (stall, out), (again, _) = (restore_under_stream(s, "huge.bin") for _ in range(2))
    assert min(stall, again) < base + 0.5, (stall, again, base)
    assert out["n_restored"] == n and "200000 checkpoints" in out["warnings"][0]
    slot = next(x for x in s.slots() if x["id"] == 0)
    assert (slot["n_tokens"], slot["checkpoints"]["count"]) == (n, 0)
    # a count within bounds: walked off the engine thread, the slot keeps its last 32
    _, out = restore_under_stream(s, "many.bin")
    assert out["warnings"] == ["3968 checkpoints past the slot's 32; dropped"]  # default 32
    slot = next(x for x in s.slots() if x["id"] == 0)
    assert slot["checkpoints"]["count"] == 32
    s.assert_integrity()
