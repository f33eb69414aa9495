"""``server.llama.logits``: a logits row nothing can be sampled from (NaN, +inf, nothing
above -inf) is refused as a client error before any sampler reads it (issue 40)."""

from __future__ import annotations

import numpy as np
import pytest

from server.llama.logits import NonFiniteLogits, check_pick, check_row


def _row(n: int = 1000) -> np.ndarray:
    return np.random.default_rng(0).normal(size=n).astype(np.float32)


def test_finite_rows_and_masked_rows_pass():
    r = _row()
    check_row(r)
    r[::2] = -np.inf  # a constraint's mask: refused tokens at -inf
    check_row(r)
    check_pick(r, int(r.argmax()))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_or_inf_anywhere_is_refused(bad):
    for at in (0, 500, 999):
        r = _row()
        r[at] = bad
        with pytest.raises(NonFiniteLogits) as e:
            check_row(r)
        assert e.value.status == 400 and "non-finite" in str(e.value)
        with pytest.raises(NonFiniteLogits):  # numpy's argmax finds the NaN / the +inf
            check_pick(r, int(r.argmax()))


def test_a_row_of_minus_inf_is_refused():
    r = np.full(100, -np.inf, dtype=np.float32)
    with pytest.raises(NonFiniteLogits):
        check_row(r)
    with pytest.raises(NonFiniteLogits):
        check_pick(r, int(r.argmax()))
