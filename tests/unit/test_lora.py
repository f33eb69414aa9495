"""LoRA adapters (issue 32) against the fake backend: one adapter set per decode step with
the sets taking turns, the adapter set in every cache key (slot KV, RAM cache, prefix
sharing, slot files), the registry's resolution rules and the flags."""

from __future__ import annotations

import os

import pytest

from server.engine.adapter_turns import canonical
from server.engine.commands import Caller
from server.schemas.bodies import LoraScale
from server.schemas.errors import APIError
from server.service.adapters import Adapter, AdapterRegistry
from server.settings.config import parse_settings
from server.tiers import slot_file, tenancy
from server.tiers.prompt_cache import PromptCache
from tests.unit.helpers import ram_find

from .helpers import make_engine, run, task

A, B = (1.0, 0.0), (0.0, 1.0)
CA, CB = canonical(A), canonical(B)  # as the plan and the backend see them: (1.0,), (0.0, 1.0)
KA, KB = "ka", "kb"  # their cache keys (the registry's digests in the server)
DOC = list(range(100, 1300))  # 1,200 tokens


def lora_task(prompt, scales, key, max_tokens=4, tenant="", id_slot=-1):
    t, c = task(
        prompt, max_tokens=max_tokens, tenant=tenancy.with_adapters(tenant, key), id_slot=id_slot
    )
    t.lora = scales
    return t, c


def test_each_decode_carries_one_adapter_set_and_sets_alternate():
    e, b = make_engine(n_seq=4)
    ta = [lora_task([1, 2, 3 + i], A, KA, max_tokens=6) for i in range(2)]
    tb = [lora_task([4, 5, 6 + i], B, KB, max_tokens=6) for i in range(2)]
    for t, _ in ta + tb:
        e.waiting.append(t)
    e.step()  # admission puts slots 0, 1 under A and 2, 3 under B
    run(e)
    seqs_a = {s.id for s in e.slots if s.run and s.run.task.lora == A}
    seqs_b = {s.id for s in e.slots if s.run and s.run.task.lora == B}
    assert seqs_a and seqs_b and not seqs_a & seqs_b
    for sc, rows in zip(b.decode_adapters, b.decodes, strict=True):
        seqs = {s for s, _, _ in rows}
        assert sc in (CA, CB) and seqs <= (seqs_a if sc == CA else seqs_b), (sc, seqs)
    # while both sets have work they alternate: never the same set twice in a row
    both = list(b.decode_adapters)
    n_both = min(both.count(CA), both.count(CB))
    assert all(both[i] != both[i + 1] for i in range(2 * n_both - 1)), both
    for _, c in ta + tb:
        assert c.result is not None and c.result.timings.predicted_n == 6


def test_a_busy_set_does_not_starve_a_lone_one():
    e, b = make_engine(n_seq=4)
    busy = [lora_task([1, 2, 3 + i], A, KA, max_tokens=40) for i in range(3)]
    lone, c = lora_task([7, 8, 9], B, KB, max_tokens=10)
    run(e, *[t for t, _ in busy], lone)
    assert c.result is not None and c.result.timings.predicted_n == 10
    first_b = b.decode_adapters.index(CB)
    last_b = len(b.decode_adapters) - 1 - b.decode_adapters[::-1].index(CB)
    window = b.decode_adapters[first_b : last_b + 1]
    assert window.count(CB) == 10  # its prompt (with the first token) and 9 more tokens
    assert window.count(CA) == window.count(CB) - 1  # the busy set got every other step
    assert all(window[i] != window[i + 1] for i in range(len(window) - 1)), window


def test_one_set_decodes_everything_together():
    e, b = make_engine(n_seq=4)
    ts = [lora_task([1, 2, 3 + i], A, KA, max_tokens=5) for i in range(4)]
    run(e, *[t for t, _ in ts])
    assert set(b.decode_adapters) == {CA}
    assert max(len({s for s, _, _ in rows}) for rows in b.decodes) == 4


