"""GreedyBias.pick is exactly argmax(row + bias), first maximum, on rows with ties, -inf
bans and biases that move the winner."""

from __future__ import annotations

import numpy as np
import pytest

from server.llama.greedy import GreedyBias

pytestmark = pytest.mark.unit


def reference(row: np.ndarray, bias: dict[int, float]) -> int:
    r = row.copy()
    for t, b in bias.items():
        r[t] += np.float32(b)
    return int(r.argmax())


@pytest.mark.parametrize("seed", range(200))
def test_pick_equals_the_biased_argmax(seed):
    rng = np.random.default_rng(seed)
    n = 64
    # few distinct values: plenty of ties between biased and unbiased tokens
    row = rng.integers(-3, 4, size=n).astype(np.float32)
    toks = rng.choice(n, size=rng.integers(1, 8), replace=False)
    choices = [-np.inf, -1.0, 0.0, 1.0, 2.0, 0.5]
    bias = {int(t): float(rng.choice(choices)) for t in toks}
    g = GreedyBias(bias)
    assert g.pick(row, int(row.argmax())) == reference(row, bias)


def test_banned_winner_falls_to_the_next_and_a_boost_wins():
    row = np.array([0.0, 5.0, 1.0, 5.0], dtype=np.float32)
    assert GreedyBias({1: -np.inf}).pick(row, 1) == 3  # the banned max; the tie at 3 next
    assert GreedyBias({2: 4.0}).pick(row, 1) == 1  # 1 + 4 ties 5: the smaller id wins
    assert GreedyBias({2: 4.5}).pick(row, 1) == 2
    assert GreedyBias({0: -1.0}).pick(row, 1) == 1  # an unrelated bias changes nothing
