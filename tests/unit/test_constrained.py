"""server.constrained: schema and grammar checks (errors name the offending part), the LRU
caches, and matchers driven token by token, on a small fake vocabulary and on the real
model's 262k-token vocabulary (loaded vocabulary-only: a few seconds)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from server.constrained import (
    ConstraintCompiler,
    ConstraintError,
    ConstraintVocab,
    gbnf_constraint,
    json_object_constraint,
    json_schema_constraint,
    lark_constraint,
    request_constraint,
    spec,
    worker,
)

# ---- a small fake vocabulary -------------------------------------------------------

PIECES = [
    b"\xff<eos>",
    b"{",
    b"}",
    b'"',
    b"a",
    b"b",
    b":",
    b",",
    b" ",
    b"1",
    b"2",
    b'{"',
    b"ab",
    b"\n",
]
EOS = 0
TOK = {p.decode(): i for i, p in enumerate(PIECES) if i != EOS}


def _greedy(text: bytes) -> list[int]:
    """Longest-match tokenizer over PIECES (what llguidance asks of a tokenizer)."""
    out, i = [], 0
    by_len = sorted(range(1, len(PIECES)), key=lambda t: -len(PIECES[t]))
    while i < len(text):
        t = next((t for t in by_len if text.startswith(PIECES[t], i)), None)
        if t is None:  # a byte no piece covers: skipped (llguidance probes with b"test")
            i += 1
            continue
        out.append(t)
        i += len(PIECES[t])
    return out


@pytest.fixture(scope="module")
def fake() -> ConstraintCompiler:
    return ConstraintCompiler(ConstraintVocab.from_pieces(PIECES, [EOS], _greedy, special=[EOS]))


def ids(*pieces: str) -> list[int]:
    return [TOK[p] for p in pieces]


SCHEMA_A = {
    "type": "object",
    "properties": {"a": {"type": "integer"}},
    "required": ["a"],
    "additionalProperties": False,
}


def test_matcher_accepts_a_valid_document_and_is_done(fake):
    m = fake.compile(json_schema_constraint(SCHEMA_A)).matcher()
    for t in ids('{"', "a", '"', ":", " ", "1", "2", "}"):
        assert m.allows(t)
        assert m.accept(t), m.error()
    assert m.is_done() and m.can_end() and not m.is_error()


def test_matcher_refuses_what_the_schema_forbids(fake):
    m = fake.compile(json_schema_constraint(SCHEMA_A)).matcher()
    assert not m.allows(TOK["}"])  # "a" is required
    assert not m.allows(TOK[" "])  # no whitespace before the document
    for t in ids("{", '"', "a", '"', ":"):
        assert m.accept(t)
    assert not m.allows(TOK['"'])  # an integer, not a string
    assert m.allows(TOK["1"])
    assert m.reset() and m.allows(TOK["{"]) and not m.allows(TOK["1"])
    for t in ids("{", '"', "a", '"', ":"):
        assert m.accept(t)
    assert not m.accept(TOK["b"])
    assert m.is_error() and m.error()  # for good: the engine checks allows() first


def test_mask_logits_leaves_exactly_the_allowed_tokens(fake):
    m = fake.compile(json_schema_constraint(SCHEMA_A)).matcher()
    logits = np.zeros(len(PIECES) + 3, dtype=np.float32)  # rows may be padded past the vocab
    n = m.mask_logits(logits)
    finite = {int(i) for i in np.flatnonzero(np.isfinite(logits))}
    assert finite == {TOK["{"], TOK['{"']} and n == 2
    assert all(m.allows(t) == (t in finite) for t in range(len(PIECES)))


def test_rollback_undoes_accepted_tokens(fake):
    m = fake.compile(json_schema_constraint(SCHEMA_A)).matcher()
    for t in ids("{", '"', "a"):
        assert m.accept(t)
    assert m.rollback(2)
    assert m.allows(TOK['"']) and not m.allows(TOK["{"])


def test_gbnf_repetition_and_end_of_generation(fake):
    m = fake.compile(gbnf_constraint('root ::= "a"{2,3}')).matcher()
    assert not m.allows(EOS)
    assert m.accept(TOK["a"]) and m.accept(TOK["a"])
    assert m.can_end() and not m.is_done() and m.allows(EOS)  # may end, or add one more
    assert m.accept(TOK["a"])
    assert m.is_done()


def test_prefix_and_suffix_around_a_schema(fake):
    c = json_schema_constraint({"type": "integer"}, prefix="ab:", suffix=",")
    m = fake.compile(c).matcher()
    for t in ids("ab", ":", "1", "2", ","):
        assert m.accept(t), m.error()
    assert m.is_done()


def test_json_object_any_keys(fake):
    m = fake.compile(json_object_constraint()).matcher()
    for t in ids('{"', "b", '"', ":", '"', "ab", '"', "}"):
        assert m.accept(t), m.error()
    assert m.is_done()


# ---- compile errors name the offending part ---------------------------------------------


@pytest.mark.parametrize(
    ("schema", "where", "reason"),
    [
        ({"type": "object", "properties": {"age": {"type": "wat"}}}, "#/properties/age", "wat"),
        ({"type": "array", "items": {"type": "string", "pattern": "(x"}}, "#/items", "regex"),
        (
            {"anyOf": [{"type": "string"}, {"type": "string", "format": "nope"}]},
            "#/anyOf/1",
            "nope",
        ),
        (
            {
                "$defs": {"P": {"type": "object", "properties": {"a/b": {"not": {}}}}},
                "$ref": "#/$defs/P",
            },
            "#/$defs/P/properties/a~1b",
            "not",
        ),
        ({"type": 123}, "#", "type"),
        ({"properties": {"a": {"$ref": "#/$defs/missing"}}}, "#/properties/a", "missing"),
        (
            {
                "type": "object",
                "properties": {"a": {}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
            "#",
            "'b'",
        ),
    ],
)
def test_schema_errors_name_the_json_pointer(schema, where, reason):
    with pytest.raises(ConstraintError) as e:
        json_schema_constraint(schema)
    assert e.value.where == where
    assert reason in e.value.reason
    assert str(e.value).startswith(where)


def test_grammar_errors_name_the_grammar():
    for bad in ("root ::= this is (not valid GBNF", "root ::= missing", "root ::= [a-z"):
        with pytest.raises(ConstraintError) as e:
            gbnf_constraint(bad)
        assert e.value.where == "grammar"
    with pytest.raises(ConstraintError):
        lark_constraint("start: nothing_here")
    with pytest.raises(ConstraintError) as e:
        json_schema_constraint([1, 2])  # type: ignore[arg-type]
    assert e.value.where == "#"


def test_unbounded_numbers_get_bounds_but_stated_ones_stay():
    b = spec._normalized(
        {
            "type": "object",
            "properties": {
                "n": {"type": "integer"},
                "x": {"type": ["number", "null"], "minimum": 0},
                "big": {"type": "integer", "minimum": 2**60},
                "e": {"enum": [{"type": "integer"}]},
            },
        }
    )
    p = b["properties"]
    assert (p["n"]["minimum"], p["n"]["maximum"]) == (-spec.MAX_NUMBER, spec.MAX_NUMBER)
    assert (p["x"]["minimum"], p["x"]["maximum"]) == (0, spec.MAX_NUMBER)
    assert "maximum" not in p["big"]  # its own bound is beyond ours: no empty range
    assert p["e"] == {"enum": [{"type": "integer"}]}  # values are not schemas


def test_schemas_are_read_as_llama_cpp_reads_them():
    # no type: properties make an object, items an array; a draft-04 tuple is prefixItems
    n = spec._normalized({"items": [{"type": "integer"}], "properties": {"p": {"items": {}}}})
    assert n["type"] == "object" and n["properties"]["p"]["type"] == "array"
    assert n["prefixItems"] == [
        {"type": "integer", "minimum": -spec.MAX_NUMBER, "maximum": spec.MAX_NUMBER}
    ]
    assert n["items"] is False and n["minItems"] == 1  # all of the tuple, as llama.cpp
    assert spec._normalized({"prefixItems": [{}, {}], "minItems": 0})["minItems"] == 0
    assert "type" not in spec._normalized({"anyOf": [{"type": "string"}], "properties": {}})


# ---- caches -----------------------------------------------------------------------------


def test_checks_and_compiles_happen_once_per_schema(fake):
    schema = {"type": "object", "properties": {"zz": {"type": "string"}}}
    runs0 = worker.pool().n_runs
    c1 = json_schema_constraint(json.loads(json.dumps(schema)))
    c2 = json_schema_constraint(json.loads(json.dumps(schema)))
    assert c1 is c2
    assert worker.pool().n_runs == runs0 + 1  # one compile child run for both
    n0 = fake.n_compiled
    k1 = fake.compile(c1)
    k2 = fake.compile(json_schema_constraint(schema))
    assert k1 is k2 and fake.n_compiled == n0 + 1
    assert k1.matcher() is not k2.matcher()  # each request gets its own matcher


def test_property_order_is_part_of_the_key():
    a = {"type": "object", "properties": {"x": {}, "y": {}}}
    b = {"type": "object", "properties": {"y": {}, "x": {}}}
    assert json_schema_constraint(a).key != json_schema_constraint(b).key


def test_compiler_cache_is_bounded():
    v = ConstraintVocab.from_pieces(PIECES, [EOS], _greedy, special=[EOS])
    comp = ConstraintCompiler(v, cache_size=2)
    cs = [gbnf_constraint(f'root ::= "{"a" * (i + 1)}"') for i in range(3)]
    for c in cs:
        comp.compile(c)
    comp.compile(cs[0])  # evicted by the third: compiled again
    assert comp.n_compiled == 4


# ---- request fields ---------------------------------------------------------------------


def test_request_fields():
    assert request_constraint() is None
    assert request_constraint(response_format={"type": "text"}) is None
    assert request_constraint(response_format={"type": "json_object"}) == json_object_constraint()
    assert request_constraint(json_schema={}) == json_object_constraint()  # llama-server
    js = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA_A, "strict": True}}
    assert request_constraint(response_format=js) == json_schema_constraint(SCHEMA_A)
    rf = {"type": "json_object", "schema": {"const": "42"}}  # llama-server's extension
    assert request_constraint(response_format=rf) == json_schema_constraint({"const": "42"})
    assert request_constraint(grammar='root ::= "x"').kind == "gbnf"


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        ({"response_format": {"type": "sound"}}, "response_format.type"),
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "json_object", "schema": 123}}, "response_format.schema"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "hiccup"}},
                }
            },
            "response_format.json_schema.schema#",
        ),
        ({"json_schema": {"properties": {"a": {"type": "x"}}}}, "json_schema#/properties/a"),
        ({"json_schema": {}, "grammar": 'root ::= "x"'}, "grammar"),
        ({"grammar": 12}, "grammar"),
    ],
)
def test_request_field_errors_name_the_field(fields, where):
    with pytest.raises(ConstraintError) as e:
        request_constraint(**fields)
    assert e.value.where == where


# ---- the real vocabulary ----------------------------------------------------------------


@pytest.fixture(scope="module")
def real():
    """The default model's vocabulary (vocabulary-only load) and its tokenizer."""
    import llama_cpp as L

    from server.http.app import default_model_path

    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.vocab_only = True
    model = L.llama_model_load_from_file(default_model_path().encode(), mp)
    assert model
    vocab = L.llama_model_get_vocab(model)
    n = L.llama_vocab_n_tokens(vocab)
    eog = [t for t in range(n) if L.llama_vocab_is_eog(vocab, t)]

    def tokenize(text: str) -> list[int]:
        b = text.encode()
        buf = (L.llama_token * (len(b) + 8))()
        k = L.llama_tokenize(vocab, b, len(b), buf, len(buf), False, False)
        return list(buf[:k])

    yield ConstraintCompiler(ConstraintVocab.from_llama(vocab, eog)), tokenize, eog
    L.llama_model_free(model)


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "role": {"type": "string", "enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "age": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
    },
    "required": ["name", "role", "tags", "address", "age"],
    "additionalProperties": False,
}


