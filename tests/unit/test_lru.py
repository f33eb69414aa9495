"""server.lru.SizedLRU: bounded by its values' sizes, least recently used out first, the
count of values that left returned by put."""

from __future__ import annotations

from server.lru import SizedLRU


def test_eviction_order_sizes_and_counts():
    c: SizedLRU[str, bytes] = SizedLRU(10, len)
    assert c.put("a", b"xxxx") == 0 and c.put("b", b"yyy") == 0 and c.put("c", b"zz") == 0
    assert c.nbytes == 9 and c.get("a") == b"xxxx"  # a is now the most recent
    assert c.put("d", b"ww") == 1  # 11 > 10: b, the least recently used, leaves
    assert ("b" in c, "a" in c, "c" in c, "d" in c) == (False, True, True, True)
    assert c.put("a", b"q") == 0 and c.nbytes == 5  # replaced: its old size is taken off
    assert c.put("big", b"0123456789A") == 0 and "big" not in c and len(c) == 3
    assert c.put("e", b"0123456789") == 3 and len(c) == 1 and c.nbytes == 10
