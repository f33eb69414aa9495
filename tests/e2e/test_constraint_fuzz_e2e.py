"""Fuzzing the constraint path (issue 25): random JSON schemas and GBNF grammars, of random
depth, width, references, recursion and patterns, some past the limits and some malformed,
sent to a real server for a bounded time. The server never dies; every answer is a 200 or a
400; every 200 to a schema that ended by itself validates against that schema (``jsonschema``).

The seed is new each run and printed on failure, so a failing case can be replayed."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import time

import jsonschema
import pytest

from .conftest import ServerProc

BUDGET_S = float(os.environ.get("FUZZ_SECONDS", "30"))
PATTERNS = ["^[a-c]{1,4}$", "^x[0-9]{0,2}$", "^(ab|cd)+$", "^[A-Z][a-z]{0,3}$"]


class SchemaGen:
    """Random schemas whose values stay small (short strings, few items, bounded numbers),
    so that a weak model's answer ends well within its token budget."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.defs: dict[str, dict] = {}

    def leaf(self) -> dict:
        r = self.rng.random()
        if r < 0.3:
            return {"type": "string", "maxLength": self.rng.randint(0, 6)}
        if r < 0.45:
            return {"type": "string", "pattern": self.rng.choice(PATTERNS)}
        if r < 0.65:
            lo = self.rng.randint(-50, 50)
            return {"type": "integer", "minimum": lo, "maximum": lo + self.rng.randint(0, 99)}
        if r < 0.75:
            return {"type": "boolean"}
        if r < 0.85:
            return {"enum": self.rng.sample(["red", "green", "blue", 1, 2, None, True], 3)}
        if r < 0.92:
            return {"const": self.rng.choice(["k", 7, False])}
        return {"type": "null"}

    def node(self, depth: int) -> dict:
        r = self.rng.random()
        if depth <= 0 or r < 0.3:
            return self.leaf()
        if r < 0.55:
            n = self.rng.randint(0, 3)
            props = {f"p{i}": self.node(depth - 1) for i in range(n)}
            req = [k for k in props if self.rng.random() < 0.7]
            return {
                "type": "object",
                "properties": props,
                "required": req,
                "additionalProperties": False,
            }
        if r < 0.7:
            return {"type": "array", "items": self.node(depth - 1), "maxItems": 2}
        if r < 0.82:
            key = "anyOf" if self.rng.random() < 0.7 else "oneOf"
            alts = [self.node(depth - 1) for _ in range(self.rng.randint(1, 3))]
            if key == "oneOf":  # alternatives that cannot overlap: jsonschema checks "one"
                alts = [
                    {
                        "type": "object",
                        "properties": {"k": {"const": i}, "v": a},
                        "required": ["k", "v"],
                        "additionalProperties": False,
                    }
                    for i, a in enumerate(alts)
                ]
            return {key: alts}
        name = f"d{len(self.defs)}"
        self.defs[name] = {}
        self.defs[name] = self.node(depth - 1)
        return {"$ref": f"#/$defs/{name}"}

    def schema(self) -> dict:
        out = self.node(self.rng.randint(1, 4))
        if self.defs:
            out = {**out, "$defs": self.defs}
        return out


def hostile_schema(rng: random.Random) -> dict | str:
    """Past a limit, malformed, or recursive without a base case; nesting thousands deep
    comes as JSON text (Python's own json module would refuse to write it)."""
    n = rng.choice([300, 2000, 6000])
    kind = rng.randrange(6)
    if kind == 0:
        defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
        defs[f"d{n}"] = {"type": "string"}
        return {"$defs": defs, "$ref": "#/$defs/d0"}
    if kind == 1:
        return '{"type":"array","items":' * n + '{"type":"string"}' + "}" * n
    if kind == 2:
        return {"type": "string", "pattern": rng.choice(["^(unclosed", "[z-a]", "(?<=x)y"])}
    if kind == 3:
        return {"$ref": rng.choice(["#", "#/$defs/missing", "urn:nowhere"])}
    if kind == 4:
        return {"enum": list(range(rng.choice([10, 5000, 20000])))}
    return {"type": rng.choice(["strin", 7, ["integer", "nope"]]), "minimum": "x"}


