"""The greedy fast path (``LlamaBackend.argmax``, with ``GreedyBias``) picks exactly what
llama.cpp's chain (logit_bias, greedy) picks, on the real model, over many rows of one decode:
it is what a speculative verify and every temperature-0 request now sample with."""

from __future__ import annotations

import llama_cpp as L
import pytest

from server.http.app import default_model_path
from server.llama.backend import LlamaBackend, ModelOptions
from server.task import SamplingParams

from .conftest import long_text


@pytest.fixture(scope="module")
def backend():
    b = LlamaBackend(ModelOptions(path=default_model_path(), n_ctx=4096, n_parallel=1))
    yield b
    b.close()


def test_argmax_is_llama_cpps_greedy_choice_on_every_row(backend):
    b = backend
    tokens = b.tokenize(long_text(1600, seed=11), add_special=True)[:1600]
    assert len(tokens) > 3 * 512  # rows past several sliding windows
    # a prefill in chunks, every row of the last chunk an output
    pos = 0
    for start in range(0, len(tokens), 512):
        chunk = tokens[start : start + 512]
        b.batch.clear()
        b.batch.add_span(chunk, pos, 0, logits_last=True)
        last = start + 512 >= len(tokens)
        if last:
            b.batch.outputs_all()
        assert b.decode(0, len(chunk)) == 0
        pos += len(chunk)
    # the plain chain, and one whose bias bans the first rows' winners and lifts another
    top = sorted({b.argmax(i) for i in range(4)})
    bias = {**dict.fromkeys(top, -float("inf")), 7: 30.0, **dict.fromkeys(b.eog_tokens(), -1e9)}
    plain, plain_ref = _both_ways(b, SamplingParams(temperature=0.0), len(chunk))
    assert plain == plain_ref and len(set(plain)) > 10  # the rows differ: a real comparison
    biased, biased_ref = _both_ways(b, SamplingParams(temperature=0.0, logit_bias=bias), len(chunk))
    assert biased == biased_ref
    assert not set(top) & set(biased) and biased != plain  # the bias did change the picks


def _both_ways(b: LlamaBackend, p: SamplingParams, n_rows: int) -> tuple[list[int], list[int]]:
    """The picks of the fast path and of llama.cpp's own chain (logit_bias, greedy) on the
    last decode's rows."""
    fast_sampler = b.new_sampler(p, [])
    assert fast_sampler.greedy
    chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    if p.logit_bias:
        arr = (L.llama_logit_bias * len(p.logit_bias))()
        for i, (tok, bias) in enumerate(p.logit_bias.items()):
            arr[i].token, arr[i].bias = tok, bias
        bias_stage = L.llama_sampler_init_logit_bias(b.n_vocab, len(p.logit_bias), arr)
        L.llama_sampler_chain_add(chain, bias_stage)
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
    try:
        fast = [b.sample(fast_sampler, i) for i in range(n_rows)]
        slow = [L.llama_sampler_sample(chain, b.ctx, i) for i in range(n_rows)]
    finally:
        L.llama_sampler_free(chain)
        fast_sampler.free()
    return fast, slow


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.0, repeat_penalty=1.1),
    ],
)
def test_only_a_greedy_chain_takes_the_argmax(backend, params):
    s = backend.new_sampler(params, [1, 2, 3])
    try:
        assert not s.greedy
    finally:
        s.free()
