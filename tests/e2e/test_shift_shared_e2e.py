"""--context-shift on cells two slots share (issue 41) end to end on the default model.

In unified KV, prefix sharing copies a prefix with llama_memory_seq_cp: both sequences hold
the same cells. A context shift moves the shifting slot's cells with llama_memory_seq_add,
which moves a shared cell for every sequence holding it: before the fix, one slot shifting
moved the other's positions (its next-token distribution changed, and its cells no longer
ended where its tokens said). Now the shifting slot first takes a private copy."""

from __future__ import annotations

from .conftest import long_text, top_logprobs

# The other slot's next-token log-probabilities before and after the shift come from the
# same computation (its cached prompt, the last token re-evaluated alone), so they agree to
# rounding; a moved prefix changes them by whole nats.
TOL = 0.02


def _next_token(s, prompt: str) -> dict:
    body = {"prompt": prompt, "n_predict": 1, "n_probs": 10, "temperature": 0, "id_slot": 0}
    r = s.client.post("/completion", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_context_shift_leaves_the_prefix_another_slot_shares_in_place(make_server):
    # -c 512: the window cache is the full one's size, so it can shift; --cache-ram 0: the
    # idle slot keeps its cells (no --cache-idle-slots save and clear)
    s = make_server("-c", "512", "-np", "2", "--context-shift", "--cache-ram", "0", "--metrics")
    prompt = long_text(260, seed=4) + "."
    n = len(s.tokenize(prompt))
    assert 280 < n < 450, n  # past the cut of llama-server's rule (256), inside the context
    _next_token(s, prompt)  # slot 0 computes the prompt
    before = _next_token(s, prompt)  # and now serves it from its cache
    assert before["tokens_cached"] == n - 1
    # slot 1 copies slot 0's prompt (prefix sharing), then generates past the context: up
    # to the shift and one token after it. The KV cache (512 cells, unified) then holds
    # every cell: slot 0 keeps the shared ones the shift dropped, so one more token of
    # slot 1 would find no room and free the idle slot 0 (and this test would see nothing)
    second = prompt + " And then"
    n_gen = 512 - len(s.tokenize(second)) + 1
    body = {
        "prompt": second,
        "n_predict": n_gen,
        "temperature": 0,
        "ignore_eos": True,
        "id_slot": 1,
    }
    r = s.client.post("/completion", json=body, timeout=900)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["tokens_cached"] >= n - 1  # shared, not computed
    assert out["truncated"] is True and out["tokens_predicted"] == n_gen  # it shifted
    s.assert_integrity()  # slot 0's cells still end where its tokens say
    after = _next_token(s, prompt)
    assert after["tokens_cached"] == n - 1
    b, a = top_logprobs(before), top_logprobs(after)
    assert max(a, key=a.__getitem__) == max(b, key=b.__getitem__), (b, a)
    common = b.keys() & a.keys()
    assert len(common) >= 8, (b, a)
    assert max(abs(a[t] - b[t]) for t in common) <= TOL, (b, a)
    s.assert_integrity()
