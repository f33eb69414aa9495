"""The greedy fast path (``LlamaBackend.argmax``) picks exactly what llama.cpp's greedy
sampler picks, on the real model, over many rows of one decode: it is what a speculative
verify and every temperature-0 request now sample with."""

from __future__ import annotations

import llama_cpp as L
import pytest

from server.app import default_model_path
from server.llama.backend import LlamaBackend, ModelOptions
from server.types import SamplingParams

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
    greedy = b.new_sampler(SamplingParams(temperature=0.0), [])
    assert greedy.greedy
    chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
    try:
        rows = range(len(chunk))
        fast = [b.sample(greedy, i) for i in rows]
        slow = [L.llama_sampler_sample(chain, b.ctx, i) for i in rows]
    finally:
        L.llama_sampler_free(chain)
        greedy.free()
    assert fast == slow
    assert len(set(fast)) > 10  # the rows differ: a real comparison


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.0, logit_bias={5: -1.0}),
        SamplingParams(temperature=0.0, repeat_penalty=1.1),
    ],
)
def test_only_a_greedy_chain_alone_takes_the_argmax(backend, params):
    s = backend.new_sampler(params, [1, 2, 3])
    try:
        assert not s.greedy
    finally:
        s.free()