def test_zero_scales_are_the_base_set():
    assert canonical((0.0, 0.0)) == canonical(()) == ()
    assert canonical((1.0, 0.0)) == (1.0,)
    e, b = make_engine(n_seq=2)
    t0, _ = lora_task([1, 2, 3], (0.0, 0.0), "")
    t1, _ = task([1, 2, 4])
    run(e, t0, t1)
    assert set(b.decode_adapters) == {()}


# ---- caches keyed by the adapter set -----------------------------------------------------


def test_slot_kv_is_reused_only_under_its_own_set():
    e, _ = make_engine(n_seq=1)
    run(e, lora_task(DOC, A, KA, max_tokens=2)[0])
    for scales, key in ((B, KB), ((), "")):
        t, c = lora_task(DOC + [5], scales, key, max_tokens=2)
        run(e, t)
        assert c.result.timings.cache_n == 0, key
        run(e, lora_task(DOC, A, KA, max_tokens=2)[0])  # A's state back in the slot
    t, c = lora_task(DOC + [5], A, KA, max_tokens=2)
    run(e, t)
    assert c.result.timings.cache_n == len(DOC)


def test_ram_cache_entries_load_only_under_their_set_and_evict_in_order():
    e, _ = make_engine(n_seq=1)
    e.cache = PromptCache(-1, 0)
    e.opts.cache_idle_slots = False
    run(e, lora_task(DOC, A, KA, max_tokens=2)[0])
    run(e, lora_task([900 + i % 50 for i in range(150)], B, KB, max_tokens=2)[0])
    assert [x.tenant for x in e.cache.entries] == [KA and tenancy.with_adapters("", KA)]
    for scales, key in ((B, KB), ((), "")):
        t, c = lora_task(DOC + [5], scales, key, max_tokens=2)
        run(e, t)
        assert c.result.timings.cache_n == 0 and e.cache.counters.loads == 0
    t, c = lora_task(DOC + [5], A, KA, max_tokens=2)
    run(e, t)
    assert c.result.timings.cache_n == len(DOC) and e.cache.counters.loads == 1


def test_ram_cache_keeps_the_same_prompt_under_two_sets_apart():
    c = PromptCache(-1, 0)
    ka, kb = tenancy.with_adapters("", KA), tenancy.with_adapters("", KB)
    assert c.save(DOC, 8, lambda: bytearray(8), tenant=ka).saved
    assert c.save(DOC[:600], 8, lambda: bytearray(8), tenant=kb).saved  # not covered by A's
    assert c.save(DOC + [1], 8, lambda: bytearray(8), tenant=kb).saved  # drops B's prefix only
    assert [(len(x.tokens), x.tenant) for x in c.entries] == [(1200, ka), (1201, kb)]
    assert ram_find(c, [], DOC, ka).index == 0 and ram_find(c, [], DOC, kb).index == 1
    assert ram_find(c, [], DOC, "") is None


def test_prefix_sharing_stays_within_a_set():
    e, _ = make_engine(n_seq=2, prefix_share_min=0)
    run(e, lora_task(DOC, A, KA, max_tokens=2)[0])
    t, c = lora_task(DOC + [5, 6], B, KB, max_tokens=2)
    run(e, t)
    assert c.result.timings.cache_n == 0 and e.stats.prefix_shared_tokens == 0


def test_slot_files_record_the_set_and_refuse_another():
    key_a = tenancy.with_adapters("", KA)
    parsed = slot_file.ParsedFile([1, 2], bytearray(16), 8, 16, tenant=key_a)
    assert Caller(key_a, False).file_refusal(parsed, "f") is None
    for caller in ("", tenancy.with_adapters("", KB)):
        r = Caller(caller, False).file_refusal(parsed, "f")
        assert r is not None and r.status == 400, caller
    plain = slot_file.ParsedFile([1, 2], bytearray(16), 8, 16, tenant=None)  # llama-server's
    assert Caller("", False).file_refusal(plain, "f") is None
    assert Caller(key_a, False).file_refusal(plain, "f").status == 400
    # under isolation the owner is compared without the set: same tenant, other set is a 400
    mine = slot_file.ParsedFile(
        [1], bytearray(16), 8, 16, tenant=tenancy.with_adapters("key:x", KA)
    )
    assert Caller(tenancy.with_adapters("key:x", KB), True).file_refusal(mine, "f").status == 400
    assert Caller(tenancy.with_adapters("key:y", KA), True).file_refusal(mine, "f").status == 403