def test_real_vocab_valid_document(real):
    comp, tokenize, eog = real
    assert comp.vocab.n_vocab == 262144 and eog
    doc = '{"name": "Ada", "role": "admin", "tags": ["x", "y"],\n  "address": {"city": "Oslo"}, "age": null}'
    m = comp.compile(json_schema_constraint(PERSON)).matcher()
    for t in tokenize(doc):
        assert m.accept(t), (t, m.error())
    assert m.is_done()


@pytest.mark.parametrize(
    "bad",
    [
        '{"name": "Ada", "role": "root"',  # not in the enum
        '{"role": "admin"',  # properties come in schema order
        '{"name": "Ada", "role": "admin", "tags": ["a", "b", "c"',  # maxItems
        '{"name": "Ada", "role": "admin", "tags": [], "address": {"city": "O"}, "age": 12345678901234567',
        '{"name": "Ada", "role": "admin", "tags": [], "address": {"city": "O"}, "age": 1, "x"',
        '{\n\n\n"name"',  # whitespace runs are bounded
    ],
)
def test_real_vocab_refuses_invalid_documents(real, bad):
    comp, tokenize, _ = real
    m = comp.compile(json_schema_constraint(PERSON)).matcher()
    assert not all(m.accept(t) for t in tokenize(bad))


