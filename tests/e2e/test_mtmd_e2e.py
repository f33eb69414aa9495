"""libmtmd on the real default model with the generated projector (issue 42): it loads,
an image becomes its 16 tokens between the template's text, the identity is the pixels'
(other bytes of the same pixels are the same image, other pixels another), the embedding
cache encodes an image once, and an image's embeddings decode into the context."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from server.http.app import default_model_path
from server.image_types import EncodedImage, MediaError
from server.llama.backend import LlamaBackend, ModelOptions
from server.llama.mtmd import Projector, ProjectorOptions
from server.prompts.chat import image_prompt
from server.service.state import ServerState
from server.settings.config import Settings
from tests.mmproj_gen import N_IMAGE_TOKENS, pixels, png, write_gemma3_mmproj


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = write_gemma3_mmproj(tmp_path_factory.mktemp("mm") / "mmproj.gguf")
    assert path.stat().st_size < 1 << 20
    b = LlamaBackend(ModelOptions(path=default_model_path(), n_ctx=2048, n_parallel=1))
    p = Projector(ProjectorOptions(str(path), n_threads=1, use_gpu=False), b.model)
    yield b, p
    p.close()
    b.close()


def prompt(p: Projector, n: int = 1) -> str:
    return "<start_of_turn>user\nlook " + f"{p.marker} " * n + "what?<end_of_turn>\n"


def test_the_projector_loads_and_an_image_is_16_tokens_between_text(loaded):
    b, p = loaded
    assert p.vision and not p.audio and not p.mrope and p.n_embd == 640
    pieces = p.tokenize(prompt(p), [png(pixels(1))])
    kinds = [type(x).__name__ for x in pieces]
    assert kinds == ["list", "EncodedImage", "list"]
    img = pieces[1]
    assert isinstance(img, EncodedImage) and img.n_tokens == N_IMAGE_TOKENS
    assert img.embd.shape == (N_IMAGE_TOKENS, 640) and img.embd.dtype == np.float32
    assert np.isfinite(img.embd).all() and img.non_causal
    assert pieces[0][0] == 2  # BOS first (add_special)


def test_identity_is_the_pixels_not_the_bytes_and_the_cache_encodes_once(loaded):
    _, p = loaded
    cache = p.cache
    hits, encoded = cache.counters.hits, cache.counters.encoded
    a = p.tokenize(prompt(p), [png(pixels(2))])[1]
    again = p.tokenize(prompt(p), [png(pixels(2), compress=1, filter_type=1)])[1]
    other = p.tokenize(prompt(p), [png(pixels(3))])[1]
    assert isinstance(a, EncodedImage) and isinstance(again, EncodedImage)
    assert isinstance(other, EncodedImage)
    assert png(pixels(2)) != png(pixels(2), compress=1, filter_type=1)
    assert a.identity == again.identity != other.identity
    assert a.encoded and not again.encoded and other.encoded
    assert np.array_equal(a.embd, again.embd)
    assert cache.counters.hits - hits == 1 and cache.counters.encoded - encoded == 2


def _decodes(p: Projector, monkeypatch) -> list[int]:
    """Count the projector's image decodes (libmtmd's helper, called by ``_bitmap``)."""
    from server.llama import mtmd

    calls: list[int] = []
    real = mtmd.M.mtmd_helper_bitmap_init_from_buf

    def counted(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(mtmd.M, "mtmd_helper_bitmap_init_from_buf", counted)
    return calls


def test_bytes_sent_again_are_not_decoded_while_their_embeddings_are_cached(loaded, monkeypatch):
    _, p = loaded
    decodes = _decodes(p, monkeypatch)
    data = png(pixels(11))
    first = p.tokenize(prompt(p), [data])
    again = p.tokenize(prompt(p) + "and again?", [data])
    assert len(decodes) == 1  # the second turn used a blank stand-in of the same size
    a, b = first[1], again[1]
    assert isinstance(a, EncodedImage) and isinstance(b, EncodedImage)
    assert a.identity == b.identity and not b.encoded and np.array_equal(a.embd, b.embd)
    assert first[0] == again[0]  # the same chunks: the text before the image
    # other bytes of the same pixels: decoded once, then known too
    other = png(pixels(11), compress=1)
    assert p.tokenize(prompt(p), [other])[1].identity == a.identity  # type: ignore[union-attr]
    assert len(decodes) == 2


def test_a_stand_in_is_never_encoded(loaded, monkeypatch):
    """Bytes known but their embeddings gone from the cache: decoded again and encoded from
    their pixels; cached under a wrong shape: the stand-in is dropped and the prompt
    tokenized again from the real pixels."""
    _, p = loaded
    data = png(pixels(12))
    a = p.tokenize(prompt(p), [data])[1]
    assert isinstance(a, EncodedImage)
    p.cache._items.pop(a.identity)  # evicted
    p.cache.nbytes -= a.embd.nbytes
    decodes = _decodes(p, monkeypatch)
    b = p.tokenize(prompt(p), [data])[1]
    assert len(decodes) == 1 and isinstance(b, EncodedImage) and b.encoded
    assert np.array_equal(a.embd, b.embd)  # from the real pixels, not a blank
    p.cache.put(a.identity, a.embd[:3])  # held, but not what this projector gives
    c = p.tokenize(prompt(p), [data])[1]
    assert len(decodes) == 2 and isinstance(c, EncodedImage) and c.encoded
    assert np.array_equal(a.embd, c.embd)


def _whole_prompt(p: Projector, text: str, images: list[bytes]) -> list[object]:
    """libmtmd's own cut of the whole prompt (mtmd_tokenize): text ids, and per image
    ("image", its token count)."""
    import ctypes

    from llama_cpp import mtmd_cpp as M

    bitmaps = [p._bitmap(i, data)[0] for i, data in enumerate(images)]
    raw = text.encode()
    it = M.mtmd_input_text(raw, len(raw), True, True)
    arr = (M.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
    chunks = M.mtmd_input_chunks_init()
    try:
        assert M.mtmd_tokenize(p.ctx, chunks, ctypes.byref(it), arr, len(bitmaps)) == 0
        out: list[object] = []
        for i in range(M.mtmd_input_chunks_size(chunks)):
            c = M.mtmd_input_chunks_get(chunks, i)
            if M.mtmd_input_chunk_get_type(c) == 0:
                n = ctypes.c_size_t()
                toks = M.mtmd_input_chunk_get_tokens_text(c, ctypes.byref(n))
                out += toks[: n.value]
            else:
                out.append(("image", M.mtmd_input_chunk_get_n_tokens(c)))
        return out
    finally:
        M.mtmd_input_chunks_free(chunks)
        for b in bitmaps:
            M.mtmd_bitmap_free(b)


def test_the_text_runs_and_images_are_the_ids_mtmd_tokenize_gives(loaded):
    """The prompt's text is tokenized run by run (each run once: TextTokens) and libmtmd
    asked for the images alone: the same ids as mtmd_tokenize on the whole prompt, with the
    image first, last, twice in a row, between special tokens, and in the cached runs of a
    second turn."""
    _, p = loaded
    m = p.marker
    a, b = png(pixels(21)), png(pixels(22))
    long = "A long system prompt about a picture. " * 40
    cases = [
        (f"<start_of_turn>user\n{long}\n\n{m}\nwhat?<end_of_turn>\n<start_of_turn>model\n", [a]),
        (f"{m} describe it", [a]),
        (f"describe {m}", [b]),
        (f"two: {m}{m} and  spaces\t{m}<end_of_turn>", [a, b, a]),
        ("", []),
        (f"<start_of_turn>user\n{long}{m}x<end_of_turn>\n<start_of_turn>model\nok", [b]),
    ]
    for text, images in cases:
        for _turn in range(2):  # the second time from the cached runs (and stand-ins)
            pieces = p.tokenize(text, images)
            got: list[object] = []
            for x in pieces:
                if isinstance(x, list):
                    got += x
                else:
                    got.append(("image", x.n_tokens))
            assert got == _whole_prompt(p, text, images), text[:40]
            assert all(not isinstance(x, list) or x for x in pieces)  # no empty runs
    assert p.texts.hits > 0 and p.texts.misses > 0


def test_bad_images_raise_media_errors(loaded):
    _, p = loaded
    with pytest.raises(MediaError, match="could not be decoded"):
        p.tokenize(prompt(p), [b"not an image at all"])
    with pytest.raises(MediaError, match="2 media markers for 1 images"):
        p.tokenize(prompt(p, 2), [png(pixels(1))])


def test_image_embeddings_decode_into_the_context(loaded):
    b, p = loaded
    pieces = p.tokenize(prompt(p), [png(pixels(4))])
    pos = 0
    for piece in pieces:
        if isinstance(piece, EncodedImage):
            assert b.decode_image(0, pos, piece.embd, piece.non_causal) == 0
            pos += piece.n_tokens
            continue
        b.batch.clear()
        b.batch.add_span(piece, pos, 0, logits_last=True)
        assert b.decode(0, len(piece)) == 0
        pos += len(piece)
    assert b.seq_pos_max(0) == pos - 1
    b.seq_clear(0)


def test_an_image_prompt_knows_where_its_last_user_turn_starts(loaded):
    b, p = loaded
    st = ServerState(settings=Settings(), backend=b, projector=p)
    first = f"<start_of_turn>user\nlook {p.marker} here<end_of_turn>\n<start_of_turn>model\nA cat.<end_of_turn>\n"
    last = "<start_of_turn>user\nWhy?<end_of_turn>\n<start_of_turn>model\n"
    out = image_prompt(st, first + last, [png(pixels(8))], len(first))
    assert len(out.images) == 1 and out.images[0].n_tokens == N_IMAGE_TOKENS
    head = p.tokenize(first, [png(pixels(8))])
    n_head = sum(len(x) if isinstance(x, list) else x.n_tokens for x in head)
    assert out.user_start == n_head and out.tokens[out.images[0].start] < 0
    assert all(t >= 0 for t in out.tokens[out.user_start :])


def _os_threads() -> int:
    import os

    return len(os.listdir("/proc/self/task"))


def test_an_encode_leaves_no_openmp_threads_behind(loaded, tmp_path):
    """Encodes run on a thread of their own (server.llama.own_thread): libgomp keeps a
    worker pool for each thread that ran a parallel region, and more pools than CPUs
    throttle every decode's barriers. Encodes of a 2-thread projector on a long-lived
    worker thread (as a request's preparation pool) leave the process with as many OS
    threads as before at most (encoded on that thread, its pool's worker would stay)."""
    b, _ = loaded
    path = write_gemma3_mmproj(tmp_path / "mmproj2.gguf")
    p = Projector(ProjectorOptions(str(path), n_threads=2, use_gpu=False), b.model)
    prep = ThreadPoolExecutor(1)
    try:
        prep.submit(lambda: None).result()  # the worker thread exists before the count
        before = _os_threads()
        for k in range(3):
            img = prep.submit(p.tokenize, prompt(p), [png(pixels(40 + k))]).result()[1]
            assert isinstance(img, EncodedImage) and img.encoded
        # an exited thread's pool is freed by its TLS destructor, a moment after the join
        deadline = time.monotonic() + 10
        while _os_threads() > before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _os_threads() <= before  # others may end meanwhile, none may stay
    finally:
        prep.shutdown()
        p.close()
