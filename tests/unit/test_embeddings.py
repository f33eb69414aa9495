"""Embeddings and reranking: request parsing and checks, normalization, response shapes
(server.protocols.embedding_shapes), and the engine's embedding path on the fake backend
(server.engine.embed): shared decodes, slots emptied, generation alongside, errors."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from server.engine.embed import EmbedTask
from server.engine.engine import Engine, EngineOptions
from server.engine_api import EmbedResult
from server.protocols.embedding_shapes import (
    EmbeddingRequest,
    RerankParts,
    RerankRequest,
    check_prompts,
    embedding_prompts,
    embeddings_on,
    encoding_base64,
    native_embeddings,
    normalize,
    oai_embeddings,
    pooling_of,
    rerank_inputs,
    rerank_prompt,
    rerank_response,
)
from server.schemas.errors import APIError
from server.settings.config import parse_settings
from server.task import TaskError
from tests.fake_backend import FakeBackend
from tests.unit.helpers import Collector, task

WIDTH = 8


def tok(text: str, add_special: bool) -> list[int]:
    """A toy tokenizer: one id per word, BOS (1) first when specials are added."""
    ids = [10 + sum(map(ord, w)) % 500 for w in text.split()]
    return ([1] if add_special else []) + ids


# ---- settings -----------------------------------------------------------------------------


def test_flags_embedding_pooling_reranking() -> None:
    s = parse_settings(["--embeddings", "--pooling", "mean"], env={})
    assert embeddings_on(s) and pooling_of(s) == 1 and s.compat == {}
    s = parse_settings(["--rerank"], env={})
    assert embeddings_on(s) and pooling_of(s) == 4
    s = parse_settings([], env={"LLAMA_ARG_EMBEDDINGS": "1", "LLAMA_ARG_POOLING": "cls"})
    assert embeddings_on(s) and pooling_of(s) == 2
    s = parse_settings([], env={})
    assert not embeddings_on(s) and pooling_of(s) == -1 and s.embd_normalize == 2
    with pytest.raises(SystemExit):
        parse_settings(["--pooling", "max"], env={})


# ---- inputs -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw,expected",
    [
        ("a b", [[1, tok("a", False)[0], tok("b", False)[0]]]),
        ([5, 6, 7], [[5, 6, 7]]),  # token ids: one prompt
        (["a", "b"], [tok("a", True), tok("b", True)]),
        ([[5, 6], "a"], [[5, 6], tok("a", True)]),
        ([5, "a", 6], [[5, *tok("a", False), 6]]),  # mixed: specials on the first element only
        (["a", 5], [[*tok("a", True), 5]]),
        ({"prompt_string": "a"}, [tok("a", True)]),
        (
            {"content": [{"type": "text", "text": "a "}, {"type": "text", "text": "b"}]},
            [tok("a b", True)],
        ),
        ([{"content": [{"type": "text", "text": "a"}]}, "b"], [tok("a", True), tok("b", True)]),
    ],
)
def test_embedding_prompts_shapes(raw, expected) -> None:
    assert embedding_prompts(raw, tok) == expected


@pytest.mark.parametrize(
    "raw,msg",
    [
        ([], "must not be empty"),
        (12.5, "elements must be"),
        (None, "elements must be"),
        (True, "elements must be"),
        ([1.5, 2], "elements must be"),
        ([[1, None]], "elements must be"),
        ({"content": "text"}, "array of content parts"),
        ({"content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "only text parts"),
        ({"other": 1}, "elements must be"),
    ],
)
def test_embedding_prompts_refused(raw, msg) -> None:
    with pytest.raises(APIError) as e:
        embedding_prompts(raw, tok)
    assert e.value.status == 400 and msg in e.value.message


def test_check_prompts() -> None:
    check_prompts([[1, 2], [3]], n_vocab=10, n_ubatch=4, n_ctx=8)
    cases = [
        ([[]], "cannot be empty"),
        ([[1, 10]], "token id 10 is outside"),
        ([[-1]], "token id -1 is outside"),
        ([[1] * 5], "input (5 tokens) is too large to process"),
        ([[1] * 9], "input (9 tokens) is too large to process"),  # the batch is checked first
    ]
    for prompts, msg in cases:
        with pytest.raises(APIError) as e:
            check_prompts(prompts, n_vocab=10, n_ubatch=4, n_ctx=8)
        assert e.value.status == 400 and msg in e.value.message
    with pytest.raises(APIError) as e:  # a batch larger than the context
        check_prompts([[1] * 9], n_vocab=10, n_ubatch=16, n_ctx=8)
    assert "input (9 tokens) is larger than the max context size (8 tokens)" in e.value.message


def test_encoding_format() -> None:
    assert encoding_base64(None) is False and encoding_base64("float") is False
    assert encoding_base64("base64") is True
    for bad in ("int8", 3):
        with pytest.raises(APIError):
            encoding_base64(bad)


# ---- outputs ------------------------------------------------------------------------------


def test_normalize_modes() -> None:
    v = np.array([[3.0, -4.0], [0.0, 0.0]], dtype=np.float32)
    assert np.allclose(normalize(v, 2)[0], [0.6, -0.8])
    assert np.allclose(normalize(v, 1)[0], [3 / 7, -4 / 7])
    assert np.allclose(normalize(v, 0)[0], [3 * 32760 / 4, -32760])
    assert np.allclose(normalize(v, -1), v)
    p3 = (27 + 64) ** (1 / 3)
    assert np.allclose(normalize(v, 3)[0], [3 / p3, -4 / p3])
    assert np.all(normalize(v, 2)[1] == 0)  # a zero row stays zero


def _results() -> list[EmbedResult]:
    rng = np.random.default_rng(0)
    return [
        EmbedResult(i, rng.standard_normal((1, WIDTH)).astype(np.float32), 3 + i) for i in range(3)
    ]


def test_oai_shape_and_base64_round_trip() -> None:
    res = _results()
    flt = oai_embeddings(res, "m", use_base64=False, mode=2)
    assert flt["object"] == "list" and flt["model"] == "m"
    assert flt["usage"] == {"prompt_tokens": 12, "total_tokens": 12}
    assert [d["index"] for d in flt["data"]] == [0, 1, 2]
    assert all(d["object"] == "embedding" and len(d["embedding"]) == WIDTH for d in flt["data"])
    assert abs(sum(x * x for x in flt["data"][0]["embedding"]) - 1) < 1e-5
    b64 = oai_embeddings(res, "m", use_base64=True, mode=2)
    for f, b in zip(flt["data"], b64["data"], strict=True):
        assert b["encoding_format"] == "base64"
        back = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        assert back.tolist() == f["embedding"]


def test_native_shape() -> None:
    per_token = EmbedResult(0, np.full((3, WIDTH), 2.0, dtype=np.float32), 3)
    out = native_embeddings([per_token], pooled=False, mode=2)
    assert out[0]["index"] == 0 and len(out[0]["embedding"]) == 3
    assert out[0]["embedding"][0][0] == 2.0  # pooling none: not normalized
    pooled = native_embeddings(_results(), pooled=True, mode=2)
    assert len(pooled) == 3 and len(pooled[1]["embedding"]) == 1
    assert abs(sum(x * x for x in pooled[1]["embedding"][0]) - 1) < 1e-5


# ---- reranking ----------------------------------------------------------------------------


PARTS = RerankParts(None, bos=1, eos=2, sep=3, add_bos=True, add_eos=True, add_sep=False)


def test_rerank_prompt() -> None:
    q, d = tok("q", False), tok("doc", False)
    assert rerank_prompt("q", "doc", PARTS, tok) == [1, *q, 2, *d, 2]
    bert = RerankParts(None, bos=1, eos=2, sep=3, add_bos=True, add_eos=False, add_sep=True)
    assert rerank_prompt("q", "doc", bert, tok) == [1, *q, 3, *d]
    tmpl = RerankParts("Q: {query} D: {document}", 1, 2, 3, True, True, True)
    assert rerank_prompt("q", "doc", tmpl, tok) == tok("Q: q D: doc", False)


@pytest.mark.parametrize(
    "body,msg",
    [
        ({"documents": ["a"]}, '"query" must be provided'),
        ({"query": 3, "documents": ["a"]}, '"query" must be a string'),
        ({"query": "q", "documents": []}, "non-empty string array"),
        ({"query": "q", "documents": None}, "non-empty string array"),
        ({"query": "q", "documents": 123}, "non-empty string array"),
        ({"query": "q", "documents": [1, 2, 3]}, "non-empty string array"),
    ],
)
def test_rerank_inputs_refused(body, msg) -> None:
    with pytest.raises(APIError) as e:
        rerank_inputs(RerankRequest(**body))
    assert e.value.status == 400 and msg in e.value.message


def test_rerank_response_order_top_n_and_tei() -> None:
    scores = [0.1, 0.9, -0.5, 0.4]
    res = [EmbedResult(i, np.array([[s]], dtype=np.float32), 2) for i, s in enumerate(scores)]
    docs = ["a", "b", "c", "d"]
    body = RerankRequest(query="q", documents=docs, top_n=2)
    out = rerank_response(body, "m", res, docs)
    assert [r["index"] for r in out["results"]] == [1, 3]
    assert out["usage"] == {"prompt_tokens": 8, "total_tokens": 8}
    out = rerank_response(RerankRequest(query="q", documents=docs, top_n=99), "m", res, docs)
    assert [r["index"] for r in out["results"]] == [1, 3, 0, 2]
    tei = rerank_response(RerankRequest(query="q", texts=docs, return_text=True), "m", res, docs)
    assert isinstance(tei, list) and tei[0] == {
        "index": 1,
        "score": pytest.approx(0.9),
        "text": "b",
    }


def test_request_models_ignore_unknown_fields() -> None:
    r = EmbeddingRequest(input="x", user="u", dimensions=3)
    assert r.input == "x" and r.encoding_format is None


# ---- the engine's embedding path ------------------------------------------------------------


class EmbedBackend(FakeBackend):
    """The fake backend with embeddings: a sequence's pooled embedding is the mean of one-hot
    rows of its decoded tokens (mod WIDTH), so the tests can tell prompts apart; pooling none
    gives the rows themselves."""

    def __init__(self, pooling: int = 1, **kw) -> None:
        super().__init__(**kw)
        self.pooling = pooling
        self.embeddings_on = False
        self.embedding_decodes: list[list[tuple[int, int, int]]] = []

    def set_embeddings(self, on: bool) -> None:
        self.embeddings_on = on

    def decode(self, start: int, count: int) -> int:
        ret = super().decode(start, count)
        if ret == 0 and self.embeddings_on:
            assert all(self.batch.logits[start : start + count]), "every token is an output"
            self.embedding_decodes.append(self.decodes[-1])
        elif ret == 0:
            assert not any(r[1] < 0 for r in self.decodes[-1])
        return ret

    def _rows(self, rows) -> np.ndarray:
        out = np.zeros((len(rows), WIDTH), dtype=np.float32)
        out[np.arange(len(rows)), [t % WIDTH for _, _, t in rows]] = 1.0
        return out

    def embedding_of_seq(self, seq: int):
        rows = [r for r in self.decodes[-1] if r[0] == seq]
        return self._rows(rows).mean(axis=0) if rows else None

    def embedding_rows(self, start: int, count: int):
        return self._rows(self.decodes[-1][start : start + count])


def _engine(**kw) -> tuple[Engine, EmbedBackend]:
    b = EmbedBackend(**kw)
    return Engine(b, EngineOptions()), b


def _embed(engine: Engine, prompts: list[list[int]]) -> list[Collector]:
    out = []
    for i, p in enumerate(prompts):
        c = Collector()
        engine._inbox.put(EmbedTask(p, c, index=i))
        out.append(c)
    return out


def _run(engine: Engine, steps: int = 20) -> None:
    for _ in range(steps):
        engine.step()


def _expected(tokens: list[int]) -> np.ndarray:
    v = np.zeros(WIDTH)
    for t in tokens:
        v[t % WIDTH] += 1
    return v / len(tokens)


def test_engine_embeds_in_shared_decodes_and_empties_slots() -> None:
    e, b = _engine(n_seq=4, n_ubatch=64)
    prompts = [[i + 1, i + 2, i + 3] for i in range(10)]
    cols = _embed(e, prompts)
    e.step()
    assert all(c.events for c in cols), "all ten in one step"
    assert [len({r[0] for r in d}) for d in b.embedding_decodes] == [4, 4, 2]
    for p, c in zip(prompts, cols, strict=True):
        (ev,) = c.events
        assert isinstance(ev, EmbedResult) and ev.n_tokens == 3
        assert np.allclose(ev.vectors[0], _expected(p))
    assert all(not s.tokens for s in e.slots) and all(not kv for kv in b.kv.values())
    assert e.check_integrity() == [] and not b.embeddings_on
    assert e.embed.n_tasks == 10 and e.embed.n_tokens == 30


def test_engine_physical_batch_budget() -> None:
    e, b = _engine(n_seq=4, n_ubatch=8)
    cols = _embed(e, [[1] * 5, [2] * 5, [3] * 3, [4] * 9])
    e.step()
    sizes = [len(d) for d in b.embedding_decodes]
    assert sizes == [5, 8] and all(n <= 8 for n in sizes)
    err = cols[3].events[0]
    assert isinstance(err, TaskError) and err.status == 400 and "too large" in err.message
    assert all(isinstance(c.events[0], EmbedResult) for c in cols[:3])


def test_engine_pooling_none_rows() -> None:
    e, b = _engine(pooling=0)
    cols = _embed(e, [[1, 2, 3], [4, 5]])
    e.step()
    first, second = cols[0].events[0], cols[1].events[0]
    assert first.vectors.shape == (3, WIDTH) and second.vectors.shape == (2, WIDTH)
    assert second.vectors[0].argmax() == 4 and second.vectors[1].argmax() == 5


def test_engine_embeds_beside_generation() -> None:
    e, b = _engine(n_seq=4)
    gen = [task(list(range(1, 6)), max_tokens=8) for _ in range(2)]
    for t, _ in gen:
        e._inbox.put(t)
    e.step()  # the generating tasks take two slots
    cols = _embed(e, [[7, 8], [9, 10], [11, 12]])
    _run(e)
    assert all(isinstance(c.events[0], EmbedResult) for c in cols)
    assert all(c.result is not None and c.result.timings.predicted_n == 8 for _, c in gen)
    # embedding decodes used only the idle slots, never a generating one's sequence
    busy = {s for d in b.embedding_decodes for s, _, _ in d}
    assert busy and busy.isdisjoint({0, 1})
    assert e.check_integrity() == []


def test_engine_lends_cached_idle_slots_emptying_them() -> None:
    e, b = _engine(n_seq=2)
    t, c = task([1, 2, 3, 4], max_tokens=2)
    e._inbox.put(t)
    _run(e)
    assert c.result is not None and any(s.tokens for s in e.slots)
    cols = _embed(e, [[5, 6], [7, 8]])
    e.step()
    assert all(isinstance(x.events[0], EmbedResult) for x in cols)
    assert all(not s.tokens for s in e.slots) and e.check_integrity() == []


def test_engine_decode_failure_and_cancel() -> None:
    e, b = _engine()
    b.fail_next = [-1]
    cols = _embed(e, [[1, 2], [3]])
    e.step()
    assert all(isinstance(c.events[0], TaskError) for c in cols)
    assert all(not kv for kv in b.kv.values()) and e.check_integrity() == []
    c = Collector()
    t = EmbedTask([1, 2], c)
    t.cancel()
    e._inbox.put(t)
    ok = _embed(e, [[4]])
    e.step()
    assert c.events == [] and isinstance(ok[0].events[0], EmbedResult)


def test_engine_no_kv_room_frees_idle_slots_then_retries() -> None:
    e, b = _engine(n_seq=2)
    t, c = task([1, 2, 3, 4], max_tokens=2)
    e._inbox.put(t)
    _run(e)
    held = [s for s in e.slots if s.tokens]
    assert c.result is not None and len(held) == 1
    b.fail_next = [1]  # the first try finds no room: the cached idle slot is freed
    cols = _embed(e, [[1, 2]])
    e.step()
    assert isinstance(cols[0].events[0], EmbedResult)
    assert not held[0].tokens and e.check_integrity() == []
    b.fail_next = [1, 1]  # no room, and nothing left to free: the task fails, nothing leaks
    cols = _embed(e, [[1, 2]])
    e.step()
    assert isinstance(cols[0].events[0], TaskError) and "no room" in cols[0].events[0].message
    assert e.check_integrity() == [] and all(not kv for kv in b.kv.values())


def test_routes_refuse_without_the_flags() -> None:
    """Without --embedding / --reranking: llama-server's 501s (no model needed: the app's
    lifespan, which loads it, does not run without the client's context manager)."""
    from fastapi.testclient import TestClient

    from server.http.app import create_app

    client = TestClient(create_app(parse_settings([], env={})))
    for path in ("/v1/embeddings", "/embedding", "/embeddings"):
        r = client.post(path, json={"input": "x"})
        assert r.status_code == 501 and "Start it with `--embeddings`" in r.text
    for path in ("/rerank", "/v1/rerank", "/reranking", "/v1/reranking"):
        r = client.post(path, json={"query": "q", "documents": ["a"]})
        assert r.status_code == 501 and "Start it with `--reranking`" in r.text
        assert r.json()["error"]["type"] == "not_supported_error"
    emb = TestClient(create_app(parse_settings(["--embedding", "--pooling", "mean"], env={})))
    r = emb.post("/rerank", json={"query": "q", "documents": ["a"]})
    assert r.status_code == 501