def test_real_vocab_mask_matches_single_token_checks(real):
    comp, tokenize, _ = real
    m = comp.compile(json_schema_constraint(PERSON)).matcher()
    for t in tokenize('{"name": "A'):
        assert m.accept(t)
    logits = np.zeros(comp.vocab.n_vocab, dtype=np.float32)
    n = m.mask_logits(logits)
    allowed = np.flatnonzero(np.isfinite(logits))
    assert len(allowed) == n and 1000 < n < comp.vocab.n_vocab  # inside a string: most text
    rng = np.random.default_rng(0)
    for t in rng.choice(comp.vocab.n_vocab, 200, replace=False):
        assert m.allows(int(t)) == bool(np.isfinite(logits[t]))


def test_concurrent_requests_for_a_new_schema_compile_it_once():
    from concurrent.futures import ThreadPoolExecutor

    v = ConstraintVocab.from_pieces(PIECES, [EOS], _greedy, special=[EOS])
    comp = ConstraintCompiler(v)
    c = json_schema_constraint({"type": "array", "items": {"type": "integer"}})
    with ThreadPoolExecutor(8) as pool:
        out = list(pool.map(lambda _: comp.compile(c), range(16)))
    assert comp.n_compiled == 1 and all(x is out[0] for x in out)


def test_real_vocab_control_tokens_need_lark_token_syntax(real):
    comp, _, _ = real
    start_of_turn = 105  # Gemma 3's <start_of_turn>, a control token
    for grammar, allowed in (
        ('start: <start_of_turn> "x"', True),
        ('start: <[105]> "x"', True),
        ('start: "<start_of_turn>" "x"', False),  # text: spelled out in ordinary tokens
    ):
        assert comp.compile(lark_constraint(grammar)).matcher().allows(start_of_turn) is allowed


def test_a_schema_that_admits_nothing_is_refused(fake):
    """``{"$ref": "#"}`` refers only to itself: no value is valid, so a request constrained by
    it could only end at once (issue 25: it answered 200 with empty, non-JSON content)."""
    with pytest.raises(ConstraintError, match="admits no output"):
        fake.compile(json_schema_constraint({"$ref": "#"}))
    with pytest.raises(ConstraintError, match="admits no output"):  # remembered as a failure
        fake.compile(json_schema_constraint({"$ref": "#"}))
    assert fake.compile(json_schema_constraint({"type": "integer"})).matcher().allows(TOK["1"])