def grammar(rng: random.Random) -> str:
    """A random GBNF grammar: a rule graph with recursion, alternatives and repetitions, at
    times chained thousands deep or broken."""
    n = rng.choice([3, 10, 40, 3000, 6000])
    if n >= 3000:
        lines = [f'r{n} ::= "end"'] + [f'r{i} ::= "x" r{i + 1}' for i in range(n)]
        return "\n".join([*lines, "root ::= r0"])
    rules = ['root ::= r0 | "z"']
    for i in range(n):
        refs = [f"r{rng.randrange(n)}" for _ in range(rng.randint(0, 2))]
        lit = f'"{rng.choice("abcxyz")}"'
        body = " ".join([lit, *refs]) if rng.random() < 0.6 else f"({lit} | {lit}{{1,3}})"
        rules.append(f"r{i} ::= {body} | [0-9]")
    text = "\n".join(rules)
    if rng.random() < 0.15:  # broken: a dangling rule, an unclosed string, a bad class
        text += rng.choice(["\nroot2 ::= nowhere", '\nr0 ::= "open', "\nq ::= [z-a]"])
    return text


def one_case(s: ServerProc, rng: random.Random) -> tuple[str, int]:
    """Sends one random body; returns its kind and status. Asserts the rules on the answer."""
    r = rng.random()
    body: dict = {"prompt": "JSON:", "n_predict": 96, "seed": rng.randrange(1 << 30)}
    schema = None
    if r < 0.55:
        schema = SchemaGen(rng).schema()
        body["json_schema"] = schema
        kind = "schema"
    elif r < 0.75:
        body["json_schema"] = hostile_schema(rng)
        kind = "hostile"
    else:
        body["grammar"] = grammar(rng)
        kind = "grammar"
    if isinstance(body.get("json_schema"), str):  # raw JSON text
        raw = body.pop("json_schema")
        text = json.dumps(body)[:-1] + ', "json_schema": ' + raw + "}"
        headers = {"Content-Type": "application/json"}
        resp = s.client.post("/completion", content=text, headers=headers, timeout=120)
    else:
        resp = s.client.post("/completion", json=body, timeout=120)
    assert resp.status_code in (200, 400), (kind, resp.status_code, resp.text[:300])
    if resp.status_code == 400:
        assert resp.json()["error"]["message"], resp.text
    elif schema is not None and resp.json()["stop_type"] != "limit":
        content = resp.json()["content"]
        jsonschema.validate(json.loads(content), schema)
    return kind, resp.status_code


@pytest.fixture(scope="module")
def srv():
    s = ServerProc("-np", "4")
    yield s
    s.stop()


def test_random_schemas_and_grammars(srv):
    seed = random.SystemRandom().randrange(1 << 32)
    rng = random.Random(seed)
    deadline = time.monotonic() + BUDGET_S
    seen: dict[tuple[str, int], int] = {}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        while time.monotonic() < deadline:
            rngs = [random.Random(rng.randrange(1 << 32)) for _ in range(4)]
            for f in [pool.submit(one_case, srv, r) for r in rngs]:
                try:
                    key = f.result()
                except AssertionError as e:
                    raise AssertionError(f"fuzz seed {seed}: {e}") from None
                except jsonschema.ValidationError as e:
                    msg = f"fuzz seed {seed}: output breaks its schema: {e}"
                    raise AssertionError(msg) from None
                seen[key] = seen.get(key, 0) + 1
            assert srv.proc.poll() is None, f"fuzz seed {seed}: the server died"
    assert srv.client.get("/health").status_code == 200
    # the run exercised both outcomes (else the generator, not the server, is broken)
    assert seen.get(("schema", 200)) and seen.get(("hostile", 400)), (seed, seen)
    print(f"fuzz seed {seed}: {seen}")
    srv.assert_integrity()
