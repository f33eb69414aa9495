"""Checks on a logits row before anything samples from it (issue 40).

A LoRA adapter at a huge scale (or a broken adapter or model) can make the decode produce
NaN or infinite logits; sampled as they are, a greedy pick is arbitrary, a distribution's
probabilities are NaN (log-probabilities then cannot be serialized) and a constraint's
mask admits nothing. ``check_row`` refuses such a row with ``NonFiniteLogits``, which the
engine answers as a client error (``status``), the request's fault under its own settings.

Cost: one ``max`` over the row (no temporary array; numpy's max propagates NaN), about
20 us for a 262k-token vocabulary; the greedy path checks only the chosen logit, since
numpy's argmax returns the first NaN when there is one, and +inf is a maximum.
"""

from __future__ import annotations

import math

import numpy as np


class NonFiniteLogits(ValueError):
    """The row holds NaN or +inf, or nothing above -inf: nothing can be sampled from it."""

    status = 400

    def __init__(self) -> None:
        super().__init__(
            "the model produced non-finite logits (NaN or infinity) under this request's"
            " settings; with LoRA adapters, use smaller scales"
        )


def check_row(row: np.ndarray) -> None:
    """Raise NonFiniteLogits unless ``row``'s largest logit is finite (NaN anywhere, +inf
    anywhere, or all -inf fail; -inf entries beside finite ones are masked tokens)."""
    if not math.isfinite(float(row.max())):
        raise NonFiniteLogits()


def check_pick(row: np.ndarray, best: int) -> None:
    """``check_row`` for a row whose argmax ``best`` is known: the same verdict in O(1)."""
    if not math.isfinite(float(row[best])):
        raise NonFiniteLogits()
