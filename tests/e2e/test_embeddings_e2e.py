"""Embeddings and reranking end to end on the default model (Gemma 3 270M, a generation
model: it embeds with --embedding as llama-server does, and is no reranker).

llama.cpp is not batch-invariant: a text embedded beside others is compared with itself
alone by cosine similarity, never for equality."""

from __future__ import annotations

import base64
import concurrent.futures as cf

import numpy as np
import pytest

from .conftest import ServerProc

TEXTS = [
    "The cat sat on the mat.",
    "Stock markets fell sharply on Monday.",
    "A recipe for bread needs flour, water and yeast.",
    "The spacecraft entered orbit around Mars.",
    "Children played football in the park.",
    "The violin concerto was performed in Vienna.",
    "Rain is expected tomorrow afternoon.",
    "He repaired the bicycle with a new chain.",
]


@pytest.fixture(scope="module")
def emb() -> ServerProc:
    s = ServerProc("--embedding", "--pooling", "mean")
    yield s
    s.stop()


def _post(s: ServerProc, path: str, body: dict):
    return s.client.post(path, json=body)


def _vectors(s: ServerProc, inputs, **kw) -> np.ndarray:
    r = _post(s, "/v1/embeddings", {"input": inputs, **kw})
    assert r.status_code == 200, r.text
    return np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float64)


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_oai_shape_usage_and_normalization(emb: ServerProc) -> None:
    r = _post(emb, "/v1/embeddings", {"input": TEXTS[:3], "model": "my-model"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "my-model"
    n = sum(len(emb.tokenize(t)) for t in TEXTS[:3])
    assert body["usage"] == {"prompt_tokens": n, "total_tokens": n}
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    for d in body["data"]:
        assert d["object"] == "embedding" and len(d["embedding"]) == 640
        assert abs(sum(x * x for x in d["embedding"]) - 1) < 1e-3
    # one string, token ids, and a mixed list are one prompt each
    assert len(_vectors(emb, TEXTS[0])) == 1
    toks = emb.tokenize(TEXTS[0])
    same = _vectors(emb, [toks, TEXTS[0]])
    assert _cos(same[0], same[1]) > 0.999


def test_base64_round_trip_equals_float(emb: ServerProc) -> None:
    flt = _post(emb, "/v1/embeddings", {"input": TEXTS[1]}).json()["data"][0]["embedding"]
    r = _post(emb, "/v1/embeddings", {"input": TEXTS[1], "encoding_format": "base64"})
    item = r.json()["data"][0]
    assert item["encoding_format"] == "base64" and isinstance(item["embedding"], str)
    back = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
    assert back.shape == (640,)
    # the same text alone both times: the same batch layout, the same numbers
    assert np.allclose(back, flt, atol=1e-6)


def test_batch_member_matches_alone_and_texts_differ(emb: ServerProc) -> None:
    alone = _vectors(emb, TEXTS[2])[0]
    batch = _vectors(emb, TEXTS)
    assert _cos(batch[2], alone) > 0.999
    # concurrent requests share decodes: each still gets its own text's vector
    with cf.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda t: _vectors(emb, t)[0], TEXTS[:4]))
    for i, v in enumerate(outs):
        assert _cos(v, batch[i]) > 0.999
    for i in range(len(TEXTS)):
        for j in range(i + 1, len(TEXTS)):
            assert _cos(batch[i], batch[j]) < 0.999, (i, j)


def test_native_embedding_shape(emb: ServerProc) -> None:
    r = _post(emb, "/embedding", {"content": TEXTS[3]})
    assert r.status_code == 200, r.text
    (item,) = r.json()
    assert item["index"] == 0 and len(item["embedding"]) == 1 and len(item["embedding"][0]) == 640
    v = np.array(item["embedding"][0])
    assert abs(v @ v - 1) < 1e-3
    oai = _vectors(emb, TEXTS[3])[0]
    assert _cos(v, oai) > 0.999
    # embd_normalize -1: the raw pooled vector, the same direction
    raw = _post(emb, "/embeddings", {"input": TEXTS[3], "embd_normalize": -1}).json()
    r0 = np.array(raw[0]["embedding"][0])
    assert abs(r0 @ r0 - 1) > 1e-3 and _cos(r0, v) > 0.9999


