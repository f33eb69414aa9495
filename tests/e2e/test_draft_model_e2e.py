"""draft-simple on the real model (it drafts for itself): agreement with plain decoding, its
acceptance rate, and the draft state through the RAM cache and slot files, with and without
a draft model on the restoring side, and hostile SDFT appendices."""

from __future__ import annotations

import re
import struct
import threading
from pathlib import Path

from tests.e2e.conftest import long_text
from tests.e2e.test_speculative_e2e import assert_agrees, complete, copy_prompt

SDFT = struct.pack("<I", 0x54464453)


def metric(s, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", s.client.get("/metrics").text, re.M)
    assert m, name
    return float(m.group(1))


def slot(s, i: int) -> dict:
    return s.slots()[i]


def action(s, i: int, act: str, name: str) -> dict:
    r = s.client.post(f"/slots/{i}?action={act}", json={"filename": name})
    assert r.status_code == 200, r.text
    return r.json()


def test_self_draft_agrees_with_plain_decoding_on_two_slots(make_server):
    s = make_server("--spec-type", "draft-simple", "-np", "2", "--metrics")
    prompts = [copy_prompt(2), copy_prompt(5)]
    out: dict[int, dict] = {}

    def go(i: int) -> None:
        out[i] = complete(s, prompts[i], 120, cache_prompt=False)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    s.assert_integrity()  # both contexts, cell by cell
    for i, p in enumerate(prompts):
        t = out[i]["timings"]
        # a model drafting for itself agrees with itself nearly always
        assert t["draft_n"] > 0 and t["draft_n_accepted"] >= 0.8 * t["draft_n"], t
        plain = complete(s, p, 120, cache_prompt=False, **{"speculative.n_max": 0})
        assert_agrees(out[i], plain)
    drafted = metric(s, "llamacpp:spec_decode_num_draft_tokens_total")
    assert drafted == sum(out[i]["timings"]["draft_n"] for i in range(2))


def test_draft_state_through_the_ram_cache(make_server):
    s = make_server("--spec-type", "draft-simple", "-np", "2", "--metrics")
    memo = long_text(1500, 1)
    first = complete(s, memo, 8, id_slot=0, return_tokens=True)
    n = slot(s, 0)["n_tokens"]
    assert n > 3 * 512 and slot(s, 0)["draft"]["n_tokens"] == n  # caught up when it ended
    # another prompt on slot 0: the slot goes to the RAM cache, both states with it
    complete(s, long_text(300, 4) + " Other.", 4, id_slot=0)
    before = metric(s, "llamaslot_draft_catchup_tokens_total")
    # the follow-up continues the answer's own ids: how greedy's text re-tokenizes (a first
    # piece may merge with the memo's last token) differs between CPUs
    ids = s.tokenize(memo) + first["tokens"] + s.tokenize(" And then", add_special=False)
    follow = complete(s, ids, 24, id_slot=0)
    assert follow["tokens_cached"] >= first["timings"]["prompt_n"] - 1  # a RAM-cache hit
    assert follow["timings"]["draft_n"] > 0
    # the draft came back with the target: it decoded only what is new, not the memo
    caught = metric(s, "llamaslot_draft_catchup_tokens_total") - before
    assert caught <= follow["timings"]["prompt_n"] + follow["timings"]["predicted_n"] + 2, caught
    s.assert_integrity()


def test_draft_state_through_slot_files(make_server, tmp_path: Path):
    d = str(tmp_path)
    s = make_server("--spec-type", "draft-simple", "-np", "2", "--slot-save-path", d)
    memo = long_text(1500, 2)
    complete(s, memo, 8, id_slot=1)
    n = slot(s, 1)["n_tokens"]
    assert slot(s, 1)["draft"]["n_tokens"] == n
    action(s, 1, "save", "memo.bin")
    data = (tmp_path / "memo.bin").read_bytes()
    assert SDFT in data  # the draft appendix is written
    action(s, 1, "erase", "")
    r = action(s, 1, "restore", "memo.bin")
    assert r["n_restored"] == n and slot(s, 1)["draft"]["n_tokens"] == n
    s.assert_integrity()
    # a file without the draft appendix: the target only
    cut = data.index(SDFT)
    (tmp_path / "plain.bin").write_bytes(data[:cut])
    assert action(s, 0, "restore", "plain.bin")["n_restored"] == n
    assert slot(s, 0)["draft"]["n_tokens"] == 0
    # a short save's draft state under the long file's tokens: proven wrong, dropped
    complete(s, long_text(200, 3), 4, id_slot=0)
    action(s, 0, "save", "short.bin")
    short = (tmp_path / "short.bin").read_bytes()
    hostile = {
        "swapped.bin": data[:cut] + short[short.index(SDFT) :],
        "garbage.bin": data[:cut] + SDFT + struct.pack("<IQ", 1, 64) + b"\x07" * 64 + bytes(8),
        "oversized.bin": data[:cut] + SDFT + struct.pack("<IQ", 1, 1 << 40) + b"\x00" * 16,
        "truncated.bin": data[: cut + (len(data) - cut) // 2],
    }
    for name, body in hostile.items():
        (tmp_path / name).write_bytes(body)
        r = action(s, 0, "restore", name)
        assert r["n_restored"] == n, name  # the target state is kept
        assert slot(s, 0)["draft"]["n_tokens"] == 0, name  # the draft dropped
        s.assert_integrity()
    # restoring into a server without a draft model keeps the target state
    s.stop()
    plain = make_server("-np", "2", "--slot-save-path", d)
    assert action(plain, 0, "restore", "memo.bin")["n_restored"] == n
    assert "draft" not in slot(plain, 0)
    plain.assert_integrity()
