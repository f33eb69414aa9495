"""bench/percost.py (workload 18): its registration and how a phase's latencies become the
reported metrics. No server: the HTTP side is the same client every workload uses."""

from __future__ import annotations

import pytest

from bench.workloads import WORKLOADS

from bench import percost  # isort: skip  (after bench.workloads, which registers it)


def test_registered_as_workload_18_with_both_concurrencies():
    w = WORKLOADS[18]
    keys = {m.key for m in w.metrics}
    for c in ("c1", f"c{percost.CLIENTS}"):
        assert {f"{c}_p50_ms", f"{c}_p99_ms", f"{c}_rps"} <= keys
    assert not w.ours_only and not w.variants


def test_p99_is_an_observed_latency_at_the_99th_rank():
    assert percost.p99([1.0]) == 1.0
    xs = [float(i) for i in range(1, 201)]  # 1 ... 200
    assert percost.p99(xs) == 198.0
    assert percost.p99(list(reversed(xs))) == 198.0


def test_phase_metrics_in_ms_and_requests_per_second():
    m = percost.phase_metrics("c64", [0.010, 0.020, 0.030, 0.040], wall_s=0.5)
    assert m["c64_p50_ms"] == pytest.approx(25.0)
    assert m["c64_p99_ms"] == pytest.approx(40.0)
    assert m["c64_rps"] == pytest.approx(8.0)


def test_the_payload_asks_one_token_whole():
    p = percost.payload("Hello there.")
    assert p["max_tokens"] == 1 and p["stream"] is False and p["temperature"] == 0.0