def test_tenancy_keys():
    k = tenancy.with_adapters("salt:ab", KA)
    assert tenancy.owner(k) == "salt:ab" and tenancy.adapters_of(k) == KA
    assert (
        tenancy.with_adapters("salt:ab", "") == "salt:ab" and tenancy.adapters_of("salt:ab") == ""
    )
    p = tenancy.with_adapters(tenancy.private_tenant(), KA)
    assert tenancy.is_private(p) and not tenancy.persistable(p)


# ---- the registry and the flags ------------------------------------------------------------


def _registry() -> AdapterRegistry:
    return AdapterRegistry(
        [
            Adapter(0, "a.gguf", "d" * 32, 1.0, 1.0),
            Adapter(1, "b.gguf", "e" * 32, 0.0, 0.5, alias="bee"),
        ]
    )


def test_registry_resolution_rules():
    r = _registry()
    assert r.resolve(None, None).scales == (1.0, 0.0)  # the global scales
    assert r.resolve([], None).scales == (1.0, 0.0)  # an empty list is no list
    one = r.resolve([LoraScale(id=1, scale=0.3)], "bee")
    assert one.scales == (0.0, 0.3)  # the request's field wins; left out: 0
    assert r.resolve(None, "bee").scales == (0.0, 0.5)  # alias: its --lora-scaled scale
    assert r.resolve(None, "other").scales == (1.0, 0.0)
    assert r.resolve([LoraScale(id=0, scale=0.0)], None).key == ""  # all zero: the base model
    k1, k2 = r.resolve(None, None).key, r.resolve([LoraScale(id=0, scale=0.5)], None).key
    assert k1 and k2 and k1 != k2 and k1 == _registry().resolve(None, None).key  # stable
    with pytest.raises(APIError) as err:
        r.resolve([LoraScale(id=2, scale=1.0)], None)
    assert err.value.status == 400
    r.set_global([LoraScale(id=1, scale=0.25)])
    assert [a.scale for a in r.adapters] == [0.0, 0.25]
    assert r.describe()[1] == {
        "id": 1,
        "path": "b.gguf",
        "scale": 0.25,
        "task_name": "",
        "prompt_prefix": "",
        "alias": "bee",
    }
    with pytest.raises(APIError):
        AdapterRegistry([]).resolve([LoraScale(id=0, scale=1.0)], None)


def test_registry_from_files(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"A" * 10)
    b.write_bytes(b"B" * 10)
    r = AdapterRegistry.from_files([(str(a), 1.0)], {"bee": str(b), "ay": str(a)}, apply=False)
    assert [(x.id, x.scale, x.alias) for x in r.adapters] == [(0, 0.0, "ay"), (1, 0.0, "bee")]
    assert r.adapters[0].digest != r.adapters[1].digest


def test_lora_flags():
    s = parse_settings(
        ["--lora", "a.gguf,b.gguf", "--lora", "c.gguf", "--lora-scaled", "d.gguf:0.5"]
        + ["--lora-alias", "x=a.gguf", "--lora-init-without-apply"],
        env={},
    )
    assert s.lora == ["a.gguf", "b.gguf", "c.gguf"] and s.lora_scaled == ["d.gguf:0.5"]
    assert s.lora_alias == ["x=a.gguf"] and s.lora_init_without_apply
    assert "--lora" not in s.compat and "--lora-scaled" not in s.compat