def test_engine_never_lends_a_waiting_tasks_prefix_source() -> None:
    from server.slot.slot import ShareWait, SlotState

    e, b = _engine(n_seq=3)
    t, c = task([1, 2, 3, 4], max_tokens=2)
    e._inbox.put(t)
    _run(e)
    src = next(s for s in e.slots if s.tokens)
    kept = list(src.tokens)
    waiter = next(s for s in e.slots if s is not src)
    t2, _ = task([1, 2, 3, 4, 5], max_tokens=2)
    waiter.start(t2, 0)
    waiter.state = SlotState.WAIT  # copies from src next step
    waiter.live.wait = ShareWait(src.id, -1, len(src.tokens))
    e._drain_inbox()
    cols = _embed(e, [[6, 7], [8, 9]])
    e._drain_inbox()
    e.runner.drive(e.embed.step())  # alone: the step's resolve_waiters would start the waiter
    e._flush()
    assert all(isinstance(x.events[0], EmbedResult) for x in cols)
    assert src.tokens == kept and b.kv[src.id] and not b.kv[waiter.id]
    assert {s for d in b.embedding_decodes for s, _, _ in d} == {3 - src.id - waiter.id}


def test_a_disconnected_client_cancels_its_prompts_not_embedded_yet() -> None:
    import asyncio
    from types import SimpleNamespace

    from server.service.embedding_runs import run_embeddings

    class StuckEngine:  # takes the tasks and never runs them
        def __init__(self) -> None:
            self.tasks: list[EmbedTask] = []

        def queue_depth(self) -> int:
            return 0

        def n_idle_slots(self) -> int:
            return 1

        def submit(self, t: EmbedTask) -> None:
            self.tasks.append(t)

    class Gone:  # the client leaves after the second poll
        polls = 0

        async def is_disconnected(self) -> bool:
            self.polls += 1
            return self.polls >= 2

    engine = StuckEngine()
    settings = SimpleNamespace(max_queue=8, timeout=60.0)
    st = SimpleNamespace(require_engine=lambda: engine, settings=settings)
    with pytest.raises(APIError) as e:
        asyncio.run(asyncio.wait_for(run_embeddings(st, [[1, 2], [3, 4], [5]], Gone()), 5))
    assert e.value.status == 499
    assert len(engine.tasks) == 3 and all(t.cancelled for t in engine.tasks)