@pytest.mark.parametrize(
    "body,status,msg",
    [
        ({"input": []}, 400, "must not be empty"),
        ({"input": [999_999_999]}, 400, "outside the vocabulary"),
        ({"input": [[1, 2], [-5]]}, 400, "outside the vocabulary"),
        ({"input": 123.5}, 400, "elements must be"),
        ({"input": {"x": 1}}, 400, "elements must be"),
        ({"model": "m"}, 400, '"input" or "content" must be provided'),
        ({"input": "a", "encoding_format": "int8"}, 400, "float or base64"),
        ({"input": [2] * 600}, 400, "too large to process"),
        ({"input": [2] * 9000}, 400, "too large to process"),  # llama-server: batch first
    ],
)
def test_errors(emb: ServerProc, body: dict, status: int, msg: str) -> None:
    r = _post(emb, "/v1/embeddings", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert msg in err["message"] and err["code"] == status and err["type"]


def test_rerank_refused_and_server_still_generates(emb: ServerProc) -> None:
    for path in ("/rerank", "/v1/rerank", "/reranking", "/v1/reranking"):
        r = _post(emb, path, {"query": "q", "documents": ["a"]})
        assert r.status_code == 501, r.text
        assert "Start it with `--reranking`" in r.json()["error"]["message"]
    # generation keeps working beside embeddings, as in llama-server (ignore_eos: 8 tokens
    # whatever the random seed samples, an early end included)
    gen_body = {"prompt": "Once upon a time", "n_predict": 8, "ignore_eos": True}
    with cf.ThreadPoolExecutor(2) as pool:
        gen = pool.submit(_post, emb, "/completion", gen_body)
        vecs = pool.submit(_vectors, emb, TEXTS)
        assert gen.result().status_code == 200 and gen.result().json()["tokens_predicted"] == 8
        assert len(vecs.result()) == len(TEXTS)
    emb.wait_idle()
    emb.assert_integrity()
    assert _post(emb, "/v1/embeddings", {"input": "still serving"}).status_code == 200
    emb.assert_integrity()


def test_pooling_none_and_reranking_servers(make_server) -> None:
    """--embedding alone: the model's own pooling (none for Gemma 3): per-token rows on
    /embedding, refused on /v1/embeddings. --reranking: llama-server's shapes."""
    s = make_server("--embedding")
    r = _post(s, "/v1/embeddings", {"input": "hello hello hello"})
    assert r.status_code == 400 and "not OAI compatible" in r.json()["error"]["message"]
    r = _post(s, "/embedding", {"content": "hello hello hello"})
    assert r.status_code == 200, r.text
    rows = r.json()[0]["embedding"]
    assert len(rows) == len(s.tokenize("hello hello hello")) and len(rows[0]) == 640
    assert all(abs(sum(x * x for x in row) - 1) > 1e-3 for row in rows)  # not normalized
    s.assert_integrity()
    s.stop()

    rr = make_server("--reranking")
    docs = ["Paris is in France.", "Bread needs yeast.", "Rome is in Italy."]
    r = _post(rr, "/v1/rerank", {"query": "capital cities", "documents": docs, "top_n": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and len(body["results"]) == 2
    scores = [x["relevance_score"] for x in body["results"]]
    assert scores == sorted(scores, reverse=True)
    assert {x["index"] for x in body["results"]} <= {0, 1, 2}
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    tei = _post(rr, "/rerank", {"query": "q", "texts": docs, "return_text": True}).json()
    assert isinstance(tei, list) and len(tei) == 3 and {x["text"] for x in tei} == set(docs)
    for bad in ([], None, 123, [1, 2, 3]):
        r = _post(rr, "/rerank", {"query": "q", "documents": bad})
        assert r.status_code == 400 and "error" in r.json()
    assert _post(rr, "/rerank", {"documents": docs}).status_code == 400
    rr.assert_integrity()