def test_prefix_sharing_within_a_set_still_shares():
    e, _ = make_engine(n_seq=2, prefix_share_min=0)
    run(e, lora_task(DOC, A, KA, max_tokens=2)[0])
    e.slots[0].last_used = 1e18  # keep slot 0: the next task goes to the empty slot 1
    t, c = lora_task(DOC[:1000] + [5, 6], A, KA, max_tokens=2, id_slot=1)
    run(e, t)
    assert c.result.timings.cache_n == 1000 and e.stats.prefix_shared_tokens == 1000


# ---- run-time adapters (issue 44: service/lora_runtime.py) ---------------------------


def test_runtime_adapters_keep_their_ids_and_keys_across_unload_and_reload(tmp_path):
    reg = AdapterRegistry([])
    a = reg.add_runtime(0, str(tmp_path / "a"), "d" * 32, "ad")
    key = reg.key((1.0,))
    assert reg.resolve(None, "ad").key == key and reg.global_scales == (0.0,)
    reg.remove("ad")
    assert a.removed and "ad" not in reg.by_alias and reg.describe() == []
    with pytest.raises(APIError):
        reg.scales_of([LoraScale(id=0, scale=1.0)])
    assert reg.by_digest("d" * 32) is a
    reg.revive(a, str(tmp_path / "b"), "again")
    assert reg.resolve(None, "again").key == key  # the same bytes: the same cache key
    reg.add_runtime(1, str(tmp_path / "c"), "e" * 32, "other")
    assert reg.resolve(None, "other").key != key  # other bytes: another key
    with pytest.raises(RuntimeError):
        reg.add_runtime(5, "x", "f" * 32, "skip")


def test_startup_aliases_cannot_be_unloaded(tmp_path):
    reg = AdapterRegistry([Adapter(0, "p", "d" * 32, 1.0, 1.0, alias="base")])
    with pytest.raises(ValueError):
        reg.remove("base")
    with pytest.raises(KeyError):
        reg.remove("nobody")


def test_runtime_paths_stay_under_the_directory(tmp_path):
    from server.service.lora_runtime import checked_path, open_checked

    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "ok.gguf").write_bytes(b"x")
    (tmp_path / "out.gguf").write_bytes(b"y")
    os.symlink(tmp_path / "out.gguf", root / "link.gguf")
    r = os.path.realpath(root)
    assert checked_path(r, "ok.gguf") == os.path.join(r, "ok.gguf")
    assert checked_path(r, "sub/../ok.gguf") == os.path.join(r, "ok.gguf")
    for bad, status in [
        ("../out.gguf", 403),
        (str(tmp_path / "out.gguf"), 403),
        ("link.gguf", 403),
        (".", 403),
        ("", 400),
        ("a\0b", 400),
        (3, 400),
    ]:
        with pytest.raises(APIError) as e:
            checked_path(r, bad)
        assert e.value.status == status, bad
    fd = open_checked(r, os.path.join(r, "ok.gguf"))
    os.close(fd)
    with pytest.raises(APIError) as e:
        open_checked(r, os.path.join(r, "sub"))
    assert e.value.status == 403


def test_a_reload_drops_runtime_adapters_whose_file_changed(tmp_path):
    from server.service.adapters import file_digest

    same, changed, gone = (tmp_path / n for n in ("same", "changed", "gone"))
    for p in (same, changed, gone):
        p.write_bytes(p.name.encode())
    reg = AdapterRegistry([Adapter(0, "base.gguf", "b" * 32, 1.0, 1.0)])
    for i, p in enumerate((same, changed, gone), start=1):
        reg.add_runtime(i, str(p), file_digest(str(p)), p.name)
    changed.write_bytes(b"other bytes")
    gone.unlink()
    assert reg.reload_paths() == ["base.gguf", str(same), "", ""]
    assert set(reg.by_alias) == {"same"}
    assert [a.removed for a in reg.adapters] == [False, False, True, True]
